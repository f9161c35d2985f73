"""A rollout spec from a JSON or TOML document, its stage sizes, and the JSON forms of a spec,
a state and a device's progress (pure: no I/O).

:func:`parse_spec` checks everything an operator may get wrong and names the field at fault
(``stages[1].gates[0].threshold: ...``) in a :class:`SpecError`; unknown keys are refused, so a
typo never silently drops a setting. The document::

    {"model": "digits", "version": "1.3.0",
     "target": {"devices": [...], "group": "lab", "labels": {"site": "a"}, "profiles": [...]},
     "stages": [{"count": 5 | "percent": 10.0, "mode": "switch" | "canary" | "shadow",
                 "weight": 0.1, "bake_s": 300, "prefetch": false, "approval": false,
                 "gates": [{"metric": "error_rate", "threshold": 0.05, "min_devices": 1,
                            "min_requests": 100, "on_fail": "rollback" | "pause",
                            "dry_run": false}]}],
     "rate": {"per_minute": 10 | null, "growth": 1.0},
     "device_timeout_s": 600}

Stage sizes (:func:`plan_stage_sizes`). Each stage names ``count`` devices or ``percent`` of
the target, exactly one of them. Every stage but the last gets its size: a count exactly, a
percent of the target rounded half up, at least 1. The last stage takes whatever remains, and
that must be at least one device. What the last stage names is a check:

* all stages are percent stages: the percents sum to 100 (within 1e-6);
* all stages are count stages: the counts sum to the target exactly;
* counts and percents mixed: the last stage is a percent stage and takes the rest (its percent
  is not compared; write 100 to say "the rest").

The first and the third rule are checked by :func:`parse_spec`, the sums by
:func:`plan_stage_sizes` once the target is known; a target of no device is refused there.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from mcp_edge.controlplane.rollouts.model import (
    DevicePhase,
    DeviceProgress,
    FailAction,
    Gate,
    GateMetric,
    GateResult,
    RateLimit,
    RolloutSpec,
    RolloutState,
    RolloutStatus,
    Stage,
    StageMode,
    Target,
)
from mcp_edge.shared.errors import McpError
from mcp_edge.shared.protocol.base import (
    LABEL_KEY_PATTERN,
    LABEL_VALUE_PATTERN,
    MAX_LABELS,
)
from mcp_edge.shared.protocol.topics import IDENTIFIER_PATTERN
from mcp_edge.shared.version import MAX_VERSION_LENGTH, SEMVER_PATTERN

MAX_STAGES = 50
MAX_GATES = 16
MAX_DEVICES = 10_000
MAX_PROFILES = 64
MAX_BAKE_S = 7 * 86_400.0
MIN_DEVICE_TIMEOUT_S = 10.0
MAX_DEVICE_TIMEOUT_S = 7 * 86_400.0
MAX_PER_MINUTE = 1_000_000.0
MAX_GROWTH = 10.0
MAX_MIN_DEVICES = 1_000_000
MAX_STAGE_COUNT = MAX_DEVICES * 100
"""The largest ``count`` a stage may name (the API schema's bound too)."""
MAX_MIN_REQUESTS = 10**12
MAX_LATENCY_RATIO = 100.0
PERCENT_TOLERANCE = 1e-6

_IDENT = re.compile(IDENTIFIER_PATTERN)
_SEMVER = re.compile(SEMVER_PATTERN)
_LABEL_KEY = re.compile(LABEL_KEY_PATTERN)
_LABEL_VALUE = re.compile(LABEL_VALUE_PATTERN)
_SURROGATE = re.compile("[\ud800-\udfff]")
_RATES = (GateMetric.INSTALL_FAILURE_RATE, GateMetric.ERROR_RATE)


class SpecError(McpError):
    """A rollout spec (or a stored rollout document) is unusable; the message names the field."""


# ---------------------------------------------------------------------------- field readers
def _keys(data: object, where: str, allowed: set[str], required: set[str]) -> Mapping[str, Any]:
    if not isinstance(data, Mapping):
        raise SpecError(f"{where}: expected an object, got {type(data).__name__}")
    unknown = sorted(str(k) for k in data if k not in allowed)
    if unknown:
        raise SpecError(
            f"{where}: unknown key(s) {', '.join(repr(k)[:70] for k in unknown[:5])}; "
            f"allowed: {', '.join(sorted(allowed))}"
        )
    missing = sorted(required - set(data))
    if missing:
        raise SpecError(f"{where}: missing {', '.join(missing)}")
    return data


def _where(parent: str, key: str) -> str:
    return f"{parent}.{key}" if parent else key


def _ident(value: object, where: str) -> str:
    if not isinstance(value, str) or _IDENT.fullmatch(value) is None:
        raise SpecError(
            f"{where}: {value!r:.80} is not an identifier: use 1-64 characters of "
            "A-Z a-z 0-9 . _ -, starting with a letter or digit"
        )
    return value


def _number(
    value: object, where: str, lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = False
) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SpecError(f"{where}: expected a number, got {value!r:.40}")
    x = float(value)
    below = x <= lo if lo_open else x < lo
    above = x >= hi if hi_open else x > hi
    if not math.isfinite(x) or below or above:
        raise SpecError(
            f"{where}: {value!r:.40} is out of range: must be "
            f"{'>' if lo_open else '>='} {lo:g} and {'<' if hi_open else '<='} {hi:g}"
        )
    return x


def _int(value: object, where: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"{where}: expected an integer, got {value!r:.40}")
    if not lo <= value <= hi:
        raise SpecError(f"{where}: {value} is out of range: must be {lo}..{hi}")
    return value


def _bool(value: object, where: str) -> bool:
    if not isinstance(value, bool):
        raise SpecError(f"{where}: expected true or false, got {value!r:.40}")
    return value


def _choice(value: object, where: str, enum_type: type[Any]) -> Any:
    choices = [m.value for m in enum_type]
    if not isinstance(value, str) or value not in choices:
        raise SpecError(f"{where}: {value!r:.40} is not one of {', '.join(choices)}")
    return enum_type(value)


def _list(value: object, where: str, most: int) -> Sequence[Any]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise SpecError(f"{where}: expected a list, got {type(value).__name__}")
    if len(value) > most:
        raise SpecError(f"{where}: {len(value)} entries; at most {most}")
    return value


# ---------------------------------------------------------------------------------- parsing
def _target(data: object) -> Target:
    d = _keys(data, "target", {"devices", "group", "labels", "profiles"}, set())
    devices = tuple(
        _ident(v, f"target.devices[{i}]")
        for i, v in enumerate(_list(d.get("devices", []), "target.devices", MAX_DEVICES))
    )
    seen: set[str] = set()
    for dev in devices:
        if dev in seen:
            raise SpecError(f"target.devices: {dev!r} is listed twice")
        seen.add(dev)
    group = d.get("group")
    if group is not None:
        group = _ident(group, "target.group")
    labels_in = d.get("labels", {})
    if not isinstance(labels_in, Mapping):
        raise SpecError("target.labels: expected an object of key: value")
    if len(labels_in) > MAX_LABELS:
        raise SpecError(f"target.labels: {len(labels_in)} labels; at most {MAX_LABELS}")
    labels: list[tuple[str, str]] = []
    for k, v in labels_in.items():
        if not isinstance(k, str) or _LABEL_KEY.fullmatch(k) is None:
            raise SpecError(
                f"target.labels: key {k!r:.70} must be 1-63 chars of a-z 0-9 . _ / -, "
                "starting with a-z 0-9"
            )
        if not isinstance(v, str) or _LABEL_VALUE.fullmatch(v) is None or _SURROGATE.search(v):
            raise SpecError(
                f"target.labels.{k}: the value must be at most 128 printable characters"
            )
        labels.append((k, v))
    profiles = tuple(
        _ident(v, f"target.profiles[{i}]")
        for i, v in enumerate(_list(d.get("profiles", []), "target.profiles", MAX_PROFILES))
    )
    target = Target(devices, group, tuple(sorted(labels)), tuple(sorted(set(profiles))))
    if target.is_empty():
        raise SpecError(
            "target: the target selects nothing: name devices, a group, labels or profiles"
        )
    return target


def _threshold(metric: GateMetric, value: object, where: str) -> float:
    if metric in _RATES:
        t = _number(value, where, 0.0, 1.0)
        if t >= 1.0:
            raise SpecError(f"{where}: a {metric.value} gate at {t:g} can never fail: use < 1")
        return t
    if metric is GateMetric.AGREEMENT:
        t = _number(value, where, 0.0, 1.0)
        if t <= 0.0:
            raise SpecError(f"{where}: an agreement gate at {t:g} can never fail: use > 0")
        return t
    if metric is GateMetric.LATENCY_P95_RATIO:
        return _number(value, where, 0.0, MAX_LATENCY_RATIO, lo_open=True)
    return _number(value, where, 0.0, 1e9, lo_open=True)


def _gate(data: object, where: str, mode: StageMode) -> Gate:
    allowed = {"metric", "threshold", "min_devices", "min_requests", "on_fail", "dry_run"}
    d = _keys(data, where, allowed, {"metric", "threshold"})
    metric: GateMetric = _choice(d["metric"], f"{where}.metric", GateMetric)
    if metric is GateMetric.AGREEMENT and mode is not StageMode.SHADOW:
        raise SpecError(f"{where}.metric: an agreement gate needs a shadow stage, not {mode.value}")
    default = Gate(metric, 0.0)
    return Gate(
        metric=metric,
        threshold=_threshold(metric, d["threshold"], f"{where}.threshold"),
        min_devices=_int(
            d.get("min_devices", default.min_devices), f"{where}.min_devices", 1, MAX_MIN_DEVICES
        ),
        min_requests=_int(
            d.get("min_requests", default.min_requests),
            f"{where}.min_requests",
            0,
            MAX_MIN_REQUESTS,
        ),
        on_fail=_choice(d.get("on_fail", default.on_fail.value), f"{where}.on_fail", FailAction),
        dry_run=_bool(d.get("dry_run", False), f"{where}.dry_run"),
    )


def _stage(data: object, where: str) -> Stage:
    allowed = {"count", "percent", "mode", "weight", "bake_s", "prefetch", "approval", "gates"}
    d = _keys(data, where, allowed, set())
    if ("count" in d) == ("percent" in d):
        raise SpecError(f"{where}: give exactly one of count or percent")
    count = _int(d["count"], f"{where}.count", 1, MAX_STAGE_COUNT) if "count" in d else None
    percent = (
        _number(d["percent"], f"{where}.percent", 0.0, 100.0, lo_open=True)
        if "percent" in d
        else None
    )
    mode: StageMode = _choice(d.get("mode", StageMode.SWITCH.value), f"{where}.mode", StageMode)
    default = Stage()
    weight = default.weight
    if "weight" in d:
        if mode is not StageMode.CANARY:
            raise SpecError(f"{where}.weight: applies to canary stages only, not {mode.value}")
        weight = _number(d["weight"], f"{where}.weight", 0.0, 1.0, lo_open=True, hi_open=True)
    gates_in = _list(d.get("gates", []), f"{where}.gates", MAX_GATES)
    gates = tuple(_gate(g, f"{where}.gates[{i}]", mode) for i, g in enumerate(gates_in))
    metrics = [g.metric for g in gates]
    for m in metrics:
        if metrics.count(m) > 1:
            raise SpecError(f"{where}.gates: two {m.value} gates; one per metric and stage")
    return Stage(
        count=count,
        percent=percent,
        mode=mode,
        weight=weight,
        bake_s=_number(d.get("bake_s", default.bake_s), f"{where}.bake_s", 0.0, MAX_BAKE_S),
        prefetch=_bool(d.get("prefetch", False), f"{where}.prefetch"),
        approval=_bool(d.get("approval", False), f"{where}.approval"),
        gates=gates,
    )


def _check_sizes(stages: Sequence[Stage]) -> None:
    percents = [s.percent for s in stages if s.percent is not None]
    if len(percents) == len(stages):
        total = math.fsum(percents)
        if abs(total - 100.0) > PERCENT_TOLERANCE:
            raise SpecError(f"stages: the percents sum to {total:g}, not 100")
    elif percents and stages[-1].percent is None:
        raise SpecError(
            "stages: with both counts and percents the last stage must be a percent stage "
            "(it takes the rest of the target)"
        )


def _rate(data: object) -> RateLimit:
    d = _keys(data, "rate", {"per_minute", "growth"}, set())
    per_minute = d.get("per_minute")
    if per_minute is not None:
        per_minute = _number(per_minute, "rate.per_minute", 0.0, MAX_PER_MINUTE, lo_open=True)
    growth = _number(d.get("growth", 1.0), "rate.growth", 1.0, MAX_GROWTH)
    return RateLimit(per_minute, growth)


def parse_spec(data: Mapping[str, Any]) -> RolloutSpec:
    """Build a :class:`RolloutSpec` from its JSON/TOML form (the module docstring's shape).

    Raises :class:`SpecError` naming the field for anything unknown, missing, mistyped or out
    of bounds.
    """
    allowed = {"model", "version", "target", "stages", "rate", "device_timeout_s"}
    d = _keys(data, "spec", allowed, {"model", "version", "target", "stages"})
    model = _ident(d["model"], "model")
    version = d["version"]
    if (
        not isinstance(version, str)
        or not 5 <= len(version) <= MAX_VERSION_LENGTH
        or _SEMVER.fullmatch(version) is None
    ):
        raise SpecError(f"version: {version!r:.80} is not a semantic version (expected e.g. 1.3.0)")
    stages_in = _list(d["stages"], "stages", MAX_STAGES)
    if not stages_in:
        raise SpecError("stages: a rollout needs at least one stage")
    stages = tuple(_stage(s, f"stages[{i}]") for i, s in enumerate(stages_in))
    _check_sizes(stages)
    return RolloutSpec(
        model=model,
        version=version,
        target=_target(d["target"]),
        stages=stages,
        rate=_rate(d["rate"]) if "rate" in d else RateLimit(),
        device_timeout_s=_number(
            d.get("device_timeout_s", 600.0),
            "device_timeout_s",
            MIN_DEVICE_TIMEOUT_S,
            MAX_DEVICE_TIMEOUT_S,
        ),
    )


# ------------------------------------------------------------------------------ stage sizes
def _round_half_up(x: float) -> int:
    return math.floor(x + 0.5)


def plan_stage_sizes(spec: RolloutSpec, n_targets: int) -> list[int]:
    """How many of ``n_targets`` devices each stage takes (the module docstring's rule).

    The sizes sum to ``n_targets`` and each is at least 1. Raises :class:`SpecError` with the
    numbers when they do not add up, or when the target holds no device.
    """
    if n_targets <= 0:
        raise SpecError("the target selects no device: nothing to roll out to")
    stages = spec.stages
    if all(s.count is not None for s in stages):
        total = sum(s.count or 0 for s in stages)
        if total != n_targets:
            raise SpecError(
                f"the stages' counts add up to {total} device(s) but the target has "
                f"{n_targets}: make them match, or make the last stage a percent stage"
            )
        return [s.count or 0 for s in stages]
    first = [
        s.count
        if s.count is not None
        else max(1, _round_half_up((s.percent or 0.0) * n_targets / 100))
        for s in stages[:-1]
    ]
    rest = n_targets - sum(first)
    if rest < 1:
        raise SpecError(
            f"stages 1 to {len(stages) - 1} take {sum(first)} of the target's {n_targets} "
            f"device(s) ({', '.join(map(str, first))}); the last stage would get nothing"
        )
    return [*first, rest]


# ---------------------------------------------------------------------------- to JSON forms
def spec_to_dict(spec: RolloutSpec) -> dict[str, Any]:
    """The JSON form of ``spec``; ``parse_spec(spec_to_dict(s)) == s`` for a parsed spec."""
    target: dict[str, Any] = {}
    if spec.target.devices:
        target["devices"] = list(spec.target.devices)
    if spec.target.group is not None:
        target["group"] = spec.target.group
    if spec.target.labels:
        target["labels"] = dict(spec.target.labels)
    if spec.target.profiles:
        target["profiles"] = list(spec.target.profiles)
    stages: list[dict[str, Any]] = []
    for s in spec.stages:
        stage: dict[str, Any] = (
            {"count": s.count} if s.count is not None else {"percent": s.percent}
        )
        stage["mode"] = s.mode.value
        if s.mode is StageMode.CANARY:
            stage["weight"] = s.weight
        stage |= {"bake_s": s.bake_s, "prefetch": s.prefetch, "approval": s.approval}
        stage["gates"] = [
            {
                "metric": g.metric.value,
                "threshold": g.threshold,
                "min_devices": g.min_devices,
                "min_requests": g.min_requests,
                "on_fail": g.on_fail.value,
                "dry_run": g.dry_run,
            }
            for g in s.gates
        ]
        stages.append(stage)
    return {
        "model": spec.model,
        "version": spec.version,
        "target": target,
        "stages": stages,
        "rate": {"per_minute": spec.rate.per_minute, "growth": spec.rate.growth},
        "device_timeout_s": spec.device_timeout_s,
    }


def _json_float(x: float | None) -> float | str | None:
    """JSON has no infinity: a ratio over a zero latency is stored as ``"inf"``."""
    if x is None or math.isfinite(x):
        return x
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


def _gate_result_to_dict(g: GateResult) -> dict[str, Any]:
    return {
        "metric": g.metric.value,
        "verdict": g.verdict,
        "value": _json_float(g.value),
        "threshold": g.threshold,
        "devices": g.devices,
        "requests": g.requests,
        "dry_run": g.dry_run,
        "reason": g.reason,
    }


def state_to_dict(state: RolloutState) -> dict[str, Any]:
    """The JSON form of ``state`` without its devices (stored one row per device; see
    :func:`progress_to_dict`)."""
    return {
        "status": state.status.value,
        "stage": state.stage,
        "stage_started_at": state.stage_started_at,
        "bake_started_at": state.bake_started_at,
        "approved": sorted(state.approved),
        "gates": [_gate_result_to_dict(g) for g in state.gates],
        "reason": state.reason,
        "finalized": state.finalized,
        "reported_invalid": sorted(state.reported_invalid),
        "reported_dry_run": sorted(m.value for m in state.reported_dry_run),
    }


def progress_to_dict(progress: DeviceProgress) -> dict[str, Any]:
    """The JSON form of one device's progress."""
    return {
        "device_id": progress.device_id,
        "stage": progress.stage,
        "phase": progress.phase.value,
        "since": progress.since,
        "told_at": progress.told_at,
        "from_version": progress.from_version,
        "mode": progress.mode.value if progress.mode is not None else None,
    }


# -------------------------------------------------------------------------- from JSON forms
def _stored_float(value: object, where: str, *, optional: bool = False) -> float | None:
    if value is None and optional:
        return None
    if isinstance(value, str) and value in ("inf", "-inf", "nan"):
        return float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SpecError(f"stored rollout {where}: expected a number, got {value!r:.40}")
    return float(value)


def _stored_time(value: object, where: str, *, optional: bool = False) -> float | None:
    x = _stored_float(value, where, optional=optional)
    if x is not None and not math.isfinite(x):
        raise SpecError(f"stored rollout {where}: expected a time, got {value!r:.40}")
    return x


def _stored_str(value: object, where: str, *, optional: bool = False) -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise SpecError(f"stored rollout {where}: expected a string, got {value!r:.40}")
    return value


def _stored_int(value: object, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SpecError(f"stored rollout {where}: expected a count, got {value!r:.40}")
    return value


def _stored_enum(value: object, where: str, enum_type: type[Any]) -> Any:
    try:
        return enum_type(value)
    except (ValueError, TypeError):
        raise SpecError(f"stored rollout {where}: {value!r:.40} is unknown") from None


def _gate_result_from_dict(d: object, where: str) -> GateResult:
    allowed = {
        "metric",
        "verdict",
        "value",
        "threshold",
        "devices",
        "requests",
        "dry_run",
        "reason",
    }
    g = _keys(d, f"stored rollout {where}", allowed, allowed)
    return GateResult(
        metric=_stored_enum(g["metric"], f"{where}.metric", GateMetric),
        verdict=_stored_str(g["verdict"], f"{where}.verdict") or "",
        value=_stored_float(g["value"], f"{where}.value", optional=True),
        threshold=_stored_float(g["threshold"], f"{where}.threshold") or 0.0,
        devices=_stored_int(g["devices"], f"{where}.devices"),
        requests=_stored_int(g["requests"], f"{where}.requests"),
        dry_run=g["dry_run"] is True,
        reason=_stored_str(g["reason"], f"{where}.reason") or "",
    )


def state_from_dict(
    data: Mapping[str, Any], devices: Mapping[str, DeviceProgress] | None = None
) -> RolloutState:
    """The state :func:`state_to_dict` wrote, with ``devices`` (default: none) put back.

    Raises :class:`SpecError` when ``data`` is not such a document.
    """
    required = {
        "status",
        "stage",
        "stage_started_at",
        "bake_started_at",
        "approved",
        "gates",
        "reason",
        "finalized",
    }
    allowed = required | {"reported_invalid", "reported_dry_run"}
    d = _keys(data, "stored rollout state", allowed, required)
    approved = d["approved"]
    gates = d["gates"]
    invalid = d.get("reported_invalid", [])
    dry = d.get("reported_dry_run", [])
    for name, value in (
        ("approved", approved),
        ("gates", gates),
        ("reported_invalid", invalid),
        ("reported_dry_run", dry),
    ):
        if not isinstance(value, list):
            raise SpecError(f"stored rollout state.{name}: expected a list")
    return RolloutState(
        status=_stored_enum(d["status"], "state.status", RolloutStatus),
        stage=_stored_int(d["stage"], "state.stage"),
        stage_started_at=_stored_time(
            d["stage_started_at"], "state.stage_started_at", optional=True
        ),
        bake_started_at=_stored_time(d["bake_started_at"], "state.bake_started_at", optional=True),
        approved=frozenset(_stored_int(v, "state.approved[]") for v in approved),
        devices=dict(devices or {}),
        gates=tuple(_gate_result_from_dict(g, f"state.gates[{i}]") for i, g in enumerate(gates)),
        reason=_stored_str(d["reason"], "state.reason") or "",
        finalized=d["finalized"] is True,
        reported_invalid=frozenset(
            _stored_str(v, "state.reported_invalid[]") or "" for v in invalid
        ),
        reported_dry_run=frozenset(
            _stored_enum(v, "state.reported_dry_run[]", GateMetric) for v in dry
        ),
    )


def progress_from_dict(data: Mapping[str, Any]) -> DeviceProgress:
    """The device progress :func:`progress_to_dict` wrote; raises :class:`SpecError`."""
    keys = {"device_id", "stage", "phase", "since", "told_at", "from_version", "mode"}
    d = _keys(data, "stored rollout device", keys, keys - {"told_at", "from_version", "mode"})
    mode = d.get("mode")
    return DeviceProgress(
        device_id=_stored_str(d["device_id"], "device.device_id") or "",
        stage=_stored_int(d["stage"], "device.stage"),
        phase=_stored_enum(d["phase"], "device.phase", DevicePhase),
        since=_stored_time(d["since"], "device.since") or 0.0,
        told_at=_stored_time(d.get("told_at"), "device.told_at", optional=True),
        from_version=_stored_str(d.get("from_version"), "device.from_version", optional=True),
        mode=_stored_enum(mode, "device.mode", StageMode) if mode is not None else None,
    )
