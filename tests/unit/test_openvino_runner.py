"""OpenVINORunner on the real OpenVINO runtime, checked against real onnxruntime.

Two models: the digits MLP (the ``digits`` fixture) and the trained digits convnet (narrow
channels), both with a dynamic batch dimension. Answers must match onnxruntime's CPU
provider at batch 1 and 32 on one compiled model, from one thread and from eight.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from mcp_edge.agent.runtime.onnx_runner import OnnxRunner
from mcp_edge.agent.runtime.openvino_runner import (
    INSTALL_HINT,
    OpenVINORunner,
    openvino_devices,
)
from mcp_edge.agent.runtime.runner import (
    BackendUnavailableError,
    InferenceError,
    InputError,
    ModelLoadError,
    ModelRunner,
    TensorSpec,
)
from mcp_edge.shared.protocol.wire import Datatype
from mcp_edge.tooling.models import (
    DigitsConvnet,
    DigitsModels,
    train_digits_convnet,
    write_convnet_onnx,
)
from mcp_edge.tooling.processes import REPO, process_env

IN, OUT = "input", "probabilities"
ATOL, RTOL = 1e-4, 1e-3


@pytest.fixture(scope="module")
def convnet(tmp_path_factory: pytest.TempPathFactory) -> DigitsConvnet:
    # Narrower than the default (160, 1024) channels: the same graph, a fraction of the work.
    return train_digits_convnet(seed=0, channels=(16, 64))


@pytest.fixture(scope="module")
def convnet_path(convnet: DigitsConvnet, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_convnet_onnx(convnet, tmp_path_factory.mktemp("convnet") / "convnet.onnx")


Case = tuple[Path, Callable[[int], np.ndarray[Any, Any]]]


@pytest.fixture(params=["digits", "convnet"])
def case(
    request: pytest.FixtureRequest,
    digits: DigitsModels,
    convnet: DigitsConvnet,
    convnet_path: Path,
) -> Case:
    if request.param == "digits":
        return digits.onnx_path, lambda n: np.ascontiguousarray(digits.X_test[:n])
    return convnet_path, lambda n: np.ascontiguousarray(convnet.X_test[:n])


def test_answers_match_onnxruntime_at_batch_1_and_32(case: Case) -> None:
    path, inputs = case
    runner = OpenVINORunner(path, num_threads=1)
    reference = OnnxRunner(path, intra_op_threads=1)
    for n in (1, 32, 1):
        X = inputs(n)
        got = runner.run({IN: X})
        assert list(got) == [OUT]
        assert got[OUT].shape == (n, 10) and got[OUT].dtype == np.float32
        np.testing.assert_allclose(got[OUT], reference.run({IN: X})[OUT], atol=ATOL, rtol=RTOL)


def test_accuracy_is_the_trained_models(
    digits: DigitsModels, convnet: DigitsConvnet, convnet_path: Path
) -> None:
    runner = OpenVINORunner(digits.onnx_path)
    labels = runner.run({IN: digits.X_test})[OUT].argmax(axis=1)
    assert abs(np.mean(labels == digits.y_test) - digits.accuracy) <= 0.01
    runner = OpenVINORunner(convnet_path)
    labels = runner.run({IN: convnet.X_test})[OUT].argmax(axis=1)
    assert abs(np.mean(labels == convnet.y_test) - convnet.accuracy) <= 0.01


def test_info_describes_the_model_and_the_config_applied(case: Case) -> None:
    path, _ = case
    runner = OpenVINORunner(path, num_threads=2)
    info = runner.info
    assert info.backend == "openvino" and info.provider == "CPU"
    assert info.inputs == OnnxRunner(path).info.inputs
    assert info.outputs == (TensorSpec(OUT, Datatype.FP32, (-1, 10)),)
    assert info.batchable is True and info.fallback_reason is None
    config = info.details["config"]
    assert config["PERFORMANCE_HINT"] == "LATENCY"
    assert config["INFERENCE_NUM_THREADS"] == 2
    assert config["INFERENCE_PRECISION_HINT"] == "f32"
    assert info.details["infer_requests"] == config["OPTIMAL_NUMBER_OF_INFER_REQUESTS"] >= 1
    assert info.details["openvino"][:4].isdigit()


def test_profile_config_overrides_the_defaults(digits: DigitsModels) -> None:
    runner = OpenVINORunner(
        digits.onnx_path,
        config={"PERFORMANCE_HINT": "THROUGHPUT", "NUM_STREAMS": 2, "ENABLE_CPU_PINNING": False},
        num_threads=2,
    )
    config = runner.info.details["config"]
    assert config["PERFORMANCE_HINT"] == "THROUGHPUT"
    assert config["NUM_STREAMS"] == 2
    # One infer request per stream: two calls can run at once.
    assert runner.info.details["infer_requests"] == 2
    X = digits.X_test[:5]
    np.testing.assert_allclose(
        runner.run({IN: X})[OUT], OnnxRunner(digits.onnx_path).run({IN: X})[OUT], atol=ATOL
    )


@pytest.mark.parametrize("hint", ["LATENCY", "THROUGHPUT"])
def test_eight_threads_at_once_each_get_their_own_answer(case: Case, hint: str) -> None:
    path, inputs = case
    runner = OpenVINORunner(path, config={"PERFORMANCE_HINT": hint}, num_threads=2)
    reference = OnnxRunner(path, intra_op_threads=1)
    sizes = [1, 32, 3, 7, 1, 16, 2, 5]
    jobs = [inputs(n) * (1.0 - 0.05 * k) for k, n in enumerate(sizes)]
    expected = [reference.run({IN: X})[OUT] for X in jobs]
    start = threading.Barrier(len(jobs))
    failures: list[str] = []

    def work(k: int) -> None:
        start.wait()
        for _ in range(40):
            try:
                got = runner.run({IN: jobs[k]})[OUT]
            except Exception as e:
                failures.append(f"thread {k}: {type(e).__name__}: {e}")
                return
            if got.shape != expected[k].shape or not np.allclose(
                got, expected[k], atol=ATOL, rtol=RTOL
            ):
                failures.append(f"thread {k}: wrong answer for batch {sizes[k]}")
                return

    threads = [threading.Thread(target=work, args=(k,)) for k in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []


def test_outputs_are_copies_the_caller_may_keep(digits: DigitsModels) -> None:
    runner = OpenVINORunner(digits.onnx_path)
    first = runner.run({IN: digits.X_test[:4]})[OUT]
    kept = first.copy()
    runner.run({IN: digits.X_test[10:14]})
    np.testing.assert_array_equal(first, kept)


def test_non_contiguous_and_big_endian_feeds_are_accepted(digits: DigitsModels) -> None:
    runner = OpenVINORunner(digits.onnx_path)
    X = np.ascontiguousarray(digits.X_test[:6])
    want = runner.run({IN: X})[OUT]
    np.testing.assert_allclose(runner.run({IN: np.asfortranarray(X)})[OUT], want, atol=1e-7)
    np.testing.assert_allclose(runner.run({IN: X.astype(">f4")})[OUT], want, atol=1e-7)


def test_read_only_feeds_are_accepted(digits: DigitsModels, tmp_path: Path) -> None:
    """A binary-tensor request's input is a read-only view of the request body."""
    runner = OpenVINORunner(digits.onnx_path)
    X = np.ascontiguousarray(digits.X_test[:6])
    want = runner.run({IN: X})[OUT]
    body = np.frombuffer(X.tobytes(), dtype=np.float32).reshape(X.shape)
    assert not body.flags.writeable
    np.testing.assert_allclose(runner.run({IN: body})[OUT], want, atol=1e-7)
    a = np.frombuffer(np.arange(6, dtype=np.float32).tobytes(), dtype=np.float32).reshape(2, 3)
    pair = tmp_path / "pair.onnx"
    _pair_model(pair)
    got = OpenVINORunner(pair).run({"a": a, "b": a})
    np.testing.assert_array_equal(got["sum"], a + a)


