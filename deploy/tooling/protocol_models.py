"""Two tiny ONNX models with non-float tensors, for protocol tests (built with onnx.helper).

* :func:`write_int64_model` (``int64_scores.onnx``): inputs ``ids`` INT64 [N, 4] and ``mask``
  BOOL [N, 4]; outputs ``scores`` FP32 [N, 3] (the kept ids, as floats, times fixed weights
  plus a bias) and ``total`` INT64 [N, 1] (the sum of the kept ids). :func:`int64_reference`
  computes both with numpy.
* :func:`write_text_model` (``text_labels.onnx``): input ``text`` STRING (the protocol's
  BYTES) [N, 1]; outputs ``class_id`` INT64 [N, 1] (index of the word in :data:`WORDS`, -1 for
  any other) and ``label`` STRING [N, 1] (the word in capitals, ``UNKNOWN`` for any other),
  through two ``ai.onnx.ml`` LabelEncoders. :func:`text_reference` computes both.

Both are checked with ``onnx.checker`` (full check) and written atomically; the batch
dimension is the symbolic ``N``. No downloads, no training: the answers are exact.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import numpy.typing as npt
import onnx
from onnx import TensorProto, helper, numpy_helper

from mcp_edge.tooling.tflite_graph import atomic_write

ONNX_OPSET = 17
ML_OPSET = 3
IR_VERSION = 8

INT64_WEIGHTS = np.array(
    [[1.0, -2.0, 0.5], [0.25, 3.0, -1.0], [-0.5, 0.125, 2.0], [2.0, 1.0, -0.75]],
    dtype=np.float32,
)
"""``scores = float(ids * mask) @ INT64_WEIGHTS + INT64_BIAS`` (weights [4, 3])."""
INT64_BIAS = np.array([0.5, -1.0, 0.25], dtype=np.float32)

WORDS = ("cat", "dog", "bird", "fish")
"""The words the text model knows, in class order."""
UNKNOWN_LABEL = "UNKNOWN"


def _finish(graph: onnx.GraphProto, opsets: list[onnx.OperatorSetIdProto], path: Path) -> Path:
    model = helper.make_model(
        graph, opset_imports=opsets, producer_name="mcp_edge.tooling.protocol_models"
    )
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model, full_check=True)
    return atomic_write(path, model.SerializeToString())


def write_int64_model(directory: Path) -> Path:
    """Write ``int64_scores.onnx`` into ``directory`` (see the module docstring).

    Returns:
        The file's path.
    """
    nodes = [
        helper.make_node("Cast", ["mask"], ["mask_i64"], to=TensorProto.INT64),
        helper.make_node("Mul", ["ids", "mask_i64"], ["kept"]),
        helper.make_node("Cast", ["kept"], ["kept_f"], to=TensorProto.FLOAT),
        helper.make_node("MatMul", ["kept_f", "w"], ["mm"]),
        helper.make_node("Add", ["mm", "b"], ["scores"]),
        helper.make_node("ReduceSum", ["kept", "axes"], ["total"], keepdims=1),
    ]
    graph = helper.make_graph(
        nodes,
        "int64_scores",
        [
            helper.make_tensor_value_info("ids", TensorProto.INT64, ["N", 4]),
            helper.make_tensor_value_info("mask", TensorProto.BOOL, ["N", 4]),
        ],
        [
            helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["N", 3]),
            helper.make_tensor_value_info("total", TensorProto.INT64, ["N", 1]),
        ],
        initializer=[
            numpy_helper.from_array(INT64_WEIGHTS, "w"),
            numpy_helper.from_array(INT64_BIAS, "b"),
            numpy_helper.from_array(np.array([1], dtype=np.int64), "axes"),
        ],
    )
    opsets = [helper.make_opsetid("", ONNX_OPSET)]
    return _finish(graph, opsets, Path(directory) / "int64_scores.onnx")


def int64_reference(
    ids: npt.NDArray[np.int64], mask: npt.NDArray[np.bool_]
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64]]:
    """(scores, total) the INT64 model answers for ``ids`` and ``mask`` ([N, 4] each)."""
    kept = ids * mask.astype(np.int64)
    scores = kept.astype(np.float32) @ INT64_WEIGHTS + INT64_BIAS
    return scores.astype(np.float32), kept.sum(axis=1, keepdims=True)


def write_text_model(directory: Path) -> Path:
    """Write ``text_labels.onnx`` into ``directory`` (see the module docstring).

    Returns:
        The file's path.
    """
    known = list(range(len(WORDS)))
    nodes = [
        helper.make_node(
            "LabelEncoder",
            ["text"],
            ["class_id"],
            domain="ai.onnx.ml",
            keys_strings=list(WORDS),
            values_int64s=known,
            default_int64=-1,
        ),
        helper.make_node(
            "LabelEncoder",
            ["class_id"],
            ["label"],
            domain="ai.onnx.ml",
            keys_int64s=known,
            values_strings=[w.upper() for w in WORDS],
            default_string=UNKNOWN_LABEL,
        ),
    ]
    graph = helper.make_graph(
        nodes,
        "text_labels",
        [helper.make_tensor_value_info("text", TensorProto.STRING, ["N", 1])],
        [
            helper.make_tensor_value_info("class_id", TensorProto.INT64, ["N", 1]),
            helper.make_tensor_value_info("label", TensorProto.STRING, ["N", 1]),
        ],
    )
    opsets = [helper.make_opsetid("", ONNX_OPSET), helper.make_opsetid("ai.onnx.ml", ML_OPSET)]
    return _finish(graph, opsets, Path(directory) / "text_labels.onnx")


def text_reference(words: list[str]) -> tuple[npt.NDArray[np.int64], list[str]]:
    """(class_id [N, 1], labels) the text model answers for ``words`` (one per row)."""
    ids = [WORDS.index(w) if w in WORDS else -1 for w in words]
    labels = [WORDS[i].upper() if i >= 0 else UNKNOWN_LABEL for i in ids]
    return np.array(ids, dtype=np.int64).reshape(-1, 1), labels
