"""``GET /api/v1/audit``: the audit log, newest first (operators and admins)."""

from __future__ import annotations

from aiohttp import web

from mcp_edge.controlplane.api.common import Endpoint, json_response, read_query, services
from mcp_edge.controlplane.api.schemas import AuditEntryOut, AuditList, AuditQuery
from mcp_edge.controlplane.auth import Role
from mcp_edge.controlplane.db import audit as q


async def list_audit(request: web.Request) -> web.Response:
    svc = services(request)
    query = read_query(request, AuditQuery)
    async with svc.db.read() as tx:
        entries = await q.list_entries(
            tx,
            limit=query.limit,
            before_id=query.before_id,
            action=query.action,
            target_type=query.target_type,
            target_id=query.target_id,
        )
    return json_response(AuditList(items=[AuditEntryOut.model_validate(e) for e in entries]))


ENDPOINTS = [
    Endpoint(
        "GET",
        "/api/v1/audit",
        list_audit,
        "The audit log, newest first; page with before_id",
        Role.OPERATOR,
        "audit",
        query=AuditQuery,
        response=AuditList,
    ),
]
