"""INT8 variants: quantize an FP32 ONNX model with onnxruntime's tools, and measure the cost.

:func:`quantize_int8` writes an INT8 copy of an FP32 ONNX model:

* ``static``: activations and weights in 8 bits, activation ranges calibrated (min/max) by
  running the FP32 model on calibration samples; QDQ format (``QuantizeLinear`` /
  ``DequantizeLinear`` pairs around each quantized node, which onnxruntime's CPU provider
  fuses into integer kernels: ``QLinearConv``, ``QLinearMatMul``...), uint8 activations and
  int8 per-channel weights (the U8S8 kernels of x86 CPUs, VNNI where present). The model is
  pre-processed first (:func:`onnxruntime.quantization.quant_pre_process`: shape inference
  and basic graph optimization) so every tensor the quantizer needs has a known shape.
* ``dynamic``: int8 weights of ``MatMul``/``Gemm``, activations quantized at run time
  (``DynamicQuantizeLinear`` + ``MatMulInteger``); needs no samples, suits MatMul-heavy models.

Weights int8 would mostly erase stay FP32: a ``Conv``/``MatMul``/``Gemm`` more than
:data:`FRAGILE_ZEROED_SHARE` of whose non-zero weights round to zero (a few outliers stretch
the range, as in a classifier head with standardisation folded into it) is left out, with
the unweighted nodes between it and its weighted neighbours (pooling, flatten, softmax), so
the features it amplifies keep full precision. The rest is quantized.

Both write a self-contained model (no external data) with the FP32 model's inputs and outputs,
deterministically: the same model and samples give the same bytes. A model in which nothing
could be quantized is refused rather than shipped as an "INT8" copy of itself.

:func:`measure_quantized` runs the reference and the quantized model with onnxruntime (CPU) on
the same samples and returns the :class:`~shared.bundle.manifest.Quantization` figures a
bundle's manifest records.

onnx and onnxruntime are imported inside the functions, like in :mod:`shared.bundle.models`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from mcp_edge.shared.bundle.manifest import Quantization, TensorSpec
from mcp_edge.shared.errors import BundleError, ModelValidationError
from mcp_edge.shared.fsutil import fsync_dir

QuantizeMode = Literal["static", "dynamic"]
QUANTIZE_MODES: tuple[QuantizeMode, ...] = ("static", "dynamic")
INT8_TAG = "int8"
"""The tag (and profile) of the INT8 variant ``mcp-bundle build --quantize int8`` adds."""
CALIBRATION_BATCH = 32
"""Samples per calibration run."""
MAX_CALIBRATION_SAMPLES = 10_000
"""Cap on the samples used to calibrate (the first ones are taken); min/max ranges settle
long before, and each sample costs one FP32 run with every intermediate tensor kept."""
SYNTHETIC_SAMPLES = 256
"""How many inputs :func:`synthetic_samples` draws (figures of a dynamic build without
baseline samples)."""
SYNTHETIC_SEED = 20_261_201
_MEASURE_BATCH = 256
_INTEGER_OPS = frozenset(
    {"QuantizeLinear", "DynamicQuantizeLinear", "MatMulInteger", "ConvInteger", "QLinearConv"}
)


def _samples_for(spec: TensorSpec, samples: npt.NDArray[Any]) -> npt.NDArray[np.float32]:
    """``samples`` as float32 in the input's shape (``[N, ...]``), or a clear error."""
    if spec.datatype != "FP32":
        raise BundleError(
            f"INT8 quantization needs an FP32 input; {spec.name!r} is {spec.datatype}"
        )
    if samples.ndim < 1 or samples.shape[0] == 0:
        raise BundleError("quantization samples must have at least one row (shape [N, ...])")
    if samples.dtype.kind not in "biuf":
        raise BundleError(f"quantization samples must be numeric, got dtype {samples.dtype}")
    per_sample = tuple(spec.shape[1:])
    have = int(np.prod(samples.shape[1:])) if samples.ndim > 1 else 1
    if -1 not in per_sample:
        want = int(np.prod(per_sample)) if per_sample else 1
        if have != want:
            raise BundleError(
                f"samples have {have} values each but input {spec.name!r} takes shape "
                f"{list(spec.shape)}"
            )
        samples = samples.reshape((samples.shape[0], *per_sample))
    data = np.ascontiguousarray(samples, dtype=np.float32)
    if not np.isfinite(data).all():
        raise BundleError("quantization samples contain NaN or infinity")
    return data


