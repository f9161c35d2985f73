"""Webhook delivery end to end: the outbox in SQLite and PostgreSQL, a real aiohttp server on a
loopback port receiving the POSTs, and a fake clock driven by the test.

Rounds are run with :meth:`WebhookDispatcher.run_once`; the background task is run once, woken
by :meth:`wake`, with the test waiting on an event the receiver sets. Every received POST is
checked the way a receiver would check it: :func:`verify_signature` over the raw body.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from mcp_edge.controlplane import __version__
from mcp_edge.controlplane.db import Database, upgrade_head
from mcp_edge.controlplane.db import webhooks as q
from mcp_edge.controlplane.settings import WebhookConfig
from mcp_edge.controlplane.webhooks import (
    LEASE_MARGIN_S,
    Webhook,
    WebhookDispatcher,
    WebhookError,
    enqueue,
    load_webhooks,
    verify_signature,
)
from mcp_edge.tooling.processes import free_port
from tests.support.controlplane import FakeClock, reset_postgres

SECRET = b"0123456789abcdef0123456789abcdef-ops"
WAIT_S = 30.0


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes

    @property
    def document(self) -> dict[str, Any]:
        doc: dict[str, Any] = orjson.loads(self.body)
        return doc


@dataclass
class Receiver:
    """A webhook receiver: records every request; ``script[path]`` lists the statuses to answer
    in turn (200 once it runs out); ``/hang`` never answers until the test ends."""

    base: str = ""
    requests: list[Received] = field(default_factory=list)
    script: dict[str, list[int]] = field(default_factory=dict)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    release: asyncio.Event = field(default_factory=asyncio.Event)

    def url(self, path: str = "/hook") -> str:
        return self.base + path

    def at(self, path: str) -> list[Received]:
        return [r for r in self.requests if r.path == path]

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.requests.append(Received(request.path, dict(request.headers), await request.read()))
        self.arrived.set()
        if request.path == "/hang":
            await self.release.wait()
        if request.path == "/moved":
            raise web.HTTPFound(self.url("/hook"))
        statuses = self.script.get(request.path, [])
        status = statuses.pop(0) if statuses else 200
        return web.Response(status=status, body=b"x" * 100_000 if status >= 500 else b"ok")


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    recv = Receiver()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", recv.handle)
    runner = web.AppRunner(app, shutdown_timeout=1.0)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    recv.base = f"http://127.0.0.1:{port}"
    yield recv
    recv.release.set()
    await runner.cleanup()


@pytest.fixture
async def db(database_url: str) -> AsyncIterator[Database]:
    database = Database(database_url)
    await upgrade_head(database)
    yield database
    await database.dispose()


@pytest.fixture
def secret_file(tmp_path: Path) -> Path:
    path = tmp_path / "ops.secret"
    path.write_bytes(SECRET + b"\n")
    path.chmod(0o600)
    return path


def hook(secret_file: Path, url: str, name: str = "ops", **kwargs: Any) -> WebhookConfig:
    return WebhookConfig(name=name, url=url, secret_file=secret_file, **kwargs)


def deliveries(registry: CollectorRegistry, webhook: str, result: str) -> float:
    value = registry.get_sample_value(
        "mcp_cp_webhook_deliveries_total", {"webhook": webhook, "result": result}
    )
    return value or 0.0


def pending(registry: CollectorRegistry, webhook: str) -> float | None:
    return registry.get_sample_value("mcp_cp_webhook_pending", {"webhook": webhook})


async def queue(
    db: Database, configs: list[WebhookConfig], clock: FakeClock, event: str, **body: Any
) -> int:
    async with db.transaction() as tx:
        return await enqueue(tx, configs, event, body, now=clock())


async def rows(db: Database) -> list[q.DeliveryView]:
    async with db.read() as tx:
        return await q.list_deliveries(tx, limit=1000)


async def until_delivered(db: Database) -> None:
    """Poll until no row is pending, for at most WAIT_S."""
    deadline = time.monotonic() + WAIT_S
    while any(r.pending for r in await rows(db)):
        assert time.monotonic() < deadline, "deliveries still pending"
        await asyncio.sleep(0.02)


def dispatcher(
    db: Database, webhooks: list[Webhook], clock: FakeClock, **kwargs: Any
) -> tuple[WebhookDispatcher, CollectorRegistry]:
    registry = CollectorRegistry()
    return WebhookDispatcher(db, webhooks, clock, metrics=registry, **kwargs), registry


async def test_an_event_reaches_the_webhooks_that_want_it_signed_and_verifiable(
    db: Database, receiver: Receiver, secret_file: Path, tmp_path: Path
) -> None:
    clock = FakeClock()
    other_secret = tmp_path / "ml.secret"
    other_secret.write_bytes(b"m" * 40)
    other_secret.chmod(0o600)
    configs = [
        hook(secret_file, receiver.url("/ops"), events=("rollout.*",)),
        hook(other_secret, receiver.url("/ml"), name="ml", events=("drift.*",)),
        hook(other_secret, receiver.url("/all"), name="all"),
    ]
    assert await queue(db, configs, clock, "rollout.stage_started", rollout=7, stage=1) == 2
    d, registry = dispatcher(db, list(load_webhooks(configs)), clock)
    async with d:
        assert await d.run_once() == 2

    assert receiver.at("/ml") == []
    (ops,) = receiver.at("/ops")
    (everything,) = receiver.at("/all")
    assert verify_signature(SECRET, ops.headers["X-MCP-Signature"], ops.body, clock())
    assert verify_signature(
        b"m" * 40, everything.headers["X-MCP-Signature"], everything.body, clock()
    )
    assert not verify_signature(
        SECRET, everything.headers["X-MCP-Signature"], everything.body, clock()
    )
    event_id = ops.headers["X-MCP-Delivery"]
    assert len(event_id) == 32 and everything.headers["X-MCP-Delivery"] == event_id
    assert ops.headers["X-MCP-Event"] == "rollout.stage_started"
    assert ops.headers["Content-Type"] == "application/json"
    assert ops.headers["User-Agent"] == f"mcp-edge/{__version__}"
    assert ops.document == {
        "id": event_id,
        "type": "rollout.stage_started",
        "created_at": "2026-05-01T12:00:00Z",
        "data": {"rollout": 7, "stage": 1},
    }
    stored = await rows(db)
    assert {r.webhook for r in stored} == {"ops", "all"}
    assert all(r.delivered_at == clock() and r.attempts == 1 for r in stored)
    assert deliveries(registry, "ops", "delivered") == 1
    assert pending(registry, "ops") == 0


async def test_a_failing_receiver_gets_the_event_on_the_third_attempt_after_backoff(
    db: Database, receiver: Receiver, secret_file: Path
) -> None:
    clock = FakeClock()
    receiver.script["/hook"] = [500, 500, 200]
    configs = [hook(secret_file, receiver.url())]
    await queue(db, configs, clock, "rollout.paused", rollout=3)
    d, registry = dispatcher(db, list(load_webhooks(configs)), clock, rand=lambda: 0.0)
    async with d:
        assert await d.run_once() == 1
        (row,) = await rows(db)
        assert row.last_error.startswith("HTTP 500: xxx") and len(row.last_error) <= 512
        assert row.next_attempt_at == clock() + timedelta(seconds=0.5)
        assert pending(registry, "ops") == 1

        assert await d.run_once() == 0  # not due for 0.5 s (1 s with jitter drawn at 0)
        clock.advance(seconds=0.5)
        assert await d.run_once() == 1
        assert await d.run_once() == 0
        clock.advance(seconds=0.9)  # the second retry waits twice as long: 1 s
        assert await d.run_once() == 0
        clock.advance(seconds=0.1)
        assert await d.run_once() == 1

    posts = receiver.at("/hook")
    assert len(posts) == 3
    assert len({p.headers["X-MCP-Delivery"] for p in posts}) == 1
    assert len({p.body for p in posts}) == 1
    for p in posts:  # each attempt is signed at the time it is sent
        assert verify_signature(SECRET, p.headers["X-MCP-Signature"], p.body, clock(), 2.0)
    (row,) = await rows(db)
    assert (row.attempts, row.delivered_at, row.failed_at, row.last_error) == (3, clock(), None, "")
    assert deliveries(registry, "ops", "retry") == 2
    assert deliveries(registry, "ops", "delivered") == 1
    assert pending(registry, "ops") == 0


async def test_a_delivery_is_given_up_after_max_attempts_with_one_warning(
    db: Database, receiver: Receiver, secret_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = FakeClock()
    receiver.script["/hook"] = [503] * 10
    configs = [hook(secret_file, receiver.url(), max_attempts=3)]
    await queue(db, configs, clock, "rollout.aborted", rollout=1)
    d, registry = dispatcher(db, list(load_webhooks(configs)), clock)
    with caplog.at_level(logging.WARNING, logger="mcp.controlplane.webhooks"):
        async with d:
            for _ in range(6):
                await d.run_once()
                clock.advance(hours=1)

    assert len(receiver.at("/hook")) == 3
    (row,) = await rows(db)
    assert row.attempts == 3 and row.delivered_at is None and row.failed_at is not None
    assert row.last_error.startswith("HTTP 503")
    gave_up = [r for r in caplog.records if "gave up" in r.getMessage()]
    assert len(gave_up) == 1 and "after 3 attempts" in gave_up[0].getMessage()
    assert deliveries(registry, "ops", "retry") == 2
    assert deliveries(registry, "ops", "failed") == 1
    assert pending(registry, "ops") == 0


async def test_redirects_timeouts_and_refused_connections_are_retried_not_followed(
    db: Database, receiver: Receiver, secret_file: Path
) -> None:
    clock = FakeClock()
    configs = [
        hook(secret_file, receiver.url("/moved"), name="moved"),
        hook(secret_file, receiver.url("/hang"), name="slow", timeout_s=0.3),
        hook(secret_file, f"http://127.0.0.1:{free_port()}/hook", name="down"),
    ]
    await queue(db, configs, clock, "rollout.succeeded", rollout=2)
    d, registry = dispatcher(db, list(load_webhooks(configs)), clock)
    async with d:
        assert await d.run_once() == 3

    assert len(receiver.at("/moved")) == 1
    assert receiver.at("/hook") == []  # the redirect's target never got a request
    errors = {r.webhook: r.last_error for r in await rows(db)}
    assert "HTTP 302 redirect" in errors["moved"] and "not followed" in errors["moved"]
    assert errors["slow"] == "no answer within 0.3 s"
    assert "connect" in errors["down"].lower()
    for r in await rows(db):
        assert r.delivered_at is None and r.failed_at is None and r.next_attempt_at > clock()
    assert [deliveries(registry, n, "retry") for n in ("moved", "slow", "down")] == [1, 1, 1]


async def test_an_event_rolled_back_with_its_transaction_is_never_sent(
    db: Database, receiver: Receiver, secret_file: Path
) -> None:
    clock = FakeClock()
    configs = [hook(secret_file, receiver.url())]

    class TransitionFailed(Exception):
        pass

    with pytest.raises(TransitionFailed):
        async with db.transaction() as tx:
            assert await enqueue(tx, configs, "rollout.promoted", {"rollout": 1}, now=clock()) == 1
            raise TransitionFailed
    with pytest.raises(WebhookError, match="not JSON"):
        async with db.transaction() as tx:
            await enqueue(tx, configs, "rollout.promoted", {"when": {1, 2}}, now=clock())
    with pytest.raises(WebhookError, match="at most 65536"):
        async with db.transaction() as tx:
            await enqueue(tx, configs, "rollout.promoted", {"x": "y" * 70_000}, now=clock())
    assert await rows(db) == []

    d, _ = dispatcher(db, list(load_webhooks(configs)), clock)
    async with d:
        assert await d.run_once() == 0
    assert receiver.requests == []


async def test_a_delivery_cut_short_is_sent_again_once_its_lease_ends(
    db: Database, receiver: Receiver, secret_file: Path
) -> None:
    """A replica that claimed a row and died before recording the answer: other dispatchers
    leave the row alone while its lease runs, then send it (at least once)."""
    clock = FakeClock()
    configs = [hook(secret_file, receiver.url(), timeout_s=5.0)]
    await queue(db, configs, clock, "rollout.resumed", rollout=4)
    lease = timedelta(seconds=5.0 + LEASE_MARGIN_S)
    async with db.transaction() as tx:
        (claimed,) = await q.claim_due(
            tx, webhooks=["ops"], now=clock(), lease_until=clock() + lease, limit=10
        )
    assert claimed.attempts == 1
    d, _ = dispatcher(db, list(load_webhooks(configs)), clock)
    async with d:
        assert await d.run_once() == 0
        clock.advance(seconds=lease.total_seconds() - 1)
        assert await d.run_once() == 0
        clock.advance(seconds=1)
        assert await d.run_once() == 1
    assert len(receiver.at("/hook")) == 1
    (row,) = await rows(db)
    assert (row.attempts, row.delivered_at, row.failed_at) == (2, clock(), None)


async def test_a_late_answer_to_an_old_claim_does_not_overwrite_a_newer_one(
    db: Database, secret_file: Path
) -> None:
    clock = FakeClock()
    await queue(db, [hook(secret_file, "http://127.0.0.1:9/")], clock, "rollout.resumed")
    lease = timedelta(seconds=35)
    for _ in range(2):  # replica A claims, its lease ends, replica B claims
        async with db.transaction() as tx:
            (claimed,) = await q.claim_due(
                tx, webhooks=["ops"], now=clock(), lease_until=clock() + lease, limit=1
            )
        clock.advance(seconds=lease.total_seconds())
    assert claimed.attempts == 2
    late = q.Outcome(claimed.id, 1, delivered=False, error="A: HTTP 500", give_up=True)
    async with db.transaction() as tx:
        await q.record_outcomes(tx, [late], now=clock())
    (row,) = await rows(db)
    assert row.pending and row.last_error == ""
    async with db.transaction() as tx:
        await q.record_outcomes(tx, [q.Outcome(claimed.id, 2, delivered=True)], now=clock())
        await q.record_outcomes(tx, [late], now=clock())
    (row,) = await rows(db)
    assert (row.delivered_at, row.failed_at, row.last_error) == (clock(), None, "")


async def test_rows_of_an_unconfigured_webhook_wait_with_one_warning(
    db: Database, receiver: Receiver, secret_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = FakeClock()
    ops, gone = hook(secret_file, receiver.url()), hook(secret_file, receiver.url("/g"), "gone")
    await queue(db, [ops, gone], clock, "rollout.succeeded", rollout=5)
    d, registry = dispatcher(db, list(load_webhooks([ops])), clock)
    with caplog.at_level(logging.WARNING, logger="mcp.controlplane.webhooks"):
        async with d:
            assert await d.run_once() == 1
            assert await d.run_once() == 0
    assert receiver.at("/g") == []
    left = [r for r in await rows(db) if r.pending]
    assert [r.webhook for r in left] == ["gone"]
    warnings = [r.getMessage() for r in caplog.records if "not configured" in r.getMessage()]
    assert len(warnings) == 1 and "'gone'" in warnings[0]
    assert pending(registry, "ops") == 0


async def test_the_background_task_delivers_when_woken_or_notified_on_commit(
    db: Database, receiver: Receiver, secret_file: Path
) -> None:
    """With an hour between idle rounds, only a wake gets events out: an explicit one after
    :func:`enqueue`, or the one :meth:`notify` arranges for its transaction's commit."""
    clock = FakeClock()
    configs = [hook(secret_file, receiver.url())]
    d, _ = dispatcher(db, list(load_webhooks(configs)), clock, idle_s=3600.0)
    await d.start()
    try:
        await queue(db, configs, clock, "rollout.stage_started", rollout=9, stage=2)
        d.wake()
        await asyncio.wait_for(receiver.arrived.wait(), WAIT_S)
        receiver.arrived.clear()
        await until_delivered(db)  # the round is over: the task waits for the next wake
        async with db.transaction() as tx:
            await d.notify(tx, "rollout.succeeded", {"rollout": 9}, clock())
        await asyncio.wait_for(receiver.arrived.wait(), WAIT_S)
    finally:
        await d.stop()
    first, second = receiver.at("/hook")
    assert first.document["data"] == {"rollout": 9, "stage": 2}
    assert second.document["type"] == "rollout.succeeded"
    assert all(r.delivered_at is not None for r in await rows(db))


