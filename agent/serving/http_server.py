"""The agent's HTTP/1.1 server: llhttp (through httptools) on an asyncio protocol.

The agent's local API is small (a score of routes, JSON and binary bodies, no cookies,
streaming or websockets) and its inference route is the hot path of the whole product: a
general web framework spends most of a small model's request in its own layers (measured
here with ``wrk``, 64 connections, a do-nothing handler: aiohttp 17–24k requests/s, this
server over 70k). This module is only what that API needs, done carefully:

- **Parsing** is llhttp's (Node.js's parser, also uvicorn's): request line, headers,
  ``Content-Length`` and chunked bodies, keep-alive and pipelining (requests on one
  connection are answered in order). A request it refuses is answered 400 and the
  connection closed; an upgrade request 501.
- **Limits** before anything is buffered: the request line (8 KiB), the headers (64 KiB and
  100 of them; 431 past either), the body (``max_body``, 413 from its ``Content-Length`` or
  as the chunks arrive); once 32 requests are queued on one connection, reading pauses (the
  requests of the read in progress are still parsed: a read is at most 256 KiB).
- ``Content-Encoding: gzip`` or ``deflate`` bodies are inflated with the same cap on the
  inflated size (a small compressed bomb is refused, never inflated in full); other codings
  are 415. ``Expect: 100-continue`` is answered once the headers pass the limits.
- **Flow control**: when a client stops reading its answers, the connection stops reading
  requests until the answers drain.
- **Idle connections** close after ``keepalive_s``; :meth:`HttpServer.stop` stops
  listening, lets the requests in progress finish (up to its grace period) and closes every
  connection.

Handlers take an :class:`HttpRequest` and return an :class:`HttpResponse`; :class:`Router`
maps ``METHOD /path/{name}/...`` patterns to them. The access log (optional) writes one line
per answer in the common combined form.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import socket
import time
import zlib
from collections.abc import Awaitable, Callable
from typing import Any, cast
from urllib.parse import unquote

import httptools
from multidict import CIMultiDict, CIMultiDictProxy

log = logging.getLogger("mcp.agent.http")

MAX_URL = 8 * 1024
MAX_HEADER_BYTES = 64 * 1024
MAX_HEAD_BYTES = MAX_URL + MAX_HEADER_BYTES + 8 * 1024
"""The bytes a request's head may take past the read it began in (see ``_feed_head``)."""
_HEAD_SLICE = 4096
MAX_HEADERS = 100
MAX_QUEUED = 32
KEEPALIVE_S = 75.0
LINGER_S = 2.0
"""After a refusal, how long the server reads and drops what the client still sends."""

_REASONS = {
    100: "Continue", 200: "OK", 204: "No Content", 400: "Bad Request", 401: "Unauthorized",
    403: "Forbidden", 404: "Not Found", 405: "Method Not Allowed", 409: "Conflict",
    413: "Payload Too Large", 415: "Unsupported Media Type", 429: "Too Many Requests",
    431: "Request Header Fields Too Large", 500: "Internal Server Error",
    501: "Not Implemented", 503: "Service Unavailable", 504: "Gateway Timeout",
}  # fmt: skip
_STATUS_LINES: dict[int, bytes] = {}


class HttpRequest:
    """One request as the handlers see it; ``body`` is complete (and inflated)."""

    __slots__ = ("body", "headers", "keep_alive", "match_info", "method", "path", "peer",
                 "query", "version")  # fmt: skip

    def __init__(
        self,
        method: str,
        path: str,
        headers: CIMultiDictProxy[str],
        body: bytes = b"",
        *,
        query: str = "",
        version: str = "1.1",
        keep_alive: bool = True,
        peer: str = "-",
    ) -> None:
        self.method, self.path, self.query = method, path, query
        self.headers = headers
        self.body = body
        self.version, self.keep_alive, self.peer = version, keep_alive, peer
        self.match_info: dict[str, str] = {}

    @property
    def content_length(self) -> int:
        return len(self.body)

    async def read(self) -> bytes:
        return self.body


