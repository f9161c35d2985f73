"""The model registry, publisher keys and the repository's state.

    POST   /api/v1/bundles                              operator; body: the raw signed .mcpb
    GET    /api/v1/models                               viewer
    GET    /api/v1/models/{name}                        viewer; with its versions, newest first
    GET    /api/v1/models/{name}/versions/{version}     viewer
    GET    /api/v1/publishers                           viewer
    POST   /api/v1/publishers                           admin: {"name", "public_key": hex}
    DELETE /api/v1/publishers/{keyid}                   admin: revoke (final)
    GET    /api/v1/repository                           viewer: TUF role versions and expiry

A bundle upload is ``application/octet-stream``, streamed to a file under the data dir and
capped by ``settings.max_bundle_bytes`` (not the small JSON cap): 413 as soon as it is over.
The answer is 201 with the new version, or 200 when the same bytes were published before.
The work is :class:`~controlplane.repository.service.RepositoryService`'s; its errors carry
their status (400 bad bundle, 403 untrusted signer, 409 conflict, 404 unknown key).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import IO

from aiohttp import StreamReader, web
from pydantic import Field

from mcp_edge.controlplane.api.common import (
    ApiError,
    Endpoint,
    json_response,
    read_body,
    services,
)
from mcp_edge.controlplane.api.schemas import PublicKeyHex, PublisherName, Request, Response
from mcp_edge.controlplane.auth import Role, principal_of
from mcp_edge.controlplane.db.models import ModelVersion, PublisherKey
from mcp_edge.controlplane.repository.http import REPOSITORY
from mcp_edge.controlplane.repository.service import RegistryError, RepositoryService
from mcp_edge.controlplane.repository.tuf_repo import RepositoryError
from mcp_edge.shared.errors import KeyFileError
from mcp_edge.shared.protocol.command import ErrorCode
from mcp_edge.shared.signing import PublicKey

log = logging.getLogger("mcp.controlplane.api")

OCTET_STREAM = "application/octet-stream"
WRITE_CHUNK_BYTES = 1 << 20


# ---------------------------------------------------------------------------- schemas
class VariantOut(Response):
    """One model file of a bundle and the hardware profiles it fits (``*``: any)."""

    name: str
    file: str
    sha256: str
    size: int
    profiles: list[str]


class ModelVersionOut(Response):
    """One published version: one signed bundle, one TUF target."""

    model: str
    version: str
    version_numeric: int = Field(description="release counter; orders versions")
    target_path: str = Field(description="TUF target path of the bundle")
    sha256: str
    length: int = Field(description="bundle size in bytes")
    format: str
    profiles: list[str] = Field(description="profiles a specific variant fits; empty: any")
    variants: list[VariantOut]
    signer: str = Field(description="key id of the publisher key that signed the bundle")
    created_at: datetime
    uploaded_by: str


class ModelSummaryOut(Response):
    name: str
    created_at: datetime
    version_count: int
    latest_version: str | None
    latest_published_at: datetime | None


class ModelList(Response):
    items: list[ModelSummaryOut]


class ModelDetail(Response):
    name: str
    created_at: datetime
    versions: list[ModelVersionOut]


class PublisherCreate(Request):
    """Register a publisher key (Ed25519, 64 hex characters)."""

    name: PublisherName
    public_key: PublicKeyHex


class PublisherOut(Response):
    keyid: str
    name: str
    public_key: str
    created_at: datetime
    revoked_at: datetime | None
    revoked: bool


class PublisherList(Response):
    items: list[PublisherOut]


class RoleOut(Response):
    role: str
    version: int
    expires: datetime
    keyids: list[str]


class RepositoryOut(Response):
    """The TUF repository's current metadata."""

    roles: list[RoleOut]
    targets: int = Field(description="number of listed targets (published versions)")
    publishers: list[str] = Field(description="publisher key ids listed in targets metadata")
    director_keyid: str
    root_key_online: bool = Field(description="false when the root key is kept offline")
    consistent_snapshot: bool


def version_out(row: ModelVersion) -> ModelVersionOut:
    return ModelVersionOut(
        model=row.model,
        version=row.version,
        version_numeric=row.version_numeric,
        target_path=row.target_path,
        sha256=row.sha256,
        length=row.length,
        format=row.format,
        profiles=list(row.profiles),
        variants=[VariantOut.model_validate(v) for v in row.variants],
        signer=row.publisher_keyid,
        created_at=row.created_at,
        uploaded_by=row.uploaded_by,
    )


