"""The whole fleet path with real processes: control plane, Mosquitto with dynamic security,
two enrolled agents, MQTT inference by device and by fleet topic, offline via the will."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mcp_edge.client import InferenceClient
from mcp_edge.tooling.models import DigitsModels
from mcp_edge.tooling.mosquitto import DynsecMosquittoBroker
from mcp_edge.tooling.processes import (
    AGENT,
    CONTROLPLANE,
    REPO,
    free_port,
    init_control_plane,
    process_env,
    serve_control_plane,
    stopped_at_exit,
    wait_until,
)

CP = CONTROLPLANE


def _api(url: str, token: str) -> Any:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[str]]]:
    with stopped_at_exit() as procs:
        yield procs


def _devices(cp_url: str, token: str) -> dict[str, dict[str, Any]]:
    body = _api(f"{cp_url}/api/v1/devices", token)
    items = body["items"] if isinstance(body, dict) else body
    return {d["id"]: d for d in items}


def test_enroll_two_agents_infer_over_mqtt_and_see_offline_by_will(
    fresh_dynsec_broker: DynsecMosquittoBroker,
    digits: DigitsModels,
    tmp_path: Path,
    processes: list[subprocess.Popen[str]],
) -> None:
    broker = fresh_dynsec_broker
    data = tmp_path / "cp"
    env = process_env()
    api_token = init_control_plane(data, broker, env=env)
    _, cp_url = serve_control_plane(data, processes, env=env)
    token = subprocess.run(
        [
            *CP,
            "tokens",
            "create",
            "--uses",
            "2",
            "--expires",
            "1h",
            "--labels",
            "site=lab",
            "--server",
            cp_url,
            "--token",
            api_token,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env=env,
    )
    assert token.returncode == 0, token.stderr
    enroll_token = token.stdout.strip().splitlines()[-1]

    agents: dict[str, subprocess.Popen[str]] = {}
    for name in ("cam-1", "cam-2"):
        state = tmp_path / name
        enrolled = subprocess.run(
            [
                *AGENT,
                "enroll",
                "--server",
                cp_url,
                "--token",
                enroll_token,
                "--device-id",
                name,
                "--state-dir",
                str(state),
            ],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=REPO,
            env=env,
        )
        assert enrolled.returncode == 0, enrolled.stderr
        assert f"enrolled as {name}" in enrolled.stdout
        again = subprocess.run(
            [
                *AGENT,
                "enroll",
                "--server",
                cp_url,
                "--token",
                enroll_token,
                "--device-id",
                name,
                "--state-dir",
                str(state),
            ],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=REPO,
            env=env,
        )
        assert again.returncode == 0 and "nothing changed" in again.stdout
        proc = subprocess.Popen(
            [
                *AGENT,
                "run",
                "--model-path",
                str(digits.onnx_path),
                "--port",
                str(free_port()),
                "--state-dir",
                str(state),
                "--health-interval",
                "1",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env=env,
        )
        processes.append(proc)
        agents[name] = proc

    def both_online() -> bool:
        devices = _devices(cp_url, api_token)
        return all(devices.get(n, {}).get("online") for n in agents)

    wait_until(both_online, "both agents online in GET /api/v1/devices", 60)
    devices = _devices(cp_url, api_token)
    assert devices["cam-1"]["labels"] == {"site": "lab"}
    wait_until(
        lambda: len(_api(f"{cp_url}/api/v1/devices/cam-1/health", api_token)["items"]) > 0,
        "a health sample from cam-1",
        60,
    )

    app = subprocess.run(
        [*CP, "apps", "create", "e2e-app", "--json", "--server", cp_url, "--token", api_token],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env=env,
    )
    assert app.returncode == 0, app.stderr
    creds = json.loads(app.stdout)

    async def infer() -> None:
        x = digits.X_test[:5].astype(np.float32)
        async with InferenceClient(
            broker.host,
            broker.port,
            client_id=creds["client_id"],
            username=creds["username"],
            password=creds["password"],
        ) as client:
            for device in ("cam-1", "cam-2", None):
                resp = await client.infer("digits", {"input": x}, device=device, timeout_s=10)
                scores = np.asarray(resp.outputs[0].data, dtype=np.float32).reshape(5, 10)
                assert scores.argmax(1).tolist() == digits.y_test[:5].tolist()

    asyncio.run(infer())

    agents["cam-2"].send_signal(signal.SIGKILL)
    agents["cam-2"].wait(timeout=10)
    wait_until(
        lambda: not _devices(cp_url, api_token)["cam-2"]["online"],
        "cam-2 offline through its last will",
        90,
    )
    assert _devices(cp_url, api_token)["cam-1"]["online"]
