"""Signed webhook delivery: a durable outbox in the database and a task that empties it.

Producers call :func:`enqueue` inside their own transaction, so an event (a rollout moving to
its next stage, ...) is stored if and only if the change it describes commits, and call
:meth:`WebhookDispatcher.wake` after the commit; :meth:`WebhookDispatcher.notify` does both. The dispatcher claims due rows in batches
(:func:`controlplane.db.webhooks.claim_due`: a lease, ``FOR UPDATE SKIP LOCKED`` on PostgreSQL,
so replicas never POST one row at the same time), POSTs each to its webhook outside any
transaction, and records the outcome. Delivery is at least once: a replica that dies between
the POST and the record sends that row again once its lease ends; receivers de-duplicate on
``X-MCP-Delivery``.

One POST::

    POST <url>
    Content-Type: application/json
    User-Agent: mcp-edge/<version>
    X-MCP-Event: rollout.stage_started
    X-MCP-Delivery: <event id, 32 hex digits, the same for every webhook and every attempt>
    X-MCP-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256(secret, "<t>.<raw body>")>

    {"id": "<event id>", "type": "rollout.stage_started", "created_at": "<RFC 3339>",
     "data": {...}}

Any 2xx answer is delivered. Anything else (another status, a redirect, which is never
followed, a timeout, a refused connection) is retried after :func:`retry_delay_s` (1 s doubling
to 1 h, each with jitter), until the webhook's ``max_attempts`` POSTs have failed; then the row
is given up (``failed_at``) with one warning. At most 4 KiB of an answer's body is read.

The signing scheme is Stripe's; :func:`verify_signature` is what a receiver runs (and what the
tests run). Metrics on the given registry: ``mcp_cp_webhook_deliveries_total{webhook,result}``
(``result``: ``delivered``, ``retry``, ``failed`` = given up) and ``mcp_cp_webhook_pending
{webhook}`` (rows not yet delivered nor given up, refreshed after every round).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import random
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

import aiohttp
import orjson
from prometheus_client import CollectorRegistry, Counter, Gauge

from mcp_edge.controlplane import __version__
from mcp_edge.controlplane.db import Database, Tx
from mcp_edge.controlplane.db import webhooks as q
from mcp_edge.controlplane.db.webhooks import DeliveryView, Outcome
from mcp_edge.controlplane.metrics import ControlPlaneMetrics
from mcp_edge.controlplane.settings import EVENT_TYPE, MAX_EVENT_TYPE, WebhookConfig
from mcp_edge.shared.errors import McpError

log = logging.getLogger("mcp.controlplane.webhooks")

Clock = Callable[[], datetime]

SIGNATURE_HEADER = "X-MCP-Signature"
EVENT_HEADER = "X-MCP-Event"
DELIVERY_HEADER = "X-MCP-Delivery"
DEFAULT_TOLERANCE_S = 300.0
"""How far a signature's timestamp may be from the receiver's clock (seconds)."""
MAX_EVENT_BYTES = 64 * 1024
"""Cap on one event's ``data``, as JSON."""
MAX_RESPONSE_BYTES = 4096
MAX_SIGNATURE_HEADER = 1024
BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 3600.0
LEASE_MARGIN_S = 30.0
"""A claim lasts the longest webhook timeout plus this (seconds)."""


class WebhookError(McpError):
    """An event cannot be queued: its type is malformed, or its data is not a JSON object
    within :data:`MAX_EVENT_BYTES`."""


# ---------------------------------------------------------------------------- signing (pure)
def _mac(secret: bytes, timestamp: int, body: bytes) -> str:
    return hmac.new(secret, str(timestamp).encode() + b"." + body, hashlib.sha256).hexdigest()


def signature_header(secret: bytes, timestamp: int, body: bytes) -> str:
    """The ``X-MCP-Signature`` value for ``body`` sent at ``timestamp`` (unix seconds)."""
    return f"t={timestamp},v1={_mac(secret, timestamp, body)}"


