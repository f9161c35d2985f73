"""The onnxruntime backend: :class:`OnnxRunner`, and the feed checks both backends share.

Execution providers are tried in the caller's order, keeping only those this onnxruntime build
offers; a provider that is missing or fails to create a session is skipped, the session falls
back (in the end to ``CPUExecutionProvider``), one warning line is logged on
``mcp.agent.runtime`` and the reason is kept in :attr:`RunnerInfo.fallback_reason`.
onnxruntime's own silent fallback (it prints to stdout and swaps providers behind our back) is
turned off, so ``info.provider`` always names the provider in use.

Feeds are checked against the model signature before ``session.run`` (:class:`InputValidator`):
every input present, no unknown names, numpy arrays of the right rank, fixed dimensions equal,
and the exact dtype. The only conversion is one that cannot change a value: an array whose
dtype maps to the same protocol :class:`Datatype` as the model's (a non-native byte order, or
``str``/``bytes`` arrays for a ``BYTES`` input). Anything else, float64 for a float32 input
included, is an :class:`InputError`: the protocol layer already builds arrays of the declared
datatype, so a mismatch is the caller's, and silently narrowing floats would hide it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnxruntime as ort
from onnxruntime.capi.onnxruntime_pybind11_state import InvalidArgument

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

CPU_PROVIDER = "CPUExecutionProvider"

_ONNX_TYPES: dict[str, Datatype] = {
    "tensor(bool)": Datatype.BOOL,
    "tensor(uint8)": Datatype.UINT8,
    "tensor(uint16)": Datatype.UINT16,
    "tensor(uint32)": Datatype.UINT32,
    "tensor(uint64)": Datatype.UINT64,
    "tensor(int8)": Datatype.INT8,
    "tensor(int16)": Datatype.INT16,
    "tensor(int32)": Datatype.INT32,
    "tensor(int64)": Datatype.INT64,
    "tensor(float16)": Datatype.FP16,
    "tensor(float)": Datatype.FP32,
    "tensor(double)": Datatype.FP64,
    "tensor(string)": Datatype.BYTES,
}


def datatype_from_onnx(onnx_type: str) -> Datatype:
    """The protocol datatype for an onnxruntime type string such as ``'tensor(float)'``.

    Raises:
        KeyError: the type has no Open Inference Protocol datatype (sequences, maps, bfloat16).
    """
    return _ONNX_TYPES[onnx_type]


def _shape_of(dims: Sequence[Any] | None) -> tuple[int, ...]:
    """An onnxruntime shape with symbolic (``'batch'``) or unknown (``None``) dims as -1."""
    return tuple(d if isinstance(d, int) and d >= 0 else -1 for d in dims or ())


def _describe(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


class InputValidator:
    """Checks a feed dict against a model's input specs; built once per model.

    The common case (every input present with the exact dtype and a fitting shape) costs a
    dict lookup and a few comparisons per input; only a feed that fails it goes through the
    slower path that explains the problem or applies a lossless conversion.
    """

    def __init__(self, model: str, inputs: Sequence[TensorSpec]) -> None:
        self._model = model
        self._specs = {spec.name: spec for spec in inputs}
        self._count = len(self._specs)
        self._checks: tuple[tuple[str, np.dtype[Any], int, tuple[int, ...] | None, bool], ...]
        self._checks = tuple(self._compile(spec) for spec in inputs)

    @staticmethod
    def _compile(
        spec: TensorSpec,
    ) -> tuple[str, np.dtype[Any], int, tuple[int, ...] | None, bool]:
        # (name, dtype, rank, dims that must match exactly, whether they are the tail after dim 0)
        shape = spec.shape
        if all(d >= 0 for d in shape):
            return spec.name, spec.datatype.numpy_dtype, len(shape), shape, False
        if shape[0] < 0 and all(d >= 0 for d in shape[1:]):
            return spec.name, spec.datatype.numpy_dtype, len(shape), shape[1:], True
        return spec.name, spec.datatype.numpy_dtype, len(shape), None, False

    def check(self, feeds: Mapping[str, Array]) -> Mapping[str, Array]:
        """Return ``feeds`` (or a converted copy) ready for the backend.

        Raises:
            InputError: an unknown or missing name, a value that is not a numpy array, a wrong
                rank, a fixed dimension of the wrong size, or a dtype the model does not take.
        """
        if len(feeds) == self._count:
            for name, dtype, rank, fixed, tail in self._checks:
                array = feeds.get(name)
                if (
                    type(array) is not np.ndarray
                    or (array.dtype is not dtype and array.dtype != dtype)
                    or array.ndim != rank
                ):
                    break
                shape = array.shape
                if fixed is not None and (shape[1:] if tail else shape) != fixed:
                    break
                if fixed is None and not self._dims_fit(name, shape):
                    break
            else:
                return feeds
        return self._check_slowly(feeds)

    def _dims_fit(self, name: str, shape: tuple[int, ...]) -> bool:
        want = self._specs[name].shape
        return all(w < 0 or w == got for w, got in zip(want, shape, strict=True))

    def _check_slowly(self, feeds: Mapping[str, Array]) -> dict[str, Array]:
        unknown = [name for name in feeds if name not in self._specs]
        if unknown:
            raise InputError(
                f"{self._model}: unknown input {unknown[0]!r}; the model's inputs are "
                + ", ".join(repr(n) for n in self._specs)
            )
        checked: dict[str, Array] = {}
        for name, spec in self._specs.items():
            if name not in feeds:
                raise InputError(
                    f"{self._model}: missing input {name!r} "
                    f"({spec.datatype.value} {_describe(spec.shape)})"
                )
            checked[name] = self._one(spec, feeds[name])
        return checked

    def _one(self, spec: TensorSpec, array: Any) -> Array:
        where = f"{self._model}: input {spec.name!r}"
        if not isinstance(array, np.ndarray):
            raise InputError(f"{where} must be a numpy array, not {type(array).__name__}")
        if array.ndim != len(spec.shape):
            raise InputError(
                f"{where} has shape {_describe(array.shape)} (rank {array.ndim}); the model "
                f"wants rank {len(spec.shape)}, shape {_describe(spec.shape)}"
            )
        for axis, (want, got) in enumerate(zip(spec.shape, array.shape, strict=True)):
            if want >= 0 and want != got:
                raise InputError(
                    f"{where} has shape {_describe(array.shape)}; dimension {axis} must be "
                    f"{want} (model shape {_describe(spec.shape)})"
                )
        want_dtype = spec.datatype.numpy_dtype
        if array.dtype == want_dtype:
            return array
        if spec.datatype is Datatype.BYTES and array.dtype.kind in "USO":
            return array
        if array.dtype.newbyteorder("=") == want_dtype:
            return array.astype(want_dtype)
        try:
            got = Datatype.from_numpy(array.dtype).value
        except Exception:
            got = "no protocol datatype"
        raise InputError(
            f"{where} is {array.dtype} ({got}); the model wants {spec.datatype.value} "
            f"({want_dtype}); convert it before sending"
        )


def _session_options(
    intra_op_threads: int, inter_op_threads: int, allow_spinning: bool
) -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.intra_op_num_threads = intra_op_threads
    options.inter_op_num_threads = inter_op_threads
    options.add_session_config_entry(
        "session.intra_op.allow_spinning", "1" if allow_spinning else "0"
    )
    # Errors only: our own log line says which provider was skipped and why.
    options.log_severity_level = 3
    return options


def _first_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0]


class OnnxRunner:
    """One onnxruntime session behind the :class:`~agent.runtime.runner.ModelRunner` interface.

    Args:
        path_or_bytes: the ``.onnx`` file, or the serialized model.
        providers: ``(provider name, provider options)`` in order of preference;
            ``CPUExecutionProvider`` is appended when absent, so a session always opens
            where the model itself is sound.
        intra_op_threads: threads inside one operator; 0 lets onnxruntime pick (one per
            physical core).
        inter_op_threads: threads across operators (the session runs sequentially, so 1
            is the useful value); 0 lets onnxruntime pick.
        allow_spinning: let idle intra-op threads spin (lower latency, busier cores).
        fallback_to_cpu: append ``CPUExecutionProvider`` when ``providers`` lacks it; False
            (the loader, when other backends follow) raises instead when none of
            ``providers`` opens.
        skipped: why backends tried before this runner were skipped (from the loader); they
            lead ``info.fallback_reason`` and the one warning line.

    Raises:
        ModelLoadError: the model does not load even on the CPU provider, or its inputs or
            outputs have types the Open Inference Protocol cannot carry.
        BackendUnavailableError: ``fallback_to_cpu`` is False and none of ``providers``
            could open a session.
    """

    def __init__(
        self,
        path_or_bytes: str | os.PathLike[str] | bytes,
        *,
        providers: Sequence[tuple[str, Mapping[str, Any]]] = ((CPU_PROVIDER, {}),),
        intra_op_threads: int = 0,
        inter_op_threads: int = 1,
        allow_spinning: bool = True,
        fallback_to_cpu: bool = True,
        skipped: Sequence[str] = (),
    ) -> None:
        if isinstance(path_or_bytes, bytes):
            model: str | bytes = path_or_bytes
            self._label = "<onnx model bytes>"
        else:
            model = os.fspath(path_or_bytes)
            self._label = os.path.basename(model)
        options = _session_options(intra_op_threads, inter_op_threads, allow_spinning)
        session, fallback_reason = self._open(
            model, options, providers, fallback_to_cpu=fallback_to_cpu, skipped=skipped
        )
        self._session: ort.InferenceSession | None = session
        # The session's compiled core: InferenceSession.run re-checks the input names and
        # ownership on every call (~2.5 µs, a tenth of a small model's run), which
        # InputValidator has already done. Its EP fallback is not used (providers are ours).
        self._run = getattr(getattr(session, "_sess", None), "run", None)

        inputs = tuple(self._spec(arg) for arg in session.get_inputs())
        outputs = tuple(self._spec(arg) for arg in session.get_outputs())
        self._output_names = [spec.name for spec in outputs]
        # Most models have one output; a dict literal is several times cheaper than dict(zip).
        self._single_output = self._output_names[0] if len(outputs) == 1 else None
        self._validator = InputValidator(self._label, inputs)
        self._info = RunnerInfo(
            backend="onnxruntime",
            provider=session.get_providers()[0],
            inputs=inputs,
            outputs=outputs,
            batchable=bool(inputs) and all(s.shape[:1] == (-1,) for s in inputs),
            fallback_reason=fallback_reason,
            details={
                "model": self._label,
                "onnxruntime": ort.__version__,
                "providers_requested": [name for name, _ in providers],
                "providers_in_session": list(session.get_providers()),
                "intra_op_threads": intra_op_threads,
                "inter_op_threads": inter_op_threads,
                "allow_spinning": allow_spinning,
            },
        )

    def _open(
        self,
        model: str | bytes,
        options: ort.SessionOptions,
        providers: Sequence[tuple[str, Mapping[str, Any]]],
        *,
        fallback_to_cpu: bool,
        skipped: Sequence[str],
    ) -> tuple[ort.InferenceSession, str | None]:
        available = set(ort.get_available_providers())
        wanted = [(name, dict(opts)) for name, opts in providers]
        if fallback_to_cpu and all(name != CPU_PROVIDER for name, _ in wanted):
            wanted.append((CPU_PROVIDER, {}))
        earlier = len(skipped)
        skipped = list(skipped)
        candidates: list[tuple[str, dict[str, Any]]] = []
        for name, opts in wanted:
            if name in available:
                candidates.append((name, opts))
            else:
                skipped.append(f"{name} is not in this onnxruntime build")
        for start, (name, _) in enumerate(candidates):
            try:
                session = ort.InferenceSession(
                    model, options, providers=candidates[start:], enable_fallback=0
                )
            except Exception as e:
                if name == CPU_PROVIDER:
                    raise ModelLoadError(
                        f"{self._label}: onnxruntime cannot load the model: {_first_line(e)}"
                    ) from e
                skipped.append(f"{name} failed to create a session: {_first_line(e)}")
                continue
            used = session.get_providers()[0]
            if used != name:
                skipped.append(f"{name} was not enabled by onnxruntime")
            reason = "; ".join(skipped) if skipped else None
            if reason is not None:
                log.warning("%s: running on %s; skipped %s", self._label, used, reason)
            return session, reason
        if not fallback_to_cpu:
            raise BackendUnavailableError("; ".join(skipped[earlier:]) or "no provider given")
        # Unreachable: CPU is always a candidate, and its failure raises above.
        raise ModelLoadError(f"{self._label}: no execution provider could load the model")

    def _spec(self, arg: Any) -> TensorSpec:
        try:
            datatype = datatype_from_onnx(arg.type)
        except KeyError:
            raise ModelLoadError(
                f"{self._label}: tensor {arg.name!r} has type {arg.type}, which the Open "
                "Inference Protocol cannot carry"
            ) from None
        return TensorSpec(arg.name, datatype, _shape_of(arg.shape))

    @property
    def info(self) -> RunnerInfo:
        """What was loaded: provider in use, signature, batchability, fallback reason."""
        return self._info

    def run(self, feeds: dict[str, Array]) -> dict[str, Array]:
        """Run one (possibly batched) inference; safe from several threads at once.

        Args:
            feeds: one numpy array per model input, by input name.

        Returns:
            One array per model output, by output name.

        Raises:
            InputError: the feeds do not fit the signature (see :class:`InputValidator`), or
                onnxruntime rejects them as invalid (e.g. inputs with different batch sizes).
            InferenceError: the run failed, or the runner is closed.
        """
        session = self._session
        if session is None:
            raise InferenceError(f"{self._label}: the runner is closed")
        checked = self._validator.check(feeds)
        try:
            core = self._run
            results = (
                core(self._output_names, checked, None)
                if core is not None
                else session.run(self._output_names, checked)
            )
        except InvalidArgument as e:
            raise InputError(f"{self._label}: {_first_line(e)}") from e
        except Exception as e:
            raise InferenceError(f"{self._label}: inference failed: {_first_line(e)}") from e
        if self._single_output is not None:
            return {self._single_output: results[0]}
        return dict(zip(self._output_names, results, strict=True))

    def close(self) -> None:
        """Drop the session; later ``run`` calls raise :class:`InferenceError`."""
        self._session = None
        self._run = None
