"""The rollout engine against a simulated fleet: random runs keep every promise (rate limit,
idempotent steps, gates that never judge below their minimum, abort and rollback from every
state, untouched devices left alone), and scripted runs stop a bad version at its first stage
and carry a good one to the end.

The fleet is a fake of the engine's inputs only: devices that take the actions with a delay
while online, report what they run as :class:`DeviceFacts`, and count requests on the new
version as :class:`DeviceMetrics` (errors, latency, agreement and drift by their behaviour).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
from hypothesis import assume, event, given, settings
from hypothesis import strategies as st

from mcp_edge.controlplane.rollouts import engine
from mcp_edge.controlplane.rollouts.engine import COMMANDS, CommandError, rate_limit
from mcp_edge.controlplane.rollouts.gates import clipped, evaluate_gate, histogram_p95
from mcp_edge.controlplane.rollouts.model import (
    Action,
    ActionKind,
    Decision,
    DeviceFacts,
    DeviceMetrics,
    DevicePhase,
    DeviceProgress,
    Gate,
    GateMetric,
    RolloutSpec,
    RolloutStatus,
    StageMode,
    Step,
    VersionStats,
)
from mcp_edge.controlplane.rollouts.spec import SpecError, parse_spec, plan_stage_sizes

OLD, NEW = "1.0.0", "1.1.0"
EDGES = (5.0, 10.0, 20.0, 50.0, 100.0, 200.0)
T0 = 1_000_000.0
S, P = RolloutStatus, DevicePhase

GOOD = "good"
BAD_INSTALL = "bad_install"  # download, install or warm-up of the new version fails
SILENT = "silent"  # takes nothing, reports nothing
ERRORS = "errors"  # 20 % of requests fail on the new version
SLOW = "slow"  # p95 twice the old version's
GARBAGE = "garbage"  # reports inconsistent figures (more errors than requests, bad histogram)
DISAGREE = "disagree"  # its shadow agrees with the old version half the time
BEHAVIOURS = (GOOD, BAD_INSTALL, SILENT, ERRORS, SLOW, GARBAGE, DISAGREE)


def bucketed(requests: int, p95: float) -> tuple[int, ...]:
    """Every request in the bucket of the first edge at or above ``p95``."""
    index = next(i for i, e in enumerate(EDGES) if e >= p95)
    return tuple(requests if i == index else 0 for i in range(len(EDGES) + 1))


@dataclass
class SimDevice:
    device_id: str
    behaviour: str = GOOD
    delay: float = 0.0
    online: bool = True
    active: str | None = OLD
    canary: str | None = None
    shadow: str | None = None
    installed: set[str] = field(default_factory=lambda: {OLD})
    failed: set[str] = field(default_factory=set)
    pending: list[tuple[float, Action]] = field(default_factory=list)
    running_since: float | None = None
    """When it started answering or shadowing with the new version."""
    before: str | None = None

    def __post_init__(self) -> None:
        self.before = self.active

    def receive(self, action: Action, now: float) -> None:
        self.pending.append((now + self.delay, action))

    def advance(self, now: float) -> None:
        if not self.online:
            return
        due = [(t, a) for t, a in self.pending if t <= now]
        self.pending = [(t, a) for t, a in self.pending if t > now]
        for at, action in due:
            self.take(action, at)

    def take(self, action: Action, at: float) -> None:
        if self.behaviour == SILENT:
            return
        if action.kind is ActionKind.REVERT:
            self.active, self.canary, self.shadow, self.running_since = (
                self.before,
                None,
                None,
                None,
            )
            return
        if self.behaviour == BAD_INSTALL:
            self.failed.add(NEW)
            return
        self.installed.add(NEW)
        if action.kind is ActionKind.PREFETCH:
            return
        if action.mode is StageMode.CANARY:
            self.canary = NEW
        elif action.mode is StageMode.SHADOW:
            self.shadow = NEW
        else:
            self.active, self.canary, self.shadow = NEW, None, None
        if self.running_since is None:
            self.running_since = at

    def facts(self) -> DeviceFacts:
        return DeviceFacts(self.device_id, self.online, self.active, self.canary, self.shadow,
                           tuple(sorted(self.installed)), None, frozenset(self.failed))  # fmt: skip

    def runs_new(self) -> bool:
        return NEW in (self.active, self.canary, self.shadow)

    def metrics(self, now: float) -> DeviceMetrics | None:
        if self.running_since is None:
            return None
        n = int(2 * (now - self.running_since))  # 2 requests a second
        errors = round(n * 0.2) if self.behaviour == ERRORS else 0
        p95 = 40.0 if self.behaviour == SLOW else 20.0
        agreed = n // 2 if self.behaviour == DISAGREE else n
        counts = bucketed(n, p95)
        drift: float | None = 0.1
        if self.behaviour == GARBAGE:
            errors, counts, drift = n + 3, counts[:-1], math.nan
        new = VersionStats(n, errors, p95, EDGES, counts, shadow_compared=n, shadow_agreed=agreed)
        old = VersionStats(n, 0, 20.0, EDGES, bucketed(n, 20.0))
        return DeviceMetrics(self.device_id, new, old, drift)


class Sim:
    """A rollout over simulated devices, checking the engine's promises on every call."""

    def __init__(self, spec: RolloutSpec, devices: list[SimDevice], now: float = T0) -> None:
        self.spec = spec
        self.now = now
        self.fleet = {d.device_id: d for d in devices}
        first = engine.start(spec, [d.facts() for d in devices], now)
        assert first.actions == ()
        self.state = first.state
        self.decisions: list[Decision] = []
        self.actions: list[tuple[float, Action]] = []
        self.first_told: dict[str, float] = {}
        self.rolled_back = False
        self.check_decisions(first.decisions)

    # ---------------------------------------------------------------- inputs
    def facts(self) -> dict[str, DeviceFacts]:
        return {i: d.facts() for i, d in self.fleet.items()}

    def metrics(self) -> dict[str, DeviceMetrics]:
        out = {}
        for i, d in self.fleet.items():
            m = d.metrics(self.now)
            if m is not None:
                out[i] = m
        return out

    def advance(self, dt: float) -> None:
        self.now += dt
        for d in self.fleet.values():
            d.advance(self.now)

    # ---------------------------------------------------------------- calls
    def step(self) -> Step:
        facts, metrics = self.facts(), self.metrics()
        result = engine.step(self.spec, self.state, facts, metrics, self.now)
        again = engine.step(self.spec, result.state, facts, metrics, self.now)
        assert again == Step(result.state), "a step run twice on the same inputs did more"
        if self.state.status not in (S.RUNNING, S.ROLLING_BACK):
            assert result == Step(self.state)
        self.check_gates(result)
        self.apply(result)
        return result

    def command(self, op: str, actor: str = "ann", reason: str = "") -> Step:
        result = engine.command(self.spec, self.state, op, self.now, actor=actor, reason=reason)
        assert result.decisions and all(actor in d.reason for d in result.decisions[:1])
        self.apply(result)
        return result

    def run(self, until: Callable[[Sim], bool], dt: float = 10.0, steps: int = 500) -> None:
        for _ in range(steps):
            self.step()
            if until(self):
                return
            self.advance(dt)
        raise AssertionError(f"not reached in {steps} steps: {self.state.status} {self.state}")

    # ---------------------------------------------------------------- checks
    def apply(self, result: Step) -> None:
        for action in result.actions:
            assert action.device_ids
            if action.kind is not ActionKind.REVERT:
                assert not self.rolled_back, f"{action} after the rollout started rolling back"
            for d in action.device_ids:
                if action.kind is ActionKind.REVERT:
                    assert d in self.first_told, f"{d} reverted but never told"
                else:
                    self.first_told.setdefault(d, self.now)
                self.fleet[d].receive(action, self.now)
            self.actions.append((self.now, action))
        self.check_decisions(result.decisions)
        self.state = result.state
        if self.state.status in (S.ROLLING_BACK, S.ROLLED_BACK):
            self.rolled_back = True
        told = {d for d, p in self.state.devices.items() if p.told_at is not None}
        assert told == set(self.first_told)
        self.check_rate()

    def check_decisions(self, decisions: tuple[Decision, ...]) -> None:
        for d in decisions:
            assert d.reason.strip(), d
            assert d.at == self.now
        self.decisions.extend(decisions)

    def check_rate(self) -> None:
        window = [d for d, t in self.first_told.items() if t > self.now - 60]
        if not window:
            return
        stage = max(self.state.devices[d].stage for d in window)
        limit = rate_limit(self.spec, stage)
        assert limit is None or len(window) <= limit, (len(window), limit)

    def check_gates(self, result: Step) -> None:
        """Every pass or fail had its minimum among the devices that truly ran the version
        with honest figures (a superset of what the engine may count)."""
        judged: list[tuple[int, str, int, int]] = [
            (result.state.stage, r.metric.value, r.devices, r.requests)
            for r in result.state.gates
            if r.verdict in ("pass", "fail") and result.state.status is S.RUNNING
        ]
        judged += [
            (d.stage or 0, str(d.detail["metric"]), int(str(d.detail["devices"])),
             int(str(d.detail["requests"])))
            for d in result.decisions
            if d.kind in ("gate_passed", "gate_failed")
        ]  # fmt: skip
        metrics = self.metrics()
        for stage, name, devices, requests in judged:
            gate = next(g for g in self.spec.stages[stage].gates if g.metric.value == name)
            assert devices >= gate.min_devices
            mine = [self.fleet[d] for d, p in result.state.devices.items() if p.stage == stage]
            if gate.metric is GateMetric.INSTALL_FAILURE_RATE:
                assert sum(d.runs_new() or NEW in d.failed for d in mine) >= gate.min_devices
                continue
            honest = [metrics[d.device_id] for d in mine if d.runs_new()
                      and d.behaviour != GARBAGE and d.device_id in metrics]  # fmt: skip
            if gate.metric is GateMetric.DRIFT:  # no request minimum
                assert sum(m.drift is not None for m in honest) >= gate.min_devices
                continue
            with_requests = [m for m in honest if m.new is not None and m.new.requests > 0]
            assert len(with_requests) >= gate.min_devices
            assert requests >= gate.min_requests
            assert sum(m.new.requests for m in with_requests if m.new) >= gate.min_requests

    def kinds(self) -> list[str]:
        return [d.kind for d in self.decisions]

    def stage_of(self, device_id: str) -> int:
        return self.state.devices[device_id].stage