class HttpResponse:
    """An answer: status, body, content type and further headers."""

    __slots__ = ("body", "content_type", "headers", "status")

    def __init__(
        self,
        body: bytes = b"",
        status: int = 200,
        content_type: str = "application/json",
        headers: dict[str, str] | None = None,
    ) -> None:
        self.body, self.status, self.content_type = body, status, content_type
        self.headers = headers


Handler = Callable[[HttpRequest], Awaitable[HttpResponse]]
NoRoute = Callable[[HttpRequest, set[str]], Awaitable[HttpResponse]]
"""Answers a request no route takes, given the methods the path takes (empty: none)."""


class Router:
    """``METHOD`` + path patterns (``/v2/models/{model}/infer``; a last segment ``{name*}``
    takes the rest of the path) → handlers, resolved segment by segment."""

    def __init__(self) -> None:
        self._static: dict[str, dict[str, Handler]] = {}
        self._patterns: dict[int, list[tuple[tuple[str, ...], dict[str, Handler]]]] = {}
        self._tails: list[tuple[tuple[str, ...], dict[str, Handler]]] = []

    def add(self, method: str, pattern: str, handler: Handler) -> None:
        """Route ``method`` (``*``: any) on ``pattern`` to ``handler``; GET routes take HEAD."""
        methods = [method] + (["HEAD"] if method == "GET" else [])
        parts = tuple(pattern.split("/"))
        if not any(p.startswith("{") for p in parts):
            routes = self._static.setdefault(pattern, {})
        elif parts[-1].endswith("*}"):
            routes = self._find(self._tails, parts)
        else:
            routes = self._find(self._patterns.setdefault(len(parts), []), parts)
        for m in methods:
            routes.setdefault(m, handler)

    @staticmethod
    def _find(
        entries: list[tuple[tuple[str, ...], dict[str, Handler]]], parts: tuple[str, ...]
    ) -> dict[str, Handler]:
        for have, found in entries:
            if have == parts:
                return found
        fresh: dict[str, Handler] = {}
        entries.append((parts, fresh))
        return fresh

    def resolve(self, method: str, path: str) -> tuple[Handler | None, dict[str, str], set[str]]:
        """(handler, path parameters, methods the path takes); the handler is None when the
        path has no route (methods empty) or not for ``method``."""
        allowed: set[str] = set()
        table = self._static.get(path)
        if table is not None:
            handler = table.get(method) or table.get("*")
            if handler is not None:
                return handler, {}, set(table)
            allowed |= table.keys()
        segments = path.split("/")
        for parts, table in self._patterns.get(len(segments), ()):
            info = _match(parts, segments)
            if info is None:
                continue
            handler = table.get(method) or table.get("*")
            if handler is not None:
                return handler, info, set(table)
            allowed |= table.keys()
        for parts, table in self._tails:
            n = len(parts) - 1
            if len(segments) < n or _match(parts[:n], segments[:n]) is None:
                continue
            handler = table.get(method) or table.get("*")
            info = {parts[n][1:-2]: "/".join(segments[n:])}
            if handler is not None:
                return handler, info, set(table)
            allowed |= table.keys()
        return None, {}, allowed


def _match(parts: tuple[str, ...], segments: list[str]) -> dict[str, str] | None:
    info: dict[str, str] = {}
    for want, got in zip(parts, segments, strict=True):
        if want[:1] == "{":
            if not got:
                return None
            info[want[1:-1]] = unquote(got) if "%" in got else got
        elif want != got:
            return None
    return info


def _status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    if line is None:
        reason = _REASONS.get(status, "Unknown")
        line = _STATUS_LINES[status] = f"HTTP/1.1 {status} {reason}\r\n".encode()
    return line


