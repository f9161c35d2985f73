"""Console pages: the device list (``/ui/devices``) and one device (``/ui/devices/{id}``).

The list filters, sorts and pages in the database (:func:`controlplane.db.devices.list_devices`,
50 a page), so a page of a fleet of 10,000 reads 50 devices; its filters are a GET form, every
one in the query string. A device's page shows its facts, health and inference charts from the
stored telemetry, its models (desired against reported), its deployment flight recorder and its
latest drift scores; operators edit its labels and revoke it through the same functions the
REST API calls (:func:`controlplane.api.devices.change_labels`, :func:`~.revoke`).
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from aiohttp import web
from markupsafe import Markup

from mcp_edge.controlplane.api.common import ApiError, validated
from mcp_edge.controlplane.api.devices import change_labels, device_filter, revoke
from mcp_edge.controlplane.api.schemas import STATUS_FILTERS, DeviceQuery, LabelsPatch
from mcp_edge.controlplane.auth import Role
from mcp_edge.controlplane.broker.base import BrokerAdminError
from mcp_edge.controlplane.db import devices as q
from mcp_edge.controlplane.db import drift as drift_q
from mcp_edge.controlplane.db import telemetry as telemetry_q
from mcp_edge.controlplane.db.devices import SORTS, DeviceView, ModelSync
from mcp_edge.controlplane.ui.charts import Series, line_chart
from mcp_edge.controlplane.ui.core import Ctx, Page, UiError

PAGE_SIZE = 50
MAX_PAGE = 10**9
SYNC_FILTERS = {"in": True, "out": False}
SORT_NAMES = {"id": "Device", "status": "Status", "profile": "Profile", "last_seen": "Last seen"}
HEALTH_POINTS = 360
INFERENCE_SPAN = timedelta(hours=24)
INFERENCE_ROWS = 3000
EVENTS_SHOWN = 100
DRIFT_SPAN = timedelta(days=7)
MAX_SENSORS = 6
STATUS_BADGES = {"accepted": "ok", "pending": "warn", "preauthorized": "warn",
                 "rejected": "bad", "revoked": "bad"}  # fmt: skip
OUTCOME_BADGES = {"ok": "ok", "progress": "", "error": "bad"}


# ---------------------------------------------------------------------------- the list
@dataclass(frozen=True)
class Listing:
    """What the list's query string asks for, checked."""

    query: DeviceQuery
    sync: str
    sort: str
    descending: bool
    page: int


def _blank(value: str) -> str | None:
    value = value.strip()
    return value or None


def parse_listing(params: Mapping[str, str], labels: Iterable[str]) -> Listing:
    """The list's filters from the query string (empty fields ignored); raises
    :class:`ApiError` or :class:`UiError` (400) naming what is wrong."""
    status = _blank(params.get("status", ""))
    sync = params.get("sync", "").strip()
    if sync and sync not in SYNC_FILTERS:
        raise UiError(f"sync filter {sync[:20]!r} must be in or out")
    raw: dict[str, Any] = {
        "label": [v.strip() for v in labels if v.strip()],
        "status": [status] if status else [],
        "profile": _blank(params.get("profile", "")),
        "group": _blank(params.get("group", "")),
        "q": _blank(params.get("q", "")),
        "model": _blank(params.get("model", "")),
        "in_sync": SYNC_FILTERS.get(sync),
    }
    query = validated({k: v for k, v in raw.items() if v is not None}, DeviceQuery)
    sort = params.get("sort", "").strip() or "id"
    descending = sort.startswith("-")
    if sort.removeprefix("-") not in SORTS:
        raise UiError(f"cannot sort by {sort[:20]!r}; use one of {', '.join(SORTS)}")
    page_text = params.get("page", "").strip() or "1"
    if not page_text.isdigit() or not 1 <= int(page_text) <= MAX_PAGE:
        raise UiError(f"page {page_text[:20]!r} must be a whole number from 1")
    return Listing(query, sync, sort.removeprefix("-"), descending, int(page_text))


def link_maker(items: Iterable[tuple[str, str]]) -> Any:
    """``link(page=3)``: ``?…`` of the current query string (``items``, repeated keys kept)
    with some keys replaced (None or "" drops them), for the pager and the sort links."""

    def link(**changes: Any) -> str:
        kept = [(k, v) for k, v in items if k not in changes and v != ""]
        kept += [(k, str(v)) for k, v in changes.items() if v is not None and v != ""]
        return "?" + urllib.parse.urlencode(kept) if kept else "?"

    return link


def _in_sync(models: list[ModelSync]) -> bool:
    return all(m.in_sync for m in models)


