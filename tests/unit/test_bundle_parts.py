"""A bundle's manifest and signature checked as separate files (shared.bundle.parts), the way a
device reads them when it fetches a bundle's parts instead of the whole bundle: real signed
bundles of the digits model, real Ed25519 keys."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest

from mcp_edge.shared.bundle import BundleLimits, build_bundle, sign_bundle
from mcp_edge.shared.bundle.parts import check_member_file, verify_manifest_parts
from mcp_edge.shared.errors import BundleError
from mcp_edge.shared.signing import PrivateKey, canonical_json, make_signature
from mcp_edge.tooling.models import DigitsModels


@pytest.fixture(scope="module")
def signed(tmp_path_factory: pytest.TempPathFactory, digits: DigitsModels) -> tuple[
    dict[str, bytes], PrivateKey
]:  # fmt: skip
    """The members of a signed digits bundle by name, and the key that signed it."""
    key = PrivateKey.generate()
    out = tmp_path_factory.mktemp("parts") / "digits-1.0.0.mcpb"
    build_bundle(digits.onnx_path, out, name="digits", version="1.0.0")
    sign_bundle(out, key, validate_models=False)
    with tarfile.open(out) as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}  # type: ignore[union-attr]
    return members, key


def test_a_signed_manifest_is_accepted_and_names_its_signer(
    signed: tuple[dict[str, bytes], PrivateKey],
) -> None:
    members, key = signed
    manifest, signer = verify_manifest_parts(
        members["manifest.json"], members["manifest.sig"], [key.public_key]
    )
    assert (manifest.name, manifest.version, signer) == ("digits", "1.0.0", key.keyid)
    assert [v.tag for v in manifest.variants] == ["default"]


def test_a_signature_by_another_key_or_over_other_bytes_is_refused(
    signed: tuple[dict[str, bytes], PrivateKey],
) -> None:
    members, key = signed
    stranger = PrivateKey.generate()
    with pytest.raises(BundleError, match="not among the trusted keys") as e:
        verify_manifest_parts(members["manifest.json"], members["manifest.sig"],
                              [stranger.public_key])  # fmt: skip
    assert e.value.member == "manifest.sig"

    # a manifest edited after signing (still canonical), with the original signature
    doc = json.loads(members["manifest.json"])
    doc["metadata_props"] = {"edited": "yes"}
    edited = canonical_json(doc) + b"\n"
    with pytest.raises(BundleError, match="does not match the manifest") as e:
        verify_manifest_parts(edited, members["manifest.sig"], [key.public_key])
    assert e.value.member == "manifest.json"

    with pytest.raises(BundleError, match="not valid JSON"):
        verify_manifest_parts(members["manifest.json"], b"\x00garbage", [key.public_key])
    with pytest.raises(ValueError, match="no trusted keys"):
        verify_manifest_parts(members["manifest.json"], members["manifest.sig"], [])


def test_a_manifest_not_in_canonical_form_is_refused_even_when_signed(
    signed: tuple[dict[str, bytes], PrivateKey],
) -> None:
    members, key = signed
    doc = json.loads(members["manifest.json"])
    pretty = json.dumps(doc, indent=2, sort_keys=True).encode()
    signature = canonical_json(make_signature(canonical_json(doc), key)) + b"\n"
    with pytest.raises(BundleError, match="canonical form") as e:
        verify_manifest_parts(pretty, signature, [key.public_key])
    assert e.value.member == "manifest.json"
    duplicated = members["manifest.json"][:-2] + b',"name":"other"}\n'
    with pytest.raises(BundleError, match="duplicate key"):
        verify_manifest_parts(duplicated, signature, [key.public_key])


def test_oversized_parts_are_refused_before_parsing(
    signed: tuple[dict[str, bytes], PrivateKey],
) -> None:
    members, key = signed
    small = BundleLimits(max_manifest_bytes=len(members["manifest.json"]) - 1)
    with pytest.raises(BundleError, match="over the cap") as e:
        verify_manifest_parts(members["manifest.json"], members["manifest.sig"],
                              [key.public_key], small)  # fmt: skip
    assert e.value.member == "manifest.json"
    tiny = BundleLimits(max_signature_bytes=16)
    with pytest.raises(BundleError, match="over the cap") as e:
        verify_manifest_parts(members["manifest.json"], members["manifest.sig"],
                              [key.public_key], tiny)  # fmt: skip
    assert e.value.member == "manifest.sig"
    few = BundleLimits(max_member_bytes=100)
    with pytest.raises(BundleError, match="over the member cap"):
        verify_manifest_parts(members["manifest.json"], members["manifest.sig"],
                              [key.public_key], few)  # fmt: skip


def test_member_files_are_checked_against_the_manifest(
    signed: tuple[dict[str, bytes], PrivateKey], tmp_path: Path
) -> None:
    members, key = signed
    manifest, _ = verify_manifest_parts(members["manifest.json"], members["manifest.sig"],
                                        [key.public_key])  # fmt: skip
    member = manifest.default_variant.file
    good = tmp_path / "good.onnx"
    good.write_bytes(members[member])
    check_member_file(manifest, member, good)

    flipped = bytearray(members[member])
    flipped[len(flipped) // 2] ^= 0xFF
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(bytes(flipped))
    with pytest.raises(BundleError, match="sha256 mismatch") as e:
        check_member_file(manifest, member, bad)
    assert e.value.member == member
    short = tmp_path / "short.onnx"
    short.write_bytes(members[member][:-1])
    with pytest.raises(BundleError, match="the manifest lists"):
        check_member_file(manifest, member, short)
    with pytest.raises(BundleError, match="not listed"):
        check_member_file(manifest, "models/other.onnx", good)
