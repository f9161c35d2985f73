"""Deployments end to end: real dynamic-security Mosquitto, real app, SQLite and PostgreSQL.

Devices enroll through the REST API and get their own broker accounts; each check subscribes to
a device's ``desired`` topic AS that device (its own credentials and ACLs) and verifies the
retained document with the director key the enrollment answer handed out, exactly as an agent
does. Model versions are inserted straight into the registry tables (publishing is another
module's job). Every wait polls against a deadline: no fixed sleeps.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import secrets
import time
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp.test_utils import TestClient, TestServer
from click.testing import CliRunner, Result

from mcp_edge.controlplane.api.common import SERVICES
from mcp_edge.controlplane.api.deployments import DEPLOYMENTS
from mcp_edge.controlplane.app import create_app
from mcp_edge.controlplane.bootstrap import initialize
from mcp_edge.controlplane.broker.dynsec import DynsecProvisioner
from mcp_edge.controlplane.cli import main
from mcp_edge.controlplane.db import Database, registry
from mcp_edge.controlplane.db.deployments import DeviceModelView, VersionView
from mcp_edge.controlplane.deployments import DeploymentService
from mcp_edge.controlplane.desired import build_desired_state, downgrades
from mcp_edge.controlplane.ingest import IngestConnection
from mcp_edge.controlplane.mqtt import BrokerAddress
from mcp_edge.controlplane.repository.tuf_repo import KeyStore
from mcp_edge.controlplane.settings import PasswordCost, Settings, load_settings
from mcp_edge.shared.errors import ExpiredError
from mcp_edge.shared.protocol import topics
from mcp_edge.shared.protocol.canary import DEFAULT_CANARY_POLICY, CanaryPolicy
from mcp_edge.shared.protocol.state import (
    DesiredState,
    ModelStatus,
    ReportedState,
    verify_desired_state,
)
from mcp_edge.shared.signing import PrivateKey, PublicKey
from mcp_edge.shared.version import parse_version
from mcp_edge.tooling.mosquitto import DynsecMosquittoBroker
from tests.integration.conftest import MqttProbe
from tests.support.controlplane import (
    START,
    ControlPlane,
    FakeClock,
    FakeProvisioner,
    envelope,
    served,
)

DEADLINE_S = 30.0
ADMIN_PASSWORD = "correct horse battery"
TTL = timedelta(days=7)


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def version_row(model: str, version: str, profiles: tuple[str, ...] = ()) -> VersionView:
    return VersionView(
        model=model,
        version=version,
        version_numeric=parse_version(version).to_numeric(),
        target_path=f"{model}/{version}/{model}-{version}.mcpb",
        sha256=sha(model + version),
        length=1000 + len(version),
        profiles=profiles,
    )


async def publish_versions(
    db: Database, now: Any, model: str, *versions: str, profiles: tuple[str, ...] = ()
) -> None:
    """Record published versions the way the registry does (one row per version)."""
    async with db.transaction() as tx:
        for version in versions:
            v = version_row(model, version, profiles)
            await registry.insert_version(
                tx,
                model=v.model,
                version=v.version,
                version_numeric=v.version_numeric,
                target_path=v.target_path,
                sha256=v.sha256,
                length=v.length,
                format="onnx",
                profiles=list(v.profiles),
                variants=[],
                publisher_keyid="",
                uploaded_by="",
                now=now,
            )


async def until(check: Callable[[], Awaitable[Any]], what: str) -> Any:
    """Poll ``check`` until it returns something truthy; fail after DEADLINE_S."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        result = await check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}; last: {result!r}")
        await asyncio.sleep(0.05)


