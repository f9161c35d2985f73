"""The outbound path of the fleet session: spool first, then publish in order, then delete.

:meth:`Outbox.put` writes a message to the :class:`agent.fleet.spool.Spool` (on one worker
thread, so the event loop never waits on an fsync) and wakes the drainer. :meth:`Outbox.run`
is the drainer: while the session is online it reads the oldest rows, publishes them as one
pipelined batch of QoS 1 messages (one connection keeps their order), and deletes each row only
once its PUBACK arrived. A row the broker refuses (reason >= 0x80: it can never be delivered)
is deleted with an error line; a row whose ack did not come (the connection dropped) stays and
is sent again after the reconnect, so delivery is at least once: receivers deduplicate by
``event_seq`` (events) or ``ts`` (telemetry).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from mcp_edge.agent.fleet.metrics import FleetMetrics
from mcp_edge.agent.fleet.spool import Spool, SpoolError, SpoolItem, SpoolKind
from mcp_edge.shared.mqtt import MqttClient, MqttError, MqttRefusedError

log = logging.getLogger("mcp.agent.fleet")
T = TypeVar("T")


class Outbox:
    def __init__(
        self,
        spool: Spool,
        mqtt: MqttClient,
        metrics: FleetMetrics,
        online: asyncio.Event,
        *,
        batch: int = 64,
        ack_timeout_s: float = 30.0,
    ) -> None:
        self.spool = spool
        self.mqtt = mqtt
        self.metrics = metrics
        self.online = online
        self.batch = batch
        self.ack_timeout_s = ack_timeout_s
        self._wake = asyncio.Event()
        self._exec = ThreadPoolExecutor(1, thread_name_prefix="mcp-spool")

    async def put(self, kind: SpoolKind, topic: str, payload: bytes, retain: bool = False) -> bool:
        """Spool one message (QoS 1) and wake the drainer; False (logged) when the spool failed."""
        try:
            await self.call(self.spool.put, kind, topic, payload, 1, retain)
        except SpoolError as e:
            log.error("could not spool a %s message: %s", kind.value, e)
            return False
        self.metrics.spooled.labels(kind.value).inc()
        self._figures()
        self._wake.set()
        return True

    def wake(self) -> None:
        """Look at the spool again (after a reconnect)."""
        self._wake.set()

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a spool method on the spool's worker thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._exec, functools.partial(fn, *args))

    async def close(self) -> None:
        await self.call(self.spool.close)
        self._exec.shutdown(wait=True)

    def _figures(self) -> None:
        self.metrics.spool_rows.set(self.spool.rows)
        for kind, n in self.spool.dropped.items():
            self.metrics.spool_dropped.labels(kind).set(n)

    async def run(self) -> None:
        """The drainer; runs until cancelled."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self.online.is_set():
                try:
                    items = await self.call(self.spool.peek, self.batch)
                except SpoolError as e:
                    log.error("cannot read the spool: %s", e)
                    break
                if not items or not await self._deliver(items):
                    break

    async def _deliver(self, items: list[SpoolItem]) -> bool:
        """Publish a batch in order and delete what the broker acked.
        Returns False when the connection went away (the rest stays for the next one)."""
        sent: list[tuple[SpoolItem, asyncio.Future[int]]] = []
        done: list[int] = []
        lost = False
        for item in items:
            try:
                fut = self.mqtt.publish_nowait(item.topic, item.payload, item.qos, item.retain)
            except MqttRefusedError as e:
                log.error("dropped an undeliverable %s message: %s", item.kind.value, e)
                done.append(item.id)
                continue
            except MqttError:
                lost = True
                break
            sent.append((item, fut))
        results = await asyncio.gather(
            *(asyncio.wait_for(f, self.ack_timeout_s) for _, f in sent), return_exceptions=True
        )
        for (item, _), r in zip(sent, results, strict=True):
            if isinstance(r, MqttRefusedError):
                log.error("broker refused a spooled %s message on %s (%s); dropped it",
                          item.kind.value, item.topic, r)  # fmt: skip
                done.append(item.id)
            elif isinstance(r, BaseException):
                lost = True
            else:
                done.append(item.id)
                self.metrics.delivered.labels(item.kind.value).inc()
        if done:
            try:
                await self.call(self.spool.ack, done)
            except SpoolError as e:
                log.error("cannot delete delivered rows from the spool: %s", e)
                return False
            self._figures()
        return not lost
