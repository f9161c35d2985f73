"""Fleet path bench: MQTT inference and telemetry ingest against raw paho, measured in one run.

Everything goes through one Mosquitto started here (anonymous, ``set_tcp_nodelay true``,
127.0.0.1), with the baselines measured in the same run, on the same machine:

1. MQTT inference round trip, one request in flight, QoS 0 and QoS 1. Baseline: a raw paho
   MQTT 5 responder (separate process) that answers on the request's ResponseTopic with its
   CorrelationData and a fixed answer shaped like the agent's. Under test: the agent's
   ``FleetSession`` + ``ModelManager`` serving the digits ONNX model (separate process, built as
   ``mcp-agent run`` builds them). The client is the same for both: ``InferenceClient.infer_raw``
   with the same pre-encoded body, in its own process. Plus raw ``session.run`` for the model.
2. Telemetry, QoS 1, ~256-byte ``HealthSample`` JSON from a raw paho publisher (separate
   process). Baseline: a raw paho subscriber on the ingest filter counting what it receives.
   Under test: ``controlplane.ingest.IngestService`` committing to SQLite (and PostgreSQL when
   ``MCP_TEST_POSTGRES_URL`` names a server: a throw-away database, dropped after), rows
   counted in the database afterwards.

Prints one JSON document (and writes it to ``--out``); ``--quick`` is a ~40 s smoke run.

    .venv/bin/python bench/fleet_path.py [--quick] [--out FILE] [--max-queued-messages N]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import secrets
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
for _p in (str(BENCH_DIR), str(REPO_ROOT)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import numpy as np  # noqa: E402
import orjson  # noqa: E402
import psutil  # noqa: E402
from _load import stop_process  # noqa: E402
from _models import make_digits  # noqa: E402
from local_inference import (  # noqa: E402
    _session,
    _time_calls,
    profile_session_settings,
    wait_quiet,
)

from mcp_edge.tooling.mosquitto import MosquittoBroker  # noqa: E402

POSTGRES_URL_ENV = "MCP_TEST_POSTGRES_URL"
READY_TIMEOUT_S = 60.0
DEVICE = "bench-dev"
ECHO_DEVICE = "bench-echo"
MODEL = "digits"
MOSQUITTO_DEFAULT_MAX_QUEUED = 1000


@dataclass(frozen=True)
class Plan:
    """Sizes and bounds of one run."""

    mode: str
    rtt_requests: int
    rtt_warmup_s: float
    rtt_max_s: float
    rounds: int
    """Inference runs per (target, QoS); ratios use the best p50 of each."""
    messages: int
    """Health samples per telemetry run."""
    ort_calls: int
    quiet_wait_s: float


FULL = Plan("full", 4000, 1.0, 6.0, 2, 30_000, 20_000, 10.0)
QUICK = Plan("quick", 800, 0.3, 2.0, 1, 5_000, 3000, 1.0)


class BenchBroker(MosquittoBroker):
    """The tests' anonymous broker, plus ``extra`` config lines (e.g. ``max_queued_messages``)."""

    def __init__(self, workdir: Path, extra: list[str]) -> None:
        super().__init__(workdir)
        self.extra = extra

    def _config_lines(self) -> list[str]:
        return [*super()._config_lines(), *self.extra]


