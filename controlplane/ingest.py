"""Telemetry ingestion: device messages from the broker into the database, in batches.

Subscriptions (every filter built by :mod:`shared.protocol.topics`)::

    $share/cp/mcp/v1/dev/+/telemetry/+   health, inference statistics, drift (shared)
    $share/cp/mcp/v1/dev/+/events        deployment events (shared)
    mcp/v1/dev/+/status                  retained online/offline (direct, see below)
    mcp/v1/dev/+/reported                retained reported state (direct, see below)

Telemetry and events go through the share group ``cp``: with several replicas each message
reaches exactly one of them. ``status`` and ``reported`` are subscribed directly because MQTT 5
does not deliver retained messages on shared subscriptions (§4.8.2), and the retained message
is what tells a (re)started control plane where every device stands; applying it is
idempotent, so replicas all doing it is harmless, and its rate is tiny.

Each message is validated on the event loop (:func:`shared.protocol.codec.decode_for_topic`,
after a size check against the message class's ``MAX_BYTES``) and turned into a row in an
in-memory batch. A background task commits the batch every ``flush_interval_s`` (0.1 s) or as
soon as ``flush_rows`` (500) rows wait: one transaction, one executemany per table, then
``last_seen_at``/``online`` of the devices heard from. Rows of devices that are not accepted
(unknown, pending, revoked) are dropped at that point, by one ``SELECT`` per batch.

Drift reports (given a :class:`~controlplane.drift.service.DriftService`) are decoded by
:func:`controlplane.drift.sample.decode_drift` (the schema's rules, a faster path for the
features' counts) and handed to the drift store after the batch's own transaction committed,
in a transaction of their own (:meth:`DriftService.store`: its refusals, aggregates and
retraining triggers); every drift report refused here (schema, size, unknown device, ...) is
also counted in ``mcp_cp_drift_reports_refused_total{reason}``. Without a drift service they
are validated, counted and dropped.

Inference statistics become one ``inference_stats`` row per model, version and role of the
report: the role written out (``stable``, ``canary``, ``shadow``; rows from before roles hold
NULL, read as stable), the latency histogram as ``{"edges_ms": [...], "counts": [...]}`` (NULL
when the report has none) and a shadow's compared and agreed answers.
:func:`controlplane.db.telemetry.version_stats` sums them for the rollout gates.

A bad message (not JSON, wrong schema, too large, a payload naming another device, an unknown
device, a status other than ``online``/``offline``) is counted in
``mcp_cp_ingest_dropped_total{reason}`` and dropped with at most one log line per reason every
``LOG_INTERVAL_S``; nothing a device sends can stop ingestion. When the database is
unavailable the batch waits for the next flush (bounded by ``max_backlog`` rows, beyond which
new messages are dropped as ``backlog_full``); other database errors drop the batch
(``db_error``).

Retention (every ``retention_interval_s``): health samples and inference statistics older than
``retention`` are deleted; health samples older than ``downsample_after`` (1 day) are thinned
to the first sample per device and 5-minute period. Deployment events are kept. Drift reports
older than ``drift_retention`` (2 days) are deleted, and drift aggregates older than
``retention``.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

import orjson
from pydantic import ValidationError

from mcp_edge.controlplane.broker.base import Credentials
from mcp_edge.controlplane.db import Database, DatabaseError, UnavailableError
from mcp_edge.controlplane.db import telemetry as q
from mcp_edge.controlplane.drift.sample import DriftSample, decode_drift
from mcp_edge.controlplane.drift.service import DriftService
from mcp_edge.controlplane.metrics import ControlPlaneMetrics
from mcp_edge.controlplane.mqtt import BrokerAddress, MqttSubscriber
from mcp_edge.shared.errors import MessageError, TopicError
from mcp_edge.shared.protocol import topics
from mcp_edge.shared.protocol.codec import decode_for_parsed, schema_for_topic
from mcp_edge.shared.protocol.state import DeploymentEvent, ReportedState
from mcp_edge.shared.protocol.telemetry import DriftReport, HealthSample, InferenceStats
from mcp_edge.shared.protocol.topics import Channel

log = logging.getLogger("mcp.controlplane.ingest")

SHARE_GROUP = "cp"
LOG_INTERVAL_S = 10.0
ONLINE, OFFLINE = b"online", b"offline"
DRIFT_SUFFIX = f"/{Channel.TELEMETRY.value}/{topics.TelemetryKind.DRIFT.value}"
Clock = Callable[[], datetime]


class DropReason(str, enum.Enum):
    """Why a device message was not stored (the ``reason`` label of the drop counter)."""

    BAD_TOPIC = "bad_topic"
    BAD_STATUS = "bad_status"
    TOO_LARGE = "too_large"
    MALFORMED_JSON = "malformed_json"
    SCHEMA = "schema"
    DEVICE_MISMATCH = "device_mismatch"
    UNKNOWN_DEVICE = "unknown_device"
    BACKLOG_FULL = "backlog_full"
    DB_ERROR = "db_error"
    INTERNAL = "internal"


def subscriptions(share_group: str = SHARE_GROUP) -> list[str]:
    """The filters ingestion subscribes to (see the module docstring)."""
    return [
        topics.shared_subscription(share_group, topics.all_devices(Channel.TELEMETRY)),
        topics.shared_subscription(share_group, topics.all_devices(Channel.EVENTS)),
        topics.all_devices(Channel.STATUS),
        topics.all_devices(Channel.REPORTED),
    ]


@dataclass(frozen=True)
class IngestConnection:
    """How ingestion reaches the broker: its address and the replica's service account."""

    address: BrokerAddress
    credentials: Credentials


