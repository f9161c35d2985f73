"""Telemetry a device sends upstream: health, inference statistics and data drift (DESIGN 4.7).

Timestamps are Unix seconds (float): cheap to produce at a high rate and to store. The agent
builds health and inference reports as the plain twins in :mod:`shared.protocol.reports`; the
models here are their schema (the control plane validates with them).
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from mcp_edge.shared.protocol.base import Identifier, Message, VersionText

Count = int
_MAX_BINS = 256


class GpuSample(Message):
    util_percent: float | None = Field(default=None, ge=0, le=100)
    mem_used_mb: float | None = Field(default=None, ge=0)
    mem_total_mb: float | None = Field(default=None, ge=0)
    emc_percent: float | None = Field(default=None, ge=0, le=100)
    power_mw: float | None = Field(default=None, ge=0)


class HealthSample(Message):
    """One periodic health reading of the device and the agent process."""

    MAX_BYTES: ClassVar[int] = 16 * 1024

    device_id: Identifier
    ts: float
    cpu_percent: float = Field(ge=0, le=100 * 1024)
    load_1m: float | None = Field(default=None, ge=0)
    mem_total_mb: float = Field(ge=0)
    mem_used_mb: float = Field(ge=0)
    disk_total_mb: float | None = Field(default=None, ge=0)
    disk_free_mb: float | None = Field(default=None, ge=0)
    process_rss_mb: float | None = Field(default=None, ge=0)
    uptime_s: float | None = Field(default=None, ge=0)
    temperatures_c: dict[str, float] = Field(default_factory=dict, max_length=64)
    gpu: GpuSample | None = None
    energy_j: float | None = Field(default=None, ge=0)


class LatencySummary(Message):
    p50_ms: float = Field(ge=0)
    p95_ms: float = Field(ge=0)
    p99_ms: float = Field(ge=0)


class ModelInferenceStats(Message):
    """Counters for one model version over one reporting window."""

    model: Identifier
    version: VersionText
    count: Count = Field(ge=0)
    errors: Count = Field(ge=0)
    rejections: Count = Field(default=0, ge=0)
    latency: LatencySummary | None = None
    latency_bucket_edges_ms: list[float] = Field(default_factory=list, max_length=_MAX_BINS)
    latency_bucket_counts: list[Count] = Field(default_factory=list, max_length=_MAX_BINS + 1)
    queue_depth: int = Field(default=0, ge=0)
    batch_size_avg: float | None = Field(default=None, ge=0)
    batch_fill_ratio: float | None = Field(default=None, ge=0, le=1)


class InferenceStats(Message):
    MAX_BYTES: ClassVar[int] = 256 * 1024

    device_id: Identifier
    ts: float
    window_s: float = Field(gt=0)
    models: list[ModelInferenceStats] = Field(default_factory=list, max_length=256)


class FeatureDrift(Message):
    """Drift of one input feature (or image summary) against the bundle's baseline bins."""

    name: str = Field(min_length=1, max_length=128)
    counts: list[Count] = Field(max_length=_MAX_BINS)
    psi: float | None = Field(default=None, ge=0)
    ks: float | None = Field(default=None, ge=0, le=1)


class DriftReport(Message):
    """Windowed histograms on the baseline's fixed bins, with PSI/KS per feature."""

    MAX_BYTES: ClassVar[int] = 256 * 1024

    device_id: Identifier
    ts: float
    model: Identifier
    version: VersionText
    window_start: float
    window_end: float
    samples: Count = Field(ge=0)
    features: list[FeatureDrift] = Field(default_factory=list, max_length=512)
    class_counts: list[Count] = Field(default_factory=list, max_length=4096)
    class_psi: float | None = Field(default=None, ge=0)
    confidence_counts: list[Count] = Field(default_factory=list, max_length=_MAX_BINS)
