"""The staged-rollout engine: ``step(spec, state, devices, metrics, now) -> Step`` (pure: no
I/O, no clock; ``now`` is given in Unix seconds).

The driver calls :func:`start` once, then :func:`step` whenever something may have changed
(a report came in, a timer fired), and :func:`command` for an operator's command. Each returns
the next :class:`~.model.RolloutState`, the :class:`~.model.Action` list to carry out and the
:class:`~.model.Decision` list to record. A step runs to a fixed point: called again with what
it returned and the same inputs and ``now``, it returns no action and no decision.

The machine (stage indexes are 0-based in values, 1-based in reasons)::

    start ─▶ running (stage 0) | awaiting_approval (stage 0 needs approval)
    running: tell the stage's devices ─▶ they settle ─▶ bake ─▶ gates
        all gates pass when the bake ended ─▶ next stage: running | awaiting_approval
        after the last stage: canary/shadow devices told to switch ─▶ succeeded
        a gate fails (at once, even mid-bake) ─▶ rolling_back (on_fail rollback) | paused
        a gate still below its minimum when the bake ended ─▶ paused (never passes by default)
    rolling_back: every touched device told to revert ─▶ they report it ─▶ rolled_back
    commands: pause, resume, approve, promote, abort, rollback (see :func:`command`)

A device of a stage: ``waiting`` ─tell─▶ ``moving`` (or ``prefetching`` ─▶ ``prefetched``,
then all the stage's devices move together) ─▶ ``active`` | ``failed`` | ``skipped``; on
rollback ─▶ ``reverting`` ─▶ ``reverted``. A waiting device is told only while online; offline
``device_timeout_s`` after its stage started it is skipped, and so is a device that does not
report the version (or the prefetch, or the revert) that long after it was told.

Rate limit: at most ``max(1, floor(per_minute * growth**stage))`` devices whose ``told_at`` is
in the last 60 s; ``told_at`` is a device's first tell (its prefetch, or its move in a stage
without prefetch). The move after a prefetch, the final switch and reverts are not limited:
the first were counted already, and a rollback must be fast.

Gates are judged by :mod:`.gates` over the stage's devices, from the moment all of them
settled. Dry-run gates are judged and shown but never act or hold a stage; a failing one is
reported once per stage.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from mcp_edge.controlplane.rollouts.gates import evaluate_gate, invalid_reason
from mcp_edge.controlplane.rollouts.model import (
    Action,
    ActionKind,
    Decision,
    DeviceFacts,
    DeviceMetrics,
    DevicePhase,
    DeviceProgress,
    FailAction,
    GateResult,
    RolloutSpec,
    RolloutState,
    RolloutStatus,
    Stage,
    StageMode,
    Step,
)
from mcp_edge.controlplane.rollouts.spec import SpecError, plan_stage_sizes
from mcp_edge.shared.errors import McpError

__all__ = [
    "COMMANDS",
    "CommandError",
    "SpecError",
    "command",
    "order_devices",
    "plan_stage_sizes",
    "rate_limit",
    "reverted",
    "runs_version",
    "start",
    "step",
]

RATE_WINDOW_S = 60.0
_LISTED = 20
"""Device ids named in a decision's reason; its ``detail`` lists up to :data:`_DETAILED`."""
_DETAILED = 1000
_S = RolloutStatus
_P = DevicePhase


class CommandError(McpError):
    """An operator's command does not apply to the rollout in its status."""


@functools.lru_cache(maxsize=1 << 16)
def _key(model: str, device_id: str) -> str:
    return hashlib.sha256(f"{model}/{device_id}".encode()).hexdigest()


def order_devices(model: str, device_ids: Iterable[str]) -> list[str]:
    """``device_ids`` in the rollout order of ``model``: by sha256 of ``model/device_id``, so
    the same devices go first on every run and for every version of the model, and another
    model spreads its first stages over other devices."""
    return sorted(device_ids, key=lambda d: (_key(model, d), d))


def rate_limit(spec: RolloutSpec, stage: int) -> int | None:
    """Devices at most first told in any 60 s during ``stage`` (None: no limit)."""
    per_minute = spec.rate.per_minute
    if per_minute is None:
        return None
    return max(1, math.floor(per_minute * spec.rate.growth**stage))


