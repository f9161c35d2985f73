"""Fixtures for broker-account tests: production ACL defaults, a broker a test may break, and an
MQTT 5 client whose every broker answer is awaited with a timeout.

- `dynsec_broker`: the session's `mosquitto_dynsec` with the production default ACL access
  (deny for all four kinds, as `deploy/mosquitto/bootstrap.sh` sets it) for one module; the
  previous defaults come back afterwards so other modules see the broker as they expect.
- `fresh_dynsec_broker`: a dynamic-security broker owned by one test (kill, stop, restart,
  SIGSTOP), with the production defaults.
- `mqtt_probe`: a factory of connected `MqttProbe` clients, all closed after the test.
- `dynsec_request(host, port, user, password, commands)` (a function): one raw
  dynamic-security command batch through `mosquitto_rr`.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.reasoncodes import ReasonCode

from mcp_edge.controlplane.broker.base import Credentials
from mcp_edge.tooling.mosquitto import DynsecMosquittoBroker, MosquittoBroker, find_executable
from tests.support.controlplane import reset_postgres

TIMEOUT_S = 10.0
ACL_KINDS = ("publishClientSend", "publishClientReceive", "subscribe", "unsubscribe")

DynsecRequest = Callable[..., list[dict[str, Any]]]


def dynsec_request(
    host: str, port: int, username: str, password: str, commands: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Send one dynamic-security command batch with `mosquitto_rr`; return the answers.

    The password goes through a private options file, never argv. (Debian's 2.0.11
    `mosquitto_ctrl dynsec setDefaultACLAccess` sends nothing, so the raw command is used.)

    Raises:
        AssertionError: mosquitto_rr failed or an answer carries an error.
    """
    with tempfile.TemporaryDirectory() as config_home:
        options = Path(config_home) / "mosquitto_rr"
        options.touch(mode=0o600)
        options.write_text(f"-u {username}\n-P {password}\n")
        result = subprocess.run(
            [
                str(find_executable("mosquitto_rr")),
                *("-h", host, "-p", str(port), "-W", "10"),
                *("-t", "$CONTROL/dynamic-security/v1"),
                *("-e", "$CONTROL/dynamic-security/v1/response"),
                *("-m", json.dumps({"commands": commands})),
            ],
            env={**os.environ, "XDG_CONFIG_HOME": config_home},
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    if result.returncode != 0:
        raise AssertionError(f"mosquitto_rr failed: {result.stdout}{result.stderr}")
    answers: list[dict[str, Any]] = json.loads(result.stdout)["responses"]
    errors = [answer for answer in answers if "error" in answer]
    assert not errors, errors
    return answers


def _as_admin(broker: DynsecMosquittoBroker, commands: list[dict[str, Any]]) -> list[Any]:
    return dynsec_request(
        broker.host, broker.port, broker.admin_username, broker.admin_password, commands
    )


def default_acl_access(broker: DynsecMosquittoBroker) -> dict[str, bool]:
    """The broker's default ACL access: ``{"subscribe": False, ...}`` (False: deny)."""
    (answer,) = _as_admin(broker, [{"command": "getDefaultACLAccess"}])
    return {acl["acltype"]: acl["allow"] for acl in answer["data"]["acls"]}


def set_default_acl_access(broker: DynsecMosquittoBroker, access: dict[str, bool]) -> None:
    """Set each ACL kind's default access (False: deny) and check that it took effect."""
    acls = [{"acltype": kind, "allow": allow} for kind, allow in access.items()]
    _as_admin(broker, [{"command": "setDefaultACLAccess", "acls": acls}])
    assert default_acl_access(broker) == access


@pytest.fixture(scope="module")
def dynsec_broker(mosquitto_dynsec: DynsecMosquittoBroker) -> Iterator[DynsecMosquittoBroker]:
    """The session's dynamic-security broker, denying by default for this module."""
    before = default_acl_access(mosquitto_dynsec)
    set_default_acl_access(mosquitto_dynsec, dict.fromkeys(ACL_KINDS, False))
    try:
        yield mosquitto_dynsec
    finally:
        set_default_acl_access(mosquitto_dynsec, before)


@pytest.fixture
def fresh_dynsec_broker(tmp_path: Path) -> Iterator[DynsecMosquittoBroker]:
    """A dynamic-security broker owned by one test, denying by default."""
    broker_dir = tmp_path / "mosquitto-dynsec"
    broker_dir.mkdir()
    with DynsecMosquittoBroker(broker_dir) as broker:
        set_default_acl_access(broker, dict.fromkeys(ACL_KINDS, False))
        yield broker


class MqttProbe:
    """A paho MQTT 5 client for broker tests; events cross into asyncio on futures/queues.

    It never reconnects by itself, so a kicked or refused session stays down.
    """

    def __init__(self, broker: MosquittoBroker, client_id: str, user: str | None, pw: str):
        self.broker = broker
        self._loop = asyncio.get_running_loop()
        self.client = mqtt.Client(
            mqtt.CallbackAPIVersion.VERSION2,
            client_id=client_id,
            protocol=mqtt.MQTTv5,
            reconnect_on_failure=False,
        )
        if user is not None:
            self.client.username_pw_set(user, pw)
        self.messages: asyncio.Queue[mqtt.MQTTMessage] = asyncio.Queue()
        self.connack: asyncio.Future[ReasonCode] = self._loop.create_future()
        self.disconnected: asyncio.Future[ReasonCode] = self._loop.create_future()
        self._acks: dict[int, asyncio.Future[Any]] = {}
        c = self.client
        c.on_connect = lambda _c, _u, _f, rc, _p: self._post(self._settle, self.connack, rc)
        c.on_disconnect = lambda _c, _u, _f, rc, _p: self._post(self._settle, self.disconnected, rc)
        c.on_subscribe = lambda _c, _u, mid, rcs, _p: self._post(self._ack, mid, rcs[0])
        c.on_unsubscribe = lambda _c, _u, mid, rcs, _p: self._post(self._ack, mid, rcs[0])
        c.on_publish = lambda _c, _u, mid, rc, _p: self._post(self._ack, mid, rc)
        c.on_message = lambda _c, _u, message: self._post(self.messages.put_nowait, message)

    def _post(self, callback: Callable[..., None], *args: Any) -> None:
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(callback, *args)

    @staticmethod
    def _settle(future: asyncio.Future[ReasonCode], reason: ReasonCode) -> None:
        if not future.done():
            future.set_result(reason)

    def _ack(self, mid: int, reason: ReasonCode) -> None:
        future = self._acks.pop(mid, None)
        if future is not None and not future.done():
            future.set_result(reason)

    async def _await_ack(self, rc: int, mid: int | None) -> ReasonCode:
        assert rc == mqtt.MQTT_ERR_SUCCESS and mid is not None, mqtt.error_string(rc)
        future = self._acks[mid] = self._loop.create_future()
        result: ReasonCode = await asyncio.wait_for(future, TIMEOUT_S)
        return result

    async def connect(self) -> ReasonCode:
        """Open the session; return the CONNACK reason code."""
        await asyncio.to_thread(self.client.connect, self.broker.host, self.broker.port, 30)
        self.client.loop_start()
        return await asyncio.wait_for(self.connack, TIMEOUT_S)

    async def subscribe(self, topic_filter: str) -> ReasonCode:
        """Subscribe at QoS 1; return the SUBACK reason code."""
        return await self._await_ack(*self.client.subscribe(topic_filter, qos=1))

    async def unsubscribe(self, topic_filter: str) -> ReasonCode:
        """Unsubscribe; return the UNSUBACK reason code."""
        return await self._await_ack(*self.client.unsubscribe(topic_filter))

    async def publish(self, topic: str, payload: bytes, *, retain: bool = False) -> ReasonCode:
        """Publish at QoS 1; return the PUBACK reason code."""
        info = self.client.publish(topic, payload, qos=1, retain=retain)
        return await self._await_ack(info.rc, info.mid)

    async def next_message(self) -> mqtt.MQTTMessage:
        """The next message delivered to this client (fails after TIMEOUT_S)."""
        return await asyncio.wait_for(self.messages.get(), TIMEOUT_S)

    async def disconnect_reason(self) -> ReasonCode:
        """Wait until the broker ends the session; return the DISCONNECT reason code."""
        return await asyncio.wait_for(asyncio.shield(self.disconnected), TIMEOUT_S)

    async def close(self) -> None:
        self.client.disconnect()
        await asyncio.to_thread(self.client.loop_stop)


ProbeFactory = Callable[..., Awaitable[MqttProbe]]


@pytest.fixture
async def mqtt_probe() -> AsyncIterator[ProbeFactory]:
    """`await mqtt_probe(broker, credentials, client_id=None, password=None, expect="Success")`
    connects a probe as `credentials` (None: anonymous), optionally with another client id or
    password, and checks the CONNACK reason code against `expect`."""
    probes: list[MqttProbe] = []

    async def connect(
        broker: MosquittoBroker,
        credentials: Credentials | None,
        *,
        client_id: str | None = None,
        password: str | None = None,
        expect: str = "Success",
    ) -> MqttProbe:
        user = credentials.username if credentials else None
        cid = client_id or (credentials.client_id if credentials else "anonymous-probe")
        probe = MqttProbe(
            broker, cid, user, password or (credentials.password if credentials else "")
        )
        probes.append(probe)
        reason = await probe.connect()
        assert reason == expect, f"CONNACK {reason} for {user} as {cid}, expected {expect}"
        return probe

    yield connect
    for probe in probes:
        await probe.close()


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """Each test twice: on an empty SQLite file, and on the session's PostgreSQL database,
    emptied before the test and again after it (other tests expect to find it empty)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'cp.db'}"
        return
    url = reset_postgres(request.getfixturevalue("postgres_url"))
    yield url
    reset_postgres(url)
