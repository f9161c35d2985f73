"""The model manager: loaded versions per model, routing, hot swap, canary and shadow.

Each model name has one *slot* holding its loaded versions and their roles: one ``stable``,
optionally a ``canary`` (a weighted share of routed traffic) or a ``shadow`` (sees a copy of
stable's inputs; only stable answers). Loading a version warms it on synthetic inputs and
checks its outputs (shape, dtype, no NaN) before it takes any role, so a bad model never serves.
A hot swap makes the new version stable in one assignment; requests already queued on the old
version finish there, and the old version is closed once it has drained.

Routing, for each request: ``X-Model-Version`` pins a version; otherwise an enabled canary gets
its weight of traffic, split by a hash of ``X-Request-Key`` (sticky) or at random; the rest goes
to stable. Each canary serves under its :class:`~shared.protocol.canary.CanaryPolicy`
(:mod:`agent.runtime.canary`): one whose error rate over its last ``window`` results passes
``max_error_rate`` (once the window holds at least ``min_requests`` results) is taken out of
rotation, and a failed canary request is answered by stable instead.

Statistics: the runs of a client's request (``infer(..., counted=True)``, as the HTTP and MQTT
transports ask) go to :attr:`ModelManager.stats`, an :class:`InferenceObserver` (the fleet
session's statistics collector), under the role the version has (:class:`InferenceRole`):
the version that answered; a canary failure handed to stable as a canary error and then a
stable request; each shadow copy as a shadow request, with whether its answer agreed with
stable's (:func:`agent.runtime.canary.answers_agree`). The shadow runs and is compared in a
task of its own, after stable's answer has gone back.

Drift: each run of a counted request that succeeded (the answer, and a shadow's copy) is also
handed, with its feeds and outputs, to :attr:`ModelManager.drift`, a :class:`DriftObserver`
(the fleet session's :class:`agent.fleet.drift.DriftTracker`), under the same role.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from mcp_edge.agent.runtime.batcher import (
    BatcherClosedError,
    BatchingConfig,
    BatchObserver,
    DeadlineExceededError,
    DynamicBatcher,
    OverloadedError,
    Priority,
)
from mcp_edge.agent.runtime.canary import CanaryState, answers_agree
from mcp_edge.agent.runtime.checks import warm_up
from mcp_edge.agent.runtime.runner import (
    Array,
    InferenceError,
    InputError,
    ModelLoadError,
    ModelRunner,
    RunnerError,
    RunnerInfo,
)
from mcp_edge.agent.runtime.statistics import VersionStatistics
from mcp_edge.agent.serving.metrics import AgentMetrics
from mcp_edge.shared.protocol.canary import DEFAULT_CANARY_POLICY, CanaryPolicy
from mcp_edge.shared.protocol.reports import InferenceRole

if TYPE_CHECKING:
    from mcp_edge.shared.bundle.manifest import DriftBaseline

log = logging.getLogger("mcp.agent.runtime")


class Outcome(str, enum.Enum):
    """How one run of a request on a version ended, as its statistics count it."""

    OK = "ok"
    ERROR = "error"
    REJECTED = "rejected"
    """Refused or cut short: overload or deadline."""


def outcome_of(e: BaseException) -> Outcome:
    """The outcome of a run that raised ``e``: overload and deadline are rejections."""
    if isinstance(e, (OverloadedError, DeadlineExceededError)):
        return Outcome.REJECTED
    return Outcome.ERROR


class InferenceObserver(Protocol):
    """Counts the runs of client requests (implemented by the fleet session's
    :class:`agent.fleet.telemetry.InferenceStatsCollector`). Called on the event loop; must be
    quick and must not raise."""

    def record(
        self,
        model: str,
        version: str,
        latency_s: float,
        outcome: Outcome,
        *,
        role: InferenceRole = InferenceRole.STABLE,
        agreed: bool | None = None,
    ) -> None:
        """One run of ``version`` in ``role`` that took ``latency_s`` seconds; ``agreed``: for
        a shadow answer, whether it agreed with stable's (None: not compared)."""


