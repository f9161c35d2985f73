"""Model distribution end to end with real processes (issue 5's first acceptance point).

Control plane + Mosquitto with dynamic security + one enrolled agent started with no model:
publish a signed bundle (`mcp-bundle push`), deploy it (`mcp-controlplane deploy`), the agent
fetches it over MQTT through TUF and serves it; publish and deploy a second version while a
client sends requests without pause: the old version answers until the swap, the new one after
it, and not one request fails. The flight recorder (deployment events) and the reported state
reach the control plane.
"""

from __future__ import annotations

import json
import os
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mcp_edge.tooling.models import DigitsModels
from mcp_edge.tooling.mosquitto import DynsecMosquittoBroker
from mcp_edge.tooling.processes import (
    AGENT,
    BUNDLE,
    CONTROLPLANE,
    REPO,
    Client,
    free_port,
    init_control_plane,
    serve_control_plane,
    stopped_at_exit,
    wait_until,
)

CP = CONTROLPLANE

pytestmark = pytest.mark.timeout(300)


def _get(url: str, token: str | None = None) -> Any:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as r:
        return json.loads(r.read())


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except OSError:
        return 0


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[str]]]:
    with stopped_at_exit() as procs:
        yield procs


def test_publish_deploy_serve_then_hot_swap_without_a_failed_request(
    fresh_dynsec_broker: DynsecMosquittoBroker,
    digits: DigitsModels,
    tmp_path: Path,
    processes: list[subprocess.Popen[str]],
) -> None:
    broker = fresh_dynsec_broker
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def sh(*args: Any, timeout: float = 120) -> str:
        done = subprocess.run(
            [str(a) for a in args],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=REPO,
            env=env,
        )
        assert done.returncode == 0, f"{args[2:5]}: {done.stdout}\n{done.stderr}"
        return done.stdout

    data = tmp_path / "cp"
    api = init_control_plane(data, broker, env=env)
    _, cp_url = serve_control_plane(data, processes, env=env)
    auth = ("--server", cp_url, "--token", api)

    # The ML team's key, registered as a publisher; two signed versions of the digits model.
    key = tmp_path / "publisher.key"
    sh(*BUNDLE, "keygen", "--out", key)
    sh(*CP, "publishers", "add", key, "--name", "vision-team", *auth)
    bundles = {}
    for version in ("1.0.0", "1.1.0"):
        path = tmp_path / f"digits-{version}.mcpb"
        sh(*BUNDLE, "build", digits.onnx_path, "--name", "digits", "--version", version, "-o", path)
        sh(*BUNDLE, "sign", path, "--key", key)
        bundles[version] = path
    sh(*BUNDLE, "push", bundles["1.0.0"], *auth)

    # One agent, enrolled, started with no model at all.
    enroll_token = (
        sh(*CP, "tokens", "create", "--uses", "1", "--expires", "1h", "--group", "line-a", *auth)
        .strip()
        .splitlines()[-1]
    )
    state = tmp_path / "agent"
    sh(
        *AGENT,
        "enroll",
        "--server",
        cp_url,
        "--token",
        enroll_token,
        "--device-id",
        "cam-1",
        "--state-dir",
        state,
    )
    port = free_port()
    agent = subprocess.Popen(
        [*AGENT, "run", "--port", str(port), "--state-dir", str(state), "--health-interval", "1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=env,
    )
    processes.append(agent)
    wait_until(
        lambda: _get(f"{cp_url}/api/v1/devices", api)["items"][0].get("online"), "cam-1 online", 90
    )
    assert _status(f"http://127.0.0.1:{port}/v2/models/digits/ready") == 404

    sh(*CP, "deploy", "digits", "1.0.0", "--device", "cam-1", *auth)
    ready = f"http://127.0.0.1:{port}/v2/models/digits/ready"
    wait_until(lambda: _status(ready) == 200, "digits 1.0.0 served by the agent", 120)

    x = digits.X_test[:4].astype(np.float32)
    body = json.dumps(
        {
            "inputs": [
                {
                    "name": "input",
                    "shape": list(x.shape),
                    "datatype": "FP32",
                    "data": x.ravel().tolist(),
                }
            ]
        }
    ).encode()
    infer = f"http://127.0.0.1:{port}/v2/models/digits/infer"
    req = urllib.request.Request(infer, data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        answer = json.loads(r.read())
    assert answer["model_version"] == "1.0.0"
    scores = np.asarray(answer["outputs"][0]["data"], dtype=np.float32).reshape(4, 10)
    assert scores.argmax(1).tolist() == digits.y_test[:4].tolist()

    # Version 1.1.0 goes live under load: the client never sees a failure.
    client = Client(infer, body)
    client.start()
    try:
        wait_until(lambda: len(client.versions) >= 20, "the client under way", 30)
        sh(*BUNDLE, "push", bundles["1.1.0"], *auth)
        sh(*CP, "deploy", "digits", "1.1.0", "--device", "cam-1", *auth)
        wait_until(
            lambda: client.versions and client.versions[-1] == "1.1.0", "answers from 1.1.0", 90
        )
        seen = len(client.versions)
        wait_until(lambda: len(client.versions) >= seen + 20, "more answers after the swap", 30)
    finally:
        client.stop.set()
        client.join(timeout=15)
    assert client.failures == []
    first_new = client.versions.index("1.1.0")
    assert set(client.versions[:first_new]) == {"1.0.0"}
    assert set(client.versions[first_new:]) == {"1.1.0"}

    # The flight recorder and the reported state reached the control plane.
    def phases() -> list[tuple[str, str, str]]:
        items = _get(f"{cp_url}/api/v1/devices/cam-1/events?limit=200", api)["items"]
        return [(e["version"], e["phase"], e["outcome"]) for e in items]

    try:
        wait_until(lambda: ("1.1.0", "active", "ok") in phases(), "the 1.1.0 activation event", 30)
    except AssertionError:
        agent.terminate()
        raise AssertionError(f"{phases()}\n{agent.communicate(timeout=20)[1][-6000:]}") from None
    steps = [p for v, p, _ in phases() if v == "1.1.0"]
    for phase in ("downloading", "verifying", "installing", "loading", "active"):
        assert phase in steps, steps
    downloaded = [
        e
        for e in _get(f"{cp_url}/api/v1/devices/cam-1/events?limit=200", api)["items"]
        if e["version"] == "1.1.0" and e.get("bytes_total")
    ]
    assert downloaded and downloaded[-1]["bytes_total"] == bundles["1.1.0"].stat().st_size
