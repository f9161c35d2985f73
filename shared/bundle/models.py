"""Model files: tell the format, validate, record the I/O signature, run on samples.

ONNX: ``onnx.checker.check_model(full_check=True)`` and strict shape inference; inputs and
outputs come from the graph (initializers are not inputs). TFLite: the interpreter loads the
file and allocates tensors; names come from the first SignatureDef (``serving_default`` when
present), else from the tensor details; ``shape_signature`` gives ``-1`` for dynamic dims.

onnx, onnxruntime and the TFLite interpreter are imported inside the functions that need them,
so ``import shared.bundle`` stays light and TFLite stays optional. Every library exception is
translated here into :class:`~shared.errors.ModelValidationError` (or
:class:`RuntimeUnavailableError` when the TFLite runtime is not installed).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from mcp_edge.shared.bundle.manifest import Datatype, ModelFormat, TensorSpec
from mcp_edge.shared.errors import BundleError, ModelValidationError

TFLITE_INSTALL_HINT = "pip install 'mcp-edge[tflite]'"
_TFLITE_MAGIC = b"TFL3"
_BATCH = 256

# onnx.TensorProto element types -> Open Inference Protocol names.
_ONNX_TYPES: dict[int, Datatype] = {
    1: "FP32",
    2: "UINT8",
    3: "INT8",
    4: "UINT16",
    5: "INT16",
    6: "INT32",
    7: "INT64",
    8: "BYTES",
    9: "BOOL",
    10: "FP16",
    11: "FP64",
    12: "UINT32",
    13: "UINT64",
    16: "BF16",
}
_NUMPY_TYPES: dict[str, Datatype] = {
    "float32": "FP32",
    "float16": "FP16",
    "float64": "FP64",
    "int8": "INT8",
    "int16": "INT16",
    "int32": "INT32",
    "int64": "INT64",
    "uint8": "UINT8",
    "uint16": "UINT16",
    "uint32": "UINT32",
    "uint64": "UINT64",
    "bool": "BOOL",
    "bytes": "BYTES",
    "object": "BYTES",
    "str": "BYTES",
}
_OIP_NUMPY: dict[str, str] = {
    "FP32": "float32",
    "FP16": "float16",
    "FP64": "float64",
    "INT8": "int8",
    "INT16": "int16",
    "INT32": "int32",
    "INT64": "int64",
    "UINT8": "uint8",
    "UINT16": "uint16",
    "UINT32": "uint32",
    "UINT64": "uint64",
    "BOOL": "bool",
}


class RuntimeUnavailableError(BundleError):
    """The runtime a model format needs is not installed on this machine."""


@dataclass(frozen=True)
class ModelInfo:
    """What validating a model file found."""

    format: ModelFormat
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    metadata_props: dict[str, str] = field(default_factory=dict)
    min_runtime: dict[str, int | str] = field(default_factory=dict)


def detect_format(path: Path) -> ModelFormat:
    """``tflite`` when the file carries the TFLite flatbuffer identifier or ends in ``.tflite``,
    ``onnx`` when it ends in ``.onnx``; raises :class:`ModelValidationError` otherwise."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError as e:
        raise ModelValidationError(f"{path}: cannot read model: {e.strerror}") from e
    if head[4:8] == _TFLITE_MAGIC or path.suffix.lower() == ".tflite":
        return "tflite"
    if path.suffix.lower() == ".onnx":
        return "onnx"
    raise ModelValidationError(
        f"{path}: cannot tell the model format; name the file *.onnx or *.tflite"
    )


def inspect_model(path: Path, fmt: ModelFormat, *, member: str | None = None) -> ModelInfo:
    """Validate the model at ``path`` and return its I/O signature and properties.

    ``member`` names the file in error messages (a bundle member, else the path).
    Raises :class:`ModelValidationError`, or :class:`RuntimeUnavailableError` for TFLite
    without a TFLite runtime.
    """
    label = member or str(path)
    if fmt == "onnx":
        return _inspect_onnx(path, label, member)
    return _inspect_tflite(path, label, member)


