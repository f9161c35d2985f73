"""Choosing a model variant and backend by measurement (agent.runtime.selection), on real
onnxruntime, OpenVINO and TFLite runners. Speed is never asserted here (bench/selection_check.py
measures how close the choice is to the fastest); what is asserted is which candidates pass,
why the others fail, and that nothing is left open."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from mcp_edge.agent.runtime.loader import PROVIDER_ALIASES, load_runner
from mcp_edge.agent.runtime.runner import Array, ModelRunner, RunnerInfo
from mcp_edge.agent.runtime.selection import (
    Candidate,
    Selection,
    SelectionError,
    backend_unavailable,
    candidate_backends,
    select,
)
from mcp_edge.shared.profiles import HardwareProfile, load_profiles, parse_profile
from mcp_edge.tooling.models import DigitsModels


@dataclass(frozen=True)
class Models:
    default: Path
    tflite: Path
    int8: Path
    nan: Path
    """Same signature as the digits MLP, but every output is NaN."""
    unrelated: Path
    """Same signature, random weights: its arg-max disagrees with the digits MLP's."""
    fixed: Path
    """A [1, 64] input: not batchable."""


def _linear_model(
    path: Path, weights: Array, *, times: float | None = None, batch: Any = "N"
) -> Path:
    nodes = [helper.make_node("MatMul", ["input", "w"], ["logits"])]
    inits = [numpy_helper.from_array(weights.astype(np.float32), "w")]
    last = "logits"
    if times is not None:
        inits.append(numpy_helper.from_array(np.array([times], np.float32), "k"))
        nodes.append(helper.make_node("Mul", ["logits", "k"], ["scaled"]))
        last = "scaled"
    nodes.append(helper.make_node("Softmax", [last], ["probabilities"], axis=1))
    graph = helper.make_graph(
        nodes,
        "selection_test",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [batch, 64])],
        [helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, [batch, 10])],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(path))
    return path


@pytest.fixture(scope="module")
def models(digits: DigitsModels, tmp_path_factory: pytest.TempPathFactory) -> Models:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    directory = tmp_path_factory.mktemp("selection")
    int8 = directory / "digits.int8.onnx"
    quantize_dynamic(str(digits.onnx_path), str(int8), weight_type=QuantType.QInt8)
    rng = np.random.default_rng(7)
    return Models(
        default=digits.onnx_path,
        tflite=digits.tflite_path,
        int8=int8,
        nan=_linear_model(directory / "nan.onnx", rng.normal(size=(64, 10)), times=float("nan")),
        unrelated=_linear_model(directory / "unrelated.onnx", rng.normal(size=(64, 10))),
        fixed=_linear_model(directory / "fixed.onnx", rng.normal(size=(64, 10)), batch=1),
    )


@pytest.fixture(scope="module")
def profile() -> HardwareProfile:
    return load_profiles()["generic-x86_64"]


class Tracked:
    """A real runner, remembering whether it was closed."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.closed = 0

    @property
    def info(self) -> RunnerInfo:
        return self.runner.info

    def run(self, feeds: dict[str, Array]) -> dict[str, Array]:
        return self.runner.run(feeds)

    def close(self) -> None:
        self.closed += 1
        self.runner.close()


class TrackingLoader:
    """``load_runner`` that keeps every runner it opened."""

    def __init__(self) -> None:
        self.opened: list[Tracked] = []

    def __call__(self, path: Path, profile: HardwareProfile, **kwargs: Any) -> ModelRunner:
        tracked = Tracked(load_runner(path, profile, **kwargs))
        self.opened.append(tracked)
        return tracked

    def all_closed_once(self) -> bool:
        return all(t.closed == 1 for t in self.opened)


def _missing_provider() -> str:
    """A GPU provider's short name that this onnxruntime build lacks."""
    for name in ("cuda", "tensorrt", "coreml", "rocm"):
        if PROVIDER_ALIASES[name] not in ort.get_available_providers():
            return name
    pytest.skip("every GPU provider is present in this onnxruntime build")


