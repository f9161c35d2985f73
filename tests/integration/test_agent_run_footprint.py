"""What an enrolled ``mcp-agent run`` loads, and when (docs/agent.md "Memory").

A real control plane, a dynamic-security Mosquitto and one enrolled agent serving the digits
model from ``--model-path``. Once the control plane has taken in the agent's health samples,
inference statistics and reported state, and the agent has answered inference requests, the
agent process has not imported pydantic or the TUF client: neither ``pydantic_core`` nor
``cryptography`` is mapped (``/proc/PID/maps``), and Python's import log (``-X importtime``)
names none of pydantic, ``tuf.ngclient``, ``tuf.api.metadata``, securesystemslib's signers,
cryptography or urllib3. (``tuf.api.exceptions``, python-tuf's exception classes, a few KiB, is
imported by the MQTT repository transport.) Then a signed bundle is deployed: the agent loads
what it needs (pydantic for the desired state, the TUF client for the metadata), fetches the
model over MQTT and serves it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mcp_edge.tooling.models import DigitsModels
from mcp_edge.tooling.mosquitto import DynsecMosquittoBroker
from mcp_edge.tooling.processes import (
    AGENT,
    BUNDLE,
    CONTROLPLANE,
    REPO,
    free_port,
    init_control_plane,
    serve_control_plane,
    stopped_at_exit,
    wait_until,
)

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/PID/maps"),
]

DEFERRED = ("pydantic", "pydantic_core", "tuf.ngclient", "tuf.api.metadata",
            "securesystemslib.signer", "cryptography", "urllib3")  # fmt: skip
"""Packages the steady path of an enrolled agent does without (import names)."""


def _status(url: str, body: bytes | None = None) -> int:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except OSError:
        return 0


def _received(cp_url: str) -> dict[str, float]:
    """Valid device messages the control plane took in, by kind (its /metrics)."""
    with urllib.request.urlopen(f"{cp_url}/metrics", timeout=10) as r:
        text = r.read().decode()
    found = re.findall(r'^mcp_cp_ingest_received_total\{kind="(\w+)"\} (\S+)$', text, re.M)
    return {kind: float(n) for kind, n in found if float(n) > 0}


def _imported(log: Path) -> set[str]:
    """Every module the process imported so far, from its ``-X importtime`` lines."""
    names = set()
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("import time:") and "|" in line:
            names.add(line.rsplit("|", 1)[1].strip())
    return names


def _deferred_in(names: set[str]) -> list[str]:
    return sorted(n for n in names if any(n == d or n.startswith(d + ".") for d in DEFERRED))


def _mapped(pid: int, library: str) -> bool:
    return f"site-packages/{library}/" in Path(f"/proc/{pid}/maps").read_text()


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[str]]]:
    with stopped_at_exit() as procs:
        yield procs


def test_enrolled_agent_serves_and_reports_without_pydantic_or_tuf_until_a_deployment(
    fresh_dynsec_broker: DynsecMosquittoBroker, digits: DigitsModels, tmp_path: Path,
    processes: list[subprocess.Popen[str]],
) -> None:  # fmt: skip
    broker = fresh_dynsec_broker
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def sh(*args: Any) -> str:
        done = subprocess.run([str(a) for a in args], capture_output=True, text=True,
                              timeout=120, cwd=REPO, env=env)  # fmt: skip
        assert done.returncode == 0, f"{args[2:5]}: {done.stdout}\n{done.stderr}"
        return done.stdout

    data = tmp_path / "cp"
    api = init_control_plane(data, broker, env=env)
    _, cp_url = serve_control_plane(data, processes, env=env, stderr=subprocess.DEVNULL)
    auth = ("--server", cp_url, "--token", api)
    token = sh(*CONTROLPLANE, "tokens", "create", "--uses", "1", "--expires", "1h", *auth)
    state = tmp_path / "agent"
    sh(*AGENT, "enroll", "--server", cp_url, "--token", token.strip().splitlines()[-1],
       "--device-id", "cam-1", "--state-dir", state)  # fmt: skip

    # The agent, with the import log on (it goes to stderr, kept in a file).
    log = tmp_path / "agent.stderr"
    port = free_port()
    with log.open("w") as stderr:
        agent = subprocess.Popen(
            [*AGENT, "run", "--model-path", str(digits.onnx_path), "--port", str(port),
             "--state-dir", str(state), "--health-interval", "1", "--stats-interval", "1"],
            stdout=subprocess.DEVNULL, stderr=stderr, text=True, cwd=REPO,
            env={**env, "PYTHONPROFILEIMPORTTIME": "1"},
        )  # fmt: skip
    processes.append(agent)
    base = f"http://127.0.0.1:{port}"
    wait_until(lambda: _status(f"{base}/v2/models/digits/ready") == 200, "digits served", 60)
    body = json.dumps({"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32",
                                   "data": digits.X_test[0].tolist()}]}).encode()  # fmt: skip
    for _ in range(20):
        assert _status(f"{base}/v2/models/digits/infer", body) == 200
    wait_until(lambda: _received(cp_url).keys() >= {"status", "health", "reported", "inference"},
               "the agent's status, health, reported state and statistics taken in", 60)  # fmt: skip
    assert not _mapped(agent.pid, "pydantic_core") and not _mapped(agent.pid, "cryptography")
    assert _deferred_in(_imported(log)) == []
    assert "tuf.api.exceptions" in _imported(log)  # what the test's docstring says it allows

    # A deployment: the desired state and TUF metadata load what they need, and it is served.
    key = tmp_path / "publisher.key"
    bundle = tmp_path / "lenet-1.0.0.mcpb"
    sh(*BUNDLE, "keygen", "--out", key)
    sh(*CONTROLPLANE, "publishers", "add", key, "--name", "vision-team", *auth)
    sh(*BUNDLE, "build", digits.onnx_path, "--name", "lenet", "--version", "1.0.0", "-o", bundle)
    sh(*BUNDLE, "sign", bundle, "--key", key)
    sh(*BUNDLE, "push", bundle, *auth)
    sh(*CONTROLPLANE, "deploy", "lenet", "1.0.0", "--device", "cam-1", *auth)
    wait_until(lambda: _status(f"{base}/v2/models/lenet/ready") == 200, "lenet deployed", 120)
    assert _status(f"{base}/v2/models/lenet/infer", body) == 200
    assert _mapped(agent.pid, "pydantic_core") and _mapped(agent.pid, "cryptography")
    assert {"pydantic", "tuf.ngclient", "tuf.api.metadata"} <= _imported(log)
