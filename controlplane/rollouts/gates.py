"""A stage's gates judged from what its devices measured (pure: no I/O).

Figures come from devices, so nothing here trusts them. A device's figures count only when
they are consistent (:func:`invalid_reason` is None): counters are non-negative integers,
errors at most requests, agreed at most compared, a histogram has ``len(edges) + 1`` buckets
over strictly increasing non-negative edges and holds at most the requests (failed requests
have no latency), and p95 and drift are finite and non-negative. A device with inconsistent figures is left out of every
gate of the stage (the engine reports it once in an ``ignored_stats`` decision).

No single device decides a request-based gate alone: when two or more devices report, each
device's requests are clipped to ``max(min_requests, requests of all the others)``, and its
errors (or agreements, or histogram counts) scaled with them; the minimum a gate needs is
counted after clipping. So one device claiming a million requests weighs at most as much as
the rest of the stage (or ``min_requests``, when the rest is smaller than that).

What each gate reads, over the stage's devices that run the version (``ACTIVE``):

* ``install_failure_rate``: FAILED / (ACTIVE + FAILED) of the stage; needs ``min_devices`` such
  devices and no request minimum.
* ``error_rate``: errors / requests of the new version; devices with at least one request.
* ``latency_p95_ratio``: p95 of the new version / p95 of the old one, over devices with
  requests and a p95 (or a histogram) of both. Each side's p95 comes from the devices' merged
  histograms when all of them have one on identical edges, otherwise from the request-weighted
  mean of the devices' p95 (a device's own histogram stands in for a missing ``p95_ms``).
  ``min_requests`` applies to each side; ``requests`` reports the smaller side.
* ``agreement``: agreed / compared of the new version (shadow stages).
* ``drift``: the largest drift a device reports; needs ``min_devices`` devices with a value.

A gate below its minimum is ``pending`` while the bake runs and ``inconclusive`` once it
ended: it never passes by default.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from mcp_edge.controlplane.rollouts.model import (
    DeviceMetrics,
    DevicePhase,
    DeviceProgress,
    Gate,
    GateMetric,
    GateResult,
    VersionStats,
)

MAX_BUCKETS = 1024
"""Histograms with more buckets are refused as inconsistent figures."""
P95 = 0.95


def _count(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0


def _stats_problem(s: VersionStats) -> str | None:
    if not all(_count(x) for x in (s.requests, s.errors, s.shadow_compared, s.shadow_agreed)):
        return "a counter is not a non-negative integer"
    if s.errors > s.requests:
        return f"{s.errors} errors over {s.requests} requests"
    if s.shadow_agreed > s.shadow_compared:
        return f"{s.shadow_agreed} agreed over {s.shadow_compared} compared"
    if s.p95_ms is not None and not _finite(s.p95_ms):
        return f"p95 {s.p95_ms!r:.20} is not a finite non-negative number"
    edges, counts = s.latency_edges_ms, s.latency_counts
    if len(edges) >= MAX_BUCKETS or len(counts) > MAX_BUCKETS:
        return "the latency histogram is too long"
    if not all(_finite(e) for e in edges) or any(a >= b for a, b in itertools.pairwise(edges)):
        return "the latency edges are not increasing non-negative numbers"
    if counts:
        if len(counts) != len(edges) + 1:
            return f"{len(counts)} latency buckets for {len(edges)} edges"
        # The histogram holds the answered requests (errors and rejections have no latency).
        if not all(_count(c) for c in counts) or sum(counts) > s.requests:
            return f"the latency buckets hold more than the {s.requests} requests"
    return None


def invalid_reason(device_id: str, metrics: DeviceMetrics) -> str | None:
    """Why a device's figures cannot be used (None: they can)."""
    if metrics.device_id != device_id:
        return f"figures filed under {device_id!r} name {metrics.device_id!r:.70}"
    for side, stats in (("new", metrics.new), ("old", metrics.old)):
        if stats is not None:
            problem = _stats_problem(stats)
            if problem is not None:
                return f"{side} version: {problem}"
    if metrics.drift is not None and not _finite(metrics.drift):
        return f"drift {metrics.drift!r:.20} is not a finite non-negative number"
    return None


