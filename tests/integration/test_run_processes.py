"""An enrolled ``mcp-agent run --processes 2``: deployments reach every serving process, and
the fleet's statistics count the requests every process answered.

One real agent process (real onnxruntime, the real Mosquitto, models from a real signed TUF
repository on disk) runs with a worker process beside it on the same port. A signed desired
state deploys ``digits`` 1.0.0 with a telemetry policy of one statistics message a second. The
test sends requests on fresh connections, so the kernel spreads them over both processes (the
access log says which process answered each), then deploys 1.1.0:

- every request is answered by the deployed version, by either process;
- the inference statistics the agent publishes count every request, those the worker answered
  included (it forwards them to the process that runs the fleet session);
- once the agent's metadata shows 1.1.0 stable, every process answers with 1.1.0, equal to
  onnxruntime on 1.1.0's file.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import subprocess
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import pytest

from mcp_edge.shared.mqtt import InboundMessage, MqttClient, MqttSettings
from mcp_edge.shared.protocol import decode, topics
from mcp_edge.shared.protocol.state import (
    DesiredModel,
    DesiredState,
    TelemetryPolicy,
    sign_desired_state,
)
from mcp_edge.shared.protocol.telemetry import InferenceStats
from mcp_edge.tooling.models import DigitsModels, onnx_predict, train_digits_mlp, write_digits_onnx
from mcp_edge.tooling.mosquitto import MosquittoBroker
from mcp_edge.tooling.processes import stopped_at_exit
from tests.support.agents import launch_repo_agent
from tests.support.tuf import SignedRepo, make_bundle

pytestmark = [pytest.mark.mosquitto, pytest.mark.timeout(120)]

DEVICE = "cam-processes"
REQUESTS = 40


async def until(check: Callable[[], Any], what: str, timeout_s: float = 60.0) -> Any:
    """Poll ``check`` until it gives something truthy; fail after ``timeout_s``."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        result = check()
        if result:
            return result
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[str]]]:
    with stopped_at_exit() as procs:
        yield procs


def _get(base: str, path: str, body: bytes | None = None) -> tuple[int, Any]:
    """One request on a connection of its own (so that either process may take it)."""
    parts = urlsplit(base)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=10)
    try:
        headers = {"Content-Type": "application/json"} if body is not None else {}
        conn.request("POST" if body is not None else "GET", path, body, headers)
        resp = conn.getresponse()
        raw = resp.read()
        return resp.status, json.loads(raw) if raw.startswith((b"{", b"[")) else raw
    except OSError:
        return 0, None
    finally:
        conn.close()


def _infer(base: str, rows: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """Each row on a fresh connection: (version that answered, scores)."""
    found = []
    for row in rows:
        body = {"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32",
                            "data": row.tolist()}]}  # fmt: skip
        status, doc = _get(base, "/v2/models/digits/infer", json.dumps(body).encode())
        assert status == 200, doc
        out = doc["outputs"][0]
        found.append((doc["model_version"], np.asarray(out["data"], np.float32)))
    return found


def _desired(repo: SignedRepo, seq: int, version: str, model: Path, tmp: Path) -> bytes:
    bundle = make_bundle(model, tmp / "bundles", "digits", version, repo.publisher)
    ref = repo.publish(bundle, "digits", version)
    now = datetime.now(timezone.utc)
    state = DesiredState(
        device_id=DEVICE, seq=seq, issued_at=now, expires=now + timedelta(hours=1),
        models=[DesiredModel(name="digits", stable=ref)],
        telemetry=TelemetryPolicy(inference_interval_s=1.0),
    )  # fmt: skip
    return json.dumps(sign_desired_state(state, repo.director)).encode()


def _served_by(log: Path) -> set[str]:
    """Which processes logged an answered inference request: 'primary', 'worker 1'."""
    found = set()
    for line in log.read_text(errors="replace").splitlines():
        if "POST /v2/models/digits/infer" in line:
            found.add("worker 1" if "[worker 1]" in line else "primary")
    return found


async def test_deployments_and_statistics_cover_every_serving_process(
    mosquitto: MosquittoBroker,
    digits: DigitsModels,
    tmp_path: Path,
    processes: list[subprocess.Popen[str]],
) -> None:
    other = write_digits_onnx(train_digits_mlp(seed=1).model, tmp_path / "other.onnx")
    repo, base = launch_repo_agent(
        mosquitto, tmp_path, processes, DEVICE, ("--processes", "2", "--access-log")
    )
    received: list[InboundMessage] = []
    settings = MqttSettings(mosquitto.host, mosquitto.port, client_id="processes-watcher",
                            clean_start=True, session_expiry_s=0)  # fmt: skip
    async with MqttClient(settings) as watcher:
        watcher.set_handler(received.append)
        await watcher.subscribe(topics.telemetry(DEVICE, "inference"))
        try:
            await watcher.publish(topics.desired(DEVICE),
                                  _desired(repo, 1, "1.0.0", digits.onnx_path, tmp_path), 1, True)  # fmt: skip

            def stable(version: str) -> bool:
                status, meta = _get(base, "/v2/models/digits")
                return status == 200 and meta["parameters"]["stable"] == version

            await until(lambda: stable("1.0.0"), "digits 1.0.0 deployed")
            status, text = _get(base, "/metrics")
            assert status == 200 and b"mcp_agent_serving_processes 2.0" in text

            x = digits.mlp.X_test[:REQUESTS].astype(np.float32)
            answers = await asyncio.to_thread(_infer, base, x)
            want = onnx_predict(digits.onnx_path, x)
            assert {v for v, _ in answers} == {"1.0.0"}
            np.testing.assert_allclose(np.stack([a for _, a in answers]), want, rtol=1e-5)
            # Both processes answered some of them (the access log names the worker).
            log = tmp_path / "agent.log"
            await until(lambda: _served_by(log) == {"primary", "worker 1"},
                        "requests answered by both processes")  # fmt: skip

            def counted() -> int:
                return sum(
                    m.count
                    for msg in list(received)
                    for m in decode(msg.payload, InferenceStats).models
                    if m.model == "digits" and m.version == "1.0.0"
                )

            await until(lambda: counted() == REQUESTS, f"statistics of all {REQUESTS} requests")

            # A new version: every process serves it once the metadata shows it.
            await watcher.publish(topics.desired(DEVICE),
                                  _desired(repo, 2, "1.1.0", other, tmp_path), 1, True)  # fmt: skip
            await until(lambda: stable("1.1.0"), "digits 1.1.0 deployed")
            answers = await asyncio.to_thread(_infer, base, x)
            assert {v for v, _ in answers} == {"1.1.0"}
            np.testing.assert_allclose(
                np.stack([a for _, a in answers]), onnx_predict(other, x), rtol=1e-5
            )
        finally:
            await watcher.publish(topics.desired(DEVICE), b"", 1, True)  # clear the retained
