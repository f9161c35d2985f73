"""The MQTT adapter's errors, drawn in one place. paho's exceptions and return codes are
translated where they enter (:mod:`mcp_edge.shared.mqtt.connection`) and chained with
``raise ... from``; nothing above this package sees a paho type.

::

    McpError
    └── MqttError                    any MQTT transport problem
        ├── MqttConnectError         no connection: network or TLS error, the broker refused the
        │                            login (``reason_code``; ``auth_refused``), no CONNACK in
        │                            time, or the socket connected to itself (nothing listens)
        ├── MqttConnectionLostError  not connected, or the connection dropped before the ack
        ├── MqttRefusedError         the broker refused a publish or a subscription (reason
        │                            code >= 0x80, e.g. not authorized), or paho refused the
        │                            message (0x99: too large, bad topic): retrying will not help
        └── MqttTimeoutError         no ack (or no session up) within the time given

Who retries: a :class:`~mcp_edge.shared.mqtt.session.Session` reconnects after
:class:`MqttConnectError` and :class:`MqttConnectionLostError` by itself, with its
:class:`~mcp_edge.shared.mqtt.reconnect.ReconnectPolicy`; a caller that publishes decides for
:class:`MqttTimeoutError`, and never retries :class:`MqttRefusedError` unchanged.
"""

from __future__ import annotations

from mcp_edge.shared.errors import McpError

RC_PACKET_REFUSED = 0x99
"""Reason code given to a message paho would not send (MQTT 5's "payload format invalid" is
the nearest; the broker never saw it)."""
_AUTH_REFUSALS = frozenset({0x84, 0x85, 0x86, 0x87, 0x8A, 0x8C})


class MqttError(McpError):
    """An MQTT transport problem."""


class MqttConnectError(MqttError):
    """Could not connect. ``reason_code`` (and ``reason``, its name) is the CONNACK reason
    when the broker refused."""

    def __init__(
        self, message: str, reason_code: int | None = None, reason: str | None = None
    ) -> None:
        super().__init__(message)
        self.reason_code = reason_code
        self.reason = reason

    @property
    def auth_refused(self) -> bool:
        """True when the broker refused the credentials or client id (fix config, not network)."""
        return self.reason_code in _AUTH_REFUSALS


class MqttConnectionLostError(MqttError):
    """Not connected, or the connection dropped before the broker acknowledged."""


class MqttRefusedError(MqttError):
    """The broker (or paho, :data:`RC_PACKET_REFUSED`) refused a publish or subscription;
    ``reason_code`` says why."""

    def __init__(self, message: str, reason_code: int) -> None:
        super().__init__(message)
        self.reason_code = reason_code


class MqttTimeoutError(MqttError):
    """The broker did not acknowledge in time (or no session came up in time)."""
