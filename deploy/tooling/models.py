"""Real models for tests: a small MLP trained on scikit-learn's digits, and its twins.

`train_digits_mlp` fits an `MLPClassifier` on the 8x8 digits images (pixels scaled to [0, 1]).
`write_digits_onnx` converts it with skl2onnx; `write_digits_tflite` writes the same weights as
a TFLite flatbuffer through the schema that ai-edge-litert ships, so no TensorFlow is needed.
Both files take one float32 input `input` of shape [batch, 64] and give one float32 output
`probabilities` of shape [batch, 10]. `onnx_predict` and `tflite_predict` run them.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import flatbuffers
import numpy as np
import numpy.typing as npt
import onnx
import onnx.utils
from sklearn.datasets import load_digits
from sklearn.exceptions import ConvergenceWarning
from sklearn.model_selection import train_test_split
from sklearn.neural_network import MLPClassifier

INPUT_NAME = "input"
OUTPUT_NAME = "probabilities"
N_FEATURES = 64
N_CLASSES = 10
ONNX_OPSET = 17
TFLITE_SIGNATURE_KEY = "serving_default"
# TFLite's own converter aligns constant buffers to 16 bytes so kernels can read floats in
# place; we do the same.
_TFLITE_BUFFER_ALIGNMENT = 16

FloatArray = npt.NDArray[np.float32]


@dataclass(frozen=True)
class DigitsMLP:
    """A fitted digits classifier and the split it was trained and scored on.

    Attributes:
        model: the fitted `MLPClassifier`.
        X_train, y_train: training pixels (float32 in [0, 1], shape [n, 64]) and labels 0..9.
        X_test, y_test: held-out pixels and labels.
        accuracy: scikit-learn's accuracy on the test split, in [0, 1].
    """

    model: MLPClassifier
    X_train: FloatArray
    y_train: npt.NDArray[np.int64]
    X_test: FloatArray
    y_test: npt.NDArray[np.int64]
    accuracy: float


def train_digits_mlp(seed: int = 0, hidden_units: int = 32) -> DigitsMLP:
    """Train a one-hidden-layer ReLU MLP on sklearn's digits (takes a few seconds).

    The split (75 % train, stratified) and the weights are fixed by `seed`.

    Returns:
        The fitted model, the data split and its test accuracy.
    """
    digits = load_digits()
    pixels = (digits.data / 16.0).astype(np.float32)
    labels = digits.target.astype(np.int64)
    X_train, X_test, y_train, y_test = train_test_split(
        pixels, labels, test_size=0.25, random_state=seed, stratify=labels
    )
    model = MLPClassifier(
        hidden_layer_sizes=(hidden_units,), activation="relu", max_iter=1000, random_state=seed
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        model.fit(X_train, y_train)
    accuracy = float(model.score(X_test, y_test))
    return DigitsMLP(model, X_train, y_train, X_test, y_test, accuracy)


@dataclass(frozen=True)
class DigitsModels:
    """A trained digits MLP and the two model files made from it.

    Attributes:
        onnx_path: the skl2onnx conversion (`input` [N, 64] -> `probabilities` [N, 10]).
        tflite_path: the TFLite twin, same weights and tensor names.
        mlp: the fitted scikit-learn model, its data split and test accuracy.
    """

    onnx_path: Path
    tflite_path: Path
    mlp: DigitsMLP

    @property
    def X_test(self) -> FloatArray:
        """Held-out pixels, float32 in [0, 1], shape [n, 64]."""
        return self.mlp.X_test

    @property
    def y_test(self) -> npt.NDArray[np.int64]:
        """Held-out labels 0..9."""
        return self.mlp.y_test

    @property
    def accuracy(self) -> float:
        """scikit-learn's accuracy on the held-out split, in [0, 1]."""
        return self.mlp.accuracy


def make_digits_models(directory: Path, seed: int = 0) -> DigitsModels:
    """Train a digits MLP and write `digits.onnx` and `digits.tflite` into `directory`.

    Returns:
        The paths and the trained model.
    """
    mlp = train_digits_mlp(seed=seed)
    return DigitsModels(
        onnx_path=write_digits_onnx(mlp.model, Path(directory) / "digits.onnx"),
        tflite_path=write_digits_tflite(mlp.model, Path(directory) / "digits.tflite"),
        mlp=mlp,
    )