def verify_signature(
    secret: bytes | str,
    header: str,
    body: bytes,
    now: datetime | float,
    tolerance_s: float = DEFAULT_TOLERANCE_S,
) -> bool:
    """Whether ``header`` (an ``X-MCP-Signature`` value) signs the raw ``body`` with ``secret``
    at a time within ``tolerance_s`` of ``now`` (an aware datetime or unix seconds).

    Any ``v1=`` entry may match (a sender rotating secrets can list several); entries of
    other schemes are ignored. Compares in constant time. Never raises.
    """
    if len(header) > MAX_SIGNATURE_HEADER:
        return False
    timestamp: int | None = None
    candidates: list[bytes] = []
    for part in header.split(","):
        key, sep, value = part.strip().partition("=")
        if not sep:
            continue
        if key == "t":
            if timestamp is not None or not value.isascii() or not value.isdigit():
                return False
            if len(value) > 12:
                return False
            timestamp = int(value)
        elif key == "v1":
            candidates.append(value.encode("utf-8", "replace"))
    if timestamp is None or not candidates:
        return False
    now_s = now.timestamp() if isinstance(now, datetime) else float(now)
    if abs(now_s - timestamp) > tolerance_s:
        return False
    key_bytes = secret.encode("utf-8") if isinstance(secret, str) else secret
    expected = _mac(key_bytes, timestamp, body).encode()
    return any(hmac.compare_digest(expected, c) for c in candidates)


def event_document(
    event_id: str, event: str, created_at: datetime, data: Mapping[str, Any]
) -> bytes:
    """The JSON body POSTed for one event (the same bytes for every attempt)."""
    stamp = created_at.astimezone(timezone.utc).isoformat().replace("+00:00", "Z")
    return orjson.dumps({"id": event_id, "type": event, "created_at": stamp, "data": data})


def retry_delay_s(attempts: int, rand: float) -> float:
    """Seconds to wait after the ``attempts``-th failed POST (1 s doubling, capped at 1 h),
    scaled into its upper half by ``rand`` in [0, 1) so retries of many rows spread out."""
    full = min(BACKOFF_FIRST_S * 2.0 ** max(attempts - 1, 0), BACKOFF_MAX_S)
    return full / 2 + full / 2 * rand


def check_event_type(event: str) -> str:
    """``event`` if it is a valid event type (``rollout.stage_started``); else
    :class:`WebhookError`."""
    if len(event) > MAX_EVENT_TYPE or not EVENT_TYPE.match(event):
        raise WebhookError(
            f"event type {event!r} must be dot-separated lower-case words such as "
            f"'rollout.stage_started', at most {MAX_EVENT_TYPE} characters"
        )
    return event