def _onnx_tensor(value_info: Any, label: str, member: str | None) -> TensorSpec:
    kind = value_info.type.WhichOneof("value")
    if kind != "tensor_type":
        raise ModelValidationError(
            f"{label}: {value_info.name!r} is a {kind}, not a tensor; the Open Inference "
            "Protocol carries tensors only (for skl2onnx classifiers, disable zipmap)",
            member=member,
        )
    tensor = value_info.type.tensor_type
    datatype = _ONNX_TYPES.get(tensor.elem_type)
    if datatype is None:
        raise ModelValidationError(
            f"{label}: {value_info.name!r} has ONNX element type {tensor.elem_type}, which the "
            "Open Inference Protocol cannot carry",
            member=member,
        )
    shape = tuple(
        d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else -1 for d in tensor.shape.dim
    )
    return TensorSpec(name=value_info.name, datatype=datatype, shape=shape)


def _inspect_onnx(path: Path, label: str, member: str | None) -> ModelInfo:
    import onnx

    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:
        raise ModelValidationError(f"{label}: not a loadable ONNX model: {e}", member=member) from e
    for tensor in model.graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            raise ModelValidationError(
                f"{label}: ONNX external data is not supported in bundles; save the model "
                "with all tensors inside the file",
                member=member,
            )
    try:
        onnx.checker.check_model(model, full_check=True)
        onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
    except Exception as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelValidationError(
            f"{label}: ONNX check failed: {first_line}", member=member
        ) from e
    initializers = {t.name for t in model.graph.initializer}
    inputs = tuple(
        _onnx_tensor(v, label, member) for v in model.graph.input if v.name not in initializers
    )
    outputs = tuple(_onnx_tensor(v, label, member) for v in model.graph.output)
    if not inputs or not outputs:
        raise ModelValidationError(f"{label}: model has no inputs or no outputs", member=member)
    opset = max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=0)
    min_runtime: dict[str, int | str] = {"onnx_ir_version": int(model.ir_version)}
    if opset:
        min_runtime["onnx_opset"] = int(opset)
    props = {p.key: p.value for p in model.metadata_props}
    return ModelInfo("onnx", inputs, outputs, props, min_runtime)


def _tflite_module() -> Any:
    try:
        import ai_edge_litert.interpreter as litert

        return litert
    except ImportError:
        pass
    try:
        import tflite_runtime.interpreter as tflite_runtime

        return tflite_runtime
    except ImportError:
        raise RuntimeUnavailableError(
            f"TFLite support is not installed; run: {TFLITE_INSTALL_HINT}"
        ) from None


def _load_tflite(path: Path, label: str, member: str | None) -> Any:
    module = _tflite_module()
    kwargs: dict[str, Any] = {}
    resolver = getattr(module, "OpResolverType", None)
    if resolver is not None:
        # Builtin kernels without the XNNPACK delegate: same answers, and no delegate log
        # line on stderr for every check.
        kwargs["experimental_op_resolver_type"] = resolver.BUILTIN_WITHOUT_DEFAULT_DELEGATES
    try:
        interpreter = module.Interpreter(model_path=str(path), **kwargs)
        interpreter.allocate_tensors()
    except Exception as e:
        raise ModelValidationError(
            f"{label}: TFLite interpreter cannot load it: {e}", member=member
        ) from e
    return interpreter


def _numpy_datatype(dtype: Any, label: str, name: str, member: str | None) -> Datatype:
    try:
        datatype = _NUMPY_TYPES.get(np.dtype(dtype).name)
    except TypeError:
        datatype = None
    if datatype is None:
        raise ModelValidationError(
            f"{label}: {name!r} has type {dtype}, which the Open Inference Protocol cannot carry",
            member=member,
        )
    return datatype


def _tflite_tensor(name: str, detail: dict[str, Any], label: str, member: str | None) -> TensorSpec:
    shape = detail.get("shape_signature")
    if shape is None or len(shape) == 0:
        shape = detail["shape"]
    return TensorSpec(
        name=name,
        datatype=_numpy_datatype(detail["dtype"], label, name, member),
        shape=tuple(int(d) if int(d) > 0 else -1 for d in shape),
    )


