"""Hardware detection and ``mcp-agent doctor`` on fake roots, one per shipped profile."""

from __future__ import annotations

import json
import os
import random
import tempfile
from pathlib import Path

import onnxruntime
import pytest
from click.testing import CliRunner, Result
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mcp_edge.agent.cli import main as agent_main
from mcp_edge.agent.hardware import (
    MAX_FLAGS,
    MAX_TEXT_CHARS,
    READ_CAP_BYTES,
    HostFacts,
    NoProfileError,
    UnknownProfileError,
    collect_facts,
    select_profile,
)
from mcp_edge.shared.profiles import HardwareProfile, load_profiles

PACKAGES = {"onnxruntime": "1.20.0"}
Profiles = dict[str, HardwareProfile]

ORIN_RELEASE = (
    "# R36 (release), REVISION: 3.0, GCID: 36191598, BOARD: generic, EABI: aarch64, "
    "DATE: Mon May  6 17:34:21 UTC 2024\n# KERNEL_VARIANT: oot\n"
    "TARGET_USERSPACE_LIB_DIR=nvidia\n"
)
XAVIER_ERA_RELEASE = (
    "# R35 (release), REVISION: 4.1, GCID: 33958178, BOARD: t186ref, EABI: aarch64, "
    "DATE: Tue Aug  1 19:57:35 UTC 2023\n"
)
ARM_FEATURES = "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimddp"


@pytest.fixture(autouse=True)
def _detect(monkeypatch: pytest.MonkeyPatch) -> None:
    """The doctor CLI detects the profile here (tests/conftest.py names one for agents)."""
    monkeypatch.delenv("MCP_PROFILE", raising=False)


def arm_cpuinfo(part: str, cores: int, extra: str = "") -> str:
    block = (
        "processor\t: {n}\nBogoMIPS\t: 62.50\nFeatures\t: " + ARM_FEATURES + "\n"
        "CPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: 0x1\n"
        f"CPU part\t: {part}\nCPU revision\t: 1\n\n"
    )
    return "".join(block.format(n=n) for n in range(cores)) + extra


def x86_cpuinfo(model: str, flags: str, cores: int) -> str:
    block = (
        "processor\t: {n}\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 106\n"
        f"model name\t: {model}\nflags\t\t: {flags}\n\n"
    )
    return "".join(block.format(n=n) for n in range(cores))


XEON_FLAGS = "fpu vme sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma avx512f avx512dq avx512_vnni"


def fake_root(base: Path, files: dict[str, str | bytes]) -> Path:
    """A directory tree standing in for ``/``: ``{"/proc/cpuinfo": text, ...}``."""
    for name, content in files.items():
        path = base / name.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
    return base


def meminfo(mib: int) -> str:
    return f"MemTotal:       {mib * 1024} kB\nMemFree:        1024 kB\n"


@pytest.fixture(scope="module")
def profiles() -> Profiles:
    return load_profiles()


def orin_root(base: Path, release: str = ORIN_RELEASE) -> Path:
    return fake_root(
        base,
        {
            "/etc/nv_tegra_release": release,
            "/proc/device-tree/model": b"NVIDIA Jetson AGX Orin Developer Kit\x00",
            "/proc/cpuinfo": arm_cpuinfo("0xd42", 12),
            "/proc/meminfo": meminfo(62_000),
            "/dev/nvhost-ctrl-gpu": "",
        },
    )


def detect(root: Path, system: str = "Linux", machine: str = "aarch64") -> HostFacts:
    return collect_facts(root, system=system, machine=machine, packages=PACKAGES)


# ------------------------------------------------------------------------------ one per profile