def fleet(n: int, behaviour: str = GOOD, **kw: Any) -> list[SimDevice]:
    return [SimDevice(f"cam-{i:02d}", behaviour, **kw) for i in range(n)]


def spec_of(*stages: dict[str, Any], **top: Any) -> RolloutSpec:
    return parse_spec({"model": "digits", "version": NEW, "target": {"group": "lab"},
                       "stages": list(stages), **top})  # fmt: skip


# ------------------------------------------------------------------------- random runs
def gate_doc(draw: st.DrawFn, metric: str) -> dict[str, Any]:
    threshold = {"install_failure_rate": 0.3, "error_rate": 0.05, "latency_p95_ratio": 1.5,
                 "agreement": 0.9, "drift": 0.5}[metric]  # fmt: skip
    return {"metric": metric, "threshold": threshold,
            "min_devices": draw(st.integers(1, 3)),
            "min_requests": draw(st.sampled_from([0, 20, 200, 5000])),
            "on_fail": draw(st.sampled_from(["rollback", "rollback", "pause"])),
            "dry_run": draw(st.booleans()) and draw(st.booleans())}  # fmt: skip


@st.composite
def run_specs(draw: st.DrawFn) -> RolloutSpec:
    k = draw(st.integers(1, 4))
    counts = draw(st.booleans())
    cuts = sorted(draw(st.lists(st.integers(1, 99), unique=True, min_size=k - 1,
                                max_size=k - 1)))  # fmt: skip
    percents = [b - a for a, b in zip([0, *cuts], [*cuts, 100], strict=True)]
    stages = []
    for i in range(k):
        mode = draw(st.sampled_from(["switch", "canary", "shadow"]))
        metrics = ["install_failure_rate", "error_rate", "latency_p95_ratio", "drift"]
        metrics += ["agreement"] if mode == "shadow" else []
        chosen = draw(st.lists(st.sampled_from(metrics), unique=True, max_size=3))
        stages.append({
            **({"count": draw(st.integers(1, 4))} if counts and i < k - 1
               else {"percent": 100 if counts else percents[i]}),
            "mode": mode,
            "bake_s": draw(st.sampled_from([0, 30, 120, 400])),
            "prefetch": draw(st.booleans()),
            "approval": draw(st.integers(0, 4)) == 0,
            "gates": [gate_doc(draw, m) for m in chosen],
        })  # fmt: skip
    rate = {"per_minute": draw(st.sampled_from([None, 1, 2.5, 4])),
            "growth": draw(st.sampled_from([1, 1.5, 3]))}  # fmt: skip
    return spec_of(*stages, rate=rate, device_timeout_s=draw(st.sampled_from([10, 60, 300])))


