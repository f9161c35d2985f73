"""The mcp-bundle command line, through click's runner and once as a real process."""

from __future__ import annotations

import json
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner, Result

from mcp_edge.shared.bundle import verify_bundle
from mcp_edge.shared.bundle_cli import cli
from mcp_edge.shared.signing import read_public_key
from mcp_edge.tooling.models import DigitsModels

MODEL = "models/model.onnx"


def run(*args: str | Path) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def flip_member_byte(bundle: Path, member: str, out: Path) -> Path:
    """Copy ``bundle`` to ``out`` with one byte of ``member``'s data changed."""
    data = bytearray(bundle.read_bytes())
    header = data.find(member.encode() + b"\x00")
    assert header >= 0 and header % 512 == 0
    data[header + 512 + 40] ^= 0x01
    out.write_bytes(bytes(data))
    return out


@pytest.fixture
def keys(tmp_path: Path) -> tuple[Path, Path]:
    key = tmp_path / "publisher.key"
    result = run("keygen", "--out", key)
    assert result.exit_code == 0, result.output
    return key, tmp_path / "publisher.pub"


def test_keygen_writes_a_private_key_0600_and_its_public_half(
    tmp_path: Path, keys: tuple[Path, Path]
) -> None:
    key, pub = keys
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert read_public_key(pub).keyid == read_public_key(key).keyid
    again = run("keygen", "--out", key)
    assert again.exit_code == 1
    assert "already exists" in again.stderr


