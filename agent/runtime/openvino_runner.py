"""The OpenVINO backend: :class:`OpenVINORunner`, the OpenVINO runtime reading ``.onnx`` itself.

OpenVINO compiles the model once for a device (``CPU``, ``GPU``, ``AUTO``); each call runs on
an *infer request*, which is not safe to share between threads. The runner keeps a pool of
them in a queue: a call takes one, runs it and puts it back, so concurrent callers each get
their own (and wait for one when all are busy). The pool holds the compiled model's optimal
number of infer requests (one on a CPU under the ``LATENCY`` hint, one per stream under
``THROUGHPUT``).

Feeds are checked by the same :class:`~agent.runtime.onnx_runner.InputValidator` as
onnxruntime's, so both backends accept and refuse exactly the same feeds. Inputs are handed to
OpenVINO without a copy; outputs are copied out of the request before it is reused.

CPU defaults (:data:`CPU_DEFAULTS`, overridden by the profile entry's ``options``):
``PERFORMANCE_HINT=LATENCY`` (one stream using every thread the runner is given: the batcher
already stacks concurrent requests into one call, and ``THROUGHPUT`` splits the threads across
streams, so each call gets fewer), ``INFERENCE_PRECISION_HINT=f32`` (OpenVINO picks bf16 on
CPUs with AVX512-BF16 or AMX, which moves probabilities by about 1e-3: answers would differ from
onnxruntime's and from the bundle's output checks; a profile may ask for ``bf16``), and
``INFERENCE_NUM_THREADS`` from ``num_threads``.

One option is the runner's own rather than OpenVINO's: ``prefer_bf16 = true`` (the Xeon
profile sets it) asks for ``INFERENCE_PRECISION_HINT=bf16`` when the CPU lists ``BF16`` among
its optimization capabilities (AVX512-BF16, AMX) and keeps ``f32`` otherwise; the choice and
why are in ``info.details["precision"]``. On the trained digits convnet bf16 is about 2x f32
with the same held-out accuracy (``bench/backends.py``); the install-time output checks compare
its answers with the reference before it serves.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
import queue
import threading
from collections.abc import Mapping
from types import ModuleType
from typing import Any

import numpy as np

from mcp_edge.agent.runtime.onnx_runner import InputValidator
from mcp_edge.agent.runtime.runner import (
    Array,
    BackendUnavailableError,
    InferenceError,
    InputError,
    ModelLoadError,
    RunnerInfo,
    TensorSpec,
)
from mcp_edge.shared.protocol.wire import Datatype

log = logging.getLogger("mcp.agent.runtime")

INSTALL_HINT = "pip install 'mcp-edge[openvino]'"

CPU_DEFAULTS: Mapping[str, Any] = {
    "PERFORMANCE_HINT": "LATENCY",
    "INFERENCE_PRECISION_HINT": "f32",
}
"""Config the runner applies on the ``CPU`` device unless the caller's ``config`` says otherwise."""
PREFER_BF16 = "prefer_bf16"
"""The runner's own option (not an OpenVINO property): bf16 where the CPU supports it."""
OTHER_DEFAULTS: Mapping[str, Any] = {"PERFORMANCE_HINT": "LATENCY"}
"""Config applied on other devices (``GPU``, ``AUTO``...), which take no thread count."""

MAX_INFER_REQUESTS = 64
"""Most infer requests one runner keeps, whatever the device suggests."""

_TYPES: dict[str, Datatype] = {
    "boolean": Datatype.BOOL,
    "u8": Datatype.UINT8,
    "u16": Datatype.UINT16,
    "u32": Datatype.UINT32,
    "u64": Datatype.UINT64,
    "i8": Datatype.INT8,
    "i16": Datatype.INT16,
    "i32": Datatype.INT32,
    "i64": Datatype.INT64,
    "f16": Datatype.FP16,
    "f32": Datatype.FP32,
    "f64": Datatype.FP64,
}
# String tensors are left out: OpenVINO converts them through its own string type, not numpy
# arrays; such models load on onnxruntime instead (the loader falls back).

# The properties read back from the compiled model for ``info.details`` (those present).
_REPORTED = (
    "PERFORMANCE_HINT",
    "INFERENCE_NUM_THREADS",
    "INFERENCE_PRECISION_HINT",
    "NUM_STREAMS",
    "EXECUTION_DEVICES",
    "OPTIMAL_NUMBER_OF_INFER_REQUESTS",
)

_core_lock = threading.Lock()
_core: Any = None


def openvino_module() -> ModuleType:
    """The ``openvino`` module.

    Raises:
        BackendUnavailableError: the OpenVINO runtime does not import here.
    """
    try:
        return importlib.import_module("openvino")
    except ImportError as e:
        raise BackendUnavailableError(
            f"the OpenVINO runtime is not installed ({e}); {INSTALL_HINT}"
        ) from None


