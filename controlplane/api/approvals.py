"""Pending approvals and preauthorization (DESIGN 4.1 step 3).

    GET  /api/v1/approvals                         viewer: devices waiting for an operator
    POST /api/v1/approvals/{device_id}/approve     operator: pending → accepted
    POST /api/v1/approvals/{device_id}/reject      operator: pending → rejected
    POST /api/v1/preauthorizations                 operator: accept a public key in advance

An approved device receives its broker credentials the next time it asks
(``mcp-agent enroll`` polls while pending), so approval itself does not touch the broker.
The decisions are :class:`~controlplane.enrollment_service.EnrollmentService`'s
(``app[ENROLLMENT]``); its errors become answers in :mod:`controlplane.api.common`. The web
console's enrollment page makes the same calls (and lists :func:`pending_devices`).
"""

from __future__ import annotations

from aiohttp import web

from mcp_edge.controlplane.api.common import (
    Endpoint,
    Services,
    json_response,
    read_body,
    services,
)
from mcp_edge.controlplane.api.devices import device_out
from mcp_edge.controlplane.api.enroll import enrollment
from mcp_edge.controlplane.api.schemas import (
    ApprovalList,
    DeviceDetail,
    PreauthorizeRequest,
    ReasonBody,
)
from mcp_edge.controlplane.auth import Role, principal_of
from mcp_edge.controlplane.db import devices as q
from mcp_edge.controlplane.db.devices import DeviceFilter, DeviceView
from mcp_edge.controlplane.enrollment import DeviceStatus

MAX_PENDING_LISTED = 1000


async def pending_devices(svc: Services) -> list[DeviceView]:
    """The devices waiting for approval (at most :data:`MAX_PENDING_LISTED`), by id."""
    async with svc.db.read() as tx:
        views, _ = await q.list_devices(
            tx,
            DeviceFilter(statuses=[DeviceStatus.PENDING.value]),
            limit=MAX_PENDING_LISTED,
            offset=0,
        )
    return views


async def list_pending(request: web.Request) -> web.Response:
    views = await pending_devices(services(request))
    return json_response(ApprovalList(items=[device_out(v) for v in views]))


async def approve(request: web.Request) -> web.Response:
    service, who = enrollment(request), principal_of(request)
    body = await read_body(request, ReasonBody)
    view = await service.approve(
        request.match_info["device_id"], actor=who.actor, reason=body.reason
    )
    return json_response(DeviceDetail.model_validate(view))


async def reject(request: web.Request) -> web.Response:
    service, who = enrollment(request), principal_of(request)
    body = await read_body(request, ReasonBody)
    view = await service.reject(
        request.match_info["device_id"], actor=who.actor, reason=body.reason
    )
    return json_response(DeviceDetail.model_validate(view))


async def preauthorize(request: web.Request) -> web.Response:
    service, who = enrollment(request), principal_of(request)
    body = await read_body(request, PreauthorizeRequest)
    view = await service.preauthorize(
        body.public_key,
        actor=who.actor,
        device_id=body.device_id,
        group=body.group,
        labels=body.labels,
    )
    return json_response(DeviceDetail.model_validate(view), 201)


ENDPOINTS = [
    Endpoint(
        "GET",
        "/api/v1/approvals",
        list_pending,
        "Devices waiting for approval",
        Role.VIEWER,
        "approvals",
        response=ApprovalList,
    ),
    Endpoint(
        "POST",
        "/api/v1/approvals/{device_id}/approve",
        approve,
        "Accept a pending device",
        Role.OPERATOR,
        "approvals",
        body=ReasonBody,
        response=DeviceDetail,
        answers={409: "the device is not pending"},
    ),
    Endpoint(
        "POST",
        "/api/v1/approvals/{device_id}/reject",
        reject,
        "Reject a pending device",
        Role.OPERATOR,
        "approvals",
        body=ReasonBody,
        response=DeviceDetail,
        answers={409: "the device is not pending"},
    ),
    Endpoint(
        "POST",
        "/api/v1/preauthorizations",
        preauthorize,
        "Accept a device's public key before it enrolls (no token needed)",
        Role.OPERATOR,
        "approvals",
        body=PreauthorizeRequest,
        response=DeviceDetail,
        status=201,
        answers={409: "the public key or the device id is taken"},
    ),
]