def runs_version(facts: DeviceFacts, version: str, mode: StageMode) -> bool:
    """Whether the device reports ``version`` in the role of ``mode``."""
    role = {
        StageMode.SWITCH: facts.active_version,
        StageMode.CANARY: facts.canary_version,
        StageMode.SHADOW: facts.shadow_version,
    }
    return role[mode] == version


def _describe(spec: RolloutSpec, index: int, devices: int, what: str) -> str:
    s = spec.stages[index]
    how = f"canary at weight {s.weight:g}" if s.mode is StageMode.CANARY else s.mode.value
    prefetch = ", prefetching first" if s.prefetch else ""
    return f"stage {index + 1} of {len(spec.stages)} {what}: {devices} device(s), {how}{prefetch}"


def _ids(ids: Sequence[str]) -> str:
    shown = ", ".join(ids[:_LISTED])
    return shown + (f" and {len(ids) - _LISTED} more" if len(ids) > _LISTED else "")


@dataclass
class _Run:
    """One call's inputs and what it produced so far."""

    spec: RolloutSpec
    facts: Mapping[str, DeviceFacts]
    metrics: Mapping[str, DeviceMetrics]
    now: float
    actions: list[Action] = field(default_factory=list)
    decisions: list[Decision] = field(default_factory=list)

    def decide(self, kind: str, reason: str, stage: int | None, **detail: object) -> None:
        self.decisions.append(Decision(self.now, kind, reason, stage, detail))

    def act(
        self,
        kind: ActionKind,
        ids: Sequence[str],
        mode: StageMode | None = None,
        weight: float | None = None,
    ) -> None:
        if ids:
            self.actions.append(Action(kind, tuple(ids), mode, weight))


def _moved(p: DeviceProgress, phase: DevicePhase, now: float) -> DeviceProgress:
    return replace(p, phase=phase, since=now)


# ------------------------------------------------------------------------------------ start
def start(spec: RolloutSpec, targets: Sequence[DeviceFacts], now: float) -> Step:
    """Plan a rollout of ``spec`` over ``targets``: stage sizes, each device's stage (in
    :func:`order_devices` order) and the version it returns to on rollback (the stable version
    the control plane gives it now, else the one it runs). Tells no device: the first
    :func:`step` does.

    Raises :class:`~.spec.SpecError` when the stage sizes do not fit the target or a device is
    listed twice.
    """
    facts: dict[str, DeviceFacts] = {}
    for t in targets:
        if t.device_id in facts:
            raise SpecError(f"device {t.device_id!r} is listed twice among the targets")
        facts[t.device_id] = t
    sizes = plan_stage_sizes(spec, len(facts))
    order = order_devices(spec.model, facts)
    devices: dict[str, DeviceProgress] = {}
    first = 0
    for index, size in enumerate(sizes):
        for d in order[first : first + size]:
            f = facts[d]
            devices[d] = DeviceProgress(
                d, index, since=now, from_version=f.desired_version or f.active_version
            )
        first += size
    run = _Run(spec, facts, {}, now)
    state = RolloutState(_S.RUNNING, devices=devices)
    state = _enter_stage(run, state, 0)
    return Step(state, tuple(run.actions), tuple(run.decisions))


def _enter_stage(run: _Run, state: RolloutState, index: int) -> RolloutState:
    """Make ``index`` the current stage: it starts, or awaits its approval."""
    n = sum(p.stage == index for p in state.devices.values())
    state = replace(
        state,
        stage=index,
        bake_started_at=None,
        gates=(),
        reported_invalid=frozenset(),
        reported_dry_run=frozenset(),
    )
    if run.spec.stages[index].approval and index not in state.approved:
        reason = _describe(run.spec, index, n, "awaits approval")
        run.decide("awaiting_approval", reason, index, devices=n)
        return replace(state, status=_S.AWAITING_APPROVAL, stage_started_at=None, reason=reason)
    reason = _describe(run.spec, index, n, "starts")
    run.decide("stage_started", reason, index, devices=n)
    return replace(state, status=_S.RUNNING, stage_started_at=run.now, reason=reason)


