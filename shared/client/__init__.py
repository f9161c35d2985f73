"""The application client: inference requests to one device or to the fleet, over MQTT 5.

::

    from mcp_edge.client import InferenceClient

    async with InferenceClient("broker.local", 1883, client_id="app-1",
                               username="app-app-1", password=...) as c:
        resp = await c.infer("digits", {"input": x}, timeout_s=5)

Installed as ``mcp_edge.client`` (the folder ``shared/client``); it speaks MQTT through the one
adapter, :mod:`mcp_edge.shared.mqtt`. Errors, all :class:`InferenceClientError`, are drawn in
:mod:`mcp_edge.client.inference`.
"""

from mcp_edge.client.inference import (
    InferenceClient,
    InferenceClientError,
    InferenceReplyError,
    InferenceTimeoutError,
    InferenceTransportError,
    NoResponderError,
    build_request,
    parse_reply,
)

__all__ = [
    "InferenceClient", "InferenceClientError", "InferenceReplyError", "InferenceTimeoutError",
    "InferenceTransportError", "NoResponderError", "build_request", "parse_reply",
]  # fmt: skip
