"""The control plane's MQTT 5 sessions: paho made async, for ingestion and repository serving.

``async with MqttSubscriber(...)`` owns one session. paho runs on the event loop's thread: the
loop watches the socket (``add_reader``/``add_writer`` call paho's ``loop_read``/``loop_write``)
and a keeper task ticks ``loop_misc`` every second for keep-alive pings. No paho thread runs, so
a message is handled, and its PUBACK queued, on the thread that read it; the acknowledgements
of everything one read brought in go out in one write. Only the blocking TCP/TLS connect runs
in the default executor. A dropped session is reconnected by the keeper (backoff 1-30 s with
jitter) and :meth:`_on_connect` subscribes again to every filter each time, so the caller never
handles reconnects. TCP_NODELAY is set on the socket as soon as it opens (DESIGN 8: Nagle
costs tens of milliseconds per small packet).

A handler receives ``(topic, payload)`` (``handler``) or, given ``on_message``, a whole
:class:`ReceivedMessage` with the MQTT 5 properties a request/response service needs (response
topic, correlation data, user properties, QoS). Handlers run on the loop inside paho's read:
they must not block; they may publish. :meth:`MqttSubscriber.publish` sends and waits for the
broker's PUBACK; :meth:`MqttSubscriber.publish_nowait` hands the message to paho and returns
(for high-rate replies whose delivery the requester checks itself). Use a session from the
loop that started it.

Errors: :class:`MqttError` for anything the broker or paho refuses at start, and for a publish
while disconnected or refused by the broker; later losses are logged and healed by the keeper.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import socket
import ssl
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from socket import IPPROTO_TCP, TCP_NODELAY
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

from mcp_edge.controlplane.broker.base import Credentials
from mcp_edge.shared.errors import McpError
from mcp_edge.shared.netutil import close_with_reset, is_self_connected
from mcp_edge.shared.recvbuffer import ChunkedReads

log = logging.getLogger("mcp.controlplane.mqtt")

KEEPER_TICK_S = 1.0
"""How often the keeper runs paho's keep-alive and dead-connection check."""
RECONNECT_DELAY_S = (1.0, 30.0)
"""First and largest wait before reconnecting a dropped session (doubling, with jitter)."""

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

    ``on_subscribed`` is called on the loop each time the broker has granted every filter
    again (first start and every reconnect): retained messages follow.

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
        on_subscribed: Callable[[], None] | None = None,
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
        self._on_subscribed = on_subscribed
        self._name = name
        self._keepalive_s = keepalive_s
        self._session_expiry_s = session_expiry_s
        self._timeout_s = timeout_s
        client = self._client = _BufferedClient(
            CallbackAPIVersion.VERSION2, client_id=credentials.client_id, protocol=mqtt.MQTTv5,
            reconnect_on_failure=False,
        )  # fmt: skip
        client.suppress_exceptions = True  # a failing callback is logged, never unwinds a read
        client.username_pw_set(credentials.username, credentials.password)
        if address.tls:
            client.tls_set_context(ssl.create_default_context())
        client.connect_timeout = timeout_s
        client.max_inflight_messages_set(max_inflight)
        client.on_socket_open = self._on_socket_open
        client.on_socket_close = lambda *_a: self._on_loop(self._unwatch)
        client.on_socket_register_write = lambda *_a: self._on_loop(self._write_soon)
        client.on_connect = self._on_connect
        client.on_subscribe = self._on_subscribe
        client.on_disconnect = self._on_disconnect
        client.on_message = self._on_message
        client.on_publish = self._on_publish
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._fd: int | None = None  # the socket the loop watches; None while disconnected
        self._writer = False  # watching for writability (the socket's send buffer was full)
        self._write_scheduled = False
        self._gone: asyncio.Event | None = None  # set while no socket is watched
        self._acks: dict[int, asyncio.Future[None]] = {}
        self._subscribed: asyncio.Future[None] | None = None
        self._subscribe_mid: int | None = None
        self._keeper: asyncio.Task[None] | None = None
        self._closed = False
        self._up = False
        self._problem: str | None = "not started"

    @property
    def where(self) -> str:
        return f"{self._address.host}:{self._address.port}"

    @property
    def name(self) -> str:
        """What the session is for (``ingest``, ``repository``, ``desired``): logs and metrics."""
        return self._name

    @property
    def up(self) -> bool:
        """Whether the session is logged in (and, with filters, subscribed) right now."""
        return self._up and not self._closed

    @property
    def problem(self) -> str | None:
        """Why the session is not up (a refused login, an unreachable broker); None when up."""
        return None if self.up else (self._problem or "closed")

    async def __aenter__(self) -> MqttSubscriber:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Connect and subscribe; return once the broker granted every filter.

        Raises MqttError: unreachable, login refused, a filter refused, or no answer in time.
        """
        loop = self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._gone = asyncio.Event()
        self._gone.set()
        self._subscribed = loop.create_future()
        props = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
        props.SessionExpiryInterval = self._session_expiry_s
        try:
            await loop.run_in_executor(None, lambda: self._client.connect(
                self._address.host, self._address.port, self._keepalive_s,
                clean_start=False, properties=props,
            ))  # fmt: skip
            sock = self._client.socket()
            if sock is None or sock.fileno() < 0:  # reset by _on_socket_open: a self-connect
                raise ConnectionRefusedError("the socket connected to itself: nothing listens")
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
        self._keeper = loop.create_task(self._keep(), name=f"mqtt-{self._name}")

    async def close(self) -> None:
        """End the session (DISCONNECT, session expiry 0) and close the socket. Safe twice."""
        if self._closed:
            return
        self._closed = True
        if self._keeper is not None:
            self._keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keeper
        if self._gone is None:  # never started
            return
        if self._fd is not None:
            props = Properties(PacketTypes.DISCONNECT)  # type: ignore[no-untyped-call]
            props.SessionExpiryInterval = 0
            self._client.disconnect(properties=props)  # paho closes the socket once it is sent
            self._flush()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._gone.wait(), self._timeout_s)
        sock = self._client.socket()
        self._unwatch()
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()

    async def _keep(self) -> None:
        """Keep-alive pings while connected; reconnect with backoff while not."""
        assert self._loop is not None and self._gone is not None
        delay = RECONNECT_DELAY_S[0]
        while True:
            if self._fd is not None:
                await asyncio.sleep(KEEPER_TICK_S)
                self._client.loop_misc()  # pings; drops a connection with no PINGRESP in time
                self._flush()
                if self._client.is_connected():  # a refused login keeps backing off
                    delay = RECONNECT_DELAY_S[0]
                continue
            await asyncio.sleep(delay * random.uniform(0.5, 1.0))
            delay = min(delay * 2, RECONNECT_DELAY_S[1])
            try:
                await self._loop.run_in_executor(None, self._client.reconnect)
            except (OSError, ValueError) as e:
                self._problem = f"cannot reach the broker at {self.where}: {e}"
                log.warning("%s session: cannot reach the broker at %s (%s); retrying",
                            self._name, self.where, e)

    # ---- paho wiring: every callback runs on the loop's thread, except the ones the
    # ---- executor's connect makes (socket open, first write), which cross with _on_loop.

    def _on_loop(self, fn: Callable[..., Any], *args: Any) -> None:
        loop = self._loop
        if threading.get_ident() == self._loop_thread:
            fn(*args)
        elif loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed after the check
                loop.call_soon_threadsafe(fn, *args)

    def _on_socket_open(self, _client: mqtt.Client, _userdata: Any, sock: Any) -> None:
        if is_self_connected(sock):  # see shared.netutil; reset: no TIME_WAIT on the port
            log.warning("%s session: the connection to %s came back to its own socket (nothing "
                        "listens there); reset", self._name, self.where)
            close_with_reset(sock)
            return
        if isinstance(sock, socket.socket) and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(IPPROTO_TCP, TCP_NODELAY, 1)
        self._on_loop(self._watch, sock.fileno())

    def _watch(self, fd: int) -> None:
        assert self._loop is not None and self._gone is not None
        if self._closed:  # a reconnect that finished after close(): nobody will use it
            sock = self._client.socket()
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.close()
            return
        self._fd = fd
        self._gone.clear()
        self._loop.add_reader(fd, self._readable)
        self._write_soon()

    def _unwatch(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None and self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(fd)
            if self._writer:
                self._loop.remove_writer(fd)
        self._writer = False
        if self._gone is not None:
            self._gone.set()

    def _write_soon(self) -> None:
        """paho queued a packet: write it this loop turn, with whatever else is queued by then
        (no writability watch, two epoll_ctl calls, per packet)."""
        if not self._write_scheduled and self._loop is not None:
            self._write_scheduled = True
            self._loop.call_soon(self._flush)

    def _readable(self) -> None:
        client = self._client
        client.loop_read()
        while client.buffered:  # whole packets paho has not taken yet: no readiness event comes
            if client.loop_read() != mqtt.MQTT_ERR_SUCCESS:
                break
        # One write for everything the read produced: PUBACKs, replies the handlers published.
        self._flush()

    def _flush(self) -> None:
        """Write what paho has queued; watch for writability only while the socket is full."""
        self._write_scheduled = False
        fd, loop = self._fd, self._loop
        if fd is None or loop is None:
            return
        if self._client.want_write():
            self._client.loop_write()
        full = self._fd is not None and self._client.want_write()
        if full != self._writer:
            self._writer = full
            if full:
                loop.add_writer(fd, self._flush)
            else:
                loop.remove_writer(fd)

    def _on_connect(
        self, client: mqtt.Client, _u: Any, _flags: Any, reason: ReasonCode, _p: Any
    ) -> None:
        if reason.is_failure:
            self._up = False
            self._fail(f"the broker at {self.where} refused the login: {reason}")
            return
        if not self._filters:  # a publish-only session
            self._ready()
            return
        # Every (re)connect: subscribe again, once per filter, in one SUBSCRIBE packet.
        rc, self._subscribe_mid = client.subscribe([(f, 1) for f in self._filters])
        if rc != mqtt.MQTT_ERR_SUCCESS:
            self._fail(f"cannot subscribe: {mqtt.error_string(rc)}")

    def _on_subscribe(
        self, _c: mqtt.Client, _u: Any, mid: int, reasons: list[ReasonCode], _p: Any
    ) -> None:
        if mid != self._subscribe_mid:
            return
        refused = [f for f, r in zip(self._filters, reasons, strict=False) if r.is_failure]
        if refused:
            self._fail(f"the broker refused the subscription(s) {refused}")
        else:
            self._ready()

    def _on_disconnect(
        self, _c: mqtt.Client, _u: Any, _flags: Any, reason: ReasonCode, _p: Any
    ) -> None:
        if self._up:  # a refused login already said why
            self._problem = f"connection to the broker at {self.where} lost: {reason}"
        self._up = False
        if not self._closed:
            log.warning("%s session to %s lost (%s); reconnecting", self._name, self.where,
                        reason)

    def _on_message(self, _c: mqtt.Client, _u: Any, message: mqtt.MQTTMessage) -> None:
        try:
            if self._handler is not None:
                self._handler(message.topic, message.payload)
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
                self._on_message_handler(received)
        except Exception:
            log.exception("MQTT %s: a message handler failed", self._name)

    def _on_publish(
        self, _c: mqtt.Client, _u: Any, mid: int, reason: ReasonCode, _p: Any
    ) -> None:
        ack = self._acks.get(mid)
        if ack is None or ack.done():
            return
        if reason.is_failure:
            ack.set_exception(MqttError(f"the broker at {self.where} refused a publish: {reason}"))
        else:
            ack.set_result(None)

    # ---- publishing (the loop's thread) ----------------------------------------------------

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
        mid = self.publish_nowait(
            topic, payload, qos=qos, retain=retain, user_properties=user_properties,
            correlation_data=correlation_data, response_topic=response_topic,
        )  # fmt: skip
        if qos == 0:
            return
        # The PUBACK is read on this thread, later: the future is registered before it can be.
        ack = self._acks[mid] = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait_for(ack, self._timeout_s)
        except asyncio.TimeoutError as e:
            raise MqttError(f"no acknowledgement from the broker at {self.where} for a publish "
                            f"on {topic!r} within {self._timeout_s} s") from e
        finally:
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

        It is written when the loop next finds the socket writable (or, from a handler, with
        the acknowledgements of the read that brought the request). Raises MqttError: not
        connected, or paho refused the message (e.g. too large).
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

    def _ready(self) -> None:
        self._up, self._problem = True, None
        if self._subscribed is not None and not self._subscribed.done():
            self._subscribed.set_result(None)
        else:
            log.info("%s session to %s restored and subscribed again", self._name, self.where)
        if self._on_subscribed is not None:
            try:
                self._on_subscribed()
            except Exception:
                log.exception("MQTT %s: the subscribed hook failed", self._name)

    def _fail(self, message: str) -> None:
        self._up, self._problem = False, message
        if self._subscribed is not None and not self._subscribed.done():
            self._subscribed.set_exception(MqttError(message))
        else:
            log.error("%s session: %s", self._name, message)



class _BufferedClient(ChunkedReads, mqtt.Client):
    """paho's client reading its socket in 64 KiB chunks (see shared.recvbuffer)."""
