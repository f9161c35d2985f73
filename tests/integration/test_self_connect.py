"""TCP self-connect against a real Mosquitto: an agent reconnecting to a broker that is down can
have its socket connected to itself (the kernel picked the broker's port as the source port).
The agent must count that as a failed connect, reset the socket so its TIME_WAIT does not hold
the port, and come online once the broker is back on that port.

The self-connect is made deterministic by connecting *from* the broker's port
(``MqttSettings.source_address``) while nothing listens there.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import replace
from pathlib import Path

import pytest

from mcp_edge.agent.fleet.session import FleetConfig, FleetSession
from mcp_edge.agent.fleet.spool import Spool
from mcp_edge.controlplane.mqtt import CP_RECONNECT
from mcp_edge.shared.mqtt import MqttClient, MqttConnectError, MqttSettings, Session
from mcp_edge.shared.netutil import ephemeral_port_range, free_port_below_ephemeral
from mcp_edge.tooling.mosquitto import LOOPBACK, MosquittoBroker

pytestmark = pytest.mark.mosquitto


async def test_a_self_connect_fails_the_connect_and_leaves_the_port_to_the_broker(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    port = free_port_below_ephemeral()
    settings = MqttSettings(LOOPBACK, port, client_id="dev-self", source_address=(LOOPBACK, port))
    client = MqttClient(settings)
    with (
        caplog.at_level(logging.INFO, logger="mcp.mqtt"),
        pytest.raises(MqttConnectError, match="connected to itself"),
    ):
        await client.connect()
    assert not client.connected
    assert "came back to its own socket" in caplog.text
    assert "Unrecognised command" not in caplog.text  # it never read its own CONNECT
    # A socket closed the usual way would sit in TIME_WAIT on this port for a minute, and the
    # broker would fail to start with "Address already in use".
    with MosquittoBroker(tmp_path, port=port) as broker:
        client.settings = replace(settings, source_address=None)
        await client.connect()
        try:
            assert client.connected
            assert "dev-self" in broker.log_text()
        finally:
            await client.close()


async def test_the_session_retries_after_a_self_connect_and_comes_online_on_that_port(
    tmp_path: Path,
) -> None:
    port = free_port_below_ephemeral()
    config = FleetConfig(
        device_id="dev-self-retry", host=LOOPBACK, port=port,
        health_interval_s=3600.0, inference_interval_s=3600.0,
    )  # fmt: skip
    settings = replace(config.mqtt_settings(), source_address=(LOOPBACK, port))
    mqtt = MqttClient(settings)
    failed, broker_up = asyncio.Event(), asyncio.Event()
    retries = 0

    async def between_attempts(_delay_s: float) -> None:
        nonlocal retries
        retries += 1
        # Later attempts leave from a port the kernel picks, as a real retry does (a fixed
        # source port could never reach a broker listening on that same port).
        mqtt.settings = replace(settings, source_address=None)
        failed.set()
        await broker_up.wait()

    session = FleetSession(
        config, spool=Spool(tmp_path / "spool.db"), mqtt=mqtt, sleep=between_attempts
    )
    broker = MosquittoBroker(tmp_path, port=port)
    await session.start()
    try:
        await asyncio.wait_for(failed.wait(), 20)
        assert not session.online.is_set()
        await asyncio.to_thread(broker.start)  # the port is free: no TIME_WAIT holds it
        broker_up.set()
        await session.wait_online(20)
        assert (retries, session.connections) == (1, 1)
        assert "dev-self-retry" in broker.log_text()
    finally:
        await session.close()
        broker.stop()


def test_test_brokers_listen_below_the_ephemeral_range_and_dodge_a_taken_port(
    tmp_path: Path,
) -> None:
    low, _ = ephemeral_port_range()
    broker = MosquittoBroker(tmp_path)
    chosen = broker.port
    assert chosen < low  # no client can be handed it as a source port
    # Another run takes the chosen port between the choice and the broker's bind.
    with socket.create_server((LOOPBACK, chosen)), broker:
        got = broker.port
        assert got != chosen and got < low
        with socket.create_connection((broker.host, got), timeout=5):
            pass
        broker.stop()
        broker.start()
        assert broker.port == got  # a restart keeps the port it got


async def test_a_reconnecting_session_refuses_a_self_connect_and_names_it_as_its_problem(
    tmp_path: Path,
) -> None:
    # The Session class every control-plane session and the broker admin session run on, with
    # their reconnect policy: a self-connect at start is a failed start whose problem (what
    # /readyz shows) names it, and the port stays free for the broker.
    port = free_port_below_ephemeral()
    settings = MqttSettings(LOOPBACK, port, client_id="cp-self", source_address=(LOOPBACK, port))
    session = Session(MqttClient(settings), name="ingest", policy=CP_RECONNECT)
    with pytest.raises(MqttConnectError, match="connected to itself"):
        await session.start()
    assert not session.up
    assert session.problem is not None and "connected to itself" in session.problem
    await session.close()
    with MosquittoBroker(tmp_path, port=port) as broker:
        assert broker.port == port
