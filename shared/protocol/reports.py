"""What a device sends upstream on its steady path, as plain values encoded without pydantic.

An enrolled agent sends a health sample every ``health_interval_s``, inference statistics every
``inference_interval_s``, its reported state after each change and a deployment event for every
step of a deployment. It builds them as the frozen dataclasses here and encodes them with
:func:`encode_report` (orjson), so a running agent never loads pydantic and the message models
(about 10 MiB of RSS) for what it says about itself; see :mod:`shared.protocol.wire` for the
same rule on the serving path.

Each class is the plain twin of a pydantic message, field for field, in the same order and
keyword-only (the model is the schema the control plane validates against and the documents
describe)::

    HealthReport         telemetry.HealthSample        (GpuReport: telemetry.GpuSample)
    InferenceReport      telemetry.InferenceStats      (ModelInferenceReport, LatencyReport)
    StateReport          state.ReportedState           (ModelStatusReport: state.ModelStatus)
    EventReport          state.DeploymentEvent

:func:`encode_report` writes the same bytes as ``encode(Model(...))`` would: fields in the
model's order, ``None`` fields left out, float fields as floats (an ``int`` given for one is
written ``5.0``), enums as their values. The unit tests check that on random values. These
values are built by the agent itself and are not validated here; the control plane validates
what arrives.

The enums the state machine and the reports share (:class:`DeploymentPhase`,
:class:`EventOutcome`) live here too, so the update agent's pure core needs no pydantic either,
and so does :class:`InferenceRole` (the part a version played for the requests its statistics
count), which the agent's statistics collector builds its reports with.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Union

import orjson

__all__ = [
    "DeploymentPhase", "EventOutcome", "EventReport", "GpuReport", "HealthReport",
    "InferenceReport", "InferenceRole", "LatencyReport", "ModelInferenceReport", "ModelStatusReport", "Report",
    "StateReport", "as_wire", "encode_report",
]  # fmt: skip


class DeploymentPhase(str, enum.Enum):
    """States of the agent's update state machine (DESIGN 4.5)."""

    IDLE = "idle"
    DOWNLOADING = "downloading"
    VERIFYING = "verifying"
    INSTALLING = "installing"
    LOADING = "loading"
    WARMING = "warming"
    ACTIVE = "active"
    ROLLING_BACK = "rolling_back"
    FAILED = "failed"


class EventOutcome(str, enum.Enum):
    PROGRESS = "progress"
    OK = "ok"
    ERROR = "error"


class InferenceRole(str, enum.Enum):
    """The part a model version played for the requests its statistics count (DESIGN 4.6)."""

    STABLE = "stable"
    """Answered the requests routed to the model (and a canary's failures handed to it)."""
    CANARY = "canary"
    """Answered its weighted share of routed requests, or requests pinned to it."""
    SHADOW = "shadow"
    """Ran copies of stable's requests; its answers were compared, never sent."""


# ------------------------------------------------------------------------------- telemetry
@dataclass(frozen=True, slots=True, kw_only=True)
class GpuReport:
    """GPU figures of a health sample (:class:`~shared.protocol.telemetry.GpuSample`)."""

    util_percent: float | None = None
    mem_used_mb: float | None = None
    mem_total_mb: float | None = None
    emc_percent: float | None = None
    power_mw: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class HealthReport:
    """One health reading (:class:`~shared.protocol.telemetry.HealthSample`); ``ts`` in Unix
    seconds, sizes in MiB, ``energy_j`` cumulative Joules."""

    device_id: str
    ts: float
    cpu_percent: float
    load_1m: float | None = None
    mem_total_mb: float
    mem_used_mb: float
    disk_total_mb: float | None = None
    disk_free_mb: float | None = None
    process_rss_mb: float | None = None
    uptime_s: float | None = None
    temperatures_c: dict[str, float] = field(default_factory=dict)
    gpu: GpuReport | None = None
    energy_j: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class LatencyReport:
    """Latency percentiles in milliseconds (:class:`~shared.protocol.telemetry.LatencySummary`)."""

    p50_ms: float
    p95_ms: float
    p99_ms: float


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelInferenceReport:
    """Counters of one model version in one role over one window
    (:class:`~shared.protocol.telemetry.ModelInferenceStats`); latencies in milliseconds."""

    model: str
    version: str
    role: InferenceRole = InferenceRole.STABLE
    count: int
    errors: int
    rejections: int = 0
    latency: LatencyReport | None = None
    latency_bucket_edges_ms: list[float] = field(default_factory=list)
    latency_bucket_counts: list[int] = field(default_factory=list)
    queue_depth: int = 0
    batch_size_avg: float | None = None
    batch_fill_ratio: float | None = None
    shadow_compared: int = 0
    shadow_agreed: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class InferenceReport:
    """Inference statistics of one window of ``window_s`` seconds
    (:class:`~shared.protocol.telemetry.InferenceStats`)."""

    device_id: str
    ts: float
    window_s: float
    models: list[ModelInferenceReport] = field(default_factory=list)