# ------------------------------------------------------------------------------------- step
def step(
    spec: RolloutSpec,
    state: RolloutState,
    devices: Mapping[str, DeviceFacts],
    metrics: Mapping[str, DeviceMetrics],
    now: float,
) -> Step:
    """Advance a running or rolling-back rollout as far as ``devices`` (what the fleet shows,
    by device id; a device missing counts as offline) and ``metrics`` (by device id) allow at
    ``now``. Any other status returns ``state`` unchanged with nothing to do."""
    if state.status not in (_S.RUNNING, _S.ROLLING_BACK):
        return Step(state)
    run = _Run(spec, devices, metrics, now)
    rounds = 8 * len(spec.stages) + 16
    for _ in range(rounds):
        before = (len(run.actions), len(run.decisions))
        if state.status is _S.RUNNING:
            nxt = _running(run, state)
        elif state.status is _S.ROLLING_BACK:
            nxt = _rolling_back(run, state)
        else:
            nxt = state
        if nxt == state and before == (len(run.actions), len(run.decisions)):
            return Step(state, tuple(run.actions), tuple(run.decisions))
        state = nxt
    raise RuntimeError(f"the rollout engine found no fixed point in {rounds} rounds")


def _track(run: _Run, p: DeviceProgress) -> DeviceProgress:
    """A told device's next phase from what the fleet shows, or by its timeout."""
    version = run.spec.version
    f = run.facts.get(p.device_id)
    failed = f is not None and version in f.failed_versions
    timed_out = run.now - p.since >= run.spec.device_timeout_s
    if p.phase is _P.PREFETCHING:
        if f is not None and version in f.installed_versions:
            return _moved(p, _P.PREFETCHED, run.now)
        if failed:
            return _moved(p, _P.FAILED, run.now)
        return _moved(p, _P.SKIPPED, run.now) if timed_out else p
    if p.phase is _P.MOVING:
        if f is not None and runs_version(f, version, p.mode or StageMode.SWITCH):
            return _moved(p, _P.ACTIVE, run.now)
        if failed:
            return _moved(p, _P.FAILED, run.now)
        return _moved(p, _P.SKIPPED, run.now) if timed_out else p
    if p.phase is _P.ACTIVE and failed:
        assert f is not None
        if not runs_version(f, version, p.mode or StageMode.SWITCH):
            return _moved(p, _P.FAILED, run.now)
    return p


def _track_all(run: _Run, state: RolloutState) -> dict[str, DeviceProgress]:
    devs = dict(state.devices)
    failed: list[str] = []
    skipped: list[str] = []
    for d, p in state.devices.items():
        if p.phase in (_P.PREFETCHING, _P.MOVING, _P.ACTIVE):
            q = _track(run, p)
            if q is not p:
                devs[d] = q
                if q.phase is _P.FAILED:
                    failed.append(d)
                elif q.phase is _P.SKIPPED:
                    skipped.append(d)
    version, timeout = run.spec.version, run.spec.device_timeout_s
    if failed:
        failed = order_devices(run.spec.model, failed)
        run.decide(
            "devices_failed",
            f"{len(failed)} device(s) failed to install or run {version}: {_ids(failed)}",
            state.stage,
            count=len(failed),
            devices=failed[:_DETAILED],
        )
    if skipped:
        skipped = order_devices(run.spec.model, skipped)
        run.decide(
            "devices_skipped",
            f"{len(skipped)} device(s) skipped: told {version} and not reporting it "
            f"{timeout:g} s later: {_ids(skipped)}",
            state.stage,
            count=len(skipped),
            devices=skipped[:_DETAILED],
        )
    return devs


