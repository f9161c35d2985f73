"""The control plane's MQTT 5 sessions (ingestion, repository serving, desired states): a thin
layer over the one adapter, :mod:`mcp_edge.shared.mqtt`.

``async with MqttSubscriber(...)`` owns one :class:`~mcp_edge.shared.mqtt.Session` logged in
with a service account: paho on the event loop's thread (no paho thread), so a message is
handled, and its PUBACK queued, inside the read that brought it, and the acknowledgements and
replies of everything one read brought in go out in one write; the socket is read 64 KiB at a
time; TCP_NODELAY is on; a socket connected to itself counts as a failed connect. A dropped
session is reconnected by the session's keeper with :data:`CP_RECONNECT` (1 s doubling to
30 s, at least half of each step) and every filter is subscribed again each time, so the caller
never handles reconnects.

A handler receives ``(topic, payload)`` (``handler``) or, given ``on_message``, the whole
:class:`~mcp_edge.shared.mqtt.InboundMessage` with the MQTT 5 properties a request/response
service needs (response topic, correlation data, user properties, QoS). Handlers run on the
loop inside the read: they must not block; they may publish. :meth:`MqttSubscriber.publish`
sends and waits for the broker's PUBACK; :meth:`MqttSubscriber.publish_nowait` hands the
message to paho and returns (for high-rate replies whose delivery the requester checks
itself). Use a session from the loop that started it.

Errors are the adapter's (:class:`~mcp_edge.shared.mqtt.MqttError` and its subclasses): at
start for anything the broker refuses or that does not answer, and for a publish while
disconnected or refused by the broker; later losses are logged and healed by the keeper, and
:attr:`MqttSubscriber.problem` says why the session is down meanwhile.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mcp_edge.controlplane.broker.base import Credentials
from mcp_edge.shared.mqtt import (
    RETAIN_SEND_ON_SUBSCRIBE,
    MessageHandler,
    MqttClient,
    MqttError,
    MqttSettings,
    ReconnectPolicy,
    Session,
    Subscription,
)

CP_RECONNECT = ReconnectPolicy(first_delay_s=1.0, max_delay_s=30.0, jitter=0.5, stable_after_s=0)
RECEIVE_MAXIMUM = 20_000
"""Unacknowledged QoS 1 messages an ``ack_when_stored`` session lets the broker send: a few
batches' worth (ingestion commits every 100 ms or 500 rows)."""
"""The control plane's sessions (and the broker admin session) wait 0.5-1 s after a loss,
doubling to 15-30 s; any successful login resets the count."""

TopicHandler = Callable[[str, bytes, int], None]
"""``(topic, payload, ack_token)``: see :data:`mcp_edge.shared.mqtt.connection.TopicHandler`."""


@dataclass(frozen=True)
class BrokerAddress:
    """Where the control plane's own MQTT sessions go (not the URL devices are given)."""

    host: str
    port: int
    tls: bool = False

    @classmethod
    def parse(cls, url: str) -> BrokerAddress:
        """``mqtt://host[:1883]`` or ``mqtts://host[:8883]``; raises :class:`MqttError`."""
        scheme, sep, rest = url.partition("://")
        if not sep or scheme not in ("mqtt", "mqtts"):
            raise MqttError(f"broker URL {url!r} must start with mqtt:// or mqtts://")
        hostport = rest.split("/", 1)[0]
        host, colon, port_text = hostport.rpartition(":")
        if not colon or "]" in port_text:
            host, port_text = hostport, ""
        host = host.strip("[]")
        if not host or (port_text and not port_text.isdigit()):
            raise MqttError(f"broker URL {url!r} needs a host and an optional numeric port")
        tls = scheme == "mqtts"
        return cls(host, int(port_text) if port_text else (8883 if tls else 1883), tls)


