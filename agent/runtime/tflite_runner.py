"""The TFLite backend: :class:`TFLiteRunner` over ai-edge-litert or tflite-runtime.

Two interpreters implement the same Python API: ai-edge-litert (LiteRT, module
``ai_edge_litert.interpreter``) and the older tflite-runtime (``tflite_runtime.interpreter``).
A runner uses the one it is told to, else ai-edge-litert when it works here, else
tflite-runtime. An implementation counts as usable only once it has run a built-in
192-byte model (one tensor, no operators): tflite-runtime 2.14, the last release, imports
under NumPy 2 but cannot create an interpreter there (it was built against NumPy 1.x).

A TFLite interpreter is not thread-safe (``invoke`` releases the GIL, and tensors are resized
in place), so :meth:`TFLiteRunner.run` holds a lock from resize to the last output copy.
Models whose ``shape_signature`` has -1 dims (usually the batch) are resized to each feed's
shape, and reallocated only when that shape changes.

XNNPACK: both interpreters apply their default XNNPACK delegate on the first
``allocate_tensors`` unless the op resolver is ``BUILTIN_WITHOUT_DEFAULT_DELEGATES``, and
both size its thread pool from ``num_threads``. The runner reports ``XNNPACK`` only when a
delegate node is seen in the interpreter's node list after allocation, ``CPU`` (builtin
kernels) otherwise; see ``info.details["delegate_nodes"]`` (``None`` where the interpreter
cannot list its nodes, and ``details["delegate_detection"]`` says so).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.metadata
import io
import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
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
from mcp_edge.shared.errors import MessageError
from mcp_edge.shared.protocol.wire import Datatype

log = logging.getLogger("mcp.agent.runtime")

INSTALL_HINT = "pip install 'mcp-edge[tflite]'"
"""How to install ai-edge-litert, the preferred interpreter."""


@dataclass(frozen=True)
class _Implementation:
    module: str
    install_hint: str


_IMPLEMENTATIONS: Mapping[str, _Implementation] = {
    "ai-edge-litert": _Implementation("ai_edge_litert.interpreter", INSTALL_HINT),
    "tflite-runtime": _Implementation(
        "tflite_runtime.interpreter", "pip install 'mcp-edge[tflite-runtime]'"
    ),
}

TFLITE_IMPLEMENTATIONS = tuple(_IMPLEMENTATIONS)
"""Names ``implementation`` accepts (distribution names), in the order ``None`` tries them."""

# The smallest model both interpreters accept: one float32 tensor of shape [1] that is the
# subgraph's input and output, no operators, schema version 3 (written with the TFLite schema).
_PROBE_MODEL = bytes.fromhex(
    "1800000054464c3300000e00140010000c000800000004000e000000100000001c0000009800000003"
    "0000000100000008000000040004000400000001000000100000000c00140010000c00080004000c00"
    "00001000000010000000140000001800000000000000010000000000000001000000000000000100"
    "000018000000140010000c000000000008000000000000000400140000000c000000100000001400"
    "000001000000010000000100000078000000010000000100000000000000"
)


def tflite_implementation(name: str | None = None) -> tuple[ModuleType, str]:
    """The interpreter module to use and its distribution name.

    Args:
        name: ``'ai-edge-litert'`` or ``'tflite-runtime'``; ``None`` takes the first of
            them that works here, ai-edge-litert first.

    Raises:
        ValueError: ``name`` is not one of :data:`TFLITE_IMPLEMENTATIONS`.
        BackendUnavailableError: the named implementation (or, for ``None``, every one) does
            not import or cannot run a model here; the message gives the reason and how to
            install it.
    """
    if name is not None and name not in _IMPLEMENTATIONS:
        raise ValueError(
            f"unknown TFLite implementation {name!r}; known: {', '.join(TFLITE_IMPLEMENTATIONS)}"
        )
    names = TFLITE_IMPLEMENTATIONS if name is None else (name,)
    reasons = []
    for candidate in names:
        module, reason = _usable(candidate)
        if module is not None:
            return module, candidate
        reasons.append(reason)
    if name is not None:
        raise BackendUnavailableError(f"{reasons[0]}; {_IMPLEMENTATIONS[name].install_hint}")
    raise BackendUnavailableError(
        f"no TFLite interpreter works here ({'; '.join(reasons)}); {INSTALL_HINT}"
    )


@functools.cache
def _usable(name: str) -> tuple[ModuleType | None, str]:
    """(module, '') when implementation ``name`` imports and runs the probe model, else
    (None, the reason). Cached: the answer holds for the life of the process."""
    try:
        module = importlib.import_module(_IMPLEMENTATIONS[name].module)
    except ImportError as e:
        return None, f"{name} is not installed ({e})"
    # NumPy writes a page of advice and a stack to stderr when a NumPy 1 build fails to load
    # under NumPy 2; the reason returned says it in one line, so keep the page off the console.
    noise = io.StringIO()
    try:
        with contextlib.redirect_stderr(noise):
            interpreter = module.Interpreter(
                model_content=_PROBE_MODEL,
                experimental_op_resolver_type=module.OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES,
            )
        interpreter.allocate_tensors()
        (detail,) = interpreter.get_input_details()
        interpreter.set_tensor(detail["index"], np.ones(1, np.float32))
        interpreter.invoke()
    except Exception as e:
        log.debug("%s probe failed; it wrote: %s", name, noise.getvalue().strip())
        return None, f"{name} {tflite_version(name)} imports but cannot run a model here: {_why(e)}"
    return module, ""


def _why(error: BaseException) -> str:
    causes = [error]
    while causes[-1].__cause__ is not None and len(causes) < 5:
        causes.append(causes[-1].__cause__)
    if any(isinstance(c, ImportError) and "numpy" in str(c) for c in causes):
        return (
            f"it was built against NumPy 1.x and NumPy {np.__version__} is installed "
            "(install numpy<2 beside it, or use ai-edge-litert)"
        )
    return f"{type(causes[-1]).__name__}: {causes[-1]}"


def tflite_version(distribution: str) -> str:
    """The installed version of ``distribution``, or ``'unknown'``."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _spec(model: str, name: str, detail: Mapping[str, Any]) -> TensorSpec:
    try:
        datatype = Datatype.from_numpy(np.dtype(detail["dtype"]))
    except MessageError as e:
        raise ModelLoadError(f"{model}: tensor {name!r}: {e}") from e
    signature = detail.get("shape_signature")
    shape = signature if signature is not None and len(signature) else detail["shape"]
    return TensorSpec(name, datatype, tuple(int(d) for d in shape))