def _running(run: _Run, state: RolloutState) -> RolloutState:
    devs = _track_all(run, state)
    if state.finalized:
        if any(p.phase is _P.MOVING for p in devs.values()):
            return replace(state, devices=devs)
        return _succeed(run, replace(state, devices=devs))
    index = state.stage
    stage = run.spec.stages[index]
    mine = [
        devs[d]
        for d in order_devices(run.spec.model, (d for d, p in devs.items() if p.stage == index))
    ]
    _skip_offline(run, state, devs, mine)
    _tell(run, state, devs, mine, stage)
    mine = [devs[p.device_id] for p in mine]
    if stage.prefetch and not any(p.phase in (_P.WAITING, _P.PREFETCHING) for p in mine):
        ready = [p.device_id for p in mine if p.phase is _P.PREFETCHED]
        _move(run, devs, ready, stage)
        mine = [devs[p.device_id] for p in mine]
    state = replace(state, devices=devs)
    if state.bake_started_at is None:
        if not all(p.phase.settled for p in mine):
            return state
        counts = {
            ph.value: sum(p.phase is ph for p in mine) for ph in (_P.ACTIVE, _P.FAILED, _P.SKIPPED)
        }
        run.decide(
            "bake_started",
            f"stage {index + 1} of {len(run.spec.stages)}: all {len(mine)} device(s) "
            f"settled ({', '.join(f'{n} {k}' for k, n in counts.items())}); baking "
            f"{stage.bake_s:g} s",
            index,
            **counts,
        )
        state = replace(state, bake_started_at=run.now)
    return _judge(run, state, mine, stage)


def _skip_offline(
    run: _Run, state: RolloutState, devs: dict[str, DeviceProgress], mine: list[DeviceProgress]
) -> None:
    started = state.stage_started_at if state.stage_started_at is not None else run.now
    if run.now - started < run.spec.device_timeout_s:
        return
    gone = [p.device_id for p in mine if p.phase is _P.WAITING and not _online(run, p.device_id)]
    for d in gone:
        devs[d] = _moved(devs[d], _P.SKIPPED, run.now)
    if gone:
        run.decide(
            "devices_skipped",
            f"{len(gone)} device(s) skipped: still offline "
            f"{run.spec.device_timeout_s:g} s after stage {state.stage + 1} started: "
            f"{_ids(gone)}",
            state.stage,
            count=len(gone),
            devices=gone[:_DETAILED],
        )


def _online(run: _Run, device_id: str) -> bool:
    f = run.facts.get(device_id)
    return f is not None and f.online


def _tell(
    run: _Run,
    state: RolloutState,
    devs: dict[str, DeviceProgress],
    mine: list[DeviceProgress],
    stage: Stage,
) -> None:
    ready = [p.device_id for p in mine if p.phase is _P.WAITING and _online(run, p.device_id)]
    limit = rate_limit(run.spec, state.stage)
    if limit is not None:
        window = sum(
            p.told_at is not None and p.told_at > run.now - RATE_WINDOW_S for p in devs.values()
        )
        ready = ready[: max(0, limit - window)]
    if not ready:
        return
    if stage.prefetch:
        for d in ready:
            devs[d] = replace(devs[d], phase=_P.PREFETCHING, since=run.now, told_at=run.now)
        run.act(ActionKind.PREFETCH, ready)
        return
    for d in ready:
        devs[d] = replace(devs[d], told_at=run.now)
    _move(run, devs, ready, stage)


def _weight(mode: StageMode, stage: Stage) -> float | None:
    return stage.weight if mode is StageMode.CANARY else None


def _mode_of(p: DeviceProgress, stage: Stage) -> StageMode:
    """A device that had no version of the model has nothing to run beside a canary or a
    shadow: it switches."""
    return stage.mode if p.from_version is not None else StageMode.SWITCH


def _move(run: _Run, devs: dict[str, DeviceProgress], ids: Sequence[str], stage: Stage) -> None:
    """Tell devices to run the new version in the stage's mode (each mode one action)."""
    by_mode: dict[StageMode, list[str]] = {}
    for d in ids:
        by_mode.setdefault(_mode_of(devs[d], stage), []).append(d)
    for mode, group in by_mode.items():
        for d in group:
            devs[d] = replace(devs[d], phase=_P.MOVING, since=run.now, mode=mode)
        run.act(ActionKind.MOVE, group, mode, _weight(mode, stage))


def _gate_detail(r: GateResult) -> dict[str, object]:
    """A gate's figures for a decision's detail (JSON: a non-finite value is left out)."""
    value = r.value if r.value is not None and math.isfinite(r.value) else None
    return {
        "metric": r.metric.value,
        "value": value,
        "threshold": r.threshold,
        "devices": r.devices,
        "requests": r.requests,
        "dry_run": r.dry_run,
    }


