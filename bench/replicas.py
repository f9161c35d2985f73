"""One control-plane replica against two, on one broker, one PostgreSQL database and one fleet.

The fleet is ``mcp-sim`` (every device its own MQTT session and credentials, the agent's
protocol); the broker is Mosquitto with dynamic security and the production queue limits
(:class:`ProductionQueues`); the control plane is ``mcp-controlplane serve`` on PostgreSQL, each
replica with its own data dir, both sharing one TUF repository and its keys through
``shared_dir`` (``init`` with ``MCP_SHARED_DIR``). The same three phases run first with replica
A alone (``one``), then with A and B (``two``):

1. HELD: the N devices connected and idle (health every 30 s, the simulator's default): each
   replica's CPU (cores, over ``--held-window`` seconds) and RSS;
2. INGEST: the simulator again with ``--health-interval 1`` (N health samples a second):
   committed rows per second over ``--ingest-window`` seconds, summed over the replicas and per
   replica (``mcp_cp_ingest_committed_total`` deltas), against what the broker acknowledged to
   the devices (the simulator's ``health_acked``; ``kept_up`` when the control plane matched
   it, so the rate is the simulator's and ``cp_cpu_ms_per_1k_rows`` is the sizing figure);
   after the fleet stops and ingestion drains, the ``health_samples`` rows added against every
   health sample acknowledged (``lost``) and ``mcp_cp_ingest_dropped_total``;
3. ROLLOUT: a new version, one stage of 100 % (mode switch, no gate, bake 0 s, no rate
   limit), timed from ``POST /api/v1/rollouts`` until every device reports it active (the
   simulator's ``all_at``), with repository requests per replica (``mcp_cp_repo_requests_total``,
   ``mcp_cp_repo_bytes_total``); ``cp_done_s`` when the control plane ended it;
   ``download_s``, each device's time from accepting its desired state to ``downloading ok``
   (its deployment events); ``timeline``, each change of the lease holder, ``step_seq`` or
   status.

Before ``one``, a first version is deployed to the N devices (untimed), so both timed
rollouts are upgrades. ``ratios`` holds two / one for the headline figures. ``disturbed`` lists
windows in which processes outside the bench used more than 0.3 cores (the box is shared).

Setup is done once: ``--work-dir`` (default ``$TMPDIR/mcp-bench-replicas``) keeps the broker's
accounts, both data dirs, the shared repository and the enrolled fleet, and the database
``--database`` (default ``mcp_bench_replicas``, on ``--postgres-url``) keeps the control
plane's records; a later run enrolls only the devices still missing. ``--clean`` drops the
database and deletes the work dir at the end. Only a database whose name starts with
``mcp_bench_`` is ever created or dropped.

    .venv/bin/python bench/replicas.py [--devices 1000] [--work-dir DIR] [--out FILE] [--clean]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import psycopg
from prometheus_client.parser import text_string_to_metric_families
from psycopg import sql

BENCH_DIR = Path(__file__).resolve().parent
for _p in (str(BENCH_DIR.parent), str(BENCH_DIR)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from rollout import Peaks, cpu_s, ensure_fleet, ensure_labels, size_label  # noqa: E402

from mcp_edge.shared.version import SemVer  # noqa: E402
from mcp_edge.tooling.processes import (  # noqa: E402
    init_control_plane,
    process_env,
    serve_control_plane,
)
from mcp_edge.tooling.sim.harness import (  # noqa: E402
    SimProcess,
    Stack,
    active_count,
    api,
    publish_model,
)

MODEL = "replicas-bench"
DB_PREFIX = "mcp_bench_"
QUIET_CORES = 0.15
"""A replica using fewer cores than this over 3 s counts as quiet."""
DISTURBED_CORES = 0.3
METRICS = (
    "mcp_cp_ingest_received_total",
    "mcp_cp_ingest_committed_total",
    "mcp_cp_ingest_dropped_total",
    "mcp_cp_ingest_backlog",
    "mcp_cp_repo_requests_total",
    "mcp_cp_repo_bytes_total",
    "mcp_cp_repo_dropped_total",
    "mcp_cp_rollout_steps_total",
)


# ------------------------------------------------------------------------------- database
def db_url(server_url: str, name: str) -> str:
    """``server_url`` with its database replaced by ``name``."""
    base, _, _ = server_url.rpartition("/")
    return f"{base}/{name}"


def database_exists(server_url: str, name: str) -> bool:
    with psycopg.connect(server_url, autocommit=True) as conn:
        row = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone()
    return row is not None


def create_database(server_url: str, name: str) -> None:
    if not name.startswith(DB_PREFIX):
        raise SystemExit(f"refusing to create {name!r}: bench databases start with {DB_PREFIX}")
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))


def drop_database(server_url: str, name: str) -> None:
    if not name.startswith(DB_PREFIX):
        raise SystemExit(f"refusing to drop {name!r}: bench databases start with {DB_PREFIX}")
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


def query_one(url: str, query: str, params: tuple[Any, ...] = ()) -> Any:
    with psycopg.connect(url, autocommit=True, connect_timeout=10) as conn:
        row = conn.execute(query, params).fetchone()
    return row[0] if row else None


def backend_pids(server_url: str, name: str) -> list[int]:
    """The server processes serving connections to database ``name``."""
    with psycopg.connect(server_url, autocommit=True, connect_timeout=10) as conn:
        rows = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
            (name,),
        ).fetchall()
    return [int(r[0]) for r in rows]


# ------------------------------------------------------------------------------- processes
@contextlib.contextmanager
def sigterm_as_exit() -> Iterator[None]:
    """SIGTERM raises SystemExit, so every ``finally`` stops what the bench started."""

    def handler(_sig: int, _frame: Any) -> None:
        raise SystemExit(143)

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def stop_process(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def rss_mb(pid: int) -> float | None:
    try:
        return round(float(psutil.Process(pid).memory_info().rss) / 2**20, 1)
    except psutil.Error:
        return None


def machine_cpu() -> tuple[float, float]:
    """CPU seconds the whole machine spent busy (all cores), and stolen by the hypervisor."""
    t = psutil.cpu_times()
    busy = t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)
    return float(busy), float(getattr(t, "steal", 0.0))


class Window:
    """CPU seconds of named processes (and the machine) between :meth:`start` and :meth:`end`."""

    def __init__(self, pids: dict[str, int], extra_pids: list[int]) -> None:
        self.pids = pids
        self.extra = extra_pids  # counted as ours but not reported by name (database backends)
        self.cpu0: dict[str, float] = {}
        self.extra0: dict[int, float] = {}
        self.t0 = self.self0 = 0.0
        self.machine0 = (0.0, 0.0)

    def start(self) -> None:
        self.cpu0 = {k: cpu_s(p) for k, p in self.pids.items()}
        self.extra0 = {p: cpu_s(p) for p in self.extra}
        self.machine0 = machine_cpu()
        self.self0 = sum(os.times()[:2])
        self.t0 = time.monotonic()

    def end(self) -> dict[str, Any]:
        wall = time.monotonic() - self.t0
        cpu = {k: cpu_s(p) - self.cpu0[k] for k, p in self.pids.items()}
        db = sum(max(0.0, cpu_s(p) - c0) for p, c0 in self.extra0.items())
        ours = sum(cpu.values()) + db + (sum(os.times()[:2]) - self.self0)
        busy1, steal1 = machine_cpu()
        busy, steal = busy1 - self.machine0[0], steal1 - self.machine0[1]
        return {
            "seconds": round(wall, 2),
            "cpu_s": {k: round(v, 2) for k, v in cpu.items()},
            "cores": {k: round(v / wall, 3) for k, v in cpu.items()},
            "postgres_cores": round(db / wall, 3),
            "others_cores": round(max(0.0, busy - ours) / wall, 3),
            "steal_cores": round(steal / wall, 3),
        }


# ------------------------------------------------------------------------------- metrics
def scrape(url: str) -> dict[str, float]:
    """The :data:`METRICS` samples of one replica, keyed ``name{label=value,...}``."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as answer:
        text = answer.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in METRICS:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def delta(after: dict[str, float], before: dict[str, float], prefix: str) -> dict[str, float]:
    """Non-zero increases of the samples whose key starts with ``prefix``, label part only."""
    out = {}
    for key, value in after.items():
        if key.startswith(prefix):
            d = value - before.get(key, 0.0)
            if d:
                out[key[len(prefix) :].strip("{}") or "total"] = round(d, 1)
    return out


