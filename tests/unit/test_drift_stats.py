"""The drift statistics both ends share (shared/drift.py) and the baseline's projection sketch."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.datasets import load_digits

from mcp_edge.shared.bundle.baseline import (
    bin_counts,
    compute_baseline,
    feature_values,
    projection_matrix,
)
from mcp_edge.shared.bundle.manifest import DriftBaseline
from mcp_edge.shared.drift import Binner, fits, ks, psi, score_counts


def _images() -> tuple[np.ndarray, np.ndarray]:
    """Digits upscaled to 16x16 (256 features: summary mode), split in two halves."""
    x = load_digits().data.reshape(-1, 8, 8)
    big = np.kron(x, np.ones((2, 2))).reshape(len(x), -1)
    rng = np.random.default_rng(7)
    order = rng.permutation(len(big))
    return big[order[:900]], big[order[900:]]


def test_psi_is_zero_for_equal_shares_and_grows_with_the_shift() -> None:
    base = [100, 200, 300, 400]
    assert psi(base, [10, 20, 30, 40]) == pytest.approx(0.0, abs=1e-3)
    small = psi(base, [120, 200, 300, 380])
    large = psi(base, [400, 300, 200, 100])
    assert small is not None and large is not None and 0 < small < large
    assert psi(base, [0, 0, 0, 0]) is None
    with pytest.raises(ValueError):
        psi(base, [1, 2, 3])


def test_ks_is_the_largest_gap_between_cumulative_shares() -> None:
    assert ks([1, 1], [1, 1]) == 0.0
    assert ks([1, 0], [0, 1]) == pytest.approx(1.0)
    assert ks([2, 1, 1], [1, 1, 2]) == pytest.approx(0.25)


def test_binner_counts_exactly_as_the_baseline_bin_rule() -> None:
    x = load_digits().data
    b = compute_baseline("x", x[:500])
    binner = Binner(b)
    live = np.vstack([x[500:700], np.full((1, 64), -99.0), np.full((1, 64), 99.0)])
    binner.add(live)
    samples, features, classes, confidence = binner.take()
    assert samples == 202 and classes == [] and confidence == []
    for fb in b.features:
        column = live[:, int(fb.name[1:])]
        assert features[fb.name] == bin_counts(column, fb.histogram.edges), fb.name
    assert binner.take()[0] == 0  # take starts a new window


def test_projection_directions_are_fixed_by_the_seed() -> None:
    a = projection_matrix(5, 100, 8)
    assert a.shape == (100, 8)
    np.testing.assert_array_equal(a, projection_matrix(5, 100, 8))
    assert not np.array_equal(a, projection_matrix(6, 100, 8))
    np.testing.assert_allclose(np.linalg.norm(a, axis=0), 1.0)


def test_the_sketch_sees_a_two_pixel_shift_that_mean_and_std_miss() -> None:
    base, held = _images()
    b = compute_baseline("image", base)
    assert b.mode == "summary" and b.projections == 24
    assert DriftBaseline.model_validate_json(b.model_dump_json()) == b  # survives the manifest
    shifted = np.roll(held.reshape(-1, 16, 16), 4, axis=2).reshape(len(held), -1)

    def scores(samples: np.ndarray) -> tuple[float, float]:
        binner = Binner(b)
        binner.add(samples[:200])
        n, features, _, _ = binner.take()
        s = score_counts(b, features, samples=n)
        summaries = [s.features["sample_mean"], s.features["sample_std"]]
        sketch = [v for k, v in s.features.items() if k.startswith("p") and v is not None]
        return max(v for v in summaries if v is not None), float(np.mean(sketch))

    held_summary, held_sketch = scores(held)
    shifted_summary, shifted_sketch = scores(shifted)
    # np.roll keeps every pixel value: mean and std of each image are unchanged ...
    assert shifted_summary == pytest.approx(held_summary, abs=1e-9)
    # ... while the sketch moves far beyond what held-out data gives.
    assert shifted_sketch > 0.2 > held_sketch, (held_sketch, shifted_sketch)


def test_feature_values_of_the_builder_and_the_agent_agree() -> None:
    base, held = _images()
    b = compute_baseline("image", base)
    directions = projection_matrix(b.projection_seed or 0, b.feature_count, b.projections)
    ours = feature_values(held, mode=b.mode, projections=b.projections, directions=directions)
    theirs = feature_values(
        held, mode=b.mode, projection_seed=b.projection_seed, projections=b.projections
    )
    np.testing.assert_array_equal(ours, theirs)
    assert ours.shape == (len(held), 26)


def test_fits_names_why_counts_do_not_fit_the_baseline() -> None:
    x = load_digits().data
    b = compute_baseline(
        "x", x[:300], output_name="p", scores=np.eye(10)[x[:300, 0].astype(int) % 10]
    )
    ok = {"f0": [1] * 10}
    assert fits(b, ok, [1] * 10, [1] * 10) is None
    assert fits(b, {"f0": [1] * 9}, [], []) == "bins"
    assert fits(b, {"nope": [1] * 10}, [], []) == "unknown_feature"
    assert fits(b, ok, [1] * 3, []) == "bins"