def _head(status: int, content_type: str, length: int, extra: dict[str, str] | None,
          close: bool) -> bytes:  # fmt: skip
    parts = [_status_line(status), b"Content-Type: ", content_type.encode("latin-1"),
             b"\r\nContent-Length: ", str(length).encode()]  # fmt: skip
    if extra:
        for k, v in extra.items():
            parts.append(f"\r\n{k}: {v}".encode("latin-1"))
    if close:
        parts.append(b"\r\nConnection: close")
    parts.append(b"\r\n\r\n")
    return b"".join(parts)


class _Refused(Exception):
    """A request the server answers itself (limits, encodings) and closes the connection."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.request: HttpRequest | None = None  # what is known of it, for the access log


class _Connection(asyncio.Protocol):
    """One client connection: parse, queue, answer in order."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.queue: collections.deque[HttpRequest | _Refused] = collections.deque()
        self.peer = "-"
        self._url = bytearray()
        self._headers: list[tuple[str, str]] = []
        self._header_bytes = 0
        self._in_head = False
        self._head_bytes = 0
        self._discarding = False
        self._body: list[bytes] = []
        self._body_size = 0
        self._inflate: Any = None
        self._expect_continue = False
        self._wakeup: asyncio.Future[None] | None = None
        self._writable = asyncio.Event()
        self._writable.set()
        self._reading = True
        self._busy = False
        self._closing = False
        self._worker: asyncio.Task[None] | None = None
        self._idle: asyncio.TimerHandle | None = None

    # ----------------------------------------------------------------- transport events
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple):
            self.peer = str(peer[0])
        self.server.connections.add(self)
        self._worker = self.loop.create_task(self._serve())
        self._arm_idle()

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing = True
        self.server.connections.discard(self)
        self._writable.set()
        if self._idle is not None:
            self._idle.cancel()
        if self._worker is not None and not self._busy:
            self._worker.cancel()
        self._wake()

    def pause_writing(self) -> None:
        self._writable.clear()
        self._pause_reading()

    def resume_writing(self) -> None:
        self._writable.set()
        self._resume_reading()

    def data_received(self, data: bytes) -> None:
        if self._discarding:  # after a refusal: read and dropped until the client closes
            return
        try:
            if self._in_head:
                self._feed_head(data)
            else:
                self.parser.feed_data(data)
        except _Refused as e:
            self._refuse(e)
        except httptools.HttpParserCallbackError as e:
            # A callback refused the request (a limit, an encoding): llhttp re-raises it so.
            cause = e.__context__
            if isinstance(cause, _Refused):
                self._refuse(cause)
            else:
                log.error("HTTP parser callback failed", exc_info=cause)
                self._refuse(_Refused(500, "internal error"))
        except httptools.HttpParserUpgrade:
            self._refuse(_Refused(501, "protocol upgrades are not supported"))
        except httptools.HttpParserError as e:
            self._refuse(_Refused(400, f"malformed HTTP request: {e}"))

    def _feed_head(self, data: bytes) -> None:
        """Feed ``data`` that continues a request's head, counting what the head takes.

        httptools holds a header name or value until it ends and only then calls
        :meth:`on_header`, so the limits there do not bound one endless header: the head is
        fed in slices and refused once it has taken :data:`MAX_HEAD_BYTES`.
        """
        view = memoryview(data)
        parser = self.parser
        for start in range(0, len(view), _HEAD_SLICE):
            if not self._in_head:
                parser.feed_data(view[start:])
                return
            self._head_bytes += min(_HEAD_SLICE, len(view) - start)
            if self._head_bytes > MAX_HEAD_BYTES:
                raise _Refused(431, f"request headers over {MAX_HEADER_BYTES} bytes")
            parser.feed_data(view[start : start + _HEAD_SLICE])

    def _refuse(self, e: _Refused) -> None:
        """Answer ``e`` after the requests queued before it, then close."""
        if self.server.access_log is not None:
            e.request = self._refused_request()
        self.queue.append(e)
        self._pause_reading()
        self._wake()

    # ----------------------------------------------------------------- parser callbacks
    def on_message_begin(self) -> None:
        self._url.clear()
        self._headers = []
        self._header_bytes = 0
        self._in_head = True
        self._head_bytes = 0
        self._body = []
        self._body_size = 0
        self._inflate = None
        self._expect_continue = False

    def on_url(self, url: bytes) -> None:
        self._url += url
        if len(self._url) > MAX_URL:
            raise _Refused(400, f"request line over {MAX_URL} bytes")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_bytes += len(name) + len(value) + 4
        if self._header_bytes > MAX_HEADER_BYTES or len(self._headers) >= MAX_HEADERS:
            raise _Refused(431, f"request headers over {MAX_HEADER_BYTES} bytes or "
                                f"{MAX_HEADERS} fields")  # fmt: skip
        self._headers.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        self._in_head = False
        if self.parser.should_upgrade():
            # llhttp would hand the connection over after this request (CONNECT too): refuse
            # it here, before it is queued, so that no handler answers it as well.
            raise _Refused(501, "protocol upgrades are not supported")
        max_body = self.server.max_body
        encoding = ""
        for name, value in self._headers:
            lower = name.lower()
            if lower == "content-length" and value.isdigit() and int(value) > max_body:
                raise _Refused(413, f"request body too large: {value} bytes, limit {max_body}")
            if lower == "content-encoding":
                encoding = value.strip().lower()
            elif lower == "expect" and value.strip().lower() == "100-continue":
                self._expect_continue = True
        if encoding in ("gzip", "x-gzip"):
            self._inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)
        elif encoding == "deflate":
            self._inflate = _Deflate()
        elif encoding not in ("", "identity"):
            raise _Refused(415, f"Content-Encoding {encoding[:40]!r} is not supported; "
                                "send gzip, deflate or no encoding")  # fmt: skip
        if self._expect_continue and self.transport is not None:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        max_body = self.server.max_body
        if self._inflate is not None:
            try:
                body = self._inflate.decompress(body, max_body - self._body_size + 1)
            except zlib.error as e:
                raise _Refused(400, f"cannot read the request body: {e}") from None
        self._body_size += len(body)
        if self._body_size > max_body:
            raise _Refused(413, f"request body too large: over {max_body} bytes")
        self._body.append(body)

    def on_message_complete(self) -> None:
        if self._inflate is not None and not self._inflate.eof:
            raise _Refused(400, "cannot read the request body: the compressed data ends early")
        try:
            url = httptools.parse_url(bytes(self._url))
        except httptools.HttpParserInvalidURLError:
            raise _Refused(400, "malformed HTTP request: invalid request target") from None
        raw_path = url.path.decode("latin-1")
        parser = self.parser
        request = HttpRequest(
            parser.get_method().decode("latin-1"),
            raw_path,
            CIMultiDictProxy(CIMultiDict(self._headers)),
            self._body[0] if len(self._body) == 1 else b"".join(self._body),
            query=url.query.decode("latin-1") if url.query else "",
            version=parser.get_http_version(),
            keep_alive=parser.should_keep_alive(),
            peer=self.peer,
        )
        self.queue.append(request)
        if len(self.queue) >= MAX_QUEUED:
            self._pause_reading()
        self._wake()

    # ----------------------------------------------------------------- answering
    def _wake(self) -> None:
        waiter = self._wakeup
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _serve(self) -> None:
        """Answer queued requests in order, for as long as the connection lives."""
        queue = self.queue
        while True:
            while not queue:
                if self._closing:
                    return
                self._wakeup = self.loop.create_future()
                await self._wakeup
                self._wakeup = None
            item = queue.popleft()
            if self._idle is not None:
                self._idle.cancel()
                self._idle = None
            if isinstance(item, _Refused):
                await self._send_refusal(item)
                return
            self._busy = True
            try:
                keep = await self._answer(item)
            finally:
                self._busy = False
            if not keep or self._closing:
                self._close()
                return
            if len(queue) < MAX_QUEUED // 2:
                self._resume_reading()
            if not queue:
                self._arm_idle()

    async def _answer(self, request: HttpRequest) -> bool:
        """Run the handler and write its answer; whether the connection stays open."""
        started = time.perf_counter()
        try:
            response = await self.server.dispatch(request)
        except Exception:
            log.exception("unhandled error answering %s %s", request.method, request.path[:200])
            response = HttpResponse(b'{"error":"internal error","code":"internal"}', 500)
        keep = request.keep_alive and not self.server.stopping
        if not self._writable.is_set():
            await self._writable.wait()
        transport = self.transport
        if transport is None or transport.is_closing():
            return False
        body = response.body
        head = _head(response.status, response.content_type, len(body), response.headers,
                     not keep)  # fmt: skip
        if request.method == "HEAD" or not body:
            transport.write(head)
        elif len(body) < 16384:
            transport.write(head + body)
        else:
            transport.writelines((head, body))
        if self.server.access_log is not None:
            self.server.log_access(request, response, time.perf_counter() - started)
        return keep

    async def _send_refusal(self, e: _Refused) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        body = _error_body(e.status, str(e))
        transport.write(_head(e.status, "application/json", len(body), None, True) + body)
        if e.request is not None and self.server.access_log is not None:
            self.server.log_access(e.request, HttpResponse(body, e.status), 0.0)
        # A lingering close: a client still sending (a 413 mid-upload) would get a reset for
        # the unread bytes, and on a real network the reset can destroy the answer before
        # it is read. Stop writing, read and drop what still comes (at most LINGER_S).
        self._discarding = True
        if transport.can_write_eof():
            with contextlib.suppress(OSError, RuntimeError):
                transport.write_eof()
            self._resume_reading_now()
            self.loop.call_later(LINGER_S, self._close)
        else:
            self._close()

    def eof_received(self) -> bool | None:
        if self._discarding:
            self._close()
        return None

    def _resume_reading_now(self) -> None:
        transport = self.transport
        if not self._reading and transport is not None and not transport.is_closing():
            self._reading = True
            transport.resume_reading()

    def _refused_request(self) -> HttpRequest:
        """What is known of a request being refused (for the access log): the method and
        target once the parser has read them, the headers read so far."""
        parser = self.parser
        known = bool(self._url)
        return HttpRequest(
            parser.get_method().decode("latin-1") if known else "-",
            self._url[:2000].decode("latin-1") if known else "-",
            CIMultiDictProxy(CIMultiDict(self._headers)),
            version=parser.get_http_version() if self._headers or not self._in_head else "-",
            peer=self.peer,
        )

    def _close(self) -> None:
        self._closing = True
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def _pause_reading(self) -> None:
        if self._reading and self.transport is not None and not self.transport.is_closing():
            self._reading = False
            self.transport.pause_reading()

    def _resume_reading(self) -> None:
        transport = self.transport
        if (
            not self._reading
            and self._writable.is_set()
            and transport is not None
            and not transport.is_closing()
            and not any(isinstance(q, _Refused) for q in self.queue)
            and len(self.queue) < MAX_QUEUED // 2
        ):
            self._reading = True
            transport.resume_reading()

    def _arm_idle(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
        self._idle = self.loop.call_later(self.server.keepalive_s, self._idle_timeout)

    def _idle_timeout(self) -> None:
        self._idle = None
        if not self._busy and not self.queue:
            self._close()

    def close_if_idle(self) -> bool:
        """Close now when no request is in progress or queued; whether it did."""
        if self._busy or self.queue:
            return False
        self._close()
        return True


class _Deflate:
    """HTTP ``deflate``: zlib-wrapped as the RFC says, or raw as some clients send it."""

    def __init__(self) -> None:
        self._d: Any = None
        self._first = b""

    @property
    def eof(self) -> bool:
        return self._d is not None and bool(self._d.eof)

    def decompress(self, data: bytes, max_length: int) -> bytes:
        if self._d is None:
            self._first += data
            if len(self._first) < 2:
                return b""
            zlib_wrapped = (self._first[0] & 0x0F) == 8 and (
                (self._first[0] << 8) | self._first[1]
            ) % 31 == 0
            self._d = zlib.decompressobj(zlib.MAX_WBITS if zlib_wrapped else -zlib.MAX_WBITS)
            data, self._first = self._first, b""
        out: bytes = self._d.decompress(data, max_length)
        return out


class HttpServer:
    """Serves a :class:`Router` on one address (see the module docstring)."""

    def __init__(
        self,
        router: Router,
        fallback: NoRoute,
        *,
        max_body: int,
        access_log: logging.Logger | None = None,
        keepalive_s: float = KEEPALIVE_S,
    ) -> None:
        self.router = router
        self.fallback = fallback
        self.max_body = max_body
        self.access_log = access_log
        self.keepalive_s = keepalive_s
        self.connections: set[_Connection] = set()
        self.stopping = False
        self._servers: list[asyncio.AbstractServer] = []
        self.addresses: list[Any] = []

    async def dispatch(self, request: HttpRequest) -> HttpResponse:
        handler, info, allowed = self.router.resolve(request.method, request.path)
        if handler is None:
            return await self.fallback(request, allowed)
        request.match_info = info
        return await handler(request)

    async def start(self, host: str, port: int, *, reuse_port: bool = False) -> int:
        """Listen on ``host:port`` (0: any free port); the port bound. Raises OSError."""
        loop = asyncio.get_running_loop()
        server = await loop.create_server(
            lambda: _Connection(self), host, port, reuse_address=True,
            reuse_port=reuse_port or None, backlog=1024,
        )  # fmt: skip
        self._servers.append(server)
        self.addresses = [s.getsockname() for s in server.sockets]
        return int(self.addresses[0][1])

    async def stop(self, grace_s: float = 10.0) -> None:
        """Stop listening, finish the requests in progress (up to ``grace_s``), close all."""
        self.stopping = True
        for server in self._servers:
            server.close()
        for conn in list(self.connections):
            conn.close_if_idle()
        deadline = time.monotonic() + grace_s
        while self.connections and time.monotonic() < deadline:
            busy = [c for c in self.connections if not c.close_if_idle()]
            if not busy:
                break
            await asyncio.sleep(0.01)
        for conn in list(self.connections):
            conn._close()
        for server in self._servers:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 1.0)

    def log_access(self, request: HttpRequest, response: HttpResponse, elapsed_s: float) -> None:
        assert self.access_log is not None
        stamp = time.strftime("%d/%b/%Y:%H:%M:%S +0000", time.gmtime())
        target = request.path + (f"?{request.query}" if request.query else "")
        self.access_log.info(
            '%s [%s] "%s %s HTTP/%s" %d %d %.6f "%s" "%s"',
            request.peer, stamp, request.method, _quoted(target[:2000]), request.version,
            response.status, len(response.body), elapsed_s,
            _quoted(request.headers.get("Referer", "-")),
            _quoted(request.headers.get("User-Agent", "-")),
        )  # fmt: skip


def _quoted(text: str) -> str:
    """``text`` fit for a quoted access-log field: a quote or backslash in it is escaped, so a
    client cannot end the field early, and control bytes are written as ``\\xHH``."""
    if text.isprintable() and '"' not in text and "\\" not in text:
        return text
    return "".join(
        "\\" + c if c in '"\\' else c if c.isprintable() else f"\\x{ord(c):02x}" for c in text
    )


_CODES = {400: "bad_request", 413: "too_large", 415: "unsupported", 431: "too_large",
          500: "internal", 501: "not_implemented"}  # fmt: skip


def _error_body(status: int, message: str) -> bytes:
    """The API's error shape for a refusal the server makes itself."""
    import orjson

    return orjson.dumps({"error": message, "code": _CODES.get(status, "bad_request")})