@dataclass
class Fleet:
    """The served control plane with a real broker, and helpers acting as devices."""

    cp: ControlPlane
    broker: DynsecMosquittoBroker
    db: Database
    service: DeploymentService
    token: str
    suffix: str = field(default_factory=lambda: secrets.token_hex(3))
    probes: list[MqttProbe] = field(default_factory=list)
    enrolled: list[str] = field(default_factory=list)
    director: list[PublicKey] = field(default_factory=list)

    def id(self, name: str) -> str:
        """A device id unique to this test, so retained messages of others never interfere."""
        return f"{name}-{self.suffix}"

    async def enroll(self, name: str, *, token: str | None = None, **kwargs: Any) -> Any:
        device_id = self.id(name)
        status, answer = await self.cp.enroll(
            PrivateKey.generate(), token or self.token, device_id=device_id, **kwargs
        )
        assert status == 200, answer
        self.enrolled.append(device_id)
        if answer["status"] == "accepted":
            self.director[:] = [PublicKey.from_hex(k) for k in answer["trust"]["director_keys"]]
        return answer

    async def device(self, name: str, **kwargs: Any) -> MqttProbe:
        """Enroll ``name``, connect as it and subscribe to its desired topic."""
        answer = await self.enroll(name, **kwargs)
        return await self.connect(answer)

    async def connect(self, answer: Any) -> MqttProbe:
        broker = answer["broker"]
        probe = MqttProbe(self.broker, broker["client_id"], broker["username"], broker["password"])
        self.probes.append(probe)
        assert await probe.connect() == "Success"
        assert await probe.subscribe(topics.desired(answer["device_id"])) == "Granted QoS 1"
        return probe

    async def desired(self, probe: MqttProbe, *, last_seq: int = 0) -> DesiredState:
        """The next desired state the device receives, verified as an agent verifies it."""
        message = await probe.next_message()
        return verify_desired_state(
            json.loads(message.payload),
            self.director,
            device_id=message.topic.split("/")[3],
            last_seq=last_seq,
            now=self.cp.clock(),
        )

    async def deploy(
        self, model: str, version: str, *, status: int = 201, token: str = "admin", **body: Any
    ) -> Any:
        selector = body.pop("selector")
        code, answer = await self.cp.call(
            "POST",
            "/api/v1/deployments",
            token=token,
            body={"model": model, "version": version, "selector": selector, **body},
        )
        assert code == status, answer
        return answer

    async def get(self, path: str, *, status: int = 200, **params: Any) -> Any:
        code, answer = await self.cp.call("GET", path, params=params or None)
        assert code == status, answer
        return answer


@asynccontextmanager
async def open_fleet(
    database_url: str, data_dir: Path, broker: DynsecMosquittoBroker
) -> AsyncIterator[Fleet]:
    """Initialize a control plane, serve it with ``broker`` (real accounts, ingestion and the
    desired-state session), and clear every retained desired state it left afterwards."""
    settings = Settings(
        data_dir=data_dir,
        database_url=database_url,
        password_cost=PasswordCost.MIN,
        broker_urls=(f"mqtt://{broker.host}:{broker.port}",),
    )
    clock = FakeClock()
    result = await initialize(
        settings, clock=clock, admin_user="admin", admin_password=ADMIN_PASSWORD
    )
    assert result.api_token is not None
    async with DynsecProvisioner(
        broker.host,
        broker.port,
        broker.admin_username,
        broker.admin_password,
    ) as provisioner:
        service = await provisioner.provision_service(f"cp-test-{secrets.token_hex(3)}")
        cleaner = await provisioner.provision_service(f"cp-clean-{secrets.token_hex(3)}")
        ingest = IngestConnection(BrokerAddress(broker.host, broker.port), service)
        app = create_app(settings, provisioner, clock, ingest=ingest)
        client: TestClient[Any, Any] = TestClient(TestServer(app))
        await client.start_server()
        cp = ControlPlane(client, provisioner, clock, result.api_token, settings)  # type: ignore[arg-type]
        token = (await cp.new_token(max_uses=20))["token"]
        f = Fleet(cp, broker, app[SERVICES].db, app[DEPLOYMENTS], token)
        try:
            yield f
        finally:
            for probe in f.probes:
                await probe.close()
            await client.close()
            if broker.running:
                probe = MqttProbe(broker, cleaner.client_id, cleaner.username, cleaner.password)
                assert await probe.connect() == "Success"
                for device_id in f.enrolled:
                    await probe.publish(topics.desired(device_id), b"", retain=True)
                await probe.close()


@pytest.fixture
async def fleet(
    database_url: str, tmp_path: Path, dynsec_broker: DynsecMosquittoBroker
) -> AsyncIterator[Fleet]:
    async with open_fleet(database_url, tmp_path / "cp", dynsec_broker) as f:
        yield f