def clipped(requests: Sequence[int], min_requests: int) -> list[int]:
    """Each device's requests clipped to ``max(min_requests, requests of the others)`` (when
    two or more report)."""
    if len(requests) < 2:
        return list(requests)
    total = sum(requests)
    return [min(r, max(min_requests, total - r)) for r in requests]


def histogram_p95(edges: Sequence[float], counts: Sequence[float]) -> float | None:
    """The 95th percentile of a histogram, interpolated inside its bucket (the first bucket
    starts at 0); ``inf`` when it lies above the last edge, None when it is empty."""
    total = math.fsum(counts)
    if total <= 0:
        return None
    rank = P95 * total
    cum = 0.0
    last = None
    for i, c in enumerate(counts):
        if c <= 0:
            continue
        last = i
        if cum + c >= rank:
            break
        cum += c
    assert last is not None
    if last >= len(edges):
        return math.inf
    lo = edges[last - 1] if last > 0 else 0.0
    hi = edges[last]
    c = counts[last]
    return lo + (hi - lo) * min(1.0, max(0.0, (rank - cum) / c))


@dataclass(frozen=True)
class _Sample:
    device_id: str
    new: VersionStats | None
    old: VersionStats | None
    drift: float | None


def _samples(
    stage_devices: Sequence[DeviceProgress], metrics: Mapping[str, DeviceMetrics]
) -> list[_Sample]:
    out = []
    for p in stage_devices:
        m = metrics.get(p.device_id)
        if (
            p.phase is DevicePhase.ACTIVE
            and m is not None
            and invalid_reason(p.device_id, m) is None
        ):
            out.append(_Sample(p.device_id, m.new, m.old, m.drift))
    return out


def _ratio(pairs: Sequence[tuple[int, float]], min_requests: int) -> tuple[float | None, int]:
    """sum(part) / sum(whole) over clipped wholes; parts scaled with their whole."""
    wholes = [w for w, _ in pairs]
    clip = clipped(wholes, min_requests)
    total = sum(clip)
    part = math.fsum(p * c / w for (w, p), c in zip(pairs, clip, strict=True))
    return (part / total if total else None), total


def _side_p95(stats: Sequence[VersionStats], min_requests: int) -> tuple[float | None, int]:
    if not stats:
        return None, 0
    clip = clipped([s.requests for s in stats], min_requests)
    total = sum(clip)
    if all(s.latency_counts for s in stats) and len({s.latency_edges_ms for s in stats}) == 1:
        edges = stats[0].latency_edges_ms
        merged = [0.0] * (len(edges) + 1)
        for s, c in zip(stats, clip, strict=True):
            for i, n in enumerate(s.latency_counts):
                merged[i] += n * c / s.requests
        return histogram_p95(edges, merged), total
    values = []
    for s, c in zip(stats, clip, strict=True):
        p = (
            s.p95_ms
            if s.p95_ms is not None
            else histogram_p95(s.latency_edges_ms, s.latency_counts)
        )
        if p is None:
            return None, total
        values.append((float(p), c))
    if any(math.isinf(p) for p, _ in values):
        return math.inf, total
    return math.fsum(p * c for p, c in values) / total, total


def _has_p95(s: VersionStats | None) -> bool:
    return s is not None and s.requests > 0 and (s.p95_ms is not None or bool(s.latency_counts))


def _p95_ratio(new: float | None, old: float | None) -> float | None:
    if new is None or old is None or (math.isinf(new) and math.isinf(old)):
        return None
    if old <= 0:
        return 1.0 if new <= 0 else math.inf
    return new / old


