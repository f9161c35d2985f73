"""The test scaffolding is real: brokers route and authenticate, restart on their port,
PostgreSQL hands out a usable database, and the ONNX and TFLite digits twins agree."""

from __future__ import annotations

import json
import queue
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import onnxruntime as ort
import paho.mqtt.client as mqtt
import psycopg
import pytest
from ai_edge_litert.interpreter import Interpreter

from mcp_edge.tooling.models import DigitsModels, onnx_predict, tflite_predict
from mcp_edge.tooling.mosquitto import DynsecMosquittoBroker, MosquittoBroker

TIMEOUT_S = 10.0
DYNSEC_COMMAND_TOPIC = "$CONTROL/dynamic-security/v1"
DYNSEC_RESPONSE_TOPIC = "$CONTROL/dynamic-security/v1/response"


class _Session:
    """A paho client running its network loop in a thread; events arrive on queues."""

    def __init__(self) -> None:
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
        self.connacks: queue.Queue[mqtt.ReasonCode] = queue.Queue()
        self.subacks: queue.Queue[list[mqtt.ReasonCode]] = queue.Queue()
        self.messages: queue.Queue[mqtt.MQTTMessage] = queue.Queue()
        self.client.on_connect = self._on_connect
        self.client.on_subscribe = self._on_subscribe
        self.client.on_message = lambda _c, _u, message: self.messages.put(message)

    def _on_connect(self, _c: Any, _u: Any, _f: Any, reason: mqtt.ReasonCode, _p: Any) -> None:
        self.connacks.put(reason)

    def _on_subscribe(
        self, _c: Any, _u: Any, _mid: int, reasons: list[mqtt.ReasonCode], _p: Any
    ) -> None:
        self.subacks.put(reasons)

    def subscribe(self, topic: str) -> None:
        self.client.subscribe(topic, qos=1)
        (granted,) = self.subacks.get(timeout=TIMEOUT_S)
        assert not granted.is_failure, f"subscription to {topic} refused: {granted}"


@contextmanager
def _mqtt_session(
    broker: MosquittoBroker, username: str | None = None, password: str | None = None
) -> Iterator[tuple[_Session, mqtt.ReasonCode]]:
    """Connect to `broker`; yield the session and the broker's CONNACK reason code."""
    session = _Session()
    if username is not None:
        session.client.username_pw_set(username, password)
    session.client.connect(broker.host, broker.port, keepalive=30)
    session.client.loop_start()
    try:
        yield session, session.connacks.get(timeout=TIMEOUT_S)
    finally:
        session.client.disconnect()
        session.client.loop_stop()


def _round_trip(broker: MosquittoBroker, topic: str, payload: bytes) -> mqtt.MQTTMessage:
    """Publish `payload` from one client and return what a second, subscribed client got."""
    with _mqtt_session(broker) as (subscriber, sub_ack), _mqtt_session(broker) as (pub, pub_ack):
        assert sub_ack == "Success" and pub_ack == "Success"
        subscriber.subscribe(topic)
        pub.client.publish(topic, payload, qos=1).wait_for_publish(timeout=TIMEOUT_S)
        return subscriber.messages.get(timeout=TIMEOUT_S)


@pytest.mark.mosquitto
def test_publish_subscribe_round_trip(mosquitto: MosquittoBroker) -> None:
    message = _round_trip(mosquitto, "scaffolding/round-trip", b"\x00hello\xff")

    assert message.topic == "scaffolding/round-trip"
    assert message.payload == b"\x00hello\xff"
    assert "set_tcp_nodelay true" in mosquitto.conf_path.read_text()


@pytest.mark.mosquitto
@pytest.mark.parametrize("credentials", ["anonymous", "wrong password"])
def test_dynsec_broker_refuses_unknown_clients(
    mosquitto_dynsec: DynsecMosquittoBroker, credentials: str
) -> None:
    username = None if credentials == "anonymous" else mosquitto_dynsec.admin_username
    password = None if credentials == "anonymous" else "not-" + mosquitto_dynsec.admin_password

    with _mqtt_session(mosquitto_dynsec, username, password) as (_session, reason):
        assert reason.is_failure
        assert reason in ("Not authorized", "Bad user name or password")


