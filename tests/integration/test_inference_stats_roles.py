"""Inference statistics per model version and role, from a real enrolled agent process.

One ``mcp-agent run`` (real onnxruntime, the real Mosquitto, models from a real signed TUF
repository on disk) is given a signed desired state: ``digits`` 1.0.0 with 1.1.0 as a canary
for half the requests, ``shadowed`` 1.0.0 with 1.1.0 in shadow (1.1.0 is a digits model of
another seed: it answers a few images differently), and a telemetry policy of one statistics
message a second, where the agent was started with one an hour. The test sends requests over
HTTP and over MQTT and reads the statistics the agent publishes on its telemetry topic:

- per version and role, the counts add up to the requests of both transports, each counted
  under the version that answered it (as the answers say), and a request that does not fit
  the model is an error of the version it was routed to;
- the shadow ran a copy of every request stable answered, and agreed exactly on those images
  where both models name the same digit (worked out here with onnxruntime);
- every message passes the control plane's schema, histograms included.

And in process: only a desired state the handler accepts sets the statistics interval, within
the policy's bounds.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest

from mcp_edge.agent.fleet.session import FleetConfig, FleetSession
from mcp_edge.agent.fleet.spool import Spool
from mcp_edge.agent.runtime.loader import load_runner
from mcp_edge.agent.runtime.manager import ModelManager, ModelSource
from mcp_edge.client import InferenceClient, InferenceReplyError
from mcp_edge.shared.errors import MessageError
from mcp_edge.shared.mqtt import InboundMessage, MqttClient, MqttSettings
from mcp_edge.shared.profiles import load_profiles
from mcp_edge.shared.protocol import decode, topics
from mcp_edge.shared.protocol.canary import CanaryPolicy
from mcp_edge.shared.protocol.state import (
    CanarySpec,
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

DEVICE = "cam-roles"
PROFILE = load_profiles()["generic-x86_64"]
DEADLINE_S = 30.0


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


@pytest.fixture(scope="module")
def other_onnx(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A digits model of another seed: same signature, a few answers of its own."""
    out = tmp_path_factory.mktemp("other") / "digits.onnx"
    return write_digits_onnx(train_digits_mlp(seed=1).model, out)


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[str]]]:
    with stopped_at_exit() as procs:
        yield procs


def _desired(repo: SignedRepo, digits: Path, other: Path, tmp_path: Path) -> dict[str, Any]:
    refs = {}
    for name in ("digits", "shadowed"):
        for version, model in (("1.0.0", digits), ("1.1.0", other)):
            bundle = make_bundle(model, tmp_path / "bundles", name, version, repo.publisher)
            refs[name, version] = repo.publish(bundle, name, version)
    now = datetime.now(timezone.utc)
    state = DesiredState(
        device_id=DEVICE, seq=1, issued_at=now, expires=now + timedelta(hours=1),
        models=[
            DesiredModel(name="digits", stable=refs["digits", "1.0.0"],
                         canary=CanarySpec.of(refs["digits", "1.1.0"], CanaryPolicy(weight=0.5))),
            DesiredModel(name="shadowed", stable=refs["shadowed", "1.0.0"],
                         shadow=refs["shadowed", "1.1.0"]),
        ],
        telemetry=TelemetryPolicy(inference_interval_s=1.0),
    )  # fmt: skip
    return sign_desired_state(state, repo.director)


@pytest.fixture
async def agent(
    mosquitto: MosquittoBroker,
    digits: DigitsModels,
    other_onnx: Path,
    tmp_path: Path,
    processes: list[subprocess.Popen[str]],
) -> AsyncIterator[tuple[str, MqttClient, list[InboundMessage]]]:
    """The enrolled agent serving both models; its base URL, a client of the broker and the
    statistics messages received so far (subscribed before any request was sent)."""
    repo, base = launch_repo_agent(mosquitto, tmp_path, processes, DEVICE)
    received: list[InboundMessage] = []
    settings = MqttSettings(mosquitto.host, mosquitto.port, client_id="roles-watcher",
                            clean_start=True, session_expiry_s=0)  # fmt: skip
    async with MqttClient(settings) as watcher, aiohttp.ClientSession() as http:
        watcher.set_handler(received.append)
        await watcher.subscribe(topics.telemetry(DEVICE, "inference"))
        envelope = _desired(repo, digits.onnx_path, other_onnx, tmp_path)
        await watcher.publish(topics.desired(DEVICE), json.dumps(envelope).encode(), 1, True)

        async def serving() -> bool:
            roles = []
            for name, role in (("digits", "canary"), ("shadowed", "shadow")):
                try:
                    async with http.get(f"{base}/v2/models/{name}") as r:
                        meta = await r.json() if r.status == 200 else {}
                except aiohttp.ClientError:
                    return False
                roles.append((meta.get("parameters") or {}).get(role) is not None)
            return all(roles)

        try:
            await until(serving, "the canary and the shadow served", 60)
            yield base, watcher, received
        finally:
            await watcher.publish(topics.desired(DEVICE), b"", 1, True)  # clear the retained