class DriftObserver(Protocol):
    """Takes the successful runs of client requests for drift measurement (implemented by
    :class:`agent.fleet.drift.DriftTracker`). Called on the event loop right after the run;
    must be quick (no numpy work here) and must not raise."""

    def observe(
        self,
        source: ModelSource,
        role: InferenceRole,
        feeds: dict[str, Array],
        outputs: dict[str, Array],
    ) -> None:
        """``source`` answered ``feeds`` with ``outputs`` in ``role``; the arrays are not
        changed afterwards and may be kept."""


class Replicas(Protocol):
    """The other serving processes of a multi-process server (``agent.serving.workers``),
    which load, swap and unload the same versions as this manager does."""

    @property
    def copies(self) -> int:
        """How many other copies of each loaded version they hold."""

    async def prepare(self, source: ModelSource) -> None:
        """Load and check ``source`` in every other process; raises ModelLoadError (having
        discarded the copies that loaded) when one fails."""

    async def commit(self, source: ModelSource, role: str, canary: CanaryPolicy) -> None:
        """Give the prepared ``source`` its role in every other process."""

    async def abort(self, source: ModelSource) -> None:
        """Discard the prepared copies of ``source``."""

    async def unload(self, name: str, version: str | None) -> None:
        """Unload a version (or the whole model) in every other process."""

    def set_canary_policy(self, name: str, policy: CanaryPolicy) -> None:
        """Apply a canary policy in every other process (sent in the background)."""


class ModelNotFoundError(RunnerError):
    """No such model, or no such version of it, is loaded."""


@dataclass(frozen=True)
class ModelSource:
    """A model version ready to load: the file for this device and what describes it."""

    name: str
    version: str
    model_path: Path
    labels: tuple[str, ...] = ()
    preprocessing: dict[str, Any] | None = None
    origin: Path | None = None
    """The file the operator gave (.onnx, .tflite or .mcpb)."""
    signer_keyid: str | None = None
    drift_baseline: DriftBaseline | None = None
    """The bundle's statistics drift is measured against; None: drift is not measured."""
    variant: str | None = None
    """The bundle variant ``model_path`` is (None for a bare model file)."""
    backend: str | None = None
    """A backend chosen for this version at install (``openvino``, ``onnxruntime``, a
    provider's short name): it overrides the serving default; None follows the profile."""


RunnerFactory = Callable[[ModelSource], Sequence[ModelRunner]]
"""Builds the instances (one or more runners) of a source; blocking, run off the loop."""


@dataclass
class LoadedVersion:
    """One version in memory: its instances behind a batcher."""

    source: ModelSource
    runners: Sequence[ModelRunner]
    batcher: DynamicBatcher
    load_s: float
    warmup_s: float
    statistics: VersionStatistics = field(default_factory=VersionStatistics)
    """Triton-shaped counters of this version (the statistics extension)."""
    output_names: tuple[str, ...] = field(init=False)
    """The model's outputs in signature order: what an answer holds unless told otherwise."""

    def __post_init__(self) -> None:
        self.output_names = tuple(s.name for s in self.runners[0].info.outputs)

    @property
    def name(self) -> str:
        return self.source.name

    @property
    def version(self) -> str:
        return self.source.version

    @property
    def info(self) -> RunnerInfo:
        return self.runners[0].info

    async def infer(
        self,
        feeds: dict[str, Array],
        priority: Priority,
        timeout_s: float | None,
        busy: bool = True,
    ) -> dict[str, Array]:
        return await self.batcher.infer(feeds, priority=priority, timeout_s=timeout_s, busy=busy)

    async def close(self) -> None:
        await self.batcher.close(drain=True)
        for r in self.runners:
            r.close()


@dataclass
class ShadowState:
    version: str
    compared: int = 0
    agreed: int = 0
    skipped: int = 0
    max_pending: int = 64
    pending: int = 0

    @property
    def agreement(self) -> float | None:
        return self.agreed / self.compared if self.compared else None


@dataclass
class ModelSlot:
    name: str
    versions: dict[str, LoadedVersion] = field(default_factory=dict)
    stable: str | None = None
    canary: CanaryState | None = None
    shadow: ShadowState | None = None

    def role_of(self, version: str) -> str:
        if version == self.stable:
            return "stable"
        if self.canary is not None and version == self.canary.version:
            return "canary"
        if self.shadow is not None and version == self.shadow.version:
            return "shadow"
        return "retiring"

    def counted_role(self, version: str) -> InferenceRole:
        """The role ``version``'s requests are counted under; a version retiring (draining
        after a swap) finishes as stable."""
        if self.canary is not None and version == self.canary.version:
            return InferenceRole.CANARY
        if self.shadow is not None and version == self.shadow.version:
            return InferenceRole.SHADOW
        return InferenceRole.STABLE


