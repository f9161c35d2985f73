"""The MQTT client: paho-mqtt 2.x (MQTT 5) made async, after aiomqtt.

- :class:`MqttClient` is long-lived; each :meth:`MqttClient.connect` opens one
  :class:`~mcp_edge.shared.mqtt.connection.Connection` with a fresh paho client whose socket
  the asyncio loop watches, so packets are read and written on the event loop thread and no
  paho thread runs.
- Each pending QoS 1 publish and (un)subscribe has a future keyed by its packet id, removed in
  ``finally``/a done callback; a lost connection fails them all with
  :class:`MqttConnectionLostError`.
- Subscriptions are remembered, once per filter, and restored in one SUBSCRIBE after every
  connect, before :meth:`connect` returns, so a caller publishes its birth message after the
  subscriptions are back (Home Assistant's order). The restored hook runs inside the read that
  brought the SUBACK, before the retained messages that follow it.
- Messages go to a handler called on the loop inside the read (:meth:`set_handler`, or
  :meth:`set_topic_handler` for ``(topic, payload)`` only), or to :meth:`messages`. The client does not reconnect by itself:
  :class:`~mcp_edge.shared.mqtt.session.Session` does.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from mcp_edge.shared.mqtt.connection import Connection, Refusals, TopicHandler
from mcp_edge.shared.mqtt.errors import (
    MqttConnectionLostError,
    MqttError,
    MqttRefusedError,
    MqttTimeoutError,
)
from mcp_edge.shared.mqtt.values import (
    ConnectResult,
    InboundMessage,
    MqttSettings,
    Subscription,
    tcp_nodelay_of,
)

log = logging.getLogger("mcp.mqtt")

MessageHandler = Callable[[InboundMessage], None]
"""Called on the loop, inside the read, with each message; must not block or raise."""
RestoredHook = Callable[[tuple[str, ...]], None]
"""Called on the loop with the refused filters once the subscriptions are back after a connect."""


class MqttClient:
    """An async MQTT 5 client (see the module docstring). Not thread-safe: use it from one loop.

    ``async with MqttClient(settings) as c`` connects once and disconnects on exit; a long-lived
    owner calls :meth:`connect` again after :meth:`wait_disconnected` returns.
    """

    def __init__(self, settings: MqttSettings) -> None:
        self.settings = settings
        self._subs: dict[str, Subscription] = {}
        self._conn: Connection | None = None
        self._queue: asyncio.Queue[InboundMessage | None] | None = None
        self._handler: MessageHandler | None = None
        self._topic_handler: TopicHandler | None = None
        self._restored: RestoredHook | None = None
        self.dropped_messages = 0
        """Inbound messages dropped because the queue was full or the topic was not UTF-8."""

    @property
    def connected(self) -> bool:
        return self._conn is not None and self._conn.up

    @property
    def where(self) -> str:
        return self.settings.where

    @property
    def tcp_nodelay(self) -> bool:
        """Whether TCP_NODELAY is on for the current connection's socket (read from it)."""
        return (
            self.connected and self._conn is not None and tcp_nodelay_of(self._conn.client.socket())
        )

    @property
    def subscriptions(self) -> tuple[Subscription, ...]:
        return tuple(self._subs.values())

    # ------------------------------------------------------------------ connect / disconnect
    async def connect(self) -> ConnectResult:
        """Open a connection, wait for CONNACK and restore the remembered subscriptions.

        Raises :class:`MqttConnectError` (nothing is left open),
        :class:`MqttConnectionLostError` when the connection drops while restoring, or
        :class:`MqttTimeoutError` when the SUBACK does not come.
        """
        if self._conn is not None and not self._conn.closed.done():
            raise MqttError("already connected; disconnect first")
        if self._queue is None:
            self._queue = asyncio.Queue()
        conn = self._conn = Connection(self.settings, self._received, self._undecodable)
        conn.topic_handler = self._topic_handler
        session_present = await conn.open()
        refused: Refusals = []
        if self._subs:
            refused = await conn.subscribe(list(self._subs.values()), self._on_restored)
        else:
            self._on_restored([])
        for f, _, reason in refused:
            log.warning("%s refused the subscription %s: %s", conn.where, f, reason)
        return ConnectResult(session_present, tuple(f for f, _, _ in refused))

    async def disconnect(
        self, timeout_s: float = 5.0, *, session_expiry_s: int | None = None
    ) -> None:
        """Send DISCONNECT (the will is not published) and close. Never raises.

        ``session_expiry_s`` 0 ends the session at the broker now instead of at its expiry.
        """
        if self._conn is not None:
            await self._conn.disconnect(timeout_s, session_expiry_s)

    async def wait_disconnected(self) -> str:
        """Wait until the current connection is gone; return why. Immediate when not connected."""
        if self._conn is None:
            return "never connected"
        return await asyncio.shield(self._conn.closed)

    async def close(self, *, session_expiry_s: int | None = None) -> None:
        """Disconnect (see :meth:`disconnect`) and end :meth:`messages` iterations."""
        await self.disconnect(session_expiry_s=session_expiry_s)
        if self._queue is not None:
            self._queue.put_nowait(None)

    async def __aenter__(self) -> MqttClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ publish
    def publish_nowait(
        self,
        topic: str,
        payload: bytes,
        qos: int = 0,
        retain: bool = False,
        *,
        response_topic: str | None = None,
        correlation_data: bytes | None = None,
        user_properties: Sequence[tuple[str, str]] = (),
        content_type: str | None = None,
        message_expiry_s: int | None = None,
    ) -> asyncio.Future[int]:
        """Send a PUBLISH now; return a future of the PUBACK reason code (0 at once for QoS 0;
        0x10 when nobody subscribes to the topic).

        Messages published in order are sent in order. The future fails with
        :class:`MqttRefusedError` (reason >= 0x80) or :class:`MqttConnectionLostError`.
        Raises :class:`MqttConnectionLostError` at once when not connected, and
        :class:`MqttRefusedError` for a message paho will not send (too large, bad topic).
        """
        fut = self._connection().publish(
            topic, payload, qos, retain, response_topic=response_topic,
            correlation_data=correlation_data, user_properties=user_properties,
            content_type=content_type, message_expiry_s=message_expiry_s,
        )  # fmt: skip
        assert fut is not None
        return fut

    def send(
        self,
        topic: str,
        payload: bytes,
        qos: int = 0,
        retain: bool = False,
        *,
        response_topic: str | None = None,
        correlation_data: bytes | None = None,
        user_properties: Sequence[tuple[str, str]] = (),
        message_expiry_s: int | None = None,
    ) -> None:
        """Send a PUBLISH and forget it: no future, the acknowledgement is not waited for (for
        high-rate replies whose delivery the requester checks itself). From a message handler
        it goes out with the acknowledgements of the read that brought the request.

        Raises like :meth:`publish_nowait`.
        """
        self._connection().publish(
            topic, payload, qos, retain, track=False, response_topic=response_topic,
            correlation_data=correlation_data, user_properties=user_properties,
            message_expiry_s=message_expiry_s,
        )  # fmt: skip

    async def publish(
        self,
        topic: str,
        payload: bytes,
        qos: int = 0,
        retain: bool = False,
        *,
        timeout_s: float | None = None,
        **properties: Any,
    ) -> int:
        """Publish and, for QoS 1, wait for the PUBACK; return its reason code.

        Raises :class:`MqttConnectionLostError`, :class:`MqttRefusedError` or
        :class:`MqttTimeoutError` (after ``timeout_s``, default ``settings.ack_timeout_s``).
        """
        fut = self.publish_nowait(topic, payload, qos, retain, **properties)
        if fut.done():
            return fut.result()
        timeout = timeout_s or self.settings.ack_timeout_s
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise MqttTimeoutError(
                f"no PUBACK from the broker at {self.where} for {topic!r:.80} within {timeout} s"
            ) from None
        finally:
            if not fut.done():
                fut.cancel()  # its done callback removes the packet id's entry

    def _connection(self) -> Connection:
        if self._conn is None:
            raise MqttConnectionLostError(f"not connected to the broker at {self.where}")
        return self._conn

    # ------------------------------------------------------------------ subscribe
    async def subscribe(self, *subs: Subscription | str) -> None:
        """Remember the filters (restored after every reconnect) and subscribe now if connected.

        Raises :class:`MqttRefusedError` naming the filters the broker refused (they are
        forgotten), or :class:`MqttConnectionLostError`/:class:`MqttTimeoutError`.
        """
        items = [s if isinstance(s, Subscription) else Subscription(s) for s in subs]
        for s in items:
            self._subs[s.topic_filter] = s
        if not items or not self.connected:
            return
        refused = await self._connection().subscribe(items)
        if refused:
            for f, _, _ in refused:
                self._subs.pop(f, None)
            raise MqttRefusedError(
                "broker refused " + ", ".join(f"{f} ({why})" for f, _, why in refused),
                refused[0][1],
            )

    async def unsubscribe(self, *filters: str) -> None:
        """Forget the filters and unsubscribe now if connected."""
        known = [f for f in filters if self._subs.pop(f, None) is not None]
        if known and self.connected:
            await self._connection().unsubscribe(known)

    def set_restored_hook(self, hook: RestoredHook | None) -> None:
        """Call ``hook`` with the refused filters each time the subscriptions were restored after
        a connect: on the loop inside the read that brought the SUBACK, before any message that
        follows it (the retained ones); right after CONNACK when there are none. It must not
        block and must not raise."""
        self._restored = hook

    def _on_restored(self, refused: Refusals) -> None:
        if self._restored is not None:
            self._restored(tuple(f for f, _, _ in refused))

    # ------------------------------------------------------------------ receive
    async def messages(self) -> AsyncIterator[InboundMessage]:
        """Every message received, across reconnects, until :meth:`close`."""
        if self._queue is None:
            self._queue = asyncio.Queue()
        while True:
            msg = await self._queue.get()
            if msg is None:
                return
            yield msg

    def set_handler(self, handler: MessageHandler | None) -> None:
        """Deliver messages by calling ``handler`` on the loop as each arrives, inside the read
        (one loop turn less on a request/response path; what it publishes goes out with the
        read's acknowledgements), instead of through :meth:`messages`. The handler must not
        block; an exception it raises is logged."""
        self._handler = handler

    def set_topic_handler(self, handler: TopicHandler | None) -> None:
        """Like :meth:`set_handler`, for a subscriber that needs only ``(topic, payload)`` and
        an ack token
        (telemetry ingestion): no :class:`InboundMessage` is built, which saves most of the
        adapter's per-message cost. It takes precedence over :meth:`set_handler`."""
        self._topic_handler = handler
        if self._conn is not None:
            self._conn.topic_handler = handler

    def ack(self, tokens: Sequence[int]) -> int:
        """Acknowledge messages received with :attr:`MqttSettings.manual_ack` by their tokens
        (the topic handler's third argument; 0s are skipped). Tokens of an earlier connection
        are not sent: the broker delivers those messages again. Returns how many were sent."""
        conn = self._conn
        if conn is None or not tokens:
            return 0
        return conn.ack(t for t in tokens if t)

    def _undecodable(self) -> None:
        self.dropped_messages += 1
        log.warning("dropped a message whose topic is not UTF-8")

    def _received(self, msg: InboundMessage) -> None:
        if self._handler is not None:
            try:
                self._handler(msg)
            except Exception:
                log.exception("message handler failed on %.120s", msg.topic)
            return
        q = self._queue
        if q is None:
            return
        if q.qsize() >= self.settings.max_queued_messages:
            self.dropped_messages += 1
            log.warning("inbound queue full (%d); dropped a message on %s", q.qsize(), msg.topic)
            return
        q.put_nowait(msg)
