"""Enrollment tokens (DESIGN 4.1 step 1).

GET    /api/v1/enrollment-tokens          viewer
POST   /api/v1/enrollment-tokens          operator: the answer holds the token, once
GET    /api/v1/enrollment-tokens/{id}     viewer
DELETE /api/v1/enrollment-tokens/{id}     operator: revoke (kept for the audit trail)

:func:`create_enrollment_token` and :func:`revoke_enrollment_token` do the work (rows and audit
entries); the web console's enrollment page calls them too.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from aiohttp import web

from mcp_edge.controlplane import audit
from mcp_edge.controlplane.api.common import (
    ApiError,
    Endpoint,
    Services,
    json_response,
    path_int,
    read_body,
    services,
)
from mcp_edge.controlplane.api.schemas import (
    EnrollmentTokenCreate,
    EnrollmentTokenCreated,
    EnrollmentTokenList,
    EnrollmentTokenOut,
)
from mcp_edge.controlplane.audit import AuditAction
from mcp_edge.controlplane.auth import (
    ENROLLMENT_TOKEN_PREFIX,
    Principal,
    Role,
    issue_secret,
    principal_of,
)
from mcp_edge.controlplane.db import enrollment as q
from mcp_edge.controlplane.db.models import EnrollmentToken
from mcp_edge.controlplane.enrollment import Approval, token_refusal
from mcp_edge.controlplane.enrollment_service import token_facts
from mcp_edge.shared.protocol.command import ErrorCode

_STATE_BY_REFUSAL = {
    "token_revoked": "revoked",
    "token_expired": "expired",
    "token_used_up": "used_up",
}


def token_out(token: EnrollmentToken, now: datetime) -> EnrollmentTokenOut:
    refusal = token_refusal(token_facts(token), now)
    state = "active" if refusal is None else _STATE_BY_REFUSAL[refusal.value]
    return EnrollmentTokenOut(
        id=token.id,
        prefix=token.prefix,
        description=token.description,
        group=token.group_name,
        labels=dict(token.labels),
        approval=Approval(token.approval),
        max_uses=token.max_uses,
        uses=token.uses,
        created_at=token.created_at,
        created_by=token.created_by,
        expires_at=token.expires_at,
        revoked_at=token.revoked_at,
        state=state,
    )


async def list_tokens(request: web.Request) -> web.Response:
    svc = services(request)
    async with svc.db.read() as tx:
        tokens = await q.list_tokens(tx)
    now = svc.clock()
    return json_response(EnrollmentTokenList(items=[token_out(t, now) for t in tokens]))


async def create_enrollment_token(
    svc: Services, who: Principal, body: EnrollmentTokenCreate
) -> tuple[EnrollmentToken, str]:
    """Create an enrollment token as ``who`` asked, audited; returns the row and the secret
    (given to ``mcp-agent enroll --token``; only its hash is stored)."""
    secret = issue_secret(ENROLLMENT_TOKEN_PREFIX)
    now = svc.clock()
    expires_at = now + timedelta(seconds=body.expires_in_s) if body.expires_in_s else None
    async with svc.db.transaction() as tx:
        token = await q.create_token(
            tx,
            token_hash=secret.digest,
            prefix=secret.prefix,
            now=now,
            created_by=who.username,
            approval=body.approval.value,
            group_name=body.group,
            labels=body.labels,
            max_uses=body.max_uses,
            expires_at=expires_at,
            description=body.description,
        )
        await audit.record(
            tx,
            at=now,
            actor=who.actor,
            action=AuditAction.ENROLLMENT_TOKEN_CREATED,
            target_type="enrollment_token",
            target_id=token.id,
            detail={
                "prefix": secret.prefix,
                "group": body.group,
                "labels": body.labels,
                "max_uses": body.max_uses,
                "approval": body.approval.value,
                "expires_at": expires_at.isoformat() if expires_at else None,
            },
        )
    return token, secret.token


async def revoke_enrollment_token(svc: Services, who: Principal, token_id: int) -> EnrollmentToken:
    """Revoke an enrollment token (kept for the audit trail), audited as ``who``; raises
    :class:`~controlplane.db.NotFoundError`."""
    now = svc.clock()
    async with svc.db.transaction() as tx:
        token = await q.revoke_token(tx, token_id, now)
        await audit.record(
            tx,
            at=now,
            actor=who.actor,
            action=AuditAction.ENROLLMENT_TOKEN_REVOKED,
            target_type="enrollment_token",
            target_id=token_id,
            detail={"prefix": token.prefix},
        )
    return token


async def create_token(request: web.Request) -> web.Response:
    svc = services(request)
    body = await read_body(request, EnrollmentTokenCreate)
    token, secret = await create_enrollment_token(svc, principal_of(request), body)
    out = token_out(token, svc.clock())
    return json_response(EnrollmentTokenCreated(**out.model_dump(), token=secret), 201)


async def get_token(request: web.Request) -> web.Response:
    svc = services(request)
    token_id = path_int(request, "token_id")
    async with svc.db.read() as tx:
        token = await q.get_token(tx, token_id)
    if token is None:
        raise ApiError(ErrorCode.NOT_FOUND, f"no enrollment token {token_id}")
    return json_response(token_out(token, svc.clock()))


async def revoke_token(request: web.Request) -> web.Response:
    svc = services(request)
    token_id = path_int(request, "token_id")
    token = await revoke_enrollment_token(svc, principal_of(request), token_id)
    return json_response(token_out(token, svc.clock()))


ENDPOINTS = [
    Endpoint(
        "GET",
        "/api/v1/enrollment-tokens",
        list_tokens,
        "List enrollment tokens",
        Role.VIEWER,
        "enrollment",
        response=EnrollmentTokenList,
    ),
    Endpoint(
        "POST",
        "/api/v1/enrollment-tokens",
        create_token,
        "Create an enrollment token (the secret is in this answer only)",
        Role.OPERATOR,
        "enrollment",
        body=EnrollmentTokenCreate,
        response=EnrollmentTokenCreated,
        status=201,
    ),
    Endpoint(
        "GET",
        "/api/v1/enrollment-tokens/{token_id}",
        get_token,
        "One enrollment token",
        Role.VIEWER,
        "enrollment",
        response=EnrollmentTokenOut,
    ),
    Endpoint(
        "DELETE",
        "/api/v1/enrollment-tokens/{token_id}",
        revoke_token,
        "Revoke an enrollment token",
        Role.OPERATOR,
        "enrollment",
        response=EnrollmentTokenOut,
    ),
]
