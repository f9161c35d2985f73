"""Load generation for the benches: a cheap HTTP/1.1 client, a null-handler server, helpers.

Run as a script it is one of two processes::

    python bench/_load.py client --port P --path /v2/models/m/infer --body-file F \
        --concurrency 64 --warmup-s 1 --duration-s 5 [--max-requests N] [--server-pid PID ...] \
        [--header 'Name: value' ...]
    python bench/_load.py null-server --port P [--reuse-port]

The client is a raw asyncio protocol on uvloop: one keep-alive TCP connection (TCP_NODELAY)
per unit of concurrency, each sending the same pre-encoded request bytes again as soon as its
previous answer is complete (closed loop). It parses only the status line and Content-Length,
so it costs a few microseconds of CPU per request; on a 2-core box the client competes with
the server for CPU, and the cheaper it is, the closer the numbers are to the server's own.
It prints one JSON object: latency percentiles (µs), requests/s, status counts, and the CPU
seconds the client, the server (``--server-pid``) and everything else used in the window.

The null server is the floor for the stack: aiohttp on uvloop (as the agent), the same route,
body read and orjson parse, and a fixed Open-Inference-Protocol-shaped answer, no model. A
request of the binary tensor extension (header ``Inference-Header-Content-Length``) has its
body read and only its JSON header parsed, and gets a fixed binary-shaped answer (JSON header
and 40 raw bytes). It prints ``READY`` once it listens; with ``--reuse-port`` several copies
share one port (SO_REUSEPORT), as ``mcp-agent serve --processes N`` does.

Every loop is bounded by a request count and a deadline; all traffic stays on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

HOST = "127.0.0.1"
_CONNECT_TIMEOUT_S = 5.0
_DRAIN_TIMEOUT_S = 5.0


# ---------------------------------------------------------------------------- helpers (parent)
def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago, below the ephemeral range (a client
    polling a server that is not up yet cannot connect to itself there)."""
    # Imported here: the load client and null server run this file in environments without the
    # repository on sys.path.
    from mcp_edge.shared.netutil import free_port_below_ephemeral

    return free_port_below_ephemeral(HOST)


def http_request(
    port: int,
    path: str,
    body: bytes | None = None,
    timeout_s: float = 5.0,
    headers: dict[str, str] | None = None,
) -> tuple[int, bytes]:
    """One request with urllib (setup and checks only, never timed)."""
    status, _, raw = http_request_headers(port, path, body, timeout_s, headers)
    return status, raw


