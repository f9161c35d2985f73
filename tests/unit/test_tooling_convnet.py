"""The digits convnet of mcp_edge.tooling.models: a real classifier with ONNX and TFLite twins.

Both files take the same request (`input` [N, 1, 28, 28], NCHW float32) and must give the same
probabilities; the head is trained, so held-out accuracy is a real figure.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from ai_edge_litert.interpreter import Interpreter
from sklearn.datasets import load_digits

from mcp_edge.tooling.models import (
    CONVNET_CHANNELS,
    DigitsConvnetModels,
    digits_images,
    make_digits_convnet,
    onnx_predict,
    tflite_predict,
    train_digits_convnet,
)


@pytest.fixture(scope="module")
def convnet(tmp_path_factory: pytest.TempPathFactory) -> DigitsConvnetModels:
    return make_digits_convnet(tmp_path_factory.mktemp("convnet"), seed=0)


@pytest.mark.parametrize("batch", [1, 32, None])
def test_onnx_and_tflite_twins_give_the_same_probabilities(
    convnet: DigitsConvnetModels, batch: int | None
) -> None:
    X = convnet.net.X_test[:batch]
    onnx_probs = onnx_predict(convnet.onnx_path, X)
    tflite_probs = tflite_predict(convnet.tflite_path, X)
    assert onnx_probs.shape == tflite_probs.shape == (len(X), 10)
    np.testing.assert_allclose(tflite_probs, onnx_probs, atol=1e-4)
    np.testing.assert_allclose(onnx_probs.sum(axis=1), 1.0, atol=1e-5)


def test_held_out_accuracy_is_real(convnet: DigitsConvnetModels) -> None:
    net = convnet.net
    predicted = onnx_predict(convnet.onnx_path, net.X_test).argmax(axis=1)
    accuracy = float(np.mean(predicted == net.y_test))
    assert accuracy >= 0.85
    assert accuracy == pytest.approx(net.accuracy, abs=1 / len(net.y_test))
    # Every class is recognised, not just the frequent ones.
    assert set(predicted) == set(range(10))


def test_onnx_file_is_valid_with_a_symbolic_batch(convnet: DigitsConvnetModels) -> None:
    model = onnx.load(str(convnet.onnx_path))
    onnx.checker.check_model(model, full_check=True)
    assert model.ir_version == 8
    assert [(op.domain, op.version) for op in model.opset_import] == [("", 17)]
    (graph_input,) = model.graph.input
    dims = graph_input.type.tensor_type.shape.dim
    assert graph_input.name == "input"
    assert [d.dim_param or d.dim_value for d in dims] == ["N", 1, 28, 28]
    assert [o.name for o in model.graph.output] == ["probabilities"]
    c1, c2 = CONVNET_CHANNELS
    weights = {init.name: tuple(init.dims) for init in model.graph.initializer}
    assert weights["c1_w"] == (c1, 1, 3, 3) and weights["c2_w"] == (c2, c1, 3, 3)


def test_tflite_file_takes_the_onnx_request_with_a_resizable_batch(
    convnet: DigitsConvnetModels,
) -> None:
    interpreter = Interpreter(model_path=str(convnet.tflite_path))
    (detail,) = interpreter.get_input_details()
    assert list(detail["shape_signature"]) == [-1, 1, 28, 28]
    assert detail["dtype"] == np.float32
    signature = interpreter.get_signature_list()
    assert signature == {"serving_default": {"inputs": ["input"], "outputs": ["probabilities"]}}


def test_the_same_seed_gives_the_same_model_and_another_seed_does_not(tmp_path: Path) -> None:
    a = train_digits_convnet(seed=3, channels=(8, 16))
    b = train_digits_convnet(seed=3, channels=(8, 16))
    c = train_digits_convnet(seed=4, channels=(8, 16))
    np.testing.assert_array_equal(a.conv2_weight, b.conv2_weight)
    np.testing.assert_array_equal(a.fc_weight, b.fc_weight)
    np.testing.assert_array_equal(a.X_test, b.X_test)
    assert not np.array_equal(a.conv2_weight, c.conv2_weight)
    assert a.conv2_weight.shape == (16, 8, 3, 3) and a.fc_weight.shape == (16, 10)
    small = make_digits_convnet(tmp_path, seed=3, channels=(8, 16))
    np.testing.assert_allclose(
        tflite_predict(small.tflite_path, small.net.X_test[:5]),
        onnx_predict(small.onnx_path, small.net.X_test[:5]),
        atol=1e-4,
    )


def test_digits_images_upscales_8x8_digits_to_28x28() -> None:
    pixels = load_digits().data[:4] / 16.0
    images = digits_images(pixels)
    assert images.shape == (4, 1, 28, 28) and images.dtype == np.float32
    assert images.min() >= 0.0 and images.max() <= 1.0
    # [N, 8, 8] is the same request as [N, 64]; a flat image stays flat.
    np.testing.assert_array_equal(digits_images(pixels.reshape(4, 8, 8)), images)
    np.testing.assert_allclose(digits_images(np.full((1, 64), 0.25)), 0.25, atol=1e-6)
    # The mean brightness survives the resize (each source pixel covers 3.5 x 3.5 pixels).
    np.testing.assert_allclose(images.mean(axis=(1, 2, 3)), pixels.mean(axis=1), atol=0.02)


@pytest.mark.parametrize("shape", [(2, 63), (2, 8, 9), (64,), (1, 1, 8, 8)])
def test_digits_images_rejects_other_shapes(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match=r"\[N, 64\] or \[N, 8, 8\]"):
        digits_images(np.zeros(shape))
