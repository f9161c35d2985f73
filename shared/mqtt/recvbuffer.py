"""Serve many small reads from one large ``recv``: the buffer behind the MQTT reader.

paho-mqtt reads each packet with three or four ``recv`` calls (the type byte, each byte of the
remaining length, then the body), one system call each. :mod:`mcp_edge.shared.mqtt._paho`
routes paho's reads through a :class:`RecvBuffer`: one ``recv`` of up to :data:`CHUNK` bytes,
and paho's small reads are sliced from it. The buffer is sans-io (the caller passes the
function that really reads) and imports no paho.
"""

from __future__ import annotations

from collections.abc import Callable

CHUNK = 65536
"""Bytes asked of the socket per real read."""


class RecvBuffer:
    """Bytes read from a socket and not yet handed out.

    :meth:`take` returns at most ``n`` bytes: from the buffer when it holds any, else from one
    ``recv(max(n, CHUNK))`` whose surplus is kept. Whatever ``recv`` raises (e.g.
    ``BlockingIOError``) propagates, and an empty result (end of stream) is returned as is.
    :attr:`pending` is true while bytes wait here: the socket reports no readiness for them, so
    the reader must go on taking. :meth:`clear` drops them with the connection.
    """

    __slots__ = ("_data", "_pos")

    def __init__(self) -> None:
        self._data = b""
        self._pos = 0

    @property
    def pending(self) -> bool:
        return self._pos < len(self._data)

    def take(self, n: int, recv: Callable[[int], bytes]) -> bytes:
        data, pos = self._data, self._pos
        if pos >= len(data):
            data = recv(max(n, CHUNK))
            if len(data) <= n:  # all of it asked for: nothing to keep, no copy
                self._data, self._pos = b"", 0
                return data
            pos = 0
        end = min(pos + n, len(data))
        self._data, self._pos = data, end
        return data[pos:end]

    def clear(self) -> None:
        self._data, self._pos = b"", 0
