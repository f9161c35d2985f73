"""Console pages: staged rollouts (docs/rollouts.md).

    GET  /ui/rollouts                     the rollouts not ended, then the history, newest first
    GET  /ui/rollouts/new                 operator: the form that starts a rollout
    POST /ui/rollouts/new                 operator: start it (what POST /api/v1/rollouts does)
    GET  /ui/rollouts/target-count        JSON {"text": "12 devices match"} for a target text
    GET  /ui/rollouts/{id}                a rollout: state, progress, stages, gates, devices,
                                          history, and the commands its status allows
    GET  /ui/rollouts/{id}/live           the same region as server-sent events
    POST /ui/rollouts/{id}/{command}      operator: pause, resume, abort, promote, approve,
                                          rollback (what the API's command endpoints do)

The form writes stages and gates in the CLI's compact ``--stage`` and ``gate=`` forms and reads
them with the CLI's parser (:mod:`controlplane.cli.rollout_spec`); the body it builds is checked
by :func:`~controlplane.rollouts.spec.parse_spec` and the API's request schema, then created by
:func:`~controlplane.api.rollouts.start_rollout`, the function ``POST /api/v1/rollouts`` calls.

A target is one line of terms separated by spaces or commas (quote a value holding either):
``group=G``, ``profile=P`` and ``device=D`` (both repeatable), ``k=v`` for a label, and
``label:k=v`` for a label named group, profile or device. Every term must hold.
"""

from __future__ import annotations

import math
import re
import shlex
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import click
from aiohttp import web

from mcp_edge.controlplane.api.common import ApiError, validated
from mcp_edge.controlplane.api.rollouts import (
    RolloutCreate,
    command_rollout,
    rollout_service,
    start_rollout,
)
from mcp_edge.controlplane.api.schemas import ReasonBody
from mcp_edge.controlplane.auth import Role
from mcp_edge.controlplane.cli.rollout_spec import (
    DEFAULT_BAKE,
    DEFAULT_GATES,
    fmt_seconds,
    gate_text,
    parse_gate,
    parse_rate,
    parse_seconds,
    stages_from_flags,
)
from mcp_edge.controlplane.db import Tx, registry
from mcp_edge.controlplane.db import devices as device_q
from mcp_edge.controlplane.db import rollouts as q
from mcp_edge.controlplane.db.devices import DeviceFilter, DeviceView
from mcp_edge.controlplane.deployments import ACCEPTED
from mcp_edge.controlplane.rollouts import engine
from mcp_edge.controlplane.rollouts.model import (
    DevicePhase,
    GateMetric,
    RolloutStatus,
    Target,
)
from mcp_edge.controlplane.rollouts.service import (
    COMMANDS,
    MAX_TARGET,
    RolloutDetail,
    RolloutNotFoundError,
)
from mcp_edge.controlplane.rollouts.spec import SpecError, parse_spec, plan_stage_sizes
from mcp_edge.controlplane.ui.core import Ctx, Page, UiError
from mcp_edge.controlplane.ui.sse import stream_fragments
from mcp_edge.shared.protocol.command import ErrorCode

