"""The agent's drift tracker and hard-example reservoir, with a fake publisher.

The tracker's core runs without an event loop here: ``observe`` (the request path), then
``drain`` / ``expire`` / ``flush`` with an injected clock, exactly what its timers call. The
counts it reports are compared with the shared binner run on the rows it should have sampled.
"""

from __future__ import annotations

import asyncio
import base64
import logging
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mcp_edge.agent.fleet.drift import DriftTracker
from mcp_edge.agent.fleet.drift_report import DriftWindowReport
from mcp_edge.agent.fleet.hard_examples import Example, HardExampleReservoir, RawTensor
from mcp_edge.agent.fleet.session import FleetConfig, FleetSession
from mcp_edge.agent.fleet.spool import Spool
from mcp_edge.agent.runtime.loader import load_runner
from mcp_edge.agent.runtime.manager import ModelManager, ModelSource
from mcp_edge.agent.serving.metrics import AgentMetrics
from mcp_edge.agent.serving.model_dir import bundle_source
from mcp_edge.shared.bundle import build_bundle, open_bundle
from mcp_edge.shared.bundle.baseline import compute_baseline
from mcp_edge.shared.bundle.manifest import DriftBaseline
from mcp_edge.shared.drift import Binner
from mcp_edge.shared.errors import MessageError
from mcp_edge.shared.profiles import load_profiles
from mcp_edge.shared.protocol import decode
from mcp_edge.shared.protocol.command import CommandRequest
from mcp_edge.shared.protocol.reports import InferenceRole, encode_report
from mcp_edge.shared.protocol.state import DriftPolicy
from mcp_edge.shared.protocol.telemetry import DriftReport, HardExampleBatch
from mcp_edge.shared.protocol.wire import CommandName
from mcp_edge.tooling.models import DigitsModels

STABLE, CANARY = InferenceRole.STABLE, InferenceRole.CANARY
RNG = np.random.default_rng(7)
TRAIN = RNG.normal(size=(500, 4)).astype(np.float32)


def softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(axis=1, keepdims=True))
    out: np.ndarray = (e / e.sum(axis=1, keepdims=True)).astype(np.float32)
    return out


@pytest.fixture(scope="module")
def baseline() -> DriftBaseline:
    scores = softmax(TRAIN[:, :3] * 2)
    return compute_baseline("x", TRAIN, output_name="y", scores=scores)


@pytest.fixture
def source(baseline: DriftBaseline) -> ModelSource:
    return ModelSource("m", "1.0.0", Path("m.onnx"), drift_baseline=baseline)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Sent:
    """The fake session: what ``publish_drift`` was given."""

    def __init__(self) -> None:
        self.reports: list[DriftWindowReport] = []
        self._changed = asyncio.Condition()

    async def __call__(self, report: DriftWindowReport) -> None:
        async with self._changed:
            self.reports.append(report)
            self._changed.notify_all()

    async def until(self, n: int, timeout_s: float = 10.0) -> None:
        async with self._changed:
            await asyncio.wait_for(self._changed.wait_for(lambda: len(self.reports) >= n),
                                   timeout_s)  # fmt: skip


def tracker(**policy: Any) -> tuple[DriftTracker, Clock]:
    clock = Clock()
    t = DriftTracker("dev-1", Sent(), policy=DriftPolicy(**policy), clock=clock,
                     metrics=AgentMetrics())  # fmt: skip
    return t, clock


def request(row: np.ndarray) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    x = np.asarray(row, dtype=np.float32).reshape(1, -1)
    return {"x": x}, {"y": softmax(x[:, :3] * 2)}


def expected_counts(baseline: DriftBaseline, rows: np.ndarray) -> dict[str, list[int]]:
    b = Binner(baseline)
    b.add(rows.astype(np.float64), softmax(rows[:, :3] * 2).astype(np.float64))
    return b.take()[1]


def counts_of(report: DriftWindowReport) -> dict[str, list[int]]:
    return {f["name"]: list(f["counts"]) for f in report.features}