class ModelManager:
    """Owns every loaded model version of the agent."""

    def __init__(
        self,
        runner_factory: RunnerFactory,
        *,
        batching: BatchingConfig | None = None,
        metrics: AgentMetrics | None = None,
        available_memory: Callable[[], int | None] | None = None,
        memory_factor: float = 3.0,
        stats: InferenceObserver | None = None,
        drift: DriftObserver | None = None,
    ) -> None:
        self._factory = runner_factory
        self.stats = stats
        """Where the runs of counted requests go (see the module docstring); None: nowhere."""
        self.drift = drift
        """Where the successful runs of counted requests go with their arrays, for drift
        measurement; None: nowhere (drift off)."""
        self.batching = batching or BatchingConfig()
        self.metrics = metrics or AgentMetrics()
        self._available_memory = available_memory or _available_memory
        self._memory_factor = memory_factor
        self._slots: dict[str, ModelSlot] = {}
        self._lock = asyncio.Lock()
        self._retiring: set[asyncio.Task[None]] = set()
        self._shadow_tasks: set[asyncio.Task[None]] = set()
        self.replicas: Replicas | None = None
        """Other serving processes that mirror every load, swap and unload; None: alone."""

    # ----------------------------------------------------------------- queries
    @property
    def loaded_names(self) -> Collection[str]:
        """Names with at least one loaded version (cheap membership test)."""
        return self._slots.keys()

    def names(self) -> list[str]:
        return sorted(n for n, s in self._slots.items() if s.stable is not None)

    def slot(self, name: str) -> ModelSlot:
        slot = self._slots.get(name)
        if slot is None or slot.stable is None:
            raise ModelNotFoundError(f"model {name!r} is not loaded")
        return slot

    def set_canary_policy(self, name: str, policy: CanaryPolicy) -> bool:
        """Serve ``name``'s canary under ``policy`` from now on, keeping its latest results (one
        taken out of rotation stays out); False when the model has no canary."""
        slot = self._slots.get(name)
        if slot is None or slot.canary is None:
            return False
        slot.canary.policy = policy
        if slot.canary.enabled:
            self.metrics.canary_weight.labels(name).set(policy.weight)
        if self.replicas is not None:
            self.replicas.set_canary_policy(name, policy)
        return True

    def get(self, name: str, version: str | None = None) -> LoadedVersion:
        slot = self.slot(name)
        v = slot.stable if version is None else version
        lv = slot.versions.get(v or "")
        if lv is None:
            raise ModelNotFoundError(f"model {name!r} has no loaded version {version!r}")
        return lv

    def find(self, name: str, version: str) -> LoadedVersion | None:
        """The loaded version ``version`` of ``name`` (retiring ones included), or None."""
        slot = self._slots.get(name)
        return None if slot is None else slot.versions.get(version)

    def snapshot(self) -> list[tuple[LoadedVersion, str, CanaryPolicy]]:
        """Every loaded version with its role and canary policy, stable versions first (a
        canary or shadow needs its stable); versions retiring after a swap are left out."""
        stables: list[tuple[LoadedVersion, str, CanaryPolicy]] = []
        others: list[tuple[LoadedVersion, str, CanaryPolicy]] = []
        for slot in self._slots.values():
            policy = slot.canary.policy if slot.canary is not None else DEFAULT_CANARY_POLICY
            for version, lv in slot.versions.items():
                role = slot.role_of(version)
                if role != "retiring":
                    (stables if role == "stable" else others).append((lv, role, policy))
        return stables + others

    @property
    def ready(self) -> bool:
        return bool(self._slots) and all(s.stable is not None for s in self._slots.values())

    # ----------------------------------------------------------------- loading
    async def load(
        self,
        source: ModelSource,
        *,
        role: str = "stable",
        canary: CanaryPolicy = DEFAULT_CANARY_POLICY,
    ) -> LoadedVersion:
        """Load, warm and check ``source``, then give it ``role`` (stable, canary or shadow);
        a canary serves under ``canary``, its policy.

        Loading ``stable`` over an existing stable is a hot swap. With :attr:`replicas` (other
        serving processes) every process loads and checks its own copy first, and the role
        changes in all of them only once every copy passed (in the others first, then here).
        Raises :class:`ModelLoadError`
        (nothing changes anywhere) when the model does not load, does not fit in memory (all
        copies counted), or fails its warm-up checks.
        """
        if role not in ("stable", "canary", "shadow"):
            raise ValueError(f"unknown role {role!r}")
        existing = self._slots.get(source.name)
        if existing is not None and source.version in existing.versions:
            raise ModelLoadError(f"{source.name} {source.version} is already loaded")
        if role != "stable" and (existing is None or existing.stable is None):
            raise ModelLoadError(f"{source.name}: load a stable version before a {role}")
        lv = await self.prepare(source)
        replicas = self.replicas
        if replicas is not None:
            try:
                await replicas.prepare(source)
            except BaseException:
                await lv.close()
                raise
        if replicas is not None:
            # The other processes first: once this process (whose state the update agent and
            # the metadata report) serves the version, every process does.
            await replicas.commit(source, role, canary)
        async with self._lock:
            try:
                self._install(lv, role, canary)
            except BaseException:
                if replicas is not None:
                    await replicas.unload(source.name, source.version)
                await lv.close()
                raise
        log.info(
            "loaded %s %s as %s on %s/%s (load %.0f ms, warm-up %.0f ms)",
            source.name,
            source.version,
            role,
            lv.info.backend,
            lv.info.provider,
            lv.load_s * 1000,
            lv.warmup_s * 1000,
        )
        return lv

    async def prepare(self, source: ModelSource) -> LoadedVersion:
        """Load, warm and check ``source`` without giving it a role (:meth:`commit` does).

        Raises :class:`ModelLoadError` like :meth:`load`.
        """
        self._check_memory(source)
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        try:
            runners = await loop.run_in_executor(None, self._factory, source)
        except RunnerError:
            self.metrics.load_failures.labels(source.name, "load").inc()
            raise
        load_s = time.perf_counter() - t0
        try:
            warm = await loop.run_in_executor(None, warm_up, runners)
        except RunnerError:
            self.metrics.load_failures.labels(source.name, "warmup").inc()
            for r in runners:
                r.close()
            raise
        warmup_s = warm.seconds
        statistics = VersionStatistics()
        batcher = self._make_batcher(source, runners, warm.run_s, statistics)
        lv = LoadedVersion(source, runners, batcher, load_s, warmup_s, statistics)
        self.metrics.load_seconds.labels(source.name).observe(load_s)
        self.metrics.warmup_seconds.labels(source.name).observe(warmup_s)
        return lv

    async def commit(
        self, lv: LoadedVersion, role: str, canary: CanaryPolicy = DEFAULT_CANARY_POLICY
    ) -> None:
        """Give a version from :meth:`prepare` its role (a hot swap for ``stable``). Raises
        :class:`ModelLoadError` (a canary or shadow with no stable)."""
        async with self._lock:
            self._install(lv, role, canary)

    def _make_batcher(
        self,
        source: ModelSource,
        runners: Sequence[ModelRunner],
        run_s: float,
        statistics: VersionStatistics,
    ) -> DynamicBatcher:
        m = self.metrics
        name, version = source.name, source.version
        depth = m.queue_depth.labels(name, version)
        max_rows = self.batching.max_batch_size

        size = m.batch_size.labels(name)
        fill, wait, run = (
            m.batch_fill.labels(name),
            m.queue_wait.labels(name),
            m.run_time.labels(name),
        )

        stats_batch = statistics.on_batch

        def on_batch(rows: int, requests: int, wait_s: float, waits_s: float, run_s: float) -> None:
            size.observe(rows)
            fill.observe(min(1.0, rows / max_rows))
            wait.observe(wait_s)
            run.observe(run_s)
            stats_batch(rows, requests, waits_s, run_s)

        observer = BatchObserver(on_batch=on_batch, on_queue_depth=depth.set)
        return DynamicBatcher(runners, self.batching, observer=observer, expected_run_s=run_s)

    def _install(self, lv: LoadedVersion, role: str, policy: CanaryPolicy) -> None:
        slot = self._slots.setdefault(lv.name, ModelSlot(lv.name))
        slot.versions[lv.version] = lv
        replaced: str | None = None
        if role == "stable":
            replaced, slot.stable = slot.stable, lv.version
            if slot.canary is not None and slot.canary.version == lv.version:
                slot.canary = None  # promoted
            if replaced is not None:
                self.metrics.swaps.labels(lv.name).inc()
                log.info("hot swap: %s %s -> %s", lv.name, replaced, lv.version)
        elif role == "canary":
            if slot.stable is None:
                raise ModelLoadError(f"{lv.name}: load a stable version before a canary")
            replaced = slot.canary.version if slot.canary else None
            slot.canary = CanaryState(lv.version, policy)
            self.metrics.canary_weight.labels(lv.name).set(policy.weight)
        else:
            if slot.stable is None:
                raise ModelLoadError(f"{lv.name}: load a stable version before a shadow")
            replaced = slot.shadow.version if slot.shadow else None
            slot.shadow = ShadowState(lv.version)
        self._refresh_info()
        if replaced is not None and replaced != lv.version and slot.role_of(replaced) == "retiring":
            self._retire(slot, replaced)

    def _retire(self, slot: ModelSlot, version: str) -> None:
        old = slot.versions.pop(version)
        self._refresh_info()
        task = asyncio.get_running_loop().create_task(old.close())
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    def _refresh_info(self) -> None:
        m = self.metrics
        m.model_info.clear()
        for slot in self._slots.values():
            for lv in slot.versions.values():
                role = slot.role_of(lv.version)
                m.model_info.labels(
                    slot.name, lv.version, role, lv.info.backend, lv.info.provider
                ).set(1)
        m.models_loaded.set(sum(len(s.versions) for s in self._slots.values()))

    async def unload(self, name: str, version: str | None = None) -> None:
        """Unload one version (or the whole model) after draining it."""
        async with self._lock:
            slot = self.slot(name)
            versions = [version] if version is not None else list(slot.versions)
            for v in versions:
                if v not in slot.versions:
                    raise ModelNotFoundError(f"model {name!r} has no loaded version {v!r}")
            for v in versions:
                if slot.canary is not None and slot.canary.version == v:
                    slot.canary = None
                if slot.shadow is not None and slot.shadow.version == v:
                    slot.shadow = None
                if slot.stable == v:
                    slot.stable = None
                self._retire(slot, v)
            if not slot.versions:
                del self._slots[name]
        if self.replicas is not None:
            await self.replicas.unload(name, version)
        await self.drain_retired()

    async def drain_retired(self) -> None:
        """Wait until every retired version has finished its requests and closed."""
        while self._retiring:
            await asyncio.gather(*list(self._retiring), return_exceptions=True)

    async def close(self) -> None:
        for name in list(self._slots):
            await self.unload(name)
        if self._shadow_tasks:
            await asyncio.gather(*list(self._shadow_tasks), return_exceptions=True)

    def _check_memory(self, source: ModelSource) -> None:
        try:
            size = source.model_path.stat().st_size
        except OSError as e:
            raise ModelLoadError(f"{source.model_path}: cannot read model file: {e}") from e
        available = self._available_memory()
        copies = 1 + (self.replicas.copies if self.replicas is not None else 0)
        need = (int(size * self._memory_factor) + 16 * 1024 * 1024) * copies
        if available is not None and need > available:
            where = f" ({copies} serving processes load a copy each)" if copies > 1 else ""
            raise ModelLoadError(
                f"{source.name} {source.version} needs about {need >> 20} MiB to load{where}; "
                f"{available >> 20} MiB is available"
            )

    # ----------------------------------------------------------------- serving
    def route(
        self, name: str, version: str | None = None, request_key: str | None = None
    ) -> LoadedVersion:
        """Pick the version that answers a request (see the module docstring)."""
        slot = self.slot(name)
        if version is not None:
            return self.get(name, version)
        canary = slot.canary
        if canary is not None and canary.takes(request_key):
            return slot.versions[canary.version]
        return slot.versions[slot.stable or ""]

    async def infer(
        self,
        lv: LoadedVersion,
        feeds: dict[str, Array],
        *,
        pinned: bool = False,
        priority: Priority = Priority.NORMAL,
        timeout_s: float | None = None,
        busy: bool = True,
        counted: bool = False,
    ) -> tuple[LoadedVersion, dict[str, Array]]:
        """Run ``feeds`` on ``lv`` (from :meth:`route`) and return who answered and the outputs.

        A canary failure is recorded and the request answered by stable instead (unless the
        version was pinned); a version retired between routing and queueing hands over to the
        current stable. Shadow copies are started here. ``counted``: a client's request, whose
        runs go to :attr:`stats` (the transports set it; internal probes do not).
        """
        slot = self._slots.get(lv.name)
        stats = self.stats if counted else None
        drift = self.drift if counted else None
        t0 = time.perf_counter() if stats is not None else 0.0
        # The batch future is awaited here, not through LoadedVersion.infer: this is every
        # request's path, and each coroutine frame in between costs a resume per request.
        try:
            future = lv.batcher.submit(feeds, priority=priority, timeout_s=timeout_s, busy=busy)
            outputs = future.result() if future.done() else await future
        except BatcherClosedError:
            if pinned:
                raise ModelNotFoundError(f"{lv.name} {lv.version} was unloaded") from None
            current = self.route(lv.name)
            return current, await self._answer_for(
                current, feeds, priority, timeout_s, stats, drift
            )
        except Exception as e:
            if stats is not None:
                self._count(stats, lv, time.perf_counter() - t0, outcome_of(e))
            if (
                not isinstance(e, (InferenceError, DeadlineExceededError))
                or isinstance(e, InputError)
                or slot is None
                or not self._is_canary(slot, lv)
            ):
                raise
            self._record_canary(slot, failed=True)
            if pinned:
                raise
            stable = self.get(lv.name)
            log.warning("canary %s %s failed (%s); answered by stable", lv.name, lv.version, e)
            return stable, await self._answer_for(stable, feeds, priority, timeout_s, stats, drift)
        if stats is not None:
            self._count(stats, lv, time.perf_counter() - t0, Outcome.OK)
        if drift is not None:
            self._observe(drift, lv, feeds, outputs)
        if slot is not None:
            if self._is_canary(slot, lv):
                self._record_canary(slot, failed=False)
            elif slot.shadow is not None and lv.version == slot.stable:
                self._start_shadow(slot, feeds, outputs, stats, drift)
        return lv, outputs

    async def _answer_for(
        self,
        lv: LoadedVersion,
        feeds: dict[str, Array],
        priority: Priority,
        timeout_s: float | None,
        stats: InferenceObserver | None,
        drift: DriftObserver | None = None,
    ) -> dict[str, Array]:
        """Run a request on ``lv``, answering for another version (a failed canary, one retired
        before the request reached it), counted in ``stats`` under ``lv``'s role."""
        t0 = time.perf_counter()
        try:
            outputs = await lv.infer(feeds, priority, timeout_s)
        except Exception as e:
            if stats is not None:
                self._count(stats, lv, time.perf_counter() - t0, outcome_of(e))
            raise
        if stats is not None:
            self._count(stats, lv, time.perf_counter() - t0, Outcome.OK)
        if drift is not None:
            self._observe(drift, lv, feeds, outputs)
        return outputs

    def _observe(
        self,
        drift: DriftObserver,
        lv: LoadedVersion,
        feeds: dict[str, Array],
        outputs: dict[str, Array],
        role: InferenceRole | None = None,
    ) -> None:
        """Hand one successful run of ``lv`` to ``drift``, under the role ``lv`` has now."""
        if role is None:
            slot = self._slots.get(lv.name)
            role = slot.counted_role(lv.version) if slot is not None else InferenceRole.STABLE
        try:
            drift.observe(lv.source, role, feeds, outputs)
        except Exception:  # statistics never fail a request
            log.exception("drift observer failed")

    def _count(
        self,
        stats: InferenceObserver,
        lv: LoadedVersion,
        latency_s: float,
        outcome: Outcome,
        agreed: bool | None = None,
    ) -> None:
        """One run of ``lv`` into ``stats``, under the role ``lv`` has now."""
        slot = self._slots.get(lv.name)
        role = slot.counted_role(lv.version) if slot is not None else InferenceRole.STABLE
        stats.record(lv.name, lv.version, latency_s, outcome, role=role, agreed=agreed)

    def count_refused(self, lv: LoadedVersion, latency_s: float, outcome: Outcome) -> None:
        """Count in :attr:`stats` a client's request routed to ``lv`` that failed before it
        could run there (its body does not fit the version's inputs): the transports call it,
        so that every request a version was given is in its statistics."""
        if self.stats is not None:
            self._count(self.stats, lv, latency_s, outcome)

    @staticmethod
    def _is_canary(slot: ModelSlot, lv: LoadedVersion) -> bool:
        return slot.canary is not None and slot.canary.version == lv.version

    def _record_canary(self, slot: ModelSlot, *, failed: bool) -> None:
        canary = slot.canary
        assert canary is not None
        if canary.record(failed):
            self.metrics.canary_fallbacks.labels(slot.name).inc()
            self.metrics.canary_weight.labels(slot.name).set(0)
            log.warning(
                "canary %s %s taken out of rotation: error rate %.1f%% over %d requests "
                "(limit %.1f%%); stable %s serves all traffic",
                slot.name,
                canary.version,
                canary.error_rate * 100,
                len(canary.results),
                canary.policy.max_error_rate * 100,
                slot.stable,
            )

    def _start_shadow(
        self,
        slot: ModelSlot,
        feeds: dict[str, Array],
        stable_out: dict[str, Array],
        stats: InferenceObserver | None,
        drift: DriftObserver | None = None,
    ) -> None:
        shadow = slot.shadow
        assert shadow is not None
        if shadow.pending >= shadow.max_pending:
            shadow.skipped += 1
            self.metrics.shadow_comparisons.labels(slot.name, "skipped").inc()
            return
        lv = slot.versions[shadow.version]
        shadow.pending += 1
        task = asyncio.get_running_loop().create_task(
            self._shadow(slot, shadow, lv, feeds, stable_out, stats, drift)
        )
        self._shadow_tasks.add(task)
        task.add_done_callback(self._shadow_tasks.discard)

    async def _shadow(
        self,
        slot: ModelSlot,
        shadow: ShadowState,
        lv: LoadedVersion,
        feeds: dict[str, Array],
        stable_out: dict[str, Array],
        stats: InferenceObserver | None,
        drift: DriftObserver | None = None,
    ) -> None:
        """Run a copy of a request stable answered on the shadow and compare the answers; a
        failed run is a shadow error and no comparison."""
        t0 = time.perf_counter()
        try:
            out = await lv.infer(feeds, Priority.LOW, None)
        except RunnerError as e:
            self.metrics.shadow_comparisons.labels(slot.name, "error").inc()
            if stats is not None:
                stats.record(lv.name, lv.version, time.perf_counter() - t0, outcome_of(e),
                             role=InferenceRole.SHADOW)  # fmt: skip
            return
        finally:
            shadow.pending -= 1
        elapsed = time.perf_counter() - t0
        self.metrics.shadow_latency.labels(slot.name).observe(elapsed)
        agree = answers_agree(stable_out, out)
        shadow.compared += 1
        shadow.agreed += agree
        self.metrics.shadow_comparisons.labels(slot.name, "agree" if agree else "disagree").inc()
        self.metrics.shadow_agreement.labels(slot.name, shadow.version).set(
            shadow.agreed / shadow.compared
        )
        if stats is not None:
            stats.record(lv.name, lv.version, elapsed, Outcome.OK, role=InferenceRole.SHADOW,
                         agreed=agree)  # fmt: skip
        if drift is not None:
            self._observe(drift, lv, feeds, out, InferenceRole.SHADOW)

    async def wait_for_shadows(self) -> None:
        """Wait for shadow comparisons started so far (tests and shutdown)."""
        while self._shadow_tasks:
            await asyncio.gather(*list(self._shadow_tasks), return_exceptions=True)


def _available_memory() -> int | None:
    """MemAvailable in bytes (Linux), or psutil's figure elsewhere; None when unknown."""
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:
        return None
