"""Pick and open the runner for a model file on this box, following a hardware profile.

The file's extension picks the format (``.onnx`` or ``.tflite``); the profile's
``runtime.backends`` entries for that format give the order to try, ``opt_in`` ones left out
unless ``--backend`` names them. For ``.onnx`` both ``openvino`` entries (the OpenVINO runtime
reading the file itself) and ``onnxruntime`` entries apply; consecutive ``onnxruntime`` entries
open one session with that provider list, and the order always ends on onnxruntime's
``CPUExecutionProvider``. ``.tflite`` files take the ``tflite`` entries.

An entry that cannot be used here (not installed, no such device, the model does not compile
for it) is skipped for the next one. Loading logs exactly one warning line on
``mcp.agent.runtime`` naming what was skipped and why, and keeps the same text in
:attr:`RunnerInfo.fallback_reason`; a load with nothing skipped logs nothing.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnxruntime as ort

from mcp_edge.agent.runtime.onnx_runner import CPU_PROVIDER, OnnxRunner
from mcp_edge.agent.runtime.openvino_runner import (
    OpenVINORunner,
    openvino_devices,
    openvino_version,
)
from mcp_edge.agent.runtime.providers import provider_options
from mcp_edge.agent.runtime.runner import (
    BackendUnavailableError,
    ModelLoadError,
    ModelRunner,
)
from mcp_edge.agent.runtime.tflite_runner import (
    TFLITE_IMPLEMENTATIONS,
    TFLiteRunner,
    tflite_implementation,
    tflite_version,
)
from mcp_edge.shared.profiles import BackendSpec, HardwareProfile

log = logging.getLogger("mcp.agent.runtime")

_FORMATS = {".onnx": "onnx", ".tflite": "tflite"}

OPENVINO_EP = "OpenVINOExecutionProvider"

PROVIDER_ALIASES: Mapping[str, str] = {
    "cpu": CPU_PROVIDER,
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
    "trt": "TensorrtExecutionProvider",
    "coreml": "CoreMLExecutionProvider",
    "openvino-ep": OPENVINO_EP,
    "xnnpack": "XnnpackExecutionProvider",
    "directml": "DmlExecutionProvider",
    "rocm": "ROCMExecutionProvider",
    "qnn": "QNNExecutionProvider",
}
"""Short ``--backend`` names and the onnxruntime execution providers they stand for.

``openvino`` is not among them: it names the OpenVINO runtime (:data:`BACKEND_NAMES`);
onnxruntime's OpenVINO execution provider is ``openvino-ep``."""

BACKEND_NAMES = ("onnxruntime", "tflite", "openvino")
"""``--backend`` names that pick a runtime rather than an onnxruntime provider."""

_BACKENDS_BY_FORMAT = {"onnx": ("openvino", "onnxruntime"), "tflite": ("tflite",)}


@dataclass(frozen=True)
class BackendChoice:
    """One step of the order the loader tries: a runtime, its provider or device, options."""

    backend: str
    """``onnxruntime``, ``openvino`` or ``tflite``."""
    provider: str
    """The onnxruntime execution provider, OpenVINO device, or TFLite ``XNNPACK``/``CPU``."""
    options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """``openvino/CPU``, ``onnxruntime/CUDAExecutionProvider``, ``tflite/XNNPACK``."""
        return f"{self.backend}/{self.provider}"


def provider_alias(name: str) -> str:
    """The onnxruntime provider for a short backend name (``'cuda'`` → ``CUDAExecutionProvider``).

    Case does not matter; a full provider name (``...ExecutionProvider``) is returned as given.

    Raises:
        ValueError: the name is neither a known short name nor a provider name (runtime names
            such as ``'openvino'`` are not provider names either).
    """
    if name.endswith("ExecutionProvider"):
        return name
    try:
        return PROVIDER_ALIASES[name.lower()]
    except KeyError:
        known = ", ".join([*BACKEND_NAMES, *PROVIDER_ALIASES])
        raise ValueError(f"unknown backend {name!r}; known: {known}") from None


def check_backend_name(name: str) -> None:
    """Raise ValueError unless ``name`` is a runtime name or a known provider name."""
    if name.lower() not in BACKEND_NAMES:
        provider_alias(name)


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


