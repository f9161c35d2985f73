"""Pending approvals and preauthorization (DESIGN 4.1 step 3).

    GET  /api/v1/approvals                         viewer: devices waiting for an operator
    POST /api/v1/approvals/{device_id}/approve     operator: pending → accepted
    POST /api/v1/approvals/{device_id}/reject      operator: pending → rejected
    POST /api/v1/preauthorizations                 operator: accept a public key in advance

An approved device receives its broker credentials the next time it asks
(``mcp-agent enroll`` polls while pending), so approval itself does not touch the broker.
"""

from __future__ import annotations

from aiohttp import web

from mcp_edge.controlplane import audit
from mcp_edge.controlplane.api.common import ApiError, Endpoint, json_response, read_body, services
from mcp_edge.controlplane.api.deployments import apply_standing_deployments
from mcp_edge.controlplane.api.devices import device_out
from mcp_edge.controlplane.api.schemas import (
    ApprovalList,
    DeviceDetail,
    PreauthorizeRequest,
    ReasonBody,
)
from mcp_edge.controlplane.audit import AuditAction
from mcp_edge.controlplane.auth import Role, principal_of
from mcp_edge.controlplane.db import devices as q
from mcp_edge.controlplane.db.devices import DeviceFilter
from mcp_edge.controlplane.enrollment import DeviceStatus, default_device_id
from mcp_edge.shared.protocol.command import ErrorCode

MAX_PENDING_LISTED = 1000


async def list_pending(request: web.Request) -> web.Response:
    svc = services(request)
    async with svc.db.read() as tx:
        views, _ = await q.list_devices(
            tx, DeviceFilter(statuses=[DeviceStatus.PENDING.value]), limit=MAX_PENDING_LISTED,
            offset=0,
        )
    return json_response(ApprovalList(items=[device_out(v) for v in views]))


async def _decide(request: web.Request, approve: bool) -> web.Response:
    svc, who = services(request), principal_of(request)
    device_id = request.match_info["device_id"]
    body = await read_body(request, ReasonBody)
    now = svc.clock()
    async with svc.db.transaction() as tx:
        view = await q.get_device(tx, device_id, lock=True)
        if view is None:
            raise ApiError(ErrorCode.NOT_FOUND, f"no device {device_id!r}")
        if view.status != DeviceStatus.PENDING.value:
            raise ApiError(
                ErrorCode.CONFLICT, f"device {device_id!r} is {view.status}, not pending"
            )
        if approve:
            view = await q.update_device(
                tx, device_id, now=now, status=DeviceStatus.ACCEPTED.value, accepted_at=now
            )
        else:
            view = await q.update_device(tx, device_id, now=now, status=DeviceStatus.REJECTED.value)
        await audit.record(
            tx, at=now, actor=who.actor,
            action=AuditAction.DEVICE_APPROVED if approve else AuditAction.DEVICE_REJECTED,
            target_type="device", target_id=device_id, detail={"reason": body.reason},
        )
    if approve:
        await apply_standing_deployments(request, device_id)
    return json_response(DeviceDetail.model_validate(view))


async def approve(request: web.Request) -> web.Response:
    return await _decide(request, approve=True)


async def reject(request: web.Request) -> web.Response:
    return await _decide(request, approve=False)


async def preauthorize(request: web.Request) -> web.Response:
    svc, who = services(request), principal_of(request)
    body = await read_body(request, PreauthorizeRequest)
    device_id = body.device_id or default_device_id(body.public_key)
    now = svc.clock()
    async with svc.db.transaction() as tx:
        known = await q.get_device_by_key(tx, body.public_key)
        if known is not None:
            raise ApiError(
                ErrorCode.CONFLICT, f"this public key already belongs to device {known.id!r}"
            )
        if await q.device_id_taken(tx, device_id):
            raise ApiError(ErrorCode.CONFLICT, f"device id {device_id!r} is taken")
        view = await q.insert_device(
            tx, device_id=device_id, public_key=body.public_key,
            status=DeviceStatus.PREAUTHORIZED.value, now=now, group_name=body.group,
            labels=body.labels,
        )
        await audit.record(
            tx, at=now, actor=who.actor, action=AuditAction.DEVICE_PREAUTHORIZED,
            target_type="device", target_id=device_id,
            detail={"public_key": body.public_key, "group": body.group, "labels": body.labels},
        )
    return json_response(DeviceDetail.model_validate(view), 201)


ENDPOINTS = [
    Endpoint("GET", "/api/v1/approvals", list_pending, "Devices waiting for approval",
             Role.VIEWER, "approvals", response=ApprovalList),
    Endpoint("POST", "/api/v1/approvals/{device_id}/approve", approve,
             "Accept a pending device", Role.OPERATOR, "approvals", body=ReasonBody,
             response=DeviceDetail, answers={409: "the device is not pending"}),
    Endpoint("POST", "/api/v1/approvals/{device_id}/reject", reject,
             "Reject a pending device", Role.OPERATOR, "approvals", body=ReasonBody,
             response=DeviceDetail, answers={409: "the device is not pending"}),
    Endpoint("POST", "/api/v1/preauthorizations", preauthorize,
             "Accept a device's public key before it enrolls (no token needed)",
             Role.OPERATOR, "approvals", body=PreauthorizeRequest, response=DeviceDetail,
             status=201, answers={409: "the public key or the device id is taken"}),
]
