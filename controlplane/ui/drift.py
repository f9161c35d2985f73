"""Console pages of drift and retraining triggers (docs/drift.md).

    GET  /ui/drift                              a model version's fleet drift over time (its
                                                stored buckets), each device's newest report,
                                                the rules in force, the newest triggers
    GET  /ui/drift/devices/{device_id}?model=   one device's drift over time (its reports)
    GET  /ui/drift/triggers                     retraining triggers, newest first
    GET  /ui/drift/triggers/live                that table as a live region (server-sent events)
    GET  /ui/drift/triggers/{trigger_id}        a trigger, its webhook deliveries, hard examples
    POST /ui/drift/triggers/{trigger_id}/acknowledge   operator: what the API's acknowledge does

Everything is read and changed through :class:`~controlplane.drift.admin.DriftAdmin`, the
object the REST API uses; rules are shown read-only with the CLI command that changes them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from typing import Any

from aiohttp import web
from markupsafe import Markup

from mcp_edge.controlplane.api.drift import AcknowledgeBody, admin_error, admin_of
from mcp_edge.controlplane.auth import Role
from mcp_edge.controlplane.cli.rollout_spec import fmt_seconds
from mcp_edge.controlplane.db import devices as device_q
from mcp_edge.controlplane.db import drift as drift_q
from mcp_edge.controlplane.db import registry as registry_q
from mcp_edge.controlplane.db.drift import SCORE_ORDERS, ReportScore
from mcp_edge.controlplane.db.webhooks import DeliveryView
from mcp_edge.controlplane.drift.admin import STATUSES, DriftAdmin, DriftAdminError, RuleInForce
from mcp_edge.controlplane.drift.rules import DEFAULT_MODEL, DriftRule
from mcp_edge.controlplane.ui.charts import Series, Threshold, line_chart
from mcp_edge.controlplane.ui.core import Ctx, Page, UiError
from mcp_edge.controlplane.ui.sse import stream_fragments
from mcp_edge.shared.errors import TopicError
from mcp_edge.shared.protocol.topics import validate_id
from mcp_edge.shared.version import MAX_VERSION_LENGTH, SEMVER_PATTERN

SPANS = {"1h": 3600, "6h": 6 * 3600, "24h": 86400, "48h": 2 * 86400, "7d": 7 * 86400}
DEFAULT_SPAN = "24h"
DEVICES_PAGE = 50
TRIGGERS_PAGE = 25
BUCKET_ROWS = 50
REPORT_ROWS = 100
MAX_PAGE = 10_000
LIVE_INTERVAL_S = 2.0
_SEMVER = re.compile(SEMVER_PATTERN)
_HTTP_STATUS = re.compile(r"^HTTP (\d{3})\b")
_METRIC_NAMES = {"input_psi": "input PSI", "class_psi": "class PSI",
                 "confidence_psi": "confidence PSI", "score": "score",
                 "max_feature_psi": "largest feature PSI"}  # fmt: skip


# ---------------------------------------------------------------------------- inputs
def _model_param(ctx: Ctx) -> str:
    model = ctx.query("model").strip()
    if model:
        try:
            validate_id(model, "model")
        except TopicError as e:
            raise UiError(str(e)) from e
    return model


def _version_param(ctx: Ctx) -> str:
    version = ctx.query("version").strip()
    if version and (len(version) > MAX_VERSION_LENGTH or not _SEMVER.match(version)):
        raise UiError(f"version {version[:80]!r} is not a semantic version")
    return version


def _choice(ctx: Ctx, name: str, choices: Sequence[str], default: str) -> str:
    value = ctx.query(name, default) or default
    if value not in choices:
        raise UiError(f"{name} must be one of {', '.join(choices)}")
    return value


def _number(ctx: Ctx, name: str, default: int = 0) -> int:
    raw = ctx.query(name)
    if not raw:
        return default
    if not raw.isdigit() or len(raw) > 18:
        raise UiError(f"{name} must be a whole number")
    return int(raw)


def _path_id(ctx: Ctx) -> int:
    raw = ctx.request.match_info["trigger_id"]
    if not raw.isdigit() or len(raw) > 18 or int(raw) < 1:
        raise UiError(f"no retraining trigger {raw[:40]!r}", status=404)
    return int(raw)


def _since(ctx: Ctx) -> tuple[str, datetime]:
    span = _choice(ctx, "span", list(SPANS), DEFAULT_SPAN)
    return span, ctx.now - timedelta(seconds=SPANS[span])


# ---------------------------------------------------------------------------- presentation
def _chart(
    title: str, rows: Sequence[Any], at: Callable[[Any], datetime], rule: DriftRule
) -> Markup:
    """The PSI figures of ``rows`` (buckets or reports) over time, with the rule's threshold."""
    metrics = ["input_psi", "class_psi", "confidence_psi", "score"]
    series = [
        Series(_METRIC_NAMES[m], [(at(r), v) for r in rows if (v := getattr(r, m)) is not None])
        for m in metrics
    ]
    if rule.metric not in metrics:  # max_feature_psi: in a bucket's figures only
        points = [(at(r), v) for r in rows if (v := _figures(r).get(rule.metric)) is not None]
        series.append(Series(_METRIC_NAMES.get(rule.metric, rule.metric), points))
    label = f"threshold ({_METRIC_NAMES.get(rule.metric, rule.metric)})"
    return line_chart(title, series, unit="PSI", thresholds=[Threshold(label, rule.threshold)])