def test_build_sign_verify_inspect(
    tmp_path: Path,
    digits: DigitsModels,
    keys: tuple[Path, Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    key, pub = keys
    monkeypatch.chdir(tmp_path)
    (tmp_path / "labels.txt").write_text("".join(f"{i}\n" for i in range(10)))
    np.save(tmp_path / "samples.npy", digits.X_test[:100])

    built = run(
        "build",
        digits.onnx_path,
        "--name",
        "digits",
        "--version",
        "1.3.0",
        "--labels",
        "labels.txt",
        "--baseline",
        "samples.npy",
        "--variant",
        f"rpi={digits.tflite_path}:raspberry-pi,generic-arm64",
        "--preprocess",
        "image:layout=flat,size=8x8,scale=1/16,grayscale=true",
        "--constraint",
        "min_memory_mb=64",
        "--constraint",
        "chip_affinity=cortex-a76",
        "--constraint",
        "min_runtime.onnxruntime=1.17.0",
        "--meta",
        "team=vision",
    )
    assert built.exit_code == 0, built.output
    bundle = tmp_path / "digits-1.3.0.mcpb"  # the default output name
    assert f"wrote {bundle.name}" in built.stdout

    signed = run("sign", bundle, "--key", key)
    assert signed.exit_code == 0, signed.output

    verified = run("verify", bundle, "--trusted-key", pub)
    assert verified.exit_code == 0, verified.output
    assert verified.stdout.startswith(f"OK {bundle}: digits 1.3.0 (onnx), signed by")

    inspected = run("inspect", bundle, "--json")
    assert inspected.exit_code == 0
    info = json.loads(inspected.stdout)
    m = info["manifest"]
    assert info["signature"]["keyid"] == read_public_key(pub).keyid
    assert m["preprocessing"] == {
        "kind": "image",
        "layout": "flat",
        "size": [8, 8],
        "scale": 0.0625,
        "mean": None,
        "std": None,
        "grayscale": True,
    }
    assert m["constraints"]["min_memory_mb"] == 64
    assert m["constraints"]["chip_affinity"] == ["cortex-a76"]
    assert m["constraints"]["min_runtime"]["onnxruntime"] == "1.17.0"
    assert m["metadata_props"]["team"] == "vision"
    assert [v["profiles"] for v in m["variants"]] == [["*"], ["raspberry-pi", "generic-arm64"]]
    assert m["drift_baseline"]["sample_count"] == 100

    table = run("inspect", bundle)
    assert table.exit_code == 0
    assert "digits 1.3.0" in table.stdout and "raspberry-pi,generic-arm64" in table.stdout
    assert "input       input FP32 [-1, 64]" in table.stdout


@pytest.fixture
def signed_bundle(tmp_path: Path, digits: DigitsModels, keys: tuple[Path, Path]) -> Path:
    bundle = tmp_path / "d.mcpb"
    assert (
        run("build", digits.onnx_path, "--name", "d", "--version", "1.0.0", "-o", bundle).exit_code
        == 0
    )
    assert run("sign", bundle, "--key", keys[0]).exit_code == 0
    return bundle


def test_tampered_model_fails_naming_the_file(
    tmp_path: Path, signed_bundle: Path, keys: tuple[Path, Path]
) -> None:
    bad = flip_member_byte(signed_bundle, MODEL, tmp_path / "bad.mcpb")

    result = run("verify", bad, "--trusted-key", keys[1])

    assert result.exit_code == 1
    assert result.stdout == ""
    assert result.stderr.startswith(f"Error: {bad}: {MODEL}: sha256 mismatch")
    assert result.stderr.count("\n") == 1


def test_tampered_manifest_fails_naming_the_manifest(
    tmp_path: Path, signed_bundle: Path, keys: tuple[Path, Path]
) -> None:
    data = signed_bundle.read_bytes().replace(b'"version":"1.0.0"', b'"version":"1.0.1"', 1)
    bad = tmp_path / "bad.mcpb"
    bad.write_bytes(data)

    result = run("verify", bad, "--trusted-key", keys[1])

    assert result.exit_code == 1
    assert "manifest.json: signature in manifest.sig" in result.stderr


def test_signing_refuses_a_tampered_bundle(
    tmp_path: Path, signed_bundle: Path, keys: tuple[Path, Path]
) -> None:
    bad = flip_member_byte(signed_bundle, MODEL, tmp_path / "bad.mcpb")
    before = bad.read_bytes()
    result = run("sign", bad, "--key", keys[0])
    assert result.exit_code == 1
    assert MODEL in result.stderr
    assert bad.read_bytes() == before


def test_untrusted_or_missing_signature(
    tmp_path: Path, digits: DigitsModels, signed_bundle: Path
) -> None:
    other = tmp_path / "other.key"
    run("keygen", "--out", other)
    wrong = run("verify", signed_bundle, "--trusted-key", tmp_path / "other.pub")
    assert wrong.exit_code == 1
    assert "manifest.sig: signed by key" in wrong.stderr

    unsigned = tmp_path / "u.mcpb"
    run("build", digits.onnx_path, "--name", "u", "--version", "1.0.0", "-o", unsigned)
    refused = run("verify", unsigned, "--trusted-key", tmp_path / "other.pub")
    assert refused.exit_code == 1
    assert "manifest.sig: bundle is not signed" in refused.stderr
    allowed = run("verify", unsigned, "--allow-unsigned", "--json")
    assert allowed.exit_code == 0
    assert json.loads(allowed.stdout)["signer"] is None
    no_keys = run("verify", unsigned)
    assert no_keys.exit_code == 2
    assert "no trusted keys" in no_keys.stderr


def test_build_errors_are_one_line_and_exit_1(tmp_path: Path, digits: DigitsModels) -> None:
    bad_name = run(
        "build",
        digits.onnx_path,
        "--name",
        "Bad Name",
        "--version",
        "1.0.0",
        "-o",
        tmp_path / "x.mcpb",
    )
    assert bad_name.exit_code == 1
    assert bad_name.stderr.startswith("Error: invalid bundle name 'Bad Name'")
    bad_constraint = run(
        "build", digits.onnx_path, "--name", "d", "--version", "1.0.0", "--constraint", "cpu=fast"
    )
    assert bad_constraint.exit_code == 2
    assert "unknown constraint 'cpu'" in bad_constraint.stderr
    assert not (tmp_path / "x.mcpb").exists()


def test_help_shows_examples() -> None:
    result = run("build", "--help")
    assert result.exit_code == 0
    assert "mcp-bundle build model.onnx --name digits --version 1.3.0" in result.stdout


def test_installed_console_script(tmp_path: Path, digits: DigitsModels) -> None:
    exe = Path(sys.executable).parent / "mcp-bundle"
    if not exe.exists():
        exe_found = shutil.which("mcp-bundle")
        if exe_found is None:
            pytest.skip("mcp-bundle is not installed (pip install -e .)")
        exe = Path(exe_found)

    def sh(*args: str | Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(exe), *map(str, args)], capture_output=True, text=True, cwd=tmp_path, timeout=120
        )

    assert sh("keygen", "--out", "pub.key").returncode == 0
    built = sh("build", digits.onnx_path, "--name", "digits", "--version", "2.0.0")
    assert built.returncode == 0, built.stderr
    assert sh("sign", "digits-2.0.0.mcpb", "--key", "pub.key").returncode == 0
    ok = sh("verify", "digits-2.0.0.mcpb", "--trusted-key", "pub.pub")
    assert ok.returncode == 0, ok.stderr
    bundle = tmp_path / "digits-2.0.0.mcpb"
    assert (
        verify_bundle(bundle, [read_public_key(tmp_path / "pub.pub")]).manifest.version == "2.0.0"
    )

    flip_member_byte(bundle, MODEL, tmp_path / "bad.mcpb")
    bad = sh("verify", "bad.mcpb", "--trusted-key", "pub.pub")
    assert bad.returncode == 1
    assert (
        bad.stderr.strip().splitlines() == [bad.stderr.strip()]
        and f"bad.mcpb: {MODEL}: sha256 mismatch" in bad.stderr
    )
    inspected = sh("inspect", "digits-2.0.0.mcpb", "--json")
    assert json.loads(inspected.stdout)["manifest"]["version"] == "2.0.0"
