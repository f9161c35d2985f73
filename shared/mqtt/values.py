"""Values of the MQTT adapter: how to reach the broker, what to subscribe to, what arrives.

Plain data with no I/O; :mod:`mcp_edge.shared.mqtt.connection` turns them into paho calls.
"""

from __future__ import annotations

import socket
import ssl
from dataclasses import dataclass
from typing import Any

RC_NO_MATCHING_SUBSCRIBERS = 0x10
"""PUBACK reason: the broker accepted the message but nobody subscribes to its topic."""

RETAIN_SEND_ON_SUBSCRIBE = 0
"""MQTT 5 retain handling: the broker sends retained messages on every SUBSCRIBE."""
RETAIN_SEND_IF_NEW_SUB = 1
"""Retained messages only when the subscription is new (not when restored on a live session)."""
RETAIN_DO_NOT_SEND = 2
"""Never send retained messages (requests and commands must not be answered twice)."""


@dataclass(frozen=True)
class Will:
    """The last will: published by the broker when the connection ends without DISCONNECT."""

    topic: str
    payload: bytes
    qos: int = 1
    retain: bool = True


@dataclass(frozen=True)
class MqttSettings:
    """How to reach the broker and which session to hold there (times in seconds)."""

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
    """Bound on the TCP/TLS connect and on the wait for CONNACK."""
    ack_timeout_s: float = 30.0
    """Default wait for a PUBACK/SUBACK."""
    max_packet_bytes: int | None = None
    """Maximum Packet Size sent in CONNECT: the broker drops bigger messages for us."""
    max_inflight_messages: int = 20
    """QoS 1 publishes sent and not yet acknowledged; later ones wait in paho's queue."""
    max_queued_messages: int = 10_000
    """Inbound messages waiting for :meth:`MqttClient.messages`; newer ones are dropped beyond."""
    manual_ack: bool = False
    """Acknowledge inbound QoS 1 messages only when :meth:`MqttClient.ack` is called with their
    token (the topic handler's third argument): a subscriber that stores what it receives
    acknowledges once it is stored, so a crash in between makes the broker deliver again."""
    receive_maximum: int | None = None
    """Receive Maximum sent in CONNECT: inbound QoS 1 messages the broker may have in flight
    to us unacknowledged (MQTT 5 default 65535; Mosquitto otherwise applies its own
    ``max_inflight_messages``, 20 by default)."""
    source_address: tuple[str, int] | None = None
    """Local ``(address, port)`` to connect from (a device with several networks); port 0 or
    None lets the kernel choose."""

    @property
    def where(self) -> str:
        """``host:port``, for messages."""
        return f"{self.host}:{self.port}"


@dataclass(frozen=True)
class Subscription:
    """One topic filter. ``retain_handling`` (``RETAIN_*``) 1, the default, sends retained
    messages only on a new subscription, so restoring subscriptions on a live session does not
    replay them; 0 sends them on every (re)subscription."""

    topic_filter: str
    qos: int = 1
    retain_handling: int = RETAIN_SEND_IF_NEW_SUB


@dataclass(frozen=True, slots=True)
class InboundMessage:
    """A received PUBLISH with the MQTT 5 properties the agent and the control plane use."""

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


def set_tcp_nodelay(sock: Any) -> bool:
    """Turn Nagle's algorithm off on a TCP (or TLS-over-TCP) socket; False when not TCP."""
    try:
        if sock.family not in (socket.AF_INET, socket.AF_INET6):
            return False
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return True
    except (AttributeError, OSError):
        return False


def tcp_nodelay_of(sock: Any) -> bool:
    """Whether TCP_NODELAY is on for ``sock`` (False when it is not a live TCP socket)."""
    try:
        if sock.family not in (socket.AF_INET, socket.AF_INET6):
            return False
        return bool(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
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