class _Dropped(Exception):
    def __init__(self, reason: DropReason, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def _classify(error: MessageError) -> DropReason:
    """The reason behind a :func:`decode_for_topic` refusal (size is checked before it)."""
    cause = error.__cause__
    if isinstance(cause, orjson.JSONDecodeError):
        return DropReason.MALFORMED_JSON
    if isinstance(cause, ValidationError):
        return DropReason.SCHEMA
    if "claims device" in str(error):
        return DropReason.DEVICE_MISMATCH
    return DropReason.SCHEMA


def _utc(ts: float) -> datetime:
    try:
        return datetime.fromtimestamp(ts, timezone.utc)
    except (OverflowError, OSError, ValueError) as e:
        raise _Dropped(DropReason.SCHEMA, f"timestamp {ts!r} is out of range") from e


@dataclass
class _Batch:
    """Rows waiting for the next flush; ``messages`` keeps ``(device_id, kind)`` per message."""

    health: list[dict[str, Any]] = field(default_factory=list)
    inference: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    reported: dict[str, dict[str, Any]] = field(default_factory=dict)
    status: dict[str, bool] = field(default_factory=dict)
    drift: list[DriftSample] = field(default_factory=list)
    messages: list[tuple[str, str]] = field(default_factory=list)
    acks: list[int] = field(default_factory=list)
    """Ack tokens of every message taken while this batch was pending, dropped ones too:
    acknowledged once the batch is committed (or dropped for good)."""

    def __len__(self) -> int:
        return len(self.messages)

    def device_ids(self) -> set[str]:
        return {d for d, _ in self.messages}

    def keep_only(self, known: set[str]) -> list[tuple[str, str]]:
        """Drop everything of devices outside ``known``; return the dropped messages."""
        dropped = [m for m in self.messages if m[0] not in known]
        if dropped:
            self.messages = [m for m in self.messages if m[0] in known]
            for name in ("health", "inference", "events"):
                setattr(self, name, [r for r in getattr(self, name) if r["device_id"] in known])
            self.reported = {d: r for d, r in self.reported.items() if d in known}
            self.status = {d: s for d, s in self.status.items() if d in known}
            self.drift = [s for s in self.drift if s.device_id in known]
        return dropped

    def then(self, later: _Batch) -> _Batch:
        """This batch followed by ``later`` (order kept; the later status/report wins)."""
        return _Batch(
            health=self.health + later.health,
            inference=self.inference + later.inference,
            events=self.events + later.events,
            reported={**self.reported, **later.reported},
            status={**self.status, **later.status},
            drift=self.drift + later.drift,
            messages=self.messages + later.messages,
            acks=self.acks + later.acks,
        )


class _LogLimiter:
    """At most one warning per drop reason every ``interval_s``, with a count of the rest."""

    def __init__(self, interval_s: float = LOG_INTERVAL_S) -> None:
        self._interval_s = interval_s
        self._last: dict[DropReason, float] = {}
        self._suppressed: Counter[DropReason] = Counter()

    def dropped(self, reason: DropReason, topic: str, detail: str) -> None:
        now = time.monotonic()
        last = self._last.get(reason)
        if last is not None and now - last < self._interval_s:
            self._suppressed[reason] += 1
            return
        self._last[reason] = now
        more = self._suppressed.pop(reason, 0)
        log.warning(
            "ingest: dropped a message on %.120s (%s): %.200s%s",
            topic,
            reason.value,
            detail,
            f" [{more} more since the last line]" if more else "",
        )


class IngestService:
    """Validates device messages and commits them in batches; see the module docstring.

    ``handle`` is the MQTT message callback (event-loop thread). ``start``/``stop`` own the
    broker session and the background tasks; ``flush`` and ``run_retention`` are also public
    for tests and tools.
    """

    def __init__(
        self,
        db: Database,
        metrics: ControlPlaneMetrics,
        clock: Clock,
        *,
        flush_interval_s: float = 0.1,
        flush_rows: int = 500,
        max_backlog: int = 100_000,
        retention: timedelta = timedelta(days=7),
        downsample_after: timedelta = timedelta(days=1),
        retention_interval_s: float = 3600.0,
        share_group: str = SHARE_GROUP,
        drift: DriftService | None = None,
        drift_retention: timedelta = timedelta(days=2),
    ) -> None:
        self._db = db
        self._metrics = metrics
        self._clock = clock
        self._flush_interval_s = flush_interval_s
        self._flush_rows = flush_rows
        self._max_backlog = max_backlog
        self._retention = retention
        self._downsample_after = downsample_after
        self._retention_interval_s = retention_interval_s
        self._share_group = share_group
        self._drift = drift
        self._drift_retention = drift_retention
        self._pending = _Batch()
        self._wake = asyncio.Event()
        self._flush_lock = asyncio.Lock()
        self._log = _LogLimiter()
        self._subscriber: MqttSubscriber | None = None
        self._tasks: list[asyncio.Task[None]] = []

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self, connection: IngestConnection) -> None:
        """Subscribe at the broker and start the flush and retention tasks.

        Raises :class:`mcp_edge.shared.mqtt.MqttError` when the broker cannot be used.
        """
        self._tasks = [
            asyncio.create_task(self._flush_loop(), name="ingest-flush"),
            asyncio.create_task(self._retention_loop(), name="ingest-retention"),
        ]
        subscriber = MqttSubscriber(
            connection.address,
            connection.credentials,
            subscriptions(self._share_group),
            self.handle,
            ack_when_stored=True,
        )
        self._subscriber = subscriber  # before the first message: flushes acknowledge on it
        try:
            await subscriber.start()
        except BaseException:
            self._subscriber = None
            await self._stop_tasks()
            raise
        log.info(
            "ingesting device telemetry from %s as %s",
            subscriber.where,
            connection.credentials.username,
        )

    @property
    def session(self) -> MqttSubscriber | None:
        """The broker session while started (for readiness and metrics)."""
        return self._subscriber

    async def stop(self) -> None:
        """Commit what is buffered (acknowledged on the live session), close the broker session,
        stop the tasks, and commit what arrived meanwhile."""
        if self._subscriber is not None:
            await self.flush()
            await self._subscriber.close()
            self._subscriber = None
        await self._stop_tasks()
        await self.flush()

    async def _stop_tasks(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []

    # ---- intake (event-loop thread) --------------------------------------------------------

    def handle(self, topic: str, payload: bytes, ack: int = 0) -> None:
        """Validate one message and buffer its rows; drops are counted, never raised. ``ack``
        (the session's token, 0 for none) is acknowledged once the rows are committed."""
        if ack:
            self._pending.acks.append(ack)
        try:
            self._take(topic, bytes(payload))
        except _Dropped as e:
            self._drop(e.reason, topic, str(e))
        except Exception as e:  # a bug must cost one message, not the ingestion
            log.exception("ingest: unexpected failure on %.120s", topic)
            self._drop(DropReason.INTERNAL, topic, repr(e))

    def _drop(self, reason: DropReason, topic: str, detail: str, count: int = 1) -> None:
        self._metrics.ingest_dropped.labels(reason.value).inc(count)
        self._log.dropped(reason, topic, detail)
        if self._drift is not None and topic.endswith(DRIFT_SUFFIX):
            self._drift.refused(reason.value, count)

    def _take(self, topic: str, payload: bytes) -> None:
        try:
            parsed = topics.parse(topic)
        except TopicError as e:
            raise _Dropped(DropReason.BAD_TOPIC, str(e)) from e
        if not isinstance(parsed, topics.DeviceTopic):
            raise _Dropped(DropReason.BAD_TOPIC, "not a device topic")
        device_id = parsed.device_id
        batch = self._pending
        if parsed.channel is Channel.STATUS:
            if payload not in (ONLINE, OFFLINE):
                if not payload:
                    return  # a retained status being cleared: nothing to record
                raise _Dropped(DropReason.BAD_STATUS, f"status {payload[:32]!r}")
            batch.status[device_id] = payload == ONLINE
            self._accept(batch, device_id, "status")
            return
        cls = schema_for_topic(parsed)
        if cls is None:
            raise _Dropped(DropReason.BAD_TOPIC, f"no ingestion for {parsed.channel.value}")
        if len(payload) > cls.MAX_BYTES:
            raise _Dropped(
                DropReason.TOO_LARGE, f"{len(payload)} bytes exceed the {cls.MAX_BYTES}-byte limit"
            )
        if len(batch) >= self._max_backlog:
            raise _Dropped(DropReason.BACKLOG_FULL, f"{len(batch)} messages wait for the database")
        if self._drift is not None and parsed.detail == topics.TelemetryKind.DRIFT.value:
            try:
                sample = decode_drift(payload, device_id, self._clock().timestamp())
            except MessageError as e:
                raise _Dropped(_classify(e), str(e)) from e
            batch.drift.append(sample)
            self._accept(batch, device_id, "drift")
            return
        try:
            message = decode_for_parsed(parsed, payload)
        except MessageError as e:
            raise _Dropped(_classify(e), str(e)) from e
        self._accept(batch, device_id, self._rows(batch, message))

    def _rows(self, batch: _Batch, message: Any) -> str:
        """Append the rows of a valid message to ``batch``; return its kind."""
        if isinstance(message, HealthSample):
            batch.health.append(
                {
                    "device_id": message.device_id,
                    "ts": _utc(message.ts),
                    "cpu_percent": message.cpu_percent,
                    "load_1m": message.load_1m,
                    "mem_used_mb": message.mem_used_mb,
                    "mem_total_mb": message.mem_total_mb,
                    "disk_free_mb": message.disk_free_mb,
                    "disk_total_mb": message.disk_total_mb,
                    "process_rss_mb": message.process_rss_mb,
                    "uptime_s": message.uptime_s,
                    "temperatures_c": dict(message.temperatures_c),
                    "gpu": message.gpu.model_dump(exclude_none=True) if message.gpu else None,
                }
            )
            return "health"
        if isinstance(message, InferenceStats):
            ts = _utc(message.ts)
            for m in message.models:
                batch.inference.append(
                    {
                        "device_id": message.device_id,
                        "ts": ts,
                        "window_s": message.window_s,
                        "model": m.model,
                        "version": m.version,
                        "count": m.count,
                        "errors": m.errors,
                        "rejections": m.rejections,
                        "p50_ms": m.latency.p50_ms if m.latency else None,
                        "p95_ms": m.latency.p95_ms if m.latency else None,
                        "p99_ms": m.latency.p99_ms if m.latency else None,
                        "queue_depth": m.queue_depth,
                        "batch_size_avg": m.batch_size_avg,
                        "batch_fill_ratio": m.batch_fill_ratio,
                        "role": m.role.value,
                        "latency_hist": {
                            "edges_ms": m.latency_bucket_edges_ms,
                            "counts": m.latency_bucket_counts,
                        }
                        if m.latency_bucket_counts
                        else None,
                        "shadow_compared": m.shadow_compared,
                        "shadow_agreed": m.shadow_agreed,
                    }
                )
            return "inference"
        if isinstance(message, DeploymentEvent):
            batch.events.append(
                {
                    "device_id": message.device_id,
                    "event_seq": message.event_seq,
                    "ts": _utc(message.ts),
                    "received_at": self._clock(),
                    "model": message.model,
                    "version": message.version,
                    "phase": message.phase.value,
                    "outcome": message.outcome.value,
                    "message": message.message,
                    "cause": message.cause,
                    "bytes_done": message.bytes_done,
                    "bytes_total": message.bytes_total,
                    "elapsed_ms": message.elapsed_ms,
                }
            )
            return "events"
        if isinstance(message, ReportedState):
            batch.reported[message.device_id] = {
                "device_id": message.device_id,
                "ts": _utc(message.ts),
                "received_at": self._clock(),
                "applied_seq": message.applied_seq,
                "document": message.model_dump(mode="json"),
            }
            return "reported"
        if isinstance(message, DriftReport):
            # Validated and counted; without a drift service nothing stores it.
            return "drift"
        raise _Dropped(DropReason.BAD_TOPIC, f"{type(message).__name__} is not ingested")

    def _accept(self, batch: _Batch, device_id: str, kind: str) -> None:
        batch.messages.append((device_id, kind))
        self._metrics.ingest_received.labels(kind).inc()
        if len(batch) >= self._flush_rows:
            self._wake.set()

    # ---- commit ----------------------------------------------------------------------------

    async def _flush_loop(self) -> None:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._flush_interval_s)
            self._wake.clear()
            await self.flush()

    async def flush(self) -> int:
        """Commit everything buffered in one transaction; return how many messages."""
        async with self._flush_lock:
            batch, self._pending = self._pending, _Batch()
            if not batch:
                self._ack(batch)  # dropped messages only
                return 0
            started = time.perf_counter()
            now = self._clock()
            try:
                async with self._db.transaction() as tx:
                    known = await q.accepted_among(tx, batch.device_ids())
                    for device_id, kind in batch.keep_only(known):
                        self._drop(
                            DropReason.UNKNOWN_DEVICE,
                            topics.device_subtree(device_id)
                            + (DRIFT_SUFFIX if kind == "drift" else ""),
                            f"device {device_id!r} is not an accepted device",
                        )
                    await q.insert_health(tx, batch.health)
                    await q.insert_inference(tx, batch.inference)
                    await q.insert_events(tx, batch.events)
                    await q.upsert_reported(tx, list(batch.reported.values()))
                    online = {d for d, up in batch.status.items() if up}
                    heard = {d for d, kind in batch.messages if kind != "status"} | online
                    await q.mark_seen(tx, heard, online, set(batch.status) - online, now)
            except UnavailableError as e:
                self._requeue(batch, str(e))
                return 0
            except DatabaseError as e:
                self._drop(DropReason.DB_ERROR, "(batch)", str(e), count=len(batch))
                self._drift_lost(DropReason.DB_ERROR, batch)
                self._ack(batch)
                return 0
            finally:
                self._metrics.ingest_backlog.set(len(self._pending))
            self._metrics.ingest_flush.observe(time.perf_counter() - started)
            kinds = Counter(k for _, k in batch.messages)
            if batch.drift and self._drift is not None:
                kinds.pop("drift", None)
                if await self._store_drift(batch.drift):
                    self._pending.acks.extend(batch.acks)  # acknowledged with the retry
                    batch.acks = []
            for kind, n in kinds.items():
                self._metrics.ingest_committed.labels(kind).inc(n)
            self._ack(batch)
            return len(batch)

    def _ack(self, batch: _Batch) -> None:
        """Acknowledge the batch's messages at the broker: they are stored (or dropped for
        good). A session that reconnected since skips them, and the broker delivers them
        again: a health sample or statistic may then be stored twice, never lost."""
        if batch.acks and self._subscriber is not None:
            self._subscriber.ack(batch.acks)

    def _drift_lost(self, reason: DropReason, batch: _Batch) -> None:
        if self._drift is not None and batch.drift:
            self._drift.refused(reason.value, len(batch.drift))

    async def _store_drift(self, samples: list[DriftSample]) -> bool:
        """Hand the drift reports of a committed batch to the drift store (own transaction);
        True when they wait for the next flush (the database is unavailable)."""
        assert self._drift is not None
        try:
            result = await self._drift.store(samples)
        except UnavailableError as e:
            if len(samples) + len(self._pending) > self._max_backlog:
                self._drop(DropReason.BACKLOG_FULL, DRIFT_SUFFIX, str(e), count=len(samples))
            else:
                self._pending.drift[:0] = samples
                self._pending.messages[:0] = [(s.device_id, "drift") for s in samples]
                log.warning("ingest: database unavailable, %d drift reports wait", len(samples))
                return True
            return False
        except DatabaseError as e:
            self._drop(DropReason.DB_ERROR, DRIFT_SUFFIX, str(e), count=len(samples))
            return False
        except Exception as e:  # a bug must cost one batch of drift reports, not the ingestion
            log.exception("ingest: storing %d drift reports failed", len(samples))
            self._drop(DropReason.INTERNAL, DRIFT_SUFFIX, repr(e), count=len(samples))
            return False
        self._metrics.ingest_committed.labels("drift").inc(result.stored)
        return False

    def _requeue(self, batch: _Batch, why: str) -> None:
        if len(batch) + len(self._pending) > self._max_backlog:
            # Too far behind: give up the older batch rather than grow without bound.
            self._drop(DropReason.BACKLOG_FULL, "(batch)", why, count=len(batch))
            self._drift_lost(DropReason.BACKLOG_FULL, batch)
        else:
            self._pending = batch.then(self._pending)
        log.warning("ingest: database unavailable, %d messages wait: %s", len(self._pending), why)

    # ---- retention -------------------------------------------------------------------------

    async def run_retention(self, now: datetime | None = None) -> tuple[int, int]:
        """Expire and downsample old telemetry; return ``(expired, thinned)`` health samples.

        Raises :class:`controlplane.db.DatabaseError`.
        """
        async with self._db.transaction() as tx:
            result = await q.expire_telemetry(
                tx,
                now or self._clock(),
                retention=self._retention,
                downsample_after=self._downsample_after,
            )
        if self._drift is not None:
            await self._drift.expire(
                reports_older=self._drift_retention, aggregates_older=self._retention
            )
        return result

    async def _retention_loop(self) -> None:
        while True:
            try:
                expired, thinned = await self.run_retention()
                if expired or thinned:
                    log.info("retention: %d health samples expired, %d thinned", expired, thinned)
            except DatabaseError as e:
                log.warning(
                    "retention failed, retried in %.0f s: %s", self._retention_interval_s, e
                )
            await asyncio.sleep(self._retention_interval_s)
