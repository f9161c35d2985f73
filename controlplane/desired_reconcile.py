"""Repairs what the broker forgot or was told wrongly about desired states.

The database holds each device's newest signed desired state; the broker's retained message on
the device's ``desired`` topic is only a copy, and it can go stale: a broker that is SIGKILLed
comes back from its last save with older retained messages or none, and anyone allowed to
publish there can leave an old envelope behind. A device that connects then gets the stale
copy, and nothing would ever publish again, because the row says it was published.

:class:`DesiredReconciler` is the desired-state session's message handler, subscribed to
``mcp/v1/dev/+/desired``:

- every retained copy the broker hands over at (re)subscription, and every later publish by
  anyone, is compared with the stored envelope (its ``seq`` and signatures); a copy that differs
  marks the row unpublished, so the publisher sends the newest document again;
- after each (re)subscription, once the retained copies stop arriving (``quiet_s`` without one,
  ``sweep_after_s`` at most), every published row whose device had no retained copy at all is
  marked unpublished too: the broker lost it.

Since the session subscribes again after each reconnect, a broker restart is always followed by
a full comparison. Handlers run on the loop inside paho's read, so messages are only noted there
and compared in batches by a task (``BATCH`` devices per query).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import orjson

from mcp_edge.controlplane.db import Database, DatabaseError
from mcp_edge.controlplane.db import deployments as q
from mcp_edge.shared.errors import TopicError
from mcp_edge.shared.protocol import topics

log = logging.getLogger("mcp.controlplane.desired")

BATCH = 500
Fingerprint = tuple[int, tuple[str, ...]] | None
"""``(seq, signatures)`` of an envelope; None for an empty or unreadable payload."""


def fingerprint(envelope: Any) -> Fingerprint:
    """What tells two signed desired states apart: their seq and their signatures."""
    if not isinstance(envelope, dict):
        return None
    signed, signatures = envelope.get("signed"), envelope.get("signatures")
    if not isinstance(signed, dict) or not isinstance(signatures, list):
        return None
    seq = signed.get("seq")
    if not isinstance(seq, int) or isinstance(seq, bool):
        return None
    sigs = tuple(str(s.get("sig")) for s in signatures if isinstance(s, dict))
    return seq, sigs


def payload_fingerprint(payload: bytes) -> Fingerprint:
    try:
        return fingerprint(orjson.loads(payload)) if payload else None
    except orjson.JSONDecodeError:
        return None


class DesiredReconciler:
    """Compares retained desired states with the database and marks stale ones unpublished.

    ``wake`` is called after rows were marked (the deployment service's publisher runs then).
    """

    def __init__(
        self,
        db: Database,
        wake: Callable[[], None],
        *,
        quiet_s: float = 2.0,
        sweep_after_s: float = 30.0,
    ) -> None:
        self._db = db
        self._wake = wake
        self._quiet_s = quiet_s
        self._sweep_after_s = sweep_after_s
        self._seen: dict[str, Fingerprint] = {}  # since the last check, by device
        self._retained_since_subscribe: set[str] = set()
        self._arrived = asyncio.Event()
        self._checker: asyncio.Task[None] | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self.repaired = 0
        """How many stale or missing retained copies were found (for tests and logs)."""

    # ---- called on the loop by the MQTT session -------------------------------------------

    def handle(self, topic: str, payload: bytes, _ack: int = 0) -> None:
        """One message on a ``desired`` topic: note it for the next comparison (acknowledged
        by the session as it arrives: nothing here needs to survive a crash)."""
        try:
            parsed = topics.parse(topic)
        except TopicError:
            return
        device_id = getattr(parsed, "device_id", None)
        if not isinstance(device_id, str):
            return
        self._seen[device_id] = payload_fingerprint(payload)
        self._retained_since_subscribe.add(device_id)
        self._arrived.set()
        if self._checker is None or self._checker.done():
            self._checker = asyncio.get_running_loop().create_task(
                self._check_soon(), name="desired-reconcile"
            )

    def subscribed(self) -> None:
        """The session (re)subscribed: the broker now sends every retained copy; sweep after."""
        self._retained_since_subscribe = set()
        if self._sweeper is not None:
            self._sweeper.cancel()
        self._sweeper = asyncio.get_running_loop().create_task(
            self._sweep_after_burst(), name="desired-sweep"
        )

    async def close(self) -> None:
        for task in (self._checker, self._sweeper):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    # ---- comparison ------------------------------------------------------------------------

    async def _check_soon(self) -> None:
        await asyncio.sleep(0)  # let the rest of this read's messages be noted first
        while self._seen:
            batch = dict(list(self._seen.items())[:BATCH])
            for device_id in batch:
                del self._seen[device_id]
            try:
                await self.check(batch)
            except DatabaseError as e:
                log.warning("desired-state reconciliation: %s; the next reconnect checks again", e)
                return

    async def check(self, copies: dict[str, Fingerprint]) -> list[str]:
        """Mark unpublished every published row whose broker copy in ``copies`` differs from
        it; return those devices."""
        async with self._db.read() as tx:
            stored = await q.desired_states(tx, copies)
        stale = [
            d
            for d, view in stored.items()
            if view.published_at is not None and fingerprint(view.envelope) != copies[d]
        ]
        await self._mark(stale, "the broker's retained copy is stale")
        return stale

    async def _sweep_after_burst(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._sweep_after_s
        while loop.time() < deadline:
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), self._quiet_s)
            except asyncio.TimeoutError:
                break
        try:
            await self.sweep(set(self._retained_since_subscribe))
        except DatabaseError as e:
            log.warning("desired-state sweep: %s; the next reconnect sweeps again", e)

    async def sweep(self, retained: set[str]) -> list[str]:
        """Mark unpublished every published row whose device is not in ``retained`` (the
        broker holds no copy); return those devices."""
        async with self._db.read() as tx:
            published = await q.published_devices(tx)
        missing = [d for d in published if d not in retained]
        await self._mark(missing, "the broker holds no retained copy")
        return missing

    async def _mark(self, device_ids: list[str], why: str) -> None:
        if not device_ids:
            return
        async with self._db.transaction() as tx:
            await q.mark_unpublished(tx, device_ids)
        self.repaired += len(device_ids)
        shown = ", ".join(device_ids[:10]) + (" …" if len(device_ids) > 10 else "")
        log.warning(
            "desired state of %d device(s) published again: %s (%s)", len(device_ids), why, shown
        )
        self._wake()