def test_jetson_orin_on_jetpack_6(tmp_path: Path, profiles: Profiles) -> None:
    facts = detect(orin_root(tmp_path))
    assert facts.device_tree_model == "NVIDIA Jetson AGX Orin Developer Kit"
    assert (facts.l4t_release, facts.l4t_revision, facts.jetpack) == (36, "3.0", "6.x")
    assert facts.cpu_model == "ARM Cortex-A78AE"
    assert facts.cpu_count == 12 and facts.mem_total_mb == 62_000
    assert "asimd" in facts.cpu_flags
    assert any("Tegra" in hint for hint in facts.gpu_hints)
    choice = select_profile(facts, profiles)
    assert choice.profile.name == "jetson-orin" and not choice.overridden
    assert "L4T R36 (JetPack 6.x) meets R36+" in choice.reasons
    dt = "device-tree model 'NVIDIA Jetson AGX Orin Developer Kit' contains 'Orin'"
    assert dt in choice.reasons
    assert choice.rejected["generic-arm64"] == "matches, but jetson-orin has higher priority"


def test_jetpack_5_is_refused_for_generic_arm64(tmp_path: Path, profiles: Profiles) -> None:
    facts = detect(orin_root(tmp_path, XAVIER_ERA_RELEASE))
    assert (facts.l4t_release, facts.jetpack) == (35, "5.x")
    choice = select_profile(facts, profiles)
    refusal = "JetPack 5 / L4T R35 is not supported; Jetson Orin needs JetPack 6.0+ (L4T R36)"
    assert choice.profile.name == "generic-arm64"
    assert choice.reasons[0] == f"refused jetson-orin: {refusal}"
    assert choice.rejected["jetson-orin"] == refusal


def test_jetson_with_unreadable_release_file_is_refused(tmp_path: Path, profiles: Profiles) -> None:
    facts = detect(orin_root(tmp_path, "\x00\xff not a release line"))
    assert facts.l4t_release is None and "/etc/nv_tegra_release" in facts.files_present
    choice = select_profile(facts, profiles)
    assert choice.profile.name == "generic-arm64"
    assert choice.reasons[0].startswith("refused jetson-orin: L4T release unknown; Jetson Orin")


def test_apple_silicon_without_proc(tmp_path: Path, profiles: Profiles) -> None:
    facts = detect(tmp_path, system="Darwin", machine="arm64")
    assert facts.cpu_model is None and facts.cpu_count is None and facts.mem_total_mb is None
    choice = select_profile(facts, profiles)
    assert choice.profile.name == "apple-silicon"
    assert choice.reasons[1:] == ["os Darwin matches Darwin", "arch arm64 matches arm64"]


def test_intel_mac_fits_no_profile(tmp_path: Path, profiles: Profiles) -> None:
    with pytest.raises(NoProfileError) as info:
        select_profile(detect(tmp_path, system="Darwin", machine="x86_64"), profiles)
    assert info.value.rejected["generic-x86_64"] == "os Darwin is not Linux"


def test_xeon_is_detected_and_avx512_is_noted(tmp_path: Path, profiles: Profiles) -> None:
    root = fake_root(
        tmp_path,
        {
            "/proc/cpuinfo": x86_cpuinfo(
                "Intel(R) Xeon(R) Platinum 8380 CPU @ 2.30GHz", XEON_FLAGS, 4
            ),
            "/proc/meminfo": meminfo(256_000),
            "/dev/nvidia0": "",
            "/proc/driver/nvidia/version": "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15\n",
        },
    )
    facts = detect(root, machine="x86_64")
    assert facts.gpu_hints == (
        "/dev/nvidia0 (NVIDIA GPU device node)",
        "NVIDIA driver: NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15",
    )
    assert facts.cpu_model == "Intel(R) Xeon(R) Platinum 8380 CPU @ 2.30GHz"
    assert {"avx512f", "avx512_vnni"} <= facts.cpu_flags and facts.cpu_count == 4
    choice = select_profile(facts, profiles)
    assert choice.profile.name == "intel-xeon"
    assert "cpu flag avx512f present (noted, does not decide)" in choice.reasons
    assert "cpu flag amx_tile absent (noted, does not decide)" in choice.reasons
    assert choice.rejected["generic-x86_64"] == "matches, but intel-xeon has higher priority"


