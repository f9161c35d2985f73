"""Bench models, made at run time with no downloads.

* ``digits``: the scikit-learn digits MLP from ``mcp_edge.tooling.models`` (``input`` [N, 64]
  FP32 -> ``probabilities`` [N, 10]), and real held-out digits as request data.
* ``convnet``: a small conv net built with ``onnx.helper`` (``input`` [N, 1, 28, 28] FP32 ->
  Conv 3x3 x8 -> Relu -> MaxPool 2x2 -> Conv 3x3 x16 -> Relu -> GlobalAveragePool -> Flatten
  -> Gemm 16x10 -> Softmax -> ``probabilities`` [N, 10]); random weights from a fixed seed.
* ``convnet_wide``: the same layout made compute-bound for the batching goal: seven 3x3 convs
  (32, 64, 128, 128, 256, 256, 256 channels, 2x2 max-pools after the second and fourth), about
  130 M multiply-adds per image, over 1 ms per batch-1 ``session.run`` on a 2-core x86 box.
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


ConvLayers = tuple[tuple[int, bool], ...]
"""Each conv layer: (output channels, 2x2 max-pool after it)."""

SMALL_CONV: ConvLayers = ((8, True), (16, False))
WIDE_CONV: ConvLayers = (
    (32, False),
    (64, True),
    (128, False),
    (128, True),
    (256, False),
    (256, False),
    (256, False),
)
"""About 130 M multiply-adds per image: over 1 ms at batch 1 on a 2-core x86 box."""


def _conv_graph(
    rng: np.random.Generator, layers: ConvLayers = SMALL_CONV, name: str = "bench_convnet"
) -> onnx.ModelProto:
    def weight(name: str, shape: tuple[int, ...], fan_in: int) -> onnx.TensorProto:
        w = rng.normal(0.0, np.sqrt(2.0 / fan_in), size=shape).astype(np.float32)
        return numpy_helper.from_array(w, name)

    inits: list[onnx.TensorProto] = []
    nodes: list[onnx.NodeProto] = []
    prev, cin = "input", 1
    for i, (cout, pool) in enumerate(layers, start=1):
        inits.append(weight(f"c{i}_w", (cout, cin, 3, 3), cin * 9))
        inits.append(numpy_helper.from_array(np.zeros(cout, np.float32), f"c{i}_b"))
        nodes.append(
            helper.make_node(
                "Conv",
                [prev, f"c{i}_w", f"c{i}_b"],
                [f"c{i}"],
                kernel_shape=[3, 3],
                pads=[1, 1, 1, 1],
            )
        )
        nodes.append(helper.make_node("Relu", [f"c{i}"], [f"r{i}"]))
        prev = f"r{i}"
        if pool:
            nodes.append(
                helper.make_node("MaxPool", [prev], [f"p{i}"], kernel_shape=[2, 2], strides=[2, 2])
            )
            prev = f"p{i}"
        cin = cout
    inits.append(weight("fc_w", (cin, 10), cin))
    inits.append(numpy_helper.from_array(np.zeros(10, np.float32), "fc_b"))
    nodes += [
        helper.make_node("GlobalAveragePool", [prev], ["gap"]),
        helper.make_node("Flatten", ["gap"], ["flat"], axis=1),
        helper.make_node("Gemm", ["flat", "fc_w", "fc_b"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["probabilities"], axis=1),
    ]
    # The initializers in the original order: every conv's weight and bias, then the Gemm's.
    graph = helper.make_graph(
        nodes,
        name,
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


def make_wide_convnet(directory: Path, seed: int = 0) -> BenchModel:
    """Write ``convnet_wide.onnx``: the conv net of :func:`make_convnet` made compute-bound
    (seven 3x3 convs, 32 to 256 channels, :data:`WIDE_CONV`), for the batching goal."""
    rng = np.random.default_rng(seed)
    model = _conv_graph(rng, WIDE_CONV, "bench_convnet_wide")
    path = Path(directory) / "convnet_wide.onnx"
    onnx.save(model, str(path))
    sample = np.round(rng.random((1, 1, 28, 28)), 4).astype(np.float32)
    return BenchModel(
        name="convnet_wide",
        path=path,
        input_name="input",
        sample=sample,
        description="conv3x3 x32, x64-maxpool, x128, x128-maxpool, x256, x256, x256 (relu "
        "after each) -gap-gemm10-softmax, 28x28x1 input; about 130 M multiply-adds per image",
    )