def openvino_version() -> str:
    """The installed OpenVINO release (``2026.4.1``), or ``'unknown'``."""
    try:
        return importlib.metadata.version("openvino")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _capabilities(core: Any, device: str) -> list[str]:
    """The device's ``OPTIMIZATION_CAPABILITIES`` (``BF16``, ``INT8``...), empty when unknown."""
    try:
        return [str(c) for c in core.get_property(device, "OPTIMIZATION_CAPABILITIES")]
    except Exception:
        return []


def openvino_core() -> Any:
    """The process's one ``openvino.Core`` (it caches plugins; compiling on it is thread-safe).

    Raises:
        BackendUnavailableError: OpenVINO does not import or its core fails to start.
    """
    global _core
    with _core_lock:
        if _core is None:
            module = openvino_module()
            try:
                _core = module.Core()
            except Exception as e:
                raise BackendUnavailableError(
                    f"the OpenVINO runtime failed to start: {_first_line(e)}"
                ) from e
        return _core


def openvino_devices() -> list[str]:
    """The devices OpenVINO can compile for here (``['CPU']``, ``['CPU', 'GPU']``...).

    Raises:
        BackendUnavailableError: OpenVINO does not import or its core fails to start.
    """
    return [str(d) for d in openvino_core().available_devices]


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    # OpenVINO prefixes its messages with "Exception from src/...cpp:NN:" lines.
    useful = [line for line in lines if not line.startswith(("Exception from ", "Check '"))]
    return (useful or lines or [type(error).__name__])[0]


def _property_text(value: Any) -> Any:
    if isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "get_type_name"):  # an element type: INFERENCE_PRECISION_HINT
        return str(value.get_type_name())
    if isinstance(value, (list, tuple)):
        return [str(v) for v in value]
    return str(value)


def _config_value(value: Any) -> Any:
    # TOML gives bool/int/float/str; OpenVINO parses booleans from "YES"/"NO".
    if isinstance(value, bool):
        return "YES" if value else "NO"
    if isinstance(value, (int, float, str)):
        return value
    return str(value)


