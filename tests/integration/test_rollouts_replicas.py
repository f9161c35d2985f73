"""Two ``mcp-controlplane serve`` replicas on one PostgreSQL database drive one rollout; the
one holding it is SIGKILLed mid-rollout and the other carries it to the end, moving each device
exactly once.

The replicas are real processes with a real broker; the devices are enrolled through the REST
API and what they report (online, reported state) is written with ingestion's own queries
into the shared database, which is what ingestion would store from their messages.
"""

from __future__ import annotations

import asyncio
import shutil
import signal
import subprocess
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import orjson
import pytest

from mcp_edge.controlplane.db import Database
from mcp_edge.controlplane.db import rollouts as rollout_q
from mcp_edge.controlplane.db import telemetry as telemetry_q
from mcp_edge.shared.signing import PrivateKey
from mcp_edge.tooling.mosquitto import DynsecMosquittoBroker
from mcp_edge.tooling.processes import (
    http_json,
    init_control_plane,
    process_env,
    serve_control_plane,
    stopped_at_exit,
    wait_until,
)
from tests.integration.conftest import reset_postgres
from tests.integration.test_deployments import publish_versions
from tests.support.controlplane import envelope

pytestmark = [pytest.mark.mosquitto, pytest.mark.postgres]
MODEL, OLD, NEW = "digits", "1.0.0", "1.1.0"
LEASE_S = 3


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[str]]]:
    with stopped_at_exit() as procs:
        yield procs


@pytest.fixture
def pg_url(postgres_url: str) -> Iterator[str]:
    url = reset_postgres(postgres_url)
    yield url
    reset_postgres(url)


def call(url: str, path: str, token: str, body: Any = None) -> Any:
    status, answer = http_json(
        f"{url}{path}", body=orjson.dumps(body) if body is not None else None, token=token
    )
    assert status in (200, 201), (path, status, answer)
    return answer


def run_db(url: str, work: Any) -> Any:
    async def go() -> Any:
        db = Database(url)
        try:
            return await work(db)
        finally:
            await db.dispose()

    return asyncio.run(go())


def report(url: str, devices: list[str], version: str) -> None:
    """The devices are online and report ``version`` active (rows as ingestion writes them)."""

    async def work(db: Database) -> None:
        now = datetime.now(timezone.utc)
        rows = [
            {
                "device_id": d,
                "ts": now,
                "received_at": now,
                "applied_seq": 1,
                "document": {
                    "device_id": d,
                    "ts": now.timestamp(),
                    "applied_seq": 1,
                    "profile": "generic-x86_64",
                    "models": [
                        {
                            "name": MODEL,
                            "phase": "active",
                            "active_version": version,
                            "installed_versions": [version],
                        }
                    ],
                },
            }
            for d in devices
        ]
        async with db.transaction() as tx:
            await telemetry_q.upsert_reported(tx, rows)
            await telemetry_q.mark_seen(tx, devices, devices, [], now)

    run_db(url, work)


def test_a_replica_killed_mid_rollout_leaves_the_other_to_finish_it_moving_each_device_once(
    fresh_dynsec_broker: DynsecMosquittoBroker,
    pg_url: str,
    tmp_path: Path,
    processes: list[subprocess.Popen[str]],
) -> None:
    env = {**process_env(), "MCP_ROLLOUT_LEASE_S": str(LEASE_S)}
    a_dir, b_dir = tmp_path / "cp-a", tmp_path / "cp-b"
    token = init_control_plane(a_dir, fresh_dynsec_broker, database_url=pg_url, env=env)
    init_control_plane(b_dir, fresh_dynsec_broker, database_url=pg_url, create_admin=False, env=env)
    shutil.rmtree(b_dir / "keys")  # replicas sign with one director key
    shutil.copytree(a_dir / "keys", b_dir / "keys")
    a_proc, a_url = serve_control_plane(a_dir, processes, env=env)
    b_proc, b_url = serve_control_plane(b_dir, processes, env=env)
    by_url = {a_url: a_proc, b_url: b_proc}

    enroll = call(a_url, "/api/v1/enrollment-tokens", token, {"max_uses": 10})["token"]
    devices = []
    for i in range(6):
        body = envelope(
            PrivateKey.generate(), enroll, now=datetime.now(timezone.utc), device_id=f"rep-{i}"
        )
        answer = call(a_url, "/api/v1/enroll", "", body)
        assert answer["status"] == "accepted"
        devices.append(answer["device_id"])

    async def publish(db: Database) -> None:
        await publish_versions(db, datetime.now(timezone.utc), MODEL, OLD, NEW)

    run_db(pg_url, publish)
    for d in devices:
        call(
            a_url,
            "/api/v1/deployments",
            token,
            {"model": MODEL, "version": OLD, "selector": {"device_id": d}},
        )
    report(pg_url, devices, OLD)

    created = call(
        b_url,
        "/api/v1/rollouts",
        token,
        {
            "model": MODEL,
            "version": NEW,
            "target": {"devices": devices},
            "stages": [
                {"count": 2, "bake_s": 0},
                {"count": 2, "bake_s": 0},
                {"percent": 100, "bake_s": 0},
            ],
        },
    )["rollout"]
    rollout_id = created["id"]

    live = {"url": a_url}

    def moved() -> list[str]:
        items = call(live["url"], f"/api/v1/rollouts/{rollout_id}/devices", token)["items"]
        return [d["device_id"] for d in items if d["phase"] != "waiting"]

    wait_until(lambda: len(moved()) == 2, "stage 1 told by one of the replicas", 30)

    def holder() -> str | None:
        async def work(db: Database) -> str | None:
            async with db.read() as tx:
                row = await rollout_q.get_rollout(tx, rollout_id)
            return row.lease_owner if row else None

        return run_db(pg_url, work)  # type: ignore[no-any-return]

    owner = holder()
    assert owner is not None
    # A replica holds leases under its broker identity, svc-cp-{host}-{id in its data dir}.
    killed_url = a_url if owner.endswith(_replica_id(a_dir)) else b_url
    assert owner.endswith(_replica_id(a_dir if killed_url == a_url else b_dir)), owner
    survivor_url = live["url"] = b_url if killed_url == a_url else a_url
    by_url[killed_url].send_signal(signal.SIGKILL)
    by_url[killed_url].wait(timeout=30)

    report(pg_url, moved(), NEW)
    wait_until(lambda: len(moved()) == 4, "stage 2 told by the surviving replica", 60)
    report(pg_url, moved(), NEW)
    wait_until(lambda: len(moved()) == 6, "stage 3 told", 60)
    report(pg_url, devices, NEW)

    def status() -> str:
        return str(call(survivor_url, f"/api/v1/rollouts/{rollout_id}", token)["rollout"]["status"])

    wait_until(lambda: status() == "succeeded", "the rollout succeeded", 60)
    items = call(survivor_url, f"/api/v1/rollouts/{rollout_id}/devices", token)["items"]
    assert sorted(d["device_id"] for d in items) == sorted(devices)
    assert {d["moves"] for d in items} == {1}, items
    assert holder() != owner
    history = call(survivor_url, f"/api/v1/rollouts/{rollout_id}/events", token)["items"]
    assert [e["kind"] for e in history].count("stage_started") == 3


def _replica_id(data: Path) -> str:
    return (data / "replica-id").read_text().strip()
