"""Application MQTT accounts (`/api/v1/apps`, `mcp-controlplane apps`) on SQLite and PostgreSQL.

The REST and CLI tests use the fake provisioner (our `BrokerProvisioner` protocol); one test
makes the accounts through the real dynamic-security Mosquitto and logs in with them. "Never
receives" is checked as in test_broker_isolation: the forbidden message goes first, a permitted
one from the same publisher last, and the test asserts on what arrived before the permitted one.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import shlex
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from aiohttp.test_utils import TestClient
from click.testing import CliRunner, Result

from mcp_edge.controlplane.app import UnconfiguredProvisioner
from mcp_edge.controlplane.bootstrap import initialize
from mcp_edge.controlplane.broker.base import BrokerProvisioner, Credentials
from mcp_edge.controlplane.broker.dynsec import DynsecProvisioner
from mcp_edge.controlplane.cli import main
from mcp_edge.controlplane.settings import PasswordCost, Settings
from mcp_edge.shared.protocol import topics
from mcp_edge.shared.protocol.topics import FleetInferTopic
from mcp_edge.shared.signing import PrivateKey
from mcp_edge.tooling.mosquitto import DynsecMosquittoBroker
from tests.integration.conftest import MqttProbe, ProbeFactory
from tests.support.controlplane import (
    ADMIN_PASSWORD,
    ControlPlane,
    FakeClock,
    FakeProvisioner,
    served,
    start_control_plane,
)

BROKER_URL = "mqtt://broker.test:1883"
NOT_AUTHORIZED = "Not authorized"


MakeControlPlane = Callable[..., Awaitable[ControlPlane]]


@pytest.fixture
async def make_cp(database_url: str, tmp_path: Path) -> AsyncIterator[MakeControlPlane]:
    """`await make_cp(provisioner=None, broker_urls=(BROKER_URL,))`: a served control plane
    with a fresh admin; the fake provisioner unless another is given."""
    clients: list[TestClient[Any, Any]] = []

    async def make(
        provisioner: BrokerProvisioner | None = None, broker_urls: tuple[str, ...] = (BROKER_URL,)
    ) -> ControlPlane:
        settings = Settings(
            data_dir=tmp_path / "cp",
            database_url=database_url,
            password_cost=PasswordCost.MIN,
            broker_urls=broker_urls,
        )
        cp = await start_control_plane(settings, FakeClock(), provisioner)
        clients.append(cp.client)
        return cp

    yield make
    for client in clients:
        await client.close()


@pytest.fixture
async def cp(make_cp: MakeControlPlane) -> ControlPlane:
    return await make_cp()


async def _create(cp: ControlPlane, client_id: str, **body: Any) -> dict[str, Any]:
    status, answer = await cp.call("POST", "/api/v1/apps", body={"client_id": client_id, **body})
    assert status == 201, answer
    return dict(answer)


async def _apps(cp: ControlPlane) -> dict[str, dict[str, Any]]:
    status, answer = await cp.call("GET", "/api/v1/apps")
    assert status == 200, answer
    return {a["client_id"]: a for a in answer["items"]}


async def _audit(cp: ControlPlane) -> list[dict[str, Any]]:
    status, answer = await cp.call("GET", "/api/v1/audit", params={"target_type": "app_client"})
    assert status == 200, answer
    return list(answer["items"])


# ---------------------------------------------------------------------------- REST
async def test_create_shows_the_password_once_then_list_and_revoke_with_audit(
    cp: ControlPlane,
) -> None:
    created = await _create(cp, "line-a-dashboard", description="line A dashboard")
    assert created["password"] == "pw-app" and created["username"] == "line-a-dashboard"
    assert created["broker_urls"] == [BROKER_URL]
    assert created["reply_topic"] == "mcp/v1/client/line-a-dashboard/reply/+"
    assert created["state"] == "active" and created["created_by"] == "admin"

    listed = (await _apps(cp))["line-a-dashboard"]
    assert "password" not in listed and listed["description"] == "line A dashboard"
    assert listed["state"] == "active" and listed["revoked_at"] is None

    cp.clock.advance(minutes=5)
    status, revoked = await cp.call("DELETE", "/api/v1/apps/line-a-dashboard")
    assert status == 200 and revoked["state"] == "revoked", revoked
    assert cp.provisioner.disabled == ["line-a-dashboard"]
    first_revocation = revoked["revoked_at"]
    cp.clock.advance(minutes=5)
    status, again = await cp.call("DELETE", "/api/v1/apps/line-a-dashboard")
    assert status == 200 and again["revoked_at"] == first_revocation
    assert cp.provisioner.disabled == ["line-a-dashboard"]  # no second broker call
    assert (await _apps(cp))["line-a-dashboard"]["state"] == "revoked"

    entries = await _audit(cp)
    assert [e["action"] for e in entries] == ["app_client.revoked", "app_client.created"]
    assert all(e["actor"] == "user:admin" for e in entries)
    assert "pw-app" not in json.dumps(entries)


async def test_taken_and_invalid_client_ids_are_refused(cp: ControlPlane) -> None:
    await _create(cp, "app-1")
    status, answer = await cp.call("POST", "/api/v1/apps", body={"client_id": "app-1"})
    assert status == 409 and "already exists" in answer["error"], answer

    assert (await cp.call("DELETE", "/api/v1/apps/app-1"))[0] == 200
    status, answer = await cp.call("POST", "/api/v1/apps", body={"client_id": "app-1"})
    assert status == 409 and "revoked" in answer["error"], answer

    token = await cp.new_token()
    status, _ = await cp.enroll(PrivateKey.generate(), token["token"], device_id="cam-1")
    assert status == 200
    status, answer = await cp.call("POST", "/api/v1/apps", body={"client_id": "cam-1"})
    assert status == 409 and "device" in answer["error"], answer

    for bad in ("bad/id", "", "-dash", "x" * 65):
        status, answer = await cp.call("POST", "/api/v1/apps", body={"client_id": bad})
        assert status == 400 and "client id" in answer["error"], (bad, answer)
    status, answer = await cp.call(
        "POST", "/api/v1/apps", body={"client_id": "app-2", "password": "mine"}
    )
    assert status == 400, answer
    status, answer = await cp.call("DELETE", "/api/v1/apps/ghost")
    assert status == 404 and "ghost" in answer["error"], answer
    assert set(await _apps(cp)) == {"app-1"}


async def test_a_viewer_may_list_but_not_create_or_revoke(cp: ControlPlane) -> None:
    await _create(cp, "app-1")
    viewer = await cp.user_token("vera", "viewer")
    status, answer = await cp.call(
        "POST", "/api/v1/apps", token=viewer, body={"client_id": "app-2"}
    )
    assert status == 403, answer
    assert (await cp.call("DELETE", "/api/v1/apps/app-1", token=viewer))[0] == 403
    status, listed = await cp.call("GET", "/api/v1/apps", token=viewer)
    assert status == 200 and [a["client_id"] for a in listed["items"]] == ["app-1"]
    assert listed["items"][0]["state"] == "active"
    assert (await cp.call("GET", "/api/v1/apps", token=None))[0] == 401


async def test_nothing_is_stored_when_the_broker_refuses(cp: ControlPlane) -> None:
    cp.provisioner.fail = True
    status, answer = await cp.call("POST", "/api/v1/apps", body={"client_id": "app-1"})
    assert status == 503 and "broker provisioning failed" in answer["error"], answer
    assert await _apps(cp) == {} and await _audit(cp) == []

    cp.provisioner.fail = False
    await _create(cp, "app-1")  # the operator retries with the same id
    cp.provisioner.fail = True
    status, answer = await cp.call("DELETE", "/api/v1/apps/app-1")
    assert status == 503, answer
    assert (await _apps(cp))["app-1"]["state"] == "active"  # still active: retry the revoke


async def test_without_a_broker_there_are_no_app_accounts(make_cp: MakeControlPlane) -> None:
    cp = await make_cp(provisioner=UnconfiguredProvisioner())
    status, answer = await cp.call("POST", "/api/v1/apps", body={"client_id": "app-1"})
    assert status == 503 and "no broker provisioner" in answer["error"], answer
    assert await _apps(cp) == {}


async def test_the_openapi_document_describes_the_app_routes(cp: ControlPlane) -> None:
    status, doc = await cp.call("GET", "/api/v1/openapi.json", token=None)
    assert status == 200
    assert set(doc["paths"]["/api/v1/apps"]) >= {"get", "post"}
    assert "delete" in doc["paths"]["/api/v1/apps/{client_id}"]
    created = doc["components"]["schemas"]["AppClientCreated"]
    assert {"client_id", "username", "password", "broker_urls", "reply_topic"} <= set(
        created["properties"]
    )


# ---------------------------------------------------------------------------- real broker
def _credentials(answer: dict[str, Any]) -> Credentials:
    return Credentials(
        username=answer["username"], password=answer["password"], client_id=answer["client_id"]
    )


async def _messages_until(probe: MqttProbe, marker_topic: str) -> list[mqtt.MQTTMessage]:
    received = [await probe.next_message()]
    while received[-1].topic != marker_topic:
        received.append(await probe.next_message())
    return received


@pytest.mark.mosquitto
async def test_an_account_made_through_the_api_works_at_the_broker_until_revoked(
    make_cp: MakeControlPlane, dynsec_broker: DynsecMosquittoBroker, mqtt_probe: ProbeFactory
) -> None:
    broker = dynsec_broker
    tag = secrets.token_hex(3)  # the session broker keeps its accounts and retained messages
    a_id, b_id, device_id, model = f"app-a-{tag}", f"app-b-{tag}", f"cam-{tag}", f"m-{tag}"
    async with DynsecProvisioner(
        broker.host, broker.port, broker.admin_username, broker.admin_password
    ) as provisioner:
        cp = await make_cp(
            provisioner=provisioner, broker_urls=(f"mqtt://{broker.host}:{broker.port}",)
        )
        a, b = await _create(cp, a_id), await _create(cp, b_id)
        assert a["username"] == f"app-{a_id}"
        device = await mqtt_probe(broker, await provisioner.provision_device(device_id))
        assert await device.subscribe(FleetInferTopic(model).shared()) == "Granted QoS 1"

        app = await mqtt_probe(broker, _credentials(a))
        await mqtt_probe(broker, _credentials(a), client_id=b_id, expect=NOT_AUTHORIZED)
        sessions = {cid: str(topics.ClientReplyTopic.new(cid)) for cid in (b_id, a_id)}
        assert await app.subscribe(b["reply_topic"]) == NOT_AUTHORIZED
        assert await app.subscribe(sessions[b_id]) == NOT_AUTHORIZED
        assert await app.subscribe(a["reply_topic"]) == "Granted QoS 1"
        assert not (await app.publish(topics.fleet_infer(model), b"request")).is_failure
        request = await device.next_message()
        assert (request.topic, request.payload) == (topics.fleet_infer(model), b"request")

        bare = f"mcp/v1/client/{a_id}/reply"
        assert await device.publish(bare, b"flood") == NOT_AUTHORIZED
        for client_id, reply in sessions.items():
            assert not (await device.publish(reply, f"for {client_id}".encode())).is_failure
        (only,) = await _messages_until(app, sessions[a_id])
        assert only.payload == f"for {a_id}".encode()

        status, revoked = await cp.call("DELETE", f"/api/v1/apps/{a_id}")
        assert status == 200 and revoked["state"] == "revoked", revoked
        assert await app.disconnect_reason() == "Administrative action"
        await mqtt_probe(broker, _credentials(a), expect=NOT_AUTHORIZED)
        await mqtt_probe(broker, _credentials(b))  # the other application is untouched


# ---------------------------------------------------------------------------- CLI
def test_the_cli_creates_lists_and_revokes_app_accounts(tmp_path: Path) -> None:
    settings = Settings(
        data_dir=tmp_path / "cp",
        database_url=f"sqlite:///{tmp_path / 'cp.db'}",
        password_cost=PasswordCost.MIN,
        broker_urls=("mqtts://broker.test",),
        port=0,
    )
    clock = FakeClock()
    result = asyncio.run(
        initialize(settings, clock=clock, admin_user="admin", admin_password=ADMIN_PASSWORD)
    )
    provisioner = FakeProvisioner()
    with served(settings, provisioner, clock) as url:
        env = {"MCP_SERVER": url, "MCP_TOKEN": str(result.api_token)}

        def run(*args: str, code: int = 0) -> Result:
            done = CliRunner(env=env).invoke(main, ["apps", *args], catch_exceptions=False)
            assert done.exit_code == code, done.output
            return done

        created = run("create", "dash-1", "--description", "line A dashboard").stdout
        assert "password     pw-app" in created and "shown only now" in created
        assert "mcp/v1/client/dash-1/reply/+" in created
        line = next(s.strip() for s in created.splitlines() if "mcp-agent infer" in s)
        words = shlex.split(line)
        assert words[0] == "MCP_MQTT_PASSWORD=pw-app"
        assert words[1:12] == [
            "mcp-agent",
            "infer",
            "--mqtt",
            "broker.test:8883",
            "--tls",
            "--client-id",
            "dash-1",
            "--username",
            "dash-1",
            "--model",
            "MODEL",
        ]

        as_json = json.loads(run("create", "dash-2", "--json").stdout)
        assert as_json["password"] == "pw-app" and as_json["client_id"] == "dash-2"
        refused = run("create", "dash-1", code=1)
        assert "already exists" in refused.output and "HTTP 409" in refused.output

        table = run("list").stdout.splitlines()
        assert table[0].split()[:3] == ["CLIENT", "ID", "STATE"]
        assert any(
            r.split()[:2] == ["dash-1", "active"] and "line A dashboard" in r for r in table[1:]
        )
        assert "pw-app" not in run("list").stdout

        assert "dash-1 is revoked" in run("revoke", "dash-1").stdout
        assert provisioner.disabled == ["dash-1"]
        states = {a["client_id"]: a["state"] for a in json.loads(run("list", "--json").stdout)}
        assert states == {"dash-1": "revoked", "dash-2": "active"}
        missing = run("revoke", "ghost", code=1)
        assert "no app client 'ghost'" in missing.output and "HTTP 404" in missing.output
