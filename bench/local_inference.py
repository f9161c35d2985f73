"""Local inference bench: the agent's HTTP and gRPC servers against their floors, in one run.

Baselines measured in the same run, on the same machine, with the same client:

1. raw ``onnxruntime`` ``session.run`` per call (batch 1, and batch 32 per item), with the
   session options the agent's hardware profile gives (and, for reference, intra-op threads 1);
2. a null-handler aiohttp server (uvloop, same route, same body read + orjson parse, fixed
   OIP-shaped answer, no model): latency at concurrency 1, throughput at concurrency 64 (the
   Python load client, and ``wrk``);
3. ``mcp-agent serve`` for the digits MLP and a small conv net, batching on and off: the same
   loads, plus its RSS, CPU per request and how many requests it merged per batch;
4. per protocol (``--protocol``: HTTP JSON, HTTP with the binary tensor extension, gRPC) and
   serving-process count (``--processes``): the agent (``--threads 1``) against the null
   handler / a null ``grpc.aio`` servicer run as as many processes on one port, c1 p50 and
   c64 throughput from C clients (``wrk``, ``h2load``);
5. batching on a compute-bound conv net: ``session.run``'s batch-32 gain against the agent's
   c64 throughput with batching on over ``--no-batching``.

Then the ratios and goals the design asks of the agent, each with a pass flag. Prints one
JSON document (and writes it to ``--out``). ``--quick`` is a ~2 min smoke run.

    .venv/bin/python bench/local_inference.py [--quick] [--out FILE] \
        [--protocol http-json,http-binary,grpc] [--processes 1,2]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
for _p in (str(BENCH_DIR), str(REPO_ROOT)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import numpy as np  # noqa: E402
import orjson  # noqa: E402
import psutil  # noqa: E402
from _load import (  # noqa: E402
    free_port,
    http_request,
    http_request_headers,
    run_client,
    stop_process,
    wait_ready,
)
from _models import BenchModel, make_convnet, make_digits, make_wide_convnet  # noqa: E402
from _native_load import ensure_tool, run_h2load, run_wrk  # noqa: E402

MIB = 1024 * 1024
READY_PATH = "/v2/health/ready"
STARTUP_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Plan:
    """Durations of one run (seconds, or request counts)."""

    mode: str
    c1_warmup_s: float
    c1_requests: int
    c1_max_s: float
    c64_warmup_s: float
    c64_s: float
    ort_calls: int
    ort_max_s: float
    null_repeats: int
    quiet_wait_s: float
    diagnostics: bool
    wrk_warmup_s: int
    wrk_s: int

    def client(self) -> dict[str, Any]:
        return {
            "type": "python-uvloop-raw-http1",
            "description": (
                "one separate process; asyncio.Protocol on uvloop, one keep-alive TCP connection "
                "(TCP_NODELAY) per unit of concurrency, pre-encoded request bytes, parses only the "
                "status line and Content-Length; closed loop (next request when the answer is in)"
            ),
            "wrk_found": _which("wrk") is not None,
            "processes": 1,
            "wrk_c64": {
                "command": f"wrk -t1 -c64 -d{self.wrk_s}s --latency -s post.lua URL",
                "warmup_run_s": self.wrk_warmup_s,
                "description": "C, one thread, 64 keep-alive connections; a Lua script POSTs "
                "the body file; rps = answers without error / duration",
            },
            "c1": {
                "warmup_s": self.c1_warmup_s,
                "requests": self.c1_requests,
                "max_s": self.c1_max_s,
            },
            "c64": {"warmup_s": self.c64_warmup_s, "duration_s": self.c64_s},
        }


FULL = Plan("full", 1.0, 5000, 5.0, 1.5, 5.0, 20000, 2.0, 2, 15.0, True, 1, 5)
QUICK = Plan("quick", 0.3, 800, 1.5, 0.5, 1.5, 3000, 0.5, 1, 3.0, False, 0, 2)
PROTOCOLS = ("http-json", "http-binary", "grpc")
DEFAULT_PROCESSES = (1, 2)


def _which(name: str) -> str | None:
    from shutil import which

    return which(name)


# ---------------------------------------------------------------------------- onnxruntime floor
def profile_session_settings() -> dict[str, Any]:
    """The onnxruntime settings the agent's hardware profile gives on this box."""
    from mcp_edge.agent.serving.serve import choose_profile

    profile, _ = choose_profile(None)
    rt = profile.runtime
    return {
        "profile": profile.name,
        "graph_optimization_level": "ORT_ENABLE_ALL",
        "execution_mode": "ORT_SEQUENTIAL",
        "intra_op_num_threads": rt.intra_op_threads,
        "inter_op_num_threads": rt.inter_op_threads,
        "allow_spinning": rt.allow_spinning,
        "providers": ["CPUExecutionProvider"],
    }


def _session(path: Path, settings: dict[str, Any], intra: int | None = None) -> Any:
    import onnxruntime as ort

    o = ort.SessionOptions()
    o.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    o.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    o.intra_op_num_threads = settings["intra_op_num_threads"] if intra is None else intra
    o.inter_op_num_threads = settings["inter_op_num_threads"]
    o.add_session_config_entry(
        "session.intra_op.allow_spinning", "1" if settings["allow_spinning"] else "0"
    )
    o.log_severity_level = 3
    return ort.InferenceSession(str(path), o, providers=["CPUExecutionProvider"])


def _time_calls(session: Any, feeds: dict[str, Any], calls: int, max_s: float) -> dict[str, float]:
    out = [session.get_outputs()[0].name]
    warm_until = time.perf_counter() + max_s / 2  # a slow model must not warm up for ages
    for _ in range(min(200, calls)):
        session.run(out, feeds)
        if time.perf_counter() > warm_until:
            break
    times: list[int] = []
    deadline = time.perf_counter_ns() + int(max_s * 1e9)
    for _ in range(calls):
        t0 = time.perf_counter_ns()
        session.run(out, feeds)
        times.append(time.perf_counter_ns() - t0)
        if t0 > deadline:
            break
    a = np.array(times) / 1000.0
    return {
        "calls": len(times),
        "p50": round(float(np.percentile(a, 50)), 2),
        "p99": round(float(np.percentile(a, 99)), 2),
        "mean": round(float(a.mean()), 2),
    }


