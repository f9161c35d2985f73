"""Devices: list with filters, detail, labels, revoke.

GET   /api/v1/devices                    viewer; ?label=k=v&label=k&profile=&status=&group=&q=
GET   /api/v1/devices/{device_id}        viewer
PATCH /api/v1/devices/{device_id}/labels operator: {"set": {...}, "remove": [...]}
POST  /api/v1/devices/{device_id}/revoke operator: disable at the broker, refuse from now on
"""

from __future__ import annotations

from aiohttp import web

from mcp_edge.controlplane import audit
from mcp_edge.controlplane.api.common import (
    ApiError,
    Endpoint,
    json_response,
    read_body,
    read_query,
    services,
)
from mcp_edge.controlplane.api.schemas import (
    CONNECTION_STATES,
    DeviceDetail,
    DeviceList,
    DeviceOut,
    DeviceQuery,
    LabelsPatch,
    ReasonBody,
)
from mcp_edge.controlplane.audit import AuditAction
from mcp_edge.controlplane.auth import Role, principal_of
from mcp_edge.controlplane.db import devices as q
from mcp_edge.controlplane.db.devices import DeviceFilter, DeviceView
from mcp_edge.controlplane.enrollment import DeviceStatus
from mcp_edge.shared.protocol.base import MAX_LABELS
from mcp_edge.shared.protocol.command import ErrorCode


def device_out(view: DeviceView) -> DeviceOut:
    return DeviceOut.model_validate(view)


def device_filter(query: DeviceQuery) -> DeviceFilter:
    """Turn query parameters into a filter; raises :class:`ApiError` for an unknown status."""
    labels: dict[str, str] = {}
    keys: list[str] = []
    for item in query.label:
        key, sep, value = item.partition("=")  # a valid filter's key holds no "="
        if sep:
            labels[key] = value
        else:
            keys.append(key)
    statuses: list[str] = []
    online: set[bool] = set()
    valid = {s.value for s in DeviceStatus}
    for status in query.status:
        if status in CONNECTION_STATES:
            online.add(CONNECTION_STATES[status])
        elif status in valid:
            statuses.append(status)
        else:
            raise ApiError(
                ErrorCode.BAD_REQUEST,
                f"unknown status {status!r}; use one of {sorted(valid | set(CONNECTION_STATES))}",
            )
    if online and not statuses:
        statuses = [DeviceStatus.ACCEPTED.value]
    return DeviceFilter(
        labels=labels,
        label_keys=keys,
        profile=query.profile,
        statuses=statuses,
        group=query.group,
        online=online.pop() if len(online) == 1 else None,
        search=query.q,
    )


async def list_devices(request: web.Request) -> web.Response:
    svc = services(request)
    query = read_query(request, DeviceQuery)
    async with svc.db.read() as tx:
        views, total = await q.list_devices(
            tx, device_filter(query), limit=query.limit, offset=query.offset
        )
    return json_response(
        DeviceList(
            items=[device_out(v) for v in views],
            total=total,
            limit=query.limit,
            offset=query.offset,
        )
    )


async def _get(request: web.Request) -> DeviceView:
    device_id = request.match_info["device_id"]
    async with services(request).db.read() as tx:
        view = await q.get_device(tx, device_id)
    if view is None:
        raise ApiError(ErrorCode.NOT_FOUND, f"no device {device_id!r}")
    return view


async def get_device(request: web.Request) -> web.Response:
    return json_response(DeviceDetail.model_validate(await _get(request)))


async def patch_labels(request: web.Request) -> web.Response:
    svc, who = services(request), principal_of(request)
    device_id = request.match_info["device_id"]
    body = await read_body(request, LabelsPatch)
    both = set(body.set) & set(body.remove)
    if both:
        raise ApiError(ErrorCode.BAD_REQUEST, f"label(s) {sorted(both)} both set and removed")
    now = svc.clock()
    async with svc.db.transaction() as tx:
        view = await q.get_device(tx, device_id, lock=True)
        if view is None:
            raise ApiError(ErrorCode.NOT_FOUND, f"no device {device_id!r}")
        labels = {k: v for k, v in view.labels.items() if k not in body.remove}
        labels.update(body.set)
        if len(labels) > MAX_LABELS:
            raise ApiError(ErrorCode.BAD_REQUEST, f"a device has at most {MAX_LABELS} labels")
        await q.replace_labels(tx, device_id, labels)
        view = await q.update_device(tx, device_id, now=now)
        await audit.record(
            tx,
            at=now,
            actor=who.actor,
            action=AuditAction.DEVICE_LABELS_CHANGED,
            target_type="device",
            target_id=device_id,
            detail={"set": body.set, "remove": body.remove},
        )
    return json_response(DeviceDetail.model_validate(view))


async def revoke_device(request: web.Request) -> web.Response:
    """Revoke: the broker disables the account (and kicks a live session) inside the same
    transaction, so a failure there leaves the device as it was and the operator can retry."""
    svc, who = services(request), principal_of(request)
    device_id = request.match_info["device_id"]
    body = await read_body(request, ReasonBody)
    now = svc.clock()
    async with svc.db.transaction() as tx:
        view = await q.get_device(tx, device_id, lock=True)
        if view is None:
            raise ApiError(ErrorCode.NOT_FOUND, f"no device {device_id!r}")
        if view.status == DeviceStatus.REVOKED.value:
            return json_response(DeviceDetail.model_validate(view))
        if view.accepted_at is not None:
            await svc.provisioner.disable_device(device_id)
        view = await q.update_device(
            tx,
            device_id,
            now=now,
            status=DeviceStatus.REVOKED.value,
            revoked_at=now,
            online=False,
        )
        await audit.record(
            tx,
            at=now,
            actor=who.actor,
            action=AuditAction.DEVICE_REVOKED,
            target_type="device",
            target_id=device_id,
            detail={"reason": body.reason},
        )
    return json_response(DeviceDetail.model_validate(view))


ENDPOINTS = [
    Endpoint(
        "GET",
        "/api/v1/devices",
        list_devices,
        "List devices, filtered by label, profile, status, group",
        Role.VIEWER,
        "devices",
        query=DeviceQuery,
        response=DeviceList,
    ),
    Endpoint(
        "GET",
        "/api/v1/devices/{device_id}",
        get_device,
        "One device with its facts",
        Role.VIEWER,
        "devices",
        response=DeviceDetail,
    ),
    Endpoint(
        "PATCH",
        "/api/v1/devices/{device_id}/labels",
        patch_labels,
        "Set and remove labels of a device",
        Role.OPERATOR,
        "devices",
        body=LabelsPatch,
        response=DeviceDetail,
    ),
    Endpoint(
        "POST",
        "/api/v1/devices/{device_id}/revoke",
        revoke_device,
        "Revoke a device: disabled at the broker and refused on every path",
        Role.OPERATOR,
        "devices",
        body=ReasonBody,
        response=DeviceDetail,
        answers={503: "database or broker unavailable; nothing changed, retry later"},
    ),
]
