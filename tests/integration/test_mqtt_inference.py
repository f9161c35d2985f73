"""Inference over MQTT 5 end to end: real Mosquitto, real onnxruntime, the agent's session."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mcp_edge.agent.fleet.session import FleetConfig, FleetSession
from mcp_edge.agent.fleet.spool import Spool
from mcp_edge.agent.runtime.batcher import BatchingConfig
from mcp_edge.agent.runtime.loader import load_runner
from mcp_edge.agent.runtime.manager import ModelManager, ModelSource
from mcp_edge.agent.runtime.runner import ModelRunner
from mcp_edge.client import (
    InferenceClient,
    InferenceReplyError,
    NoResponderError,
    parse_reply,
)
from mcp_edge.shared.mqtt import InboundMessage, MqttClient, MqttSettings
from mcp_edge.shared.profiles import load_profiles
from mcp_edge.shared.protocol import ErrorCode, topics
from mcp_edge.tooling.models import DigitsModels, onnx_predict
from mcp_edge.tooling.mosquitto import MosquittoBroker
from tests.support.runners import DoublingRunner

pytestmark = pytest.mark.mosquitto
PROFILE = load_profiles()["generic-x86_64"]


def real_factory(source: ModelSource) -> Sequence[ModelRunner]:
    return [load_runner(source.model_path, PROFILE, threads=1)]


def v2_body(x: np.ndarray, name: str = "input") -> dict[str, Any]:
    return {
        "inputs": [
            {"name": name, "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}
        ]
    }


def scores(resp: Any) -> np.ndarray:
    return resp.outputs[0].to_numpy()


async def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Wait for ``condition`` (polling the loop), failing after ``timeout_s``."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.002)


async def digits_manager(digits: DigitsModels) -> ModelManager:
    manager = ModelManager(real_factory)
    await manager.load(ModelSource("digits", "1", digits.onnx_path))
    return manager


@asynccontextmanager
async def running_session(
    broker: MosquittoBroker, manager: ModelManager, tmp_path: Path, device_id: str, **config: Any
) -> AsyncIterator[FleetSession]:
    cfg = FleetConfig(
        device_id=device_id,
        host=broker.host,
        port=broker.port,
        health_interval_s=3600,
        inference_interval_s=3600,
        **config,
    )
    session = FleetSession(cfg, spool=Spool(tmp_path / f"{device_id}-spool.db"), manager=manager)
    await session.start()
    try:
        await session.wait_online(10)
        yield session
    finally:
        await session.close()


@pytest.fixture
async def digits_agent(
    mosquitto: MosquittoBroker, digits: DigitsModels, tmp_path: Path
) -> AsyncIterator[tuple[FleetSession, ModelManager]]:
    manager = await digits_manager(digits)
    try:
        async with running_session(
            mosquitto, manager, tmp_path, "dev-inf", max_infer_bytes=64 * 1024
        ) as session:
            yield session, manager
    finally:
        await manager.close()


@pytest.fixture
async def client(mosquitto: MosquittoBroker) -> AsyncIterator[InferenceClient]:
    async with InferenceClient(mosquitto.host, mosquitto.port) as c:
        yield c


@pytest.mark.parametrize("qos", [0, 1])
async def test_device_and_fleet_topics_answer_with_the_models_predictions(
    digits: DigitsModels, digits_agent: Any, client: InferenceClient, qos: int
) -> None:
    session, _ = digits_agent
    x = digits.X_test[:30].astype(np.float32)
    expected = onnx_predict(digits.onnx_path, x).argmax(1)
    resp = await client.infer("digits", {"input": x}, device="dev-inf", qos=qos, request_id="r1")
    assert resp.model_name == "digits" and resp.model_version == "1" and resp.id == "r1"
    assert list(scores(resp).argmax(1)) == list(expected)
    accuracy = float((scores(resp).argmax(1) == digits.y_test[:30]).mean())
    assert accuracy >= 0.85
    # The fleet topic (shared subscription) answers the same, row by row.
    for i in range(5):
        resp = await client.infer("digits", {"input": x[i : i + 1]}, qos=qos)
        assert int(scores(resp).argmax(1)[0]) == expected[i]
    assert session.inference.counters.received_fleet == 5
    assert session.mqtt.tcp_nodelay


async def test_reply_echoes_correlation_data_and_carries_status(
    digits: DigitsModels, digits_agent: Any, mosquitto: MosquittoBroker
) -> None:
    replies: list[InboundMessage] = []
    reply_topic = str(topics.ClientReplyTopic.new("raw-app"))
    async with MqttClient(
        MqttSettings(
            mosquitto.host,
            mosquitto.port,
            client_id="raw-app",
            clean_start=True,
            session_expiry_s=0,
        )
    ) as raw:
        await raw.subscribe(reply_topic)
        reader = asyncio.create_task(_collect(raw, replies))
        body = json.dumps(v2_body(digits.X_test[:1])).encode()
        for i, corr in enumerate([b"\x00\x01binary", b"second"]):
            await raw.publish(
                topics.device_infer("dev-inf", "digits"),
                body,
                1,
                response_topic=reply_topic,
                correlation_data=corr,
            )
            await until(lambda n=i: len(replies) == n + 1)
        reader.cancel()
    assert [r.correlation_data for r in replies] == [b"\x00\x01binary", b"second"]
    assert all(r.user_property("mcp-status") == "200" for r in replies)
    assert all(r.user_property("mcp-device") == "dev-inf" for r in replies)


async def _collect(raw: MqttClient, into: list[InboundMessage]) -> None:
    async for msg in raw.messages():
        into.append(msg)


@pytest.mark.parametrize(
    ("model", "payload", "props", "code", "reason", "counted"),
    [
        (
            "nope",
            v2_body(np.zeros((1, 64), np.float32)),
            {},
            ErrorCode.NOT_FOUND,
            "not loaded",
            None,
        ),
        (
            "digits",
            {"inputs": [{"name": "input", "shape": [1, 63], "datatype": "FP32", "data": [0] * 63}]},
            {},
            ErrorCode.BAD_REQUEST,
            "does not fit",
            None,
        ),
        (
            "digits",
            {"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32", "data": [0, 1]}]},
            {},
            ErrorCode.BAD_REQUEST,
            "needs 64 values",
            None,
        ),
        (
            "digits",
            {
                "inputs": [
                    {"name": "pixels", "shape": [1, 64], "datatype": "FP32", "data": [0] * 64}
                ]
            },
            {},
            ErrorCode.BAD_REQUEST,
            "unknown input",
            None,
        ),
        ("digits", b"{not json", {}, ErrorCode.BAD_REQUEST, "not valid JSON", "json"),
        ("digits", {"inputs": "x"}, {}, ErrorCode.BAD_REQUEST, "inputs", "schema"),
        ("digits", {"inputs": [], "extra": 1}, {}, ErrorCode.BAD_REQUEST, "InferRequest", "schema"),
        (
            "digits",
            b"[" + b"0," * 50_000 + b"0]",
            {},
            ErrorCode.TOO_LARGE,
            "too large",
            "too_large",
        ),
        (
            "digits",
            v2_body(np.zeros((1, 64), np.float32)),
            {"model-version": "7"},
            ErrorCode.NOT_FOUND,
            "no loaded version",
            None,
        ),
        (
            "digits",
            v2_body(np.zeros((1, 64), np.float32)),
            {"priority": "urgent"},
            ErrorCode.BAD_REQUEST,
            "priority",
            None,
        ),
        (
            "digits",
            v2_body(np.zeros((1, 64), np.float32)),
            {"timeout-ms": "soon"},
            ErrorCode.BAD_REQUEST,
            "timeout-ms",
            None,
        ),
    ],
)
async def test_every_failure_is_a_structured_error_reply(
    digits: DigitsModels,
    digits_agent: Any,
    client: InferenceClient,
    model: str,
    payload: Any,
    props: dict[str, str],
    code: ErrorCode,
    reason: str,
    counted: str | None,
) -> None:
    session, _ = digits_agent
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    msg = await _raw_request(client, "dev-inf", model, body, props)
    with pytest.raises(InferenceReplyError) as info:
        parse_reply(msg)
    assert info.value.code is code and reason in info.value.reply.error, info.value.reply
    assert msg.user_property("mcp-status") == str(code.http_status)
    if counted is not None:
        assert session.metrics.dropped[("infer", counted)] == 1
    # The agent keeps serving.
    resp = await client.infer("digits", {"input": digits.X_test[:1]}, device="dev-inf")
    assert resp.model_name == "digits"


async def _raw_request(
    client: InferenceClient, device: str, model: str, body: bytes, props: dict[str, str]
) -> InboundMessage:
    return (
        await client.infer_raw(
            model,
            body,
            device=device,
            version=props.get("model-version"),
            priority=props.get("priority"),
        )
        if "timeout-ms" not in props
        else await _with_bad_timeout(client, device, model, body)
    )


async def _with_bad_timeout(
    client: InferenceClient, device: str, model: str, body: bytes
) -> InboundMessage:
    loop = asyncio.get_running_loop()
    reply: asyncio.Future[InboundMessage] = loop.create_future()
    corr = os.urandom(16)
    client._waiting[corr] = reply
    client.mqtt.publish_nowait(
        topics.device_infer(device, model),
        body,
        1,
        response_topic=client.reply_topic,
        correlation_data=corr,
        user_properties=[("timeout-ms", "soon")],
    )
    return await asyncio.wait_for(reply, 10)


async def test_requests_without_a_usable_response_topic_are_counted_and_dropped(
    digits: DigitsModels, digits_agent: Any, mosquitto: MosquittoBroker, client: InferenceClient
) -> None:
    session, _ = digits_agent
    body = json.dumps(v2_body(digits.X_test[:1])).encode()
    async with MqttClient(
        MqttSettings(
            mosquitto.host,
            mosquitto.port,
            client_id="no-reply",
            clean_start=True,
            session_expiry_s=0,
        )
    ) as raw:
        await raw.publish(topics.device_infer("dev-inf", "digits"), body, 1)
        not_session_replies = [
            topics.desired("dev-other"),
            "mcp/v1/client/no-reply/reply",  # bare: any device could answer there
            "mcp/v1/client/no-reply/reply/short",  # a token too short to be unguessable
        ]
        for response_topic in not_session_replies:
            await raw.publish(topics.fleet_infer("digits"), body, 1, response_topic=response_topic)
    await until(
        lambda: (
            session.metrics.dropped[("infer", "no_response_topic")] == 1
            and session.metrics.dropped[("infer", "bad_response_topic")] == 3
        )
    )
    assert session.inference.counters.dropped == 4
    assert session.inference.counters.answered_ok == 0
    assert (await client.infer("digits", {"input": digits.X_test[:1]})).model_name == "digits"


@asynccontextmanager
async def fake_device(broker: MosquittoBroker, device_id: str) -> AsyncIterator[MqttClient]:
    """A device that answers by hand: subscribed to its ``digits`` request topic."""
    settings = MqttSettings(
        broker.host, broker.port, client_id=device_id, clean_start=True, session_expiry_s=0
    )
    async with MqttClient(settings) as raw:
        await raw.subscribe(topics.device_infer(device_id, "digits"))
        yield raw


async def _next(raw: MqttClient) -> InboundMessage:
    return await asyncio.wait_for(anext(raw.messages()), 10)


ANSWER = b'{"model_name": "digits", "outputs": []}'


async def test_the_client_drops_replies_it_did_not_ask_for_and_still_gets_the_real_one(
    mosquitto: MosquittoBroker, client: InferenceClient
) -> None:
    # A device that saw one of the client's requests knows its reply topic; it must still not
    # be able to answer for another request, nor reach the client on another topic.
    other_session = str(topics.ClientReplyTopic.new(client.client_id))
    await client.mqtt.subscribe(other_session)  # as if the application listened there too
    async with fake_device(mosquitto, "dev-spoof") as device:
        pending = asyncio.create_task(
            client.infer_raw("digits", b"{}", device="dev-spoof", timeout_s=10)
        )
        request = await _next(device)
        assert request.response_topic == client.reply_topic
        real = request.correlation_data
        assert real is not None and len(real) == 16
        await device.publish(client.reply_topic, b"spoofed", 1, correlation_data=b"f" * 16)
        await device.publish(client.reply_topic, b"spoofed", 1)  # no correlation data at all
        await device.publish(other_session, b"spoofed", 1, correlation_data=real)
        await device.publish(client.reply_topic, ANSWER, 1, correlation_data=real)
        reply = await pending
    # One publisher's messages arrive in order: every spoof was seen before the real reply.
    assert reply.payload == ANSWER and parse_reply(reply).model_name == "digits"
    assert client.dropped_replies == {"unmatched": 2, "foreign_topic": 1}


async def test_the_client_never_receives_a_reply_over_its_size_limit(
    mosquitto: MosquittoBroker,
) -> None:
    limit = 64 * 1024
    async with (
        InferenceClient(mosquitto.host, mosquitto.port, max_reply_bytes=limit) as small,
        fake_device(mosquitto, "dev-flood") as device,
    ):
        pending = asyncio.create_task(small.infer_raw("digits", b"{}", device="dev-flood"))
        request = await _next(device)
        corr = request.correlation_data
        flood = b" " * (limit + 128 * 1024)  # well past the payload limit and the header room
        await device.publish(small.reply_topic, flood, 1, correlation_data=corr)
        await device.publish(small.reply_topic, ANSWER, 1, correlation_data=corr)
        reply = await pending
    # The broker dropped the flood instead of delivering it (the client's Maximum Packet Size).
    assert reply.payload == ANSWER


async def test_an_answer_over_the_reply_limit_becomes_a_too_large_error_reply(
    mosquitto: MosquittoBroker, digits: DigitsModels, tmp_path: Path, client: InferenceClient
) -> None:
    manager = await digits_manager(digits)
    limit = 4096
    x = digits.X_test[:200].astype(np.float32)
    try:
        async with running_session(
            mosquitto, manager, tmp_path, "dev-cap", max_reply_bytes=limit
        ) as session:
            with pytest.raises(InferenceReplyError) as info:
                await client.infer("digits", {"input": x}, device="dev-cap")
            one = await client.infer("digits", {"input": x[:1]}, device="dev-cap")
    finally:
        await manager.close()
    error = info.value.reply
    assert info.value.code is ErrorCode.TOO_LARGE and info.value.device == "dev-cap"
    assert f"the limit for MQTT replies is {limit} bytes" in error.error, error
    size = int(error.error.split("the answer is ")[1].split(" bytes")[0])
    assert size > limit
    assert int(scores(one).argmax(1)[0]) == int(onnx_predict(digits.onnx_path, x[:1]).argmax(1)[0])
    assert session.inference.counters.answered_error == 1
    assert session.inference.counters.answered_ok == 1


async def test_the_reply_limit_must_leave_room_for_an_error_and_stay_decodable(
    tmp_path: Path,
) -> None:
    spool = Spool(tmp_path / "spool.db")
    for bad in (1023, 32 * 1024 * 1024 + 1):
        with pytest.raises(ValueError, match=r"max_reply_bytes must be in 1024\.\.33554432"):
            FleetSession(
                FleetConfig(device_id="d", max_reply_bytes=bad),
                spool=spool,
                manager=ModelManager(real_factory),
            )


async def test_a_model_nobody_serves_on_the_fleet_topic_fails_fast(
    digits_agent: Any, client: InferenceClient
) -> None:
    with pytest.raises(NoResponderError):
        await client.infer("unserved", {"input": np.zeros((1, 64), np.float32)}, timeout_s=5)


async def test_overload_and_deadline_get_structured_replies(
    mosquitto: MosquittoBroker, tmp_path: Path, client: InferenceClient
) -> None:
    model = tmp_path / "fake.onnx"
    model.write_bytes(b"placeholder: the fake factory does not read it")
    runner = DoublingRunner()
    # inline_below_s=0: the gated fake must run off the event loop, like a real model would.
    batching = BatchingConfig(max_batch_size=1, max_queue=4, inline_below_s=0)
    manager = ModelManager(lambda s: [runner], batching=batching)
    await manager.load(ModelSource("fake", "1", model))
    body = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}
    try:
        async with running_session(mosquitto, manager, tmp_path, "dev-busy"):
            runner.gate.clear()
            runner.entered.clear()
            batcher = manager.get("fake").batcher
            send = lambda: asyncio.create_task(  # noqa: E731
                client.infer("fake", body, device="dev-busy", timeout_s=30)
            )
            accepted = [send()]
            await asyncio.to_thread(runner.entered.wait, 10)  # the only instance is busy
            for depth in range(1, 5):
                accepted.append(send())
                await until(lambda d=depth: batcher.queue_depth == d)
            flood = await asyncio.gather(*(send() for _ in range(10)), return_exceptions=True)
            assert all(isinstance(e, InferenceReplyError) for e in flood), flood
            assert {e.code for e in flood} == {ErrorCode.OVERLOADED}  # type: ignore[union-attr]
            assert all(e.reply.retry_after_s and e.reply.retry_after_s > 0 for e in flood)  # type: ignore[union-attr]
            runner.gate.set()
            answers = await asyncio.gather(*accepted)
            assert [a.outputs[0].data for a in answers] == [[2, 4, 6, 8]] * 5
            # A request that waits past its deadline (timeout-ms) gets a timeout reply.
            runner.gate.clear()
            runner.entered.clear()
            blocked = send()
            await asyncio.to_thread(runner.entered.wait, 10)
            with pytest.raises(InferenceReplyError) as info:
                await client.infer("fake", body, device="dev-busy", timeout_s=0.05)
            runner.gate.set()
            assert (await blocked).outputs[0].data == [2, 4, 6, 8]
    except BaseException:
        runner.gate.set()
        raise
    finally:
        await manager.close()
    assert info.value.code is ErrorCode.TIMEOUT and "timed out" in info.value.reply.error


async def test_two_agents_share_the_fleet_topic_and_each_request_is_answered_once(
    mosquitto: MosquittoBroker, digits: DigitsModels, tmp_path: Path, client: InferenceClient
) -> None:
    managers = [await digits_manager(digits), await digits_manager(digits)]
    try:
        async with (
            running_session(mosquitto, managers[0], tmp_path, "dev-a") as a,
            running_session(mosquitto, managers[1], tmp_path, "dev-b") as b,
        ):
            x = digits.X_test[:40].astype(np.float32)
            expected = onnx_predict(digits.onnx_path, x).argmax(1)
            replies = await asyncio.gather(
                *(
                    client.infer_raw("digits", json.dumps(v2_body(x[i : i + 1])).encode())
                    for i in range(40)
                )
            )
            answered_by = Counter(r.user_property("mcp-device") for r in replies)
            assert [int(scores(parse_reply(r)).argmax(1)[0]) for r in replies] == list(expected)
            # Barrier: a request on each device topic is delivered after every fleet request
            # the broker routed to that device (one connection delivers in order).
            for dev in ("dev-a", "dev-b"):
                await client.infer("digits", {"input": x[:1]}, device=dev)
            received = a.inference.counters.received_fleet + b.inference.counters.received_fleet
            assert received == 40  # no request went to both
            assert set(answered_by) == {"dev-a", "dev-b"}  # load shared
            assert answered_by["dev-a"] == a.inference.counters.received_fleet
    finally:
        for m in managers:
            await m.close()


async def test_cli_infer_command_against_a_running_agent(
    digits: DigitsModels, digits_agent: Any, mosquitto: MosquittoBroker, tmp_path: Path
) -> None:
    x = digits.X_test[:2].astype(np.float32)
    data = tmp_path / "req.json"
    data.write_text(json.dumps(v2_body(x)))
    expected = onnx_predict(digits.onnx_path, x).argmax(1)
    code = "from agent.fleet.cli import infer_command; infer_command()"
    broker = f"{mosquitto.host}:{mosquitto.port}"
    for args in (
        ["--device", "dev-inf", "--data", f"@{data}"],
        ["--data", json.dumps(x.tolist()), "--qos", "0"],
    ):
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            code,
            "--mqtt",
            broker,
            "--model",
            "digits",
            *args,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, err.decode()
        body = json.loads(out)
        probs = np.asarray(body["outputs"][0]["data"]).reshape(body["outputs"][0]["shape"])
        assert list(probs.argmax(1)) == list(expected)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        code,
        "--mqtt",
        broker,
        "--model",
        "nope",
        "--device",
        "dev-inf",
        "--data",
        "[1, 2]",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 1 and json.loads(err)["code"] == "not_found"