# ---------------------------------------------------------------------------- one device
async def test_deploy_publishes_a_signed_retained_desired_state(fleet: Fleet) -> None:
    await publish_versions(fleet.db, fleet.cp.clock(), "digits", "1.0.0", "1.1.0", "1.2.0-rc1")
    cam = fleet.id("cam")
    probe = await fleet.device("cam")

    answer = await fleet.deploy("digits", "1.0.0", selector={"device_id": cam})
    assert answer["devices"] == [{"device_id": cam, "seq": 1, "published": True}]
    assert answer["deployment"]["devices_matched"] == 1
    state = await fleet.desired(probe)
    assert state.seq == 1 and state.device_id == cam
    assert state.expires - state.issued_at == TTL
    (model,) = state.models
    assert model.name == "digits" and model.stable.version == "1.0.0"
    assert model.stable.sha256 == sha("digits1.0.0") and not model.rollback
    assert model.stable.target_path == "digits/1.0.0/digits-1.0.0.mcpb"

    await fleet.deploy(
        "digits",
        "1.1.0",
        selector={"device_id": cam},
        canary={"version": "1.2.0-rc1", "weight": 0.25},
    )
    state = await fleet.desired(probe, last_seq=1)
    assert state.seq == 2
    assert state.models[0].stable.version == "1.1.0"
    assert state.models[0].canary is not None
    assert (state.models[0].canary.target.version, state.models[0].canary.weight) == (
        "1.2.0-rc1",
        0.25,
    )

    # Subscribing again (as after a restart) finds the newest document retained.
    assert await probe.unsubscribe(topics.desired(cam)) == "Success"
    assert await probe.subscribe(topics.desired(cam)) == "Granted QoS 1"
    message = await probe.next_message()
    assert message.retain
    assert (
        verify_desired_state(
            json.loads(message.payload),
            fleet.director,
            device_id=cam,
            last_seq=1,
            now=fleet.cp.clock(),
        ).seq
        == 2
    )

    shown = await fleet.get(f"/api/v1/devices/{cam}/desired")
    assert shown["seq"] == 2 and shown["published"] is True
    assert (
        verify_desired_state(
            shown["envelope"], fleet.director, device_id=cam, last_seq=1, now=fleet.cp.clock()
        ).seq
        == 2
    )
    history = (await fleet.get("/api/v1/deployments", model="digits"))["items"]
    assert [(d["version"], d["canary_version"]) for d in history] == [
        ("1.1.0", "1.2.0-rc1"),
        ("1.0.0", None),
    ]
    assert history[0]["created_by"] == "user:admin"
    audit = (await fleet.get("/api/v1/audit", action="deployment.created"))["items"]
    assert [e["detail"]["version"] for e in audit] == ["1.1.0", "1.0.0"]


# ---------------------------------------------------------------------------- groups
async def test_group_deploy_reaches_every_accepted_device_and_later_ones(fleet: Fleet) -> None:
    await publish_versions(fleet.db, fleet.cp.clock(), "digits", "1.0.0")
    group = fleet.id("line-a")
    in_group = (await fleet.cp.new_token(group=group, max_uses=10))["token"]
    manual = (await fleet.cp.new_token(group=group, approval="manual"))["token"]
    a = await fleet.device("cam-a", token=in_group)
    b = await fleet.device("cam-b", token=in_group)
    other = await fleet.device("cam-other")
    pending = await fleet.enroll("cam-pending", token=manual)
    assert pending["status"] == "pending"

    answer = await fleet.deploy("digits", "1.0.0", selector={"group": group})
    assert sorted(d["device_id"] for d in answer["devices"]) == [
        fleet.id("cam-a"),
        fleet.id("cam-b"),
    ]
    for probe in (a, b):
        state = await fleet.desired(probe)
        assert [m.stable.version for m in state.models] == ["1.0.0"]
    await fleet.get(f"/api/v1/devices/{fleet.id('cam-other')}/desired", status=404)
    await fleet.get(f"/api/v1/devices/{fleet.id('cam-pending')}/desired", status=404)
    assert other.messages.empty()

    # Accepted later, by enrollment or by approval: the standing deployment reaches both.
    late = await fleet.device("cam-late", token=in_group)
    assert [m.name for m in (await fleet.desired(late)).models] == ["digits"]
    code, _ = await fleet.cp.call(
        "POST", f"/api/v1/approvals/{fleet.id('cam-pending')}/approve", body={}
    )
    assert code == 200
    shown = await fleet.get(f"/api/v1/devices/{fleet.id('cam-pending')}/desired")
    assert shown["seq"] == 1 and shown["published"] is True
    assert shown["envelope"]["signed"]["models"][0]["stable"]["version"] == "1.0.0"

    # After a group undeploy, devices accepted later get nothing, the others lose the model.
    code, answer = await fleet.cp.call(
        "POST",
        "/api/v1/deployments/undeploy",
        body={"model": "digits", "selector": {"group": group}},
    )
    assert code == 200, answer
    assert len(answer["devices"]) == 4
    assert (await fleet.desired(a, last_seq=1)).models == []
    await fleet.enroll("cam-after", token=in_group)
    await fleet.get(f"/api/v1/devices/{fleet.id('cam-after')}/desired", status=404)


