"""The update agent: signed desired states in, converged models out (DESIGN 4.2, 4.4, 4.5).

:class:`UpdateAgent` is the fleet session's desired-state handler. For each accepted desired
state it converges every model's stable, canary and shadow version through the persisted state
machine (:mod:`agent.update.machine`, handlers in :mod:`agent.update.steps`), then its
``prefetch``: that version is downloaded and verified as for an install, installed and kept in
the store, never loaded, and reported among the installed versions (a later desired state that
makes it stable or canary finds it installed, so that switch downloads nothing). It publishes
a :class:`~shared.protocol.reports.EventReport` (the wire's ``DeploymentEvent``) for every step
(the flight recorder: ``event_seq`` persisted and increasing across restarts) and the
:class:`~shared.protocol.reports.StateReport` (``ReportedState``) after each change.

At start, :meth:`UpdateAgent.resume` loads the committed versions (whole install directories
only), finishes or rolls back deployments a crash interrupted, cleans ``staging/`` and applies
the stored desired state if it was not fully applied.

A desired state is refused (raised as the :class:`shared.errors.McpError` that
:func:`shared.protocol.state.verify_desired_state` gives) when its signature is not by a
director key, its ``seq`` is not above the last accepted one (replay) or it has expired
(freeze); nothing changes then.

What loads when (docs/agent.md "Memory"): this module, the machine's table and the store's file
layout import neither pydantic nor TUF. The desired-state schema (pydantic) loads with the first
desired state, the stored documents (:mod:`agent.update.records`) with the first one read or
written, the phase handlers (:mod:`agent.update.steps`: bundles) with the first deployment or
installed model, and python-tuf when a deployment first needs repository metadata. Events and
the reported state are plain values (:mod:`shared.protocol.reports`).
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import shutil
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from mcp_edge.agent import __version__
from mcp_edge.agent.runtime.manager import ModelManager
from mcp_edge.agent.runtime.runner import RunnerError
from mcp_edge.agent.update.machine import Cause, Phase, UpdateError, advance, new_record
from mcp_edge.agent.update.machine import Trigger as _Trigger
from mcp_edge.agent.update.store import DiskUsageFn, ModelStore
from mcp_edge.agent.update.transport import RepoTransport
from mcp_edge.agent.update.trust_root import load_bootstrap_root
from mcp_edge.shared.errors import ExpiredError, McpError, ReplayError, SigningError, TopicError
from mcp_edge.shared.fsutil import atomic_write_bytes
from mcp_edge.shared.profiles import HardwareProfile
from mcp_edge.shared.protocol.canary import DEFAULT_CANARY_POLICY, CanaryPolicy
from mcp_edge.shared.protocol.reports import (
    EventOutcome,
    EventReport,
    ModelStatusReport,
    StateReport,
)
from mcp_edge.shared.protocol.topics import validate_id
from mcp_edge.shared.signing import PublicKey

if TYPE_CHECKING:
    from mcp_edge.agent.update.records import UpdateRecord
    from mcp_edge.agent.update.spans import DeploymentSpans
    from mcp_edge.agent.update.steps import DeploymentRunner, PhaseHook, RetryPolicy
    from mcp_edge.agent.update.tuf_client import TufClient
    from mcp_edge.shared.protocol.state import DesiredModel, DesiredState, TargetRef
    from mcp_edge.shared.tracing import Tracing

log = logging.getLogger("mcp.agent.update")

MAX_DESIRED_FILE = 1024 * 1024
MAX_BACKEND_TEXT = 128
"""The longest ``backend/provider`` a reported state carries (``ModelStatus.active_backend``)."""


class UpdateSink(Protocol):
    """Where events and reported states go (the fleet session implements it)."""

    async def publish_event(self, event: EventReport) -> None: ...

    async def publish_reported(self, state: StateReport) -> None: ...


EventObserver = Callable[["UpdateRecord", Phase, EventOutcome, str, "float | None"], None]
"""Sees each deployment event: record, phase, outcome, message, elapsed ms."""


class FlightRecorder:
    """Numbers deployment events (persisted counter), keeps the recent ones, and sends them in
    order to the sink. ``record`` is thread-safe (download progress comes from a thread)."""

    def __init__(self, store: ModelStore, device_id: str, clock: Callable[[], float]) -> None:
        self.store, self.device_id, self.clock = store, device_id, clock
        self.sink: UpdateSink | None = None
        self.recent: collections.deque[EventReport] = collections.deque(maxlen=256)
        self.observer: EventObserver | None = None
        """Also sees every event (deployment spans); called under the recorder's lock."""
        self._pending: collections.deque[EventReport] = collections.deque()
        self._lock = threading.Lock()

    def record(
        self, rec: UpdateRecord, phase: Phase, outcome: EventOutcome, message: str = "", *,
        cause: str | None = None, bytes_done: int | None = None, elapsed_ms: float | None = None,
    ) -> EventReport:  # fmt: skip
        with self._lock:
            event = EventReport(
                device_id=self.device_id, event_seq=self.store.next_event_seq(), ts=self.clock(),
                model=rec.model, version=rec.to_version, phase=phase, outcome=outcome,
                message=message[:2048], cause=cause, bytes_done=bytes_done,
                bytes_total=rec.length, elapsed_ms=elapsed_ms,
            )  # fmt: skip
            self.recent.append(event)
            self._pending.append(event)
            if self.observer is not None:
                try:
                    self.observer(rec, phase, outcome, event.message, elapsed_ms)
                except Exception:  # tracing never fails a deployment
                    log.exception("deployment event observer failed")
        return event

    def refused(self, model: str, version: str, cause: str, message: str) -> EventReport:
        """Record that a desired state naming ``model`` ``version`` was refused (nothing ran)."""
        with self._lock:
            event = EventReport(
                device_id=self.device_id, event_seq=self.store.next_event_seq(), ts=self.clock(),
                model=model, version=version, phase=Phase.IDLE, outcome=EventOutcome.ERROR,
                message=message[:2048], cause=cause,
            )  # fmt: skip
            self.recent.append(event)
            self._pending.append(event)
        return event

    async def flush(self) -> None:
        """Hand pending events to the sink, oldest first (kept while there is no sink)."""
        while self.sink is not None:
            with self._lock:
                if not self._pending:
                    return
                event = self._pending[0]
            try:
                await self.sink.publish_event(event)
            except Exception:
                log.exception("deployment event %d not handed over", event.event_seq)
                return
            with self._lock:
                self._pending.popleft()