@pytest.fixture
def clean_postgres(postgres_url: str) -> Iterator[str]:
    url = reset_postgres(postgres_url)
    yield url
    reset_postgres(url)


@pytest.mark.postgres
async def test_two_replicas_racing_on_postgresql_deliver_each_event_exactly_once(
    clean_postgres: str, receiver: Receiver, secret_file: Path
) -> None:
    clock = FakeClock()
    configs = [hook(secret_file, receiver.url())]
    first, second = Database(clean_postgres), Database(clean_postgres)
    try:
        await upgrade_head(first)
        for n in range(50):
            await queue(first, configs, clock, "rollout.stage_started", rollout=n)
        webhooks = list(load_webhooks(configs))
        a, reg_a = dispatcher(first, webhooks, clock, batch_size=4)
        b, reg_b = dispatcher(second, webhooks, clock, batch_size=4)
        async with a, b:
            while sum(await asyncio.gather(a.run_once(), b.run_once())):
                pass
    finally:
        await first.dispose()
        await second.dispose()

    ids = [p.headers["X-MCP-Delivery"] for p in receiver.at("/hook")]
    assert len(ids) == 50 and len(set(ids)) == 50
    assert sorted(p.document["data"]["rollout"] for p in receiver.at("/hook")) == list(range(50))
    assert deliveries(reg_a, "ops", "delivered") + deliveries(reg_b, "ops", "delivered") == 50
