"""Rollout against its floor at fleet scale: ``mcp-sim`` devices, a real control plane and broker.

For each fleet size N (``--devices``, default 2,000 and 10,000), the first N devices of one
simulated fleet (``mcp-sim``, :mod:`mcp_edge.tooling.sim`: every device its own MQTT session,
desired-state verification, TUF fetch of the real bundle, the agent's events and reported
state) run against Mosquitto with dynamic security (the production queue limits) and
``mcp-controlplane serve`` on SQLite:

1. three new versions of one model are published (signed bundles pushed to the registry);
2. v1 is deployed to the N devices (``POST /api/v1/deployments``, a label selector that names
   exactly them) and the bench waits until every device reports it active;
3. FLOOR: a plain deployment of v2 to the same selector, timed from the request until every
   device reports v2 active;
4. ROLLOUT: a rollout of v3 over the same devices (``POST /api/v1/rollouts``: one stage of
   100 %, mode switch, no gate, bake 0 s, no rate limit), timed the same way.

"Reports active" is the simulator's count of devices whose retained reported state, as the
broker acknowledged it, names the version active (the status file's ``all_at``). Between the
phases the bench waits until the control plane's CPU is quiet, so a phase does not pay for the
ingest backlog of the one before.

Per N: ``devices``, ``floor_s``, ``rollout_s``, ``ratio`` (rollout_s / floor_s), ``cp_cpu_s``
(control-plane CPU during the rollout phase; ``floor.cp_cpu_s`` for the floor), ``cp_rss_mb``
and ``broker_rss_mb`` (peaks over the run of that N), ``lost`` (devices that did not report the
new version within ``--phase-timeout`` in either phase), plus the simulator's own CPU and RSS.
Goals (reported with a ``pass`` flag, never asserted): ratio <= 1.25, 10,000 devices converged
in under 60 s, lost = 0.

Setup is done once: ``--work-dir`` (default ``$TMPDIR/mcp-bench-rollout``) keeps the broker's
accounts, the control plane's data and the enrolled fleet; a later run starts them again and
enrolls only the devices still missing. Each device carries the labels ``in-N=yes`` of every
size N it belongs to, so a selector names exactly the first N devices.

    .venv/bin/python bench/rollout.py [--devices 2000,10000] [--work-dir DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

BENCH_DIR = Path(__file__).resolve().parent
if str(BENCH_DIR.parent) not in sys.path:
    sys.path.insert(0, str(BENCH_DIR.parent))

from mcp_edge.shared.version import SemVer  # noqa: E402
from mcp_edge.tooling.sim.fleet import load_devices  # noqa: E402
from mcp_edge.tooling.sim.harness import (  # noqa: E402
    SimProcess,
    Stack,
    active_count,
    api,
    publish_model,
    sim_enroll,
)

MODEL = "rollout-bench"
GROUP = "bench-rollout"
GOAL_RATIO = 1.25
GOAL_10K_S = 60.0
QUIET_CPU = 0.15
"""Control-plane cores below which it counts as quiet between phases."""


def size_label(n: int) -> str:
    return f"in-{n}"


# ------------------------------------------------------------------------------- sampling
@dataclass
class Peaks:
    """RSS peaks of the control plane, the broker and the simulator, sampled every 0.5 s."""

    pids: dict[str, int]
    rss_mb: dict[str, float] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            for name, pid in self.pids.items():
                try:
                    rss = psutil.Process(pid).memory_info().rss / 2**20
                except psutil.Error:
                    continue
                self.rss_mb[name] = round(max(self.rss_mb.get(name, 0.0), rss), 1)


def cpu_s(pid: int) -> float:
    try:
        t = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return 0.0
    return float(t.user + t.system)


def wait_quiet(pid: int, *, seconds: float = 3.0, limit_s: float = 120.0) -> float:
    """Wait until ``pid`` used under :data:`QUIET_CPU` cores over ``seconds``; return the wait."""
    start = time.monotonic()
    while time.monotonic() - start < limit_s:
        before = cpu_s(pid)
        time.sleep(seconds)
        if (cpu_s(pid) - before) / seconds < QUIET_CPU:
            break
    return round(time.monotonic() - start, 1)


# ------------------------------------------------------------------------------- setup
def ensure_fleet(stack: Stack, fleet: Path, sizes: list[int]) -> dict[str, Any]:
    """Enroll the devices still missing, each labelled ``in-N=yes`` for every size N it is in."""
    have = before = len(load_devices(fleet)) if fleet.exists() else 0
    started = time.monotonic()
    bounds = sorted(sizes)
    lo = 0
    for hi in bounds:
        if have < hi:
            start = max(lo, have)
            labels = [f"--label={size_label(n)}=yes" for n in bounds if n >= hi]
            sim_enroll(stack.url, stack.token, hi - start, fleet, "--group", GROUP,
                       "--concurrency", "16", "--timeout", "600", *labels,
                       timeout_s=6 * 3600)  # fmt: skip
            have = hi
        lo = hi
    return {"devices_before": before, "devices": len(load_devices(fleet)),
            "enroll_s": round(time.monotonic() - started, 1)}  # fmt: skip


def ensure_labels(stack: Stack, fleet: Path, sizes: list[int]) -> dict[str, int]:
    """Make the label ``in-N=yes`` name exactly the first N devices of the fleet, for each N
    (``PATCH /api/v1/devices/{id}/labels``): devices an earlier setup enrolled for other sizes
    get it, and devices the control plane holds but the fleet does not (an enrollment whose
    answer never came back) lose it. Returns how many devices were changed each way."""
    devices = load_devices(fleet)
    changed = {"labelled": 0, "unlabelled": 0}
    for n in sizes:
        label = size_label(n)
        want = {d.device_id for d in devices[:n]}
        have: set[str] = set()
        offset = 0
        while True:
            code, body = api(stack.url, stack.token, "GET",
                             f"/api/v1/devices?label={label}=yes&limit=1000&offset={offset}")  # fmt: skip
            if code != 200:
                raise RuntimeError(f"listing devices labelled {label} failed ({code}): {body}")
            have.update(d["id"] for d in body["items"])
            offset += len(body["items"])
            if not body["items"] or offset >= int(body["total"]):
                break
        for device_id, patch, kind in [
            *((d, {"set": {label: "yes"}, "remove": []}, "labelled") for d in sorted(want - have)),
            *((d, {"set": {}, "remove": [label]}, "unlabelled") for d in sorted(have - want)),
        ]:
            code, body = api(stack.url, stack.token, "PATCH",
                             f"/api/v1/devices/{device_id}/labels", patch)  # fmt: skip
            if code != 200:
                raise RuntimeError(f"labelling {device_id} failed ({code}): {body}")
            changed[kind] += 1
    return changed


def next_versions(stack: Stack) -> list[str]:
    """Three versions above every published one of :data:`MODEL`: M.0.0, M.1.0, M.2.0."""
    status, body = api(stack.url, stack.token, "GET", f"/api/v1/models/{MODEL}")
    major = 1
    if status == 200 and isinstance(body, dict):
        for v in body.get("versions", []):
            major = max(major, SemVer.parse(v["version"]).major + 1)
    return [f"{major}.0.0", f"{major}.1.0", f"{major}.2.0"]


# ------------------------------------------------------------------------------- one size
def deploy(stack: Stack, version: str, n: int) -> float:
    """POST the deployment; return the wall time the request was sent."""
    body = {"model": MODEL, "version": version,
            "selector": {"labels": {size_label(n): "yes"}}}  # fmt: skip
    t0 = time.time()
    status, answer = api(stack.url, stack.token, "POST", "/api/v1/deployments", body,
                         timeout_s=600)  # fmt: skip
    if status != 201:
        raise RuntimeError(f"deployment of {version} refused ({status}): {answer}")
    return t0


def roll_out(stack: Stack, version: str, n: int) -> tuple[float, int]:
    body = {
        "model": MODEL, "version": version, "target": {"labels": {size_label(n): "yes"}},
        "stages": [{"percent": 100, "mode": "switch", "bake_s": 0, "gates": []}],
        "rate": {"per_minute": None},
    }  # fmt: skip
    t0 = time.time()
    status, answer = api(stack.url, stack.token, "POST", "/api/v1/rollouts", body, timeout_s=600)
    if status != 201:
        raise RuntimeError(f"rollout of {version} refused ({status}): {answer}")
    return t0, int(answer["rollout"]["id"])


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


def run_size(stack: Stack, fleet: Path, work: Path, onnx: Path, n: int, args: argparse.Namespace,
             cp_pid: int, broker_pid: int) -> dict[str, Any]:  # fmt: skip
    versions = next_versions(stack)
    publish_model(stack.url, stack.token, onnx, MODEL, versions, work)
    v1, v2, v3 = versions
    status_file = work / f"status-{n}.json"
    status_file.unlink(missing_ok=True)
    sim = SimProcess(fleet, status_file, "--devices", str(n), "--connect-rate",
                     str(args.connect_rate), "--summary-interval", "10",
                     log=work / f"sim-{n}.log")  # fmt: skip
    peaks = Peaks({"cp": cp_pid, "broker": broker_pid, "sim": sim.pid})
    peaks.start()
    out: dict[str, Any] = {"devices": n, "versions": versions}
    try:
        t_connect = time.monotonic()
        sim.wait_for(lambda s: s["connected"] >= n, f"{n} devices connected",
                     n / args.connect_rate + 120)  # fmt: skip
        out["connect_s"] = round(time.monotonic() - t_connect, 1)

        def online() -> int:
            q = f"/api/v1/devices?label={size_label(n)}=yes&status=online&limit=1"
            code, body = api(stack.url, stack.token, "GET", q)
            return int(body["total"]) if code == 200 else -1

        deadline = time.monotonic() + 120
        while online() < n and time.monotonic() < deadline:
            time.sleep(1)
        out["cp_online"] = online()

        t0 = deploy(stack, v1, n)
        out["setup_v1"] = converge(sim, v1, n, t0, args.phase_timeout)
        out["quiet_before_floor_s"] = wait_quiet(cp_pid)

        cpu0, sim_cpu0 = cpu_s(cp_pid), cpu_s(sim.pid)
        broker0 = cpu_s(broker_pid)
        t0 = deploy(stack, v2, n)
        out["floor_request_s"] = round(time.time() - t0, 2)
        floor = converge(sim, v2, n, t0, args.phase_timeout)
        floor["cp_cpu_s"] = round(cpu_s(cp_pid) - cpu0, 2)
        floor["broker_cpu_s"] = round(cpu_s(broker_pid) - broker0, 2)
        floor["sim_cpu_s"] = round(cpu_s(sim.pid) - sim_cpu0, 2)
        out["floor"] = floor
        out["quiet_before_rollout_s"] = wait_quiet(cp_pid)

        cpu0, sim_cpu0 = cpu_s(cp_pid), cpu_s(sim.pid)
        broker0 = cpu_s(broker_pid)
        t0, rollout_id = roll_out(stack, v3, n)
        out["rollout_request_s"] = round(time.time() - t0, 2)
        rollout = converge(sim, v3, n, t0, args.phase_timeout)
        rollout["cp_cpu_s"] = round(cpu_s(cp_pid) - cpu0, 2)
        rollout["broker_cpu_s"] = round(cpu_s(broker_pid) - broker0, 2)
        rollout["sim_cpu_s"] = round(cpu_s(sim.pid) - sim_cpu0, 2)
        rollout["id"] = rollout_id
        rollout.update(rollout_outcome(stack, rollout_id, t0, args.phase_timeout))
        out["rollout"] = rollout
    finally:
        code = sim.stop()
        peaks.stop()
        out["sim_exit"] = code
    final = sim.status() or {}
    floor, rollout = out.get("floor", {}), out.get("rollout", {})
    f_s, r_s = floor.get("converged_s"), rollout.get("converged_s")
    out.update({
        "floor_s": f_s,
        "rollout_s": r_s,
        "ratio": round(r_s / f_s, 3) if f_s and r_s else None,
        "cp_cpu_s": rollout.get("cp_cpu_s"),
        "cp_rss_mb": peaks.rss_mb.get("cp"),
        "broker_rss_mb": peaks.rss_mb.get("broker"),
        "sim_rss_mb": peaks.rss_mb.get("sim"),
        "lost": int(floor.get("lost", n)) + int(rollout.get("lost", n)),
        "sim_counters": final.get("counters", {}),
    })  # fmt: skip
    return out


def rollout_outcome(stack: Stack, rollout_id: int, t0: float, timeout_s: float) -> dict[str, Any]:
    """When the control plane saw the rollout end, and how (polled once a second)."""
    deadline = time.time() + timeout_s
    doc: dict[str, Any] = {}
    while time.time() < deadline:
        code, body = api(stack.url, stack.token, "GET", f"/api/v1/rollouts/{rollout_id}")
        if code == 200:
            doc = body["rollout"]
            if doc["status"] not in ("running", "awaiting_approval"):
                return {"status": doc["status"], "cp_done_s": round(time.time() - t0, 1),
                        "cp_devices": doc.get("devices"), "reason": doc.get("reason")}  # fmt: skip
        time.sleep(1)
    return {"status": doc.get("status"), "cp_done_s": None, "cp_devices": doc.get("devices")}


# ------------------------------------------------------------------------------- main
def goals(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for r in results:
        n = r["devices"]
        out.append({"devices": n, "goal": f"ratio <= {GOAL_RATIO}", "value": r["ratio"],
                    "pass": r["ratio"] is not None and r["ratio"] <= GOAL_RATIO})  # fmt: skip
        out.append({"devices": n, "goal": "lost == 0", "value": r["lost"],
                    "pass": r["lost"] == 0})  # fmt: skip
        if n == 10_000:
            worst = max((r[k] for k in ("floor_s", "rollout_s") if r[k] is not None),
                        default=None)  # fmt: skip
            out.append({"devices": n, "goal": f"converged in < {GOAL_10K_S:g} s (floor and "
                        "rollout)", "value": worst,
                        "pass": worst is not None and r["lost"] == 0 and worst < GOAL_10K_S})  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--devices", default="2000,10000",
                   help="comma-separated fleet sizes (default 2000,10000)")  # fmt: skip
    p.add_argument("--work-dir", type=Path,
                   default=Path(tempfile.gettempdir()) / "mcp-bench-rollout",
                   help="kept between runs: broker accounts, control-plane data, the fleet")  # fmt: skip
    p.add_argument("--phase-timeout", type=float, default=300.0,
                   help="seconds a phase may take before its stragglers count as lost")  # fmt: skip
    p.add_argument("--connect-rate", type=float, default=1000.0, help="devices per second")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    p.add_argument("--setup-only", action="store_true",
                   help="enroll and label the fleet in --work-dir, then stop (run it niced "
                   "once: 10,000 enrollments take over an hour on Mosquitto 2.0)")  # fmt: skip
    args = p.parse_args(argv)
    sizes = sorted({int(x) for x in args.devices.split(",") if x.strip()})
    work: Path = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    fleet = work / "fleet"
    started = time.monotonic()
    result: dict[str, Any] = {
        "bench": "rollout", "work_dir": str(work), "sizes": sizes,
        "host": {"cpus": os.cpu_count(), "python": platform.python_version(),
                 "platform": platform.platform()},
    }  # fmt: skip
    with Stack(work) as stack:
        assert stack.cp is not None and stack.broker is not None
        result["setup"] = {"reused": stack.reused, **ensure_fleet(stack, fleet, sizes)}
        result["setup"]["labels_patched"] = ensure_labels(stack, fleet, sizes)
        if args.setup_only:
            print(json.dumps(result, indent=2))
            return 0
        onnx = work / "digits.onnx"
        if not onnx.exists():
            from mcp_edge.tooling.models import train_digits_mlp, write_digits_onnx

            write_digits_onnx(train_digits_mlp(seed=0).model, onnx)
        results = []
        for n in sizes:
            results.append(run_size(stack, fleet, work, onnx, n, args, stack.cp.pid,
                                    stack.broker.pid))  # fmt: skip
            print(json.dumps({k: results[-1][k] for k in ("devices", "floor_s", "rollout_s",
                                                          "ratio", "lost")}),
                  file=sys.stderr, flush=True)  # fmt: skip
    result["results"] = results
    result["goals"] = goals(results)
    result["seconds"] = round(time.monotonic() - started, 1)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