NAV = "rollouts"
HISTORY_PAGE = 50
"""Ended rollouts per page of the list."""
ACTIVE_SHOWN = 500
DEVICE_PAGE = 100
"""Devices per page of a rollout's device table."""
EVENTS_SHOWN = 100
"""The newest history rows a rollout's page shows."""
EVENT_CHUNK = 1000
MAX_TARGET_TEXT = 16 * 1024
MODELS_SHOWN = 200
VERSIONS_SHOWN = 50
"""Versions of each model the form offers (newest first); any other may be typed."""
LIVE_INTERVAL_S = 1.0
DONE_PHASES = frozenset(
    {DevicePhase.ACTIVE, DevicePhase.FAILED, DevicePhase.SKIPPED, DevicePhase.REVERTED}
)
"""Phases in which a device has finished its part (progress counts them)."""
BUTTONS = {
    "pause": "Pause",
    "resume": "Resume",
    "approve": "Approve",
    "promote": "Promote",
    "abort": "Abort",
    "rollback": "Roll back",
}
CONFIRM = {
    "pause": "Pause rollout {id}? No device is told anything until it resumes.",
    "resume": "Resume rollout {id}?",
    "approve": "Approve stage {stage} of rollout {id}?",
    "promote": "Promote stage {stage} of rollout {id} now, skipping its bake and gates?",
    "abort": "Abort rollout {id}? Devices stay where they are.",
    "rollback": "Roll back rollout {id}? Every device it touched returns to its previous version.",
}
DONE = {
    "pause": "paused",
    "resume": "resumed",
    "approve": "approved",
    "promote": "promoted",
    "abort": "aborted",
    "rollback": "told to roll back",
}
DANGER = frozenset({"abort", "rollback"})
STATUS_BADGE = {
    RolloutStatus.RUNNING: "",
    RolloutStatus.AWAITING_APPROVAL: "warn",
    RolloutStatus.PAUSED: "warn",
    RolloutStatus.ROLLING_BACK: "bad",
    RolloutStatus.SUCCEEDED: "ok",
    RolloutStatus.ROLLED_BACK: "bad",
    RolloutStatus.ABORTED: "bad",
}
PHASE_BADGE = {
    DevicePhase.ACTIVE: "ok",
    DevicePhase.FAILED: "bad",
    DevicePhase.SKIPPED: "warn",
    DevicePhase.REVERTING: "warn",
    DevicePhase.REVERTED: "warn",
}
VERDICT_BADGE = {"pass": "ok", "fail": "bad", "inconclusive": "warn"}
TARGET_EXAMPLE = "group=line-a site=f1 profile=jetson-orin"
FIELDS = (
    "model",
    "version",
    "target",
    "stages",
    "gates",
    "bake",
    "rate",
    "rate_growth",
    "device_timeout",
)


def status_text(status: str) -> str:
    """A status as the console writes it: ``rolled_back`` is "rolled back"."""
    return status.replace("_", " ")