def _judge(
    run: _Run, state: RolloutState, mine: list[DeviceProgress], stage: Stage
) -> RolloutState:
    assert state.bake_started_at is not None
    index = state.stage
    ended = run.now >= state.bake_started_at + stage.bake_s
    results = tuple(evaluate_gate(g, mine, run.metrics, bake_ended=ended) for g in stage.gates)
    state = replace(state, gates=results)
    state = _report_invalid(run, state, mine)
    dry = [
        r
        for r in results
        if r.dry_run and r.verdict == "fail" and r.metric not in state.reported_dry_run
    ]
    for r in dry:
        run.decide("gate_failed", f"dry run: not acting: {r.reason}", index, **_gate_detail(r))
    if dry:
        state = replace(state, reported_dry_run=state.reported_dry_run | {r.metric for r in dry})
    acting = [r for r in results if not r.dry_run]
    failing = [r for r in acting if r.verdict == "fail"]
    if failing:
        for r in failing:
            run.decide("gate_failed", r.reason, index, **_gate_detail(r))
        on_fail = {g.metric: g.on_fail for g in stage.gates}
        reason = "; ".join(r.reason for r in failing)
        if any(on_fail[r.metric] is FailAction.ROLLBACK for r in failing):
            return _rollback(run, state, f"stage {index + 1} failed: {reason}")
        reason = f"stage {index + 1} paused: {reason}"
        run.decide("paused", reason, index)
        return replace(state, status=_S.PAUSED, reason=reason)
    if not ended:
        return state
    open_ = [r for r in acting if r.verdict != "pass"]
    if open_:
        for r in open_:
            run.decide("gate_inconclusive", r.reason, index, **_gate_detail(r))
        reason = "; ".join(r.reason for r in open_)
        run.decide("paused", reason, index)
        return replace(state, status=_S.PAUSED, reason=reason)
    for r in acting:
        run.decide("gate_passed", r.reason, index, **_gate_detail(r))
    gates = f"its {len(acting)} gate(s) passed" if acting else "it has no gate"
    return _pass_stage(run, state, f"{gates} after a {stage.bake_s:g} s bake")


def _report_invalid(run: _Run, state: RolloutState, mine: list[DeviceProgress]) -> RolloutState:
    found: dict[str, str] = {}
    for p in mine:
        m = run.metrics.get(p.device_id)
        if p.phase is _P.ACTIVE and m is not None and p.device_id not in state.reported_invalid:
            why = invalid_reason(p.device_id, m)
            if why is not None:
                found[p.device_id] = why
    if not found:
        return state
    listed = "; ".join(f"{d}: {why}" for d, why in list(found.items())[:_LISTED])
    run.decide(
        "ignored_stats",
        f"figures of {len(found)} device(s) ignored as inconsistent: {listed}",
        state.stage,
        count=len(found),
        devices=dict(list(found.items())[:_DETAILED]),
    )
    return replace(state, reported_invalid=state.reported_invalid | found.keys())


def _pass_stage(run: _Run, state: RolloutState, why: str) -> RolloutState:
    index = state.stage
    total = len(run.spec.stages)
    if index + 1 < total:
        run.decide("stage_passed", f"stage {index + 1} of {total} passed: {why}", index)
        return _enter_stage(run, state, index + 1)
    devs = dict(state.devices)
    # Canary and shadow devices switch; a skipped one that was told is told again (its
    # retained desired state then names the switch when it comes back) but not waited for.
    switch = [
        d
        for d in order_devices(run.spec.model, devs)
        if devs[d].mode in (StageMode.CANARY, StageMode.SHADOW)
        and (
            devs[d].phase is _P.ACTIVE
            or (devs[d].phase is _P.SKIPPED and devs[d].told_at is not None)
        )
    ]
    for d in switch:
        phase = _P.MOVING if devs[d].phase is _P.ACTIVE else devs[d].phase
        devs[d] = replace(devs[d], phase=phase, since=run.now, mode=StageMode.SWITCH)
    run.act(ActionKind.MOVE, switch, StageMode.SWITCH)
    then = f"; {len(switch)} canary/shadow device(s) told to switch" if switch else ""
    reason = f"stage {index + 1} of {total} passed: {why}{then}"
    run.decide("stage_passed", reason, index, switching=len(switch))
    return replace(state, devices=devs, finalized=True, reason=reason)


