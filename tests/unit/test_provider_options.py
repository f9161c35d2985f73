"""Profile options → onnxruntime provider options (agent/runtime/providers.py)."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from mcp_edge.agent.runtime.providers import (
    describe,
    known_options,
    model_cache_key,
    provider_options,
)
from mcp_edge.shared.profiles import load_profiles
from mcp_edge.tooling.models import DigitsModels

TRT = "TensorrtExecutionProvider"
CUDA = "CUDAExecutionProvider"
COREML = "CoreMLExecutionProvider"
OVEP = "OpenVINOExecutionProvider"
CPU = "CPUExecutionProvider"


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_tensorrt_caches_go_under_the_cache_dir_in_private_directories(tmp_path: Path) -> None:
    cache = tmp_path / "state" / "cache"
    built = provider_options(
        TRT,
        {"trt_fp16_enable": True, "trt_engine_cache_enable": True, "trt_timing_cache_enable": True},
        cache_dir=cache,
    )
    assert built["trt_fp16_enable"] == "1"
    assert built["trt_engine_cache_enable"] == "1" and built["trt_timing_cache_enable"] == "1"
    engines = Path(built["trt_engine_cache_path"])
    timing = Path(built["trt_timing_cache_path"])
    assert timing == cache / "tensorrt"
    assert engines.parent == cache / "tensorrt" / "engines"
    assert engines.name.startswith("settings-")
    for directory in (cache, timing, engines.parent, engines):
        assert directory.is_dir() and _mode(directory) == 0o700


def test_tensorrt_engines_are_cached_per_model_file(tmp_path: Path) -> None:
    # TensorRT names an engine by file name and graph, not weights: two versions of one model
    # (same file name, same graph) must not share an engine directory.
    v1 = tmp_path / "models" / "digits" / "1" / "model.onnx"
    v2 = tmp_path / "models" / "digits" / "2" / "model.onnx"
    for path in (v1, v2):
        path.parent.mkdir(parents=True)
        path.write_bytes(b"onnx")
    options = {"trt_engine_cache_enable": True}
    first = provider_options(TRT, options, cache_dir=tmp_path / "cache", model_path=v1)
    again = provider_options(TRT, options, cache_dir=tmp_path / "cache", model_path=v1)
    second = provider_options(TRT, options, cache_dir=tmp_path / "cache", model_path=v2)
    assert first["trt_engine_cache_path"] == again["trt_engine_cache_path"]
    assert first["trt_engine_cache_path"] != second["trt_engine_cache_path"]
    engines = Path(first["trt_engine_cache_path"])
    assert engines.parent.parent == tmp_path / "cache" / "tensorrt" / "engines"
    assert engines.parent.name.startswith("model-")  # the model file's stem, then its key
    assert "trt_timing_cache_path" not in first  # timing cache not asked for
    # A file rewritten in place gets a new key.
    key = model_cache_key(v1)
    v1.write_bytes(b"onnx, retrained")
    assert model_cache_key(v1) != key


def test_tensorrt_fp16_follows_the_profile(tmp_path: Path) -> None:
    assert provider_options(TRT, {"trt_fp16_enable": False})["trt_fp16_enable"] == "0"
    assert provider_options(TRT, {"trt_fp16_enable": True})["trt_fp16_enable"] == "1"
    assert "trt_fp16_enable" not in provider_options(TRT, {})
    # The engine file name does not carry the precision: FP16 and FP32 engines live apart.
    model = tmp_path / "model.onnx"
    model.write_bytes(b"onnx")
    paths = {
        fp16: provider_options(
            TRT,
            {"trt_engine_cache_enable": True, "trt_fp16_enable": fp16},
            cache_dir=tmp_path / "cache",
            model_path=model,
        )["trt_engine_cache_path"]
        for fp16 in (False, True)
    }
    assert paths[False] != paths[True]
    assert Path(paths[False]).parent == Path(paths[True]).parent  # same model directory


def test_tensorrt_without_a_cache_dir_turns_its_caches_off(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="mcp.agent.runtime"):
        built = provider_options(TRT, {"trt_engine_cache_enable": True})
    assert built["trt_engine_cache_enable"] == "0" and "trt_engine_cache_path" not in built
    assert "no cache directory" in caplog.text


def test_tensorrt_numbers_are_checked_and_passed_as_text() -> None:
    built = provider_options(
        TRT, {"trt_max_workspace_size": 2 << 30, "trt_builder_optimization_level": 5}
    )
    assert built == {"trt_max_workspace_size": "2147483648", "trt_builder_optimization_level": "5"}
    with pytest.raises(ValueError, match="trt_builder_optimization_level' must be at most 5"):
        provider_options(TRT, {"trt_builder_optimization_level": 6})
    with pytest.raises(ValueError, match="trt_max_workspace_size' must be at least 0"):
        provider_options(TRT, {"trt_max_workspace_size": -1})


def test_cuda_gets_a_jetson_friendly_arena_unless_the_profile_says_otherwise() -> None:
    assert provider_options(CUDA, {}) == {"arena_extend_strategy": "kSameAsRequested"}
    built = provider_options(
        CUDA,
        {"arena_extend_strategy": "kNextPowerOfTwo", "device_id": 1, "enable_cuda_graph": True},
    )
    assert built == {
        "arena_extend_strategy": "kNextPowerOfTwo",
        "device_id": "1",
        "enable_cuda_graph": "1",
    }
    with pytest.raises(ValueError, match="must be one of EXHAUSTIVE, HEURISTIC, DEFAULT"):
        provider_options(CUDA, {"cudnn_conv_algo_search": "FAST"})


def test_coreml_options_and_model_cache(tmp_path: Path) -> None:
    built = provider_options(
        COREML,
        {"ModelFormat": "MLProgram", "MLComputeUnits": "ALL", "RequireStaticInputShapes": True},
        cache_dir=tmp_path / "cache",
    )
    # CoreML reads only "1" as true.
    assert built["RequireStaticInputShapes"] == "1"
    assert (built["ModelFormat"], built["MLComputeUnits"]) == ("MLProgram", "ALL")
    cache = Path(built["ModelCacheDirectory"])
    assert cache == tmp_path / "cache" / "coreml" and _mode(cache) == 0o700
    assert "ModelCacheDirectory" not in provider_options(COREML, {"ModelFormat": "MLProgram"})
    with pytest.raises(ValueError, match="MLComputeUnits' must be one of ALL, CPUOnly"):
        provider_options(COREML, {"MLComputeUnits": "GPU"})


def test_openvino_options_and_cache_dir(tmp_path: Path) -> None:
    built = provider_options(
        OVEP,
        {
            "device_type": "GPU.0",
            "precision": "FP16",
            "num_of_threads": 4,
            "enable_qdq_optimizer": True,
            "load_config": {"GPU": {"PERFORMANCE_HINT": "LATENCY"}},
        },
        cache_dir=tmp_path / "cache",
    )
    # OpenVINO accepts only True/False (a "1" makes it refuse the option).
    assert built["enable_qdq_optimizer"] == "True"
    assert built["num_of_threads"] == "4" and built["precision"] == "FP16"
    assert built["load_config"] == '{"GPU":{"PERFORMANCE_HINT":"LATENCY"}}'
    assert built["cache_dir"] == str(tmp_path / "cache" / "openvino")
    assert _mode(tmp_path / "cache" / "openvino") == 0o700
    assert provider_options(OVEP, {"device_type": "AUTO:GPU,CPU"})["device_type"] == "AUTO:GPU,CPU"
    with pytest.raises(ValueError, match="'device_type': 'TPU' is not a valid value"):
        provider_options(OVEP, {"device_type": "TPU"})


def test_cpu_takes_no_options() -> None:
    assert provider_options(CPU, {}, cache_dir=None) == {}
    with pytest.raises(ValueError, match="CPUExecutionProvider takes no options; remove 'x'"):
        provider_options(CPU, {"x": 1})


def test_an_unknown_key_names_the_key_the_provider_and_the_known_keys() -> None:
    with pytest.raises(ValueError) as caught:
        provider_options(TRT, {"trt_fp16_enabled": True})
    message = str(caught.value)
    assert "TensorrtExecutionProvider: unknown option 'trt_fp16_enabled'" in message
    assert "did you mean 'trt_fp16_enable'?" in message
    assert "known options: device_id, " in message and "trt_max_workspace_size" in message
    known = known_options(TRT)
    assert known is not None and "trt_fp16_enable" in known
    assert "trt_engine_cache_path" not in known  # the agent's to set


def test_a_wrong_type_is_refused_with_what_was_given() -> None:
    with pytest.raises(ValueError, match=r"trt_fp16_enable' must be true or false, not str '1'"):
        provider_options(TRT, {"trt_fp16_enable": "1"})
    with pytest.raises(ValueError, match="device_id' must be an integer, not bool True"):
        provider_options(CUDA, {"device_id": True})
    with pytest.raises(ValueError, match="'ModelFormat' must be a string, not int 1"):
        provider_options(COREML, {"ModelFormat": 1})
    with pytest.raises(ValueError, match="num_of_threads' must be an integer, not str '4'"):
        provider_options(OVEP, {"num_of_threads": "4"})


def test_paths_are_not_the_profiles_to_set(tmp_path: Path) -> None:
    for provider, key in (
        (TRT, "trt_engine_cache_path"),
        (TRT, "trt_timing_cache_path"),
        (COREML, "ModelCacheDirectory"),
        (OVEP, "cache_dir"),
    ):
        with pytest.raises(ValueError, match=f"{provider} option '{key}' is a path the agent"):
            provider_options(provider, {key: str(tmp_path)}, cache_dir=tmp_path)


def test_providers_not_described_pass_their_options_unchanged() -> None:
    assert provider_options("XnnpackExecutionProvider", {"intra_op_num_threads": 2}) == {
        "intra_op_num_threads": 2
    }
    assert known_options("XnnpackExecutionProvider") is None


def test_describe_is_one_sorted_line() -> None:
    assert describe(CPU, {}) == CPU
    assert describe(TRT, {"trt_fp16_enable": "1", "device_id": "0"}) == (
        "TensorrtExecutionProvider(device_id=0, trt_fp16_enable=1)"
    )


def test_every_shipped_profile_entry_builds(tmp_path: Path) -> None:
    built = 0
    for profile in load_profiles().values():
        for entry in profile.runtime.backends:
            if entry.name != "onnxruntime":
                continue
            options = provider_options(entry.provider, entry.options, cache_dir=tmp_path / "c")
            assert all(isinstance(v, str) for v in options.values()), (profile.name, options)
            built += 1
    assert built >= 8
    orin = load_profiles()["jetson-orin"].runtime.backends[0]
    trt = provider_options(orin.provider, orin.options, cache_dir=tmp_path / "c")
    assert trt["trt_fp16_enable"] == "1"
    assert trt["trt_engine_cache_path"].startswith(str(tmp_path / "c" / "tensorrt"))


def test_a_cpu_session_accepts_the_built_options(digits: DigitsModels) -> None:
    session = ort.InferenceSession(
        str(digits.onnx_path), providers=[(CPU, provider_options(CPU, {}))]
    )
    assert session.get_providers() == [CPU]
    (probabilities,) = session.run(["probabilities"], {"input": digits.X_test[:8]})
    assert probabilities.shape == (8, 10)
    np.testing.assert_allclose(probabilities.sum(axis=1), 1.0, rtol=1e-5)


def test_cache_dirs_that_exist_are_reused(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o755)
    os.chmod(cache, 0o755)
    first = provider_options(OVEP, {}, cache_dir=cache)
    second = provider_options(OVEP, {}, cache_dir=cache)
    assert first == second
    assert _mode(cache) == 0o755  # an existing directory keeps its mode
    (cache / "coreml").write_text("not a directory")
    with pytest.raises(NotADirectoryError, match="coreml exists and is not a directory"):
        provider_options(COREML, {}, cache_dir=cache)