def total(after: dict[str, float], before: dict[str, float], prefix: str) -> float:
    return float(sum(delta(after, before, prefix).values()))


# ------------------------------------------------------------------------------- the stack
class Replicas:
    """Replica A (the :class:`Stack`'s control plane) and, once started, replica B."""

    def __init__(self, stack: Stack, env: dict[str, str]) -> None:
        self.stack = stack
        self.env = env
        self.urls: dict[str, str] = {}
        self.pids: dict[str, int] = {}
        self.procs: list[subprocess.Popen[str]] = []
        assert stack.cp is not None
        self.urls["a"], self.pids["a"] = stack.url, stack.cp.pid

    def start_b(self) -> None:
        work = self.stack.work
        data = work / "cp-b"
        if not (data / "controlplane.toml").exists():
            assert self.stack.broker is not None
            init_control_plane(data, self.stack.broker, create_admin=False, env=self.env)
        with (work / "cp-b.log").open("ab") as log:
            proc, url = serve_control_plane(data, self.procs, env=self.env, stderr=log.fileno())
        self.urls["b"], self.pids["b"] = url, proc.pid

    def stop(self) -> None:
        for proc in self.procs:
            stop_process(proc)

    def names(self) -> dict[str, str]:
        """Each replica's broker identity (``cp-{host}-{id}``, the id kept in its data dir)."""
        host = platform.node().split(".")[0]
        out = {}
        for name, data in (("a", "cp"), ("b", "cp-b")):
            rid = self.stack.work / data / "replica-id"
            if rid.exists():
                out[name] = f"cp-{host}-{rid.read_text().strip()}"
        return out