async def test_the_canary_policy_reaches_each_signed_desired_state(fleet: Fleet) -> None:
    await publish_versions(fleet.db, fleet.cp.clock(), "digits", "1.0.0", "1.1.0")
    group = fleet.id("line-c")
    token = (await fleet.cp.new_token(group=group, max_uses=5))["token"]
    first = await fleet.device("cam-first", token=token)
    canary = {"version": "1.1.0", "weight": 0.3, "max_error_rate": 0.5, "min_requests": 7}
    policy = CanaryPolicy(weight=0.3, max_error_rate=0.5, min_requests=7)

    answer = await fleet.deploy("digits", "1.0.0", selector={"group": group}, canary=canary)
    assert (
        answer["deployment"]["canary_max_error_rate"],
        answer["deployment"]["canary_min_requests"],
    ) == (0.5, 7)
    spec = (await fleet.desired(first)).models[0].canary
    assert spec is not None and (spec.target.version, spec.policy) == ("1.1.0", policy)
    # A device accepted later gets the standing deployment with its policy.
    late = await fleet.device("cam-late", token=token)
    spec = (await fleet.desired(late)).models[0].canary
    assert spec is not None and spec.policy == policy
    desired = (await fleet.get(f"/api/v1/devices/{fleet.id('cam-late')}/models"))["items"][0]
    assert (
        desired["desired"]["canary_max_error_rate"],
        desired["desired"]["canary_min_requests"],
    ) == (0.5, 7)

    # A canary given only its version gets the default policy, error budget included.
    await fleet.deploy("digits", "1.0.0", selector={"group": group}, canary={"version": "1.1.0"})
    spec = (await fleet.desired(first, last_seq=1)).models[0].canary
    assert spec is not None and spec.policy == DEFAULT_CANARY_POLICY
    for bad in (
        {"min_requests": 0},
        {"min_requests": DEFAULT_CANARY_POLICY.window + 1},
        {"max_error_rate": 1.5},
        {"window": 50},
    ):
        refused = await fleet.deploy(
            "digits",
            "1.0.0",
            selector={"group": group},
            status=400,
            canary={"version": "1.1.0", **bad},
        )
        assert next(iter(bad)) in refused["error"], refused


async def test_label_deploy_skips_devices_whose_profile_no_variant_fits(fleet: Fleet) -> None:
    await publish_versions(
        fleet.db, fleet.cp.clock(), "detector", "2.0.0", profiles=("jetson-orin",)
    )
    site = {"site": fleet.id("f1")}
    await fleet.enroll("orin", labels=site, profile="jetson-orin")
    await fleet.enroll("x86", labels=site, profile="generic-x86_64")
    answer = await fleet.deploy("detector", "2.0.0", selector={"labels": site})
    assert [d["device_id"] for d in answer["devices"]] == [fleet.id("orin")]
    assert "generic-x86_64" in answer["skipped"][fleet.id("x86")]
    code, refused = await fleet.cp.call(
        "POST",
        "/api/v1/deployments",
        body={"model": "detector", "version": "2.0.0", "selector": {"device_id": fleet.id("x86")}},
    )
    assert code == 409 and "jetson-orin" in refused["error"]