@pytest.mark.parametrize(
    ("make_feeds", "reason"),
    [
        (lambda X: {"inputs": X}, "unknown input 'inputs'"),
        (lambda X: {IN: X, "extra": X}, "unknown input 'extra'"),
        (lambda X: {}, "missing input 'input'"),
        (lambda X: {IN: X[:, :63]}, "input 'input' has shape .*dimension 1 must be 64"),
        (lambda X: {IN: X[0]}, "input 'input' .*wants rank 2"),
        (lambda X: {IN: X.astype(np.float64)}, "input 'input' is float64.*wants FP32"),
        (lambda X: {IN: X.tolist()}, "input 'input' must be a numpy array"),
    ],
    ids=["unknown", "extra", "missing", "dim", "rank", "float64", "list"],
)
def test_bad_feeds_raise_input_error_naming_the_input(
    make_feeds: Callable[[Any], dict[str, Any]], reason: str, digits: DigitsModels
) -> None:
    runner = OpenVINORunner(digits.onnx_path)
    with pytest.raises(InputError, match=reason) as raised:
        runner.run(make_feeds(digits.X_test[:4]))
    assert "\n" not in str(raised.value)
    assert runner.run({IN: digits.X_test[:2]})[OUT].shape == (2, 10)


def _pair_model(path: Path) -> None:
    """Two inputs a and b (N x 3 floats), two outputs: their sum and their product."""
    nodes = [
        helper.make_node("Add", ["a", "b"], ["sum"]),
        helper.make_node("Mul", ["a", "b"], ["product"]),
    ]
    graph = helper.make_graph(
        nodes,
        "pair",
        [
            helper.make_tensor_value_info("a", TensorProto.FLOAT, ["N", 3]),
            helper.make_tensor_value_info("b", TensorProto.FLOAT, ["N", 3]),
        ],
        [
            helper.make_tensor_value_info("sum", TensorProto.FLOAT, ["N", 3]),
            helper.make_tensor_value_info("product", TensorProto.FLOAT, ["N", 3]),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))