def prepare_work_dir(work: Path, server_url: str, database: str) -> bool:
    """Make the work dir and the database agree: both kept, or both made anew. Returns
    whether the database was created now."""
    exists = database_exists(server_url, database)
    kept = (work / "stack.json").exists()
    if kept and not exists:
        shutil.rmtree(work)  # its accounts and repository belong to a database that is gone
    if exists and not kept:
        drop_database(server_url, database)
        exists = False
    work.mkdir(parents=True, exist_ok=True)
    if not exists:
        create_database(server_url, database)
    return not exists


# ------------------------------------------------------------------------------- phases
def wait_quiet(pids: dict[str, int], *, seconds: float = 3.0, limit_s: float = 90.0) -> float:
    """Wait until every process uses under :data:`QUIET_CORES` over ``seconds``; the wait."""
    start = time.monotonic()
    while time.monotonic() - start < limit_s:
        before = {k: cpu_s(p) for k, p in pids.items()}
        time.sleep(seconds)
        if all((cpu_s(p) - before[k]) / seconds < QUIET_CORES for k, p in pids.items()):
            break
    return round(time.monotonic() - start, 1)


def start_sim(fleet: Path, work: Path, n: int, tag: str, *extra: str) -> SimProcess:
    status = work / f"status-{tag}.json"
    status.unlink(missing_ok=True)
    return SimProcess(fleet, status, "--devices", str(n), "--connect-rate", "500",
                      "--summary-interval", "10", *extra, log=work / f"sim-{tag}.log")  # fmt: skip


def wait_connected(sim: SimProcess, replicas: Replicas, n: int) -> dict[str, Any]:
    """Every device connected, and the control plane shows them online (bounded)."""
    t0 = time.monotonic()
    sim.wait_for(lambda s: s["connected"] >= n, f"{n} devices connected", n / 500 + 120)
    connect_s = round(time.monotonic() - t0, 1)
    stack = replicas.stack
    q = f"/api/v1/devices?label={size_label(n)}=yes&status=online&limit=1"
    deadline = time.monotonic() + 120
    online = -1
    while time.monotonic() < deadline:
        code, body = api(stack.url, stack.token, "GET", q)
        online = int(body["total"]) if code == 200 else -1
        if online >= n:
            break
        time.sleep(1)
    return {"connect_s": connect_s, "cp_online": online}


