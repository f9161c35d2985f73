"""The repository over MQTT request/response: the agent's default :class:`RepoTransport`.

Protocol: :mod:`shared.protocol.repo`. Each request is one chunk ``(path, offset, length)``
published on ``dev/{id}/repo`` with the response topic ``dev/{id}/repo/reply`` and fresh
correlation data; :meth:`MqttRepoTransport.handle_reply` (called by the fleet session on the
event loop for every message on the reply topic) resolves the request's future.

Threads: ngclient and the state machine run in a worker thread and call the synchronous
methods (:meth:`download`, the fetcher's ``fetch``). A download is one coroutine on the agent's
event loop (:func:`asyncio.run_coroutine_threadsafe`) that keeps the window full, checks each
reply and ``pwrite``s its bytes where they arrive, so a chunk costs no thread hand-over; the
worker thread only waits for the result and fsyncs. Metadata reads (small) hand each chunk to
the worker. Calling the blocking methods from the event loop's own thread raises
``RuntimeError`` (it would deadlock).

A chunk request waits ``chunk_timeout_s`` for its reply and is sent again after an
exponential backoff (``backoff_initial_s`` doubling up to ``backoff_max_s``) up to
``chunk_retries`` times, also while the connection is down; a whole call gives up after
``total_timeout_s``. Replies that arrive late (after a retry or for a cancelled request) match
no pending request and are counted in :attr:`MqttRepoTransport.stale_replies`.

python-tuf's exceptions (``tuf.api.exceptions``, small) load with this module; ngclient's
fetcher base class (all of ``tuf.ngclient``, about 10 MiB) only when :meth:`fetcher` is first
called, so an agent holds this transport from its start without the TUF client.

Errors (``tuf.api.exceptions``, as ngclient expects)::

    DownloadHTTPError(404)       the repository answered not_found
    DownloadLengthMismatchError  the file is longer than the caller allows, or a reply carries
                                 more bytes than asked for
    SlowRetrievalError           a chunk got no reply after every retry, or the total timeout
    DownloadError                anything else: bad_request, server error, not connected,
                                 a malformed reply
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import orjson
from tuf.api.exceptions import (
    DownloadError,
    DownloadHTTPError,
    DownloadLengthMismatchError,
    SlowRetrievalError,
)

from mcp_edge.agent.update.transport import Progress, open_partial
from mcp_edge.shared.errors import MessageError
from mcp_edge.shared.mqtt import InboundMessage, MqttClient, MqttError
from mcp_edge.shared.protocol import topics
from mcp_edge.shared.protocol.repo import (
    MAX_CHUNK_BYTES,
    RepoReply,
    RepoStatus,
    validate_repo_path,
)

if TYPE_CHECKING:
    from tuf.ngclient.fetcher import FetcherInterface

log = logging.getLogger("mcp.agent.update.mqtt")

BASE_URL = "mqtt-repo://control-plane/"
"""The pseudo-URL the transport gives ngclient; what follows it is the repository path."""

_Reply = tuple[RepoReply, bytes]
T = TypeVar("T")


@dataclass(frozen=True)
class MqttTransportConfig:
    """Tuning of :class:`MqttRepoTransport` (times in seconds, sizes in bytes)."""

    window: int = 8
    """Chunk requests in flight per download."""
    chunk_bytes: int = MAX_CHUNK_BYTES
    chunk_timeout_s: float = 10.0
    chunk_retries: int = 5
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 8.0
    total_timeout_s: float = 3600.0
    qos: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.window <= 64:
            raise ValueError("window must be 1-64 chunks")
        if not 1 <= self.chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be 1-{MAX_CHUNK_BYTES}")
        if self.chunk_timeout_s <= 0 or self.total_timeout_s <= 0 or self.chunk_retries < 0:
            raise ValueError("timeouts must be positive and retries not negative")
        if self.qos not in (0, 1):
            raise ValueError("qos must be 0 or 1")


class _Lost(Exception):
    """A request got no answer: no reply in time, or the connection went away."""

    def __init__(self, message: str, *, timed_out: bool) -> None:
        super().__init__(message)
        self.timed_out = timed_out


class MqttRepoTransport:
    """:class:`agent.update.transport.RepoTransport` over the agent's MQTT session."""

    def __init__(
        self,
        mqtt: MqttClient,
        device_id: str,
        config: MqttTransportConfig | None = None,
        *,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self._mqtt = mqtt
        self.device_id = topics.validate_id(device_id, "device id")
        self.config = config or MqttTransportConfig()
        self._request_topic = topics.repo_request(self.device_id)
        self.reply_topic = topics.repo_reply(self.device_id)
        if loop is None:
            with contextlib.suppress(RuntimeError):
                loop = asyncio.get_running_loop()
        self._loop = loop
        self._pending: dict[bytes, asyncio.Future[_Reply]] = {}
        self._watcher: asyncio.Task[None] | None = None
        self._prefix = os.urandom(6)
        self._counter = itertools.count()
        self._lock = threading.Lock()
        self.requests_sent = 0
        """Chunk requests published (retries included)."""
        self.retries = 0
        self.stale_replies = 0

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Use ``loop`` (the one the MQTT client runs on) for requests."""
        self._loop = loop

    # ---- RepoTransport ---------------------------------------------------------------------

    @property
    def metadata_url(self) -> str:
        return BASE_URL + "metadata/"

    @property
    def targets_url(self) -> str:
        return BASE_URL + "targets/"

    def fetcher(self) -> FetcherInterface:
        # ngclient's fetcher base class imports all of tuf.ngclient: only once metadata is read.
        from mcp_edge.agent.update.fetcher import ReaderFetcher

        return ReaderFetcher(self._read_url, f"mqtt:{self.device_id}")

    def _read_url(self, url: str) -> Iterator[bytes]:
        return self.iter_file(self.path_of(url))

    def download(
        self, url: str, dest: Path, *, length: int, progress: Progress | None = None
    ) -> int:
        """See :meth:`agent.update.transport.RepoTransport.download`."""
        path = self.path_of(url)
        deadline = time.monotonic() + self.config.total_timeout_s
        fd, start = open_partial(dest, length)
        try:
            future = self._run_on_loop(self._download(fd, path, start, length, deadline, progress))
        except BaseException:
            os.close(fd)
            raise
        ended = True  # False only while the coroutine may still be writing
        try:
            # The coroutine enforces the deadline itself; the margin only guards against an
            # event loop that stopped running (the agent shutting down).
            written = future.result(timeout=max(0.0, deadline - time.monotonic()) + 30.0)
        except concurrent.futures.TimeoutError:
            ended = False
            future.cancel()
            log.warning("download of %s abandoned: the event loop does not answer", path)
            raise SlowRetrievalError(f"{path}: total timeout reached") from None
        finally:
            if ended:
                os.fsync(fd)
                os.close(fd)
        return written

    # ---- downloads run on the event loop ---------------------------------------------------

    async def _download(
        self,
        fd: int,
        path: str,
        start: int,
        length: int,
        deadline: float,
        progress: Progress | None,
    ) -> int:
        """Keep ``window`` chunk requests in flight and write each reply at its offset.

        Runs on the event loop, so a chunk costs no thread hand-over: the reply's bytes are
        checked and written (``pwrite`` into the page cache) where they arrive.
        """
        loop = asyncio.get_running_loop()
        chunk = self.config.chunk_bytes
        window: deque[tuple[int, int, asyncio.Task[_Reply]]] = deque()
        next_offset, end, written = start, length, 0

        def ask(offset: int, n: int) -> None:
            window.append((offset, n, loop.create_task(self.request(path, offset, n))))

        try:
            if next_offset >= end:  # nothing left to fetch: still learn the size
                ask(start, 1)
            while window or next_offset < end:
                while len(window) < self.config.window and next_offset < end:
                    n = min(chunk, end - next_offset)
                    ask(next_offset, n)
                    next_offset += n
                offset, n, task = window.popleft()
                reply, data = await self._reply_of(task, deadline, path)
                size = self._check_ok(reply, data, path, offset, n, length)
                if size < start:
                    os.ftruncate(fd, 0)
                    raise DownloadError(
                        f"the partial download is longer than {path} "
                        f"({size} bytes); it was discarded"
                    )
                end = min(end, size)
                if offset >= end:
                    continue
                os.pwrite(fd, data, offset)
                written += len(data)
                if progress is not None:
                    progress(offset + len(data), size)
        finally:
            for _, _, task in window:
                task.cancel()
        return written

    @staticmethod
    async def _reply_of(task: asyncio.Task[_Reply], deadline: float, path: str) -> _Reply:
        try:
            return await asyncio.wait_for(task, max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            raise SlowRetrievalError(f"{path}: total timeout reached") from None
        except _Lost as e:
            if e.timed_out:
                raise SlowRetrievalError(f"{path}: {e}") from None
            raise DownloadError(f"{path}: {e}") from None

    def _check_ok(
        self, reply: RepoReply, data: bytes, path: str, offset: int, asked: int, length: int
    ) -> int:
        """Check one reply to ``(path, offset, asked)``; return the file's size."""
        if reply.status is RepoStatus.NOT_FOUND:
            raise DownloadHTTPError(f"{path}: not found ({reply.error})", 404)
        if reply.status is not RepoStatus.OK:
            raise DownloadError(
                f"{path}: the repository answered {reply.status.value}: "
                f"{reply.error or 'no reason given'}"
            )
        size = reply.size
        assert size is not None
        if size > length:
            raise DownloadLengthMismatchError(
                f"{path} is {size} bytes, more than the {length} bytes allowed"
            )
        if reply.offset != offset:
            raise DownloadError(f"{path}: reply for offset {reply.offset}, asked {offset}")
        expected = max(0, min(asked, size - offset))
        if len(data) > expected:
            raise DownloadLengthMismatchError(
                f"{path}: {len(data)} bytes at offset {offset}, expected {expected}"
            )
        if len(data) < expected:
            raise DownloadError(
                f"{path}: short reply of {len(data)} bytes at offset {offset}, expected {expected}"
            )
        return size

    def _submit(self, path: str, offset: int, n: int) -> concurrent.futures.Future[_Reply]:
        return self._run_on_loop(self.request(path, offset, n))

    def _run_on_loop(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the transport's loop from a worker thread."""
        loop = self._loop
        if loop is None or loop.is_closed():
            coro.close()
            raise DownloadError("the MQTT transport is not bound to a running event loop")
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            coro.close()
            raise RuntimeError("MqttRepoTransport's blocking calls must not run on its loop")
        return asyncio.run_coroutine_threadsafe(coro, loop)

    @staticmethod
    def _result(future: concurrent.futures.Future[_Reply], deadline: float, path: str) -> _Reply:
        remaining = deadline - time.monotonic()
        try:
            return future.result(timeout=max(0.0, remaining))
        except concurrent.futures.TimeoutError:
            raise SlowRetrievalError(f"{path}: total timeout reached") from None
        except _Lost as e:
            if e.timed_out:
                raise SlowRetrievalError(f"{path}: {e}") from None
            raise DownloadError(f"{path}: {e}") from None

    @staticmethod
    def path_of(url: str) -> str:
        """The repository path a transport URL names; raises DownloadError for other URLs."""
        if not url.startswith(BASE_URL):
            raise DownloadError(f"{url!r:.120} is not a URL of the MQTT repository transport")
        try:
            return validate_repo_path(url[len(BASE_URL) :])
        except MessageError as e:
            raise DownloadError(str(e)) from None

    # ---- the event loop --------------------------------------------------------------------

    async def request(self, path: str, offset: int, length: int) -> _Reply:
        """Ask for one chunk, retrying with backoff; return the reply and its payload.

        Raises :class:`_Lost` after the last retry (``timed_out`` when replies stopped coming
        rather than the connection being down).
        """
        cfg = self.config
        payload = orjson.dumps({"path": path, "offset": offset, "length": length})
        attempt = 0
        while True:
            try:
                return await self._ask(payload)
            except _Lost as e:
                if attempt >= cfg.chunk_retries:
                    raise _Lost(
                        f"chunk at offset {offset}: {e} (after {attempt} retries)",
                        timed_out=e.timed_out,
                    ) from None
                delay = min(cfg.backoff_max_s, cfg.backoff_initial_s * 2**attempt)
                attempt += 1
                self.retries += 1
                log.info(
                    "repository chunk %s@%d: %s; retry %d in %.1f s",
                    path,
                    offset,
                    e,
                    attempt,
                    delay,
                )
                await asyncio.sleep(delay)

    async def _ask(self, payload: bytes) -> _Reply:
        with self._lock:
            correlation = self._prefix + next(self._counter).to_bytes(8, "big")
        reply: asyncio.Future[_Reply] = asyncio.get_running_loop().create_future()
        self._pending[correlation] = reply
        try:
            try:
                ack = self._mqtt.publish_nowait(
                    self._request_topic,
                    payload,
                    self.config.qos,
                    response_topic=self.reply_topic,
                    correlation_data=correlation,
                )
            except MqttError as e:
                raise _Lost(f"not connected: {e}", timed_out=False) from None
            self.requests_sent += 1
            self._watch_connection()
            ack.add_done_callback(lambda a: _fail_on_lost_ack(a, reply))
            try:
                return await asyncio.wait_for(reply, self.config.chunk_timeout_s)
            except asyncio.TimeoutError:
                raise _Lost(
                    f"no reply within {self.config.chunk_timeout_s} s", timed_out=True
                ) from None
        finally:
            self._pending.pop(correlation, None)

    def _watch_connection(self) -> None:
        """Fail every pending request as soon as the connection they went out on is lost
        (their replies will never come), rather than after ``chunk_timeout_s``."""
        if (self._watcher is None or self._watcher.done()) and self._mqtt.connected:
            self._watcher = asyncio.get_running_loop().create_task(
                self._fail_pending_on_loss(), name="repo-transport-watch"
            )

    async def _fail_pending_on_loss(self) -> None:
        why = await self._mqtt.wait_disconnected()
        for future in list(self._pending.values()):
            if not future.done():
                future.set_exception(_Lost(f"connection lost: {why}", timed_out=False))

    def handle_reply(self, msg: InboundMessage) -> None:
        """Resolve the request ``msg`` answers (on the event loop; never raises)."""
        correlation = msg.correlation_data
        future = self._pending.pop(bytes(correlation), None) if correlation else None
        if future is None or future.done():
            self.stale_replies += 1
            return
        try:
            reply = RepoReply.from_user_properties(msg.user_properties)
        except MessageError as e:
            reply = RepoReply(RepoStatus.ERROR, error=f"malformed reply: {e}")
        future.set_result((reply, msg.payload))

    # ---- fetcher ---------------------------------------------------------------------------

    def iter_file(self, path: str) -> Iterator[bytes]:
        """Yield a whole repository file in order, ``window`` chunks in flight (ngclient
        stops reading once it has more than it allows)."""
        chunk = self.config.chunk_bytes
        deadline = time.monotonic() + self.config.total_timeout_s
        reply, data = self._result(self._submit(path, 0, chunk), deadline, path)
        size = self._check_ok(reply, data, path, 0, chunk, 2**62)
        yield data
        window: deque[tuple[int, int, concurrent.futures.Future[_Reply]]] = deque()
        next_offset = len(data)
        try:
            while window or next_offset < size:
                while len(window) < self.config.window and next_offset < size:
                    n = min(chunk, size - next_offset)
                    window.append((next_offset, n, self._submit(path, next_offset, n)))
                    next_offset += n
                offset, n, future = window.popleft()
                reply, data = self._result(future, deadline, path)
                if self._check_ok(reply, data, path, offset, n, 2**62) != size:
                    raise DownloadError(f"{path} changed size while being read")
                yield data
        finally:
            for _, _, future in window:
                future.cancel()


def _fail_on_lost_ack(ack: asyncio.Future[int], reply: asyncio.Future[_Reply]) -> None:
    """A request the broker never acknowledged (connection lost, refused) fails at once."""
    if ack.cancelled():
        return
    error = ack.exception()
    if error is not None and not reply.done():
        reply.set_exception(_Lost(f"request not delivered: {error}", timed_out=False))
