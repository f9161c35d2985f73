from __future__ import annotations

import pytest
from click.testing import CliRunner

from agent.cli import main as agent_main
from shared.profiles import ProfileError, load_profiles, parse_profile


def test_shipped_profiles_load_and_keep_their_promises() -> None:
    profiles = load_profiles()
    assert set(profiles) == {
        "jetson-orin", "apple-silicon", "intel-xeon", "generic-x86_64", "generic-arm64",
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
