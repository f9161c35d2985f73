"""What every REST handler shares: the route table entry, the services, body and query parsing
with size caps, JSON answers, and the middleware that turns every failure into
``{"error": "...", "code": "..."}`` with the matching status.

Errors by who is at fault (the HTTP status a client sees)::

    ApiError(code)                 raised by handlers: the code's status
    AuthError                      401 (who are you?) / 403 (not allowed)
    MessageError, ProtocolError    400: the client sent something unusable
    ReplayError                    409
    db.ConflictError               409, db.NotFoundError 404, db.UnavailableError 503
    AccountConflictError           409: another kind of broker account holds the client id
                                   (the answer names no account; the log does)
    BrokerAdminError               503: the broker did not take the change (nothing committed)
    EnrollmentError                by kind (controlplane.enrollment_service): invalid 400,
                                   signature 401, refused 403, no such device 404, conflict 409
    anything else                  500, logged with its traceback
"""

from __future__ import annotations

import logging
import time
import typing
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypeVar

import orjson
from aiohttp import web
from aiohttp.typedefs import Middleware
from pydantic import BaseModel, ValidationError

from mcp_edge.controlplane.auth import AuthError, PasswordHasher, Role
from mcp_edge.controlplane.broker.base import (
    AccountConflictError,
    BrokerAdminError,
    BrokerProvisioner,
)
from mcp_edge.controlplane.db import (
    ConflictError,
    Database,
    DatabaseError,
    NotFoundError,
    UnavailableError,
)
from mcp_edge.controlplane.enrollment_service import (
    DeviceNotFoundError,
    EnrollmentConflictError,
    EnrollmentError,
    EnrollmentRefusedError,
    EnrollmentSignatureError,
    InvalidEnrollmentError,
    TrustSource,
)
from mcp_edge.controlplane.metrics import ControlPlaneMetrics
from mcp_edge.controlplane.settings import Settings
from mcp_edge.shared.errors import MessageError, ProtocolError, ReplayError
from mcp_edge.shared.protocol.codec import describe_validation_error, loads
from mcp_edge.shared.protocol.command import ErrorCode
from mcp_edge.shared.protocol.enrollment import TrustRoot

log = logging.getLogger("mcp.controlplane.api")

M = TypeVar("M", bound=BaseModel)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Clock = Callable[[], datetime]
JSON = "application/json"


class EmptyTrust:
    """The trust source until the repository exists: an empty :class:`TrustRoot`."""

    async def trust_root(self) -> TrustRoot:
        return TrustRoot()


@dataclass(frozen=True)
class Services:
    """Everything handlers use, built once by :func:`controlplane.app.create_app`."""

    settings: Settings
    db: Database
    provisioner: BrokerProvisioner
    clock: Clock
    hasher: PasswordHasher
    trust: TrustSource
    metrics: ControlPlaneMetrics


SERVICES = web.AppKey("services", Services)


def services(request: web.Request) -> Services:
    return request.app[SERVICES]