def publisher_out(row: PublisherKey) -> PublisherOut:
    return PublisherOut(
        keyid=row.keyid,
        name=row.name,
        public_key=row.public_key,
        created_at=row.created_at,
        revoked_at=row.revoked_at,
        revoked=row.revoked_at is not None,
    )


# ---------------------------------------------------------------------------- handlers
def _repository(request: web.Request) -> RepositoryService:
    return request.app[REPOSITORY]


@contextlib.contextmanager
def _registry_errors() -> Iterator[None]:
    """Answer registry refusals with their own status, repository failures with 503."""
    try:
        yield
    except RegistryError as e:
        raise ApiError(e.code, str(e)) from e
    except RepositoryError as e:
        log.error("repository unusable: %s", e)
        raise ApiError(ErrorCode.UNAVAILABLE, f"repository unusable: {e}") from e


def _write_all(f: IO[bytes], data: bytes) -> None:
    f.write(data)


def _finish(f: IO[bytes]) -> None:
    f.flush()
    os.fsync(f.fileno())
    f.close()


async def receive_upload(content: StreamReader, dest: Path, cap: int) -> int:
    """Stream a request body into the new file ``dest`` (0600), at most ``cap`` bytes.

    Writes happen in a worker thread, about a MiB at a time; the file is fsynced. Returns the
    size in bytes. Raises :class:`ApiError` (413) as soon as the body passes ``cap`` and 400
    for an empty body; ``dest`` is removed on every failure.
    """
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    f = os.fdopen(fd, "wb")
    size = 0
    buffer: list[bytes] = []
    buffered = 0
    try:
        async for chunk in content.iter_chunked(WRITE_CHUNK_BYTES):
            size += len(chunk)
            if size > cap:
                raise ApiError(
                    ErrorCode.TOO_LARGE,
                    f"bundle is larger than the {cap}-byte limit (max_bundle_bytes)",
                )
            buffer.append(chunk)
            buffered += len(chunk)
            if buffered >= WRITE_CHUNK_BYTES:
                await asyncio.to_thread(_write_all, f, b"".join(buffer))
                buffer, buffered = [], 0
        if buffer:
            await asyncio.to_thread(_write_all, f, b"".join(buffer))
        await asyncio.to_thread(_finish, f)
        if size == 0:
            raise ApiError(ErrorCode.BAD_REQUEST, "empty body: send the .mcpb file")
        return size
    except BaseException:
        f.close()
        dest.unlink(missing_ok=True)
        raise


async def upload_bundle(request: web.Request) -> web.Response:
    """Publish a signed bundle: send the .mcpb as the body, ``Content-Type:
    application/octet-stream``. 201 with the new version; 200 when the same bytes were
    published before; 409 when the version exists with other bytes; 403 when the signer is
    not a registered, non-revoked publisher key; 413 past ``max_bundle_bytes``."""
    svc, who, repo = services(request), principal_of(request), _repository(request)
    cap = svc.settings.max_bundle_bytes
    if request.content_type != OCTET_STREAM:
        raise ApiError(
            ErrorCode.UNSUPPORTED, f"send the bundle as {OCTET_STREAM}, not {request.content_type}"
        )
    if request.content_length is not None and request.content_length > cap:
        raise ApiError(
            ErrorCode.TOO_LARGE,
            f"bundle of {request.content_length} bytes exceeds the {cap}-byte limit "
            "(max_bundle_bytes)",
        )
    path = repo.upload_path()
    await receive_upload(request.content, path, cap)
    try:
        with _registry_errors():
            result = await repo.publish_bundle(path, actor=who.actor)
    finally:
        path.unlink(missing_ok=True)
    return json_response(version_out(result.version), status=201 if result.created else 200)


async def list_models(request: web.Request) -> web.Response:
    summaries = await _repository(request).list_models()
    return json_response(ModelList(items=[ModelSummaryOut.model_validate(s) for s in summaries]))


