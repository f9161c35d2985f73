"""Enrollment at fleet scale: the project's enrollment client against a demo-like control plane.

Starts a real Mosquitto with dynamic security (:class:`mcp_edge.tooling.mosquitto.
DynsecMosquittoBroker`), ``mcp-controlplane init`` and ``serve`` on SQLite (the demo's setup,
through :func:`mcp_edge.tooling.processes.init_control_plane` and ``serve_control_plane``),
creates one enrollment token with ``--uses N``, and enrolls ``N`` devices with
:func:`mcp_edge.agent.enroll.enroll` (what ``mcp-agent enroll`` runs: a fresh Ed25519 key, a
signed request, its own HTTP connection, the answer stored in the device's state directory),
``--concurrency`` at a time, in this process on one event loop.

Reported (one JSON document on stdout):

* ``rate_first_1k`` / ``rate_last_1k``: enrollments per second over the first and the last
  ``window`` completions (1,000, or half the devices when fewer than 2,000); ``rate_by_1k``
  every window in order, so the slope shows;
* ``p95_ms`` / ``p50_ms`` / ``max_ms``: latency of one enrollment as the client sees it;
* ``failed`` and the first distinct ``failures``;
* ``cpu``: seconds of CPU the control plane, the broker and this client spent, and per
  enrollment;
* ``dynsec_file_bytes``: the broker's ``dynamic-security.json`` at the end;
* ``broker_floor_ms``: the baseline, measured in the same run with the same broker: the median
  time of one raw dynamic-security account creation (:meth:`DynsecProvisioner.provision_device`,
  alone, no database, no HTTP) before the fleet enrolls and again after; what Mosquitto alone
  costs per account at that fleet size;
* ``connected``: devices (the first and the last few enrolled) that logged in to the broker
  with the credentials they were given, right after their answer.

Device state directories live under ``/dev/shm`` when it exists (each real device writes to
its own disk; this machine's disk would otherwise time the bench's fsyncs); the control
plane's SQLite file lives on the regular disk, as in the demo. Nothing is asserted: ``goals``
lists each goal with a ``pass`` flag.

    .venv/bin/python bench/enroll.py [--devices 10000] [--concurrency 16] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

BENCH_DIR = Path(__file__).resolve().parent
if str(BENCH_DIR.parent) not in sys.path:
    sys.path.insert(0, str(BENCH_DIR.parent))

from mcp_edge.agent.enroll import EnrollError, enroll  # noqa: E402
from mcp_edge.agent.hardware import collect_facts, select_profile  # noqa: E402
from mcp_edge.controlplane.broker.dynsec import DynsecProvisioner  # noqa: E402
from mcp_edge.shared.profiles import load_profiles  # noqa: E402
from mcp_edge.shared.protocol.enrollment import EnrollmentAnswer, EnrollmentStatus  # noqa: E402
from mcp_edge.tooling.mosquitto import DynsecMosquittoBroker  # noqa: E402
from mcp_edge.tooling.processes import (  # noqa: E402
    CONTROLPLANE,
    REPO,
    init_control_plane,
    process_env,
    serve_control_plane,
    stopped_at_exit,
)

WINDOW = 1000
FLOOR_SAMPLES = 5
CONNECT_SAMPLES = 3
GOAL_RATE = 50.0
GOAL_RATIO = 0.8
CLIENT_TIMEOUT_S = 60.0


@dataclass
class Outcome:
    """What the client saw of every enrollment, in completion order."""

    started: float = 0.0
    ends: list[float] = field(default_factory=list)
    latencies_ms: list[float] = field(default_factory=list)
    failures: Counter[str] = field(default_factory=Counter)
    answers: list[tuple[int, EnrollmentAnswer]] = field(default_factory=list)


def _cli(*args: str) -> str:
    done = subprocess.run(
        [*args], capture_output=True, text=True, timeout=120, cwd=REPO, env=process_env()
    )
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args[2:5])} failed: {done.stderr}")
    return done.stdout.strip().splitlines()[-1]


async def _enroll_all(
    url: str, token: str, devices: int, concurrency: int, states: Path
) -> Outcome:
    facts = collect_facts()
    profile = select_profile(facts, load_profiles()).profile.name
    facts_doc = facts.to_dict()
    out = Outcome(started=time.monotonic())
    next_index = iter(range(devices))

    async def worker() -> None:
        for i in next_index:
            began = time.monotonic()
            try:
                answer = await enroll(
                    url,
                    token,
                    state_dir=states / f"d{i:05d}",
                    profile=profile,
                    facts=facts_doc,
                    labels={"bench": "enroll"},
                    timeout_s=CLIENT_TIMEOUT_S,
                )
            except EnrollError as e:
                out.failures[str(e)[:200]] += 1
                continue
            ended = time.monotonic()
            if answer.status is not EnrollmentStatus.ACCEPTED or answer.broker is None:
                out.failures[f"answer {answer.status.value} without credentials"] += 1
                continue
            out.ends.append(ended)
            out.latencies_ms.append((ended - began) * 1000.0)
            out.answers.append((i, answer))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return out


async def _broker_floor_ms(broker: DynsecMosquittoBroker, tag: str) -> float:
    """Median ms of one raw account creation on ``broker`` (then deleted again)."""
    times: list[float] = []
    async with DynsecProvisioner(
        broker.host, broker.port, broker.admin_username, broker.admin_password, timeout_s=60.0
    ) as provisioner:
        for k in range(FLOOR_SAMPLES):
            began = time.perf_counter()
            await provisioner.provision_device(f"floor-{tag}-{k}")
            times.append((time.perf_counter() - began) * 1000.0)
        for k in range(FLOOR_SAMPLES):
            await provisioner.delete_device(f"floor-{tag}-{k}")
    return round(statistics.median(times), 2)


def _connects(broker: DynsecMosquittoBroker, answer: EnrollmentAnswer) -> bool:
    """Whether a device logs in with the credentials of ``answer`` (MQTT 5 CONNACK success)."""
    import paho.mqtt.client as mqtt

    assert answer.broker is not None
    client = mqtt.Client(
        mqtt.CallbackAPIVersion.VERSION2,
        client_id=answer.broker.client_id,
        protocol=mqtt.MQTTv5,
    )
    client.username_pw_set(answer.broker.username, answer.broker.password)
    result: list[bool] = []
    client.on_connect = lambda _c, _u, _f, reason, _p: result.append(not reason.is_failure)
    try:
        client.connect(broker.host, broker.port, keepalive=10)
        deadline = time.monotonic() + 10
        while not result and time.monotonic() < deadline:
            client.loop(timeout=0.1)
        client.disconnect()
    except OSError:
        return False
    return bool(result and result[0])


def _cpu_s(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


def _own_cpu_s() -> float:
    times = os.times()
    return float(times.user + times.system)


def _rates(out: Outcome, window: int) -> dict[str, Any]:
    ends = sorted(out.ends)
    if len(ends) < 2 * window or window < 1:
        return {"rate_first_1k": None, "rate_last_1k": None, "rate_by_1k": []}
    edges = [out.started, *ends]
    by_window = [
        round(window / (edges[j + window] - edges[j]), 2)
        for j in range(0, len(ends) - window + 1, window)
    ]
    last = window / (ends[-1] - ends[-window - 1])
    return {
        "rate_first_1k": by_window[0],
        "rate_last_1k": round(last, 2),
        "rate_by_1k": by_window,
    }


def _percentile(values: list[float], p: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))], 1)


def run(work: Path, states: Path, devices: int, concurrency: int) -> dict[str, Any]:
    broker_dir = work / "broker"
    broker_dir.mkdir()
    data = work / "cp"
    cp_log = work / "controlplane.log"
    with DynsecMosquittoBroker(broker_dir) as broker, stopped_at_exit() as procs:
        api_token = init_control_plane(data, broker)
        with cp_log.open("w") as log_file:
            cp, url = serve_control_plane(data, procs, stderr=log_file.fileno())
        enroll_token = _cli(
            *CONTROLPLANE, "tokens", "create", "--uses", str(devices), "--expires", "12h",
            "--server", url, "--token", api_token,
        )  # fmt: skip
        floor_before = asyncio.run(_broker_floor_ms(broker, "before"))
        cpu_before = (_cpu_s(cp.pid), _cpu_s(broker.pid), _own_cpu_s())
        began = time.monotonic()
        out = asyncio.run(_enroll_all(url, enroll_token, devices, concurrency, states))
        wall = time.monotonic() - began
        cpu = (
            _cpu_s(cp.pid) - cpu_before[0],
            _cpu_s(broker.pid) - cpu_before[1],
            _own_cpu_s() - cpu_before[2],
        )
        samples = out.answers[:CONNECT_SAMPLES] + out.answers[-CONNECT_SAMPLES:]
        connected = sum(_connects(broker, answer) for _, answer in samples)
        floor_after = asyncio.run(_broker_floor_ms(broker, "after"))
        dynsec_bytes = broker.dynsec_path.stat().st_size
        log_tail = cp_log.read_text(errors="replace").splitlines()[-5:] if out.failures else []
    enrolled = len(out.ends)
    window = min(WINDOW, devices // 2)
    return {
        "devices": devices,
        "enrolled": enrolled,
        "failed": devices - enrolled,
        "failures": dict(out.failures.most_common(5)),
        "concurrency": concurrency,
        "window": window,
        **_rates(out, window),
        "rate_overall": round(enrolled / wall, 2) if wall > 0 else None,
        "wall_s": round(wall, 1),
        "p50_ms": _percentile(out.latencies_ms, 50),
        "p95_ms": _percentile(out.latencies_ms, 95),
        "max_ms": _percentile(out.latencies_ms, 100),
        "cpu": {
            "controlplane_s": round(cpu[0], 1),
            "broker_s": round(cpu[1], 1),
            "client_s": round(cpu[2], 1),
            "controlplane_ms_per_enrollment": round(1000 * cpu[0] / max(enrolled, 1), 2),
            "broker_ms_per_enrollment": round(1000 * cpu[1] / max(enrolled, 1), 2),
            "client_ms_per_enrollment": round(1000 * cpu[2] / max(enrolled, 1), 2),
        },
        "dynsec_file_bytes": dynsec_bytes,
        "broker_floor_ms": {"before": floor_before, "after": floor_after},
        "connected": f"{connected}/{len(samples)}",
        "controlplane_log_tail": log_tail,
    }


def _goals(result: dict[str, Any]) -> list[dict[str, Any]]:
    first, last = result["rate_first_1k"], result["rate_last_1k"]
    ratio = round(last / first, 2) if first and last else None
    return [
        {
            "name": "rate_last_1k / rate_first_1k",
            "value": ratio,
            "goal": f">= {GOAL_RATIO}",
            "pass": ratio is not None and ratio >= GOAL_RATIO,
        },
        {
            "name": "rate_last_1k",
            "value": last,
            "goal": f">= {GOAL_RATE}",
            "pass": last is not None and last >= GOAL_RATE,
        },
        {
            "name": "failed",
            "value": result["failed"],
            "goal": "== 0",
            "pass": result["failed"] == 0,
        },
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=10_000, help="devices to enroll")
    parser.add_argument("--concurrency", type=int, default=16, help="enrollments in flight")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    if args.devices < 2 or args.concurrency < 1:
        parser.error("--devices must be at least 2 and --concurrency at least 1")
    shm = Path("/dev/shm")
    with (
        tempfile.TemporaryDirectory(prefix="mcp-enroll-bench-") as tmp,
        tempfile.TemporaryDirectory(
            prefix="mcp-enroll-devices-", dir=shm if shm.is_dir() else None
        ) as states,
    ):
        result = run(Path(tmp), Path(states), args.devices, args.concurrency)
    report = {
        "bench": "enroll",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        **result,
        "goals": _goals(result),
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