class ApiError(Exception):
    """An error answer chosen by a handler."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Endpoint:
    """One route: how to serve it, who may call it, and how the OpenAPI document describes it.

    ``role`` None means public. ``max_body`` None means ``settings.max_body_bytes``.
    ``raw_body`` is the media type of a body the handler reads unparsed (``body`` is then
    None); ``media_type`` that of a success answer without a ``response`` model.

    The statuses the document lists follow from the declaration (:mod:`controlplane.openapi`:
    400 with a body or query, 401 and 503 with a role, 403 with a role above viewer, 404 with
    a path parameter, 413 and 415 with a body); ``answers`` adds the others this handler
    gives, status to description (another success status, 409, ...).
    """

    method: str
    path: str
    handler: Handler
    summary: str
    role: Role | None
    tag: str
    body: type[BaseModel] | None = None
    query: type[BaseModel] | None = None
    response: type[BaseModel] | None = None
    status: int = 200
    max_body: int | None = None
    answers: dict[int, str] = field(default_factory=dict, hash=False)
    raw_body: str | None = None
    media_type: str | None = None


# ---------------------------------------------------------------------------- answers
def json_response(body: BaseModel | dict[str, Any], status: int = 200) -> web.Response:
    data = body.model_dump_json().encode() if isinstance(body, BaseModel) else orjson.dumps(body)
    return web.Response(body=data, status=status, content_type=JSON)


def error_response(
    code: ErrorCode,
    message: str,
    *,
    status: int | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    body = orjson.dumps({"error": message, "code": code.value})
    return web.Response(
        body=body, status=status or code.http_status, content_type=JSON, headers=headers
    )


# ---------------------------------------------------------------------------- inputs
async def read_json(request: web.Request, max_bytes: int) -> Any:
    """The request body parsed as JSON, at most ``max_bytes``; an empty body is ``{}``.

    Raises :class:`ApiError` (413 too large, 415 not JSON content, 400 invalid JSON).
    """
    if request.content_length is not None and request.content_length > max_bytes:
        raise ApiError(
            ErrorCode.TOO_LARGE,
            f"request body of {request.content_length} bytes exceeds the {max_bytes}-byte limit",
        )
    if request.body_exists and request.content_type not in (JSON, "application/octet-stream"):
        raise ApiError(ErrorCode.UNSUPPORTED, f"send {JSON}, not {request.content_type}")
    chunks: list[bytes] = []
    size = 0
    while chunk := await request.content.read(64 * 1024):
        size += len(chunk)
        if size > max_bytes:
            raise ApiError(ErrorCode.TOO_LARGE, f"request body exceeds the {max_bytes}-byte limit")
        chunks.append(chunk)
    if size == 0:
        return {}
    try:
        return loads(b"".join(chunks), max_bytes=max_bytes)
    except MessageError as e:
        raise ApiError(ErrorCode.BAD_REQUEST, str(e)) from e


_INT64 = range(-(2**63), 2**63)


def _json_schema_numbers(obj: Any) -> Any:
    """``obj`` with every float that has no fraction as an int: JSON Schema counts ``5.0`` an
    integer, pydantic's strict mode does not."""
    if isinstance(obj, float) and obj.is_integer() and int(obj) in _INT64:
        return int(obj)
    if isinstance(obj, dict):
        return {k: _json_schema_numbers(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_json_schema_numbers(v) for v in obj]
    return obj


def _refuse_nul(value: Any, where: str) -> None:
    """ApiError (400) naming the first string in ``value`` that holds a NUL character:
    PostgreSQL's text columns cannot store one, and it is never meaningful here."""
    if isinstance(value, str):
        if "\x00" in value:
            raise ApiError(ErrorCode.BAD_REQUEST, f"{where}: contains a NUL character")
    elif isinstance(value, dict):
        for key, item in value.items():
            _refuse_nul(key, f"{where}: a key")
            _refuse_nul(item, str(key) if where in ("body", "query") else f"{where}.{key}")
    elif isinstance(value, list):
        for item in value:
            _refuse_nul(item, where)


def validated(obj: Any, cls: type[M], *, strict: bool = False) -> M:
    """``obj`` validated as ``cls``; raises :class:`ApiError` (400) naming the first error (a
    NUL character in any string is one).

    ``strict`` takes JSON types as JSON Schema (the OpenAPI document) reads them: ``0`` is no
    boolean and ``"5"`` no integer, ``5.0`` is one. Query strings need the lax form.
    """
    _refuse_nul(obj, "body" if strict else "query")
    try:
        if strict:
            data = orjson.dumps(_json_schema_numbers(obj))
            return cls.model_validate_json(data, strict=True)
        return cls.model_validate(obj)
    except ValidationError as e:
        raise ApiError(ErrorCode.BAD_REQUEST, describe_validation_error(e)) from e


async def read_body(request: web.Request, cls: type[M], max_bytes: int | None = None) -> M:
    """Read, size-check, parse and validate the body as ``cls`` (strict JSON types)."""
    cap = max_bytes if max_bytes is not None else services(request).settings.max_body_bytes
    return validated(await read_json(request, cap), cls, strict=True)


def _is_list(annotation: Any) -> bool:
    return typing.get_origin(annotation) is list


def read_query(request: web.Request, cls: type[M]) -> M:
    """The query string validated as ``cls``; list fields take repeated parameters.

    Unknown parameters are errors (``cls`` forbids extra fields), so a typo is never ignored.
    """
    raw: dict[str, Any] = {}
    for name in request.query:
        field = cls.model_fields.get(name)
        if field is not None and _is_list(field.annotation):
            raw[name] = request.query.getall(name)
        else:
            raw[name] = request.query[name]
    return validated(raw, cls)


def path_int(request: web.Request, name: str) -> int:
    value = request.match_info[name]
    if not value.isdigit() or len(value) > 18:
        raise ApiError(ErrorCode.NOT_FOUND, f"{name} must be a number")
    return int(value)


# ---------------------------------------------------------------------------- middleware
_ENROLLMENT_CODES: tuple[tuple[type[EnrollmentError], ErrorCode], ...] = (
    (InvalidEnrollmentError, ErrorCode.BAD_REQUEST),
    (EnrollmentSignatureError, ErrorCode.UNAUTHORIZED),
    (EnrollmentRefusedError, ErrorCode.FORBIDDEN),
    (DeviceNotFoundError, ErrorCode.NOT_FOUND),
    (EnrollmentConflictError, ErrorCode.CONFLICT),
)


def enrollment_code(e: EnrollmentError) -> ErrorCode:
    return next(
        (code for cls, code in _ENROLLMENT_CODES if isinstance(e, cls)), ErrorCode.BAD_REQUEST
    )


def _classify(e: Exception) -> web.Response:
    if isinstance(e, ApiError):
        return error_response(e.code, str(e))
    if isinstance(e, EnrollmentError):
        code = enrollment_code(e)
        auth = {"WWW-Authenticate": "Bearer"} if code is ErrorCode.UNAUTHORIZED else None
        return error_response(code, str(e), headers=auth)
    if isinstance(e, AuthError):
        if e.status == 403:
            return error_response(ErrorCode.FORBIDDEN, str(e))
        return error_response(
            ErrorCode.UNAUTHORIZED, str(e), headers={"WWW-Authenticate": "Bearer"}
        )
    if isinstance(e, ReplayError):
        return error_response(ErrorCode.CONFLICT, str(e))
    if isinstance(e, ProtocolError):
        return error_response(ErrorCode.BAD_REQUEST, str(e))
    if isinstance(e, ConflictError):
        return error_response(ErrorCode.CONFLICT, str(e))
    if isinstance(e, NotFoundError):
        return error_response(ErrorCode.NOT_FOUND, str(e))
    if isinstance(e, UnavailableError):
        log.warning("database unavailable: %s", e)
        return error_response(ErrorCode.UNAVAILABLE, "database unavailable; retry later")
    if isinstance(e, AccountConflictError):
        log.warning("broker account conflict: %s", e)
        return error_response(ErrorCode.CONFLICT, f"id {e.client_id!r} is not available")
    if isinstance(e, BrokerAdminError):
        log.warning("broker provisioning failed: %s", e)
        return error_response(ErrorCode.UNAVAILABLE, f"broker provisioning failed: {e}")
    if isinstance(e, DatabaseError):
        log.error("database error: %s", e)
        return error_response(ErrorCode.INTERNAL, "database error")
    log.exception("unexpected error while handling a request", exc_info=e)
    return error_response(ErrorCode.INTERNAL, f"internal error: {type(e).__name__}")


def _http_exception(e: web.HTTPException) -> web.Response:
    codes = {404: ErrorCode.NOT_FOUND, 413: ErrorCode.TOO_LARGE, 415: ErrorCode.UNSUPPORTED}
    code = codes.get(e.status, ErrorCode.INTERNAL if e.status >= 500 else ErrorCode.BAD_REQUEST)
    headers = {k: v for k, v in e.headers.items() if k.lower() == "allow"}
    return error_response(code, e.reason, status=e.status, headers=headers or None)


def error_middleware(metrics: ControlPlaneMetrics) -> Middleware:
    """Outermost middleware: JSON errors for everything, and request metrics."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        started = time.perf_counter()
        route = request.match_info.route.resource
        name = route.canonical if route is not None else "unmatched"
        try:
            response = await handler(request)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            response = _http_exception(e)
        except Exception as e:
            response = _classify(e)
        metrics.observe_request(
            request.method, name, response.status, time.perf_counter() - started
        )
        return response

    return middleware
