"""Pick and open the runner for a model file on this box, following a hardware profile.

The file's extension picks the backend (``.onnx`` → onnxruntime, ``.tflite`` → TFLite); the
profile's ``runtime.backends`` entries of that backend give the provider order, skipping
``opt_in`` ones unless ``--backend`` names them. An explicit backend is tried first, with the
CPU as the fallback; the runner logs one warning line when it falls back.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import onnxruntime as ort

from mcp_edge.agent.runtime.onnx_runner import CPU_PROVIDER, OnnxRunner
from mcp_edge.agent.runtime.runner import BackendUnavailableError, ModelLoadError, ModelRunner
from mcp_edge.agent.runtime.tflite_runner import TFLiteRunner, tflite_implementation, tflite_version
from mcp_edge.shared.profiles import HardwareProfile

_FORMATS = {".onnx": "onnx", ".tflite": "tflite"}

PROVIDER_ALIASES: Mapping[str, str] = {
    "cpu": CPU_PROVIDER,
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
    "trt": "TensorrtExecutionProvider",
    "coreml": "CoreMLExecutionProvider",
    "openvino": "OpenVINOExecutionProvider",
    "xnnpack": "XnnpackExecutionProvider",
    "directml": "DmlExecutionProvider",
    "rocm": "ROCMExecutionProvider",
    "qnn": "QNNExecutionProvider",
}
"""Short ``--backend`` names and the onnxruntime execution providers they stand for."""

BACKEND_NAMES = ("onnxruntime", "tflite")


def provider_alias(name: str) -> str:
    """The onnxruntime provider for a short backend name (``'cuda'`` → ``CUDAExecutionProvider``).

    Case does not matter; a full provider name (``...ExecutionProvider``) is returned as given.

    Raises:
        ValueError: the name is neither a known short name nor a provider name.
    """
    if name.endswith("ExecutionProvider"):
        return name
    try:
        return PROVIDER_ALIASES[name.lower()]
    except KeyError:
        known = ", ".join([*BACKEND_NAMES, *PROVIDER_ALIASES])
        raise ValueError(f"unknown backend {name!r}; known: {known}") from None


def model_format(model_path: Path) -> str:
    """``'onnx'`` or ``'tflite'``, from the file extension.

    Raises:
        ModelLoadError: the extension is neither ``.onnx`` nor ``.tflite``.
    """
    try:
        return _FORMATS[model_path.suffix.lower()]
    except KeyError:
        raise ModelLoadError(
            f"{model_path.name}: unknown model format {model_path.suffix!r} "
            "(expected .onnx or .tflite)"
        ) from None


def load_runner(
    model_path: Path,
    profile: HardwareProfile,
    *,
    backend: str | None = None,
    threads: int | None = None,
) -> ModelRunner:
    """Open ``model_path`` with the backend and settings ``profile`` prescribes for this box.

    Args:
        model_path: a ``.onnx`` or ``.tflite`` file.
        profile: the hardware profile in force (thread defaults, backend preference).
        backend: ``None`` for the profile's order; ``'onnxruntime'`` or ``'tflite'`` to insist
            on a backend; or a provider's short name (``'cpu'``, ``'cuda'``, ``'tensorrt'``,
            ``'coreml'``, ``'openvino'``, ``'xnnpack'``...) to try that provider first, even
            when the profile marks it ``opt_in``. For ``.tflite``, ``'xnnpack'`` enables the
            XNNPACK delegate and ``'cpu'`` disables it.
        threads: intra-op threads; ``None`` takes the profile's ``intra_op_threads``; 0 means
            :func:`auto_threads` (half the CPUs this process may use, at least one).

    Raises:
        ModelLoadError: unknown extension, or the model does not load.
        BackendUnavailableError: the backend does not fit the format, the profile does not
            list the format, or no TFLite interpreter is installed.
        ValueError: ``backend`` is not a known name.
    """
    fmt = model_format(model_path)
    if fmt not in profile.runtime.formats:
        raise BackendUnavailableError(
            f"{model_path.name}: profile {profile.name!r} does not run {fmt} models "
            f"(formats: {', '.join(profile.runtime.formats)})"
        )
    intra = profile.runtime.intra_op_threads if threads is None else threads
    if intra == 0:
        # Half the CPUs this process may use: the event loop, the HTTP parsing and other
        # instances need the rest. On a 2-core box one backend thread halves the CPU per
        # request against onnxruntime's own choice (bench/local_inference.py).
        intra = auto_threads()
    if fmt == "onnx":
        if backend == "tflite":
            raise BackendUnavailableError(f"{model_path.name}: tflite cannot run an .onnx model")
        return OnnxRunner(
            model_path,
            providers=onnx_providers(profile, backend),
            intra_op_threads=intra,
            inter_op_threads=profile.runtime.inter_op_threads,
            allow_spinning=profile.runtime.allow_spinning,
        )
    return TFLiteRunner(
        model_path,
        num_threads=intra,
        use_xnnpack=_tflite_uses_xnnpack(model_path, profile, backend),
    )


def onnx_providers(
    profile: HardwareProfile, backend: str | None = None
) -> list[tuple[str, dict[str, Any]]]:
    """The onnxruntime ``(provider, options)`` list for ``profile``, best first.

    Without ``backend`` (or with ``'onnxruntime'``): the profile's onnxruntime entries in
    order, ``opt_in`` ones left out. With a provider name: that provider (with the profile's
    options for it, if any), then the CPU.

    Raises:
        ValueError: ``backend`` is not a known name.
    """
    entries = [e for e in profile.runtime.backends if e.name == "onnxruntime"]
    if backend is None or backend == "onnxruntime":
        chosen = [(e.provider, dict(e.options)) for e in entries if not e.opt_in]
        return chosen or [(CPU_PROVIDER, {})]
    provider = provider_alias(backend)
    options = next((dict(e.options) for e in entries if e.provider == provider), {})
    chosen = [(provider, options)]
    if provider != CPU_PROVIDER:
        cpu = next((dict(e.options) for e in entries if e.provider == CPU_PROVIDER), {})
        chosen.append((CPU_PROVIDER, cpu))
    return chosen


def _tflite_uses_xnnpack(model_path: Path, profile: HardwareProfile, backend: str | None) -> bool:
    if backend in (None, "tflite"):
        entries = [e for e in profile.runtime.backends if e.name == "tflite" and not e.opt_in]
        # XNNPACK is the interpreter's default; a profile says otherwise with provider "CPU".
        return not entries or entries[0].provider.upper() == "XNNPACK"
    if backend.lower() in ("xnnpack", "cpu"):
        return backend.lower() == "xnnpack"
    if backend == "onnxruntime":
        raise BackendUnavailableError(f"{model_path.name}: onnxruntime cannot run a .tflite model")
    provider_alias(backend)  # an unknown name is a ValueError, a known one is not for TFLite
    raise BackendUnavailableError(
        f"{model_path.name}: backend {backend!r} does not apply to .tflite models "
        "(use 'xnnpack' or 'cpu')"
    )


def auto_threads() -> int:
    """Backend threads when the profile says 0 (auto): half the usable CPUs, at least one."""
    return max(1, _usable_cpus() // 2)


def _usable_cpus() -> int:
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def available_backends() -> dict[str, str]:
    """What can run models here, for ``mcp-agent doctor``.

    Returns:
        ``{"onnxruntime": "<version>: <providers>", "tflite": "<implementation> <version>"}``,
        with ``"unavailable: <reason>"`` when no TFLite interpreter imports (onnxruntime is
        a hard dependency).
    """
    providers = ", ".join(ort.get_available_providers())
    found = {"onnxruntime": f"{ort.__version__}: {providers}"}
    try:
        _, implementation = tflite_implementation()
        found["tflite"] = f"{implementation} {tflite_version(implementation)}"
    except BackendUnavailableError as e:
        found["tflite"] = f"unavailable: {e}"
    return found
