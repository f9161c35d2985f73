"""INT8 variants: ``mcp-bundle build --quantize int8`` with real onnxruntime quantization."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import numpy.typing as npt
import onnx
import onnxruntime as ort
import pytest
from click.testing import CliRunner, Result
from onnx import TensorProto, helper, numpy_helper

from mcp_edge.shared.bundle import (
    BundleManifest,
    build_bundle,
    open_bundle,
    sign_bundle,
    verify_bundle,
)
from mcp_edge.shared.bundle.quantize import measure_quantized, quantize_int8
from mcp_edge.shared.bundle_cli import cli
from mcp_edge.shared.errors import BundleError, ModelValidationError
from mcp_edge.shared.signing import PrivateKey
from mcp_edge.tooling.models import DigitsModels

EPOCH = "1764547200"


def run(*args: str | Path) -> Result:
    return CliRunner(env={"SOURCE_DATE_EPOCH": EPOCH}).invoke(
        cli, [str(a) for a in args], catch_exceptions=False
    )


def scores(path: Path, x: npt.NDArray[np.float32]) -> npt.NDArray[np.float64]:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (out,) = session.run(["probabilities"], {"input": x})
    return np.asarray(out, np.float64)


def accuracy(path: Path, x: npt.NDArray[np.float32], y: npt.NDArray[np.int64]) -> float:
    return 100.0 * float(np.mean(scores(path, x).argmax(axis=1) == y))


def write_nan_output_onnx(src: Path, dst: Path) -> Path:
    """A copy of the single-output model ``src`` whose output is multiplied by NaN: it loads,
    passes the ONNX checks and runs, and answers NaN for every input."""
    model = onnx.load(str(src))
    graph = model.graph
    out = graph.output[0].name
    for node in graph.node:
        node.output[:] = [f"{o}_before_nan" if o == out else o for o in node.output]
    graph.initializer.append(numpy_helper.from_array(np.array(np.nan, np.float32), "nan_const"))
    graph.node.append(helper.make_node("Mul", [f"{out}_before_nan", "nan_const"], [out]))
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(dst))
    return dst


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory, digits: DigitsModels) -> dict[str, Path]:
    """Baseline samples (the training digits) and their labels as .npy files."""
    root = tmp_path_factory.mktemp("quantize-data")
    np.save(root / "samples.npy", digits.mlp.X_train)
    np.save(root / "labels.npy", digits.mlp.y_train)
    np.save(root / "test_labels.npy", digits.y_test)
    return {
        "samples": root / "samples.npy",
        "labels": root / "labels.npy",
        "test_labels": root / "test_labels.npy",
    }


@pytest.fixture(scope="module")
def static_bundle(
    tmp_path_factory: pytest.TempPathFactory, digits: DigitsModels, data: dict[str, Path]
) -> tuple[Path, Result]:
    out = tmp_path_factory.mktemp("quantize-static") / "digits.mcpb"
    result = run(
        "build", digits.onnx_path, "--name", "digits", "--version", "1.3.0",
        "--baseline", data["samples"], "--baseline-labels", data["labels"],
        "--quantize", "int8", "-o", out,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    return out, result


def test_int8_variant_keeps_held_out_accuracy_within_one_point(
    tmp_path: Path, digits: DigitsModels, static_bundle: tuple[Path, Result]
) -> None:
    bundle, result = static_bundle
    key = PrivateKey.generate()
    sign_bundle(bundle, key, tmp_path / "signed.mcpb")
    opened = open_bundle(tmp_path / "signed.mcpb", tmp_path / "opened", [key.public_key])
    m = opened.manifest
    int8 = m.variant("int8")
    assert (int8.file, int8.format, int8.profiles) == ("models/model.int8.onnx", "onnx", ("int8",))
    assert m.variant_for_profiles(["int8"]).tag == "int8"
    assert int8.inputs == m.inputs and int8.outputs == m.outputs
    fp32_acc = accuracy(opened.variant_path("default"), digits.X_test, digits.y_test)
    int8_acc = accuracy(opened.variant_path("int8"), digits.X_test, digits.y_test)
    assert fp32_acc > 90
    assert abs(int8_acc - fp32_acc) <= 1.0, (fp32_acc, int8_acc)
    # It is a different, integer model, not a copy of the FP32 one.
    assert int8.sha256 != m.default_variant.sha256
    ops = {n.op_type for n in onnx.load(str(opened.variant_path("int8"))).graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops
    q = int8.quantization
    assert q is not None and q.scheme == "int8-static" and q.reference == "default"
    assert f"int8 (static): top-1 agreement {100 * q.top1_agreement:.1f} %" in result.stderr


def test_manifest_figures_equal_a_recomputation(
    tmp_path: Path, digits: DigitsModels, static_bundle: tuple[Path, Result]
) -> None:
    bundle, _ = static_bundle
    opened = open_bundle(bundle, tmp_path / "opened", [], require_signature=False)
    q = opened.manifest.variant("int8").quantization
    assert q is not None
    x, y = digits.mlp.X_train, digits.mlp.y_train
    ref = scores(opened.variant_path("default"), x)
    got = scores(opened.variant_path("int8"), x)
    assert q.samples == len(x)
    assert q.top1_agreement == pytest.approx(np.mean(ref.argmax(1) == got.argmax(1)), abs=1e-6)
    assert q.max_abs_diff == pytest.approx(np.abs(ref - got).max(), abs=1e-6)
    want_delta = 100 * (np.mean(got.argmax(1) == y) - np.mean(ref.argmax(1) == y))
    assert q.accuracy_delta == pytest.approx(want_delta, abs=1e-3)
    assert q.max_abs_diff > 0  # the INT8 model really answers differently


def test_signature_verify_and_inspect_show_the_figures(
    tmp_path: Path, static_bundle: tuple[Path, Result]
) -> None:
    bundle, _ = static_bundle
    key = PrivateKey.generate()
    signed = sign_bundle(bundle, key, tmp_path / "signed.mcpb")
    assert verify_bundle(tmp_path / "signed.mcpb", [key.public_key]).signer_keyid == key.keyid
    q = signed.manifest.variant("int8").quantization
    assert q is not None
    text = run("inspect", tmp_path / "signed.mcpb")
    assert text.exit_code == 0
    assert f"int8-static from default: top-1 agreement {100 * q.top1_agreement:.1f} %" in (
        text.output
    )
    doc = json.loads(run("inspect", tmp_path / "signed.mcpb", "--json").output)
    (int8,) = [v for v in doc["manifest"]["variants"] if v["tag"] == "int8"]
    assert int8["quantization"] == q.model_dump(mode="json")
    assert "quantization" not in doc["manifest"]["variants"][0]  # the default has none


def test_build_is_reproducible(
    tmp_path: Path, digits: DigitsModels, data: dict[str, Path], static_bundle: tuple[Path, Result]
) -> None:
    bundle, _ = static_bundle
    again = tmp_path / "again.mcpb"
    result = run(
        "build", digits.onnx_path, "--name", "digits", "--version", "1.3.0",
        "--baseline", data["samples"], "--baseline-labels", data["labels"],
        "--quantize", "int8", "-o", again,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert again.read_bytes() == bundle.read_bytes()
    one, two = tmp_path / "one.onnx", tmp_path / "two.onnx"
    for out in (one, two):
        quantize_int8(digits.onnx_path, out, mode="dynamic", calibration=None, input_name="input")
    assert one.read_bytes() == two.read_bytes()


def test_dynamic_is_the_default_without_samples(tmp_path: Path, digits: DigitsModels) -> None:
    out = tmp_path / "dyn.mcpb"
    result = run(
        "build", digits.onnx_path, "--name", "digits", "--version", "1.3.0",
        "--quantize", "int8", "-o", out,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    manifest = verify_bundle(out, [], require_signature=False).manifest
    q = manifest.variant("int8").quantization
    assert q is not None and q.scheme == "int8-dynamic" and q.accuracy_delta is None
    assert q.measured_on == "synthetic"  # recorded: the figures are not from real samples
    assert "seeded random inputs" in result.stderr
    opened = open_bundle(out, tmp_path / "opened", [], require_signature=False)
    ops = {n.op_type for n in onnx.load(str(opened.variant_path("int8"))).graph.node}
    assert "MatMulInteger" in ops or "DynamicQuantizeLinear" in ops
    fp32_acc = accuracy(opened.variant_path("default"), digits.X_test, digits.y_test)
    int8_acc = accuracy(opened.variant_path("int8"), digits.X_test, digits.y_test)
    assert abs(int8_acc - fp32_acc) <= 1.0


@pytest.mark.parametrize(
    ("extra", "code", "message"),
    [
        (("--quantize", "int8", "--quantize-mode", "static"), 1, "pass --baseline SAMPLES.npy"),
        (("--quantize", "int4"), 2, "Invalid value for '--quantize'"),
        (
            ("--quantize", "int8", "--baseline", "@samples", "--baseline-labels", "@test_labels"),
            1,
            "one integer class per baseline sample: 1347 samples, labels of shape [450]",
        ),
        (("--baseline-labels", "@labels"), 1, "need --quantize int8"),
        (("--quantize", "int8", "--variant", "int8=@model"), 1, "already has a variant tagged"),
    ],
)
def test_refusals(
    tmp_path: Path,
    digits: DigitsModels,
    data: dict[str, Path],
    extra: tuple[str, ...],
    code: int,
    message: str,
) -> None:
    paths = {**{f"@{k}": str(v) for k, v in data.items()}, "@model": str(digits.onnx_path)}
    args = [paths.get(a, a.replace("int8=@model", f"int8={digits.onnx_path}")) for a in extra]
    out = tmp_path / "x.mcpb"
    result = run(
        "build", digits.onnx_path, "--name", "digits", "--version", "1.3.0", *args, "-o", out
    )
    assert result.exit_code == code, result.output
    assert message in result.stderr
    if code == 1:
        assert len(result.stderr.strip().splitlines()) == 1
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []  # no temporary files left


def test_a_tflite_default_is_refused(tmp_path: Path, digits: DigitsModels) -> None:
    with pytest.raises(BundleError, match="default model is tflite"):
        build_bundle(digits.tflite_path, tmp_path / "x.mcpb", name="d", version="1.0.0",
                     quantize="int8")  # fmt: skip
    assert list(tmp_path.iterdir()) == []


def test_a_quantized_model_answering_nan_fails_its_check(
    tmp_path: Path, digits: DigitsModels
) -> None:
    nan_model = write_nan_output_onnx(digits.onnx_path, tmp_path / "nan.onnx")
    assert np.isnan(scores(nan_model, digits.X_test[:4])).all()
    with pytest.raises(ModelValidationError, match="NaN"):
        measure_quantized(
            digits.onnx_path, nan_model, digits.X_test, digits.y_test, scheme="int8-static"
        )


def test_manifest_without_quantization_keeps_its_fields(
    tmp_path: Path, digits: DigitsModels
) -> None:
    manifest = build_bundle(digits.onnx_path, tmp_path / "p.mcpb", name="d", version="1.0.0")
    assert isinstance(manifest, BundleManifest)
    assert [v.tag for v in manifest.variants] == ["default"]
    assert "quantization" not in json.dumps(manifest.to_json_dict())


def test_a_head_int8_would_erase_stays_fp32(tmp_path: Path) -> None:
    from mcp_edge.tooling.models import train_digits_convnet, write_convnet_onnx

    net = train_digits_convnet(seed=0, channels=(16, 64))
    fp32 = write_convnet_onnx(net, tmp_path / "convnet.onnx")
    out = quantize_int8(
        fp32, tmp_path / "q.onnx", mode="static", calibration=net.X_train, input_name="input"
    )
    graph = onnx.load(str(out)).graph
    kinds = {n.op_type for n in graph.node}
    assert {"QuantizeLinear", "DequantizeLinear", "Conv"} <= kinds
    (gemm,) = [n for n in graph.node if n.op_type == "Gemm"]
    fp32_names = {t.name for t in graph.initializer if t.data_type == TensorProto.FLOAT}
    assert gemm.input[1] in fp32_names  # the head's weights were not quantized
    q = measure_quantized(fp32, out, net.X_test, net.y_test, scheme="int8-static")
    # Quantizing the head and its features drops this model to about 15 % accuracy.
    assert q.accuracy_delta is not None and q.accuracy_delta > -3.0
    assert q.top1_agreement > 0.95