@pytest.mark.mosquitto
def test_dynsec_admin_logs_in_and_administers(mosquitto_dynsec: DynsecMosquittoBroker) -> None:
    broker = mosquitto_dynsec
    with _mqtt_session(broker, broker.admin_username, broker.admin_password) as (admin, reason):
        assert reason == "Success"
        admin.subscribe(DYNSEC_RESPONSE_TOPIC)
        command = {"commands": [{"command": "listClients"}]}
        admin.client.publish(DYNSEC_COMMAND_TOPIC, json.dumps(command), qos=1)
        response = json.loads(admin.messages.get(timeout=TIMEOUT_S).payload)

    (result,) = response["responses"]
    assert "error" not in result, result
    assert broker.admin_username in result["data"]["clients"]


@pytest.mark.mosquitto
def test_killed_broker_restarts_on_the_same_port(fresh_mosquitto: MosquittoBroker) -> None:
    broker = fresh_mosquitto
    port, first_pid = broker.port, broker.pid
    assert _round_trip(broker, "scaffolding/before", b"1").payload == b"1"

    broker.kill()
    assert not broker.running
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((broker.host, port), timeout=TIMEOUT_S).close()

    broker.start()
    assert broker.port == port
    assert broker.pid != first_pid
    assert _round_trip(broker, "scaffolding/after", b"2").payload == b"2"


@pytest.mark.postgres
def test_postgres_url_is_a_fresh_writable_database(postgres_url: str) -> None:
    with psycopg.connect(postgres_url) as conn:
        name = conn.execute("SELECT current_database()").fetchone()
        user_tables = conn.execute(
            "SELECT count(*) FROM information_schema.tables WHERE table_schema = 'public'"
        ).fetchone()
        conn.execute("CREATE TABLE devices (id text PRIMARY KEY, seen_at timestamptz)")
        conn.execute("INSERT INTO devices VALUES ('dev-1', now())")
        rows = conn.execute("SELECT id FROM devices").fetchall()

    assert name is not None and name[0].startswith("mcp_test_")
    assert postgres_url.endswith("/" + name[0])
    assert user_tables == (0,)
    assert rows == [("dev-1",)]


def test_onnx_model_has_the_documented_interface(digits: DigitsModels) -> None:
    session = ort.InferenceSession(str(digits.onnx_path), providers=["CPUExecutionProvider"])

    ((name, shape, dtype),) = [(i.name, i.shape, i.type) for i in session.get_inputs()]
    assert (name, shape[1:], dtype) == ("input", [64], "tensor(float)")
    assert [o.name for o in session.get_outputs()] == ["probabilities"]


def test_tflite_model_has_the_documented_interface(digits: DigitsModels) -> None:
    interpreter = Interpreter(model_path=str(digits.tflite_path))

    (inp,) = interpreter.get_input_details()
    (out,) = interpreter.get_output_details()
    assert (inp["name"], list(inp["shape_signature"])) == ("input", [-1, 64])
    assert (out["name"], list(out["shape"])) == ("probabilities", [1, 10])
    assert inp["dtype"] is np.float32 and out["dtype"] is np.float32
    assert interpreter.get_signature_list() == {
        "serving_default": {"inputs": ["input"], "outputs": ["probabilities"]}
    }


def test_onnx_and_tflite_twins_match_the_sklearn_model(digits: DigitsModels) -> None:
    onnx_probs = onnx_predict(digits.onnx_path, digits.X_test)
    tflite_probs = tflite_predict(digits.tflite_path, digits.X_test)
    n_test = len(digits.y_test)

    assert onnx_probs.shape == tflite_probs.shape == (n_test, 10)
    assert np.allclose(onnx_probs.sum(axis=1), 1.0, atol=1e-5)
    assert digits.accuracy > 0.9
    for probs in (onnx_probs, tflite_probs):
        accuracy = float(np.mean(probs.argmax(axis=1) == digits.y_test))
        assert accuracy == pytest.approx(digits.accuracy, abs=0.01)
    assert np.allclose(onnx_probs, tflite_probs, atol=1e-4)
