"""Drift statistics on a bundle's baseline bins (DESIGN 4.7), numpy only.

The agent bins what its model version sees with :class:`Binner` and reports the counts per
window; the control plane sums counts across windows and devices and scores the sum with
:func:`score_counts`. Both ends use this module, so a device's figure and the fleet's agree on
the definitions:

* **PSI** (population stability index) of live counts ``a`` against baseline counts ``e`` on
  the same bins: ``sum((p_a - p_e) * ln(p_a / p_e))`` with ``p = (c + 0.5) / (n + 0.5 k)``
  (``k`` bins; the half-count keeps empty bins finite). 0 is no change; 0.1 is commonly read
  as a small shift and 0.25 as a large one. PSIs are never averaged across devices or windows:
  the counts are summed and the PSI of the sum is taken.
* **KS** on binned data: the largest gap between the two cumulative shares at the bin edges.
* ``input_psi`` of a window: the mean of its features' PSIs (one feature of 64 moving by
  noise does not raise it alone); ``max_feature_psi`` the largest. ``class_psi`` is on the
  arg-max class counts, ``confidence_psi`` on the top-score histogram.
* ``score`` (what rules and the rollout gate compare): the largest of ``input_psi``,
  ``class_psi`` and ``confidence_psi`` that could be computed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from mcp_edge.shared.bundle.baseline import (
    CONFIDENCE_EDGES,
    as_probabilities,
    feature_values,
    projection_matrix,
)
from mcp_edge.shared.bundle.manifest import DriftBaseline

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

SMOOTHING = 0.5
"""Counts added to every bin of both histograms before PSI."""


def psi(expected: Sequence[int] | IntArray, actual: Sequence[int] | IntArray) -> float | None:
    """PSI of ``actual`` against ``expected`` (same bins); None when either is empty."""
    e = np.asarray(expected, dtype=np.float64)
    a = np.asarray(actual, dtype=np.float64)
    if e.shape != a.shape or e.ndim != 1 or e.size == 0:
        raise ValueError(f"PSI needs two histograms of the same bins, got {e.shape} {a.shape}")
    if e.sum() <= 0 or a.sum() <= 0:
        return None
    pe = (e + SMOOTHING) / (e.sum() + SMOOTHING * e.size)
    pa = (a + SMOOTHING) / (a.sum() + SMOOTHING * a.size)
    return float(np.sum((pa - pe) * np.log(pa / pe)))


def ks(expected: Sequence[int] | IntArray, actual: Sequence[int] | IntArray) -> float | None:
    """Largest gap between the cumulative shares of two histograms on the same bins."""
    e = np.asarray(expected, dtype=np.float64)
    a = np.asarray(actual, dtype=np.float64)
    if e.shape != a.shape or e.ndim != 1:
        raise ValueError(f"KS needs two histograms of the same bins, got {e.shape} {a.shape}")
    if e.sum() <= 0 or a.sum() <= 0:
        return None
    return float(np.max(np.abs(np.cumsum(e) / e.sum() - np.cumsum(a) / a.sum())))


@dataclass(frozen=True)
class DriftScores:
    """What one set of counts says against a baseline (see the module docstring)."""

    samples: int
    features: dict[str, float | None] = field(default_factory=dict)
    """PSI per feature name."""
    ks: dict[str, float | None] = field(default_factory=dict)
    input_psi: float | None = None
    max_feature_psi: float | None = None
    class_psi: float | None = None
    confidence_psi: float | None = None

    @property
    def score(self) -> float | None:
        values = [v for v in (self.input_psi, self.class_psi, self.confidence_psi) if v is not None]
        return max(values) if values else None

    def as_dict(self) -> dict[str, object]:
        return {
            "samples": self.samples,
            "score": _round(self.score),
            "input_psi": _round(self.input_psi),
            "max_feature_psi": _round(self.max_feature_psi),
            "class_psi": _round(self.class_psi),
            "confidence_psi": _round(self.confidence_psi),
            "features": {k: _round(v) for k, v in self.features.items()},
        }


def _round(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else round(value, 6)


def score_counts(
    baseline: DriftBaseline,
    features: Mapping[str, Sequence[int]],
    class_counts: Sequence[int] = (),
    confidence_counts: Sequence[int] = (),
    *,
    samples: int = 0,
) -> DriftScores:
    """Score live counts (already checked to fit ``baseline``'s bins) against it."""
    per, gaps = _feature_scores(baseline, features)
    return _scores(baseline, per, gaps, class_counts, confidence_counts, samples)


def _scores(
    baseline: DriftBaseline,
    per: dict[str, float | None],
    gaps: dict[str, float | None],
    class_counts: Sequence[int],
    confidence_counts: Sequence[int],
    samples: int,
) -> DriftScores:
    known = [v for v in per.values() if v is not None]
    out = baseline.output
    class_psi = confidence_psi = None
    if out is not None and class_counts:
        class_psi = psi(out.class_counts, class_counts)
    if out is not None and confidence_counts:
        confidence_psi = psi(out.confidence.counts, confidence_counts)
    return DriftScores(
        samples=samples,
        features=per,
        ks=gaps,
        input_psi=float(np.mean(known)) if known else None,
        max_feature_psi=max(known) if known else None,
        class_psi=class_psi,
        confidence_psi=confidence_psi,
    )


def _feature_scores(
    baseline: DriftBaseline, features: Mapping[str, Sequence[int]]
) -> tuple[dict[str, float | None], dict[str, float | None]]:
    """:func:`psi` and :func:`ks` of each feature in ``features``; one numpy pass over all of
    them when their bins are equally many (the usual case: a window has 64 features or more,
    and one pass costs what a single feature costs)."""
    names = [fb.name for fb in baseline.features if fb.name in features]
    expected = [fb.histogram.counts for fb in baseline.features if fb.name in features]
    actual = [features[n] for n in names]
    if not names or len({len(c) for c in (*expected, *actual)}) != 1:
        return (
            {n: psi(e, a) for n, e, a in zip(names, expected, actual, strict=True)},
            {n: ks(e, a) for n, e, a in zip(names, expected, actual, strict=True)},
        )
    return _row_scores(
        names, np.asarray(expected, dtype=np.float64), np.asarray(actual, dtype=np.float64)
    )


def _row_scores(
    names: list[str], e: FloatArray, a: FloatArray
) -> tuple[dict[str, float | None], dict[str, float | None]]:
    """:func:`psi` and :func:`ks` of each row of ``a`` against the same row of ``e``
    (``[features, bins]``), by name; None where either row is empty."""
    e_n, a_n = e.sum(axis=1, keepdims=True), a.sum(axis=1, keepdims=True)
    k = e.shape[1]
    pe = (e + SMOOTHING) / (e_n + SMOOTHING * k)
    pa = (a + SMOOTHING) / (a_n + SMOOTHING * k)
    psis = np.sum((pa - pe) * np.log(pa / pe), axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        gaps = np.max(np.abs(np.cumsum(e, axis=1) / e_n - np.cumsum(a, axis=1) / a_n), axis=1)
    empty = ((e_n <= 0) | (a_n <= 0)).ravel().tolist()
    return (
        {n: None if x else float(v) for n, v, x in zip(names, psis.tolist(), empty, strict=True)},
        {n: None if x else float(v) for n, v, x in zip(names, gaps.tolist(), empty, strict=True)},
    )


def fits(
    baseline: DriftBaseline,
    features: Mapping[str, Sequence[int]],
    class_counts: Sequence[int],
    confidence_counts: Sequence[int],
) -> str | None:
    """Why counts do not fit ``baseline``'s bins (a short reason), or None when they do."""
    names = {fb.name: len(fb.histogram.counts) for fb in baseline.features}
    for name, counts in features.items():
        if name not in names:
            return "unknown_feature"
        if len(counts) != names[name]:
            return "bins"
    out = baseline.output
    if class_counts and (out is None or len(class_counts) != len(out.class_counts)):
        return "bins"
    if confidence_counts and (out is None or len(confidence_counts) != len(out.confidence.counts)):
        return "bins"
    return None


class Binner:
    """Bins batches of samples on one baseline's edges, vectorised: O(N · features · bins).

    ``add(matrix, scores)`` takes ``[N, F]`` inputs (flattened samples) and optionally the
    model's ``[N, K]`` scores; ``take()`` returns the counts gathered since the last take and
    starts over. Not thread-safe: one owner.
    """

    def __init__(self, baseline: DriftBaseline) -> None:
        self.baseline = baseline
        self.names = [fb.name for fb in baseline.features]
        widths = {len(fb.histogram.counts) for fb in baseline.features}
        self._uniform = len(widths) == 1
        self._edges = [np.asarray(fb.histogram.edges, dtype=np.float64) for fb in baseline.features]
        if self._uniform:
            # Inner edges stacked [F, B-1]: a value's bin is how many inner edges it reaches.
            # Inner edges, one row per edge index: row j holds every feature's j-th inner edge.
            self._inner_rows = np.ascontiguousarray(np.stack([e[1:-1] for e in self._edges]).T)
            self._bins = widths.pop()
            self._offsets = np.arange(len(self._edges), dtype=np.intp) * self._bins
            self._expected = np.asarray(
                [fb.histogram.counts for fb in baseline.features], dtype=np.float64
            )
        self._directions = (
            projection_matrix(
                baseline.projection_seed, baseline.feature_count, baseline.projections
            )
            if baseline.projections and baseline.projection_seed is not None
            else None
        )
        self._classes = len(baseline.output.class_counts) if baseline.output else 0
        self._conf_edges = np.asarray(CONFIDENCE_EDGES, dtype=np.float64)
        self._reset()

    def _reset(self) -> None:
        self.samples = 0
        # Uniform bins: one [F, B] grid, taken as its rows; otherwise one array per feature.
        self._grid = np.zeros((len(self._edges), self._bins if self._uniform else 0), np.int64)
        self._features = (
            list(self._grid)
            if self._uniform
            else [np.zeros(len(e) - 1, dtype=np.int64) for e in self._edges]
        )
        self._class_counts = np.zeros(self._classes, dtype=np.int64)
        self._confidence = np.zeros(len(self._conf_edges) - 1, dtype=np.int64)

    def add(self, matrix: FloatArray, scores: FloatArray | None = None) -> None:
        """Count ``matrix`` ([N, feature_count] finite floats) and its ``scores``."""
        values = feature_values(
            matrix,
            mode=self.baseline.mode,
            projections=self.baseline.projections,
            directions=self._directions,
        )
        n = values.shape[0]
        if self._uniform:
            # A value's bin is how many inner edges it reaches: one pass per edge over [N, F],
            # counted in bytes (at most 255 inner edges).
            reached = np.zeros(values.shape, dtype=np.uint8)
            step = np.empty(values.shape, dtype=bool)
            for row in self._inner_rows:
                np.greater_equal(values, row, out=step)
                reached += step.view(np.uint8)
            idx = reached + self._offsets
            self._grid += np.bincount(idx.ravel(), minlength=self._grid.size).reshape(
                self._grid.shape
            )
        else:
            for i, edges in enumerate(self._edges):
                j = np.clip(
                    np.searchsorted(edges, values[:, i], side="right") - 1, 0, len(edges) - 2
                )
                self._features[i] += np.bincount(j, minlength=len(edges) - 1)
        if (
            scores is not None
            and self._classes
            and scores.ndim == 2
            and scores.shape == (n, self._classes)
        ):
            probs = as_probabilities(scores)
            self._class_counts += np.bincount(probs.argmax(axis=1), minlength=self._classes)
            conf = probs.max(axis=1)
            j = np.clip(np.searchsorted(self._conf_edges, conf, side="right") - 1, 0, 9)
            self._confidence += np.bincount(j, minlength=len(self._conf_edges) - 1)
        self.samples += n

    def take(self) -> tuple[int, dict[str, list[int]], list[int], list[int]]:
        """``(samples, features, class_counts, confidence_counts)`` since the last take."""
        result = (
            self.samples,
            dict(zip(self.names, [f.tolist() for f in self._features], strict=True)),
            self._class_counts.tolist() if self._class_counts.sum() else [],
            self._confidence.tolist() if self._confidence.sum() else [],
        )
        self._reset()
        return result

    def take_scored(
        self,
    ) -> tuple[tuple[int, dict[str, list[int]], list[int], list[int]], DriftScores]:
        """:meth:`take` and :func:`score_counts` of what it returns, scored on the binner's own
        arrays (no conversion of the baseline's counts for every window)."""
        if not self._uniform:
            counts = self.take()
            return counts, score_counts(
                self.baseline, counts[1], counts[2], counts[3], samples=counts[0]
            )
        per, gaps = _row_scores(self.names, self._expected, self._grid.astype(np.float64))
        counts = self.take()
        return counts, _scores(self.baseline, per, gaps, counts[2], counts[3], counts[0])


def confidences(scores: FloatArray) -> FloatArray:
    """The top probability of each row of ``scores`` (hard examples are the low ones)."""
    result: FloatArray = as_probabilities(scores).max(axis=1)
    return result