# ---------------------------------------------------------------------------- refusals
async def test_downgrade_needs_rollback(fleet: Fleet) -> None:
    await publish_versions(fleet.db, fleet.cp.clock(), "digits", "1.0.0", "1.1.0")
    cam = fleet.id("cam")
    probe = await fleet.device("cam")
    await fleet.deploy("digits", "1.1.0", selector={"device_id": cam})
    assert (await fleet.desired(probe)).seq == 1

    refused = await fleet.deploy("digits", "1.0.0", selector={"device_id": cam}, status=409)
    assert cam in refused["error"] and "rollback" in refused["error"]
    assert (await fleet.get(f"/api/v1/devices/{cam}/desired"))["seq"] == 1

    await fleet.deploy("digits", "1.0.0", selector={"device_id": cam}, rollback=True)
    state = await fleet.desired(probe, last_seq=1)
    assert state.seq == 2
    assert state.models[0].stable.version == "1.0.0" and state.models[0].rollback is True


async def test_canary_or_shadow_below_the_current_version_needs_rollback(fleet: Fleet) -> None:
    await publish_versions(fleet.db, fleet.cp.clock(), "digits", "0.9.0", "1.0.0", "1.1.0")
    cam = fleet.id("cam")
    probe = await fleet.device("cam")
    await fleet.deploy("digits", "1.1.0", selector={"device_id": cam})
    assert (await fleet.desired(probe)).seq == 1

    for extra in ({"canary": {"version": "0.9.0", "weight": 1.0}}, {"shadow": "1.0.0"}):
        refused = await fleet.deploy(
            "digits", "1.1.0", selector={"device_id": cam}, status=409, **extra
        )
        assert cam in refused["error"] and "rollback" in refused["error"], refused
        assert "canary" in refused["error"] or "shadow" in refused["error"], refused
    assert (await fleet.get(f"/api/v1/devices/{cam}/desired"))["seq"] == 1

    await fleet.deploy(
        "digits",
        "1.1.0",
        selector={"device_id": cam},
        rollback=True,
        canary={"version": "0.9.0", "weight": 0.5},
    )
    state = await fleet.desired(probe, last_seq=1)
    assert state.seq == 2 and state.models[0].canary is not None
    assert state.models[0].canary.target.version == "0.9.0" and state.models[0].rollback


async def test_refusals_name_the_problem(fleet: Fleet) -> None:
    await publish_versions(fleet.db, fleet.cp.clock(), "digits", "1.0.0", "1.1.0")
    cam = fleet.id("cam")
    await fleet.enroll("cam")
    dev = {"device_id": cam}
    assert "9.9.9" in (await fleet.deploy("digits", "9.9.9", selector=dev, status=404))["error"]
    assert "nope" in (await fleet.deploy("nope", "1.0.0", selector=dev, status=404))["error"]
    await fleet.deploy("digits", "1.0.0", selector={"device_id": fleet.id("ghost")}, status=404)
    await fleet.deploy("digits", "1.0.0", selector={"device_id": cam, "group": "g"}, status=400)
    await fleet.deploy(
        "digits", "1.0.0", selector=dev, status=400, shadow="1.1.0", canary={"version": "1.1.0"}
    )
    await fleet.deploy(
        "digits", "1.0.0", selector=dev, status=400, canary={"version": "1.1.0", "weight": 1.5}
    )
    pending = (await fleet.cp.new_token(approval="manual"))["token"]
    await fleet.enroll("waiting", token=pending)
    refused = await fleet.deploy(
        "digits", "1.0.0", selector={"device_id": fleet.id("waiting")}, status=409
    )
    assert "pending" in refused["error"]
    code, answer = await fleet.cp.call("DELETE", f"/api/v1/devices/{cam}/models/digits")
    assert code == 404, answer
    assert (await fleet.get("/api/v1/deployments"))["items"] == []


async def test_viewer_reads_but_cannot_deploy(fleet: Fleet) -> None:
    await publish_versions(fleet.db, fleet.cp.clock(), "digits", "1.0.0")
    cam = fleet.id("cam")
    await fleet.enroll("cam")
    viewer = await fleet.cp.user_token("watcher", "viewer")
    await fleet.deploy("digits", "1.0.0", selector={"device_id": cam}, token=viewer, status=403)
    code, _ = await fleet.cp.call("DELETE", f"/api/v1/devices/{cam}/models/digits", token=viewer)
    assert code == 403
    await fleet.deploy("digits", "1.0.0", selector={"device_id": cam})
    code, answer = await fleet.cp.call("GET", f"/api/v1/devices/{cam}/desired", token=viewer)
    assert code == 200 and answer["seq"] == 1
    code, _ = await fleet.cp.call("GET", "/api/v1/deployments", token=viewer)
    assert code == 200


