"""Real models for tests and benchmarks, trained on scikit-learn's digits, and their twins.

Two models, each written as ONNX and as TFLite with the same weights (the TFLite flatbuffers
are built through the schema that ai-edge-litert ships, so no TensorFlow is needed):

* the digits MLP: `train_digits_mlp` fits an `MLPClassifier` on the 8x8 images (pixels
  scaled to [0, 1]); `write_digits_onnx` converts it with skl2onnx and `write_digits_tflite`
  writes its weights. Input `input` float32 [batch, 64].
* the digits convnet: `train_digits_convnet` upscales the images to 28x28 (`digits_images`),
  keeps two seeded random 3x3 convolutions and trains a softmax head on their pooled
  features; `write_convnet_onnx` and `write_convnet_tflite` write it. Input `input` float32
  [batch, 1, 28, 28] (NCHW) in both files.

Both give one float32 output `probabilities` of shape [batch, 10]; `onnx_predict` and
`tflite_predict` run them. Files are written atomically.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import onnx
import onnx.utils
from onnx import TensorProto, helper, numpy_helper
from sklearn.datasets import load_digits
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import train_test_split
from sklearn.neural_network import MLPClassifier

from mcp_edge.tooling.tflite_graph import TFLiteGraph, atomic_write

INPUT_NAME = "input"
OUTPUT_NAME = "probabilities"
N_FEATURES = 64
N_CLASSES = 10
ONNX_OPSET = 17

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
    return atomic_write(path, model.SerializeToString())


def write_digits_tflite(mlp: MLPClassifier, path: Path) -> Path:
    """Write the MLP as a TFLite model: FULLY_CONNECTED(+ReLU), FULLY_CONNECTED, SOFTMAX.

    Tensors are float32 with batch 1 in `shape` and -1 in `shape_signature`, so the
    interpreter may resize the batch. One signature, `serving_default`, maps `input` and
    `probabilities`.

    Returns:
        `path`.
    """
    (w1, b1), (w2, b2) = _dense_layers(mlp)
    graph = TFLiteGraph()
    x = graph.activation(INPUT_NAME, [1, N_FEATURES])
    h = graph.activation("dense1/relu", [1, w1.shape[1]])
    logits = graph.activation("dense2/logits", [1, N_CLASSES])
    probs = graph.activation(OUTPUT_NAME, [1, N_CLASSES])
    # FULLY_CONNECTED wants weights as [out, in]: the transpose of sklearn's coefs_.
    graph.fully_connected(x, w1.T, b1, h, relu=True)
    graph.fully_connected(h, w2.T, b2, logits, relu=False)
    graph.softmax(logits, probs)
    return graph.write(
        path, {INPUT_NAME: x}, {OUTPUT_NAME: probs}, "digits MLP written by mcp_edge.tooling.models"
    )


# -- The digits convnet ---------------------------------------------------------------------

IMAGE_SIZE = 28
CONVNET_CHANNELS = (160, 1024)
"""Default widths of the two 3x3 convolutions (47 M multiply-adds per image): enough work
that one image costs a millisecond or more in onnxruntime on a two-core x86 machine, so the
model is compute-bound in benchmarks. Pass smaller `channels` for a lighter twin."""
_FEATURE_BATCH = 64


@dataclass(frozen=True)
class DigitsConvnet:
    """A digits convnet: random (seeded) convolution features and a trained softmax head.

    The graph is Conv 3x3 (pad 1) -> Relu -> MaxPool 2x2 -> Conv 3x3 (pad 1) -> Relu ->
    GlobalAveragePool -> Gemm -> Softmax, from `input` [N, 1, 28, 28] (NCHW, float32 in
    [0, 1]) to `probabilities` [N, 10].

    Attributes:
        conv1_weight, conv1_bias: [C1, 1, 3, 3] and [C1] (ONNX's OIHW layout).
        conv2_weight, conv2_bias: [C2, C1, 3, 3] and [C2].
        fc_weight, fc_bias: the head, [C2, 10] (Gemm without transpose) and [10].
        X_train, y_train: training images (float32 [n, 1, 28, 28] in [0, 1]) and labels 0..9.
        X_test, y_test: held-out images and labels.
        accuracy: the model's accuracy on the held-out split, in [0, 1].
    """

    conv1_weight: FloatArray
    conv1_bias: FloatArray
    conv2_weight: FloatArray
    conv2_bias: FloatArray
    fc_weight: FloatArray
    fc_bias: FloatArray
    X_train: FloatArray
    y_train: npt.NDArray[np.int64]
    X_test: FloatArray
    y_test: npt.NDArray[np.int64]
    accuracy: float


def _linear_resize_matrix(n_in: int, n_out: int) -> npt.NDArray[np.float64]:
    """[n_out, n_in] weights of a half-pixel-centred linear resize (rows sum to 1)."""
    matrix = np.zeros((n_out, n_in))
    centres = np.clip((np.arange(n_out) + 0.5) * n_in / n_out - 0.5, 0, n_in - 1)
    low = np.floor(centres).astype(int)
    high = np.minimum(low + 1, n_in - 1)
    frac = centres - low
    np.add.at(matrix, (np.arange(n_out), low), 1.0 - frac)
    np.add.at(matrix, (np.arange(n_out), high), frac)
    return matrix


def digits_images(X8x8: npt.ArrayLike) -> FloatArray:
    """Turn 8x8 digits into the convnet's input: bilinear upscale to [N, 1, 28, 28] float32.

    Args:
        X8x8: pixels in [0, 1] (scikit-learn's `digits.data / 16`, as `train_digits_mlp`
            uses), shape [N, 64] or [N, 8, 8].

    Returns:
        Images of shape [N, 1, 28, 28], values in [0, 1].

    Raises:
        ValueError: the array is not [N, 64] or [N, 8, 8].
    """
    pixels = np.asarray(X8x8, dtype=np.float64)
    if pixels.ndim == 2 and pixels.shape[1] == 64:
        pixels = pixels.reshape(-1, 8, 8)
    if pixels.ndim != 3 or pixels.shape[1:] != (8, 8):
        raise ValueError(f"expected digits of shape [N, 64] or [N, 8, 8], got {pixels.shape}")
    resize = _linear_resize_matrix(8, IMAGE_SIZE)
    images = np.einsum("ij,njk,lk->nil", resize, pixels, resize)
    return np.ascontiguousarray(images[:, None], dtype=np.float32)


def _convnet_onnx(
    weights: dict[str, FloatArray], head: bool, name: str = "digits_convnet"
) -> onnx.ModelProto:
    """The ONNX graph; without `head` it stops at the pooled features [N, C2]."""
    nodes = [
        helper.make_node(
            "Conv", [INPUT_NAME, "c1_w", "c1_b"], ["c1"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]
        ),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node(
            "Conv", ["p1", "c2_w", "c2_b"], ["c2"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]
        ),
        helper.make_node("Relu", ["c2"], ["r2"]),
        helper.make_node("GlobalAveragePool", ["r2"], ["gap"]),
        helper.make_node("Flatten", ["gap"], ["features"], axis=1),
    ]
    output = ("features", weights["c2_w"].shape[0])
    if head:
        nodes += [
            helper.make_node("Gemm", ["features", "fc_w", "fc_b"], ["logits"]),
            helper.make_node("Softmax", ["logits"], [OUTPUT_NAME], axis=1),
        ]
        output = (OUTPUT_NAME, N_CLASSES)
    used = {name for node in nodes for name in node.input}
    graph = helper.make_graph(
        nodes,
        name,
        [
            helper.make_tensor_value_info(
                INPUT_NAME, TensorProto.FLOAT, ["N", 1, IMAGE_SIZE, IMAGE_SIZE]
            )
        ],
        [helper.make_tensor_value_info(output[0], TensorProto.FLOAT, ["N", output[1]])],
        initializer=[
            numpy_helper.from_array(np.asarray(value, np.float32), key)
            for key, value in weights.items()
            if key in used
        ],
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", ONNX_OPSET)],
        producer_name="mcp_edge.tooling.models",
    )
    model.ir_version = 8
    return model


def _onnx_weights(net: DigitsConvnet) -> dict[str, FloatArray]:
    return {
        "c1_w": net.conv1_weight,
        "c1_b": net.conv1_bias,
        "c2_w": net.conv2_weight,
        "c2_b": net.conv2_bias,
        "fc_w": net.fc_weight,
        "fc_b": net.fc_bias,
    }


def train_digits_convnet(
    seed: int = 0, channels: tuple[int, int] = CONVNET_CHANNELS
) -> DigitsConvnet:
    """Build the digits convnet and train its head (a few seconds on two cores).

    The convolutions keep He-initialised random weights drawn from `seed` (the second with
    small negative biases, so each channel fires on part of the image only); onnxruntime
    computes their pooled features for every image, and a scikit-learn
    `LogisticRegression` on the standardised features becomes the Gemm head (the
    standardisation folded into its weights). The split is the one `train_digits_mlp` uses
    for the same `seed` (75 % train, stratified), as upscaled images.

    Args:
        seed: fixes the split and the convolution weights.
        channels: output channels of the first and second convolution.

    Returns:
        The weights, the data split and the held-out accuracy of the whole model.
    """
    import onnxruntime as ort

    c1, c2 = channels
    digits = load_digits()
    pixels = (digits.data / 16.0).astype(np.float32)
    labels = digits.target.astype(np.int64)
    X_train8, X_test8, y_train, y_test = train_test_split(
        pixels, labels, test_size=0.25, random_state=seed, stratify=labels
    )
    X_train, X_test = digits_images(X_train8), digits_images(X_test8)

    rng = np.random.default_rng(seed)
    conv = {
        "c1_w": rng.normal(0.0, np.sqrt(2.0 / 9), (c1, 1, 3, 3)).astype(np.float32),
        "c1_b": np.zeros(c1, np.float32),
        "c2_w": rng.normal(0.0, np.sqrt(2.0 / (9 * c1)), (c2, c1, 3, 3)).astype(np.float32),
        "c2_b": (-0.5 * np.abs(rng.normal(size=c2))).astype(np.float32),
    }
    session = ort.InferenceSession(
        _convnet_onnx(conv, head=False).SerializeToString(), providers=["CPUExecutionProvider"]
    )

    def features(images: FloatArray) -> npt.NDArray[np.float64]:
        chunks = [
            session.run(None, {INPUT_NAME: images[i : i + _FEATURE_BATCH]})[0]
            for i in range(0, len(images), _FEATURE_BATCH)
        ]
        return np.concatenate(chunks).astype(np.float64)

    F_train, F_test = features(X_train), features(X_test)
    mean, scale = F_train.mean(axis=0), F_train.std(axis=0) + 1e-6
    head = LogisticRegression(C=0.1, max_iter=1000, tol=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        head.fit((F_train - mean) / scale, y_train)
    coef = head.coef_ / scale  # [10, C2]
    fc_weight = coef.T.astype(np.float32)
    fc_bias = (head.intercept_ - coef @ mean).astype(np.float32)
    predicted = np.argmax(F_test @ fc_weight + fc_bias, axis=1)
    accuracy = float(np.mean(predicted == y_test))
    return DigitsConvnet(
        conv1_weight=conv["c1_w"],
        conv1_bias=conv["c1_b"],
        conv2_weight=conv["c2_w"],
        conv2_bias=conv["c2_b"],
        fc_weight=fc_weight,
        fc_bias=fc_bias,
        X_train=X_train,
        y_train=y_train,
        X_test=X_test,
        y_test=y_test,
        accuracy=accuracy,
    )


def write_convnet_onnx(net: DigitsConvnet, path: Path) -> Path:
    """Write the convnet as ONNX (opset 17, IR 8): `input` [N, 1, 28, 28] -> `probabilities`.

    The batch dimension is the symbolic `N`. The model passes `onnx.checker`'s full check.

    Returns:
        `path`.
    """
    model = _convnet_onnx(_onnx_weights(net), head=True)
    onnx.checker.check_model(model, full_check=True)
    return atomic_write(path, model.SerializeToString())


def write_convnet_tflite(net: DigitsConvnet, path: Path) -> Path:
    """Write the convnet as TFLite with the same weights and the same request as the ONNX twin.

    The input is `input` [N, 1, 28, 28] (NCHW, like the ONNX model), so one request serves
    both; a TRANSPOSE turns it into TFLite's NHWC, then CONV_2D (SAME, fused ReLU),
    MAX_POOL_2D 2x2, CONV_2D (SAME, fused ReLU), MEAN over H and W, FULLY_CONNECTED and
    SOFTMAX give `probabilities` [N, 10]. The batch is -1 in `shape_signature`.

    Returns:
        `path`.
    """
    g = TFLiteGraph()
    c1, c2 = net.conv1_weight.shape[0], net.conv2_weight.shape[0]
    half = IMAGE_SIZE // 2
    x = g.activation(INPUT_NAME, [1, 1, IMAGE_SIZE, IMAGE_SIZE])
    nhwc = g.activation("nhwc", [1, IMAGE_SIZE, IMAGE_SIZE, 1])
    r1 = g.activation("conv1/relu", [1, IMAGE_SIZE, IMAGE_SIZE, c1])
    p1 = g.activation("pool1", [1, half, half, c1])
    r2 = g.activation("conv2/relu", [1, half, half, c2])
    gap = g.activation("gap", [1, c2])
    logits = g.activation("logits", [1, N_CLASSES])
    probs = g.activation(OUTPUT_NAME, [1, N_CLASSES])
    g.transpose(x, [0, 2, 3, 1], nhwc)
    # CONV_2D wants filters as [out, kh, kw, in] (OHWI); ONNX stores them OIHW.
    g.conv_2d(nhwc, net.conv1_weight.transpose(0, 2, 3, 1), net.conv1_bias, r1, relu=True)
    g.max_pool_2d(r1, 2, p1)
    g.conv_2d(p1, net.conv2_weight.transpose(0, 2, 3, 1), net.conv2_bias, r2, relu=True)
    g.mean(r2, [1, 2], gap)
    g.fully_connected(gap, net.fc_weight.T, net.fc_bias, logits, relu=False)
    g.softmax(logits, probs)
    return g.write(
        path,
        {INPUT_NAME: x},
        {OUTPUT_NAME: probs},
        "digits convnet written by mcp_edge.tooling.models",
    )


@dataclass(frozen=True)
class DigitsConvnetModels:
    """A trained digits convnet and the two model files made from it.

    Attributes:
        onnx_path: `convnet.onnx` (`input` [N, 1, 28, 28] -> `probabilities` [N, 10]).
        tflite_path: `convnet.tflite`, the same weights, input and output.
        net: the weights, the data split (as images) and the held-out accuracy.
    """

    onnx_path: Path
    tflite_path: Path
    net: DigitsConvnet


def make_digits_convnet(
    directory: Path, seed: int = 0, channels: tuple[int, int] = CONVNET_CHANNELS
) -> DigitsConvnetModels:
    """Train a digits convnet and write `convnet.onnx` and `convnet.tflite` into `directory`.

    Returns:
        The paths and the trained model.
    """
    net = train_digits_convnet(seed=seed, channels=channels)
    return DigitsConvnetModels(
        onnx_path=write_convnet_onnx(net, Path(directory) / "convnet.onnx"),
        tflite_path=write_convnet_tflite(net, Path(directory) / "convnet.tflite"),
        net=net,
    )


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
