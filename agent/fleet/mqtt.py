"""The agent's one MQTT adapter: paho-mqtt 2.x (MQTT 5) made async, after aiomqtt.

Shape (STYLE 6):

- :class:`MqttClient` is long-lived; each :meth:`MqttClient.connect` opens one connection
  with a fresh paho client whose socket is watched by the asyncio loop (``add_reader`` /
  ``add_writer``), so packets are read and written on the event loop thread and no paho thread
  runs. The blocking TCP/TLS connect runs in the default executor; the paho callbacks it
  triggers there cross into the loop with ``loop.call_soon_threadsafe``.
- TCP_NODELAY is set on the socket as soon as it opens (DESIGN 8: Nagle turned a 0.3 ms QoS 1
  round trip into 44-88 ms).
- MQTT 5, ``clean_start=False`` with a Session Expiry Interval (a persistent session), a
  keep-alive, an optional will and TLS context, username/password/client id.
- Each pending QoS 1 publish and (un)subscribe has a future keyed by its packet id, removed in
  ``finally``/a done callback; a lost connection fails them all with
  :class:`MqttConnectionLostError` (one socket's machinery: :mod:`agent.fleet.mqtt_connection`).
- Subscriptions are remembered, once per filter, and restored in one SUBSCRIBE after every
  connect, before :meth:`connect` returns, so a caller publishes its birth message after the
  subscriptions are back (Home Assistant's order). The caller owns reconnecting, using
  :class:`Backoff` (exponential, full jitter).

Settings, messages, errors (the tree is drawn in :mod:`agent.fleet.mqtt_types`) and
:class:`Backoff` are importable from here too.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import paho.mqtt.client as paho

from mcp_edge.agent.fleet.mqtt_connection import Connection
from mcp_edge.agent.fleet.mqtt_types import (
    RC_NO_MATCHING_SUBSCRIBERS,
    Backoff,
    ConnectResult,
    InboundMessage,
    MqttConnectError,
    MqttConnectionLostError,
    MqttError,
    MqttRefusedError,
    MqttSettings,
    MqttTimeoutError,
    Subscription,
    Will,
    parse_host_port,
)

__all__ = [
    "RC_NO_MATCHING_SUBSCRIBERS", "Backoff", "ConnectResult", "InboundMessage", "MqttClient",
    "MqttConnectError", "MqttConnectionLostError", "MqttError", "MqttRefusedError",
    "MqttSettings", "MqttTimeoutError", "Subscription", "Will", "parse_host_port",
]  # fmt: skip

log = logging.getLogger("mcp.agent.mqtt")


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
        self._handler: Callable[[InboundMessage], None] | None = None
        self.dropped_messages = 0
        """Inbound messages dropped because the queue was full or the topic was not UTF-8."""

    @property
    def connected(self) -> bool:
        return self._conn is not None and self._conn.up

    @property
    def tcp_nodelay(self) -> bool:
        """Whether TCP_NODELAY is on for the current connection's socket."""
        return self._conn is not None and self._conn.nodelay

    @property
    def subscriptions(self) -> tuple[Subscription, ...]:
        return tuple(self._subs.values())

    # ------------------------------------------------------------------ connect / disconnect
    async def connect(self) -> ConnectResult:
        """Open a connection, wait for CONNACK and restore the remembered subscriptions.

        Raises :class:`MqttConnectError` (nothing is left open) or
        :class:`MqttConnectionLostError` when the connection drops while restoring.
        """
        if self._conn is not None and not self._conn.closed.done():
            raise MqttError("already connected; disconnect first")
        if self._queue is None:
            self._queue = asyncio.Queue()
        conn = self._conn = Connection(self.settings, self._received)
        session_present = await conn.open()
        refused: list[tuple[str, Any]] = []
        if self._subs:
            refused = await conn.subscribe(list(self._subs.values()))
        for f, rc in refused:
            log.warning("broker refused the subscription %s: %s", f, rc)
        return ConnectResult(session_present, tuple(f for f, _ in refused))

    async def disconnect(self, timeout_s: float = 5.0) -> None:
        """Send DISCONNECT (the will is not published) and close. Never raises."""
        if self._conn is not None:
            await self._conn.disconnect(timeout_s)

    async def wait_disconnected(self) -> str:
        """Wait until the current connection is gone; return why. Immediate when not connected."""
        if self._conn is None:
            return "never connected"
        return await asyncio.shield(self._conn.closed)

    async def close(self) -> None:
        """Disconnect and end :meth:`messages` iterations."""
        await self.disconnect()
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
        Raises :class:`MqttConnectionLostError` at once when not connected.
        """
        if self._conn is None:
            raise MqttConnectionLostError("not connected to the broker")
        return self._conn.publish(
            topic, payload, qos, retain, response_topic=response_topic,
            correlation_data=correlation_data, user_properties=user_properties,
            content_type=content_type, message_expiry_s=message_expiry_s,
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
        try:
            return await asyncio.wait_for(fut, timeout_s or self.settings.ack_timeout_s)
        except asyncio.TimeoutError:
            raise MqttTimeoutError(f"no PUBACK for {topic!r:.80}") from None
        finally:
            if not fut.done():
                fut.cancel()  # its done callback removes the packet id's entry

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
        assert self._conn is not None
        refused = await self._conn.subscribe(items)
        if refused:
            for f, _ in refused:
                self._subs.pop(f, None)
            raise MqttRefusedError(
                "broker refused " + ", ".join(f"{f} ({rc})" for f, rc in refused),
                refused[0][1].value,
            )

    async def unsubscribe(self, *filters: str) -> None:
        """Forget the filters and unsubscribe now if connected."""
        known = [f for f in filters if self._subs.pop(f, None) is not None]
        if known and self.connected:
            assert self._conn is not None
            await self._conn.unsubscribe(known)

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

    def set_handler(self, handler: Callable[[InboundMessage], None] | None) -> None:
        """Deliver messages by calling ``handler`` on the loop as each arrives, instead of
        through :meth:`messages` (one loop turn less on a request/response path). The handler
        must not block and must not raise; it typically starts a task."""
        self._handler = handler

    def _received(self, m: paho.MQTTMessage) -> None:
        try:
            topic = m.topic
        except UnicodeDecodeError:
            self.dropped_messages += 1
            log.warning("dropped a message whose topic is not UTF-8")
            return
        props = m.properties
        msg = InboundMessage(
            topic=topic,
            payload=bytes(m.payload),
            qos=m.qos,
            retain=bool(m.retain),
            response_topic=getattr(props, "ResponseTopic", None),
            correlation_data=getattr(props, "CorrelationData", None),
            user_properties=tuple(getattr(props, "UserProperty", ()) or ()),
            content_type=getattr(props, "ContentType", None),
        )
        if self._handler is not None:
            try:
                self._handler(msg)
            except Exception:
                log.exception("message handler failed on %.120s", topic)
            return
        q = self._queue
        if q is None:
            return
        if q.qsize() >= self.settings.max_queued_messages:
            self.dropped_messages += 1
            log.warning("inbound queue full (%d); dropped a message on %s", q.qsize(), topic)
            return
        q.put_nowait(msg)