class TFLiteRunner:
    """One TFLite interpreter behind the :class:`~agent.runtime.runner.ModelRunner` interface.

    Tensor names come from the model's signature when it has exactly one over the main
    subgraph (the names a converter user chose), else from the tensors themselves. Inputs of
    quantized models are fed as stored (int8/uint8); the runner does not quantize.

    Args:
        path: the ``.tflite`` file.
        num_threads: threads for the CPU kernels and XNNPACK; ``None`` or 0 keeps the
            interpreter's default (one thread in ai-edge-litert's Python wrapper, the C++
            default in tflite-runtime's). Recorded in ``info.details["num_threads"]``.
        use_xnnpack: let the interpreter apply its default XNNPACK delegate; False runs the
            builtin kernels only.
        implementation: ``'ai-edge-litert'`` or ``'tflite-runtime'``; ``None`` takes
            ai-edge-litert when it works here, else tflite-runtime.
        fallback_reason: why the caller did not get a backend it preferred; it leads the
            runner's own reason in ``info.fallback_reason``.

    Raises:
        ValueError: ``implementation`` is unknown, or ``num_threads`` is negative.
        BackendUnavailableError: the interpreter asked for (or, for ``None``, every one) is
            not installed or cannot run here.
        ModelLoadError: the file does not load or allocate, or a tensor's dtype has no
            Open Inference Protocol datatype.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        num_threads: int | None = None,
        use_xnnpack: bool = True,
        implementation: str | None = None,
        fallback_reason: str | None = None,
    ) -> None:
        if num_threads is not None and num_threads < 0:
            raise ValueError(f"num_threads must be 0 (default) or more, not {num_threads}")
        module, implementation = tflite_implementation(implementation)
        self._label = os.path.basename(os.fspath(path))
        self._lock = threading.Lock()
        resolver = "AUTO" if use_xnnpack else "BUILTIN_WITHOUT_DEFAULT_DELEGATES"
        try:
            interpreter = module.Interpreter(
                model_path=os.fspath(path),
                num_threads=num_threads or None,
                experimental_op_resolver_type=getattr(module.OpResolverType, resolver),
            )
            interpreter.allocate_tensors()
            inputs, self._input_indices, outputs, self._output_indices = self._signature(
                interpreter
            )
        except (SystemError, ImportError) as e:
            # The probe ran a model, so this is unexpected; still an environment problem.
            raise BackendUnavailableError(
                f"{self._label}: {implementation} cannot create an interpreter: {_why(e)}"
            ) from e
        except (ValueError, RuntimeError) as e:
            raise ModelLoadError(f"{self._label}: TFLite cannot load the model: {e}") from e
        self._interpreter: Any = interpreter
        self._input_names = tuple(spec.name for spec in inputs)
        self._output_names = tuple(spec.name for spec in outputs)
        self._single_output = self._output_names[0] if len(outputs) == 1 else None
        self._allocated: tuple[tuple[int, ...], ...] | None = None
        self._validator = InputValidator(self._label, inputs)

        delegate_nodes = self._count_delegate_nodes(interpreter)
        own_reason = None
        if not use_xnnpack:
            provider = "CPU"
        elif delegate_nodes is None:
            provider = "XNNPACK"  # on by default; this interpreter cannot show its nodes
        elif delegate_nodes:
            provider = "XNNPACK"
        else:
            provider = "CPU"
            own_reason = "XNNPACK delegated no node (unsupported ops, or a build without it)"
            log.warning("%s: running on TFLite CPU kernels; %s", self._label, own_reason)
        reasons = [r for r in (fallback_reason, own_reason) if r]
        self._info = RunnerInfo(
            backend="tflite",
            provider=provider,
            inputs=inputs,
            outputs=outputs,
            batchable=bool(inputs) and all(s.shape[:1] == (-1,) for s in inputs),
            fallback_reason="; ".join(reasons) or None,
            details={
                "model": self._label,
                "implementation": implementation,
                "version": tflite_version(implementation),
                "num_threads": num_threads or None,
                "op_resolver": resolver,
                "delegate_nodes": delegate_nodes,
                "delegate_detection": (
                    "node list"
                    if delegate_nodes is not None
                    else f"unavailable ({implementation} does not list its nodes)"
                ),
            },
        )

    def _signature(
        self, interpreter: Any
    ) -> tuple[tuple[TensorSpec, ...], tuple[int, ...], tuple[TensorSpec, ...], tuple[int, ...]]:
        in_details = {d["index"]: d for d in interpreter.get_input_details()}
        out_details = {d["index"]: d for d in interpreter.get_output_details()}
        in_names = {index: str(d["name"]) for index, d in in_details.items()}
        out_names = {index: str(d["name"]) for index, d in out_details.items()}
        signatures = interpreter.get_signature_list()
        if len(signatures) == 1:
            runner = interpreter.get_signature_runner(next(iter(signatures)))
            sig_in = {d["index"]: name for name, d in runner.get_input_details().items()}
            sig_out = {d["index"]: name for name, d in runner.get_output_details().items()}
            # The runner holds a reference to the native interpreter, and TFLite refuses to
            # invoke while any such reference is alive.
            del runner
            if sig_in.keys() == in_names.keys() and sig_out.keys() == out_names.keys():
                in_names, out_names = sig_in, sig_out
        inputs = tuple(_spec(self._label, in_names[i], in_details[i]) for i in in_names)
        outputs = tuple(_spec(self._label, out_names[i], out_details[i]) for i in out_names)
        return inputs, tuple(in_names), outputs, tuple(out_names)

    @staticmethod
    def _count_delegate_nodes(interpreter: Any) -> int | None:
        # No public API says whether a delegate was applied; the node list after
        # allocate_tensors shows one DELEGATE node per delegated partition.
        ops_details = getattr(interpreter, "_get_ops_details", None)
        if ops_details is None:
            return None
        try:
            return sum(1 for op in ops_details() if op.get("op_name") == "DELEGATE")
        except Exception:
            return None

    @property
    def info(self) -> RunnerInfo:
        """What was loaded: delegate in use, signature, batchability, fallback reason."""
        return self._info

    def run(self, feeds: dict[str, Array]) -> dict[str, Array]:
        """Run one (possibly batched) inference; calls from several threads are serialized.

        Args:
            feeds: one numpy array per model input, by input name.

        Returns:
            One array per model output, by output name (copies the caller may keep).

        Raises:
            InputError: the feeds do not fit the signature, or TFLite refuses their shape.
            InferenceError: the run failed, or the runner is closed.
        """
        checked = self._validator.check(feeds)
        shapes = tuple(checked[name].shape for name in self._input_names)
        with self._lock:
            interpreter = self._interpreter
            if interpreter is None:
                raise InferenceError(f"{self._label}: the runner is closed")
            if shapes != self._allocated:
                self._resize(interpreter, shapes)
            try:
                for index, name in zip(self._input_indices, self._input_names, strict=True):
                    interpreter.set_tensor(index, checked[name])
                interpreter.invoke()
                results = [interpreter.get_tensor(index) for index in self._output_indices]
            except (ValueError, RuntimeError) as e:
                raise InferenceError(f"{self._label}: inference failed: {e}") from e
        if self._single_output is not None:
            return {self._single_output: results[0]}
        return dict(zip(self._output_names, results, strict=True))

    def _resize(self, interpreter: Any, shapes: tuple[tuple[int, ...], ...]) -> None:
        # Called under the lock. Forget the old size first: a failure half-way leaves the
        # tensors in an unknown state, and the next call must resize again.
        self._allocated = None
        try:
            for index, shape in zip(self._input_indices, shapes, strict=True):
                interpreter.resize_tensor_input(index, list(shape), strict=True)
        except (ValueError, RuntimeError) as e:
            raise InputError(f"{self._label}: cannot resize inputs to {list(shapes)}: {e}") from e
        try:
            interpreter.allocate_tensors()
        except (ValueError, RuntimeError) as e:
            raise InferenceError(f"{self._label}: cannot allocate for {list(shapes)}: {e}") from e
        self._allocated = shapes

    def close(self) -> None:
        """Release the interpreter; later ``run`` calls raise :class:`InferenceError`."""
        with self._lock:
            self._interpreter = None