class UpdateAgent:
    """Converges this device's models to signed desired states (see the module docstring).

    Args:
        state_dir: the agent's state directory (``models/``, ``staging/``, ``updates/``, ``tuf/``).
        device_id: this device; desired states for another device are refused.
        profile: the hardware profile (picks bundle variants).
        manager: the model manager that serves.
        transport: the way to the TUF repository.
        director_keys: keys desired states must be signed by.
        events: where events and reported states go (may be attached later with :meth:`attach`).
        clock: Unix time in seconds (desired-state expiry, event timestamps).
        tuf_root: the TUF trust anchor (default: the one ``mcp-agent enroll`` stored).
        retry: attempts and backoff for transport failures.
        phase_hook: called after each record write, before that phase's work (fault tests).
        sleep: awaited between retries.
        disk_usage: ``shutil.disk_usage``-like, for the free-disk check.
        backends: reported as the device's backends.
        tracing: where deployment spans go (:mod:`agent.update.spans`); None: off.
    """

    def __init__(
        self,
        state_dir: Path,
        device_id: str,
        profile: HardwareProfile,
        manager: ModelManager,
        transport: RepoTransport,
        director_keys: Iterable[PublicKey],
        *,
        events: UpdateSink | None = None,
        clock: Callable[[], float] = time.time,
        tuf_root: bytes | None = None,
        retry: RetryPolicy | None = None,
        phase_hook: PhaseHook | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        disk_usage: DiskUsageFn = shutil.disk_usage,
        backends: Iterable[str] = (),
        tracing: Tracing | None = None,
    ) -> None:
        self.state_dir = Path(state_dir)
        self.device_id = device_id
        self.profile = profile
        self.manager = manager
        self.transport = transport
        self.director_keys = list(director_keys)
        self.clock = clock
        self.backends = list(backends)
        self.store = ModelStore(self.state_dir, disk_usage=disk_usage)
        self.recorder = FlightRecorder(self.store, device_id, clock)
        self.recorder.sink = events
        self.spans: DeploymentSpans | None = None
        if tracing is not None:
            from mcp_edge.agent.update.spans import DeploymentSpans

            self.spans = DeploymentSpans(tracing, device_id)
            self.recorder.observer = self.spans.on_event
        root = tuf_root if tuf_root is not None else load_bootstrap_root(self.state_dir)
        self._tuf_root = root
        self._runner_args = (sleep, retry, phase_hook)
        self._runner: DeploymentRunner | None = None
        self._lock = asyncio.Lock()
        self._desired_path = self.state_dir / "desired-state.json"

    def attach(self, sink: UpdateSink) -> None:
        """Send events and reported states to ``sink`` from now on (pending events included)."""
        self.recorder.sink = sink

    @property
    def runner(self) -> DeploymentRunner:
        """The phase handlers, built (and :mod:`agent.update.steps` imported) on first use."""
        if self._runner is None:
            from mcp_edge.agent.update.steps import DeploymentRunner

            sleep, retry, phase_hook = self._runner_args
            self._runner = DeploymentRunner(
                self.store, self.manager, self.profile, self._tuf_client, self.transport,
                emit=self.recorder.record, clock=self.clock, sleep=sleep, retry=retry,
                phase_hook=phase_hook,
            )  # fmt: skip
        return self._runner

    def _tuf_client(self) -> TufClient:
        if self._tuf_root is None:
            raise UpdateError(Cause.TUF_METADATA,
                              "no TUF trust root in the state directory; run `mcp-agent enroll`")  # fmt: skip
        from mcp_edge.agent.update.tuf_client import TufClient  # python-tuf loads here

        return TufClient(self.state_dir, self.transport, bootstrap_root=self._tuf_root)

    # ------------------------------------------------------------------ desired state
    def _desired_doc(self) -> dict[str, Any]:
        try:
            data = self._desired_path.read_bytes()[: MAX_DESIRED_FILE + 1]
            doc = json.loads(data)
            return doc if isinstance(doc, dict) else {}
        except (FileNotFoundError, ValueError):
            return {}

    @property
    def accepted_seq(self) -> int:
        """The highest desired-state seq accepted (replay protection survives restarts)."""
        return int(self._desired_doc().get("seq", 0))

    @property
    def applied_seq(self) -> int:
        return int(self._desired_doc().get("applied_seq", 0))

    def _save_desired(self, seq: int, applied_seq: int, envelope: Any) -> None:
        doc = {"seq": seq, "applied_seq": applied_seq, "envelope": envelope}
        self.state_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(self._desired_path, json.dumps(doc).encode())

    def _now(self) -> datetime:
        return datetime.fromtimestamp(self.clock(), timezone.utc)

    async def handle_desired(self, envelope: Any) -> None:
        """Verify a desired-state envelope and converge to it.

        Raises the :class:`McpError` of a refused document (signature, schema, another device,
        replay, expiry); deployment failures are not raised (they are events and records).
        """
        from mcp_edge.shared.protocol.state import verify_desired_state  # pydantic loads here

        async with self._lock:
            try:
                state = verify_desired_state(
                    envelope, self.director_keys, device_id=self.device_id,
                    last_seq=self.accepted_seq, now=self._now(),
                )  # fmt: skip
            except McpError as e:
                if isinstance(e, ReplayError) and envelope == self._desired_doc().get("envelope"):
                    # The retained document again (a new subscription after a restart or a
                    # reconnect): already accepted, nothing to do and nothing to report.
                    log.debug("desired state seq %s is the one already accepted", self.accepted_seq)
                    return
                log.warning("desired state refused: %s", e)
                for model, version in _named_models(envelope):
                    self.recorder.refused(model, version, _refusal_cause(e), str(e))
                await self.recorder.flush()
                raise
            log.info("desired state seq %d accepted (%d models)", state.seq, len(state.models))
            if self.spans is not None:
                self.spans.begin(state.seq, state.traceparent)
            await asyncio.to_thread(self._save_desired, state.seq, self.applied_seq, envelope)
            await self._converge(state, envelope)

    async def _converge(self, state: DesiredState, envelope: Any) -> None:
        for model in state.models:
            await self._converge_model(model, state.seq)
        wanted = {m.name for m in state.models}
        for name in self.store.indexed_models():
            if name not in wanted:
                await self._retire_model(name)
        await asyncio.to_thread(self._save_desired, state.seq, state.seq, envelope)
        await self._report()

    async def _converge_model(self, model: DesiredModel, seq: int) -> None:
        self._keep_installed_prefetch(model)
        await self._deploy(model.name, "stable", model.stable, seq, rollback=model.rollback)
        index = self.store.index(model.name)
        if model.canary is not None:
            c = model.canary
            if index.canary is not None and index.canary.version == c.target.version:
                self._set_canary_policy(model.name, c.policy)
            else:
                await self._deploy(model.name, "canary", c.target, seq, canary=c.policy,
                                   rollback=model.rollback)  # fmt: skip
        elif index.canary is not None:
            await self._drop_role(model.name, index.canary.version, "canary")
        index = self.store.index(model.name)
        if model.shadow is not None:
            await self._deploy(model.name, "shadow", model.shadow, seq, rollback=model.rollback)
        elif index.shadow is not None:
            await self._drop_role(model.name, index.shadow, "shadow")
        await self._prefetch(model, seq)

    def _prefetched(self, name: str, target: TargetRef) -> bool:
        """True when ``target`` is installed (whole, same sha256) and the index keeps it as the
        prefetch."""
        info = self.store.installed(name, target.version)
        prefetch = self.store.index(name).prefetch
        return prefetch == target.version and info is not None and info.sha256 == target.sha256

    def _keep_installed_prefetch(self, model: DesiredModel) -> None:
        """A desired prefetch that is installed already (a version leaving its role, or the one
        before it) is named in the index before the roles change, so no collection removes it
        and it needs no download."""
        want = model.prefetch
        if want is None:
            return
        info = self.store.installed(model.name, want.version)
        index = self.store.index(model.name)
        if info is not None and info.sha256 == want.sha256 and index.prefetch != want.version:
            self.store.save_index(index.model_copy(update={"prefetch": want.version}))

    async def _prefetch(self, model: DesiredModel, seq: int) -> None:
        """Keep ``model.prefetch`` installed and unloaded, or let go of a prefetch the desired
        state no longer names. A failed prefetch is a failed record of its own and events; what
        serves is not touched."""
        want = model.prefetch
        if want is None:
            if self.store.index(model.name).prefetch is not None:
                await self._let_go_prefetch(model.name)
            return
        if self._prefetched(model.name, want):
            log.debug("%s %s already prefetched: nothing to do", model.name, want.version)
            return
        active = self.store.index(model.name).active
        record = new_record(
            model=model.name, role="prefetch", from_version=active, to_version=want.version,
            target_path=want.target_path, sha256=want.sha256, length=want.length,
            desired_seq=seq, now=self.clock(), rollback=model.rollback,
        )  # fmt: skip
        log.info("prefetching %s %s beside %s (not run)", model.name, want.version,
                 active or "nothing")  # fmt: skip
        self.recorder.record(record, Phase.IDLE, EventOutcome.PROGRESS,
                             f"prefetch started beside {active or 'nothing'}: download and "
                             "verify, not run")  # fmt: skip
        result = await self.runner.run(record)
        if result.phase is not Phase.IDLE and self.store.index(model.name).prefetch is not None:
            await self._let_go_prefetch(model.name)  # the one it replaces is not wanted either
        await self.recorder.flush()
        await self._report()

    async def _let_go_prefetch(self, name: str) -> None:
        index = self.store.index(name)
        log.info("%s %s is no longer wanted as prefetch", name, index.prefetch)
        index = index.model_copy(update={"prefetch": None})
        self.store.save_index(index)
        await asyncio.to_thread(self.store.gc, name, index.referenced())

    def _current(self, name: str, role: str) -> str | None:
        index = self.store.index(name)
        if role == "stable":
            return index.active
        if role == "canary":
            return index.canary.version if index.canary else None
        return index.shadow

    async def _deploy(
        self, name: str, role: str, target: TargetRef, seq: int, *, rollback: bool = False,
        canary: CanaryPolicy | None = None,
    ) -> UpdateRecord | None:  # fmt: skip
        from mcp_edge.agent.update.steps import loaded_roles

        current = self._current(name, role)
        info = self.store.installed(name, target.version)
        serving = loaded_roles(self.manager, name).get(target.version) == role
        if current == target.version and serving and info is not None \
                and info.sha256 == target.sha256:  # fmt: skip
            log.debug("%s %s already %s: nothing to do", name, target.version, role)
            return None
        record = new_record(
            model=name, role=role, from_version=current, to_version=target.version,
            target_path=target.target_path, sha256=target.sha256, length=target.length,
            desired_seq=seq, now=self.clock(), rollback=rollback, canary=canary,
        )  # fmt: skip
        log.info(
            "deploying %s %s as %s (from %s)", name, target.version, role, current or "nothing"
        )
        self.recorder.record(record, Phase.IDLE, EventOutcome.PROGRESS,
                             f"deployment as {role} from {current or 'nothing'} started")  # fmt: skip
        result = await self.runner.run(record)
        await self.recorder.flush()
        await self._report()
        return result

    def _set_canary_policy(self, name: str, policy: CanaryPolicy) -> None:
        """The same canary under another policy: applied in place, no new deployment."""
        self.manager.set_canary_policy(name, policy)
        index = self.store.index(name)
        if index.canary is not None and index.canary.policy != policy:
            ref = index.canary.model_copy(update={"policy": policy})
            self.store.save_index(index.model_copy(update={"canary": ref}))

    async def _drop_role(self, name: str, version: str, role: str) -> None:
        from mcp_edge.agent.update.steps import loaded_roles

        log.info("%s %s is no longer wanted as %s: unloading", name, version, role)
        if loaded_roles(self.manager, name).get(version) == role:
            await self.manager.unload(name, version)
        index = self.store.index(name)
        index = index.model_copy(update={role: None})
        self.store.save_index(index)
        await asyncio.to_thread(self.store.gc, name, index.referenced())

    async def _retire_model(self, name: str) -> None:
        index = self.store.index(name)
        if (index.active, index.canary, index.shadow, index.prefetch) == (None,) * 4:
            return
        from mcp_edge.agent.update.steps import loaded_roles

        log.info("%s is not in the desired state any more: unloading", name)
        if loaded_roles(self.manager, name):
            await self.manager.unload(name)
        previous = index.active or index.previous
        self.store.save_index(index.model_copy(update={"active": None, "previous": previous,
                                                       "canary": None, "shadow": None,
                                                       "prefetch": None}))  # fmt: skip

    # ------------------------------------------------------------------ start-up
    async def resume(self) -> None:
        """Serve what is committed, then finish or roll back interrupted deployments, clean
        staging, and apply the stored desired state if it was accepted but not applied."""
        async with self._lock:
            await asyncio.to_thread(self.store.ensure_dirs)
            for name in self.store.indexed_models():
                await self._load_committed(name)
            for record in [*self.store.records(), *self.store.records(prefetch=True)]:
                if record.interrupted:
                    await self._recover(record)
            await asyncio.to_thread(self.store.clean_staging)
            for name in self.store.indexed_models():
                await asyncio.to_thread(self.store.gc, name, self.store.index(name).referenced())
            doc = self._desired_doc()
            if doc.get("seq", 0) > doc.get("applied_seq", 0):
                await self._reapply(doc)
            await self.recorder.flush()
            await self._report()

    async def _load_committed(self, name: str) -> None:
        from mcp_edge.agent.update.steps import installed_source, loaded_roles

        index = self.store.index(name)
        roles = [("stable", index.active)]
        if index.canary is not None:
            roles.append(("canary", index.canary.version))
        roles.append(("shadow", index.shadow))
        for role, version in roles:
            if version is None or loaded_roles(self.manager, name).get(version) == role:
                continue
            info = self.store.installed(name, version)
            if info is None:
                log.error("%s %s is committed as %s but not installed", name, version, role)
                continue
            try:
                source = installed_source(self.store, info)
                policy = index.canary.policy if index.canary else DEFAULT_CANARY_POLICY
                await self.manager.load(source, role=role, canary=policy)
            except (RunnerError, UpdateError) as e:
                log.error("%s %s (%s) does not load: %s", name, version, role, e)

    async def _recover(self, record: UpdateRecord) -> None:
        installed = self.store.installed(record.model, record.to_version) is not None
        log.warning("%s %s was interrupted in %s; %s", record.model, record.to_version,
                    record.phase.value, "resuming")  # fmt: skip
        if record.phase in (Phase.LOADING, Phase.WARMING) and not installed:
            record = advance(record, _Trigger.FAIL, now=self.clock(), cause=Cause.INTERRUPTED,
                             error=f"interrupted in {record.phase.value}; install incomplete")  # fmt: skip
        self.recorder.record(record, record.phase, EventOutcome.PROGRESS,
                             "resuming after the agent restarted")  # fmt: skip
        await self.runner.run(record)

    async def _reapply(self, doc: dict[str, Any]) -> None:
        from mcp_edge.shared.protocol.state import DesiredState

        try:
            state = DesiredState.model_validate(doc["envelope"]["signed"])
        except (KeyError, TypeError, ValueError) as e:
            log.error("stored desired state unreadable: %s", e)
            return
        if self._now() >= state.expires:
            log.warning("stored desired state seq %d expired; not applied", state.seq)
            return
        log.info("applying stored desired state seq %d", state.seq)
        await self._converge(state, doc["envelope"])

    # ------------------------------------------------------------------ reporting
    def reported_state(self) -> StateReport:
        """What this device runs now, per model."""
        models = []
        names = sorted(set(self.store.indexed_models()) | {r.model for r in self.store.records()})
        for name in names[:64]:
            index = self.store.index(name)
            record = self.store.record(name)
            phase = record.phase if record is not None else Phase.IDLE
            if phase is Phase.IDLE and index.active is not None:
                phase = Phase.ACTIVE
            error = record.error if record is not None and record.phase is Phase.FAILED else None
            variant, backend = self._running(name, index.active)
            models.append(ModelStatusReport(
                name=name, phase=phase, active_version=index.active,
                canary_version=index.canary.version if index.canary else None,
                shadow_version=index.shadow,
                installed_versions=self.store.installed_versions(name)[:16],
                last_error=(f"{record.cause.value}: {error}" if record and record.cause
                            and error else None),
                active_variant=variant, active_backend=backend,
            ))  # fmt: skip
        return StateReport(
            device_id=self.device_id, ts=self.clock(), applied_seq=self.applied_seq,
            profile=self.profile.name, backends=self.backends[:16], agent_version=__version__,
            models=models,
        )  # fmt: skip

    def _running(self, name: str, version: str | None) -> tuple[str | None, str | None]:
        """The variant ``version`` of ``name`` was installed as (its ``install.json``) and the
        ``backend/provider`` it is loaded on; each None when unknown: no install info, not
        loaded, or text the reported state would refuse (a variant that is no identifier, a
        backend longer than :data:`MAX_BACKEND_TEXT`)."""
        if version is None:
            return None, None
        info = self.store.installed(name, version)
        variant = info.variant if info is not None else None
        if variant is not None:
            try:
                validate_id(variant, "variant")
            except TopicError:
                log.warning("%s %s: variant %r is not reported", name, version, variant[:80])
                variant = None
        try:
            loaded = self.manager.get(name, version).info
        except RunnerError:
            return variant, None
        backend = f"{loaded.backend}/{loaded.provider}"
        return variant, backend if len(backend) <= MAX_BACKEND_TEXT else None

    async def _report(self) -> None:
        sink = self.recorder.sink
        if sink is None:
            return
        try:
            await sink.publish_reported(self.reported_state())
        except Exception:
            log.exception("reported state not handed over")

    def status(self) -> dict[str, Any]:
        """Records and installed versions, for ``mcp-agent updates``."""
        return updates_status(self.store)