def backend_order(
    profile: HardwareProfile, fmt: str, backend: str | None = None
) -> list[BackendChoice]:
    """The order the loader tries for a ``fmt`` model (``'onnx'`` or ``'tflite'``), best first.

    ``backend``: ``None`` for the profile's entries of that format, ``opt_in`` ones left out;
    ``'onnxruntime'`` for its onnxruntime entries only; ``'openvino'`` for the profile's
    ``openvino`` entries (``CPU`` when it has none), then the rest; a provider's short name
    (``'cuda'``, ``'openvino-ep'``...) for that provider with the profile's options for it,
    then the CPU. For ``.tflite``, ``'xnnpack'`` enables the XNNPACK delegate and ``'cpu'``
    disables it. An ``.onnx`` order always ends on onnxruntime's CPU provider.

    Raises:
        BackendUnavailableError: ``backend`` names a runtime or provider that does not run
            ``fmt`` models.
        ValueError: ``backend`` is not a known name.
    """
    entries = [e for e in profile.runtime.backends if e.name in _BACKENDS_BY_FORMAT[fmt]]
    if fmt == "tflite":
        return _tflite_order(entries, backend)
    return _onnx_order(entries, backend)


def _choice(entry: BackendSpec) -> BackendChoice:
    return BackendChoice(entry.name, entry.provider, dict(entry.options))


def _onnx_order(entries: list[BackendSpec], backend: str | None) -> list[BackendChoice]:
    name = backend.lower() if backend is not None else None
    if name == "tflite":
        raise BackendUnavailableError("tflite cannot run an .onnx model")
    if name is None:
        chosen = [_choice(e) for e in entries if not e.opt_in]
    elif name == "onnxruntime":
        chosen = [_choice(e) for e in entries if e.name == "onnxruntime" and not e.opt_in]
    elif name == "openvino":
        first = [_choice(e) for e in entries if e.name == "openvino"]
        rest = [_choice(e) for e in entries if e.name != "openvino" and not e.opt_in]
        chosen = (first or [BackendChoice("openvino", "CPU")]) + rest
    else:
        provider = provider_alias(backend or "")
        ort_entries = [e for e in entries if e.name == "onnxruntime"]
        options = next((dict(e.options) for e in ort_entries if e.provider == provider), {})
        chosen = [BackendChoice("onnxruntime", provider, options)]
    # Nothing after the CPU provider is ever reached; without it, it ends the order.
    cpu = next(
        (
            i
            for i, c in enumerate(chosen)
            if c.backend == "onnxruntime" and c.provider == CPU_PROVIDER
        ),
        None,
    )
    if cpu is not None:
        return chosen[: cpu + 1]
    options = next(
        (
            dict(e.options)
            for e in entries
            if e.name == "onnxruntime" and e.provider == CPU_PROVIDER
        ),
        {},
    )
    return [*chosen, BackendChoice("onnxruntime", CPU_PROVIDER, options)]


def _tflite_order(entries: list[BackendSpec], backend: str | None) -> list[BackendChoice]:
    name = backend.lower() if backend is not None else None
    if name in (None, "tflite"):
        chosen = [_choice(e) for e in entries if not e.opt_in]
        # XNNPACK is the interpreter's default; a profile says otherwise with provider "CPU".
        return chosen or [BackendChoice("tflite", "XNNPACK")]
    if name in ("xnnpack", "cpu"):
        provider = name.upper()
        options = next((dict(e.options) for e in entries if e.provider.upper() == provider), {})
        return [BackendChoice("tflite", provider, options)]
    if name in ("onnxruntime", "openvino"):
        raise BackendUnavailableError(f"{name} cannot run a .tflite model")
    provider_alias(backend or "")  # an unknown name is a ValueError, a known one is not for TFLite
    raise BackendUnavailableError(
        f"backend {backend!r} does not apply to .tflite models (use 'xnnpack' or 'cpu')"
    )


def onnx_providers(
    profile: HardwareProfile, backend: str | None = None
) -> list[tuple[str, dict[str, Any]]]:
    """The onnxruntime ``(provider, options)`` entries of the ``.onnx`` order, best first.

    The OpenVINO runtime's entries, tried before or between them, are left out; see
    :func:`backend_order` for the whole order.

    Raises:
        ValueError: ``backend`` is not a known name.
        BackendUnavailableError: ``backend`` is ``'tflite'``.
    """
    return [
        (c.provider, dict(c.options))
        for c in backend_order(profile, "onnx", backend)
        if c.backend == "onnxruntime"
    ]