def _figures(row: Any) -> dict[str, Any]:
    figures = getattr(row, "figures", None)
    return figures if isinstance(figures, dict) else {}


def rule_command(model: str, rule: DriftRule) -> str:
    """The ``mcp-controlplane drift rules set`` command that states ``rule`` in full."""
    name = "'*'" if model == DEFAULT_MODEL else model
    parts = [
        f"mcp-controlplane drift rules set {name}", f"--metric {rule.metric}",
        f"--threshold {rule.threshold:g}", f"--min-devices {rule.min_devices}",
        f"--min-samples {rule.min_samples}", f"--sustained {rule.sustained}",
        f"--cooldown {fmt_seconds(rule.cooldown_s)}", f"--window {fmt_seconds(rule.window_s)}",
        "--enable" if rule.enabled else "--disable",
        "--hard-examples" if rule.collect_hard_examples else "--no-hard-examples",
    ]  # fmt: skip
    return " ".join(parts)


def _rule_rows(selected: str, in_force: RuleInForce | None, default: RuleInForce,
               stored: Sequence[RuleInForce]) -> list[tuple[str, RuleInForce]]:  # fmt: skip
    """``(applies to, rule)``: the selected model's rule in force, the default, then every
    other model's own rule."""
    rows: list[tuple[str, RuleInForce]] = []
    if in_force is not None:
        rows.append((selected, in_force))
    rows.append(("every model without its own rule (*)", default))
    rows += [(r.rule.model, r) for r in stored if r.rule.model not in (selected, DEFAULT_MODEL)]
    return rows


def delivery_state(d: DeliveryView) -> tuple[str, str]:
    """``(text, badge class)`` of a webhook delivery."""
    if d.delivered_at is not None:
        return "delivered", "ok"
    if d.failed_at is not None:
        return "given up", "bad"
    if d.attempts:
        return "retrying", "warn"
    return "queued", ""


def delivery_http(d: DeliveryView) -> str:
    """The HTTP status of the newest attempt, as far as the outbox keeps it: any 2xx for a
    delivered row (the exact code is not stored), the code in a failure's ``last_error``,
    else a dash (a connection that failed, no attempt yet)."""
    if d.delivered_at is not None:
        return "2xx"
    found = _HTTP_STATUS.match(d.last_error)
    return found.group(1) if found else "–"