def _judge(
    gate: Gate,
    value: float | None,
    enough: bool,
    devices: int,
    requests: int,
    shortfall: str,
    measured: str,
    bake_ended: bool,
) -> GateResult:
    name = gate.metric.value
    if not enough or value is None:
        if bake_ended:
            verdict = "inconclusive"
            reason = (
                f"gate {name} inconclusive: {shortfall} when the bake ended; "
                "approve with promote or roll back"
            )
        else:
            verdict, reason = "pending", f"gate {name} pending: {shortfall}"
    else:
        ok = value >= gate.threshold if gate.metric.is_floor else value <= gate.threshold
        verdict = "pass" if ok else "fail"
        op = (">=" if ok else "<") if gate.metric.is_floor else ("<=" if ok else ">")
        reason = (
            f"gate {name} {'passes' if ok else 'fails'}: {value:.4g} {op} {gate.threshold:g} "
            f"over {measured}"
        )
    return GateResult(
        gate.metric, verdict, value, gate.threshold, devices, requests, gate.dry_run, reason
    )


def evaluate_gate(
    gate: Gate,
    stage_devices: Sequence[DeviceProgress],
    metrics: Mapping[str, DeviceMetrics],
    *,
    bake_ended: bool,
) -> GateResult:
    """Judge ``gate`` over one stage's devices and their figures (the module docstring)."""
    dev_need = gate.min_devices
    req_need = gate.min_requests
    metric = gate.metric
    if metric is GateMetric.INSTALL_FAILURE_RATE:
        active = sum(p.phase is DevicePhase.ACTIVE for p in stage_devices)
        failed = sum(p.phase is DevicePhase.FAILED for p in stage_devices)
        n = active + failed
        return _judge(
            gate,
            failed / n if n else None,
            n >= dev_need,
            n,
            0,
            f"{n} of {dev_need} settled device(s)",
            f"{failed} failed of {n} settled device(s)",
            bake_ended,
        )
    samples = _samples(stage_devices, metrics)
    if metric is GateMetric.DRIFT:
        drifts = [float(s.drift) for s in samples if s.drift is not None]
        return _judge(
            gate,
            max(drifts) if drifts else None,
            len(drifts) >= dev_need,
            len(drifts),
            0,
            f"drift from {len(drifts)} of {dev_need} device(s)",
            f"{len(drifts)} device(s)",
            bake_ended,
        )
    if metric is GateMetric.LATENCY_P95_RATIO:
        both = [(s.new, s.old) for s in samples if _has_p95(s.new) and _has_p95(s.old)]
        new_p95, new_req = _side_p95([n for n, _ in both if n is not None], req_need)
        old_p95, old_req = _side_p95([o for _, o in both if o is not None], req_need)
        requests = min(new_req, old_req)
        shortfall = (
            f"{new_req} new and {old_req} old of {req_need} requests from "
            f"{len(both)} of {dev_need} device(s)"
        )
        measured = f"{new_req} new and {old_req} old requests from {len(both)} device(s)"
        enough = len(both) >= dev_need and requests >= req_need
        return _judge(
            gate,
            _p95_ratio(new_p95, old_p95),
            enough,
            len(both),
            requests,
            shortfall,
            measured,
            bake_ended,
        )
    pairs: list[tuple[int, float]] = []
    if metric is GateMetric.AGREEMENT:
        what = "compared requests"
        for s in samples:
            if s.new is not None and s.new.shadow_compared > 0:
                pairs.append((s.new.shadow_compared, float(s.new.shadow_agreed)))
    else:
        what = "requests"
        for s in samples:
            if s.new is not None and s.new.requests > 0:
                pairs.append((s.new.requests, float(s.new.errors)))
    value, total = _ratio(pairs, req_need)
    enough = len(pairs) >= dev_need and total >= req_need
    return _judge(
        gate,
        value,
        enough,
        len(pairs),
        total,
        f"{total} of {req_need} {what} from {len(pairs)} of {dev_need} device(s)",
        f"{total} {what} from {len(pairs)} device(s)",
        bake_ended,
    )