def load_runner(
    model_path: Path,
    profile: HardwareProfile,
    *,
    backend: str | None = None,
    threads: int | None = None,
    cache_dir: Path | None = None,
) -> ModelRunner:
    """Open ``model_path`` with the first backend of the profile's order that works here.

    Args:
        model_path: a ``.onnx`` or ``.tflite`` file.
        profile: the hardware profile in force (thread defaults, backend order).
        backend: ``None`` for the profile's order; ``'onnxruntime'``, ``'openvino'`` or
            ``'tflite'`` to insist on a runtime (``'openvino'`` falls back to the rest of the
            order); or a provider's short name (``'cpu'``, ``'cuda'``, ``'tensorrt'``,
            ``'coreml'``, ``'openvino-ep'``, ``'xnnpack'``...) to try that provider first, even
            when the profile marks it ``opt_in`` (see :func:`backend_order`).
        threads: intra-op threads; ``None`` takes the profile's ``intra_op_threads``; 0 means
            :func:`auto_threads` (half the CPUs this process may use, at least one).
        cache_dir: the agent's cache directory: engine and compiled-model caches go below
            it (``openvino/`` for the OpenVINO runtime); None: no caches.

    Raises:
        ModelLoadError: unknown extension, or the model does not load on the last backend of
            the order.
        BackendUnavailableError: the backend does not fit the format, the profile does not
            list the format, or no backend of the order can be used here.
        ValueError: ``backend`` is not a known name, or the last entry's options are invalid
            (an entry before the last with invalid options is skipped like one not installed).
        OSError: the last entry's cache directory cannot be created.
    """
    fmt = model_format(model_path)
    if fmt not in profile.runtime.formats:
        raise BackendUnavailableError(
            f"{model_path.name}: profile {profile.name!r} does not run {fmt} models "
            f"(formats: {', '.join(profile.runtime.formats)})"
        )
    try:
        order = backend_order(profile, fmt, backend)
    except BackendUnavailableError as e:
        raise BackendUnavailableError(f"{model_path.name}: {e}") from None
    intra = profile.runtime.intra_op_threads if threads is None else threads
    if intra == 0:
        # Half the CPUs this process may use: the event loop, the HTTP parsing and other
        # instances need the rest. On a 2-core box one backend thread halves the CPU per
        # request against onnxruntime's own choice (bench/local_inference.py).
        intra = auto_threads()
    skipped: list[str] = []
    start = 0
    while start < len(order):
        choice = order[start]
        end = start + 1
        if choice.backend == "onnxruntime":
            while end < len(order) and order[end].backend == "onnxruntime":
                end += 1
        last = end == len(order)
        try:
            if choice.backend == "onnxruntime":
                providers = _ort_providers(model_path, order[start:end], cache_dir, skipped)
                # Logs the one warning line itself, naming what was skipped before it too.
                return OnnxRunner(
                    model_path,
                    providers=providers,
                    intra_op_threads=intra,
                    inter_op_threads=profile.runtime.inter_op_threads,
                    allow_spinning=profile.runtime.allow_spinning,
                    fallback_to_cpu=last,
                    skipped=skipped,
                )
            reason = "; ".join(skipped) if skipped else None
            runner = _open_other(model_path, choice, intra, cache_dir, reason)
        except (BackendUnavailableError, ModelLoadError, ValueError, OSError) as e:
            # ValueError/OSError: the entry's options do not fit the backend, or its cache
            # directory cannot be made.
            if last:
                raise
            if choice.backend == "onnxruntime":
                skipped.append(_without_label(model_path, e))
            else:
                skipped.append(f"{choice.label}: {_without_label(model_path, e)}")
            start = end
            continue
        if reason is not None:
            log.warning("%s: running on %s; skipped %s", model_path.name, choice.label, reason)
        return runner
    # Unreachable: every order has at least one entry, and the last one's failure raises.
    raise BackendUnavailableError(f"{model_path.name}: no backend to try")


