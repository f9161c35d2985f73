"""Prometheus metrics of the agent's local inference server (``GET /metrics``).

One :class:`AgentMetrics` per server, on its own registry, so tests and several servers in one
process never share counters. Names follow Prometheus conventions (``_total`` counters,
``_seconds`` units); ``docs/agent.md`` lists them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)

from mcp_edge.agent.serving.loop_metrics import LoopCounter, LoopGauge, LoopHistogram

LATENCY_BUCKETS = (
    0.0002,
    0.0005,
    0.001,
    0.002,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
RATIO_BUCKETS = (0.1, 0.25, 0.5, 0.75, 0.9, 1.0)
LOAD_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class AgentMetrics:
    """Every metric family the agent exports."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        self.requests = LoopCounter(
            "mcp_agent_requests_total",
            "Inference requests answered, by outcome code.",
            ["model", "protocol", "code"],
            registry=r,
        )
        self.latency = LoopHistogram(
            "mcp_agent_request_latency_seconds",
            "Time from request received to answer sent.",
            ["model", "version"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.active = LoopGauge(
            "mcp_agent_active_requests", "Inference requests being handled now.", registry=r
        )
        self.queue_depth = LoopGauge(
            "mcp_agent_queue_depth",
            "Requests waiting in a model version's batch queue.",
            ["model", "version"],
            registry=r,
        )
        self.queue_wait = LoopHistogram(
            "mcp_agent_queue_wait_seconds",
            "How long the oldest request of a batch waited.",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.run_time = LoopHistogram(
            "mcp_agent_inference_run_seconds",
            "Backend time per batch.",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_size = LoopHistogram(
            "mcp_agent_batch_size",
            "Rows per batch run.",
            ["model"],
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.batch_fill = LoopHistogram(
            "mcp_agent_batch_fill_ratio",
            "Rows per batch over the maximum batch size.",
            ["model"],
            buckets=RATIO_BUCKETS,
            registry=r,
        )
        self.errors = Counter(
            "mcp_agent_inference_errors_total",
            "Failed inference requests by cause.",
            ["model", "cause"],
            registry=r,
        )
        self.rejections = Counter(
            "mcp_agent_rejections_total",
            "Requests refused before running (overload, deadline).",
            ["model", "reason"],
            registry=r,
        )
        self.payload_bytes = LoopHistogram(
            "mcp_agent_request_payload_bytes",
            "Size of inference request bodies.",
            ["protocol"],
            buckets=(256, 1024, 4096, 16384, 65536, 262144, 1048576, 8388608),
            registry=r,
        )
        self.load_seconds = Histogram(
            "mcp_agent_model_load_seconds",
            "Time to load a model version into its backend.",
            ["model"],
            buckets=LOAD_BUCKETS,
            registry=r,
        )
        self.warmup_seconds = Histogram(
            "mcp_agent_model_warmup_seconds",
            "Time to warm up and check a model version.",
            ["model"],
            buckets=LOAD_BUCKETS,
            registry=r,
        )
        self.load_failures = Counter(
            "mcp_agent_model_load_failures_total",
            "Model versions that failed to load or warm.",
            ["model", "stage"],
            registry=r,
        )
        self.swaps = Counter(
            "mcp_agent_model_swaps_total",
            "Stable versions replaced by a hot swap.",
            ["model"],
            registry=r,
        )
        self.models_loaded = Gauge(
            "mcp_agent_model_versions_loaded", "Model versions currently loaded.", registry=r
        )
        self.model_info = Gauge(
            "mcp_agent_model_info",
            "Loaded model versions (value 1) and how they run.",
            ["model", "version", "role", "backend", "provider"],
            registry=r,
        )
        self.canary_weight = Gauge(
            "mcp_agent_canary_weight",
            "Share of routed requests sent to the canary.",
            ["model"],
            registry=r,
        )
        self.canary_fallbacks = Counter(
            "mcp_agent_canary_fallbacks_total",
            "Canaries taken out of rotation because their error rate passed the limit.",
            ["model"],
            registry=r,
        )
        self.shadow_comparisons = Counter(
            "mcp_agent_shadow_comparisons_total",
            "Shadow answers compared with stable.",
            ["model", "outcome"],
            registry=r,
        )
        self.shadow_agreement = Gauge(
            "mcp_agent_shadow_agreement_ratio",
            "Share of shadow answers agreeing with stable.",
            ["model", "version"],
            registry=r,
        )
        self.shadow_latency = Histogram(
            "mcp_agent_shadow_latency_seconds",
            "Shadow inference latency.",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )

        self.drift_samples = LoopCounter(
            "mcp_agent_drift_samples_total",
            "Rows of answered requests binned for drift measurement.",
            ["model"],
            registry=r,
        )
        self.drift_dropped = LoopCounter(
            "mcp_agent_drift_dropped_total",
            "Sampled requests or rows not binned for drift, by reason "
            "(buffer_full, shape, not_finite, no_input, dtype, report, internal).",
            ["model", "reason"],
            registry=r,
        )
        self.drift_windows = LoopCounter(
            "mcp_agent_drift_windows_total",
            "Drift windows closed and queued for the control plane.",
            ["model"],
            registry=r,
        )
        self.hard_example_bytes = LoopGauge(
            "mcp_agent_hard_example_bytes",
            "Raw tensor bytes of the hard examples held for upload.",
            registry=r,
        )

        self.processes = Gauge(
            "mcp_agent_serving_processes",
            "Processes serving requests on the agent's ports (mcp-agent serve --processes).",
            registry=r,
        )
        self.processes.set(1)

    def exposition(self) -> bytes:
        """The text exposition format for ``GET /metrics``."""
        return generate_latest(self.registry)


# How a gauge sums over serving processes (Prometheus multiprocess mode has the same choices):
# most gauges add up (requests in flight, queue depth, memory); these say one thing for the
# whole server, which every process repeats.
_GAUGE_MODES = {
    "mcp_agent_model_info": "max",
    "mcp_agent_model_versions_loaded": "max",
    "mcp_agent_canary_weight": "max",
    "mcp_agent_shadow_agreement_ratio": "mean",
    "mcp_agent_serving_processes": "max",
    "process_start_time_seconds": "min",
    "process_max_fds": "max",
    "python_info": "max",
}


def merge_families(groups: Sequence[Iterable[Any]], *, processes: int) -> bytes:
    """One text exposition from the metric families of several serving processes.

    Counters, histograms and summaries add up sample by sample (their ``_created`` time is the
    earliest); gauges add up too except those that state one fact for the whole server
    (``_GAUGE_MODES``: max, min or mean). ``mcp_agent_serving_processes`` is set to
    ``processes``.
    """
    merged: dict[str, Any] = {}
    values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], tuple[Any, list[float]]]] = {}
    for families in groups:
        for fam in families:
            if fam.name not in merged:
                merged[fam.name] = fam
                values[fam.name] = {}
            per_sample = values[fam.name]
            for sample in fam.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                seen = per_sample.get(key)
                if seen is None:
                    per_sample[key] = (sample, [sample.value])
                else:
                    seen[1].append(sample.value)
    out: list[Any] = []
    for name, fam in merged.items():
        mode = _GAUGE_MODES.get(name, "sum") if fam.type == "gauge" else "sum"
        samples = []
        for first, vals in values[name].values():
            if name == "mcp_agent_serving_processes":
                value = float(processes)
            elif first.name.endswith("_created"):
                # A counter's or histogram's creation time: the earliest, never a sum.
                value = min(vals)
            elif mode == "max":
                value = max(vals)
            elif mode == "min":
                value = min(vals)
            elif mode == "mean":
                value = sum(vals) / len(vals)
            else:
                value = sum(vals)
            samples.append(first._replace(value=value))
        fam.samples = samples
        out.append(fam)
    return generate_latest(_Fixed(out))


class _Fixed:
    """A collector-like object holding finished families for ``generate_latest``."""

    def __init__(self, families: list[Any]) -> None:
        self._families = families

    def collect(self) -> Iterator[Any]:
        return iter(self._families)