def _trial(selection: Selection | SelectionError, variant: str, backend: str) -> Any:
    return next(
        t
        for t in selection.trials
        if (t.candidate.variant, t.candidate.backend) == (variant, backend)
    )


def test_every_passing_candidate_is_timed_and_one_is_chosen(
    models: Models, profile: HardwareProfile, caplog: pytest.LogCaptureFixture
) -> None:
    candidates = [
        Candidate("default", models.default, "onnxruntime"),
        Candidate("int8", models.int8, "onnxruntime", quantized=True),
        Candidate("tflite", models.tflite, "tflite"),
    ]
    loader = TrackingLoader()
    with caplog.at_level(logging.INFO, logger="mcp.agent.runtime"):
        selection = select(candidates, profile, budget_s=2.0, load=loader)

    assert [t.candidate for t in selection.trials] == candidates
    assert all(t.ok and t.reason is None for t in selection.trials), selection.summary()
    for t in selection.trials:
        assert t.p50_us is not None and t.p50_us > 0
        assert t.rps is not None and t.rps > 0
    assert selection.chosen in candidates
    assert selection.criterion == "rps"  # every candidate is batchable
    assert _trial(selection, "default", "onnxruntime").runtime == "onnxruntime/CPU"
    assert _trial(selection, "tflite", "tflite").runtime.startswith("tflite/")
    assert len(loader.opened) == 3 and loader.all_closed_once()

    line = selection.summary()
    assert "\n" not in line
    assert line.startswith(f"chose {selection.chosen.variant} on ")
    assert "3 candidates in" in line and "rows/s" in line
    assert any(r.getMessage() == f"model selection: {line}" for r in caplog.records)

    data = selection.to_json()
    assert json.loads(json.dumps(data)) == data
    assert data["chosen"]["variant"] == selection.chosen.variant
    assert [t["ok"] for t in data["trials"]] == [True, True, True]


def test_openvino_candidate_when_the_runtime_offers_it(models: Models) -> None:
    profile = load_profiles()["intel-xeon"]
    if "openvino" not in candidate_backends("onnx", _profile_with_openvino()):
        pytest.skip("the OpenVINO runtime is not installed")
    candidates = [
        Candidate("default", models.default, "onnxruntime"),
        Candidate("default", models.default, "openvino"),
    ]
    loader = TrackingLoader()
    selection = select(candidates, profile, budget_s=1.0, load=loader)
    openvino = _trial(selection, "default", "openvino")
    if not openvino.ok and "ran on onnxruntime" in (openvino.reason or ""):
        pytest.skip("load_runner has no OpenVINO runtime backend yet")
    assert openvino.ok, openvino.reason
    assert openvino.runtime == "openvino/CPU"
    assert loader.all_closed_once()


def test_a_candidate_answering_nan_fails_and_is_never_chosen(
    models: Models, profile: HardwareProfile
) -> None:
    # First in the list, so it would be the reference and the preferred one if it passed.
    candidates = [
        Candidate("broken", models.nan, "onnxruntime"),
        Candidate("default", models.default, "onnxruntime"),
    ]
    loader = TrackingLoader()
    selection = select(candidates, profile, budget_s=1.0, load=loader)

    broken = _trial(selection, "broken", "onnxruntime")
    assert not broken.ok
    assert "NaN" in (broken.reason or "")
    assert broken.p50_us is None and broken.rps is None
    assert selection.chosen.variant == "default"
    assert "broken on onnxruntime: " in selection.summary()
    assert loader.all_closed_once()


def test_answers_unlike_the_reference_fail_the_candidate(
    models: Models, profile: HardwareProfile
) -> None:
    candidates = [
        Candidate("default", models.default, "onnxruntime"),
        Candidate("other", models.unrelated, "onnxruntime"),
    ]
    selection = select(candidates, profile, budget_s=1.0)
    other = _trial(selection, "other", "onnxruntime")
    assert not other.ok
    assert "top-1 agrees with the reference" in (other.reason or "")
    assert selection.chosen.variant == "default"


