"""Driving the web console over HTTP in tests (no browser): sign in through the login form,
keep the session cookie, read the CSRF token a page carries, submit forms.

The browser tests (tests/ui/) drive the same pages in Chromium; these helpers serve the
server-side tests of each section (tests/integration/test_ui_*.py).
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import ClientSession, CookieJar
from aiohttp.test_utils import TestClient

from mcp_edge.controlplane.settings import PasswordCost, Settings
from tests.support.controlplane import (
    ADMIN_PASSWORD,
    ControlPlane,
    FakeClock,
    start_control_plane,
)

_LOGIN_CSRF = re.compile(r'name="csrf" value="([^"]+)"')
_META_CSRF = re.compile(r'<meta name="csrf-token" content="([^"]+)">')


@dataclass
class Page:
    status: int
    text: str
    headers: dict[str, str]
    url: str


class Console:
    """One signed-in browser-like client of a test control plane."""

    def __init__(self, client: TestClient[Any, Any], session: ClientSession) -> None:
        self.client = client
        self.session = session
        self.csrf = ""

    def url(self, path: str) -> str:
        return str(self.client.make_url(path))

    async def get(self, path: str, *, follow: bool = True) -> Page:
        async with self.session.get(self.url(path), allow_redirects=follow) as r:
            text = await r.text()
            page = Page(r.status, text, dict(r.headers), str(r.url))
        found = _META_CSRF.search(page.text)
        if found:
            self.csrf = found.group(1)
        return page

    async def post(
        self,
        path: str,
        data: dict[str, Any] | list[tuple[str, str]] | None = None,
        *,
        csrf: str | None = None,
        follow: bool = True,
    ) -> Page:
        """Submit a form; the session's CSRF token unless ``csrf`` is given ("" for none)."""
        fields: list[tuple[str, str]] = (
            list(data.items()) if isinstance(data, dict) else list(data or [])
        )
        token = self.csrf if csrf is None else csrf
        if token:
            fields.append(("csrf", token))
        async with self.session.post(self.url(path), data=fields, allow_redirects=follow) as r:
            text = await r.text()
            return Page(r.status, text, dict(r.headers), str(r.url))

    async def close(self) -> None:
        await self.session.close()


async def sign_in(
    cp: ControlPlane, username: str = "admin", password: str = ADMIN_PASSWORD
) -> Console:
    """A console client signed in as ``username``; raises AssertionError when sign-in fails."""
    session = ClientSession(cookie_jar=CookieJar(unsafe=True))
    console = Console(cp.client, session)
    form = await console.get("/ui/login")
    assert form.status == 200, form.text
    nonce = _LOGIN_CSRF.search(form.text)
    assert nonce is not None
    answer = await console.post(
        "/ui/login",
        {"username": username, "password": password, "next": "/ui/account"},
        csrf=nonce.group(1),
    )
    assert answer.status == 200 and "/ui/account" in answer.url, answer.text[:500]
    await console.get("/ui/account")
    assert console.csrf
    return console


async def user_console(cp: ControlPlane, username: str, role: str) -> Console:
    """A new user with ``role``, signed in to the console."""
    password = f"{username}-password"
    status, answer = await cp.call(
        "POST", "/api/v1/users", body={"username": username, "password": password, "role": role}
    )
    assert status == 201, answer
    return await sign_in(cp, username, password)


@dataclass
class ConsolePlane:
    """A test control plane (fake broker provisioner, fake clock) and its admin's console."""

    cp: ControlPlane
    admin: Console


@asynccontextmanager
async def console_plane(
    database_url: str, data_dir: Path, **overrides: Any
) -> AsyncIterator[ConsolePlane]:
    """Serve a control plane on ``database_url`` and sign its admin in to the console."""
    settings = Settings(
        data_dir=data_dir,
        database_url=database_url,
        password_cost=PasswordCost.MIN,
        broker_urls=("mqtt://broker.test:1883",),
        **overrides,
    )
    cp = await start_control_plane(settings, FakeClock())
    admin = await sign_in(cp)
    try:
        yield ConsolePlane(cp, admin)
    finally:
        await admin.close()
        await cp.client.close()
