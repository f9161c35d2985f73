"""The agent's own HTTP/1.1 server (:mod:`mcp_edge.agent.serving.http_server`) over raw TCP.

Every limit and connection rule its module docstring promises, checked byte for byte on a real
loopback socket: the status line, the JSON error body and its code, and whether the server
closes the connection afterwards. The server is the real one with the real API and a real
onnxruntime digits model behind it; after every refusal a fresh connection must still get a
correct inference answer. A few tests build an :class:`HttpServer` on a router of their own,
where a request must be held in progress (pipelining order, graceful stop, flow control).

The client is a small asyncio protocol that keeps every byte it receives and notes when the
server ends the connection (EOF or reset), so an answer that arrives just before a reset is
still read.
"""

from __future__ import annotations

import asyncio
import logging
import re
import shutil
import socket
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import orjson
import psutil
import pytest

from mcp_edge.agent.runtime.batcher import BatchingConfig
from mcp_edge.agent.runtime.loader import load_runner
from mcp_edge.agent.runtime.manager import ModelManager, ModelSource
from mcp_edge.agent.runtime.runner import ModelRunner
from mcp_edge.agent.serving.http_api import DEFAULT_MAX_BODY, build_server
from mcp_edge.agent.serving.http_server import (
    MAX_HEADER_BYTES,
    MAX_HEADERS,
    MAX_URL,
    HttpRequest,
    HttpResponse,
    HttpServer,
    Router,
)
from mcp_edge.agent.serving.model_dir import ModelDirectory
from mcp_edge.shared.profiles import load_profiles
from mcp_edge.tooling.models import DigitsModels, onnx_predict

PROFILE = load_profiles()["generic-x86_64"]
IO_TIMEOUT_S = 10.0
INFER = "/v2/models/digits/infer"


# ---------------------------------------------------------------------------- the client
@dataclass
class Answer:
    status: int
    reason: str
    headers: dict[str, str]  # names in lower case
    body: bytes

    def json(self) -> Any:
        return orjson.loads(self.body)


class Wire(asyncio.Protocol):
    """One raw client connection: write exact bytes, parse answers from what came back."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.data = bytearray()
        self.ended = False  # the server closed (EOF) or reset the connection
        self._changed = asyncio.Event()
        self._writable = asyncio.Event()
        self._writable.set()

    @classmethod
    async def open(cls, port: int, *, buffers: int | None = None) -> Wire:
        """Connect; ``buffers``: the socket's kernel buffers, fixed (not grown by the kernel)."""
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if buffers is not None:  # before connecting, so the window offered is small
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffers)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffers)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, ("127.0.0.1", port))
        except OSError:
            sock.close()
            raise
        _, wire = await loop.create_connection(cls, sock=sock)
        return wire

    # --- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.data += data
        self._changed.set()

    def eof_received(self) -> bool:
        self._end()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._end()

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    def _end(self) -> None:
        self.ended = True
        self._changed.set()
        self._writable.set()

    # --- the test's side
    def send(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.write(data)

    async def drain(self) -> None:
        """Wait until the bytes written so far are handed to the kernel (or the end)."""
        await asyncio.wait_for(self._writable.wait(), IO_TIMEOUT_S)

    async def _until(self, ready: Callable[[], bool], what: str) -> None:
        async def wait() -> None:
            while not ready():
                if self.ended:
                    raise AssertionError(
                        f"the server closed the connection before {what}; "
                        f"received {bytes(self.data)[:300]!r}"
                    )
                self._changed.clear()
                await self._changed.wait()

        try:
            await asyncio.wait_for(wait(), IO_TIMEOUT_S)
        except TimeoutError:
            pytest.fail(f"no {what} within {IO_TIMEOUT_S} s; received {bytes(self.data)[:300]!r}")

    async def answer(self, *, head: bool = False) -> Answer:
        """The next answer (an interim 1xx one too); ``head``: an answer to HEAD (no body)."""
        await self._until(lambda: b"\r\n\r\n" in self.data, "answer")
        end = self.data.index(b"\r\n\r\n")
        lines = bytes(self.data[:end]).decode("latin-1").split("\r\n")
        del self.data[: end + 4]
        version, status, reason = lines[0].split(" ", 2)
        assert version == "HTTP/1.1", lines[0]
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        code = int(status)
        body = b""
        if not head and code >= 200 and code not in (204, 304):
            n = int(headers["content-length"])
            await self._until(lambda: len(self.data) >= n, f"{n}-byte body of a {code} answer")
            body = bytes(self.data[:n])
            del self.data[:n]
        return Answer(code, reason, headers, body)

    async def end(self) -> bytes:
        """Wait for the server to close the connection; the bytes not yet taken before that."""
        await self._until(lambda: self.ended, "close from the server")
        rest = bytes(self.data)
        self.data.clear()
        return rest

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


def request(
    method: str,
    target: str,
    *,
    headers: Sequence[tuple[str, str]] = (),
    body: bytes | None = None,
    version: str = "1.1",
) -> bytes:
    """The exact bytes of a request (``Host`` first; ``Content-Length`` for a body unless a
    length or ``Transfer-Encoding`` is among ``headers``)."""
    lines = [f"{method} {target} HTTP/{version}", "Host: agent"]
    lines += [f"{k}: {v}" for k, v in headers]
    framed = any(k.lower() in ("content-length", "transfer-encoding") for k, _ in headers)
    if body is not None and not framed:
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body or b"")


