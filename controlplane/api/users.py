"""Users, login and API tokens.

POST   /api/v1/auth/login            username + password → a new API token (public)
GET    /api/v1/auth/whoami           the caller
GET    /api/v1/api-tokens            the caller's API tokens (admins: everyone's)
DELETE /api/v1/api-tokens/{id}       revoke one (own; admins: any)
GET    /api/v1/users                 admin
POST   /api/v1/users                 admin
PATCH  /api/v1/users/{username}      admin: role, disabled, password
"""

from __future__ import annotations

from datetime import datetime, timedelta

from aiohttp import web

from mcp_edge.controlplane import audit
from mcp_edge.controlplane.api.common import (
    ApiError,
    Endpoint,
    json_response,
    path_int,
    read_body,
    services,
)
from mcp_edge.controlplane.api.schemas import (
    ApiTokenCreated,
    ApiTokenList,
    ApiTokenOut,
    LoginRequest,
    UserCreate,
    UserList,
    UserOut,
    UserUpdate,
    WhoAmI,
)
from mcp_edge.controlplane.audit import AuditAction
from mcp_edge.controlplane.auth import (
    API_TOKEN_PREFIX,
    AuthError,
    Principal,
    Role,
    issue_secret,
    principal_of,
)
from mcp_edge.controlplane.db import Tx
from mcp_edge.controlplane.db import users as q
from mcp_edge.controlplane.db.models import ApiToken, User
from mcp_edge.shared.protocol.command import ErrorCode

LOGIN_MAX_BODY = 4096


def _token_out(token: ApiToken, username: str) -> ApiTokenOut:
    return ApiTokenOut(
        id=token.id,
        name=token.name,
        username=username,
        prefix=token.prefix,
        created_at=token.created_at,
        expires_at=token.expires_at,
        last_used_at=token.last_used_at,
        revoked_at=token.revoked_at,
    )


async def issue_api_token(
    tx: Tx, user: User, *, name: str, actor: str, expires_in: timedelta | None, now: datetime
) -> ApiTokenCreated:
    """Create an API token for ``user`` in ``tx`` and audit it; the answer holds the secret."""
    secret = issue_secret(API_TOKEN_PREFIX)
    expires_at = now + expires_in if expires_in is not None else None
    token = await q.create_api_token(
        tx,
        user=user,
        name=name,
        token_hash=secret.digest,
        prefix=secret.prefix,
        now=now,
        expires_at=expires_at,
    )
    await audit.record(
        tx,
        at=now,
        actor=actor,
        action=AuditAction.API_TOKEN_CREATED,
        target_type="api_token",
        target_id=token.id,
        detail={"user": user.username, "name": name, "prefix": secret.prefix},
    )
    return ApiTokenCreated(**_token_out(token, user.username).model_dump(), token=secret.token)


async def login(request: web.Request) -> web.Response:
    svc = services(request)
    body = await read_body(request, LoginRequest, LOGIN_MAX_BODY)
    async with svc.db.read() as tx:
        user = await q.get_user(tx, body.username)
    ok = await svc.hasher.verify(user.password_hash if user else None, body.password)
    if not ok or user is None:
        raise AuthError("wrong username or password")
    if user.disabled:
        raise AuthError(f"user {user.username!r} is disabled")
    now = svc.clock()
    expires = timedelta(seconds=body.expires_in_s) if body.expires_in_s else None
    async with svc.db.transaction() as tx:
        created = await issue_api_token(
            tx,
            user,
            name=body.token_name,
            actor=f"user:{user.username}",
            expires_in=expires,
            now=now,
        )
    return json_response(created, 201)


async def whoami(request: web.Request) -> web.Response:
    who = principal_of(request)
    return json_response(WhoAmI(username=who.username, role=who.role, token_id=who.token_id))


async def list_api_tokens(request: web.Request) -> web.Response:
    svc, who = services(request), principal_of(request)
    async with svc.db.read() as tx:
        rows = await q.list_api_tokens(tx, None if who.role is Role.ADMIN else who.user_id)
    return json_response(ApiTokenList(items=[_token_out(t, name) for t, name in rows]))


