"""Telemetry ingestion end to end: real dynamic-security Mosquitto, real app, SQLite and
PostgreSQL.

Devices enroll through the REST API with the real `DynsecProvisioner`, so each gets its own
broker account; the control plane ingests with its own service account through shared
subscriptions. Every wait polls the REST API (or /metrics) against a deadline: no fixed sleeps.
"""

from __future__ import annotations

import asyncio
import secrets
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import orjson
import pytest
import sqlalchemy
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import select

from mcp_edge.controlplane.app import INGEST, create_app
from mcp_edge.controlplane.bootstrap import initialize
from mcp_edge.controlplane.broker.base import Credentials
from mcp_edge.controlplane.broker.dynsec import DynsecProvisioner
from mcp_edge.controlplane.db import Database
from mcp_edge.controlplane.db import telemetry as telemetry_q
from mcp_edge.controlplane.db.models import InferenceStatsRow
from mcp_edge.controlplane.ingest import IngestConnection, IngestService
from mcp_edge.controlplane.mqtt import BrokerAddress
from mcp_edge.controlplane.settings import PasswordCost, Settings
from mcp_edge.shared.protocol import topics
from mcp_edge.shared.protocol.topics import TelemetryKind
from mcp_edge.shared.signing import PrivateKey
from mcp_edge.tooling.mosquitto import DynsecMosquittoBroker
from tests.integration.conftest import MqttProbe
from tests.support.controlplane import ControlPlane, FakeClock

DEADLINE_S = 15.0
ADMIN_PASSWORD = "correct horse battery"


