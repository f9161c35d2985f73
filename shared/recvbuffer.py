"""Serve many small reads from one large ``recv``: the buffer behind both sides' MQTT readers.

paho-mqtt reads each packet with three or four ``recv`` calls (the type byte, each byte of the
remaining length, then the body), one system call each. The agent's and the control plane's
MQTT clients mix :class:`ChunkedReads` into paho's client: one ``recv`` of up to :data:`CHUNK`
bytes into a :class:`RecvBuffer`, and paho's small reads are sliced from it. The buffer is
sans-io (the caller passes the function that really reads); the mixin imports no paho.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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


class ChunkedReads:
    """Mix in before ``paho.mqtt.client.Client`` to read its socket through a
    :class:`RecvBuffer`: ``class Client(ChunkedReads, paho.Client)``.

    One ``recv`` of up to :data:`CHUNK` bytes instead of three or four per packet;
    :attr:`buffered` tells the reader to go on calling ``loop_read`` while whole packets may
    wait in the buffer. Hooks paho 2.x's ``_sock_recv``/``_sock_close`` (pinned in
    deploy/constraints.txt); if a release renames them, the client reads as paho does. Nothing
    here imports paho.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._rbuf = RecvBuffer()

    @property
    def buffered(self) -> bool:
        return self._rbuf.pending

    def _sock_recv(self, bufsize: int) -> bytes:
        return self._rbuf.take(bufsize, super()._sock_recv)  # type: ignore[misc]

    def _sock_close(self) -> None:
        self._rbuf.clear()
        super()._sock_close()  # type: ignore[misc]