def bench_session_run(model: BenchModel, settings: dict[str, Any], plan: Plan) -> dict[str, Any]:
    """``session.run`` µs per call at batch 1 and 32, profile settings and intra-op 1."""
    x1 = {model.input_name: model.sample}
    x32 = {model.input_name: np.ascontiguousarray(np.repeat(model.sample, 32, axis=0))}
    result: dict[str, Any] = {}
    for label, intra in (("profile", None), ("intra_op_1", 1)):
        s = _session(model.path, settings, intra)
        b1 = _time_calls(s, x1, plan.ort_calls, plan.ort_max_s)
        b32 = _time_calls(s, x32, max(100, plan.ort_calls // 8), plan.ort_max_s)
        result[label] = {
            "batch1_us": b1,
            "batch32_us": b32,
            "batch32_per_item_us": round(b32["p50"] / 32, 2),
            "batch32_item_speedup": round(b1["p50"] / (b32["p50"] / 32), 2),
        }
        del s
    return result


# ---------------------------------------------------------------------------- servers
QUIET_BUSY_PERCENT = 15.0


def wait_quiet(max_s: float) -> dict[str, float]:
    """Wait (at most ``max_s``) until the machine is under 15 % busy over half a second."""
    t0 = time.monotonic()
    busy = psutil.cpu_percent(interval=0.5)
    while busy > QUIET_BUSY_PERCENT and time.monotonic() - t0 < max_s:
        busy = psutil.cpu_percent(interval=0.5)
    return {"waited_s": round(time.monotonic() - t0, 1), "busy_percent": busy}


def _tail(path: Path, n: int = 2000) -> str:
    with contextlib.suppress(OSError):
        return path.read_text(errors="replace")[-n:]
    return ""


def _wait_lines(
    procs: list[subprocess.Popen[bytes]], logs: list[Path], lines: tuple[str, ...], timeout_s: float
) -> None:
    """Wait until every log holds every one of ``lines``; RuntimeError if a process exits or
    ``timeout_s`` passes first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for proc in procs:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
        if all(all(line in _tail(log, 1_000_000) for line in lines) for log in logs):
            return
        time.sleep(0.05)
    raise RuntimeError(f"server not ready after {timeout_s:.0f} s (waiting for {lines})")


class Servers:
    """Starts servers as subprocesses and makes sure every one is gone at exit, with any
    process it started (the agent's serving processes)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.live: list[subprocess.Popen[bytes]] = []

    @contextlib.contextmanager
    def start(
        self,
        label: str,
        cmd: list[str],
        port: int,
        *,
        ready_lines: tuple[str, ...] = (),
        http_ready: bool = True,
    ) -> Iterator[tuple[subprocess.Popen[bytes], float]]:
        with self.start_group(label, cmd, port, ready_lines=ready_lines, http_ready=http_ready) as (
            procs,
            startup,
        ):
            yield procs[0], startup

    @contextlib.contextmanager
    def start_group(
        self,
        label: str,
        cmd: list[str],
        port: int,
        *,
        copies: int = 1,
        ready_lines: tuple[str, ...] = (),
        http_ready: bool = True,
    ) -> Iterator[tuple[list[subprocess.Popen[bytes]], float]]:
        """``copies`` processes of ``cmd`` (sharing ``port``: SO_REUSEPORT), ready when each
        one's log holds ``ready_lines`` and, with ``http_ready``, ``GET /v2/health/ready``
        answers 200."""
        procs: list[subprocess.Popen[bytes]] = []
        logs: list[Path] = []
        t0 = time.monotonic()
        try:
            for i in range(copies):
                log = self.workdir / (f"{label}.log" if copies == 1 else f"{label}.{i}.log")
                with open(log, "wb") as f:
                    proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
                self.live.append(proc)
                procs.append(proc)
                logs.append(log)
            try:
                if http_ready:
                    wait_ready(procs[0], port, READY_PATH, STARTUP_TIMEOUT_S)
                if ready_lines:
                    _wait_lines(procs, logs, ready_lines, STARTUP_TIMEOUT_S)
            except RuntimeError as e:
                raise RuntimeError(f"{label}: {e}\n{_tail(logs[-1])}") from None
            yield procs, time.monotonic() - t0
        finally:
            for proc in procs:
                self._stop(proc)

    def _stop(self, proc: subprocess.Popen[bytes]) -> None:
        kids: list[psutil.Process] = []
        with contextlib.suppress(psutil.Error):
            kids = psutil.Process(proc.pid).children(recursive=True)
        stop_process(proc)
        for kid in kids:  # a serving process its parent did not take down
            with contextlib.suppress(psutil.Error):
                kid.terminate()
        _, alive = psutil.wait_procs(kids, timeout=5.0)
        for kid in alive:
            with contextlib.suppress(psutil.Error):
                kid.kill()
        if proc in self.live:
            self.live.remove(proc)

    def stop_all(self) -> None:
        for proc in list(self.live):
            self._stop(proc)
        self.live.clear()


def _wrk_c64(
    wrk: str | None,
    port: int,
    path: str,
    body_file: Path,
    pids: list[int],
    plan: Plan,
    script_dir: Path,
    headers: dict[str, str] | None = None,
) -> dict[str, Any]:
    """``wrk -t1 -c64`` against one route; never raises (an ``error`` or ``skipped`` key)."""
    if wrk is None:
        return {"skipped": "wrk is not available (see client.wrk)"}
    try:
        return run_wrk(
            wrk,
            port=port,
            path=path,
            body_file=body_file,
            headers={"Content-Type": "application/json"} | (headers or {}),
            script_dir=script_dir,
            connections=64,
            warmup_s=plan.wrk_warmup_s,
            duration_s=plan.wrk_s,
            server_pids=pids,
        )
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        return {"error": str(e)[:1000]}


def _loads(
    port: int,
    path: str,
    body_file: Path,
    pid: int,
    plan: Plan,
    wrk: str | None = None,
    script_dir: Path | None = None,
) -> dict[str, Any]:
    c1 = run_client(
        port=port,
        path=path,
        body_file=body_file,
        concurrency=1,
        warmup_s=plan.c1_warmup_s,
        duration_s=plan.c1_max_s,
        max_requests=plan.c1_requests,
        server_pid=pid,
    )
    c64 = run_client(
        port=port,
        path=path,
        body_file=body_file,
        concurrency=64,
        warmup_s=plan.c64_warmup_s,
        duration_s=plan.c64_s,
        max_requests=10_000_000,
        server_pid=pid,
    )
    out = {"c1": c1, "c64": c64}
    if script_dir is not None:
        out["c64_wrk"] = _wrk_c64(wrk, port, path, body_file, [pid], plan, script_dir)
    return out


def _rss_mib(pid: int) -> float:
    return round(float(psutil.Process(pid).memory_info().rss) / MIB, 1)


BATCH_FAMILY = "mcp_agent_batch_size"
RUN_FAMILY = "mcp_agent_inference_run_seconds"


def _histogram_sums(port: int, family: str, model: str) -> dict[str, float]:
    """``family``'s sum/count for ``model`` from the agent's /metrics (0s if absent)."""
    status, text = http_request(port, "/metrics")
    found = {"sum": 0.0, "count": 0.0}
    if status != 200:
        return found
    for line in text.decode().splitlines():
        for key in found:
            if line.startswith(f"{family}_{key}{{") and f'model="{model}"' in line:
                found[key] = float(line.rsplit(" ", 1)[1])
    return found


def _run_us_between(before: dict[str, float], after: dict[str, float]) -> float | None:
    """Mean backend run time (µs) between two readings of mcp_agent_inference_run_seconds."""
    runs = after["count"] - before["count"]
    return round((after["sum"] - before["sum"]) / runs * 1e6, 2) if runs else None


def _check_agent_answer(
    port: int, model: BenchModel, body: bytes, expected: np.ndarray
) -> dict[str, Any]:
    status, raw = http_request(port, f"/v2/models/{model.name}/infer", body)
    if status != 200:
        return {"status": status, "outputs_match_onnxruntime": False, "body": raw[:300].decode()}
    doc = orjson.loads(raw)
    got = np.asarray(doc["outputs"][0]["data"], dtype=np.float32).reshape(expected.shape)
    return {
        "status": status,
        "outputs_match_onnxruntime": bool(np.allclose(got, expected, rtol=1e-4, atol=1e-6)),
        "response_bytes": len(raw),
    }


def bench_null(
    servers: Servers,
    models: list[BenchModel],
    bodies: dict[str, Path],
    plan: Plan,
    repeat: int,
    wrk: str | None = None,
) -> dict[str, Any]:
    quiet = wait_quiet(plan.quiet_wait_s)
    port = free_port()
    cmd = [sys.executable, str(BENCH_DIR / "_load.py"), "null-server", "--port", str(port)]
    with servers.start(f"null-{repeat}", cmd, port) as (proc, startup):
        runs = {
            m.name: _loads(
                port,
                f"/v2/models/{m.name}/infer",
                bodies[m.name],
                proc.pid,
                plan,
                wrk,
                servers.workdir,
            )
            for m in models
        }
        return {
            "command": "python bench/_load.py null-server --port P",
            "startup_s": round(startup, 2),
            "quiet_before": quiet,
            "rss_mib": _rss_mib(proc.pid),
            "runs": runs,
        }


def bench_agent(
    servers: Servers,
    model: BenchModel,
    body_file: Path,
    expected: np.ndarray,
    batching: bool,
    plan: Plan,
    state_dir: Path,
    extra: tuple[str, ...] = (),
    wrk: str | None = None,
) -> dict[str, Any]:
    quiet = wait_quiet(plan.quiet_wait_s)
    port = free_port()
    exe = Path(sys.executable).with_name("mcp-agent")
    base = (
        [str(exe)] if exe.exists() else [sys.executable, "-c", "from agent.cli import main; main()"]
    )
    args = [
        "serve",
        "--model-path",
        str(model.path),
        "--port",
        str(port),
        "--state-dir",
        str(state_dir),
        "--log-level",
        "warning",
    ]
    if not batching:
        args.append("--no-batching")
    args += extra
    label = f"agent-{model.name}-{'on' if batching else 'off'}{''.join(extra)}"
    with servers.start(label, base + args, port) as (proc, startup):
        check = _check_agent_answer(port, model, body_file.read_bytes(), expected)
        rss_ready = _rss_mib(proc.pid)
        path = f"/v2/models/{model.name}/infer"
        runs_start = _histogram_sums(port, RUN_FAMILY, model.name)
        c1 = run_client(
            port=port,
            path=path,
            body_file=body_file,
            concurrency=1,
            warmup_s=plan.c1_warmup_s,
            duration_s=plan.c1_max_s,
            max_requests=plan.c1_requests,
            server_pid=proc.pid,
        )
        runs_c1 = _histogram_sums(port, RUN_FAMILY, model.name)
        before = _histogram_sums(port, BATCH_FAMILY, model.name)
        c64 = run_client(
            port=port,
            path=path,
            body_file=body_file,
            concurrency=64,
            warmup_s=plan.c64_warmup_s,
            duration_s=plan.c64_s,
            max_requests=10_000_000,
            server_pid=proc.pid,
        )
        after = _histogram_sums(port, BATCH_FAMILY, model.name)
        runs_c64 = _histogram_sums(port, RUN_FAMILY, model.name)
        batches = after["count"] - before["count"]
        c64_wrk = _wrk_c64(wrk, port, path, body_file, [proc.pid], plan, servers.workdir)
        after_wrk = _histogram_sums(port, BATCH_FAMILY, model.name)
        wrk_batches = after_wrk["count"] - after["count"]
        if wrk_batches:
            c64_wrk["requests_per_batch"] = round(
                (after_wrk["sum"] - after["sum"]) / wrk_batches, 2
            )
        return {
            "command": "mcp-agent "
            + " ".join(
                a if a not in (str(model.path), str(port), str(state_dir)) else "…" for a in args
            ),
            "startup_s": round(startup, 2),
            "quiet_before": quiet,
            "check": check,
            "rss_mib_ready": rss_ready,
            "rss_mib_after_load": _rss_mib(proc.pid),
            "c1": c1,
            "c64": c64,
            "c64_wrk": c64_wrk,
            "c64_batches": {
                "batches": int(batches),
                "requests_per_batch": round((after["sum"] - before["sum"]) / batches, 2)
                if batches
                else None,
                "note": "from /metrics; includes the c64 warm-up",
            },
            "backend_run_us_mean": {
                "c1": _run_us_between(runs_start, runs_c1),
                "c64_per_batch": _run_us_between(runs_c1, runs_c64),
                "note": "the agent's own mcp_agent_inference_run_seconds (warm-ups included); "
                "compare with session_run, timed back to back",
            },
        }


# ---------------------------------------------------------------------------- ratios
def _ratio(
    name: str, value: float, op: str, goal: float | None, inputs: dict[str, Any]
) -> dict[str, Any]:
    ok: bool | None
    ok = None if goal is None else value <= goal if op == "<=" else value >= goal
    return {
        "name": name,
        "value": round(value, 3),
        "goal": None if goal is None else f"{op} {goal:g}",
        "pass": ok,
        "inputs": inputs,
    }


def ratios(result: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    null_runs = result["null_handler"]
    for model in result["models"]:
        nulls = [n["runs"][model] for n in null_runs]
        null_p50 = min(n["c1"]["latency_us"]["p50"] for n in nulls)
        null_rps = max(n["c64"]["rps"] for n in nulls)
        ort_p50 = result["session_run"][model]["profile"]["batch1_us"]["p50"]
        primary = model == "digits"
        for mode in ("batching_on", "batching_off"):
            a = result["agent"][model][mode]
            floor = null_p50 + ort_p50
            default = mode == "batching_on"  # goals apply to the default config; off is context
            out.append(
                _ratio(
                    f"{model}.{mode}.latency_c1_p50_over_floor",
                    a["c1"]["latency_us"]["p50"] / floor,
                    "<=",
                    1.3 if default else None,
                    {
                        "agent_p50_us": a["c1"]["latency_us"]["p50"],
                        "null_p50_us": null_p50,
                        "session_run_p50_us": ort_p50,
                        "agent_backend_run_us_mean_c1": a["backend_run_us_mean"]["c1"],
                    },
                )
            )
            out.append(
                _ratio(
                    f"{model}.{mode}.rps_c64_over_null",
                    a["c64"]["rps"] / null_rps,
                    ">=",
                    0.8 if default else None,
                    {"agent_rps": a["c64"]["rps"], "null_rps": null_rps},
                )
            )
        on = result["agent"][model]["batching_on"]["c64"]["rps"]
        off = result["agent"][model]["batching_off"]["c64"]["rps"]
        out.append(
            _ratio(
                f"{model}.rps_c64_batching_on_over_off",
                on / off if off else float("inf"),
                ">=",
                2.0 if primary else None,
                {"on_rps": on, "off_rps": off},
            )
        )
    rss = result["agent"]["digits"]["batching_on"]["rss_mib_after_load"]
    out.append(
        _ratio(
            "digits.agent_rss_mib",
            rss,
            "<=",
            100.0,
            {"null_handler_rss_mib": null_runs[0]["rss_mib"]},
        )
    )
    return out


def _row(runs: dict[str, Any]) -> dict[str, Any]:
    c1, c64 = runs["c1"], runs["c64"]
    return {
        "c1_p50_us": c1["latency_us"]["p50"],
        "c1_p99_us": c1["latency_us"]["p99"],
        "c64_rps": c64["rps"],
        "c64_p50_us": c64["latency_us"]["p50"],
        "c64_p99_us": c64["latency_us"]["p99"],
        "c1_server_cpu_us_per_req": c1.get("cpu", {}).get("server_us_per_request"),
        "c64_server_cpu_us_per_req": c64.get("cpu", {}).get("server_us_per_request"),
        "c64_main_thread_cpu_us_per_req": c64.get("cpu", {}).get(
            "server_main_thread_us_per_request"
        ),
        "c64_wrk_rps": _get(runs, "c64_wrk", "rps"),
        "c64_wrk_p50_us": _get(runs, "c64_wrk", "latency_us", "p50"),
        "c64_wrk_server_cpu_us_per_req": _get(runs, "c64_wrk", "cpu", "server_us_per_request"),
    }


def _table(result: dict[str, Any]) -> dict[str, Any]:
    """The headline numbers of every server run, one row each."""
    rows: dict[str, Any] = {}
    for i, null in enumerate(result["null_handler"]):
        for model, runs in null["runs"].items():
            rows[f"null[{i}].{model}"] = _row(runs)
    for model, modes in result["agent"].items():
        for mode, a in modes.items():
            rows[f"agent.{model}.{mode}"] = _row(a)
    for name, a in result.get("diagnostics", {}).items():
        rows[f"diagnostics.{name}"] = _row(a)
    return rows


def _disturbed(result: dict[str, Any]) -> list[str]:
    """Client runs during which other work (processes or hypervisor steal) used the box."""
    found: list[str] = []

    def visit(node: Any, path: str) -> None:
        if isinstance(node, dict):
            if node.get("disturbed"):
                cpu = node.get("cpu", {})
                found.append(
                    f"{path} (other {cpu.get('other_cores')} cores, "
                    f"steal {cpu.get('steal_cores')} cores)"
                )
            for k, v in node.items():
                visit(v, f"{path}.{k}" if path else k)
        elif isinstance(node, list):
            for i, v in enumerate(node):
                visit(v, f"{path}[{i}]")

    for key in ("null_handler", "agent", "diagnostics", "protocol_runs", "batching"):
        visit(result.get(key), key)
    return found


# ---------------------------------------------------------------------------- protocols
GRPC_PATH = "/inference.GRPCInferenceService/ModelInfer"
GRPC_H2_HEADERS = {"content-type": "application/grpc", "te": "trailers"}
PROTOCOL_MODEL = {"http-json": "digits", "http-binary": "convnet", "grpc": "digits"}
"""The model each protocol is measured on: digits (the protocol's own cost dominates) for JSON
and gRPC; the conv net (a 784-value input, where the encoding matters) for binary."""
BINARY_HEADER = "Inference-Header-Content-Length"


@dataclass(frozen=True)
class HttpLoad:
    """One HTTP request as the clients send it: a body file and its headers."""

    model: str
    body_file: Path
    headers: dict[str, str]

    @property
    def path(self) -> str:
        return f"/v2/models/{self.model}/infer"


def _binary_body(model: BenchModel) -> tuple[bytes, dict[str, str]]:
    """A request of Triton's binary tensor extension: the JSON header, then the raw FP32
    input; the answer asked in binary too (``binary_data_output``)."""
    raw = np.ascontiguousarray(model.sample, dtype=np.float32).tobytes()
    head = orjson.dumps(
        {
            "inputs": [
                {
                    "name": model.input_name,
                    "shape": list(model.sample.shape),
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": len(raw)},
                }
            ],
            "parameters": {"binary_data_output": True},
        }
    )
    headers = {"Content-Type": "application/octet-stream", BINARY_HEADER: str(len(head))}
    return head + raw, headers


def _check_binary_answer(port: int, load: HttpLoad, expected: np.ndarray) -> dict[str, Any]:
    status, headers, raw = http_request_headers(
        port, load.path, load.body_file.read_bytes(), headers=load.headers
    )
    out: dict[str, Any] = {"status": status, "response_bytes": len(raw)}
    head_len = {k.lower(): v for k, v in headers.items()}.get(BINARY_HEADER.lower())
    if status != 200 or head_len is None:
        out["outputs_match_onnxruntime"] = False
        out["body"] = raw[:300].decode(errors="replace")
        return out
    n = int(head_len)
    doc = orjson.loads(raw[:n])
    size = doc["outputs"][0]["parameters"]["binary_data_size"]
    got = np.frombuffer(raw[n : n + size], dtype=np.float32)
    out["outputs_match_onnxruntime"] = bool(
        got.size == expected.size
        and np.allclose(got.reshape(expected.shape), expected, rtol=1e-4, atol=1e-6)
    )
    out["binary_answer"] = True
    return out


def _c1(port: int, load: HttpLoad, pids: list[int], plan: Plan) -> dict[str, Any]:
    return run_client(
        port=port,
        path=load.path,
        body_file=load.body_file,
        concurrency=1,
        warmup_s=plan.c1_warmup_s,
        duration_s=plan.c1_max_s,
        max_requests=plan.c1_requests,
        server_pid=pids,
        headers=load.headers,
    )


def _http_load_figures(
    port: int, load: HttpLoad, pids: list[int], plan: Plan, wrk: str | None, script_dir: Path
) -> dict[str, Any]:
    """c1 with the Python client, c64 with wrk."""
    return {
        "model": load.model,
        "c1": _c1(port, load, pids, plan),
        "c64_wrk": _wrk_c64(
            wrk, port, load.path, load.body_file, pids, plan, script_dir, load.headers
        ),
    }


def _grpc_client(cmd: list[str], timeout_s: float) -> dict[str, Any]:
    done = subprocess.run(cmd, capture_output=True, timeout=timeout_s, check=False)
    if done.returncode != 0:
        raise RuntimeError(
            f"gRPC client failed ({done.returncode}): {done.stderr.decode()[-1500:]}"
        )
    return dict(json.loads(done.stdout))


@dataclass(frozen=True)
class GrpcLoad:
    model: str
    input_name: str
    sample_file: Path
    expect_file: Path
    h2_body_file: Path


def _grpc_figures(
    port: int, load: GrpcLoad, pids: list[int], plan: Plan, h2load: str | None, check: bool
) -> dict[str, Any]:
    """c1 with the sync gRPC client; c64 with h2load (or 64 grpc.aio calls in flight)."""
    base = [
        sys.executable,
        str(BENCH_DIR / "_grpc_load.py"),
        "",
        "--port",
        str(port),
        "--model",
        load.model,
        "--input",
        load.input_name,
        "--sample",
        str(load.sample_file),
    ]
    for pid in pids:
        base += ["--server-pid", str(pid)]
    c1_cmd = list(base)
    c1_cmd[2] = "client"
    c1_cmd += [
        "--calls",
        str(plan.c1_requests),
        "--warmup-s",
        str(plan.c1_warmup_s),
        "--max-s",
        str(plan.c1_max_s),
    ]
    if check:
        c1_cmd += ["--expect", str(load.expect_file)]
    out: dict[str, Any] = {"model": load.model}
    out["c1"] = _grpc_client(c1_cmd, plan.c1_warmup_s + plan.c1_max_s + 60)
    if h2load is not None:
        try:
            out["c64"] = run_h2load(
                h2load,
                port=port,
                path=GRPC_PATH,
                body_file=load.h2_body_file,
                headers=GRPC_H2_HEADERS,
                connections=64,
                streams_per_connection=1,
                warmup_s=max(0.5, float(plan.wrk_warmup_s)),
                duration_s=float(plan.wrk_s),
                server_pids=pids,
            )
        except (RuntimeError, OSError, subprocess.SubprocessError) as e:
            out["c64"] = {"client": "h2load", "error": str(e)[:1000]}
    else:
        aio = list(base)
        aio[2] = "aio-client"
        aio += [
            "--connections",
            "64",
            "--concurrency",
            "64",
            "--warmup-s",
            str(max(0.5, float(plan.wrk_warmup_s))),
            "--duration-s",
            str(plan.wrk_s),
        ]
        try:
            out["c64"] = _grpc_client(aio, plan.wrk_s + 60)
        except (RuntimeError, OSError, subprocess.SubprocessError) as e:
            out["c64"] = {"client": "python-grpc-aio", "error": str(e)[:1000]}
    return out


def _agent_base() -> list[str]:
    exe = Path(sys.executable).with_name("mcp-agent")
    return (
        [str(exe)] if exe.exists() else [sys.executable, "-c", "from agent.cli import main; main()"]
    )


def _try(fn: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """``fn``'s result, or ``{"error": ...}`` when it fails (a section never sinks the run)."""
    try:
        return dict(fn(*args, **kwargs))
    except Exception as e:  # SystemExit (SIGTERM) still unwinds: it is no Exception
        return {"error": f"{type(e).__name__}: {e}"[:2000]}


def bench_protocols(
    servers: Servers,
    plan: Plan,
    protocols: list[str],
    processes: list[int],
    http_loads: dict[str, HttpLoad],
    grpc_load: GrpcLoad,
    models_dir: Path,
    expected: dict[str, np.ndarray],
    state_dir: Path,
    tools: dict[str, str | None],
) -> dict[str, Any]:
    """For each process count: the null HTTP handler and the null gRPC servicer (as many
    copies on one port), then the agent (``--threads 1 --processes N``) serving both; in full
    mode twice over (``null_repeats`` rounds, keys ``..._2``), and the summary takes each
    side's best round, so a drift of the machine's speed during the run favours neither."""
    wrk, h2load = tools.get("wrk"), tools.get("h2load")
    http = [p for p in protocols if p.startswith("http")]
    result: dict[str, Any] = {}
    for n in processes:
        entry: dict[str, Any] = {"processes": n, "rounds": max(1, plan.null_repeats)}
        result[f"p{n}"] = entry
        for r in range(entry["rounds"]):
            _protocol_round(entry, "" if r == 0 else f"_{r + 1}", servers, plan, n, protocols,
                            http, http_loads, grpc_load, models_dir, expected, state_dir,
                            tools, wrk, h2load)  # fmt: skip
    return result


def _protocol_round(
    entry: dict[str, Any],
    suffix: str,
    servers: Servers,
    plan: Plan,
    n: int,
    protocols: list[str],
    http: list[str],
    http_loads: dict[str, HttpLoad],
    grpc_load: GrpcLoad,
    models_dir: Path,
    expected: dict[str, np.ndarray],
    state_dir: Path,
    tools: dict[str, str | None],
    wrk: str | None,
    h2load: str | None,
) -> None:
    if http:
        entry["null_http" + suffix] = _try(
            _null_http_protocols, servers, plan, n, http, http_loads, wrk
        )
    if "grpc" in protocols:
        entry["null_grpc" + suffix] = _try(_null_grpc_protocol, servers, plan, n, grpc_load, h2load)
    entry["agent" + suffix] = _try(
        _agent_protocols,
        servers,
        plan,
        n,
        protocols,
        http_loads,
        grpc_load,
        models_dir,
        expected,
        state_dir,
        tools,
    )


def _null_http_protocols(
    servers: Servers,
    plan: Plan,
    copies: int,
    http: list[str],
    http_loads: dict[str, HttpLoad],
    wrk: str | None,
) -> dict[str, Any]:
    quiet = wait_quiet(plan.quiet_wait_s)
    port = free_port()
    cmd = [sys.executable, str(BENCH_DIR / "_load.py"), "null-server", "--port", str(port)]
    cmd += ["--reuse-port"]
    with servers.start_group(
        f"null-http-p{copies}", cmd, port, copies=copies, ready_lines=("READY",)
    ) as (procs, startup):
        pids = [p.pid for p in procs]
        loads = {
            proto: _http_load_figures(port, http_loads[proto], pids, plan, wrk, servers.workdir)
            for proto in http
        }
        return {
            "command": f"{copies} x python bench/_load.py null-server --port P --reuse-port",
            "startup_s": round(startup, 2),
            "quiet_before": quiet,
            "rss_mib": round(sum(_rss_mib(pid) for pid in pids), 1),
            "loads": loads,
        }


def _null_grpc_protocol(
    servers: Servers, plan: Plan, copies: int, load: GrpcLoad, h2load: str | None
) -> dict[str, Any]:
    quiet = wait_quiet(plan.quiet_wait_s)
    port = free_port()
    cmd = [sys.executable, str(BENCH_DIR / "_grpc_load.py"), "null-server", "--port", str(port)]
    with servers.start_group(
        f"null-grpc-p{copies}",
        cmd,
        port,
        copies=copies,
        ready_lines=("READY",),
        http_ready=False,
    ) as (procs, startup):
        pids = [p.pid for p in procs]
        return {
            "command": f"{copies} x python bench/_grpc_load.py null-server --port P",
            "startup_s": round(startup, 2),
            "quiet_before": quiet,
            "rss_mib": round(sum(_rss_mib(pid) for pid in pids), 1),
            "loads": {"grpc": _grpc_figures(port, load, pids, plan, h2load, check=False)},
        }


def _agent_protocols(
    servers: Servers,
    plan: Plan,
    processes: int,
    protocols: list[str],
    http_loads: dict[str, HttpLoad],
    grpc_load: GrpcLoad,
    models_dir: Path,
    expected: dict[str, np.ndarray],
    state_dir: Path,
    tools: dict[str, str | None],
) -> dict[str, Any]:
    wrk, h2load = tools.get("wrk"), tools.get("h2load")
    quiet = wait_quiet(plan.quiet_wait_s)
    port = free_port()
    args = [
        "serve",
        "--model-path",
        str(models_dir),
        "--port",
        str(port),
        "--state-dir",
        str(state_dir),
        "--log-level",
        "warning",
        "--threads",
        "1",
        "--processes",
        str(processes),
    ]
    ready: tuple[str, ...] = ()
    grpc_port = None
    if "grpc" in protocols:
        grpc_port = free_port()
        while grpc_port == port:
            grpc_port = free_port()
        args += ["--grpc-port", str(grpc_port)]
        ready += ("gRPC (inference.GRPCInferenceService) on",)
    if processes > 1:
        ready += ("serving processes share these ports",)
    hidden = {str(models_dir), str(port), str(state_dir), str(grpc_port)}
    with servers.start(f"agent-protocols-p{processes}", _agent_base() + args, port,
                       ready_lines=ready) as (proc, startup):  # fmt: skip
        pids = [proc.pid]  # the clients count its children (the serving processes) too
        checks: dict[str, Any] = {}
        loads: dict[str, Any] = {}
        for proto in protocols:
            if proto == "http-json":
                load = http_loads[proto]
                checks[proto] = _check_agent_answer(
                    port, _model_stub(load.model), load.body_file.read_bytes(), expected[load.model]
                )
                loads[proto] = _http_load_figures(port, load, pids, plan, wrk, servers.workdir)
            elif proto == "http-binary":
                load = http_loads[proto]
                checks[proto] = _check_binary_answer(port, load, expected[load.model + ".raw"])
                loads[proto] = _http_load_figures(port, load, pids, plan, wrk, servers.workdir)
                # The same model with a JSON body, for the binary-over-JSON goal.
                same = http_loads["http-json-" + load.model]
                loads[proto]["json_same_model"] = {
                    "model": same.model,
                    "c64_wrk": _wrk_c64(
                        wrk,
                        port,
                        same.path,
                        same.body_file,
                        pids,
                        plan,
                        servers.workdir,
                        same.headers,
                    ),
                }
            elif proto == "grpc":
                assert grpc_port is not None
                figures = _grpc_figures(grpc_port, grpc_load, pids, plan, h2load, check=True)
                checks[proto] = figures["c1"].get("check")
                loads[proto] = figures
        counts = _request_counts(port)
        return {
            "command": "mcp-agent " + " ".join(a if a not in hidden else "…" for a in args),
            "startup_s": round(startup, 2),
            "quiet_before": quiet,
            "processes_running": len(_tree(proc.pid)),
            "rss_mib_total": round(sum(_rss_mib(pid) for pid in _tree(proc.pid)), 1),
            "checks": checks,
            "requests_answered_by_protocol": counts,
            "loads": loads,
        }


def _tree(pid: int) -> list[int]:
    with contextlib.suppress(psutil.Error):
        return [pid] + [c.pid for c in psutil.Process(pid).children(recursive=True)]
    return [pid]


def _model_stub(name: str) -> BenchModel:
    """Just enough of a BenchModel for :func:`_check_agent_answer` (it uses the name)."""
    return BenchModel(name, Path(), "input", np.zeros((1, 1), np.float32), "")


def _request_counts(port: int) -> dict[str, float]:
    """mcp_agent_requests_total by protocol and code, from the agent's /metrics (all
    serving processes summed by the primary)."""
    status, text = http_request(port, "/metrics")
    found: dict[str, float] = {}
    if status != 200:
        return found
    for line in text.decode().splitlines():
        if line.startswith("mcp_agent_requests_total{"):
            labels, _, value = line.rpartition(" ")
            proto = labels.split('protocol="', 1)[1].split('"', 1)[0]
            code = labels.split('code="', 1)[1].split('"', 1)[0]
            key = f"{proto}/{code}"
            found[key] = found.get(key, 0.0) + float(value)
    return found


def _get(node: Any, *path: str) -> Any:
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def _div(a: Any, b: Any) -> float | None:
    if not isinstance(a, int | float) or not isinstance(b, int | float) or not b:
        return None
    return round(float(a) / float(b), 3)


def _best_round(rounds: list[Any], c64_key: str) -> dict[str, Any]:
    """One side's figures over its rounds: the first round, with the lowest c1 p50 and the
    highest c64 throughput of them all."""
    found = [r for r in rounds if isinstance(r, dict)]
    if not found:
        return {}
    best = dict(found[0])
    c1s = [r["c1"] for r in found if _get(r, "c1", "latency_us", "p50") is not None]
    if c1s:
        best["c1"] = min(c1s, key=lambda c: c["latency_us"]["p50"])
    c64s = [r[c64_key] for r in found if _get(r, c64_key, "rps") is not None]
    if c64s:
        best[c64_key] = max(c64s, key=lambda c: c["rps"])
    return best


def protocol_summary(result: dict[str, Any]) -> dict[str, Any]:
    """One entry per protocol and process count: the agent against its baseline."""
    out: dict[str, Any] = {}
    runs = result.get("protocol_runs") or {}
    for pkey, entry in runs.items():
        n = entry["processes"]
        for proto in result.get("protocols_measured", []):
            base_key = "null_grpc" if proto == "grpc" else "null_http"
            c64_key = "c64" if proto == "grpc" else "c64_wrk"
            suffixes = [""] + [f"_{r}" for r in range(2, int(entry.get("rounds", 1)) + 1)]
            agent = _best_round([_get(entry, "agent" + s, "loads", proto) for s in suffixes],
                                c64_key)  # fmt: skip
            base = _best_round([_get(entry, base_key + s, "loads", proto) for s in suffixes],
                               c64_key)  # fmt: skip
            row: dict[str, Any] = {
                "protocol": proto,
                "processes": n,
                "model": PROTOCOL_MODEL[proto],
                "agent_command": _get(entry, "agent", "command"),
                "baseline": "null grpc.aio servicer (bench/_grpc_load.py)"
                if proto == "grpc"
                else "null aiohttp handler (bench/_load.py)",
                "p50_us": _get(agent, "c1", "latency_us", "p50"),
                "rps": _get(agent, c64_key, "rps"),
                "baseline_p50_us": _get(base, "c1", "latency_us", "p50"),
                "baseline_rps": _get(base, c64_key, "rps"),
                "p99_us": _get(agent, "c1", "latency_us", "p99"),
                "baseline_p99_us": _get(base, "c1", "latency_us", "p99"),
                "client": {
                    "c1": "python-grpc-sync (bench/_grpc_load.py client)"
                    if proto == "grpc"
                    else "python-uvloop-raw-http1 (bench/_load.py client)",
                    "c64": (_get(agent, c64_key, "client") or _get(base, c64_key, "client"))
                    if proto == "grpc"
                    else "wrk -t1 -c64",
                },
                "check": _get(entry, "agent", "checks", proto),
            }
            row["ratio_p50"] = _div(row["p50_us"], row["baseline_p50_us"])
            row["ratio_rps"] = _div(row["rps"], row["baseline_rps"])
            ort = _get(result, "session_run", row["model"], "intra_op_1", "batch1_us", "p50")
            row["session_run_p50_us_threads_1"] = ort
            if proto == "http-binary":
                row["json_rps_same_model"] = _get(agent, "json_same_model", "c64_wrk", "rps")
                row["binary_over_json_rps"] = _div(row["rps"], row["json_rps_same_model"])
            errors = [
                f"{who}: {node['error'][:300]}"
                for who, node in (("agent", entry.get("agent")), ("baseline", entry.get(base_key)))
                if isinstance(node, dict) and "error" in node
            ]
            for who, node in (("agent", agent), ("baseline", base)):
                for k in ("c64_wrk", "c64"):
                    sub = node.get(k) if isinstance(node, dict) else None
                    if isinstance(sub, dict) and ("error" in sub or "skipped" in sub):
                        errors.append(f"{who}.{k}: {sub.get('error') or sub.get('skipped')}")
            if errors:
                row["problems"] = errors
            out[f"{proto}/{pkey}"] = row
    return out


# ---------------------------------------------------------------------------- batching
def bench_batching(
    servers: Servers,
    plan: Plan,
    model: BenchModel,
    settings: dict[str, Any],
    state_dir: Path,
    wrk: str | None,
) -> dict[str, Any]:
    """Offline gain from ``session.run`` at batch 32 against the agent's dynamic-batching
    gain at c64 (binary body, wrk), on the compute-bound conv net."""
    x1 = {model.input_name: model.sample}
    x32 = {model.input_name: np.ascontiguousarray(np.repeat(model.sample, 32, axis=0))}
    sess = _session(model.path, settings)
    expected = sess.run(None, x1)[0]
    b1 = _time_calls(sess, x1, plan.ort_calls, max(1.0, plan.ort_max_s))
    b32 = _time_calls(sess, x32, 400, max(1.0, plan.ort_max_s) * 2)
    del sess
    offline = b1["p50"] / (b32["p50"] / 32)
    body, headers = _binary_body(model)
    body_file = servers.workdir / f"{model.name}.body.bin"
    body_file.write_bytes(body)
    load = HttpLoad(model.name, body_file, headers)
    out: dict[str, Any] = {
        "model": model.name,
        "description": model.description,
        "file_bytes": model.path.stat().st_size,
        "session_run": {
            "options": "profile (session_run.options)",
            "batch1_us": b1,
            "batch32_us": b32,
            "batch32_per_item_us": round(b32["p50"] / 32, 2),
            "batch1_at_least_1ms": b1["p50"] >= 1000.0,
        },
        "offline_gain": round(offline, 3),
        "agent": {},
    }
    for on in (True, False):
        key = f"batching_{'on' if on else 'off'}"
        out["agent"][key] = _try(
            _batching_agent, servers, plan, model, load, expected, on, state_dir, wrk
        )
    on_rps = _get(out, "agent", "batching_on", "c64_wrk", "rps")
    off_rps = _get(out, "agent", "batching_off", "c64_wrk", "rps")
    dynamic = _div(on_rps, off_rps)
    out["dynamic_gain"] = dynamic
    out["dynamic_over_offline"] = _div(dynamic, offline)
    return out


def _batching_agent(
    servers: Servers,
    plan: Plan,
    model: BenchModel,
    load: HttpLoad,
    expected: np.ndarray,
    batching: bool,
    state_dir: Path,
    wrk: str | None,
) -> dict[str, Any]:
    quiet = wait_quiet(plan.quiet_wait_s)
    port = free_port()
    args = ["serve", "--model-path", str(model.path), "--port", str(port),
            "--state-dir", str(state_dir), "--log-level", "warning"]  # fmt: skip
    if not batching:
        args.append("--no-batching")
    label = f"agent-{model.name}-{'on' if batching else 'off'}"
    with servers.start(label, _agent_base() + args, port) as (proc, startup):
        check = _check_binary_answer(port, load, expected)
        before = _histogram_sums(port, BATCH_FAMILY, model.name)
        runs_before = _histogram_sums(port, RUN_FAMILY, model.name)
        c64 = _wrk_c64(
            wrk, port, load.path, load.body_file, [proc.pid], plan, servers.workdir, load.headers
        )
        after = _histogram_sums(port, BATCH_FAMILY, model.name)
        runs_after = _histogram_sums(port, RUN_FAMILY, model.name)
        batches = after["count"] - before["count"]
        return {
            "command": "mcp-agent "
            + " ".join(
                a if a not in (str(model.path), str(port), str(state_dir)) else "…" for a in args
            ),
            "startup_s": round(startup, 2),
            "quiet_before": quiet,
            "check": check,
            "c64_wrk": c64,
            "c64_batches": {
                "batches": int(batches),
                "requests_per_batch": round((after["sum"] - before["sum"]) / batches, 2)
                if batches
                else None,
                "backend_run_us_mean": _run_us_between(runs_before, runs_after),
                "note": "from /metrics; includes wrk's warm-up run",
            },
        }


# ---------------------------------------------------------------------------- goals
def _goal(
    name: str,
    value: float | None,
    op: str,
    goal: float,
    inputs: dict[str, Any],
    why_missing: str = "",
) -> dict[str, Any]:
    if value is None:
        return {
            "name": name,
            "value": None,
            "goal": f"{op} {goal:g}",
            "pass": None,
            "inputs": inputs,
            "skipped": why_missing or "a figure it needs is missing (see inputs)",
        }
    return _ratio(name, value, op, goal, inputs)


def _why_missing(result: dict[str, Any], *keys: str) -> str:
    """Why the protocol entries ``keys`` do not give a figure."""
    p = result.get("protocols") or {}
    absent = [k for k in keys if k not in p]
    if absent:
        return (
            f"{', '.join(absent)} not measured in this run (see protocols_measured and "
            "processes_measured: --protocol, --processes)"
        )
    problems = [x for k in keys for x in p[k].get("problems", [])]
    return "; ".join(problems)[:600]


def _why_batching_missing(bt: dict[str, Any]) -> str:
    if "error" in bt:
        return str(bt["error"])[:600]
    found = []
    for mode in ("batching_on", "batching_off"):
        node = _get(bt, "agent", mode) or {}
        sub = node.get("c64_wrk") if "error" not in node else node
        if isinstance(sub, dict) and ("error" in sub or "skipped" in sub):
            found.append(f"{mode}: {sub.get('error') or sub.get('skipped')}")
    return "; ".join(found)[:600]


def _processes_ceiling(result: dict[str, Any]) -> dict[str, Any]:
    """What the cores of this machine allow ``--processes 2`` against one process, with the
    load generator on the same cores: every core busy, each request costing the server and
    wrk what they measured at p2."""
    cpu1 = _get(result, "protocol_runs", "p1", "agent", "loads", "http-json", "c64_wrk", "cpu")
    cpu2 = _get(result, "protocol_runs", "p2", "agent", "loads", "http-json", "c64_wrk", "cpu")
    p1 = _get(result, "protocols", "http-json/p1", "rps")
    if not isinstance(cpu1, dict) or not isinstance(cpu2, dict) or not p1:
        return {}
    server2, client2 = cpu2.get("server_us_per_request"), cpu2.get("client_us_per_request")
    cores = os.cpu_count() or 1
    ceiling = None
    if isinstance(server2, int | float) and isinstance(client2, int | float) and server2:
        ceiling = round(cores * 1e6 / (server2 + client2) / float(p1), 3)
    return {
        "p1_server_us_per_request": cpu1.get("server_us_per_request"),
        "p2_server_us_per_request": server2,
        "p2_wrk_us_per_request": client2,
        "p1_machine_busy_fraction": cpu1.get("machine_busy_fraction"),
        "p2_machine_busy_fraction": cpu2.get("machine_busy_fraction"),
        "ceiling_p2_over_p1_with_wrk_on_these_cores": ceiling,
    }


def goals(result: dict[str, Any]) -> list[dict[str, Any]]:
    p = result.get("protocols") or {}
    out: list[dict[str, Any]] = []
    j1 = p.get("http-json/p1") or {}
    out.append(
        _goal(
            "http_json.digits.c1_p50_over_null",
            j1.get("ratio_p50"),
            "<=",
            1.4,
            {
                "source": "protocols.http-json/p1",
                "agent_p50_us": j1.get("p50_us"),
                "null_p50_us": j1.get("baseline_p50_us"),
                "client": _get(j1, "client", "c1"),
                "agent": j1.get("agent_command"),
            },
            _why_missing(result, "http-json/p1"),
        )
    )
    out.append(
        _goal(
            "http_json.digits.c64_rps_over_null",
            j1.get("ratio_rps"),
            ">=",
            0.7,
            {
                "source": "protocols.http-json/p1",
                "agent_rps": j1.get("rps"),
                "null_rps": j1.get("baseline_rps"),
                "client": _get(j1, "client", "c64"),
            },
            _why_missing(result, "http-json/p1"),
        )
    )
    b1 = p.get("http-binary/p1") or {}
    out.append(
        _goal(
            "http_binary.convnet.c64_rps_over_json",
            b1.get("binary_over_json_rps"),
            ">=",
            1.5,
            {
                "source": "protocols.http-binary/p1 (one agent, the same model, wrk -t1 -c64)",
                "binary_rps": b1.get("rps"),
                "json_rps": b1.get("json_rps_same_model"),
                "binary_body_bytes": result.get("models", {})
                .get("convnet", {})
                .get("binary_request_body_bytes"),
                "json_body_bytes": result.get("models", {})
                .get("convnet", {})
                .get("request_body_bytes"),
            },
            _why_missing(result, "http-binary/p1"),
        )
    )
    g1 = p.get("grpc/p1") or {}
    out.append(
        _goal(
            "grpc.digits.c1_p50_over_null_servicer",
            g1.get("ratio_p50"),
            "<=",
            1.3,
            {
                "source": "protocols.grpc/p1",
                "agent_p50_us": g1.get("p50_us"),
                "null_servicer_p50_us": g1.get("baseline_p50_us"),
                "client": _get(g1, "client", "c1"),
            },
            _why_missing(result, "grpc/p1"),
        )
    )
    j2 = p.get("http-json/p2") or {}
    out.append(
        _goal(
            "http_json.digits.processes_2_over_1_rps",
            _div(j2.get("rps"), j1.get("rps")),
            ">=",
            1.6,
            {
                "source": "protocols.http-json/p2 and http-json/p1",
                "model": "digits",
                "agent": "mcp-agent serve --threads 1 --processes N (batching on)",
                "client": "wrk -t1 -c64",
                "p2_rps": j2.get("rps"),
                "p1_rps": j1.get("rps"),
                "null_p2_over_p1_rps": _div(j2.get("baseline_rps"), j1.get("baseline_rps")),
                **_processes_ceiling(result),
            },
            _why_missing(result, "http-json/p1", "http-json/p2"),
        )
    )
    bt = result.get("batching") or {}
    out.append(
        _goal(
            "batching.convnet_wide.dynamic_gain_over_offline_gain",
            bt.get("dynamic_over_offline"),
            ">=",
            0.6,
            {
                "source": "batching",
                "model": bt.get("model"),
                "offline_gain": bt.get("offline_gain"),
                "offline_gain_is": "session.run batch-1 time / (batch-32 time / 32), profile "
                "threads",
                "dynamic_gain": bt.get("dynamic_gain"),
                "dynamic_gain_is": "agent c64 rps batching on / --no-batching (binary body, "
                "wrk -t1 -c64)",
                "on_rps": _get(bt, "agent", "batching_on", "c64_wrk", "rps"),
                "off_rps": _get(bt, "agent", "batching_off", "c64_wrk", "rps"),
                "session_run_batch1_p50_us": _get(bt, "session_run", "batch1_us", "p50"),
            },
            _why_batching_missing(bt),
        )
    )
    return out


# ---------------------------------------------------------------------------- main
def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {"python": platform.python_version()}
    for dist in (
        "onnxruntime",
        "aiohttp",
        "uvloop",
        "orjson",
        "numpy",
        "psutil",
        "grpcio",
        "tritonclient",
        "mcp-edge",
    ):
        try:
            found[dist] = version(dist)
        except PackageNotFoundError:
            found[dist] = "not installed"
    return found


def _request_body(model: BenchModel) -> bytes:
    tensor = {
        "name": model.input_name,
        "shape": list(model.sample.shape),
        "datatype": "FP32",
        "data": [round(float(v), 6) for v in model.sample.reshape(-1)],
    }
    return orjson.dumps({"inputs": [tensor]})


def _tools() -> dict[str, Any]:
    return {
        "wrk": ensure_tool("wrk", "wrk", "-v"),
        "h2load": ensure_tool("h2load", "nghttp2-client", "--version"),
    }


def run(
    plan: Plan,
    protocols: list[str] | None = None,
    processes: list[int] | None = None,
) -> dict[str, Any]:
    t_start = time.monotonic()
    protocols = list(protocols or PROTOCOLS)
    processes = list(processes or DEFAULT_PROCESSES)
    tool_info = _tools()
    tools: dict[str, str | None] = {k: v.get("path") for k, v in tool_info.items()}
    settings = profile_session_settings()
    result: dict[str, Any] = {
        "bench": "local_inference",
        "mode": plan.mode,
        "started_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "loadavg_start": [round(x, 2) for x in os.getloadavg()],
            "pinning": "none",
        },
        "versions": _versions(),
        "client": plan.client(),
        "units": "latency in µs; rps = 200 answers per second; rss in MiB",
        "protocols_measured": protocols,
        "processes_measured": processes,
    }
    result["client"]["wrk"] = tool_info["wrk"]
    result["client"]["h2load"] = tool_info["h2load"]
    result["client"]["grpc"] = {
        "c1": "python-grpc-sync: bench/_grpc_load.py client, one process, a sync grpc channel "
        "and the generated stub, one pre-built ModelInferRequest (raw_input_contents)",
        "c64": "h2load -t1 -c64 -m1 (h2c; POST with content-type application/grpc, te "
        "trailers, body = 1 flag byte + 4-byte big-endian length + the serialized request)"
        if tools["h2load"]
        else "python-grpc-aio: bench/_grpc_load.py aio-client, 64 calls in flight over 64 "
        "channels (h2load is not available)",
    }
    with tempfile.TemporaryDirectory(prefix="mcp-bench-") as tmp_name:
        tmp = Path(tmp_name)
        models = [make_digits(tmp), make_convnet(tmp)]
        bodies: dict[str, Path] = {}
        expected: dict[str, np.ndarray] = {}
        binary_loads: dict[str, HttpLoad] = {}
        for m in models:
            bodies[m.name] = tmp / f"{m.name}.body.json"
            bodies[m.name].write_bytes(_request_body(m))
            sess = _session(m.path, settings)
            rows = np.asarray(
                orjson.loads(bodies[m.name].read_bytes())["inputs"][0]["data"], dtype=np.float32
            ).reshape(m.sample.shape)
            expected[m.name] = sess.run(None, {m.input_name: rows})[0]
            # What a binary-extension or gRPC request (the raw FP32 sample) should get.
            expected[m.name + ".raw"] = sess.run(None, {m.input_name: m.sample})[0]
            bin_body, bin_headers = _binary_body(m)
            bin_file = tmp / f"{m.name}.body.bin"
            bin_file.write_bytes(bin_body)
            binary_loads[m.name] = HttpLoad(m.name, bin_file, bin_headers)
            np.save(tmp / f"{m.name}.sample.npy", m.sample)
            np.save(tmp / f"{m.name}.expected.npy", expected[m.name + ".raw"])
        result["models"] = {
            m.name: {
                "description": m.description,
                "input_shape": list(m.sample.shape),
                "file_bytes": m.path.stat().st_size,
                "request_body_bytes": bodies[m.name].stat().st_size,
                "binary_request_body_bytes": binary_loads[m.name].body_file.stat().st_size,
            }
            for m in models
        }
        result["session_run"] = {"options": settings} | {
            m.name: bench_session_run(m, settings, plan) for m in models
        }
        servers = Servers(tmp)
        wrk = tools["wrk"]
        try:
            result["null_handler"] = [bench_null(servers, models, bodies, plan, 0, wrk)]
            result["agent"] = {}
            for m in models:
                result["agent"][m.name] = {
                    f"batching_{'on' if on else 'off'}": bench_agent(
                        servers,
                        m,
                        bodies[m.name],
                        expected[m.name],
                        on,
                        plan,
                        tmp / "state",
                        wrk=wrk,
                    )
                    for on in (True, False)
                }
            for i in range(1, plan.null_repeats):
                result["null_handler"].append(bench_null(servers, models, bodies, plan, i, wrk))
            if plan.diagnostics:
                # Same as the default digits run but one onnxruntime thread: shows what the
                # profile's intra-op pool (spinning threads on a 2-core box) costs.
                digits = models[0]
                result["diagnostics"] = {
                    "digits_batching_on_threads_1": bench_agent(
                        servers,
                        digits,
                        bodies[digits.name],
                        expected[digits.name],
                        True,
                        plan,
                        tmp / "state",
                        ("--threads", "1"),
                        wrk=wrk,
                    )
                }
            # Protocols and serving processes: one agent serving digits and the conv net.
            models_dir = tmp / "protocol-models"
            models_dir.mkdir()
            for m in models:
                os.link(m.path, models_dir / m.path.name)
            http_loads = {
                "http-json": HttpLoad("digits", bodies["digits"], {}),
                "http-binary": binary_loads["convnet"],
                "http-json-convnet": HttpLoad("convnet", bodies["convnet"], {}),
            }
            grpc_model = PROTOCOL_MODEL["grpc"]
            h2_body = tmp / f"{grpc_model}.grpc.h2"
            grpc_load = GrpcLoad(
                grpc_model,
                "input",
                tmp / f"{grpc_model}.sample.npy",
                tmp / f"{grpc_model}.expected.npy",
                h2_body,
            )
            if "grpc" in protocols:
                subprocess.run(
                    [sys.executable, str(BENCH_DIR / "_grpc_load.py"), "h2-body", "--model",
                     grpc_model, "--input", "input", "--sample", str(grpc_load.sample_file),
                     "--out", str(h2_body)],
                    check=True, capture_output=True, timeout=60,
                )  # fmt: skip
            result["protocol_runs"] = bench_protocols(
                servers,
                plan,
                protocols,
                processes,
                http_loads,
                grpc_load,
                models_dir,
                expected,
                tmp / "state",
                tools,
            )
            # Dynamic batching on a compute-bound model.
            wide = make_wide_convnet(tmp)
            result["batching"] = _try(
                bench_batching, servers, plan, wide, settings, tmp / "state", wrk
            )
        finally:
            servers.stop_all()
    result["ratios"] = ratios(result)
    result["protocols"] = protocol_summary(result)
    result["goals"] = goals(result)
    result["summary"] = {r["name"]: r["pass"] for r in result["ratios"] if r["pass"] is not None}
    result["summary"] |= {g["name"]: g["pass"] for g in result["goals"] if g["pass"] is not None}
    result["goals_skipped"] = {g["name"]: g["skipped"] for g in result["goals"] if "skipped" in g}
    result["disturbed_runs"] = _disturbed(result)
    result["table"] = _table(result)
    result["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    result["wall_s"] = round(time.monotonic() - t_start, 1)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="~2 min smoke run")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    parser.add_argument(
        "--protocol",
        action="append",
        metavar="P[,P]",
        help=f"protocols to measure, repeatable or a comma list: {', '.join(PROTOCOLS)} "
        "(default: all)",
    )
    parser.add_argument(
        "--processes",
        action="append",
        metavar="N[,N]",
        help="serving-process counts to measure each protocol at, repeatable or a comma list "
        "(default: 1,2)",
    )
    args = parser.parse_args(argv)
    protocols: list[str] = []
    for item in args.protocol or []:
        for name in filter(None, (x.strip() for x in item.split(","))):
            if name not in PROTOCOLS:
                parser.error(f"--protocol {name!r}: choose from {', '.join(PROTOCOLS)}")
            if name not in protocols:
                protocols.append(name)
    processes: list[int] = []
    for item in args.processes or []:
        for text in filter(None, (x.strip() for x in item.split(","))):
            if not text.isdigit() or not 1 <= int(text) <= 8:
                parser.error(f"--processes {text!r}: a count from 1 to 8")
            if int(text) not in processes:
                processes.append(int(text))

    def _terminate(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)  # unwinds through the finally blocks that stop servers

    signal.signal(signal.SIGTERM, _terminate)
    result = run(QUICK if args.quick else FULL, protocols or None, processes or None)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
