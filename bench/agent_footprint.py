"""The agent's memory footprint, enrolled and standalone, against the stack floor, in one run.

Three processes, each holding the digits MLP, measured by resident set size (VmRSS):

1. ``floor``: a bare Python process with what any agent of this design must hold: onnxruntime
   with the digits session loaded, an aiohttp server listening, and a paho MQTT 5 client
   connected to the broker (uvloop installed as the loop, as the agent does);
2. ``serve``: ``mcp-agent serve --model-path digits.onnx`` (no control plane);
3. ``run``: ``mcp-agent run --model-path digits.onnx`` enrolled with a real control plane and a
   real Mosquitto (dynamic security), measured once its MQTT session is online, the model is
   ready and the control plane has taken in its first health sample and reported state.

Each is read when ready and again after 200 inference requests; for ``run`` the second reading
waits until the control plane has also taken in the inference statistics of those requests
(``--stats-interval 2``), so it holds everything the steady path loads. ``run.received`` is the
control plane's count of each kind of message it took in from the agent. The goal: ``run`` ≤
100 MiB (Greengrass's nucleus needs ≥ 96 MB). Prints one JSON document; every process is
stopped in a ``finally`` block.

    .venv/bin/python bench/agent_footprint.py [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import textwrap
import urllib.request
from pathlib import Path
from typing import Any

import psutil

from mcp_edge.tooling.models import train_digits_mlp, write_digits_onnx
from mcp_edge.tooling.mosquitto import DynsecMosquittoBroker
from mcp_edge.tooling.processes import (
    AGENT,
    CONTROLPLANE,
    REPO,
    free_port,
    http_json,
    init_control_plane,
    serve_control_plane,
    stopped_at_exit,
    wait_until,
)

MIB = 1024 * 1024
GOAL_MIB = 100.0
REQUESTS = 200
ENV = {**os.environ, "PYTHONPATH": str(REPO)}

FLOOR = textwrap.dedent("""
    import asyncio, sys
    import uvloop, onnxruntime as ort, paho.mqtt.client as mqtt
    from aiohttp import web
    from paho.mqtt.enums import CallbackAPIVersion
    model, http_port, broker_port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    async def main():
        async def ready(request):
            return web.json_response({"ready": True})
        app = web.Application()
        app.router.add_get("/v2/health/ready", ready)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", http_port).start()
        client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="floor",
                             protocol=mqtt.MQTTv5)
        client.username_pw_set(sys.argv[4], sys.argv[5])
        client.connect("127.0.0.1", broker_port)
        client.loop_start()
        print("ready", flush=True)
        await asyncio.Event().wait()
    uvloop.run(main())
