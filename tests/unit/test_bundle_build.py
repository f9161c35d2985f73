"""Building, signing, verifying and opening bundles made from the real digits models."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import onnx
import pytest

from mcp_edge.shared.bundle import (
    BundleManifest,
    TensorSpec,
    VariantSource,
    build_bundle,
    inspect_bundle,
    open_bundle,
    sign_bundle,
    verify_bundle,
)
from mcp_edge.shared.bundle.baseline import bin_counts, compute_baseline
from mcp_edge.shared.errors import BundleError, ModelValidationError
from mcp_edge.shared.signing import PrivateKey
from mcp_edge.tooling.models import DigitsModels, onnx_predict

CREATED = datetime(2024, 5, 1, 12, 0, 0, tzinfo=timezone.utc)
DIGITS_IN = (TensorSpec(name="input", datatype="FP32", shape=(-1, 64)),)
DIGITS_OUT = (TensorSpec(name="probabilities", datatype="FP32", shape=(-1, 10)),)


@pytest.fixture(scope="module")
def publisher() -> PrivateKey:
    return PrivateKey.generate()


@pytest.fixture
def labels(tmp_path: Path) -> Path:
    path = tmp_path / "labels.txt"
    path.write_text("".join(f"digit-{i}\n" for i in range(10)))
    return path


@pytest.fixture
def samples(tmp_path: Path, digits: DigitsModels) -> Path:
    path = tmp_path / "samples.npy"
    np.save(path, digits.X_test[:200])
    return path


def test_onnx_bundle_builds_signs_and_verifies(
    tmp_path: Path, digits: DigitsModels, publisher: PrivateKey, labels: Path
) -> None:
    out = tmp_path / "digits.mcpb"
    manifest = build_bundle(
        digits.onnx_path,
        out,
        name="digits",
        version="1.3.0",
        labels_path=labels,
        variants={"rpi": VariantSource(digits.tflite_path, ("raspberry-pi", "generic-arm64"))},
        created=CREATED,
    )
    assert manifest.inputs == DIGITS_IN and manifest.outputs == DIGITS_OUT
    signed = sign_bundle(out, publisher)
    assert signed.signer_keyid == publisher.keyid

    result = verify_bundle(out, [publisher.public_key])

    assert result.signer_keyid == publisher.keyid
    m = result.manifest
    assert (m.name, m.version, m.format, m.created) == (
        "digits",
        "1.3.0",
        "onnx",
        "2024-05-01T12:00:00Z",
    )
    assert m.inputs == DIGITS_IN and m.outputs == DIGITS_OUT
    assert m.labels is not None and (m.labels.file, m.labels.count) == ("labels.txt", 10)
    assert m.constraints.min_runtime["onnx_opset"] >= 13
    default, rpi = m.variants
    assert (default.tag, default.file, default.profiles) == ("default", "models/model.onnx", ("*",))
    assert (rpi.tag, rpi.format, rpi.file) == ("rpi", "tflite", "models/model.rpi.tflite")
    assert rpi.profiles == ("raspberry-pi", "generic-arm64")
    assert rpi.inputs == DIGITS_IN  # recorded from the TFLite file's own signature
    assert m.variant_for_profiles(["generic-arm64"]).tag == "rpi"
    assert m.variant_for_profiles(["jetson-orin"]).tag == "default"
    assert {f.path: f.size for f in m.files} == {
        "labels.txt": labels.stat().st_size,
        "models/model.onnx": digits.onnx_path.stat().st_size,
        "models/model.rpi.tflite": digits.tflite_path.stat().st_size,
    }
    with tarfile.open(out) as tar:
        names = tar.getnames()
    assert names == [
        "manifest.json",
        "manifest.sig",
        "labels.txt",
        "models/model.onnx",
        "models/model.rpi.tflite",
    ]


def test_tflite_bundle_records_the_interpreters_signature(
    tmp_path: Path, digits: DigitsModels, publisher: PrivateKey
) -> None:
    out = tmp_path / "digits-tflite.mcpb"
    build_bundle(digits.tflite_path, out, name="digits-lite", version="0.1.0")
    sign_bundle(out, publisher)

    m = verify_bundle(out, [publisher.public_key]).manifest

    assert m.format == "tflite"
    assert m.default_variant.file == "models/model.tflite"
    # shape_signature gives the dynamic batch, not the allocated [1, 64]
    assert m.inputs == DIGITS_IN and m.outputs == DIGITS_OUT
    assert m.metadata_props["tflite.signature_key"] == "serving_default"


def test_onnx_metadata_props_are_copied_and_overridable(
    tmp_path: Path, digits: DigitsModels
) -> None:
    model = onnx.load(str(digits.onnx_path))
    onnx.helper.set_model_props(model, {"author": "ml-team", "license": "MIT"})
    src = tmp_path / "with-props.onnx"
    onnx.save(model, str(src))

    m = build_bundle(
        src,
        tmp_path / "b.mcpb",
        name="digits",
        version="1.0.0",
        metadata={"license": "Apache-2.0", "git_sha": "abc123"},
    )

    assert m.metadata_props == {"author": "ml-team", "license": "Apache-2.0", "git_sha": "abc123"}


def test_baseline_is_computed_from_samples_and_model_answers(
    tmp_path: Path, digits: DigitsModels, samples: Path
) -> None:
    m = build_bundle(
        digits.onnx_path,
        tmp_path / "b.mcpb",
        name="digits",
        version="1.0.0",
        baseline_npy=samples,
    )

    b = m.drift_baseline
    assert b is not None
    assert (b.input, b.sample_count, b.mode, b.feature_count) == ("input", 200, "per_feature", 64)
    assert [f.name for f in b.features] == [f"f{i}" for i in range(64)]
    x = np.load(samples)
    f10 = b.features[10]
    assert sum(f10.histogram.counts) == 200
    assert f10.mean == pytest.approx(float(x[:, 10].mean()))
    assert f10.histogram.edges[0] == pytest.approx(float(x[:, 10].min()))
    assert b.output is not None and b.output.output == "probabilities"
    predicted = onnx_predict(digits.onnx_path, x).argmax(axis=1)
    assert list(b.output.class_counts) == np.bincount(predicted, minlength=10).tolist()
    assert sum(b.output.confidence.counts) == 200
    assert b.output.confidence.edges == tuple(i / 10 for i in range(11))


def test_baseline_summarises_wide_inputs_and_clips_outliers_into_end_bins() -> None:
    rng = np.random.default_rng(0)
    images = rng.uniform(0, 1, size=(50, 3, 8, 8))

    b = compute_baseline("image", images)

    assert (b.mode, b.feature_count) == ("summary", 192)
    assert [f.name for f in b.features] == ["sample_mean", "sample_std"] + [
        f"p{i}" for i in range(24)
    ]
    assert b.projections == 24 and b.projection_seed is not None
    assert sum(b.features[0].histogram.counts) == 50
    assert bin_counts([-5.0, 0.0, 0.5, 1.0, 9.0], [0.0, 0.5, 1.0]) == [2, 3]


def test_same_inputs_give_the_same_bytes(
    tmp_path: Path, digits: DigitsModels, labels: Path, samples: Path
) -> None:
    a, b, c = tmp_path / "a.mcpb", tmp_path / "b.mcpb", tmp_path / "c.mcpb"
    for out in (a, b):
        build_bundle(
            digits.onnx_path,
            out,
            name="digits",
            version="1.0.0",
            labels_path=labels,
            baseline_npy=samples,
            created=CREATED,
        )
    build_bundle(
        digits.onnx_path,
        c,
        name="digits",
        version="1.0.0",
        labels_path=labels,
        baseline_npy=samples,
        created=datetime(2025, 1, 1, tzinfo=timezone.utc),
    )

    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()
    with tarfile.open(a) as tar:
        for info in tar.getmembers():
            assert (info.mtime, info.uid, info.gid, info.mode, info.uname) == (0, 0, 0, 0o644, "")


@pytest.mark.parametrize("name", ["Digits", "../digits", "", "a" * 65, "di gits", "-x"])
def test_bad_name_is_refused(tmp_path: Path, digits: DigitsModels, name: str) -> None:
    out = tmp_path / "out.mcpb"
    with pytest.raises(BundleError, match="invalid bundle name"):
        build_bundle(digits.onnx_path, out, name=name, version="1.0.0")
    assert not out.exists()


@pytest.mark.parametrize("version", ["1.3", "1.3.0.1", "01.2.3", "latest", ""])
def test_bad_version_is_refused(tmp_path: Path, digits: DigitsModels, version: str) -> None:
    out = tmp_path / "out.mcpb"
    with pytest.raises(BundleError, match=r"semantic version|not a version"):
        build_bundle(digits.onnx_path, out, name="digits", version=version)
    assert not out.exists()


def test_variant_tag_default_is_refused(tmp_path: Path, digits: DigitsModels) -> None:
    with pytest.raises(BundleError, match="'default' variant is the main model"):
        build_bundle(
            digits.onnx_path,
            tmp_path / "o.mcpb",
            name="d",
            version="1.0.0",
            variants={"default": VariantSource(digits.tflite_path)},
        )


def test_variant_profiles_default_to_its_tag(tmp_path: Path, digits: DigitsModels) -> None:
    m = build_bundle(
        digits.onnx_path,
        tmp_path / "o.mcpb",
        name="d",
        version="1.0.0",
        variants={"jetson-orin": VariantSource(digits.onnx_path)},
    )
    assert m.variant("jetson-orin").profiles == ("jetson-orin",)


def test_corrupt_model_is_refused_at_build(tmp_path: Path) -> None:
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x08\x07garbage that is not a model" * 10)
    out = tmp_path / "o.mcpb"
    with pytest.raises(ModelValidationError, match=r"bad\.onnx"):
        build_bundle(bad, out, name="bad", version="1.0.0")
    assert not out.exists()


def test_preprocessing_is_validated(tmp_path: Path, digits: DigitsModels) -> None:
    m = build_bundle(
        digits.onnx_path,
        tmp_path / "o.mcpb",
        name="d",
        version="1.0.0",
        preprocessing={
            "kind": "image",
            "layout": "flat",
            "size": [8, 8],
            "scale": 1 / 16,
            "grayscale": True,
        },
    )
    assert m.preprocessing is not None and m.preprocessing.size == (8, 8)
    with pytest.raises(BundleError, match="invalid preprocessing: layout"):
        build_bundle(
            digits.onnx_path,
            tmp_path / "p.mcpb",
            name="d",
            version="1.0.0",
            preprocessing={"kind": "image", "layout": "CHWN"},
        )


def test_open_bundle_unpacks_a_runnable_model(
    tmp_path: Path, digits: DigitsModels, publisher: PrivateKey, labels: Path
) -> None:
    bundle = tmp_path / "b.mcpb"
    build_bundle(digits.onnx_path, bundle, name="digits", version="1.0.0", labels_path=labels)
    sign_bundle(bundle, publisher)
    dest = tmp_path / "models" / "digits-1.0.0"
    dest.parent.mkdir()

    opened = open_bundle(bundle, dest, [publisher.public_key])

    assert opened.root == dest
    assert sorted(p.name for p in dest.iterdir()) == [
        "labels.txt",
        "manifest.json",
        "manifest.sig",
        "models",
    ]
    assert opened.path_of("labels.txt").read_bytes() == labels.read_bytes()
    model = opened.variant_path("default")
    np.testing.assert_allclose(
        onnx_predict(model, digits.X_test[:5]), onnx_predict(digits.onnx_path, digits.X_test[:5])
    )
    assert (
        BundleManifest.model_validate_json((dest / "manifest.json").read_bytes()) == opened.manifest
    )
    assert sorted(p.name for p in dest.parent.iterdir()) == ["digits-1.0.0"]  # no staging left
    with pytest.raises(FileExistsError):
        open_bundle(bundle, dest, [publisher.public_key])


def test_resigning_replaces_the_signature(
    tmp_path: Path, digits: DigitsModels, publisher: PrivateKey
) -> None:
    bundle = tmp_path / "b.mcpb"
    build_bundle(digits.onnx_path, bundle, name="digits", version="1.0.0")
    sign_bundle(bundle, publisher)
    other = PrivateKey.generate()
    signed_copy = tmp_path / "re.mcpb"

    sign_bundle(bundle, other, signed_copy)

    assert verify_bundle(signed_copy, [other.public_key]).signer_keyid == other.keyid
    with pytest.raises(BundleError) as info:
        verify_bundle(signed_copy, [publisher.public_key])
    assert info.value.member == "manifest.sig"
    assert verify_bundle(bundle, [publisher.public_key]).signer_keyid == publisher.keyid


def test_inspect_reports_manifest_and_claimed_signer(
    tmp_path: Path, digits: DigitsModels, publisher: PrivateKey
) -> None:
    bundle = tmp_path / "b.mcpb"
    build_bundle(digits.onnx_path, bundle, name="digits", version="1.0.0")
    assert inspect_bundle(bundle)["signature"] is None
    sign_bundle(bundle, publisher)

    info = inspect_bundle(bundle)

    assert info["signature"] == {"keyid": publisher.keyid, "verified": False}
    assert info["manifest"]["name"] == "digits"
    assert info["size"] == bundle.stat().st_size
    json.dumps(info)  # JSON-ready


def test_importing_bundle_code_loads_no_model_runtime() -> None:
    code = (
        "import sys, shared.bundle, shared.bundle_cli\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & "
        "{'onnx', 'onnxruntime', 'ai_edge_litert', 'tflite_runtime', 'tqdm'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_tflite_without_runtime_says_what_to_install(tmp_path: Path, digits: DigitsModels) -> None:
    # Simulate a machine without ai-edge-litert or tflite_runtime: a None entry in
    # sys.modules makes the import fail as if the package were absent.
    code = (
        "import sys\n"
        "for m in ('ai_edge_litert', 'ai_edge_litert.interpreter', 'tflite_runtime',\n"
        "          'tflite_runtime.interpreter'):\n"
        "    sys.modules[m] = None\n"
        "from shared.bundle import build_bundle, RuntimeUnavailableError\n"
        "try:\n"
        f"    build_bundle({str(digits.tflite_path)!r}, {str(tmp_path / 'o.mcpb')!r},\n"
        "                 name='d', version='1.0.0')\n"
        "except RuntimeUnavailableError as e:\n"
        "    print('refused:', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "refused:" in out.stdout
    assert "pip install 'mcp-edge[tflite]'" in out.stdout
    assert not (tmp_path / "o.mcpb").exists()