# ------------------------------------------------------------------------------ sampling, windows
def test_one_in_n_answered_requests_is_binned_and_windows_close_at_window_requests(
    source: ModelSource, baseline: DriftBaseline
) -> None:
    t, _ = tracker(window_requests=10, sample_every=3)
    live = RNG.normal(size=(65, 4)).astype(np.float32)
    for row in live:
        t.observe(source, STABLE, *request(row))
    reports = t.drain()

    # 65 answered, every third sampled: 21 samples, two full windows of 10 and one open.
    assert [r.samples for r in reports] == [10, 10]
    assert all(r.sample_every == 3 and r.role is STABLE for r in reports)
    sampled = live[2::3]
    assert counts_of(reports[0]) == expected_counts(baseline, sampled[:10])
    assert counts_of(reports[1]) == expected_counts(baseline, sampled[10:20])
    assert sum(reports[0].class_counts) == sum(reports[0].confidence_counts) == 10
    # What goes on the wire is what the control plane's schema reads, byte for byte.
    for r in reports:
        wire = encode_report(r)
        assert encode_report(decode(wire, DriftReport)) == wire
    assert reports[0].input_psi is not None and reports[0].class_psi is not None
    assert all("psi" in f and "ks" in f for f in reports[0].features)
    # The one left over goes out when the window is closed.
    rest = t.flush()
    assert [r.samples for r in rest] == [1]
    assert counts_of(rest[0]) == expected_counts(baseline, sampled[20:21])


def test_a_window_closes_after_window_s_and_an_empty_window_sends_nothing(
    source: ModelSource,
) -> None:
    t, clock = tracker(window_requests=200, window_s=5.0)
    for row in RNG.normal(size=(7, 4)):
        t.observe(source, STABLE, *request(row))
    assert t.drain() == []
    clock.t += 4.9
    assert t.expire() == []
    clock.t += 0.1
    (report,) = t.expire()
    assert report.samples == 7
    assert (report.window_start, report.window_end) == (1000.0, 1005.0)
    clock.t += 60
    assert t.expire() == [] and t.flush() == []


def test_shifted_inputs_score_far_higher_than_in_distribution_ones(source: ModelSource) -> None:
    t, _ = tracker(window_requests=200)
    for row in RNG.normal(size=(200, 4)):
        t.observe(source, STABLE, *request(row))
    for row in RNG.normal(size=(200, 4)) + 1.5:
        t.observe(source, STABLE, *request(row))
    same, shifted = t.drain()
    assert same.input_psi is not None and shifted.input_psi is not None
    assert same.input_psi < 0.1 < 0.5 < shifted.input_psi


def test_a_window_holds_one_role(source: ModelSource) -> None:
    t, _ = tracker(window_requests=100)
    for i, row in enumerate(RNG.normal(size=(12, 4))):
        t.observe(source, STABLE if i < 5 else CANARY, *request(row))
    reports = t.drain() + t.flush()
    assert [(r.role, r.samples) for r in reports] == [(STABLE, 5), (CANARY, 7)]


def test_the_buffer_is_bounded_and_what_does_not_fit_is_counted(source: ModelSource) -> None:
    t, _ = tracker(window_requests=10)
    t.max_pending = 5
    for row in RNG.normal(size=(8, 4)):
        t.observe(source, STABLE, *request(row))
    assert t.dropped["buffer_full"] == 3
    assert t.metrics is not None
    assert t.metrics.drift_dropped.labels("m", "buffer_full").value == 3
    t.drain()
    (report,) = t.flush()
    assert report.samples == 5
    assert t.metrics.drift_samples.labels("m").value == 5