def check_abort_and_rollback_apply(sim: Sim) -> None:
    """From any state not ended, abort ends it touching nothing; from it or succeeded,
    rollback tells every touched device not yet reverted to revert."""
    state = sim.state
    if state.status.ended and state.status is not S.SUCCEEDED:
        for op in COMMANDS:
            with pytest.raises(CommandError, match="has ended and takes no command"):
                engine.command(sim.spec, state, op, sim.now, actor="ann")
        return
    if not state.status.ended:
        aborted = engine.command(sim.spec, state, "abort", sim.now, actor="ann")
        assert aborted.state.status is S.ABORTED and aborted.actions == ()
        assert aborted.state.devices == state.devices
        assert [d.kind for d in aborted.decisions] == ["aborted"]
    back = engine.command(sim.spec, state, "rollback", sim.now, actor="ann", reason="test")
    told = {d for a in back.actions if a.kind is ActionKind.REVERT for d in a.device_ids}
    already = {d for d, p in state.devices.items() if p.phase is P.REVERTED}
    assert all(a.kind is ActionKind.REVERT for a in back.actions)
    assert told | already == set(sim.first_told) and not told & already
    assert back.state.status is (S.ROLLING_BACK if told else S.ROLLED_BACK)
    assert all(back.state.devices[d].phase is P.REVERTING for d in told)


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_random_runs_keep_every_promise(data: st.DataObject) -> None:
    spec = data.draw(run_specs(), "spec")
    n = data.draw(st.integers(1, 16), "devices")
    try:
        plan_stage_sizes(spec, n)
    except SpecError:
        assume(False)
    devices = [
        SimDevice(f"d{i}", data.draw(st.sampled_from((GOOD, GOOD, *BEHAVIOURS))),
                  delay=data.draw(st.sampled_from([0, 5, 40])),
                  online=data.draw(st.integers(0, 5)) > 0)
        for i in range(n)
    ]  # fmt: skip
    sim = Sim(spec, devices)
    first_stage = {d for d, p in sim.state.devices.items() if p.stage == 0}
    for _ in range(data.draw(st.integers(10, 50), "steps")):
        sim.advance(data.draw(st.sampled_from([0, 1, 10, 30, 61, 150, 400, 1000])))
        flip = data.draw(st.none() | st.sampled_from(sorted(sim.fleet)))
        if flip is not None:
            sim.fleet[flip].online = not sim.fleet[flip].online
        check_abort_and_rollback_apply(sim)
        op = data.draw(st.sampled_from([None] * 24 + [*COMMANDS, "approve", "resume", "promote"]))
        if sim.state.status in (S.AWAITING_APPROVAL, S.PAUSED) and data.draw(st.booleans()):
            op = data.draw(st.sampled_from(["approve", "resume", "promote"]))
        if op is not None:
            status = sim.state.status
            try:
                sim.command(op, reason="random")
            except CommandError:
                assert status not in COMMANDS[op] or (op == "promote" and sim.state.finalized)
            else:
                assert status in COMMANDS[op]
        sim.step()
        if sim.rolled_back and sim.state.stage == 0:
            assert set(sim.first_told) <= first_stage  # later stages never touched
        if sim.state.status.ended and sim.state.status is not S.SUCCEEDED:
            break
    check_abort_and_rollback_apply(sim)
    event(f"ended {sim.state.status.value} at stage {sim.state.stage + 1}/{len(spec.stages)}")
    event(f"decisions: {' '.join(sorted(set(sim.kinds())))}")


