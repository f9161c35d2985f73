"""One MQTT connection: a fresh paho-mqtt 2.x client whose socket the asyncio loop watches.

:class:`Connection` lives for one socket. paho reads and writes on the event loop thread
(``add_reader`` calls ``loop_read``, reading the socket in 64 KiB chunks; queued packets are
written in the same loop turn, with ``add_writer`` only while the socket is full; a task calls
``loop_misc`` every second for keep-alive pings and the dead-connection check), so no paho
thread runs. Only
the blocking TCP/TLS connect runs in the default executor; the callbacks paho makes there cross
into the loop with ``loop.call_soon_threadsafe``. TCP_NODELAY is set the moment the socket
opens; a socket that connected to itself (nothing listened on the broker's port and the kernel
picked that port as our source: :mod:`shared.netutil`) is reset at once, never watched, and the
connect fails with :class:`MqttConnectError`. Each QoS 1 publish and (un)subscribe waits on a
future keyed by its packet id; the entry is removed when the future completes, and a lost
connection fails them all with :class:`MqttConnectionLostError`. :class:`agent.fleet.mqtt.MqttClient` is the public face.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import ssl
import threading
from collections.abc import Callable, Sequence
from typing import Any

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

from mcp_edge.agent.fleet.mqtt_types import (
    MqttConnectError,
    MqttConnectionLostError,
    MqttError,
    MqttRefusedError,
    MqttSettings,
    MqttTimeoutError,
    Subscription,
    set_tcp_nodelay,
)
from mcp_edge.shared.netutil import close_with_reset, is_self_connected
from mcp_edge.shared.recvbuffer import ChunkedReads

log = logging.getLogger("mcp.agent.mqtt")
_MISC_INTERVAL_S = 1.0


class Connection:
    """One connection's paho client and everything waiting on it."""

    def __init__(
        self, settings: MqttSettings, on_message: Callable[[paho.MQTTMessage], None]
    ) -> None:
        self.settings = settings
        self.loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._on_message = on_message
        self.connack: asyncio.Future[tuple[bool, ReasonCode]] = self.loop.create_future()
        self.closed: asyncio.Future[str] = self.loop.create_future()
        self.pending: dict[int, asyncio.Future[Any]] = {}
        self.fd: int | None = None
        self.writing = False  # watching for writability: the socket's send buffer was full
        self._write_scheduled = False
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
        bind_address, bind_port = s.source_address or ("", 0)
        connect = functools.partial(
            self.client.connect, s.host, s.port, keepalive=s.keepalive_s,
            bind_address=bind_address, bind_port=bind_port, clean_start=s.clean_start,
            properties=props,
        )  # fmt: skip
        where = f"{s.host}:{s.port}"
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
                raise MqttConnectError(f"connection to {where} closed: {e}") from e
            if rc.is_failure:
                raise MqttConnectError(f"{where} refused the connection: {rc}", rc.value)
        except BaseException as e:
            self.teardown(f"connect failed: {e}")
            raise
        self._misc_task = self.loop.create_task(self._misc(), name="mqtt-keepalive")
        return bool(session_present)

    async def disconnect(self, timeout_s: float) -> None:
        """Send DISCONNECT (the will is not published) and close. Never raises."""
        if self.closed.done():
            return
        try:
            self.client.disconnect()
            self.flush()
            await asyncio.wait_for(asyncio.shield(self.closed), timeout_s)
        except (asyncio.TimeoutError, OSError):
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
        err = MqttConnectionLostError(f"connection lost: {why}")
        for fut in [self.connack, *self.pending.values()]:
            if not fut.done():
                fut.set_exception(err)
                fut.exception()  # retrieved: no "exception was never retrieved" warning
        self.pending.clear()
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
        response_topic: str | None = None,
        correlation_data: bytes | None = None,
        user_properties: Sequence[tuple[str, str]] = (),
        content_type: str | None = None,
        message_expiry_s: int | None = None,
    ) -> asyncio.Future[int]:
        """See :meth:`agent.fleet.mqtt.MqttClient.publish_nowait`."""
        if not self.up:
            raise MqttConnectionLostError("not connected to the broker")
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
                raise MqttRefusedError(f"cannot publish on {topic!r:.80}: {e}", 0x99) from e
        try:
            info = self.client.publish(topic, payload, qos, retain, props)
        except ValueError as e:
            raise MqttRefusedError(f"cannot publish on {topic!r:.80}: {e}", 0x99) from e
        if info.rc != paho.MQTT_ERR_SUCCESS:
            raise MqttConnectionLostError(f"publish failed: {paho.error_string(info.rc)}")
        fut: asyncio.Future[int] = self.loop.create_future()
        if qos == 0:
            fut.set_result(0)
        else:
            self.pending[info.mid] = fut
            fut.add_done_callback(functools.partial(self._forget, info.mid))
        self.flush()
        return fut

    async def subscribe(self, items: list[Subscription]) -> list[tuple[str, ReasonCode]]:
        """Send one SUBSCRIBE; return the filters the broker refused with their reasons."""
        rc, mid = self.client.subscribe([(s.topic_filter, s.options()) for s in items])
        if rc != paho.MQTT_ERR_SUCCESS or mid is None:
            raise MqttConnectionLostError(f"subscribe failed: {paho.error_string(rc)}")
        codes: list[ReasonCode] = await self._await_ack(mid, "SUBACK")
        return [(s.topic_filter, c) for s, c in zip(items, codes, strict=False) if c.is_failure]

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
            raise MqttTimeoutError(f"no {what} within {timeout} s") from None
        finally:
            self.pending.pop(mid, None)

    def _forget(self, mid: int, fut: asyncio.Future[Any]) -> None:
        if self.pending.get(mid) is fut:
            del self.pending[mid]

    def flush(self) -> None:
        """Write queued packets now; watch for writability only while the socket is full."""
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
    def _new_client(self) -> _ChunkedClient:
        s = self.settings
        client = _ChunkedClient(
            CallbackAPIVersion.VERSION2, client_id=s.client_id, protocol=paho.MQTTv5,
            reconnect_on_failure=False,
        )  # fmt: skip
        client.suppress_exceptions = True
        client.enable_logger(logging.getLogger("mcp.agent.mqtt.paho"))
        client.connect_timeout = s.connect_timeout_s
        if s.username is not None:
            client.username_pw_set(s.username, s.password)
        if s.tls is not None:
            client.tls_set_context(s.tls)
        if s.will is not None:
            w = s.will
            client.will_set(w.topic, w.payload, w.qos, w.retain)
        on = self._in_loop
        client.on_socket_open = lambda _c, _u, sock: self._opened(sock)
        client.on_socket_close = lambda _c, _u, _s: on(self._unwatch)
        client.on_socket_register_write = lambda _c, _u, _s: on(self._write_soon)
        client.on_connect = lambda _c, _u, flags, rc, _p: on(
            _resolve, self.connack, (flags.session_present, rc)
        )
        client.on_disconnect = lambda _c, _u, _f, rc, _p: on(self.teardown, str(rc))
        client.on_publish = lambda _c, _u, mid, rc, _p: on(self._acked, mid, rc)
        client.on_subscribe = lambda _c, _u, mid, codes, _p: on(
            _resolve, self.pending.get(mid), list(codes)
        )
        client.on_unsubscribe = lambda _c, _u, mid, codes, _p: on(
            _resolve, self.pending.get(mid), codes
        )
        client.on_message = lambda _c, _u, m: on(self._on_message, m)
        return client

    def _in_loop(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn`` on the loop thread: directly there, else via call_soon_threadsafe."""
        if threading.get_ident() == self._loop_thread:
            fn(*args)
        elif not self.loop.is_closed():
            self.loop.call_soon_threadsafe(fn, *args)

    def _opened(self, sock: Any) -> None:
        if is_self_connected(sock):
            # Reset, not closed: its TIME_WAIT would hold the broker's port for a minute.
            self.self_connected = True
            close_with_reset(sock)
            return
        self.nodelay = set_tcp_nodelay(sock)
        self._in_loop(self._watch, sock.fileno())

    def _watch(self, fd: int) -> None:
        if self.closed.done():
            return
        self.fd = fd
        self.loop.add_reader(fd, self._readable)
        self._write_soon()

    def _unwatch(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
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
        client.loop_read()
        while client.buffered:  # whole packets read but not parsed: no readiness event comes
            if client.loop_read() != paho.MQTT_ERR_SUCCESS:
                break
        self.flush()

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
            fut.set_exception(MqttRefusedError(f"broker refused the message: {rc}", rc.value))
        else:
            fut.set_result(rc.value)


class _ChunkedClient(ChunkedReads, paho.Client):
    """paho's client reading its socket in 64 KiB chunks (see shared.recvbuffer)."""


class EncodedProperties:
    """PUBLISH properties we encoded ourselves. paho calls only ``pack()`` (and ``str()`` for
    debug logs) on the properties of a message it sends; its own :class:`Properties` validates
    and packs each attribute by scanning every property name, which cost more than the whole
    broker round trip on the inference path (tens of µs per message)."""

    __slots__ = ("_data",)

    def __init__(self, data: bytes) -> None:
        self._data = data

    def pack(self) -> bytes:
        return self._data

    def __str__(self) -> str:
        return f"<{len(self._data) - 1} bytes of properties>"


def encode_publish_properties(
    *,
    response_topic: str | None = None,
    correlation_data: bytes | None = None,
    user_properties: Sequence[tuple[str, str]] = (),
    content_type: str | None = None,
    message_expiry_s: int | None = None,
) -> bytes:
    """The MQTT 5 property block of a PUBLISH (length prefix included), in identifier order as
    paho writes it. Raises ValueError for a string or binary value over 65535 bytes."""
    out = bytearray()
    if message_expiry_s:
        out += b"\x02" + int(message_expiry_s).to_bytes(4, "big")
    if content_type:
        out += b"\x03" + _field(content_type.encode())
    if response_topic:
        out += b"\x08" + _field(response_topic.encode())
    if correlation_data is not None:
        out += b"\x09" + _field(bytes(correlation_data))
    for key, value in user_properties:
        out += b"\x26" + _field(key.encode()) + _field(value.encode())
    return _varint(len(out)) + bytes(out)


def _field(data: bytes) -> bytes:
    if len(data) > 0xFFFF:
        raise ValueError(f"property value of {len(data)} bytes exceeds 65535")
    return len(data).to_bytes(2, "big") + data


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        n, digit = divmod(n, 128)
        out.append(digit | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _resolve(fut: asyncio.Future[Any] | None, value: Any) -> None:
    if fut is not None and not fut.done():
        fut.set_result(value)
