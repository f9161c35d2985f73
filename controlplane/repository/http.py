"""The repository's HTTP transport: TUF metadata and targets as plain files.

    GET /repo/metadata/{file}      e.g. 1.root.json, timestamp.json, 3.snapshot.json
    GET /repo/targets/{path}       e.g. digits/1.3.0/<sha256>.digits-1.3.0.mcpb

Unauthenticated on purpose: every byte is signed (metadata) or hashed by signed metadata
(targets), so a device or a CDN in front of the control plane can read them without an
account; ``tuf.ngclient.Updater`` takes ``<base>/repo/metadata/`` and ``<base>/repo/targets/``
as its base URLs. Range requests work (``web.FileResponse``). A path is first checked with
:func:`shared.protocol.repo.validate_repo_path` (400 when it is not a repository path), then
resolved inside the repository directory (404 when it is absent, or when a symlink would lead
outside). Versioned files never change and may be cached for good; ``timestamp.json`` and
``root.json`` must be revalidated.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from aiohttp import web

from mcp_edge.controlplane.api.common import Endpoint, error_response
from mcp_edge.controlplane.repository.service import RepositoryService
from mcp_edge.shared.errors import MessageError
from mcp_edge.shared.protocol.command import ErrorCode
from mcp_edge.shared.protocol.repo import validate_repo_path

log = logging.getLogger("mcp.controlplane.repository")

REPOSITORY = web.AppKey("repository", RepositoryService)
IMMUTABLE = "public, max-age=31536000, immutable"
REVALIDATE = "no-cache"
MUTABLE_METADATA = frozenset({"timestamp.json", "root.json"})


def resolve_repo_file(root: Path, relative: str) -> Path | None:
    """The regular file ``relative`` names inside ``root``, or None when there is none there.

    ``relative`` must already be a valid repository path; symlinks that resolve outside
    ``root`` count as absent.
    """
    base = root.resolve()
    candidate = (base / relative).resolve()
    if not candidate.is_relative_to(base) or not candidate.is_file():
        return None
    return candidate


async def _serve(request: web.Request, relative: str) -> web.StreamResponse:
    service = request.app[REPOSITORY]
    if not service.settings.repository_http:
        return error_response(
            ErrorCode.FORBIDDEN,
            "the HTTP repository is off on this control plane (repository_http = false); "
            "devices fetch models over MQTT",
        )
    try:
        validate_repo_path(relative)
    except MessageError as e:
        return error_response(ErrorCode.BAD_REQUEST, str(e))
    root = request.app[REPOSITORY].repo.dir
    path = resolve_repo_file(root, relative)
    if path is None:
        return error_response(ErrorCode.NOT_FOUND, f"no repository file {relative!r}")
    metadata = relative.startswith("metadata/")
    headers = {
        "Cache-Control": REVALIDATE if metadata and path.name in MUTABLE_METADATA else IMMUTABLE,
        "Content-Type": "application/json" if metadata else "application/octet-stream",
    }
    return web.FileResponse(path, headers=headers)


async def repo_metadata(request: web.Request) -> web.StreamResponse:
    """One TUF metadata file."""
    return await _serve(request, "metadata/" + request.match_info["file"])


async def repo_target(request: web.Request) -> web.StreamResponse:
    """One target file, by its consistent-snapshot name."""
    return await _serve(request, "targets/" + request.match_info["path"])


# What web.FileResponse answers besides 200, and the refusals of _serve.
_FILE_ANSWERS = {
    206: "the part of the file a Range header asked for",
    304: "not modified since the If-Modified-Since time",
    400: "not a repository path",
    403: "the HTTP repository is off on this control plane",
    412: "modified since the If-Unmodified-Since time",
    416: "the Range header asks for bytes the file does not have",
}
ENDPOINTS = [
    Endpoint(
        "GET",
        "/repo/metadata/{file}",
        repo_metadata,
        "TUF metadata of the model repository (public: signed)",
        None,
        "repository",
        media_type="application/json",
        answers=_FILE_ANSWERS,
    ),
    Endpoint(
        "GET",
        "/repo/targets/{path}",
        repo_target,
        "A target file (signed bundle) by its consistent-snapshot path, several segments "
        "deep; Range requests work (public: hashed by signed metadata)",
        None,
        "repository",
        media_type="application/octet-stream",
        answers=_FILE_ANSWERS,
    ),
]
"""How the OpenAPI document describes the routes :func:`add_repository_routes` adds (the
targets route matches several path segments, which an OpenAPI template cannot say)."""


def add_repository_routes(router: web.UrlDispatcher) -> None:
    """Register ``GET``/``HEAD /repo/metadata/{file}`` and ``/repo/targets/{path}`` (public)."""
    router.add_get("/repo/metadata/{file}", repo_metadata)
    router.add_get("/repo/targets/{path:.*}", repo_target)


def attach_repository(app: web.Application, repository: RepositoryService) -> None:
    """Serve ``repository`` from ``app``: the ``/repo`` routes, :data:`REPOSITORY`, and at
    startup (append this after the migration hook) create the repository when missing and
    re-sign its timestamp every ``settings.timestamp_refresh_s`` seconds until cleanup."""
    app[REPOSITORY] = repository
    add_repository_routes(app.router)
    stop = asyncio.Event()
    tasks: list[asyncio.Task[None]] = []

    async def start(app: web.Application) -> None:
        if await repository.init():
            log.info("created the TUF repository in %s", repository.repo.dir)
        interval = repository.settings.timestamp_refresh_s
        tasks.append(
            asyncio.create_task(
                repository.run_refresh(interval, stop), name="repository-timestamp-refresh"
            )
        )

    async def finish(app: web.Application) -> None:
        stop.set()
        for task in tasks:
            await task

    app.on_startup.append(start)
    app.on_cleanup.append(finish)
