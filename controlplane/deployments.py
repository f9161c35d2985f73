"""Deployments: what each device should run, as a director-signed desired state (DESIGN 4.2).

:class:`DeploymentService` turns an operator's deploy or undeploy into rows of
``device_models`` and, for every device touched, a whole new :class:`DesiredState` (every model
of that device, ``seq`` one above the last, expiring after ``settings.desired_ttl_s``) signed
with the director key, stored in ``desired_states`` and published retained at QoS 1 on the
device's ``desired`` topic. The database row is the truth: a publish that fails (broker down, no
broker configured yet) leaves the row unpublished, and the background task publishes it later.
The same task re-signs each document (next seq) at half its lifetime, so a device that is
online never sees its desired state expire, and a device cut off from the control plane freezes.

Group and label deployments stand: a device accepted later into the group (or with the labels)
gets the newest deployment of each model through :meth:`DeploymentService.device_accepted`.

Errors (all :class:`DeploymentError`, by who is at fault)::

    InvalidDeploymentError   400  the request contradicts itself (canary and shadow, ...)
    UnknownVersionError      404  the model or a version was never published
    UnknownDeviceError       404  no such device / the device does not have the model
    DeploymentConflictError  409  a device is not accepted, its profile fits no variant, ...
    DowngradeError           409  a device would go below its current version without rollback
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Protocol

import orjson
from pydantic import ValidationError

from mcp_edge.controlplane.db import Database, Tx
from mcp_edge.controlplane.db import audit as audit_q
from mcp_edge.controlplane.db import deployments as q
from mcp_edge.controlplane.db import devices as device_q
from mcp_edge.controlplane.db.deployments import (
    DeploymentView,
    DesiredView,
    DeviceModelView,
    VersionView,
    canary_columns,
)
from mcp_edge.controlplane.db.devices import DeviceFilter, DeviceView
from mcp_edge.controlplane.desired import build_desired_state, downgrades, misfits
from mcp_edge.controlplane.repository.tuf_repo import DIRECTOR, KeyStore
from mcp_edge.controlplane.settings import Settings
from mcp_edge.shared.errors import McpError
from mcp_edge.shared.protocol import topics
from mcp_edge.shared.protocol.canary import CanaryPolicy
from mcp_edge.shared.protocol.state import DesiredState, TelemetryPolicy, sign_desired_state
from mcp_edge.shared.signing import PrivateKey

if TYPE_CHECKING:
    from mcp_edge.shared.tracing import Tracing

log = logging.getLogger("mcp.controlplane.deployments")

Clock = Callable[[], datetime]
ACCEPTED = "accepted"
SYSTEM_ACTOR = "system"
DEPLOY, UNDEPLOY = "deploy", "undeploy"
MAX_MATCHED_DEVICES = 100_000
BATCH = 500


class DesiredPublisher(Protocol):
    """Where signed desired states go: the control plane's MQTT session."""

    async def publish(
        self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False
    ) -> None: ...


class DeploymentError(McpError):
    """A deployment cannot be made as asked."""


class InvalidDeploymentError(DeploymentError):
    pass


class UnknownVersionError(DeploymentError):
    pass


class UnknownDeviceError(DeploymentError):
    pass


class DeploymentConflictError(DeploymentError):
    pass


class DowngradeError(DeploymentConflictError):
    """``devices`` maps each device that would go down to the version it has now."""

    def __init__(self, message: str, devices: Mapping[str, str]) -> None:
        super().__init__(message)
        self.devices = dict(devices)


