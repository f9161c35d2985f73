"""Devices: list with filters, detail, labels, revoke, inference figures.

GET   /api/v1/devices                      viewer; ?label=k=v&label=k&profile=&status=&group=&q=
                                           &model=&in_sync=
GET   /api/v1/devices/{device_id}          viewer: the device, its facts and its models
GET   /api/v1/devices/{device_id}/inference viewer: requests, errors, p95 per model version
PATCH /api/v1/devices/{device_id}/labels   operator: {"set": {...}, "remove": [...]}
POST  /api/v1/devices/{device_id}/revoke   operator: disable at the broker, refuse from now on

:func:`change_labels` and :func:`revoke` are the changes themselves (audited, and for a revoke
the broker account disabled in the same transaction); the console calls them too.
"""

from __future__ import annotations

from datetime import timedelta

from aiohttp import web

from mcp_edge.controlplane import audit
from mcp_edge.controlplane.api.common import (
    ApiError,
    Endpoint,
    Services,
    json_response,
    read_body,
    read_query,
    services,
)
from mcp_edge.controlplane.api.schemas import (
    CONNECTION_STATES,
    DeviceDetail,
    DeviceDocument,
    DeviceInference,
    DeviceList,
    DeviceListItem,
    DeviceOut,
    DeviceQuery,
    InferenceQuery,
    LabelsPatch,
    ModelSyncOut,
    ReasonBody,
    VersionFiguresOut,
)
from mcp_edge.controlplane.audit import AuditAction
from mcp_edge.controlplane.auth import Role, principal_of
from mcp_edge.controlplane.db import devices as q
from mcp_edge.controlplane.db import telemetry as telemetry_q
from mcp_edge.controlplane.db.devices import DeviceFilter, DeviceView, ModelSync
from mcp_edge.controlplane.enrollment import DeviceStatus
from mcp_edge.shared.protocol.base import MAX_LABELS
from mcp_edge.shared.protocol.command import ErrorCode


def device_out(view: DeviceView) -> DeviceOut:
    return DeviceOut.model_validate(view)


def sync_fields(models: list[ModelSync]) -> dict[str, object]:
    """``models`` and ``in_sync`` of a device's answer."""
    return {
        "models": [ModelSyncOut.model_validate(m) for m in models],
        "in_sync": all(m.in_sync for m in models),
    }


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
        model=query.model,
        in_sync=query.in_sync,
    )


async def list_devices(request: web.Request) -> web.Response:
    svc = services(request)
    query = read_query(request, DeviceQuery)
    async with svc.db.read() as tx:
        views, total = await q.list_devices(
            tx, device_filter(query), limit=query.limit, offset=query.offset
        )
        models = await q.model_sync(tx, [v.id for v in views])
    items = [
        DeviceListItem.model_validate({**device_out(v).model_dump(), **sync_fields(models[v.id])})
        for v in views
    ]
    return json_response(
        DeviceList(items=items, total=total, limit=query.limit, offset=query.offset)
    )


async def _get(request: web.Request) -> DeviceView:
    device_id = request.match_info["device_id"]
    async with services(request).db.read() as tx:
        view = await q.get_device(tx, device_id)
    if view is None:
        raise ApiError(ErrorCode.NOT_FOUND, f"no device {device_id!r}")
    return view


async def get_device(request: web.Request) -> web.Response:
    view = await _get(request)
    async with services(request).db.read() as tx:
        models = (await q.model_sync(tx, [view.id]))[view.id]
    detail = DeviceDetail.model_validate(view).model_dump()
    return json_response(DeviceDocument.model_validate({**detail, **sync_fields(models)}))