@st.composite
def size_specs(draw: st.DrawFn) -> RolloutSpec:
    k = draw(st.integers(1, 8))
    kind = draw(st.sampled_from(["percent", "count", "mixed"]))
    cuts = sorted(draw(st.lists(st.floats(0.01, 99.99), unique=True, min_size=k - 1,
                                max_size=k - 1)))  # fmt: skip
    percents = [b - a for a, b in zip([0, *cuts], [*cuts, 100], strict=True)]
    stages: list[dict[str, Any]] = []
    for i in range(k):
        if kind == "percent" or (kind == "mixed" and (i == k - 1 or draw(st.booleans()))):
            stages.append({"percent": percents[i] if kind == "percent" else
                           draw(st.floats(0.01, 100))})  # fmt: skip
        else:
            stages.append({"count": draw(st.integers(1, 300))})
    assume(all(s.get("percent", 1) > 0 for s in stages))
    try:
        return spec_of(*stages)
    except SpecError:  # float cuts that miss 100 by more than 1e-6
        assume(False)
        raise


@settings(max_examples=200, deadline=None)
@given(size_specs(), st.integers(0, 3000))
def test_stage_sizes_add_up_to_the_target_or_are_refused(spec: RolloutSpec, n: int) -> None:
    try:
        sizes = plan_stage_sizes(spec, n)
    except SpecError as e:
        assert n == 0 or "would get nothing" in str(e) or "counts add up to" in str(e)
        all_percent = all(s.percent is not None for s in spec.stages)
        big = all(s.percent is not None and s.percent >= 1 for s in spec.stages)
        assert not (all_percent and big and n >= 100 * len(spec.stages)), (sizes_of(spec), n)
        return
    assert sum(sizes) == n and all(s >= 1 for s in sizes)
    for stage, size in zip(spec.stages[:-1], sizes, strict=False):
        if stage.count is not None:
            assert size == stage.count
        else:
            assert size == max(1, math.floor((stage.percent or 0) * n / 100 + 0.5))
    devices = [DeviceFacts(f"d{i}", True, OLD) for i in range(n)]
    state = engine.start(spec, devices, T0).state
    assert [sum(p.stage == i for p in state.devices.values()) for i in range(len(sizes))] == sizes


def sizes_of(spec: RolloutSpec) -> list[float | int | None]:
    return [s.count if s.count is not None else s.percent for s in spec.stages]


# ------------------------------------------------------------------------- scripted runs
THREE = (
    {"count": 3, "mode": "canary", "bake_s": 300,
     "gates": [{"metric": "install_failure_rate", "threshold": 0.0, "min_devices": 3},
               {"metric": "error_rate", "threshold": 0.05, "min_devices": 3,
                "min_requests": 300},
               {"metric": "latency_p95_ratio", "threshold": 1.5, "min_devices": 3,
                "min_requests": 300}]},
    {"percent": 30, "mode": "shadow", "bake_s": 120,
     "gates": [{"metric": "agreement", "threshold": 0.95, "min_requests": 100}]},
    {"percent": 100, "mode": "switch", "bake_s": 60,
     "gates": [{"metric": "error_rate", "threshold": 0.05, "min_requests": 50}]},
)  # fmt: skip


