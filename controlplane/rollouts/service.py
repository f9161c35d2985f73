"""Staged rollouts on the control plane: create them, drive them, and carry out operators'
commands (DESIGN 4.2, docs/rollouts.md).

:class:`RolloutService` is the I/O around the pure engine (:mod:`controlplane.rollouts.engine`).
One step of one rollout:

1. **Read** (one read transaction): the rollout row, its device rows, what each device reports
   of the model, which versions it reported failed, and its inference statistics of the new and
   the old version (:func:`controlplane.db.telemetry.version_stats`); when the stage has a
   ``drift`` gate, each device's drift of the new version since the stage started
   (:func:`controlplane.drift.gate.device_drift`: the score of its summed drift reports).
2. **Decide**: ``engine.step(spec, state, facts, metrics, now)``, no I/O.
3. **Write** (one transaction, only when something changed): the new state over the
   ``step_seq`` read (:func:`controlplane.db.rollouts.write_step`: a replica that stepped first
   makes this one roll back, so no step is ever applied twice), the device rows that changed,
   the decisions as history rows, a webhook event per decision, and every action as a
   placement through the deployment service (:meth:`DeploymentService.place`), which signs each
   touched device's next desired state in the same transaction.
4. **Publish** the issued desired states after the commit (a failed publish is retried by the
   deployment service's own background task: the database is the truth).

The loop steps every running rollout each ``interval_s`` (and at once after a create or a
command). With several replicas on one PostgreSQL database each rollout is driven by the replica
holding its lease (a conditional ``UPDATE`` on ``lease_owner``/``lease_until``, renewed every
step); a replica that dies lets its leases run out (``lease_s``) and another takes over where
the database says the rollout stands.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta, timezone
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from mcp_edge.controlplane.db import Database, Tx
from mcp_edge.controlplane.db import audit as audit_q
from mcp_edge.controlplane.db import deployments as deploy_q
from mcp_edge.controlplane.db import devices as device_q
from mcp_edge.controlplane.db import rollouts as q
from mcp_edge.controlplane.db import telemetry as telemetry_q
from mcp_edge.controlplane.db.devices import DeviceFilter, DeviceView
from mcp_edge.controlplane.db.rollouts import DeviceSnapshot, RolloutDeviceView, RolloutView
from mcp_edge.controlplane.deployments import (
    ACCEPTED,
    DeploymentConflictError,
    DeploymentService,
    Placement,
    UnknownDeviceError,
    UnknownVersionError,
)
from mcp_edge.controlplane.desired import misfits
from mcp_edge.controlplane.drift.gate import device_drift
from mcp_edge.controlplane.rollouts import engine
from mcp_edge.controlplane.rollouts.model import (
    Action,
    ActionKind,
    DeviceFacts,
    DeviceMetrics,
    DevicePhase,
    DeviceProgress,
    GateMetric,
    RolloutSpec,
    RolloutState,
    StageMode,
    Step,
    VersionStats,
)
from mcp_edge.controlplane.rollouts.spec import (
    parse_spec,
    plan_stage_sizes,
    spec_to_dict,
    state_from_dict,
    state_to_dict,
)
from mcp_edge.shared.errors import McpError
from mcp_edge.shared.protocol.canary import CanaryPolicy

log = logging.getLogger("mcp.controlplane.rollouts")

Clock = Callable[[], datetime]
Notify = Callable[[Tx, str, Mapping[str, Any], datetime], Awaitable[None]]
"""Queue an event for the webhooks inside the caller's transaction: ``(tx, type, body, now)``."""
SYSTEM = "system"
MAX_TARGET = 100_000
BASELINE_S = 1800.0
"""How far before a switch stage started the old version's latency is taken from."""
COMMANDS = ("pause", "resume", "abort", "promote", "approve", "rollback")


class RolloutError(McpError):
    """A rollout cannot be made or changed as asked."""


class RolloutNotFoundError(RolloutError):
    pass


class RolloutConflictError(RolloutError):
    """Another rollout holds the devices, the target fits nothing, a command does not apply
    in the rollout's status."""


class RolloutInvalidError(RolloutError):
    pass


def _ts(at: datetime | None) -> float | None:
    return at.timestamp() if at is not None else None


def _at(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, timezone.utc)


def _progress(row: RolloutDeviceView) -> DeviceProgress:
    return DeviceProgress(
        device_id=row.device_id,
        stage=row.stage,
        phase=DevicePhase(row.phase),
        since=row.since.timestamp(),
        told_at=_ts(row.told_at),
        from_version=row.from_version,
        mode=StageMode(row.mode) if row.mode else None,
    )


