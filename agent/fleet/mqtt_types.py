"""Values of the MQTT adapter: settings, messages, errors and the reconnect backoff.

Errors (nothing above :mod:`agent.fleet.mqtt` sees a paho exception)::

    McpError
    └── MqttError                    any MQTT transport problem
        ├── MqttConnectError         no connection: network error, TLS error, CONNACK refusal,
        │                            no CONNACK in time (``reason_code`` when the broker said no),
        │                            the socket connected to itself (nothing listens there)
        ├── MqttConnectionLostError  not connected, or the connection dropped before the ack
        ├── MqttRefusedError         the broker refused a publish or a subscription (reason
        │                            code >= 0x80, e.g. not authorized): retrying will not help
        └── MqttTimeoutError         no ack within the time given
"""

from __future__ import annotations

import random
import socket
import ssl
from dataclasses import dataclass, field
from typing import Any

from paho.mqtt.subscribeoptions import SubscribeOptions

from mcp_edge.shared.errors import McpError

RC_NO_MATCHING_SUBSCRIBERS = 0x10
"""PUBACK reason: the broker accepted the message but nobody subscribes to its topic."""
_AUTH_REFUSALS = frozenset({0x84, 0x85, 0x86, 0x87, 0x8A, 0x8C})


class MqttError(McpError):
    """An MQTT transport problem."""


class MqttConnectError(MqttError):
    """Could not connect. ``reason_code`` is the CONNACK reason when the broker refused."""

    def __init__(self, message: str, reason_code: int | None = None) -> None:
        super().__init__(message)
        self.reason_code = reason_code

    @property
    def auth_refused(self) -> bool:
        """True when the broker refused the credentials or client id (fix config, not network)."""
        return self.reason_code in _AUTH_REFUSALS


class MqttConnectionLostError(MqttError):
    """Not connected, or the connection dropped before the broker acknowledged."""


class MqttRefusedError(MqttError):
    """The broker refused a publish or subscription; ``reason_code`` says why."""

    def __init__(self, message: str, reason_code: int) -> None:
        super().__init__(message)
        self.reason_code = reason_code


class MqttTimeoutError(MqttError):
    """The broker did not acknowledge in time."""


@dataclass(frozen=True)
class Will:
    """The last will: published by the broker when the connection ends without DISCONNECT."""

    topic: str
    payload: bytes
    qos: int = 1
    retain: bool = True


@dataclass(frozen=True)
class MqttSettings:
    """How to reach the broker and which session to hold there."""

    host: str
    port: int = 1883
    client_id: str = ""
    username: str | None = None
    password: str | None = None
    keepalive_s: int = 30
    clean_start: bool = False
    session_expiry_s: int = 900
    """How long the broker keeps the session (subscriptions, queued QoS 1) after a drop."""
    tls: ssl.SSLContext | None = None
    will: Will | None = None
    connect_timeout_s: float = 10.0
    ack_timeout_s: float = 30.0
    """Default wait for a PUBACK/SUBACK."""
    max_packet_bytes: int | None = None
    """Maximum Packet Size sent in CONNECT: the broker drops bigger messages for us."""
    max_queued_messages: int = 10_000
    """Inbound messages waiting for :meth:`MqttClient.messages`; newer ones are dropped beyond."""
    source_address: tuple[str, int] | None = None
    """Local ``(address, port)`` to connect from (a device with several networks); port 0 or
    None lets the kernel choose."""


@dataclass(frozen=True)
class Subscription:
    """One topic filter. ``retain_handling`` 1 sends retained messages only on a new
    subscription, so restoring subscriptions on a live session does not replay them."""

    topic_filter: str
    qos: int = 1
    retain_handling: int = SubscribeOptions.RETAIN_SEND_IF_NEW_SUB

    def options(self) -> SubscribeOptions:
        return SubscribeOptions(qos=self.qos, retainHandling=self.retain_handling)


@dataclass(frozen=True)
class InboundMessage:
    """A received PUBLISH with the MQTT 5 properties the agent uses."""

    topic: str
    payload: bytes
    qos: int = 0
    retain: bool = False
    response_topic: str | None = None
    correlation_data: bytes | None = None
    user_properties: tuple[tuple[str, str], ...] = ()
    content_type: str | None = None

    def user_property(self, name: str) -> str | None:
        """The first user property called ``name`` (case-insensitive), or None."""
        lname = name.lower()
        for k, v in self.user_properties:
            if k.lower() == lname:
                return v
        return None


@dataclass(frozen=True)
class ConnectResult:
    session_present: bool
    refused: tuple[str, ...] = ()
    """Remembered filters the broker refused when they were restored."""


@dataclass
class Backoff:
    """Exponential backoff with full jitter: attempt n waits uniform(0, min(max, initial·2ⁿ)).

    ``rng`` is injectable so tests see the delays; :meth:`reset` after a stable connection.
    """

    initial_s: float = 0.5
    max_s: float = 60.0
    multiplier: float = 2.0
    rng: random.Random = field(default_factory=random.Random)
    attempt: int = 0

    def ceiling(self, attempt: int | None = None) -> float:
        n = self.attempt if attempt is None else attempt
        return min(self.max_s, self.initial_s * self.multiplier ** min(n, 64))

    def next_delay(self) -> float:
        """The delay before the next attempt (seconds); advances the attempt counter."""
        delay = self.rng.uniform(0.0, self.ceiling())
        self.attempt += 1
        return delay

    def reset(self) -> None:
        self.attempt = 0


def set_tcp_nodelay(sock: Any) -> bool:
    """Turn Nagle's algorithm off on a TCP (or TLS-over-TCP) socket; False when not TCP."""
    try:
        if sock.family not in (socket.AF_INET, socket.AF_INET6):
            return False
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return True
    except (AttributeError, OSError):
        return False


def parse_host_port(text: str, default_port: int = 1883) -> tuple[str, int]:
    """``host``, ``host:port`` or ``[v6]:port`` → (host, port). Raises ValueError."""
    text = text.strip()
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep:
            raise ValueError(f"unclosed '[' in {text!r}")
        port_text = rest[1:] if rest.startswith(":") else ""
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    else:
        host, port_text = text, ""
    if not host:
        raise ValueError(f"no host in {text!r}")
    try:
        port = int(port_text) if port_text else default_port
    except ValueError:
        raise ValueError(f"port must be a number in {text!r}") from None
    if not 0 < port < 65536:
        raise ValueError(f"port {port} out of range")
    return host, port