@pytest.mark.parametrize(
    ("behaviour", "metric"),
    [(BAD_INSTALL, "install_failure_rate"), (ERRORS, "error_rate"), (SLOW, "latency_p95_ratio")],
)
def test_a_bad_version_is_stopped_at_the_first_stage_by_its_gate(behaviour: str,
                                                                  metric: str) -> None:  # fmt: skip
    sim = Sim(spec_of(*THREE), fleet(20, behaviour, delay=5))
    sim.run(lambda s: s.state.status.ended)
    assert sim.state.status is S.ROLLED_BACK and sim.state.stage == 0
    failed = [d for d in sim.decisions if d.kind == "gate_failed"]
    assert [d.detail["metric"] for d in failed] == [metric]
    assert sim.kinds()[-3:] == ["gate_failed", "rolling_back", "rolled_back"]
    assert "stage_passed" not in sim.kinds()
    assert (
        sim.decisions[-1].reason
        == "rolled back: 3 device(s) reverted to the version they ran before"
    )
    first = {d for d, p in sim.state.devices.items() if p.stage == 0}
    assert set(sim.first_told) == first and len(first) == 3
    assert all(sim.state.devices[d].phase is P.REVERTED for d in first)
    assert all(sim.fleet[d].facts().canary_version is None for d in sim.fleet)
    assert all(sim.fleet[d].active == OLD for d in sim.fleet)
    if behaviour != BAD_INSTALL:  # judged on its figures: the bake was cut short by the fail
        assert sim.now < T0 + 300 + 60


def test_a_good_version_succeeds_through_three_stages_and_switches_everyone() -> None:
    sim = Sim(spec_of(*THREE), fleet(20, delay=5))
    sim.run(lambda s: s.state.status.ended)
    assert sim.state.status is S.SUCCEEDED and sim.state.finalized
    assert sim.kinds().count("stage_passed") == 3
    assert sim.kinds().count("stage_started") == 3
    assert [d.detail.get("metric") for d in sim.decisions if d.kind == "gate_passed"] == [
        "install_failure_rate",
        "error_rate",
        "latency_p95_ratio",
        "agreement",
        "error_rate",
    ]
    assert all(p.phase is P.ACTIVE for p in sim.state.devices.values())
    assert all(d.active == NEW and d.canary is None and d.shadow is None
               for d in sim.fleet.values())  # fmt: skip
    switch = [a for _, a in sim.actions if a.kind is ActionKind.MOVE]
    assert [a.mode for a in switch] == [StageMode.CANARY, StageMode.SHADOW, StageMode.SWITCH,
                                        StageMode.SWITCH]  # fmt: skip
    assert sorted(switch[-1].device_ids) == sorted(
        d for d, p in sim.state.devices.items() if p.stage < 2
    )
    succeeded = sim.decisions[-1]
    assert succeeded.kind == "succeeded" and "20 device(s) run it" in succeeded.reason
    assert sim.state.reason == succeeded.reason
    # Rolling back a finished rollout puts every device back.
    back = sim.command("rollback", reason="regression found later")
    assert back.state.status is S.ROLLING_BACK
    assert sorted(back.actions[0].device_ids) == sorted(sim.fleet)
    sim.run(lambda s: s.state.status.ended)
    assert sim.state.status is S.ROLLED_BACK and all(d.active == OLD for d in sim.fleet.values())


def test_the_first_stage_starts_with_a_readable_reason_and_tells_in_hash_order() -> None:
    spec = spec_of({"count": 2, "mode": "canary", "weight": 0.25}, {"percent": 100})
    sim = Sim(spec, fleet(5))
    assert [(d.kind, d.reason) for d in sim.decisions] == [
        ("stage_started", "stage 1 of 2 starts: 2 device(s), canary at weight 0.25")
    ]
    step = sim.step()
    order = engine.order_devices("digits", sim.fleet)
    assert step.actions == (Action(ActionKind.MOVE, tuple(order[:2]), StageMode.CANARY, 0.25),)
    assert {sim.stage_of(d) for d in order[:2]} == {0}


def test_a_device_without_the_model_switches_in_a_canary_stage() -> None:
    devices = fleet(3)
    devices[0] = SimDevice("cam-00", active=None, installed=set())
    sim = Sim(spec_of({"percent": 100, "mode": "canary", "bake_s": 0}), devices)
    moves = sim.step().actions
    assert set(moves) == {
        Action(ActionKind.MOVE, tuple(sorted_by_hash(["cam-01", "cam-02"])), StageMode.CANARY,
               0.1),
        Action(ActionKind.MOVE, ("cam-00",), StageMode.SWITCH),
    }  # fmt: skip
    sim.run(lambda s: s.state.status.ended)
    assert sim.state.status is S.SUCCEEDED
    assert all(d.active == NEW and d.canary is None for d in sim.fleet.values())
    back = sim.command("rollback")
    assert back.actions[0].device_ids == tuple(sorted_by_hash(list(sim.fleet)))
    sim.run(lambda s: s.state.status.ended)
    assert not [d for d in sim.decisions if "did not confirm" in d.reason]
    assert [sim.fleet[d].active for d in sorted(sim.fleet)] == [None, OLD, OLD]


def test_the_device_order_is_a_fixed_hash_order_per_model() -> None:
    ids = [f"cam-{i}" for i in range(6)]
    assert engine.order_devices("digits", ids) == engine.order_devices("digits", ids[::-1])
    assert engine.order_devices("digits", ids) == [
        "cam-3", "cam-2", "cam-5", "cam-1", "cam-4", "cam-0"]  # fmt: skip
    assert engine.order_devices("faces", ids) != engine.order_devices("digits", ids)