def test_a_backend_this_box_lacks_is_a_failed_trial(
    models: Models, profile: HardwareProfile
) -> None:
    missing = _missing_provider()
    candidates = [
        Candidate("default", models.default, "onnxruntime"),
        Candidate("default", models.default, missing),
        Candidate("default", models.default, "no-such-backend"),
        Candidate("gone", models.default.parent / "gone.onnx", "onnxruntime"),
    ]
    loader = TrackingLoader()
    selection = select(candidates, profile, budget_s=1.0, load=loader)

    lacking = _trial(selection, "default", missing)
    assert not lacking.ok
    # It fell back to the CPU: not a second CPU candidate under another name.
    assert f"{missing} is not usable here" in (lacking.reason or "")
    assert "ExecutionProvider" in (lacking.reason or "")
    unknown = _trial(selection, "default", "no-such-backend")
    assert not unknown.ok and "unknown backend" in (unknown.reason or "")
    gone = _trial(selection, "gone", "onnxruntime")
    assert not gone.ok and "does not load" in (gone.reason or "")
    assert selection.chosen == candidates[0]
    assert loader.all_closed_once()


def test_a_spent_budget_leaves_later_candidates_untried(
    models: Models, profile: HardwareProfile
) -> None:
    candidates = [
        Candidate("default", models.default, "onnxruntime"),
        Candidate("int8", models.int8, "onnxruntime", quantized=True),
        Candidate("tflite", models.tflite, "tflite"),
    ]
    loader = TrackingLoader()
    selection = select(candidates, profile, budget_s=1e-6, load=loader)

    assert selection.chosen == candidates[0]
    first = selection.trials[0]
    assert first.ok and first.p50_us is not None and first.rps is not None
    for t in selection.trials[1:]:
        assert not t.ok
        assert (t.reason or "").startswith("not tried: budget")
    assert len(loader.opened) == 1 and loader.all_closed_once()
    assert "not tried: budget" in selection.summary()


def test_candidates_beyond_max_candidates_are_not_tried(
    models: Models, profile: HardwareProfile
) -> None:
    candidates = [
        Candidate("default", models.default, "onnxruntime"),
        Candidate("tflite", models.tflite, "tflite"),
        Candidate("int8", models.int8, "onnxruntime", quantized=True),
    ]
    loader = TrackingLoader()
    selection = select(candidates, profile, budget_s=1.0, max_candidates=2, load=loader)
    assert [t.ok for t in selection.trials] == [True, True, False]
    assert selection.trials[2].reason == "not tried: max_candidates is 2"
    assert len(loader.opened) == 2 and loader.all_closed_once()


def test_no_candidate_passing_raises_with_every_reason(
    models: Models, profile: HardwareProfile
) -> None:
    missing = _missing_provider()
    candidates = [
        Candidate("broken", models.nan, "onnxruntime"),
        Candidate("default", models.default, missing),
        Candidate("gone", models.default.parent / "gone.onnx", "onnxruntime"),
    ]
    loader = TrackingLoader()
    with pytest.raises(SelectionError) as raised:
        select(candidates, profile, budget_s=1.0, load=loader)

    message = str(raised.value)
    assert message.startswith("no candidate passed the checks: ")
    assert "broken on onnxruntime: " in message and "NaN" in message
    assert f"default on {missing}: {missing} is not usable here" in message
    assert "gone on onnxruntime: does not load" in message
    assert [t.ok for t in raised.value.trials] == [False, False, False]
    assert len(loader.opened) == 2 and loader.all_closed_once()


def test_a_model_that_cannot_batch_is_chosen_by_latency(
    models: Models, profile: HardwareProfile
) -> None:
    candidates = [
        Candidate("fixed", models.fixed, "onnxruntime"),
        Candidate("fixed", models.fixed, "cpu"),
    ]
    selection = select(candidates, profile, budget_s=0.5)
    assert selection.criterion == "p50"
    assert all(t.ok for t in selection.trials)
    assert "by batch-1 p50" in selection.summary()