async def test_counts_per_version_and_role_add_up_over_http_and_mqtt(
    agent: tuple[str, MqttClient, list[InboundMessage]], digits: DigitsModels, other_onnx: Path
) -> None:
    base, watcher, received = agent
    x = digits.mlp.X_test[:40].astype(np.float32)
    answered: Counter[tuple[str, str]] = Counter()
    bad = {"inputs": [{"name": "input", "shape": [1, 3], "datatype": "FP32", "data": [0] * 3}]}
    host, port = watcher.settings.host, watcher.settings.port
    async with aiohttp.ClientSession() as http, InferenceClient(host, port) as mqtt:
        for i, row in enumerate(x):
            body = {"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32",
                                "data": row.tolist()}]}  # fmt: skip
            for name in ("digits", "shadowed"):
                if i % 2:
                    async with http.post(f"{base}/v2/models/{name}/infer", json=body) as r:
                        assert r.status == 200
                        version = (await r.json())["model_version"]
                else:
                    resp = await mqtt.infer(name, {"input": row[None]}, device=DEVICE)
                    version = resp.model_version
                answered[name, version] += 1
        async with http.post(f"{base}/v2/models/digits/infer", json=bad) as r:
            assert r.status == 400
        with pytest.raises(InferenceReplyError):
            await mqtt.infer("digits", {"input": np.zeros((1, 3), np.float32)}, device=DEVICE)
    # Both versions of digits answered (half each, at random), only stable for shadowed.
    assert answered["digits", "1.0.0"] and answered["digits", "1.1.0"]
    assert answered == {("digits", "1.0.0"): answered["digits", "1.0.0"],
                        ("digits", "1.1.0"): answered["digits", "1.1.0"],
                        ("shadowed", "1.0.0"): 40}  # fmt: skip

    def totals() -> dict[tuple[str, str, str], list[int]]:
        out: dict[tuple[str, str, str], list[int]] = {}
        for msg in list(received):
            for m in decode(msg.payload, InferenceStats).models:  # the control plane's schema
                t = out.setdefault((m.model, m.version, m.role.value), [0] * 5)
                ok = m.count - m.errors - m.rejections
                for j, n in enumerate((m.count, m.errors, m.shadow_compared, m.shadow_agreed,
                                       ok - sum(m.latency_bucket_counts))):  # fmt: skip
                    t[j] += n
        return out

    def complete() -> dict[tuple[str, str, str], list[int]]:
        got = totals()
        counted = sum(t[0] for k, t in got.items() if k[0] == "digits")
        shadow = got.get(("shadowed", "1.1.0", "shadow"), [0])[0]
        return got if counted == 42 and shadow == 40 else {}

    got = await until(complete, "statistics of every request")
    # The two bad requests are errors of the version each was routed to.
    stable, canary = got.get(("digits", "1.0.0", "stable")), got.get(("digits", "1.1.0", "canary"))
    assert stable is not None and canary is not None
    assert stable[1] + canary[1] == 2
    assert stable[0] - stable[1] == answered["digits", "1.0.0"]
    assert canary[0] - canary[1] == answered["digits", "1.1.0"]
    # The shadow: a copy of each of the 40 requests, agreeing where both name the same digit.
    same = onnx_predict(digits.onnx_path, x).argmax(1) == onnx_predict(other_onnx, x).argmax(1)
    assert 0 < same.sum() <= 40
    assert got[("shadowed", "1.0.0", "stable")][:3] == [40, 0, 0]
    assert got[("shadowed", "1.1.0", "shadow")][:4] == [40, 0, 40, int(same.sum())]
    assert set(got) == {("digits", "1.0.0", "stable"), ("digits", "1.1.0", "canary"),
                        ("shadowed", "1.0.0", "stable"), ("shadowed", "1.1.0", "shadow")}  # fmt: skip
    # Every histogram holds exactly the successful requests.
    assert all(t[4] == 0 for t in got.values())


async def test_only_an_accepted_desired_state_sets_the_statistics_interval(
    mosquitto: MosquittoBroker, digits: DigitsModels, tmp_path: Path
) -> None:
    device = "cam-interval"
    handled: list[Any] = []

    async def handler(envelope: Any) -> None:  # the update agent's part: accept or refuse
        handled.append(envelope)
        if envelope["signed"].get("refuse"):
            raise MessageError("refused by this test's handler")

    manager = ModelManager(lambda s: [load_runner(s.model_path, PROFILE, threads=1)])
    await manager.load(ModelSource("digits", "1", digits.onnx_path))
    config = FleetConfig(device_id=device, host=mosquitto.host, port=mosquitto.port,
                         health_interval_s=3600, inference_interval_s=3600)  # fmt: skip
    session = FleetSession(config, spool=Spool(tmp_path / "spool"), manager=manager,
                           desired_handler=handler)  # fmt: skip
    received: list[InboundMessage] = []
    settings = MqttSettings(mosquitto.host, mosquitto.port, client_id="interval-watcher",
                            clean_start=True, session_expiry_s=0)  # fmt: skip
    try:
        async with (
            MqttClient(settings) as watcher,
            InferenceClient(mosquitto.host, mosquitto.port) as client,
        ):
            watcher.set_handler(received.append)
            await watcher.subscribe(topics.telemetry(device, "inference"))
            await session.start()
            await session.wait_online(10)
            for signed in ({"telemetry": {"inference_interval_s": 1}},
                           {"telemetry": {"inference_interval_s": 3600}, "refuse": True},
                           {"telemetry": {"inference_interval_s": 0.5}},  # out of bounds
                           {"telemetry": {}}):  # fmt: skip
                doc = {"signed": signed, "signatures": []}
                await watcher.publish(topics.desired(device), json.dumps(doc).encode(), 1)
            await until(lambda: len(handled) == 4, "the four desired states handled")
            assert session.inference_interval_s == 1.0
            for row in digits.mlp.X_test[:3]:
                await client.infer("digits", {"input": row[None]}, device=device)

            def counted() -> int:
                return sum(m.count for msg in received
                           for m in decode(msg.payload, InferenceStats).models)  # fmt: skip

            # Started with one statistics message an hour, it sends within seconds now.
            await until(lambda: counted() == 3, "the statistics of the three requests")
    finally:
        await session.close()
        await manager.close()