def test_the_rate_limit_spreads_moves_over_minutes_and_grows_per_stage() -> None:
    spec = spec_of({"count": 6, "bake_s": 0}, {"percent": 100, "bake_s": 0},
                   rate={"per_minute": 2, "growth": 2})  # fmt: skip
    sim = Sim(spec, fleet(16))
    sim.run(lambda s: s.state.status.ended, dt=20)
    assert sim.state.status is S.SUCCEEDED
    stage0 = [t for d, t in sim.first_told.items() if sim.stage_of(d) == 0]
    stage1 = [t for d, t in sim.first_told.items() if sim.stage_of(d) == 1]
    assert max(stage0) - min(stage0) >= 120  # 6 devices at 2 a minute: three minutes
    # Stage 2 allows 4 a minute: its 10 devices are told over about two and a half minutes.
    assert 60 <= max(stage1) - min(stage1) < max(stage0) - min(stage0) + 60


def test_a_garbage_device_alone_can_neither_pass_nor_fail_a_gate() -> None:
    spec = spec_of({"count": 1, "bake_s": 100, "gates": [
        {"metric": "error_rate", "threshold": 0.05, "min_requests": 10},
        {"metric": "drift", "threshold": 0.5}]}, {"percent": 100})  # fmt: skip
    sim = Sim(spec, fleet(3, GARBAGE))
    sim.run(lambda s: s.state.status is not S.RUNNING)
    assert sim.state.status is S.PAUSED and sim.state.stage == 0
    assert [g.verdict for g in sim.state.gates] == ["inconclusive", "inconclusive"]
    assert all(g.devices == 0 and g.requests == 0 for g in sim.state.gates)
    ignored = [d for d in sim.decisions if d.kind == "ignored_stats"]
    assert len(ignored) == 1 and "more" not in ignored[0].reason
    assert "errors over" in ignored[0].reason  # what was wrong, for the operator


def test_one_device_claiming_huge_counts_weighs_no_more_than_the_others() -> None:
    gate = Gate(GateMetric.ERROR_RATE, 0.05, min_devices=2, min_requests=100)
    devices = [DeviceProgress("a", 0, P.ACTIVE), DeviceProgress("b", 0, P.ACTIVE)]
    metrics = {"a": DeviceMetrics("a", VersionStats(100, 20)),
               "b": DeviceMetrics("b", VersionStats(1_000_000, 0))}  # fmt: skip
    result = evaluate_gate(gate, devices, metrics, bake_ended=False)
    assert (result.verdict, result.value, result.requests) == ("fail", 0.1, 200)
    assert clipped([100, 1_000_000], 100) == [100, 100]
    assert clipped([100, 1_000_000], 5000) == [100, 5000]
    assert clipped([7], 100) == [7]


def test_gates_wait_for_their_minimum_and_then_judge() -> None:
    gate = Gate(GateMetric.ERROR_RATE, 0.05, min_devices=2, min_requests=100)
    one = [DeviceProgress("a", 0, P.ACTIVE), DeviceProgress("b", 0, P.MOVING)]
    metrics = {d: DeviceMetrics(d, VersionStats(500, 400)) for d in ("a", "b")}
    pending = evaluate_gate(gate, one, metrics, bake_ended=False)
    assert (pending.verdict, pending.reason) == (
        "pending",
        "gate error_rate pending: 500 of 100 requests from 1 of 2 device(s)",
    )
    two = [replace(p, phase=P.ACTIVE) for p in one]
    assert evaluate_gate(gate, two, metrics, bake_ended=False).verdict == "fail"


def test_latency_compares_merged_histograms_or_falls_back_to_weighted_p95() -> None:
    assert histogram_p95(EDGES, bucketed(100, 20.0)) == pytest.approx(19.5)
    assert histogram_p95(EDGES, (0, 0, 0, 0, 0, 0, 10)) == math.inf
    assert histogram_p95(EDGES, (0,) * 7) is None
    gate = Gate(GateMetric.LATENCY_P95_RATIO, 1.5, min_devices=1, min_requests=10)
    devices = [DeviceProgress("a", 0, P.ACTIVE)]
    hist = {
        "a": DeviceMetrics(
            "a",
            VersionStats(100, 0, None, EDGES, bucketed(100, 40.0)),
            VersionStats(100, 0, None, EDGES, bucketed(100, 20.0)),
        )
    }
    result = evaluate_gate(gate, devices, hist, bake_ended=False)
    assert result.verdict == "fail" and result.value == pytest.approx(48.5 / 19.5)
    p95s = {"a": DeviceMetrics("a", VersionStats(100, 0, 30.0), VersionStats(100, 0, 25.0))}
    result = evaluate_gate(gate, devices, p95s, bake_ended=False)
    assert result.verdict == "pass" and result.value == pytest.approx(1.2)
    no_old = {"a": DeviceMetrics("a", VersionStats(100, 0, 30.0))}
    assert evaluate_gate(gate, devices, no_old, bake_ended=True).verdict == "inconclusive"