@dataclass(frozen=True)
class Selector:
    """Which devices: exactly one of a device id, a group, or labels (all must match)."""

    device_id: str | None = None
    group: str | None = None
    labels: Mapping[str, str] | None = None

    def __post_init__(self) -> None:
        given = [x for x in (self.device_id, self.group, self.labels) if x]
        if len(given) != 1:
            raise InvalidDeploymentError("select devices by exactly one of device, group, labels")

    def describe(self) -> str:
        if self.device_id:
            return f"device {self.device_id}"
        if self.group:
            return f"group {self.group}"
        return "labels " + ",".join(f"{k}={v}" for k, v in (self.labels or {}).items())

    def matches(self, device: DeviceView) -> bool:
        if self.device_id:
            return device.id == self.device_id
        if self.group:
            return device.group_name == self.group
        return all(device.labels.get(k) == v for k, v in (self.labels or {}).items())

    @classmethod
    def of(cls, deployment: DeploymentView) -> Selector:
        return cls(deployment.device_id, deployment.group_name, deployment.labels)


@dataclass(frozen=True)
class Issued:
    """A desired state issued to one device; ``published`` once the broker took it."""

    device_id: str
    seq: int
    published: bool


@dataclass(frozen=True)
class Outcome:
    """What a deploy or undeploy did. ``publisher`` False: no broker is configured, so the
    documents are stored and go out once one is."""

    deployment: DeploymentView
    issued: list[Issued]
    skipped: dict[str, str] = field(default_factory=dict)
    publisher: bool = True


@dataclass(frozen=True)
class Placement:
    """What one device should run of a model after a rollout step: ``stable`` None removes
    the model (the device had none before the rollout)."""

    device_id: str
    stable: str | None
    canary: tuple[str, CanaryPolicy] | None = None
    shadow: str | None = None
    prefetch: str | None = None
    rollback: bool = False

    def key(self) -> tuple[object, ...]:
        return (self.stable, self.canary, self.shadow, self.prefetch, self.rollback)


