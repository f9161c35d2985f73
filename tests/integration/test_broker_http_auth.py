"""Broker accounts in the control plane's database, asked for over HTTP by EMQX, VerneMQ and
mosquitto-go-auth: the real app on a loopback port, a real database (SQLite, and PostgreSQL
with ``MCP_TEST_POSTGRES_URL``), and each broker's documented request shapes.

Each broker dialect below builds exactly what that broker sends (docs/broker-http-auth.md has
the broker configurations that produce them): EMQX 5's HTTP authenticator and authorizer with
the bodies we configure, VerneMQ's webhooks with their ``vernemq-hook`` header, and
mosquitto-go-auth's HTTP backend in its JSON params mode.
"""

from __future__ import annotations

import asyncio
import base64
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer

from mcp_edge.controlplane.app import create_app
from mcp_edge.controlplane.bootstrap import initialize
from mcp_edge.controlplane.broker.base import AccountConflictError, BrokerAdminError, Credentials
from mcp_edge.controlplane.broker.http_auth import HttpAuthProvisioner
from mcp_edge.controlplane.broker.http_hooks import MAX_BODY_BYTES, serve_broker_hooks
from mcp_edge.controlplane.db import Database
from mcp_edge.controlplane.settings import (
    BrokerProvisionerKind,
    PasswordCost,
    Settings,
    SettingsError,
)
from mcp_edge.shared.protocol import topics
from mcp_edge.shared.protocol.topics import TelemetryKind
from mcp_edge.shared.signing import PrivateKey
from tests.support.controlplane import FakeClock, envelope

SECRET = "5eb1c2d3e4f5a6b7c8d9e0f1a2b3c4d5e6f7a8b9c0d1e2f3a4b5c6d7e8f9a0b1"
ADMIN_PASSWORD = "admin-password-1"
BEARER = {"Authorization": f"Bearer {SECRET}"}