# ---------------------------------------------------------------------------- the target
class FieldError(Exception):
    """A form field's value is unusable: ``field`` names it, the message says why."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(message)
        self.field = field_name


_TARGET_KEYS = {"group": "group", "profile": "profiles", "device": "devices"}


def parse_target(text: str) -> dict[str, Any]:
    """The target line (the module docstring's terms) as the spec's ``target`` object.

    Raises ValueError naming the term at fault. The values are checked by
    :func:`parse_target_spec` (the spec's own rules)."""
    if len(text) > MAX_TARGET_TEXT:
        raise ValueError(f"the target is longer than {MAX_TARGET_TEXT} characters")
    lexer = shlex.shlex(text, posix=True)
    lexer.whitespace += ","
    lexer.whitespace_split = True
    lexer.commenters = ""
    try:
        terms = list(lexer)
    except ValueError as e:
        raise ValueError(f"the target does not parse: {e} (close every quote)") from None
    target: dict[str, Any] = {}
    labels: dict[str, str] = {}
    for term in terms:
        explicit = term.startswith("label:")
        key, sep, value = term.removeprefix("label:").partition("=")
        if not sep or not key:
            raise ValueError(
                f"{term!r:.80}: write group=G, profile=P, device=D or a label k=v "
                f"(e.g. {TARGET_EXAMPLE})"
            )
        if key in _TARGET_KEYS and not explicit:
            name = _TARGET_KEYS[key]
            if name == "group":
                if "group" in target and target["group"] != value:
                    raise ValueError(f"two groups ({target['group']!r} and {value!r}): name one")
                target["group"] = value
            elif value not in target.setdefault(name, []):
                target[name].append(value)
            continue
        if key in labels and labels[key] != value:
            raise ValueError(f"label {key!r:.70} is given twice with different values")
        labels[key] = value
    if labels:
        target["labels"] = labels
    return target


def _quoted(value: str) -> str:
    return shlex.quote(value) if re.search(r"[\s,'\"\\]", value) or not value else value


def format_target(target: Target) -> str:
    """``target`` as the target line :func:`parse_target` reads."""
    terms = [f"group={_quoted(target.group)}"] if target.group is not None else []
    terms += [f"profile={_quoted(p)}" for p in target.profiles]
    terms += [f"device={_quoted(d)}" for d in target.devices]
    for key, value in target.labels:
        terms.append(("label:" if key in _TARGET_KEYS else "") + f"{key}={_quoted(value)}")
    return " ".join(terms)


def parse_target_spec(target: Mapping[str, Any]) -> Target:
    """``target`` checked by the rollout spec's own rules (those of ``POST /api/v1/rollouts``).

    Raises ValueError with the spec's message."""
    probe = {"model": "target", "version": "0.0.0", "target": target, "stages": [{"percent": 100}]}
    try:
        return parse_spec(probe).target
    except SpecError as e:
        raise ValueError(str(e).removeprefix("target: ")) from None


def _selects(device: DeviceView, target: Target) -> bool:
    return (
        (target.group is None or device.group_name == target.group)
        and all(device.labels.get(k) == v for k, v in target.labels)
        and (not target.profiles or device.profile in target.profiles)
    )


async def count_target(tx: Tx, target: Target) -> tuple[int, list[str]]:
    """The accepted devices ``target`` selects, as the rollout service selects them at create
    (before leaving out devices the version's profiles do not fit), and what is wrong with any
    device it lists by id."""
    if target.devices:
        problems: list[str] = []
        found = 0
        for device_id in target.devices:
            device = await device_q.get_device(tx, device_id)
            if device is None:
                problems.append(f"there is no device {device_id}")
            elif device.status != ACCEPTED:
                problems.append(f"{device_id} is {device.status}, not accepted")
            elif _selects(device, target):
                found += 1
        return found, problems
    total = 0
    for profile in target.profiles or (None,):
        _, n = await device_q.list_devices(
            tx,
            DeviceFilter(
                group=target.group,
                labels=dict(target.labels) or None,
                profile=profile,
                statuses=[ACCEPTED],
            ),
            limit=1,  # the total is what counts; one row is read
            offset=0,
        )
        total += n
    return total, []


def _devices(n: int) -> str:
    return f"{n:,} device" + ("" if n == 1 else "s")


async def target_text(tx: Tx, text: str) -> str:
    """What the form shows under the target: how many devices match, or what is wrong."""
    if not text.strip():
        return f"Name the devices, e.g. {TARGET_EXAMPLE}"
    try:
        target = parse_target_spec(parse_target(text))
    except ValueError as e:
        return f"Not a target: {e}"
    n, problems = await count_target(tx, target)
    line = f"{_devices(n)} match" + ("es" if n == 1 else "")
    if n == 0:
        line = "No accepted device matches"
    if n > MAX_TARGET and not target.devices:
        line += f"; a rollout takes at most the first {MAX_TARGET:,}"
    if problems:
        more = f" and {len(problems) - 3} more" if len(problems) > 3 else ""
        line += "; " + "; ".join(problems[:3]) + more
    return line


# ---------------------------------------------------------------------------- the form
_SIZE_AHEAD = r"(?=\d|rest\b)"
_METRIC_AHEAD = "(?=(?:" + "|".join(m.value for m in GateMetric) + r")\b)"


def _compact(text: str) -> str:
    """Spaces around ``:``, ``=``, ``<``, ``>`` and ``,`` dropped (``10% : canary`` reads as
    ``10%:canary``)."""
    return re.sub(r"\s*([:=<>,])\s*", r"\1", text.strip())


def split_stages(text: str) -> list[str]:
    """Stages in the ``--stage`` form, separated by spaces, new lines or commas (a comma
    inside a gate's options does not separate: the next stage starts with a size)."""
    return [s for s in re.split(r"\s+|," + _SIZE_AHEAD, _compact(text), flags=re.I) if s]


def split_gates(text: str) -> list[str]:
    """Gates in the ``gate=`` form without ``gate=``, separated by spaces, new lines or
    commas followed by a metric."""
    parts = re.split(r"\s+|," + _METRIC_AHEAD, _compact(text))
    return [p.removeprefix("gate=") for p in parts if p]


def _usage(e: click.ClickException) -> str:
    """A CLI parser's message without the CLI's flag names and example line."""
    first = e.format_message().splitlines()[0]
    return re.sub(r"^--stage:? ?", "stage ", first)


def _number_field(name: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise FieldError(name, f"{text!r:.40} is not a number") from None
    if not math.isfinite(value):
        raise FieldError(name, f"{text!r:.40} is not a finite number")
    return value


def _stages(values: Mapping[str, str]) -> list[dict[str, Any]]:
    texts = split_stages(values["stages"])
    if not texts:
        raise FieldError("stages", "give at least one stage, e.g. 10%, 50%, rest")
    try:
        stages = stages_from_flags(texts)
    except click.UsageError as e:
        raise FieldError("stages", _usage(e)) from None
    gates: list[dict[str, Any]] = []
    for text in split_gates(values["gates"]):
        try:
            gates.append(parse_gate(text))
        except ValueError as e:
            raise FieldError("gates", str(e)) from None
    bake: float | None = None
    if values["bake"]:
        try:
            bake = parse_seconds(values["bake"])
        except ValueError as e:
            raise FieldError("bake", str(e)) from None
    on_fail = "rollback" if values["auto_rollback"] else "pause"
    for stage in stages:
        if "gates" not in stage and gates:
            stage["gates"] = [dict(g) for g in gates]
        for gate in stage.get("gates", []):
            gate.setdefault("on_fail", on_fail)
        if bake is not None:
            stage.setdefault("bake_s", bake)
    return stages


def build_body(values: Mapping[str, str]) -> dict[str, Any]:
    """The ``POST /api/v1/rollouts`` body the form's ``values`` say; raises
    :class:`FieldError` for the first field that cannot be read."""
    if not values["model"]:
        raise FieldError("model", "choose a model")
    if not values["version"]:
        raise FieldError("version", "give the version to roll out, e.g. 1.3.0")
    if not values["target"]:
        raise FieldError("target", f"name the devices, e.g. {TARGET_EXAMPLE}")
    try:
        target = parse_target(values["target"])
    except ValueError as e:
        raise FieldError("target", str(e)) from None
    body: dict[str, Any] = {
        "model": values["model"],
        "version": values["version"],
        "target": target,
        "stages": _stages(values),
    }
    rate: dict[str, Any] = {}
    if values["rate"]:
        try:
            per_minute = parse_rate(values["rate"])
        except click.BadParameter as e:
            raise FieldError("rate", e.format_message()) from None
        if per_minute is not None:
            rate["per_minute"] = per_minute
    if values["rate_growth"]:
        rate["growth"] = _number_field("rate_growth", values["rate_growth"])
    if rate:
        body["rate"] = rate
    if values["device_timeout"]:
        try:
            body["device_timeout_s"] = parse_seconds(values["device_timeout"])
        except ValueError as e:
            raise FieldError("device_timeout", str(e)) from None
    return body


_PATH_FIELDS = {
    "model": "model",
    "version": "version",
    "target": "target",
    "stages": "stages",
    "rate": "rate",
    "device_timeout_s": "device_timeout",
}


def _readable(message: str) -> str:
    """``stages[1].gates[0].threshold: ...`` (or the schema's ``stages.1.gates.0``) as
    ``stage 2, gate 1, threshold: ...``: stages and gates numbered from 1."""
    path, sep, rest = message.partition(": ")
    if not sep or " " in path:
        return message

    def number(m: re.Match[str]) -> str:
        return f"{m[1][:-1]} {int(m[2] or m[3]) + 1}"

    path = re.sub(r"(stages|gates)(?:\[(\d+)\]|\.(\d+))", number, path)
    return path.replace(".", ", ") + sep + rest


def _field_of(message: str) -> str:
    """The form field a spec or schema message (``stages[0].mode: ...``) is about."""
    path = message.partition(":")[0]
    if ".gates" in path:
        return "gates"
    if path.startswith("rate.growth"):
        return "rate_growth"
    head = re.match(r"[a-z_]+", path)
    return _PATH_FIELDS.get(head[0] if head else "", "stages")


def _refusal_field(e: ApiError) -> str:
    """The form field a refusal of the create is about."""
    text = str(e)
    if e.code is ErrorCode.NOT_FOUND:
        if text.startswith("no model"):
            return "model"
        return "target" if "device" in text.split("'")[0] else "version"
    if e.code is ErrorCode.CONFLICT:
        return "version" if "is below the current version" in text else "target"
    if text.startswith("the target"):
        return "target"
    return _field_of(text)


def check_body(body: Mapping[str, Any]) -> RolloutCreate:
    """``body`` checked by the spec's rules, then by the API's request schema, as the REST body
    would be; raises :class:`FieldError`."""
    try:
        parse_spec(body)
    except SpecError as e:
        raise FieldError(_field_of(str(e)), _readable(str(e))) from None
    try:
        return validated(body, RolloutCreate, strict=True)
    except ApiError as e:
        raise FieldError(_field_of(str(e)), _readable(str(e))) from None


def _default_values() -> dict[str, str]:
    return {
        "model": "",
        "version": "",
        "target": "",
        "stages": "10%, 50%, rest",
        "gates": ", ".join(g.removeprefix("gate=") for g in DEFAULT_GATES),
        "bake": DEFAULT_BAKE,
        "rate": "",
        "rate_growth": "",
        "device_timeout": fmt_seconds(600.0),
        "auto_rollback": "on",
    }


@dataclass(frozen=True)
class ModelChoice:
    name: str
    versions: list[str]


async def _model_choices(tx: Tx) -> list[ModelChoice]:
    models = (await registry.list_models(tx))[:MODELS_SHOWN]
    out: list[ModelChoice] = []
    for m in models:
        if m.version_count:
            versions = await registry.list_versions(tx, m.name)
            out.append(ModelChoice(m.name, [v.version for v in versions[:VERSIONS_SHOWN]]))
    return out


async def _render_form(
    ctx: Ctx, values: Mapping[str, str], errors: Mapping[str, str], *, status: int = 200
) -> web.Response:
    async with ctx.svc.db.read() as tx:
        models = await _model_choices(tx)
        count = await target_text(tx, values["target"])
    return ctx.render(
        "rollouts/new.html",
        status=status,
        values=values,
        errors=errors,
        models=models,
        count=count,
        target_example=TARGET_EXAMPLE,
        metrics=[m.value for m in GateMetric],
    )


async def new_form(ctx: Ctx) -> web.StreamResponse:
    values = _default_values()
    values["model"] = ctx.query("model")[:64]
    values["version"] = ctx.query("version")[:128]
    values["target"] = ctx.query("target")[:MAX_TARGET_TEXT]
    if values["model"] and not values["version"]:
        async with ctx.svc.db.read() as tx:
            versions = await registry.list_versions(tx, values["model"])
        values["version"] = versions[0].version if versions else ""
    return await _render_form(ctx, values, {})


async def create(ctx: Ctx) -> web.StreamResponse:
    values = {name: ctx.field(name) for name in FIELDS}
    values["auto_rollback"] = "on" if ctx.field("auto_rollback") else ""
    service = rollout_service(ctx.request)
    try:
        body = check_body(build_body(values))
        try:
            detail = await start_rollout(service, body, actor=ctx.principal.actor)
        except ApiError as e:
            if e.code not in (ErrorCode.BAD_REQUEST, ErrorCode.NOT_FOUND, ErrorCode.CONFLICT):
                raise
            raise FieldError(_refusal_field(e), str(e)) from None
    except FieldError as e:
        return await _render_form(ctx, values, {e.field: str(e)}, status=400)
    r = detail.rollout
    return ctx.redirect(
        f"/ui/rollouts/{r.id}",
        f"Rollout {r.id} started: {r.model} {r.version} to {_devices(r.target_devices)} "
        f"in {len(detail.spec.stages)} stage(s).",
    )


async def target_count(ctx: Ctx) -> web.StreamResponse:
    async with ctx.svc.db.read() as tx:
        text = await target_text(tx, ctx.query("target"))
    return web.json_response({"text": text})


# ---------------------------------------------------------------------------- the list
@dataclass(frozen=True)
class Row:
    """One rollout in the list."""

    id: int
    model: str
    version: str
    status: str
    status_text: str
    badge: str
    stage: str
    done: int
    target: int
    percent: int
    created_by: str
    created_at: Any
    ended_at: Any
    reason: str


def _done(phases: Mapping[str, int]) -> int:
    return sum(n for p, n in phases.items() if DevicePhase(p) in DONE_PHASES)


def _percent(done: int, target: int) -> int:
    return done * 100 // target if target else 100


def _row(d: RolloutDetail) -> Row:
    r, stages = d.rollout, len(d.spec.stages)
    done = _done(d.phases)
    return Row(
        id=r.id,
        model=r.model,
        version=r.version,
        status=r.status,
        status_text=status_text(r.status),
        badge=STATUS_BADGE[RolloutStatus(r.status)],
        stage=f"{min(r.stage, stages - 1) + 1} of {stages}",
        done=done,
        target=r.target_devices,
        percent=_percent(done, r.target_devices),
        created_by=r.created_by,
        created_at=r.created_at,
        ended_at=r.ended_at,
        reason=d.state.reason,
    )


def _row_id(text: str, what: str) -> int:
    if not text.isdigit() or len(text) > 18:
        raise UiError(f"there is no {what} {text[:40]!r}", status=404)
    return int(text)


async def rollout_list(ctx: Ctx) -> web.StreamResponse:
    service = rollout_service(ctx.request)
    before_text = ctx.query("before")
    before = _row_id(before_text, "page") if before_text else None
    active = (
        []
        if before is not None
        else await service.list_rollouts(limit=ACTIVE_SHOWN, statuses=q.ACTIVE_STATUSES)
    )
    ended = [s.value for s in RolloutStatus if s.ended]
    history = await service.list_rollouts(limit=HISTORY_PAGE + 1, before_id=before, statuses=ended)
    older = history[HISTORY_PAGE - 1].rollout.id if len(history) > HISTORY_PAGE else None
    return ctx.render(
        "rollouts/list.html",
        active=[_row(d) for d in active],
        history=[_row(d) for d in history[:HISTORY_PAGE]],
        older=older,
        before=before,
    )


# ---------------------------------------------------------------------------- one rollout
@dataclass
class History:
    """The newest :data:`EVENTS_SHOWN` history rows of a rollout, read once and then only
    what is new (a live stream keeps one)."""

    rollout_id: int
    after: int = 0
    total: int = 0
    items: deque[q.RolloutEventView] = field(default_factory=lambda: deque(maxlen=EVENTS_SHOWN))

    async def read(self, tx: Tx) -> None:
        while True:
            rows = await q.list_events(tx, self.rollout_id, after_id=self.after, limit=EVENT_CHUNK)
            self.items.extend(rows)
            self.total += len(rows)
            if rows:
                self.after = rows[-1].id
            if len(rows) < EVENT_CHUNK:
                return


@dataclass(frozen=True)
class StageRow:
    number: int
    size: str
    mode: str
    bake: str
    flags: str
    gates: str
    state: str
    badge: str


@dataclass(frozen=True)
class GateRow:
    metric: str
    value: str
    threshold: str
    verdict: str
    badge: str
    devices: int
    requests: int
    reason: str


@dataclass(frozen=True)
class DeviceRow:
    device_id: str
    stage: int
    phase: str
    badge: str
    version: str
    since: Any
    reason: str


@dataclass(frozen=True)
class EventRow:
    at: Any
    kind: str
    stage: str
    actor: str
    reason: str


@dataclass(frozen=True)
class Action:
    op: str
    label: str
    confirm: str
    danger: bool


def _fmt_value(value: float | None) -> str:
    if value is None:
        return "–"
    if math.isinf(value):
        return "infinite"
    return f"{value:.4g}"


def _stage_rows(d: RolloutDetail) -> list[StageRow]:
    r = d.rollout
    try:
        sizes: Sequence[int | None] = plan_stage_sizes(d.spec, r.target_devices)
    except SpecError:
        sizes = [None] * len(d.spec.stages)
    status = RolloutStatus(r.status)
    rows = []
    for i, (stage, stored, n) in enumerate(
        zip(d.spec.stages, r.spec["stages"], sizes, strict=False)
    ):
        if stage.count is not None:
            size = _devices(stage.count)
        else:
            size = f"{stage.percent:g}%" + (f" ({_devices(n)})" if n is not None else "")
        if status is RolloutStatus.SUCCEEDED or i < r.stage:
            state, badge = "passed", "ok"
        elif i == r.stage:
            state, badge = status_text(r.status), STATUS_BADGE[status]
            if status is RolloutStatus.RUNNING and d.state.bake_started_at is not None:
                state = "baking"
        else:
            state, badge = "not started", ""
        mode = stage.mode.value + (f" {stage.weight:g}" if stage.mode.value == "canary" else "")
        rows.append(
            StageRow(
                number=i + 1,
                size=size,
                mode=mode,
                bake=fmt_seconds(stage.bake_s),
                flags=", ".join(f for f in ("prefetch", "approval") if getattr(stage, f)) or "–",
                gates=" ".join(gate_text(g) for g in stored["gates"]) or "–",
                state=state,
                badge=badge,
            )
        )
    return rows


def _gate_rows(d: RolloutDetail) -> list[GateRow]:
    index = d.rollout.stage
    if index >= len(d.spec.stages):
        return []
    results = {g.metric: g for g in d.state.gates}
    rows = []
    for gate in d.spec.stages[index].gates:
        result = results.get(gate.metric)
        verdict = result.verdict if result is not None else "not judged yet"
        rows.append(
            GateRow(
                metric=gate.metric.value,
                value=_fmt_value(result.value if result is not None else None),
                threshold=("> " if gate.metric.is_floor else "< ") + f"{gate.threshold:g}",
                verdict=verdict + (" (dry run)" if gate.dry_run else ""),
                badge=VERDICT_BADGE.get(verdict, ""),
                devices=result.devices if result is not None else 0,
                requests=result.requests if result is not None else 0,
                reason=result.reason if result is not None else "",
            )
        )
    return rows


def _device_reasons(history: History) -> dict[str, str]:
    """device -> why it failed or was skipped, from the newest history rows naming it (the
    reason without its count and list of devices)."""
    out: dict[str, str] = {}
    for e in history.items:
        if e.kind not in ("devices_failed", "devices_skipped"):
            continue
        why = re.sub(r"^\d+ device\(s\) ", "", e.reason.rsplit(": ", 1)[0])
        named = e.detail.get("devices")
        for device_id in named if isinstance(named, list) else []:
            if isinstance(device_id, str):
                out[device_id] = why
    return out


def _device_version(row: q.RolloutDeviceView, version: str) -> str:
    before = row.from_version or "none"
    phase = DevicePhase(row.phase)
    if phase is DevicePhase.ACTIVE:
        return version + (f" ({row.mode})" if row.mode and row.mode != "switch" else "")
    if phase is DevicePhase.MOVING:
        return f"{before} → {version}"
    if phase is DevicePhase.REVERTING:
        return f"→ {before}"
    return before


_PHASE_TEXT = {
    DevicePhase.WAITING: "not told yet",
    DevicePhase.PREFETCHING: "downloading and verifying",
    DevicePhase.PREFETCHED: "downloaded; waits for its stage",
    DevicePhase.MOVING: "told to move; not reporting it yet",
    DevicePhase.ACTIVE: "reports the version running",
    DevicePhase.FAILED: "failed",
    DevicePhase.SKIPPED: "skipped",
    DevicePhase.REVERTING: "told to return to its previous version",
    DevicePhase.REVERTED: "back on its previous version",
}


def _actions(d: RolloutDetail) -> list[Action]:
    status = RolloutStatus(d.rollout.status)
    out = []
    for op in BUTTONS:
        if status not in engine.COMMANDS[op] or (op == "promote" and d.state.finalized):
            continue
        confirm = CONFIRM[op].format(id=d.rollout.id, stage=d.rollout.stage + 1)
        out.append(Action(op, BUTTONS[op], confirm, op in DANGER))
    return out


async def _live_values(
    ctx: Ctx, rollout_id: int, history: History, phase: str | None, offset: int
) -> dict[str, Any]:
    try:
        d = await rollout_service(ctx.request).get(rollout_id)
    except RolloutNotFoundError as e:
        raise UiError(str(e), status=404) from None
    async with ctx.svc.db.read() as tx:
        rows, total = await q.page_devices(
            tx, rollout_id, limit=DEVICE_PAGE, offset=offset, phase=phase
        )
        await history.read(tx)
    reasons = _device_reasons(history)
    r = d.rollout
    done = _done(d.phases)
    phases = [(p.value, d.phases[p.value]) for p in DevicePhase if d.phases.get(p.value)]
    devices = [
        DeviceRow(
            device_id=row.device_id,
            stage=row.stage + 1,
            phase=row.phase,
            badge=PHASE_BADGE.get(DevicePhase(row.phase), ""),
            version=_device_version(row, r.version),
            since=row.since,
            reason=reasons.get(row.device_id) or _PHASE_TEXT[DevicePhase(row.phase)],
        )
        for row in rows
    ]
    events = [
        EventRow(e.at, e.kind, str(e.stage + 1) if e.stage is not None else "–", e.actor, e.reason)
        for e in reversed(history.items)
    ]
    return {
        "r": r,
        "row": _row(d),
        "target": format_target(d.spec.target),
        "ended": RolloutStatus(r.status).ended,
        "done": done,
        "percent": _percent(done, r.target_devices),
        "phases": phases,
        "bake_started_at": d.state.bake_started_at,
        "stages": _stage_rows(d),
        "gates": _gate_rows(d),
        "current_stage": min(r.stage, len(d.spec.stages) - 1) + 1,
        "devices": devices,
        "device_total": total,
        "device_phase": phase or "",
        "device_offset": offset,
        "device_page": DEVICE_PAGE,
        "events": events,
        "event_total": history.total,
        "actions": _actions(d),
    }


def _device_query(ctx: Ctx) -> tuple[str | None, int]:
    phase = ctx.query("phase") or None
    if phase is not None and phase not in {p.value for p in DevicePhase}:
        raise UiError(f"no device state {phase[:40]!r}; one of the table's states", status=400)
    offset_text = ctx.query("offset", "0")
    if not offset_text.isdigit() or len(offset_text) > 9:
        raise UiError("offset must be a whole number", status=400)
    return phase, int(offset_text)


def _live_url(rollout_id: int, phase: str | None, offset: int) -> str:
    params = [f"phase={phase}"] if phase else []
    params += [f"offset={offset}"] if offset else []
    return f"/ui/rollouts/{rollout_id}/live" + ("?" + "&".join(params) if params else "")


async def _detail_page(
    ctx: Ctx, rollout_id: int, *, action_error: str = "", status: int = 200
) -> web.Response:
    phase, offset = _device_query(ctx)
    values = await _live_values(ctx, rollout_id, History(rollout_id), phase, offset)
    return ctx.render(
        "rollouts/detail.html",
        status=status,
        action_error=action_error,
        live_url=_live_url(rollout_id, phase, offset),
        **values,
    )


async def detail(ctx: Ctx) -> web.StreamResponse:
    return await _detail_page(ctx, _row_id(ctx.request.match_info["rollout_id"], "rollout"))


async def live(ctx: Ctx) -> web.StreamResponse:
    rollout_id = _row_id(ctx.request.match_info["rollout_id"], "rollout")
    phase, offset = _device_query(ctx)
    history = History(rollout_id)
    first = [await _live_values(ctx, rollout_id, history, phase, offset)]  # 404 before streaming
    ended = False

    async def produce() -> str:
        nonlocal ended
        values = (
            first.pop() if first else await _live_values(ctx, rollout_id, history, phase, offset)
        )
        ended = values["ended"]
        return ctx.fragment("rollouts/_live.html", **values)

    return await stream_fragments(ctx, produce, interval=LIVE_INTERVAL_S, finished=lambda: ended)


def _commander(op: str) -> Any:
    async def handler(ctx: Ctx) -> web.StreamResponse:
        rollout_id = _row_id(ctx.request.match_info["rollout_id"], "rollout")
        reason = validated({"reason": ctx.field("reason")}, ReasonBody, strict=True).reason
        try:
            d = await command_rollout(
                rollout_service(ctx.request),
                rollout_id,
                op,
                actor=ctx.principal.actor,
                reason=reason,
            )
        except ApiError as e:
            if e.code is not ErrorCode.CONFLICT:
                raise
            return await _detail_page(ctx, rollout_id, action_error=str(e), status=409)
        return ctx.redirect(
            f"/ui/rollouts/{rollout_id}",
            f"Rollout {rollout_id} {DONE[op]}; it is {status_text(d.rollout.status)}.",
        )

    handler.__name__ = f"{op}_rollout"
    return handler


PAGES = [
    Page("GET", "/ui/rollouts", rollout_list, Role.VIEWER, nav=NAV),
    Page("GET", "/ui/rollouts/new", new_form, Role.OPERATOR, nav=NAV),
    Page("POST", "/ui/rollouts/new", create, Role.OPERATOR, nav=NAV),
    Page("GET", "/ui/rollouts/target-count", target_count, Role.VIEWER, nav=NAV),
    Page("GET", "/ui/rollouts/{rollout_id}", detail, Role.VIEWER, nav=NAV),
    Page("GET", "/ui/rollouts/{rollout_id}/live", live, Role.VIEWER, nav=NAV),
    *(
        Page("POST", f"/ui/rollouts/{{rollout_id}}/{op}", _commander(op), Role.OPERATOR, nav=NAV)
        for op in COMMANDS
    ),
]

__all__ = ["PAGES", "count_target", "format_target", "parse_target", "target_text"]