""")


def rss_mib(pid: int) -> float:
    return round(psutil.Process(pid).memory_info().rss / MIB, 1)


def infer_body(x: Any) -> bytes:
    return json.dumps(
        {
            "inputs": [
                {
                    "name": "input",
                    "shape": [1, 64],
                    "datatype": "FP32",
                    "data": [float(v) for v in x],
                }
            ]
        }
    ).encode()


def load(port: int, body: bytes) -> None:
    """``REQUESTS`` sequential inference requests (this bench measures memory, not speed)."""
    url = f"http://127.0.0.1:{port}/v2/models/digits/infer"
    for _ in range(REQUESTS):
        request = urllib.request.Request(
            url, data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=10) as answer:
            assert answer.status == 200


def ready(port: int) -> bool:
    try:
        return http_json(f"http://127.0.0.1:{port}/v2/health/ready")[0] == 200
    except OSError:
        return False


def cli(*args: str) -> str:
    done = subprocess.run([*args], capture_output=True, text=True, timeout=120, cwd=REPO, env=ENV)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:4])}… failed: {done.stderr}")
    return done.stdout.strip().splitlines()[-1]


def run(work: Path) -> dict[str, Any]:
    mlp = train_digits_mlp(seed=0)
    model = write_digits_onnx(mlp.model, work / "digits.onnx")
    body = infer_body(mlp.X_test[0])
    broker_dir = work / "broker"
    broker_dir.mkdir()
    result: dict[str, Any] = {}
    with DynsecMosquittoBroker(broker_dir) as broker, stopped_at_exit() as procs:
        # 1. the floor
        port = free_port()
        floor = subprocess.Popen(
            [
                sys.executable,
                "-c",
                FLOOR,
                str(model),
                str(port),
                str(broker.port),
                broker.admin_username,
                broker.admin_password,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        procs.append(floor)
        assert floor.stdout is not None and floor.stdout.readline().strip() == "ready"
        result["floor"] = {"rss_mib_ready": rss_mib(floor.pid)}

        # 2. mcp-agent serve
        port = free_port()
        serve = subprocess.Popen(
            [*AGENT, "serve", "--model-path", str(model), "--port", str(port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env=ENV,
        )
        procs.append(serve)
        wait_until(lambda: ready(port), "mcp-agent serve ready", 60)
        result["serve"] = {"rss_mib_ready": rss_mib(serve.pid)}
        load(port, body)
        result["serve"]["rss_mib_after_load"] = rss_mib(serve.pid)
        serve.terminate()

        # 3. mcp-agent run, enrolled
        data = work / "cp"
        token = init_control_plane(data, broker, env=ENV)
        _, cp_url = serve_control_plane(data, procs, env=ENV, stderr=subprocess.DEVNULL)
        enroll_token = cli(
            *CONTROLPLANE,
            "tokens",
            "create",
            "--uses",
            "1",
            "--expires",
            "1h",
            "--server",
            cp_url,
            "--token",
            token,
        )
        state = work / "agent"
        cli(
            *AGENT,
            "enroll",
            "--server",
            cp_url,
            "--token",
            enroll_token,
            "--device-id",
            "bench-cam",
            "--state-dir",
            str(state),
        )
        port = free_port()
        agent = subprocess.Popen(
            [
                *AGENT,
                "run",
                "--model-path",
                str(model),
                "--port",
                str(port),
                "--state-dir",
                str(state),
                "--stats-interval",
                "2",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env=ENV,
        )
        procs.append(agent)

        def online() -> bool:
            code, device = http_json(f"{cp_url}/api/v1/devices/bench-cam", token=token)
            return code == 200 and bool(device and device.get("online")) and ready(port)

        wait_until(online, "mcp-agent run online and ready", 90)
        wait_until(
            lambda: _received(cp_url).keys() >= {"health", "reported"},
            "the first health sample and reported state at the control plane",
            60,
        )
        result["run"] = {"rss_mib_ready": rss_mib(agent.pid)}
        load(port, body)
        wait_until(
            lambda: "inference" in _received(cp_url),
            "inference statistics at the control plane",
            60,
        )
        result["run"]["rss_mib_after_load"] = rss_mib(agent.pid)
        result["run"]["received"] = _received(cp_url)
        result["run"]["modules"] = sorted(_module_roots(agent.pid))
    return result


def _received(cp_url: str) -> dict[str, float]:
    """``mcp_cp_ingest_received_total`` by kind: valid device messages the control plane took in."""
    with urllib.request.urlopen(f"{cp_url}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    found = re.findall(r'^mcp_cp_ingest_received_total\{kind="(\w+)"\} (\S+)$', text, re.M)
    return {kind: float(n) for kind, n in found if float(n) > 0}


def _module_roots(pid: int) -> set[str]:
    """Shared libraries mapped by the process that belong to Python packages (what it loaded)."""
    roots: set[str] = set()
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            path = line.split()[-1] if "/" in line else ""
            if "site-packages/" in path:
                roots.add(path.split("site-packages/")[1].split("/")[0])
    return {r for r in roots if not r.endswith(".libs")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="mcp-footprint-") as tmp:
        measured = run(Path(tmp))
    run_rss = measured["run"]["rss_mib_after_load"]
    report = {
        "bench": "agent_footprint",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "units": "MiB (VmRSS)",
        **measured,
        "ratios": [
            {
                "name": "run_rss_mib_after_load",
                "value": run_rss,
                "goal": f"<= {GOAL_MIB}",
                "pass": run_rss <= GOAL_MIB,
            },
            {
                "name": "run_over_serve",
                "value": round(run_rss / measured["serve"]["rss_mib_after_load"], 2),
            },
            {
                "name": "run_over_floor",
                "value": round(run_rss / measured["floor"]["rss_mib_ready"], 2),
            },
        ],
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
