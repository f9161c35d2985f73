"""Helpers for drift tests on the control plane: a fleet of devices in a real database fed
through the real ingestion path (no broker: messages go to :meth:`IngestService.handle` as the
MQTT callback would hand them over), the drift store, and a webhook dispatcher posting to a
real HTTP receiver that checks each delivery the way a training pipeline would: the HMAC over
the raw body within the timestamp tolerance, and each delivery id only once (a replay is
answered 409 and recorded as such).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from mcp_edge.controlplane.db import Database, upgrade_head
from mcp_edge.controlplane.db import drift as q
from mcp_edge.controlplane.drift.service import DriftService
from mcp_edge.controlplane.ingest import IngestService
from mcp_edge.controlplane.metrics import ControlPlaneMetrics
from mcp_edge.controlplane.settings import WebhookConfig
from mcp_edge.controlplane.webhooks import (
    DELIVERY_HEADER,
    SIGNATURE_HEADER,
    WebhookDispatcher,
    load_webhooks,
    verify_signature,
)
from mcp_edge.shared.bundle.manifest import DriftBaseline
from mcp_edge.shared.protocol import topics
from mcp_edge.shared.protocol.topics import TelemetryKind
from mcp_edge.tooling.processes import free_port
from tests.support.controlplane import FakeClock

SECRET = b"drift-receiver-secret-0123456789abcdef"


@dataclass
class Delivery:
    headers: dict[str, str]
    body: bytes
    verdict: str
    """``accepted``, ``bad_signature`` or ``replay``."""

    @property
    def document(self) -> dict[str, Any]:
        doc: dict[str, Any] = orjson.loads(self.body)
        return doc


@dataclass
class Receiver:
    """A training pipeline's webhook endpoint (see the module docstring)."""

    clock: FakeClock
    secret: bytes = SECRET
    url: str = ""
    deliveries: list[Delivery] = field(default_factory=list)
    seen: set[str] = field(default_factory=set)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)

    def accepted(self) -> list[Delivery]:
        return [d for d in self.deliveries if d.verdict == "accepted"]

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        headers = dict(request.headers)
        if not verify_signature(self.secret, headers.get(SIGNATURE_HEADER, ""), body, self.clock()):
            verdict, status = "bad_signature", 401
        elif headers.get(DELIVERY_HEADER, "") in self.seen:
            verdict, status = "replay", 409
        else:
            self.seen.add(headers[DELIVERY_HEADER])
            verdict, status = "accepted", 200
        self.deliveries.append(Delivery(headers, body, verdict))
        self.arrived.set()
        return web.Response(status=status, text=verdict)


@asynccontextmanager
async def running_receiver(clock: FakeClock) -> AsyncIterator[Receiver]:
    receiver = Receiver(clock)
    app = web.Application()
    app.router.add_post("/hook", receiver.handle)
    runner = web.AppRunner(app, shutdown_timeout=1.0)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    receiver.url = f"http://127.0.0.1:{port}/hook"
    try:
        yield receiver
    finally:
        await runner.cleanup()


def secret_file(directory: Path, secret: bytes = SECRET) -> Path:
    path = directory / "training.secret"
    path.write_bytes(secret)
    path.chmod(0o600)
    return path


@dataclass
class DriftFleet:
    """A database with devices running ``model`` ``version``, and the ingest path into drift."""

    db: Database
    clock: FakeClock
    metrics: ControlPlaneMetrics
    drift: DriftService
    ingest: IngestService
    webhooks: WebhookDispatcher
    model: str
    version: str

    def send(self, device_id: str, report: Mapping[str, Any] | bytes) -> None:
        payload = report if isinstance(report, bytes) else orjson.dumps(report)
        self.ingest.handle(topics.telemetry(device_id, TelemetryKind.DRIFT), payload)

    async def flush(self) -> int:
        return await self.ingest.flush()

    async def deliver(self) -> int:
        return await self.webhooks.run_once()

    def refused(self, reason: str) -> float:
        value = self.metrics.registry.get_sample_value(
            "mcp_cp_drift_reports_refused_total", {"reason": reason}
        )
        return value or 0.0

    def triggers_counted(self) -> float:
        value = self.metrics.registry.get_sample_value(
            "mcp_cp_retraining_triggers_total", {"model": self.model}
        )
        return value or 0.0

    async def buckets(self) -> list[q.AggregateView]:
        async with self.db.read() as tx:
            return await q.list_aggregates(tx, model=self.model, limit=10_000)

    async def triggers(self) -> list[q.TriggerView]:
        async with self.db.read() as tx:
            return await q.list_triggers(tx, model=self.model, limit=1000)

    async def close(self) -> None:
        await self.webhooks.close()
        await self.db.dispose()


@asynccontextmanager
async def drift_fleet(
    database_url: str,
    baseline: DriftBaseline,
    device_ids: Sequence[str],
    *,
    clock: FakeClock,
    webhook_url: str | None = None,
    secret: Path | None = None,
    model: str = "digits",
    version: str = "1.0.0",
    max_reports_per_minute: int = 60,
) -> AsyncIterator[DriftFleet]:
    db = Database(database_url)
    await upgrade_head(db)
    async with db.transaction() as tx:
        await q.seed_fleet(tx, device_ids=list(device_ids), model=model, version=version,
                           version_numeric=1_000_000, baseline=baseline.model_dump(mode="json"),
                           now=clock())  # fmt: skip
    metrics = ControlPlaneMetrics()
    hooks = []
    if webhook_url is not None and secret is not None:
        hooks = list(load_webhooks([WebhookConfig(name="training", url=webhook_url,
                                                  secret_file=secret,
                                                  events=("retraining.*",))]))  # fmt: skip
    webhooks = WebhookDispatcher(db, hooks, clock, metrics=metrics)
    drift = DriftService(db, clock, metrics=metrics, notify=webhooks.notify,
                         max_reports_per_minute=max_reports_per_minute)  # fmt: skip
    ingest = IngestService(db, metrics, clock, drift=drift)
    fleet = DriftFleet(db, clock, metrics, drift, ingest, webhooks, model, version)
    try:
        yield fleet
    finally:
        await fleet.close()


def window(
    device_id: str,
    at: datetime,
    samples: int,
    features: Mapping[str, list[int]],
    classes: Sequence[int] = (),
    confidence: Sequence[int] = (),
    *,
    model: str = "digits",
    version: str = "1.0.0",
    length_s: float = 60.0,
) -> dict[str, Any]:
    """A drift report as an agent sends it."""
    end = at.timestamp()
    return {
        "device_id": device_id,
        "ts": end,
        "model": model,
        "version": version,
        "window_start": end - length_s,
        "window_end": end,
        "samples": samples,
        "features": [{"name": n, "counts": list(c)} for n, c in features.items()],
        "class_counts": list(classes),
        "confidence_counts": list(confidence),
    }
