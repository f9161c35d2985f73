"""The console's plumbing as a browser meets it: sign-in, sessions, CSRF, roles, headers.

Real control plane (SQLite and PostgreSQL), HTTP through aiohttp's client with a cookie jar;
the browser tests (tests/ui/) cover the same in Chromium.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import unquote

import pytest

from mcp_edge.controlplane.ui.core import CSP
from tests.support.console import ConsolePlane, console_plane, sign_in, user_console
from tests.support.controlplane import ADMIN_PASSWORD


@pytest.fixture
async def plane(database_url: str, tmp_path: Path) -> AsyncIterator[ConsolePlane]:
    async with console_plane(database_url, tmp_path / "cp") as p:
        yield p


async def test_root_and_pages_need_a_session(plane: ConsolePlane) -> None:
    async with plane.cp.client.get("/", allow_redirects=False) as r:
        assert r.status == 303 and r.headers["Location"] == "/ui/"
    async with plane.cp.client.get("/ui/account", allow_redirects=False) as r:
        assert r.status == 303
        assert unquote(r.headers["Location"]) == "/ui/login?next=/ui/account"
    async with plane.cp.client.post("/ui/logout", allow_redirects=False) as r:
        assert r.status == 401
        assert "sign in again" in await r.text()


async def test_session_cookie_flags_and_wrong_password(plane: ConsolePlane) -> None:
    with pytest.raises(AssertionError):
        await sign_in(plane.cp, "admin", "not the password")
    client = plane.cp.client
    async with client.get("/ui/login") as r:
        nonce = re.search(r'name="csrf" value="([^"]+)"', await r.text())
    assert nonce is not None
    form = {"username": "admin", "password": ADMIN_PASSWORD, "csrf": nonce.group(1)}
    async with client.post("/ui/login", data=form, allow_redirects=False) as r:
        assert r.status == 303
        cookies = [c for c in r.headers.getall("Set-Cookie") if c.startswith("mcp_session=")]
    assert len(cookies) == 1
    flags = {part.strip().lower() for part in cookies[0].split(";")}
    assert {"httponly", "samesite=strict", "path=/"} <= flags
    assert "secure" not in flags  # plain HTTP here; Secure when served over TLS
    page = await plane.admin.get("/ui/account")
    assert page.status == 200 and "admin" in page.text and "this one" in page.text
    assert page.headers["Content-Security-Policy"] == CSP
    assert "unsafe-inline" not in CSP and page.headers["X-Frame-Options"] == "DENY"


async def test_login_form_refuses_a_cross_site_submission(plane: ConsolePlane) -> None:
    async with plane.cp.client.post(
        "/ui/login", data={"username": "admin", "password": "x", "csrf": "forged"},
        allow_redirects=False,
    ) as r:  # fmt: skip
        assert r.status == 403
        assert "mcp_session" not in r.cookies


async def test_csrf_token_is_required_on_every_post(plane: ConsolePlane) -> None:
    admin = plane.admin
    for token in ("", "0" * 64):
        page = await admin.post("/ui/logout", csrf=token)
        assert page.status == 403 and "CSRF" in page.text
    assert (await admin.get("/ui/account")).status == 200  # still signed in


async def test_sign_out_ends_the_session_and_the_api_sees_it(plane: ConsolePlane) -> None:
    console = await sign_in(plane.cp)
    cookie = console.session.cookie_jar.filter_cookies(console.url("/"))["mcp_session"].value
    status, whoami = await plane.cp.call("GET", "/api/v1/auth/whoami", token=cookie)
    assert status == 200 and whoami["username"] == "admin"
    page = await console.post("/ui/logout")
    assert page.status == 200 and "/ui/login" in page.url
    status, _ = await plane.cp.call("GET", "/api/v1/auth/whoami", token=cookie)
    assert status == 401
    again = await console.get("/ui/account")
    assert "/ui/login" in again.url
    await console.close()


async def test_revoked_and_expired_sessions_stop_working(plane: ConsolePlane) -> None:
    console = await sign_in(plane.cp)
    status, tokens = await plane.cp.call("GET", "/api/v1/api-tokens")
    assert status == 200
    web = [t for t in tokens["items"] if t["name"] == "web session"]
    assert len(web) == 2 and all(t["expires_at"] for t in web)
    newest = max(web, key=lambda t: t["id"])
    status, _ = await plane.cp.call("DELETE", f"/api/v1/api-tokens/{newest['id']}")
    assert status == 200
    assert "/ui/login" in (await console.get("/ui/account")).url
    await console.close()
    plane.cp.clock.advance(hours=13)
    assert "/ui/login" in (await plane.admin.get("/ui/account")).url


async def test_the_api_takes_the_cookie_for_reads_only(plane: ConsolePlane) -> None:
    admin = plane.admin
    async with admin.session.get(admin.url("/api/v1/devices")) as r:
        assert r.status == 200
    async with admin.session.post(
        admin.url("/api/v1/enrollment-tokens"), json={}, headers={"X-CSRF-Token": admin.csrf}
    ) as r:
        assert r.status == 401


async def test_viewer_changes_nothing(plane: ConsolePlane) -> None:
    viewer = await user_console(plane.cp, "vera", "viewer")
    try:
        page = await viewer.get("/ui/account")
        assert "change nothing" in page.text
    finally:
        await viewer.close()


async def test_unknown_page_and_static_files(plane: ConsolePlane) -> None:
    page = await plane.admin.get("/ui/no-such-page")
    assert page.status == 404 and "no page at /ui/no-such-page" in page.text
    assert "<html" in page.text
    for name, kind in (("app.css", "text/css"), ("app.js", "text/javascript")):
        async with plane.cp.client.get(f"/ui/static/{name}") as r:
            assert r.status == 200 and r.content_type == kind
    async with plane.cp.client.get("/ui/static/..%2Fcore.py") as r:
        assert r.status == 404