def _dense_layers(mlp: MLPClassifier) -> list[tuple[FloatArray, FloatArray]]:
    """Return (weights [in, out], bias [out]) per layer, checking the shape we support."""
    if mlp.activation != "relu" or mlp.out_activation_ != "softmax" or len(mlp.coefs_) != 2:
        raise ValueError("expected a one-hidden-layer ReLU MLP with a softmax output")
    return [
        (np.asarray(w, np.float32), np.asarray(b, np.float32))
        for w, b in zip(mlp.coefs_, mlp.intercepts_, strict=True)
    ]


def write_digits_onnx(mlp: MLPClassifier, path: Path) -> Path:
    """Convert the MLP with skl2onnx and write it to `path`.

    The graph keeps only the probabilities (skl2onnx's `label` output is cut off).

    Returns:
        `path`.
    """
    from skl2onnx import convert_sklearn
    from skl2onnx.common.data_types import FloatTensorType

    converted = convert_sklearn(
        mlp,
        initial_types=[(INPUT_NAME, FloatTensorType([None, N_FEATURES]))],
        options={id(mlp): {"zipmap": False}},
        target_opset={"": ONNX_OPSET, "ai.onnx.ml": 3},
    )
    model = onnx.utils.Extractor(converted).extract_model([INPUT_NAME], [OUTPUT_NAME])
    used_domains = {node.domain for node in model.graph.node}
    kept = [op for op in model.opset_import if op.domain in used_domains | {""}]
    del model.opset_import[:]
    model.opset_import.extend(kept)
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(path))
    return path


def _aligned_buffer(data: bytes) -> Any:
    """A schema `BufferT` whose bytes start on a 16-byte boundary of the finished file."""
    from ai_edge_litert import schema_py_generated as schema

    class AlignedBufferT(schema.BufferT):  # type: ignore[misc]  # generated code, untyped
        def Pack(self, builder: flatbuffers.Builder) -> int:
            builder.StartVector(1, len(data), _TFLITE_BUFFER_ALIGNMENT)
            builder.head -= len(data)
            builder.Bytes[builder.head : builder.head + len(data)] = data
            vector = builder.EndVector()
            schema.BufferStart(builder)
            schema.BufferAddData(builder, vector)
            return int(schema.BufferEnd(builder))

    return AlignedBufferT()


