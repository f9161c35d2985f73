"""``mcp-agent serve`` as an operator runs it: a real process, real port, real files."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mcp_edge.tooling.models import DigitsModels
from mcp_edge.tooling.processes import free_port

AGENT = [sys.executable, "-m", "mcp_edge.agent.cli"]


def _get(url: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _post(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _wait(predicate: Any, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def agent_process(tmp_path: Path) -> Iterator[Any]:
    procs: list[subprocess.Popen[str]] = []

    def start(*args: str) -> tuple[subprocess.Popen[str], str]:
        port = free_port()
        proc = subprocess.Popen(
            [*AGENT, "serve", "--port", str(port), "--state-dir", str(tmp_path / "state"), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).resolve().parents[2],
        )
        procs.append(proc)
        base = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"agent exited: {proc.communicate()[1]}")
            return _get(base + "/v2/health/ready")[0] == 200

        _wait(ready, "the agent to become ready")
        return proc, base

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=10)


def test_serve_answers_reloads_a_replaced_file_and_stops_cleanly(
    digits: DigitsModels, tmp_path: Path, agent_process: Any
) -> None:
    models = tmp_path / "models"
    models.mkdir()
    shutil.copy(digits.onnx_path, models / "digits.onnx")
    proc, base = agent_process("--model-path", str(models), "--watch-interval", "0.1")
    x = digits.X_test[:2]
    body = {
        "inputs": [
            {"name": "input", "shape": [2, 64], "datatype": "FP32", "data": x.ravel().tolist()}
        ]
    }
    status, answer = _post(base + "/v2/models/digits/infer", body)
    assert status == 200 and answer["model_version"] == "1"
    # Replace the file the way deploy tools do (write aside, rename over): the watcher
    # hot-swaps it in.
    shutil.copy(digits.onnx_path, models / ".digits.onnx.new")
    os.replace(models / ".digits.onnx.new", models / "digits.onnx")
    _wait(lambda: _get(base + "/v2/models/digits")[1]["versions"] == ["2"], "version 2")
    status, answer = _post(base + "/v2/models/digits/infer", body)
    assert status == 200 and answer["model_version"] == "2"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "serving digits on http://127.0.0.1:" in err
    assert "hot swap: digits 1 -> 2" in err


def test_serve_with_a_canary_from_the_command_line(
    digits: DigitsModels, tmp_path: Path, agent_process: Any
) -> None:
    canary_dir = tmp_path / "next"
    canary_dir.mkdir()
    shutil.copy(digits.onnx_path, canary_dir / "digits.onnx")
    _, base = agent_process(
        "--model-path", str(digits.onnx_path), "--canary", f"{canary_dir / 'digits.onnx'}:0.25"
    )
    meta = _get(base + "/v2/models/digits")[1]
    assert meta["versions"] == ["1", "2"]
    assert meta["parameters"]["canary"] == {
        "version": "2",
        "weight": 0.25,
        "enabled": True,
        "error_rate": 0.0,
    }


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/PID/maps")
def test_serving_well_formed_requests_never_loads_pydantic(
    digits: DigitsModels, agent_process: Any
) -> None:
    # pydantic and the message models cost about 10 MiB of RSS; serving needs them only to
    # explain a refused body (docs/agent.md).
    proc, base = agent_process("--model-path", str(digits.onnx_path))
    maps = Path(f"/proc/{proc.pid}/maps")
    body = {
        "inputs": [
            {
                "name": "input",
                "shape": [1, 64],
                "datatype": "FP32",
                "data": digits.X_test[0].tolist(),
            }
        ]
    }
    assert _post(base + "/v2/models/digits/infer", body)[0] == 200
    assert _get(base + "/v2/models/digits")[0] == 200
    with urllib.request.urlopen(base + "/metrics", timeout=5) as r:
        assert b"mcp_agent_requests_total" in r.read()
    assert "pydantic_core" not in maps.read_text()
    status, answer = _post(base + "/v2/models/digits/infer", {"inputs": "nope"})
    assert status == 400 and "inputs" in answer["error"]
    assert "pydantic_core" in maps.read_text()  # loaded for the full validation, once


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model-path", "/nonexistent/model.onnx"], "does not exist"),
        (["--model-path", "{empty}"], "no model files"),
        (["--model-path", "{model}", "--profile", "mainframe"], "unknown profile"),
        (["--model-path", "{model}", "--canary", "{model}:7"], "weight must be from 0 to 1"),
    ],
)
def test_serve_refuses_bad_arguments_with_a_clear_message(
    digits: DigitsModels, tmp_path: Path, args: list[str], message: str
) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    args = [a.format(empty=empty, model=digits.onnx_path) for a in args]
    result = subprocess.run(
        [*AGENT, "serve", "--port", str(free_port()), "--state-dir", str(tmp_path / "s"), *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert result.returncode != 0
    assert message in result.stderr.lower()


def test_quickstart_script_serves_the_demo_model(tmp_path: Path) -> None:
    repo = Path(__file__).resolve().parents[2]
    env = {
        **os.environ,
        "MCP_VENV": sys.prefix,
        "PORT": str(free_port()),
        "MCP_QUICKSTART_DIR": str(tmp_path / "qs"),
    }
    result = subprocess.run(
        ["bash", "deploy/quickstart.sh", "--smoke"],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    expected = result.stdout.split("expected answers for sample.json: ")[1].splitlines()[0]
    assert f"quickstart: digits answered {expected}" in result.stdout