# ---------------------------------------------------------------------------- processes
class Procs:
    """Role processes of ``_fleet.py``; every one is stopped at exit (``stop_all`` in finally)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.live: list[subprocess.Popen[bytes]] = []

    def start(self, label: str, role: str, *args: str, ready: bool) -> subprocess.Popen[bytes]:
        log = open(self.workdir / f"{label}.log", "wb")  # noqa: SIM115 - closed with the process
        cmd = [sys.executable, str(BENCH_DIR / "_fleet.py"), role, *args]
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL, cwd=REPO_ROOT
        )
        log.close()
        proc.label = label  # type: ignore[attr-defined]
        self.live.append(proc)
        if ready:
            self._wait_ready(proc)
        return proc

    def _wait_ready(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            r, _, _ = select.select([proc.stdout], [], [], 0.2)
            if r:
                line = proc.stdout.readline()
                if line.strip() == b"READY":
                    return
                if not line:
                    break
            elif proc.poll() is not None:
                break
        self.stop(proc)
        raise RuntimeError(f"{proc.label} did not get ready:\n{self.tail(proc)}")  # type: ignore[attr-defined]

    def result(self, proc: subprocess.Popen[bytes], timeout_s: float) -> dict[str, Any]:
        """Wait (bounded) for a role's final JSON line."""
        try:
            out, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.stop(proc)
            raise RuntimeError(f"{proc.label} ran past {timeout_s} s:\n{self.tail(proc)}") from None  # type: ignore[attr-defined]
        self.live.remove(proc)
        lines = [x for x in out.decode().splitlines() if x.startswith("{")]
        if proc.returncode != 0 or not lines:
            raise RuntimeError(
                f"{proc.label} exited {proc.returncode}:\n{self.tail(proc)}"  # type: ignore[attr-defined]
            )
        doc: dict[str, Any] = json.loads(lines[-1])
        return doc

    def finish(self, proc: subprocess.Popen[bytes], timeout_s: float = 15.0) -> dict[str, Any]:
        """SIGTERM a long-running role and collect its final JSON line."""
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        return self.result(proc, timeout_s)

    def tail(self, proc: subprocess.Popen[bytes], n: int = 3000) -> str:
        with contextlib.suppress(OSError):
            return (self.workdir / f"{proc.label}.log").read_text(errors="replace")[-n:]  # type: ignore[attr-defined]
        return ""

    def stop(self, proc: subprocess.Popen[bytes]) -> None:
        stop_process(proc)
        if proc in self.live:
            self.live.remove(proc)

    def stop_all(self) -> None:
        for proc in list(self.live):
            self.stop(proc)


class CpuWindow:
    """Machine CPU over a window, split into this run's processes and everything else.

    Processes reaped during the window count through ``os.times()`` (children), live ones
    (broker, responders) through psutil. ``other_cores`` > 0.3 or ``steal_cores`` > 0.15 marks
    the window disturbed, as in ``local_inference.py``.
    """

    _BUSY = ("user", "nice", "system", "irq", "softirq")

    def __init__(self, live_pids: list[int]) -> None:
        self.pids = live_pids
        self.start = self._sample()

    def _sample(self) -> dict[str, float]:
        total = psutil.cpu_times()
        t = os.times()
        own = 0.0
        for pid in [os.getpid(), *self.pids]:
            with contextlib.suppress(psutil.Error):
                c = psutil.Process(pid).cpu_times()
                own += c.user + c.system
        return {
            "wall": time.monotonic(),
            "busy": sum(getattr(total, f, 0.0) for f in self._BUSY),
            "steal": getattr(total, "steal", 0.0),
            "ours": own + t.children_user + t.children_system,
        }

    def end(self) -> dict[str, Any]:
        e = self._sample()
        s = self.start
        wall = max(1e-9, e["wall"] - s["wall"])
        busy = e["busy"] - s["busy"]
        ours = e["ours"] - s["ours"]
        other = (busy - ours) / wall
        steal = (e["steal"] - s["steal"]) / wall
        return {
            "seconds": round(wall, 2),
            "machine_busy_cores": round(busy / wall, 2),
            "bench_cores": round(ours / wall, 2),
            "other_cores": round(other, 2),
            "steal_cores": round(steal, 2),
            "disturbed": other > 0.3 or steal > 0.15,
        }


# ---------------------------------------------------------------------------- inference
def _answer_like_agent(probs: np.ndarray) -> bytes:
    """The fixed answer of the echo responder: the agent's answer shape for one row."""
    return orjson.dumps(
        {
            "model_name": MODEL,
            "model_version": "1",
            "outputs": [
                {
                    "name": "probabilities",
                    "datatype": "FP32",
                    "shape": list(probs.shape),
                    "data": [float(v) for v in probs.reshape(-1)],
                }
            ],
        }
    )


