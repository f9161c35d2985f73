"""Calls between the serving processes of one agent, over the socket pair that joins them.

A multi-process server (:mod:`.workers`) keeps one :class:`Channel` between the primary
process and each worker it started. Either side may call the other: a call is
``(op, payload)`` and its answer a value or an error carrying the
:class:`~.requests.RequestError` code and message. Frames are a 4-byte length and a pickle;
the socket is an unnamed pair created by the primary and inherited by its own child, never
reachable from the network, so both ends are the same program. A frame over
:data:`MAX_FRAME` ends the channel.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import pickle
import struct
from collections.abc import Awaitable, Callable
from typing import Any

from mcp_edge.agent.serving.requests import RequestError
from mcp_edge.shared.errors import McpError
from mcp_edge.shared.protocol.wire import ErrorCode

log = logging.getLogger("mcp.agent.workers")

MAX_FRAME = 256 * 1024 * 1024
_HEADER = struct.Struct("!I")

Handler = Callable[[str, Any], Awaitable[Any]]


class ChannelClosedError(McpError):
    """The process at the other end is gone (or the channel was closed)."""


class RemoteError(RequestError):
    """A call the other process answered with an error."""


class Channel:
    """Calls in both directions over one stream (see the module docstring)."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, handler: Handler
    ) -> None:
        self._reader, self._writer = reader, writer
        self._handler = handler
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False
        self.closed = asyncio.Event()

    async def call(self, op: str, payload: Any = None, timeout_s: float | None = 120.0) -> Any:
        """Ask the other process to run ``op``; its answer, or RemoteError /
        ChannelClosedError / TimeoutError."""
        if self._closed:
            raise ChannelClosedError("the other serving process is gone")
        call_id = next(self._ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[call_id] = future
        try:
            self._send(("call", call_id, op, payload))
            return await asyncio.wait_for(future, timeout_s)
        finally:
            self._pending.pop(call_id, None)

    def _send(self, message: tuple[Any, ...]) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        if len(data) > MAX_FRAME:
            raise RequestError(ErrorCode.TOO_LARGE, f"message of {len(data)} bytes between "
                               "serving processes is over the limit")  # fmt: skip
        self._writer.write(_HEADER.pack(len(data)) + data)

    async def run(self) -> None:
        """Read and dispatch until the other end closes; then fail every pending call."""
        try:
            while True:
                head = await self._reader.readexactly(_HEADER.size)
                (size,) = _HEADER.unpack(head)
                if size > MAX_FRAME:
                    log.error("frame of %d bytes from the other serving process: closing", size)
                    break
                message = pickle.loads(await self._reader.readexactly(size))
                self._dispatch(message)
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        finally:
            self.close()

    def _dispatch(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "call":
            _, call_id, op, payload = message
            task = asyncio.get_running_loop().create_task(self._serve(call_id, op, payload))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return
        _, call_id, ok, value = message
        future = self._pending.get(call_id)
        if future is None or future.done():
            return
        if ok:
            future.set_result(value)
        else:
            code, text = value
            future.set_exception(RemoteError(ErrorCode(code), text))

    async def _serve(self, call_id: int, op: str, payload: Any) -> None:
        try:
            value = await self._handler(op, payload)
            answer: tuple[Any, ...] = ("answer", call_id, True, value)
        except RequestError as e:
            answer = ("answer", call_id, False, (e.code.value, str(e)))
        except Exception as e:
            if not isinstance(e, McpError):
                log.exception("%s failed in a serving process", op)
            answer = ("answer", call_id, False, (ErrorCode.INTERNAL.value, str(e) or repr(e)))
        if self._closed:
            return
        try:
            self._send(answer)
        except RequestError as e:
            self._send(("answer", call_id, False, (e.code.value, str(e))))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for future in self._pending.values():
            if not future.done():
                future.set_exception(ChannelClosedError("the other serving process is gone"))
        self._writer.close()
        self.closed.set()
