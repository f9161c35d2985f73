"""The faulty digits versions the rollout tests deploy (mcp_edge.tooling.faulty_models), run with
onnxruntime and through the agent's own runner and warm-up: each loads, answers normal input
exactly as digits does (when it answers at all), and has its one defect."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from mcp_edge.agent.runtime.checks import warm_up
from mcp_edge.agent.runtime.onnx_runner import OnnxRunner
from mcp_edge.agent.runtime.runner import InferenceError, ModelLoadError
from mcp_edge.tooling.faulty_models import (
    ERROR_MARKER,
    marked,
    write_erroring_onnx,
    write_slow_onnx,
    write_warmup_failing_onnx,
)
from mcp_edge.tooling.models import INPUT_NAME, OUTPUT_NAME, DigitsModels, onnx_predict


def _session(path: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def test_warmup_failing_version_loads_then_fails_the_agents_warm_up(
    digits: DigitsModels, tmp_path: Path
) -> None:
    path = write_warmup_failing_onnx(digits.onnx_path, tmp_path / "fails.onnx")
    session = _session(path)  # the load succeeds
    assert [i.name for i in session.get_inputs()] == [INPUT_NAME]
    assert [o.name for o in session.get_outputs()] == [OUTPUT_NAME]
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.Fail, match="Reshape"):
        session.run([OUTPUT_NAME], {INPUT_NAME: digits.X_test[:3]})

    runner = OnnxRunner(path, intra_op_threads=1)  # the agent's loader opens it too
    with pytest.raises(ModelLoadError, match="warm-up failed"):
        warm_up([runner])


def test_erroring_version_fails_only_batches_with_a_marked_row(
    digits: DigitsModels, tmp_path: Path
) -> None:
    path = write_erroring_onnx(digits.onnx_path, tmp_path / "errors.onnx")
    runner = OnnxRunner(path, intra_op_threads=1)
    warm_up([runner])  # synthetic inputs in [0, 1) never carry the marker

    x = digits.X_test
    (answer,) = _session(path).run([OUTPUT_NAME], {INPUT_NAME: x})
    assert np.array_equal(answer, onnx_predict(digits.onnx_path, x))

    one_marked = x[:4].copy()
    one_marked[2] = marked(x[2:3])[0]
    assert one_marked[2, 0] == ERROR_MARKER and (one_marked[[0, 1, 3], 0] != ERROR_MARKER).all()
    with pytest.raises(InferenceError, match="Reshape"):
        runner.run({INPUT_NAME: one_marked})
    # The plain digits model answers marked input like any other.
    scores = onnx_predict(digits.onnx_path, marked(x[:8]))
    assert scores.shape == (8, 10) and np.isfinite(scores).all()


def test_slow_version_answers_like_digits_after_extra_products_on_every_run(
    digits: DigitsModels, tmp_path: Path
) -> None:
    path = write_slow_onnx(digits.onnx_path, tmp_path / "slow.onnx", size=64, repeats=3)
    warm_up([OnnxRunner(path, intra_op_threads=1)])
    x = digits.X_test
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL  # as the agent
    options.enable_profiling = True
    options.profile_file_prefix = str(tmp_path / "profile")
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    (answer,) = session.run([OUTPUT_NAME], {INPUT_NAME: x[:1]})
    assert np.array_equal(answer, onnx_predict(digits.onnx_path, x[:1]))
    (answer,) = session.run([OUTPUT_NAME], {INPUT_NAME: x})
    assert np.array_equal(answer, onnx_predict(digits.onnx_path, x))

    # Not folded away when the session was made: every run executes the three products.
    events = json.loads(Path(session.end_profiling()).read_text())
    runs = [
        e["name"]
        for e in events
        if e.get("cat") == "Node" and e["args"].get("op_name") == "MatMul"
        and e["name"].startswith("slow_p")
    ]  # fmt: skip
    assert sorted(runs) == sorted([f"slow_p{i}_kernel_time" for i in range(3)] * 2)


def test_faulty_writers_refuse_a_model_without_digits_signature(
    digits: DigitsModels, tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match="expected one input 'input' and one output"):
        write_erroring_onnx(_renamed_output(digits.onnx_path, tmp_path), tmp_path / "x.onnx")
    with pytest.raises(ValueError, match="at least 1"):
        write_slow_onnx(digits.onnx_path, tmp_path / "y.onnx", repeats=0)


def _renamed_output(path: Path, tmp_path: Path) -> Path:
    import onnx

    model = onnx.load(str(path))
    model.graph.output[0].name = "scores"
    for node in model.graph.node:
        for i, name in enumerate(node.output):
            if name == OUTPUT_NAME:
                node.output[i] = "scores"
    out = tmp_path / "renamed.onnx"
    onnx.save(model, str(out))
    return out


def test_faulty_writers_apply_to_each_others_models(digits: DigitsModels, tmp_path: Path) -> None:
    slow = write_slow_onnx(digits.onnx_path, tmp_path / "slow.onnx", size=16, repeats=1)
    slower = write_slow_onnx(slow, tmp_path / "slower.onnx", size=16, repeats=2)
    erroring = write_erroring_onnx(slower, tmp_path / "erroring.onnx")
    failing = write_warmup_failing_onnx(slower, tmp_path / "failing.onnx")
    x = digits.X_test
    for path in (slower, erroring):
        warm_up([OnnxRunner(path, intra_op_threads=1)])
        (answer,) = _session(path).run([OUTPUT_NAME], {INPUT_NAME: x})
        assert np.array_equal(answer, onnx_predict(digits.onnx_path, x)), path.name
    with pytest.raises(InferenceError, match="Reshape"):
        OnnxRunner(erroring, intra_op_threads=1).run({INPUT_NAME: marked(x[:2])})
    with pytest.raises(ModelLoadError, match="warm-up failed"):
        warm_up([OnnxRunner(failing, intra_op_threads=1)])