@dataclass
class Hooks:
    """The served app, its provisioner, and a way to ask it as a broker does."""

    client: TestClient[Any, Any]
    provisioner: HttpAuthProvisioner
    db: Database
    settings: Settings
    admin_token: str
    clock: FakeClock

    async def post(
        self,
        path: str,
        body: Any = None,
        *,
        headers: dict[str, str] | None = None,
        raw: bytes | None = None,
    ) -> tuple[int, Any]:
        sent = {**BEARER, **(headers or {})}
        kwargs: dict[str, Any] = {"headers": sent}
        if raw is not None:
            kwargs["data"] = raw
        else:
            kwargs["json"] = body
        async with self.client.post("/broker/v1" + path, **kwargs) as response:
            return response.status, await response.json(content_type=None)

    async def api(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        headers = {"Authorization": f"Bearer {self.admin_token}"}
        async with self.client.request(method, path, json=body, headers=headers) as response:
            return response.status, await response.json(content_type=None)


def write_secret(path: Path, text: str = SECRET) -> Path:
    path.write_text(text + "\n")
    path.chmod(0o600)
    return path


@pytest.fixture
async def hooks(database_url: str, tmp_path: Path) -> AsyncIterator[Hooks]:
    settings = Settings(
        data_dir=tmp_path / "cp",
        database_url=database_url,
        password_cost=PasswordCost.MIN,
        broker_provisioner=BrokerProvisionerKind.HTTP,
        broker_auth_secret_file=write_secret(tmp_path / "broker.secret"),
    )
    clock = FakeClock()
    result = await initialize(
        settings, clock=clock, admin_user="admin", admin_password=ADMIN_PASSWORD
    )
    assert result.api_token is not None
    db = Database(settings.effective_database_url)
    provisioner = HttpAuthProvisioner(db)
    app = create_app(settings, provisioner, clock, database=db)
    client: TestClient[Any, Any] = TestClient(TestServer(app))
    await client.start_server()
    try:
        yield Hooks(client, provisioner, db, settings, result.api_token, clock)
    finally:
        await client.close()
        await provisioner.close()
        await db.dispose()


# ---------------------------------------------------------------------------- the three dialects
class Dialect:
    """One broker's questions: may this client log in, publish, subscribe (and, where the
    broker asks, receive)?"""

    name = ""

    async def login(
        self, h: Hooks, username: str | None, password: str | None, client_id: str
    ) -> bool:
        raise NotImplementedError

    async def publish(self, h: Hooks, username: str, client_id: str, topic: str) -> bool:
        raise NotImplementedError

    async def subscribe(self, h: Hooks, username: str, client_id: str, topic: str) -> bool:
        raise NotImplementedError


class Emqx(Dialect):
    """EMQX 5: the authenticator's body is ``{username, password, clientid, peerhost}``, the
    authorizer's ``{username, clientid, topic, action, qos, retain}`` (placeholders render as
    text); a shared subscription is asked about by its real filter, ``$share/{group}/`` removed
    (emqx_channel: ``emqx_topic:get_shared_real_topic``)."""

    name = "emqx"

    async def login(
        self, h: Hooks, username: str | None, password: str | None, client_id: str
    ) -> bool:
        body = {"username": username or "", "password": password or "", "clientid": client_id,
                "peerhost": "10.0.0.7"}  # fmt: skip
        status, answer = await h.post("/emqx/authn", body)
        assert status == 200 and answer["is_superuser"] is False, answer
        assert answer["result"] in ("allow", "deny")
        return bool(answer["result"] == "allow")

    async def _authz(
        self, h: Hooks, username: str, client_id: str, topic: str, action: str
    ) -> bool:
        body = {"username": username, "clientid": client_id, "topic": topic, "action": action,
                "qos": "1", "retain": "false", "peerhost": "10.0.0.7"}  # fmt: skip
        status, answer = await h.post("/emqx/authz", body)
        assert status == 200 and answer["result"] in ("allow", "deny"), answer
        return bool(answer["result"] == "allow")

    async def publish(self, h: Hooks, username: str, client_id: str, topic: str) -> bool:
        return await self._authz(h, username, client_id, topic, "publish")

    async def subscribe(self, h: Hooks, username: str, client_id: str, topic: str) -> bool:
        if topic.startswith("$share/"):
            topic = topic.split("/", 2)[2]
        return await self._authz(h, username, client_id, topic, "subscribe")


class VerneMQ(Dialect):
    """VerneMQ webhooks (MQTT 5 hooks here; the v3 ones are tested below)."""

    name = "vernemq"

    async def _hook(self, h: Hooks, hook: str, body: dict[str, Any]) -> Any:
        status, answer = await h.post("/vernemq", body, headers={"vernemq-hook": hook})
        assert status == 200, answer
        return answer

    async def login(
        self, h: Hooks, username: str | None, password: str | None, client_id: str
    ) -> bool:
        answer = await self._hook(h, "auth_on_register_m5", {
            "peer_addr": "10.0.0.7", "peer_port": 51234, "mountpoint": "", "client_id": client_id,
            "username": username, "password": password, "clean_start": True, "properties": {},
        })  # fmt: skip
        return _vernemq_ok(answer)

    async def publish(self, h: Hooks, username: str, client_id: str, topic: str) -> bool:
        answer = await self._hook(h, "auth_on_publish_m5", {
            "username": username, "mountpoint": "", "client_id": client_id, "qos": 1,
            "topic": topic, "retain": False, "properties": {},
        })  # fmt: skip
        return _vernemq_ok(answer)

    async def subscribe(self, h: Hooks, username: str, client_id: str, topic: str) -> bool:
        answer = await self._hook(h, "auth_on_subscribe_m5", {
            "username": username, "mountpoint": "", "client_id": client_id,
            "topics": [{"topic": topic, "qos": 1, "no_local": False, "rap": False,
                        "retain_handling": "send_retain"}],
            "properties": {},
        })  # fmt: skip
        return _vernemq_ok(answer)


def _vernemq_ok(answer: Any) -> bool:
    if answer == {"result": "ok"}:
        return True
    assert answer == {"result": {"error": "not_allowed"}}, answer
    return False


class GoAuth(Dialect):
    """mosquitto-go-auth's HTTP backend, ``auth_opt_http_params_mode json`` (its default):
    allowed is a 2xx answer (status mode), or a 2xx with ``{"ok": true}`` (json mode)."""

    name = "go-auth"

    async def _ask(self, h: Hooks, path: str, body: dict[str, Any]) -> bool:
        status, answer = await h.post(path, body, headers={"User-Agent": "mosquitto-2.0.18"})
        assert status in (200, 403), answer
        assert answer["ok"] is (status == 200) and isinstance(answer["error"], str)
        return status == 200

    async def login(
        self, h: Hooks, username: str | None, password: str | None, client_id: str
    ) -> bool:
        body = {"username": username or "", "password": password or "", "clientid": client_id}
        return await self._ask(h, "/go-auth/user", body)

    async def acl(self, h: Hooks, username: str, client_id: str, topic: str, acc: int) -> bool:
        body = {"username": username, "clientid": client_id, "topic": topic, "acc": acc}
        return await self._ask(h, "/go-auth/acl", body)

    async def publish(self, h: Hooks, username: str, client_id: str, topic: str) -> bool:
        return await self.acl(h, username, client_id, topic, 2)

    async def subscribe(self, h: Hooks, username: str, client_id: str, topic: str) -> bool:
        return await self.acl(h, username, client_id, topic, 4)


@pytest.fixture(params=[Emqx(), VerneMQ(), GoAuth()], ids=lambda d: d.name)
def broker(request: pytest.FixtureRequest) -> Dialect:
    dialect: Dialect = request.param
    return dialect


async def login(broker: Dialect, h: Hooks, c: Credentials) -> bool:
    return await broker.login(h, c.username, c.password, c.client_id)


# ---------------------------------------------------------------------------- logins
async def test_each_kind_of_account_logs_in_with_the_credentials_it_was_given(
    hooks: Hooks, broker: Dialect
) -> None:
    accounts = [
        await hooks.provisioner.provision_device("cam-1"),
        await hooks.provisioner.provision_service("cp-east-1"),
        await hooks.provisioner.provision_app_client("checkout"),
    ]
    assert [c.username for c in accounts] == ["dev-cam-1", "svc-cp-east-1", "app-checkout"]
    for c in accounts:
        assert await login(broker, hooks, c), c
        assert not await broker.login(hooks, c.username, c.password + "x", c.client_id)
        assert not await broker.login(hooks, c.username, c.password, c.client_id + "-2")
        assert not await broker.login(hooks, c.username, "", c.client_id)
    device = accounts[0]
    assert not await broker.login(hooks, "dev-cam-9", device.password, "cam-9")  # no account
    assert not await broker.login(hooks, "dev-cam-1", device.password, "cp-east-1")
    # Another account's password is no key to this one.
    assert not await broker.login(hooks, "dev-cam-1", accounts[2].password, "cam-1")


async def test_vernemq_refuses_a_client_without_username_or_password(hooks: Hooks) -> None:
    device = await hooks.provisioner.provision_device("cam-1")
    vernemq = VerneMQ()
    assert not await vernemq.login(hooks, None, device.password, "cam-1")
    assert not await vernemq.login(hooks, device.username, None, "cam-1")
    status, answer = await hooks.post(
        "/vernemq",
        {"peer_addr": "10.0.0.7", "peer_port": 1, "username": device.username,
         "password": device.password, "mountpoint": "", "client_id": "cam-1",
         "clean_session": True},
        headers={"vernemq-hook": "auth_on_register"},
    )  # fmt: skip
    assert (status, answer) == (200, {"result": "ok"})  # the MQTT 3 hook too


# ---------------------------------------------------------------------------- topics
async def test_a_device_uses_its_own_topics_and_not_another_devices(
    hooks: Hooks, broker: Dialect
) -> None:
    me = await hooks.provisioner.provision_device("cam-1")
    await hooks.provisioner.provision_device("cam-2")
    u, c = me.username, me.client_id
    for topic in (topics.status("cam-1"), topics.telemetry("cam-1", TelemetryKind.HEALTH),
                  topics.repo_request("cam-1"), topics.client_reply("checkout", "R" * 22)):  # fmt: skip
        assert await broker.publish(hooks, u, c, topic), topic
    for topic in (topics.status("cam-2"), topics.telemetry("cam-2", TelemetryKind.HEALTH),
                  topics.desired("cam-1"), "mcp/v1/client/checkout/reply", "mcp/v1/dev/cam-1/#"):  # fmt: skip
        assert not await broker.publish(hooks, u, c, topic), topic
    for topic in (topics.desired("cam-1"), topics.command("cam-1"), "mcp/v1/dev/cam-1/infer/+",
                  "$share/agents/mcp/v1/fleet/infer/+"):  # fmt: skip
        assert await broker.subscribe(hooks, u, c, topic), topic
    for topic in (
        topics.desired("cam-2"),
        "mcp/v1/dev/+/desired",
        "#",
        topics.client_replies("checkout"),
    ):
        assert not await broker.subscribe(hooks, u, c, topic), topic
    # The right account with another client id may do nothing.
    assert not await broker.publish(hooks, u, "cam-2", topics.status("cam-1"))
    assert not await broker.subscribe(hooks, u, "cam-2", topics.desired("cam-1"))


async def test_shared_subscriptions_for_the_control_plane_only(
    hooks: Hooks, broker: Dialect
) -> None:
    svc = await hooks.provisioner.provision_service("cp-east-1")
    dev = await hooks.provisioner.provision_device("cam-1")
    app = await hooks.provisioner.provision_app_client("checkout")
    shared = ["$share/cp/mcp/v1/dev/+/telemetry/+", "$share/repo/mcp/v1/dev/+/repo"]
    for topic in shared:
        assert await broker.subscribe(hooks, svc.username, svc.client_id, topic), topic
        assert not await broker.subscribe(hooks, dev.username, dev.client_id, topic), topic
        assert not await broker.subscribe(hooks, app.username, app.client_id, topic), topic
    assert await broker.publish(hooks, svc.username, svc.client_id, topics.desired("cam-1"))
    assert not await broker.publish(hooks, svc.username, svc.client_id, topics.fleet_infer("d"))
    assert await broker.publish(hooks, app.username, app.client_id, topics.fleet_infer("digits"))
    assert await broker.subscribe(
        hooks, app.username, app.client_id, topics.client_replies("checkout")
    )
    assert not await broker.subscribe(
        hooks, app.username, app.client_id, topics.client_replies("other")
    )


async def test_go_auth_checks_deliveries_and_has_no_superuser(hooks: Hooks) -> None:
    dev = await hooks.provisioner.provision_device("cam-1")
    go = GoAuth()
    assert await go.acl(hooks, dev.username, "cam-1", topics.desired("cam-1"), 1)  # read
    assert not await go.acl(hooks, dev.username, "cam-1", topics.desired("cam-2"), 1)
    assert not await go.acl(hooks, dev.username, "cam-1", topics.status("cam-1"), 3)  # no read
    svc = await hooks.provisioner.provision_service("cp-east-1")
    assert await go.acl(hooks, svc.username, "cp-east-1", topics.status("cam-1"), 3)  # both
    status, answer = await hooks.post("/go-auth/superuser", {"username": svc.username})
    assert (status, answer["ok"]) == (403, False)


async def test_vernemq_answers_a_mixed_subscription_topic_by_topic(hooks: Hooks) -> None:
    dev = await hooks.provisioner.provision_device("cam-1")
    asked = [
        {"topic": topics.desired("cam-1"), "qos": 1},
        {"topic": topics.desired("cam-2"), "qos": 1},
    ]
    body = {"username": dev.username, "mountpoint": "", "client_id": "cam-1", "topics": asked}
    status, v5 = await hooks.post(
        "/vernemq", body, headers={"vernemq-hook": "auth_on_subscribe_m5"}
    )
    assert status == 200
    assert v5 == {"result": "ok", "modifiers": {"topics": [
        {"topic": topics.desired("cam-1"), "qos": 1}, {"topic": topics.desired("cam-2"), "qos": 135}
    ]}}  # fmt: skip
    status, v3 = await hooks.post("/vernemq", body, headers={"vernemq-hook": "auth_on_subscribe"})
    assert status == 200
    assert v3 == {"result": "ok", "topics": [
        {"topic": topics.desired("cam-1"), "qos": 1}, {"topic": topics.desired("cam-2"), "qos": 128}
    ]}  # fmt: skip
    body["topics"] = [asked[1]]
    assert await hooks.post("/vernemq", body, headers={"vernemq-hook": "auth_on_subscribe"}) == (
        200, {"result": {"error": "not_allowed"}},
    )  # fmt: skip


# ---------------------------------------------------------------------------- revocation
async def test_a_revoked_device_is_denied_at_its_next_check(hooks: Hooks, broker: Dialect) -> None:
    p = hooks.provisioner
    old = await p.provision_device("cam-1")
    status = topics.status("cam-1")
    assert await login(broker, hooks, old)
    await p.disable_device("cam-1")
    assert not await login(broker, hooks, old)
    assert not await broker.publish(hooks, old.username, "cam-1", status)
    assert not await broker.subscribe(hooks, old.username, "cam-1", topics.desired("cam-1"))
    await p.enable_device("cam-1")
    assert await login(broker, hooks, old) and await broker.publish(
        hooks, old.username, "cam-1", status
    )
    new = await p.provision_device("cam-1")  # a new password; the old one is dead
    assert await login(broker, hooks, new) and not await login(broker, hooks, old)
    await p.delete_device("cam-1")
    assert not await login(broker, hooks, new)
    assert not await broker.publish(hooks, new.username, "cam-1", status)
    with pytest.raises(BrokerAdminError, match="does not exist"):
        await p.enable_device("cam-1")
    await p.disable_device("cam-1")  # no account: nothing to do, no error
    await p.delete_device("cam-1")
    back = await p.provision_device("cam-1")
    assert await login(broker, hooks, back)


async def test_a_revoked_application_is_denied(hooks: Hooks, broker: Dialect) -> None:
    app = await hooks.provisioner.provision_app_client("checkout")
    fleet = topics.fleet_infer("digits")
    await hooks.provisioner.disable_app_client("checkout")
    assert not await login(broker, hooks, app)
    assert not await broker.publish(hooks, app.username, "checkout", fleet)
    await hooks.provisioner.delete_app_client("checkout")
    await hooks.provisioner.delete_app_client("checkout")
    assert not await login(broker, hooks, app)


async def test_one_client_id_belongs_to_one_account(hooks: Hooks) -> None:
    await hooks.provisioner.provision_device("shared-id")
    with pytest.raises(AccountConflictError) as taken:
        await hooks.provisioner.provision_app_client("shared-id")
    assert taken.value.holder == "dev-shared-id"
    with pytest.raises(AccountConflictError):
        await hooks.provisioner.provision_service("shared-id")
    await hooks.provisioner.delete_device("shared-id")
    assert (await hooks.provisioner.provision_app_client("shared-id")).username == "app-shared-id"


# ---------------------------------------------------------------------------- through the product
async def test_enrollment_credentials_work_at_the_broker_and_revocation_ends_them(
    hooks: Hooks, broker: Dialect
) -> None:
    """The path a device takes: enrollment provisions its account inside the enrollment's own
    transaction, the answer's credentials log in, the operator's revocation locks it out."""
    status, token = await hooks.api("POST", "/api/v1/enrollment-tokens", {})
    assert status == 201, token
    body = envelope(PrivateKey.generate(), token["token"], now=hooks.clock(), device_id="cam-7")
    status, answer = await hooks.api("POST", "/api/v1/enroll", body)
    assert status == 200 and answer["status"] == "accepted", answer
    creds = answer["broker"]
    assert (creds["username"], creds["client_id"]) == ("dev-cam-7", "cam-7")
    assert await broker.login(hooks, creds["username"], creds["password"], "cam-7")
    assert await broker.publish(hooks, "dev-cam-7", "cam-7", topics.status("cam-7"))
    status, _ = await hooks.api("POST", "/api/v1/devices/cam-7/revoke", {"reason": "stolen"})
    assert status == 200
    assert not await broker.login(hooks, creds["username"], creds["password"], "cam-7")
    assert not await broker.publish(hooks, "dev-cam-7", "cam-7", topics.status("cam-7"))
    status, app = await hooks.api("POST", "/api/v1/apps", {"client_id": "checkout"})
    assert status == 201, app
    assert await broker.login(hooks, app["username"], app["password"], "checkout")
    assert (await hooks.api("DELETE", "/api/v1/apps/checkout"))[0] == 200
    assert not await broker.login(hooks, app["username"], app["password"], "checkout")


async def test_provisioning_inside_an_open_write_transaction_neither_blocks_nor_waits(
    hooks: Hooks,
) -> None:
    """Callers provision inside their own write transaction; SQLite has one writer, so the
    change is answered from memory at once and written when that transaction ends."""
    async with hooks.db.transaction():
        creds = await hooks.provisioner.provision_device("cam-1")
        assert await Emqx().login(hooks, creds.username, creds.password, "cam-1")
        await hooks.provisioner.disable_device("cam-1")
        assert not await Emqx().login(hooks, creds.username, creds.password, "cam-1")
        await hooks.provisioner.enable_device("cam-1")
    await hooks.provisioner.flush()
    # A second provisioner on the same database (another process, a restart) sees the row.
    restarted = HttpAuthProvisioner(hooks.db)
    (stored,) = await restarted.accounts()
    assert (stored.username, stored.client_id, stored.kind, stored.enabled) == (
        "dev-cam-1", "cam-1", "device", True,
    )  # fmt: skip
    assert stored.password_hash.startswith("scrypt$") and creds.password not in stored.password_hash
    assert (await restarted.authenticate(creds.username, creds.password, "cam-1")).allowed
    await restarted.close()


async def test_a_verified_password_is_not_hashed_again(hooks: Hooks) -> None:
    p = hooks.provisioner
    creds = await p.provision_device("cam-1")
    for _ in range(3):
        assert await Emqx().login(hooks, creds.username, creds.password, "cam-1")
    assert p.password_checks == 1
    assert not await Emqx().login(hooks, creds.username, "wrong", "cam-1")
    assert p.password_checks == 2  # a wrong password is always checked
    new = await p.provision_device("cam-1")
    assert not await Emqx().login(hooks, creds.username, creds.password, "cam-1")
    assert await Emqx().login(hooks, new.username, new.password, "cam-1")


# ---------------------------------------------------------------------------- the endpoint's guard
async def test_only_callers_with_the_secret_are_answered(hooks: Hooks) -> None:
    body = {"username": "u", "password": "p", "clientid": "c"}
    for headers in (
        {"Authorization": ""},
        {"Authorization": "Bearer " + SECRET[:-1]},
        {"Authorization": "Bearer " + SECRET + "x"},
        {"Authorization": "Basic " + base64.b64encode(b"broker:wrong").decode()},
        {"Authorization": "Basic !!!"},
        {"Authorization": SECRET},
    ):
        status, answer = await hooks.post("/go-auth/user", body, headers=headers)
        assert status == 401 and "secret" in answer["error"], headers
    basic = "Basic " + base64.b64encode(f"broker:{SECRET}".encode()).decode()
    status, answer = await hooks.post("/go-auth/user", body, headers={"Authorization": basic})
    assert (status, answer["ok"]) == (403, False)  # let in, and the unknown user refused
    # The secret is checked before the body is read: an oversized body is still a 401.
    status, _ = await hooks.post(
        "/emqx/authn", raw=b"x" * (MAX_BODY_BYTES * 4), headers={"Authorization": ""}
    )
    assert status == 401


async def test_large_bodies_are_refused(hooks: Hooks) -> None:
    big = {"username": "u", "password": "p" * 20000, "clientid": "c"}
    status, answer = await hooks.post("/emqx/authn", big)
    assert status == 413 and str(MAX_BODY_BYTES) in answer["error"]

    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(20):
            yield b" " * 1024  # no Content-Length: the cap is counted while reading

    async with hooks.client.post(
        "/broker/v1/vernemq",
        data=chunks(),
        headers={**BEARER, "vernemq-hook": "auth_on_publish", "Content-Type": "application/json"},
    ) as response:
        assert response.status == 413


def _auth_body() -> dict[str, Any]:
    return {"username": "dev-cam-1", "password": "x", "clientid": "cam-1"}


MALFORMED: list[tuple[str, dict[str, str], Any, str]] = [
    ("/emqx/authn", {}, {"username": "u", "password": "p"}, "clientid: is missing"),
    ("/emqx/authn", {}, {**_auth_body(), "username": 7}, "username: must be a string"),
    ("/emqx/authn", {}, {**_auth_body(), "password": None}, "password: must be a string"),
    ("/emqx/authn", {}, {**_auth_body(), "clientid": "c" * 1025}, "clientid: is longer"),
    ("/emqx/authn", {}, {**_auth_body(), "username": "a\x00b"}, "username: contains a NUL"),
    ("/emqx/authn", {}, [1, 2], "must be a JSON object"),
    (
        "/emqx/authz",
        {},
        {"username": "u", "clientid": "c", "topic": "t", "action": "all"},
        "action",
    ),
    (
        "/emqx/authz",
        {},
        {"username": "u", "clientid": "c", "topic": "t", "action": "publish", "qos": 3},
        "qos: must be 0, 1 or 2",
    ),
    (
        "/emqx/authz",
        {},
        {"username": "u", "clientid": "c", "topic": "t", "action": "publish", "retain": "yes"},
        "retain: must be true or false",
    ),
    (
        "/emqx/authz",
        {},
        {"username": "u", "clientid": "c", "action": "publish"},
        "topic: is missing",
    ),
    ("/vernemq", {}, {"client_id": "c"}, "vernemq-hook header"),
    ("/vernemq", {"vernemq-hook": "on_publish"}, {"client_id": "c"}, "vernemq-hook header"),
    ("/vernemq", {"vernemq-hook": "auth_on_register"}, {"username": "u"}, "client_id: is missing"),
    (
        "/vernemq",
        {"vernemq-hook": "auth_on_register_m5"},
        {"client_id": "c", "username": ["u"]},
        "username: must be a string",
    ),
    (
        "/vernemq",
        {"vernemq-hook": "auth_on_publish_m5"},
        {"client_id": "c", "username": "u", "topic": "t", "qos": "high"},
        "qos",
    ),
    (
        "/vernemq",
        {"vernemq-hook": "auth_on_subscribe"},
        {"client_id": "c", "username": "u", "topics": []},
        "topics: must be a list",
    ),
    (
        "/vernemq",
        {"vernemq-hook": "auth_on_subscribe_m5"},
        {"client_id": "c", "username": "u", "topics": ["a/b"]},
        "topics[0]",
    ),
    (
        "/vernemq",
        {"vernemq-hook": "auth_on_subscribe_m5"},
        {"client_id": "c", "username": "u", "topics": [{"topic": "a/b"}]},
        "qos: is missing",
    ),
    ("/go-auth/user", {}, {"username": "u", "clientid": "c"}, "password: is missing"),
    ("/go-auth/superuser", {}, {}, "username: is missing"),
    ("/go-auth/acl", {}, {"username": "u", "clientid": "c", "topic": "t", "acc": 8}, "acc"),
    ("/go-auth/acl", {}, {"username": "u", "clientid": "c", "topic": "t", "acc": "2"}, "acc"),
    ("/go-auth/acl", {}, {"username": "u", "clientid": "c", "topic": "t", "acc": True}, "acc"),
    (
        "/go-auth/acl",
        {},
        {"username": "u", "clientid": "c", "topic": "t" * 4097, "acc": 1},
        "topic",
    ),
]


@pytest.mark.parametrize(("path", "headers", "body", "problem"), MALFORMED)
async def test_malformed_questions_get_a_clear_400(
    hooks: Hooks, path: str, headers: dict[str, str], body: Any, problem: str
) -> None:
    status, answer = await hooks.post(path, body, headers=headers)
    assert status == 400, answer
    assert problem in answer["error"] and answer["code"] == "bad_request"


async def test_bodies_that_are_not_json_are_refused(hooks: Hooks) -> None:
    status, answer = await hooks.post("/emqx/authn", raw=b"{not json", headers={
        "Content-Type": "application/json"})  # fmt: skip
    assert status == 400 and "JSON" in answer["error"]
    status, _ = await hooks.post(
        "/go-auth/user", raw=b"username=u&password=p", headers={
            "Content-Type": "application/x-www-form-urlencoded"},
    )  # fmt: skip
    assert status == 415
    status, answer = await hooks.post(
        "/emqx/authn", raw=b"", headers={"Content-Type": "application/json"}
    )
    assert status == 400 and "username: is missing" in answer["error"]


# ---------------------------------------------------------------------------- wiring
async def test_the_brokers_listener_of_their_own(hooks: Hooks) -> None:
    creds = await hooks.provisioner.provision_device("cam-1")
    body = {"username": creds.username, "password": creds.password, "clientid": "cam-1"}
    async with serve_broker_hooks(hooks.provisioner, SECRET, "127.0.0.1", 0) as url, \
            aiohttp.ClientSession() as http:  # fmt: skip
        assert url.startswith("http://127.0.0.1:")
        async with http.post(url + "/broker/v1/go-auth/user", json=body, headers=BEARER) as r:
            assert (r.status, await r.json()) == (200, {"ok": True, "error": ""})
        async with http.post(url + "/broker/v1/go-auth/user", json=body) as r:
            assert r.status == 401
        async with http.get(url + "/api/v1/devices", headers=BEARER) as r:
            assert r.status == 404  # the brokers' endpoints only


async def test_the_app_needs_the_secret_to_serve_the_brokers(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, broker_provisioner=BrokerProvisionerKind.HTTP)
    db = Database(settings.effective_database_url)
    try:
        with pytest.raises(SettingsError, match="broker_auth_secret_file"):
            create_app(settings, HttpAuthProvisioner(db), database=db)
    finally:
        await db.dispose()


@pytest.mark.mosquitto
def test_serve_provisions_its_own_accounts_in_the_database(tmp_path: Path, mosquitto: Any) -> None:
    """``mcp-controlplane serve`` with ``broker_provisioner = "http"`` (set by ``init``): the
    replica's own sessions get service accounts the brokers' endpoint answers for, a device
    enrolled through the running process logs in with the credentials it got, and the
    accounts are in the database once the process has stopped."""
    data_dir = tmp_path / "cp"
    admin_pw = tmp_path / "admin.pw"
    admin_pw.write_text(ADMIN_PASSWORD)
    secret_file = write_secret(tmp_path / "broker.secret")
    env = {**os.environ, "MCP_DATA_DIR": str(data_dir), "MCP_REPLICA_NAME": "cp-t"}
    cli = [sys.executable, "-m", "mcp_edge.controlplane.cli"]
    init = subprocess.run(
        [*cli, "init", "--admin-password-file", str(admin_pw), "--listen", "127.0.0.1:0",
         "--broker-admin-url", f"mqtt://127.0.0.1:{mosquitto.port}",
         "--broker-provisioner", "http", "--broker-auth-secret-file", str(secret_file)],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert init.returncode == 0, init.stderr
    token = init.stdout.strip()
    server = subprocess.Popen(
        [*cli, "serve"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None
        url = server.stdout.readline().strip()  # printed once the socket listens
        assert url.startswith("http://127.0.0.1:"), server.stderr.read() if server.stderr else ""
        answers = asyncio.run(_ask_the_served_control_plane(url, token))
    finally:
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=30) == 0
    assert answers == {
        "ready": 200, "device login": True,
        "svc-cp-t": 200, "svc-cp-t-repo": 200, "svc-cp-t-desired": 200, "svc-cp-x": 403,
    }  # fmt: skip
    stored = asyncio.run(_stored_accounts(f"sqlite:///{data_dir / 'controlplane.db'}"))
    assert {"svc-cp-t", "svc-cp-t-repo", "svc-cp-t-desired", "dev-cam-1"} <= stored.keys()
    assert stored["dev-cam-1"] == "device" and stored["svc-cp-t"] == "service"


async def _ask_the_served_control_plane(url: str, token: str) -> dict[str, Any]:
    admin = {"Authorization": f"Bearer {token}"}
    out: dict[str, Any] = {}
    async with aiohttp.ClientSession() as http:
        async with http.get(url + "/readyz") as r:
            out["ready"] = r.status  # the replica's broker sessions are up
        for name in ("cp-t", "cp-t-repo", "cp-t-desired", "cp-x"):
            acl = {"username": f"svc-{name}", "clientid": name, "acc": 4,
                   "topic": "$share/cp/mcp/v1/dev/+/telemetry/+"}  # fmt: skip
            async with http.post(url + "/broker/v1/go-auth/acl", json=acl, headers=BEARER) as r:
                out[f"svc-{name}"] = r.status
        async with http.post(url + "/api/v1/enrollment-tokens", json={}, headers=admin) as r:
            enrollment = (await r.json())["token"]
        now = datetime.now(timezone.utc)
        body = envelope(PrivateKey.generate(), enrollment, now=now, device_id="cam-1")
        async with http.post(url + "/api/v1/enroll", json=body) as r:
            creds = (await r.json())["broker"]
        login = {"username": creds["username"], "password": creds["password"], "clientid": "cam-1"}
        async with http.post(url + "/broker/v1/emqx/authn", json=login, headers=BEARER) as r:
            out["device login"] = (await r.json())["result"] == "allow"
    return out


async def _stored_accounts(url: str) -> dict[str, str]:
    db = Database(url)
    try:
        return {a.username: a.kind for a in await HttpAuthProvisioner(db).accounts()}
    finally:
        await db.dispose()
