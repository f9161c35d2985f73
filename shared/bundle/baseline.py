"""Drift baselines: statistics of sample inputs and of the model's answers, on fixed bins.

numpy only. The agent bins live traffic with :func:`bin_counts` on the edges stored here, so
baseline and live histograms are always comparable (PSI, chi²). Rules:

* Inputs are flattened per sample to ``F`` features (float64).
* ``F <= MAX_PER_FEATURE`` (64): mode ``per_feature``, one histogram per feature named
  ``f0``..``f{F-1}``.
* More features (images): mode ``summary``, two histograms over per-sample summaries,
  ``sample_mean`` (brightness) and ``sample_std`` (contrast).
* Each histogram has ``bins`` equal-width bins between the sample min and max of what it
  describes (widened by 0.5 either side when all values are equal); values outside the edges
  fall in the first or last bin.
* Output: from a ``[N, K]`` score output (``K >= 2``): counts of the arg-max class, and a
  histogram of the top score on the 10 bins 0.0, 0.1, ..., 1.0. Scores that are not
  probabilities (negative, or rows not summing to 1) get a softmax first.
"""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import numpy.typing as npt

from mcp_edge.shared.bundle.manifest import (
    DriftBaseline,
    FeatureBaseline,
    Histogram,
    OutputBaseline,
)

MAX_PER_FEATURE = 64
DEFAULT_BINS = 10
CONFIDENCE_EDGES: tuple[float, ...] = tuple(i / 10 for i in range(11))

FloatArray = npt.NDArray[np.float64]


class BaselineError(ValueError):
    """The samples cannot give a baseline (empty, not numeric, NaN/inf, wrong shape)."""


def bin_counts(values: npt.ArrayLike, edges: tuple[float, ...] | list[float]) -> list[int]:
    """Count ``values`` on the bins ``edges`` describes, clipping outliers into the end bins.

    Bin ``i`` holds ``edges[i] <= v < edges[i+1]``; the last bin also holds ``v == edges[-1]``.
    Returns ``len(edges) - 1`` counts.
    """
    e = np.asarray(edges, dtype=np.float64)
    v = np.asarray(values, dtype=np.float64).ravel()
    v = v[~np.isnan(v)]
    idx = np.searchsorted(e, v, side="right") - 1
    idx = np.clip(idx, 0, len(e) - 2)
    return [int(c) for c in np.bincount(idx, minlength=len(e) - 1)]


def _edges(values: FloatArray, bins: int) -> tuple[float, ...]:
    lo, hi = float(values.min()), float(values.max())
    if hi <= lo:
        lo, hi = lo - 0.5, hi + 0.5
    edges = [float(x) for x in np.linspace(lo, hi, bins + 1)]
    # 12 significant digits keep manifests readable (0.3, not 0.30000000000000004); keep the
    # exact edges in the rare case rounding would merge two of them.
    rounded = [float(f"{x:.12g}") for x in edges]
    if all(b > a for a, b in pairwise(rounded)):
        edges = rounded
    return tuple(edges)


def _feature(name: str, values: FloatArray, bins: int) -> FeatureBaseline:
    edges = _edges(values, bins)
    return FeatureBaseline(
        name=name,
        histogram=Histogram(edges=edges, counts=tuple(bin_counts(values, edges))),
        mean=float(values.mean()),
        std=float(values.std()),
        min=float(values.min()),
        max=float(values.max()),
    )


def as_feature_matrix(samples: npt.ArrayLike) -> FloatArray:
    """Samples ``[N, ...]`` as a finite float64 matrix ``[N, F]``; raises BaselineError."""
    arr = np.asarray(samples)
    if arr.dtype.kind not in "biuf":
        raise BaselineError(f"samples must be numeric, got dtype {arr.dtype}")
    if arr.ndim < 1 or arr.shape[0] == 0:
        raise BaselineError("samples must have at least one row (shape [N, ...])")
    matrix = arr.reshape(arr.shape[0], -1).astype(np.float64)
    if matrix.shape[1] == 0:
        raise BaselineError("samples have no features")
    if not np.isfinite(matrix).all():
        raise BaselineError("samples contain NaN or infinity")
    return matrix


def input_features(
    matrix: FloatArray, bins: int = DEFAULT_BINS
) -> tuple[str, list[FeatureBaseline]]:
    """Per-feature or summary statistics of a ``[N, F]`` matrix; returns ``(mode, features)``."""
    if not 1 <= bins <= 256:
        raise BaselineError("bins must be between 1 and 256")
    n_features = matrix.shape[1]
    if n_features <= MAX_PER_FEATURE:
        return "per_feature", [_feature(f"f{i}", matrix[:, i], bins) for i in range(n_features)]
    return "summary", [
        _feature("sample_mean", matrix.mean(axis=1), bins),
        _feature("sample_std", matrix.std(axis=1), bins),
    ]


def _as_probabilities(scores: FloatArray) -> FloatArray:
    rows_sum_to_one = np.allclose(scores.sum(axis=1), 1.0, atol=1e-3)
    if (scores >= 0).all() and (scores <= 1).all() and rows_sum_to_one:
        return scores
    shifted = scores - scores.max(axis=1, keepdims=True)
    exp = np.exp(shifted)
    result: FloatArray = exp / exp.sum(axis=1, keepdims=True)
    return result


def output_distribution(output_name: str, scores: npt.ArrayLike) -> OutputBaseline:
    """Class counts (arg-max) and top-score histogram of an ``[N, K]`` score array."""
    arr = np.asarray(scores, dtype=np.float64)
    if arr.ndim != 2 or arr.shape[1] < 2 or arr.shape[0] == 0:
        raise BaselineError(f"output {output_name!r}: expected scores of shape [N, K>=2]")
    if not np.isfinite(arr).all():
        raise BaselineError(f"output {output_name!r}: the model answered NaN or infinity")
    probs = _as_probabilities(arr)
    classes = np.bincount(probs.argmax(axis=1), minlength=probs.shape[1])
    confidence = probs.max(axis=1)
    return OutputBaseline(
        output=output_name,
        class_counts=tuple(int(c) for c in classes),
        confidence=Histogram(
            edges=CONFIDENCE_EDGES, counts=tuple(bin_counts(confidence, CONFIDENCE_EDGES))
        ),
    )


def compute_baseline(
    input_name: str,
    samples: npt.ArrayLike,
    *,
    output_name: str | None = None,
    scores: npt.ArrayLike | None = None,
    bins: int = DEFAULT_BINS,
) -> DriftBaseline:
    """The drift baseline of ``samples`` (and of the model's ``scores`` on them, if given).

    Raises :class:`BaselineError` when the samples or scores are unusable.
    """
    matrix = as_feature_matrix(samples)
    mode, features = input_features(matrix, bins)
    output = None
    if scores is not None:
        if output_name is None:
            raise BaselineError("scores given without the name of the output they came from")
        output = output_distribution(output_name, scores)
    return DriftBaseline(
        input=input_name,
        sample_count=int(matrix.shape[0]),
        mode="per_feature" if mode == "per_feature" else "summary",
        feature_count=int(matrix.shape[1]),
        features=tuple(features),
        output=output,
    )
