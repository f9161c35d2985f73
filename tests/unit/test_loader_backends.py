"""The loader's backend order: the profile's entries in order, opt_in, ``--backend``, and the
clean fallback (one warning line, ``fallback_reason``) when an entry cannot be used here.

Real OpenVINO and onnxruntime throughout; "OpenVINO not installed" is a subprocess whose
``sys.modules["openvino"]`` is None, which makes the real import fail.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from mcp_edge.agent.runtime.loader import (
    BackendChoice,
    available_backends,
    backend_available,
    backend_order,
    load_runner,
    onnx_providers,
    provider_alias,
)
from mcp_edge.agent.runtime.openvino_runner import INSTALL_HINT, openvino_core, openvino_version
from mcp_edge.agent.runtime.runner import BackendUnavailableError, ModelLoadError
from mcp_edge.agent.runtime.tflite_runner import tflite_implementation
from mcp_edge.shared.profiles import HardwareProfile, load_profiles, parse_profile
from mcp_edge.tooling.models import DigitsModels, onnx_predict
from mcp_edge.tooling.processes import REPO, process_env

IN, OUT = "input", "probabilities"
CPU = "CPUExecutionProvider"
OFFERED = set(ort.get_available_providers())


def _profile(backends: str, formats: str = '["onnx", "tflite"]') -> HardwareProfile:
    return parse_profile(
        f"""
name = "test-box"
description = "a box"
[detect]
[runtime]
formats = {formats}
intra_op_threads = 1
{backends}
[variants]
tags = ["test-box"]
""",
        "test-box.toml",
    )


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and r.name == "mcp.agent.runtime"
    ]


def test_xeon_order_is_openvino_then_onnxruntime_cpu() -> None:
    xeon = load_profiles()["intel-xeon"]
    assert xeon.runtime.selection.measure is True
    assert [c.label for c in backend_order(xeon, "onnx")] == [
        "openvino/CPU",
        "onnxruntime/CPUExecutionProvider",
    ]
    # The OpenVINO execution provider is opt-in: only when named.
    assert [c.label for c in backend_order(xeon, "onnx", "openvino-ep")] == [
        "onnxruntime/OpenVINOExecutionProvider",
        "onnxruntime/CPUExecutionProvider",
    ]
    assert backend_order(xeon, "onnx", "openvino-ep")[0].options == {"device_type": "CPU"}
    assert [c.label for c in backend_order(xeon, "onnx", "onnxruntime")] == [
        "onnxruntime/CPUExecutionProvider"
    ]
    assert [c.label for c in backend_order(xeon, "onnx", "cpu")] == [
        "onnxruntime/CPUExecutionProvider"
    ]
    assert onnx_providers(xeon) == [(CPU, {})]


def test_openvino_is_a_runtime_name_and_openvino_ep_the_provider() -> None:
    generic = load_profiles()["generic-x86_64"]
    # A profile without an openvino entry: --backend openvino still tries it first, on CPU.
    assert backend_order(generic, "onnx", "openvino") == [
        BackendChoice("openvino", "CPU"),
        BackendChoice("onnxruntime", CPU),
    ]
    assert provider_alias("openvino-ep") == "OpenVINOExecutionProvider"
    with pytest.raises(ValueError, match="unknown backend 'openvino'"):
        provider_alias("openvino")
    with pytest.raises(BackendUnavailableError, match=r"openvino cannot run a \.tflite"):
        backend_order(generic, "tflite", "openvino")


def test_order_follows_the_profile_and_always_ends_on_cpu() -> None:
    profile = _profile(
        """
