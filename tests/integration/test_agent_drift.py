"""Drift measured on a real enrolled agent, and hard examples uploaded on command.

One ``mcp-agent run`` (real onnxruntime, the real Mosquitto) installs the digits model from a
real signed TUF repository: a bundle built with ``--baseline`` on the model's training split.
The signed desired state's telemetry policy sets drift windows of 200 requests and keeps hard
examples (top score at most 0.9). The test sends held-out digits over HTTP, then the same
digits inverted (``1 - x``: the pixels are scaled to [0, 1]), reads the drift reports the agent
publishes on its telemetry topic, and asks for hard examples as the control plane does (a
``CommandRequest`` on the device's command topic, the reply on ``cmd/reply`` with the
request's correlation data):

- the in-distribution window has a low input PSI and the inverted windows a far higher one,
  within 2 windows of 200 requests; every report passes the control plane's schema;
- the hard examples come back within the bytes asked for and byte-identical to the request
  bodies the device was sent, in the order they were sent, each with the answer the model gave.
"""

from __future__ import annotations

import asyncio
import base64
import json
import secrets
import subprocess
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest

from mcp_edge.shared.bundle import build_bundle, sign_bundle
from mcp_edge.shared.mqtt import InboundMessage, MqttClient, MqttSettings
from mcp_edge.shared.protocol import decode, topics
from mcp_edge.shared.protocol.command import CommandReply, CommandRequest
from mcp_edge.shared.protocol.state import (
    DesiredModel,
    DesiredState,
    DriftPolicy,
    TelemetryPolicy,
    sign_desired_state,
)
from mcp_edge.shared.protocol.telemetry import DriftReport, HardExampleBatch
from mcp_edge.shared.protocol.wire import CommandName
from mcp_edge.tooling.models import DigitsModels, onnx_predict
from mcp_edge.tooling.mosquitto import MosquittoBroker
from mcp_edge.tooling.processes import stopped_at_exit
from tests.support.agents import launch_repo_agent
from tests.support.tuf import SignedRepo

pytestmark = [pytest.mark.mosquitto, pytest.mark.timeout(180)]

DEVICE = "cam-drift"
WINDOW = 200
MAX_CONFIDENCE = 0.9
DEADLINE_S = 60.0