def test_amd_epyc_is_generic_x86_64(tmp_path: Path, profiles: Profiles) -> None:
    root = fake_root(
        tmp_path,
        {"/proc/cpuinfo": x86_cpuinfo("AMD EPYC 7763 64-Core Processor", "fpu sse2 avx avx2", 2)},
    )
    choice = select_profile(detect(root, machine="x86_64"), profiles)
    assert choice.profile.name == "generic-x86_64"
    assert choice.rejected["intel-xeon"] == (
        "cpu model 'AMD EPYC 7763 64-Core Processor' does not contain 'Xeon'"
    )


def test_plain_arm64_server_is_generic_arm64(tmp_path: Path, profiles: Profiles) -> None:
    root = fake_root(tmp_path, {"/proc/cpuinfo": arm_cpuinfo("0xd0c", 2)})
    facts = detect(root)
    assert facts.cpu_model == "ARM Neoverse-N1" and facts.device_tree_model is None
    choice = select_profile(facts, profiles)
    assert choice.profile.name == "generic-arm64"
    assert choice.rejected["raspberry-pi"] == "no device-tree model (needs 'Raspberry Pi')"
    # No refusal: jetson-orin does not fit in more ways than its L4T gate.
    assert not any(r.startswith("refused") for r in choice.reasons)


def test_raspberry_pi_via_device_tree(tmp_path: Path, profiles: Profiles) -> None:
    root = fake_root(
        tmp_path,
        {
            "/proc/device-tree/model": b"Raspberry Pi 4 Model B Rev 1.4\x00",
            "/proc/cpuinfo": arm_cpuinfo(
                "0xd08", 4, "Hardware\t: BCM2835\nModel\t\t: Raspberry Pi 4 Model B Rev 1.4\n"
            ),
        },
    )
    facts = detect(root)
    assert facts.device_tree_model == "Raspberry Pi 4 Model B Rev 1.4"
    assert facts.cpu_model == "ARM Cortex-A72"
    choice = select_profile(facts, profiles)
    assert choice.profile.name == "raspberry-pi"
    assert choice.profile.runtime.backends[0].name == "tflite"
    assert choice.rejected["jetson-orin"].startswith("file /etc/nv_tegra_release missing")


# ------------------------------------------------------------------------------------ overrides


def test_override_to_a_matching_profile(tmp_path: Path, profiles: Profiles) -> None:
    choice = select_profile(detect(orin_root(tmp_path)), profiles, override="generic-arm64")
    assert choice.profile.name == "generic-arm64" and choice.overridden
    assert choice.detected == "jetson-orin"
    assert choice.reasons[0] == "generic-arm64: chosen by --profile; its rules all match this box"
    assert choice.rejected["jetson-orin"] == "matches, but --profile generic-arm64 was given"


def test_override_that_does_not_match_says_so(tmp_path: Path, profiles: Profiles) -> None:
    facts = detect(orin_root(tmp_path, XAVIER_ERA_RELEASE))
    choice = select_profile(facts, profiles, override="jetson-orin")
    assert choice.profile.name == "jetson-orin" and choice.detected == "generic-arm64"
    assert (
        "its rules do NOT match this box (JetPack 5 / L4T R35 is not supported"
        in (choice.reasons[0])
    )
    assert "auto-detection would pick generic-arm64" in choice.reasons


def test_unknown_override_lists_the_valid_names(tmp_path: Path, profiles: Profiles) -> None:
    with pytest.raises(UnknownProfileError) as info:
        select_profile(detect(tmp_path), profiles, override="jetson-nano")
    assert info.value.valid == sorted(profiles)
    assert "unknown profile 'jetson-nano'; valid profiles: apple-silicon, generic-arm64" in str(
        info.value
    )


# ----------------------------------------------------------------------------- robustness, JSON