def next_versions(stack: Stack, count: int) -> list[str]:
    """``count`` versions above every published one of :data:`MODEL`."""
    status, body = api(stack.url, stack.token, "GET", f"/api/v1/models/{MODEL}")
    major = 1
    if status == 200 and isinstance(body, dict):
        for v in body.get("versions", []):
            major = max(major, SemVer.parse(v["version"]).major + 1)
    return [f"{major}.{i}.0" for i in range(count)]


def converge(sim: SimProcess, version: str, n: int, t0: float, timeout_s: float) -> dict[str, Any]:
    """Wait until every device reports ``version`` active; the phase's figures."""
    try:
        status = sim.wait_for(lambda s: active_count(s, MODEL, version) >= n,
                              f"{version} on all {n} devices", timeout_s)  # fmt: skip
    except AssertionError:
        status = sim.status() or {}
    at = status.get("all_at", {}).get(MODEL, {}).get("active", {}).get(version)
    first = status.get("first_at", {}).get(MODEL, {}).get("active", {}).get(version)
    done = active_count(status, MODEL, version)
    return {
        "version": version,
        "converged_s": round(at - t0, 2) if at else None,
        "first_active_s": round(first - t0, 2) if first else None,
        "converged": done,
        "lost": n - done,
        "failed": sum(status.get("models", {}).get(MODEL, {}).get("failed", {}).values()),
    }


def deploy_baseline(stack: Stack, sim: SimProcess, version: str, n: int, timeout_s: float) -> Any:
    body = {"model": MODEL, "version": version,
            "selector": {"labels": {size_label(n): "yes"}}}  # fmt: skip
    t0 = time.time()
    code, answer = api(stack.url, stack.token, "POST", "/api/v1/deployments", body, timeout_s=600)
    if code != 201:
        raise RuntimeError(f"deployment of {version} refused ({code}): {answer}")
    return converge(sim, version, n, t0, timeout_s)


def held_phase(replicas: Replicas, sim: SimProcess, broker_pid: int, args: argparse.Namespace,
               db_pids: list[int]) -> dict[str, Any]:  # fmt: skip
    pids = {**{f"cp_{k}": p for k, p in replicas.pids.items()}, "broker": broker_pid,
            "sim": sim.pid}  # fmt: skip
    window = Window(pids, db_pids)
    window.start()
    time.sleep(args.held_window)
    w = window.end()
    per = {k: {"cores": w["cores"][f"cp_{k}"], "rss_mb": rss_mb(p)}
           for k, p in replicas.pids.items()}  # fmt: skip
    return {
        "window": w,
        "per_replica": per,
        "cp_cores": round(sum(v["cores"] for v in per.values()), 3),
        "cp_rss_mb": round(sum(v["rss_mb"] or 0.0 for v in per.values()), 1),
        "broker_rss_mb": rss_mb(broker_pid),
        "sim_rss_mb": rss_mb(sim.pid),
    }