def test_two_inputs_and_two_outputs(tmp_path: Path) -> None:
    path = tmp_path / "pair.onnx"
    _pair_model(path)
    runner = OpenVINORunner(path)
    assert [s.name for s in runner.info.inputs] == ["a", "b"]
    assert [s.name for s in runner.info.outputs] == ["sum", "product"]
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.full((2, 3), 2.0, dtype=np.float32)
    got = runner.run({"b": b, "a": a})
    np.testing.assert_array_equal(got["sum"], a + b)
    np.testing.assert_array_equal(got["product"], a * b)


def test_fixed_batch_model_is_not_batchable(digits: DigitsModels, tmp_path: Path) -> None:
    model = onnx.load(str(digits.onnx_path))
    for value in (*model.graph.input, *model.graph.output):
        dim0 = value.type.tensor_type.shape.dim[0]
        dim0.ClearField("dim_param")
        dim0.dim_value = 1
    fixed = tmp_path / "fixed.onnx"
    onnx.save(model, str(fixed))
    runner = OpenVINORunner(fixed)
    assert runner.info.batchable is False
    assert runner.info.inputs[0].shape == (1, 64)
    with pytest.raises(InputError, match="dimension 0 must be 1"):
        runner.run({IN: digits.X_test[:2]})
    assert runner.run({IN: digits.X_test[:1]})[OUT].shape == (1, 10)


@pytest.mark.parametrize("damage", ["garbage", "truncated", "missing"])
def test_corrupt_or_missing_model_is_a_model_load_error(
    damage: str, digits: DigitsModels, tmp_path: Path
) -> None:
    bad = tmp_path / "bad.onnx"
    if damage == "garbage":
        bad.write_bytes(b"\x00not a model\xff" * 64)
    elif damage == "truncated":
        bad.write_bytes(digits.onnx_path.read_bytes()[: digits.onnx_path.stat().st_size // 3])
    with pytest.raises(ModelLoadError, match=r"bad\.onnx: OpenVINO cannot") as raised:
        OpenVINORunner(bad)
    assert "\n" not in str(raised.value)


def test_string_tensors_are_refused_at_load(tmp_path: Path) -> None:
    graph = helper.make_graph(
        [helper.make_node("Identity", ["text"], ["same"])],
        "strings",
        [helper.make_tensor_value_info("text", TensorProto.STRING, ["N"])],
        [helper.make_tensor_value_info("same", TensorProto.STRING, ["N"])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = tmp_path / "strings.onnx"
    onnx.save(model, str(path))
    with pytest.raises(ModelLoadError, match=r"strings\.onnx"):
        OpenVINORunner(path)


def test_a_device_openvino_lacks_is_unavailable(digits: DigitsModels) -> None:
    missing = next(d for d in ("NPU", "GPU", "GNA") if d not in openvino_devices())
    with pytest.raises(BackendUnavailableError, match=f"no {missing} device"):
        OpenVINORunner(digits.onnx_path, device=missing)


def test_closed_runner_refuses_to_run(digits: DigitsModels) -> None:
    runner: ModelRunner = OpenVINORunner(digits.onnx_path)
    assert runner.run({IN: digits.X_test[:1]})[OUT].shape == (1, 10)
    runner.close()
    with pytest.raises(InferenceError, match="closed"):
        runner.run({IN: digits.X_test[:1]})


def test_without_openvino_the_error_says_how_to_install_it(digits: DigitsModels) -> None:
    # None in sys.modules makes the real `import openvino` fail, as on a box without it.
    code = f"""
import json, sys
sys.modules["openvino"] = None
from mcp_edge.agent.runtime.openvino_runner import OpenVINORunner
from mcp_edge.agent.runtime.runner import BackendUnavailableError
try:
    OpenVINORunner({str(digits.onnx_path)!r})
except BackendUnavailableError as e:
    print(json.dumps(str(e)))
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
    message = json.loads(done.stdout)
    assert "OpenVINO runtime is not installed" in message
    assert message.endswith(INSTALL_HINT)