def test_facts_are_json_and_round_trip(tmp_path: Path) -> None:
    facts = collect_facts(
        orin_root(tmp_path),
        system="Linux",
        machine="aarch64",
        packages={"onnxruntime-gpu": "1.18.0", "tflite-runtime": "2.14.0"},
    )
    assert facts.packages == {"onnxruntime-gpu": "1.18.0", "tflite-runtime": "2.14.0"}
    wire = json.loads(json.dumps(facts.to_dict()))
    assert wire["cpu_flags"] == sorted(facts.cpu_flags)
    assert wire["files_present"] == ["/etc/nv_tegra_release"]
    assert HostFacts.from_dict({**wire, "added_by_a_newer_agent": 1}) == facts


def test_garbage_binary_and_huge_files_do_not_crash(tmp_path: Path, profiles: Profiles) -> None:
    rng = random.Random(7)
    huge = "flags\t\t: avx2 " + "x" * 100 + "\n" + "junk line\n" * (READ_CAP_BYTES // 5)
    root = fake_root(
        tmp_path,
        {
            "/proc/cpuinfo": huge + "model name\t: Intel Xeon past the cap\n",
            "/proc/meminfo": rng.randbytes(50_000),
            "/etc/nv_tegra_release": "# R" + "9" * 5000 + " (release), REVISION: 1.0\n",
            "/proc/device-tree/model/not-a-file": "",
        },
    )
    facts = detect(root, machine="x86_64")
    assert "avx2" in facts.cpu_flags
    assert facts.cpu_model is None  # it sits beyond READ_CAP_BYTES: reads stay bounded
    assert facts.l4t_release is None and facts.device_tree_model is None
    assert select_profile(facts, profiles).profile.name == "generic-x86_64"
    json.dumps(facts.to_dict())


def test_facts_from_hostile_files_stay_small_enough_to_enroll(tmp_path: Path) -> None:
    flood = "\u00e9" * 200 + " " + " ".join(f"flag{i}" for i in range(5000))
    snowmen = "\u2603" * 5000
    root = fake_root(
        tmp_path,
        {
            "/proc/cpuinfo": f"model name\t: {snowmen}\nflags\t: {flood}\n",
            "/proc/device-tree/model": b"\x01\x02" + "\u00e9".encode() * 3000,
        },
    )
    facts = detect(root)
    assert len(json.dumps(facts.to_dict())) < 16 * 1024  # EnrollmentRequest allows 32 KiB
    assert facts.cpu_model == "\u2603" * MAX_TEXT_CHARS and len(facts.cpu_flags) == MAX_FLAGS


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_in_place_of_a_file_does_not_hang(tmp_path: Path) -> None:
    (tmp_path / "proc").mkdir()
    os.mkfifo(tmp_path / "proc" / "cpuinfo")
    assert detect(tmp_path).cpu_model is None


FILES = ("/proc/cpuinfo", "/proc/meminfo", "/etc/nv_tegra_release", "/proc/device-tree/model")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.binary(max_size=2000), min_size=len(FILES), max_size=len(FILES)))
def test_any_bytes_in_any_file_give_serialisable_facts(contents: list[bytes]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = fake_root(Path(tmp), dict(zip(FILES, contents, strict=True)))
        facts = detect(root)
        assert HostFacts.from_dict(json.loads(json.dumps(facts.to_dict()))) == facts


def test_the_real_host_gives_facts() -> None:
    facts = collect_facts()
    json.dumps(facts.to_dict())
    assert facts.os and facts.arch and facts.cpu_count
    assert "onnxruntime" in facts.packages


# ------------------------------------------------------------------------------------ doctor CLI


def doctor(root: Path, *args: str, system: str = "Linux", machine: str = "aarch64") -> Result:
    return CliRunner().invoke(
        agent_main, ["doctor", "--root", str(root), "--system", system, "--machine", machine, *args]
    )


def test_doctor_human_output_on_a_jetson(tmp_path: Path) -> None:
    result = doctor(orin_root(tmp_path))
    assert result.exit_code == 0, result.output
    out = result.output
    assert "Profile: jetson-orin (detected)" in out
    assert "R36.3.0 (JetPack 6.x)" in out
    assert "NVIDIA Jetson AGX Orin Developer Kit" in out
    order = "TensorrtExecutionProvider -> CUDAExecutionProvider -> CPUExecutionProvider"
    assert f".onnx models    {order}" in out
    used = next(line for line in out.splitlines() if "would use" in line).split()[-1]
    assert used in onnxruntime.get_available_providers()
    assert "Loadable here" in out and "onnxruntime" in out.split("Loadable here")[1]


def test_doctor_json_on_a_jetpack_5_jetson(tmp_path: Path) -> None:
    result = doctor(orin_root(tmp_path, XAVIER_ERA_RELEASE), "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["profile"] == "generic-arm64"
    assert report["reasons"][0].startswith(
        "refused jetson-orin: JetPack 5 / L4T R35 is not supported"
    )
    assert report["facts"]["l4t_release"] == 35
    assert report["onnx_order"] == ["CPUExecutionProvider"]
    assert set(report["available"]) >= {"onnxruntime", "tflite"}


def test_doctor_apple_silicon_with_coreml(tmp_path: Path) -> None:
    result = doctor(tmp_path, "--backend", "coreml", "--json", system="Darwin", machine="arm64")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["profile"] == "apple-silicon"
    assert report["onnx_order"] == ["CoreMLExecutionProvider", "CPUExecutionProvider"]
    coreml = [b for b in report["backends"] if b["provider"] == "CoreMLExecutionProvider"]
    assert coreml == [
        {
            "name": "onnxruntime",
            "provider": "CoreMLExecutionProvider",
            "opt_in": True,
            "flag": "coreml",
            "offered_here": "CoreMLExecutionProvider" in onnxruntime.get_available_providers(),
        }
    ]


def test_doctor_on_xeon_runs_openvino_first_and_the_ep_opt_in(tmp_path: Path) -> None:
    cpuinfo = x86_cpuinfo("Intel(R) Xeon(R) Gold 6338", XEON_FLAGS, 2)
    root = fake_root(tmp_path, {"/proc/cpuinfo": cpuinfo})
    plain = doctor(root, machine="x86_64")
    assert plain.exit_code == 0, plain.output
    assert "1. openvino/CPU\n" in plain.output
    assert "OpenVINOExecutionProvider  (opt-in: --backend openvino-ep" in plain.output
    assert ".onnx models    openvino/CPU -> CPUExecutionProvider\n" in plain.output
    assert "would use     openvino/CPU\n" in plain.output
    assert "openvino     " in plain.output.split("Loadable here")[1]
    asked = doctor(root, "--backend", "openvino-ep", machine="x86_64")
    assert ".onnx models    OpenVINOExecutionProvider -> CPUExecutionProvider" in asked.output
    assert "asked for with --backend" in asked.output
    report = json.loads(doctor(root, "--backend", "openvino", "--json", machine="x86_64").output)
    assert report["onnx_order"] == ["openvino/CPU", "CPUExecutionProvider"]
    openvino = report["backends"][0]
    assert openvino == {
        "name": "openvino",
        "provider": "CPU",
        "opt_in": False,
        "flag": "openvino",
        "offered_here": True,
    }
    assert "CPU" in report["available"]["openvino"].split(": ", 1)[1].split(", ")


def test_doctor_refuses_unknown_names_with_exit_2(tmp_path: Path) -> None:
    result = doctor(tmp_path, "--profile", "jetson-nano")
    assert result.exit_code == 2
    assert "unknown profile 'jetson-nano'; valid profiles: apple-silicon" in result.output
    result = doctor(tmp_path, "--backend", "warp-drive")
    assert result.exit_code == 2 and "unknown backend 'warp-drive'" in result.output


def test_doctor_exits_1_when_no_profile_fits(tmp_path: Path) -> None:
    result = doctor(tmp_path, system="Darwin", machine="x86_64")
    assert result.exit_code == 1
    assert "Profile: none (no hardware profile matches this box" in result.output
    assert "generic-x86_64  os Darwin is not Linux" in result.output