def rollout_phase(replicas: Replicas, sim: SimProcess, broker_pid: int, version: str, n: int,
                  args: argparse.Namespace, db: str, db_pids: list[int]) -> dict[str, Any]:  # fmt: skip
    stack = replicas.stack
    before = {k: scrape(u) for k, u in replicas.urls.items()}
    pids = {**{f"cp_{k}": p for k, p in replicas.pids.items()}, "broker": broker_pid,
            "sim": sim.pid}  # fmt: skip
    window = Window(pids, db_pids)
    body = {
        "model": MODEL, "version": version, "target": {"labels": {size_label(n): "yes"}},
        "stages": [{"percent": 100, "mode": "switch", "bake_s": 0, "gates": []}],
        "rate": {"per_minute": None},
    }  # fmt: skip
    window.start()
    t0 = time.time()
    code, answer = api(stack.url, stack.token, "POST", "/api/v1/rollouts", body, timeout_s=600)
    if code != 201:
        raise RuntimeError(f"rollout of {version} refused ({code}): {answer}")
    request_s = round(time.time() - t0, 2)
    rollout_id = int(answer["rollout"]["id"])
    names = {v: k for k, v in replicas.names().items()}
    # Until every device reports the version and the control plane has ended the rollout
    # (bounded): each change of the rollout's lease holder, step_seq or status, as seen here.
    timeline: list[dict[str, Any]] = []
    w: dict[str, Any] | None = None
    cp_done_s = None
    deadline = time.monotonic() + args.phase_timeout
    with psycopg.connect(db, autocommit=True, connect_timeout=10) as conn:
        while time.monotonic() < deadline and (w is None or cp_done_s is None):
            q = "SELECT lease_owner, step_seq, status FROM rollouts WHERE id = %s"
            row = conn.execute(q, (rollout_id,)).fetchone()
            active = active_count(sim.status() or {}, MODEL, version)
            if row is not None:
                seen = {"owner": names.get(row[0], row[0]), "step_seq": row[1], "status": row[2]}
                if not timeline or any(timeline[-1][k] != v for k, v in seen.items()):
                    timeline.append({"t_s": round(time.time() - t0, 1), **seen, "active": active})
                if cp_done_s is None and row[2] not in ("running", "awaiting_approval"):
                    cp_done_s = round(time.time() - t0, 1)
            if w is None and active >= n:
                w = window.end()
            time.sleep(0.5)
    result = converge(sim, version, n, t0, 1.0)
    w = w or window.end()
    result["download_s"] = download_times(db, version)
    cp_status = timeline[-1]["status"] if timeline else None
    after = {k: scrape(u) for k, u in replicas.urls.items()}
    per = {}
    for k in replicas.urls:
        per[k] = {
            "repo_requests": delta(after[k], before[k], "mcp_cp_repo_requests_total"),
            "repo_mib": round(total(after[k], before[k], "mcp_cp_repo_bytes_total") / 2**20, 2),
            "repo_dropped": delta(after[k], before[k], "mcp_cp_repo_dropped_total"),
            "rollout_steps": delta(after[k], before[k], "mcp_cp_rollout_steps_total"),
            "cpu_s": w["cpu_s"][f"cp_{k}"],
        }
    requests = sum(sum(v["repo_requests"].values()) for v in per.values())
    for v in per.values():
        share = sum(v["repo_requests"].values()) / requests if requests else None
        v["repo_share"] = round(share, 3) if share is not None else None
    return {
        **result,
        "id": rollout_id,
        "request_s": request_s,
        "cp_status": cp_status,
        "cp_done_s": cp_done_s,
        "lease_owners": sorted({str(e["owner"]) for e in timeline if e["owner"]}),
        "timeline": timeline,
        "window": w,
        "per_replica": per,
        "repo_requests": requests,
        "cp_cpu_s": round(sum(v["cpu_s"] for v in per.values()), 2),
    }


def download_times(db: str, version: str) -> dict[str, float | None]:
    """Per device, from its deployment events (the simulator's clock): desired state accepted
    (``idle``/``progress``) to ``downloading``/``ok``, in seconds: median, p90, max."""
    query = """
        WITH d AS (
            SELECT device_id,
                   max(ts) FILTER (WHERE phase = 'idle' AND outcome = 'progress') AS accepted,
                   max(ts) FILTER (WHERE phase = 'downloading' AND outcome = 'ok') AS downloaded
            FROM deployment_events WHERE model = %s AND version = %s GROUP BY device_id),
        s AS (SELECT extract(epoch FROM downloaded - accepted) AS s FROM d
              WHERE downloaded IS NOT NULL AND accepted IS NOT NULL)
        SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY s),
               percentile_cont(0.9) WITHIN GROUP (ORDER BY s), max(s) FROM s"""
    with psycopg.connect(db, autocommit=True, connect_timeout=10) as conn:
        row = conn.execute(query, (MODEL, version)).fetchone()
    keys = ("p50", "p90", "max")
    return {
        k: round(float(v), 2) if v is not None else None
        for k, v in zip(keys, row or (), strict=False)
    }