# ---------------------------------------------------------------------------- upkeep
async def test_documents_are_re_signed_at_half_their_lifetime(fleet: Fleet) -> None:
    await publish_versions(fleet.db, fleet.cp.clock(), "digits", "1.0.0")
    cam = fleet.id("cam")
    probe = await fleet.device("cam")
    await fleet.deploy("digits", "1.0.0", selector={"device_id": cam})
    first = await fleet.desired(probe)
    first_envelope = (await fleet.get(f"/api/v1/devices/{cam}/desired"))["envelope"]

    fleet.cp.clock.advance(days=3, hours=12, seconds=-1)
    await fleet.service.maintain()
    assert (await fleet.get(f"/api/v1/devices/{cam}/desired"))["seq"] == 1

    fleet.cp.clock.advance(seconds=2)
    fleet.service.wake()  # the background task's next round, now
    second = await fleet.desired(probe, last_seq=first.seq)
    assert second.seq == 2 and second.models == first.models
    assert second.expires == fleet.cp.clock() + TTL
    # Four days on, the first document has expired (a device holding only it freezes); the
    # re-signed one is still good.
    fleet.cp.clock.advance(days=4)
    with pytest.raises(ExpiredError):
        verify_desired_state(
            first_envelope, fleet.director, device_id=cam, last_seq=0, now=fleet.cp.clock()
        )
    second_envelope = (await fleet.get(f"/api/v1/devices/{cam}/desired"))["envelope"]
    assert (
        verify_desired_state(
            second_envelope, fleet.director, device_id=cam, last_seq=1, now=fleet.cp.clock()
        ).seq
        == 2
    )


async def test_broker_down_at_deploy_publishes_once_it_returns(
    database_url: str, tmp_path: Path, fresh_dynsec_broker: DynsecMosquittoBroker
) -> None:
    async with open_fleet(database_url, tmp_path / "cp", fresh_dynsec_broker) as fleet:
        await publish_versions(fleet.db, fleet.cp.clock(), "digits", "1.0.0")
        cam = fleet.id("cam")
        answer = await fleet.enroll("cam")
        fresh_dynsec_broker.kill()

        result = await fleet.deploy("digits", "1.0.0", selector={"device_id": cam})
        assert result["devices"] == [{"device_id": cam, "seq": 1, "published": False}]
        assert "wait for the broker" in result["message"]
        shown = await fleet.get(f"/api/v1/devices/{cam}/desired")
        assert shown["seq"] == 1 and shown["published"] is False

        fresh_dynsec_broker.start()

        async def published() -> bool:
            return bool((await fleet.get(f"/api/v1/devices/{cam}/desired"))["published"])

        await until(published, "the desired state published after the broker returned")
        probe = await fleet.connect(answer)
        state = await fleet.desired(probe)
        assert state.seq == 1 and state.models[0].stable.version == "1.0.0"