def test_a_prefetch_stage_downloads_first_then_switches_all_together() -> None:
    spec = spec_of({"count": 3, "prefetch": True, "bake_s": 0}, {"percent": 100},
                   device_timeout_s=60)  # fmt: skip
    devices = fleet(5, delay=5)
    sim = Sim(spec, devices)
    stage0 = [d for d in engine.order_devices("digits", sim.fleet) if sim.stage_of(d) == 0]
    sim.fleet[stage0[2]].online = False
    first = sim.step()
    assert first.actions == (Action(ActionKind.PREFETCH, tuple(stage0[:2])),)
    sim.advance(10)
    assert sim.step().actions == ()  # two prefetched, one still waiting offline: no move yet
    assert [sim.state.devices[d].phase for d in stage0] == [P.PREFETCHED, P.PREFETCHED,
                                                            P.WAITING]  # fmt: skip
    sim.advance(60)
    moved = sim.step()
    assert moved.actions == (Action(ActionKind.MOVE, tuple(stage0[:2]), StageMode.SWITCH),)
    assert sim.state.devices[stage0[2]].phase is P.SKIPPED
    skipped = [d for d in moved.decisions if d.kind == "devices_skipped"]
    assert "1 device(s) skipped: still offline 60 s after stage 1 started" in skipped[0].reason
    sim.run(lambda s: s.state.stage == 1)


def test_a_device_that_comes_online_is_prefetched_then() -> None:
    spec = spec_of({"count": 2, "prefetch": True, "bake_s": 0}, {"percent": 100})
    sim = Sim(spec, fleet(3))
    stage0 = [d for d in engine.order_devices("digits", sim.fleet) if sim.stage_of(d) == 0]
    sim.fleet[stage0[1]].online = False
    assert sim.step().actions == (Action(ActionKind.PREFETCH, (stage0[0],)),)
    sim.advance(30)
    sim.fleet[stage0[1]].online = True
    assert sim.step().actions == (Action(ActionKind.PREFETCH, (stage0[1],)),)
    sim.advance(1)
    assert sim.step().actions == (Action(ActionKind.MOVE, tuple(stage0), StageMode.SWITCH),)


def test_stages_that_need_approval_wait_for_it() -> None:
    spec = spec_of({"count": 1, "approval": True, "bake_s": 0},
                   {"percent": 100, "approval": True, "bake_s": 0})  # fmt: skip
    sim = Sim(spec, fleet(3))
    assert sim.state.status is S.AWAITING_APPROVAL
    assert sim.decisions[0].reason == "stage 1 of 2 awaits approval: 1 device(s), switch"
    assert sim.step() == Step(sim.state)  # nothing moves before a human says so
    with pytest.raises(CommandError, match="rollout is awaiting_approval; resume applies"):
        sim.command("resume")
    approved = sim.command("approve", actor="bob", reason="change 42")
    assert [d.kind for d in approved.decisions] == ["approved", "stage_started"]
    assert approved.decisions[0].reason == "stage 1 of 2 approved by bob: change 42"
    assert approved.state.approved == {0} and approved.state.status is S.RUNNING
    sim.run(lambda s: s.state.status is S.AWAITING_APPROVAL)
    assert sim.state.stage == 1 and sim.kinds()[-2:] == ["stage_passed", "awaiting_approval"]
    untold = [d for d in sim.fleet if sim.stage_of(d) == 1]
    assert not set(untold) & set(sim.first_told)
    promoted = sim.command("promote", actor="cy")  # promoting a waiting stage approves it
    assert [d.kind for d in promoted.decisions] == ["promoted", "stage_started"]
    sim.run(lambda s: s.state.status.ended)
    assert sim.state.status is S.SUCCEEDED


def test_inconclusive_gates_pause_with_the_numbers_and_resume_restarts_the_bake() -> None:
    spec = spec_of({"count": 1, "bake_s": 100,
                    "gates": [{"metric": "error_rate", "threshold": 0.05}]},
                   {"percent": 100})  # fmt: skip
    sim = Sim(spec, fleet(3))
    stage0 = next(d for d in sim.fleet if sim.stage_of(d) == 0)
    sim.step()
    sim.fleet[stage0].behaviour = SILENT  # takes the version, then stops counting requests
    sim.fleet[stage0].running_since = T0
    sim.fleet[stage0].active = NEW
    sim.step()
    sim.advance(6)
    sim.step()
    frozen = sim.metrics()
    sim.advance(94)
    paused = engine.step(sim.spec, sim.state, sim.facts(), frozen, sim.now)
    sim.apply(paused)
    assert sim.state.status is S.PAUSED
    assert sim.state.reason == (
        "gate error_rate inconclusive: 12 of 100 requests from 1 of 1 device(s) when the bake "
        "ended; approve with promote or roll back")  # fmt: skip
    assert [d.kind for d in paused.decisions] == ["gate_inconclusive", "paused"]
    assert sim.step() == Step(sim.state)  # paused: nothing happens
    sim.advance(50)
    resumed = sim.command("resume", actor="dee")
    assert resumed.state.status is S.RUNNING and resumed.state.bake_started_at == sim.now
    assert resumed.decisions[0].reason == "resumed by dee"
    promoted = sim.command("promote", actor="dee", reason="looked at the logs")
    assert [d.kind for d in promoted.decisions] == ["promoted", "stage_passed", "stage_started"]
    assert "bake and gates skipped" in promoted.decisions[1].reason
    assert promoted.state.stage == 1


