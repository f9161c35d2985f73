"""Ranking a bundle's variants for a device (agent.update.variants): real manifests built from
the digits model, the real hardware profiles, and a backend check the test controls."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from mcp_edge.agent.update.variants import (
    rank_variants,
    variant_candidates,
)
from mcp_edge.shared.bundle import BundleManifest, VariantSource, build_bundle
from mcp_edge.shared.profiles import HardwareProfile, load_profiles
from mcp_edge.tooling.models import DigitsModels


@pytest.fixture(scope="module")
def manifest_doc(tmp_path_factory: pytest.TempPathFactory, digits: DigitsModels) -> dict[str, Any]:
    """A digits manifest with default (ONNX), xeon (ONNX, for intel-xeon), x86_64 (ONNX, by tag)
    and rpi (TFLite, for raspberry-pi), as JSON."""
    out = tmp_path_factory.mktemp("variants")
    copy = out / "xeon.onnx"
    copy.write_bytes(digits.onnx_path.read_bytes())
    tagged = out / "x86.onnx"
    tagged.write_bytes(digits.onnx_path.read_bytes())
    manifest = build_bundle(
        digits.onnx_path, out / "b.mcpb", name="digits", version="1.0.0",
        variants={"xeon": VariantSource(copy, ("intel-xeon",)),
                  "x86_64": VariantSource(tagged, ("generic-x86_64",)),
                  "rpi": VariantSource(digits.tflite_path, ("raspberry-pi",))},
    )  # fmt: skip
    doc: dict[str, Any] = json.loads(json.dumps(manifest.to_json_dict()))
    return doc


def manifest_with(doc: dict[str, Any], **backends: str) -> BundleManifest:
    doc = json.loads(json.dumps(doc))
    for v in doc["variants"]:
        if v["tag"] in backends:
            v["backend"] = backends[v["tag"]]
    return BundleManifest.model_validate_json(json.dumps(doc))


def present(_: str) -> str | None:
    return None


def profile(name: str, **runtime: Any) -> HardwareProfile:
    base = load_profiles()[name]
    if not runtime:
        return base
    return dataclasses.replace(base, runtime=dataclasses.replace(base.runtime, **runtime))


def tags(manifest: BundleManifest, prof: HardwareProfile, check: Any = present) -> list[str]:
    return [v.tag for v in variant_candidates(manifest, prof, check)]


def test_the_variant_naming_the_profile_comes_first_then_tags_then_default(
    manifest_doc: dict[str, Any],
) -> None:
    m = manifest_with(manifest_doc)
    # intel-xeon lists tags intel-xeon, x86_64, default: the xeon variant names the profile,
    # x86_64 is one of its tags, default last
    assert tags(m, profile("intel-xeon")) == ["xeon", "x86_64", "default"]
    assert tags(m, profile("generic-x86_64")) == ["x86_64", "default"]
    # a profile no variant names and whose tags the bundle lacks gets the default only
    assert tags(m, profile("jetson-orin")) == ["default"]


def test_only_formats_the_profile_runs_are_candidates(manifest_doc: dict[str, Any]) -> None:
    m = manifest_with(manifest_doc)
    assert tags(m, profile("raspberry-pi")) == ["rpi", "default"]
    onnx_only = profile("raspberry-pi", formats=["onnx"])
    ranking = rank_variants(m, onnx_only, present)
    assert [v.tag for v in ranking.candidates] == ["default"]
    assert ranking.skipped[0][0] == "rpi" and "format tflite" in ranking.skipped[0][1]


def test_a_variant_for_a_backend_the_device_lacks_is_skipped_with_its_reason(
    manifest_doc: dict[str, Any],
) -> None:
    m = manifest_with(manifest_doc, xeon="tensorrt")
    asked: list[str] = []

    def check(name: str) -> str | None:
        asked.append(name)
        return "no TensorrtExecutionProvider here" if name == "tensorrt" else None

    ranking = rank_variants(m, profile("intel-xeon"), check)
    assert [v.tag for v in ranking.candidates] == ["x86_64", "default"]
    assert ranking.skipped == (
        ("xeon", "it needs backend tensorrt: no TensorrtExecutionProvider here"),
    )
    assert "variant xeon skipped: it needs backend tensorrt" in ranking.describe_skipped()
    assert asked == ["tensorrt"]
    # with the backend present the variant is first again
    m2 = manifest_with(manifest_doc, xeon="onnxruntime")
    assert tags(m2, profile("intel-xeon")) == ["xeon", "x86_64", "default"]


def test_manifest_fixture_is_what_the_tests_assume(manifest_doc: dict[str, Any]) -> None:
    assert {v["tag"] for v in manifest_doc["variants"]} == {"default", "xeon", "x86_64", "rpi"}
    assert Path(manifest_doc["variants"][0]["file"]).suffix in (".onnx", ".tflite")


def test_the_parts_a_bundle_target_names_are_checked_before_use() -> None:
    from tuf.api.metadata import TargetFile

    from mcp_edge.agent.update.machine import Cause, UpdateError
    from mcp_edge.agent.update.steps import parts_of

    def target(custom: dict[str, Any]) -> TargetFile:
        info = TargetFile(10, {"sha256": "0" * 64}, "digits/1.0.0/digits-1.0.0.mcpb")
        info.unrecognized_fields["custom"] = custom
        return info

    assert parts_of(target({"model": "digits"})) is None  # published before parts existed
    good = {"manifest": "digits/1.0.0/manifest.json", "signature": "digits/1.0.0/manifest.sig",
            "files": {"models/model.onnx": "digits/1.0.0/models/model.onnx"}}  # fmt: skip
    parts = parts_of(target({"parts": good}))
    assert parts is not None and parts.files == {
        "models/model.onnx": "digits/1.0.0/models/model.onnx"
    }
    for bad in ({**good, "files": ["x"]}, {**good, "manifest": 3},
                {**good, "files": {"m": "../../etc/passwd"}}, "parts"):  # fmt: skip
        with pytest.raises(UpdateError) as e:
            parts_of(target({"parts": bad}))
        assert e.value.cause is Cause.TUF_METADATA
