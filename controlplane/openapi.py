"""The OpenAPI 3.1 document of the REST API, built from the route table and pydantic's JSON
Schemas (served at ``GET /api/v1/openapi.json``).

Pure: takes :class:`controlplane.api.common.Endpoint` values and returns a JSON-ready dict.
Request bodies use each schema's validation form, answers its serialization form. The document
says what the server enforces, no more and no less:

* a path parameter has the pattern its ids are made with
  (:data:`controlplane.api.schemas.PATH_PARAMETERS`);
* a request body is ``required`` only when the server refuses a request without one (an empty
  body is read as ``{}``, so a schema whose every field has a default takes none);
* every status the handler can answer is listed, each error with the shared ``ErrorBody``
  schema: those the declaration implies (see :class:`~controlplane.api.common.Endpoint`) and
  the endpoint's own ``answers``.

The role an operation needs is its ``x-required-role``.
"""

from __future__ import annotations

import re
import typing
from collections.abc import Sequence
from typing import Any, Literal, cast

from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic.json_schema import models_json_schema

from mcp_edge.controlplane.api.common import Endpoint
from mcp_edge.controlplane.api.schemas import PATH_PARAMETERS, ErrorBody
from mcp_edge.controlplane.auth import Role

REF = "#/components/schemas/{model}"
_PATH_PARAM = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
Mode = Literal["validation", "serialization"]

_IMPLIED = {
    400: "invalid request: the body or a parameter breaks its schema",
    401: "no API token, or one that is unknown, expired or revoked",
    404: "no such object",
    413: "request body too large",
    415: "the body is not of the documented content type",
    503: "database unavailable; retry later",
}
_RAW_SCHEMAS = {
    "application/json": {"type": "object"},
    "text/plain": {"type": "string"},
}
_BINARY = {"type": "string", "format": "binary"}
_BODYLESS = frozenset({304, 412, 416})
"""Statuses answered without a body (web.FileResponse's)."""


def _error(description: str) -> dict[str, Any]:
    return {
        "description": description,
        "content": {"application/json": {"schema": {"$ref": REF.format(model="ErrorBody")}}},
    }


def _media_schema(media_type: str) -> dict[str, Any]:
    return _RAW_SCHEMAS.get(media_type.split(";")[0].strip(), _BINARY)


def _query_parameters(model: type[BaseModel], schema: dict[str, Any]) -> list[dict[str, Any]]:
    props = schema.get("properties", {})
    params = []
    for name, field in model.model_fields.items():
        param: dict[str, Any] = {
            "name": name,
            "in": "query",
            "required": field.is_required(),
            "schema": {k: v for k, v in props.get(name, {}).items() if k != "title"},
        }
        if field.description:
            param["description"] = field.description
        if typing.get_origin(field.annotation) is list:
            param.update(style="form", explode=True)
        params.append(param)
    return params


def _path_parameters(path: str) -> list[dict[str, Any]]:
    """Raises :class:`KeyError` naming a parameter that has no entry in ``PATH_PARAMETERS``."""
    params = []
    for name in _PATH_PARAM.findall(path):
        if name not in PATH_PARAMETERS:
            raise KeyError(f"path parameter {name!r} of {path} has no type in PATH_PARAMETERS")
        schema = TypeAdapter(PATH_PARAMETERS[name]).json_schema()
        params.append({"name": name, "in": "path", "required": True, "schema": schema})
    return params


def body_required(model: type[BaseModel]) -> bool:
    """Whether the server refuses a request without a body: the handlers read an absent
    body as ``{}``, so exactly when ``{}`` does not validate as ``model``."""
    try:
        model.model_validate({})
    except ValidationError:
        return True
    return False