def _device_row(p: DeviceProgress, moves: int) -> dict[str, Any]:
    return {
        "device_id": p.device_id,
        "stage": p.stage,
        "phase": p.phase.value,
        "since": _at(p.since),
        "told_at": _at(p.told_at) if p.told_at is not None else None,
        "from_version": p.from_version,
        "mode": p.mode.value if p.mode else None,
        "moves": moves,
    }


def _facts(snapshot: DeviceSnapshot, failed: set[str]) -> DeviceFacts:
    status = snapshot.reported or {}

    def text(key: str) -> str | None:
        value = status.get(key)
        return value if isinstance(value, str) else None

    installed = status.get("installed_versions")
    return DeviceFacts(
        device_id=snapshot.device_id,
        online=snapshot.online,
        active_version=text("active_version"),
        canary_version=text("canary_version"),
        shadow_version=text("shadow_version"),
        installed_versions=tuple(v for v in installed if isinstance(v, str))
        if isinstance(installed, list)
        else (),
        desired_version=snapshot.desired_version,
        failed_versions=frozenset(failed),
    )


def _stats(totals: telemetry_q.VersionTotals | None) -> VersionStats | None:
    if totals is None:
        return None
    return VersionStats(
        requests=totals.requests,
        errors=totals.errors,
        p95_ms=totals.p95_ms,
        latency_edges_ms=tuple(totals.latency_edges_ms),
        latency_counts=tuple(totals.latency_counts),
        shadow_compared=totals.shadow_compared,
        shadow_agreed=totals.shadow_agreed,
    )


@dataclass(frozen=True)
class RolloutDetail:
    """A rollout as the API shows it: its row, its spec and state, and devices per phase."""

    rollout: RolloutView
    spec: RolloutSpec
    state: RolloutState
    phases: dict[str, int]


