"""Hostile bundles: every way a .mcpb can be tampered with or made unsafe is refused.

Each case starts from a good signed bundle, breaks one thing by writing tar bytes by hand,
and checks that verification fails naming the member at fault, and that opening it leaves
no file anywhere (not in the destination's parent, not at the path a member points to).
"""

from __future__ import annotations

import copy
import hashlib
import json
import tarfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

from mcp_edge.shared.bundle import (
    BundleLimits,
    build_bundle,
    open_bundle,
    sign_bundle,
    verify_bundle,
)
from mcp_edge.shared.errors import BundleError, ModelValidationError
from mcp_edge.shared.signing import PrivateKey, canonical_json, make_signature
from mcp_edge.tooling.models import DigitsModels

MODEL = "models/model.onnx"
ABSOLUTE_TARGET = "/tmp/mcpb-hostile-absolute-escape"

Members = list[tuple[str, bytes]]


@dataclass(frozen=True)
class Good:
    """A valid signed bundle, its members in order, and the manifest as a dict."""

    path: Path
    members: Members
    manifest: dict[str, Any]
    key: PrivateKey


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory, digits: DigitsModels) -> Good:
    root = tmp_path_factory.mktemp("good")
    labels = root / "labels.txt"
    labels.write_text("".join(f"{i}\n" for i in range(10)))
    path = root / "good.mcpb"
    build_bundle(digits.onnx_path, path, name="digits", version="1.0.0", labels_path=labels)
    key = PrivateKey.generate()
    sign_bundle(path, key)
    with tarfile.open(path) as tar:
        members = [(m.name, _read(tar, m)) for m in tar.getmembers()]
    assert [n for n, _ in members] == ["manifest.json", "manifest.sig", "labels.txt", MODEL]
    return Good(path, members, json.loads(members[0][1]), key)


def _read(tar: tarfile.TarFile, member: tarfile.TarInfo) -> bytes:
    f = tar.extractfile(member)
    assert f is not None
    return f.read()


# --- writing tar bytes by hand ------------------------------------------------------------


def entry(
    name: str,
    data: bytes = b"",
    *,
    kind: bytes = tarfile.REGTYPE,
    size: int | None = None,
    linkname: str = "",
    fmt: int = tarfile.USTAR_FORMAT,
) -> bytes:
    """One member: header(s) claiming ``size`` (default: the real size), data, padding."""
    info = tarfile.TarInfo(name)
    info.size = len(data) if size is None else size
    info.type, info.linkname, info.mtime, info.mode = kind, linkname, 0, 0o644
    header = info.tobuf(fmt, "utf-8", "surrogateescape")
    return header + data + bytes(-len(data) % 512)


def tar_bytes(*entries: bytes, end: bool = True) -> bytes:
    return b"".join(entries) + (bytes(1024) if end else b"")


def regular(members: Members) -> list[bytes]:
    return [entry(name, data) for name, data in members]


def signed(doc: dict[str, Any], key: PrivateKey) -> Members:
    """manifest.json and manifest.sig for ``doc`` (canonical bytes, as the builder writes)."""
    sig = canonical_json(make_signature(canonical_json(doc), key)) + b"\n"
    return [("manifest.json", canonical_json(doc) + b"\n"), ("manifest.sig", sig)]


def with_file(good: Good, path: str, data: bytes) -> Members:
    """A re-signed bundle whose ``path`` holds ``data``, hashes updated everywhere."""
    doc = copy.deepcopy(good.manifest)
    digest = hashlib.sha256(data).hexdigest()
    for item in doc["files"] + doc["variants"]:
        if item.get("path", item.get("file")) == path:
            item["sha256"], item["size"] = digest, len(data)
    files = [(n, data if n == path else d) for n, d in good.members[2:]]
    return signed(doc, good.key) + files


def flip(data: bytes, index: int) -> bytes:
    return data[:index] + bytes([data[index] ^ 0x01]) + data[index + 1 :]