# ---------------------------------------------------------------------------- desired vs reported
async def test_models_view_compares_desired_and_reported_and_delete_removes(fleet: Fleet) -> None:
    await publish_versions(fleet.db, fleet.cp.clock(), "digits", "1.0.0")
    await publish_versions(fleet.db, fleet.cp.clock(), "iris", "0.1.0")
    cam = fleet.id("cam")
    probe = await fleet.device("cam")
    await fleet.deploy("digits", "1.0.0", selector={"device_id": cam})
    await fleet.deploy("iris", "0.1.0", selector={"device_id": cam})
    state = await fleet.desired(probe)
    state = await fleet.desired(probe, last_seq=state.seq)
    assert [m.name for m in state.models] == ["digits", "iris"]

    view = await fleet.get(f"/api/v1/devices/{cam}/models")
    assert view["desired_seq"] == 2 and view["applied_seq"] is None
    assert [(m["model"], m["in_sync"]) for m in view["items"]] == [
        ("digits", False),
        ("iris", False),
    ]

    reported = ReportedState(
        device_id=cam,
        ts=time.time(),
        applied_seq=2,
        profile="generic-x86_64",
        models=[
            ModelStatus(name="digits", phase="active", active_version="1.0.0"),
            ModelStatus(name="iris", phase="downloading"),
        ],
    )
    await probe.publish(topics.reported(cam), reported.model_dump_json().encode(), retain=True)

    async def applied() -> Any:
        answer = await fleet.get(f"/api/v1/devices/{cam}/models")
        return answer if answer["applied_seq"] == 2 else None

    view = await until(applied, "the reported state ingested")
    items = {m["model"]: m for m in view["items"]}
    assert items["digits"]["in_sync"] is True
    assert items["digits"]["reported"]["active_version"] == "1.0.0"
    assert items["iris"]["in_sync"] is False and items["iris"]["reported"]["phase"] == "downloading"

    code, answer = await fleet.cp.call("DELETE", f"/api/v1/devices/{cam}/models/iris")
    assert code == 200, answer
    assert answer["devices"] == [{"device_id": cam, "seq": 3, "published": True}]
    state = await fleet.desired(probe, last_seq=2)
    assert [m.name for m in state.models] == ["digits"]
    items = {m["model"]: m for m in (await fleet.get(f"/api/v1/devices/{cam}/models"))["items"]}
    assert items["iris"]["desired"] is None and items["digits"]["in_sync"] is False  # seq 3 new
    removed = (await fleet.get("/api/v1/audit", action="deployment.removed"))["items"]
    assert removed[0]["detail"]["selector"] == f"device {cam}"
    await probe.publish(topics.reported(cam), b"", retain=True)


# ---------------------------------------------------------------------------- CLI
@dataclass
class CliFleet:
    url: str
    token: str
    settings: Settings
    clock: FakeClock

    def run(self, *args: str, ok: bool = True) -> Result:
        env = {"MCP_SERVER": self.url, "MCP_TOKEN": self.token}
        result = CliRunner(env=env).invoke(main, list(args), catch_exceptions=False)
        if ok:
            assert result.exit_code == 0, result.output
        else:
            assert result.exit_code != 0, result.output
        return result