def _json_object(body: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(body, Mapping):
        raise WebhookError(f"event data must be a mapping, not {type(body).__name__}")
    try:
        encoded = orjson.dumps(dict(body))
    except TypeError as e:
        raise WebhookError(f"event data is not JSON: {e}") from e
    if len(encoded) > MAX_EVENT_BYTES:
        raise WebhookError(f"event data is {len(encoded)} bytes as JSON; at most {MAX_EVENT_BYTES}")
    decoded: dict[str, Any] = orjson.loads(encoded)
    return decoded


# ---------------------------------------------------------------------------- the outbox
async def enqueue(
    tx: Tx,
    webhooks: Iterable[WebhookConfig],
    event: str,
    body: Mapping[str, Any],
    *,
    now: datetime,
) -> int:
    """Queue ``event`` with ``body`` as its ``data`` for every webhook that accepts it, inside
    the caller's transaction ``tx`` (rolled back with it). Returns the rows inserted (0 when no
    webhook wants the event). Call :meth:`WebhookDispatcher.wake` once ``tx`` has committed.

    Raises :class:`WebhookError` for a malformed event type or data that is not a JSON object
    within :data:`MAX_EVENT_BYTES`.
    """
    check_event_type(event)
    data = _json_object(body)
    names = [w.name for w in webhooks if w.accepts(event)]
    return await q.insert_deliveries(
        tx, event_id=uuid.uuid4().hex, event=event, body=data, webhooks=names, now=now
    )


@dataclass(frozen=True)
class Webhook:
    """A configured webhook with its secret, read at startup by :func:`load_webhooks`."""

    config: WebhookConfig
    secret: bytes = field(repr=False)

    @property
    def name(self) -> str:
        return self.config.name


def load_webhooks(configs: Iterable[WebhookConfig]) -> tuple[Webhook, ...]:
    """Read every webhook's secret; raises :class:`controlplane.settings.SettingsError`."""
    return tuple(Webhook(c, c.read_secret()) for c in configs)


class WebhookMetrics:
    """The dispatcher's metric families, on the app's registry."""

    RESULTS = ("delivered", "retry", "failed")

    def __init__(self, registry: CollectorRegistry) -> None:
        self.deliveries = Counter(
            "mcp_cp_webhook_deliveries_total",
            "Webhook POSTs by outcome: delivered, retry (failed, to be retried), failed "
            "(given up after max_attempts).",
            ["webhook", "result"],
            registry=registry,
        )
        self.pending = Gauge(
            "mcp_cp_webhook_pending",
            "Webhook deliveries neither delivered nor given up.",
            ["webhook"],
            registry=registry,
        )


@dataclass(frozen=True)
class _Attempt:
    """One POST's result: ``error`` is empty when it was delivered."""

    error: str = ""

    @property
    def delivered(self) -> bool:
        return not self.error


class WebhookDispatcher:
    """Delivers the outbox to ``webhooks`` (see the module docstring).

    Drive it with :meth:`start`/:meth:`stop` (a background task), or call :meth:`run_once`
    directly (tests); :meth:`close` ends the HTTP client either way. ``clock`` gives the times
    written to the rows and the signature's timestamp. ``rand`` draws the retry jitter.
    """

    def __init__(
        self,
        db: Database,
        webhooks: Sequence[Webhook],
        clock: Clock,
        *,
        metrics: ControlPlaneMetrics | CollectorRegistry | None = None,
        batch_size: int = 50,
        concurrency: int = 8,
        idle_s: float = 30.0,
        rand: Callable[[], float] = random.random,
    ) -> None:
        self._db = db
        self._hooks = {w.name: w for w in webhooks}
        self._configs = tuple(w.config for w in webhooks)
        self._clock = clock
        registry = metrics.registry if isinstance(metrics, ControlPlaneMetrics) else metrics
        self.metrics = WebhookMetrics(registry or CollectorRegistry())
        self._batch_size = batch_size
        self._concurrency = asyncio.Semaphore(concurrency)
        self._connections = concurrency
        self._idle_s = idle_s
        self._rand = rand
        longest = max((w.config.timeout_s for w in webhooks), default=0.0)
        self._lease = timedelta(seconds=longest + LEASE_MARGIN_S)
        self._grace_s = longest + 1.0
        self._headers = {
            "Content-Type": "application/json",
            "User-Agent": f"mcp-edge/{__version__}",
        }
        self._http: aiohttp.ClientSession | None = None
        self._wake = asyncio.Event()
        self._stopping = False
        self._task: asyncio.Task[None] | None = None
        self._failing: set[str] = set()
        self._unknown_warned: set[str] = set()

    # ------------------------------------------------------------------ lifecycle
    async def __aenter__(self) -> WebhookDispatcher:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        """Start the background task; a no-op when it runs already."""
        if self._task is None:
            self._stopping = False
            self._task = asyncio.create_task(self._run(), name="webhook-dispatcher")

    async def stop(self) -> None:
        """Let the round in progress finish (at most the longest timeout, then it is cancelled
        and its rows are sent again after their lease), end the task, close the HTTP client."""
        task, self._task = self._task, None
        if task is not None and not task.done():
            self._stopping = True
            self._wake.set()
            with contextlib.suppress(asyncio.TimeoutError):  # wait_for cancelled the task
                await asyncio.wait_for(task, self._grace_s)
        await self.close()

    async def close(self) -> None:
        """Close the HTTP client (a later round opens a new one)."""
        if self._http is not None:
            await self._http.close()
            self._http = None

    def wake(self) -> None:
        """Run a round now (call after a transaction that enqueued events has committed)."""
        self._wake.set()

    async def notify(self, tx: Tx, event: str, body: Mapping[str, Any], now: datetime) -> None:
        """:func:`enqueue` for this dispatcher's webhooks, and :meth:`wake` once ``tx``
        commits: what a producer (the rollout service's ``notify``) is handed."""
        if await enqueue(tx, self._configs, event, body, now=now):
            q.call_after_commit(tx, self.wake)

    # ------------------------------------------------------------------ one round
    async def run_once(self) -> int:
        """Claim one batch of due rows, POST them, record the outcomes; return how many rows
        were claimed. Database errors pass out as :mod:`controlplane.db.errors`."""
        now = self._clock()
        claimed: list[DeliveryView] = []
        if self._hooks:
            async with self._db.transaction() as tx:
                claimed = await q.claim_due(
                    tx,
                    webhooks=list(self._hooks),
                    now=now,
                    lease_until=now + self._lease,
                    limit=self._batch_size,
                )
        outcomes = await asyncio.gather(*(self._deliver(row) for row in claimed))
        if outcomes:
            async with self._db.transaction() as tx:
                await q.record_outcomes(tx, outcomes, now=self._clock())
                pending = await q.pending_by_webhook(tx)
        else:
            async with self._db.read() as tx:
                pending = await q.pending_by_webhook(tx)
        for row, outcome in zip(claimed, outcomes, strict=True):
            self._account(row, outcome)
        self._show_pending(pending)
        return len(claimed)

    async def _deliver(self, row: DeliveryView) -> Outcome:
        hook = self._hooks[row.webhook]
        limit = hook.config.max_attempts
        if row.attempts > limit:  # its last claim was cut short (a stop, a crash)
            error = row.last_error or "interrupted"
            return Outcome(row.id, row.attempts, delivered=False, error=error, give_up=True)
        async with self._concurrency:
            attempt = await self._post(hook, row)
        if attempt.delivered:
            return Outcome(row.id, row.attempts, delivered=True)
        if row.attempts >= limit:
            return Outcome(row.id, row.attempts, delivered=False, error=attempt.error, give_up=True)
        delay = retry_delay_s(row.attempts, self._rand())
        retry_at = self._clock() + timedelta(seconds=delay)
        return Outcome(
            row.id, row.attempts, delivered=False, error=attempt.error, retry_at=retry_at
        )

    async def _post(self, hook: Webhook, row: DeliveryView) -> _Attempt:
        """POST one row; every failure comes back as an :class:`_Attempt` with its reason."""
        body = event_document(row.event_id, row.event, row.created_at, row.body)
        timestamp = int(self._clock().timestamp())
        headers = {
            **self._headers,
            EVENT_HEADER: row.event,
            DELIVERY_HEADER: row.event_id,
            SIGNATURE_HEADER: signature_header(hook.secret, timestamp, body),
        }
        timeout = aiohttp.ClientTimeout(total=hook.config.timeout_s)
        try:
            async with self._session().post(
                hook.config.url, data=body, headers=headers, allow_redirects=False, timeout=timeout
            ) as response:
                head = await response.content.read(MAX_RESPONSE_BYTES)
                status = response.status
                location = response.headers.get("Location", "")
        except asyncio.TimeoutError:
            return _Attempt(f"no answer within {hook.config.timeout_s:g} s")
        except (aiohttp.ClientError, OSError, ValueError) as e:
            return _Attempt(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
        if 200 <= status < 300:
            return _Attempt()
        if 300 <= status < 400:
            return _Attempt(
                f"HTTP {status} redirect to {location[:200]!r} (redirects are not followed)"
            )
        text = head[:200].decode("utf-8", "replace")
        return _Attempt(f"HTTP {status}: {text}" if text else f"HTTP {status}")

    def _session(self) -> aiohttp.ClientSession:
        if self._http is None or self._http.closed:
            self._http = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._connections),
                cookie_jar=aiohttp.DummyCookieJar(),
                trust_env=False,
            )
        return self._http

    def _account(self, row: DeliveryView, outcome: Outcome) -> None:
        """Count one outcome and log what an operator needs: a webhook starting to fail, its
        recovery, and each delivery given up."""
        name = row.webhook
        if outcome.delivered:
            self.metrics.deliveries.labels(name, "delivered").inc()
            if name in self._failing:
                self._failing.discard(name)
                log.info("webhook %s: delivering again", name)
            return
        if outcome.give_up:
            self.metrics.deliveries.labels(name, "failed").inc()
            log.warning(
                "webhook %s: gave up on event %s (%s) after %d attempts; last error: %s",
                name,
                row.event_id,
                row.event,
                row.attempts,
                outcome.error,
            )
        else:
            self.metrics.deliveries.labels(name, "retry").inc()
        if name not in self._failing:
            self._failing.add(name)
            log.warning(
                "webhook %s: delivery failed (%s); retrying with backoff", name, outcome.error
            )

    def _show_pending(self, pending: Mapping[str, int]) -> None:
        for name in self._hooks:
            self.metrics.pending.labels(name).set(pending.get(name, 0))
        for name in sorted(set(pending) - set(self._hooks) - self._unknown_warned):
            self._unknown_warned.add(name)
            log.warning(
                "%d webhook deliveries wait for webhook %r, which is not configured here; they "
                "are sent if it is configured again",
                pending[name],
                name,
            )

    # ------------------------------------------------------------------ the task
    async def _wait_s(self) -> float:
        async with self._db.read() as tx:
            due = await q.next_due(tx, webhooks=list(self._hooks))
        if due is None:
            return self._idle_s
        # A floor: rows due now but locked by another replica's claim are leased a moment later.
        return min(max((due - self._clock()).total_seconds(), 0.1), self._idle_s)

    async def _run(self) -> None:
        retry_s = 1.0
        while not self._stopping:
            try:
                claimed = await self.run_once()
                retry_s = 1.0
                wait_s = 0.0 if claimed >= self._batch_size else await self._wait_s()
            except Exception:  # the task must outlive any one failing round
                log.exception("webhook delivery round failed; trying again in %.0f s", retry_s)
                wait_s, retry_s = retry_s, min(retry_s * 2, self._idle_s)
            if self._stopping:
                break
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), wait_s)
            self._wake.clear()