async def until(check: Callable[[], Any], what: str, timeout_s: float = DEADLINE_S) -> Any:
    """Poll ``check`` (sync or async) until it gives something truthy; fail after ``timeout_s``."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return result
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[str]]]:
    with stopped_at_exit() as procs:
        yield procs


def _desired(repo: SignedRepo, digits: DigitsModels, tmp_path: Path) -> dict[str, Any]:
    samples = tmp_path / "train.npy"
    np.save(samples, digits.mlp.X_train)
    bundle = tmp_path / "digits-1.0.0.mcpb"
    build_bundle(digits.onnx_path, bundle, name="digits", version="1.0.0", baseline_npy=samples)
    sign_bundle(bundle, repo.publisher)
    ref = repo.publish(bundle, "digits", "1.0.0")
    now = datetime.now(timezone.utc)
    drift = DriftPolicy(window_requests=WINDOW, window_s=3600, hard_examples=True,
                        hard_example_max_confidence=MAX_CONFIDENCE,
                        hard_example_budget_bytes=512 * 1024)  # fmt: skip
    state = DesiredState(
        device_id=DEVICE, seq=1, issued_at=now, expires=now + timedelta(hours=1),
        models=[DesiredModel(name="digits", stable=ref)],
        telemetry=TelemetryPolicy(drift=drift),
    )  # fmt: skip
    return sign_desired_state(state, repo.director)


@pytest.fixture
async def agent(
    mosquitto: MosquittoBroker,
    digits: DigitsModels,
    tmp_path: Path,
    processes: list[subprocess.Popen[str]],
) -> AsyncIterator[tuple[str, MqttClient, list[InboundMessage]]]:
    """The enrolled agent serving digits 1.0.0; its base URL, a client of the broker and the
    drift reports and command replies received (subscribed before any request was sent)."""
    repo, base = launch_repo_agent(mosquitto, tmp_path, processes, DEVICE)
    received: list[InboundMessage] = []
    settings = MqttSettings(mosquitto.host, mosquitto.port, client_id="drift-watcher",
                            clean_start=True, session_expiry_s=0)  # fmt: skip
    async with MqttClient(settings) as watcher, aiohttp.ClientSession() as http:
        watcher.set_handler(received.append)
        await watcher.subscribe(topics.telemetry(DEVICE, "drift"), topics.command_reply(DEVICE))
        envelope = _desired(repo, digits, tmp_path)
        await watcher.publish(topics.desired(DEVICE), json.dumps(envelope).encode(), 1, True)

        async def serving() -> bool:
            try:
                async with http.get(f"{base}/v2/models/digits") as r:
                    return r.status == 200
            except aiohttp.ClientError:
                return False

        try:
            await until(serving, "digits 1.0.0 served")
            yield base, watcher, received
        finally:
            await watcher.publish(topics.desired(DEVICE), b"", 1, True)  # clear the retained


async def _send(http: aiohttp.ClientSession, base: str, rows: np.ndarray) -> None:
    for row in rows:
        body = {"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32",
                            "data": row.tolist()}]}  # fmt: skip
        async with http.post(f"{base}/v2/models/digits/infer", json=body) as r:
            assert r.status == 200, await r.text()


def _reports(received: list[InboundMessage]) -> list[DriftReport]:
    drift = topics.telemetry(DEVICE, "drift")
    return [decode(m.payload, DriftReport) for m in list(received) if m.topic == drift]


async def _command(
    watcher: MqttClient, received: list[InboundMessage], **args: Any
) -> HardExampleBatch:
    now = datetime.now(timezone.utc)
    req = CommandRequest(command_id=secrets.token_hex(16), name=CommandName.UPLOAD_HARD_EXAMPLES,
                         args=args, issued_at=now, expires=now + timedelta(minutes=1))  # fmt: skip
    correlation = secrets.token_bytes(8)
    reply_topic = topics.command_reply(DEVICE)
    await watcher.publish(topics.command(DEVICE), req.model_dump_json().encode(), 1,
                          response_topic=reply_topic, correlation_data=correlation)  # fmt: skip

    def reply() -> CommandReply | None:
        for m in list(received):
            if m.topic == reply_topic and m.correlation_data == correlation:
                return decode(m.payload, CommandReply)
        return None

    answer: CommandReply = await until(reply, "the upload_hard_examples reply")
    assert answer.ok, answer.error
    return HardExampleBatch.model_validate(answer.result)


async def test_shifted_traffic_drifts_and_hard_examples_come_back_byte_for_byte(
    agent: tuple[str, MqttClient, list[InboundMessage]], digits: DigitsModels
) -> None:
    base, watcher, received = agent
    held_out = digits.X_test[:WINDOW].astype(np.float32)
    inverted = (1.0 - digits.X_test[: 2 * WINDOW]).astype(np.float32)
    async with aiohttp.ClientSession() as http:
        await _send(http, base, held_out)
        (calm,) = await until(lambda: _reports(received), "the first drift window")
        await _send(http, base, inverted)
        reports = await until(lambda: len(_reports(received)) >= 3 and _reports(received),
                              "two more drift windows")  # fmt: skip
    assert [(r.model, r.version, r.samples, r.sample_every) for r in reports] == [
        ("digits", "1.0.0", WINDOW, 1)
    ] * 3
    assert calm.input_psi is not None and calm.input_psi < 0.15
    shifted = [r.input_psi for r in reports[1:]]
    assert all(p is not None and p > 1.0 and p > 10 * calm.input_psi for p in shifted)
    calm_classes = calm.class_psi if calm.class_psi is not None else 0.0
    assert all(r.class_psi is not None and r.class_psi > calm_classes for r in reports[1:])
    assert [f.name for f in calm.features] == [f"f{i}" for i in range(64)]

    # Hard examples: the sent rows the model answered with a top score of at most 0.9.
    sent = np.concatenate([held_out, inverted])
    scores = onnx_predict(digits.onnx_path, sent)
    hard = [i for i in range(len(sent)) if scores[i].max() <= MAX_CONFIDENCE]
    assert len(hard) > 20
    assert reports[-1].hard_examples > 20
    per_example = 64 * 4 + 10 * 4
    first = await _command(watcher, received, model="digits", max_bytes=20 * per_example)
    assert len(first.examples) == 20 and first.bytes == 20 * per_example
    rest = await _command(watcher, received, model="digits", version="1.0.0")
    assert rest.held == 0 and len(first.examples) + len(rest.examples) <= len(hard)
    assert first.held == len(rest.examples)
    position = {sent[i].tobytes(): i for i in hard}
    order = []
    for ex in first.examples + rest.examples:
        raw = base64.b64decode(ex.input.data_b64)
        assert raw in position, "a hard example is not byte-identical to a request sent"
        i = position[raw]
        order.append(i)
        assert (ex.input.datatype, ex.input.shape) == ("FP32", [1, 64])
        assert ex.output is not None
        answer = np.frombuffer(base64.b64decode(ex.output.data_b64), "<f4")
        np.testing.assert_allclose(answer, scores[i], rtol=1e-5, atol=1e-6)
        assert ex.predicted == int(scores[i].argmax())
        assert ex.confidence == pytest.approx(float(scores[i].max()), abs=1e-5)
    assert order == sorted(order)  # oldest first, none twice
    assert len(set(order)) == len(order)