def synthetic_samples(spec: TensorSpec, count: int = SYNTHETIC_SAMPLES) -> npt.NDArray[np.float32]:
    """``count`` inputs for ``spec`` drawn uniformly from [0, 1) with a fixed seed (dynamic
    dimensions other than the batch taken as 1): what the figures of a quantized variant are
    measured on when the build has no samples."""
    shape = tuple(d if d > 0 else 1 for d in spec.shape[1:])
    rng = np.random.Generator(np.random.PCG64(SYNTHETIC_SEED))
    return rng.random((count, *shape), dtype=np.float32)


def _input_spec(path: Path, input_name: str) -> TensorSpec:
    from mcp_edge.shared.bundle.models import inspect_model

    info = inspect_model(path, "onnx")
    specs = [s for s in info.inputs if s.name == input_name]
    if len(info.inputs) != 1 or not specs:
        raise BundleError(
            f"{path}: INT8 quantization needs a model with one input named {input_name!r}; "
            f"it has {[s.name for s in info.inputs]}"
        )
    return specs[0]


def _session(path: Path) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    # One thread: the same arithmetic order on every run, so calibration ranges and measured
    # figures do not depend on how many cores the build machine has.
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _reader(input_name: str, data: npt.NDArray[np.float32], batch: int) -> Any:
    """A CalibrationDataReader over ``data`` in batches (one sample at a time for a model
    with a fixed batch dimension)."""
    from onnxruntime.quantization import CalibrationDataReader

    class _Reader(CalibrationDataReader):  # type: ignore[misc]
        def __init__(self) -> None:
            self._batches = self._iterate()

        def _iterate(self) -> Iterator[dict[str, npt.NDArray[np.float32]]]:
            for start in range(0, data.shape[0], batch):
                yield {input_name: data[start : start + batch]}

        def get_next(self) -> dict[str, npt.NDArray[np.float32]] | None:
            return next(self._batches, None)

        def rewind(self) -> None:
            self._batches = self._iterate()

    return _Reader()


def quantize_int8(
    fp32_onnx: Path,
    out: Path,
    *,
    mode: QuantizeMode,
    calibration: npt.NDArray[Any] | None,
    input_name: str,
    per_channel: bool = True,
) -> Path:
    """Write an INT8 copy of the FP32 ONNX model ``fp32_onnx`` to ``out``; return ``out``.

    ``mode`` "static" calibrates activation ranges on ``calibration`` (samples ``[N, ...]``
    for the input ``input_name``; required) and writes a QDQ model with uint8 activations and
    int8 weights (per output channel unless ``per_channel`` is false); "dynamic" quantizes
    the weights of ``MatMul``/``Gemm`` only (``calibration`` is not used). The result has
    the same inputs and outputs as the FP32 model and is written atomically.
    Raises :class:`BundleError` (:class:`~shared.errors.ModelValidationError` when
    onnxruntime cannot quantize the model).
    """
    import onnx
    from onnxruntime.quantization import (
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quant_pre_process,
        quantize_dynamic,
        quantize_static,
    )

    if mode not in QUANTIZE_MODES:
        raise BundleError(f"unknown quantization mode {mode!r}; use static or dynamic")
    fp32_onnx, out = Path(fp32_onnx), Path(out)
    spec = _input_spec(fp32_onnx, input_name)
    data = None
    if mode == "static":
        if calibration is None:
            raise BundleError("static INT8 quantization needs calibration samples")
        data = _samples_for(spec, np.asarray(calibration)[:MAX_CALIBRATION_SAMPLES])
    work = Path(tempfile.mkdtemp(prefix=".quantize-", dir=out.parent))
    try:
        prepared = work / "prepared.onnx"
        quantized = work / "quantized.onnx"
        try:
            quant_pre_process(str(fp32_onnx), str(prepared), skip_symbolic_shape=True)
            exclude = _name_nodes_and_find_fragile(prepared, per_channel)
            if data is not None:
                batch = CALIBRATION_BATCH if spec.shape and spec.shape[0] == -1 else 1
                quantize_static(
                    str(prepared),
                    str(quantized),
                    _reader(input_name, data, batch),
                    quant_format=QuantFormat.QDQ,
                    per_channel=per_channel,
                    activation_type=QuantType.QUInt8,
                    weight_type=QuantType.QInt8,
                    calibrate_method=CalibrationMethod.MinMax,
                    calibration_providers=["CPUExecutionProvider"],
                    nodes_to_exclude=exclude,
                    extra_options={
                        "CalibMaxIntermediateOutputs": 64,
                        # onnxruntime's int32-bias adjustment of per-channel weight scales
                        # fails on MatMul+Add (Gemm) weights; the bias is quantized as is.
                        "QDQDisableWeightAdjustForInt32Bias": per_channel,
                    },
                )
            else:
                quantize_dynamic(
                    str(prepared),
                    str(quantized),
                    op_types_to_quantize=["MatMul", "Gemm"],
                    nodes_to_exclude=exclude,
                    per_channel=per_channel,
                    weight_type=QuantType.QInt8,
                )
        except BundleError:
            raise
        except Exception as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ModelValidationError(
                f"{fp32_onnx}: onnxruntime cannot quantize it ({mode}): {first}"
            ) from e
        model = onnx.load(str(quantized))
        if not any(n.op_type in _INTEGER_OPS for n in model.graph.node):
            raise BundleError(
                f"{fp32_onnx}: {mode} INT8 quantization found nothing to quantize "
                f"({'Conv, MatMul' if mode == 'static' else 'MatMul, Gemm'} with int8-friendly "
                "weights)" + ("; try --quantize-mode static" if mode == "dynamic" else "")
            )
        _normalise(model, fp32_onnx)
        tmp = work / "final.onnx"
        with open(tmp, "wb") as f:
            f.write(model.SerializeToString(deterministic=True))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
        fsync_dir(out.parent)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


