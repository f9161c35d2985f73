"""Drift acceptance on real data: the digits model through onnxruntime, its baseline from the
training split (inputs and the model's scores, ``compute_baseline``), device windows binned by
the agent's ``Binner`` from held-out digits, reports through the real ingestion path into the
drift store on SQLite and PostgreSQL, and the retraining webhook at a real HTTP receiver.

The rule used: ``input_psi > 0.2`` in ``sustained=2`` buckets of 60 s in a row, each bucket one
device window of 200 requests (``min_samples=100``, ``min_devices=1``), one trigger per hour.
``input_psi`` rather than ``score``: a baseline taken on the training split holds the model's
confidence on data it was fitted to, so held-out traffic's confidence PSI sits near 0.15 and
reaches 0.35 without any drift (32 of 500 windows over 0.2 by ``score``,
docs/drift.md#false-alarms); input PSI has no such bias.

Measured (the test prints them): 0 of 500 in-distribution buckets over the threshold, so a
false-alarm rate of 0/500 per window for this rule (the largest input PSI is about 0.06); every
shift (inverted, noised, shifted two pixels, brightness halved) is over from its first window
(input PSI 0.6 to 5) and raises its trigger with the second.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import onnxruntime as ort
import pytest

from mcp_edge.controlplane.drift.admin import DriftAdmin
from mcp_edge.controlplane.webhooks import verify_signature
from mcp_edge.shared.bundle.baseline import compute_baseline
from mcp_edge.shared.bundle.manifest import DriftBaseline
from mcp_edge.shared.drift import Binner
from mcp_edge.tooling.models import INPUT_NAME, OUTPUT_NAME, DigitsModels
from tests.support.controlplane import FakeClock
from tests.support.drift import SECRET, DriftFleet, drift_fleet, running_receiver, secret_file
from tests.support.drift import window as report_of

WINDOW = 200
BUCKET_S = 60
DEVICES = [f"cam-{i}" for i in range(5)]
RULE = {"metric": "input_psi", "threshold": 0.2, "min_devices": 1, "min_samples": 100,
        "sustained": 2, "cooldown_s": 3600, "window_s": BUCKET_S}  # fmt: skip
Shift = Callable[[np.ndarray[Any, Any], np.random.Generator], np.ndarray[Any, Any]]


def _inverted(x: Any, rng: np.random.Generator) -> Any:
    return 1.0 - x  # 16 - x on the original 0..16 scale


def _noised(x: Any, rng: np.random.Generator) -> Any:
    return np.clip(x + rng.normal(0.0, 0.2, x.shape), 0.0, 1.0)


def _shifted(x: Any, rng: np.random.Generator) -> Any:
    return np.roll(x.reshape(-1, 8, 8), 2, axis=2).reshape(-1, 64)


def _dimmed(x: Any, rng: np.random.Generator) -> Any:
    return x * 0.5


SHIFTS: dict[str, Shift] = {"inverted": _inverted, "noised": _noised, "shifted_2px": _shifted,
                            "brightness_x0.5": _dimmed}  # fmt: skip


class Model:
    """The digits ONNX model through onnxruntime, and its training-split baseline."""

    def __init__(self, digits: DigitsModels) -> None:
        self.session = ort.InferenceSession(str(digits.onnx_path),
                                            providers=["CPUExecutionProvider"])  # fmt: skip
        self.held_out = digits.X_test.astype(np.float32)
        train = digits.mlp.X_train.astype(np.float32)
        self.baseline: DriftBaseline = compute_baseline(
            INPUT_NAME, train, output_name=OUTPUT_NAME, scores=self.run(train)
        )

    def run(self, x: Any) -> Any:
        return self.session.run([OUTPUT_NAME], {INPUT_NAME: np.asarray(x, np.float32)})[0]


@pytest.fixture(scope="module")
def model(digits: DigitsModels) -> Model:
    return Model(digits)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


class Devices:
    """Devices answering held-out digits (optionally shifted) and binning them as the agent
    does, one report per window of 200 requests."""

    def __init__(self, model: Model, fleet: DriftFleet, seed: int) -> None:
        self.model, self.fleet = model, fleet
        self.binner = Binner(model.baseline)
        self.rng = np.random.default_rng(seed)

    async def window(self, device: str, shift: Shift | None = None) -> None:
        """One window of ``device``, its report ingested, then the clock moves one bucket."""
        pick = self.rng.choice(len(self.model.held_out), WINDOW, replace=False)
        x = self.model.held_out[pick].astype(np.float64)
        if shift is not None:
            x = shift(x, self.rng)
        self.binner.add(x, self.model.run(x).astype(np.float64))
        n, features, classes, confidence = self.binner.take()
        self.fleet.send(device, report_of(device, self.fleet.clock(), n, features, classes,
                                          confidence))  # fmt: skip
        assert await self.fleet.flush() == 1
        self.fleet.clock.advance(seconds=BUCKET_S)


async def _start(fleet: DriftFleet) -> None:
    await DriftAdmin(fleet.db, fleet.clock).set_rule(fleet.model, RULE, actor="user:test")


@pytest.fixture
def secret(tmp_path: Path) -> Iterator[Path]:
    yield secret_file(tmp_path)


async def test_held_out_digits_raise_no_trigger_over_500_windows(
    database_url: str, model: Model, clock: FakeClock
) -> None:
    async with drift_fleet(database_url, model.baseline, DEVICES, clock=clock) as fleet:
        await _start(fleet)
        devices = Devices(model, fleet, seed=1)
        for i in range(500):
            await devices.window(DEVICES[i % len(DEVICES)])
        buckets = await fleet.buckets()
        assert len(buckets) == 500 and {b.reports for b in buckets} == {1}
        over = [b for b in buckets if b.over]
        worst = max(b.input_psi or 0.0 for b in buckets)
        score_over = sum(1 for b in buckets if (b.score or 0.0) > RULE["threshold"])
        print(f"\nin-distribution: {len(over)}/500 buckets over input_psi > 0.2 (false-alarm "
              f"rate {len(over) / 500:.3f}), max input_psi {worst:.4f}; for comparison "
              f"{score_over}/500 over score > 0.2 (confidence PSI against a training-split "
              "baseline)")  # fmt: skip
        assert over == [] and worst < 0.12
        assert await fleet.triggers() == []
        assert fleet.triggers_counted() == 0
        assert fleet.metrics.registry.get_sample_value("mcp_cp_drift_reports_total") == 500


@pytest.mark.parametrize("kind", list(SHIFTS))
async def test_shifted_digits_raise_one_trigger_within_two_windows_and_a_signed_webhook(
    database_url: str, model: Model, clock: FakeClock, secret: Path, kind: str
) -> None:
    async with (
        running_receiver(clock) as receiver,
        drift_fleet(database_url, model.baseline, DEVICES, clock=clock,
                    webhook_url=receiver.url, secret=secret) as fleet,
    ):  # fmt: skip
        await _start(fleet)
        devices = Devices(model, fleet, seed=2)
        for i in range(5):
            await devices.window(DEVICES[i])
        assert await fleet.triggers() == []

        detected_after = None
        for n in (1, 2):
            await devices.window(DEVICES[n], SHIFTS[kind])
            if await fleet.triggers():
                detected_after = n
                break
        buckets = await fleet.buckets()
        print(f"\n{kind}: input_psi of the shifted windows "
              f"{[round(b.input_psi or 0, 3) for b in buckets[5:]]}; trigger after "
              f"{detected_after} window(s)")  # fmt: skip
        assert detected_after is not None and detected_after <= 2
        assert all(b.over for b in buckets[5:])

        for i in range(30):  # the drift goes on for half an hour: no second trigger
            await devices.window(DEVICES[i % 5], SHIFTS[kind])
        assert len(await fleet.triggers()) == 1
        clock.advance(seconds=RULE["cooldown_s"])  # cooldown over, still drifting: one more
        for i in range(2):
            await devices.window(DEVICES[i], SHIFTS[kind])
        triggers = await fleet.triggers()
        assert len(triggers) == 2 and fleet.triggers_counted() == 2
        newest, first = triggers
        assert (newest.raised_at - first.raised_at).total_seconds() >= RULE["cooldown_s"]
        assert first.figures["value"] > 0.2 and first.rule["metric"] == "input_psi"

        assert await fleet.deliver() == 2
        accepted = receiver.accepted()
        assert [d.document["data"]["trigger_id"] for d in accepted] == [first.id, newest.id]
        for d in accepted:
            assert verify_signature(SECRET, d.headers["X-MCP-Signature"], d.body, clock())
            assert d.document["type"] == "retraining.triggered"
            assert d.document["data"]["model"] == "digits"
            assert d.document["data"]["device_count"] >= 1
        replay = accepted[0]
        async with aiohttp.ClientSession() as http, http.post(
            receiver.url, data=replay.body,
            headers={k: v for k, v in replay.headers.items() if k.startswith("X-MCP")},
        ) as answer:  # fmt: skip
            assert answer.status == 409
        assert receiver.deliveries[-1].verdict == "replay"
