from __future__ import annotations

import pytest
from click.testing import CliRunner

from mcp_edge.agent.cli import main as agent_main
from mcp_edge.shared.profiles import ProfileError, load_profiles, parse_profile


def test_shipped_profiles_load_and_keep_their_promises() -> None:
    profiles = load_profiles()
    assert set(profiles) == {
        "jetson-orin",
        "apple-silicon",
        "intel-xeon",
        "generic-x86_64",
        "generic-arm64",
        "raspberry-pi",
    }
    orin = [b.provider for b in profiles["jetson-orin"].runtime.backends]
    assert orin == ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
    assert profiles["jetson-orin"].runtime.backends[0].options["trt_fp16_enable"] is True
    assert profiles["jetson-orin"].detect.min_l4t_release == 36
    # Apple Silicon: CPU first, CoreML an option; OpenVINO on Xeon opt-in.
    apple = profiles["apple-silicon"].runtime.backends
    assert apple[0].provider == "CPUExecutionProvider"
    assert [b.opt_in for b in apple if b.provider == "CoreMLExecutionProvider"] == [True]
    xeon = profiles["intel-xeon"].runtime.backends
    assert [b.opt_in for b in xeon if b.provider == "OpenVINOExecutionProvider"] == [True]
    assert profiles["raspberry-pi"].runtime.backends[0].name == "tflite"
    # Specific profiles outrank the generic ones.
    order = list(profiles)
    assert order.index("jetson-orin") < order.index("generic-arm64")


def test_bad_profile_documents_are_refused_with_the_source_named() -> None:
    with pytest.raises(ProfileError, match=r"x\.toml: not valid TOML"):
        parse_profile("name = ", "x.toml")
    with pytest.raises(ProfileError, match="runtime"):
        parse_profile('name = "a"\ndescription = "d"\n[detect]\n[variants]\ntags=["a"]', "y.toml")


def test_agent_cli_lists_profiles() -> None:
    result = CliRunner().invoke(agent_main, ["profiles"])
    assert result.exit_code == 0
    assert "jetson-orin" in result.output and "TensorrtExecutionProvider" in result.output


_GOOD = """
name = "box"
description = "a box"
[detect]
arch = ["x86_64"]
[runtime]
formats = ["onnx"]
intra_op_threads = 2
memory_budget_fraction = 1
[[runtime.backends]]
name = "onnxruntime"
provider = "CPUExecutionProvider"
options = { a = 1 }
[variants]
tags = ["x"]
"""


def test_a_minimal_profile_gets_the_documented_defaults() -> None:
    p = parse_profile(_GOOD, "box.toml")
    assert (p.name, p.priority, p.runtime.inter_op_threads, p.runtime.allow_spinning) == (
        "box",
        0,
        1,
        True,
    )
    assert p.runtime.intra_op_threads == 2 and p.runtime.memory_budget_fraction == 1.0
    assert p.runtime.backends[0].options == {"a": 1} and p.runtime.backends[0].opt_in is False
    assert p.detect.min_l4t_release is None and p.telemetry.sources == []
    assert p.to_dict()["runtime"]["backends"][0]["provider"] == "CPUExecutionProvider"


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ('name = "box"', 'name = "bad name!"', r"name: invalid identifier"),
        ('description = "a box"', 'description = "a box"\ncolour = "red"', r"colour: unknown key"),
        (
            "intra_op_threads = 2",
            "intra_op_threads = -1",
            r"runtime\.intra_op_threads: must be >= 0",
        ),
        (
            "intra_op_threads = 2",
            'intra_op_threads = "2"',
            r"runtime\.intra_op_threads: must be an integer",
        ),
        (
            "intra_op_threads = 2",
            "intra_op_threads = true",
            r"runtime\.intra_op_threads: must be an integer",
        ),
        (
            "memory_budget_fraction = 1",
            "memory_budget_fraction = 0",
            r"runtime\.memory_budget_fraction: must be > 0",
        ),
        (
            "memory_budget_fraction = 1",
            "memory_budget_fraction = 1.5",
            r"runtime\.memory_budget_fraction: must be <= 1",
        ),
        ('name = "onnxruntime"', 'name = "tensorflow"', r"runtime\.backends\.0\.name: must match"),
        ("options = { a = 1 }", "options = 3", r"runtime\.backends\.0\.options: must be a table"),
        ('tags = ["x"]', "tags = []", r"variants\.tags: needs at least 1"),
        ('arch = ["x86_64"]', "arch = [1]", r"detect\.arch\.0: must be a string"),
        ('arch = ["x86_64"]', 'arch = "x86_64"', r"detect\.arch: must be a list"),
        ('[variants]\ntags = ["x"]', "", r"variants: missing"),
    ],
)
def test_each_schema_rule_refuses_with_where_and_why(old: str, new: str, message: str) -> None:
    assert old in _GOOD
    with pytest.raises(ProfileError, match=rf"^bad\.toml: {message}"):
        parse_profile(_GOOD.replace(old, new, 1), "bad.toml")