def http_request_headers(
    port: int,
    path: str,
    body: bytes | None = None,
    timeout_s: float = 5.0,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, str], bytes]:
    """:func:`http_request`, with the answer's headers."""
    sent = {"Content-Type": "application/json"} if body is not None else {}
    sent.update(headers or {})
    req = urllib.request.Request(
        f"http://{HOST}:{port}{path}",
        data=body,
        method="POST" if body is not None else "GET",
        headers=sent,
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return int(resp.status), dict(resp.headers.items()), resp.read()
    except urllib.error.HTTPError as e:
        return int(e.code), dict(e.headers.items()), e.read()


def wait_ready(proc: subprocess.Popen[bytes], port: int, path: str, timeout_s: float) -> float:
    """Poll ``GET path`` until it answers 200; return seconds waited.

    Raises RuntimeError if the process exits or ``timeout_s`` passes first.
    """
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
        with contextlib.suppress(OSError):
            status, _ = http_request(port, path, timeout_s=1.0)
            if status == 200:
                return time.monotonic() - t0
        time.sleep(0.05)
    raise RuntimeError(f"server not ready after {timeout_s:.0f} s")


def stop_process(proc: subprocess.Popen[bytes] | None, timeout_s: float = 10.0) -> None:
    """SIGTERM, wait, then SIGKILL: the process is gone when this returns."""
    if proc is None or proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait(timeout=timeout_s)


def run_client(
    *,
    port: int,
    path: str,
    body_file: Path,
    concurrency: int,
    warmup_s: float,
    duration_s: float,
    max_requests: int,
    server_pid: int | list[int] | None,
    headers: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Run the client in its own process and return its JSON report.

    ``server_pid``: the server's process (or processes; their children are counted too);
    ``headers``: sent with every request (``Content-Type`` replaces application/json).
    """
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "client",
        "--port",
        str(port),
        "--path",
        path,
        "--body-file",
        str(body_file),
        "--concurrency",
        str(concurrency),
        "--warmup-s",
        str(warmup_s),
        "--duration-s",
        str(duration_s),
        "--max-requests",
        str(max_requests),
    ]
    pids = [server_pid] if isinstance(server_pid, int) else list(server_pid or [])
    for pid in pids:
        cmd += ["--server-pid", str(pid)]
    for k, v in (headers or {}).items():
        cmd += ["--header", f"{k}: {v}"]
    limit = warmup_s + duration_s + _CONNECT_TIMEOUT_S + _DRAIN_TIMEOUT_S + 30
    done = subprocess.run(cmd, capture_output=True, timeout=limit, check=False)
    if done.returncode != 0:
        raise RuntimeError(
            f"load client failed ({done.returncode}): {done.stderr.decode()[-2000:]}"
        )
    return dict(json.loads(done.stdout))


# ---------------------------------------------------------------------------- client
def _percentile(sorted_ns: list[int], q: float) -> float:
    if not sorted_ns:
        return float("nan")
    i = min(len(sorted_ns) - 1, max(0, round(q / 100.0 * (len(sorted_ns) - 1))))
    return sorted_ns[i] / 1000.0


class _Run:
    """Shared state of one client run; connections report completions here."""

    def __init__(self, request: bytes, max_requests: int, server_pids: list[int]) -> None:
        self.request = request
        self.max_requests = max_requests
        self.measuring = False
        self.stopped = False
        self.latencies: list[int] = []
        self.statuses: dict[int, int] = {}
        self.bytes_in = 0
        self.warmup_requests = 0
        self.lost = 0
        self.conns: list[_Conn] = []
        self.finished: asyncio.Future[None] | None = None
        self.t_start = self.t_end = 0
        self._server = None
        self._servers: list[Any] = []
        if server_pids:
            import psutil

            self._server = psutil.Process(server_pids[0])
            # Every serving process: the ones named and their children (worker processes).
            found: dict[int, Any] = {}
            for pid in server_pids:
                p = psutil.Process(pid)
                found[p.pid] = p
                for c in p.children(recursive=True):
                    found[c.pid] = c
            self._servers = list(found.values())
        self.cpu_start: dict[str, float] = {}
        self.cpu: dict[str, float] = {}

    def _cpu_sample(self) -> dict[str, float]:
        import psutil

        total = psutil.cpu_times()
        # guest time is already inside user; steal is time the hypervisor gave to others.
        busy = sum(getattr(total, f, 0.0) for f in ("user", "nice", "system", "irq", "softirq"))
        sample = {
            "machine_busy_s": busy,
            "client_s": time.process_time(),
            "steal_s": getattr(total, "steal", 0.0),
        }
        if self._server is not None:
            import psutil

            sample["server_s"] = 0.0
            for p in self._servers:
                with contextlib.suppress(psutil.Error):
                    t = p.cpu_times()
                    sample["server_s"] += t.user + t.system
            # The event loop runs on the main thread (thread id == pid); the rest is worker
            # and backend threads (executor, onnxruntime's intra-op pool).
            main = [x for x in self._server.threads() if x.id == self._server.pid]
            if main:
                sample["server_main_thread_s"] = main[0].user_time + main[0].system_time
        return sample

    def begin_measuring(self) -> None:
        self.cpu_start = self._cpu_sample()
        self.t_start = time.perf_counter_ns()
        self.measuring = True

    def stop(self) -> None:
        if self.stopped:
            return
        self.t_end = time.perf_counter_ns()
        self.stopped = True
        if self.measuring:
            end = self._cpu_sample()
            self.cpu = {k: end[k] - self.cpu_start[k] for k in end}
        if self.finished is not None and not self.finished.done():
            self.finished.set_result(None)

    def completed(self, conn: _Conn, status: int, sent_ns: int, size: int) -> None:
        now = time.perf_counter_ns()
        if self.measuring and not self.stopped:
            self.latencies.append(now - sent_ns)
            self.statuses[status] = self.statuses.get(status, 0) + 1
            self.bytes_in += size
            if len(self.latencies) >= self.max_requests:
                self.stop()
        elif not self.stopped:
            self.warmup_requests += 1
        if not self.stopped:
            conn.send()

    def connection_lost(self) -> None:
        self.lost += 1
        if self.lost >= len(self.conns):
            self.stop()


class _Conn(asyncio.Protocol):
    def __init__(self, run: _Run) -> None:
        self.run = run
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.need = -1
        self.status = 0
        self.sent_ns = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError, AttributeError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send(self) -> None:
        assert self.transport is not None
        self.sent_ns = time.perf_counter_ns()
        self.transport.write(self.run.request)

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        while True:
            if self.need < 0:
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    return
                head = bytes(buf[:end])
                self.status = int(head[9:12])
                length = -1
                for line in head.split(b"\r\n")[1:]:
                    k, _, v = line.partition(b":")
                    if k.strip().lower() == b"content-length":
                        length = int(v)
                        break
                if length < 0:
                    raise RuntimeError("response without Content-Length")
                self.need = end + 4 + length
            if len(buf) < self.need:
                return
            size = self.need
            del buf[:size]
            self.need = -1
            self.run.completed(self, self.status, self.sent_ns, size)

    def connection_lost(self, exc: Exception | None) -> None:
        self.run.connection_lost()


async def _client_main(args: argparse.Namespace) -> dict[str, Any]:
    body = Path(args.body_file).read_bytes()
    extra = dict(h.split(":", 1) for h in args.header)
    extra = {k.strip(): v.strip() for k, v in extra.items()}
    content_type = extra.pop("Content-Type", "application/json")
    lines = "".join(f"{k}: {v}\r\n" for k, v in extra.items())
    head = (
        f"POST {args.path} HTTP/1.1\r\nHost: {HOST}:{args.port}\r\n"
        f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n{lines}\r\n"
    ).encode()
    run = _Run(head + body, args.max_requests, args.server_pid)
    loop = asyncio.get_running_loop()
    run.finished = loop.create_future()
    for _ in range(args.concurrency):
        _, conn = await asyncio.wait_for(
            loop.create_connection(lambda: _Conn(run), HOST, args.port), _CONNECT_TIMEOUT_S
        )
        run.conns.append(conn)
    loop.call_later(args.warmup_s, run.begin_measuring)
    loop.call_later(args.warmup_s + args.duration_s, run.stop)
    for conn in run.conns:
        conn.send()
    await asyncio.wait_for(run.finished, args.warmup_s + args.duration_s + _DRAIN_TIMEOUT_S)
    for conn in run.conns:
        if conn.transport is not None:
            conn.transport.close()
    await asyncio.sleep(0)

    lat = sorted(run.latencies)
    seconds = (run.t_end - run.t_start) / 1e9
    n = len(lat)
    ok = run.statuses.get(200, 0)
    report: dict[str, Any] = {
        "concurrency": args.concurrency,
        "requests": n,
        "ok": ok,
        "statuses": {str(k): v for k, v in sorted(run.statuses.items())},
        "connections_lost": run.lost,
        "warmup_requests": run.warmup_requests,
        "seconds": round(seconds, 3),
        "rps": round(ok / seconds, 1) if seconds > 0 else 0.0,
        "latency_us": {
            "p50": round(_percentile(lat, 50), 1),
            "p90": round(_percentile(lat, 90), 1),
            "p99": round(_percentile(lat, 99), 1),
            "max": round(lat[-1] / 1000.0, 1) if lat else float("nan"),
            "mean": round(sum(lat) / n / 1000.0, 1) if n else float("nan"),
        },
        "request_bytes": len(run.request),
        "response_bytes_mean": round(run.bytes_in / n, 1) if n else 0,
    }
    if run.cpu:
        cpu = {k: round(v, 3) for k, v in run.cpu.items()}
        server = run.cpu.get("server_s", 0.0)
        cpu["other_s"] = round(run.cpu["machine_busy_s"] - run.cpu["client_s"] - server, 3)
        cpu["machine_busy_fraction"] = round(
            run.cpu["machine_busy_s"] / max(1e-9, seconds * (os.cpu_count() or 1)), 3
        )
        cpu["other_cores"] = round(cpu["other_s"] / max(1e-9, seconds), 3)
        cpu["steal_cores"] = round(run.cpu["steal_s"] / max(1e-9, seconds), 3)
        if n:
            cpu["client_us_per_request"] = round(run.cpu["client_s"] / n * 1e6, 1)
            if "server_s" in run.cpu:
                cpu["server_us_per_request"] = round(server / n * 1e6, 1)
            if "server_main_thread_s" in run.cpu:
                cpu["server_main_thread_us_per_request"] = round(
                    run.cpu["server_main_thread_s"] / n * 1e6, 1
                )
        report["cpu"] = cpu
        # Someone else's work on the box (other processes, or the hypervisor taking the
        # vCPUs: steal) makes this run's numbers suspect; the caller may rerun.
        report["disturbed"] = cpu["other_cores"] > 0.3 or cpu["steal_cores"] > 0.15
    return report


# ---------------------------------------------------------------------------- null server
_NULL_ANSWER = json.dumps(
    {
        "model_name": "null",
        "model_version": "1",
        "outputs": [
            {
                "name": "probabilities",
                "datatype": "FP32",
                "shape": [1, 10],
                "data": [0.1] * 10,
            }
        ],
    }
).encode()
_NULL_BINARY_HEAD = json.dumps(
    {
        "model_name": "null",
        "model_version": "1",
        "outputs": [
            {
                "name": "probabilities",
                "datatype": "FP32",
                "shape": [1, 10],
                "parameters": {"binary_data_size": 40},
            }
        ],
    }
).encode()
_NULL_BINARY_ANSWER = _NULL_BINARY_HEAD + bytes(40)
HEADER_LENGTH = "Inference-Header-Content-Length"


async def _null_main(port: int, reuse_port: bool) -> None:
    import orjson
    from aiohttp import web

    binary_headers = {HEADER_LENGTH: str(len(_NULL_BINARY_HEAD))}

    async def infer(request: web.Request) -> web.Response:
        body = await request.read()
        head_length = request.headers.get(HEADER_LENGTH)
        if head_length is None:
            orjson.loads(body)
            return web.Response(body=_NULL_ANSWER, content_type="application/json")
        orjson.loads(memoryview(body)[: int(head_length)])
        return web.Response(
            body=_NULL_BINARY_ANSWER,
            content_type="application/octet-stream",
            headers=binary_headers,
        )

    async def ready(request: web.Request) -> web.Response:
        return web.Response(body=b'{"ready": true}', content_type="application/json")

    app = web.Application(client_max_size=8 * 1024 * 1024)
    app.router.add_post("/v2/models/{model}/infer", infer)
    app.router.add_get("/v2/health/ready", ready)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, HOST, port, reuse_address=True, reuse_port=reuse_port or None)
    await site.start()
    print("READY", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def _install_uvloop() -> str:
    try:
        import uvloop
    except ImportError:
        return "asyncio"
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return "uvloop"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("client")
    c.add_argument("--port", type=int, required=True)
    c.add_argument("--path", required=True)
    c.add_argument("--body-file", required=True)
    c.add_argument("--concurrency", type=int, default=1)
    c.add_argument("--warmup-s", type=float, default=1.0)
    c.add_argument("--duration-s", type=float, default=5.0)
    c.add_argument("--max-requests", type=int, default=10_000_000)
    c.add_argument("--server-pid", type=int, action="append", default=[])
    c.add_argument("--header", action="append", default=[], help="'Name: value' (repeatable)")
    s = sub.add_parser("null-server")
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--reuse-port", action="store_true", help="SO_REUSEPORT (several copies)")
    args = parser.parse_args(argv)
    loop_kind = _install_uvloop()
    if args.cmd == "client":
        report = asyncio.run(_client_main(args))
        report["event_loop"] = loop_kind
        print(json.dumps(report))
    else:
        asyncio.run(_null_main(args.port, args.reuse_port))


if __name__ == "__main__":
    main()
