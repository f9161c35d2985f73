"""What the agent reports about itself: health samples and inference statistics (DESIGN 4.7).

- :class:`HealthCollector` reads CPU, memory, disk, load, temperatures and the agent's RSS with
  psutil, plus the sources the hardware profile names: ``tegrastats`` (Jetson GPU load, EMC,
  power rails, SoC temperatures), ``rapl`` (Intel package energy) and ``thermal_zone``.
- :func:`parse_tegrastats_line` (from :mod:`agent.fleet.tegrastats`) turns one line of
  ``tegrastats`` output into a :class:`TegrastatsReading`.
- :class:`InferenceStatsCollector` counts requests, errors and rejections per model version and
  role (stable, canary, shadow) and keeps their latencies over a reporting window: exact
  p50/p95/p99 from a bounded reservoir and a fixed-edge histogram (:data:`LATENCY_EDGES_MS`) the
  control plane can sum across devices, plus how many of a shadow's answers agreed with
  stable's. The model manager feeds it for HTTP and MQTT requests alike.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import math
import os
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from mcp_edge.agent.fleet.tegrastats import (
    CpuCore,
    TegrastatsParseError,
    TegrastatsReader,
    TegrastatsReading,
    parse_tegrastats_line,
)
from mcp_edge.agent.runtime.manager import Outcome
from mcp_edge.shared.protocol.reports import (
    HealthReport,
    InferenceReport,
    InferenceRole,
    LatencyReport,
    ModelInferenceReport,
)

log = logging.getLogger("mcp.agent.telemetry")

__all__ = [
    "CpuCore", "HealthCollector", "InferenceStatsCollector", "Outcome", "TegrastatsParseError",
    "TegrastatsReader", "TegrastatsReading", "parse_tegrastats_line",
]  # fmt: skip

MAX_TEMPERATURES = 64


# ------------------------------------------------------------------------------- health
class HealthCollector:
    """Builds health readings (:class:`HealthReport`, the wire's ``HealthSample``). ``collect`` is
    blocking (psutil, sysfs) but fast; the session runs it off the event loop. ``sources`` come
    from the hardware profile."""

    def __init__(
        self,
        *,
        sources: Iterable[str] = ("psutil",),
        disk_path: Path | str = "/",
        tegrastats: TegrastatsReader | None = None,
        sysfs: Path | str = "/sys",
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.sources = frozenset(sources)
        self.disk_path = str(disk_path)
        self.sysfs = Path(sysfs)
        self.clock = clock
        if tegrastats is None and "tegrastats" in self.sources and TegrastatsReader.available():
            tegrastats = TegrastatsReader()
        self.tegrastats = tegrastats
        self._process = psutil.Process()
        self._rapl_warned = False
        psutil.cpu_percent(None)  # the first call only sets the reference point

    async def start(self) -> None:
        if self.tegrastats is not None:
            try:
                await self.tegrastats.start()
            except OSError as e:
                log.warning("cannot run tegrastats (%s); no GPU figures", e)
                self.tegrastats = None

    async def close(self) -> None:
        if self.tegrastats is not None:
            await self.tegrastats.close()

    def collect(self, device_id: str) -> HealthReport:
        """One reading now."""
        vm = psutil.virtual_memory()
        try:
            disk = psutil.disk_usage(self.disk_path)
            disk_total, disk_free = disk.total / 2**20, disk.free / 2**20
        except OSError:
            disk_total = disk_free = None
        try:
            load_1m: float | None = os.getloadavg()[0]
        except (AttributeError, OSError):
            load_1m = None
        try:
            rss: float | None = self._process.memory_info().rss / 2**20
        except psutil.Error:
            rss = None
        now = self.clock()
        temps = self._temperatures()
        gpu = None
        reading = self.tegrastats.latest if self.tegrastats is not None else None
        if reading is not None:
            gpu = reading.gpu
            for name, value in reading.temperatures_c.items():
                temps.setdefault(f"tegra/{name}", value)
        return HealthReport(
            device_id=device_id,
            ts=now,
            cpu_percent=min(psutil.cpu_percent(None), 100.0 * 1024),
            load_1m=load_1m,
            mem_total_mb=vm.total / 2**20,
            mem_used_mb=(vm.total - vm.available) / 2**20,
            disk_total_mb=disk_total,
            disk_free_mb=disk_free,
            process_rss_mb=rss,
            uptime_s=max(0.0, time.time() - psutil.boot_time()),
            temperatures_c=dict(list(temps.items())[:MAX_TEMPERATURES]),
            gpu=gpu,
            energy_j=self._rapl_energy_j() if "rapl" in self.sources else None,
        )

    def _temperatures(self) -> dict[str, float]:
        temps: dict[str, float] = {}
        read = getattr(psutil, "sensors_temperatures", None)
        if read is not None:
            try:
                for chip, entries in read().items():
                    for i, e in enumerate(entries):
                        _put_temp(temps, f"{chip}/{e.label or i}", e.current)
            except (OSError, RuntimeError):
                pass
        if "thermal_zone" in self.sources:
            for zone in sorted((self.sysfs / "class" / "thermal").glob("thermal_zone*")):
                try:
                    kind = (zone / "type").read_text().strip() or zone.name
                    _put_temp(temps, f"zone/{kind}", int((zone / "temp").read_text()) / 1000)
                except (OSError, ValueError):
                    continue
        return temps

    def _rapl_energy_j(self) -> float | None:
        """Sum of package energy counters (Joules, cumulative; wraps at max_energy_range_uj)."""
        total = 0.0
        found = False
        for pkg in sorted((self.sysfs / "class" / "powercap").glob("intel-rapl:[0-9]*")):
            if pkg.name.count(":") != 1:
                continue  # sub-zones (core, uncore, dram) are inside the package figure
            try:
                total += int((pkg / "energy_uj").read_text()) / 1e6
                found = True
            except PermissionError:
                if not self._rapl_warned:
                    log.info("RAPL energy counters are not readable by this user; no energy_j")
                    self._rapl_warned = True
                return None
            except (OSError, ValueError):
                continue
        return total if found else None


def _put_temp(temps: dict[str, float], name: str, value: Any) -> None:
    try:
        v = float(value)
    except (TypeError, ValueError):
        return
    if math.isfinite(v) and -100.0 < v < 250.0 and len(temps) < MAX_TEMPERATURES:
        temps.setdefault(name, v)


# ------------------------------------------------------------------------------- inference stats
LATENCY_EDGES_MS: tuple[float, ...] = (
    0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 25.0, 35.0, 50.0, 75.0, 100.0, 150.0,
    250.0, 350.0, 500.0, 750.0, 1000.0, 1500.0, 2500.0, 5000.0, 10000.0,
)  # fmt: skip
"""The fixed upper edges (ms) of the latency histogram every agent reports, 0.25 ms to 10 s,
about three per decade (finer from 1 ms to 1 s, where models answer): histograms with the
same edges add up across devices and windows, which is how the control plane compares p95s."""


@dataclass
class _Window:
    count: int = 0
    errors: int = 0
    rejections: int = 0
    seen_ok: int = 0
    reservoir: list[float] = field(default_factory=list)
    buckets: list[int] = field(default_factory=list)
    shadow_compared: int = 0
    shadow_agreed: int = 0


class InferenceStatsCollector:
    """Per model version and role: count, errors, rejections and latency over the window.

    It is the model manager's :class:`~agent.runtime.manager.InferenceObserver`: the fleet
    session hands it to the manager, which calls :meth:`record` for every run of a request that
    came over HTTP or MQTT (the answer, a canary failure handed to stable, a shadow's copy with
    whether it agreed). :meth:`snapshot` closes the window and starts the next.

    Latencies (seconds in, milliseconds out) are those of the successful requests: exact
    p50/p95/p99 over up to ``max_samples`` of them per version and role (a uniform reservoir
    beyond), and a histogram on ``edges_ms`` whose counts add up to ``count - errors -
    rejections``, as the wire schema checks.
    """

    def __init__(
        self,
        *,
        max_samples: int = 4096,
        edges_ms: tuple[float, ...] = LATENCY_EDGES_MS,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        """Raises ValueError when ``edges_ms`` is not 1..256 finite, increasing values ≥ 0."""
        increasing = all(a < b for a, b in itertools.pairwise(edges_ms))
        if not (0 < len(edges_ms) <= 256 and increasing and edges_ms[0] >= 0) or not all(
            math.isfinite(e) for e in edges_ms
        ):
            raise ValueError("edges_ms must be 1 to 256 finite, strictly increasing values >= 0")
        self.max_samples = max_samples
        self.edges_ms = edges_ms
        self.clock = clock
        self.rng = rng or random.Random()
        self._windows: dict[tuple[str, str, InferenceRole], _Window] = {}
        self._started = clock()
        self._batch_marks: dict[str, tuple[float, float, float, float]] = {}

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
        """Count one run of ``version`` in ``role`` that took ``latency_s`` seconds; ``agreed``
        (a shadow's answer): whether it agreed with stable's, None when not compared."""
        key = (model, version, role)
        w = self._windows.get(key)
        if w is None:
            w = self._windows[key] = _Window(buckets=[0] * (len(self.edges_ms) + 1))
        w.count += 1
        if outcome is Outcome.ERROR:
            w.errors += 1
        elif outcome is Outcome.REJECTED:
            w.rejections += 1
        else:
            ms = latency_s * 1000.0
            w.seen_ok += 1
            if len(w.reservoir) < self.max_samples:
                w.reservoir.append(ms)
            else:
                j = self.rng.randrange(w.seen_ok)
                if j < self.max_samples:
                    w.reservoir[j] = ms
            w.buckets[bisect.bisect_left(self.edges_ms, ms)] += 1
        if agreed is not None:
            w.shadow_compared += 1
            w.shadow_agreed += agreed

    def snapshot(
        self, device_id: str, *, now: float | None = None, manager: Any = None
    ) -> InferenceReport:
        """Close the window: one :class:`ModelInferenceReport` (the wire's ``ModelInferenceStats``)
        per model, version and role that had requests in it (at most 256; an idle window gives
        none).

        With ``manager`` (an :class:`agent.runtime.manager.ModelManager`), each carries its
        version's queue depth now, and the stable version's the model's batch size and fill ratio
        over the window.
        """
        t = self.clock()
        window_s = max(t - self._started, 1e-3)
        windows, self._windows, self._started = self._windows, {}, t
        queue_depth: dict[tuple[str, str], int] = {}
        stable: dict[str, str] = {}
        if manager is not None:
            for name in manager.names():
                slot = manager.slot(name)
                stable[name] = slot.stable
                for version, lv in slot.versions.items():
                    queue_depth[(name, version)] = lv.batcher.queue_depth
        batch = self._batch_deltas(manager, stable) if manager is not None else {}
        models = []
        for key in sorted(windows, key=_order)[:256]:
            name, version, role = key
            w = windows[key]
            latency = None
            if w.reservoir:
                p50, p95, p99 = np.percentile(np.asarray(w.reservoir), [50, 95, 99])
                latency = LatencyReport(p50_ms=float(p50), p95_ms=float(p95), p99_ms=float(p99))
            size_avg, fill = (None, None)
            if role is InferenceRole.STABLE and stable.get(name) == version:
                size_avg, fill = batch.get(name, (None, None))
            models.append(
                ModelInferenceReport(
                    model=name,
                    version=version_text(version),
                    role=role,
                    count=w.count,
                    errors=w.errors,
                    rejections=w.rejections,
                    latency=latency,
                    latency_bucket_edges_ms=list(self.edges_ms),
                    latency_bucket_counts=w.buckets,
                    queue_depth=queue_depth.get((name, version), 0),
                    batch_size_avg=size_avg,
                    batch_fill_ratio=fill,
                    shadow_compared=w.shadow_compared,
                    shadow_agreed=w.shadow_agreed,
                )
            )
        return InferenceReport(
            device_id=device_id,
            ts=time.time() if now is None else now,
            window_s=window_s,
            models=models,
        )

    def _batch_deltas(
        self, manager: Any, stable: dict[str, str]
    ) -> dict[str, tuple[float | None, float | None]]:
        registry = manager.metrics.registry
        out: dict[str, tuple[float | None, float | None]] = {}
        for name in stable:
            labels = {"model": name}
            now = tuple(
                registry.get_sample_value(n, labels) or 0.0
                for n in (
                    "mcp_agent_batch_size_sum",
                    "mcp_agent_batch_size_count",
                    "mcp_agent_batch_fill_ratio_sum",
                    "mcp_agent_batch_fill_ratio_count",
                )
            )
            before = self._batch_marks.get(name, (0.0, 0.0, 0.0, 0.0))
            self._batch_marks[name] = now  # type: ignore[assignment]
            d = [a - b for a, b in zip(now, before, strict=True)]
            size_avg = d[0] / d[1] if d[1] > 0 else None
            fill = min(1.0, d[2] / d[3]) if d[3] > 0 else None
            out[name] = (size_avg, fill)
        return out


_ROLE_ORDER = {InferenceRole.STABLE: 0, InferenceRole.CANARY: 1, InferenceRole.SHADOW: 2}


def _order(key: tuple[str, str, InferenceRole]) -> tuple[str, str, int]:
    return key[0], key[1], _ROLE_ORDER[key[2]]


def version_text(version: str) -> str:
    """The protocol's version field is semver text (5-128 characters); versions the manager
    derives from plain model files ("1", "2") become "1.0.0", "2.0.0"."""
    return version[:128] if len(version) >= 5 else f"{version}.0.0"