class RolloutMetrics:
    """Prometheus families of rollouts (on the control plane's registry)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = registry or CollectorRegistry()
        self.rollouts = Gauge(
            "mcp_cp_rollouts", "Rollouts by status (ended ones included).", ["status"], registry=r
        )
        self.transitions = Counter(
            "mcp_cp_rollout_transitions_total",
            "Rollout decisions and operator actions, by kind.",
            ["kind"],
            registry=r,
        )
        self.devices = Gauge(
            "mcp_cp_rollout_devices",
            "Devices of a rollout that has not ended, by phase.",
            ["rollout", "model", "phase"],
            registry=r,
        )
        self.gate_value = Gauge(
            "mcp_cp_rollout_gate_value",
            "The last value of each gate of a running rollout's current stage.",
            ["rollout", "metric"],
            registry=r,
        )
        self.steps = Counter(
            "mcp_cp_rollout_steps_total",
            "Rollout steps written, by outcome (written, conflict: another replica was first).",
            ["outcome"],
            registry=r,
        )


def round_rest(took_s: float, interval_s: float, lease_s: float) -> float:
    """How long the loop rests after a round that took ``took_s``.

    A round over thousands of devices takes a while: rest twice as long, so the loop keeps to
    about a third of the process while ingestion and the repository serve the devices it
    moved; at least ``interval_s``. Never more than a third of the lease, though: the next
    round renews this replica's leases before they run out (a longer rest let another, live
    replica take them over) and notices a finished stage or rollout soon after the devices
    report it. A command or a create wakes the loop at once.
    """
    return max(interval_s, min(2 * took_s, lease_s / 3))


class RolloutService:
    """Create, command and drive rollouts. ``owner`` names this replica in leases."""

    def __init__(
        self,
        db: Database,
        deployments: DeploymentService,
        clock: Clock,
        *,
        owner: str,
        notify: Notify | None = None,
        registry: CollectorRegistry | None = None,
        interval_s: float = 1.0,
        lease_s: float = 15.0,
    ) -> None:
        self._db = db
        self._deployments = deployments
        self._clock = clock
        self._owner = owner
        self._notify = notify
        self._interval_s = interval_s
        self._lease = timedelta(seconds=lease_s)
        self.metrics = RolloutMetrics(registry)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._gauged: set[tuple[str, ...]] = set()

    @property
    def db(self) -> Database:
        return self._db

    @property
    def owner(self) -> str:
        return self._owner

    # ------------------------------------------------------------------ reading
    async def get(self, rollout_id: int) -> RolloutDetail:
        async with self._db.read() as tx:
            row = await q.get_rollout(tx, rollout_id)
            if row is None:
                raise RolloutNotFoundError(f"no rollout {rollout_id}")
            phases = (await q.phase_counts(tx, [rollout_id]))[rollout_id]
        return RolloutDetail(row, parse_spec(row.spec), state_from_dict(row.state), phases)

    async def list_rollouts(
        self,
        *,
        limit: int,
        before_id: int | None = None,
        model: str | None = None,
        statuses: Sequence[str] | None = None,
    ) -> list[RolloutDetail]:
        async with self._db.read() as tx:
            rows = await q.list_rollouts(
                tx, limit=limit, before_id=before_id, model=model, statuses=statuses
            )
            phases = await q.phase_counts(tx, [r.id for r in rows])
        return [
            RolloutDetail(r, parse_spec(r.spec), state_from_dict(r.state), phases[r.id])
            for r in rows
        ]

    # ------------------------------------------------------------------ create
    async def create(self, data: Mapping[str, Any], *, actor: str) -> RolloutDetail:
        """Validate ``data`` (a spec as JSON or TOML gives it), check it against the fleet, and
        start the rollout. Raises :class:`controlplane.rollouts.spec.SpecError` (400),
        :class:`UnknownVersionError`/:class:`UnknownDeviceError` (404),
        :class:`RolloutConflictError` or :class:`DeploymentConflictError` (409)."""
        spec = parse_spec(data)
        now = self._clock()
        async with self._db.transaction() as tx:
            await deploy_q.lock_model(tx, spec.model)
            version = await self._version(tx, spec)
            devices, skipped = await self._targets(tx, spec, version)
            ids = [d.id for d in devices]
            plan_stage_sizes(spec, len(ids))  # SpecError when the sizes cannot add up
            busy = await q.active_targets(tx, spec.model, ids)
            if busy:
                listed = ", ".join(f"rollout {r} ({n} device(s))" for r, n in sorted(busy.items()))
                raise RolloutConflictError(
                    f"{spec.model}: {listed} already targets these devices and has not ended; "
                    "wait for it, or abort or roll it back first"
                )
            await self._deployments.refuse_downgrades(tx, spec.model, version, ids)
            snapshots = await q.snapshots(tx, spec.model, ids)
            facts = [_facts(snapshots[i], set()) for i in ids if i in snapshots]
            first = engine.start(spec, facts, now.timestamp())
            row = await q.insert_rollout(
                tx,
                model=spec.model,
                version=spec.version,
                status=first.state.status.value,
                stage=first.state.stage,
                spec=spec_to_dict(spec),
                state=state_to_dict(first.state),
                target_devices=len(ids),
                created_by=actor,
                created_at=now,
                updated_at=now,
                step_seq=0,
            )
            await q.insert_devices(
                tx, row.id, [_device_row(p, 0) for p in first.state.devices.values()]
            )
            await self._record(tx, row, first, now, actor)
            await audit_q.insert_entry(
                tx,
                at=now,
                actor=actor,
                action="rollout.created",
                target_type="rollout",
                target_id=str(row.id),
                detail={
                    "model": spec.model,
                    "version": spec.version,
                    "devices": len(ids),
                    "stages": len(spec.stages),
                    "skipped": sorted(skipped)[:100],
                },
            )
            seqs = await self._apply(tx, row, spec, first.state, first.actions, now, actor)
        if seqs:
            await self._deployments.publish_issued(seqs)
        log.info(
            "rollout %d: %s %s to %d device(s) in %d stage(s), %d skipped, by %s",
            row.id,
            spec.model,
            spec.version,
            len(ids),
            len(spec.stages),
            len(skipped),
            actor,
        )
        self.wake()
        return await self.get(row.id)

    async def _version(self, tx: Tx, spec: RolloutSpec) -> deploy_q.VersionView:
        if not await deploy_q.model_exists(tx, spec.model):
            raise UnknownVersionError(f"no model {spec.model!r} is published")
        version = await deploy_q.get_version(tx, spec.model, spec.version)
        if version is None:
            raise UnknownVersionError(
                f"model {spec.model!r} has no published version {spec.version!r}"
            )
        return version

    async def _targets(
        self, tx: Tx, spec: RolloutSpec, version: deploy_q.VersionView
    ) -> tuple[list[DeviceView], dict[str, str]]:
        """Accepted devices the target selects and the version fits, and why others not."""
        target = spec.target
        if target.devices:
            found: list[DeviceView] = []
            for device_id in target.devices:
                device = await device_q.get_device(tx, device_id)
                if device is None:
                    raise UnknownDeviceError(f"no device {device_id!r}")
                if device.status != ACCEPTED:
                    raise DeploymentConflictError(
                        f"device {device_id!r} is {device.status}; only accepted devices take "
                        "part in a rollout"
                    )
                found.append(device)
        else:
            found, _ = await device_q.list_devices(
                tx,
                DeviceFilter(
                    group=target.group, labels=dict(target.labels) or None, statuses=[ACCEPTED]
                ),
                limit=MAX_TARGET,
                offset=0,
            )
        labels = dict(target.labels)
        selected = [
            d
            for d in found
            if (target.group is None or d.group_name == target.group)
            and all(d.labels.get(k) == v for k, v in labels.items())
            and (not target.profiles or d.profile in target.profiles)
        ]
        fits, skipped = misfits(selected, [version])
        if not fits:
            why = f" ({len(skipped)} do not fit the version's profiles)" if skipped else ""
            raise RolloutConflictError(
                f"the target matches no accepted device that can run {spec.model} "
                f"{spec.version}{why}"
            )
        return fits, skipped

    # ------------------------------------------------------------------ commands
    async def command(
        self, rollout_id: int, op: str, *, actor: str, reason: str = ""
    ) -> RolloutDetail:
        """Pause, resume, abort, promote, approve or roll back. Raises
        :class:`RolloutNotFoundError`, :class:`RolloutConflictError` (not in this status)."""
        if op not in COMMANDS:
            raise RolloutInvalidError(f"unknown command {op!r}; one of {', '.join(COMMANDS)}")
        for _ in range(5):  # another writer stepping meanwhile: read again and retry
            now = self._clock()
            async with self._db.transaction() as tx:
                row = await q.get_rollout(tx, rollout_id)
                if row is None:
                    raise RolloutNotFoundError(f"no rollout {rollout_id}")
                spec = parse_spec(row.spec)
                state = await self._state(tx, row)
                try:
                    result = engine.command(
                        spec, state, op, now.timestamp(), actor=actor, reason=reason
                    )
                except engine.CommandError as e:
                    raise RolloutConflictError(f"rollout {rollout_id}: {e}") from e
                if not await self._write(tx, row, state, result, now, actor):
                    continue
                await audit_q.insert_entry(
                    tx,
                    at=now,
                    actor=actor,
                    action=f"rollout.{op}",
                    target_type="rollout",
                    target_id=str(rollout_id),
                    detail={"reason": reason, "status": result.state.status.value},
                )
                seqs = await self._apply(tx, row, spec, result.state, result.actions, now, actor)
            if seqs:
                await self._deployments.publish_issued(seqs)
            log.info(
                "rollout %d: %s by %s%s", rollout_id, op, actor, f": {reason}" if reason else ""
            )
            self.wake()
            return await self.get(rollout_id)
        raise RolloutConflictError(f"rollout {rollout_id} keeps changing; try again")

    # ------------------------------------------------------------------ the loop
    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="rollouts")

    async def stop(self, grace_s: float = 10.0) -> None:
        """Let the round in progress finish (a task cancelled inside a transaction leaves the
        pool a connection it cannot reset), at most ``grace_s``; then end the task and give
        up this replica's leases."""
        task, self._task = self._task, None
        if task is not None:
            self._stopping = True
            self._wake.set()
            try:
                await asyncio.wait_for(task, grace_s)
            except asyncio.TimeoutError:
                log.warning("a rollout round ran past %.0f s at shutdown; cancelled it", grace_s)
            self._stopping = False
            with contextlib.suppress(Exception):
                async with self._db.transaction() as tx:
                    await q.release(tx, self._owner)

    def wake(self) -> None:
        self._wake.set()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._stopping:
            began = loop.time()
            try:
                await self.run_once()
            except Exception:  # the loop must outlive any one failing round
                log.exception("rollout round failed; trying again")
            rest = round_rest(loop.time() - began, self._interval_s, self._lease.total_seconds())
            if self._stopping:
                break
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), rest)
            self._wake.clear()

    async def run_once(self) -> int:
        """Step every running rollout whose lease this replica holds or can take; return how
        many steps were written."""
        async with self._db.read() as tx:
            ids = await q.stepped_rollout_ids(tx)
        written = 0
        for rollout_id in ids:
            if self._stopping:
                break
            now = self._clock()
            async with self._db.transaction() as tx:
                mine = await q.claim(tx, rollout_id, self._owner, now, now + self._lease)
            if mine and await self.step(rollout_id):
                written += 1
        await self._gauge()
        return written

    async def step(self, rollout_id: int) -> bool:
        """One step of one rollout (read, decide, write, publish); True when it changed
        something. Safe to call from several replicas at once: only one write lands."""
        now = self._clock()
        async with self._db.read() as tx:
            row = await q.get_rollout(tx, rollout_id)
            if row is None or row.status not in q.STEPPED_STATUSES:
                return False
            spec = parse_spec(row.spec)
            state = await self._state(tx, row)
            facts, metrics = await self._observe(tx, row, spec, state)
        result = engine.step(spec, state, facts, metrics, now.timestamp())
        if not result.actions and not result.decisions and result.state == state:
            return False
        async with self._db.transaction() as tx:
            if not await self._write(tx, row, state, result, now, SYSTEM):
                return False
            seqs = await self._apply(tx, row, spec, result.state, result.actions, now, SYSTEM)
        if seqs:
            await self._deployments.publish_issued(seqs)
        for d in result.decisions:
            log.info("rollout %d: %s: %s", rollout_id, d.kind, d.reason)
        return True

    # ------------------------------------------------------------------ internals
    async def _state(self, tx: Tx, row: RolloutView) -> RolloutState:
        devices = {d.device_id: _progress(d) for d in await q.rollout_devices(tx, row.id)}
        return replace(state_from_dict(row.state), devices=devices)

    async def _observe(
        self, tx: Tx, row: RolloutView, spec: RolloutSpec, state: RolloutState
    ) -> tuple[dict[str, DeviceFacts], dict[str, DeviceMetrics]]:
        """What the devices of the rollout report: facts of every device, and the statistics
        of the devices of the current stage (new version since the stage started; old version
        beside it, or before the stage for a switch)."""
        ids = list(state.devices)
        snapshots = await q.snapshots(tx, spec.model, ids)
        failed = await q.failed_versions(tx, spec.model, ids, row.created_at)
        facts = {i: _facts(s, failed.get(i, set())) for i, s in snapshots.items()}
        stage_ids = [
            p.device_id
            for p in state.devices.values()
            if p.stage == state.stage and p.phase is DevicePhase.ACTIVE
        ]
        metrics: dict[str, DeviceMetrics] = {}
        if stage_ids and state.stage < len(spec.stages) and state.stage_started_at is not None:
            mode = spec.stages[state.stage].mode
            started = _at(state.stage_started_at)
            drift_gates = [
                g for g in spec.stages[state.stage].gates if g.metric is GateMetric.DRIFT
            ]
            drift = (
                await device_drift(tx, spec.model, spec.version, stage_ids, started,
                                   min_samples=min(g.min_requests for g in drift_gates))
                if drift_gates
                else {}
            )  # fmt: skip
            now_stats = await telemetry_q.version_stats(tx, stage_ids, spec.model, started)
            if mode is StageMode.SWITCH:
                before = await telemetry_q.version_stats(
                    tx, stage_ids, spec.model, started - timedelta(seconds=BASELINE_S), started
                )
            else:
                before = now_stats
            for device_id in stage_ids:
                progress = state.devices[device_id]
                moved_as = progress.mode or mode
                role = moved_as.value if moved_as is not StageMode.SWITCH else "stable"
                old_version = progress.from_version
                metrics[device_id] = DeviceMetrics(
                    device_id=device_id,
                    new=_stats(now_stats.get((device_id, spec.version, role))),
                    old=_stats(before.get((device_id, old_version, "stable")))
                    if old_version
                    else None,
                    drift=drift.get(device_id),
                )
        return facts, metrics

    async def _write(
        self,
        tx: Tx,
        row: RolloutView,
        before: RolloutState,
        result: Step,
        now: datetime,
        actor: str,
    ) -> bool:
        """Store ``result`` over the step read; False (nothing written) when another writer
        was first."""
        state = result.state
        if not await q.write_step(
            tx,
            row.id,
            expected_seq=row.step_seq,
            status=state.status.value,
            stage=state.stage,
            state=state_to_dict(state),
            now=now,
            ended=state.status.ended,
        ):
            self.metrics.steps.labels("conflict").inc()
            return False  # nothing was written in this transaction: committing it is a no-op
        self.metrics.steps.labels("written").inc()
        moved = {i for a in result.actions if a.kind is ActionKind.MOVE for i in a.device_ids}
        changed_ids = [
            i for i, p in state.devices.items() if before.devices.get(i) != p or i in moved
        ]
        # ``moves`` of an updated row is added to the stored count (no read of the rows).
        changed = [_device_row(state.devices[i], 1 if i in moved else 0) for i in changed_ids]
        await q.update_devices(tx, row.id, changed)
        await self._record(tx, row, result, now, actor)
        return True

    async def _record(
        self, tx: Tx, row: RolloutView, result: Step, now: datetime, actor: str
    ) -> None:
        """History rows and webhook events for the step's decisions."""
        if not result.decisions:
            return
        await q.insert_events(
            tx,
            [
                {
                    "rollout_id": row.id,
                    "at": now,
                    "kind": d.kind,
                    "stage": d.stage,
                    "actor": actor,
                    "reason": d.reason[:2048],
                    "detail": dict(d.detail),
                }
                for d in result.decisions
            ],
        )
        for d in result.decisions:
            self.metrics.transitions.labels(d.kind).inc()
            if self._notify is not None:
                await self._notify(
                    tx,
                    f"rollout.{d.kind}",
                    {
                        "rollout": row.id,
                        "model": row.model,
                        "version": row.version,
                        "status": result.state.status.value,
                        "stage": d.stage,
                        "reason": d.reason,
                        "actor": actor,
                        "detail": dict(d.detail),
                    },
                    now,
                )

    async def _apply(
        self,
        tx: Tx,
        row: RolloutView,
        spec: RolloutSpec,
        state: RolloutState,
        actions: Sequence[Action],
        now: datetime,
        actor: str,
    ) -> dict[str, int]:
        """Turn the engine's actions into placements and issue the desired states."""
        if not actions:
            return {}
        placements: list[Placement] = []
        for action in actions:
            for device_id in action.device_ids:
                progress = state.devices[device_id]
                placements.append(self._placement(spec, action, progress))
        key = await self._deployments.director_key()
        by = actor if actor != SYSTEM else f"rollout {row.id}"
        return await self._deployments.place(
            tx, spec.model, placements, rollout_id=row.id, actor=by, now=now, key=key
        )

    @staticmethod
    def _placement(spec: RolloutSpec, action: Action, progress: DeviceProgress) -> Placement:
        old = progress.from_version
        if action.kind is ActionKind.REVERT:
            return Placement(progress.device_id, old, rollback=old is not None)
        if action.kind is ActionKind.PREFETCH:
            if old is None:  # nothing to keep running: the version itself, not yet switched
                return Placement(progress.device_id, spec.version)
            return Placement(progress.device_id, old, prefetch=spec.version)
        mode = action.mode or StageMode.SWITCH
        if mode is StageMode.SWITCH or old is None:
            return Placement(progress.device_id, spec.version)
        if mode is StageMode.CANARY:
            weight = action.weight if action.weight is not None else 0.1
            return Placement(
                progress.device_id,
                old,
                canary=(spec.version, CanaryPolicy(weight=weight)),
            )
        return Placement(progress.device_id, old, shadow=spec.version)

    async def _gauge(self) -> None:
        """Refresh the status and per-phase gauges."""
        async with self._db.read() as tx:
            counts = await q.count_by_status(tx)
            live = await q.list_rollouts(tx, limit=1000, statuses=q.ACTIVE_STATUSES)
            phases = await q.phase_counts(tx, [r.id for r in live])
        for status in ("running", "awaiting_approval", "paused", "rolling_back",
                       "succeeded", "rolled_back", "aborted"):  # fmt: skip
            self.metrics.rollouts.labels(status).set(counts.get(status, 0))
        seen: set[tuple[str, ...]] = set()
        for r in live:
            for phase in DevicePhase:
                labels: tuple[str, ...] = (str(r.id), r.model, phase.value)
                self.metrics.devices.labels(*labels).set(phases[r.id].get(phase.value, 0))
                seen.add(labels)
            for gate in state_from_dict(r.state).gates:
                gate_labels = (str(r.id), gate.metric.value)
                if gate.value is not None:
                    self.metrics.gate_value.labels(*gate_labels).set(gate.value)
                    seen.add(("gate", *gate_labels))
        for labels in self._gauged - seen:
            with contextlib.suppress(KeyError):
                if labels[0] == "gate":
                    self.metrics.gate_value.remove(*labels[1:])
                else:
                    self.metrics.devices.remove(*labels)
        self._gauged = seen