def test_a_dry_run_gate_reports_its_failure_once_and_never_acts() -> None:
    spec = spec_of({"count": 2, "bake_s": 50, "gates": [
        {"metric": "error_rate", "threshold": 0.05, "min_requests": 10, "dry_run": True}]},
        {"percent": 100, "bake_s": 0})  # fmt: skip
    sim = Sim(spec, fleet(4, ERRORS))
    sim.run(lambda s: s.state.stage == 1, dt=10)
    dry = [d for d in sim.decisions if d.kind == "gate_failed"]
    assert len(dry) == 1 and dry[0].reason.startswith("dry run: not acting: gate error_rate fails")
    assert not sim.rolled_back


def test_a_failing_gate_that_pauses_holds_the_rollout() -> None:
    spec = spec_of({"count": 2, "bake_s": 300, "gates": [
        {"metric": "error_rate", "threshold": 0.05, "min_requests": 10, "on_fail": "pause"}]},
        {"percent": 100})  # fmt: skip
    sim = Sim(spec, fleet(4, ERRORS))
    sim.run(lambda s: s.state.status is not S.RUNNING, dt=10)
    assert sim.state.status is S.PAUSED and sim.now < T0 + 300
    assert sim.state.reason.startswith("stage 1 paused: gate error_rate fails: 0.2 > 0.05")
    assert sim.kinds()[-2:] == ["gate_failed", "paused"]


def test_devices_that_never_report_are_skipped_and_unconfirmed_reverts_counted() -> None:
    spec = spec_of({"count": 3, "bake_s": 0, "gates": [
        {"metric": "install_failure_rate", "threshold": 0.0, "min_devices": 1}]},
        {"percent": 100}, device_timeout_s=60)  # fmt: skip
    sim = Sim(spec, fleet(5))
    good, bad, silent = [d for d in engine.order_devices("digits", sim.fleet)
                         if sim.stage_of(d) == 0]  # fmt: skip
    sim.fleet[bad].behaviour = BAD_INSTALL
    sim.fleet[silent].behaviour = SILENT
    sim.step()
    sim.advance(1)
    assert [d.kind for d in sim.step().decisions] == ["devices_failed"]
    assert sim.state.bake_started_at is None  # the silent one has not settled yet
    sim.advance(59)
    sim.fleet[good].online = False  # and stays away: it will not confirm its revert
    failed = sim.step()
    assert [d.kind for d in failed.decisions] == [
        "devices_skipped", "bake_started", "gate_failed", "rolling_back"]  # fmt: skip
    assert "told 1.1.0 and not reporting it 60 s later" in failed.decisions[0].reason
    assert failed.decisions[2].reason.startswith("gate install_failure_rate fails: 0.5 > 0")
    assert failed.actions == (Action(ActionKind.REVERT, tuple(sorted_by_hash([good, bad,
                                                                              silent]))),)  # fmt: skip
    # The two that never ran the version show their old one already: reverted at once.
    assert sim.state.status is S.ROLLING_BACK
    assert {d: p.phase for d, p in sim.state.devices.items() if p.stage == 0} == {
        good: P.REVERTING, bad: P.REVERTED, silent: P.REVERTED}  # fmt: skip
    sim.advance(30)
    assert sim.step().decisions == ()
    sim.advance(30)
    done = sim.step()
    assert [d.kind for d in done.decisions] == ["devices_skipped", "rolled_back"]
    assert "1 device(s) did not confirm the revert within 60 s" in done.decisions[0].reason


def sorted_by_hash(ids: list[str]) -> list[str]:
    return engine.order_devices("digits", ids)


def test_commands_that_do_not_apply_are_refused_with_the_status() -> None:
    sim = Sim(spec_of({"percent": 100, "bake_s": 0}), fleet(2))
    with pytest.raises(CommandError, match="unknown command 'restart'"):
        sim.command("restart")
    with pytest.raises(CommandError, match="rollout is running; approve applies to a rollout "
                                           "that is awaiting_approval"):  # fmt: skip
        sim.command("approve")
    sim.run(lambda s: s.state.status.ended)
    for op in ("pause", "resume", "abort", "promote", "approve"):
        with pytest.raises(CommandError, match="rollout is succeeded; only rollback applies"):
            sim.command(op)
    sim.command("rollback")
    sim.run(lambda s: s.state.status.ended)
    with pytest.raises(CommandError, match="rollout is rolled_back; it has ended"):
        sim.command("rollback")


def test_pause_and_abort_stop_the_rollout_where_it_stands() -> None:
    sim = Sim(spec_of({"count": 2, "bake_s": 0}, {"percent": 100}), fleet(5))
    sim.step()
    paused = sim.command("pause", actor="eve", reason="maintenance window")
    assert paused.state.status is S.PAUSED
    assert paused.decisions[0].reason == "paused by eve: maintenance window"
    sim.advance(100)
    assert sim.step() == Step(sim.state)
    before = sim.state.devices
    aborted = sim.command("abort", actor="eve")
    assert aborted.actions == () and aborted.state.devices == before
    assert aborted.state.status is S.ABORTED and aborted.state.reason == "aborted by eve"
