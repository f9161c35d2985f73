"""The control plane's MQTT 5 sessions: paho made async, for ingestion and repository serving.

``async with MqttSubscriber(...)`` owns one session. paho's network loop runs in its own thread
(``loop_start``); every event crosses to asyncio with ``call_soon_threadsafe``. paho reconnects
a dropped session by itself (backoff 1-30 s) and :meth:`_on_connect` subscribes again to every
filter each time, so the caller never handles reconnects. TCP_NODELAY is set on the socket as
soon as it opens (DESIGN 8: Nagle costs tens of milliseconds per small packet).

A handler receives ``(topic, payload)`` (``handler``) or, given ``on_message``, a whole
:class:`ReceivedMessage` with the MQTT 5 properties a request/response service needs (response
topic, correlation data, user properties, QoS). :meth:`MqttSubscriber.publish` sends and waits
for the broker's PUBACK; :meth:`MqttSubscriber.publish_nowait` hands the message to paho and
returns (for high-rate replies whose delivery the requester checks itself).

Errors: :class:`MqttError` for anything the broker or paho refuses at start, and for a publish
while disconnected or refused by the broker; later losses are logged and healed by paho.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import socket
import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from socket import IPPROTO_TCP, TCP_NODELAY
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

from controlplane.broker.base import Credentials
from shared.errors import McpError

log = logging.getLogger("mcp.controlplane.mqtt")

MessageHandler = Callable[[str, bytes], None]
"""Called on the event loop's thread with ``(topic, payload)`` for each delivered message."""


@dataclass(frozen=True)
class ReceivedMessage:
    """One delivered message with the MQTT 5 properties a request/response service needs."""

    topic: str
    payload: bytes
    qos: int
    response_topic: str | None = None
    correlation_data: bytes | None = None
    user_properties: tuple[tuple[str, str], ...] = ()


PropertiesHandler = Callable[[ReceivedMessage], None]
"""Called on the event loop's thread with each delivered :class:`ReceivedMessage`."""


