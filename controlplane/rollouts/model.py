"""The values a rollout is made of: its spec, its state, what the fleet shows, and what to do.

Everything here is a frozen dataclass or an enum with no I/O, so the engine
(:mod:`controlplane.rollouts.engine`) is a pure function of these values::

    step(spec, state, devices, metrics, now) -> Step(state, actions, decisions)

and the driver (:mod:`controlplane.rollouts.driver`) only translates: database rows into
:class:`DeviceFacts` and :class:`DeviceMetrics`, :class:`Action` into deployments, the new
:class:`RolloutState` and its :class:`Decision` list into rows. Times are Unix seconds (float).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field


class StageMode(str, enum.Enum):
    """How a stage's devices take the new version."""

    SWITCH = "switch"
    """The new version becomes the stable version."""
    CANARY = "canary"
    """The new version runs beside the old (stable) one and answers a share (``weight``)."""
    SHADOW = "shadow"
    """The new version runs on copies of the requests; the old one answers."""


class GateMetric(str, enum.Enum):
    """What a gate measures, and whether its threshold is a ceiling or a floor."""

    INSTALL_FAILURE_RATE = "install_failure_rate"
    """Devices of the stage whose download, install or activation of the new version failed,
    over the devices that settled (ceiling, 0..1)."""
    ERROR_RATE = "error_rate"
    """Failed requests over requests answered by the new version (ceiling, 0..1)."""
    LATENCY_P95_RATIO = "latency_p95_ratio"
    """p95 latency of the new version over p95 of the old one on the same devices (ceiling,
    > 0: 1.5 means at most 50 % slower)."""
    AGREEMENT = "agreement"
    """Share of shadowed requests where the new version agreed with the old (floor, 0..1);
    shadow stages only."""
    DRIFT = "drift"
    """Drift score of the new version's traffic against its bundle's baseline (ceiling, PSI):
    per device, the largest of input, class and confidence PSI of its drift reports summed
    since the stage started (:mod:`controlplane.drift.gate`); ``min_requests`` is the samples
    a device needs for a figure."""

    @property
    def is_floor(self) -> bool:
        return self is GateMetric.AGREEMENT


class FailAction(str, enum.Enum):
    ROLLBACK = "rollback"
    PAUSE = "pause"


@dataclass(frozen=True)
class Gate:
    """One check of a stage, judged only once ``min_devices`` devices reported valid figures
    and (for request-based metrics) ``min_requests`` requests were counted in the stage."""

    metric: GateMetric
    threshold: float
    min_devices: int = 1
    min_requests: int = 100
    on_fail: FailAction = FailAction.ROLLBACK
    dry_run: bool = False
    """Evaluated and shown, never acting (neither failing nor holding the stage)."""


@dataclass(frozen=True)
class Stage:
    """One step of a rollout: a size (``count`` devices or ``percent`` of the target, exactly
    one of them), how the devices take the version, and how long it bakes once all of them
    settled before its gates decide."""

    count: int | None = None
    percent: float | None = None
    mode: StageMode = StageMode.SWITCH
    weight: float = 0.1
    """Canary share of routed requests (``canary`` stages only)."""
    bake_s: float = 300.0
    prefetch: bool = False
    """Every device of the stage downloads and verifies first; then all switch together."""
    approval: bool = False
    """A human approves before the stage starts."""
    gates: tuple[Gate, ...] = ()


@dataclass(frozen=True)
class RateLimit:
    """At most ``per_minute`` devices told to move in any 60 s, times ``growth`` per stage
    (stage ``i`` allows ``per_minute * growth**i``). ``per_minute`` None: no limit."""

    per_minute: float | None = None
    growth: float = 1.0


@dataclass(frozen=True)
class Target:
    """Which devices: every criterion given must hold (an empty target is refused)."""

    devices: tuple[str, ...] = ()
    group: str | None = None
    labels: tuple[tuple[str, str], ...] = ()
    profiles: tuple[str, ...] = ()

    def is_empty(self) -> bool:
        return not (self.devices or self.group or self.labels or self.profiles)


@dataclass(frozen=True)
class RolloutSpec:
    """What an operator asked for. Validated by :mod:`controlplane.rollouts.spec`."""

    model: str
    version: str
    target: Target
    stages: tuple[Stage, ...]
    rate: RateLimit = RateLimit()
    device_timeout_s: float = 600.0
    """A device told to move that has not settled by then is skipped (counted, never waited
    for again); so is a device still offline that long after its stage started."""


class RolloutStatus(str, enum.Enum):
    RUNNING = "running"
    AWAITING_APPROVAL = "awaiting_approval"
    PAUSED = "paused"
    ROLLING_BACK = "rolling_back"
    SUCCEEDED = "succeeded"
    ROLLED_BACK = "rolled_back"
    ABORTED = "aborted"

    @property
    def ended(self) -> bool:
        return self in (RolloutStatus.SUCCEEDED, RolloutStatus.ROLLED_BACK, RolloutStatus.ABORTED)


