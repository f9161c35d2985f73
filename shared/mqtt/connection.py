"""One MQTT connection: a fresh paho-mqtt 2.x client whose socket the asyncio loop watches.

:class:`Connection` lives for one socket. paho reads and writes on the event loop thread
(``add_reader`` calls ``loop_read``, which reads the socket in 64 KiB chunks through
:mod:`mcp_edge.shared.mqtt._paho`; queued packets are written in the same loop turn, with
``add_writer`` only while the socket is full; a task calls ``loop_misc`` every second for
keep-alive pings and the dead-connection check), so no paho thread runs and a message handler
runs inside the read that brought the message: the acknowledgements and replies of everything
one read brought in go out in one write. Only the blocking TCP/TLS connect runs in the default
executor; the callbacks paho makes there cross into the loop with
``loop.call_soon_threadsafe``. TCP_NODELAY is set the moment the socket opens; a socket that
connected to itself (nothing listened on the broker's port and the kernel picked that port as
our source: :mod:`mcp_edge.shared.netutil`) is reset at once, never watched, and the connect
fails with :class:`MqttConnectError`. Each QoS 1 publish and (un)subscribe waits on a future
keyed by its packet id; the entry is removed when the future completes, and a lost connection
fails them all with :class:`MqttConnectionLostError`. paho's exceptions and return codes are
translated here (:mod:`mcp_edge.shared.mqtt.errors`). :class:`mcp_edge.shared.mqtt.client.
MqttClient` is the public face.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import ssl
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode
from paho.mqtt.subscribeoptions import SubscribeOptions

from mcp_edge.shared.mqtt._paho import ChunkedClient
from mcp_edge.shared.mqtt.errors import (
    RC_PACKET_REFUSED,
    MqttConnectError,
    MqttConnectionLostError,
    MqttError,
    MqttRefusedError,
    MqttTimeoutError,
)
from mcp_edge.shared.mqtt.properties import EncodedProperties, encode_publish_properties
from mcp_edge.shared.mqtt.values import InboundMessage, MqttSettings, Subscription, set_tcp_nodelay
from mcp_edge.shared.netutil import close_with_reset, is_self_connected

log = logging.getLogger("mcp.mqtt")
_MISC_INTERVAL_S = 1.0

Refusals = list[tuple[str, int, str]]
"""Filters the broker refused: ``(filter, reason code, reason name)``."""
SubackHook = Callable[[Refusals], None]
TopicHandler = Callable[[str, bytes, int], None]
"""``(topic, payload, ack_token)``; the token is 0 unless the client acknowledges by hand
(:attr:`MqttSettings.manual_ack`) and the message is QoS 1: then pass it to
:meth:`MqttClient.ack` once the message is dealt with."""

ACK_EPOCH_SHIFT = 16
"""An ack token is ``(connection epoch << 16) | packet id``: an acknowledgement of a message
read on an earlier connection is never sent on a later one (the broker delivers it again)."""
_epochs = itertools.count(1)


class Connection:
    """One connection's paho client and everything waiting on it."""

    def __init__(
        self,
        settings: MqttSettings,
        on_message: Callable[[InboundMessage], None],
        on_undecodable: Callable[[], None],
    ) -> None:
        self.settings = settings
        self.where = f"the broker at {settings.where}"
        self.loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._on_message = on_message
        self._on_undecodable = on_undecodable
        self.topic_handler: TopicHandler | None = None
        """When set, messages go to it as ``(topic, payload, ack_token)`` and no InboundMessage
        is built (exceptions it raises are logged)."""
        self.epoch = next(_epochs)
        self.connack: asyncio.Future[tuple[bool, ReasonCode]] = self.loop.create_future()
        self.closed: asyncio.Future[str] = self.loop.create_future()
        self.pending: dict[int, asyncio.Future[Any]] = {}
        self._suback_hooks: dict[int, tuple[Sequence[Subscription], SubackHook]] = {}
        self.fd: int | None = None
        self.writing = False  # watching for writability: the socket's send buffer was full
        self._write_scheduled = False
        self._reading = False  # inside loop_read: paho holds its callback lock, writes must wait
        self.nodelay = False
        self.self_connected = False  # set on the connect's executor thread, read after it
        self._misc_task: asyncio.Task[None] | None = None
        self.client = self._new_client()

    @property
    def up(self) -> bool:
        c = self.connack
        return c.done() and not c.cancelled() and c.exception() is None and not self.closed.done()

    # ------------------------------------------------------------------ open / close
    async def open(self) -> bool:
        """Connect and wait for a successful CONNACK; return whether the session was present.

        Raises :class:`MqttConnectError`; nothing is left open then.
        """
        s = self.settings
        props = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
        if s.session_expiry_s > 0:
            props.SessionExpiryInterval = s.session_expiry_s
        if s.max_packet_bytes:
            props.MaximumPacketSize = s.max_packet_bytes
        if s.receive_maximum:
            props.ReceiveMaximum = s.receive_maximum
        bind_address, bind_port = s.source_address or ("", 0)
        connect = functools.partial(
            self.client.connect, s.host, s.port, keepalive=s.keepalive_s,
            bind_address=bind_address, bind_port=bind_port, clean_start=s.clean_start,
            properties=props,
        )  # fmt: skip
        where = self.where
        try:
            try:
                await self.loop.run_in_executor(None, connect)
            except (OSError, ssl.SSLError, ValueError) as e:
                raise MqttConnectError(f"cannot connect to {where}: {e}") from e
            if self.self_connected:
                log.warning(
                    "the connection to %s came back to its own socket: nothing listens "
                    "there; the socket was reset and the connect counts as failed",
                    where,
                )
                raise MqttConnectError(
                    f"cannot connect to {where}: the socket connected to itself "
                    "(source port = broker port, no broker listening)"
                )
            self.flush()
            try:
                session_present, rc = await asyncio.wait_for(
                    asyncio.shield(self.connack), s.connect_timeout_s
                )
            except asyncio.TimeoutError:
                raise MqttConnectError(
                    f"{where} sent no CONNACK within {s.connect_timeout_s} s"
                ) from None
            except MqttError as e:
                raise MqttConnectError(f"cannot connect to {where}: {e}") from e
            if rc.is_failure:
                raise MqttConnectError(f"{where} refused the login: {rc}", rc.value, str(rc))
        except BaseException as e:
            self.teardown(f"connect failed: {e}")
            raise
        self._misc_task = self.loop.create_task(self._misc(), name="mqtt-keepalive")
        return bool(session_present)

    async def disconnect(self, timeout_s: float, session_expiry_s: int | None = None) -> None:
        """Send DISCONNECT (the will is not published) and close. Never raises.

        ``session_expiry_s`` replaces the session's expiry at the broker: 0 ends it now.
        """
        if self.closed.done():
            return
        try:
            props = None
            if session_expiry_s is not None and self.settings.session_expiry_s > 0:
                # MQTT 5 forbids raising the expiry from 0 at DISCONNECT; lowering it is fine.
                props = Properties(PacketTypes.DISCONNECT)  # type: ignore[no-untyped-call]
                props.SessionExpiryInterval = session_expiry_s
            self.client.disconnect(properties=props)
            self.flush()
            await asyncio.wait_for(asyncio.shield(self.closed), timeout_s)
        except (asyncio.TimeoutError, OSError, MqttError):
            pass
        finally:
            self.teardown("disconnected")

    def teardown(self, why: str) -> None:
        """Stop watching the socket, close it and fail everything waiting on this connection."""
        self._unwatch()
        if self._misc_task is not None and not self._misc_task.done():
            self._misc_task.cancel()
        sock = self.client.socket()
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()
        err = MqttConnectionLostError(f"connection to {self.where} lost: {why}")
        for fut in [self.connack, *self.pending.values()]:
            if not fut.done():
                fut.set_exception(err)
                fut.exception()  # retrieved: no "exception was never retrieved" warning
        self.pending.clear()
        self._suback_hooks.clear()
        if not self.closed.done():
            self.closed.set_result(why)

    # ------------------------------------------------------------------ packets
    def publish(
        self,
        topic: str,
        payload: bytes,
        qos: int,
        retain: bool,
        *,
        track: bool = True,
        response_topic: str | None = None,
        correlation_data: bytes | None = None,
        user_properties: Sequence[tuple[str, str]] = (),
        content_type: str | None = None,
        message_expiry_s: int | None = None,
    ) -> asyncio.Future[int] | None:
        """See :meth:`mcp_edge.shared.mqtt.client.MqttClient.publish_nowait`; with ``track``
        False no future is made (None is returned) and the acknowledgement is not waited for."""
        if not self.up:
            raise MqttConnectionLostError(f"not connected to {self.where}")
        props: Any = None
        if response_topic or correlation_data is not None or user_properties or content_type \
                or message_expiry_s:  # fmt: skip
            try:
                props = EncodedProperties(encode_publish_properties(
                    response_topic=response_topic, correlation_data=correlation_data,
                    user_properties=user_properties, content_type=content_type,
                    message_expiry_s=message_expiry_s,
                ))  # fmt: skip
            except ValueError as e:
                raise MqttRefusedError(
                    f"cannot publish on {topic!r:.80}: {e}", RC_PACKET_REFUSED
                ) from e
        try:
            info = self.client.publish(topic, payload, qos, retain, props)
        except ValueError as e:
            raise MqttRefusedError(
                f"cannot publish on {topic!r:.80}: {e}", RC_PACKET_REFUSED
            ) from e
        if info.rc != paho.MQTT_ERR_SUCCESS:
            raise MqttConnectionLostError(
                f"cannot publish on {topic!r:.80}: {paho.error_string(info.rc)}"
            )
        fut: asyncio.Future[int] | None = None
        if track:
            fut = self.loop.create_future()
            if qos == 0:
                fut.set_result(0)
            else:
                self.pending[info.mid] = fut
                fut.add_done_callback(functools.partial(self._forget, info.mid))
        self.flush()
        return fut

    async def subscribe(
        self, items: Sequence[Subscription], on_suback: SubackHook | None = None
    ) -> Refusals:
        """Send one SUBSCRIBE; return the filters the broker refused with their reasons.

        ``on_suback`` is called with the same list on the loop inside the read that brought
        the SUBACK, before any message that follows it (e.g. a retained one) is handled.
        Raises :class:`MqttConnectionLostError` or :class:`MqttTimeoutError`.
        """
        subs = [
            (s.topic_filter, SubscribeOptions(qos=s.qos, retainHandling=s.retain_handling))
            for s in items
        ]
        rc, mid = self.client.subscribe(subs)
        if rc != paho.MQTT_ERR_SUCCESS or mid is None:
            raise MqttConnectionLostError(f"subscribe failed: {paho.error_string(rc)}")
        if on_suback is not None:
            self._suback_hooks[mid] = (items, on_suback)
        try:
            codes: list[ReasonCode] = await self._await_ack(mid, "SUBACK")
        finally:
            self._suback_hooks.pop(mid, None)
        return _refusals(items, codes)

    async def unsubscribe(self, filters: list[str]) -> None:
        rc, mid = self.client.unsubscribe(filters)
        if rc != paho.MQTT_ERR_SUCCESS or mid is None:
            raise MqttConnectionLostError(f"unsubscribe failed: {paho.error_string(rc)}")
        await self._await_ack(mid, "UNSUBACK")

    async def _await_ack(self, mid: int, what: str) -> Any:
        fut: asyncio.Future[Any] = self.loop.create_future()
        self.pending[mid] = fut
        self.flush()
        timeout = self.settings.ack_timeout_s
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        except asyncio.TimeoutError:
            raise MqttTimeoutError(f"no {what} from {self.where} within {timeout} s") from None
        finally:
            self.pending.pop(mid, None)

    def _forget(self, mid: int, fut: asyncio.Future[Any]) -> None:
        if self.pending.get(mid) is fut:
            del self.pending[mid]

    def flush(self) -> None:
        """Write queued packets now; watch for writability only while the socket is full.

        Inside a read (a handler publishing) nothing is written: paho's writer takes the lock
        its message callback holds, and the read ends with one write for everything anyway.
        """
        if self._reading:
            return
        self._write_scheduled = False
        fd = self.fd
        if fd is None:
            return
        if self.client.want_write():
            self.client.loop_write()
        full = self.fd is not None and self.client.want_write()
        if full != self.writing:
            self.writing = full
            if full:
                self.loop.add_writer(fd, self.flush)
            else:
                self.loop.remove_writer(fd)

    # ------------------------------------------------------------------ paho wiring
    def _new_client(self) -> ChunkedClient:
        s = self.settings
        client = ChunkedClient(
            CallbackAPIVersion.VERSION2, client_id=s.client_id, protocol=paho.MQTTv5,
            reconnect_on_failure=False,
        )  # fmt: skip
        client.suppress_exceptions = True  # a failing callback is logged, never unwinds a read
        client.enable_logger(logging.getLogger("mcp.mqtt.paho"))
        client.connect_timeout = s.connect_timeout_s
        client.max_inflight_messages_set(s.max_inflight_messages)
        if s.manual_ack:
            client.manual_ack_set(True)
        if s.username is not None:
            client.username_pw_set(s.username, s.password)
        if s.tls is not None:
            client.tls_set_context(s.tls)
        if s.will is not None:
            w = s.will
            client.will_set(w.topic, w.payload, w.qos, w.retain)
        client.on_socket_open = self._cb_socket_open
        client.on_socket_close = self._cb_socket_close
        client.on_socket_register_write = self._cb_register_write
        client.on_connect = self._cb_connect
        client.on_disconnect = self._cb_disconnect
        client.on_publish = self._cb_publish
        client.on_subscribe = self._cb_subscribe
        client.on_unsubscribe = self._cb_unsubscribe
        client.on_message = self._cb_message
        return client

    # paho's callbacks: on the loop thread (inside loop_read/loop_write/loop_misc), except
    # those the executor's connect makes (socket open, first write), which cross with _in_loop.
    def _cb_socket_open(self, _c: paho.Client, _u: Any, sock: Any) -> None:
        if is_self_connected(sock):
            # Reset, not closed: its TIME_WAIT would hold the broker's port for a minute.
            self.self_connected = True
            close_with_reset(sock)
            return
        self.nodelay = set_tcp_nodelay(sock)
        self._in_loop(self._watch, sock.fileno())

    def _cb_socket_close(self, _c: paho.Client, _u: Any, _sock: Any) -> None:
        self._in_loop(self._unwatch)

    def _cb_register_write(self, _c: paho.Client, _u: Any, _sock: Any) -> None:
        self._in_loop(self._write_soon)

    def _cb_connect(
        self, _c: paho.Client, _u: Any, flags: paho.ConnectFlags, rc: ReasonCode, _p: Any
    ) -> None:
        self._in_loop(_resolve, self.connack, (flags.session_present, rc))

    def _cb_disconnect(
        self, _c: paho.Client, _u: Any, _f: paho.DisconnectFlags, rc: ReasonCode, _p: Any
    ) -> None:
        self._in_loop(self.teardown, str(rc))

    def _cb_publish(self, _c: paho.Client, _u: Any, mid: int, rc: ReasonCode, _p: Any) -> None:
        self._in_loop(self._acked, mid, rc)

    def _cb_subscribe(
        self, _c: paho.Client, _u: Any, mid: int, codes: list[ReasonCode], _p: Any
    ) -> None:
        self._in_loop(self._subscribed, mid, list(codes))

    def _cb_unsubscribe(
        self, _c: paho.Client, _u: Any, mid: int, codes: list[ReasonCode], _p: Any
    ) -> None:
        self._in_loop(_resolve, self.pending.get(mid), codes)

    def _cb_message(self, _c: paho.Client, _u: Any, m: paho.MQTTMessage) -> None:
        try:
            topic = m.topic
        except UnicodeDecodeError:
            self._on_undecodable()
            return
        topic_handler = self.topic_handler
        if topic_handler is not None:  # the telemetry path: no properties wanted
            token = 0
            if m.qos == 1 and self.settings.manual_ack:
                token = (self.epoch << ACK_EPOCH_SHIFT) | m.mid
            try:
                topic_handler(topic, bytes(m.payload), token)
            except Exception:
                log.exception("message handler failed on %.120s", topic)
            return
        props = m.properties
        self._on_message(InboundMessage(
            topic,
            bytes(m.payload),  # no copy: paho hands bytes
            m.qos,
            bool(m.retain),
            getattr(props, "ResponseTopic", None),
            getattr(props, "CorrelationData", None),
            tuple(getattr(props, "UserProperty", ()) or ()),
            getattr(props, "ContentType", None),
        ))  # fmt: skip

    def ack(self, tokens: Iterable[int]) -> int:
        """Send the PUBACKs of ``tokens`` read on this connection (others are skipped: their
        connection is gone, so the broker delivers those messages again); returns how many
        were sent."""
        if not self.up:
            return 0
        sent = 0
        epoch = self.epoch
        for token in tokens:
            if token >> ACK_EPOCH_SHIFT == epoch:
                self.client.ack(token & 0xFFFF, 1)
                sent += 1
        if sent:
            self._write_soon()
        return sent

    def _in_loop(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn`` on the loop thread: directly there, else via call_soon_threadsafe."""
        if threading.get_ident() == self._loop_thread:
            fn(*args)
        elif not self.loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed after the check
                self.loop.call_soon_threadsafe(fn, *args)

    def _watch(self, fd: int) -> None:
        if self.closed.done():
            return
        self.fd = fd
        self.loop.add_reader(fd, self._readable)
        self._write_soon()

    def _unwatch(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None and not self.loop.is_closed():
            self.loop.remove_reader(fd)
            if self.writing:
                self.loop.remove_writer(fd)
        self.writing = False

    def _write_soon(self) -> None:
        # paho queued a packet (e.g. the PUBACK of a message read): written this loop turn,
        # with whatever else is queued by then, not through a writability watch per packet.
        if not self._write_scheduled:
            self._write_scheduled = True
            self.loop.call_soon(self.flush)

    def _readable(self) -> None:
        client = self.client
        self._reading = True
        try:
            client.loop_read()
            while client.buffered:  # whole packets read but not parsed: no readiness event
                if client.loop_read() != paho.MQTT_ERR_SUCCESS:
                    break
        finally:
            self._reading = False
        self.flush()  # one write for everything the read produced: PUBACKs, replies

    async def _misc(self) -> None:
        # Keep-alive pings and the dead-connection check (no PINGRESP within keep-alive).
        while not self.closed.done():
            await asyncio.sleep(_MISC_INTERVAL_S)
            self.client.loop_misc()
            self.flush()

    def _acked(self, mid: int, rc: ReasonCode) -> None:
        fut = self.pending.pop(mid, None)
        if fut is None or fut.done():
            return
        if rc.is_failure:
            fut.set_exception(MqttRefusedError(f"{self.where} refused the message: {rc}", rc.value))
        else:
            fut.set_result(rc.value)

    def _subscribed(self, mid: int, codes: list[ReasonCode]) -> None:
        hook = self._suback_hooks.pop(mid, None)
        if hook is not None:
            try:
                hook[1](_refusals(hook[0], codes))
            except Exception:
                log.exception("a SUBACK hook failed")
        _resolve(self.pending.get(mid), codes)


def _refusals(items: Sequence[Subscription], codes: list[ReasonCode]) -> Refusals:
    return [
        (s.topic_filter, c.value, str(c))
        for s, c in zip(items, codes, strict=False)
        if c.is_failure
    ]


def _resolve(fut: asyncio.Future[Any] | None, value: Any) -> None:
    if fut is not None and not fut.done():
        fut.set_result(value)
