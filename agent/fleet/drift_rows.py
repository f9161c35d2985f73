"""The rows of a batch of sampled requests, ready to bin: one float64 matrix for the batch.

Part of :mod:`agent.fleet.drift` (off the request path). :func:`gather` stacks the input arrays
of the sampled requests of one model version into a ``[rows, feature_count]`` float64 matrix
and their score outputs into ``[rows, classes]``, in one ``numpy.concatenate`` when the requests
share a shape (the common case) and request by request otherwise. What cannot be binned is
left out and counted by reason: ``dtype`` (not numeric), ``shape`` (not ``feature_count``
values per row), ``not_finite`` (a NaN or infinity in the row). Scores that do not fit (missing,
another class count, not finite) only leave the row out of the class and confidence counts.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from mcp_edge.agent.runtime.runner import Array
from mcp_edge.shared.protocol.reports import InferenceRole

Item = tuple[InferenceRole, Array, Array | None]
"""One sampled request: the role it was answered in, its input, its score output (or None)."""

if TYPE_CHECKING:
    from mcp_edge.shared.bundle.manifest import DriftBaseline

_NUMERIC = frozenset("biuf")


@dataclass
class Rows:
    """The binnable rows of a batch, in request order."""

    matrix: Array
    """``[n, feature_count]`` float64, finite."""
    scores: Array
    """``[n, classes]`` float64; rows without usable scores are NaN."""
    has_scores: Array
    """``[n]`` bool: the row's scores are usable."""
    segments: list[tuple[int, int, InferenceRole]]
    """``(start, end, role)``: runs of rows answered in one role."""
    dropped: collections.Counter[str] = field(default_factory=collections.Counter)
    _inputs: list[Array] = field(default_factory=list)
    _outputs: list[Array | None] = field(default_factory=list)
    _counts: list[int] | None = None
    _finite: Array | None = None

    @property
    def _bounds(self) -> Array:
        if self._counts is None:
            self._counts = [int(x.shape[0]) for x in self._inputs]
        return _bounds(self._counts)

    def source_row(self, r: int) -> tuple[Array, Array | None, int]:
        """Row ``r`` as the request held it: ``(input, output or None, request index)``; the
        input keeps its dtype and has shape ``[1, ...]`` (or the request's own shape, for an
        input without a batch axis)."""
        bounds = self._bounds
        orig = r if self._finite is None else int(np.flatnonzero(self._finite)[r])
        j = int(np.searchsorted(bounds, orig, side="right") - 1)
        within = orig - int(bounds[j])
        count = int(bounds[j + 1] - bounds[j])
        x, y = self._inputs[j], self._outputs[j]
        if x.ndim >= 2 and x.shape[0] == count:
            x = x[within : within + 1]
        if y is not None:
            if y.ndim >= 2 and y.shape[0] == count:
                y = y[within : within + 1]
            elif count != 1:
                y = None
        return x, y, j


def _as_rows(x: Array, features: int) -> Array | None:
    if x.ndim >= 2 and math.prod(x.shape[1:]) == features:
        return x.reshape(x.shape[0], features)
    if x.size == features:
        return x.reshape(1, features)
    return None


def _bounds(counts: list[int]) -> Array:
    return np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])


def gather(items: list[Item], baseline: DriftBaseline) -> Rows:
    """The rows of ``items``, the sampled requests of one version, in order."""
    features = baseline.feature_count
    classes = len(baseline.output.class_counts) if baseline.output is not None else 0
    dropped: collections.Counter[str] = collections.Counter()
    xs: list[Array] = [it[1] for it in items]
    ys: list[Array | None] = [it[2] for it in items]
    roles: list[InferenceRole] = [it[0] for it in items]
    counts: list[int] | None = None
    try:
        stacked: Array | None = np.concatenate(xs) if len(xs) > 1 else xs[0]
    except ValueError:
        stacked = None
    if (
        stacked is not None
        and stacked.dtype.kind in _NUMERIC
        and stacked.ndim >= 2
        and math.prod(stacked.shape[1:]) == features
    ):
        matrix = stacked.reshape(stacked.shape[0], features)
        if stacked.shape[0] != len(xs):  # not one row per request
            counts = [int(x.shape[0]) for x in xs]
    else:  # request by request: mixed shapes, no batch axis, or some that do not fit
        views, keep = [], []
        counts = []
        for j, x in enumerate(xs):
            v = _as_rows(x, features) if x.dtype.kind in _NUMERIC else None
            if v is None:
                dropped["dtype" if x.dtype.kind not in _NUMERIC else "shape"] += 1
                continue
            views.append(v)
            keep.append(j)
            counts.append(int(v.shape[0]))
        xs = [xs[j] for j in keep]
        ys = [ys[j] for j in keep]
        roles = [roles[j] for j in keep]
        matrix = np.concatenate(views) if views else np.empty((0, features))
    matrix = np.asarray(matrix, dtype=np.float64)
    n = matrix.shape[0]
    scores = _scores(ys, counts, n, classes)
    has: Array = np.asarray(np.isfinite(scores).all(axis=1)) if classes else np.zeros(n, dtype=bool)
    finite = np.isfinite(matrix).all(axis=1)
    all_finite = bool(finite.all())
    if not all_finite:
        dropped["not_finite"] += int(n - finite.sum())
        matrix, scores, has = matrix[finite], scores[finite], has[finite]
    segments: list[tuple[int, int, InferenceRole]] = []
    if roles and roles.count(roles[0]) == len(roles):
        if matrix.shape[0]:
            segments.append((0, matrix.shape[0], roles[0]))
    elif roles:
        bounds = _bounds(counts if counts is not None else [1] * len(roles))
        kept_before = np.concatenate([[0], np.cumsum(finite, dtype=np.int64)])
        first = 0
        for j in range(1, len(roles) + 1):
            if j == len(roles) or roles[j] is not roles[first]:
                a, b = int(kept_before[bounds[first]]), int(kept_before[bounds[j]])
                if b > a:
                    segments.append((a, b, roles[first]))
                first = j
    rows = Rows(matrix, scores, has, segments, dropped, xs, ys)
    rows._counts = counts if counts is not None else [1] * len(xs)
    rows._finite = None if all_finite else finite
    return rows


def _scores(ys: list[Array | None], counts: list[int] | None, n: int, classes: int) -> Array:
    """``[n, classes]`` float64 scores; NaN rows where a request's output does not fit."""
    if not classes:
        return np.empty((n, 0))
    present = [y for y in ys if y is not None]
    if len(present) == len(ys) and present:
        try:
            stacked: Array | None = np.concatenate(present) if len(present) > 1 else present[0]
        except ValueError:
            stacked = None
        if (
            stacked is not None
            and stacked.dtype.kind in _NUMERIC
            and stacked.ndim == 2
            and stacked.shape == (n, classes)
        ):
            return np.asarray(stacked, dtype=np.float64)
    out = np.full((n, classes), np.nan)
    at = 0
    for y, c in zip(ys, counts if counts is not None else [1] * len(ys), strict=True):
        if y is not None and y.dtype.kind in _NUMERIC and y.size == c * classes:
            out[at : at + c] = y.reshape(c, classes)
        at += c
    return out


def chunks(items: list[Item], max_bytes: int) -> list[list[Item]]:
    """``items`` in runs whose inputs, as float64, stay under ``max_bytes`` (one item may
    exceed it alone)."""
    out: list[list[Item]] = [[]]
    size = 0
    for item in items:
        need = item[1].size * 8
        if out[-1] and size + need > max_bytes:
            out.append([])
            size = 0
        out[-1].append(item)
        size += need
    return out