class MqttError(McpError):
    """The broker could not be reached, refused the login, or refused a subscription."""


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
    (``(topic, payload)``) or, when given, to ``on_message`` (a :class:`ReceivedMessage`).
    With no filters (and no handler) it is a publish-only session.

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
        handler: MessageHandler | None = None,
        *,
        on_message: PropertiesHandler | None = None,
        name: str = "ingest",
        keepalive_s: int = 30,
        session_expiry_s: int = 300,
        timeout_s: float = 10.0,
        max_inflight: int = 20,
    ) -> None:
        if filters and (handler is None) == (on_message is None):
            raise ValueError("give exactly one of handler and on_message")
        if not filters and (handler is not None or on_message is not None):
            raise ValueError("a session without filters receives nothing: give no handler")
        self._address = address
        self._filters = list(filters)
        self._handler = handler
        self._on_message_handler = on_message
        self._name = name
        self._keepalive_s = keepalive_s
        self._session_expiry_s = session_expiry_s
        self._timeout_s = timeout_s
        self._client = mqtt.Client(
            CallbackAPIVersion.VERSION2, client_id=credentials.client_id, protocol=mqtt.MQTTv5
        )
        self._client.username_pw_set(credentials.username, credentials.password)
        if address.tls:
            self._client.tls_set_context(ssl.create_default_context())
        self._client.connect_timeout = timeout_s
        self._client.reconnect_delay_set(min_delay=1, max_delay=30)
        self._client.max_inflight_messages_set(max_inflight)
        self._client.on_socket_open = self._on_socket_open
        self._client.on_connect = self._on_connect
        self._client.on_subscribe = self._on_subscribe
        self._client.on_disconnect = self._on_disconnect
        self._client.on_message = self._on_message
        self._client.on_publish = self._on_publish
        self._loop: asyncio.AbstractEventLoop | None = None
        self._inbox: collections.deque[tuple[Callable[..., Any], tuple[Any, ...]]] = (
            collections.deque()
        )
        self._drain_scheduled = False
        self._acks: dict[int, asyncio.Future[None]] = {}
        self._waiting = 0  # publish() calls waiting for an acknowledgement (read by paho's thread)
        self._subscribed: asyncio.Future[None] | None = None
        self._subscribe_mid: int | None = None
        self._closed = False

    @property
    def where(self) -> str:
        return f"{self._address.host}:{self._address.port}"

    async def __aenter__(self) -> MqttSubscriber:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Connect and subscribe; return once the broker granted every filter.

        Raises MqttError: unreachable, login refused, a filter refused, or no answer in time.
        """
        self._loop = asyncio.get_running_loop()
        self._subscribed = self._loop.create_future()
        props = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
        props.SessionExpiryInterval = self._session_expiry_s
        try:
            await asyncio.to_thread(
                self._client.connect, self._address.host, self._address.port,
                self._keepalive_s, clean_start=False, properties=props,
            )
            self._client.loop_start()
            await asyncio.wait_for(self._subscribed, self._timeout_s)
        except asyncio.TimeoutError as e:  # before OSError: on 3.11+ it is one
            await self.close()
            raise MqttError(f"no subscription at the broker {self.where} within "
                            f"{self._timeout_s} s") from e
        except (OSError, ValueError) as e:
            await self.close()
            raise MqttError(f"cannot connect to the broker at {self.where}: {e}") from e
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        """Disconnect and stop paho's thread. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        props = Properties(PacketTypes.DISCONNECT)  # type: ignore[no-untyped-call]
        props.SessionExpiryInterval = 0
        self._client.disconnect(properties=props)
        await asyncio.to_thread(self._client.loop_stop)

    # ---- paho callbacks (paho's thread) ----------------------------------------------------

    def _on_socket_open(self, _client: mqtt.Client, _userdata: Any, sock: Any) -> None:
        if isinstance(sock, socket.socket) and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(IPPROTO_TCP, TCP_NODELAY, 1)

    def _on_connect(
        self, client: mqtt.Client, _u: Any, _flags: Any, reason: ReasonCode, _p: Any
    ) -> None:
        if reason.is_failure:
            self._post(self._fail, f"the broker at {self.where} refused the login: {reason}")
            return
        if not self._filters:  # a publish-only session
            self._post(self._ready)
            return
        # Every (re)connect: subscribe again, once per filter, in one SUBSCRIBE packet.
        rc, self._subscribe_mid = client.subscribe([(f, 1) for f in self._filters])
        if rc != mqtt.MQTT_ERR_SUCCESS:
            self._post(self._fail, f"cannot subscribe: {mqtt.error_string(rc)}")

    def _on_subscribe(
        self, _c: mqtt.Client, _u: Any, mid: int, reasons: list[ReasonCode], _p: Any
    ) -> None:
        if mid != self._subscribe_mid:
            return
        refused = [f for f, r in zip(self._filters, reasons, strict=False) if r.is_failure]
        if refused:
            self._post(self._fail, f"the broker refused the subscription(s) {refused}")
        else:
            self._post(self._ready)

    def _on_disconnect(
        self, _c: mqtt.Client, _u: Any, _flags: Any, reason: ReasonCode, _p: Any
    ) -> None:
        if not self._closed:
            self._post(log.warning, "%s session to %s lost (%s); paho reconnects",
                       self._name, self.where, reason)

    def _on_message(self, _c: mqtt.Client, _u: Any, message: mqtt.MQTTMessage) -> None:
        if self._handler is not None:
            self._post(self._handler, message.topic, message.payload)
            return
        props = getattr(message, "properties", None)
        correlation = getattr(props, "CorrelationData", None)
        received = ReceivedMessage(
            topic=message.topic,
            payload=bytes(message.payload),
            qos=message.qos,
            response_topic=getattr(props, "ResponseTopic", None),
            correlation_data=bytes(correlation) if correlation is not None else None,
            user_properties=tuple(
                (str(k), str(v)) for k, v in getattr(props, "UserProperty", None) or ()
            ),
        )
        if self._on_message_handler is not None:
            self._post(self._on_message_handler, received)

    def _on_publish(
        self, _c: mqtt.Client, _u: Any, mid: int, reason: ReasonCode, _p: Any
    ) -> None:
        if self._waiting:  # only publish() waits; publish_nowait() leaves nothing to settle
            self._post(self._settle, mid, reason)

    def _post(self, callback: Callable[..., Any], *args: Any) -> None:
        """Queue ``callback(*args)`` for the event loop, in order.

        A burst of messages wakes the loop once: only the first call after a drain schedules
        one (a wake-up costs a syscall and a loop iteration per call otherwise, and under load
        that, not the handling, limits how fast messages are taken in).
        """
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        self._inbox.append((callback, args))
        if self._drain_scheduled:
            return
        self._drain_scheduled = True
        with contextlib.suppress(RuntimeError):  # the loop closed after the check
            loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        # Cleared before draining: a message queued from now on schedules a drain of its own,
        # so none can be left behind.
        self._drain_scheduled = False
        inbox = self._inbox
        while inbox:
            callback, args = inbox.popleft()
            try:
                callback(*args)
            except Exception:
                log.exception("MQTT %s: a message handler failed", self._name)

    # ---- asyncio's thread ------------------------------------------------------------------

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
        if qos == 0:
            self.publish_nowait(
                topic, payload, qos=0, retain=retain, user_properties=user_properties,
                correlation_data=correlation_data, response_topic=response_topic,
            )
            return
        loop = asyncio.get_running_loop()
        self._waiting += 1  # before sending, so paho's thread posts the acknowledgement
        mid: int | None = None
        try:
            mid = self.publish_nowait(
                topic, payload, qos=qos, retain=retain, user_properties=user_properties,
                correlation_data=correlation_data, response_topic=response_topic,
            )
            # No await since the send: the acknowledgement, posted by paho's thread to this
            # loop, cannot be handled before the future is registered.
            ack = self._acks[mid] = loop.create_future()
            await asyncio.wait_for(ack, self._timeout_s)
        except asyncio.TimeoutError as e:
            raise MqttError(f"no acknowledgement from the broker at {self.where} for a publish "
                            f"on {topic!r} within {self._timeout_s} s") from e
        finally:
            self._waiting -= 1
            if mid is not None:
                self._acks.pop(mid, None)

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
    ) -> int:
        """Hand one message to paho without waiting for the broker; return its message id.

        Raises MqttError: not connected, or paho refused the message (e.g. too large).
        """
        if self._closed or not self._client.is_connected():
            raise MqttError(f"not connected to the broker at {self.where}")
        props: Properties | None = None
        if user_properties or correlation_data is not None or response_topic is not None:
            props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
            if user_properties:
                props.UserProperty = list(user_properties)
            if correlation_data is not None:
                props.CorrelationData = correlation_data
            if response_topic is not None:
                props.ResponseTopic = response_topic
        try:
            info = self._client.publish(topic, payload, qos=qos, retain=retain, properties=props)
        except ValueError as e:
            raise MqttError(f"cannot publish on {topic!r}: {e}") from e
        if info.rc != mqtt.MQTT_ERR_SUCCESS:
            raise MqttError(f"cannot publish on {topic!r}: {mqtt.error_string(info.rc)}")
        return int(info.mid)

    def _settle(self, mid: int, reason: ReasonCode) -> None:
        ack = self._acks.get(mid)
        if ack is None or ack.done():
            return
        if reason.is_failure:
            ack.set_exception(MqttError(f"the broker at {self.where} refused a publish: {reason}"))
        else:
            ack.set_result(None)

    def _ready(self) -> None:
        if self._subscribed is not None and not self._subscribed.done():
            self._subscribed.set_result(None)
        else:
            log.info("%s session to %s restored and subscribed again", self._name, self.where)

    def _fail(self, message: str) -> None:
        if self._subscribed is not None and not self._subscribed.done():
            self._subscribed.set_exception(MqttError(message))
        else:
            log.error("%s session: %s", self._name, message)