async def until(condition: Callable[[], bool], what: str, timeout_s: float = IO_TIMEOUT_S) -> None:
    """Wait (yielding to the event loop) for ``condition``; fail after ``timeout_s``."""

    async def wait() -> None:
        while not condition():
            await asyncio.sleep(0.005)

    try:
        await asyncio.wait_for(wait(), timeout_s)
    except TimeoutError:
        pytest.fail(f"{what}: not within {timeout_s} s")


async def assert_refused(wire: Wire, status: int, code: str, says: str = "") -> Answer:
    """The next answer is the server's own refusal, in the API's error shape, and the server
    closes the connection after it with nothing more."""
    answer = await wire.answer()
    assert answer.status == status, (answer, bytes(wire.data)[:200])
    assert answer.headers["content-type"] == "application/json"
    assert answer.headers.get("connection") == "close"
    body = answer.json()
    assert set(body) == {"error", "code"} and body["code"] == code, body
    assert says in body["error"], body
    assert await wire.end() == b""
    return answer


# ---------------------------------------------------------------------------- the server
def real_factory(source: ModelSource) -> Sequence[ModelRunner]:
    return [load_runner(source.model_path, PROFILE, threads=1)]


@dataclass
class Api:
    """The real API on a real port, serving the digits model through onnxruntime."""

    server: HttpServer
    port: int
    rows: np.ndarray  # a few digits
    classes: list[int]  # onnxruntime's own answer for them


def infer_body(rows: np.ndarray, request_id: str) -> bytes:
    return orjson.dumps(
        {
            "id": request_id,
            "inputs": [
                {
                    "name": "input",
                    "shape": list(rows.shape),
                    "datatype": "FP32",
                    "data": rows.ravel().tolist(),
                }
            ],
        }
    )


def classes_of(answer: Answer) -> list[int]:
    out = answer.json()["outputs"][0]
    return [int(c) for c in np.asarray(out["data"]).reshape(out["shape"]).argmax(1)]


def assert_inference(answer: Answer, api: Api, request_id: str, rows: slice = slice(None)) -> None:
    assert answer.status == 200, answer
    doc = answer.json()
    assert doc["id"] == request_id and doc["model_name"] == "digits"
    assert classes_of(answer) == api.classes[rows]


async def assert_serves(api: Api) -> None:
    """A fresh connection gets a correct inference answer (the server survived)."""
    wire = await Wire.open(api.port)
    try:
        wire.send(request("POST", INFER, body=infer_body(api.rows, "after")))
        assert_inference(await wire.answer(), api, "after")
    finally:
        wire.close()


@pytest.fixture
async def start_api(
    digits: DigitsModels, tmp_path: Path
) -> AsyncIterator[Callable[..., Awaitable[Api]]]:
    started: list[tuple[HttpServer, ModelManager]] = []
    models = tmp_path / "models"
    models.mkdir()
    shutil.copy(digits.onnx_path, models / "digits.onnx")
    rows = digits.X_test[:4].astype(np.float32)
    classes = onnx_predict(digits.onnx_path, rows).argmax(1).tolist()

    async def start(**kwargs: Any) -> Api:
        manager = ModelManager(real_factory, batching=BatchingConfig())
        model_dir = ModelDirectory(models, state_dir=tmp_path / "state", profile=PROFILE)
        await model_dir.load_all(manager)
        server = build_server(manager, **kwargs)
        started.append((server, manager))
        port = await server.start("127.0.0.1", 0)
        return Api(server, port, rows, classes)

    yield start
    for server, manager in started:
        await server.stop(grace_s=1.0)
        await manager.close()


