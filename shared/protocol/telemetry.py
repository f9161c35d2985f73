"""Telemetry a device sends upstream: health, inference statistics and data drift (DESIGN 4.7).

Timestamps are Unix seconds (float): cheap to produce at a high rate and to store. The agent
builds health and inference reports as the plain twins in :mod:`shared.protocol.reports`; the
models here are their schema (the control plane validates with them).
"""

from __future__ import annotations

import itertools
import math
from typing import Annotated, ClassVar

from pydantic import Field, model_validator

from mcp_edge.shared.protocol.base import Identifier, Message, VersionText
from mcp_edge.shared.protocol.reports import InferenceRole

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
    """Counters for one model version in one role (:class:`InferenceRole`) over one window.

    ``count`` is every request the version took in the role, ``errors`` and ``rejections``
    (overload, deadline) the failed ones among them. The latency histogram counts the successful
    requests, ``latency_bucket_counts[i]`` those of at most ``latency_bucket_edges_ms[i]`` ms
    (and above the edge before), the last count those above the last edge. For a shadow,
    ``shadow_compared`` of its answers were compared with stable's and ``shadow_agreed`` agreed.

    Refused (a ``ValueError``, so the control plane drops the report as ``schema``): errors and
    rejections above ``count``, edges that are not finite, ≥ 0 and strictly increasing, counts
    without exactly one more entry than the edges or that do not add up to the successful
    requests, and more agreed shadow answers than compared ones.
    """

    model: Identifier
    version: VersionText
    role: InferenceRole = InferenceRole.STABLE
    count: Count = Field(ge=0)
    errors: Count = Field(ge=0)
    rejections: Count = Field(default=0, ge=0)
    latency: LatencySummary | None = None
    latency_bucket_edges_ms: list[float] = Field(default_factory=list, max_length=_MAX_BINS)
    latency_bucket_counts: list[Count] = Field(default_factory=list, max_length=_MAX_BINS + 1)
    queue_depth: int = Field(default=0, ge=0)
    batch_size_avg: float | None = Field(default=None, ge=0)
    batch_fill_ratio: float | None = Field(default=None, ge=0, le=1)
    shadow_compared: Count = Field(default=0, ge=0)
    shadow_agreed: Count = Field(default=0, ge=0)

    @model_validator(mode="after")
    def _consistent(self) -> ModelInferenceStats:
        succeeded = self.count - self.errors - self.rejections
        if succeeded < 0:
            raise ValueError("errors and rejections add up to more than count")
        edges, counts = self.latency_bucket_edges_ms, self.latency_bucket_counts
        if any(not math.isfinite(e) or e < 0 for e in edges):
            raise ValueError("latency bucket edges must be finite and >= 0")
        if any(b <= a for a, b in itertools.pairwise(edges)):
            raise ValueError("latency bucket edges must be strictly increasing")
        if counts:
            if len(counts) != len(edges) + 1:
                raise ValueError(
                    f"{len(counts)} latency bucket counts for {len(edges)} edges "
                    f"(one more count than edges: the last counts what is above the last edge)"
                )
            if any(c < 0 for c in counts):
                raise ValueError("latency bucket counts must be >= 0")
            if sum(counts) != succeeded:
                raise ValueError(
                    f"latency bucket counts add up to {sum(counts)}, not to the {succeeded} "
                    "successful requests (count - errors - rejections)"
                )
        if self.shadow_agreed > self.shadow_compared:
            raise ValueError("shadow_agreed is above shadow_compared")
        return self


class InferenceStats(Message):
    MAX_BYTES: ClassVar[int] = 256 * 1024

    device_id: Identifier
    ts: float
    window_s: float = Field(gt=0)
    models: list[ModelInferenceStats] = Field(default_factory=list, max_length=256)


NonNegative = Annotated[int, Field(ge=0)]
Score = Annotated[float, Field(ge=0, allow_inf_nan=False)]