async def device_inference(request: web.Request) -> web.Response:
    """Per model version and role: requests, errors and p95 over the window (the figures the
    rollout gates read, :func:`controlplane.db.telemetry.version_stats`)."""
    query = read_query(request, InferenceQuery)
    view = await _get(request)
    since = services(request).clock() - timedelta(seconds=query.window_s)
    items: list[VersionFiguresOut] = []
    async with services(request).db.read() as tx:
        for model in await q.inference_models(tx, view.id, since):
            stats = await telemetry_q.version_stats(tx, [view.id], model, since)
            for (_, version, role), t in sorted(stats.items()):
                items.append(
                    VersionFiguresOut(
                        model=model, version=version, role=role, requests=t.requests,
                        errors=t.errors, error_rate=t.errors / t.requests if t.requests else None,
                        p95_ms=t.p95_ms,
                    )
                )  # fmt: skip
    return json_response(DeviceInference(device_id=view.id, since=since, items=items))


async def change_labels(
    svc: Services, actor: str, device_id: str, patch: LabelsPatch
) -> DeviceView:
    """Set and remove labels of a device, audited; raises :class:`ApiError` (unknown device,
    a key both set and removed, more than :data:`MAX_LABELS` labels)."""
    both = set(patch.set) & set(patch.remove)
    if both:
        raise ApiError(ErrorCode.BAD_REQUEST, f"label(s) {sorted(both)} both set and removed")
    now = svc.clock()
    async with svc.db.transaction() as tx:
        view = await q.get_device(tx, device_id, lock=True)
        if view is None:
            raise ApiError(ErrorCode.NOT_FOUND, f"no device {device_id!r}")
        labels = {k: v for k, v in view.labels.items() if k not in patch.remove}
        labels.update(patch.set)
        if len(labels) > MAX_LABELS:
            raise ApiError(ErrorCode.BAD_REQUEST, f"a device has at most {MAX_LABELS} labels")
        await q.replace_labels(tx, device_id, labels)
        view = await q.update_device(tx, device_id, now=now)
        await audit.record(
            tx,
            at=now,
            actor=actor,
            action=AuditAction.DEVICE_LABELS_CHANGED,
            target_type="device",
            target_id=device_id,
            detail={"set": patch.set, "remove": patch.remove},
        )
    return view


async def revoke(svc: Services, actor: str, device_id: str, reason: str) -> tuple[DeviceView, bool]:
    """Revoke a device: the broker disables the account (and kicks a live session) inside the
    same transaction, so a failure there leaves the device as it was and the operator can
    retry. Returns the device and whether this call revoked it (False: it already was)."""
    now = svc.clock()
    async with svc.db.transaction() as tx:
        view = await q.get_device(tx, device_id, lock=True)
        if view is None:
            raise ApiError(ErrorCode.NOT_FOUND, f"no device {device_id!r}")
        if view.status == DeviceStatus.REVOKED.value:
            return view, False
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
            actor=actor,
            action=AuditAction.DEVICE_REVOKED,
            target_type="device",
            target_id=device_id,
            detail={"reason": reason},
        )
    return view, True


async def patch_labels(request: web.Request) -> web.Response:
    body = await read_body(request, LabelsPatch)
    view = await change_labels(
        services(request), principal_of(request).actor, request.match_info["device_id"], body
    )
    return json_response(DeviceDetail.model_validate(view))


async def revoke_device(request: web.Request) -> web.Response:
    body = await read_body(request, ReasonBody)
    view, _ = await revoke(
        services(request), principal_of(request).actor, request.match_info["device_id"],
        body.reason,
    )  # fmt: skip
    return json_response(DeviceDetail.model_validate(view))


ENDPOINTS = [
    Endpoint(
        "GET",
        "/api/v1/devices",
        list_devices,
        "List devices with their models, filtered by label, profile, status, group, model, sync",
        Role.VIEWER,
        "devices",
        query=DeviceQuery,
        response=DeviceList,
    ),
    Endpoint(
        "GET",
        "/api/v1/devices/{device_id}",
        get_device,
        "One device with its facts and its models",
        Role.VIEWER,
        "devices",
        response=DeviceDocument,
    ),
    Endpoint(
        "GET",
        "/api/v1/devices/{device_id}/inference",
        device_inference,
        "Requests, errors and p95 latency of each model version on a device, over a window",
        Role.VIEWER,
        "devices",
        query=InferenceQuery,
        response=DeviceInference,
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