def ingest_phase(replicas: Replicas, fleet: Path, work: Path, n: int, tag: str, broker_pid: int,
                 args: argparse.Namespace, db: str, db_pids: list[int]) -> dict[str, Any]:  # fmt: skip
    rows0 = int(query_one(db, "SELECT count(*) FROM health_samples"))
    metrics0 = {k: scrape(u) for k, u in replicas.urls.items()}
    sim = start_sim(fleet, work, n, f"{tag}-ingest", "--health-interval", "1")
    out: dict[str, Any] = {"health_interval_s": 1.0, "offered_per_s": n}
    try:
        out.update(wait_connected(sim, replicas, n))
        time.sleep(args.warmup)
        pids = {**{f"cp_{k}": p for k, p in replicas.pids.items()}, "broker": broker_pid,
                "sim": sim.pid}  # fmt: skip
        window = Window(pids, db_pids)
        before = {k: scrape(u) for k, u in replicas.urls.items()}
        s0 = sim.status() or {}
        window.start()
        time.sleep(args.ingest_window)
        w = window.end()
        after = {k: scrape(u) for k, u in replicas.urls.items()}
        s1 = sim.status() or {}
    finally:
        sim.stop()
    final = sim.status() or {}
    seconds = w["seconds"]
    per = {}
    for k in replicas.urls:
        committed = delta(after[k], before[k], "mcp_cp_ingest_committed_total")
        per[k] = {
            "committed_per_s": round(sum(committed.values()) / seconds, 1),
            "health_committed_per_s": round(committed.get("kind=health", 0.0) / seconds, 1),
            "committed_by_kind": committed,
            "received_by_kind": delta(after[k], before[k], "mcp_cp_ingest_received_total"),
            "cores": w["cores"][f"cp_{k}"],
        }
    acked = s1.get("counters", {}).get("health_acked", 0) - s0.get("counters", {}).get(
        "health_acked", 0
    )
    sim_s = (s1.get("ts", 0.0) - s0.get("ts", 0.0)) or seconds
    health_total = sum(v["health_committed_per_s"] for v in per.values())
    for v in per.values():
        v["health_share"] = (
            round(v["health_committed_per_s"] / health_total, 3) if health_total else None
        )
    # Drain: the fleet has stopped; wait until every replica's backlog is empty and its
    # committed count stands still (bounded).
    drain_t0 = time.monotonic()
    last: dict[str, float] = {}
    while time.monotonic() - drain_t0 < args.drain_timeout:
        now = {k: scrape(u) for k, u in replicas.urls.items()}
        committed = {k: total(now[k], {}, "mcp_cp_ingest_committed_total") for k in now}
        backlog = sum(m.get("mcp_cp_ingest_backlog", 0.0) for m in now.values())
        if backlog == 0 and committed == last:
            break
        last = committed
        time.sleep(3)
    rows1 = int(query_one(db, "SELECT count(*) FROM health_samples"))
    end = {k: scrape(u) for k, u in replicas.urls.items()}
    acked_all = int(final.get("counters", {}).get("health_acked", 0))
    dropped = {k: delta(end[k], metrics0[k], "mcp_cp_ingest_dropped_total") for k in end}
    out.update({
        "window": w,
        "sim_acked_per_s": round(acked / sim_s, 1) if sim_s else None,
        # The control plane kept pace with what the broker took from the devices: the rate is
        # then the simulator's, not the control plane's ceiling (see cp_cpu_ms_per_1k_rows).
        "kept_up": bool(acked) and health_total >= 0.97 * acked / sim_s,
        "committed_per_s": round(sum(v["committed_per_s"] for v in per.values()), 1),
        "health_committed_per_s": round(health_total, 1),
        "per_replica": per,
        "cp_cores": round(sum(v["cores"] for v in per.values()), 3),
        "cp_cpu_ms_per_1k_rows": round(
            sum(w["cpu_s"][f"cp_{k}"] for k in per) * 1e6
            / max(1.0, sum(v["committed_per_s"] for v in per.values()) * seconds), 1),
        "drain_s": round(time.monotonic() - drain_t0, 1),
        "health_acked_total": acked_all,
        "health_rows_added": rows1 - rows0,
        "lost": acked_all - (rows1 - rows0),
        "dropped": {k: v for k, v in dropped.items() if v},
    })  # fmt: skip
    return out