def test_rows_that_cannot_be_binned_are_skipped_and_counted(
    source: ModelSource, baseline: DriftBaseline
) -> None:
    t, _ = tracker(window_requests=100)
    good = RNG.normal(size=(4, 4)).astype(np.float32)
    nan_row = good[0].copy()
    nan_row[1] = np.nan
    batch = np.stack([good[1], nan_row, good[2]])  # one request of three rows, one bad
    feeds: list[dict[str, np.ndarray]] = [
        {"x": good[:1]},
        {"x": batch},
        {"x": np.full((1, 4), np.inf, np.float32)},
        {"x": np.zeros((1, 5), np.float32)},  # five features, the baseline has four
        {"x": np.array([["a", "b", "c", "d"]])},
        {"other": good[:1]},  # no input of the baseline's name
        {"x": good[3]},  # no batch axis: one sample of four features
    ]
    for f in feeds:
        t.observe(source, STABLE, f, {"y": np.zeros((3, 7), np.float32)})  # scores don't fit
    t.drain()
    (report,) = t.flush()
    kept = np.stack([good[0], good[1], good[2], good[3]])
    assert report.samples == 4
    b = Binner(baseline)
    b.add(kept.astype(np.float64))
    assert counts_of(report) == b.take()[1]
    assert report.class_counts == [] and report.confidence_counts == []
    assert dict(t.dropped) == {"not_finite": 2, "shape": 1, "dtype": 1, "no_input": 1}


def test_versions_without_a_baseline_are_not_tracked_and_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    t, _ = tracker()
    plain = ModelSource("plain", "1", Path("plain.onnx"))
    with caplog.at_level(logging.INFO, "mcp.agent.drift"):
        for row in RNG.normal(size=(50, 4)):
            t.observe(plain, STABLE, *request(row))
    assert t.flush() == [] and t.samples == 0
    assert sum("plain 1" in r.getMessage() for r in caplog.records) == 1


async def test_policy_changes_apply_to_the_open_windows_and_off_stops_measuring(
    source: ModelSource,
) -> None:
    sent = Sent()
    t = DriftTracker("dev-1", sent, policy=DriftPolicy(window_requests=100))
    for row in RNG.normal(size=(6, 4)):
        t.observe(source, STABLE, *request(row))
    t.drain()
    t.apply_policy(DriftPolicy(window_requests=10))  # the open window now closes at 10
    for row in RNG.normal(size=(5, 4)):
        t.observe(source, STABLE, *request(row))
    assert [r.samples for r in t.drain()] == [10]
    t.apply_policy(DriftPolicy(window_requests=10, sample_every=2))  # closes the window of 1
    for row in RNG.normal(size=(6, 4)):
        t.observe(source, STABLE, *request(row))
    t.apply_policy(DriftPolicy(enabled=False))  # closes the window of 3
    for row in RNG.normal(size=(6, 4)):
        t.observe(source, STABLE, *request(row))
    await t.close()
    assert [(r.samples, r.sample_every) for r in sent.reports] == [(1, 1), (3, 2)]
    assert t.samples == 14


async def test_the_running_tracker_bins_off_the_request_path_and_publishes(
    source: ModelSource,
) -> None:
    sent = Sent()
    t = DriftTracker("dev-1", sent, policy=DriftPolicy(window_requests=10), drain_delay_s=0.001)
    await t.start()
    try:
        for row in RNG.normal(size=(25, 4)):
            t.observe(source, STABLE, *request(row))
        assert t.samples == 0  # nothing binned inside observe
        await sent.until(2)
        assert t.samples == 25
    finally:
        await t.close()
    assert [r.samples for r in sent.reports] == [10, 10, 5]  # the open window sent at close


# ------------------------------------------------------------------------------ hard examples
def example(model: str, n: int, ts: float, version: str = "1.0.0") -> Example:
    data = bytes([int(ts) % 256]) * n
    return Example(model, version, ts, 0.3, 1, RawTensor("x", "UINT8", (1, n), data), None)


def test_the_reservoir_keeps_the_newest_within_its_budget() -> None:
    r = HardExampleReservoir(100)
    for ts in range(1, 4):
        assert r.add(example("m", 40, ts))
    assert [e.ts for e in r] == [2, 3] and r.bytes == 80 and r.evicted == 1
    assert not r.add(example("m", 101, 9))  # larger than the whole budget
    assert r.refused == 1
    r.budget_bytes = 50
    assert [e.ts for e in r] == [3]
    assert r.held("m") == 1 and r.held("m", "1.0.0") == 1 and r.held("other") == 0
    r.budget_bytes = 0
    assert len(r) == 0 and r.bytes == 0


