"""The control plane's REST API end to end, on SQLite and on PostgreSQL.

Each test runs `init` (migrations, first admin, API token) against a fresh database, serves the
real app through aiohttp's test server, and enrolls devices with real signed envelopes. The
broker side is a fake provisioner implementing our `BrokerProvisioner` protocol.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from mcp_edge.controlplane.db import Database
from mcp_edge.controlplane.db.migrate import head_revision, schema_differences
from mcp_edge.controlplane.settings import EnrollmentApproval, PasswordCost, Settings
from mcp_edge.shared.protocol.enrollment import nonce_retention
from mcp_edge.shared.signing import PrivateKey
from tests.support.controlplane import (
    ADMIN_PASSWORD,
    ControlPlane,
    FakeClock,
    envelope,
    start_control_plane,
)

BROKER_URL = "mqtt://broker.test:1883"


MakeControlPlane = Callable[..., Awaitable[ControlPlane]]


@pytest.fixture
async def make_cp(database_url: str, tmp_path: Path) -> AsyncIterator[MakeControlPlane]:
    clients: list[TestClient[Any, Any]] = []

    async def make(**overrides: Any) -> ControlPlane:
        settings = Settings(
            data_dir=tmp_path / "cp",
            database_url=database_url,
            password_cost=PasswordCost.MIN,
            broker_urls=(BROKER_URL,),
            **overrides,
        )
        cp = await start_control_plane(settings, FakeClock())
        clients.append(cp.client)
        return cp

    yield make
    for client in clients:
        await client.close()


@pytest.fixture
async def cp(make_cp: MakeControlPlane) -> ControlPlane:
    return await make_cp()


async def test_enroll_two_devices_filter_label_revoke_and_audit(cp: ControlPlane) -> None:
    token = await cp.new_token(group="line-a", labels={"site": "f1"}, max_uses=5)
    assert token["token"].startswith("mcpe_") and token["state"] == "active"
    key_a, key_b = PrivateKey.generate(), PrivateKey.generate()

    status, a = await cp.enroll(key_a, token["token"], device_id="cam-a", labels={"rack": "1"})
    assert status == 200, a
    assert a["status"] == "accepted" and a["device_id"] == "cam-a"
    assert a["broker"]["urls"] == [BROKER_URL]
    assert a["broker"]["client_id"] == "cam-a" and a["broker"]["password"].startswith("pw-cam-a")
    assert a["topic_prefix"] == "mcp/v1" and "trust" in a
    status, b = await cp.enroll(key_b, token["token"], profile="raspberry-pi")
    assert status == 200, b
    b_id = b["device_id"]
    assert b_id.startswith("dev-")
    assert cp.provisioner.provisioned == ["cam-a", b_id]

    status, listing = await cp.call("GET", "/api/v1/devices")
    assert status == 200 and listing["total"] == 2
    by_id = {d["id"]: d for d in listing["items"]}
    assert by_id["cam-a"]["labels"] == {"rack": "1", "site": "f1"}
    assert by_id["cam-a"]["group"] == "line-a" and by_id[b_id]["profile"] == "raspberry-pi"

    async def ids(**params: Any) -> set[str]:
        status, answer = await cp.call("GET", "/api/v1/devices", params=params)
        assert status == 200, answer
        return {d["id"] for d in answer["items"]}

    assert await ids(label="site=f1") == {"cam-a", b_id}
    assert await ids(label="rack=1") == {"cam-a"}
    assert await ids(label="rack") == {"cam-a"}
    assert await ids(profile="raspberry-pi") == {b_id}
    assert await ids(status="accepted", group="line-a") == {"cam-a", b_id}
    assert await ids(status="pending") == set()
    assert await ids(status="offline") == {"cam-a", b_id}

    status, detail = await cp.call(
        "PATCH", "/api/v1/devices/cam-a/labels", body={"set": {"env": "prod"}, "remove": ["rack"]}
    )
    assert status == 200, detail
    assert detail["labels"] == {"env": "prod", "site": "f1"} and detail["facts"]["cpu_count"] == 4
    assert await ids(label="env=prod") == {"cam-a"}

    status, revoked = await cp.call(
        "POST", f"/api/v1/devices/{b_id}/revoke", body={"reason": "lost"}
    )
    assert status == 200 and revoked["status"] == "revoked"
    assert cp.provisioner.disabled == [b_id]
    status, again = await cp.enroll(key_b, token["token"])
    assert status == 403 and "revoked" in again["error"]

    status, log = await cp.call("GET", "/api/v1/audit")
    assert status == 200
    actions = [e["action"] for e in log["items"]]
    for expected in (
        "user.created",
        "api_token.created",
        "enrollment_token.created",
        "device.enrolled",
        "device.labels_changed",
        "device.revoked",
    ):
        assert expected in actions
    assert actions.count("device.enrolled") == 2
    revoke_entry = next(e for e in log["items"] if e["action"] == "device.revoked")
    assert revoke_entry["actor"] == "user:admin" and revoke_entry["target_id"] == b_id
    assert revoke_entry["detail"] == {"reason": "lost"}
    status, tokens = await cp.call("GET", "/api/v1/enrollment-tokens")
    assert tokens["items"][0]["uses"] == 2 and "token" not in tokens["items"][0]


async def test_replayed_envelope_is_refused(cp: ControlPlane) -> None:
    token = await cp.new_token()
    env = envelope(PrivateKey.generate(), token["token"], now=cp.clock())
    status, first = await cp.call("POST", "/api/v1/enroll", token=None, body=env)
    assert status == 200, first
    status, second = await cp.call("POST", "/api/v1/enroll", token=None, body=env)
    assert status == 409 and "replayed" in second["error"]
    # Still refused near the end of the clock-skew window, when the nonce must still be known.
    cp.clock.advance(seconds=nonce_retention().total_seconds() / 2 - 1)
    assert (await cp.call("POST", "/api/v1/enroll", token=None, body=env))[0] == 409
    # A refused enrollment spends its nonce too: the same envelope cannot succeed later.
    key = PrivateKey.generate()
    bad = envelope(key, "mcpe_unknown-token", now=cp.clock())
    assert (await cp.call("POST", "/api/v1/enroll", token=None, body=bad))[0] == 403
    assert (await cp.call("POST", "/api/v1/enroll", token=None, body=bad))[0] == 409


@pytest.mark.parametrize("case", ["expired", "used_up", "revoked", "unknown"])
async def test_unusable_tokens_are_refused(cp: ControlPlane, case: str) -> None:
    token = await cp.new_token(max_uses=1, expires_in_s=3600)
    secret = token["token"]
    if case == "expired":
        cp.clock.advance(hours=1, seconds=1)
        message = "expired"
    elif case == "used_up":
        assert (await cp.enroll(PrivateKey.generate(), secret))[0] == 200
        message = "no uses left"
    elif case == "revoked":
        status, answer = await cp.call("DELETE", f"/api/v1/enrollment-tokens/{token['id']}")
        assert status == 200 and answer["state"] == "revoked"
        message = "revoked"
    else:
        secret = "mcpe_" + "x" * 40
        message = "not recognised"
    status, answer = await cp.enroll(PrivateKey.generate(), secret)
    assert status == 403 and message in answer["error"] and answer["code"] == "forbidden"
    status, listing = await cp.call("GET", "/api/v1/devices")
    assert listing["total"] == (1 if case == "used_up" else 0)


async def test_concurrent_enrollments_share_the_last_uses_exactly(cp: ControlPlane) -> None:
    token = await cp.new_token(max_uses=5)
    results = await asyncio.gather(
        *(cp.enroll(PrivateKey.generate(), token["token"]) for _ in range(12))
    )
    statuses = sorted(status for status, _ in results)
    assert statuses == [200] * 5 + [403] * 7, results
    assert all("no uses left" in a["error"] for s, a in results if s == 403)
    assert (await cp.call("GET", "/api/v1/devices"))[1]["total"] == 5
    assert len(cp.provisioner.provisioned) == 5


async def test_manual_approval_flow(cp: ControlPlane) -> None:
    token = await cp.new_token(approval="manual", labels={"site": "f2"})
    key, other = PrivateKey.generate(), PrivateKey.generate()
    status, answer = await cp.enroll(key, token["token"], device_id="gate-1")
    assert status == 200 and answer["status"] == "pending"
    assert answer["poll_after_s"] == cp.settings.poll_after_s and "broker" not in answer
    assert cp.provisioner.provisioned == []
    status, pending = await cp.call("GET", "/api/v1/approvals")
    assert [d["id"] for d in pending["items"]] == ["gate-1"]

    status, answer = await cp.enroll(key, token["token"])  # polling: still pending
    assert answer["status"] == "pending" and answer["device_id"] == "gate-1"
    status, approved = await cp.call("POST", "/api/v1/approvals/gate-1/approve", body={})
    assert status == 200 and approved["status"] == "accepted"
    status, answer = await cp.enroll(key, token["token"])
    assert answer["status"] == "accepted" and answer["broker"]["username"] == "gate-1"
    assert (await cp.call("POST", "/api/v1/approvals/gate-1/approve"))[0] == 409

    assert (await cp.enroll(other, token["token"], device_id="gate-2"))[1]["status"] == "pending"
    status, rejected = await cp.call(
        "POST", "/api/v1/approvals/gate-2/reject", body={"reason": "unknown box"}
    )
    assert status == 200 and rejected["status"] == "rejected"
    status, answer = await cp.enroll(other, token["token"])
    assert status == 403 and "rejected" in answer["error"]
    assert (await cp.call("GET", "/api/v1/approvals"))[1]["items"] == []


async def test_server_policy_manual_overrides_auto_tokens(make_cp: MakeControlPlane) -> None:
    cp = await make_cp(enrollment_approval=EnrollmentApproval.MANUAL)
    token = await cp.new_token(approval="auto")
    status, answer = await cp.enroll(PrivateKey.generate(), token["token"])
    assert status == 200 and answer["status"] == "pending"


async def test_preauthorized_key_is_accepted_without_a_token(cp: ControlPlane) -> None:
    key = PrivateKey.generate()
    body = {
        "public_key": key.public_key.raw.hex(),
        "device_id": "kiosk-7",
        "labels": {"site": "hq"},
        "group": "kiosks",
    }
    status, pre = await cp.call("POST", "/api/v1/preauthorizations", body=body)
    assert status == 201 and pre["status"] == "preauthorized"
    assert (await cp.call("POST", "/api/v1/preauthorizations", body=body))[0] == 409

    status, answer = await cp.enroll(key, "not-a-real-token", labels={"site": "x", "cam": "2"})
    assert status == 200 and answer["status"] == "accepted" and answer["device_id"] == "kiosk-7"
    status, detail = await cp.call("GET", "/api/v1/devices/kiosk-7")
    assert detail["labels"] == {"site": "hq", "cam": "2"} and detail["group"] == "kiosks"
    assert detail["enrollment_token_id"] is None and detail["accepted_at"] is not None


async def test_reenroll_is_a_noop_unless_forced(cp: ControlPlane) -> None:
    token = await cp.new_token(max_uses=1)
    key = PrivateKey.generate()
    status, first = await cp.enroll(key, token["token"], profile="generic-x86_64")
    assert status == 200
    device_id = first["device_id"]
    status, again = await cp.enroll(key, token["token"], profile="jetson-orin", labels={"a": "b"})
    assert status == 200 and again["device_id"] == device_id and again["status"] == "accepted"
    assert "already enrolled" in again["message"]
    status, detail = await cp.call("GET", f"/api/v1/devices/{device_id}")
    assert detail["profile"] == "generic-x86_64" and "a" not in detail["labels"]
    status, listing = await cp.call("GET", f"/api/v1/enrollment-tokens/{token['id']}")
    assert listing["uses"] == 1  # the no-op took no use (the token has none left anyway)

    status, forced = await cp.enroll(key, token["token"], force=True, profile="jetson-orin")
    assert status == 200 and forced["device_id"] == device_id and forced["message"] == "re-enrolled"
    status, detail = await cp.call("GET", f"/api/v1/devices/{device_id}")
    assert detail["profile"] == "jetson-orin"
    actions = [e["action"] for e in (await cp.call("GET", "/api/v1/audit"))[1]["items"]]
    assert actions.count("device.reenrolled") == 1 and actions.count("device.enrolled") == 1


async def test_roles_viewer_and_operator(cp: ControlPlane) -> None:
    viewer = await cp.user_token("vera", "viewer")
    operator = await cp.user_token("otto", "operator")
    status, answer = await cp.call("POST", "/api/v1/enrollment-tokens", token=viewer, body={})
    assert status == 403 and answer["code"] == "forbidden" and "operator" in answer["error"]
    assert (await cp.call("GET", "/api/v1/devices", token=viewer))[0] == 200
    assert (await cp.call("GET", "/api/v1/audit", token=viewer))[0] == 403
    assert (await cp.call("POST", "/api/v1/enrollment-tokens", token=operator, body={}))[0] == 201
    status, _ = await cp.call(
        "POST",
        "/api/v1/users",
        token=operator,
        body={"username": "eve", "password": "12345678", "role": "admin"},
    )
    assert status == 403
    status, me = await cp.call("GET", "/api/v1/auth/whoami", token=viewer)
    assert me["username"] == "vera" and me["role"] == "viewer"


async def test_unauthenticated_requests_get_401(cp: ControlPlane) -> None:
    status, answer = await cp.call("GET", "/api/v1/devices", token=None)
    assert status == 401 and answer["code"] == "unauthorized"
    assert (await cp.call("GET", "/api/v1/devices", token="mcpa_nonsense"))[0] == 401
    status, answer = await cp.call(
        "POST",
        "/api/v1/auth/login",
        token=None,
        body={"username": "admin", "password": "wrong password"},
    )
    assert status == 401 and "wrong username or password" in answer["error"]

    short_lived = await cp.login("admin", ADMIN_PASSWORD)
    assert (await cp.call("GET", "/api/v1/devices", token=short_lived))[0] == 200
    cp.clock.advance(days=31)
    assert (await cp.call("GET", "/api/v1/devices", token=short_lived))[0] == 401

    fresh = await cp.login_answer("admin", ADMIN_PASSWORD)
    status, mine = await cp.call("GET", "/api/v1/api-tokens", token=fresh["token"])
    assert fresh["id"] in [t["id"] for t in mine["items"]]
    assert all("token" not in t for t in mine["items"])
    assert (await cp.call("DELETE", f"/api/v1/api-tokens/{fresh['id']}"))[0] == 200
    status, answer = await cp.call("GET", "/api/v1/devices", token=fresh["token"])
    assert status == 401 and "revoked" in answer["error"]

    await cp.user_token("dora", "viewer")
    assert (await cp.call("PATCH", "/api/v1/users/dora", body={"disabled": True}))[0] == 200
    status, answer = await cp.call(
        "POST",
        "/api/v1/auth/login",
        token=None,
        body={"username": "dora", "password": "dora-password"},
    )
    assert status == 401 and "disabled" in answer["error"]


async def test_nul_characters_are_refused_with_400_on_every_database(cp: ControlPlane) -> None:
    # PostgreSQL text cannot hold NUL: without the check these reached the database as a 500.
    cases: list[tuple[str, str, dict[str, Any]]] = [
        ("GET", "/api/v1/audit", {"params": {"action": "device.\x00accepted"}}),
        ("GET", "/api/v1/audit", {"params": {"target_id": "\x00"}}),
        ("GET", "/api/v1/devices", {"params": {"q": "cam\x00"}}),
        ("POST", "/api/v1/enrollment-tokens", {"body": {"description": "line\x00a"}}),
    ]
    for method, path, kwargs in cases:
        status, answer = await cp.call(method, path, **kwargs)
        assert status == 400 and "NUL" in answer["error"], (path, kwargs, answer)


async def test_malformed_requests_get_400(cp: ControlPlane) -> None:
    json_headers = {"Content-Type": "application/json"}
    cases: list[tuple[str, str, dict[str, Any]]] = [
        ("POST", "/api/v1/enrollment-tokens", {"raw": b"{not json", "headers": json_headers}),
        ("POST", "/api/v1/enrollment-tokens", {"body": {"max_uses": 0}}),
        ("POST", "/api/v1/enrollment-tokens", {"body": {"groop": "typo"}}),
        ("POST", "/api/v1/enrollment-tokens", {"body": {"labels": {"Bad Key": "v"}}}),
        ("POST", "/api/v1/enroll", {"token": None, "body": {"hello": "world"}}),
        ("POST", "/api/v1/enroll", {"token": None, "body": [1, 2, 3]}),
        ("GET", "/api/v1/devices", {"params": {"status": "sleeping"}}),
        ("GET", "/api/v1/devices", {"params": {"limit": "lots"}}),
        ("GET", "/api/v1/devices", {"params": {"colour": "blue"}}),
        ("POST", "/api/v1/preauthorizations", {"body": {"public_key": "zz"}}),
        ("PATCH", "/api/v1/devices/x/labels", {"body": {"set": {"a": "b"}, "remove": ["a"]}}),
    ]
    for method, path, kwargs in cases:
        status, answer = await cp.call(method, path, **kwargs)
        assert status == 400, (path, kwargs, answer)
        assert answer["code"] == "bad_request" and answer["error"]

    status, answer = await cp.call(
        "POST",
        "/api/v1/enrollment-tokens",
        raw=b"group=a",
        headers={"Content-Type": "application/x-www-form-urlencoded"},
    )
    assert status == 415
    token = await cp.new_token()
    env = envelope(PrivateKey.generate(), token["token"], now=cp.clock())
    env["signed"]["profile"] = "tampered"
    status, answer = await cp.call("POST", "/api/v1/enroll", token=None, body=env)
    assert status == 401 and "signature" in answer["error"]
    old = envelope(PrivateKey.generate(), token["token"], now=cp.clock())
    cp.clock.advance(hours=1)
    status, answer = await cp.call("POST", "/api/v1/enroll", token=None, body=old)
    assert status == 400 and "clock" in answer["error"]
    assert (await cp.call("GET", "/api/v1/devices/nope"))[0] == 404
    assert (await cp.call("GET", "/api/v1/nothing-here"))[1]["code"] == "not_found"


async def test_oversized_bodies_get_413(cp: ControlPlane) -> None:
    token = await cp.new_token()
    huge_facts = {f"k{i}": "x" * 500 for i in range(100)}
    env = envelope(PrivateKey.generate(), token["token"], now=cp.clock(), facts=huge_facts)
    status, answer = await cp.call("POST", "/api/v1/enroll", token=None, body=env)
    assert status == 413 and answer["code"] == "too_large"
    status, answer = await cp.call(
        "POST", "/api/v1/enrollment-tokens", body={"description": "x" * 100_000}
    )
    assert status == 413 and answer["code"] == "too_large"


async def test_device_id_of_another_key_is_refused(cp: ControlPlane) -> None:
    token = await cp.new_token()
    assert (await cp.enroll(PrivateKey.generate(), token["token"], device_id="twin"))[0] == 200
    status, answer = await cp.enroll(PrivateKey.generate(), token["token"], device_id="twin")
    assert status == 409 and "another key" in answer["error"]
    status, tok = await cp.call("GET", f"/api/v1/enrollment-tokens/{token['id']}")
    assert tok["uses"] == 1  # the refused enrollment did not spend a use


async def test_broker_failure_commits_nothing(cp: ControlPlane) -> None:
    token = await cp.new_token(max_uses=1)
    key = PrivateKey.generate()
    cp.provisioner.fail = True
    status, answer = await cp.enroll(key, token["token"])
    assert status == 503 and "broker" in answer["error"]
    assert (await cp.call("GET", "/api/v1/devices"))[1]["total"] == 0
    cp.provisioner.fail = False
    status, answer = await cp.enroll(key, token["token"])
    assert status == 200 and answer["status"] == "accepted"


async def test_openapi_health_metrics_and_schema(cp: ControlPlane) -> None:
    status, doc = await cp.call("GET", "/api/v1/openapi.json", token=None)
    assert status == 200 and doc["openapi"].startswith("3.1")
    routes = {
        (r.method.lower(), r.resource.canonical)
        for r in cp.client.server.app.router.routes()
        if r.resource is not None
        and r.method != "HEAD"
        # The console's pages are HTML for browsers (docs/console.md), not the REST API.
        and r.resource.canonical != "/"
        and not r.resource.canonical.startswith("/ui/")
    }
    documented = {(m, p) for p, ops in doc["paths"].items() for m in ops}
    assert routes == documented
    operation_ids = [op["operationId"] for ops in doc["paths"].values() for op in ops.values()]
    assert len(operation_ids) == len(set(operation_ids))
    schemas = doc["components"]["schemas"]

    def refs(node: Any) -> list[str]:
        if isinstance(node, dict):
            found = [node["$ref"]] if "$ref" in node else []
            return found + [r for v in node.values() for r in refs(v)]
        if isinstance(node, list):
            return [r for v in node for r in refs(v)]
        return []

    for ref in refs(doc):
        assert ref.removeprefix("#/components/schemas/") in schemas, ref
    enroll_op = doc["paths"]["/api/v1/enroll"]["post"]
    assert enroll_op["security"] == [] and "413" in enroll_op["responses"]
    assert doc["paths"]["/api/v1/enrollment-tokens"]["post"]["x-required-role"] == "operator"

    assert (await cp.call("GET", "/healthz", token=None))[0] == 200
    status, ready = await cp.call("GET", "/readyz", token=None)
    assert status == 200 and ready["schema_revision"] == head_revision()
    token = await cp.new_token()
    await cp.enroll(PrivateKey.generate(), token["token"])
    await cp.enroll(PrivateKey.generate(), "mcpe_" + "y" * 40)
    async with cp.client.get("/metrics") as response:
        text = await response.text()
    assert 'mcp_cp_enrollments_total{outcome="accepted"} 1.0' in text
    assert 'mcp_cp_enrollments_total{outcome="token_unknown"} 1.0' in text
    assert 'mcp_cp_devices{status="accepted"} 1.0' in text

    db = Database(cp.settings.effective_database_url)
    try:
        assert await schema_differences(db) == []
    finally:
        await db.dispose()
