"""``mcp-agent serve --profile intel-xeon`` as a real process: the Xeon profile serves ``.onnx``
models on the OpenVINO runtime, answers as onnxruntime does, and says so in the model's
metadata, ``/metrics`` and ``mcp-agent doctor``; compiled models are cached under the state
directory."""

from __future__ import annotations

import json
import subprocess
import urllib.request
from pathlib import Path

import numpy as np

from mcp_edge.tooling.models import DigitsModels, onnx_predict
from mcp_edge.tooling.processes import (
    AGENT,
    REPO,
    free_port,
    http_json,
    process_env,
    stopped_at_exit,
    wait_until,
)


def _ready(proc: subprocess.Popen[str], base: str) -> bool:
    if proc.poll() is not None:
        raise AssertionError(f"agent exited: {proc.communicate()[1]}")
    try:
        return http_json(f"{base}/v2/health/ready")[0] == 200
    except OSError:
        return False


def test_xeon_profile_serves_onnx_on_openvino(digits: DigitsModels, tmp_path: Path) -> None:
    state = tmp_path / "state"
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with stopped_at_exit() as procs:
        proc = subprocess.Popen(
            [
                *AGENT,
                "serve",
                "--model-path",
                str(digits.onnx_path),
                "--profile",
                "intel-xeon",
                "--threads",
                "1",
                "--port",
                str(port),
                "--state-dir",
                str(state),
                "--watch-interval",
                "0",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env=process_env(),
        )
        procs.append(proc)
        wait_until(lambda: _ready(proc, base), "the agent to become ready", timeout_s=60)

        X = digits.X_test[:5]
        body = {
            "inputs": [
                {"name": "input", "shape": [5, 64], "datatype": "FP32", "data": X.ravel().tolist()}
            ]
        }
        status, answer = http_json(f"{base}/v2/models/digits/infer", body=json.dumps(body).encode())
        assert status == 200, answer
        (out,) = answer["outputs"]
        assert out["name"] == "probabilities" and out["shape"] == [5, 10]
        got = np.asarray(out["data"], dtype=np.float32).reshape(5, 10)
        expected = onnx_predict(digits.onnx_path, X)
        # The Xeon profile prefers bf16 where the CPU lists BF16: answers within about 1e-2.
        np.testing.assert_allclose(got, expected, atol=2e-2)
        assert (got.argmax(axis=1) == expected.argmax(axis=1)).all()

        status, meta = http_json(f"{base}/v2/models/digits")
        assert status == 200
        assert meta["parameters"]["backend"] == "openvino"
        assert meta["platform"] == "openvino_onnx"
        assert meta["parameters"]["provider"] == "CPU"
        assert meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 64]}]

        with urllib.request.urlopen(f"{base}/metrics", timeout=10) as r:
            metrics = r.read().decode()
        info = [line for line in metrics.splitlines() if line.startswith("mcp_agent_model_info{")]
        assert any('backend="openvino"' in line and 'provider="CPU"' in line for line in info)

        # The compiled model went to the cache under the state directory.
        assert any((state / "cache" / "openvino").iterdir())

        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert "digits 1 on openvino/CPU" in err

    doctor = subprocess.run(
        [*AGENT, "doctor", "--profile", "intel-xeon"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=process_env(),
        timeout=120,
    )
    assert doctor.returncode == 0, doctor.stderr
    assert ".onnx models    openvino/CPU -> CPUExecutionProvider" in doctor.stdout
    assert "would use     openvino/CPU" in doctor.stdout
    loadable = doctor.stdout.split("Loadable here")[1]
    assert any(line.split()[:1] == ["openvino"] for line in loadable.splitlines())
    # Both TFLite interpreters are installed here: the second one is listed with its version
    # or, under NumPy 2, the one-line reason it cannot run; NumPy's page of advice stays out.
    assert "tflite (tflite-runtime)" in loadable
    assert "compiled using NumPy 1.x" not in doctor.stderr
