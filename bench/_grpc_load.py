"""gRPC load for the benches: a null servicer, a latency client, a concurrent client.

Run as a script it is one process::

    python bench/_grpc_load.py null-server --port P
    python bench/_grpc_load.py client --port P --model M --input NAME --sample F.npy \\
        [--expect F.npy] --calls N --warmup-s S --max-s S [--server-pid PID ...]
    python bench/_grpc_load.py aio-client --port P --model M --input NAME --sample F.npy \\
        --connections 64 --concurrency 64 --warmup-s S --duration-s S [--server-pid PID ...]
    python bench/_grpc_load.py h2-body --model M --input NAME --sample F.npy --out FILE

* ``null-server``: the floor for the gRPC stack. ``inference.GRPCInferenceService`` on
  ``grpc.aio`` under uvloop, with the agent's server options (message limits,
  ``grpc.so_reuseport``: several copies share one port), whose ModelInfer answers a fixed
  ModelInferResponse shaped like the agent's (``probabilities`` FP32 [1, 10] in
  ``raw_output_contents``) and does nothing else; ServerLive/ServerReady answer true. Prints
  ``READY`` once it listens.
* ``client``: latency at concurrency 1. A sync ``grpc`` channel and the generated stub, one
  pre-built ModelInferRequest (the sample in ``raw_input_contents``), called back to back:
  p50/p90/p99 in µs, and the CPU of the client, the server processes and everything else.
  The first answer is checked against ``--expect`` when given.
* ``aio-client``: throughput with a ``grpc.aio`` client, ``--concurrency`` calls in flight
  over ``--connections`` channels (local subchannel pools, so one TCP connection each); the
  fallback when ``h2load`` is missing.
* ``h2-body``: the request as an HTTP/2 body for h2load: 1 flag byte (0, uncompressed), the
  4-byte big-endian length, the serialized message.

Every loop is bounded by a call count and a deadline; all traffic stays on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import struct
import time
from pathlib import Path
from typing import Any

# As the agent: processes are started with fork+exec, gRPC's fork handlers are not needed.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")

HOST = "127.0.0.1"
METHOD = "/inference.GRPCInferenceService/ModelInfer"
MAX_RECEIVE = 8 * 1024 * 1024  # the agent's default --max-body-mb
try:
    from mcp_edge.shared.protocol.wire import MAX_INFER_RESPONSE_BYTES
except ImportError:  # run without the repository installed
    MAX_INFER_RESPONSE_BYTES = 32 * 1024 * 1024
SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_RECEIVE),
    ("grpc.max_send_message_length", MAX_INFER_RESPONSE_BYTES + 65536),
    ("grpc.so_reuseport", 1),
]
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_INFER_RESPONSE_BYTES + 65536),
    ("grpc.max_send_message_length", MAX_RECEIVE),
]


def _install_uvloop() -> str:
    try:
        import uvloop
    except ImportError:
        return "asyncio"
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return "uvloop"


def build_request(model: str, input_name: str, sample_file: str) -> Any:
    import numpy as np
    from tritonclient.grpc import service_pb2 as pb

    sample = np.ascontiguousarray(np.load(sample_file), dtype=np.float32)
    tensor = pb.ModelInferRequest.InferInputTensor(
        name=input_name, datatype="FP32", shape=list(sample.shape)
    )
    return pb.ModelInferRequest(
        model_name=model, inputs=[tensor], raw_input_contents=[sample.tobytes()]
    )


def grpc_frame(message: bytes) -> bytes:
    """A gRPC length-prefixed message: flag byte 0, 4-byte big-endian length, the bytes."""
    return b"\x00" + struct.pack(">I", len(message)) + message


# ---------------------------------------------------------------------------- CPU accounting
class _Cpu:
    def __init__(self, server_pids: list[int]) -> None:
        import psutil

        found: dict[int, Any] = {}
        for pid in server_pids:
            with contextlib.suppress(psutil.Error):
                p = psutil.Process(pid)
                found[p.pid] = p
                for c in p.children(recursive=True):
                    found[c.pid] = c
        self.procs = list(found.values())

    def sample(self) -> dict[str, float]:
        import psutil

        total = psutil.cpu_times()
        busy = sum(getattr(total, f, 0.0) for f in ("user", "nice", "system", "irq", "softirq"))
        server = 0.0
        for p in self.procs:
            with contextlib.suppress(psutil.Error):
                t = p.cpu_times()
                server += t.user + t.system
        return {
            "machine_busy_s": busy,
            "client_s": time.process_time(),
            "steal_s": getattr(total, "steal", 0.0),
            "server_s": server,
        }

    def report(self, start: dict[str, float], seconds: float, n: int) -> dict[str, Any]:
        end = self.sample()
        d = {k: end[k] - start[k] for k in end}
        seconds = max(1e-9, seconds)
        cpu = {k: round(v, 3) for k, v in d.items()}
        other = d["machine_busy_s"] - d["client_s"] - (d["server_s"] if self.procs else 0.0)
        cpu["other_s"] = round(other, 3)
        cpu["other_cores"] = round(other / seconds, 3)
        cpu["steal_cores"] = round(d["steal_s"] / seconds, 3)
        cpu["machine_busy_fraction"] = round(
            d["machine_busy_s"] / (seconds * (os.cpu_count() or 1)), 3
        )
        if n:
            cpu["client_us_per_request"] = round(d["client_s"] / n * 1e6, 1)
            if self.procs:
                cpu["server_us_per_request"] = round(d["server_s"] / n * 1e6, 1)
        return cpu


def _pct(sorted_ns: list[int], q: float) -> float:
    if not sorted_ns:
        return float("nan")
    i = min(len(sorted_ns) - 1, max(0, round(q / 100.0 * (len(sorted_ns) - 1))))
    return round(sorted_ns[i] / 1000.0, 1)


def _latency(lat: list[int]) -> dict[str, float]:
    lat = sorted(lat)
    return {
        "p50": _pct(lat, 50),
        "p90": _pct(lat, 90),
        "p99": _pct(lat, 99),
        "max": round(lat[-1] / 1000.0, 1) if lat else float("nan"),
        "mean": round(sum(lat) / len(lat) / 1000.0, 1) if lat else float("nan"),
    }


# ---------------------------------------------------------------------------- sync client
def _wait_channel(grpc: Any, channel: Any, timeout_s: float) -> None:
    grpc.channel_ready_future(channel).result(timeout=timeout_s)


def _check(answer: Any, expect_file: str | None) -> dict[str, Any]:
    import numpy as np

    out: dict[str, Any] = {
        "outputs": [
            {"name": o.name, "datatype": o.datatype, "shape": list(o.shape)} for o in answer.outputs
        ],
        "response_bytes": answer.ByteSize(),
    }
    if expect_file is not None:
        expected = np.load(expect_file)
        ok = bool(answer.raw_output_contents) and len(answer.raw_output_contents[0]) == (
            expected.size * 4
        )
        if ok:
            got = np.frombuffer(answer.raw_output_contents[0], dtype=np.float32).reshape(
                expected.shape
            )
            ok = bool(np.allclose(got, expected, rtol=1e-4, atol=1e-6))
        out["outputs_match_onnxruntime"] = ok
    return out


def client_main(args: argparse.Namespace) -> dict[str, Any]:
    import grpc
    from tritonclient.grpc import service_pb2_grpc

    request = build_request(args.model, args.input, args.sample)
    channel = grpc.insecure_channel(f"{HOST}:{args.port}", options=CHANNEL_OPTIONS)
    try:
        _wait_channel(grpc, channel, 10.0)
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        infer = stub.ModelInfer
        check = _check(infer(request, timeout=10.0), args.expect)
        deadline = time.perf_counter() + args.warmup_s
        warm = 0
        while time.perf_counter() < deadline:
            infer(request)
            warm += 1
        cpu = _Cpu(args.server_pid)
        start = cpu.sample()
        t_start = time.perf_counter_ns()
        stop = t_start + int(args.max_s * 1e9)
        lat: list[int] = []
        clock = time.perf_counter_ns
        for _ in range(args.calls):
            t0 = clock()
            infer(request)
            t1 = clock()
            lat.append(t1 - t0)
            if t1 > stop:
                break
        seconds = (clock() - t_start) / 1e9
        report: dict[str, Any] = {
            "client": "python-grpc-sync",
            "concurrency": 1,
            "requests": len(lat),
            "ok": len(lat),
            "warmup_requests": warm,
            "seconds": round(seconds, 3),
            "rps": round(len(lat) / seconds, 1) if seconds > 0 else 0.0,
            "latency_us": _latency(lat),
            "request_bytes": request.ByteSize(),
            "check": check,
        }
        c = cpu.report(start, seconds, len(lat))
        report["cpu"] = c
        report["disturbed"] = c["other_cores"] > 0.3 or c["steal_cores"] > 0.15
        return report
    finally:
        channel.close()


# ---------------------------------------------------------------------------- aio client
async def aio_client_main(args: argparse.Namespace) -> dict[str, Any]:
    import grpc
    from tritonclient.grpc import service_pb2_grpc

    request = build_request(args.model, args.input, args.sample)
    options = [*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
    channels = [
        grpc.aio.insecure_channel(f"{HOST}:{args.port}", options=options)
        for _ in range(max(1, args.connections))
    ]
    try:
        for ch in channels:
            await asyncio.wait_for(ch.channel_ready(), 10.0)
        stubs = [service_pb2_grpc.GRPCInferenceServiceStub(ch) for ch in channels]
        state = {"measuring": False, "stopped": False, "warm": 0, "errors": 0}
        lat: list[int] = []
        clock = time.perf_counter_ns

        async def caller(stub: Any) -> None:
            infer = stub.ModelInfer
            while not state["stopped"]:
                t0 = clock()
                try:
                    await infer(request)
                except grpc.aio.AioRpcError:
                    state["errors"] += 1
                    continue
                if state["stopped"]:
                    break
                if state["measuring"]:
                    lat.append(clock() - t0)
                else:
                    state["warm"] += 1

        tasks = [
            asyncio.get_running_loop().create_task(caller(stubs[i % len(stubs)]))
            for i in range(args.concurrency)
        ]
        await asyncio.sleep(args.warmup_s)
        cpu = _Cpu(args.server_pid)
        start = cpu.sample()
        state["measuring"] = True
        t_start = clock()
        await asyncio.sleep(args.duration_s)
        state["stopped"] = True
        seconds = (clock() - t_start) / 1e9
        n = len(lat)
        c = cpu.report(start, seconds, n)
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10.0)
        return {
            "client": "python-grpc-aio",
            "command": f"python bench/_grpc_load.py aio-client --connections {args.connections} "
            f"--concurrency {args.concurrency}",
            "concurrency": args.concurrency,
            "connections": len(channels),
            "requests": n,
            "ok": n,
            "errors": state["errors"],
            "warmup_requests": state["warm"],
            "seconds": round(seconds, 3),
            "rps": round(n / seconds, 1) if seconds > 0 else 0.0,
            "latency_us": _latency(lat),
            "cpu": c,
            "disturbed": c["other_cores"] > 0.3 or c["steal_cores"] > 0.15,
        }
    finally:
        for ch in channels:
            await ch.close()


# ---------------------------------------------------------------------------- null servicer
async def null_main(port: int) -> None:
    import grpc
    from tritonclient.grpc import service_pb2 as pb
    from tritonclient.grpc import service_pb2_grpc

    answer = pb.ModelInferResponse(
        model_name="null",
        model_version="1",
        outputs=[
            pb.ModelInferResponse.InferOutputTensor(
                name="probabilities", datatype="FP32", shape=[1, 10]
            )
        ],
        raw_output_contents=[bytes(40)],
    )

    class NullServicer(service_pb2_grpc.GRPCInferenceServiceServicer):  # type: ignore[misc]
        async def ServerLive(self, request: Any, context: Any) -> Any:
            return pb.ServerLiveResponse(live=True)

        async def ServerReady(self, request: Any, context: Any) -> Any:
            return pb.ServerReadyResponse(ready=True)

        async def ModelInfer(self, request: Any, context: Any) -> Any:
            return answer

    server = grpc.aio.server(options=SERVER_OPTIONS)
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(NullServicer(), server)
    if not server.add_insecure_port(f"{HOST}:{port}"):
        raise SystemExit(f"cannot listen on {HOST}:{port}")
    await server.start()
    print("READY", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await server.stop(1.0)


# ---------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("null-server")
    s.add_argument("--port", type=int, required=True)
    for name in ("client", "aio-client", "h2-body"):
        p = sub.add_parser(name)
        p.add_argument("--model", required=True)
        p.add_argument("--input", required=True)
        p.add_argument("--sample", required=True, help=".npy of the batch-1 input")
        if name == "h2-body":
            p.add_argument("--out", required=True)
            continue
        p.add_argument("--port", type=int, required=True)
        p.add_argument("--warmup-s", type=float, default=1.0)
        p.add_argument("--server-pid", type=int, action="append", default=[])
        if name == "client":
            p.add_argument("--expect", default=None, help=".npy of the expected output")
            p.add_argument("--calls", type=int, default=5000)
            p.add_argument("--max-s", type=float, default=5.0)
        else:
            p.add_argument("--connections", type=int, default=64)
            p.add_argument("--concurrency", type=int, default=64)
            p.add_argument("--duration-s", type=float, default=5.0)
    args = parser.parse_args(argv)
    if args.cmd == "h2-body":
        body = grpc_frame(build_request(args.model, args.input, args.sample).SerializeToString())
        Path(args.out).write_bytes(body)
        print(json.dumps({"bytes": len(body)}))
        return
    loop_kind = _install_uvloop()
    if args.cmd == "null-server":
        asyncio.run(null_main(args.port))
        return
    report = client_main(args) if args.cmd == "client" else asyncio.run(aio_client_main(args))
    report["event_loop"] = loop_kind
    print(json.dumps(report))


if __name__ == "__main__":
    main()
