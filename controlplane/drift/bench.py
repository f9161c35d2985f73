"""What one window of drift reports from a whole fleet costs the control plane (for
``bench/drift.py``).

:func:`aggregate_window` takes the reports (already validated, as ingestion hands them over),
seeds a fresh SQLite database in a directory with their devices running their version (the
bundle manifest's baseline), and times one :meth:`DriftService.store` of the whole batch:
refusals, report rows, the aggregate, the rule. The figure is process CPU time, user and
system, of every thread (the database driver's included).

:func:`measure_aggregation` seeds a fresh database with ``devices`` accepted devices running one
version whose baseline has ``features`` features of ``bins`` bins and a 10-class output, makes
one report per device (``samples`` requests drawn from the baseline's own distribution, as
the agent would bin them), and passes every payload through the real ingestion path:
:meth:`IngestService.handle` (size check, decode) and one :meth:`IngestService.flush` (the
batch's transaction, then the drift store: refusals, report rows, the aggregate, the rule).
It returns the process CPU time of each part (every thread, the database driver's included)
and what was stored.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from mcp_edge.controlplane.db import Database, upgrade_head
from mcp_edge.controlplane.db import drift as q
from mcp_edge.controlplane.drift.sample import DriftSample, from_report
from mcp_edge.controlplane.drift.service import DriftService
from mcp_edge.controlplane.ingest import IngestService
from mcp_edge.controlplane.metrics import ControlPlaneMetrics
from mcp_edge.shared.bundle.baseline import compute_baseline
from mcp_edge.shared.bundle.manifest import BundleManifest, DriftBaseline
from mcp_edge.shared.protocol import topics
from mcp_edge.shared.protocol.telemetry import DriftReport
from mcp_edge.shared.protocol.topics import TelemetryKind

MODEL, VERSION = "bench-drift", "1.0.0"


def _reports(baseline: Any, devices: int, samples: int, at: float, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    features = []
    for fb in baseline.features:
        p = np.asarray(fb.histogram.counts, dtype=np.float64)
        features.append(rng.multinomial(samples, p / p.sum(), size=devices))
    out = baseline.output
    classes = rng.multinomial(samples, np.asarray(out.class_counts) / sum(out.class_counts),
                              size=devices)  # fmt: skip
    conf = np.asarray(out.confidence.counts, dtype=np.float64)
    confidence = rng.multinomial(samples, conf / conf.sum(), size=devices)
    payloads = []
    for i in range(devices):
        payloads.append(
            orjson.dumps(
                {
                    "device_id": f"bench-{i:06d}",
                    "ts": at,
                    "model": MODEL,
                    "version": VERSION,
                    "window_start": at - 60.0,
                    "window_end": at,
                    "samples": samples,
                    "features": [
                        {"name": fb.name, "counts": features[j][i].tolist()}
                        for j, fb in enumerate(baseline.features)
                    ],
                    "class_counts": classes[i].tolist(),
                    "confidence_counts": confidence[i].tolist(),
                }
            )
        )
    return payloads


async def measure_aggregation(
    database_url: str,
    *,
    devices: int = 10_000,
    samples: int = 200,
    features: int = 64,
    bins: int = 10,
    seed: int = 0,
) -> dict[str, Any]:
    """Seed ``database_url`` (an empty database) and time one window of reports from
    ``devices`` devices through ingestion and the drift store (see the module docstring).

    Keys: ``agg_devices``, ``agg_cpu_s`` (decode + flush), ``decode_cpu_s``, ``flush_cpu_s``,
    ``store_cpu_s`` (the drift store alone), ``stored``, ``dropped`` (reports not stored),
    ``report_bytes`` (one payload), ``fleet_score`` (the aggregate's score: near 0).
    """
    rng = np.random.default_rng(seed)
    data = rng.normal(size=(4000, features))
    scores = rng.dirichlet(np.ones(10) * 0.3, size=4000)
    baseline = compute_baseline("input", data, output_name="probabilities", scores=scores,
                                bins=bins)  # fmt: skip
    now = datetime.now(timezone.utc)
    db = Database(database_url)
    try:
        await upgrade_head(db)
        ids = [f"bench-{i:06d}" for i in range(devices)]
        async with db.transaction() as tx:
            await q.seed_fleet(tx, device_ids=ids, model=MODEL, version=VERSION,
                               version_numeric=1, baseline=baseline.model_dump(mode="json"),
                               now=now)  # fmt: skip
        payloads = _reports(baseline, devices, samples, now.timestamp(), seed)
        metrics = ControlPlaneMetrics()
        drift = DriftService(db, lambda: now, metrics=metrics)
        ingest = IngestService(db, metrics, lambda: now, drift=drift, max_backlog=devices + 1,
                               flush_rows=devices + 1)  # fmt: skip
        topic_of = [topics.telemetry(d, TelemetryKind.DRIFT) for d in ids]
        started = time.process_time()
        for topic, payload in zip(topic_of, payloads, strict=True):
            ingest.handle(topic, payload)
        decoded = time.process_time()
        await ingest.flush()
        flushed = time.process_time()
        async with db.read() as tx:
            buckets = await q.list_aggregates(tx, model=MODEL, limit=10)
        stored = sum(b.reports for b in buckets)
        store_sum = metrics.registry.get_sample_value("mcp_cp_drift_store_cpu_seconds_sum") or 0.0
        return {
            "agg_devices": devices,
            "agg_cpu_s": round(flushed - started, 4),
            "decode_cpu_s": round(decoded - started, 4),
            "flush_cpu_s": round(flushed - decoded, 4),
            "store_cpu_s": round(store_sum, 4),
            "stored": stored,
            "dropped": devices - stored,
            "report_bytes": len(payloads[0]),
            "fleet_score": buckets[-1].score if buckets else None,
        }
    finally:
        await db.dispose()


def _cpu_s() -> float:
    """User and system CPU seconds of this process so far (every thread)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def store_timed(
    database_url: str, baseline: DriftBaseline, samples: Sequence[DriftSample]
) -> dict[str, Any]:
    """Seed ``database_url`` (empty) with the samples' devices running their version, then
    time one :meth:`DriftService.store` of all of them (see the module docstring)."""
    model, version = samples[0].model, samples[0].version
    received = max(s.received_at for s in samples)
    at = datetime.fromtimestamp(received, timezone.utc)
    db = Database(database_url)
    try:
        await upgrade_head(db)
        ids = sorted({s.device_id for s in samples})
        async with db.transaction() as tx:
            await q.seed_fleet(tx, device_ids=ids, model=model, version=version,
                               version_numeric=1, baseline=baseline.model_dump(mode="json"),
                               now=at)  # fmt: skip
        drift = DriftService(db, lambda: at, metrics=ControlPlaneMetrics())
        cpu, wall = _cpu_s(), time.perf_counter()
        result = await drift.store(samples)
        cpu, wall = _cpu_s() - cpu, time.perf_counter() - wall
        async with db.read() as tx:
            buckets = await q.list_aggregates(tx, model=model, limit=10)
        return {
            "agg_cpu_s": round(cpu, 4),
            "agg_wall_s": round(wall, 4),
            "stored": result.stored,
            "dropped": len(samples) - result.stored,
            "refused": dict(result.refused),
            "buckets": result.buckets,
            "fleet_score": buckets[-1].score if buckets else None,
            "fleet_input_psi": buckets[-1].input_psi if buckets else None,
        }
    finally:
        await db.dispose()


async def aggregate_window(
    directory: Path, manifest: BundleManifest, reports: Sequence[DriftReport]
) -> dict[str, Any]:
    """One window of ``reports`` (validated :class:`DriftReport` objects, one per device)
    stored and aggregated into a fresh SQLite database in ``directory``: the keys of
    :func:`store_timed`. Raises ValueError for a manifest without a drift baseline."""
    if manifest.drift_baseline is None:
        raise ValueError(f"{manifest.name} {manifest.version} has no drift baseline")
    directory.mkdir(parents=True, exist_ok=True)
    received = max(r.window_end for r in reports)
    samples = [from_report(r, received) for r in reports]
    url = f"sqlite:///{(directory / 'drift-bench.db').resolve()}"
    return await store_timed(url, manifest.drift_baseline, samples)