class OpenVINORunner:
    """One model compiled by the OpenVINO runtime behind the ``ModelRunner`` interface.

    Args:
        path: the ``.onnx`` file (OpenVINO also reads its own ``.xml`` IR).
        device: the OpenVINO device to compile for: ``CPU``, ``GPU``, ``AUTO``...
        config: OpenVINO properties (``PERFORMANCE_HINT``, ``NUM_STREAMS``,
            ``INFERENCE_PRECISION_HINT``, ``CACHE_DIR``...); they override the runner's
            defaults (:data:`CPU_DEFAULTS`).
        num_threads: ``INFERENCE_NUM_THREADS`` on the CPU device unless ``config`` sets it;
            ``None`` or 0 lets OpenVINO use every core.
        fallback_reason: why the backends before this one were skipped (set by the loader;
            kept in ``info.fallback_reason``).

    Raises:
        BackendUnavailableError: OpenVINO is not installed, or ``device`` is not one it has.
        ModelLoadError: the file does not read or compile, or a tensor has a type or shape the
            runner cannot carry (string tensors, dynamic rank).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        device: str = "CPU",
        config: Mapping[str, Any] | None = None,
        num_threads: int | None = None,
        fallback_reason: str | None = None,
    ) -> None:
        module = openvino_module()
        core = openvino_core()
        self._label = os.path.basename(os.fspath(path))
        self._tensor_type = module.Tensor
        device_kind = device.split(".", 1)[0].upper()
        applied: dict[str, Any] = dict(CPU_DEFAULTS if device_kind == "CPU" else OTHER_DEFAULTS)
        if device_kind == "CPU" and num_threads:
            applied["INFERENCE_NUM_THREADS"] = int(num_threads)
        wanted = dict(config or {})
        precision_note = None
        prefer_bf16 = wanted.pop(PREFER_BF16, False)
        if not isinstance(prefer_bf16, bool):
            raise ModelLoadError(f"{self._label}: option {PREFER_BF16} must be true or false")
        if prefer_bf16 and "INFERENCE_PRECISION_HINT" not in wanted and device_kind == "CPU":
            capabilities = _capabilities(core, device)
            if "BF16" in capabilities:
                applied["INFERENCE_PRECISION_HINT"] = "bf16"
                precision_note = "bf16 (prefer_bf16; the CPU lists BF16)"
            else:
                precision_note = "f32 (prefer_bf16, but the CPU does not list BF16)"
        applied.update(wanted)
        applied = {key: _config_value(value) for key, value in applied.items()}
        known = [str(d) for d in core.available_devices]
        if device_kind not in ("AUTO", "MULTI", "HETERO") and not any(
            d == device or d.split(".", 1)[0] == device_kind for d in known
        ):
            raise BackendUnavailableError(
                f"{self._label}: OpenVINO has no {device} device here "
                f"(devices: {', '.join(known) or 'none'})"
            )
        try:
            model = core.read_model(os.fspath(path))
        except Exception as e:
            raise ModelLoadError(
                f"{self._label}: OpenVINO cannot read the model: {_first_line(e)}"
            ) from e
        # Names come from the model as read: compiling adds internal aliases (``cast_input``).
        inputs = tuple(self._spec(port, "input") for port in model.inputs)
        outputs = tuple(self._spec(port, "output") for port in model.outputs)
        try:
            compiled = core.compile_model(model, device, applied)
        except Exception as e:
            raise ModelLoadError(
                f"{self._label}: OpenVINO cannot compile the model for {device}: {_first_line(e)}"
            ) from e
        properties = self._read_back(compiled)
        count = properties.get("OPTIMAL_NUMBER_OF_INFER_REQUESTS")
        size = min(MAX_INFER_REQUESTS, max(1, count if isinstance(count, int) else 1))
        pool: queue.SimpleQueue[Any] = queue.SimpleQueue()
        try:
            for _ in range(size):
                pool.put(compiled.create_infer_request())
        except Exception as e:
            raise ModelLoadError(
                f"{self._label}: OpenVINO cannot create an infer request: {_first_line(e)}"
            ) from e
        self._compiled: Any = compiled
        self._requests: queue.SimpleQueue[Any] | None = pool
        self._input_names = tuple(spec.name for spec in inputs)
        self._output_names = tuple(spec.name for spec in outputs)
        self._single_input = self._input_names[0] if len(inputs) == 1 else None
        self._single_output = self._output_names[0] if len(outputs) == 1 else None
        self._validator = InputValidator(self._label, inputs)
        self._info = RunnerInfo(
            backend="openvino",
            provider=device,
            inputs=inputs,
            outputs=outputs,
            batchable=bool(inputs) and all(s.shape[:1] == (-1,) for s in inputs),
            fallback_reason=fallback_reason,
            details={
                "model": self._label,
                "openvino": openvino_version(),
                "device": device,
                "config_requested": dict(applied),
                "config": properties,
                "infer_requests": size,
                "precision": precision_note
                or str(properties.get("INFERENCE_PRECISION_HINT", "device default")),
            },
        )

    def _spec(self, port: Any, kind: str) -> TensorSpec:
        name = port.get_any_name()
        type_name = port.get_element_type().get_type_name()
        datatype = _TYPES.get(type_name)
        if datatype is None:
            raise ModelLoadError(
                f"{self._label}: {kind} {name!r} has element type {type_name}, which the "
                "OpenVINO runner cannot carry"
            )
        shape = port.get_partial_shape()
        if shape.rank.is_dynamic:
            raise ModelLoadError(f"{self._label}: {kind} {name!r} has no fixed rank")
        dims = tuple(d.get_length() if d.is_static else -1 for d in shape)
        return TensorSpec(name, datatype, dims)

    @staticmethod
    def _read_back(compiled: Any) -> dict[str, Any]:
        try:
            supported = set(compiled.get_property("SUPPORTED_PROPERTIES"))
        except Exception:
            supported = set()
        found: dict[str, Any] = {}
        for key in _REPORTED:
            if key not in supported:
                continue
            try:
                found[key] = _property_text(compiled.get_property(key))
            except Exception:
                continue
        return found

    @property
    def info(self) -> RunnerInfo:
        """What was loaded: device, signature, batchability, applied config, fallback reason."""
        return self._info

    def run(self, feeds: dict[str, Array]) -> dict[str, Array]:
        """Run one (possibly batched) inference; safe from several threads at once.

        Args:
            feeds: one numpy array per model input, by input name.

        Returns:
            One array per model output, by output name (copies the caller may keep).

        Raises:
            InputError: the feeds do not fit the signature (see ``InputValidator``), or
                OpenVINO refuses their shape.
            InferenceError: the run failed, or the runner is closed.
        """
        requests = self._requests
        if requests is None:
            raise InferenceError(f"{self._label}: the runner is closed")
        checked = self._validator.check(feeds)
        tensor = self._tensor_type
        request = requests.get()
        try:
            try:
                if self._single_input is not None:
                    array = checked[self._single_input]
                    if not array.flags.c_contiguous:
                        array = np.ascontiguousarray(array)
                    # Shared only when writeable: OpenVINO refuses to share a read-only array
                    # (a binary request's tensor is a view of the request body), so copy it.
                    request.set_input_tensor(
                        tensor(array, shared_memory=bool(array.flags.writeable))
                    )
                else:
                    for index, name in enumerate(self._input_names):
                        array = checked[name]
                        if not array.flags.c_contiguous:
                            array = np.ascontiguousarray(array)
                        shared = bool(array.flags.writeable)
                        request.set_input_tensor(index, tensor(array, shared_memory=shared))
            except Exception as e:
                raise InputError(f"{self._label}: {_first_line(e)}") from e
            try:
                request.infer(share_outputs=True)
            except Exception as e:
                raise InferenceError(f"{self._label}: inference failed: {_first_line(e)}") from e
            if self._single_output is not None:
                return {self._single_output: request.get_output_tensor(0).data.copy()}
            return {
                name: request.get_output_tensor(index).data.copy()
                for index, name in enumerate(self._output_names)
            }
        finally:
            requests.put(request)

    def close(self) -> None:
        """Drop the compiled model; later ``run`` calls raise :class:`InferenceError`.

        Calls already running finish on their infer request.
        """
        self._requests = None
        self._compiled = None
