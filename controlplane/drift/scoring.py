"""A version's drift baseline as one flat vector, reports aligned to it, and their scores.

Every count a report carries has a place in :class:`Layout`'s flat vector: each feature's bins
in the baseline's order, then the class counts, then the confidence histogram. A batch of
reports of one version becomes a ``[reports, width]`` integer matrix; summing its rows is the
fleet aggregate (the counts, never the PSIs, are summed), and :func:`score_rows` gives every
row's PSI at once with the definitions of :mod:`shared.drift` (same smoothing, ``input_psi``
the mean of the features' PSIs, ``score`` the largest of input, class and confidence PSI).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from mcp_edge.controlplane.drift.sample import DriftSample
from mcp_edge.shared.bundle.manifest import DriftBaseline
from mcp_edge.shared.drift import SMOOTHING, DriftScores, score_counts

IntMatrix = npt.NDArray[np.int64]
FloatMatrix = npt.NDArray[np.float64]

TOP_FEATURES = 10
"""How many of the most drifted features a trigger's figures name."""


@dataclass(frozen=True)
class RowScores:
    """Scores of each row of a batch (NaN where a figure could not be computed)."""

    score: FloatMatrix
    input_psi: FloatMatrix
    class_psi: FloatMatrix
    confidence_psi: FloatMatrix


class Layout:
    """Where each count of ``baseline`` lives in a flat vector (see the module docstring)."""

    def __init__(self, baseline: DriftBaseline) -> None:
        self.baseline = baseline
        self.names = tuple(fb.name for fb in baseline.features)
        self.index = {n: i for i, n in enumerate(self.names)}
        self.bins = tuple(len(fb.histogram.counts) for fb in baseline.features)
        starts = np.concatenate([[0], np.cumsum(self.bins)]).astype(int)
        self.slices = tuple(slice(int(a), int(b)) for a, b in itertools.pairwise(starts))
        self.uniform = self.bins[0] if len(set(self.bins)) == 1 else None
        at = int(starts[-1])
        out = baseline.output
        self.classes = slice(at, at + (len(out.class_counts) if out else 0))
        at = self.classes.stop
        self.confidence = slice(at, at + (len(out.confidence.counts) if out else 0))
        self.width = self.confidence.stop
        parts: list[Sequence[int]] = [fb.histogram.counts for fb in baseline.features]
        if out is not None:
            parts += [out.class_counts, out.confidence.counts]
        self.expected = np.concatenate([np.asarray(p, dtype=np.float64) for p in parts])

    # ---------------------------------------------------------------- reports into the layout
    def misfit(self, sample: DriftSample) -> str | None:
        """Why ``sample``'s counts do not fit the baseline's bins (``unknown_feature`` or
        ``bins``, as :func:`shared.drift.fits` says), or None when they do."""
        m = sample.matrix
        if m is None or m.shape[1] != self.uniform or sample.names != self.names:
            for i, name in enumerate(sample.names):
                j = self.index.get(name)
                if j is None:
                    return "unknown_feature"
                if sample.feature(i).shape[0] != self.bins[j]:
                    return "bins"
        for part, counts in ((self.classes, sample.class_counts),
                             (self.confidence, sample.confidence_counts)):  # fmt: skip
            if counts.shape[0] and counts.shape[0] != part.stop - part.start:
                return "bins"
        return None

    def rows(self, samples: Sequence[DriftSample]) -> IntMatrix:
        """The counts of samples that fit (:meth:`misfit` is None) as a ``[n, width]`` matrix.
        Samples with the baseline's own features in its order (what agents send) are copied in
        one block. Callers pass a bounded chunk: fresh memory is what costs most here."""
        whole = self._whole(samples)
        if whole is not None:
            return whole
        rows = np.zeros((len(samples), self.width), dtype=np.int64)
        block: list[int] = []
        for i, s in enumerate(samples):
            m = s.matrix
            if m is not None and m.shape[1] == self.uniform and s.names == self.names:
                block.append(i)
            else:
                for k, name in enumerate(s.names):
                    rows[i, self.slices[self.index[name]]] = s.feature(k)
        if block:
            stacked = np.stack([samples[i].matrix for i in block])  # type: ignore[misc]
            rows[block, : self.slices[-1].stop] = stacked.reshape(len(block), -1)
        for part, attr in ((self.classes, "class_counts"), (self.confidence, "confidence_counts")):
            fit = [i for i, s in enumerate(samples) if getattr(s, attr).shape[0]]
            if fit:
                rows[fit, part] = np.stack([getattr(samples[i], attr) for i in fit])
        return rows

    def _whole(self, samples: Sequence[DriftSample]) -> IntMatrix | None:
        """:meth:`rows` in one concatenation when every sample has the baseline's features in
        its order and both output histograms (what agents send); None otherwise."""
        k, c = self.classes.stop - self.classes.start, self.confidence.stop - self.confidence.start
        parts: list[list[Any]] = [[], [], []]
        for s in samples:
            m = s.matrix
            if (
                m is None
                or m.shape[1] != self.uniform
                or s.names != self.names
                or s.class_counts.shape[0] != k
                or s.confidence_counts.shape[0] != c
            ):
                return None
            parts[0].append(m)
            parts[1].append(s.class_counts)
            parts[2].append(s.confidence_counts)
        if not samples or not self.names:
            return None
        n = len(samples)
        blocks = [np.stack(parts[0]).reshape(n, -1)]
        if k:
            blocks += [np.stack(parts[1]), np.stack(parts[2])]
        out: IntMatrix = np.concatenate(blocks, axis=1).astype(np.int64, copy=False)
        return out

    def align(self, samples: Sequence[DriftSample]) -> tuple[IntMatrix, dict[int, str]]:
        """:meth:`rows` of the samples that fit, and why the others do not (by index)."""
        refused = {i: r for i, s in enumerate(samples) if (r := self.misfit(s)) is not None}
        return self.rows([s for i, s in enumerate(samples) if i not in refused]), refused

    def to_document(self, row: IntMatrix) -> dict[str, Any]:
        """A flat vector as the ``counts`` JSON the database stores (features with no count
        left out)."""
        values = row.tolist()
        features = {
            n: values[s] for n, s in zip(self.names, self.slices, strict=True) if any(values[s])
        }
        return {
            "features": features,
            "classes": values[self.classes] if any(values[self.classes]) else [],
            "confidence": values[self.confidence] if any(values[self.confidence]) else [],
        }

    def zero(self) -> IntMatrix:
        """An empty flat vector."""
        return np.zeros(self.width, dtype=np.int64)

    def from_document(self, counts: Mapping[str, Any]) -> IntMatrix:
        """The flat vector of a stored ``counts`` document (what does not fit is left out)."""
        row = np.zeros(self.width, dtype=np.int64)
        features = counts.get("features")
        if isinstance(features, Mapping):
            for name, values in features.items():
                j = self.index.get(name)
                if j is not None and isinstance(values, list) and len(values) == self.bins[j]:
                    row[self.slices[j]] = values
        for key, part in (("classes", self.classes), ("confidence", self.confidence)):
            values = counts.get(key)
            if isinstance(values, list) and values and len(values) == part.stop - part.start:
                row[part] = values
        return row

    # ---------------------------------------------------------------- scores
    def score(self, row: IntMatrix, samples: int) -> DriftScores:
        """The full score of one flat vector (an aggregate): :func:`shared.drift.score_counts`."""
        document = self.to_document(row)
        return score_counts(
            self.baseline,
            document["features"],
            document["classes"],
            document["confidence"],
            samples=samples,
        )

    def score_rows(self, rows: IntMatrix) -> RowScores:
        """Every row's input, class and confidence PSI and its score, vectorised."""
        n = rows.shape[0]
        counts = rows.astype(np.float64)
        if self.uniform is not None and self.names:
            f, b = len(self.names), self.uniform
            live = counts[:, : f * b].reshape(n, f, b)
            per = _psi(self.expected[: f * b].reshape(f, b), live)
        else:
            per = np.stack(
                [_psi(self.expected[s][None, :], counts[:, s][:, None, :].copy())[:, 0]
                 for s in self.slices],
                axis=1,
            ) if self.names else np.full((n, 0), np.nan)  # fmt: skip
        known = ~np.isnan(per)
        with np.errstate(invalid="ignore"):
            input_psi = np.where(
                known.any(axis=1), np.nansum(per, axis=1) / np.maximum(known.sum(axis=1), 1), np.nan
            )
        class_psi = self._part(counts, self.classes)
        confidence_psi = self._part(counts, self.confidence)
        stacked = np.stack([input_psi, class_psi, confidence_psi], axis=1)
        has = ~np.isnan(stacked).all(axis=1)
        score = np.full(n, np.nan)
        score[has] = np.nanmax(stacked[has], axis=1)
        return RowScores(score, input_psi, class_psi, confidence_psi)

    def _part(self, counts: FloatMatrix, part: slice) -> FloatMatrix:
        if part.stop == part.start:
            return np.full(counts.shape[0], np.nan)
        return _psi(self.expected[part][None, :], counts[:, part][:, None, :].copy())[:, 0]


