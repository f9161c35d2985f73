"""The one MQTT adapter: paho-mqtt 2.x (MQTT 5) made async, for the agent, the control plane
and the application client. The marked I/O exception in ``shared``: the only package of the
repository that imports paho (``tests/unit/test_layering.py`` holds it to that).

Layers, bottom up:

- :mod:`.values` settings, subscriptions, messages; :mod:`.errors` the exception tree (drawn in
  its docstring; paho's exceptions never get past :mod:`.connection`); :mod:`.reconnect` the
  one reconnect policy (:class:`ReconnectPolicy`, :class:`Backoff`).
- :mod:`.connection` one socket: paho on the event loop (no paho thread), futures per packet
  id, handlers inside the read with one write per read, 64 KiB reads (:mod:`._paho`, the only
  module touching paho's private API, over the pure :mod:`.recvbuffer`), TCP_NODELAY, a
  self-connected socket refused (:mod:`mcp_edge.shared.netutil`).
- :mod:`.client` :class:`MqttClient`: connect, restore subscriptions, publish (awaited, a
  future, or fire-and-forget), subscribe, receive. It never reconnects by itself.
- :mod:`.session` :class:`Session`: keeps a client connected with a :class:`ReconnectPolicy`;
  ``up``/``problem`` for readiness.
"""

from mcp_edge.shared.mqtt.client import MessageHandler, MqttClient
from mcp_edge.shared.mqtt.errors import (
    MqttConnectError,
    MqttConnectionLostError,
    MqttError,
    MqttRefusedError,
    MqttTimeoutError,
)
from mcp_edge.shared.mqtt.reconnect import Backoff, ReconnectPolicy
from mcp_edge.shared.mqtt.session import Session
from mcp_edge.shared.mqtt.values import (
    RC_NO_MATCHING_SUBSCRIBERS,
    RETAIN_DO_NOT_SEND,
    RETAIN_SEND_IF_NEW_SUB,
    RETAIN_SEND_ON_SUBSCRIBE,
    ConnectResult,
    InboundMessage,
    MqttSettings,
    Subscription,
    Will,
    parse_host_port,
)

__all__ = [
    "RC_NO_MATCHING_SUBSCRIBERS", "RETAIN_DO_NOT_SEND", "RETAIN_SEND_IF_NEW_SUB",
    "RETAIN_SEND_ON_SUBSCRIBE", "Backoff", "ConnectResult", "InboundMessage", "MessageHandler",
    "MqttClient", "MqttConnectError", "MqttConnectionLostError", "MqttError", "MqttRefusedError",
    "MqttSettings", "MqttTimeoutError", "ReconnectPolicy", "Session", "Subscription", "Will",
    "parse_host_port",
]  # fmt: skip