FRAGILE_ZEROED_SHARE = 0.10
"""A weight tensor more than this share of whose non-zero values would round to 0 in int8
(a few outliers stretch its range) stays FP32: quantizing it would erase most of it."""
_WEIGHTED_OPS = ("Conv", "MatMul", "Gemm")


def _weight_axis(node: Any) -> int:
    """The output-channel axis of a Conv/MatMul/Gemm weight (what per-channel scales follow)."""
    if node.op_type == "Conv":
        return 0
    if node.op_type == "Gemm":
        trans_b = next((a.i for a in node.attribute if a.name == "transB"), 0)
        return 0 if trans_b else 1
    return 1


def zeroed_share(weight: npt.NDArray[Any], axis: int | None) -> float:
    """Share of the non-zero values of ``weight`` that symmetric int8 quantization (one scale
    per slice along ``axis``, or one for the tensor when None) rounds to zero."""
    w = np.abs(np.asarray(weight, np.float64))
    if w.ndim == 0 or not w.any():
        return 0.0
    if axis is None or w.ndim < 2:
        peak = np.full_like(w, w.max())
    else:
        others = tuple(i for i in range(w.ndim) if i != axis % w.ndim)
        peak = np.broadcast_to(w.max(axis=others, keepdims=True), w.shape)
    nonzero = w > 0
    zeroed = nonzero & (w < peak / 127 / 2)
    return float(zeroed.sum() / nonzero.sum())


def _name_nodes_and_find_fragile(path: Path, per_channel: bool) -> list[str]:
    """Name every unnamed node of the model at ``path`` (``<op>_<index>``, rewritten in
    place) and return the names of the nodes to keep in FP32: each weighted node whose
    weights int8 would mostly erase (:data:`FRAGILE_ZEROED_SHARE`), with the unweighted nodes
    that feed it from the previous weighted node and those it feeds up to the next one (a
    classifier head amplifying tiny feature differences needs them in full precision too)."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(path))
    nodes = list(model.graph.node)
    taken = {n.name for n in nodes if n.name}
    for i, node in enumerate(nodes):
        if not node.name:
            name = f"{node.op_type}_{i}"
            while name in taken:
                name += "_"
            node.name = name
            taken.add(name)
    weights = {t.name: t for t in model.graph.initializer}
    producer = {out: n for n in nodes for out in n.output}
    consumers: dict[str, list[Any]] = {}
    for n in nodes:
        for name in n.input:
            consumers.setdefault(name, []).append(n)
    fragile: list[str] = []

    def keep(node: Any) -> None:
        if node.name in fragile:
            return
        fragile.append(node.name)
        if node.op_type == "Gemm":  # the dynamic quantizer rewrites Gemm as MatMul + Add
            fragile.append(f"{node.name}_MatMul")

    for node in nodes:
        if node.op_type not in _WEIGHTED_OPS or len(node.input) < 2:
            continue
        tensor = weights.get(node.input[1])
        if tensor is None:
            continue
        axis = _weight_axis(node) if per_channel else None
        if zeroed_share(numpy_helper.to_array(tensor), axis) <= FRAGILE_ZEROED_SHARE:
            continue
        keep(node)
        back = [producer[i] for i in node.input[:1] if i in producer]
        while back:
            n = back.pop()
            if n.op_type not in _WEIGHTED_OPS and n.name not in fragile:
                keep(n)
                back += [producer[i] for i in n.input if i in producer and i not in weights]
        ahead = [c for o in node.output for c in consumers.get(o, [])]
        while ahead:
            n = ahead.pop()
            if n.op_type not in _WEIGHTED_OPS and n.name not in fragile:
                keep(n)
                ahead += [c for o in n.output for c in consumers.get(o, [])]
    with open(path, "wb") as f:
        f.write(model.SerializeToString(deterministic=True))
    return fragile


def _normalise(model: Any, source: Path) -> None:
    """Give the quantized model the FP32 model's metadata and nothing that varies by run."""
    import onnx

    original = onnx.load(str(source), load_external_data=False)
    del model.metadata_props[:]
    model.metadata_props.extend(original.metadata_props)
    model.producer_name = "mcp-bundle (onnxruntime.quantization)"
    model.producer_version = ""
    model.doc_string = ""


