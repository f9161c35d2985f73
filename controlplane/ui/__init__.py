"""The operator's console: server-rendered pages on the control plane's own port (``/ui/``).

Pages are Jinja2 templates (``templates/``) rendered by handlers in this package, one module
per section, each exporting ``PAGES`` (:class:`~controlplane.ui.core.Page`). Two static files
(``static/app.css``, ``static/app.js``) and each section's own script are served from
``/ui/static/``; nothing is loaded from another host. docs/console.md describes the pages.
"""

from __future__ import annotations

import asyncio
import mimetypes

from aiohttp import web

from mcp_edge.controlplane.ui import (
    apiref,
    devices,
    drift,
    enrollment,
    models,
    overview,
    rollouts,
    session_pages,
)
from mcp_edge.controlplane.ui.core import (
    SECURITY_HEADERS,
    STATIC,
    UI_ENV,
    Page,
    attach_pages,
    error_page,
    make_env,
    session_principal,
)
from mcp_edge.controlplane.ui.sse import STOPPING

SECTIONS = (overview, devices, enrollment, models, rollouts, drift, apiref, session_pages)
STATIC_TYPES = {".css": "text/css", ".js": "text/javascript", ".svg": "image/svg+xml"}


def all_pages() -> list[Page]:
    return [page for section in SECTIONS for page in section.PAGES]


def _static_files() -> dict[str, bytes]:
    return {
        p.name: p.read_bytes()
        for p in sorted(STATIC.iterdir())
        if p.is_file() and p.suffix in STATIC_TYPES
    }


def attach_ui(app: web.Application) -> None:
    """Add the console's routes to ``app`` (before the API's catch-alls, after its routes)."""
    app[UI_ENV] = make_env()
    app[STOPPING] = asyncio.Event()
    files = _static_files()

    async def static(request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        body = files.get(name)
        if body is None:
            return error_page(request, 404, f"no static file {name[:80]!r}")
        kind = STATIC_TYPES.get("." + name.rpartition(".")[2]) or mimetypes.guess_type(name)[0]
        headers = {**SECURITY_HEADERS, "Cache-Control": "public, max-age=300"}
        return web.Response(body=body, content_type=kind, headers=headers)

    async def root(request: web.Request) -> web.StreamResponse:
        raise web.HTTPSeeOther("/ui/", headers=SECURITY_HEADERS)

    async def not_found(request: web.Request) -> web.StreamResponse:
        found = await session_principal(request)
        return error_page(
            request, 404, f"there is no page at {request.path[:200]}", found[0] if found else None
        )

    async def stopping(app: web.Application) -> None:
        app[STOPPING].set()

    app.on_shutdown.append(stopping)
    app.router.add_get("/", root)
    app.router.add_get("/ui/static/{name}", static)
    session_pages.login_routes(app)
    attach_pages(app, all_pages())
    app.router.add_route("*", "/ui/{tail:.*}", not_found)
