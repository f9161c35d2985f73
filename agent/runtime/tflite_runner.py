"""The TFLite backend: :class:`TFLiteRunner` over ai-edge-litert (or tflite-runtime).

A TFLite interpreter is not thread-safe (``invoke`` releases the GIL, and tensors are resized
in place), so :meth:`TFLiteRunner.run` holds a lock from resize to the last output copy.
Models whose ``shape_signature`` has -1 dims (usually the batch) are resized to each feed's
shape, and reallocated only when that shape changes.

XNNPACK: ai-edge-litert applies its default XNNPACK delegate on the first ``allocate_tensors``
unless the op resolver is ``BUILTIN_WITHOUT_DEFAULT_DELEGATES``. The runner reports
``XNNPACK`` only when a delegate node is seen in the interpreter's node list after allocation,
``CPU`` (builtin kernels) otherwise; see ``info.details["delegate_nodes"]``.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
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
from mcp_edge.shared.errors import MessageError
from mcp_edge.shared.protocol.wire import Datatype

log = logging.getLogger("mcp.agent.runtime")

INSTALL_HINT = "pip install 'mcp-edge[tflite]'"
_IMPLEMENTATIONS = (
    ("ai_edge_litert.interpreter", "ai-edge-litert"),
    ("tflite_runtime.interpreter", "tflite-runtime"),
)


def tflite_implementation() -> tuple[ModuleType, str]:
    """The interpreter module in use and its distribution name, ai-edge-litert preferred.

    Raises:
        BackendUnavailableError: neither ai-edge-litert nor tflite-runtime imports here.
    """
    reasons = []
    for module_name, distribution in _IMPLEMENTATIONS:
        try:
            return importlib.import_module(module_name), distribution
        except ImportError as e:
            reasons.append(f"{distribution}: {e}")
    raise BackendUnavailableError(
        f"no TFLite interpreter is installed ({'; '.join(reasons)}); {INSTALL_HINT}"
    )


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
            interpreter's default (one thread in ai-edge-litert's Python wrapper).
        use_xnnpack: let the interpreter apply its default XNNPACK delegate; False runs the
            builtin kernels only.

    Raises:
        BackendUnavailableError: no TFLite interpreter is installed.
        ModelLoadError: the file does not load or allocate, or a tensor's dtype has no
            Open Inference Protocol datatype.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        num_threads: int | None = None,
        use_xnnpack: bool = True,
    ) -> None:
        module, implementation = tflite_implementation()
        self._label = os.path.basename(os.fspath(path))
        self._lock = threading.Lock()
        resolver_type = getattr(module, "OpResolverType", None)
        kwargs: dict[str, Any] = {"num_threads": num_threads or None}
        resolver = "AUTO"
        if resolver_type is not None and not use_xnnpack:
            resolver = "BUILTIN_WITHOUT_DEFAULT_DELEGATES"
        if resolver_type is not None:
            kwargs["experimental_op_resolver_type"] = getattr(resolver_type, resolver)
        try:
            interpreter = module.Interpreter(model_path=os.fspath(path), **kwargs)
            interpreter.allocate_tensors()
            inputs, self._input_indices, outputs, self._output_indices = self._signature(
                interpreter
            )
        except (ValueError, RuntimeError) as e:
            raise ModelLoadError(f"{self._label}: TFLite cannot load the model: {e}") from e
        self._interpreter: Any = interpreter
        self._input_names = tuple(spec.name for spec in inputs)
        self._output_names = tuple(spec.name for spec in outputs)
        self._single_output = self._output_names[0] if len(outputs) == 1 else None
        self._allocated: tuple[tuple[int, ...], ...] | None = None
        self._validator = InputValidator(self._label, inputs)

        delegate_nodes = self._count_delegate_nodes(interpreter)
        fallback_reason = None
        if not use_xnnpack:
            provider = "CPU"
        elif delegate_nodes is None:
            provider = "XNNPACK"  # on by default; this interpreter cannot show its nodes
        elif delegate_nodes:
            provider = "XNNPACK"
        else:
            provider = "CPU"
            fallback_reason = "XNNPACK delegated no node (unsupported ops, or a build without it)"
            log.warning("%s: running on TFLite CPU kernels; %s", self._label, fallback_reason)
        self._info = RunnerInfo(
            backend="tflite",
            provider=provider,
            inputs=inputs,
            outputs=outputs,
            batchable=bool(inputs) and all(s.shape[:1] == (-1,) for s in inputs),
            fallback_reason=fallback_reason,
            details={
                "model": self._label,
                "implementation": implementation,
                "version": tflite_version(implementation),
                "num_threads": num_threads or None,
                "op_resolver": resolver,
                "delegate_nodes": delegate_nodes,
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
