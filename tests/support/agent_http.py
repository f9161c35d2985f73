"""The agent's HTTP server in the test's own event loop, and a client session bound to it."""

from __future__ import annotations

from typing import Any

import aiohttp

from mcp_edge.agent.runtime.manager import ModelManager
from mcp_edge.agent.serving.http_api import build_server
from mcp_edge.agent.serving.http_server import HttpServer


class AgentClient:
    """``get``/``post``/``request`` with paths, against a running agent HTTP server (the
    product's own server on a free loopback port)."""

    def __init__(self, server: HttpServer, session: aiohttp.ClientSession) -> None:
        self.server = server
        self.session = session

    def get(self, path: str, **kwargs: Any) -> Any:
        return self.session.get(path, **kwargs)

    def post(self, path: str, **kwargs: Any) -> Any:
        return self.session.post(path, **kwargs)

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        return self.session.request(method, path, **kwargs)

    async def close(self) -> None:
        await self.session.close()
        await self.server.stop(grace_s=1.0)


async def serve_manager(manager: ModelManager, **kwargs: Any) -> AgentClient:
    """Start :func:`build_server` for ``manager`` on 127.0.0.1 (any port) and a session."""
    server = build_server(manager, **kwargs)
    port = await server.start("127.0.0.1", 0)
    session = aiohttp.ClientSession(base_url=f"http://127.0.0.1:{port}")
    return AgentClient(server, session)