def command(**args: Any) -> CommandRequest:
    now = datetime.now(timezone.utc)
    return CommandRequest(command_id="a" * 32, name=CommandName.UPLOAD_HARD_EXAMPLES,
                          args=args, issued_at=now, expires=now + timedelta(minutes=1))  # fmt: skip


async def test_low_confidence_inputs_upload_within_max_bytes_byte_for_byte(
    source: ModelSource,
) -> None:
    t, _ = tracker(hard_examples=True, hard_example_max_confidence=0.5,
                   hard_example_budget_bytes=10_000)  # fmt: skip
    sent_rows = []
    for i in range(20):
        x = RNG.normal(size=(1, 4)).astype(np.float32)
        hard = i % 2 == 0
        scores = np.array([[0.4, 0.35, 0.25]] if hard else [[0.9, 0.05, 0.05]], np.float32)
        t.observe(source, STABLE, {"x": x}, {"y": scores})
        if hard:
            sent_rows.append((x, scores))
    # 10 hard examples of 16 input + 12 output bytes: 28 bytes each.
    first = HardExampleBatch.model_validate(await t.upload_hard_examples(command(model="m",
                                                                          max_bytes=100)))  # fmt: skip
    assert len(first.examples) == 3 and first.bytes == 84 <= 100 and first.held == 7
    rest = HardExampleBatch.model_validate(await t.upload_hard_examples(command(model="m")))
    assert len(rest.examples) == 7 and rest.held == 0
    got = first.examples + rest.examples
    for ex, (x, scores) in zip(got, sent_rows, strict=True):
        assert (ex.model, ex.version, ex.predicted) == ("m", "1.0.0", 0)
        assert ex.confidence == pytest.approx(0.4)
        assert ex.input.datatype == "FP32" and ex.input.shape == [1, 4]
        assert base64.b64decode(ex.input.data_b64) == x.tobytes()
        assert ex.output is not None and base64.b64decode(ex.output.data_b64) == scores.tobytes()
    empty = HardExampleBatch.model_validate(await t.upload_hard_examples(command(model="m")))
    assert empty.examples == [] and empty.bytes == 0
    # The reports say how many are held.
    t.observe(source, STABLE, {"x": sent_rows[0][0]}, {"y": sent_rows[0][1]})
    (report,) = t.flush()
    assert report.hard_examples == 1


async def test_upload_arguments_are_checked_and_max_bytes_is_capped_by_the_budget(
    source: ModelSource,
) -> None:
    t, _ = tracker(hard_examples=True, hard_example_budget_bytes=60)
    for _ in range(5):
        t.observe(source, STABLE, {"x": np.zeros((1, 4), np.uint8)},
                  {"y": np.array([[0.34, 0.33, 0.33]], np.float32)})  # fmt: skip
    batch = HardExampleBatch.model_validate(
        await t.upload_hard_examples(command(model="m", version="1.0.0", max_bytes=10**6))
    )
    assert batch.bytes <= 60 and len(batch.examples) == 3  # 16 bytes each; 60 held at most
    assert batch.examples[0].input.datatype == "UINT8"
    for bad in ({}, {"model": 3}, {"model": "a/b"}, {"model": "m", "max_bytes": -1},
                {"model": "m", "max_bytes": True}, {"model": "m", "extra": 1}):  # fmt: skip
        with pytest.raises(MessageError):
            await t.upload_hard_examples(command(**bad))


async def test_of_one_batch_the_newest_hard_examples_that_fit_are_kept(
    source: ModelSource,
) -> None:
    t, _ = tracker(hard_examples=True, hard_example_max_confidence=1.0,
                   hard_example_budget_bytes=3 * 28)  # fmt: skip
    rows = [np.full((1, 4), i, np.float32) for i in range(10)]
    for x in rows:
        t.observe(source, STABLE, {"x": x}, {"y": np.array([[0.5, 0.3, 0.2]], np.float32)})
    t.drain()  # one batch of ten, three fit
    batch = HardExampleBatch.model_validate(await t.upload_hard_examples(command(model="m")))
    assert [base64.b64decode(e.input.data_b64) for e in batch.examples] == [
        x.tobytes() for x in rows[-3:]
    ]