def _rtt(
    procs: Procs,
    port: int,
    device: str,
    qos: int,
    body: Path,
    plan: Plan,
    label: str,
    live: list[int],
    save_reply: Path | None = None,
) -> dict[str, Any]:
    args = [
        "--port",
        str(port),
        "--device",
        device,
        "--model",
        MODEL,
        "--body-file",
        str(body),
        "--qos",
        str(qos),
        "--requests",
        str(plan.rtt_requests),
        "--warmup-s",
        str(plan.rtt_warmup_s),
        "--max-s",
        str(plan.rtt_max_s),
    ]
    if save_reply is not None:
        args += ["--save-reply", str(save_reply)]
    cpu = CpuWindow(live)
    before = {pid: _proc_cpu_s(pid) for pid in live}
    proc = procs.start(label, "rtt", *args, ready=False)
    result = procs.result(proc, plan.rtt_warmup_s + plan.rtt_max_s + 60)
    result["cpu"] = cpu.end()
    # The window covers the client's start-up and warm-up too: divide by every request sent.
    n = max(1, result["requests"] + result["warmup_requests"])
    names = {live[0]: "broker", live[1]: "responder"}
    for pid, name in names.items():
        result["cpu"][f"{name}_us_per_request"] = round(
            (_proc_cpu_s(pid) - before[pid]) / n * 1e6, 1
        )
    result["cpu"]["client_us_per_request"] = result.pop("client_cpu_us_per_request")
    return result


def _proc_cpu_s(pid: int) -> float:
    with contextlib.suppress(psutil.Error):
        t = psutil.Process(pid).cpu_times()
        return float(t.user + t.system)
    return 0.0


def bench_inference(procs: Procs, broker: MosquittoBroker, tmp: Path, plan: Plan) -> dict[str, Any]:
    settings = profile_session_settings()
    model = make_digits(tmp)
    sess = _session(model.path, settings)
    feeds = {model.input_name: model.sample}
    expected = np.asarray(sess.run(None, feeds)[0], dtype=np.float32)
    session_run = _time_calls(sess, feeds, plan.ort_calls, 2.0)
    del sess

    body = tmp / "infer.body.json"
    body.write_bytes(
        orjson.dumps(
            {
                "inputs": [
                    {
                        "name": model.input_name,
                        "shape": list(model.sample.shape),
                        "datatype": "FP32",
                        "data": [round(float(v), 6) for v in model.sample.reshape(-1)],
                    }
                ]
            }
        )
    )
    answer = tmp / "echo.answer.json"
    answer.write_bytes(_answer_like_agent(expected))
    port = str(broker.port)
    quiet = wait_quiet(plan.quiet_wait_s)
    echo = procs.start(
        "echo",
        "echo",
        "--port",
        port,
        "--device",
        ECHO_DEVICE,
        "--model",
        MODEL,
        "--answer-file",
        str(answer),
        "--max-s",
        "600",
        ready=True,
    )
    t0 = time.monotonic()
    agent = procs.start(
        "agent",
        "agent",
        "--port",
        port,
        "--device",
        DEVICE,
        "--model",
        MODEL,
        "--model-path",
        str(model.path),
        "--max-s",
        "600",
        ready=True,
    )
    agent_startup = time.monotonic() - t0
    runs: dict[str, list[dict[str, Any]]] = {}
    reply_file = tmp / "agent.reply.json"
    for rnd in range(plan.rounds):
        for qos in (0, 1):
            for target, device in (("echo", ECHO_DEVICE), ("agent", DEVICE)):
                save = reply_file if (target == "agent" and rnd == 0 and qos == 1) else None
                responder = echo if target == "echo" else agent
                live = [broker.pid, responder.pid, (agent if target == "echo" else echo).pid]
                runs.setdefault(f"{target}.qos{qos}", []).append(
                    _rtt(
                        procs,
                        broker.port,
                        device,
                        qos,
                        body,
                        plan,
                        f"rtt-{target}-q{qos}-{rnd}",
                        live,
                        save,
                    )
                )
    rss = {
        "agent": round(psutil.Process(agent.pid).memory_info().rss / 2**20, 1),
        "echo": round(psutil.Process(echo.pid).memory_info().rss / 2**20, 1),
    }
    agent_end = procs.finish(agent)
    echo_end = procs.finish(echo)
    reply = orjson.loads(reply_file.read_bytes())
    got = np.asarray(reply["outputs"][0]["data"], np.float32).reshape(expected.shape)
    return {
        "model": {
            "name": MODEL,
            "path": "digits.onnx (built at run time)",
            "description": model.description,
        },
        "session_run_us": {"settings": settings, **session_run},
        "quiet_before": quiet,
        "agent_startup_s": round(agent_startup, 2),
        "check": {
            "agent_outputs_match_onnxruntime": bool(
                np.allclose(got, expected, rtol=1e-4, atol=1e-6)
            ),
            "agent_profile": agent_end.get("profile"),
            "agent_counters": agent_end.get("counters"),
            "echo_counters": echo_end,
        },
        "rss_mib": rss,
        "runs": runs,
    }