class DevicePhase(str, enum.Enum):
    """Where one target device stands in the rollout."""

    WAITING = "waiting"
    """Not told anything yet (its stage has not started, it is offline, or the rate limit)."""
    PREFETCHING = "prefetching"
    """Told to download and verify the new version without running it."""
    PREFETCHED = "prefetched"
    MOVING = "moving"
    """Told to run the new version in its stage's mode; not yet reporting it."""
    ACTIVE = "active"
    """Reports the new version running in the stage's role."""
    FAILED = "failed"
    """Its download, install or activation of the new version failed."""
    SKIPPED = "skipped"
    """Offline or stuck past ``device_timeout_s``: counted and left out of the judgement."""
    REVERTING = "reverting"
    """Told to go back to the version it ran before the rollout."""
    REVERTED = "reverted"
    """Reports the old version again (or the timeout passed after it was told)."""

    @property
    def settled(self) -> bool:
        return self in (DevicePhase.ACTIVE, DevicePhase.FAILED, DevicePhase.SKIPPED)


@dataclass(frozen=True)
class DeviceProgress:
    device_id: str
    stage: int
    """The index of the stage the device belongs to (fixed when the rollout starts)."""
    phase: DevicePhase = DevicePhase.WAITING
    since: float = 0.0
    """When ``phase`` was entered."""
    told_at: float | None = None
    """When the device was first told to take the new version (its prefetch, or its move in a
    stage without prefetch): the rate limit's clock, and the mark of a device the rollout
    touched. Later tells (the move after a prefetch, the final switch, a revert) change
    ``phase`` and ``since`` only, so they never count against the rate limit."""
    from_version: str | None = None
    """The stable version it should run before the rollout (None: it had none)."""
    mode: StageMode | None = None
    """The mode it was last told to run the new version in."""


@dataclass(frozen=True)
class GateResult:
    metric: GateMetric
    verdict: str
    """``pass``, ``fail``, ``pending`` (below its minimum samples, the bake still running) or
    ``inconclusive`` (still below its minimum when the bake ended)."""
    value: float | None
    threshold: float
    devices: int
    requests: int
    dry_run: bool
    reason: str


@dataclass(frozen=True)
class RolloutState:
    status: RolloutStatus
    stage: int = 0
    stage_started_at: float | None = None
    bake_started_at: float | None = None
    """When every device of the current stage settled; the bake runs from there."""
    approved: frozenset[int] = frozenset()
    """Stages a human approved (those with ``approval``)."""
    devices: Mapping[str, DeviceProgress] = field(default_factory=dict)
    gates: tuple[GateResult, ...] = ()
    """The last evaluation of the current stage's gates."""
    reason: str = ""
    """Why the rollout is in its status, for a human."""
    finalized: bool = False
    """On success: devices of canary and shadow stages were told to switch."""
    reported_invalid: frozenset[str] = frozenset()
    """Devices of the current stage whose invalid figures an ``ignored_stats`` decision already
    named (so the decision comes once per device and stage)."""
    reported_dry_run: frozenset[GateMetric] = frozenset()
    """Dry-run gates of the current stage whose failure a decision already reported."""


@dataclass(frozen=True)
class DeviceFacts:
    """What the control plane knows of one target device now (for the rollout's model)."""

    device_id: str
    online: bool
    active_version: str | None = None
    """The stable version it reports running."""
    canary_version: str | None = None
    shadow_version: str | None = None
    installed_versions: tuple[str, ...] = ()
    desired_version: str | None = None
    """The stable version the control plane tells it to run now."""
    failed_versions: frozenset[str] = frozenset()
    """Versions whose download, install or activation it reported failed (since it was last
    told to move)."""


@dataclass(frozen=True)
class VersionStats:
    """One device's counters of one version over the judged window."""

    requests: int = 0
    errors: int = 0
    p95_ms: float | None = None
    latency_edges_ms: tuple[float, ...] = ()
    latency_counts: tuple[int, ...] = ()
    """len(edges) + 1 buckets: ``counts[i]`` answered requests at or below ``edges[i]``, the
    last one above the last edge. Failed and rejected requests have no latency, so the buckets
    hold at most ``requests``."""
    shadow_compared: int = 0
    shadow_agreed: int = 0


@dataclass(frozen=True)
class DeviceMetrics:
    """What one device measured since it moved: ``new`` the rollout's version, ``old`` the
    version it ran before (beside it for canary/shadow, before the move for switch)."""

    device_id: str
    new: VersionStats | None = None
    old: VersionStats | None = None
    drift: float | None = None
    """The new version's drift score since the stage started (None: no figure yet)."""


class ActionKind(str, enum.Enum):
    PREFETCH = "prefetch"
    """Tell the devices to download and verify ``version`` without running it."""
    MOVE = "move"
    """Tell the devices to run the new version in ``mode`` (``weight`` for a canary)."""
    REVERT = "revert"
    """Tell each device to go back to its ``from_version`` (or drop the model: None)."""


@dataclass(frozen=True)
class Action:
    kind: ActionKind
    device_ids: tuple[str, ...]
    mode: StageMode | None = None
    weight: float | None = None


@dataclass(frozen=True)
class Decision:
    """One thing that happened, for the history and the webhooks."""

    at: float
    kind: str
    """``stage_started``, ``awaiting_approval``, ``bake_started``, ``gate_passed``,
    ``gate_failed``, ``gate_inconclusive``, ``devices_skipped``, ``devices_failed``,
    ``paused``, ``resumed``, ``promoted``, ``approved``, ``rolling_back``, ``rolled_back``,
    ``aborted``, ``succeeded``, ``stage_passed``, ``ignored_stats``."""
    reason: str
    stage: int | None = None
    detail: Mapping[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class Step:
    state: RolloutState
    actions: tuple[Action, ...] = ()
    decisions: tuple[Decision, ...] = ()
