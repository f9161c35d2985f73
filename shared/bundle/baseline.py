"""Drift baselines: statistics of sample inputs and of the model's answers, on fixed bins.

numpy only. The agent bins live traffic with :func:`bin_counts` on the edges stored here, so
baseline and live histograms are always comparable (PSI, chi²). Rules:

* Inputs are flattened per sample to ``F`` features (float64).
* ``F <= MAX_PER_FEATURE`` (64): mode ``per_feature``, one histogram per feature named
  ``f0``..``f{F-1}``.
* More features (images): mode ``summary``, histograms over per-sample summaries,
  ``sample_mean`` (brightness) and ``sample_std`` (contrast), then a random-projection sketch:
  ``p0``..``p{k-1}`` (``k`` = :data:`DEFAULT_PROJECTIONS`), each the dot product of the sample
  with one fixed random unit direction (:func:`projection_matrix`, drawn from
  ``projection_seed``, stored in the manifest). A shift that keeps mean and std (two pixels
  sideways, a mirrored image, a changed texture) moves these.
* :func:`feature_values` turns samples into exactly the values the baseline's histograms
  describe, one column per baseline feature: the bundle builder and the agent both use it.
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
DEFAULT_PROJECTIONS = 24
DEFAULT_PROJECTION_SEED = 20_261_201
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


def projection_matrix(seed: int, n_features: int, projections: int) -> FloatArray:
    """The sketch's directions: ``[n_features, projections]``, each column a unit vector drawn
    from a standard normal by ``numpy.random.Generator(PCG64(seed))`` (column-major draw order:
    ``standard_normal((projections, n_features)).T``), then divided by its norm. Deterministic
    for a seed on every platform numpy supports."""
    rng = np.random.Generator(np.random.PCG64(seed))
    m = rng.standard_normal((projections, n_features)).T
    norms = np.linalg.norm(m, axis=0, keepdims=True)
    result: FloatArray = m / np.where(norms == 0, 1.0, norms)
    return result


def feature_values(
    matrix: FloatArray,
    *,
    mode: str,
    projection_seed: int | None = None,
    projections: int = 0,
    directions: FloatArray | None = None,
) -> FloatArray:
    """The values a baseline's histograms describe, ``[N, n_baseline_features]``, from a
    ``[N, F]`` float64 matrix: the matrix itself (``per_feature``), or per sample its mean, its
    std and its ``projections`` sketch values (``summary``). ``directions``: a precomputed
    :func:`projection_matrix` (the agent keeps one per model version)."""
    if mode == "per_feature":
        return matrix
    columns = [matrix.mean(axis=1, keepdims=True), matrix.std(axis=1, keepdims=True)]
    if projections:
        if directions is None:
            if projection_seed is None:
                raise BaselineError("a projection sketch needs its seed")
            directions = projection_matrix(projection_seed, matrix.shape[1], projections)
        columns.append(matrix @ directions)
    return np.hstack(columns)


def input_features(
    matrix: FloatArray,
    bins: int = DEFAULT_BINS,
    *,
    projections: int = DEFAULT_PROJECTIONS,
    projection_seed: int = DEFAULT_PROJECTION_SEED,
) -> tuple[str, list[FeatureBaseline]]:
    """Per-feature or summary statistics of a ``[N, F]`` matrix; returns ``(mode, features)``.
    ``projections``/``projection_seed``: the sketch of summary mode (0: none)."""
    if not 1 <= bins <= 256:
        raise BaselineError("bins must be between 1 and 256")
    if not 0 <= projections <= 64:
        raise BaselineError("projections must be between 0 and 64")
    n_features = matrix.shape[1]
    if n_features <= MAX_PER_FEATURE:
        return "per_feature", [_feature(f"f{i}", matrix[:, i], bins) for i in range(n_features)]
    values = feature_values(
        matrix, mode="summary", projection_seed=projection_seed, projections=projections
    )
    names = ["sample_mean", "sample_std", *(f"p{i}" for i in range(projections))]
    return "summary", [_feature(n, values[:, i], bins) for i, n in enumerate(names)]


def as_probabilities(scores: FloatArray) -> FloatArray:
    """``[N, K]`` scores as probabilities: as they are when they already are, else softmax."""
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
    probs = as_probabilities(arr)
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
    projections: int = DEFAULT_PROJECTIONS,
    projection_seed: int = DEFAULT_PROJECTION_SEED,
) -> DriftBaseline:
    """The drift baseline of ``samples`` (and of the model's ``scores`` on them, if given).

    Raises :class:`BaselineError` when the samples or scores are unusable.
    """
    matrix = as_feature_matrix(samples)
    mode, features = input_features(
        matrix, bins, projections=projections, projection_seed=projection_seed
    )
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
        projection_seed=projection_seed if mode == "summary" and projections else None,
        projections=projections if mode == "summary" else 0,
    )