@dataclass
class Fleet:
    """The served control plane, its broker, and helpers to enroll and connect devices."""

    cp: ControlPlane
    broker: DynsecMosquittoBroker
    ingest: IngestService
    probes: list[MqttProbe]
    token: str
    enrolled: list[str]

    async def enroll(self, device_id: str) -> Credentials:
        status, answer = await self.cp.enroll(
            PrivateKey.generate(), self.token, device_id=device_id
        )
        assert status == 200 and answer["status"] == "accepted", answer
        self.enrolled.append(device_id)
        broker = answer["broker"]
        return Credentials(broker["username"], broker["password"], broker["client_id"])

    async def connect(self, creds: Credentials, *, will: bool = False) -> MqttProbe:
        probe = MqttProbe(self.broker, creds.client_id, creds.username, creds.password)
        if will:
            probe.client.will_set(topics.status(creds.client_id), b"offline", qos=1, retain=True)
        self.probes.append(probe)
        assert await probe.connect() == "Success"
        return probe

    async def get(self, path: str, **params: Any) -> Any:
        status, answer = await self.cp.call("GET", path, params=params or None)
        assert status == 200, answer
        return answer

    async def metrics(self) -> dict[tuple[str, str], float]:
        """``{(sample name, label value): value}`` of the ingest counters."""
        async with self.cp.client.get("/metrics") as response:
            text = await response.text()
        out: dict[tuple[str, str], float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name.startswith("mcp_cp_ingest_") and s.name.endswith("_total"):
                    label = s.labels.get("reason") or s.labels.get("kind") or ""
                    out[(s.name, label)] = s.value
        return out


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


@pytest.fixture
async def fleet(
    database_url: str, tmp_path: Path, dynsec_broker: DynsecMosquittoBroker
) -> AsyncIterator[Fleet]:
    settings = Settings(
        data_dir=tmp_path / "cp",
        database_url=database_url,
        password_cost=PasswordCost.MIN,
        broker_urls=(f"mqtt://{dynsec_broker.host}:{dynsec_broker.port}",),
    )
    clock = FakeClock()
    result = await initialize(
        settings, clock=clock, admin_user="admin", admin_password=ADMIN_PASSWORD
    )
    assert result.api_token is not None
    async with DynsecProvisioner(
        dynsec_broker.host,
        dynsec_broker.port,
        dynsec_broker.admin_username,
        dynsec_broker.admin_password,
    ) as provisioner:
        service = await provisioner.provision_service(f"cp-test-{secrets.token_hex(3)}")
        ingest = IngestConnection(BrokerAddress(dynsec_broker.host, dynsec_broker.port), service)
        app = create_app(settings, provisioner, clock, ingest=ingest)
        client: TestClient[Any, Any] = TestClient(TestServer(app))
        await client.start_server()
        cp = ControlPlane(client, provisioner, clock, result.api_token, settings)  # type: ignore[arg-type]
        token = (await cp.new_token(max_uses=10))["token"]
        f = Fleet(cp, dynsec_broker, app[INGEST], [], token, [])
        try:
            yield f
        finally:
            for probe in f.probes:
                await probe.close()
            await client.close()
            # Clear the retained status this test left, as the service account (now free).
            cleaner = MqttProbe(
                dynsec_broker, service.client_id, service.username, service.password
            )
            assert await cleaner.connect() == "Success"
            for device_id in f.enrolled:
                await cleaner.publish(topics.status(device_id), b"", retain=True)
            await cleaner.close()


def health(device_id: str, ts: float, cpu: float = 10.0, **extra: Any) -> bytes:
    return orjson.dumps(
        {
            "device_id": device_id,
            "ts": ts,
            "cpu_percent": cpu,
            "mem_total_mb": 1024.0,
            "mem_used_mb": 512.0,
            "disk_free_mb": 900.0,
            "process_rss_mb": 60.0,
            "temperatures_c": {"cpu": 41.5},
            "gpu": {"util_percent": 3.0},
            **extra,
        }
    )


def event(device_id: str, seq: int, phase: str = "downloading") -> bytes:
    return orjson.dumps(
        {
            "device_id": device_id,
            "event_seq": seq,
            "ts": 1_777_000_000.0 + seq,
            "model": "digits",
            "version": "1.0.0",
            "phase": phase,
            "outcome": "progress",
            "bytes_done": seq * 100,
            "bytes_total": 1000,
        }
    )


async def online_ids(fleet: Fleet) -> set[str]:
    answer = await fleet.get("/api/v1/devices", status="online")
    return {d["id"] for d in answer["items"]}


async def test_online_health_events_in_order_and_offline_by_will(fleet: Fleet) -> None:
    a_creds, b_creds = await fleet.enroll("cam-a"), await fleet.enroll("cam-b")
    assert a_creds.client_id == "cam-a" and a_creds.username != "cam-a"  # real dynsec account
    a = await fleet.connect(a_creds, will=True)
    b = await fleet.connect(b_creds)
    for probe, device in ((a, "cam-a"), (b, "cam-b")):
        await probe.publish(topics.status(device), b"online", retain=True)

    async def both_online() -> bool:
        return await online_ids(fleet) == {"cam-a", "cam-b"}

    await until(both_online, "both devices online")
    detail = await fleet.get("/api/v1/devices/cam-a")
    assert detail["last_seen_at"] is not None

    t0 = 1_777_000_000.0
    for i in range(20):
        await a.publish(topics.telemetry("cam-a", TelemetryKind.HEALTH), health("cam-a", t0 + i, i))
    for seq in range(5):
        await a.publish(topics.events("cam-a"), event("cam-a", seq))
    for seq in (1, 2, 3):  # a resend after a reconnect must change nothing
        await a.publish(topics.events("cam-a"), event("cam-a", seq, phase="failed"))
    await a.publish(topics.events("cam-a"), event("cam-a", 5, phase="active"))

    async def samples() -> list[Any]:
        items = (await fleet.get("/api/v1/devices/cam-a/health", limit=50))["items"]
        return items if len(items) == 20 else []

    items = await until(samples, "20 health samples")
    assert [s["cpu_percent"] for s in items] == [float(i) for i in range(20)]
    assert items[0]["temperatures_c"] == {"cpu": 41.5} and items[0]["gpu"]["util_percent"] == 3.0
    recent = (await fleet.get("/api/v1/devices/cam-a/health", limit=3))["items"]
    assert [s["cpu_percent"] for s in recent] == [17.0, 18.0, 19.0]

    async def events() -> list[Any]:
        items = (await fleet.get("/api/v1/devices/cam-a/events"))["items"]
        return items if items and items[-1]["event_seq"] == 5 else []

    stored = await until(events, "event 5")
    assert [e["event_seq"] for e in stored] == [0, 1, 2, 3, 4, 5]
    assert [e["phase"] for e in stored] == ["downloading"] * 5 + ["active"]
    later = (await fleet.get("/api/v1/devices/cam-a/events", after_seq=3))["items"]
    assert [e["event_seq"] for e in later] == [4, 5]
    assert (await fleet.get("/api/v1/devices/cam-b/health"))["items"] == []

    await b.publish(topics.status("cam-b"), b"offline", retain=True)

    async def only_a() -> bool:
        return await online_ids(fleet) == {"cam-a"}

    await until(only_a, "cam-b offline")
    sock = a.client.socket()
    assert isinstance(sock, socket.socket)
    sock.shutdown(socket.SHUT_RDWR)  # vanish without DISCONNECT: the broker sends the will

    async def none_online() -> bool:
        return await online_ids(fleet) == set()

    await until(none_online, "cam-a offline by its will")
    m = await fleet.metrics()
    assert m[("mcp_cp_ingest_committed_total", "health")] == 20
    assert m[("mcp_cp_ingest_committed_total", "events")] == 9


async def test_bad_input_on_every_topic_is_counted_and_dropped(fleet: Fleet) -> None:
    creds = await fleet.enroll("cam-a")
    await fleet.enroll("cam-b")
    a = await fleet.connect(creds)
    # Retained statuses left by other tests arrived before this one on the same subscription;
    # once cam-a shows online they are all counted, so the counters below are deltas.
    await a.publish(topics.status("cam-a"), b"online", retain=True)

    async def a_online() -> bool:
        return await online_ids(fleet) == {"cam-a"}

    await until(a_online, "cam-a online")
    before = await fleet.metrics()
    ghost = await fleet.cp.provisioner.provision_device("ghost-1")  # at the broker, not in the DB
    g = await fleet.connect(ghost)
    health_topic = topics.telemetry("cam-a", TelemetryKind.HEALTH)
    bad: list[tuple[str, bytes]] = [
        (health_topic, b"{not json"),
        (health_topic, orjson.dumps({"device_id": "cam-a", "ts": 1.0})),
        (health_topic, health("cam-a", 1.0, padding="x" * 20_000)),
        (health_topic, health("cam-b", 1.0)),  # A speaking for B on A's own topic
        (topics.telemetry("cam-a", TelemetryKind.INFERENCE), b"[1, 2"),
        (
            topics.telemetry("cam-a", TelemetryKind.INFERENCE),
            orjson.dumps({"device_id": "cam-a", "ts": 1.0, "window_s": 0}),
        ),
        (topics.telemetry("cam-a", TelemetryKind.DRIFT), b"\xff\xfe"),
        (topics.events("cam-a"), b"nope"),
        (topics.events("cam-a"), orjson.dumps({"device_id": "cam-a", "event_seq": -1})),
        (topics.events("cam-a"), event("cam-a", 1)[:-1] + b', "x": "' + b"y" * 17_000 + b'"}'),
        (topics.reported("cam-a"), b"{}"),
        (topics.reported("cam-a"), b"\x00\x01"),
        (topics.status("cam-a"), b"maybe"),
    ]
    for topic, payload in bad:
        await a.publish(topic, payload)
    await g.publish(topics.telemetry("ghost-1", TelemetryKind.HEALTH), health("ghost-1", 5.0))
    await a.publish(health_topic, health("cam-a", 2.0, cpu=42.0))

    async def good_one_stored() -> list[Any]:
        return (await fleet.get("/api/v1/devices/cam-a/health"))["items"]

    (stored,) = await until(good_one_stored, "the good sample after the bad ones")
    assert stored["cpu_percent"] == 42.0
    expected = {
        "malformed_json": 5,
        "schema": 4,
        "too_large": 2,
        "device_mismatch": 1,
        "bad_status": 1,
        "unknown_device": 1,
    }

    async def counted() -> dict[str, float]:
        m = await fleet.metrics()
        got = {
            r: m.get(("mcp_cp_ingest_dropped_total", r), 0.0)
            - before.get(("mcp_cp_ingest_dropped_total", r), 0.0)
            for r in expected
        }
        return got if got == expected else {}

    await until(counted, f"drop counters {expected}")
    status, _ = await fleet.cp.call("GET", "/api/v1/devices/ghost-1/health")
    assert status == 404
    async with fleet.cp.client.get("/healthz") as response:
        assert response.status == 200


async def test_retention_expires_and_downsamples_health(fleet: Fleet) -> None:
    await fleet.enroll("cam-a")
    now = fleet.cp.clock()
    base = now.timestamp()
    topic = topics.telemetry("cam-a", TelemetryKind.HEALTH)
    old = [base - 10 * 86400 + i for i in range(3)]  # past the 7-day retention
    # Two days old: 20 samples, 30 s apart, from the start of a 5-minute period (2 periods).
    start = (base - 2 * 86400) // 300 * 300
    thinned = [start + 30 * i for i in range(20)]
    fresh = [base - 60 + i for i in range(5)]
    for ts in old + thinned + fresh:
        fleet.ingest.handle(topic, health("cam-a", ts))
    await fleet.ingest.flush()
    assert len((await fleet.get("/api/v1/devices/cam-a/health", limit=100))["items"]) == 28

    expired, dropped = await fleet.ingest.run_retention(now)
    assert (expired, dropped) == (3, 18)
    items = (await fleet.get("/api/v1/devices/cam-a/health", limit=100))["items"]
    kept = [s["ts"] for s in items]
    assert len(kept) == 7
    assert await fleet.ingest.run_retention(now + timedelta(seconds=1)) == (0, 0)


# ------------------------------------------------------------------------------ per-role stats
EDGES = [1.0, 10.0, 100.0]
T0 = 1_777_000_000.0


def stats_row(version: str, count: int, counts: list[int], *, edges: list[float] = EDGES,
              **extra: Any) -> dict[str, Any]:  # fmt: skip
    return {"model": "digits", "version": version, "count": count, "errors": 0,
            "latency_bucket_edges_ms": edges, "latency_bucket_counts": counts, **extra}  # fmt: skip


def inference(device_id: str, ts: float, *models: dict[str, Any]) -> bytes:
    return orjson.dumps({"device_id": device_id, "ts": ts, "window_s": 60.0, "models": models})


async def test_inference_stats_per_role_are_stored_and_summed_per_device_version_and_role(
    fleet: Fleet, database_url: str
) -> None:
    for device in ("cam-a", "cam-b", "cam-c"):
        await fleet.enroll(device)
    topic = {d: topics.telemetry(d, TelemetryKind.INFERENCE) for d in ("cam-a", "cam-b", "cam-c")}
    before = await fleet.metrics()
    reports = [
        # cam-a: stable and a canary, two windows; plus a window before the span, another
        # model, and a report whose histogram does not add up (refused by the schema).
        ("cam-a", inference("cam-a", T0 - 60, stats_row("1.0.0", 1000, [0, 0, 0, 1000]))),
        ("cam-a", inference(
            "cam-a", T0,
            stats_row("1.0.0", 100, [50, 40, 8, 0], errors=2, role="stable",
                      latency={"p50_ms": 1.0, "p95_ms": 40.0, "p99_ms": 60.0}),
            stats_row("1.1.0", 20, [10, 8, 0, 0], errors=1, rejections=1, role="canary"),
            {**stats_row("1.0.0", 7, [7, 0, 0, 0]), "model": "other"},
        )),
        ("cam-a", inference(
            "cam-a", T0 + 60,
            stats_row("1.0.0", 50, [0, 0, 45, 5]),  # no role: an older agent's, stable
            stats_row("1.1.0", 10, [0, 10, 0, 0], role="canary"),
        )),
        ("cam-a", inference("cam-a", T0 + 90, stats_row("1.0.0", 5, [1, 1, 1, 1]))),
        # cam-b: a shadow beside stable; its stable histograms have other edges each window.
        ("cam-b", inference(
            "cam-b", T0,
            stats_row("1.0.0", 30, [0, 30, 0, 0], latency={"p50_ms": 5, "p95_ms": 8, "p99_ms": 9}),
            stats_row("1.1.0", 40, [0, 39, 0, 0], errors=1, role="shadow", shadow_compared=39,
                      shadow_agreed=35),
        )),
        ("cam-b", inference(
            "cam-b", T0 + 60,
            stats_row("1.0.0", 10, [5, 5, 0], edges=[2.0, 20.0],
                      latency={"p50_ms": 2, "p95_ms": 15, "p99_ms": 19}),
            stats_row("1.1.0", 10, [0, 10, 0, 0], role="shadow", shadow_compared=10,
                      shadow_agreed=10),
        )),
        # The span ends before this one, and cam-c is not asked about.
        ("cam-b", inference("cam-b", T0 + 120, stats_row("1.0.0", 9, [9, 0, 0, 0]))),
        ("cam-c", inference("cam-c", T0, stats_row("1.0.0", 9, [9, 0, 0, 0]))),
    ]  # fmt: skip
    for device, payload in reports:
        fleet.ingest.handle(topic[device], payload)
    await fleet.ingest.flush()
    m = await fleet.metrics()
    assert (
        m[("mcp_cp_ingest_dropped_total", "schema")]
        - before.get(("mcp_cp_ingest_dropped_total", "schema"), 0.0)
        == 1
    )

    db = Database(database_url)
    try:
        async with db.transaction() as tx:
            # A row stored before roles (0007): role, histogram and shadow counters NULL.
            await telemetry_q.insert_inference(tx, [{
                "device_id": "cam-b", "ts": datetime.fromtimestamp(T0 + 30, timezone.utc),
                "window_s": 60.0, "model": "digits", "version": "1.0.0", "count": 20,
                "errors": 1, "rejections": 0, "p95_ms": 20.0, "queue_depth": 0,
            }])  # fmt: skip
        statements: list[str] = []

        def seen(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
            statements.append(statement)

        sqlalchemy.event.listen(db.engine.sync_engine, "before_cursor_execute", seen)
        asked = ["cam-a", "cam-b", *(f"cam-{i}" for i in range(1200))]
        span = (datetime.fromtimestamp(T0, timezone.utc),
                datetime.fromtimestamp(T0 + 120, timezone.utc))  # fmt: skip
        async with db.read() as tx:
            got = await telemetry_q.version_stats(tx, asked, "digits", *span)
        sqlalchemy.event.remove(db.engine.sync_engine, "before_cursor_execute", seen)
        # The stored rows: role written out, the histogram as {"edges_ms", "counts"}.
        async with db.read() as tx:
            stored = (await tx.execute(
                select(InferenceStatsRow.role, InferenceStatsRow.latency_hist,
                       InferenceStatsRow.shadow_agreed)
                .where(InferenceStatsRow.device_id == "cam-b", InferenceStatsRow.role == "shadow")
                .order_by(InferenceStatsRow.ts)
            )).all()  # fmt: skip
    finally:
        await db.dispose()
    selects = [s for s in statements if s.lstrip().upper().startswith("SELECT")]
    assert len(selects) == 1  # 1202 devices, one SELECT
    assert [tuple(r) for r in stored] == [
        ("shadow", {"edges_ms": EDGES, "counts": [0, 39, 0, 0]}, 35),
        ("shadow", {"edges_ms": EDGES, "counts": [0, 10, 0, 0]}, 10),
    ]
    assert set(got) == {("cam-a", "1.0.0", "stable"), ("cam-a", "1.1.0", "canary"),
                        ("cam-b", "1.0.0", "stable"), ("cam-b", "1.1.0", "shadow")}  # fmt: skip
    # Merged histograms with the same edges: p95 is the upper edge of its bucket.
    stable_a = got["cam-a", "1.0.0", "stable"]
    assert (stable_a.requests, stable_a.errors) == (150, 2)
    assert stable_a.latency_edges_ms == tuple(EDGES)
    assert stable_a.latency_counts == (50, 40, 53, 5)
    assert stable_a.p95_ms == 100.0  # the 141st of 148 falls in (10, 100]
    canary_a = got["cam-a", "1.1.0", "canary"]
    assert (canary_a.requests, canary_a.errors, canary_a.latency_counts) == (30, 1, (10, 18, 0, 0))
    assert canary_a.p95_ms == 10.0 and canary_a.shadow_compared == 0
    # Other edges, and a row without a histogram: the requests-weighted mean of the rows' p95.
    stable_b = got["cam-b", "1.0.0", "stable"]
    assert (stable_b.requests, stable_b.errors) == (60, 1)
    assert stable_b.latency_edges_ms == () and stable_b.latency_counts == ()
    assert stable_b.p95_ms == pytest.approx((30 * 8 + 20 * 20 + 10 * 15) / 60)
    shadow_b = got["cam-b", "1.1.0", "shadow"]
    assert (shadow_b.requests, shadow_b.errors) == (50, 1)
    assert (shadow_b.shadow_compared, shadow_b.shadow_agreed) == (49, 45)
    assert shadow_b.latency_counts == (0, 49, 0, 0) and shadow_b.p95_ms == 10.0
    async with fleet.cp.client.get("/healthz") as response:
        assert response.status == 200
