"""Provider options: what a hardware profile's ``runtime.backends[].options`` become when a
session is opened (onnxruntime execution providers, the OpenVINO runtime's config).

``provider_options`` is the one place that turns the profile's TOML values into what the runtime
takes, and adds the per-device paths a profile cannot know (engine and model caches under the
agent's state directory).

For the execution providers described here (TensorRT, CUDA, CoreML, OpenVINO, CPU) every key is
checked against the options onnxruntime documents for that provider, with its type: a typo or a
wrong type in a profile is a :class:`ValueError` at load naming the key, the provider and the
known keys, instead of an option onnxruntime ignores or a session that fails far from its cause.
Values become the strings each provider parses: booleans are ``"1"``/``"0"`` for TensorRT, CUDA
and CoreML (CoreML only reads ``"1"`` as true; several TensorRT and CUDA options are integers
underneath) and ``"True"``/``"False"`` for OpenVINO (the only spellings it accepts).

Paths are the agent's to choose, so a profile may not set them:

* TensorRT: with ``trt_engine_cache_enable``, ``trt_engine_cache_path`` is
  ``{cache_dir}/tensorrt/engines/{model key}/settings-{hash}`` (no model key without a model);
  with ``trt_timing_cache_enable``, ``trt_timing_cache_path`` is ``{cache_dir}/tensorrt``
  (layer timings are shared between models). onnxruntime names an engine file by the model's
  file name, graph structure, the onnxruntime, CUDA and TensorRT versions and the GPU, not by
  its weights nor by the build options: the model key (:func:`model_cache_key`: path, size and
  modification time) keeps a retrained model with the same graph from loading the previous
  version's engine, and the settings hash (precision, workspace, shape profiles...) keeps an
  FP32 engine from being read back when the profile asks for FP16.
* CoreML: ``ModelCacheDirectory`` is ``{cache_dir}/coreml/{model key}`` (or ``{cache_dir}/coreml``).
* OpenVINO: ``cache_dir`` is ``{cache_dir}/openvino`` (OpenVINO keys its blobs by the model's
  content itself).

Directories are created with mode 0700. Without ``cache_dir``, TensorRT's caches are turned off
(one warning line: they would otherwise land in the working directory) and the other providers
run without a cache.

CUDA gets ``arena_extend_strategy = "kSameAsRequested"`` unless the profile says otherwise: the
default (``kNextPowerOfTwo``) can reserve up to twice what a model needs, and on a Jetson that
memory is the CPU's too.

Providers not described here (XNNPACK, DirectML, QNN...) get the profile's options unchanged.
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import json
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("mcp.agent.runtime")

TENSORRT = "TensorrtExecutionProvider"
CUDA = "CUDAExecutionProvider"
COREML = "CoreMLExecutionProvider"
OPENVINO = "OpenVINOExecutionProvider"
CPU = "CPUExecutionProvider"

_MAX_TEXT = 4096
"""Longest string option accepted (paths, shape lists, JSON config)."""


@dataclass(frozen=True)
class _Option:
    """One documented option of a provider: its TOML type and the values it may take."""

    kind: type
    """``bool``, ``int`` or ``str`` (``dict`` for a table sent as JSON)."""
    choices: tuple[str, ...] = ()
    minimum: int | None = None
    maximum: int | None = None
    pattern: str | None = None
    managed: bool = False
    """A path the agent sets under its cache directory; a profile may not give it."""


_BOOL = _Option(bool)
_STR = _Option(str)
_COUNT = _Option(int, minimum=0)
_POSITIVE = _Option(int, minimum=1)
_PATH = _Option(str, managed=True)


@dataclass(frozen=True)
class _Provider:
    options: Mapping[str, _Option]
    true: str
    false: str


_TENSORRT_OPTIONS: dict[str, _Option] = {
    "device_id": _COUNT,
    "trt_max_workspace_size": _COUNT,
    "trt_max_partition_iterations": _POSITIVE,
    "trt_min_subgraph_size": _POSITIVE,
    "trt_fp16_enable": _BOOL,
    "trt_bf16_enable": _BOOL,
    "trt_int8_enable": _BOOL,
    "trt_int8_calibration_table_name": _STR,
    "trt_int8_use_native_calibration_table": _BOOL,
    "trt_dla_enable": _BOOL,
    "trt_dla_core": _COUNT,
    "trt_dump_subgraphs": _BOOL,
    "trt_engine_cache_enable": _BOOL,
    "trt_engine_cache_path": _PATH,
    "trt_engine_cache_prefix": _Option(str, pattern=r"[A-Za-z0-9_.-]{1,64}"),
    "trt_engine_decryption_enable": _BOOL,
    "trt_engine_decryption_lib_path": _STR,
    "trt_force_sequential_engine_build": _BOOL,
    "trt_context_memory_sharing_enable": _BOOL,
    "trt_layer_norm_fp32_fallback": _BOOL,
    "trt_timing_cache_enable": _BOOL,
    "trt_timing_cache_path": _PATH,
    "trt_force_timing_cache": _BOOL,
    "trt_detailed_build_log": _BOOL,
    "trt_build_heuristics_enable": _BOOL,
    "trt_sparsity_enable": _BOOL,
    "trt_builder_optimization_level": _Option(int, minimum=0, maximum=5),
    "trt_auxiliary_streams": _Option(int, minimum=-1),
    "trt_tactic_sources": _STR,
    "trt_extra_plugin_lib_paths": _STR,
    "trt_profile_min_shapes": _STR,
    "trt_profile_max_shapes": _STR,
    "trt_profile_opt_shapes": _STR,
    "trt_cuda_graph_enable": _BOOL,
    "trt_dump_ep_context_model": _BOOL,
    "trt_ep_context_file_path": _STR,
    "trt_ep_context_embed_mode": _Option(int, minimum=0, maximum=1),
    "trt_engine_hw_compatible": _BOOL,
    "trt_weight_stripped_engine_enable": _BOOL,
    "trt_onnx_model_folder_path": _STR,
    "trt_op_types_to_exclude": _STR,
}

_CUDA_OPTIONS: dict[str, _Option] = {
    "device_id": _COUNT,
    "gpu_mem_limit": _POSITIVE,
    "arena_extend_strategy": _Option(str, choices=("kNextPowerOfTwo", "kSameAsRequested")),
    "cudnn_conv_algo_search": _Option(str, choices=("EXHAUSTIVE", "HEURISTIC", "DEFAULT")),
    "do_copy_in_default_stream": _BOOL,
    "cudnn_conv_use_max_workspace": _BOOL,
    "cudnn_conv1d_pad_to_nc1d": _BOOL,
    "enable_cuda_graph": _BOOL,
    "enable_skip_layer_norm_strict_mode": _BOOL,
    "tunable_op_enable": _BOOL,
    "tunable_op_tuning_enable": _BOOL,
    "tunable_op_max_tuning_duration_ms": _COUNT,
    "use_tf32": _BOOL,
    "prefer_nhwc": _BOOL,
    "use_ep_level_unified_stream": _BOOL,
    "fuse_conv_bias": _BOOL,
    "sdpa_kernel": _COUNT,
}

_COREML_OPTIONS: dict[str, _Option] = {
    "ModelFormat": _Option(str, choices=("MLProgram", "NeuralNetwork")),
    "MLComputeUnits": _Option(str, choices=("ALL", "CPUOnly", "CPUAndGPU", "CPUAndNeuralEngine")),
    "RequireStaticInputShapes": _BOOL,
    "EnableOnSubgraphs": _BOOL,
    "SpecializationStrategy": _Option(str, choices=("Default", "FastPrediction")),
    "ProfileComputePlan": _BOOL,
    "AllowLowPrecisionAccumulationOnGPU": _BOOL,
    "ModelCacheDirectory": _PATH,
}

_OPENVINO_OPTIONS: dict[str, _Option] = {
    "device_type": _Option(
        str,
        pattern=r"(CPU|GPU(\.\d+)?|NPU(\.\d+)?|AUTO)"
        r"|(AUTO|HETERO|MULTI):(CPU|GPU(\.\d+)?|NPU(\.\d+)?)(,(CPU|GPU(\.\d+)?|NPU(\.\d+)?))*",
    ),
    "precision": _Option(str, choices=("FP32", "FP16", "ACCURACY")),
    "num_of_threads": _POSITIVE,
    "num_streams": _Option(int, minimum=1, maximum=8),
    "cache_dir": _PATH,
    "model_priority": _Option(str, choices=("LOW", "MEDIUM", "HIGH", "DEFAULT")),
    "load_config": _Option(dict),
    "enable_opencl_throttling": _BOOL,
    "enable_qdq_optimizer": _BOOL,
    "disable_dynamic_shapes": _BOOL,
    "reshape_input": _STR,
    "layout": _STR,
    "device_luid": _STR,
}

_PROVIDERS: dict[str, _Provider] = {
    TENSORRT: _Provider(_TENSORRT_OPTIONS, "1", "0"),
    CUDA: _Provider(_CUDA_OPTIONS, "1", "0"),
    COREML: _Provider(_COREML_OPTIONS, "1", "0"),
    OPENVINO: _Provider(_OPENVINO_OPTIONS, "True", "False"),
    CPU: _Provider({}, "1", "0"),
}

_CUDA_DEFAULTS: Mapping[str, str] = {"arena_extend_strategy": "kSameAsRequested"}


def known_options(provider: str) -> tuple[str, ...] | None:
    """The option names ``provider`` accepts from a profile, sorted; None: not described here
    (its options pass unchecked). Paths the agent sets are not included."""
    spec = _PROVIDERS.get(provider)
    if spec is None:
        return None
    return tuple(sorted(k for k, o in spec.options.items() if not o.managed))


def model_cache_key(model_path: str | os.PathLike[str]) -> str:
    """A short key for a model file's compiled caches: its resolved path, size and mtime.

    A new version installed elsewhere, or a file rewritten in place, gets a new key; the same
    file read again after a restart gets the same one.

    Raises:
        OSError: the file cannot be read (``stat``).
    """
    path = Path(model_path).resolve()
    st = path.stat()
    digest = hashlib.sha256(f"{path}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return f"{path.stem[:32]}-{digest.hexdigest()[:16]}"


def provider_options(
    provider: str,
    options: Mapping[str, Any],
    *,
    cache_dir: Path | None = None,
    model_path: str | os.PathLike[str] | None = None,
) -> dict[str, Any]:
    """The options to open ``provider`` with, from the profile's ``options`` for it.

    Args:
        provider: an onnxruntime execution provider name (``TensorrtExecutionProvider``...).
        options: the profile entry's ``options`` table.
        cache_dir: the agent's cache directory (engine caches go below it); None: no cache paths.
        model_path: the model file the session opens; with it, TensorRT engines and CoreML
            models are cached per model file (see :func:`model_cache_key`).

    Returns:
        For the providers described here, string values as onnxruntime parses them, with the
        cache paths and defaults added; for others, ``options`` unchanged.

    Raises:
        ValueError: an unknown key, a value of the wrong type or out of range, or a path the
            agent sets; the message names the provider, the key and the known keys.
        OSError: a cache directory cannot be created.
    """
    spec = _PROVIDERS.get(provider)
    if spec is None:
        return dict(options)
    built = {key: _convert(provider, spec, key, value) for key, value in options.items()}
    if provider == TENSORRT:
        _tensorrt_caches(built, cache_dir, model_path)
    elif provider == CUDA:
        for key, value in _CUDA_DEFAULTS.items():
            built.setdefault(key, value)
    elif provider == COREML and cache_dir is not None:
        built["ModelCacheDirectory"] = str(_cache_path(cache_dir, "coreml", model_path))
    elif provider == OPENVINO and cache_dir is not None:
        built["cache_dir"] = str(_cache_path(cache_dir, "openvino", None))
    return built


def describe(provider: str, options: Mapping[str, Any]) -> str:
    """One line for logs and ``doctor``: ``Provider(key=value, ...)``, keys sorted."""
    if not options:
        return provider
    inner = ", ".join(f"{key}={options[key]}" for key in sorted(options))
    return f"{provider}({inner})"


def _convert(provider: str, spec: _Provider, key: str, value: Any) -> str:
    option = spec.options.get(key)
    if option is None:
        raise ValueError(_unknown(provider, spec, key))
    where = f"{provider} option {key!r}"
    if option.managed:
        raise ValueError(
            f"{where} is a path the agent sets under its cache directory; remove it from the "
            "profile"
        )
    if option.kind is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{where} must be true or false, not {_shown(value)}")
        return spec.true if value else spec.false
    if option.kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{where} must be an integer, not {_shown(value)}")
        if option.minimum is not None and value < option.minimum:
            raise ValueError(f"{where} must be at least {option.minimum}, not {value}")
        if option.maximum is not None and value > option.maximum:
            raise ValueError(f"{where} must be at most {option.maximum}, not {value}")
        return str(value)
    if option.kind is dict:
        if isinstance(value, Mapping):
            text = json.dumps(value, separators=(",", ":"), sort_keys=True)
        elif isinstance(value, str):
            text = value
        else:
            raise ValueError(f"{where} must be a table or a JSON string, not {_shown(value)}")
        if len(text) > _MAX_TEXT:
            raise ValueError(f"{where} is longer than {_MAX_TEXT} characters")
        return text
    if not isinstance(value, str):
        raise ValueError(f"{where} must be a string, not {_shown(value)}")
    if len(value) > _MAX_TEXT:
        raise ValueError(f"{where} is longer than {_MAX_TEXT} characters")
    if option.choices and value not in option.choices:
        raise ValueError(f"{where} must be one of {', '.join(option.choices)}, not {value!r}")
    if option.pattern is not None and re.fullmatch(option.pattern, value) is None:
        raise ValueError(f"{where}: {value!r} is not a valid value")
    return value


def _unknown(provider: str, spec: _Provider, key: str) -> str:
    known = [k for k, o in spec.options.items() if not o.managed]
    if not known:
        return f"{provider} takes no options; remove {key!r} from the profile"
    close = difflib.get_close_matches(key, known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"{provider}: unknown option {key!r}{hint}; known options: {', '.join(sorted(known))}"


def _shown(value: Any) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__name__} {text}"


def _tensorrt_caches(
    built: dict[str, str], cache_dir: Path | None, model_path: str | os.PathLike[str] | None
) -> None:
    engine = built.get("trt_engine_cache_enable") == "1"
    timing = built.get("trt_timing_cache_enable") == "1"
    if not (engine or timing):
        return
    if cache_dir is None:
        log.warning(
            "%s: engine and timing caches turned off: no cache directory was given", TENSORRT
        )
        built["trt_engine_cache_enable"] = "0"
        built["trt_timing_cache_enable"] = "0"
        return
    if timing:
        built["trt_timing_cache_path"] = str(_cache_path(cache_dir, "tensorrt", None))
    if engine:
        engines = _cache_path(cache_dir, "tensorrt", None) / "engines"
        per_model = engines if model_path is None else engines / model_cache_key(model_path)
        built["trt_engine_cache_path"] = str(_cache_path(per_model, _engine_settings(built), None))


_NOT_IN_ENGINE = frozenset(
    {
        "trt_engine_cache_enable",
        "trt_engine_cache_path",
        "trt_timing_cache_enable",
        "trt_timing_cache_path",
        "trt_force_timing_cache",
        "trt_detailed_build_log",
        "trt_dump_subgraphs",
    }
)


def _engine_settings(built: Mapping[str, str]) -> str:
    """A short key for the options that shape a TensorRT engine (precision, workspace, shape
    profiles...): the engine's file name does not carry them, so turning FP16 on or off in the
    profile must not find the engine built the other way."""
    settings = sorted((k, v) for k, v in built.items() if k not in _NOT_IN_ENGINE)
    digest = hashlib.sha256(json.dumps(settings).encode()).hexdigest()[:12]
    return f"settings-{digest}"


def _cache_path(
    cache_dir: Path, kind: str | None, model_path: str | os.PathLike[str] | None
) -> Path:
    path = Path(cache_dir) if kind is None else Path(cache_dir) / kind
    if model_path is not None:
        path = path / model_cache_key(model_path)
    _make_private_dirs(path)
    return path


def _make_private_dirs(path: Path) -> None:
    """Create ``path`` and any missing parents with mode 0700 (existing ones are left as they
    are)."""
    missing: list[Path] = []
    current = path
    while not current.exists():
        missing.append(current)
        if current.parent == current:
            break
        current = current.parent
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):  # made by another process meanwhile
            directory.mkdir(mode=0o700)
    if not path.is_dir():
        raise NotADirectoryError(f"cache path {path} exists and is not a directory")