async def test_hard_examples_off_keeps_nothing(source: ModelSource) -> None:
    t, _ = tracker(hard_examples=False)
    t.observe(source, STABLE, {"x": np.zeros((1, 4), np.float32)},
              {"y": np.array([[0.34, 0.33, 0.33]], np.float32)})  # fmt: skip
    batch = HardExampleBatch.model_validate(await t.upload_hard_examples(command(model="m")))
    assert batch.examples == [] and len(t.reservoir) == 0


# ------------------------------------------------------------------------------ wiring
PROFILE = load_profiles()["generic-x86_64"]


async def test_a_bundle_with_a_baseline_is_measured_through_the_model_manager(
    tmp_path: Path, digits: DigitsModels
) -> None:
    np.save(tmp_path / "samples.npy", digits.mlp.X_train)
    build_bundle(digits.onnx_path, tmp_path / "d.mcpb", name="digits", version="1.0.0",
                 baseline_npy=tmp_path / "samples.npy")  # fmt: skip
    opened = open_bundle(tmp_path / "d.mcpb", tmp_path / "open", [], require_signature=False)
    src = bundle_source(opened.manifest, opened.root, "default")
    assert src.drift_baseline is not None
    sent = Sent()
    t = DriftTracker("dev-1", sent, policy=DriftPolicy(window_requests=10))
    manager = ModelManager(lambda s: [load_runner(s.model_path, PROFILE, threads=1)], drift=t)
    await manager.load(src)
    try:
        lv = manager.route("digits")
        for row in digits.X_test[:12]:
            await manager.infer(lv, {"input": row[None]}, counted=True)
        await manager.infer(lv, {"input": digits.X_test[:1]})  # an internal probe: not counted
    finally:
        await manager.close()
    (report,) = t.drain()
    assert (report.model, report.version, report.samples) == ("digits", "1.0.0", 10)
    assert sum(report.class_counts) == 10
    assert [r.samples for r in t.flush()] == [2]


def test_the_session_applies_the_desired_states_drift_policy(tmp_path: Path) -> None:
    config = FleetConfig(device_id="dev-policy")
    session = FleetSession(config, spool=Spool(tmp_path / "spool"))
    assert session.drift.policy is None  # the defaults, resolved with the first baseline
    doc = {"telemetry": {"drift": {"window_requests": 50, "sample_every": 4}}}
    session.apply_telemetry_policy({"signed": doc})
    assert session.drift.policy == DriftPolicy(window_requests=50, sample_every=4)
    session.apply_telemetry_policy({"signed": {"telemetry": {"drift": {"window_requests": 1}}}})
    session.apply_telemetry_policy({"signed": {"telemetry": {"inference_interval_s": 5}}})
    assert session.drift.policy == DriftPolicy(window_requests=50, sample_every=4)
    assert session.inference_interval_s == 5
    assert CommandName.UPLOAD_HARD_EXAMPLES in session.control.commands


def test_window_scores_are_the_psi_and_ks_of_each_feature(baseline: DriftBaseline) -> None:
    from mcp_edge.shared.drift import ks, psi, score_counts

    b = Binner(baseline)
    b.add(RNG.normal(size=(300, 4)) * 1.3 + 0.2)
    samples, features, _, _ = b.take()
    scores = score_counts(baseline, features, samples=samples)
    for fb in baseline.features:
        assert scores.features[fb.name] == pytest.approx(psi(fb.histogram.counts,
                                                             features[fb.name]), rel=1e-12)  # fmt: skip
        assert scores.ks[fb.name] == pytest.approx(ks(fb.histogram.counts, features[fb.name]))
    b.add(RNG.normal(size=(300, 4)) * 1.3 + 0.2, softmax(RNG.normal(size=(300, 3))) * 1.0)
    counts, own = b.take_scored()
    assert own == score_counts(baseline, counts[1], counts[2], counts[3], samples=counts[0])
    empty = score_counts(baseline, {n: [0] * len(c) for n, c in features.items()})
    assert set(empty.features.values()) == {None} and empty.input_psi is None