def _succeed(run: _Run, state: RolloutState) -> RolloutState:
    phases = [p.phase for p in state.devices.values()]
    counts = {ph.value: phases.count(ph) for ph in (_P.ACTIVE, _P.FAILED, _P.SKIPPED, _P.WAITING)}
    reason = (
        f"rollout of {run.spec.model} {run.spec.version} succeeded: {counts['active']} device(s) "
        f"run it; {counts['failed']} failed, {counts['skipped'] + counts['waiting']} skipped"
    )
    run.decide("succeeded", reason, state.stage, **counts)
    return replace(state, status=_S.SUCCEEDED, reason=reason)


# ----------------------------------------------------------------------------- rolling back
def _rollback(run: _Run, state: RolloutState, why: str) -> RolloutState:
    """Tell every device the rollout touched (and not reverted yet) to go back."""
    devs = dict(state.devices)
    back = [
        d
        for d in order_devices(run.spec.model, devs)
        if devs[d].told_at is not None and devs[d].phase is not _P.REVERTED
    ]
    for d in back:
        devs[d] = _moved(devs[d], _P.REVERTING, run.now)
    run.act(ActionKind.REVERT, back)
    reason = f"rolling back {len(back)} device(s): {why}"
    run.decide("rolling_back", reason, state.stage, devices=len(back))
    return replace(state, status=_S.ROLLING_BACK, devices=devs, reason=reason)


def reverted(facts: DeviceFacts, progress: DeviceProgress, version: str) -> bool:
    """Whether the device runs its version from before the rollout again (or no version of
    the model, when it had none) and no canary or shadow of ``version``."""
    return (
        facts.active_version == progress.from_version
        and facts.canary_version != version
        and facts.shadow_version != version
    )


def _rolling_back(run: _Run, state: RolloutState) -> RolloutState:
    devs = dict(state.devices)
    unconfirmed: list[str] = []
    for d, p in state.devices.items():
        if p.phase is not _P.REVERTING:
            continue
        f = run.facts.get(d)
        if f is not None and reverted(f, p, run.spec.version):
            devs[d] = _moved(p, _P.REVERTED, run.now)
        elif run.now - p.since >= run.spec.device_timeout_s:
            devs[d] = _moved(p, _P.REVERTED, run.now)
            unconfirmed.append(d)
    if unconfirmed:
        unconfirmed = order_devices(run.spec.model, unconfirmed)
        run.decide(
            "devices_skipped",
            f"{len(unconfirmed)} device(s) did not confirm the revert within "
            f"{run.spec.device_timeout_s:g} s; counted as reverted, not confirmed: "
            f"{_ids(unconfirmed)}",
            state.stage,
            count=len(unconfirmed),
            devices=unconfirmed[:_DETAILED],
            confirmed=False,
        )
    state = replace(state, devices=devs)
    if any(p.phase is _P.REVERTING for p in devs.values()):
        return state
    return _rolled_back(run, state)


def _rolled_back(run: _Run, state: RolloutState) -> RolloutState:
    n = sum(p.phase is _P.REVERTED for p in state.devices.values())
    reason = f"rolled back: {n} device(s) reverted to the version they ran before"
    run.decide("rolled_back", reason, state.stage, devices=n)
    return replace(state, status=_S.ROLLED_BACK, reason=reason)


# --------------------------------------------------------------------------------- commands
COMMANDS: dict[str, frozenset[RolloutStatus]] = {
    "pause": frozenset({_S.RUNNING, _S.AWAITING_APPROVAL}),
    "resume": frozenset({_S.PAUSED}),
    "abort": frozenset(s for s in _S if not s.ended),
    "promote": frozenset({_S.RUNNING, _S.PAUSED, _S.AWAITING_APPROVAL}),
    "approve": frozenset({_S.AWAITING_APPROVAL}),
    "rollback": frozenset({*(s for s in _S if not s.ended), _S.SUCCEEDED}),
}
"""Each operator command and the statuses it applies in."""


