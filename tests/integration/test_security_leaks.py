"""What a stranger on the network can make the control plane say or store.

- Requests too large for the HTTP parser are answered 400 and logged as one short line per
  burst, never a traceback per request (the real ``serve``, raw sockets).
- A device id or application client id that another kind of broker account holds is refused
  with 409 that names no broker account, and leaves nothing behind (real Mosquitto with
  dynamic security, the real provisioner).
- Publisher and preauthorized keys that are not usable Ed25519 keys, and publisher names with
  control characters or past the length cap, are refused with 400; nothing reaches the
  database or signed TUF metadata.
"""

from __future__ import annotations

import json
import logging
import secrets
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from mcp_edge.controlplane.app import create_app
from mcp_edge.controlplane.broker.dynsec import DynsecProvisioner
from mcp_edge.controlplane.db import Database
from mcp_edge.controlplane.db import registry as registry_q
from mcp_edge.controlplane.settings import PasswordCost, Settings
from mcp_edge.shared.protocol.enrollment import EnrollmentRequest, new_nonce
from mcp_edge.shared.signing import PrivateKey, key_id, sign_document
from mcp_edge.tooling.mosquitto import DynsecMosquittoBroker
from tests.support.controlplane import (
    START,
    ControlPlane,
    FakeClock,
    FakeProvisioner,
    served,
    start_control_plane,
)

SOCKET_TIMEOUT_S = 10.0