# ---------------------------------------------------------------------------- fleet drift
async def overview(ctx: Ctx) -> web.StreamResponse:
    admin = admin_of(ctx.request.app)
    span, since = _since(ctx)
    wanted_model, wanted_version = _model_param(ctx), _version_param(ctx)
    order = _choice(ctx, "sort", SCORE_ORDERS, "-score")
    page = max(1, min(_number(ctx, "page", 1), MAX_PAGE))
    async with ctx.svc.db.read() as tx:
        models = [m.name for m in await registry_q.list_models(tx)]
        model = wanted_model or (models[0] if models else "")
        versions = [v.version for v in await registry_q.list_versions(tx, model)] if model else []
        baseline: dict[str, Any] | None = None
        version = wanted_version if wanted_version in versions else ""
        if model and not version and versions:
            newest = await drift_q.list_aggregates(tx, model=model, limit=1)
            version = newest[0].version if newest else versions[0]
        if version:
            _, baseline = await drift_q.baseline_of(tx, model, version)
    values: dict[str, Any] = {
        "models": models, "model": model, "versions": versions, "version": version,
        "wanted_model": wanted_model, "span": span, "spans": list(SPANS), "sort": order,
        "params": dict(ctx.request.query), "has_baseline": baseline is not None,
    }  # fmt: skip
    default = await admin.rule(DEFAULT_MODEL)
    in_force = await admin.rule(model) if model in models else None
    values["rules"] = _rule_rows(model, in_force, default, await admin.rules())
    commands = [("Every model without its own rule", rule_command(DEFAULT_MODEL, default.rule))]
    if in_force is not None:
        commands.insert(0, (f"{model}", rule_command(model, in_force.rule)))
    values["rule_commands"] = commands
    values["reset_model"] = model if in_force is not None and in_force.source == "model" else ""
    if version:
        rule = (in_force or default).rule
        buckets = await admin.buckets(model, version=version, since=since)
        total, devices = await admin.latest_by_device(
            model, version, since=since, order=order, limit=DEVICES_PAGE,
            offset=(page - 1) * DEVICES_PAGE,
        )  # fmt: skip
        values.update(
            chart=_chart(f"Fleet drift of {model} {version}", buckets, lambda b: b.bucket_start,
                         rule),
            buckets=list(reversed(buckets))[:BUCKET_ROWS], bucket_count=len(buckets),
            devices=devices, device_total=total, page=page,
            pages=max(1, -(-total // DEVICES_PAGE)), rule=rule,
        )  # fmt: skip
    triggers = await admin.triggers(limit=TRIGGERS_PAGE + 1)
    values.update(_trigger_page(triggers, status="", model="", before=0))
    return ctx.render("drift/index.html", **values)


async def device_drift(ctx: Ctx) -> web.StreamResponse:
    admin = admin_of(ctx.request.app)
    device_id = ctx.request.match_info["device_id"]
    try:
        validate_id(device_id, "device")
    except TopicError as e:
        raise UiError(str(e), status=404) from e
    span, since = _since(ctx)
    model, wanted_version = _model_param(ctx), _version_param(ctx)
    async with ctx.svc.db.read() as tx:
        if await device_q.get_device(tx, device_id) is None:
            raise UiError(f"no device {device_id}", status=404)
    if not model:
        newest = await admin.report_scores(device_id, limit=1)
        model = newest[0].model if newest else ""
    reports: list[ReportScore] = []
    if model:
        reports = await admin.report_scores(device_id, model=model, since=since)
    versions = sorted({r.version for r in reports})
    version = wanted_version if wanted_version in versions else ""
    if not version and reports:
        version = reports[-1].version
    shown = [r for r in reports if r.version == version]
    values: dict[str, Any] = {
        "device_id": device_id, "model": model, "version": version, "versions": versions,
        "span": span, "spans": list(SPANS), "reports": list(reversed(shown))[:REPORT_ROWS],
        "report_count": len(shown), "chart": None,
    }  # fmt: skip
    if shown:
        rule = (await admin.rule(model)).rule
        title = f"Drift of {model} {version} on {device_id}"
        values.update(chart=_chart(title, shown, lambda r: r.received_at, rule), rule=rule)
    return ctx.render("drift/device.html", **values)


# ---------------------------------------------------------------------------- triggers
def _trigger_page(found: Sequence[Any], *, status: str, model: str, before: int) -> dict[str, Any]:
    """What ``drift/_triggers.html`` needs: one page of triggers (``found`` holds one more
    than a page when there are older ones) and the filters that made it."""
    shown = list(found[:TRIGGERS_PAGE])
    older = shown[-1].id if len(found) > TRIGGERS_PAGE and shown else None
    live = {k: v for k, v in (("status", status), ("model", model)) if v}
    if before:
        live["before"] = str(before)
    return {"triggers": shown, "older": older, "filter_status": status, "trigger_model": model,
            "before": before, "live_params": live}  # fmt: skip


async def _triggers_for(ctx: Ctx, admin: DriftAdmin) -> dict[str, Any]:
    status = _choice(ctx, "status", ["", *STATUSES], "")
    model = _model_param(ctx)
    before = _number(ctx, "before")
    found = await admin.triggers(
        model=model or None, status=status or None, before_id=before or None,
        limit=TRIGGERS_PAGE + 1,
    )  # fmt: skip
    return _trigger_page(found, status=status, model=model, before=before)


async def triggers(ctx: Ctx) -> web.StreamResponse:
    admin = admin_of(ctx.request.app)
    values = await _triggers_for(ctx, admin)
    async with ctx.svc.db.read() as tx:
        models = [m.name for m in await registry_q.list_models(tx)]
    return ctx.render("drift/triggers.html", models=models, statuses=STATUSES, **values)


async def triggers_live(ctx: Ctx) -> web.StreamResponse:
    admin = admin_of(ctx.request.app)
    await _triggers_for(ctx, admin)  # refuses bad filters before the stream starts

    async def produce() -> str:
        return ctx.fragment("drift/_triggers.html", **await _triggers_for(ctx, admin))

    return await stream_fragments(ctx, produce, interval=LIVE_INTERVAL_S)


async def trigger(ctx: Ctx) -> web.StreamResponse:
    admin = admin_of(ctx.request.app)
    try:
        record = await admin.record(_path_id(ctx))
    except DriftAdminError as e:
        raise admin_error(e) from e
    t = record.trigger
    return ctx.render(
        "drift/trigger.html", t=t, figures=t.figures, rule=t.rule,
        deliveries=[(d, *delivery_state(d), delivery_http(d)) for d in record.deliveries],
        hard_examples=record.hard_examples, note_max=2048,
    )  # fmt: skip


async def acknowledge(ctx: Ctx) -> web.StreamResponse:
    trigger_id = _path_id(ctx)
    body = AcknowledgeBody(note=ctx.field("note"))  # the API's own rules (a ValueError: 400)
    try:
        await admin_of(ctx.request.app).acknowledge(
            trigger_id, actor=ctx.principal.actor, note=body.note
        )
    except DriftAdminError as e:
        raise admin_error(e) from e
    return ctx.redirect(f"/ui/drift/triggers/{trigger_id}", f"Trigger {trigger_id} acknowledged.")


PAGES = [
    Page("GET", "/ui/drift", overview, Role.VIEWER, nav="drift"),
    Page("GET", "/ui/drift/devices/{device_id}", device_drift, Role.VIEWER, nav="drift"),
    Page("GET", "/ui/drift/triggers", triggers, Role.VIEWER, nav="drift"),
    Page("GET", "/ui/drift/triggers/live", triggers_live, Role.VIEWER, nav="drift"),
    Page("GET", "/ui/drift/triggers/{trigger_id}", trigger, Role.VIEWER, nav="drift"),
    Page("POST", "/ui/drift/triggers/{trigger_id}/acknowledge", acknowledge, Role.OPERATOR,
         nav="drift"),
]  # fmt: skip