def _refuse(state: RolloutState, op: str) -> CommandError:
    status = state.status.value
    if state.status is _S.SUCCEEDED:
        return CommandError(f"rollout is {status}; only rollback applies")
    if state.status.ended:
        return CommandError(f"rollout is {status}; it has ended and takes no command")
    where = " or ".join(sorted(s.value for s in COMMANDS[op]))
    return CommandError(f"rollout is {status}; {op} applies to a rollout that is {where}")


def command(
    spec: RolloutSpec, state: RolloutState, op: str, now: float, *, actor: str, reason: str = ""
) -> Step:
    """Apply an operator's command ``op`` (a key of :data:`COMMANDS`) at ``now``:

    * ``pause``: running or awaiting approval ─▶ paused.
    * ``resume``: paused ─▶ running (awaiting approval when the stage had not started); a bake
      that had begun starts again at ``now``.
    * ``abort``: any status not ended ─▶ aborted; no action, devices stay where they are.
    * ``promote``: the current stage counts as passed now, skipping its bake and gates (its
      devices not told yet are skipped; prefetched ones are told to move), and the next stage
      starts or awaits its approval; promoting a stage that awaits approval approves and starts
      it.
    * ``approve``: awaiting approval ─▶ running; the stage starts.
    * ``rollback``: any status not ended, or succeeded ─▶ rolling back every touched device.

    Decisions name ``actor``. Raises :class:`CommandError` when ``op`` is unknown or does not
    apply in the rollout's status.
    """
    if op not in COMMANDS:
        raise CommandError(f"unknown command {op!r:.40}: use {', '.join(COMMANDS)}")
    if state.status not in COMMANDS[op]:
        raise _refuse(state, op)
    if op == "promote" and state.finalized:
        raise CommandError("rollout is finishing: every stage passed; nothing to promote")
    run = _Run(spec, {}, {}, now)
    by = f"by {actor}" + (f": {reason}" if reason else "")
    index = state.stage
    if op == "pause":
        why = f"paused {by}"
        run.decide("paused", why, index, actor=actor)
        state = replace(state, status=_S.PAUSED, reason=why)
    elif op == "resume":
        why = f"resumed {by}"
        run.decide("resumed", why, index, actor=actor)
        if state.stage_started_at is None:
            state = _enter_stage(run, replace(state, reason=why), index)
        else:
            bake = now if state.bake_started_at is not None else None
            state = replace(state, status=_S.RUNNING, bake_started_at=bake, reason=why)
    elif op == "abort":
        why = f"aborted {by}"
        run.decide("aborted", why, index, actor=actor)
        state = replace(state, status=_S.ABORTED, reason=why)
    elif op == "approve" or (op == "promote" and state.stage_started_at is None):
        kind = "approved" if op == "approve" else "promoted"
        run.decide(kind, f"stage {index + 1} of {len(spec.stages)} {kind} {by}", index, actor=actor)
        state = _enter_stage(run, replace(state, approved=state.approved | {index}), index)
    elif op == "promote":
        run.decide(
            "promoted", f"stage {index + 1} of {len(spec.stages)} promoted {by}", index, actor=actor
        )
        state = _pass_stage(run, _close_stage(run, state), f"promoted {by}; bake and gates skipped")
    else:
        state = _rollback(run, state, f"rollback asked {by}")
        if state.status is _S.ROLLING_BACK and not run.actions:
            state = _rolled_back(run, state)
    return Step(state, tuple(run.actions), tuple(run.decisions))


def _close_stage(run: _Run, state: RolloutState) -> RolloutState:
    """A promoted stage: devices not told yet are skipped, prefetched ones told to move."""
    index = state.stage
    devs = dict(state.devices)
    mine = order_devices(run.spec.model, (d for d, p in devs.items() if p.stage == index))
    untold = [d for d in mine if devs[d].phase is _P.WAITING]
    for d in untold:
        devs[d] = _moved(devs[d], _P.SKIPPED, run.now)
    if untold:
        run.decide(
            "devices_skipped",
            f"{len(untold)} device(s) of stage {index + 1} skipped: the stage was "
            f"promoted before they were told: {_ids(untold)}",
            index,
            count=len(untold),
            devices=untold[:_DETAILED],
        )
    prefetch = [d for d in mine if devs[d].phase in (_P.PREFETCHING, _P.PREFETCHED)]
    _move(run, devs, prefetch, run.spec.stages[index])
    return replace(state, devices=devs)