def tiny_onnx(input_name: str) -> bytes:
    x = helper.make_tensor_value_info(input_name, TensorProto.FLOAT, [None, 64])
    y = helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, [None, 10])
    w = helper.make_tensor("w", TensorProto.FLOAT, [64, 10], [0.0] * 640)
    graph = helper.make_graph(
        [helper.make_node("MatMul", [input_name, "w"], ["probabilities"])], "g", [x], [y], [w]
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


# --- the cases ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    id: str
    make: Callable[[Good], bytes]
    member: str | None
    fragment: str
    limits: BundleLimits = field(default_factory=BundleLimits)
    model_error: bool = False


def _replace(good: Good, name: str, data: bytes) -> bytes:
    return tar_bytes(*regular([(n, data if n == name else d) for n, d in good.members]))


def _insert(good: Good, *extra: bytes, at: int = 4) -> bytes:
    parts = regular(good.members)
    return tar_bytes(*parts[:at], *extra, *parts[at:])


def _manifest_text(good: Good) -> bytes:
    return dict(good.members)["manifest.json"]


def _other_manifest_signature(good: Good) -> bytes:
    other = copy.deepcopy(good.manifest)
    other["version"] = "2.0.0"
    sig = signed(other, good.key)[1]
    return tar_bytes(*regular([good.members[0], sig, *good.members[2:]]))


def _lying_manifest_header(good: Good) -> bytes:
    # Claims 5 MiB but carries the real bytes: the cap must refuse before any read.
    return tar_bytes(entry("manifest.json", _manifest_text(good), size=5 << 20))


def _lying_member_header(good: Good) -> bytes:
    parts = regular(good.members[:3])
    model = dict(good.members)[MODEL]
    return tar_bytes(*parts, entry(MODEL, model + b"\0" * 512, size=len(model) + 512))


def _bad_checksum(good: Good) -> bytes:
    parts = regular(good.members)
    header = bytearray(parts[2])
    header[148:156] = b"0000000\x00"
    parts[2] = bytes(header)
    return tar_bytes(*parts)


def _big_signature(good: Good) -> bytes:
    sig = b" " * 5000 + dict(good.members)["manifest.sig"]
    return tar_bytes(*regular([good.members[0], ("manifest.sig", sig), *good.members[2:]]))


def _corrupt_model(good: Good) -> bytes:
    return tar_bytes(*regular(with_file(good, MODEL, b"\x08\x07not an onnx model at all" * 20)))


def _model_io_differs(good: Good) -> bytes:
    return tar_bytes(*regular(with_file(good, MODEL, tiny_onnx("pixels"))))


def _two_defaults(good: Good) -> bytes:
    doc = copy.deepcopy(good.manifest)
    doc["variants"].append({**doc["variants"][0]})
    return tar_bytes(*regular(signed(doc, good.key) + good.members[2:]))


def _labels_count_wrong(good: Good) -> bytes:
    return tar_bytes(
        *regular(with_file(good, "labels.txt", b"".join(b"%d\n" % i for i in range(9))))
    )


def _file_under_a_file(good: Good) -> bytes:
    doc = copy.deepcopy(good.manifest)
    data = b"x"
    doc["files"].append(
        {"path": "labels.txt/x", "sha256": hashlib.sha256(data).hexdigest(), "size": 1}
    )
    members = [*signed(doc, good.key), *good.members[2:], ("labels.txt/x", data)]
    return tar_bytes(*regular(members))


CASES = [
    Case(
        "model-byte-flipped",
        lambda g: _replace(g, MODEL, flip(dict(g.members)[MODEL], 100)),
        MODEL,
        "sha256 mismatch",
    ),
    Case(
        "labels-reordered",
        lambda g: _replace(g, "labels.txt", b"".join(b"%d\n" % (9 - i) for i in range(10))),
        "labels.txt",
        "sha256 mismatch",
    ),
    Case(
        "labels-shortened",
        lambda g: _replace(g, "labels.txt", b"a\nb\n"),
        "labels.txt",
        "header says 4 bytes but the manifest lists 20",
    ),
    Case(
        "manifest-value-changed",
        lambda g: _replace(
            g,
            "manifest.json",
            _manifest_text(g).replace(b'"version":"1.0.0"', b'"version":"9.0.0"'),
        ),
        "manifest.json",
        "does not match the manifest",
    ),
    Case(
        "manifest-reformatted",
        lambda g: _replace(g, "manifest.json", json.dumps(g.manifest, indent=1).encode()),
        "manifest.json",
        "canonical form",
    ),
    Case(
        "manifest-duplicate-key",
        lambda g: _replace(g, "manifest.json", b'{"name":"a","name":"b"}\n'),
        "manifest.json",
        "duplicate key",
    ),
    Case("manifest-schema-broken", _two_defaults, "manifest.json", "invalid manifest"),
    Case(
        "unsigned",
        lambda g: tar_bytes(*regular([g.members[0], *g.members[2:]])),
        "manifest.sig",
        "not signed",
    ),
    Case(
        "unknown-signer",
        lambda g: tar_bytes(*regular(signed(g.manifest, PrivateKey.generate()) + g.members[2:])),
        "manifest.sig",
        "not among the trusted keys",
    ),
    Case(
        "signature-of-another-manifest",
        _other_manifest_signature,
        "manifest.json",
        "does not match the manifest",
    ),
    Case(
        "malformed-signature",
        lambda g: _replace(g, "manifest.sig", b'{"keyid": "zz", "sig": "00"}'),
        "manifest.sig",
        "malformed signature",
    ),
    Case(
        "dotdot", lambda g: _insert(g, entry("../escape", b"pwned")), "../escape", "path traversal"
    ),
    Case(
        "dotdot-inside",
        lambda g: _insert(g, entry("models/../../escape", b"pwned")),
        "models/../../escape",
        "path traversal",
    ),
    Case(
        "absolute",
        lambda g: _insert(g, entry(ABSOLUTE_TARGET, b"pwned")),
        ABSOLUTE_TARGET,
        "absolute member path",
    ),
    Case(
        "dot-slash", lambda g: _insert(g, entry("./escape", b"pwned")), "./escape", "'.' component"
    ),
    Case(
        "double-slash",
        lambda g: _insert(g, entry("models//escape", b"x")),
        "models//escape",
        "empty or '.' component",
    ),
    Case(
        "backslash", lambda g: _insert(g, entry("..\\escape", b"pwned")), "..\\escape", "backslash"
    ),
    Case(
        "hidden-file",
        lambda g: _insert(g, entry(".escape", b"x")),
        ".escape",
        "is not [A-Za-z0-9._-]",
    ),
    Case(
        "symlink",
        lambda g: _insert(g, entry("escape", kind=tarfile.SYMTYPE, linkname="/etc/passwd")),
        "escape",
        "symbolic link members are not allowed",
    ),
    Case(
        "symlink-over-listed-file",
        lambda g: tar_bytes(
            *regular(g.members[:3]), entry(MODEL, kind=tarfile.SYMTYPE, linkname="/etc/passwd")
        ),
        MODEL,
        "symbolic link members are not allowed",
    ),
    Case(
        "hard-link",
        lambda g: _insert(g, entry("escape", kind=tarfile.LNKTYPE, linkname="labels.txt")),
        "escape",
        "hard link members are not allowed",
    ),
    Case(
        "char-device",
        lambda g: _insert(g, entry("escape", kind=tarfile.CHRTYPE)),
        "escape",
        "character device members are not allowed",
    ),
    Case(
        "block-device",
        lambda g: _insert(g, entry("escape", kind=tarfile.BLKTYPE)),
        "escape",
        "block device members are not allowed",
    ),
    Case(
        "fifo",
        lambda g: _insert(g, entry("escape", kind=tarfile.FIFOTYPE)),
        "escape",
        "FIFO members are not allowed",
    ),
    Case(
        "directory",
        lambda g: _insert(g, entry("models/", kind=tarfile.DIRTYPE), at=3),
        "models/",
        "directory members are not allowed",
    ),
    Case(
        "contiguous",
        lambda g: _insert(g, entry("escape", b"x", kind=tarfile.CONTTYPE)),
        "escape",
        "contiguous file members are not allowed",
    ),
    Case(
        "unknown-type",
        lambda g: _insert(g, entry("escape", b"x", kind=b"Z")),
        "escape",
        "unknown member type",
    ),
    Case(
        "pax-header",
        lambda g: _insert(g, entry("modèle", b"x", fmt=tarfile.PAX_FORMAT)),
        "././@PaxHeader",
        "pax extended header members are not allowed",
    ),
    Case(
        "gnu-format",
        lambda g: _insert(g, entry("escape", b"x", fmt=tarfile.GNU_FORMAT)),
        "escape",
        "not a POSIX ustar header",
    ),
    Case("non-ascii-name", lambda g: _insert(g, entry("modèle", b"x")), "modèle", "not ASCII"),
    Case(
        "duplicate",
        lambda g: _insert(g, entry(MODEL, dict(g.members)[MODEL])),
        MODEL,
        "duplicate member",
    ),
    Case(
        "duplicate-by-case",
        lambda g: _insert(g, entry("LABELS.txt", b"0\n")),
        "LABELS.txt",
        "duplicate member",
    ),
    Case(
        "duplicate-manifest",
        lambda g: _insert(g, entry("manifest.json", _manifest_text(g))),
        "manifest.json",
        "duplicate member",
    ),
    Case(
        "signature-not-at-start",
        lambda g: tar_bytes(*regular([g.members[0], *g.members[2:], g.members[1]])),
        "manifest.sig",
        "not signed",
    ),
    Case(
        "manifest-not-first",
        lambda g: tar_bytes(*regular([g.members[2], g.members[0], g.members[1], g.members[3]])),
        "labels.txt",
        "first member must be manifest.json",
    ),
    Case(
        "unlisted-file",
        lambda g: _insert(g, entry("extra.txt", b"surprise")),
        "extra.txt",
        "not listed in the manifest",
    ),
    Case(
        "listed-file-missing",
        lambda g: tar_bytes(*regular(g.members[:2] + g.members[3:])),
        "labels.txt",
        "missing from the bundle",
    ),
    Case(
        "manifest-over-cap",
        lambda g: g.path.read_bytes(),
        "manifest.json",
        "over the cap",
        BundleLimits(max_manifest_bytes=256),
    ),
    Case("manifest-header-lies", _lying_manifest_header, "manifest.json", "over the cap"),
    Case("signature-over-cap", _big_signature, "manifest.sig", "over the cap"),
    Case(
        "member-over-cap",
        lambda g: g.path.read_bytes(),
        MODEL,
        "over the member cap",
        BundleLimits(max_member_bytes=1024),
    ),
    Case("member-header-lies", _lying_member_header, MODEL, "header says"),
    Case(
        "too-many-members",
        lambda g: g.path.read_bytes(),
        "manifest.json",
        "at most 1 are",
        BundleLimits(max_members=3),
    ),
    Case(
        "bundle-over-cap",
        lambda g: g.path.read_bytes(),
        None,
        "over the bundle cap",
        BundleLimits(max_bundle_bytes=4096),
    ),
    Case(
        "truncated-in-manifest", lambda g: g.path.read_bytes()[:700], "manifest.json", "truncated"
    ),
    Case(
        "truncated-in-model",
        lambda g: tar_bytes(*regular(g.members))[: -1024 - 3000],
        MODEL,
        "truncated",
    ),
    Case(
        "truncated-before-end-marker",
        lambda g: tar_bytes(*regular(g.members), end=False),
        None,
        "truncated",
    ),
    Case("empty-file", lambda g: b"", None, "truncated"),
    Case("bad-header-checksum", _bad_checksum, "labels.txt", "bad checksum"),
    Case(
        "data-after-end",
        lambda g: tar_bytes(*regular(g.members)) + b"trailing junk",
        None,
        "data after the end-of-archive marker",
    ),
    Case("corrupt-model", _corrupt_model, MODEL, "ONNX", model_error=True),
    Case("model-io-differs", _model_io_differs, MODEL, "differ from those the manifest records"),
    Case("labels-count-wrong", _labels_count_wrong, "labels.txt", "holds 9 labels"),
    Case(
        "labels-not-utf8",
        lambda g: tar_bytes(*regular(with_file(g, "labels.txt", b"\xff\xfe\n" * 10))),
        "labels.txt",
        "labels file unusable",
    ),
    Case("file-under-a-file", _file_under_a_file, "manifest.json", "as a directory"),
]


def _snapshot(root: Path) -> set[Path]:
    return set(root.rglob("*"))


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_verify_refuses_and_names_the_member(tmp_path: Path, good: Good, case: Case) -> None:
    bundle = tmp_path / "hostile.mcpb"
    bundle.write_bytes(case.make(good))
    work = tmp_path / "work"
    work.mkdir()

    with pytest.raises(BundleError) as info:
        verify_bundle(bundle, [good.key.public_key], limits=case.limits, work_dir=work)

    assert info.value.member == case.member, str(info.value)
    assert case.fragment in str(info.value)
    assert "\n" not in str(info.value)
    assert isinstance(info.value, ModelValidationError) == case.model_error
    assert list(work.iterdir()) == []  # the private unpack directory is gone


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_open_refuses_and_writes_nothing(tmp_path: Path, good: Good, case: Case) -> None:
    assert not Path(ABSOLUTE_TARGET).exists()
    bundle = tmp_path / "in" / "hostile.mcpb"
    bundle.parent.mkdir()
    bundle.write_bytes(case.make(good))
    models = tmp_path / "a" / "b" / "models"
    models.mkdir(parents=True)
    before = _snapshot(tmp_path)

    with pytest.raises(BundleError) as info:
        open_bundle(bundle, models / "digits", [good.key.public_key], limits=case.limits)

    assert info.value.member == case.member
    assert _snapshot(tmp_path) == before  # no staging dir left, nothing escaped upwards
    assert not Path(ABSOLUTE_TARGET).exists()


def test_the_good_bundle_passes(tmp_path: Path, good: Good) -> None:
    # The hand-written tar of the good members is accepted: failures above are the cases'.
    bundle = tmp_path / "rewritten.mcpb"
    bundle.write_bytes(tar_bytes(*regular(good.members)))
    assert verify_bundle(bundle, [good.key.public_key]).signer_keyid == good.key.keyid
    assert onnx.load_from_string(dict(good.members)[MODEL]).graph.input[0].name == "input"


def test_verify_requires_trusted_keys_when_a_signature_is_required(good: Good) -> None:
    with pytest.raises(ValueError, match="no trusted keys"):
        verify_bundle(good.path, [])


def test_unsigned_is_accepted_only_when_allowed(tmp_path: Path, good: Good) -> None:
    bundle = tmp_path / "unsigned.mcpb"
    bundle.write_bytes(tar_bytes(*regular([good.members[0], *good.members[2:]])))
    result = verify_bundle(bundle, [], require_signature=False)
    assert (result.signer_keyid, result.claimed_keyid) == (None, None)
    # a present signature is still checked when keys are given, even if not required
    with pytest.raises(BundleError) as info:
        verify_bundle(good.path, [PrivateKey.generate().public_key], require_signature=False)
    assert info.value.member == "manifest.sig"
    # nor can a signature hide after the files, even when signatures are optional
    late = tmp_path / "late-signature.mcpb"
    late.write_bytes(tar_bytes(*regular([good.members[0], *good.members[2:], good.members[1]])))
    with pytest.raises(BundleError, match="may appear only at the start") as info:
        verify_bundle(late, [], require_signature=False)
    assert info.value.member == "manifest.sig"


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_flipping_any_manifest_or_model_byte_is_caught(good: Good, data: st.DataObject) -> None:
    target = data.draw(st.sampled_from(["manifest.json", MODEL]), label="member")
    content = dict(good.members)[target]
    index = data.draw(st.integers(0, len(content) - 1), label="index")
    bit = data.draw(st.integers(0, 7), label="bit")
    changed = content[:index] + bytes([content[index] ^ (1 << bit)]) + content[index + 1 :]
    bundle = good.path.with_name("flipped.mcpb")
    bundle.write_bytes(_replace(good, target, changed))

    with pytest.raises(BundleError) as info:
        verify_bundle(bundle, [good.key.public_key], validate_models=False)

    assert info.value.member == target
