"""Drift on the control plane without a database: the report decoder against the schema, the
vectorised scores against shared.drift, PSI of the sum, and the rules (thresholds, minimum
devices and samples, sustained buckets, cooldown)."""

from __future__ import annotations

import copy
import itertools
import math
from typing import Any

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mcp_edge.controlplane.drift.rules import (
    Bucket,
    DriftRule,
    RuleError,
    bucket_start,
    cooled_down,
    sustained_over,
)
from mcp_edge.controlplane.drift.sample import decode_drift, from_report
from mcp_edge.controlplane.drift.scoring import Layout
from mcp_edge.shared.bundle.baseline import compute_baseline
from mcp_edge.shared.drift import psi, score_counts
from mcp_edge.shared.errors import MessageError
from mcp_edge.shared.protocol.telemetry import DriftReport

DEVICE = "dev-1"


@pytest.fixture(scope="module")
def baseline() -> Any:
    rng = np.random.default_rng(3)
    data = rng.normal(size=(2000, 8))
    scores = rng.dirichlet(np.ones(4), size=2000)
    return compute_baseline("x", data, output_name="p", scores=scores, bins=6)


def report(baseline: Any, samples: int = 50, seed: int = 0, shift: float = 0.0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    features = []
    for fb in baseline.features:
        p = np.asarray(fb.histogram.counts, dtype=np.float64) + 1.0
        p = np.roll(p, int(shift)) if shift else p
        counts = rng.multinomial(samples, p / p.sum())
        features.append({"name": fb.name, "counts": counts.tolist()})
    return {
        "device_id": DEVICE,
        "ts": 1000.0,
        "model": "m",
        "version": "1.0.0",
        "window_start": 900.0,
        "window_end": 1000.0,
        "samples": samples,
        "features": features,
        "class_counts": rng.multinomial(samples, [0.25] * 4).tolist(),
        "confidence_counts": rng.multinomial(samples, [0.1] * 10).tolist(),
    }


# ---------------------------------------------------------------------------- the decoder
def _schema(payload: bytes) -> DriftReport | None:
    try:
        return DriftReport.model_validate_json(payload)
    except ValueError:
        return None


def _mutations(doc: dict[str, Any], rng: np.random.Generator) -> list[dict[str, Any]]:
    """Each mutation of a valid report a device (or an attacker) might send."""
    out = []
    values: list[Any] = [-1, 1.5, 2.0, "3", True, None, [], {}, 2**63, 2**70, float("1e308"),
                         "x" * 129, "", 0]  # fmt: skip
    for _ in range(40):
        d = copy.deepcopy(doc)
        f = d["features"][int(rng.integers(len(d["features"])))]
        kind = int(rng.integers(9))
        if kind == 0:
            f["counts"][int(rng.integers(len(f["counts"])))] = values[
                int(rng.integers(len(values)))
            ]
        elif kind == 1:
            f["counts"].append(0)
        elif kind == 2:
            f["name"] = values[int(rng.integers(len(values)))]
        elif kind == 3:
            f["psi"] = values[int(rng.integers(len(values)))]
        elif kind == 4:
            f["ks"] = values[int(rng.integers(len(values)))]
        elif kind == 5:
            f["extra"] = 1
        elif kind == 6:
            d["features"].append(copy.deepcopy(f))
        elif kind == 7:
            d["samples"] = values[int(rng.integers(len(values)))]
        else:
            d["features"] = values[int(rng.integers(len(values)))]
        out.append(d)
    return out


def test_the_decoder_accepts_exactly_what_the_schema_accepts_with_the_same_counts(
    baseline: Any,
) -> None:
    rng = np.random.default_rng(7)
    docs = [report(baseline, seed=i) for i in range(5)]
    cases = [d for doc in docs for d in [doc, *_mutations(doc, rng)]]
    accepted = refused = 0
    for doc in cases:
        try:
            payload = orjson.dumps(doc)
        except TypeError:
            continue
        expected = _schema(payload)
        try:
            got = decode_drift(payload, DEVICE, 5.0)
        except MessageError:
            assert expected is None, doc
            refused += 1
            continue
        assert expected is not None, doc
        want = from_report(expected, 5.0)
        assert got.names == want.names
        assert got.feature_counts() == want.feature_counts()
        assert got.class_counts.tolist() == want.class_counts.tolist()
        assert (got.samples, got.window_end, got.role) == (want.samples, want.window_end, want.role)
        accepted += 1
    assert accepted > 10 and refused > 50


def test_the_decoder_refuses_another_devices_report_nan_and_negative_counts(
    baseline: Any,
) -> None:
    doc = report(baseline)
    with pytest.raises(MessageError, match="claims device"):
        decode_drift(orjson.dumps(doc), "dev-2", 0.0)
    nan = orjson.dumps(doc).replace(b'"window_start":900.0', b'"window_start":NaN')
    with pytest.raises(MessageError, match="not valid JSON"):
        decode_drift(nan, DEVICE, 0.0)
    doc["features"][0]["counts"][0] = -1
    doc["features"][0]["counts"][1] += 1
    with pytest.raises(MessageError, match="greater than or equal to 0"):
        decode_drift(orjson.dumps(doc), DEVICE, 0.0)


# ---------------------------------------------------------------------------- scores
def test_vectorised_scores_match_shared_drift_row_by_row(baseline: Any) -> None:
    layout = Layout(baseline)
    samples = [decode_drift(orjson.dumps(report(baseline, seed=i, shift=i % 3)), DEVICE, 0.0)
               for i in range(12)]  # fmt: skip
    rows, refused = layout.align(samples)
    assert refused == {}
    got = layout.score_rows(rows)
    for i, s in enumerate(samples):
        want = score_counts(baseline, s.feature_counts(), s.class_counts.tolist(),
                            s.confidence_counts.tolist(), samples=s.samples)  # fmt: skip
        assert got.input_psi[i] == pytest.approx(want.input_psi, rel=1e-9)
        assert got.class_psi[i] == pytest.approx(want.class_psi, rel=1e-9)
        assert got.confidence_psi[i] == pytest.approx(want.confidence_psi, rel=1e-9)
        assert got.score[i] == pytest.approx(want.score, rel=1e-9)


def test_the_fleet_figure_is_the_psi_of_the_summed_counts_never_the_mean_psi(
    baseline: Any,
) -> None:
    layout = Layout(baseline)
    samples = [decode_drift(orjson.dumps(report(baseline, samples=40, seed=i)), DEVICE, 0.0)
               for i in range(20)]  # fmt: skip
    rows, _ = layout.align(samples)
    total = rows.sum(axis=0)
    fleet = layout.score(total, sum(s.samples for s in samples))
    mean_of_psis = float(np.mean(layout.score_rows(rows).input_psi))
    f0 = layout.slices[0]
    assert fleet.features["f0"] == pytest.approx(
        psi(baseline.features[0].histogram.counts, total[f0].tolist())
    )
    # Sampling noise in small windows inflates each device's PSI; the sum's PSI does not
    # carry it: in-distribution devices sum to a small fleet figure.
    assert fleet.input_psi is not None and fleet.input_psi < mean_of_psis / 3


def test_counts_that_do_not_fit_the_bins_are_refused_with_their_reason(baseline: Any) -> None:
    layout = Layout(baseline)
    good = report(baseline)
    wrong_bins = copy.deepcopy(good)
    wrong_bins["features"][0]["counts"] = [*wrong_bins["features"][0]["counts"], 0]
    unknown = copy.deepcopy(good)
    unknown["features"][1]["name"] = "not-a-feature"
    classes = copy.deepcopy(good)
    classes["class_counts"] = [good["samples"], 0]
    samples = [decode_drift(orjson.dumps(d), DEVICE, 0.0) for d in (good, wrong_bins, unknown,
                                                                     classes)]  # fmt: skip
    rows, refused = layout.align(samples)
    assert refused == {1: "bins", 2: "unknown_feature", 3: "bins"}
    assert rows[0].sum() == good["samples"] * (len(baseline.features) + 2)


# ---------------------------------------------------------------------------- rules
def test_a_bucket_is_over_only_above_the_threshold_with_enough_samples_and_devices() -> None:
    rule = DriftRule(threshold=0.2, min_devices=3, min_samples=500, metric="score")
    over = {"score": 0.25, "input_psi": 0.1}
    assert rule.bucket_over(over, samples=500, devices=3)
    assert not rule.bucket_over({"score": 0.2}, samples=500, devices=3)  # not above
    assert not rule.bucket_over(over, samples=499, devices=3)
    assert not rule.bucket_over(over, samples=500, devices=2)
    assert not rule.bucket_over({"score": None}, samples=500, devices=3)
    assert not DriftRule(metric="input_psi").bucket_over(over, samples=500, devices=3)
    assert DriftRule().metric == "input_psi"  # the default: no false alarms on held-out data


def test_sustained_means_the_newest_buckets_one_after_the_other_all_over() -> None:
    rule = DriftRule(sustained=3, window_s=60)
    buckets = [Bucket(180.0, True), Bucket(120.0, True), Bucket(60.0, True)]
    assert sustained_over(rule, buckets, 180.0)
    assert not sustained_over(rule, buckets[:2], 180.0)  # only two
    assert not sustained_over(rule, [Bucket(180.0, True), Bucket(120.0, False),
                                     Bucket(60.0, True)], 180.0)  # fmt: skip
    # A gap (no reports at all in a bucket) breaks the run.
    assert not sustained_over(rule, [Bucket(240.0, True), *buckets[1:]], 240.0)
    assert sustained_over(DriftRule(sustained=1, window_s=60), [Bucket(60.0, True)], 60.0)


def test_cooldown_allows_one_trigger_per_period() -> None:
    rule = DriftRule(cooldown_s=3600)
    assert cooled_down(rule, None, 100.0)
    assert not cooled_down(rule, 100.0, 3699.0)
    assert cooled_down(rule, 100.0, 3700.0)


def test_buckets_follow_the_rule_window() -> None:
    assert bucket_start(1234.5, 300) == 1200.0
    assert bucket_start(1200.0, 300) == 1200.0


@pytest.mark.parametrize(
    "bad",
    [
        {"threshold": 0.0},
        {"threshold": math.inf},
        {"metric": "psi"},
        {"min_devices": 0},
        {"sustained": 0},
        {"window_s": 1},
        {"cooldown_s": -1},
    ],
)
def test_rules_out_of_bounds_are_refused(bad: dict[str, Any]) -> None:
    with pytest.raises(RuleError):
        DriftRule(**bad)


@settings(max_examples=60, deadline=None)
@given(
    overs=st.lists(st.booleans(), min_size=1, max_size=12),
    sustained=st.integers(1, 4),
)
def test_a_run_of_buckets_raises_at_most_one_trigger_per_cooldown(
    overs: list[bool], sustained: int
) -> None:
    """Walk buckets through the rule like the store does: a trigger only at the end of a run
    of ``sustained`` buckets over, and never twice within the cooldown."""
    rule = DriftRule(sustained=sustained, window_s=60, cooldown_s=600)
    raised: list[float] = []
    seen: list[Bucket] = []
    for i, over in enumerate(overs):
        start = i * 60.0
        seen.insert(0, Bucket(start, over))
        last = raised[-1] if raised else None
        if sustained_over(rule, seen, start) and cooled_down(rule, last, start):
            raised.append(start)
    for a, b in itertools.pairwise(raised):
        assert b - a >= 600
    run = 0
    for over in overs:
        run = run + 1 if over else 0
        if run >= sustained:
            assert raised
            break
    else:
        assert raised == []