def _statuses(ep: Endpoint) -> dict[int, str]:
    """Every error status of ``ep`` with its description, implied ones first."""
    implied: list[int] = []
    if ep.body is not None or ep.query is not None or ep.raw_body is not None:
        implied.append(400)
    if ep.role is not None:
        implied += [401, 503]
    if _PATH_PARAM.search(ep.path):
        implied.append(404)
    if ep.body is not None or ep.raw_body is not None:
        implied += [413, 415]
    errors = {status: _IMPLIED[status] for status in implied}
    if ep.role is not None and ep.role is not Role.VIEWER:
        errors[403] = f"needs the {ep.role.value} role"
    errors.update(ep.answers)
    return errors


def _operation(
    ep: Endpoint,
    refs: dict[tuple[type[BaseModel], Mode], dict[str, Any]],
    query_schemas: dict[type[BaseModel], dict[str, Any]],
) -> dict[str, Any]:
    op: dict[str, Any] = {
        "summary": ep.summary,
        "operationId": f"{ep.method.lower()}_{ep.handler.__name__}",
        "tags": [ep.tag],
        "security": [{"bearer": []}] if ep.role is not None else [],
    }
    if ep.handler.__doc__:
        op["description"] = ep.handler.__doc__.strip()
    if ep.role is not None:
        op["x-required-role"] = ep.role.value
    params = _path_parameters(ep.path)
    if ep.query is not None:
        params += _query_parameters(ep.query, query_schemas[ep.query])
    if params:
        op["parameters"] = params
    if ep.body is not None:
        op["requestBody"] = {
            "required": body_required(ep.body),
            "content": {"application/json": {"schema": refs[(ep.body, "validation")]}},
        }
    elif ep.raw_body is not None:  # read whole, and an empty one is refused
        body_schema = {**_media_schema(ep.raw_body), "minLength": 1}
        op["requestBody"] = {"required": True, "content": {ep.raw_body: {"schema": body_schema}}}
    content: dict[str, Any] | None = None
    if ep.response is not None:
        content = {"application/json": {"schema": refs[(ep.response, "serialization")]}}
    elif ep.media_type is not None:
        content = {ep.media_type: {"schema": _media_schema(ep.media_type)}}
    responses: dict[int, dict[str, Any]] = {ep.status: {"description": "success"}}
    for status, description in _statuses(ep).items():
        bare = status < 400 or status in _BODYLESS
        responses[status] = {"description": description} if bare else _error(description)
    for status, answer in responses.items():
        if status < 300 and content is not None:  # another success status: the same answer
            answer["content"] = content
    op["responses"] = {str(status): responses[status] for status in sorted(responses)}
    return op


def build_openapi(
    endpoints: Sequence[Endpoint], *, version: str, title: str = "MCP Edge control plane"
) -> dict[str, Any]:
    """The OpenAPI 3.1 document for ``endpoints``.

    Raises :class:`KeyError` when a route has a path parameter without a declared type.
    """
    wanted: list[tuple[type[BaseModel], Mode]] = [(ErrorBody, "serialization")]
    for ep in endpoints:
        if ep.body is not None:
            wanted.append((ep.body, "validation"))
        if ep.response is not None:
            wanted.append((ep.response, "serialization"))
    unique = list(dict.fromkeys(wanted))
    keyed, defs = models_json_schema(unique, ref_template=REF)
    refs = cast(dict[tuple[type[BaseModel], Mode], dict[str, Any]], dict(keyed))
    query_schemas = {
        ep.query: ep.query.model_json_schema(ref_template=REF)
        for ep in endpoints
        if ep.query is not None
    }
    paths: dict[str, dict[str, Any]] = {}
    for ep in endpoints:
        paths.setdefault(ep.path, {})[ep.method.lower()] = _operation(ep, refs, query_schemas)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": title,
            "version": version,
            "description": "Fleet management API. Authenticate with `Authorization: Bearer "
            "<API token>` (from `mcp-controlplane init` or `POST /api/v1/auth/login`). No "
            "string in a query parameter or a body may contain a NUL character (U+0000): "
            "such a request is answered 400.",
        },
        "paths": paths,
        "components": {
            "schemas": defs.get("$defs", {}),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