# ---------------------------------------------------------------------------- HTTP parser
def _raw_exchange(url: str, request: bytes) -> bytes:
    """Send ``request`` on a fresh connection and read the answer until the server closes."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=SOCKET_TIMEOUT_S) as conn:
        conn.sendall(request)
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
    return answer


OVERSIZED = [
    b"GET /" + b"a" * 10240 + b" HTTP/1.1\r\nHost: cp\r\n\r\n",
    b"GET /healthz HTTP/1.1\r\nHost: cp\r\nX-Filler: " + b"b" * 10240 + b"\r\n\r\n",
    b"GET /healthz HTTP/1.1\r\nHost: cp\r\n" + b"X-Many: y\r\n" * 200 + b"\r\n",
]


def test_oversized_requests_get_400_and_one_log_line_per_burst_without_traceback(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = Settings(
        data_dir=tmp_path / "cp",
        database_url=f"sqlite:///{tmp_path / 'cp.db'}",
        password_cost=PasswordCost.MIN,
        port=0,
    )
    caplog.set_level(logging.INFO)
    with served(settings, FakeProvisioner()) as url:
        caplog.clear()
        answers = [_raw_exchange(url, request) for request in OVERSIZED * 3]
        healthy = _raw_exchange(
            url, b"GET /healthz HTTP/1.1\r\nHost: cp\r\nConnection: close\r\n\r\n"
        )

    assert all(a.startswith(b"HTTP/1.") and a.split(b" ", 2)[1] == b"400" for a in answers), [
        a[:60] for a in answers
    ]
    assert healthy.split(b" ", 2)[1] == b"200"  # the server is still serving
    assert "Traceback" not in caplog.text
    assert not [r for r in caplog.records if r.exc_info]
    about_requests = [r for r in caplog.records if "HTTP request" in r.getMessage()]
    assert len(about_requests) == 1, [r.getMessage() for r in about_requests]
    line = about_requests[0].getMessage()
    assert "\n" not in line and "127.0.0.1" in line and "400" in line
    assert "aaaa" not in line  # the client's bytes are not echoed into the log


# ---------------------------------------------------------------------------- broker accounts
@pytest.fixture
async def dynsec_cp(
    dynsec_broker: DynsecMosquittoBroker, tmp_path: Path
) -> AsyncIterator[tuple[ControlPlane, DynsecProvisioner]]:
    """The app on a test server, provisioning through the real dynamic-security plugin."""
    broker = dynsec_broker
    async with DynsecProvisioner(
        broker.host, broker.port, broker.admin_username, broker.admin_password
    ) as provisioner:
        settings = Settings(
            data_dir=tmp_path / "cp",
            database_url=f"sqlite:///{tmp_path / 'cp.db'}",
            password_cost=PasswordCost.MIN,
            broker_urls=("mqtt://broker.test:1883",),
        )
        cp = await start_control_plane(settings, FakeClock(), provisioner)
        try:
            yield cp, provisioner
        finally:
            await cp.client.close()


def _tag() -> str:
    """A suffix unique to one test: the session broker keeps its accounts."""
    return secrets.token_hex(3)


def _names_no_account(error: str) -> None:
    assert "svc-" not in error and "app-" not in error and "dev-" not in error
    assert "account" not in error and "broker" not in error


@pytest.mark.mosquitto
async def test_a_device_id_held_by_a_service_is_refused_409_and_nothing_is_kept(
    dynsec_cp: tuple[ControlPlane, DynsecProvisioner],
) -> None:
    cp, provisioner = dynsec_cp
    service = f"cp-{_tag()}"
    await provisioner.provision_service(service)
    token = await cp.new_token(max_uses=1)
    key = PrivateKey.generate()

    status, answer = await cp.enroll(key, token["token"], device_id=service)

    assert status == 409, answer
    assert answer == {
        "code": "conflict",
        "error": f"device id {service!r} is not available; enroll with another id or none",
    }
    _names_no_account(answer["error"])
    status, devices = await cp.call("GET", "/api/v1/devices")
    assert status == 200 and devices["items"] == []
    status, kept = await cp.call("GET", f"/api/v1/enrollment-tokens/{token['id']}")
    assert status == 200 and kept["uses"] == 0  # the token's only use is not spent
    status, audit = await cp.call("GET", "/api/v1/audit", params={"action": "device.enrolled"})
    assert status == 200 and audit["items"] == []

    status, enrolled = await cp.enroll(key, token["token"], device_id=f"cam-{_tag()}")
    assert status == 200 and enrolled["status"] == "accepted", enrolled


@pytest.mark.mosquitto
async def test_ids_held_by_an_application_or_a_service_are_refused_409_naming_no_account(
    dynsec_cp: tuple[ControlPlane, DynsecProvisioner],
) -> None:
    cp, provisioner = dynsec_cp
    app_id, service = f"dash-{_tag()}", f"cp-{_tag()}"
    await provisioner.provision_service(service)
    status, created = await cp.call("POST", "/api/v1/apps", body={"client_id": app_id})
    assert status == 201, created
    token = await cp.new_token()

    status, answer = await cp.enroll(PrivateKey.generate(), token["token"], device_id=app_id)
    assert status == 409 and answer["error"].startswith(f"device id {app_id!r} is not available")
    _names_no_account(answer["error"])

    status, answer = await cp.call("POST", "/api/v1/apps", body={"client_id": service})
    assert status == 409, answer
    assert answer["error"] == f"client id {service!r} is not available; pick another"
    _names_no_account(answer["error"])
    status, apps = await cp.call("GET", "/api/v1/apps")
    assert [a["client_id"] for a in apps["items"]] == [app_id]


@pytest.mark.mosquitto
async def test_a_preauthorized_device_whose_id_a_service_holds_stays_preauthorized(
    dynsec_cp: tuple[ControlPlane, DynsecProvisioner],
) -> None:
    cp, provisioner = dynsec_cp
    service = f"cp-{_tag()}"
    await provisioner.provision_service(service)
    key = PrivateKey.generate()
    status, pre = await cp.call(
        "POST",
        "/api/v1/preauthorizations",
        body={"public_key": key.public_key.raw.hex(), "device_id": service},
    )
    assert status == 201, pre
    token = await cp.new_token()

    status, answer = await cp.enroll(key, token["token"])

    assert status == 409, answer
    assert answer["error"] == (
        f"device id {service!r} is not available; ask an operator to give this device another id"
    )
    _names_no_account(answer["error"])
    status, device = await cp.call("GET", f"/api/v1/devices/{service}")
    assert status == 200 and device["status"] == "preauthorized" and device["accepted_at"] is None


# ---------------------------------------------------------------------------- publisher keys
SMALL_ORDER = {
    "all zeros": "00" * 32,
    "identity": "01" + "00" * 31,
    "order 8": "26e8958fc2b227b045c3f489f2ef98f0d5dfac05d3c63339b13802886d53fc05",
}
NON_CANONICAL = "ee" + "ff" * 30 + "7f"  # y = p + 1


@pytest.fixture
async def cp(tmp_path: Path) -> AsyncIterator[ControlPlane]:
    settings = Settings(
        data_dir=tmp_path / "cp",
        database_url=f"sqlite:///{tmp_path / 'cp.db'}",
        password_cost=PasswordCost.MIN,
    )
    control_plane = await start_control_plane(settings, FakeClock())
    try:
        yield control_plane
    finally:
        await control_plane.client.close()


async def _signed_targets(cp: ControlPlane) -> dict[str, Any]:
    async def metadata(name: str) -> dict[str, Any]:
        async with cp.client.get(f"/repo/metadata/{name}") as response:
            assert response.status == 200
            return dict(json.loads(await response.read()))

    timestamp = await metadata("timestamp.json")
    snapshot = await metadata(
        f"{timestamp['signed']['meta']['snapshot.json']['version']}.snapshot.json"
    )
    targets = await metadata(
        f"{snapshot['signed']['meta']['targets.json']['version']}.targets.json"
    )
    return dict(targets["signed"])


async def test_unusable_publisher_keys_are_refused_and_never_signed_into_targets(
    cp: ControlPlane,
) -> None:
    before = await _signed_targets(cp)
    for what, hexkey in [*SMALL_ORDER.items(), ("non-canonical", NON_CANONICAL)]:
        status, answer = await cp.call(
            "POST", "/api/v1/publishers", body={"name": "vision", "public_key": hexkey}
        )
        assert status == 400, (what, answer)
        assert answer["error"].startswith("public_key: "), answer
        assert "small order" in answer["error"] or "canonical" in answer["error"], answer

    status, listed = await cp.call("GET", "/api/v1/publishers")
    assert status == 200 and listed["items"] == []
    after = await _signed_targets(cp)
    assert after["version"] == before["version"]
    assert not after.get("x-mcp-publishers")


async def test_unusable_keys_cannot_be_preauthorized(cp: ControlPlane) -> None:
    status, answer = await cp.call(
        "POST",
        "/api/v1/preauthorizations",
        body={"public_key": SMALL_ORDER["all zeros"], "device_id": "kiosk-1"},
    )
    assert status == 400 and "small order" in answer["error"], answer
    status, devices = await cp.call("GET", "/api/v1/devices")
    assert devices["items"] == []


async def test_a_device_cannot_enroll_with_a_small_order_key(cp: ControlPlane) -> None:
    token = await cp.new_token()
    request = EnrollmentRequest(
        public_key=SMALL_ORDER["all zeros"],
        token=token["token"],
        nonce=new_nonce(),
        timestamp=cp.clock(),
        profile="generic-x86_64",
        agent_version="0.1.0",
    )
    # Nobody holds the private half of such a key: sign with some other key.
    body = sign_document(request.model_dump(mode="json"), PrivateKey.generate())

    status, answer = await cp.call("POST", "/api/v1/enroll", token=None, body=body)

    assert status == 400 and "public_key" in answer["error"], answer
    assert "small order" in answer["error"]
    status, kept = await cp.call("GET", f"/api/v1/enrollment-tokens/{token['id']}")
    assert kept["uses"] == 0


async def test_an_unusable_key_registered_by_an_older_version_is_left_out_at_startup(
    tmp_path: Path,
) -> None:
    settings = Settings(
        data_dir=tmp_path / "cp",
        database_url=f"sqlite:///{tmp_path / 'cp.db'}",
        password_cost=PasswordCost.MIN,
    )
    first = await start_control_plane(settings, FakeClock())
    await first.client.close()
    zero = bytes(32)
    db = Database(settings.effective_database_url)
    try:
        async with db.transaction() as tx:  # as the registry stored it before the check
            await registry_q.add_publisher(
                tx, keyid=key_id(zero), public_key=zero.hex(), name="legacy", now=START
            )
    finally:
        await db.dispose()

    client: TestClient[Any, Any] = TestClient(
        TestServer(create_app(settings, FakeProvisioner(), FakeClock()))
    )
    await client.start_server()  # the repository syncs publisher keys on startup
    try:
        again = ControlPlane(client, FakeProvisioner(), FakeClock(), first.admin_token, settings)
        assert not (await _signed_targets(again)).get("x-mcp-publishers")
        status, listed = await again.call("GET", "/api/v1/publishers")
        assert status == 200 and [p["name"] for p in listed["items"]] == ["legacy"]
        status, revoked = await again.call("DELETE", f"/api/v1/publishers/{key_id(zero)}")
        assert status == 200 and revoked["revoked"]
    finally:
        await client.close()


# ---------------------------------------------------------------------------- publisher names
@pytest.mark.parametrize(
    "name",
    [
        "vision\nteam",
        "vision\n",
        "\x1b[31mvision",
        "vision\x00",
        "v" * 65,
        "",
        " vision",
        "vision\u202eteam",
    ],
)
async def test_publisher_names_must_be_short_and_printable(cp: ControlPlane, name: str) -> None:
    key = PrivateKey.generate().public_key.raw.hex()
    status, answer = await cp.call(
        "POST", "/api/v1/publishers", body={"name": name, "public_key": key}
    )
    assert status == 400, answer
    assert answer["error"].startswith("name: "), answer
    status, listed = await cp.call("GET", "/api/v1/publishers")
    assert listed["items"] == []


async def test_names_in_use_stay_valid_and_the_openapi_document_shows_the_rule(
    cp: ControlPlane,
) -> None:
    for name in ["vision", "vision-team", "ML team", "ml.ops_2@example.org", "v" * 64]:
        key = PrivateKey.generate().public_key.raw.hex()
        status, row = await cp.call(
            "POST", "/api/v1/publishers", body={"name": name, "public_key": key}
        )
        assert status == 201 and row["name"] == name, row
    status, document = await cp.call("GET", "/api/v1/openapi.json", token=None)
    assert status == 200
    schema = document["components"]["schemas"]["PublisherCreate"]["properties"]
    assert schema["name"]["pattern"] == "^[A-Za-z0-9][A-Za-z0-9 ._@-]{0,63}$"