@pytest.fixture
async def api(start_api: Callable[..., Awaitable[Api]]) -> Api:
    return await start_api()


async def _fallback(request: HttpRequest, allowed: set[str]) -> HttpResponse:
    return HttpResponse(b'{"error":"no such route","code":"not_found"}', 404)


@pytest.fixture
async def own_server() -> AsyncIterator[Callable[..., Awaitable[tuple[HttpServer, int]]]]:
    """An :class:`HttpServer` on a router of the test's own; stopped afterwards."""
    servers: list[HttpServer] = []

    async def start(router: Router, **kwargs: Any) -> tuple[HttpServer, int]:
        server = HttpServer(router, _fallback, max_body=kwargs.pop("max_body", 1 << 20), **kwargs)
        servers.append(server)
        return server, await server.start("127.0.0.1", 0)

    yield start
    for server in servers:
        await server.stop(grace_s=1.0)


def _json(doc: Any, **kwargs: Any) -> HttpResponse:
    return HttpResponse(orjson.dumps(doc), **kwargs)


# ---------------------------------------------------------------------------- malformed
@pytest.mark.parametrize(
    "raw",
    [
        pytest.param(b"HELLO\r\n\r\n", id="not-a-method"),
        pytest.param(b"GET\r\n\r\n", id="no-target"),
        pytest.param(b"GET /v2/health/live HTTP/7.7\r\nHost: a\r\n\r\n", id="bad-version"),
        pytest.param(b"GET /v2/health live HTTP/1.1\r\nHost: a\r\n\r\n", id="space-in-target"),
        pytest.param(b"GET /v2/health/live HTTP/1.1\nHost: a\n\n", id="bare-newlines"),
        pytest.param(b"GET /v2/health/live HTTP/1.1\r\nHost a\r\n\r\n", id="header-no-colon"),
        pytest.param(
            b"POST /v2/models/digits/infer HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
            id="length-and-chunked",
        ),
    ],
)
async def test_a_malformed_request_is_400_and_the_connection_closed(api: Api, raw: bytes) -> None:
    wire = await Wire.open(api.port)
    wire.send(raw)
    await assert_refused(wire, 400, "bad_request", "malformed HTTP request")
    await assert_serves(api)


async def test_a_request_line_over_8_kib_is_400(api: Api) -> None:
    # Just under the limit the request is routed (an unknown model: the API's 404, kept open).
    near = "/v2/models/" + "m" * (MAX_URL - 40) + "/ready"
    wire = await Wire.open(api.port)
    wire.send(request("GET", near))
    answer = await wire.answer()
    assert answer.status == 404 and answer.json()["code"] == "not_found"
    # Over it: refused as the bytes arrive (sent in two writes), then closed.
    over = ("GET /v2/models/" + "m" * MAX_URL).encode()
    wire.send(over[:5000])
    await wire.drain()
    wire.send(over[5000:] + b"/ready HTTP/1.1\r\nHost: agent\r\n\r\n")
    await assert_refused(wire, 400, "bad_request", f"request line over {MAX_URL} bytes")
    await assert_serves(api)


async def test_100_header_fields_pass_and_101_are_431(api: Api) -> None:
    wire = await Wire.open(api.port)
    fields = [(f"X-Field-{i}", "v") for i in range(MAX_HEADERS - 1)]  # + Host: 100
    wire.send(request("POST", INFER, headers=fields[:-1], body=infer_body(api.rows, "100")))
    assert_inference(await wire.answer(), api, "100")  # Content-Length is the 100th
    wire.send(request("GET", "/v2/health/live", headers=[*fields, ("X-One-Too-Many", "v")]))
    await assert_refused(wire, 431, "too_large", f"{MAX_HEADERS} fields")
    await assert_serves(api)