def _best_p50(runs: list[dict[str, Any]]) -> float:
    return float(min(r["latency_us"]["p50"] for r in runs))


def _best_p99(runs: list[dict[str, Any]]) -> float:
    return float(min(r["latency_us"]["p99"] for r in runs))


# ---------------------------------------------------------------------------- telemetry
@contextlib.contextmanager
def postgres_database(server_url: str) -> Iterator[str]:
    """A throw-away database on ``server_url``, dropped afterwards (as tests/conftest.py does)."""
    import psycopg
    from psycopg import sql

    name = f"mcp_bench_{secrets.token_hex(6)}"
    with psycopg.connect(server_url, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield urlunsplit(urlsplit(server_url)._replace(path="/" + name))
    finally:
        with psycopg.connect(server_url, autocommit=True) as admin:
            admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


def _publish(procs: Procs, port: int, plan: Plan, tag: str) -> dict[str, Any]:
    proc = procs.start(
        f"publish-{tag}",
        "publish",
        "--port",
        str(port),
        "--count",
        str(plan.messages),
        "--qos",
        "1",
        "--tag",
        tag,
        "--max-s",
        "90",
        ready=False,
    )
    return procs.result(proc, 120)


def _telemetry_run(
    procs: Procs, broker: MosquittoBroker, plan: Plan, tag: str, role: str, *extra: str
) -> dict[str, Any]:
    quiet = wait_quiet(plan.quiet_wait_s)
    log_before = len(broker.log_text())
    sub = procs.start(
        f"{role}-{tag}",
        role,
        "--port",
        str(broker.port),
        "--expect",
        str(plan.messages),
        "--tag",
        tag,
        "--max-s",
        "120",
        *extra,
        ready=True,
    )
    cpu = CpuWindow([broker.pid, sub.pid])
    pub = _publish(procs, broker.port, plan, tag)
    got = procs.result(sub, 150)
    broker_log = broker.log_text()[log_before:]
    return {
        "quiet_before": quiet,
        "publisher": pub,
        "subscriber": got,
        "cpu": cpu.end(),
        "broker_drop_lines": [line for line in broker_log.splitlines() if "drop" in line.lower()][
            :5
        ],
    }


def bench_telemetry(
    procs: Procs, broker: MosquittoBroker, tmp: Path, plan: Plan, tag: str
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "broker_extra_config": getattr(broker, "extra", []),
        "raw_paho": _telemetry_run(procs, broker, plan, f"raw-{tag}", "subscribe"),
    }
    databases: list[tuple[str, contextlib.AbstractContextManager[str]]] = [
        ("sqlite", contextlib.nullcontext(f"sqlite:///{tmp / f'ingest-{tag}.db'}"))
    ]
    server = os.environ.get(POSTGRES_URL_ENV)
    if server:
        databases.append(("postgresql", postgres_database(server)))
    out["ingest"] = {}
    for name, db in databases:
        with db as url:
            run = _telemetry_run(procs, broker, plan, f"{name}-{tag}", "ingest", "--db-url", url)
        sub = run["subscriber"]
        sub["lost"] = run["publisher"]["acked"] - sub["rows_in_db"]
        out["ingest"][name] = run
    if not server:
        out["ingest"]["postgresql"] = {"skipped": f"{POSTGRES_URL_ENV} is not set"}
    return out


# ---------------------------------------------------------------------------- ratios
def _ratio(
    name: str, value: float, op: str, goal: float | None, inputs: dict[str, Any]
) -> dict[str, Any]:
    ok = None if goal is None else (value <= goal if op == "<=" else value >= goal)
    return {
        "name": name,
        "value": round(value, 3),
        "goal": None if goal is None else f"{op} {goal:g}",
        "pass": ok,
        "inputs": inputs,
    }


def ratios(result: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    inf = result["inference"]
    runs = inf["runs"]
    ort = inf["session_run_us"]["p50"]
    for qos in (0, 1):
        echo = _best_p50(runs[f"echo.qos{qos}"])
        agent = _best_p50(runs[f"agent.qos{qos}"])
        out.append(
            _ratio(
                f"inference.qos{qos}.agent_p50_over_echo_plus_session_run",
                agent / (echo + ort),
                "<=",
                1.5,
                {"agent_p50_us": agent, "echo_p50_us": echo, "session_run_p50_us": ort},
            )
        )
    a0, a1 = _best_p50(runs["agent.qos0"]), _best_p50(runs["agent.qos1"])
    out.append(
        _ratio(
            "inference.agent_qos1_p50_over_qos0_p50",
            a1 / a0,
            "<=",
            1.3,
            {"qos1_p50_us": a1, "qos0_p50_us": a0},
        )
    )
    e0, e1 = _best_p50(runs["echo.qos0"]), _best_p50(runs["echo.qos1"])
    out.append(
        _ratio(
            "inference.echo_qos1_p50_over_qos0_p50",
            e1 / e0,
            "<=",
            None,
            {"qos1_p50_us": e1, "qos0_p50_us": e0},
        )
    )
    for cfg, tel in result["telemetry"].items():
        raw = tel["raw_paho"]["subscriber"]
        for name, run in tel["ingest"].items():
            if "skipped" in run:
                continue
            sub = run["subscriber"]
            # The goal holds for the deployed broker config (raised_queue); with Mosquitto's
            # built-in queue limit the broker itself drops a burst, for raw paho too.
            goal = 0.5 if cfg == "raised_queue" else None
            r = _ratio(
                f"telemetry.{cfg}.{name}.committed_over_raw_receive",
                sub["committed_per_s"] / raw["msgs_per_s"] if raw["msgs_per_s"] else 0.0,
                ">=",
                goal,
                {
                    "broker_extra_config": tel["broker_extra_config"],
                    "committed_per_s": sub["committed_per_s"],
                    "raw_receive_per_s": raw["msgs_per_s"],
                    "raw_lost": tel["raw_paho"]["publisher"]["acked"] - raw["received"],
                    "published": run["publisher"]["acked"],
                    "rows_in_db": sub["rows_in_db"],
                    "lost": sub["lost"],
                },
            )
            if goal is not None:
                r["pass"] = bool(r["pass"]) and sub["lost"] == 0
                r["goal"] += " and lost == 0"
            out.append(r)
    return out


def _table(result: dict[str, Any]) -> dict[str, Any]:
    rows: dict[str, Any] = {"session_run_us_p50": result["inference"]["session_run_us"]["p50"]}
    for key, runs in result["inference"]["runs"].items():
        rows[f"inference.{key}"] = {
            "p50_us": [r["latency_us"]["p50"] for r in runs],
            "p99_us": [r["latency_us"]["p99"] for r in runs],
            "best_p50_us": _best_p50(runs),
            "best_p99_us": _best_p99(runs),
        }
    for cfg, tel in result["telemetry"].items():
        raw = tel["raw_paho"]
        rows[f"telemetry.{cfg}.raw_paho"] = {
            "published_per_s": raw["publisher"]["msgs_per_s"],
            "received_per_s": raw["subscriber"]["msgs_per_s"],
            "published": raw["publisher"]["acked"],
            "received": raw["subscriber"]["received"],
            "lost": raw["publisher"]["acked"] - raw["subscriber"]["received"],
        }
        for name, run in tel["ingest"].items():
            if "skipped" in run:
                continue
            sub = run["subscriber"]
            rows[f"telemetry.{cfg}.ingest.{name}"] = {
                "published_per_s": run["publisher"]["msgs_per_s"],
                "received_per_s": sub["received_per_s"],
                "committed_per_s": sub["committed_per_s"],
                "published": run["publisher"]["acked"],
                "rows_in_db": sub["rows_in_db"],
                "lost": sub["lost"],
                "rows_per_flush": sub["rows_per_flush"],
            }
    return rows


def _disturbed(result: dict[str, Any]) -> list[str]:
    found: list[str] = []

    def visit(node: Any, path: str) -> None:
        if isinstance(node, dict):
            cpu = node.get("cpu")
            if isinstance(cpu, dict) and cpu.get("disturbed"):
                found.append(
                    f"{path} (other {cpu['other_cores']} cores, steal {cpu['steal_cores']} cores)"
                )
            for k, v in node.items():
                visit(v, f"{path}.{k}" if path else k)
        elif isinstance(node, list):
            for i, v in enumerate(node):
                visit(v, f"{path}[{i}]")

    visit(result.get("inference", {}).get("runs"), "inference.runs")
    visit(result.get("telemetry"), "telemetry")
    return found


# ---------------------------------------------------------------------------- main
def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {"python": platform.python_version()}
    for dist in (
        "paho-mqtt",
        "onnxruntime",
        "sqlalchemy",
        "aiosqlite",
        "asyncpg",
        "psycopg",
        "uvloop",
        "mcp-edge",
    ):
        try:
            found[dist] = version(dist)
        except PackageNotFoundError:
            found[dist] = "not installed"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        from mcp_edge.tooling.mosquitto import find_executable

        out = subprocess.run(
            [str(find_executable("mosquitto")), "-h"], capture_output=True, timeout=10, check=False
        )
        found["mosquitto"] = out.stdout.decode().splitlines()[0].split()[-1]
    return found


def run(plan: Plan, max_queued: int) -> dict[str, Any]:
    t_start = time.monotonic()
    raised = [f"max_queued_messages {max_queued}"]
    result: dict[str, Any] = {
        "bench": "fleet_path",
        "mode": plan.mode,
        "started_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "loadavg_start": [round(x, 2) for x in os.getloadavg()],
            "pinning": "none",
        },
        "versions": _versions(),
        "broker": {
            "config": "mcp_edge.tooling.mosquitto MosquittoBroker: anonymous, set_tcp_nodelay "
            "true, persistence false, 127.0.0.1",
            "inference": "no extra config (Mosquitto defaults)",
            "telemetry": {
                "default_queue": f"Mosquitto's built-in max_queued_messages "
                f"{MOSQUITTO_DEFAULT_MAX_QUEUED} (informational: no goal)",
                "raised_queue": [*raised, "(deploy/mosquitto/mosquitto.conf sets 100000)"],
            },
            "max_inflight_messages": 20,
            "note": "a fresh broker per section (inference, each telemetry config)",
        },
        "plan": {
            "rtt_requests": plan.rtt_requests,
            "rtt_warmup_s": plan.rtt_warmup_s,
            "rtt_max_s": plan.rtt_max_s,
            "rounds": plan.rounds,
            "telemetry_messages": plan.messages,
            "publisher_inflight": 100,
        },
        "units": "latency in µs; rates in messages/s; rss in MiB",
    }
    with tempfile.TemporaryDirectory(prefix="mcp-bench-fleet-") as tmp_name:
        tmp = Path(tmp_name)
        procs = Procs(tmp)
        brokers: list[BenchBroker] = []

        def fresh_broker(name: str, extra: list[str]) -> BenchBroker:
            (tmp / name).mkdir()
            b = BenchBroker(tmp / name, extra)
            brokers.append(b)
            b.start()
            return b

        try:
            b = fresh_broker("broker-inference", [])
            result["inference"] = bench_inference(procs, b, tmp, plan)
            b.stop()
            result["telemetry"] = {}
            for cfg, extra in (("default_queue", []), ("raised_queue", raised)):
                b = fresh_broker(f"broker-{cfg}", extra)
                result["telemetry"][cfg] = bench_telemetry(procs, b, tmp, plan, cfg)
                b.stop()
        except BaseException:
            for b in brokers:
                sys.stderr.write(b.log_text()[-2000:])
            raise
        finally:
            procs.stop_all()
            for b in brokers:
                b.stop()
    result["ratios"] = ratios(result)
    result["summary"] = {
        r["name"]: {"value": r["value"], "goal": r["goal"], "pass": r["pass"]}
        for r in result["ratios"]
    }
    result["table"] = _table(result)
    result["disturbed_runs"] = _disturbed(result)
    result["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    result["duration_s"] = round(time.monotonic() - t_start, 1)
    return result


def _interrupt(_signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run, about 40 s")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    parser.add_argument(
        "--max-queued-messages",
        type=int,
        default=100_000,
        help="max_queued_messages of the raised_queue telemetry broker (default 100000); the "
        f"default_queue broker keeps Mosquitto's {MOSQUITTO_DEFAULT_MAX_QUEUED}",
    )
    args = parser.parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the finally blocks stop every process.
    signal.signal(signal.SIGTERM, _interrupt)
    result = run(QUICK if args.quick else FULL, args.max_queued_messages)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
