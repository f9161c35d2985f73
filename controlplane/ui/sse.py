"""Live updates by server-sent events: a region of a page re-rendered on the server and sent
when it changes.

The page marks the region ``<div data-live="/ui/.../live">``; app.js opens an ``EventSource``
on that URL and replaces the region's content with each ``update`` event's data. The stream
polls ``produce`` every ``interval`` seconds and sends only when the HTML differs, a comment
every :data:`KEEPALIVE_S` so proxies keep the connection, and ``end`` when ``finished`` says
the thing shown can no longer change (a rollout that completed). A stream lasts at most
:data:`MAX_STREAM_S` (the browser reconnects by itself) and stops when the server shuts down.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from mcp_edge.controlplane.ui.core import SECURITY_HEADERS, Ctx

KEEPALIVE_S = 15.0
MAX_STREAM_S = 600.0
STOPPING = web.AppKey("ui_stopping", asyncio.Event)


def _event(name: str, data: str) -> bytes:
    lines = data.splitlines() or [""]
    body = "".join(f"data: {line}\n" for line in lines)
    return f"event: {name}\n{body}\n".encode()


async def stream_fragments(
    ctx: Ctx,
    produce: Callable[[], Awaitable[str]],
    *,
    interval: float = 1.0,
    finished: Callable[[], bool] | None = None,
) -> web.StreamResponse:
    """Serve ``produce()``'s HTML as an event stream until the client goes or it finishes."""
    request = ctx.request
    response = web.StreamResponse(
        headers={
            **SECURITY_HEADERS,
            "Content-Type": "text/event-stream; charset=utf-8",
            "X-Accel-Buffering": "no",
        }
    )
    await response.prepare(request)
    stopping = request.app.get(STOPPING)
    started = last_sent = time.monotonic()
    previous: str | None = None
    try:
        await response.write(b"retry: 2000\n\n")
        while time.monotonic() - started < MAX_STREAM_S:
            html = await produce()
            if html != previous:
                await response.write(_event("update", html))
                previous, last_sent = html, time.monotonic()
            elif time.monotonic() - last_sent > KEEPALIVE_S:
                await response.write(b": keepalive\n\n")
                last_sent = time.monotonic()
            if finished is not None and finished():
                await response.write(_event("end", ""))
                break
            if stopping is None:
                await asyncio.sleep(interval)
                continue
            try:
                await asyncio.wait_for(stopping.wait(), timeout=interval)
                break
            except asyncio.TimeoutError:
                pass
    except (ConnectionResetError, asyncio.CancelledError):
        return response
    return response
