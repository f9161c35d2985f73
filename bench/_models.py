"""Bench models, made at run time with no downloads.

* ``digits``: the scikit-learn digits MLP from ``mcp_edge.tooling.models`` (``input`` [N, 64]
  FP32 -> ``probabilities`` [N, 10]), and real held-out digits as request data.
* ``convnet``: a small conv net built with ``onnx.helper`` (``input`` [N, 1, 28, 28] FP32 ->
  Conv 3x3 x8 -> Relu -> MaxPool 2x2 -> Conv 3x3 x16 -> Relu -> GlobalAveragePool -> Flatten
  -> Gemm 16x10 -> Softmax -> ``probabilities`` [N, 10]); random weights from a fixed seed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import onnx
from onnx import TensorProto, helper, numpy_helper

REPO_ROOT = Path(__file__).resolve().parent.parent
CONV_OPSET = 17


@dataclass(frozen=True)
class BenchModel:
    """A model file and one request's worth of input (batch 1) for it."""

    name: str
    path: Path
    input_name: str
    sample: npt.NDArray[np.float32]
    """Shape [1, ...]: the row every benchmark request sends."""
    description: str


def make_digits(directory: Path, seed: int = 0) -> BenchModel:
    """Train the digits MLP (a few seconds) and write ``digits.onnx`` into ``directory``."""
    from mcp_edge.tooling.models import train_digits_mlp, write_digits_onnx

    mlp = train_digits_mlp(seed=seed)
    path = write_digits_onnx(mlp.model, Path(directory) / "digits.onnx")
    return BenchModel(
        name="digits",
        path=path,
        input_name="input",
        sample=np.ascontiguousarray(mlp.X_test[:1], dtype=np.float32),
        description="sklearn MLPClassifier 64-32-10 (relu, softmax) via skl2onnx",
    )


def _conv_graph(rng: np.random.Generator) -> onnx.ModelProto:
    def weight(name: str, shape: tuple[int, ...], fan_in: int) -> onnx.TensorProto:
        w = rng.normal(0.0, np.sqrt(2.0 / fan_in), size=shape).astype(np.float32)
        return numpy_helper.from_array(w, name)

    inits = [
        weight("c1_w", (8, 1, 3, 3), 9),
        numpy_helper.from_array(np.zeros(8, np.float32), "c1_b"),
        weight("c2_w", (16, 8, 3, 3), 72),
        numpy_helper.from_array(np.zeros(16, np.float32), "c2_b"),
        weight("fc_w", (16, 10), 16),
        numpy_helper.from_array(np.zeros(10, np.float32), "fc_b"),
    ]
    nodes = [
        helper.make_node(
            "Conv", ["input", "c1_w", "c1_b"], ["c1"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]
        ),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node(
            "Conv", ["p1", "c2_w", "c2_b"], ["c2"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]
        ),
        helper.make_node("Relu", ["c2"], ["r2"]),
        helper.make_node("GlobalAveragePool", ["r2"], ["gap"]),
        helper.make_node("Flatten", ["gap"], ["flat"], axis=1),
        helper.make_node("Gemm", ["flat", "fc_w", "fc_b"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["probabilities"], axis=1),
    ]
    graph = helper.make_graph(
        nodes,
        "bench_convnet",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 1, 28, 28])],
        [helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, ["N", 10])],
        initializer=inits,
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", CONV_OPSET)], producer_name="mcp-edge-bench"
    )
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def make_convnet(directory: Path, seed: int = 0) -> BenchModel:
    """Write ``convnet.onnx`` (random weights from ``seed``) into ``directory``."""
    rng = np.random.default_rng(seed)
    model = _conv_graph(rng)
    path = Path(directory) / "convnet.onnx"
    onnx.save(model, str(path))
    # An image-like input: values in [0, 1] with 4 decimals, as a client would send pixels.
    sample = np.round(rng.random((1, 1, 28, 28)), 4).astype(np.float32)
    return BenchModel(
        name="convnet",
        path=path,
        input_name="input",
        sample=sample,
        description="conv3x3x8-relu-maxpool-conv3x3x16-relu-gap-gemm10-softmax, 28x28x1 input",
    )
