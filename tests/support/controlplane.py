"""Helpers for control-plane tests: a fake broker provisioner, a settable clock, signed
enrollment envelopes, database URLs for SQLite and PostgreSQL, and the real app served from a
thread on a free loopback port (the shape of httpx's test server).

`ControlPlane` wraps a test client of the real app with the admin's token and helpers.
`FakeProvisioner` implements our own `BrokerProvisioner` protocol and records every call; it
can be told to fail, the way an unreachable broker would.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg
from aiohttp.test_utils import TestClient, TestServer
from psycopg import sql

from mcp_edge.controlplane.app import create_app, serve
from mcp_edge.controlplane.bootstrap import initialize
from mcp_edge.controlplane.broker.base import BrokerAdminError, Credentials
from mcp_edge.controlplane.settings import Settings
from mcp_edge.shared.protocol.enrollment import EnrollmentRequest, new_nonce, sign_enrollment
from mcp_edge.shared.signing import PrivateKey

START = datetime(2026, 5, 1, 12, 0, tzinfo=timezone.utc)


class FakeClock:
    """A clock that moves only when told to."""

    def __init__(self, now: datetime = START) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now

    def advance(self, **kwargs: float) -> None:
        self.now += timedelta(**kwargs)


@dataclass
class FakeProvisioner:
    """Records provisioning calls; `fail` makes every call raise like a broker that is down."""

    provisioned: list[str] = field(default_factory=list)
    disabled: list[str] = field(default_factory=list)
    enabled: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    fail: bool = False
    _serial: Iterator[int] = field(default_factory=lambda: itertools.count(1))

    def _check(self) -> None:
        if self.fail:
            raise BrokerAdminError("broker did not answer (fake)")

    async def provision_device(self, device_id: str) -> Credentials:
        self._check()
        self.provisioned.append(device_id)
        return Credentials(
            username=device_id,
            password=f"pw-{device_id}-{next(self._serial)}",
            client_id=device_id,
        )

    async def provision_service(self, name: str) -> Credentials:
        self._check()
        return Credentials(username=name, password="pw-service", client_id=name)

    async def provision_app_client(self, client_id: str) -> Credentials:
        self._check()
        return Credentials(username=client_id, password="pw-app", client_id=client_id)

    async def disable_device(self, device_id: str) -> None:
        self._check()
        self.disabled.append(device_id)

    async def enable_device(self, device_id: str) -> None:
        self._check()
        self.enabled.append(device_id)

    async def delete_device(self, device_id: str) -> None:
        self._check()
        self.deleted.append(device_id)

    async def disable_app_client(self, client_id: str) -> None:
        self._check()
        self.disabled.append(client_id)

    async def delete_app_client(self, client_id: str) -> None:
        self._check()
        self.deleted.append(client_id)


def envelope(
    key: PrivateKey,
    token: str,
    *,
    now: datetime,
    device_id: str | None = None,
    labels: dict[str, str] | None = None,
    profile: str = "generic-x86_64",
    nonce: str | None = None,
    facts: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A signed enrollment request, exactly as `mcp-agent enroll` builds it."""
    request = EnrollmentRequest(
        device_id=device_id,
        public_key=key.public_key.raw.hex(),
        token=token,
        nonce=nonce or new_nonce(),
        timestamp=now,
        profile=profile,
        labels=labels or {},
        facts=facts if facts is not None else {"cpu_count": 4, "os": "linux"},
        agent_version="0.1.0",
    )
    return sign_enrollment(request, key)


@dataclass
class ControlPlane:
    client: TestClient[Any, Any]
    provisioner: FakeProvisioner
    clock: FakeClock
    admin_token: str
    settings: Settings

    async def call(
        self,
        method: str,
        path: str,
        *,
        token: str | None = "admin",
        body: Any = None,
        params: Any = None,
        raw: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, Any]:
        h = dict(headers or {})
        if token == "admin":
            token = self.admin_token
        if token is not None:
            h["Authorization"] = f"Bearer {token}"
        kwargs: dict[str, Any] = {"headers": h, "params": params}
        if raw is not None:
            kwargs["data"] = raw
        elif body is not None:
            kwargs["json"] = body
        async with self.client.request(method, path, **kwargs) as response:
            data = await response.json(content_type=None) if response.status != 204 else None
            return response.status, data

    async def new_token(self, **body: Any) -> dict[str, Any]:
        status, answer = await self.call("POST", "/api/v1/enrollment-tokens", body=body)
        assert status == 201, answer
        return answer

    async def enroll(
        self, key: PrivateKey, token: str, *, force: bool = False, **kwargs: Any
    ) -> tuple[int, Any]:
        env = envelope(key, token, now=self.clock(), **kwargs)
        return await self.call(
            "POST",
            "/api/v1/enroll",
            token=None,
            body=env,
            params={"force": "true"} if force else None,
        )

    async def login(self, username: str, password: str) -> str:
        return str((await self.login_answer(username, password))["token"])

    async def login_answer(self, username: str, password: str) -> dict[str, Any]:
        status, answer = await self.call(
            "POST",
            "/api/v1/auth/login",
            token=None,
            body={"username": username, "password": password},
        )
        assert status == 201, answer
        return dict(answer)

    async def user_token(self, username: str, role: str) -> str:
        password = f"{username}-password"
        status, answer = await self.call(
            "POST", "/api/v1/users", body={"username": username, "password": password, "role": role}
        )
        assert status == 201, answer
        return await self.login(username, password)


ADMIN_PASSWORD = "correct horse battery"


async def start_control_plane(
    settings: Settings, clock: FakeClock, provisioner: Any = None
) -> ControlPlane:
    """Initialize ``settings``' data dir with an admin (:data:`ADMIN_PASSWORD`) and serve the
    app on a test server; the caller closes ``.client``. The fake provisioner unless given."""
    result = await initialize(
        settings, clock=clock, admin_user="admin", admin_password=ADMIN_PASSWORD
    )
    assert result.api_token is not None
    chosen = provisioner if provisioner is not None else FakeProvisioner()
    client: TestClient[Any, Any] = TestClient(TestServer(create_app(settings, chosen, clock)))
    await client.start_server()
    return ControlPlane(client, chosen, clock, result.api_token, settings)


def reset_postgres(url: str) -> str:
    """Empty the database at `url` (drop and recreate schema public); return `url`."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS public CASCADE"))
        conn.execute(sql.SQL("CREATE SCHEMA public"))
    return url


@contextmanager
def served(settings: Settings, provisioner: Any, clock: Any = None) -> Iterator[str]:
    """Run the real app (`controlplane.app.serve`) in a thread; yield its base URL.

    Waits for the listening socket by an event the server sets, and stops it through its stop
    event, so no test sleeps to synchronise.
    """
    ready = threading.Event()
    url: list[str] = []
    failure: list[BaseException] = []
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()

    def on_ready(base: str) -> None:
        url.append(base)
        ready.set()

    def run() -> None:
        asyncio.set_event_loop(loop)
        kwargs: dict[str, Any] = {"on_ready": on_ready, "stop": stop}
        if clock is not None:
            kwargs["clock"] = clock
        try:
            loop.run_until_complete(serve(settings, provisioner, **kwargs))
        except BaseException as e:
            failure.append(e)
            ready.set()
        finally:
            loop.close()

    thread = threading.Thread(target=run, name="controlplane-test-server", daemon=True)
    thread.start()
    if not ready.wait(timeout=60) or failure:
        raise RuntimeError(f"control plane did not start: {failure[:1]}")
    try:
        yield url[0]
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(timeout=30)