async def test_headers_over_64_kib_are_431(api: Api) -> None:
    fields = [(f"X-Field-{i}", "v" * 1000) for i in range(MAX_HEADER_BYTES // 1000 + 2)]
    assert len(fields) < MAX_HEADERS
    wire = await Wire.open(api.port)
    wire.send(request("GET", "/v2/health/live", headers=fields))
    await assert_refused(wire, 431, "too_large", f"over {MAX_HEADER_BYTES} bytes")
    await assert_serves(api)


async def stream_until_answer(wire: Wire, pieces: Iterable[bytes]) -> tuple[Answer, bool]:
    """Write ``pieces`` one after the other (waiting for each to reach the kernel) until the
    server answers or ends the connection; (the answer, whether every piece was written)."""
    answer = asyncio.ensure_future(wire.answer())
    finished = True
    try:
        for piece in pieces:
            if answer.done() or wire.ended:
                finished = False
                break
            wire.send(piece)
            await wire.drain()
        return await answer, finished
    finally:
        answer.cancel()


async def test_one_endless_header_is_refused_before_it_is_buffered(api: Api) -> None:
    # A header value that never ends: refused once the head passes its limit, not held
    # (byte after byte) for as long as the client sends.
    wire = await Wire.open(api.port)
    pieces = [b"GET /v2/health/live HTTP/1.1\r\nHost: agent\r\nX-Endless: "]
    pieces += [b"v" * 65536] * 512  # 32 MiB
    answer, finished = await stream_until_answer(wire, pieces)
    assert not finished, "the server read a 32 MiB header without answering"
    assert answer.status == 431 and answer.json()["code"] == "too_large"
    assert answer.headers.get("connection") == "close"
    assert await wire.end() == b""
    await assert_serves(api)


# ---------------------------------------------------------------------------- bodies
async def test_a_content_length_over_the_cap_is_413_before_the_body_is_sent(api: Api) -> None:
    wire = await Wire.open(api.port)
    length = DEFAULT_MAX_BODY + 1
    wire.send(
        request("POST", INFER, headers=[("Content-Length", str(length))])  # and no body
    )
    await assert_refused(wire, 413, "too_large", f"{length} bytes, limit {DEFAULT_MAX_BODY}")
    await assert_serves(api)


async def test_a_chunked_body_over_the_cap_is_413_as_the_chunks_arrive(
    start_api: Callable[..., Awaitable[Api]],
) -> None:
    cap = 256 * 1024
    api = await start_api(max_body=cap)
    wire = await Wire.open(api.port)
    chunk = b" " * 32768
    pieces = [request("POST", INFER, headers=[("Transfer-Encoding", "chunked")])]
    pieces += [b"8000\r\n" + chunk + b"\r\n"] * 1024  # 32 MiB, never the last chunk
    answer, finished = await stream_until_answer(wire, pieces)
    assert not finished, "the server read 32 MiB of chunks past a 256 KiB cap"
    assert answer.status == 413
    assert answer.json() == {
        "error": f"request body too large: over {cap} bytes",
        "code": "too_large",
    }
    assert await wire.end() == b""
    await assert_serves(api)


def _deflate(data: bytes, wbits: int) -> bytes:
    squeeze = zlib.compressobj(6, zlib.DEFLATED, wbits)
    return squeeze.compress(data) + squeeze.flush()


@pytest.mark.parametrize(
    ("coding", "wbits"),
    [("gzip", 16 + zlib.MAX_WBITS), ("deflate", zlib.MAX_WBITS), ("deflate", -zlib.MAX_WBITS)],
    ids=["gzip", "deflate-zlib", "deflate-raw"],
)
async def test_compressed_bodies_are_inflated(api: Api, coding: str, wbits: int) -> None:
    wire = await Wire.open(api.port)
    body = _deflate(infer_body(api.rows, coding), wbits)
    wire.send(request("POST", INFER, headers=[("Content-Encoding", coding)], body=body))
    assert_inference(await wire.answer(), api, coding)
    # Chunked and compressed, the first chunks a byte each (a raw stream's first byte alone).
    pieces = [body[:1], body[1:2], body[2:3], body[3:]]
    framed = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"
    chunked = [("Content-Encoding", coding), ("Transfer-Encoding", "chunked")]
    wire.send(request("POST", INFER, headers=chunked) + framed)
    assert_inference(await wire.answer(), api, coding)


def _peak_rss() -> int | None:
    """This process's peak resident size since :func:`_reset_peak` (Linux), in bytes."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


@pytest.mark.parametrize("wbits", [16 + zlib.MAX_WBITS, zlib.MAX_WBITS], ids=["gzip", "deflate"])
async def test_a_compression_bomb_is_413_without_inflating_it(api: Api, wbits: int) -> None:
    # 100 MB of zeros in about 100 KB, against the default 8 MiB cap.
    squeeze = zlib.compressobj(9, zlib.DEFLATED, wbits)
    zeros = bytes(1 << 20)
    bomb = b"".join(squeeze.compress(zeros) for _ in range(100)) + squeeze.flush()
    assert len(bomb) < 500_000
    del zeros
    coding = "gzip" if wbits > zlib.MAX_WBITS else "deflate"
    process = psutil.Process()
    wire = await Wire.open(api.port)
    rss_before = process.memory_info().rss
    peak_known = _reset_peak()
    wire.send(request("POST", INFER, headers=[("Content-Encoding", coding)], body=bomb))
    await assert_refused(wire, 413, "too_large", f"over {DEFAULT_MAX_BODY} bytes")
    grown = process.memory_info().rss - rss_before
    assert grown < 40 * 1024 * 1024, f"the server grew by {grown >> 20} MiB"
    peak = _peak_rss() if peak_known else None
    if peak is not None:  # what was inflated and freed again shows in the peak
        assert peak - rss_before < 40 * 1024 * 1024, f"peak {(peak - rss_before) >> 20} MiB up"
    await assert_serves(api)


@pytest.mark.parametrize(
    ("body", "says"),
    [
        pytest.param(
            _deflate(b'{"inputs": []}' * 100, 16 + zlib.MAX_WBITS)[:-20],
            "ends early",
            id="truncated",
        ),
        pytest.param(b"\x1f\x8b\x08\x00 this is not gzip at all", "cannot read", id="corrupt"),
    ],
)
async def test_a_broken_gzip_body_is_400(api: Api, body: bytes, says: str) -> None:
    wire = await Wire.open(api.port)
    wire.send(request("POST", INFER, headers=[("Content-Encoding", "gzip")], body=body))
    await assert_refused(wire, 400, "bad_request", says)
    await assert_serves(api)


async def test_an_unknown_content_encoding_is_415(api: Api) -> None:
    wire = await Wire.open(api.port)
    wire.send(request("POST", INFER, headers=[("Content-Encoding", "br")], body=b"\x0b\x00\x80"))
    await assert_refused(wire, 415, "unsupported", "'br' is not supported")
    await assert_serves(api)


async def test_expect_100_continue_then_the_answer(api: Api) -> None:
    wire = await Wire.open(api.port)
    body = infer_body(api.rows, "expect")
    wire.send(
        request(
            "POST", INFER, headers=[("Content-Length", str(len(body))), ("Expect", "100-continue")]
        )
    )
    interim = await wire.answer()
    assert (interim.status, interim.reason, interim.headers) == (100, "Continue", {})
    wire.send(body)
    assert_inference(await wire.answer(), api, "expect")
    # Too large: the 413 comes instead of the 100, and the body is never asked for.
    wire.send(
        request(
            "POST",
            INFER,
            headers=[("Content-Length", str(DEFAULT_MAX_BODY + 1)), ("Expect", "100-continue")],
        )
    )
    await assert_refused(wire, 413, "too_large")
    await assert_serves(api)


# ---------------------------------------------------------------------------- connections
async def test_pipelined_requests_are_answered_in_order(api: Api) -> None:
    wire = await Wire.open(api.port)
    ids = ["first", "second", "third"]
    wire.send(
        b"".join(
            request("POST", INFER, body=infer_body(api.rows[i : i + 1], ids[i])) for i in range(3)
        )
    )
    for i, request_id in enumerate(ids):
        assert_inference(await wire.answer(), api, request_id, slice(i, i + 1))
    # A malformed request behind two good ones: both answered first, then the 400 and close.
    wire.send(
        request("GET", "/v2/health/live")
        + request("GET", "/v2/models/digits/ready")
        + b"NONSENSE\r\n\r\n"
    )
    assert (await wire.answer()).json() == {"live": True}
    assert (await wire.answer()).json()["name"] == "digits"
    await assert_refused(wire, 400, "bad_request")
    await assert_serves(api)


async def test_a_slow_answer_is_not_overtaken_by_a_later_one(own_server: Any) -> None:
    release = asyncio.Event()
    started = asyncio.Event()

    async def slow(request: HttpRequest) -> HttpResponse:
        started.set()
        await release.wait()
        return _json({"path": "slow"})

    async def fast(request: HttpRequest) -> HttpResponse:
        return _json({"path": "fast"})

    router = Router()
    router.add("GET", "/slow", slow)
    router.add("GET", "/fast", fast)
    _, port = await own_server(router)
    wire = await Wire.open(port)
    wire.send(request("GET", "/slow") + request("GET", "/fast"))
    await asyncio.wait_for(started.wait(), IO_TIMEOUT_S)
    release.set()
    assert (await wire.answer()).json() == {"path": "slow"}
    assert (await wire.answer()).json() == {"path": "fast"}
    wire.close()


async def test_http_1_0_is_answered_then_closed(api: Api) -> None:
    wire = await Wire.open(api.port)
    wire.send(request("POST", INFER, body=infer_body(api.rows, "old"), version="1.0"))
    answer = await wire.answer()
    assert_inference(answer, api, "old")
    assert answer.headers.get("connection") == "close"
    assert await wire.end() == b""


async def test_connection_close_closes_after_the_answer(api: Api) -> None:
    wire = await Wire.open(api.port)
    wire.send(
        request("POST", INFER, headers=[("Connection", "close")], body=infer_body(api.rows, "bye"))
    )
    answer = await wire.answer()
    assert_inference(answer, api, "bye")
    assert answer.headers.get("connection") == "close"
    assert await wire.end() == b""


async def test_a_keep_alive_connection_serves_many_requests(api: Api) -> None:
    wire = await Wire.open(api.port)
    for i in range(5):
        wire.send(request("POST", INFER, body=infer_body(api.rows, f"r{i}")))
        answer = await wire.answer()
        assert_inference(answer, api, f"r{i}")
        assert "connection" not in answer.headers
    assert not wire.ended
    wire.close()


async def test_head_has_the_get_headers_and_no_body(api: Api) -> None:
    wire = await Wire.open(api.port)
    wire.send(request("GET", "/v2/models/digits"))
    got = await wire.answer()
    assert got.status == 200 and got.json()["name"] == "digits"
    wire.send(request("HEAD", "/v2/models/digits"))
    head = await wire.answer(head=True)
    assert head.status == 200
    assert head.headers["content-length"] == str(len(got.body))
    assert head.headers["content-type"] == "application/json"
    # No body bytes follow: the next answer on the connection starts right there.
    wire.send(request("GET", "/v2/health/live"))
    assert (await wire.answer()).json() == {"live": True}
    assert wire.data == b""
    wire.close()


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param(
            request(
                "GET",
                "/v2/health/live",
                headers=[
                    ("Connection", "Upgrade"),
                    ("Upgrade", "websocket"),
                    ("Sec-WebSocket-Version", "13"),
                    ("Sec-WebSocket-Key", "dGhlIHNhbXBsZSBub25jZQ=="),
                ],
            ),
            id="websocket",
        ),
        pytest.param(
            b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com\r\n\r\n", id="connect"
        ),
    ],
)
async def test_an_upgrade_request_is_501_and_not_served(api: Api, raw: bytes) -> None:
    wire = await Wire.open(api.port)
    wire.send(raw)
    # The first and only answer is the 501: the route behind it does not answer as well.
    await assert_refused(wire, 501, "not_implemented", "upgrades are not supported")
    await assert_serves(api)


async def test_an_idle_keep_alive_connection_is_closed(
    start_api: Callable[..., Awaitable[Api]],
) -> None:
    api = await start_api()
    api.server.keepalive_s = 0.2
    used = await Wire.open(api.port)
    used.send(request("POST", INFER, body=infer_body(api.rows, "then-idle")))
    assert_inference(await used.answer(), api, "then-idle")
    silent = await Wire.open(api.port)  # never sends a byte
    assert await used.end() == b""
    assert await silent.end() == b""
    await assert_serves(api)


async def test_stop_finishes_the_request_in_progress_and_refuses_new_connections(
    own_server: Any,
) -> None:
    started = asyncio.Event()
    release = asyncio.Event()

    async def slow(request: HttpRequest) -> HttpResponse:
        started.set()
        await release.wait()
        return _json({"done": True})

    async def fast(request: HttpRequest) -> HttpResponse:
        return _json({"fast": True})

    router = Router()
    router.add("GET", "/slow", slow)
    router.add("GET", "/fast", fast)
    server, port = await own_server(router)
    idle = await Wire.open(port)
    idle.send(request("GET", "/fast"))
    assert (await idle.answer()).json() == {"fast": True}
    busy = await Wire.open(port)
    busy.send(request("GET", "/slow"))
    await asyncio.wait_for(started.wait(), IO_TIMEOUT_S)

    stopping = asyncio.ensure_future(server.stop(grace_s=60.0))
    assert await idle.end() == b""  # an idle keep-alive connection is closed at once
    with pytest.raises(ConnectionRefusedError):
        await Wire.open(port)
    assert not stopping.done() and not busy.ended
    release.set()
    answer = await busy.answer()
    assert answer.status == 200 and answer.json() == {"done": True}
    assert answer.headers.get("connection") == "close"
    assert await busy.end() == b""
    await asyncio.wait_for(stopping, IO_TIMEOUT_S)


async def test_stop_closes_a_request_that_outlives_the_grace_period(own_server: Any) -> None:
    started = asyncio.Event()
    release = asyncio.Event()

    async def stuck(request: HttpRequest) -> HttpResponse:
        started.set()
        await release.wait()
        return _json({"late": True})

    router = Router()
    router.add("GET", "/stuck", stuck)
    server, port = await own_server(router)
    wire = await Wire.open(port)
    wire.send(request("GET", "/stuck"))
    await asyncio.wait_for(started.wait(), IO_TIMEOUT_S)
    await asyncio.wait_for(server.stop(grace_s=0.2), IO_TIMEOUT_S)
    assert await wire.end() == b""  # closed with no answer
    release.set()  # the handler may finish; nothing is written to the closed connection


@pytest.mark.parametrize(
    ("n", "body_size"),
    [
        # Small requests: a single read brings them all in, so only the wait to write (not a
        # pause in reading) keeps the server from answering every one into its own memory.
        pytest.param(1000, 0, id="small-requests"),
        # 10 MB of requests: more than the kernel holds, so the client sees them wait.
        pytest.param(600, 16384, id="large-requests"),
    ],
)
async def test_a_client_that_never_reads_stops_the_server(
    own_server: Any, n: int, body_size: int
) -> None:
    answer_size = 32768
    calls = 0

    async def big(request: HttpRequest) -> HttpResponse:
        nonlocal calls
        calls += 1
        return HttpResponse(
            b"x" * answer_size,
            content_type="application/octet-stream",
            headers={"X-Seq": request.query},
        )

    async def probe(request: HttpRequest) -> HttpResponse:
        return _json({"probe": True})

    router = Router()
    router.add("POST", "/big", big)
    router.add("GET", "/probe", probe)
    server, port = await own_server(router)
    wire = await Wire.open(port, buffers=32768)
    assert wire.transport is not None
    wire.transport.pause_reading()  # the client never reads its answers
    body = b"." * body_size
    wire.send(b"".join(request("POST", f"/big?{i}", body=body) for i in range(n)))

    # The server goes on until it cannot write: its own buffer over the high-water mark.
    await until(lambda: len(server.connections) == 1, "the connection accepted")
    out = next(iter(server.connections)).transport
    assert out is not None
    high = out.get_write_buffer_limits()[1]
    await until(lambda: out.get_write_buffer_size() > high, "the server's writing paused")
    # And it stops reading requests from that client (its transport paused).
    await until(lambda: not out.is_reading(), "the server's reading paused")
    handled = calls
    # Other clients are served meanwhile, and the stalled connection takes no more work.
    for _ in range(3):
        other = await Wire.open(port)
        other.send(request("GET", "/probe", headers=[("Connection", "close")]))
        assert (await other.answer()).json() == {"probe": True}
        assert await other.end() == b""
    assert calls == handled
    # What it handled is what fits in the buffers between it and the client (the kernel's
    # on both sides, its own up to the high-water mark), not all of them.
    sndbuf = out.get_extra_info("socket").getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    rcvbuf = wire.transport.get_extra_info("socket").getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
    bound = (sndbuf + rcvbuf + high) // answer_size + 4
    assert handled <= bound < n, (handled, bound, sndbuf, rcvbuf)
    assert not out.is_reading()
    if body_size:  # which the client sees: its requests wait on its side
        waiting = wire.transport.get_write_buffer_size()
        assert waiting > 0, "the server read every request although it could answer none"

    # Once the client reads, every answer comes, in order.
    wire.transport.resume_reading()
    for i in range(n):
        answer = await wire.answer()
        assert answer.status == 200 and answer.headers["x-seq"] == str(i)
        assert len(answer.body) == answer_size
    assert calls == n
    wire.close()


# ---------------------------------------------------------------------------- routes, log
async def test_405_with_allow_and_404_in_the_api_shape(api: Api) -> None:
    wire = await Wire.open(api.port)
    wire.send(request("GET", INFER))
    answer = await wire.answer()
    assert answer.status == 405 and answer.reason == "Method Not Allowed"
    assert answer.headers["allow"] == "POST"
    assert answer.json()["code"] == "bad_request" and "use POST" in answer.json()["error"]
    wire.send(request("DELETE", "/v2/health/live"))
    answer = await wire.answer()
    assert answer.status == 405 and answer.headers["allow"] == "GET,HEAD"
    wire.send(request("GET", "/v2/nothing/here"))
    answer = await wire.answer()
    assert answer.status == 404
    assert answer.json() == {"error": "no such route: /v2/nothing/here", "code": "not_found"}
    # Not refusals: the connection stays open and serves.
    wire.send(request("POST", INFER, body=infer_body(api.rows, "still")))
    assert_inference(await wire.answer(), api, "still")
    wire.close()


async def test_percent_encoded_path_parameters_reach_the_handler_decoded(
    api: Api, own_server: Any
) -> None:
    async def ready(request: HttpRequest) -> HttpResponse:
        return _json({"model": request.match_info["model"], "path": request.path})

    router = Router()
    router.add("GET", "/v2/models/{model}/ready", ready)
    _, port = await own_server(router)
    wire = await Wire.open(port)
    wire.send(request("GET", "/v2/models/my%20model/ready"))
    assert (await wire.answer()).json() == {
        "model": "my model",
        "path": "/v2/models/my%20model/ready",
    }
    wire.close()
    # The real API too: "dig%69ts" is the digits model.
    wire = await Wire.open(api.port)
    wire.send(request("GET", "/v2/models/dig%69ts/ready"))
    assert (await wire.answer()).json() == {"name": "digits", "version": "1", "ready": True}
    wire.close()


ACCESS_LINE = re.compile(
    r"^127\.0\.0\.1 \[\d\d/[A-Z][a-z]{2}/\d{4}:\d\d:\d\d:\d\d \+0000\] "
    r'"(?P<method>[A-Z]+) (?P<target>\S+) HTTP/(?P<version>[\d.]+)" (?P<status>\d{3}) '
    r'(?P<size>\d+) (?P<elapsed>\d+\.\d{6}) "(?P<referer>(?:[^"\\]|\\.)*)" '
    r'"(?P<agent>(?:[^"\\]|\\.)*)"$'
)


async def test_the_access_log_writes_one_combined_line_per_answer(
    start_api: Callable[..., Awaitable[Api]], caplog: pytest.LogCaptureFixture
) -> None:
    access = logging.getLogger("test.http_server.access")
    caplog.set_level(logging.INFO, logger=access.name)
    api = await start_api(access_log=access)
    wire = await Wire.open(api.port)
    wire.send(
        request(
            "GET",
            "/v2/health/live?probe=1",
            headers=[("User-Agent", "edge-probe/1.0 (linux)"), ("Referer", "http://console/fleet")],
        )
    )
    live = await wire.answer()
    wire.send(
        request(
            "POST",
            INFER,
            body=infer_body(api.rows, "logged"),
            headers=[("User-Agent", 'odd "quoted" agent')],
            version="1.0",
        )
    )
    inferred = await wire.answer()
    await wire.end()
    # A refusal is an answer too.
    wire = await Wire.open(api.port)
    wire.send(
        request(
            "POST",
            INFER,
            headers=[("Content-Length", str(DEFAULT_MAX_BODY + 1)), ("User-Agent", "too-big/2")],
        )
    )
    refused = await assert_refused(wire, 413, "too_large")
    lines = [r.getMessage() for r in caplog.records if r.name == access.name]
    assert len(lines) == 3, lines
    first, second, third = (ACCESS_LINE.match(line) for line in lines)
    assert first is not None and second is not None and third is not None, lines
    assert first.group("method", "target", "version", "status", "size") == (
        "GET",
        "/v2/health/live?probe=1",
        "1.1",
        "200",
        str(len(live.body)),
    )
    assert first.group("referer", "agent") == ("http://console/fleet", "edge-probe/1.0 (linux)")
    assert lines[0].endswith('"edge-probe/1.0 (linux)"')
    assert second.group("method", "target", "version", "status", "size") == (
        "POST",
        INFER,
        "1.0",
        "200",
        str(len(inferred.body)),
    )
    assert second.group("referer") == "-"
    # A quote in the agent cannot end the field early: it is escaped.
    assert second.group("agent") == r"odd \"quoted\" agent"
    assert third.group("method", "target", "version", "status", "size", "agent") == (
        "POST",
        INFER,
        "1.1",
        "413",
        str(len(refused.body)),
        "too-big/2",
    )