@pytest.fixture
def cli_fleet(tmp_path: Path) -> Iterator[CliFleet]:
    """``mcp-controlplane init`` + a served control plane without a broker."""
    data_dir = tmp_path / "cp"
    password = tmp_path / "admin.pw"
    password.write_text(ADMIN_PASSWORD + "\n")
    result = CliRunner().invoke(
        main,
        [
            "init",
            "--data-dir",
            str(data_dir),
            "--admin-password-file",
            str(password),
            "--listen",
            "127.0.0.1:0",
            "--broker-url",
            "mqtt://broker.test:1883",
        ],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    settings = load_settings(data_dir, environ={})
    clock = FakeClock()

    async def record() -> None:
        db = Database(settings.effective_database_url)
        try:
            await publish_versions(db, clock(), "digits", "1.0.0", "1.1.0")
        finally:
            await db.dispose()

    asyncio.run(record())
    with served(settings, FakeProvisioner(), clock) as url:
        yield CliFleet(url, result.stdout.strip().splitlines()[-1], settings, clock)


def test_cli_round_trip(cli_fleet: CliFleet) -> None:
    token = cli_fleet.run("tokens", "create", "--group", "line-a").stdout.strip().splitlines()[-1]
    body = orjson.dumps(
        envelope(PrivateKey.generate(), token, now=cli_fleet.clock(), device_id="cam-1")
    )
    request = urllib.request.Request(
        cli_fleet.url + "/api/v1/enroll", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        assert json.loads(response.read())["status"] == "accepted"

    out = cli_fleet.run("deploy", "digits", "1.1.0", "--group", "line-a")
    assert "cam-1  seq 1  not published yet" in out.stdout
    assert "no broker configured" in out.stderr

    shown = cli_fleet.run("desired", "show", "cam-1")
    assert "seq 1" in shown.stdout and "published not yet" in shown.stdout
    assert "digits" in shown.stdout and "1.1.0" in shown.stdout
    signed = json.loads(cli_fleet.run("desired", "show", "cam-1", "--envelope").stdout)
    director = KeyStore(cli_fleet.settings.data_dir / "keys").load("director").public_key
    assert (
        verify_desired_state(
            signed, [director], device_id="cam-1", last_seq=0, now=cli_fleet.clock()
        )
        .models[0]
        .stable.version
        == "1.1.0"
    )

    refused = cli_fleet.run("deploy", "digits", "1.0.0", "--device", "cam-1", ok=False)
    assert "rollback" in refused.output and "cam-1" in refused.output
    out = cli_fleet.run("deploy", "digits", "1.0.0", "--device", "cam-1", "--rollback")
    assert "seq 2" in out.stdout
    assert "rollback" in cli_fleet.run("deployments", "list").stdout

    usage = cli_fleet.run("deploy", "digits", "1.0.0", ok=False)
    assert "exactly one of --device, --group or --label" in usage.output
    usage = cli_fleet.run(
        "deploy", "digits", "1.0.0", "--device", "cam-1", "--weight", "0.2", ok=False
    )
    assert "--canary" in usage.output
    missing = cli_fleet.run("deploy", "digits", "7.0.0", "--device", "cam-1", ok=False)
    assert "7.0.0" in missing.output and "404" in missing.output

    out = cli_fleet.run("undeploy", "digits", "--device", "cam-1")
    assert "seq 3" in out.stdout
    models = cli_fleet.run("desired", "models", "cam-1")
    assert "desired seq 3" in models.stdout and "digits" not in models.stdout
    listed = json.loads(cli_fleet.run("deployments", "list", "--json").stdout)
    assert [d["action"] for d in listed] == ["undeploy", "deploy", "deploy"]


def test_cli_deploy_sets_the_canary_policy(cli_fleet: CliFleet) -> None:
    token = cli_fleet.run("tokens", "create").stdout.strip().splitlines()[-1]
    body = orjson.dumps(
        envelope(PrivateKey.generate(), token, now=cli_fleet.clock(), device_id="cam-2")
    )
    request = urllib.request.Request(
        cli_fleet.url + "/api/v1/enroll", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        assert json.loads(response.read())["status"] == "accepted"

    cli_fleet.run(
        "deploy",
        "digits",
        "1.0.0",
        "--device",
        "cam-2",
        "--canary",
        "1.1.0",
        "--weight",
        "0.2",
        "--max-error-rate",
        "0.5",
        "--min-requests",
        "7",
    )
    signed = json.loads(cli_fleet.run("desired", "show", "cam-2", "--envelope").stdout)
    director = KeyStore(cli_fleet.settings.data_dir / "keys").load("director").public_key
    state = verify_desired_state(
        signed, [director], device_id="cam-2", last_seq=0, now=cli_fleet.clock()
    )
    spec = state.models[0].canary
    assert spec is not None
    assert spec.policy == CanaryPolicy(weight=0.2, max_error_rate=0.5, min_requests=7)

    usage = cli_fleet.run(
        "deploy", "digits", "1.0.0", "--device", "cam-2", "--max-error-rate", "0.5", ok=False
    )
    assert "--canary" in usage.output
    usage = cli_fleet.run(
        "deploy",
        "digits",
        "1.0.0",
        "--device",
        "cam-2",
        "--canary",
        "1.1.0",
        "--min-requests",
        "0",
        ok=False,
    )
    assert "--min-requests" in usage.output


# ---------------------------------------------------------------------------- pure core
def test_downgrade_counts_what_a_device_reports_running() -> None:
    known = {"1.0.0": parse_version("1.0.0").to_numeric()}
    target = parse_version("1.5.0").to_numeric()
    below = downgrades(
        target,
        desired={"a": "1.0.0", "b": "1.0.0"},
        reported={"b": "2.0.0", "c": "1.5.0-rc1", "d": "not-semver"},
        known=known,
    )
    assert below == {"b": "2.0.0"}  # an rc of the same release is below it; junk is ignored
    assert downgrades(parse_version("1.5.0-rc1").to_numeric(), {}, {"c": "1.5.0"}, {}) == {
        "c": "1.5.0"
    }


def test_a_model_whose_version_vanished_is_left_out_of_the_document() -> None:
    v = version_row("digits", "1.0.0")
    models = [DeviceModelView("cam", "digits", "1.0.0"), DeviceModelView("cam", "iris", "0.1.0")]
    state = build_desired_state("cam", 4, START, TTL, models, {("digits", "1.0.0"): v})
    assert [m.name for m in state.models] == ["digits"]
    assert (state.seq, state.expires) == (4, START + TTL)
