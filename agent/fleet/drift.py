"""Drift of the model versions this agent runs, measured against their bundles' baselines.

DESIGN 4.7. A bundle built with ``--baseline`` carries a :class:`DriftBaseline`: fixed bins for
the model's input (per feature, or per-sample summaries and a random-projection sketch for
images) and for its answers (arg-max class, top score). :class:`DriftTracker` counts live
traffic on the same bins, per model version, and sends one report per window
(:class:`~agent.fleet.drift_report.DriftWindowReport`, the plain twin of ``DriftReport``).

Cost, on the request path: the model manager calls :meth:`DriftTracker.observe` once a counted
request (HTTP or MQTT) has been answered: a dictionary look-up and a countdown for the 1 in
``sample_every`` requests that are sampled, and for those an append of references to the input
and output arrays (no copy, no numpy work). A callback on the event loop, ``DRAIN_DELAY_S``
after the first sample (or as soon as ``DRAIN_BATCH`` are buffered), bins everything buffered
since, vectorised over the batch (:class:`shared.drift.Binner`), so the answers never wait for
the statistics and the per-request share of the binning shrinks with load. Measured on the
digits model (64 features, windows of 200): 3 to 5 µs of CPU per sampled request in all (the
window's scores, report and encoding included), of which the request path pays under 1 µs.

Memory: at most ``max_pending`` sampled requests and ``max_pending_bytes`` of their inputs are
buffered between drains (more are dropped and counted, reason ``buffer_full``); each version
keeps its histograms (features × bins integers). Hard examples: :mod:`agent.fleet.hard_examples`.

Windows: a version's window closes after ``window_requests`` samples (a request of N rows is N
samples) or ``window_s`` seconds after its first sample, whichever comes first; a window with
no sample sends nothing. A window holds one role: when a version changes role (a canary
promoted) its window closes and the next starts under the new role. Rows that cannot be binned
are skipped and counted: ``shape`` (not ``feature_count`` values per row), ``not_finite``
(NaN or infinity), ``no_input`` (the baseline's input is not among the feeds), ``dtype``.

Policy: the accepted desired state's ``telemetry.drift`` (:class:`DriftPolicy`, applied by the
fleet session through :meth:`DriftTracker.apply_policy`); until one arrives the defaults hold.
Versions whose bundle has no baseline (plain model files included) are not tracked.

pydantic and the drift maths are imported only once a version with a baseline is seen (its
manifest loaded pydantic already): an agent serving plain model files loads neither.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from mcp_edge.agent.fleet.drift_report import DriftWindowReport, describe, summary, window_report
from mcp_edge.agent.fleet.drift_rows import Item, Rows, chunks, gather
from mcp_edge.agent.fleet.hard_examples import (
    HardExampleReservoir,
    keep_hard_examples,
    parse_upload_args,
    select_for_upload,
)
from mcp_edge.agent.fleet.telemetry import version_text
from mcp_edge.agent.runtime.runner import Array
from mcp_edge.shared.protocol.reports import InferenceRole

if TYPE_CHECKING:
    from mcp_edge.agent.runtime.manager import ModelManager, ModelSource
    from mcp_edge.agent.serving.metrics import AgentMetrics
    from mcp_edge.shared.bundle.manifest import DriftBaseline
    from mcp_edge.shared.drift import Binner
    from mcp_edge.shared.profiles import HardwareProfile
    from mcp_edge.shared.protocol.command import CommandRequest
    from mcp_edge.shared.protocol.state import DriftPolicy

log = logging.getLogger("mcp.agent.drift")

Publish = Callable[[DriftWindowReport], Awaitable[None]]
"""Sends one closed window upstream (the fleet session's ``publish_drift``: spooled)."""

DRAIN_DELAY_S = 0.05
"""Seconds between the first sample buffered and the binning of everything buffered by then."""
DRAIN_BATCH = 256
"""Samples buffered that are binned at once, without waiting for ``DRAIN_DELAY_S``."""
TICK_S = 0.5
"""How often windows are checked against ``window_s``."""
MAX_QUEUED_REPORTS = 256
CHUNK_BYTES = 16 * 1024 * 1024
"""Float64 matrix size binned at once (bounds the drain's transient memory)."""


class _Track:
    """One model version's state: its baseline, sampling countdown and open window."""

    __slots__ = (
        "baseline", "binner", "countdown", "every", "input_name", "last", "name",
        "output_name", "pending", "role", "start", "version", "wire_version",
    )  # fmt: skip

    def __init__(
        self, name: str, version: str, baseline: DriftBaseline | None, every: int, now: float
    ) -> None:
        self.name, self.version, self.baseline = name, version, baseline
        self.wire_version = version_text(version)
        """The version as reports and hard examples name it (semver text)."""
        self.input_name = baseline.input if baseline is not None else ""
        out = baseline.output if baseline is not None else None
        self.output_name = out.output if out is not None else None
        self.binner: Binner | None = None
        self.countdown = every
        self.every = every
        """``sample_every`` of the open window."""
        self.role = InferenceRole.STABLE
        self.start: float | None = None
        """When the open window's first sample was binned; None: no window open."""
        self.last = now
        self.pending: list[Item] = []
        """Sampled requests not binned yet: ``(role, input, output or None)``."""


class DriftTracker:
    """Measures drift per model version (see the module docstring).

    ``publish`` sends closed windows; ``policy`` (a :class:`DriftPolicy`; None: its defaults,
    resolved when the first version with a baseline is seen); ``metrics`` the agent's
    Prometheus families; ``clock`` gives wall-clock seconds (window times, report stamps).
    The synchronous core (:meth:`observe`, :meth:`drain`, :meth:`expire`) needs no event loop;
    :meth:`start` adds the timers and the sender. Used on the event loop thread only.
    """

    def __init__(
        self,
        device_id: str,
        publish: Publish,
        *,
        policy: DriftPolicy | None = None,
        metrics: AgentMetrics | None = None,
        clock: Callable[[], float] = time.time,
        max_pending: int = 4096,
        max_pending_bytes: int = 32 * 1024 * 1024,
        drain_delay_s: float = DRAIN_DELAY_S,
        drain_batch: int = DRAIN_BATCH,
        tick_s: float = TICK_S,
    ) -> None:
        self.device_id = device_id
        self._publish = publish
        self.metrics = metrics
        self.clock = clock
        self.max_pending = max_pending
        self.max_pending_bytes = max_pending_bytes
        self.drain_delay_s = drain_delay_s
        self.drain_batch = drain_batch
        self.tick_s = tick_s
        self.policy: DriftPolicy | None = None
        self._on = True
        self._every = 1
        self.reservoir = HardExampleReservoir()
        self._tracks: dict[tuple[str, str], _Track] = {}
        self._warned: set[tuple[str, str, str]] = set()
        self._dirty: list[_Track] = []
        """Tracks with pending samples."""
        self._pending_count = 0
        self._pending_bytes = 0
        self._scheduled: asyncio.Handle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: collections.deque[DriftWindowReport] = collections.deque()
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self.dropped: collections.Counter[str] = collections.Counter()
        """Samples not binned (rows; ``buffer_full``: requests), by reason."""
        self.samples = 0
        self.windows = 0
        """Windows closed (reports built)."""
        if policy is not None:
            self.apply_policy(policy)

    # ------------------------------------------------------------------ request path
    def observe(
        self,
        source: ModelSource,
        role: InferenceRole,
        feeds: dict[str, Array],
        outputs: dict[str, Array],
    ) -> None:
        """One answered request of ``source`` in ``role`` (the model manager's
        :class:`~agent.runtime.manager.DriftObserver`). Never raises, never blocks."""
        if not self._on:
            return
        track = self._tracks.get((source.name, source.version))
        if track is None:
            track = self._track_for(source)
        if track.baseline is None:
            return
        track.countdown -= 1
        if track.countdown > 0:
            return
        track.countdown = self._every
        x = feeds.get(track.input_name)
        if x is None:
            self._drop(track, "no_input", 1)
            return
        size = x.nbytes
        if self._pending_count >= self.max_pending or self._pending_bytes + size > (
            self.max_pending_bytes
        ):
            self._drop(track, "buffer_full", 1)
            return
        y = outputs.get(track.output_name) if track.output_name is not None else None
        if not track.pending:
            self._dirty.append(track)
        track.pending.append((role, x, y))
        self._pending_count += 1
        self._pending_bytes += size
        if self._loop is not None:
            if self._scheduled is None:
                self._scheduled = self._loop.call_later(self.drain_delay_s, self._drain_now)
            elif self._pending_count == self.drain_batch:
                self._scheduled.cancel()
                self._scheduled = self._loop.call_soon(self._drain_now)

    def _track_for(self, source: ModelSource) -> _Track:
        baseline = source.drift_baseline
        if baseline is not None and self.policy is None:
            from mcp_edge.shared.protocol.state import DriftPolicy

            self.apply_policy(DriftPolicy())
        track = _Track(source.name, source.version, baseline, self._every, self.clock())
        self._tracks[(source.name, source.version)] = track
        if baseline is None:
            self._warn_once(track, "no_baseline", "its bundle has no drift baseline: not measured")
        return track

    def _warn_once(self, track: _Track, what: str, text: str) -> None:
        key = (track.name, track.version, what)
        if key not in self._warned:
            if len(self._warned) > 4096:
                self._warned.clear()
            self._warned.add(key)
            log.info("drift of %s %s: %s", track.name, track.version, text)

    def _drop(self, track: _Track, reason: str, n: int) -> None:
        self.dropped[reason] += n
        if self.metrics is not None:
            self.metrics.drift_dropped.labels(track.name, reason).inc(n)

    # ------------------------------------------------------------------ binning (off the path)
    def drain(self, now: float | None = None) -> list[DriftWindowReport]:
        """Bin every buffered sample; returns the windows that closed by size."""
        if self._scheduled is not None:
            self._scheduled.cancel()
            self._scheduled = None
        dirty, self._dirty = self._dirty, []
        if not dirty:
            return []
        big = self._pending_bytes * 8 > CHUNK_BYTES  # float64 of the smallest dtype
        self._pending_count = self._pending_bytes = 0
        t = self.clock() if now is None else now
        reports: list[DriftWindowReport] = []
        for track in dirty:
            items, track.pending = track.pending, []
            track.last = t
            for chunk in chunks(items, CHUNK_BYTES) if big else (items,):
                try:
                    reports.extend(self._bin(track, chunk, t))
                except Exception:  # one version's odd data must not stop the others
                    log.exception("drift of %s %s: binning failed", track.name, track.version)
                    self._drop(track, "internal", len(chunk))
        return reports

    def _bin(self, track: _Track, items: list[Item], now: float) -> list[DriftWindowReport]:
        baseline = track.baseline
        assert baseline is not None
        if track.binner is None:
            from mcp_edge.shared.drift import Binner

            track.binner = Binner(baseline)
        rows = gather(items, baseline)
        for reason, n in rows.dropped.items():
            self._drop(track, reason, n)
            if reason in ("shape", "no_input", "dtype"):
                self._warn_once(track, reason, f"rows skipped ({reason}); see the metrics")
        if rows.matrix.shape[0] == 0:
            return []
        self.samples += rows.matrix.shape[0]
        if self.metrics is not None:
            self.metrics.drift_samples.labels(track.name).inc(rows.matrix.shape[0])
        policy = self.policy
        if policy is not None and policy.hard_examples:
            self._keep_hard(track, rows, policy.hard_example_max_confidence, now)
        return self._count(track, rows.segments, rows.matrix, rows.scores, rows.has_scores, now)

    def _count(
        self,
        track: _Track,
        segments: list[tuple[int, int, InferenceRole]],
        matrix: Array,
        scores: Array,
        has: Array,
        now: float,
    ) -> list[DriftWindowReport]:
        """Add rows to the open window, closing it each time it is full (or the role
        changes)."""
        binner = track.binner
        assert binner is not None and self.policy is not None
        size = self.policy.window_requests
        reports: list[DriftWindowReport] = []
        for a, b, role in segments:
            while a < b:
                if track.start is not None and track.role is not role:
                    reports.extend(self._close(track, now))
                if track.start is None:
                    track.start, track.role, track.every = now, role, self._every
                end = min(b, a + max(1, size - binner.samples))
                m, s, h = matrix[a:end], scores[a:end], has[a:end]
                if h.all():
                    binner.add(m, s)
                else:
                    if h.any():
                        binner.add(m[h], s[h])
                    binner.add(m[~h])
                a = end
                if binner.samples >= size:
                    reports.extend(self._close(track, now))
        return reports

    def _keep_hard(self, track: _Track, rows: Rows, max_confidence: float, now: float) -> None:
        keep_hard_examples(
            self.reservoir, rows, model=track.name, version=track.wire_version,
            input_name=track.input_name, output_name=track.output_name,
            max_confidence=max_confidence, now=now,
        )  # fmt: skip
        self._hard_metric()

    def _hard_metric(self) -> None:
        if self.metrics is not None:
            self.metrics.hard_example_bytes.set(self.reservoir.bytes)

    def _close(self, track: _Track, now: float) -> list[DriftWindowReport]:
        """Close ``track``'s open window; its report (none for an empty window)."""
        start, track.start = track.start, None
        binner = track.binner
        if start is None or binner is None or binner.samples == 0:
            return []
        counts, scores = binner.take_scored()
        self.windows += 1
        return [
            window_report(
                device_id=self.device_id, model=track.name, version=track.wire_version,
                role=track.role, start=start, now=now, sample_every=track.every, counts=counts,
                scores=scores, hard_examples=self.reservoir.held(track.name, track.wire_version),
            )
        ]  # fmt: skip

    def expire(self, now: float | None = None) -> list[DriftWindowReport]:
        """Close the windows open for ``window_s`` or more (bins what is buffered first) and
        forget versions idle for a whole window."""
        t = self.clock() if now is None else now
        reports = self.drain(t)
        window_s = self.policy.window_s if self.policy is not None else None
        if window_s is None:
            return reports
        assert self.policy is not None
        size = self.policy.window_requests
        for key, track in list(self._tracks.items()):
            full = track.binner is not None and track.binner.samples >= size
            if track.start is not None and (full or t - track.start >= window_s):
                reports.extend(self._close(track, t))
            if track.start is None and t - track.last >= window_s:
                del self._tracks[key]
        return reports

    def flush(self, now: float | None = None) -> list[DriftWindowReport]:
        """Bin what is buffered and close every open window now."""
        t = self.clock() if now is None else now
        reports = self.drain(t)
        for track in self._tracks.values():
            reports.extend(self._close(track, t))
        return reports

    # ------------------------------------------------------------------ policy
    def apply_policy(self, policy: DriftPolicy) -> None:
        """Measure under ``policy`` from now on. Open windows close by the new size and time;
        a new ``sample_every`` closes them at once (a window has one sampling rate); turning
        hard examples off empties the reservoir; turning drift off sends the open windows and
        stops measuring."""
        old, self.policy = self.policy, policy
        if old == policy:
            return
        log.info("drift: %s", describe(policy))
        if old is not None and (
            old.enabled != policy.enabled or old.sample_every != policy.sample_every
        ):
            self._emit(self.flush())
        self._on, self._every = policy.enabled, policy.sample_every
        for track in self._tracks.values():
            track.countdown = min(track.countdown, self._every)
        self.reservoir.budget_bytes = (
            policy.hard_example_budget_bytes if policy.hard_examples else 0
        )
        self._hard_metric()
        if not policy.enabled:
            self._tracks.clear()

    # ------------------------------------------------------------------ hard examples
    async def upload_hard_examples(self, req: CommandRequest) -> dict[str, Any]:
        """The ``upload_hard_examples`` command: ``HardExampleBatch`` as the reply's result.
        Raises MessageError for bad arguments (the reply says ``bad_request``)."""
        self._emit(self.drain())  # what was answered until now counts
        budget = self.reservoir.budget_bytes
        request = parse_upload_args(req.args, budget)
        result = select_for_upload(self.reservoir, request)
        self._hard_metric()
        log.info(
            "uploaded %d hard examples of %s (%d bytes; %d held)",
            len(result["examples"]), request.model, result["bytes"], result["held"],
        )  # fmt: skip
        return result

    # ------------------------------------------------------------------ the loop's side
    async def start(self) -> None:
        """Bin on a timer and send closed windows through ``publish`` (until :meth:`close`)."""
        self._loop = loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._send_loop(), name="drift-send"),
            loop.create_task(self._tick_loop(), name="drift-tick"),
        ]

    async def close(self) -> None:
        """Stop the timers, close the open windows and send them (and any still queued)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        self._loop = None
        self._queue.extend(self.flush())
        while self._queue:
            await self._send(self._queue.popleft())

    def _drain_now(self) -> None:
        self._scheduled = None
        try:
            self._emit(self.drain())
        except Exception:
            log.exception("drift binning failed")

    def _emit(self, reports: list[DriftWindowReport]) -> None:
        for r in reports:
            if len(self._queue) >= MAX_QUEUED_REPORTS:
                self._queue.popleft()
                self.dropped["report_queue"] += 1
            self._queue.append(r)
        if reports:
            self._wake.set()

    async def _send(self, report: DriftWindowReport) -> None:
        try:
            await self._publish(report)
        except Exception:
            log.exception("drift report of %s %s not sent", report.model, report.version)
            return
        if self.metrics is not None:
            self.metrics.drift_windows.labels(report.model).inc()

    async def _send_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                await self._send(self._queue.popleft())

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            try:
                self._emit(self.expire())
            except Exception:
                log.exception("drift window check failed")


def local_drift(
    policy: DriftPolicy,
) -> Callable[[ModelManager, HardwareProfile], contextlib.AbstractAsyncContextManager[object]]:
    """An ``attach`` hook for :func:`agent.serving.serve.run_server` (``mcp-agent serve``, no
    control plane): measures drift under ``policy`` and logs each window in one line."""

    async def log_report(report: DriftWindowReport) -> None:
        log.info("drift %s", summary(report))

    @contextlib.asynccontextmanager
    async def attach(manager: ModelManager, profile: HardwareProfile) -> AsyncIterator[object]:
        tracker = DriftTracker("local", log_report, policy=policy, metrics=manager.metrics)
        manager.drift = tracker
        await tracker.start()
        try:
            yield tracker
        finally:
            if manager.drift is tracker:
                manager.drift = None
            await tracker.close()

    return attach