def run_config(tag: str, replicas: Replicas, fleet: Path, work: Path, n: int, version: str,
               baseline: str | None, args: argparse.Namespace, db: str, server_url: str,
               database: str) -> dict[str, Any]:  # fmt: skip
    stack = replicas.stack
    assert stack.broker is not None
    broker_pid = stack.broker.pid
    out: dict[str, Any] = {"replicas": sorted(replicas.urls), "names": replicas.names()}
    out["quiet_at_start_s"] = wait_quiet(replicas.pids)
    sim = start_sim(fleet, work, n, tag)
    peaks = Peaks({**{f"cp_{k}": p for k, p in replicas.pids.items()}, "broker": broker_pid,
                   "sim": sim.pid})  # fmt: skip
    peaks.start()
    try:
        out["connect"] = wait_connected(sim, replicas, n)
        if baseline is not None:
            out["baseline"] = deploy_baseline(stack, sim, baseline, n, args.phase_timeout)
        out["quiet_before_held_s"] = wait_quiet(replicas.pids)
        db_pids = backend_pids(server_url, database)
        out["held"] = held_phase(replicas, sim, broker_pid, args, db_pids)
        print(f"[{tag}] held: {json.dumps(out['held']['per_replica'])}", file=sys.stderr,
              flush=True)  # fmt: skip
        out["quiet_before_rollout_s"] = wait_quiet(replicas.pids)
        out["rollout"] = rollout_phase(replicas, sim, broker_pid, version, n, args, db,
                                       backend_pids(server_url, database))  # fmt: skip
        print(f"[{tag}] rollout: {out['rollout']['converged_s']} s, lost "
              f"{out['rollout']['lost']}", file=sys.stderr, flush=True)  # fmt: skip
    finally:
        out["sim_exit"] = sim.stop()
        out["sim_counters"] = (sim.status() or {}).get("counters", {})
    try:
        out["quiet_before_ingest_s"] = wait_quiet(replicas.pids)
        out["ingest"] = ingest_phase(replicas, fleet, work, n, tag, broker_pid, args, db,
                                     backend_pids(server_url, database))  # fmt: skip
        print(f"[{tag}] ingest: {out['ingest']['committed_per_s']} rows/s, lost "
              f"{out['ingest']['lost']}", file=sys.stderr, flush=True)  # fmt: skip
    finally:
        peaks.stop()
    out["rss_peak_mb"] = peaks.rss_mb
    return out


# ------------------------------------------------------------------------------- report
def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def ratios(one: dict[str, Any], two: dict[str, Any]) -> dict[str, Any]:
    def get(doc: dict[str, Any], *path: str) -> Any:
        for p in path:
            if not isinstance(doc, dict):
                return None
            doc = doc.get(p)  # type: ignore[assignment]
        return doc

    out = {}
    for name, path in {
        "held_cp_cores": ("held", "cp_cores"),
        "held_cp_rss_mb": ("held", "cp_rss_mb"),
        "ingest_committed_per_s": ("ingest", "committed_per_s"),
        "ingest_health_committed_per_s": ("ingest", "health_committed_per_s"),
        "ingest_cp_cores": ("ingest", "cp_cores"),
        "ingest_cp_cpu_ms_per_1k_rows": ("ingest", "cp_cpu_ms_per_1k_rows"),
        "rollout_s": ("rollout", "converged_s"),
        "rollout_cp_done_s": ("rollout", "cp_done_s"),
        "rollout_download_p50_s": ("rollout", "download_s", "p50"),
        "rollout_cp_cpu_s": ("rollout", "cp_cpu_s"),
    }.items():
        a, b = get(two, *path), get(one, *path)
        out[name] = {"one": b, "two": a, "two_over_one": ratio(a, b)}
    return out


