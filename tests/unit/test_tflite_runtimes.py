"""One TFLite runner over both interpreters: ai-edge-litert (LiteRT) and tflite-runtime.

Each test runs against every implementation that works here; one that cannot run is skipped
with the runner's own reason (tflite-runtime 2.14 needs NumPy 1.x, so it is skipped where
NumPy 2 is installed). Answers are checked against onnxruntime on the ONNX twin of the same
weights: the digits MLP and the digits convnet.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from mcp_edge.agent.runtime.runner import BackendUnavailableError
from mcp_edge.agent.runtime.tflite_runner import (
    TFLITE_IMPLEMENTATIONS,
    TFLiteRunner,
    tflite_implementation,
)
from mcp_edge.tooling.models import DigitsModels, make_digits_convnet, onnx_predict

ATOL = 1e-4


@dataclass(frozen=True)
class Twins:
    name: str
    onnx_path: Path
    tflite_path: Path
    X: npt.NDArray[np.float32]
    """Held-out requests (at least 32 rows)."""


@pytest.fixture(scope="module")
def models(digits: DigitsModels, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Twins]:
    convnet = make_digits_convnet(tmp_path_factory.mktemp("convnet"), seed=0)
    return {
        "mlp": Twins("mlp", digits.onnx_path, digits.tflite_path, digits.X_test),
        "convnet": Twins("convnet", convnet.onnx_path, convnet.tflite_path, convnet.net.X_test),
    }


@pytest.fixture(params=TFLITE_IMPLEMENTATIONS)
def implementation(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    try:
        tflite_implementation(name)
    except BackendUnavailableError as e:
        pytest.skip(f"{name} does not work here: {e}")
    return name


@pytest.mark.parametrize("use_xnnpack", [True, False], ids=["xnnpack", "builtin"])
@pytest.mark.parametrize("batch", [1, 32])
@pytest.mark.parametrize("model", ["mlp", "convnet"])
def test_tflite_answers_like_onnxruntime_on_the_onnx_twin(
    models: dict[str, Twins], implementation: str, model: str, batch: int, use_xnnpack: bool
) -> None:
    twins = models[model]
    X = twins.X[:batch]
    runner = TFLiteRunner(twins.tflite_path, implementation=implementation, use_xnnpack=use_xnnpack)
    (name,) = (spec.name for spec in runner.info.outputs)
    out = runner.run({"input": X})[name]
    assert name == "probabilities"
    assert out.shape == (batch, 10)
    np.testing.assert_allclose(out, onnx_predict(twins.onnx_path, X), atol=ATOL)


def test_xnnpack_on_shows_delegate_nodes_and_off_runs_builtin_kernels(
    models: dict[str, Twins], implementation: str
) -> None:
    path = models["convnet"].tflite_path
    on = TFLiteRunner(path, implementation=implementation, use_xnnpack=True).info
    off = TFLiteRunner(path, implementation=implementation, use_xnnpack=False).info
    assert on.details["delegate_detection"] == "node list"
    assert on.provider == "XNNPACK"
    assert on.details["delegate_nodes"] >= 1
    assert on.details["op_resolver"] == "AUTO"
    assert on.fallback_reason is None
    assert off.provider == "CPU"
    assert off.details["delegate_nodes"] == 0
    assert off.details["op_resolver"] == "BUILTIN_WITHOUT_DEFAULT_DELEGATES"


@pytest.mark.parametrize("num_threads", [None, 1, 2])
def test_details_name_the_interpreter_its_version_and_threads(
    models: dict[str, Twins], implementation: str, num_threads: int | None
) -> None:
    twins = models["convnet"]
    runner = TFLiteRunner(twins.tflite_path, implementation=implementation, num_threads=num_threads)
    details = runner.info.details
    assert details["implementation"] == implementation
    assert details["version"] == importlib.metadata.version(implementation)
    assert details["num_threads"] == num_threads
    assert details["model"] == "convnet.tflite"
    X = twins.X[:8]
    np.testing.assert_allclose(
        runner.run({"input": X})["probabilities"], onnx_predict(twins.onnx_path, X), atol=ATOL
    )


def test_concurrent_calls_from_eight_threads_get_their_own_answers(
    models: dict[str, Twins], implementation: str
) -> None:
    twins = models["convnet"]
    runner = TFLiteRunner(twins.tflite_path, implementation=implementation, num_threads=2)
    # Different batch sizes per thread, so calls also race on resizing the interpreter.
    requests = [twins.X[i : i + 1 + i % 4 * 5] for i in range(8)]
    expected = [onnx_predict(twins.onnx_path, X) for X in requests]
    start = threading.Barrier(len(requests))

    def worker(i: int) -> list[npt.NDArray[np.float32]]:
        start.wait()
        return [runner.run({"input": requests[i]})["probabilities"] for _ in range(10)]

    with ThreadPoolExecutor(max_workers=len(requests)) as pool:
        results = list(pool.map(worker, range(len(requests))))
    for got, want in zip(results, expected, strict=True):
        for out in got:
            np.testing.assert_allclose(out, want, atol=ATOL)


def test_without_a_name_ai_edge_litert_is_preferred(models: dict[str, Twins]) -> None:
    try:
        tflite_implementation("ai-edge-litert")
    except BackendUnavailableError as e:
        pytest.skip(f"ai-edge-litert does not work here: {e}")
    runner = TFLiteRunner(models["mlp"].tflite_path)
    assert runner.info.details["implementation"] == "ai-edge-litert"
    assert tflite_implementation()[1] == "ai-edge-litert"


def test_an_unknown_implementation_is_a_clear_error(models: dict[str, Twins]) -> None:
    message = r"unknown TFLite implementation 'tflite-micro'; known: ai-edge-litert, tflite-runtime"
    with pytest.raises(ValueError, match=message):
        TFLiteRunner(models["mlp"].tflite_path, implementation="tflite-micro")
    with pytest.raises(ValueError, match=message):
        tflite_implementation("tflite-micro")


def test_negative_threads_are_refused(models: dict[str, Twins]) -> None:
    with pytest.raises(ValueError, match="num_threads"):
        TFLiteRunner(models["mlp"].tflite_path, num_threads=-1)


def test_a_caller_fallback_reason_leads_in_info(models: dict[str, Twins]) -> None:
    runner = TFLiteRunner(models["mlp"].tflite_path, fallback_reason="no NPU delegate here")
    assert runner.info.fallback_reason == "no NPU delegate here"


_MISSING = """
import sys
for module in {missing!r}:
    sys.modules[module] = None  # makes `import module` raise ImportError