def test_select_refuses_nonsense(models: Models, profile: HardwareProfile) -> None:
    with pytest.raises(ValueError, match="at least one candidate"):
        select([], profile)
    with pytest.raises(ValueError, match="budget_s"):
        select([Candidate("default", models.default, "onnxruntime")], profile, budget_s=0)


def _profile_with_openvino() -> HardwareProfile:
    return parse_profile(
        """
name = "selection-test"
description = "every backend kind"
[detect]
[runtime]
formats = ["onnx", "tflite"]
[[runtime.backends]]
name = "onnxruntime"
provider = "CPUExecutionProvider"
[[runtime.backends]]
name = "openvino"
provider = "CPU"
[[runtime.backends]]
name = "openvino"
provider = "GPU"
[[runtime.backends]]
name = "onnxruntime"
provider = "CUDAExecutionProvider"
[[runtime.backends]]
name = "onnxruntime"
provider = "OpenVINOExecutionProvider"
opt_in = true
[[runtime.backends]]
name = "tflite"
provider = "XNNPACK"
[runtime.selection]
measure = true
[variants]
tags = ["default"]
"""
    )


def test_candidate_backends_follow_the_profile() -> None:
    everything = _profile_with_openvino()
    onnx_backends = candidate_backends("onnx", everything)
    expected = ["onnxruntime"]
    if backend_unavailable("openvino") is None:
        expected.append("openvino")  # two OpenVINO devices, one backend
    if "CUDAExecutionProvider" in ort.get_available_providers():
        expected.append("cuda")
    # The OpenVINO execution provider is opt-in: not measured unless asked for.
    assert onnx_backends == expected
    assert candidate_backends("tflite", everything) == ["tflite"]

    only_onnx = parse_profile(
        """
name = "onnx-only"
description = "onnxruntime CPU only"
[detect]
[runtime]
formats = ["onnx"]
[[runtime.backends]]
name = "onnxruntime"
provider = "CPUExecutionProvider"
[variants]
tags = ["default"]
"""
    )
    assert candidate_backends("onnx", only_onnx) == ["onnxruntime"]
    assert candidate_backends("tflite", only_onnx) == []


def test_the_shipped_server_profile_measures() -> None:
    xeon = load_profiles()["intel-xeon"]
    backends = candidate_backends("onnx", xeon)
    assert "onnxruntime" in backends
    assert all(backend_unavailable(b) is None for b in backends)


def test_a_quantized_variant_its_manifest_calls_inaccurate_is_not_opened(
    models: Models, profile: HardwareProfile
) -> None:
    candidates = [
        Candidate("default", models.default, "onnxruntime"),
        Candidate("int8", models.int8, "onnxruntime", quantized=True, top1_agreement=0.6),
    ]
    loader = TrackingLoader()
    selection = select(candidates, profile, budget_s=1.0, load=loader)
    int8 = _trial(selection, "int8", "onnxruntime")
    assert not int8.ok
    assert "its manifest says its top-1 agrees with the reference on 60%" in (int8.reason or "")
    assert len(loader.opened) == 1 and selection.chosen == candidates[0]


def test_given_samples_are_the_comparison_inputs(
    digits: DigitsModels, models: Models, profile: HardwareProfile
) -> None:
    samples = {"input": np.ascontiguousarray(digits.X_test[:5], dtype=np.float32)}
    candidates = [
        Candidate("default", models.default, "onnxruntime"),
        Candidate("int8", models.int8, "onnxruntime", quantized=True, top1_agreement=0.99),
        Candidate("other", models.unrelated, "onnxruntime"),
    ]
    selection = select(candidates, profile, budget_s=1.0, samples=samples)
    assert [t.ok for t in selection.trials] == [True, True, False]
    assert "of 5 rows" in (selection.trials[2].reason or "")
    with pytest.raises(ValueError, match="samples"):
        select(candidates, profile, samples={"input": np.zeros((0, 64), np.float32)})
