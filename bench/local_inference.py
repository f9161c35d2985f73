"""Local inference bench: the agent's HTTP server against its floors, measured in one run.

Baselines measured in the same run, on the same machine, with the same client:

1. raw ``onnxruntime`` ``session.run`` per call (batch 1, and batch 32 per item), with the
   session options the agent's hardware profile gives (and, for reference, intra-op threads 1);
2. a null-handler aiohttp server (uvloop, same route, same body read + orjson parse, fixed
   OIP-shaped answer, no model): latency at concurrency 1, throughput at concurrency 64;
3. ``mcp-agent serve`` for the digits MLP and a small conv net, batching on and off: the same
   two loads, plus its RSS, CPU per request and how many requests it merged per batch.

Then the ratios the design asks of the agent, each with its goal and a pass flag. Prints one
JSON document (and writes it to ``--out``). ``--quick`` is a ~30 s smoke run.

    .venv/bin/python bench/local_inference.py [--quick] [--out FILE]
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
    run_client,
    stop_process,
    wait_ready,
)
from _models import BenchModel, make_convnet, make_digits  # noqa: E402

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
            "c1": {
                "warmup_s": self.c1_warmup_s,
                "requests": self.c1_requests,
                "max_s": self.c1_max_s,
            },
            "c64": {"warmup_s": self.c64_warmup_s, "duration_s": self.c64_s},
        }


FULL = Plan("full", 1.0, 5000, 5.0, 1.5, 5.0, 20000, 2.0, 2, 15.0, True)
QUICK = Plan("quick", 0.3, 800, 1.5, 0.5, 1.5, 3000, 0.5, 1, 3.0, False)


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
    for _ in range(min(200, calls)):
        session.run(out, feeds)
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


class Servers:
    """Starts servers as subprocesses and makes sure every one is gone at exit."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.live: list[subprocess.Popen[bytes]] = []

    @contextlib.contextmanager
    def start(
        self, label: str, cmd: list[str], port: int
    ) -> Iterator[tuple[subprocess.Popen[bytes], float]]:
        log = self.workdir / f"{label}.log"
        with open(log, "wb") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
        self.live.append(proc)
        try:
            try:
                startup = wait_ready(proc, port, READY_PATH, STARTUP_TIMEOUT_S)
            except RuntimeError as e:
                raise RuntimeError(f"{label}: {e}\n{_tail(log)}") from None
            yield proc, startup
        finally:
            stop_process(proc)
            self.live.remove(proc)

    def stop_all(self) -> None:
        for proc in list(self.live):
            stop_process(proc)
        self.live.clear()


def _loads(port: int, path: str, body_file: Path, pid: int, plan: Plan) -> dict[str, Any]:
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
    return {"c1": c1, "c64": c64}


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
    servers: Servers, models: list[BenchModel], bodies: dict[str, Path], plan: Plan, repeat: int
) -> dict[str, Any]:
    quiet = wait_quiet(plan.quiet_wait_s)
    port = free_port()
    cmd = [sys.executable, str(BENCH_DIR / "_load.py"), "null-server", "--port", str(port)]
    with servers.start(f"null-{repeat}", cmd, port) as (proc, startup):
        runs = {
            m.name: _loads(port, f"/v2/models/{m.name}/infer", bodies[m.name], proc.pid, plan)
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

    for key in ("null_handler", "agent", "diagnostics"):
        visit(result.get(key), key)
    return found


# ---------------------------------------------------------------------------- main
def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {"python": platform.python_version()}
    for dist in ("onnxruntime", "aiohttp", "uvloop", "orjson", "numpy", "psutil", "mcp-edge"):
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


def run(plan: Plan) -> dict[str, Any]:
    t_start = time.monotonic()
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
    }
    with tempfile.TemporaryDirectory(prefix="mcp-bench-") as tmp_name:
        tmp = Path(tmp_name)
        models = [make_digits(tmp), make_convnet(tmp)]
        bodies: dict[str, Path] = {}
        expected: dict[str, np.ndarray] = {}
        for m in models:
            bodies[m.name] = tmp / f"{m.name}.body.json"
            bodies[m.name].write_bytes(_request_body(m))
            sess = _session(m.path, settings)
            rows = np.asarray(
                orjson.loads(bodies[m.name].read_bytes())["inputs"][0]["data"], dtype=np.float32
            ).reshape(m.sample.shape)
            expected[m.name] = sess.run(None, {m.input_name: rows})[0]
        result["models"] = {
            m.name: {
                "description": m.description,
                "input_shape": list(m.sample.shape),
                "file_bytes": m.path.stat().st_size,
                "request_body_bytes": bodies[m.name].stat().st_size,
            }
            for m in models
        }
        result["session_run"] = {"options": settings} | {
            m.name: bench_session_run(m, settings, plan) for m in models
        }
        servers = Servers(tmp)
        try:
            result["null_handler"] = [bench_null(servers, models, bodies, plan, 0)]
            result["agent"] = {}
            for m in models:
                result["agent"][m.name] = {
                    f"batching_{'on' if on else 'off'}": bench_agent(
                        servers, m, bodies[m.name], expected[m.name], on, plan, tmp / "state"
                    )
                    for on in (True, False)
                }
            for i in range(1, plan.null_repeats):
                result["null_handler"].append(bench_null(servers, models, bodies, plan, i))
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
                    )
                }
        finally:
            servers.stop_all()
    result["ratios"] = ratios(result)
    result["summary"] = {r["name"]: r["pass"] for r in result["ratios"] if r["pass"] is not None}
    result["disturbed_runs"] = _disturbed(result)
    result["table"] = _table(result)
    result["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    result["wall_s"] = round(time.monotonic() - t_start, 1)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="~30 s smoke run")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)

    def _terminate(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)  # unwinds through the finally blocks that stop servers

    signal.signal(signal.SIGTERM, _terminate)
    result = run(QUICK if args.quick else FULL)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