def updates_status(store: ModelStore) -> dict[str, Any]:
    """A JSON-able snapshot of the update state in a store (no agent needed)."""
    out: dict[str, Any] = {"models": {}}
    names = sorted(set(store.indexed_models()) | {r.model for r in store.records()})
    for name in names:
        record = store.record(name)
        prefetch = store.record(name, prefetch=True)
        out["models"][name] = {
            "index": store.index(name).model_dump(mode="json"),
            "installed": store.installed_versions(name),
            "record": record.model_dump(mode="json") if record else None,
            "prefetch_record": prefetch.model_dump(mode="json") if prefetch else None,
        }
    return out


def _refusal_cause(e: McpError) -> str:
    """The event cause of a refused desired state."""
    if isinstance(e, SigningError):
        return "desired_signature"
    if isinstance(e, ReplayError):
        return "desired_replay"
    if isinstance(e, ExpiredError):
        return "desired_expired"
    return "desired_invalid"


def _named_models(envelope: Any) -> list[tuple[str, str]]:
    """``(model, stable version)`` pairs a refused envelope names, where they are well-formed.

    Only for the event that says what was refused: nothing here is acted upon.
    """
    signed = envelope.get("signed") if isinstance(envelope, dict) else None
    models = signed.get("models") if isinstance(signed, dict) else None
    named: list[tuple[str, str]] = []
    for m in models[:64] if isinstance(models, list) else []:
        stable = m.get("stable") if isinstance(m, dict) else None
        name = m.get("name") if isinstance(m, dict) else None
        version = stable.get("version") if isinstance(stable, dict) else None
        if not (isinstance(name, str) and isinstance(version, str) and 5 <= len(version) <= 128):
            continue
        try:
            named.append((validate_id(name, "model name"), version))
        except McpError:
            continue
    return named