async def get_model(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    found = await _repository(request).model_detail(name)
    if found is None:
        raise ApiError(ErrorCode.NOT_FOUND, f"no model {name!r}")
    model, versions = found
    return json_response(
        ModelDetail(
            name=model.name,
            created_at=model.created_at,
            versions=[version_out(v) for v in versions],
        )
    )


async def get_model_version(request: web.Request) -> web.Response:
    name, version = request.match_info["name"], request.match_info["version"]
    row = await _repository(request).model_version(name, version)
    if row is None:
        raise ApiError(ErrorCode.NOT_FOUND, f"no version {version!r} of model {name!r}")
    return json_response(version_out(row))


async def list_publishers(request: web.Request) -> web.Response:
    rows = await _repository(request).list_publishers()
    return json_response(PublisherList(items=[publisher_out(r) for r in rows]))


async def add_publisher(request: web.Request) -> web.Response:
    """Register a publisher key; 201, or 200 when it is registered already. Its bundles can
    be published from now on, and devices learn it from signed targets metadata."""
    who = principal_of(request)
    body = await read_body(request, PublisherCreate)
    try:
        key = PublicKey.from_hex(body.public_key)
    except KeyFileError as e:
        raise ApiError(ErrorCode.BAD_REQUEST, str(e)) from e
    with _registry_errors():
        row, created = await _repository(request).add_publisher(
            key, name=body.name, actor=who.actor
        )
    return json_response(publisher_out(row), status=201 if created else 200)


async def revoke_publisher(request: web.Request) -> web.Response:
    """Revoke a publisher key: its bundles are refused from now on and it is delisted from
    targets metadata, so devices stop trusting it. Final: the key cannot be added again."""
    who = principal_of(request)
    with _registry_errors():
        row = await _repository(request).revoke_publisher(
            request.match_info["keyid"], actor=who.actor
        )
    return json_response(publisher_out(row))


async def repository_status(request: web.Request) -> web.Response:
    with _registry_errors():
        status = await _repository(request).status()
    return json_response(RepositoryOut.model_validate(status))


ENDPOINTS = [
    Endpoint(
        "POST",
        "/api/v1/bundles",
        upload_bundle,
        "Publish a signed model bundle (body: the .mcpb, application/octet-stream)",
        Role.OPERATOR,
        "models",
        response=ModelVersionOut,
        status=201,
        raw_body=OCTET_STREAM,
        answers={
            200: "the same bytes were published before",
            400: "not a well-formed, signed bundle, or an empty body",
            403: "needs the operator role, or the signer is not a registered publisher key",
            409: "the version exists with other bytes",
            503: "database or model repository unavailable; retry later",
        },
    ),
    Endpoint(
        "GET",
        "/api/v1/models",
        list_models,
        "List models with their newest version",
        Role.VIEWER,
        "models",
        response=ModelList,
    ),
    Endpoint(
        "GET",
        "/api/v1/models/{name}",
        get_model,
        "One model with its versions",
        Role.VIEWER,
        "models",
        response=ModelDetail,
    ),
    Endpoint(
        "GET",
        "/api/v1/models/{name}/versions/{version}",
        get_model_version,
        "One published version of a model",
        Role.VIEWER,
        "models",
        response=ModelVersionOut,
    ),
    Endpoint(
        "GET",
        "/api/v1/publishers",
        list_publishers,
        "List publisher keys",
        Role.VIEWER,
        "models",
        response=PublisherList,
    ),
    Endpoint(
        "POST",
        "/api/v1/publishers",
        add_publisher,
        "Register a publisher key",
        Role.ADMIN,
        "models",
        body=PublisherCreate,
        response=PublisherOut,
        status=201,
        answers={
            200: "the key is registered already",
            409: "the key was revoked; it cannot be added again",
            503: "database or model repository unavailable; retry later",
        },
    ),
    Endpoint(
        "DELETE",
        "/api/v1/publishers/{keyid}",
        revoke_publisher,
        "Revoke a publisher key",
        Role.ADMIN,
        "models",
        response=PublisherOut,
        answers={503: "database or model repository unavailable; retry later"},
    ),
    Endpoint(
        "GET",
        "/api/v1/repository",
        repository_status,
        "The TUF repository: role versions, expiry times, keys",
        Role.VIEWER,
        "models",
        response=RepositoryOut,
        answers={503: "database or model repository unavailable; retry later"},
    ),
]