[[runtime.backends]]
name = "onnxruntime"
provider = "CUDAExecutionProvider"
[[runtime.backends]]
name = "openvino"
provider = "AUTO"
options = { PERFORMANCE_HINT = "THROUGHPUT" }
[[runtime.backends]]
name = "openvino"
provider = "GPU"
opt_in = true
[[runtime.backends]]
name = "tflite"
provider = "CPU"
"""
    )
    assert [c.label for c in backend_order(profile, "onnx")] == [
        "onnxruntime/CUDAExecutionProvider",
        "openvino/AUTO",
        "onnxruntime/CPUExecutionProvider",
    ]
    assert backend_order(profile, "onnx")[1].options == {"PERFORMANCE_HINT": "THROUGHPUT"}
    # --backend openvino: every openvino entry (opt-in too) first, then the rest.
    assert [c.label for c in backend_order(profile, "onnx", "openvino")] == [
        "openvino/AUTO",
        "openvino/GPU",
        "onnxruntime/CUDAExecutionProvider",
        "onnxruntime/CPUExecutionProvider",
    ]
    assert [c.label for c in backend_order(profile, "tflite")] == ["tflite/CPU"]
    assert [c.label for c in backend_order(profile, "tflite", "xnnpack")] == ["tflite/XNNPACK"]


def test_xeon_loads_on_openvino_and_answers_like_onnxruntime(
    digits: DigitsModels, caplog: pytest.LogCaptureFixture
) -> None:
    xeon = load_profiles()["intel-xeon"]
    with caplog.at_level(logging.WARNING, logger="mcp.agent.runtime"):
        runner = load_runner(digits.onnx_path, xeon, threads=1)
    assert runner.info.backend == "openvino" and runner.info.provider == "CPU"
    assert runner.info.fallback_reason is None
    assert runner.info.details["config"]["INFERENCE_NUM_THREADS"] == 1
    assert _warnings(caplog) == []
    X = digits.X_test[:32]
    got, want = runner.run({IN: X})[OUT], onnx_predict(digits.onnx_path, X)
    # The Xeon profile's prefer_bf16: bf16 where the CPU lists BF16, f32 elsewhere.
    bf16 = "BF16" in openvino_core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")
    assert runner.info.details["precision"].startswith("bf16" if bf16 else "f32")
    np.testing.assert_allclose(got, want, atol=2e-2 if bf16 else 1e-4)
    assert (got.argmax(axis=1) == want.argmax(axis=1)).all()
    # Insisting on onnxruntime skips the openvino entry without a warning.
    runner = load_runner(digits.onnx_path, xeon, backend="onnxruntime", threads=1)
    assert (runner.info.backend, runner.info.provider) == ("onnxruntime", CPU)
    assert runner.info.fallback_reason is None


def test_tflite_files_take_the_tflite_entries_on_xeon(digits: DigitsModels) -> None:
    runner = load_runner(digits.tflite_path, load_profiles()["intel-xeon"], threads=1)
    assert runner.info.backend == "tflite"
    with pytest.raises(BackendUnavailableError, match=r"openvino cannot run a \.tflite"):
        load_runner(digits.tflite_path, load_profiles()["intel-xeon"], backend="openvino")


def test_openvino_compile_failure_falls_back_with_one_warning(
    digits: DigitsModels, caplog: pytest.LogCaptureFixture
) -> None:
    profile = _profile(
        """
[[runtime.backends]]
name = "openvino"
provider = "CPU"
options = { PERFORMANCE_HINT = "WARP_SPEED" }
[[runtime.backends]]
name = "onnxruntime"
provider = "CPUExecutionProvider"
"""
    )
    with caplog.at_level(logging.WARNING, logger="mcp.agent.runtime"):
        runner = load_runner(digits.onnx_path, profile)
    assert (runner.info.backend, runner.info.provider) == ("onnxruntime", CPU)
    reason = runner.info.fallback_reason or ""
    assert reason.startswith("openvino/CPU: OpenVINO cannot compile the model for CPU")
    assert "WARP_SPEED" in reason
    (line,) = _warnings(caplog)
    assert line.startswith("digits.onnx: running on CPUExecutionProvider; skipped openvino/CPU")
    assert "\n" not in line
    X = digits.X_test[:8]
    np.testing.assert_allclose(runner.run({IN: X})[OUT], onnx_predict(digits.onnx_path, X))


@pytest.mark.skipif("CUDAExecutionProvider" in OFFERED, reason="needs an onnxruntime without CUDA")
def test_a_missing_provider_before_openvino_falls_to_openvino_not_to_cpu(
    digits: DigitsModels, caplog: pytest.LogCaptureFixture
) -> None:
    profile = _profile(
        """
[[runtime.backends]]
name = "onnxruntime"
provider = "CUDAExecutionProvider"
[[runtime.backends]]
name = "openvino"
provider = "CPU"
[[runtime.backends]]
name = "onnxruntime"
provider = "CPUExecutionProvider"
"""
    )
    with caplog.at_level(logging.WARNING, logger="mcp.agent.runtime"):
        runner = load_runner(digits.onnx_path, profile)
    assert (runner.info.backend, runner.info.provider) == ("openvino", "CPU")
    assert runner.info.fallback_reason == "CUDAExecutionProvider is not in this onnxruntime build"
    assert _warnings(caplog) == [
        "digits.onnx: running on openvino/CPU; skipped "
        "CUDAExecutionProvider is not in this onnxruntime build"
    ]


@pytest.mark.skipif("OpenVINOExecutionProvider" in OFFERED, reason="this onnxruntime has OVEP")
def test_backend_openvino_ep_falls_back_to_cpu_when_not_installed(
    digits: DigitsModels, caplog: pytest.LogCaptureFixture
) -> None:
    xeon = load_profiles()["intel-xeon"]
    with caplog.at_level(logging.WARNING, logger="mcp.agent.runtime"):
        runner = load_runner(digits.onnx_path, xeon, backend="openvino-ep")
    assert (runner.info.backend, runner.info.provider) == ("onnxruntime", CPU)
    assert "OpenVINOExecutionProvider" in (runner.info.fallback_reason or "")
    assert len(_warnings(caplog)) == 1


def test_tflite_entries_pick_the_implementation_in_order(
    digits: DigitsModels, caplog: pytest.LogCaptureFixture
) -> None:
    profile = _profile(
        """