def write_digits_tflite(mlp: MLPClassifier, path: Path) -> Path:
    """Write the MLP as a TFLite model: FULLY_CONNECTED(+ReLU), FULLY_CONNECTED, SOFTMAX.

    Tensors are float32 with batch 1 in `shape` and -1 in `shape_signature`, so the
    interpreter may resize the batch. One signature, `serving_default`, maps `input` and
    `probabilities`.

    Returns:
        `path`.
    """
    from ai_edge_litert import schema_py_generated as schema

    (w1, b1), (w2, b2) = _dense_layers(mlp)
    hidden = w1.shape[1]
    buffers = [schema.BufferT()]  # buffer 0: the empty sentinel every schema reader expects

    def constant(array: FloatArray) -> int:
        buffers.append(_aligned_buffer(np.ascontiguousarray(array, dtype="<f4").tobytes()))
        return len(buffers) - 1

    tensors: list[Any] = []

    def tensor(name: str, shape: list[int], buffer: int = 0, batched: bool = True) -> int:
        t = schema.TensorT()
        t.name, t.shape, t.type, t.buffer = name, shape, schema.TensorType.FLOAT32, buffer
        t.shapeSignature = [-1, *shape[1:]] if batched else list(shape)
        tensors.append(t)
        return len(tensors) - 1

    # FULLY_CONNECTED wants weights as [out, in]: the transpose of sklearn's coefs_.
    x = tensor(INPUT_NAME, [1, N_FEATURES])
    w1_t = tensor("dense1/weights", [hidden, N_FEATURES], constant(w1.T), batched=False)
    b1_t = tensor("dense1/bias", [hidden], constant(b1), batched=False)
    h = tensor("dense1/relu", [1, hidden])
    w2_t = tensor("dense2/weights", [N_CLASSES, hidden], constant(w2.T), batched=False)
    b2_t = tensor("dense2/bias", [N_CLASSES], constant(b2), batched=False)
    logits = tensor("dense2/logits", [1, N_CLASSES])
    probs = tensor(OUTPUT_NAME, [1, N_CLASSES])

    def opcode(builtin: int) -> Any:
        code = schema.OperatorCodeT()
        code.builtinCode = code.deprecatedBuiltinCode = builtin
        code.version = 1
        return code

    def fully_connected(inputs: list[int], output: int, activation: int) -> Any:
        op = schema.OperatorT()
        op.opcodeIndex, op.inputs, op.outputs = 0, inputs, [output]
        op.builtinOptionsType = schema.BuiltinOptions.FullyConnectedOptions
        op.builtinOptions = schema.FullyConnectedOptionsT()
        op.builtinOptions.fusedActivationFunction = activation
        return op

    softmax = schema.OperatorT()
    softmax.opcodeIndex, softmax.inputs, softmax.outputs = 1, [logits], [probs]
    softmax.builtinOptionsType = schema.BuiltinOptions.SoftmaxOptions
    softmax.builtinOptions = schema.SoftmaxOptionsT()
    softmax.builtinOptions.beta = 1.0

    subgraph = schema.SubGraphT()
    subgraph.name = "main"
    subgraph.tensors, subgraph.inputs, subgraph.outputs = tensors, [x], [probs]
    subgraph.operators = [
        fully_connected([x, w1_t, b1_t], h, schema.ActivationFunctionType.RELU),
        fully_connected([h, w2_t, b2_t], logits, schema.ActivationFunctionType.NONE),
        softmax,
    ]

    signature = schema.SignatureDefT()
    signature.signatureKey, signature.subgraphIndex = TFLITE_SIGNATURE_KEY, 0
    signature.inputs = [_tensor_map(schema, INPUT_NAME, x)]
    signature.outputs = [_tensor_map(schema, OUTPUT_NAME, probs)]

    model = schema.ModelT()
    model.version = 3
    model.description = "digits MLP written by mcp_edge.tooling.models"
    model.operatorCodes = [
        opcode(schema.BuiltinOperator.FULLY_CONNECTED),
        opcode(schema.BuiltinOperator.SOFTMAX),
    ]
    model.subgraphs, model.buffers, model.signatureDefs = [subgraph], buffers, [signature]

    builder = flatbuffers.Builder(1024)
    builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
    Path(path).write_bytes(builder.Output())
    return path


def _tensor_map(schema: Any, name: str, index: int) -> Any:
    mapping = schema.TensorMapT()
    mapping.name, mapping.tensorIndex = name, index
    return mapping


def onnx_predict(path: Path, X: npt.ArrayLike) -> FloatArray:
    """Run an ONNX model with onnxruntime (CPU) on a batch.

    Returns:
        Class probabilities, float32 of shape [len(X), n_classes].
    """
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    batch = np.asarray(X, dtype=np.float32)
    (probabilities,) = session.run([OUTPUT_NAME], {INPUT_NAME: batch})
    return np.asarray(probabilities, dtype=np.float32)


def tflite_predict(path: Path, X: npt.ArrayLike) -> FloatArray:
    """Run a TFLite model with ai-edge-litert on a batch, resizing its input to [len(X), ...].

    Returns:
        Class probabilities, float32 of shape [len(X), n_classes].

    Raises:
        ValueError: the model has more than one input or output, or its input's
            `shape_signature` does not allow the batch size (the resize is strict).
    """
    from ai_edge_litert.interpreter import Interpreter

    batch = np.asarray(X, dtype=np.float32)
    interpreter = Interpreter(model_path=str(path))
    (input_detail,) = interpreter.get_input_details()
    (output_detail,) = interpreter.get_output_details()
    interpreter.resize_tensor_input(input_detail["index"], list(batch.shape), strict=True)
    interpreter.allocate_tensors()
    interpreter.set_tensor(input_detail["index"], batch)
    interpreter.invoke()
    return np.array(interpreter.get_tensor(output_detail["index"]), dtype=np.float32)