def _psi(expected: FloatMatrix, actual: FloatMatrix) -> FloatMatrix:
    """PSI of ``actual`` ``[n, f, b]`` against ``expected`` ``[f, b]`` per row and feature
    (:func:`shared.drift.psi`'s smoothing); NaN where either histogram is empty. ``actual`` is
    overwritten (the batch's matrix is large: no temporary copies of it)."""
    k = expected.shape[-1]
    e_total = expected.sum(axis=-1, keepdims=True)
    pe = (expected + SMOOTHING) / (e_total + SMOOTHING * k)
    a_total = actual.sum(axis=-1, keepdims=True)
    pa = actual
    pa += SMOOTHING
    pa /= a_total + SMOOTHING * k
    gap = pa - pe
    np.log(pa, out=pa)
    pa -= np.log(pe)
    gap *= pa
    out: FloatMatrix = gap.sum(axis=-1)
    empty = (a_total[..., 0] <= 0) | (e_total[None, ..., 0] <= 0)
    out[np.broadcast_to(empty, out.shape)] = np.nan
    return out


def figures(scores: DriftScores, top: int = TOP_FEATURES) -> dict[str, Any]:
    """What an aggregate or a trigger shows: the scores and the ``top`` most drifted
    features (``top_features``: ``[[name, psi], ...]``, largest first)."""
    out = scores.as_dict()
    ranked = sorted(
        ((n, v) for n, v in scores.features.items() if v is not None), key=lambda kv: -kv[1]
    )
    out["top_features"] = [[n, round(v, 6)] for n, v in ranked[:top]]
    return out


def nan_to_none(value: float) -> float | None:
    return None if np.isnan(value) else float(value)