class FeatureDrift(Message):
    """One input feature (or image summary / sketch value) of a window, on the baseline's bins."""

    name: str = Field(min_length=1, max_length=128)
    counts: list[NonNegative] = Field(min_length=1, max_length=_MAX_BINS)
    psi: Score | None = None
    ks: float | None = Field(default=None, ge=0, le=1, allow_inf_nan=False)


class DriftReport(Message):
    """One window of one model version's traffic on the bundle baseline's fixed bins.

    ``samples`` requests were binned (1 in ``sample_every`` of those answered); every feature's
    counts add up to ``samples``; class and confidence counts (when the baseline has an output)
    add up to the same number, at most ``samples``. The PSI/KS figures are the device's own;
    the control plane recomputes its aggregates from the counts. ``hard_examples``: how many
    inputs the device holds for upload (see :class:`HardExample`).
    """

    MAX_BYTES: ClassVar[int] = 256 * 1024

    device_id: Identifier
    ts: float = Field(allow_inf_nan=False)
    model: Identifier
    version: VersionText
    role: InferenceRole = InferenceRole.STABLE
    window_start: float = Field(allow_inf_nan=False)
    window_end: float = Field(allow_inf_nan=False)
    samples: Count = Field(ge=1)
    sample_every: int = Field(default=1, ge=1, le=1_000_000)
    features: list[FeatureDrift] = Field(default_factory=list, max_length=512)
    class_counts: list[NonNegative] = Field(default_factory=list, max_length=4096)
    class_psi: Score | None = None
    confidence_counts: list[NonNegative] = Field(default_factory=list, max_length=_MAX_BINS)
    confidence_psi: Score | None = None
    input_psi: Score | None = None
    hard_examples: Count = Field(default=0, ge=0)

    @model_validator(mode="after")
    def _consistent(self) -> DriftReport:
        if self.window_end < self.window_start:
            raise ValueError("window_end is before window_start")
        names = [f.name for f in self.features]
        if len(set(names)) != len(names):
            raise ValueError("a feature appears twice")
        for f in self.features:
            if sum(f.counts) != self.samples:
                raise ValueError(
                    f"feature {f.name!r}: counts add up to {sum(f.counts)}, not {self.samples}"
                )
        classes, confidence = sum(self.class_counts), sum(self.confidence_counts)
        if self.class_counts and self.confidence_counts and classes != confidence:
            raise ValueError("class and confidence counts add up to different numbers")
        if max(classes, confidence) > self.samples:
            raise ValueError("more answers counted than samples")
        return self


class TensorBytes(Message):
    """A tensor as raw little-endian bytes (base64), as the device decoded it from a request."""

    name: str = Field(min_length=1, max_length=256)
    datatype: str = Field(pattern=r"^(BOOL|U?INT(8|16|32|64)|FP(16|32|64))$")
    shape: list[Annotated[int, Field(ge=0, le=2**31)]] = Field(max_length=16)
    data_b64: str = Field(max_length=2 * 1024 * 1024)


class HardExample(Message):
    """One input the model answered with low confidence, and what it answered."""

    model: Identifier
    version: VersionText
    ts: float = Field(allow_inf_nan=False)
    confidence: float = Field(ge=0, le=1, allow_inf_nan=False)
    predicted: int | None = Field(default=None, ge=0)
    input: TensorBytes
    output: TensorBytes | None = None


class HardExampleBatch(Message):
    """The ``result`` of an ``upload_hard_examples`` command reply.

    Arguments of the command: ``model`` (required), ``version`` (optional), ``max_bytes`` (the
    raw tensor bytes the reply may carry, at most the policy's budget). ``held``: how many the
    device still keeps after this upload (those that did not fit).
    """

    MAX_BYTES: ClassVar[int] = 1024 * 1024

    examples: list[HardExample] = Field(default_factory=list, max_length=4096)
    bytes: Count = Field(ge=0)
    held: Count = Field(default=0, ge=0)