[[runtime.backends]]
name = "tflite"
provider = "XNNPACK"
options = { implementation = "tflite-runtime" }
[[runtime.backends]]
name = "tflite"
provider = "XNNPACK"
options = { implementation = "ai-edge-litert" }
"""
    )
    try:
        tflite_implementation("tflite-runtime")
        usable = True
    except BackendUnavailableError:
        usable = False  # tflite-runtime 2.14 under NumPy 2
    with caplog.at_level(logging.WARNING, logger="mcp.agent.runtime"):
        runner = load_runner(digits.tflite_path, profile)
    assert runner.info.backend == "tflite"
    if usable:
        assert runner.info.details["implementation"] == "tflite-runtime"
        assert runner.info.fallback_reason is None and _warnings(caplog) == []
    else:
        assert runner.info.details["implementation"] == "ai-edge-litert"
        assert (runner.info.fallback_reason or "").startswith("tflite/XNNPACK: tflite-runtime")
        (line,) = _warnings(caplog)
        assert line.startswith("digits.tflite: running on tflite/XNNPACK; skipped tflite/XNNPACK")
    X = digits.X_test[:4]
    assert runner.run({IN: X})[OUT].shape == (4, 10)


def test_invalid_provider_options_skip_the_provider_with_the_reason(
    digits: DigitsModels, caplog: pytest.LogCaptureFixture
) -> None:
    profile = _profile(
        """
[[runtime.backends]]
name = "onnxruntime"
provider = "CPUExecutionProvider"
options = { bogus = 1 }
"""
    )
    with caplog.at_level(logging.WARNING, logger="mcp.agent.runtime"):
        runner = load_runner(digits.onnx_path, profile)
    assert (runner.info.backend, runner.info.provider) == ("onnxruntime", CPU)
    assert "'bogus'" in (runner.info.fallback_reason or "")
    (line,) = _warnings(caplog)
    assert "'bogus'" in line and "default options" in line


def test_a_corrupt_model_is_a_model_load_error_after_every_backend(
    digits: DigitsModels, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x00not a model\xff" * 64)
    with pytest.raises(ModelLoadError, match=r"bad\.onnx: onnxruntime cannot load the model"):
        load_runner(bad, load_profiles()["intel-xeon"])


def test_openvino_compiles_into_the_cache_dir(digits: DigitsModels, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    runner = load_runner(digits.onnx_path, load_profiles()["intel-xeon"], cache_dir=cache)
    assert runner.info.details["config_requested"]["CACHE_DIR"] == str(cache / "openvino")
    assert any((cache / "openvino").iterdir())


def test_backend_available_says_why_not() -> None:
    assert backend_available("onnxruntime") is None
    assert backend_available("openvino") is None
    assert backend_available("tflite") is None
    assert backend_available("cpu") is None
    assert backend_available("CPUExecutionProvider") is None
    assert backend_available("xnnpack") is None  # the TFLite interpreter's delegate
    if "TensorrtExecutionProvider" not in OFFERED:
        reason = backend_available("tensorrt") or ""
        assert reason.startswith("TensorrtExecutionProvider is not in this onnxruntime build")
    if "OpenVINOExecutionProvider" not in OFFERED:
        assert "OpenVINOExecutionProvider" in (backend_available("openvino-ep") or "")
    assert "unknown backend 'warp-drive'" in (backend_available("warp-drive") or "")


def test_available_backends_names_openvino_and_its_devices() -> None:
    found = available_backends()
    assert found["openvino"].startswith(f"{openvino_version()}: ")
    assert "CPU" in found["openvino"].split(": ", 1)[1].split(", ")


def test_without_openvino_xeon_falls_back_to_onnxruntime_with_one_warning(
    digits: DigitsModels,
) -> None:
    code = f"""
import json, logging, sys
sys.modules["openvino"] = None
from pathlib import Path
from mcp_edge.agent.runtime.loader import available_backends, backend_available, load_runner
from mcp_edge.shared.profiles import load_profiles

records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append((record.name, record.levelname, record.getMessage()))
logging.getLogger().addHandler(Keep())
logging.getLogger().setLevel(logging.DEBUG)
runner = load_runner(Path({str(digits.onnx_path)!r}), load_profiles()["intel-xeon"])
print(json.dumps({{
    "backend": runner.info.backend,
    "provider": runner.info.provider,
    "fallback_reason": runner.info.fallback_reason,
    "records": [r for r in records if r[1] in ("WARNING", "ERROR")],
    "available": backend_available("openvino"),
    "listed": available_backends()["openvino"],
}}))
"""
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=process_env(),
        timeout=120,
        check=True,
    )
    got = json.loads(done.stdout)
    assert (got["backend"], got["provider"]) == ("onnxruntime", CPU)
    assert got["fallback_reason"].startswith("openvino/CPU: the OpenVINO runtime is not installed")
    assert got["fallback_reason"].endswith(INSTALL_HINT)
    assert len(got["records"]) == 1
    name, _, message = got["records"][0]
    assert name == "mcp.agent.runtime"
    assert message == (
        f"digits.onnx: running on CPUExecutionProvider; skipped {got['fallback_reason']}"
    )
    assert INSTALL_HINT in got["available"]
    assert got["listed"].startswith("unavailable: ") and INSTALL_HINT in got["listed"]