from mcp_edge.agent.runtime.runner import BackendUnavailableError
from mcp_edge.agent.runtime.tflite_runner import TFLiteRunner
try:
    TFLiteRunner({path!r}, implementation={implementation!r})
except BackendUnavailableError as e:
    print(e)
"""


@pytest.mark.parametrize(
    ("implementation", "missing", "expected"),
    [
        (
            "tflite-runtime",
            ["tflite_runtime", "tflite_runtime.interpreter"],
            "tflite-runtime is not installed (import of tflite_runtime.interpreter halted; "
            "None in sys.modules); pip install 'mcp-edge[tflite-runtime]'",
        ),
        (
            "ai-edge-litert",
            ["ai_edge_litert", "ai_edge_litert.interpreter"],
            "ai-edge-litert is not installed (import of ai_edge_litert.interpreter halted; "
            "None in sys.modules); pip install 'mcp-edge[tflite]'",
        ),
        (
            None,
            [
                "ai_edge_litert",
                "ai_edge_litert.interpreter",
                "tflite_runtime",
                "tflite_runtime.interpreter",
            ],
            "no TFLite interpreter works here (ai-edge-litert is not installed",
        ),
    ],
    ids=["tflite-runtime", "ai-edge-litert", "neither"],
)
def test_a_missing_interpreter_is_named_with_its_install_hint(
    models: dict[str, Twins], implementation: str | None, missing: list[str], expected: str
) -> None:
    script = _MISSING.format(
        missing=missing, path=str(models["mlp"].tflite_path), implementation=implementation
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.startswith(expected), done.stdout
