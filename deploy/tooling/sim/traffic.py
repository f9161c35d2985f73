"""What a simulated device says about its inference traffic and its health, drawn per window.

No request is simulated one by one: for each reporting window of ``window_s`` seconds a device
draws, per model it serves,

- the requests: Poisson with mean ``request_rate × window_s`` of the stable version; a canary
  takes its weight's share of them (binomial), stable the rest; a shadow runs a copy of each of
  stable's requests;
- the failures: binomial with the version's ``error_rate``;
- the latency of the successful ones: a multinomial over the agent's histogram edges
  (:data:`agent.fleet.telemetry.LATENCY_EDGES_MS`) with the probabilities of a log-normal
  distribution of median ``latency_ms × latency_factor`` and spread ``latency_sigma``; the
  percentiles are that distribution's;
- for a shadow, the answers compared (its successful ones) and those that agreed (binomial
  with the version's ``agreement``).

The result is the agent's own :class:`~shared.protocol.reports.ModelInferenceReport` (the
wire's ``ModelInferenceStats``) with its role (stable, canary, shadow) and, for a shadow, the
compared and agreed counts: the histogram counts add up to the successful requests, so the
control plane's checks hold.
"""

from __future__ import annotations

import functools
import itertools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mcp_edge.agent.fleet.telemetry import LATENCY_EDGES_MS
from mcp_edge.shared.protocol.reports import (
    HealthReport,
    InferenceRole,
    LatencyReport,
    ModelInferenceReport,
)
from mcp_edge.tooling.sim.config import Behaviour, VersionBehaviour

_Z95, _Z99 = 1.6448536269514722, 2.3263478740408408


@dataclass(frozen=True, slots=True)
class Serving:
    """What one model serves on a device: its stable version and at most one candidate."""

    model: str
    stable: str
    canary: str | None = None
    canary_weight: float = 0.0
    shadow: str | None = None


class Traffic:
    """Draws windows of statistics and health samples (see the module docstring).

    ``seed`` makes a run repeatable; one generator serves the whole fleet.
    """

    def __init__(self, behaviour: Behaviour, *, seed: int | None = None) -> None:
        self.behaviour = behaviour
        self.rng = np.random.default_rng(seed)
        self.py_rng = random.Random(seed)

    def window(self, serving: Sequence[Serving], window_s: float) -> list[ModelInferenceReport]:
        """One window's statistics for every version served."""
        out: list[ModelInferenceReport] = []
        for s in serving:
            stable = self.behaviour.of(s.model, s.stable)
            total = int(self.rng.poisson(stable.request_rate * window_s))
            to_canary = int(self.rng.binomial(total, s.canary_weight)) if s.canary else 0
            stable_n = total - to_canary
            out.append(self._report(s.model, s.stable, InferenceRole.STABLE, stable, stable_n))
            if s.canary is not None:
                b = self.behaviour.of(s.model, s.canary)
                out.append(self._report(s.model, s.canary, InferenceRole.CANARY, b, to_canary))
            if s.shadow is not None:
                b = self.behaviour.of(s.model, s.shadow)
                out.append(self._report(s.model, s.shadow, InferenceRole.SHADOW, b, stable_n))
        return out

    def _report(
        self, model: str, version: str, role: InferenceRole, b: VersionBehaviour, n: int
    ) -> ModelInferenceReport:
        errors = int(self.rng.binomial(n, b.error_rate)) if n else 0
        ok = n - errors
        probs = bucket_probabilities(b.median_ms, b.latency_sigma)
        counts = [int(c) for c in self.rng.multinomial(ok, probs)] if ok else [0] * len(probs)
        latency = None
        if ok:
            m, s = b.median_ms, b.latency_sigma
            latency = LatencyReport(p50_ms=m, p95_ms=m * math.exp(_Z95 * s),
                                    p99_ms=m * math.exp(_Z99 * s))  # fmt: skip
        compared = agreed = 0
        if role is InferenceRole.SHADOW and ok:
            compared, agreed = ok, int(self.rng.binomial(ok, b.agreement))
        return ModelInferenceReport(
            model=model, version=version, role=role, count=n, errors=errors, latency=latency,
            latency_bucket_edges_ms=list(LATENCY_EDGES_MS), latency_bucket_counts=counts,
            shadow_compared=compared, shadow_agreed=agreed,
        )  # fmt: skip

    def health(self, device_id: str, now: float, uptime_s: float) -> HealthReport:
        """A plausible health sample of a small device (figures drawn around fixed means)."""
        r = self.py_rng
        return HealthReport(
            device_id=device_id, ts=now, cpu_percent=r.uniform(5.0, 40.0),
            load_1m=r.uniform(0.1, 1.5), mem_total_mb=4096.0, mem_used_mb=r.uniform(900, 1400),
            disk_total_mb=32768.0, disk_free_mb=r.uniform(12000, 13000),
            process_rss_mb=r.uniform(85.0, 98.0), uptime_s=uptime_s,
            temperatures_c={"cpu": round(r.uniform(40.0, 58.0), 1)},
        )  # fmt: skip


@functools.lru_cache(maxsize=256)
def bucket_probabilities(median_ms: float, sigma: float) -> tuple[float, ...]:
    """P(latency in each histogram bucket) for a log-normal latency; len(edges) + 1 entries."""
    cdf = [_lognormal_cdf(e, median_ms, sigma) for e in LATENCY_EDGES_MS]
    probs = [cdf[0], *(b - a for a, b in itertools.pairwise(cdf)), 1.0 - cdf[-1]]
    clipped = [max(0.0, p) for p in probs]
    total = sum(clipped)
    return tuple(p / total for p in clipped)


def _lognormal_cdf(x: float, median: float, sigma: float) -> float:
    if x <= 0:
        return 0.0
    if sigma < 1e-9:
        return 1.0 if x >= median else 0.0
    return 0.5 * (1.0 + math.erf((math.log(x) - math.log(median)) / (sigma * math.sqrt(2.0))))