async def device_list(ctx: Ctx) -> web.StreamResponse:
    params = ctx.request.query
    error = ""
    devices: list[DeviceView] = []
    models: dict[str, list[ModelSync]] = {}
    total = 0
    listing: Listing | None = None
    async with ctx.svc.db.read() as tx:
        choices = await q.filter_choices(tx)
        try:
            listing = parse_listing(params, params.getall("label", []))
            found = device_filter(listing.query)
        except (ApiError, UiError) as e:
            error = str(e)
        else:
            page = listing.page
            devices, total = await q.list_devices(
                tx, found, limit=PAGE_SIZE, offset=(page - 1) * PAGE_SIZE,
                sort=listing.sort, descending=listing.descending,
            )  # fmt: skip
            last = max(1, -(-total // PAGE_SIZE))
            if not devices and page > last:  # past the end: show the last page
                page = last
                listing = Listing(listing.query, listing.sync, listing.sort,
                                  listing.descending, page)  # fmt: skip
                devices, total = await q.list_devices(
                    tx, found, limit=PAGE_SIZE, offset=(page - 1) * PAGE_SIZE,
                    sort=listing.sort, descending=listing.descending,
                )  # fmt: skip
            models = await q.model_sync(tx, [d.id for d in devices])
    page = listing.page if listing else 1
    first = (page - 1) * PAGE_SIZE + 1 if devices else 0
    return ctx.render(
        "devices/list.html",
        status=400 if error else 200,
        error=error,
        devices=devices,
        models=models,
        in_sync={d.id: _in_sync(models.get(d.id, [])) for d in devices},
        total=total,
        first=first,
        last_shown=first + len(devices) - 1 if devices else 0,
        page=page,
        pages=max(1, -(-total // PAGE_SIZE)),
        sort=listing.sort if listing else "id",
        descending=listing.descending if listing else False,
        sort_names=SORT_NAMES,
        choices=choices,
        statuses=STATUS_FILTERS,
        status_badges=STATUS_BADGES,
        selected={
            "status": params.get("status", ""),
            "profile": params.get("profile", ""),
            "group": params.get("group", ""),
            "q": params.get("q", ""),
            "model": params.get("model", ""),
            "sync": params.get("sync", ""),
            "sort": params.get("sort", "") or "id",
        },
        label_filters=[v for v in params.getall("label", []) if v.strip()],
        link=link_maker(list(params.items())),
        filtered=any(params.get(k) for k in ("status", "profile", "group", "q", "model", "sync"))
        or bool(params.getall("label", [])),
    )


# ---------------------------------------------------------------------------- one device
def _points(rows: list[dict[str, Any]], value: Any) -> list[tuple[datetime, float]]:
    out = []
    for row in rows:
        v = value(row)
        if isinstance(v, int | float):
            out.append((row["ts"], float(v)))
    return out


def health_charts(rows: list[dict[str, Any]]) -> list[Markup]:
    """CPU, memory, temperatures and (when reported) GPU and power, over the samples given."""
    charts = [
        line_chart("CPU", [Series("CPU", _points(rows, lambda r: r["cpu_percent"])),
                           Series("load 1 min", _points(rows, lambda r: r["load_1m"]))],
                   unit="%, load"),
        line_chart("Memory", [Series("used", _points(rows, lambda r: r["mem_used_mb"])),
                              Series("total", _points(rows, lambda r: r["mem_total_mb"])),
                              Series("agent RSS", _points(rows, lambda r: r["process_rss_mb"]))],
                   unit="MB"),
    ]  # fmt: skip
    sensors = sorted({k for r in rows for k in (r.get("temperatures_c") or {})})[:MAX_SENSORS]
    charts.append(
        line_chart(
            "Temperature",
            [Series(s, _points(rows, lambda r, s=s: (r.get("temperatures_c") or {}).get(s)))
             for s in sensors],
            unit="°C",
        )
    )  # fmt: skip
    if any(r.get("gpu") for r in rows):

        def gpu(key: str) -> Any:
            return lambda r: (r.get("gpu") or {}).get(key)

        busy = [
            Series("utilisation", _points(rows, gpu("util_percent"))),
            Series("memory controller", _points(rows, gpu("emc_percent"))),
        ]
        charts.append(line_chart("GPU", busy, unit="%"))
        power = [(t, v / 1000) for t, v in _points(rows, gpu("power_mw"))]
        if power:
            charts.append(line_chart("Power", [Series("GPU power", power)], unit="W"))
    return charts


def inference_charts(rows: list[dict[str, Any]]) -> list[Markup]:
    """p95 latency and error rate per model version (and role) over the windows given."""
    p95: dict[str, list[tuple[datetime, float]]] = {}
    errors: dict[str, list[tuple[datetime, float]]] = {}
    for r in rows:
        role = r["role"] or "stable"
        name = f"{r['model']} {r['version']}" + ("" if role == "stable" else f" ({role})")
        if r["p95_ms"] is not None:
            p95.setdefault(name, []).append((r["ts"], float(r["p95_ms"])))
        if r["count"]:
            errors.setdefault(name, []).append((r["ts"], 100.0 * r["errors"] / r["count"]))
    return [
        line_chart("Inference p95 latency", [Series(k, v) for k, v in sorted(p95.items())],
                   unit="ms"),
        line_chart("Inference error rate", [Series(k, v) for k, v in sorted(errors.items())],
                   unit="%"),
    ]  # fmt: skip


def latest_drift(reports: list[drift_q.ReportView]) -> list[drift_q.ReportView]:
    """The newest report of each model version and role, by model, version and role."""
    newest: dict[tuple[str, str, str], drift_q.ReportView] = {}
    for r in reports:  # oldest first: later ones replace earlier ones
        newest[(r.model, r.version, r.role)] = r
    return [newest[k] for k in sorted(newest)]


def labels_text(labels: Mapping[str, str]) -> str:
    return "\n".join(f"{k}={v}" for k, v in labels.items())


def parse_labels_text(text: str, current: Mapping[str, str]) -> LabelsPatch:
    """A ``key=value`` per line as the device's new labels, as the change from ``current``
    (validated as the API's PATCH body); raises :class:`UiError`."""
    wanted: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        key, sep, value = line.partition("=")
        key = key.strip()
        if not sep or not key:
            raise UiError(f"line {number}: {line.strip()[:60]!r} is not key=value")
        if key in wanted:
            raise UiError(f"line {number}: label {key[:63]!r} is given twice")
        wanted[key] = value.strip()
    changed = {k: v for k, v in wanted.items() if current.get(k) != v}
    removed = sorted(k for k in current if k not in wanted)
    try:
        return validated({"set": changed, "remove": removed}, LabelsPatch, strict=True)
    except ApiError as e:
        raise UiError(str(e)) from e


async def _device_page(
    ctx: Ctx, *, label_error: str = "", label_text: str | None = None, status: int = 200
) -> web.Response:
    device_id = ctx.request.match_info["device_id"]
    now = ctx.now
    async with ctx.svc.db.read() as tx:
        view = await q.get_device(tx, device_id)
        if view is None:
            raise UiError(f"no device {device_id[:64]!r}", status=404)
        models = (await q.model_sync(tx, [device_id]))[device_id]
        health = await telemetry_q.recent_health(tx, device_id, HEALTH_POINTS)
        inference = await q.recent_inference(tx, device_id, now - INFERENCE_SPAN, INFERENCE_ROWS)
        events = await q.recent_events(tx, device_id, EVENTS_SHOWN)
        drift = await drift_q.list_reports(tx, device_id=device_id, since=now - DRIFT_SPAN)
    return ctx.render(
        "devices/detail.html",
        status=status,
        device=view,
        models=models,
        in_sync=_in_sync(models),
        health=health[-1] if health else None,
        health_charts=health_charts(health),
        inference_charts=inference_charts(inference),
        events=events,
        events_max=EVENTS_SHOWN,
        drift=latest_drift(drift),
        label_text=labels_text(view.labels) if label_text is None else label_text,
        label_error=label_error,
        status_badges=STATUS_BADGES,
        outcome_badges=OUTCOME_BADGES,
    )


async def device_page(ctx: Ctx) -> web.StreamResponse:
    return await _device_page(ctx)


async def edit_labels(ctx: Ctx) -> web.StreamResponse:
    device_id = ctx.request.match_info["device_id"]
    text = ctx.fields("labels")[0] if ctx.fields("labels") else ""
    async with ctx.svc.db.read() as tx:
        view = await q.get_device(tx, device_id)
    if view is None:
        raise UiError(f"no device {device_id[:64]!r}", status=404)
    try:
        patch = parse_labels_text(text, view.labels)
        if not patch.set and not patch.remove:
            return ctx.redirect(f"/ui/devices/{device_id}", f"{device_id}: labels unchanged")
        await change_labels(ctx.svc, ctx.principal.actor, device_id, patch)
    except (UiError, ApiError) as e:
        if isinstance(e, ApiError) and e.code.http_status == 404:
            raise
        return await _device_page(ctx, label_error=str(e), label_text=text, status=400)
    return ctx.redirect(f"/ui/devices/{device_id}", f"{device_id}: labels saved")


async def revoke_device(ctx: Ctx) -> web.StreamResponse:
    device_id = ctx.request.match_info["device_id"]
    reason = ctx.field("reason")
    if len(reason) > 256:
        raise UiError("the reason is longer than 256 characters")
    try:
        _, revoked = await revoke(ctx.svc, ctx.principal.actor, device_id, reason)
    except BrokerAdminError as e:
        raise UiError(
            f"the broker did not disable {device_id}, so nothing changed; retry later ({e})",
            status=503,
        ) from e
    if not revoked:
        return ctx.redirect(f"/ui/devices/{device_id}", f"{device_id} was already revoked")
    return ctx.redirect(
        f"/ui/devices/{device_id}",
        f"revoked {device_id}: its broker account is disabled and it is refused from now on",
    )


PAGES: list[Page] = [
    Page("GET", "/ui/devices", device_list, Role.VIEWER, nav="devices"),
    Page("GET", "/ui/devices/{device_id}", device_page, Role.VIEWER, nav="devices"),
    Page("POST", "/ui/devices/{device_id}/labels", edit_labels, Role.OPERATOR, nav="devices"),
    Page("POST", "/ui/devices/{device_id}/revoke", revoke_device, Role.OPERATOR, nav="devices"),
]
