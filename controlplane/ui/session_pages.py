"""Sign in, sign out, and the signed-in user's own sessions (``/ui/login``, ``/ui/account``).

A login asks for the control plane's username and password (argon2id, as the API's login),
creates a session (an API token named ``web session``, expiring after
``ui_session_hours``) and sets it as an HttpOnly, SameSite=Strict cookie. The login form is
itself guarded against cross-site submission by a double-submit cookie (a random value in a
SameSite=Strict cookie that the form repeats).
"""

from __future__ import annotations

import hmac
import secrets

from aiohttp import web

from mcp_edge.controlplane import audit
from mcp_edge.controlplane.api.common import services
from mcp_edge.controlplane.api.users import issue_api_token
from mcp_edge.controlplane.audit import AuditAction
from mcp_edge.controlplane.auth import MAX_PASSWORD_BYTES, SESSION_COOKIE, Role
from mcp_edge.controlplane.db import users as user_queries
from mcp_edge.controlplane.ui.core import (
    LOGIN_CSRF_COOKIE,
    SECURITY_HEADERS,
    SESSION_TOKEN_NAME,
    Ctx,
    Page,
    UiError,
    html_response,
    read_form,
    render,
    session_lifetime,
    session_principal,
)

MAX_USERNAME = 128


def _safe_next(value: str) -> str:
    """Where to go after signing in: a path on this console, never another site."""
    if value.startswith("/ui/") and not value.startswith("//") and "\\" not in value:
        return value
    return "/ui/"


def _login_page(
    request: web.Request, *, error: str = "", username: str = "", status: int = 200
) -> web.Response:
    nonce = request.cookies.get(LOGIN_CSRF_COOKIE) or secrets.token_urlsafe(24)
    text = render(
        request.app, "login.html", principal=None, csrf="", nav="", can_operate=False,
        can_admin=False, flash="", login_csrf=nonce, error=error, username=username,
        next=_safe_next(request.query.get("next", "")), now=services(request).clock(),
        request_path=request.path_qs,
    )  # fmt: skip
    response = html_response(text, status=status)
    response.set_cookie(
        LOGIN_CSRF_COOKIE, nonce, httponly=True, samesite="Strict", path="/ui/",
        secure=request.secure, max_age=3600,
    )  # fmt: skip
    return response


async def login_form(request: web.Request) -> web.StreamResponse:
    if await session_principal(request) is not None:
        raise web.HTTPSeeOther(_safe_next(request.query.get("next", "")), headers=SECURITY_HEADERS)
    return _login_page(request)


async def login_submit(request: web.Request) -> web.StreamResponse:
    svc = services(request)
    try:
        form = await read_form(request)
    except UiError as e:
        return _login_page(request, error=str(e), status=e.status)

    def one(name: str) -> str:
        values = form.get(name)
        return values[0] if values else ""

    cookie = request.cookies.get(LOGIN_CSRF_COOKIE, "")
    if not cookie or not hmac.compare_digest(one("csrf").encode(), cookie.encode()):
        return _login_page(request, error="the sign-in form expired; try again", status=403)
    username, password = one("username").strip(), one("password")
    if not username or not password:
        return _login_page(
            request, error="enter your username and password", username=username, status=400
        )
    if len(username) > MAX_USERNAME or len(password.encode()) > MAX_PASSWORD_BYTES:
        return _login_page(request, error="wrong username or password", status=401)
    async with svc.db.read() as tx:
        user = await user_queries.get_user(tx, username)
    ok = await svc.hasher.verify(user.password_hash if user else None, password)
    if not ok or user is None:
        return _login_page(
            request, error="wrong username or password", username=username, status=401
        )
    if user.disabled:
        return _login_page(request, error=f"user {username!r} is disabled", status=403)
    now = svc.clock()
    async with svc.db.transaction() as tx:
        created = await issue_api_token(
            tx, user, name=SESSION_TOKEN_NAME, actor=f"user:{user.username}",
            expires_in=session_lifetime(svc), now=now,
        )  # fmt: skip
    target = _safe_next(one("next"))
    response = web.Response(status=303, headers={"Location": target, **SECURITY_HEADERS})
    response.set_cookie(
        SESSION_COOKIE, created.token, httponly=True, samesite="Strict", path="/",
        secure=request.secure, max_age=int(session_lifetime(svc).total_seconds()),
    )  # fmt: skip
    response.del_cookie(LOGIN_CSRF_COOKIE, path="/ui/")
    return response


async def logout(ctx: Ctx) -> web.StreamResponse:
    now = ctx.now
    async with ctx.svc.db.transaction() as tx:
        token = await user_queries.revoke_api_token(tx, ctx.principal.token_id, now)
        await audit.record(
            tx, at=now, actor=ctx.principal.actor, action=AuditAction.API_TOKEN_REVOKED,
            target_type="api_token", target_id=token.id,
            detail={"prefix": token.prefix, "why": "signed out"},
        )  # fmt: skip
    response = web.Response(status=303, headers={"Location": "/ui/login", **SECURITY_HEADERS})
    response.del_cookie(SESSION_COOKIE, path="/")
    return response


async def account(ctx: Ctx) -> web.StreamResponse:
    async with ctx.svc.db.read() as tx:
        rows = await user_queries.list_api_tokens(tx, ctx.principal.user_id)
    sessions = [
        t for t, _ in rows
        if t.name == SESSION_TOKEN_NAME and t.revoked_at is None
        and (t.expires_at is None or t.expires_at > ctx.now)
    ]  # fmt: skip
    tokens = [t for t, _ in rows if t.name != SESSION_TOKEN_NAME]
    return ctx.render("account.html", sessions=sessions, tokens=tokens)


async def revoke_own_token(ctx: Ctx) -> web.StreamResponse:
    raw = ctx.request.match_info["token_id"]
    if not raw.isdigit() or len(raw) > 18:
        raise UiError("no such session", status=404)
    token_id = int(raw)
    now = ctx.now
    async with ctx.svc.db.transaction() as tx:
        found = await user_queries.get_api_token(tx, token_id)
        if found is None or found[0].user_id != ctx.principal.user_id:
            raise UiError(f"no session or token {token_id} of yours", status=404)
        token = await user_queries.revoke_api_token(tx, token_id, now)
        await audit.record(
            tx, at=now, actor=ctx.principal.actor, action=AuditAction.API_TOKEN_REVOKED,
            target_type="api_token", target_id=token_id, detail={"prefix": token.prefix},
        )  # fmt: skip
    if token_id == ctx.principal.token_id:
        response = web.Response(status=303, headers={"Location": "/ui/login", **SECURITY_HEADERS})
        response.del_cookie(SESSION_COOKIE, path="/")
        return response
    return ctx.redirect("/ui/account", f"revoked {token.prefix}…")


def login_routes(app: web.Application) -> None:
    app.router.add_get("/ui/login", login_form)
    app.router.add_post("/ui/login", login_submit)


PAGES = [
    Page("POST", "/ui/logout", logout, Role.VIEWER),
    Page("GET", "/ui/account", account, Role.VIEWER, nav="account"),
    Page("POST", "/ui/account/tokens/{token_id}/revoke", revoke_own_token, Role.VIEWER),
]

__all__ = ["PAGES", "login_routes"]