async def revoke_api_token(request: web.Request) -> web.Response:
    svc, who = services(request), principal_of(request)
    token_id = path_int(request, "token_id")
    now = svc.clock()
    async with svc.db.transaction() as tx:
        found = await q.get_api_token(tx, token_id)
        if found is None or (who.role is not Role.ADMIN and found[0].user_id != who.user_id):
            raise ApiError(ErrorCode.NOT_FOUND, f"no API token {token_id}")
        username = found[1]
        token = await q.revoke_api_token(tx, token_id, now)
        await audit.record(
            tx,
            at=now,
            actor=who.actor,
            action=AuditAction.API_TOKEN_REVOKED,
            target_type="api_token",
            target_id=token_id,
            detail={"prefix": token.prefix},
        )
    return json_response(_token_out(token, username))


async def list_users(request: web.Request) -> web.Response:
    svc = services(request)
    async with svc.db.read() as tx:
        users = await q.list_users(tx)
    return json_response(UserList(items=[UserOut.model_validate(u) for u in users]))


async def create_user(request: web.Request) -> web.Response:
    svc, who = services(request), principal_of(request)
    body = await read_body(request, UserCreate)
    password_hash = await svc.hasher.hash(body.password)
    now = svc.clock()
    async with svc.db.transaction() as tx:
        user = await q.create_user(
            tx,
            username=body.username,
            password_hash=password_hash,
            role=body.role.value,
            now=now,
        )
        await audit.record(
            tx,
            at=now,
            actor=who.actor,
            action=AuditAction.USER_CREATED,
            target_type="user",
            target_id=user.username,
            detail={"role": body.role.value},
        )
    return json_response(UserOut.model_validate(user), 201)


def _check_self_change(who: Principal, username: str, body: UserUpdate) -> None:
    if username != who.username:
        return
    if body.disabled or (body.role is not None and body.role is not Role.ADMIN):
        raise ApiError(
            ErrorCode.CONFLICT, "an admin cannot disable or demote themselves; ask another admin"
        )


async def update_user(request: web.Request) -> web.Response:
    svc, who = services(request), principal_of(request)
    username = request.match_info["username"]
    body = await read_body(request, UserUpdate)
    _check_self_change(who, username, body)
    password_hash = await svc.hasher.hash(body.password) if body.password else None
    now = svc.clock()
    async with svc.db.transaction() as tx:
        user = await q.update_user(
            tx,
            username,
            now=now,
            role=body.role.value if body.role else None,
            disabled=body.disabled,
            password_hash=password_hash,
        )
        changed = {k: v for k, v in body.model_dump(mode="json").items() if v is not None}
        if "password" in changed:
            changed["password"] = "changed"
        await audit.record(
            tx,
            at=now,
            actor=who.actor,
            action=AuditAction.USER_UPDATED,
            target_type="user",
            target_id=username,
            detail=changed,
        )
    return json_response(UserOut.model_validate(user))


ENDPOINTS = [
    Endpoint(
        "POST",
        "/api/v1/auth/login",
        login,
        "Log in: trade a password for an API token",
        None,
        "auth",
        body=LoginRequest,
        response=ApiTokenCreated,
        status=201,
        max_body=LOGIN_MAX_BODY,
        answers={
            401: "wrong username or password, or the user is disabled",
            503: "database unavailable; retry later",
        },
    ),
    Endpoint(
        "GET",
        "/api/v1/auth/whoami",
        whoami,
        "The caller's user and role",
        Role.VIEWER,
        "auth",
        response=WhoAmI,
    ),
    Endpoint(
        "GET",
        "/api/v1/api-tokens",
        list_api_tokens,
        "List API tokens (own; admins see all)",
        Role.VIEWER,
        "auth",
        response=ApiTokenList,
    ),
    Endpoint(
        "DELETE",
        "/api/v1/api-tokens/{token_id}",
        revoke_api_token,
        "Revoke an API token",
        Role.VIEWER,
        "auth",
        response=ApiTokenOut,
    ),
    Endpoint(
        "GET", "/api/v1/users", list_users, "List users", Role.ADMIN, "users", response=UserList
    ),
    Endpoint(
        "POST",
        "/api/v1/users",
        create_user,
        "Create a user",
        Role.ADMIN,
        "users",
        body=UserCreate,
        response=UserOut,
        status=201,
        answers={409: "a user of that name exists"},
    ),
    Endpoint(
        "PATCH",
        "/api/v1/users/{username}",
        update_user,
        "Change a user's role, password or disabled flag",
        Role.ADMIN,
        "users",
        body=UserUpdate,
        response=UserOut,
        answers={409: "an admin cannot disable or demote themselves"},
    ),
]