def _ort_providers(
    model_path: Path, group: list[BackendChoice], cache_dir: Path | None, skipped: list[str]
) -> list[tuple[str, dict[str, Any]]]:
    """The group's ``(provider, options)``; a provider whose options do not build is left out
    with its reason added to ``skipped``. Options are built only for providers this
    onnxruntime offers; the runner reports the others as missing."""
    offered = set(ort.get_available_providers())
    providers: list[tuple[str, dict[str, Any]]] = []
    for c in group:
        if c.provider not in offered:
            providers.append((c.provider, dict(c.options)))
            continue
        try:
            options = provider_options(
                c.provider, c.options, cache_dir=cache_dir, model_path=model_path
            )
        except (ValueError, OSError) as e:
            if c.provider == CPU_PROVIDER:  # the provider of last resort: opened as it comes
                skipped.append(f"{e}; {CPU_PROVIDER} opened with its default options")
                providers.append((CPU_PROVIDER, {}))
            else:
                skipped.append(str(e))
            continue
        providers.append((c.provider, options))
    return providers


def _open_other(
    model_path: Path,
    choice: BackendChoice,
    threads: int,
    cache_dir: Path | None,
    fallback_reason: str | None,
) -> ModelRunner:
    if choice.backend == "openvino":
        config = dict(choice.options)
        if cache_dir is not None and "CACHE_DIR" not in config:
            config["CACHE_DIR"] = os.fspath(cache_dir / "openvino")
        return OpenVINORunner(
            model_path,
            device=choice.provider,
            config=config,
            num_threads=threads,
            fallback_reason=fallback_reason,
        )
    implementation = choice.options.get("implementation")
    if implementation is not None and not isinstance(implementation, str):
        raise ValueError(f"options.implementation must be a string, not {implementation!r}")
    return TFLiteRunner(
        model_path,
        num_threads=threads,
        use_xnnpack=choice.provider.upper() == "XNNPACK",
        implementation=implementation,
        fallback_reason=fallback_reason,
    )


def _without_label(model_path: Path, error: Exception) -> str:
    return str(error).removeprefix(f"{model_path.name}: ")


def backend_available(name: str) -> str | None:
    """Whether a backend can be used here: None when it can, else the reason it cannot.

    ``name`` is a runtime (``onnxruntime``, ``openvino``, ``tflite``) or a provider's short
    or full name (``tensorrt``, ``CUDAExecutionProvider``, ``openvino-ep``...); ``xnnpack``
    is usable when a TFLite interpreter (its XNNPACK delegate) or onnxruntime's XNNPACK
    provider is here. An unknown name gives a reason too.
    """
    key = name.lower()
    if key == "onnxruntime":
        return None
    if key == "tflite":
        try:
            tflite_implementation()
        except BackendUnavailableError as e:
            return str(e)
        return None
    if key == "openvino":
        try:
            devices = openvino_devices()
        except BackendUnavailableError as e:
            return str(e)
        return None if devices else "the OpenVINO runtime sees no device here"
    try:
        provider = provider_alias(name)
    except ValueError as e:
        return str(e)
    offered = ort.get_available_providers()
    if provider in offered:
        return None
    if key == "xnnpack" and backend_available("tflite") is None:
        return None
    return f"{provider} is not in this onnxruntime build (it offers {', '.join(offered)})"


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
        ``{"onnxruntime": "<version>: <providers>", "openvino": "<version>: <devices>",
        "tflite": "<implementation> <version>"}``, with ``"unavailable: <reason>"`` for
        OpenVINO or TFLite when it does not import (onnxruntime is a hard dependency), and
        ``"tflite (<name>)"`` for the other TFLite interpreter when it is installed too (its
        version, or why it cannot run here).
    """
    providers = ", ".join(ort.get_available_providers())
    found = {"onnxruntime": f"{ort.__version__}: {providers}"}
    try:
        found["openvino"] = f"{openvino_version()}: {', '.join(openvino_devices())}"
    except BackendUnavailableError as e:
        found["openvino"] = f"unavailable: {e}"
    try:
        _, implementation = tflite_implementation()
        found["tflite"] = f"{implementation} {tflite_version(implementation)}"
    except BackendUnavailableError as e:
        found["tflite"] = f"unavailable: {e}"
    for name in TFLITE_IMPLEMENTATIONS:  # each interpreter that is installed, usable or not
        if name in found["tflite"] or tflite_version(name) == "unknown":
            continue
        try:
            tflite_implementation(name)
            found[f"tflite ({name})"] = f"{name} {tflite_version(name)}"
        except BackendUnavailableError as e:
            found[f"tflite ({name})"] = f"unavailable: {e}"
    return found