def _run(path: Path, input_name: str, data: npt.NDArray[np.float32]) -> npt.NDArray[np.float64]:
    session = _session(path)
    output = session.get_outputs()[0].name
    fixed = session.get_inputs()[0].shape[0]
    batch = 1 if isinstance(fixed, int) and fixed > 0 else _MEASURE_BATCH
    parts = [
        np.asarray(session.run([output], {input_name: data[i : i + batch]})[0], np.float64)
        for i in range(0, data.shape[0], batch)
    ]
    result = np.concatenate(parts)
    return result.reshape(result.shape[0], -1)


def measure_quantized(
    reference: Path,
    quantized: Path,
    samples: npt.NDArray[Any],
    labels: npt.NDArray[Any] | None,
    *,
    scheme: Literal["int8-dynamic", "int8-static"],
    reference_tag: str = "default",
) -> Quantization:
    """Run ``reference`` and ``quantized`` (onnxruntime CPU) on ``samples`` and compare.

    Both must have one FP32 input; their first outputs (``[N, K]`` scores) are compared:
    ``top1_agreement`` (share of samples with the same arg-max), ``max_abs_diff`` (largest
    absolute difference of any value), and with ``labels`` (one integer class per sample)
    ``accuracy_delta``, top-1 accuracy in points, quantized minus reference.
    Raises :class:`BundleError` for unusable samples or labels, or a model answering NaN.
    """
    reference, quantized = Path(reference), Path(quantized)
    spec = _input_spec(reference, _only_input(reference))
    data = _samples_for(spec, np.asarray(samples))
    n = data.shape[0]
    truth = None
    if labels is not None:
        truth = np.asarray(labels)
        if truth.ndim != 1 or truth.shape[0] != n:
            raise BundleError(
                f"labels must be one integer class per sample: {n} samples, labels of shape "
                f"{list(truth.shape)}"
            )
        if truth.dtype.kind not in "iu":
            raise BundleError(f"labels must be integers, got dtype {truth.dtype}")
    try:
        ref = _run(reference, spec.name, data)
        got = _run(quantized, spec.name, data)
    except Exception as e:
        raise ModelValidationError(f"quantized model check failed on the samples: {e}") from e
    if ref.shape != got.shape:
        raise ModelValidationError(
            f"quantized model answers shape {list(got.shape)}, the reference {list(ref.shape)}"
        )
    for what, values in (("reference", ref), ("quantized", got)):
        bad = int((~np.isfinite(values)).any(axis=1).sum())
        if bad:
            raise ModelValidationError(
                f"the {what} model answered NaN or infinity on {bad} of {n} samples"
            )
    ref_top, got_top = ref.argmax(axis=1), got.argmax(axis=1)
    delta = None
    if truth is not None:
        delta = 100.0 * (float(np.mean(got_top == truth)) - float(np.mean(ref_top == truth)))
    return Quantization(
        scheme=scheme,
        reference=reference_tag,
        samples=n,
        top1_agreement=round(float(np.mean(ref_top == got_top)), 6),
        max_abs_diff=round(float(np.abs(ref - got).max()), 6),
        accuracy_delta=None if delta is None else round(delta, 4),
    )


def _only_input(path: Path) -> str:
    from mcp_edge.shared.bundle.models import inspect_model

    info = inspect_model(path, "onnx")
    if len(info.inputs) != 1:
        raise BundleError(f"{path}: measuring a quantized model needs exactly one input")
    return info.inputs[0].name