# ------------------------------------------------------------------------------- state, events
@dataclass(frozen=True, slots=True, kw_only=True)
class ModelStatusReport:
    """One model in the reported state (:class:`~shared.protocol.state.ModelStatus`)."""

    name: str
    phase: DeploymentPhase = DeploymentPhase.IDLE
    active_version: str | None = None
    canary_version: str | None = None
    shadow_version: str | None = None
    installed_versions: list[str] = field(default_factory=list)
    last_error: str | None = None
    active_variant: str | None = None
    active_backend: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class StateReport:
    """What the device runs (:class:`~shared.protocol.state.ReportedState`); ``ts`` in Unix s."""

    device_id: str
    ts: float
    applied_seq: int
    profile: str
    backends: list[str] = field(default_factory=list)
    agent_version: str = ""
    models: list[ModelStatusReport] = field(default_factory=list)


@dataclass(frozen=True, slots=True, kw_only=True)
class EventReport:
    """One step of a deployment (:class:`~shared.protocol.state.DeploymentEvent`); ``ts`` in
    Unix seconds, ``elapsed_ms`` in milliseconds."""

    device_id: str
    event_seq: int
    ts: float
    model: str
    version: str
    phase: DeploymentPhase
    outcome: EventOutcome
    message: str = ""
    cause: str | None = None
    bytes_done: int | None = None
    bytes_total: int | None = None
    elapsed_ms: float | None = None


Report = HealthReport | InferenceReport | StateReport | EventReport
"""A message the agent sends upstream on its own."""

_Convert = Callable[[Any], Any]


def as_wire(report: Any) -> dict[str, Any]:
    """``report`` (any dataclass above) as the JSON object its model encodes to."""
    out: dict[str, Any] = {}
    for name, convert in _plan(type(report)):
        value = getattr(report, name)
        if value is not None:
            out[name] = value if convert is None else convert(value)
    return out


def encode_report(report: Any) -> bytes:
    """Compact JSON bytes of ``report``: a :data:`Report` (or a part of one), or a pydantic
    :class:`~shared.protocol.base.Message` (encoded by its model, as
    :func:`shared.protocol.codec.encode` does). Raises TypeError for anything else."""
    if dataclasses.is_dataclass(report) and not isinstance(report, type):
        return orjson.dumps(as_wire(report))
    dump = getattr(report, "model_dump_json", None)
    if dump is None:
        raise TypeError(f"not a report or a message: {type(report).__name__}")
    return typing.cast(str, dump(exclude_none=True)).encode("utf-8")


_Plan = tuple[tuple[str, _Convert | None], ...]
_PLANS: dict[type, _Plan] = {}


def _plan(cls: type) -> _Plan:
    """``(field, converter)`` in wire order; the converter is None where the value goes as is.
    Worked out once per class, from its type hints."""
    plan = _PLANS.get(cls)
    if plan is None:
        hints = typing.get_type_hints(cls)
        fields = dataclasses.fields(cls)
        plan = _PLANS[cls] = tuple((f.name, _converter(hints[f.name])) for f in fields)
    return plan


def _converter(hint: Any) -> _Convert | None:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        (hint,) = [a for a in args if a is not type(None)]
        origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is float:
        return float
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return _enum_value
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return as_wire
    if origin is list:
        item = _converter(args[0])
        return list if item is None else functools.partial(_each, item)
    if origin is dict:
        value = _converter(args[1])
        return dict if value is None else functools.partial(_each_value, value)
    return None


def _enum_value(member: enum.Enum) -> Any:
    return member.value


def _each(convert: _Convert, items: Any) -> list[Any]:
    return [convert(x) for x in items]


def _each_value(convert: _Convert, mapping: Any) -> dict[str, Any]:
    return {k: convert(v) for k, v in mapping.items()}