def disturbed(configs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for tag, doc in configs.items():
        for phase in ("held", "rollout", "ingest"):
            w = doc.get(phase, {}).get("window")
            if w and w["others_cores"] > DISTURBED_CORES:
                out.append({"config": tag, "phase": phase, "others_cores": w["others_cores"],
                            "steal_cores": w["steal_cores"]})  # fmt: skip
    return out


def machine(server_url: str) -> dict[str, Any]:
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mosq = subprocess.run(["mosquitto", "-h"], capture_output=True, text=True, timeout=10)
    return {
        "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "cpus": os.cpu_count(),
        "cpu_model": model,
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "platform": platform.platform(),
        "mosquitto": (mosq.stdout or mosq.stderr).splitlines()[0] if (mosq.stdout or mosq.stderr) else None,
        "postgres": query_one(server_url, "SHOW server_version"),
    }  # fmt: skip


# ------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--devices", type=int, default=1000, help="fleet size N (default 1000)")
    p.add_argument("--work-dir", type=Path,
                   default=Path(tempfile.gettempdir()) / "mcp-bench-replicas",
                   help="kept between runs: broker accounts, data dirs, shared dir, the fleet")  # fmt: skip
    p.add_argument("--postgres-url", default=os.environ.get(
        "MCP_BENCH_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/postgres"),
        help="a PostgreSQL server the bench may create its database on "
        "(default $MCP_BENCH_POSTGRES_URL or postgresql://postgres@127.0.0.1:5432/postgres)")  # fmt: skip
    p.add_argument("--database", default="mcp_bench_replicas",
                   help=f"the bench's own database (its name must start with {DB_PREFIX})")  # fmt: skip
    p.add_argument("--held-window", type=float, default=20.0, help="seconds (default 20)")
    p.add_argument("--ingest-window", type=float, default=30.0, help="seconds (default 30)")
    p.add_argument("--warmup", type=float, default=10.0,
                   help="seconds of 1 Hz health before the ingest window (default 10)")  # fmt: skip
    p.add_argument("--drain-timeout", type=float, default=120.0,
                   help="seconds ingestion may take to drain after the fleet stops")  # fmt: skip
    p.add_argument("--phase-timeout", type=float, default=300.0,
                   help="seconds a rollout may take before its stragglers count as lost")  # fmt: skip
    p.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    p.add_argument("--setup-only", action="store_true", help="enroll and label, then stop")
    p.add_argument("--clean", action="store_true",
                   help="drop the database and delete the work dir at the end")  # fmt: skip
    args = p.parse_args(argv)
    if not args.database.startswith(DB_PREFIX):
        p.error(f"--database must start with {DB_PREFIX}")
    n: int = args.devices
    work: Path = args.work_dir.absolute()
    started = time.monotonic()
    result: dict[str, Any] = {"bench": "replicas", "devices": n, "work_dir": str(work),
                              "machine": machine(args.postgres_url)}  # fmt: skip
    db = db_url(args.postgres_url, args.database)
    with sigterm_as_exit():
        try:
            result["setup"] = {"database_created": prepare_work_dir(work, args.postgres_url,
                                                                    args.database)}  # fmt: skip
            shared = work / "shared"
            shared.mkdir(exist_ok=True)
            env = {**process_env(), "MCP_DATABASE_URL": db, "MCP_SHARED_DIR": str(shared)}
            fleet = work / "fleet"
            with Stack(work, cp_env=env) as stack:
                result["setup"].update(ensure_fleet(stack, fleet, [n]))
                result["setup"]["labels_patched"] = ensure_labels(stack, fleet, [n])
                if args.setup_only:
                    print(json.dumps(result, indent=2))
                    return 0
                onnx = work / "digits.onnx"
                if not onnx.exists():
                    from mcp_edge.tooling.models import train_digits_mlp, write_digits_onnx

                    write_digits_onnx(train_digits_mlp(seed=0).model, onnx)
                versions = next_versions(stack, 3)
                publish_model(stack.url, stack.token, onnx, MODEL, versions, work)
                result["versions"] = versions
                replicas = Replicas(stack, env)
                try:
                    configs: dict[str, dict[str, Any]] = {}
                    configs["one"] = run_config("one", replicas, fleet, work, n, versions[1],
                                                versions[0], args, db, args.postgres_url,
                                                args.database)  # fmt: skip
                    replicas.start_b()
                    configs["two"] = run_config("two", replicas, fleet, work, n, versions[2],
                                                None, args, db, args.postgres_url,
                                                args.database)  # fmt: skip
                finally:
                    replicas.stop()
            result["one"], result["two"] = configs["one"], configs["two"]
            result["ratios"] = ratios(configs["one"], configs["two"])
            result["disturbed"] = disturbed(configs)
        finally:
            if args.clean:
                drop_database(args.postgres_url, args.database)
                shutil.rmtree(work, ignore_errors=True)
    result["seconds"] = round(time.monotonic() - started, 1)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
