"""Model runners on the real digits models: answers, batching, threads, fallback, errors."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from mcp_edge.agent.runtime.loader import (
    available_backends,
    load_runner,
    onnx_providers,
    provider_alias,
)
from mcp_edge.agent.runtime.onnx_runner import OnnxRunner
from mcp_edge.agent.runtime.runner import (
    BackendUnavailableError,
    InferenceError,
    InputError,
    ModelLoadError,
    ModelRunner,
    TensorSpec,
)
from mcp_edge.agent.runtime.tflite_runner import TFLiteRunner
from mcp_edge.shared.profiles import load_profiles
from mcp_edge.shared.protocol.inference import Datatype
from mcp_edge.tooling.models import DigitsModels, onnx_predict, tflite_predict

IN, OUT = "input", "probabilities"
BACKENDS = ["onnxruntime", "tflite"]


@pytest.fixture(scope="module")
def runners(digits: DigitsModels) -> Iterator[dict[str, ModelRunner]]:
    made: dict[str, ModelRunner] = {
        "onnxruntime": OnnxRunner(digits.onnx_path, intra_op_threads=1),
        "tflite": TFLiteRunner(digits.tflite_path, num_threads=1),
    }
    yield made
    for runner in made.values():
        runner.close()


def _predict(runner: ModelRunner, X: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return runner.run({IN: np.ascontiguousarray(X, dtype=np.float32)})[OUT]


@pytest.mark.parametrize("backend", BACKENDS)
def test_runner_answers_like_scikit_learn(
    backend: str, runners: dict[str, ModelRunner], digits: DigitsModels
) -> None:
    probabilities = _predict(runners[backend], digits.X_test)
    assert probabilities.shape == (len(digits.X_test), 10)
    labels = probabilities.argmax(axis=1)
    accuracy = float(np.mean(labels == digits.y_test))
    assert abs(accuracy - digits.accuracy) <= 0.01
    assert np.mean(labels == digits.mlp.model.predict(digits.X_test)) >= 0.99
    reference = onnx_predict(digits.onnx_path, digits.X_test)
    np.testing.assert_allclose(probabilities, reference, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_of_64_agrees_with_rows_one_at_a_time(
    backend: str, runners: dict[str, ModelRunner], digits: DigitsModels
) -> None:
    runner = runners[backend]
    X = digits.X_test[:64]
    batched = _predict(runner, X)
    rows = np.concatenate([_predict(runner, X[i : i + 1]) for i in range(len(X))])
    assert batched.shape == rows.shape == (64, 10)
    np.testing.assert_allclose(batched, rows, atol=1e-6)


def test_tflite_resizes_its_batch_again_and_again(
    runners: dict[str, ModelRunner], digits: DigitsModels
) -> None:
    runner = runners["tflite"]
    for n in (64, 1, 17, 64, 17):
        X = digits.X_test[n : 2 * n]
        out = _predict(runner, X)
        assert out.shape == (n, 10)
        np.testing.assert_allclose(out, tflite_predict(digits.tflite_path, X), atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_concurrent_runs_with_mixed_batch_sizes_give_each_caller_its_answer(
    backend: str, runners: dict[str, ModelRunner], digits: DigitsModels
) -> None:
    # Each thread runs its own batch size over its own rows, so an interpreter resized or
    # refilled by another thread mid-run shows up as a wrong shape, wrong values or an error.
    runner = runners[backend]
    sizes = [1, 64, 3, 33, 7, 50, 2, 17]
    jobs = [digits.X_test[i : i + n] for i, n in enumerate(sizes)]
    expected = [onnx_predict(digits.onnx_path, X) for X in jobs]
    start = threading.Barrier(len(jobs))
    failures: list[str] = []

    def work(k: int) -> None:
        start.wait()
        for _ in range(150):
            try:
                got = _predict(runner, jobs[k])
            except Exception as e:
                failures.append(f"thread {k}: {type(e).__name__}: {e}")
                return
            if got.shape != expected[k].shape or not np.allclose(got, expected[k], atol=1e-5):
                failures.append(f"thread {k}: wrong answer for batch {sizes[k]}")
                return

    threads = [threading.Thread(target=work, args=(k,)) for k in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []


def test_profile_preferring_cuda_falls_back_to_cpu_with_one_warning(
    digits: DigitsModels, caplog: pytest.LogCaptureFixture
) -> None:
    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime has CUDA; the fallback needs a CPU-only build")
    orin = load_profiles()["jetson-orin"]
    with caplog.at_level(logging.WARNING, logger="mcp.agent.runtime"):
        runner = load_runner(digits.onnx_path, orin)
    assert runner.info.provider == "CPUExecutionProvider"
    assert runner.info.fallback_reason is not None
    assert "CUDAExecutionProvider" in runner.info.fallback_reason
    assert "TensorrtExecutionProvider" in runner.info.fallback_reason
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    assert "CUDAExecutionProvider" in warnings[0].getMessage()
    assert "CPUExecutionProvider" in warnings[0].getMessage()
    labels = _predict(runner, digits.X_test).argmax(axis=1)
    assert abs(np.mean(labels == digits.y_test) - digits.accuracy) <= 0.01


def test_cpu_profile_loads_without_fallback_or_warning(
    digits: DigitsModels, caplog: pytest.LogCaptureFixture
) -> None:
    generic = load_profiles()["generic-x86_64"]
    with caplog.at_level(logging.WARNING, logger="mcp.agent.runtime"):
        runner = load_runner(digits.onnx_path, generic, threads=1)
    assert runner.info.provider == "CPUExecutionProvider"
    assert runner.info.fallback_reason is None
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_explicit_backend_is_tried_first_then_cpu(
    digits: DigitsModels, caplog: pytest.LogCaptureFixture
) -> None:
    apple = load_profiles()["apple-silicon"]
    # CoreML is opt_in: left out unless asked for, then first with the profile's options.
    assert onnx_providers(apple) == [("CPUExecutionProvider", {})]
    coreml = onnx_providers(apple, "coreml")
    assert [name for name, _ in coreml] == ["CoreMLExecutionProvider", "CPUExecutionProvider"]
    assert coreml[0][1]["ModelFormat"] == "MLProgram"
    if "CoreMLExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime has CoreML; the fallback needs a build without it")
    with caplog.at_level(logging.WARNING, logger="mcp.agent.runtime"):
        runner = load_runner(digits.onnx_path, apple, backend="coreml")
    assert runner.info.provider == "CPUExecutionProvider"
    assert "CoreMLExecutionProvider" in (runner.info.fallback_reason or "")
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("make_feeds", "reason"),
    [
        (lambda X: {"inputs": X}, "unknown input 'inputs'"),
        (lambda X: {IN: X, "extra": X}, "unknown input 'extra'"),
        (lambda X: {}, "missing input 'input'"),
        (lambda X: {IN: X[:, :63]}, "dimension 1 must be 64"),
        (lambda X: {IN: X[0]}, "wants rank 2"),
        (lambda X: {IN: X.astype(np.float64)}, "float64.*wants FP32"),
        (lambda X: {IN: X.astype(np.int64)}, "int64.*wants FP32"),
        (lambda X: {IN: X.tolist()}, "must be a numpy array"),
    ],
    ids=["unknown", "extra", "missing", "dim", "rank", "float64", "int64", "list"],
)
def test_bad_feeds_are_refused_with_the_reason(
    backend: str,
    make_feeds: Any,
    reason: str,
    runners: dict[str, ModelRunner],
    digits: DigitsModels,
) -> None:
    with pytest.raises(InputError, match=reason):
        runners[backend].run(make_feeds(digits.X_test[:4]))
    # The runner is still usable afterwards.
    assert _predict(runners[backend], digits.X_test[:2]).shape == (2, 10)


@pytest.mark.parametrize("backend", BACKENDS)
def test_big_endian_float32_is_the_same_datatype_and_accepted(
    backend: str, runners: dict[str, ModelRunner], digits: DigitsModels
) -> None:
    X = digits.X_test[:5]
    swapped = X.astype(">f4")
    got = runners[backend].run({IN: swapped})[OUT]
    np.testing.assert_allclose(got, _predict(runners[backend], X), atol=1e-7)


@pytest.mark.parametrize("suffix", [".onnx", ".tflite"])
@pytest.mark.parametrize("damage", ["garbage", "truncated", "missing"])
def test_corrupt_or_missing_model_is_a_model_load_error(
    suffix: str, damage: str, digits: DigitsModels, tmp_path: Path
) -> None:
    good = digits.onnx_path if suffix == ".onnx" else digits.tflite_path
    bad = tmp_path / f"bad{suffix}"
    if damage == "garbage":
        bad.write_bytes(b"\x00not a model\xff" * 64)
    elif damage == "truncated":
        bad.write_bytes(good.read_bytes()[: good.stat().st_size // 3])
    profile = load_profiles()["generic-x86_64"]
    with pytest.raises(ModelLoadError, match="bad"):
        load_runner(bad, profile)


def test_runner_info_describes_the_models(runners: dict[str, ModelRunner]) -> None:
    for backend in BACKENDS:
        info = runners[backend].info
        assert info.backend == backend
        assert info.inputs == (TensorSpec(IN, Datatype.FP32, (-1, 64)),)
        assert info.outputs == (TensorSpec(OUT, Datatype.FP32, (-1, 10)),)
        assert info.batchable is True
        assert info.fallback_reason is None
    assert runners["onnxruntime"].info.provider == "CPUExecutionProvider"
    tflite = runners["tflite"].info
    assert tflite.provider == "XNNPACK"
    assert tflite.details["delegate_nodes"] >= 1


def test_onnx_runner_loads_from_bytes(digits: DigitsModels) -> None:
    runner = OnnxRunner(digits.onnx_path.read_bytes())
    np.testing.assert_allclose(
        _predict(runner, digits.X_test[:3]),
        onnx_predict(digits.onnx_path, digits.X_test[:3]),
        atol=1e-6,
    )


def test_tflite_without_xnnpack_says_cpu(digits: DigitsModels) -> None:
    pi = load_profiles()["raspberry-pi"]
    runner = load_runner(digits.tflite_path, pi, backend="cpu")
    assert runner.info.backend == "tflite"
    assert runner.info.provider == "CPU"
    assert runner.info.details["delegate_nodes"] == 0
    np.testing.assert_allclose(
        _predict(runner, digits.X_test[:9]),
        tflite_predict(digits.tflite_path, digits.X_test[:9]),
        atol=1e-5,
    )


def test_fixed_batch_model_is_not_batchable(digits: DigitsModels, tmp_path: Path) -> None:
    model = onnx.load(str(digits.onnx_path))
    for value in (*model.graph.input, *model.graph.output):
        dim0 = value.type.tensor_type.shape.dim[0]
        dim0.ClearField("dim_param")
        dim0.dim_value = 1
    fixed = tmp_path / "fixed.onnx"
    onnx.save(model, str(fixed))
    runner = OnnxRunner(fixed)
    assert runner.info.batchable is False
    assert runner.info.inputs[0].shape == (1, 64)
    with pytest.raises(InputError, match="dimension 0 must be 1"):
        runner.run({IN: digits.X_test[:2]})
    assert _predict(runner, digits.X_test[:1]).shape == (1, 10)


@pytest.mark.parametrize("backend", BACKENDS)
def test_closed_runner_refuses_to_run(backend: str, digits: DigitsModels) -> None:
    runner = load_runner(
        digits.onnx_path if backend == "onnxruntime" else digits.tflite_path,
        load_profiles()["generic-x86_64"],
    )
    assert _predict(runner, digits.X_test[:1]).shape == (1, 10)
    runner.close()
    with pytest.raises(InferenceError, match="closed"):
        _predict(runner, digits.X_test[:1])


def test_loader_refuses_what_does_not_fit(digits: DigitsModels, tmp_path: Path) -> None:
    profile = load_profiles()["generic-x86_64"]
    with pytest.raises(BackendUnavailableError, match=r"tflite cannot run an \.onnx"):
        load_runner(digits.onnx_path, profile, backend="tflite")
    with pytest.raises(BackendUnavailableError, match=r"does not apply to \.tflite"):
        load_runner(digits.tflite_path, profile, backend="cuda")
    with pytest.raises(ValueError, match="unknown backend 'quantum'"):
        load_runner(digits.onnx_path, profile, backend="quantum")
    odd = tmp_path / "model.pt"
    odd.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="unknown model format"):
        load_runner(odd, profile)


def test_provider_aliases() -> None:
    assert provider_alias("cuda") == "CUDAExecutionProvider"
    assert provider_alias("TensorRT") == "TensorrtExecutionProvider"
    assert provider_alias("openvino-ep") == "OpenVINOExecutionProvider"
    assert provider_alias("CPUExecutionProvider") == "CPUExecutionProvider"
    with pytest.raises(ValueError, match="unknown backend"):
        provider_alias("gpu-please")


def test_available_backends_names_what_loads_here() -> None:
    found = available_backends()
    assert "CPUExecutionProvider" in found["onnxruntime"]
    assert ort.__version__ in found["onnxruntime"]
    assert found["tflite"].startswith("ai-edge-litert ")
