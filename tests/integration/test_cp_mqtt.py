"""The control plane's MQTT session (``controlplane.mqtt.MqttSubscriber``) against real Mosquitto.

The session runs paho on the event loop and reads the socket in 64 KiB chunks, so these tests
push bursts whose packets straddle chunk boundaries (empty, tiny, and larger than a chunk),
reply from inside the message handler, and restart the broker under a live session.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from mcp_edge.controlplane.broker.base import Credentials
from mcp_edge.controlplane.mqtt import BrokerAddress, MqttSubscriber
from mcp_edge.shared.mqtt import InboundMessage, MqttError, ReconnectPolicy
from mcp_edge.tooling.mosquitto import MosquittoBroker
from tests.integration.conftest import MqttProbe, ProbeFactory

DEADLINE_S = 20.0
MIXED = (0, 1, 37, 250, 4_000, 70_000, 131_072, 9)  # 70_000 and 131_072 exceed one 64 KiB read
TINY = (3, 20, 0, 64)  # many whole packets per read: the tail must not wait for more data


def _payload(i: int, sizes: tuple[int, ...] = MIXED) -> bytes:
    size = sizes[i % len(sizes)]
    return (i.to_bytes(4, "big") * (size // 4 + 1))[:size]


def _anonymous(client_id: str) -> Credentials:
    return Credentials(None, None, client_id)  # type: ignore[arg-type]


async def _until(check: object, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def _fire(probe: MqttProbe, topic: str, count: int, sizes: tuple[int, ...]) -> None:
    """Queue ``count`` QoS 1 messages at once: paho's thread writes them back to back."""
    for i in range(count):
        info = probe.client.publish(f"{topic}/{i % 3}", _payload(i, sizes), qos=1)
        assert info.rc == mqtt.MQTT_ERR_SUCCESS, mqtt.error_string(info.rc)


@pytest.fixture
async def broker(tmp_path: Path) -> AsyncIterator[MosquittoBroker]:
    b = MosquittoBroker(tmp_path)
    b.start()
    yield b
    b.stop()


@pytest.mark.parametrize("sizes", [MIXED, TINY], ids=["mixed", "tiny"])
async def test_a_burst_arrives_whole_and_in_order(
    broker: MosquittoBroker, mqtt_probe: ProbeFactory, sizes: tuple[int, ...]
) -> None:
    got: list[tuple[str, bytes]] = []
    address = BrokerAddress(broker.host, broker.port)
    async with MqttSubscriber(
        address, _anonymous("cp-burst"), ["burst/#"], lambda t, p, _ack: got.append((t, bytes(p)))
    ):
        probe = await mqtt_probe(broker, None, client_id="burst-publisher")
        _fire(probe, "burst", 240, sizes)
        await _until(lambda: len(got) >= 240, "240 messages")
    assert [p for _, p in got] == [_payload(i, sizes) for i in range(240)]
    assert [t for t, _ in got] == [f"burst/{i % 3}" for i in range(240)]


async def test_replies_published_from_the_handler_all_go_out(
    broker: MosquittoBroker, mqtt_probe: ProbeFactory
) -> None:
    session: MqttSubscriber | None = None

    def answer(m: InboundMessage) -> None:
        assert session is not None and m.response_topic and m.correlation_data is not None
        session.publish_nowait(
            m.response_topic, m.payload[::-1], qos=m.qos, correlation_data=m.correlation_data
        )

    address = BrokerAddress(broker.host, broker.port)
    session = MqttSubscriber(address, _anonymous("cp-echo"), ["req/#"], on_message=answer)
    async with session:
        probe = await mqtt_probe(broker, None, client_id="requester")
        assert not (await probe.subscribe("rep")).is_failure
        for i in range(60):
            props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
            props.ResponseTopic = "rep"
            props.CorrelationData = i.to_bytes(2, "big")
            probe.client.publish(f"req/{i}", _payload(i), qos=i % 2, properties=props)
        replies = [await probe.next_message() for _ in range(60)]
    by_id = {int.from_bytes(r.properties.CorrelationData, "big"): r.payload for r in replies}
    assert by_id == {i: _payload(i)[::-1] for i in range(60)}


async def test_the_session_comes_back_after_a_broker_restart(
    broker: MosquittoBroker, mqtt_probe: ProbeFactory
) -> None:
    got: list[bytes] = []
    address = BrokerAddress(broker.host, broker.port)
    async with MqttSubscriber(
        address, _anonymous("cp-restart"), ["restart/#"], lambda _t, p, _ack: got.append(bytes(p))
    ) as session:
        broker.stop()
        broker.start()  # no persistence: the broker forgot the session and its subscription
        probe = await mqtt_probe(broker, None, client_id="restart-publisher")
        deadline = time.monotonic() + DEADLINE_S
        while b"after" not in got:  # resent until the re-subscribed session receives one
            assert time.monotonic() < deadline, "no message after the restart"
            await probe.publish("restart/x", b"after")
            await asyncio.sleep(0.1)
        await session.publish("restart/x", b"from-cp")  # and its publishes are acknowledged
        await _until(lambda: b"from-cp" in got, "the session's own publish")


async def test_messages_not_acknowledged_when_stored_are_delivered_again_to_the_next_session(
    broker: MosquittoBroker, mqtt_probe: ProbeFactory
) -> None:
    """An ``ack_when_stored`` session acknowledges only what its owner says is stored: a
    process that dies before that leaves the rest to the broker, which delivers it again to
    the session's next connection (here: a second process taking the session over)."""
    address = BrokerAddress(broker.host, broker.port)
    first: list[tuple[bytes, int]] = []
    never = ReconnectPolicy(first_delay_s=3600.0, max_delay_s=3600.0, jitter=0.0)
    crashed = MqttSubscriber(
        address, _anonymous("cp-acked"), ["acked/#"],
        lambda _t, p, ack: first.append((bytes(p), ack)), ack_when_stored=True, reconnect=never,
    )  # fmt: skip
    await crashed.start()
    probe = await mqtt_probe(broker, None, client_id="acked-publisher")
    for i in range(5):
        await probe.publish(f"acked/{i}", f"m{i}".encode())
    await _until(lambda: len(first) == 5, "five messages")
    assert all(token for _, token in first)
    assert crashed.ack([token for _, token in first[:2]]) == 2  # m0 and m1 are "stored"

    again: list[bytes] = []
    successor = MqttSubscriber(
        address, _anonymous("cp-acked"), ["acked/#"],
        lambda _t, p, ack: again.append(bytes(p)), ack_when_stored=True,
    )  # fmt: skip
    async with successor:  # takes the session over: the first connection is dropped
        await probe.publish("acked/end", b"end")
        await _until(lambda: b"end" in again, "the message sent after the takeover")
        assert again == [b"m2", b"m3", b"m4", b"end"]
        assert crashed.ack([token for _, token in first[2:]]) == 0  # its connection is gone
    await crashed.close()


async def test_an_unreachable_broker_is_a_clear_error(tmp_path: Path) -> None:
    broker = MosquittoBroker(tmp_path)  # never started: nothing listens on its port
    session = MqttSubscriber(
        BrokerAddress(broker.host, broker.port),
        _anonymous("cp-none"),
        ["x/#"],
        lambda _t, _p, _ack: None,
        timeout_s=2,
    )
    with pytest.raises(MqttError, match="cannot connect to the broker"):
        await session.start()
    await session.close()