class MqttSubscriber:
    """One MQTT 5 session subscribed to ``filters`` at QoS 1, handing messages to ``handler``
    (``(topic, payload)``) or, when given, to ``on_message`` (an ``InboundMessage``).
    With no filters (and no handler) it is a publish-only session.

    ``on_subscribed`` is called on the loop each time the broker has granted every filter
    again (first start and every reconnect), inside the read that brought the SUBACK: the
    retained messages follow it (every filter asks for them on each subscription).

    ``ack_when_stored``: the handler's QoS 1 messages are acknowledged only by :meth:`ack`,
    which ingestion calls once their rows are committed; a replica killed in between leaves
    them unacknowledged, and the broker delivers them again (to its restart, or to another
    member of the share group when the session ends). The session asks for a Receive Maximum
    of :data:`RECEIVE_MAXIMUM`, so a batch waiting for its commit does not stall delivery.

    ``session_expiry_s``: after a crash or a lost connection the broker keeps the session (and
    queues its QoS 1 messages, including its turn of every shared subscription) this long, so
    a process restarted with the same client id misses nothing. :meth:`close` ends the session
    at once (DISCONNECT with a session expiry of 0): a replica that stops cleanly leaves its
    share groups instead of swallowing its share of messages until the expiry.
    """

    def __init__(
        self,
        address: BrokerAddress,
        credentials: Credentials,
        filters: Sequence[str],
        handler: TopicHandler | None = None,
        *,
        on_message: MessageHandler | None = None,
        on_subscribed: Callable[[], None] | None = None,
        name: str = "ingest",
        keepalive_s: int = 30,
        session_expiry_s: int = 300,
        timeout_s: float = 10.0,
        max_inflight: int = 20,
        reconnect: ReconnectPolicy = CP_RECONNECT,
        ack_when_stored: bool = False,
    ) -> None:
        if filters and (handler is None) == (on_message is None):
            raise ValueError("give exactly one of handler and on_message")
        if not filters and (handler is not None or on_message is not None):
            raise ValueError("a session without filters receives nothing: give no handler")
        self._timeout_s = timeout_s
        self._filters = [
            Subscription(f, qos=1, retain_handling=RETAIN_SEND_ON_SUBSCRIBE) for f in filters
        ]
        self._client = MqttClient(MqttSettings(
            host=address.host, port=address.port, client_id=credentials.client_id,
            username=credentials.username, password=credentials.password,
            keepalive_s=keepalive_s, clean_start=False, session_expiry_s=session_expiry_s,
            tls=ssl.create_default_context() if address.tls else None,
            connect_timeout_s=timeout_s, ack_timeout_s=timeout_s,
            max_inflight_messages=max_inflight,
            manual_ack=ack_when_stored and handler is not None,
            receive_maximum=RECEIVE_MAXIMUM if ack_when_stored else None,
        ))  # fmt: skip
        if handler is not None:
            self._client.set_topic_handler(handler)
        elif on_message is not None:
            self._client.set_handler(on_message)
        self._session = Session(
            self._client, name=name, policy=reconnect, on_subscribed=on_subscribed,
            end_session_on_close=True,
        )  # fmt: skip

    @property
    def where(self) -> str:
        return self._client.where

    @property
    def name(self) -> str:
        """What the session is for (``ingest``, ``repository``, ``desired``): logs and metrics."""
        return self._session.name

    @property
    def up(self) -> bool:
        """Whether the session is logged in (and, with filters, subscribed) right now."""
        return self._session.up

    @property
    def problem(self) -> str | None:
        """Why the session is not up (a refused login, an unreachable broker); None when up."""
        return self._session.problem

    def ack(self, tokens: Sequence[int]) -> int:
        """Acknowledge messages by the tokens the handler got (``ack_when_stored``); see
        :meth:`MqttClient.ack`."""
        return self._client.ack(tokens)

    async def __aenter__(self) -> MqttSubscriber:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Connect and subscribe; return once the broker granted every filter.

        Raises MqttError: unreachable, login refused, a filter refused, or no answer in time.
        """
        await self._client.subscribe(*self._filters)  # remembered: sent with each connect
        try:
            await self._session.start(wait=True)
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        """End the session (DISCONNECT, session expiry 0) and close the socket. Safe twice."""
        await self._session.close()

    async def publish(
        self,
        topic: str,
        payload: bytes,
        *,
        qos: int = 1,
        retain: bool = False,
        user_properties: Sequence[tuple[str, str]] = (),
        correlation_data: bytes | None = None,
        response_topic: str | None = None,
    ) -> None:
        """Publish and, at QoS 1 or 2, wait for the broker's acknowledgement.

        Raises MqttError: not connected, paho refused the message, the broker answered with a
        failure reason code (e.g. not authorised), or no acknowledgement within ``timeout_s``.
        """
        await self._client.publish(
            topic, payload, qos, retain, timeout_s=self._timeout_s,
            user_properties=user_properties, correlation_data=correlation_data,
            response_topic=response_topic,
        )  # fmt: skip

    def publish_nowait(
        self,
        topic: str,
        payload: bytes,
        *,
        qos: int = 1,
        retain: bool = False,
        user_properties: Sequence[tuple[str, str]] = (),
        correlation_data: bytes | None = None,
        response_topic: str | None = None,
    ) -> None:
        """Hand one message to paho without waiting for the broker.

        It is written in this loop turn (from a handler: with the acknowledgements of the read
        that brought the request). Raises MqttError: not connected, or paho refused the message
        (e.g. too large).
        """
        self._client.send(
            topic, payload, qos, retain, user_properties=user_properties,
            correlation_data=correlation_data, response_topic=response_topic,
        )  # fmt: skip
