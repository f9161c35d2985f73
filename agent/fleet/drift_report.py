"""The drift report of one closed window, built without pydantic.

Part of :mod:`agent.fleet.drift`. :class:`DriftWindowReport` (with :class:`FeatureWindow`, a
typed dict) is the plain twin of :class:`shared.protocol.telemetry.DriftReport` (and ``FeatureDrift``), field
for field, in the same order, like the twins of :mod:`shared.protocol.reports`:
:func:`shared.protocol.reports.encode_report` writes the bytes the pydantic model would
(``tests/unit/test_agent_drift.py`` checks it), and the control plane validates what arrives.
Building and validating the pydantic model for each window cost about ten times more, on the
event loop, once per window.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypedDict

from mcp_edge.shared.protocol.reports import InferenceRole

if TYPE_CHECKING:
    from mcp_edge.shared.drift import DriftScores
    from mcp_edge.shared.protocol.state import DriftPolicy


class _FeatureCounts(TypedDict):
    name: str
    counts: list[int]


class FeatureWindow(_FeatureCounts, total=False):
    """One feature's counts in a window and its PSI/KS (``telemetry.FeatureDrift``), as the
    JSON object it is on the wire: a window has a few dozen of them, and building each as a
    dataclass and converting it back cost more than the rest of the report."""

    psi: float
    ks: float


@dataclass(frozen=True, slots=True, kw_only=True)
class DriftWindowReport:
    """One window of one model version (``telemetry.DriftReport``; fields documented there)."""

    device_id: str
    ts: float
    model: str
    version: str
    role: InferenceRole = InferenceRole.STABLE
    window_start: float
    window_end: float
    samples: int
    sample_every: int = 1
    features: list[FeatureWindow] = field(default_factory=list)
    class_counts: list[int] = field(default_factory=list)
    class_psi: float | None = None
    confidence_counts: list[int] = field(default_factory=list)
    confidence_psi: float | None = None
    input_psi: float | None = None
    hard_examples: int = 0


def window_report(
    *,
    device_id: str,
    model: str,
    version: str,
    role: InferenceRole,
    start: float,
    now: float,
    sample_every: int,
    counts: tuple[int, dict[str, list[int]], list[int], list[int]],
    scores: DriftScores,
    hard_examples: int,
) -> DriftWindowReport:
    """The report of a window from ``counts`` (``Binner.take()``) and their ``scores``."""
    samples, features, classes, confidence = counts
    return DriftWindowReport(
        device_id=device_id, ts=now, model=model, version=version, role=role,
        window_start=start, window_end=max(now, start), samples=samples,
        sample_every=sample_every,
        features=[_feature(n, c, scores.features.get(n), scores.ks.get(n))
                  for n, c in features.items()],
        class_counts=classes, class_psi=scores.class_psi,
        confidence_counts=confidence, confidence_psi=scores.confidence_psi,
        input_psi=scores.input_psi, hard_examples=hard_examples,
    )  # fmt: skip


def _feature(name: str, counts: list[int], psi: float | None, ks: float | None) -> FeatureWindow:
    out: FeatureWindow = {"name": name, "counts": counts}
    if psi is not None:
        out["psi"] = psi
    if ks is not None:
        out["ks"] = ks
    return out


def describe(policy: DriftPolicy) -> str:
    """The policy in one line, for the log."""
    if not policy.enabled:
        return "off"
    hard = (
        f"hard examples up to confidence {policy.hard_example_max_confidence:g} within "
        f"{policy.hard_example_budget_bytes} bytes"
        if policy.hard_examples
        else "no hard examples"
    )
    return (
        f"windows of {policy.window_requests} samples or {policy.window_s:g} s, "
        f"1 in {policy.sample_every} requests sampled, {hard}"
    )


def summary(report: DriftWindowReport) -> str:
    """A window in one line, for the log."""

    def fmt(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    return (
        f"{report.model} {report.version} ({report.role.value}): {report.samples} samples, "
        f"input PSI {fmt(report.input_psi)}, class PSI {fmt(report.class_psi)}, "
        f"confidence PSI {fmt(report.confidence_psi)}"
    )