def _tflite_io(interpreter: Any) -> tuple[str | None, dict[str, Any], dict[str, Any]]:
    signatures = interpreter.get_signature_list()
    if signatures:
        key = "serving_default" if "serving_default" in signatures else next(iter(signatures))
        runner = interpreter.get_signature_runner(key)
        return key, dict(runner.get_input_details()), dict(runner.get_output_details())
    ins = {d["name"]: d for d in interpreter.get_input_details()}
    outs = {d["name"]: d for d in interpreter.get_output_details()}
    return None, ins, outs


def _inspect_tflite(path: Path, label: str, member: str | None) -> ModelInfo:
    interpreter = _load_tflite(path, label, member)
    try:
        key, ins, outs = _tflite_io(interpreter)
    except Exception as e:
        raise ModelValidationError(
            f"{label}: TFLite signature unreadable: {e}", member=member
        ) from e
    inputs = tuple(_tflite_tensor(n, d, label, member) for n, d in ins.items())
    outputs = tuple(_tflite_tensor(n, d, label, member) for n, d in outs.items())
    if not inputs or not outputs:
        raise ModelValidationError(f"{label}: model has no inputs or no outputs", member=member)
    props = {"tflite.signature_key": key} if key else {}
    return ModelInfo("tflite", inputs, outputs, props, {})


def run_model(
    path: Path, fmt: ModelFormat, spec: TensorSpec, samples: npt.NDArray[Any]
) -> dict[str, npt.NDArray[Any]]:
    """Run a single-input model on ``samples`` (first axis = samples); return every output.

    Samples are cast to the input's dtype and reshaped to its shape when the element counts
    agree. Models with a fixed batch dimension run one sample at a time.
    Raises :class:`ModelValidationError` when the model cannot run on them.
    """
    np_type = _OIP_NUMPY.get(spec.datatype)
    if np_type is None:
        raise ModelValidationError(f"cannot feed baseline samples to a {spec.datatype} input")
    per_sample = tuple(spec.shape[1:]) if spec.shape else ()
    want = int(np.prod([d for d in per_sample if d > 0])) if per_sample else 1
    n = samples.shape[0]
    have = int(np.prod(samples.shape[1:])) if samples.ndim > 1 else 1
    if -1 not in per_sample and have != want:
        raise ModelValidationError(
            f"baseline samples have {have} values each but input {spec.name!r} takes "
            f"shape {list(spec.shape)}"
        )
    shaped = samples.reshape((n, *per_sample)) if -1 not in per_sample else samples
    data = shaped.astype(np_type)
    batch = _BATCH if spec.shape and spec.shape[0] == -1 else 1
    call = _onnx_runner(path) if fmt == "onnx" else _tflite_runner(path)
    chunks: dict[str, list[npt.NDArray[Any]]] = {}
    try:
        for start in range(0, n, batch):
            for name, value in call(spec.name, data[start : start + batch]).items():
                chunks.setdefault(name, []).append(np.asarray(value))
    except ModelValidationError:
        raise
    except Exception as e:
        raise ModelValidationError(f"model failed on the baseline samples: {e}") from e
    return {name: np.concatenate(parts) for name, parts in chunks.items()}


def _onnx_runner(path: Path) -> Any:
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]

    def call(input_name: str, batch: npt.NDArray[Any]) -> dict[str, Any]:
        return dict(zip(names, session.run(names, {input_name: batch}), strict=True))

    return call


def _tflite_runner(path: Path) -> Any:
    interpreter = _load_tflite(path, str(path), None)
    key, _, outs = _tflite_io(interpreter)

    def call(input_name: str, batch: npt.NDArray[Any]) -> dict[str, Any]:
        if key is not None:
            return dict(interpreter.get_signature_runner(key)(**{input_name: batch}))
        (detail,) = (d for d in interpreter.get_input_details() if d["name"] == input_name)
        interpreter.resize_tensor_input(detail["index"], list(batch.shape))
        interpreter.allocate_tensors()
        interpreter.set_tensor(detail["index"], batch)
        interpreter.invoke()
        return {n: interpreter.get_tensor(d["index"]).copy() for n, d in outs.items()}

    return call