class DeploymentService:
    """Deploy, undeploy, and keep every device's signed desired state fresh and published.

    ``publisher`` None: documents are stored, never published (no broker yet). ``interval_s``:
    how often the background task looks for documents to re-sign; after a failed publish it
    retries sooner (1 s, doubling up to ``interval_s``). ``publish_timeout_s`` bounds the
    publishes a request waits for; what is left goes out from the background task.
    """

    def __init__(
        self,
        db: Database,
        keys: KeyStore,
        publisher: DesiredPublisher | None,
        clock: Clock,
        settings: Settings,
        *,
        interval_s: float = 60.0,
        publish_timeout_s: float = 5.0,
        tracing: Tracing | None = None,
    ) -> None:
        self._db = db
        self._tracing = tracing
        self._keys = keys
        self._publisher = publisher
        self._clock = clock
        self._ttl = timedelta(seconds=settings.desired_ttl_s)
        self._telemetry = TelemetryPolicy(
            inference_interval_s=settings.inference_interval_s, drift=settings.drift_policy
        )
        self._interval_s = min(interval_s, settings.desired_ttl_s / 10)
        self._publish_timeout_s = publish_timeout_s
        self._publish_lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._failing = False

    @property
    def db(self) -> Database:
        return self._db

    @property
    def publishes(self) -> bool:
        """Whether a broker session is configured to publish documents."""
        return self._publisher is not None

    def use_publisher(self, publisher: DesiredPublisher | None) -> None:
        """Publish through ``publisher`` from now on (its session opens after construction)."""
        self._publisher = publisher
        self.wake()

    # ------------------------------------------------------------------ operator actions
    async def deploy(
        self,
        model: str,
        version: str,
        selector: Selector,
        *,
        canary: tuple[str, CanaryPolicy] | None = None,
        shadow: str | None = None,
        rollback: bool = False,
        actor: str,
    ) -> Outcome:
        """Make ``version`` the stable version of ``model`` on every accepted device selected
        (with a canary ``(version, policy)`` or a shadow version), then issue and publish each
        device's new desired state. Raises :class:`DeploymentError` subclasses.

        With tracing on, the call is a span (``deploy MODEL VERSION``) whose trace the issued
        desired states carry, so each device's deployment continues it.
        """
        tracing = self._tracing
        if tracing is None:
            return await self._deploy(model, version, selector, canary, shadow, rollback, actor)
        attributes = {"mcp.model": model, "mcp.version": version, "mcp.actor": actor,
                      "mcp.selector": selector.describe()}  # fmt: skip
        with tracing.tracer.start_as_current_span(
            f"deploy {model} {version}", attributes=attributes
        ) as span:
            try:
                outcome = await self._deploy(
                    model, version, selector, canary, shadow, rollback, actor,
                    tracing.traceparent(span),
                )  # fmt: skip
            except DeploymentError as e:
                tracing.error(span, str(e))
                raise
            span.set_attribute("mcp.devices", outcome.deployment.devices_matched)
            return outcome

    async def _deploy(
        self,
        model: str,
        version: str,
        selector: Selector,
        canary: tuple[str, CanaryPolicy] | None,
        shadow: str | None,
        rollback: bool,
        actor: str,
        traceparent: str | None = None,
    ) -> Outcome:
        if canary is not None and shadow is not None:
            raise InvalidDeploymentError("a model takes a canary or a shadow, not both")
        policy = canary_columns(canary[1] if canary else None)
        wanted = [version] + ([canary[0]] if canary else []) + ([shadow] if shadow else [])
        if len(set(wanted)) != len(wanted):
            raise InvalidDeploymentError("the canary or shadow must differ from the stable version")
        now, key = self._clock(), await self._director_key()
        async with self._db.transaction() as tx:
            versions = await self._versions(tx, model, wanted)
            devices = await self._accepted(tx, selector)
            fits, skipped = misfits(devices, [versions[v] for v in wanted])
            if selector.device_id and skipped:
                raise DeploymentConflictError(skipped[selector.device_id])
            ids = [d.id for d in fits]
            await self._refuse_downgrades(
                tx,
                model,
                {
                    "stable": versions[version],
                    **({"canary": versions[canary[0]]} if canary else {}),
                    **({"shadow": versions[shadow]} if shadow else {}),
                },
                ids,
                rollback,
            )
            deployment = await q.insert_deployment(
                tx,
                action=DEPLOY,
                model=model,
                version=version,
                device_id=selector.device_id,
                group_name=selector.group,
                labels=dict(selector.labels) if selector.labels else None,
                canary_version=canary[0] if canary else None,
                **policy,
                shadow_version=shadow,
                rollback=rollback,
                created_by=actor,
                created_at=now,
                devices_matched=len(ids),
            )
            await q.put_device_models(
                tx,
                [
                    DeviceModelView(
                        device_id=device_id,
                        model=model,
                        stable_version=version,
                        canary_version=canary[0] if canary else None,
                        **policy,
                        shadow_version=shadow,
                        rollback=rollback,
                        deployment_id=deployment.id,
                    )
                    for device_id in ids
                ],
                now=now,
            )
            seqs = await self._issue(tx, ids, now, key, traceparent)
            await self._audit(tx, now, actor, "deployment.created", deployment, skipped)
        log.info(
            "deployment %d: %s %s to %s: %d device(s), %d skipped, by %s",
            deployment.id,
            model,
            version,
            selector.describe(),
            len(ids),
            len(skipped),
            actor,
        )
        return Outcome(deployment, await self._publish_issued(seqs), skipped, self.publishes)

    async def undeploy(self, model: str, selector: Selector, *, actor: str) -> Outcome:
        """Remove ``model`` from every selected device that has it and issue their new desired
        states. A group or label undeploy also ends the standing deployment for devices
        accepted later. Raises :class:`UnknownDeviceError` when a selected device does not
        exist or does not have the model."""
        now, key = self._clock(), await self._director_key()
        async with self._db.transaction() as tx:
            if selector.device_id:
                if await device_q.get_device(tx, selector.device_id) is None:
                    raise UnknownDeviceError(f"no device {selector.device_id!r}")
                ids = await q.devices_with_model(tx, model, device_id=selector.device_id)
                if not ids:
                    raise UnknownDeviceError(
                        f"device {selector.device_id!r} has no desired version of {model!r}"
                    )
            elif selector.group:
                ids = await q.devices_with_model(tx, model, group_name=selector.group)
            else:
                having = set(await q.devices_with_model(tx, model))
                labelled, _ = await device_q.list_devices(
                    tx, DeviceFilter(labels=selector.labels), limit=MAX_MATCHED_DEVICES, offset=0
                )
                ids = [d.id for d in labelled if d.id in having]
            deployment = await q.insert_deployment(
                tx,
                action=UNDEPLOY,
                model=model,
                version=None,
                device_id=selector.device_id,
                group_name=selector.group,
                labels=dict(selector.labels) if selector.labels else None,
                rollback=False,
                created_by=actor,
                created_at=now,
                devices_matched=len(ids),
            )
            await q.remove_device_models(tx, model, ids)
            seqs = await self._issue(tx, ids, now, key)
            await self._audit(tx, now, actor, "deployment.removed", deployment, {})
        log.info(
            "undeploy %d: %s from %s: %d device(s), by %s",
            deployment.id,
            model,
            selector.describe(),
            len(ids),
            actor,
        )
        return Outcome(deployment, await self._publish_issued(seqs), {}, self.publishes)

    async def device_accepted(self, device_id: str) -> list[Issued]:
        """Give a newly accepted device the standing deployments that select it: for each
        model it does not have yet, the newest group, label or device deployment (none when
        that is an undeploy). Idempotent; returns the state issued, if any."""
        now, key = self._clock(), await self._director_key()
        async with self._db.transaction() as tx:
            device = await device_q.get_device(tx, device_id)
            if device is None or device.status != ACCEPTED:
                return []
            have = {m.model for m in (await q.device_models(tx, [device_id]))[device_id]}
            newest: dict[str, DeploymentView] = {}
            for d in await q.standing_deployments(
                tx, device_id=device_id, group_name=device.group_name
            ):
                if d.model not in newest and Selector.of(d).matches(device):
                    newest[d.model] = d
            applied: list[int] = []
            for d in newest.values():
                if d.action != DEPLOY or d.model in have or d.version is None:
                    continue
                wanted = [v for v in (d.version, d.canary_version, d.shadow_version) if v]
                found = await q.get_versions(tx, [(d.model, v) for v in wanted])
                if len(found) != len(wanted):
                    log.warning("deployment %d names a version no longer published", d.id)
                    continue
                _, skipped = misfits([device], list(found.values()))
                if skipped:
                    log.info(
                        "deployment %d skips device %s: %s", d.id, device_id, skipped[device_id]
                    )
                    continue
                await q.put_device_model(
                    tx,
                    DeviceModelView(
                        device_id=device_id,
                        model=d.model,
                        stable_version=d.version,
                        canary_version=d.canary_version,
                        **canary_columns(d.canary_policy),
                        shadow_version=d.shadow_version,
                        rollback=d.rollback,
                        deployment_id=d.id,
                    ),
                    now=now,
                )
                applied.append(d.id)
            if not applied:
                return []
            seqs = await self._issue(tx, [device_id], now, key)
            await audit_q.insert_entry(
                tx,
                at=now,
                actor=SYSTEM_ACTOR,
                action="deployment.applied",
                target_type="device",
                target_id=device_id,
                detail={"deployments": applied},
            )
        log.info("device %s accepted: deployments %s applied", device_id, applied)
        return await self._publish_issued(seqs)

    # ------------------------------------------------------------------ rollouts
    async def place(
        self,
        tx: Tx,
        model: str,
        placements: Sequence[Placement],
        *,
        rollout_id: int,
        actor: str,
        now: datetime,
        key: PrivateKey,
    ) -> dict[str, int]:
        """Within the caller's transaction, make each device run what its :class:`Placement`
        says of ``model`` (a rollout's step), record one deployment row per distinct placement
        (``rollout_id`` set, no selector), and issue every touched device's next desired
        state. Returns ``{device: seq}``; publish with :meth:`publish_issued` after the commit.
        The versions must be published (the rollout checked them when it was created)."""
        groups: dict[tuple[object, ...], list[Placement]] = {}
        for p in placements:
            groups.setdefault(p.key(), []).append(p)
        removed: list[str] = []
        for group in groups.values():
            first = group[0]
            policy = canary_columns(first.canary[1] if first.canary else None)
            deployment = await q.insert_deployment(
                tx,
                action=DEPLOY if first.stable is not None else UNDEPLOY,
                model=model,
                version=first.stable,
                canary_version=first.canary[0] if first.canary else None,
                **policy,
                shadow_version=first.shadow,
                prefetch_version=first.prefetch,
                rollback=first.rollback,
                created_by=actor,
                created_at=now,
                devices_matched=len(group),
                rollout_id=rollout_id,
            )
            if first.stable is None:
                removed.extend(p.device_id for p in group)
                continue
            await q.put_device_models(
                tx,
                [
                    DeviceModelView(
                        device_id=p.device_id,
                        model=model,
                        stable_version=first.stable,
                        canary_version=first.canary[0] if first.canary else None,
                        **policy,
                        shadow_version=first.shadow,
                        prefetch_version=first.prefetch,
                        rollback=first.rollback,
                        deployment_id=deployment.id,
                    )
                    for p in group
                ],
                now=now,
            )
        await q.remove_device_models(tx, model, removed)
        return await self._issue(tx, [p.device_id for p in placements], now, key)

    async def director_key(self) -> PrivateKey:
        """The director key documents are signed with (read each time: it may be rotated)."""
        return await self._director_key()

    async def publish_issued(self, seqs: Mapping[str, int]) -> list[Issued]:
        """Publish the documents :meth:`place` issued (after their transaction committed)."""
        return await self._publish_issued(seqs)

    async def refuse_downgrades(
        self, tx: Tx, model: str, version: VersionView, device_ids: list[str]
    ) -> None:
        """Raise :class:`DowngradeError` when ``version`` is below what any of the devices
        runs or was told to run (a rollout never goes down; a rollback deploy does)."""
        await self._refuse_downgrades(tx, model, {"stable": version}, device_ids, False)

    # ------------------------------------------------------------------ upkeep
    async def maintain(self) -> int:
        """Re-sign documents that reached half their lifetime, then publish what is
        unpublished. Returns how many documents still wait for the broker."""
        now, key = self._clock(), await self._director_key()
        async with self._db.transaction() as tx:
            due = await q.due_for_refresh(tx, now, limit=BATCH)
            if due:
                await self._issue(tx, due, now, key)
        if due:
            log.info("re-signed the desired state of %d device(s) before expiry", len(due))
        _, pending = await self.publish_pending()
        return pending

    async def publish_pending(
        self, device_ids: Collection[str] | None = None
    ) -> tuple[set[str], int]:
        """Publish unpublished documents (of ``device_ids``, or all), in batches until none is
        left or the broker fails one; return the devices published and how many failed.
        Without a publisher: nothing, 0."""
        if self._publisher is None:
            return set(), 0
        published: set[str] = set()
        failed = 0
        async with self._publish_lock:
            while not failed:
                async with self._db.read() as tx:
                    rows = await q.unpublished(tx, limit=BATCH, device_ids=device_ids)
                if not rows:
                    break
                results = await asyncio.gather(*(self._publish_one(r) for r in rows))
                done = {r.device_id: r.seq for r, ok in zip(rows, results, strict=True) if ok}
                failed = len(rows) - len(done)
                changed: list[str] = []
                if done:  # a document replaced meanwhile is unpublished again: the next batch
                    async with self._db.transaction() as tx:
                        changed = await q.mark_published(tx, done, self._clock())
                published |= set(done) - set(changed)
                if len(rows) < BATCH and not changed:
                    break
        if failed and not self._failing:
            log.warning("%d desired state(s) not published; retrying in the background", failed)
        elif not failed and self._failing:
            log.info("desired states publish again")
        self._failing = failed > 0
        return published, failed

    async def start(self) -> None:
        """Start the background task (re-sign before expiry, publish what is pending)."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="desired-state-upkeep")

    async def stop(self, grace_s: float = 10.0) -> None:
        """Let the round in progress finish (a task cancelled inside a transaction leaves the
        pool a connection it cannot reset), at most ``grace_s``; then end the task."""
        task, self._task = self._task, None
        if task is not None:
            self._stopping = True
            self._wake.set()
            try:
                await asyncio.wait_for(task, grace_s)
            except asyncio.TimeoutError:
                log.warning("desired-state upkeep ran past %.0f s at shutdown; cancelled", grace_s)
            self._stopping = False

    def wake(self) -> None:
        """Run the background task's next round now."""
        self._wake.set()

    async def _run(self) -> None:
        retry_s = 1.0
        while not self._stopping:
            try:
                pending = await self.maintain()
            except Exception:  # the task must outlive any one failing round
                log.exception("desired-state upkeep failed; trying again")
                pending = 1
            if pending:
                wait_s, retry_s = retry_s, min(retry_s * 2, self._interval_s)
            else:
                wait_s, retry_s = self._interval_s, 1.0
            if self._stopping:
                break
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), wait_s)
            self._wake.clear()

    # ------------------------------------------------------------------ internals
    async def _versions(self, tx: Tx, model: str, wanted: Sequence[str]) -> dict[str, VersionView]:
        found = await q.get_versions(tx, [(model, v) for v in wanted])
        if not await q.model_exists(tx, model):
            raise UnknownVersionError(f"no model {model!r} is published")
        for v in wanted:
            if (model, v) not in found:
                raise UnknownVersionError(f"model {model!r} has no published version {v!r}")
        return {v: found[(model, v)] for v in wanted}

    async def _accepted(self, tx: Tx, selector: Selector) -> list[DeviceView]:
        if selector.device_id:
            device = await device_q.get_device(tx, selector.device_id)
            if device is None:
                raise UnknownDeviceError(f"no device {selector.device_id!r}")
            if device.status != ACCEPTED:
                raise DeploymentConflictError(
                    f"device {device.id!r} is {device.status}; only accepted devices get models"
                )
            return [device]
        devices, _ = await device_q.list_devices(
            tx,
            DeviceFilter(group=selector.group, labels=selector.labels, statuses=[ACCEPTED]),
            limit=MAX_MATCHED_DEVICES,
            offset=0,
        )
        return devices

    async def _refuse_downgrades(
        self,
        tx: Tx,
        model: str,
        placed: Mapping[str, VersionView],
        ids: list[str],
        rollback: bool,
    ) -> None:
        """Refuse (409) when any version placed on a device, stable, canary or shadow, is
        below what the device runs or was last told to run, unless this is a rollback: the
        device's release counter would refuse it anyway, and the device would end failed."""
        if rollback or not ids:
            return
        current = {
            m.device_id: m.stable_version
            for ms in (await q.device_models(tx, ids)).values()
            for m in ms
            if m.model == model
        }
        known = await q.get_versions(tx, [(model, v) for v in set(current.values())])
        numeric = {v: view.version_numeric for (_, v), view in known.items()}
        reported = await q.reported_active_versions(tx, ids, model)
        for role, target in placed.items():
            below = downgrades(target.version_numeric, current, reported, numeric)
            if not below:
                continue
            listed = ", ".join(f"{d} ({v})" for d, v in sorted(below.items())[:20])
            more = f" and {len(below) - 20} more" if len(below) > 20 else ""
            what = f"{model} {target.version}" + ("" if role == "stable" else f" (as {role})")
            raise DowngradeError(
                f"{what} is below the current version on {len(below)} "
                f"device(s): {listed}{more}; deploy with rollback to go back on purpose",
                below,
            )

    async def _issue(
        self,
        tx: Tx,
        device_ids: Sequence[str],
        now: datetime,
        key: PrivateKey,
        traceparent: str | None = None,
    ) -> dict[str, int]:
        """Build, sign (with ``key``) and store the next desired state of each device;
        ``{device: seq}``. ``traceparent``: the deploy call's trace, carried to the devices."""
        if not device_ids:
            return {}
        previous = await q.desired_states(tx, device_ids, lock=True)
        models = await q.device_models(tx, device_ids)
        pairs = {
            (m.model, v)
            for ms in models.values()
            for m in ms
            for v in (m.stable_version, m.canary_version, m.shadow_version, m.prefetch_version)
            if v
        }
        versions = await q.get_versions(tx, pairs)
        seqs: dict[str, int] = {}
        documents: list[DesiredView] = []
        for device_id in device_ids:
            seq = previous[device_id].seq + 1 if device_id in previous else 1
            try:
                state = build_desired_state(
                    device_id, seq, now, self._ttl, models[device_id], versions,
                    self._telemetry, traceparent,
                )  # fmt: skip
            except ValidationError as e:
                raise DeploymentConflictError(
                    f"the desired state of {device_id!r} would be invalid: {e.errors()[0]['msg']}"
                ) from e
            envelope = sign_desired_state(state, key)
            if len(orjson.dumps(envelope)) > DesiredState.MAX_BYTES:
                raise DeploymentConflictError(f"the desired state of {device_id!r} is too large")
            documents.append(
                DesiredView(
                    device_id=device_id,
                    seq=seq,
                    envelope=envelope,
                    issued_at=now,
                    expires_at=state.expires,
                    refresh_at=now + self._ttl / 2,
                    published_at=None,
                )
            )
            seqs[device_id] = seq
        await q.save_desired_states(tx, documents)
        return seqs

    async def _director_key(self) -> PrivateKey:
        # Read each time: `keys rotate director` may replace the file beside a running serve.
        return await asyncio.to_thread(self._keys.ensure, DIRECTOR)

    async def _publish_issued(self, seqs: Mapping[str, int]) -> list[Issued]:
        published: set[str] = set()
        if seqs and self._publisher is not None:
            published, pending = await self.publish_pending(list(seqs))
            if pending:
                self.wake()
        return [Issued(d, s, d in published) for d, s in seqs.items()]

    async def _publish_one(self, row: DesiredView) -> bool:
        assert self._publisher is not None
        try:
            await asyncio.wait_for(
                self._publisher.publish(
                    topics.desired(row.device_id), orjson.dumps(row.envelope), qos=1, retain=True
                ),
                self._publish_timeout_s,
            )
        except Exception as e:  # any publisher failure leaves the row for the next round
            log.debug("desired state seq %d of %s not published: %r", row.seq, row.device_id, e)
            return False
        return True

    @staticmethod
    async def _audit(
        tx: Tx,
        now: datetime,
        actor: str,
        action: str,
        deployment: DeploymentView,
        skipped: Mapping[str, str],
    ) -> None:
        await audit_q.insert_entry(
            tx,
            at=now,
            actor=actor,
            action=action,
            target_type="deployment",
            target_id=str(deployment.id),
            detail={
                "model": deployment.model,
                "version": deployment.version,
                "selector": Selector.of(deployment).describe(),
                "canary": deployment.canary_version,
                "shadow": deployment.shadow_version,
                "rollback": deployment.rollback,
                "devices": deployment.devices_matched,
                "skipped": sorted(skipped)[:100],
            },
        )
