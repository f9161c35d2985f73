"""The one module that touches paho-mqtt's private API.

paho reads each packet with three or four ``recv`` calls; :class:`ChunkedClient` routes them
through a :class:`~mcp_edge.shared.mqtt.recvbuffer.RecvBuffer` (one ``recv`` of up to 64 KiB,
paho's small reads sliced from it). What that relies on, in paho-mqtt |PAHO_TESTED|:

- ``Client._sock_recv(self, bufsize: int) -> bytes``: every read of the socket (``_packet_read``)
- ``Client._sock_close(self) -> None``: every close of the socket (the buffer is dropped then)

pyproject.toml bounds paho-mqtt to that minor release, and
``tests/unit/test_mqtt_paho_internals.py`` fails when an installed paho no longer has these
methods with these signatures, so an upgrade is a conscious step. Everything else the adapter
uses from paho is its public API.
"""

from __future__ import annotations

from typing import Any

import paho.mqtt.client as paho

from mcp_edge.shared.mqtt.recvbuffer import RecvBuffer

PAHO_TESTED = (2, 2)
"""The paho-mqtt ``major.minor`` whose private methods this module was checked against."""
PRIVATE_METHODS = {"_sock_recv": ("self", "bufsize"), "_sock_close": ("self",)}
"""The private methods overridden here, with the parameters they take."""


class ChunkedClient(paho.Client):
    """paho's client reading its socket in 64 KiB chunks.

    :attr:`buffered` tells the reader to go on calling ``loop_read`` while whole packets may
    wait in the buffer (the socket reports no readiness for them).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._rbuf = RecvBuffer()
        super().__init__(*args, **kwargs)

    @property
    def buffered(self) -> bool:
        return self._rbuf.pending

    def _sock_recv(self, bufsize: int) -> bytes:
        return self._rbuf.take(bufsize, super()._sock_recv)

    def _sock_close(self) -> None:
        self._rbuf.clear()
        super()._sock_close()
