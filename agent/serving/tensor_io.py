"""Open Inference Protocol bodies to model feeds and model outputs to answer bytes.

Shared by the HTTP API and the MQTT inference topics. :func:`decode_feeds` turns a parsed
request body into one array per model input. A body that plainly fits the model's signature
(the common case: every input named once, the model's datatype, a fitting shape, numeric
``data``) is converted straight from the parsed JSON; anything else goes through the full
schema validation and :func:`tensors_to_feeds`, so every refusal and its message are those of
the full path. The fast path never accepts what the full path refuses: ``tests/unit`` runs both
on the same bodies.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson

from mcp_edge.agent.runtime.runner import Array, InputError, TensorSpec
from mcp_edge.agent.serving.binary_tensors import raw_from_array
from mcp_edge.agent.serving.oip import Call, not_implemented, output_requests, request_parameters
from mcp_edge.shared.protocol.wire import MAX_TENSOR_ELEMENTS, Datatype

if TYPE_CHECKING:
    from mcp_edge.shared.protocol.inference import InferTensor

_REQUEST_KEYS = frozenset({"id", "parameters", "inputs"})
_TENSOR_KEYS = frozenset({"name", "shape", "datatype", "parameters", "data"})
_FLOAT_KINDS = frozenset("iuf")
# orjson writes these numpy dtypes natively (OPT_SERIALIZE_NUMPY); others go through tolist().
_ORJSON_NATIVE = frozenset({"f4", "f8", "i8", "i4", "u1", "i1", "b1"})
_FLOAT_MAX = {
    Datatype.FP16: float(np.finfo(np.float16).max),
    Datatype.FP32: float(np.finfo(np.float32).max),
    Datatype.FP64: math.inf,
}


def tensors_to_feeds(inputs: list[InferTensor], specs: tuple[TensorSpec, ...]) -> dict[str, Array]:
    """Check request tensors against the model's inputs and turn them into arrays.

    Raises :class:`InputError` (unknown, missing or duplicate name; wrong datatype or shape) or
    :class:`MessageError` (data that does not fit its own shape/datatype).
    """
    by_name = {s.name: s for s in specs}
    feeds: dict[str, Array] = {}
    for t in inputs:
        spec = by_name.get(t.name)
        if spec is None:
            raise InputError(f"unknown input {t.name!r}; the model takes {sorted(by_name)}")
        if t.name in feeds:
            raise InputError(f"input {t.name!r} given twice")
        if t.datatype is not spec.datatype:
            raise InputError(
                f"input {t.name!r}: model expects {spec.datatype.value}, got {t.datatype.value}"
            )
        if len(t.shape) != len(spec.shape) or any(
            d >= 0 and d != s for d, s in zip(spec.shape, t.shape, strict=False)
        ):
            raise InputError(
                f"input {t.name!r}: shape {t.shape} does not fit the model's {list(spec.shape)}"
            )
        feeds[t.name] = t.to_numpy()
    missing = by_name.keys() - feeds.keys()
    if missing:
        raise InputError(f"missing input(s) {sorted(missing)}")
    return feeds


def decode_feeds(obj: Any, specs: tuple[TensorSpec, ...]) -> Call:
    """A parsed JSON request body as a :class:`~.oip.Call` (id, feeds, requested outputs and
    the request's parameters).

    Raises :class:`MessageError` (schema, data) or :class:`InputError` (signature) with the
    full path's message, or :class:`~.requests.RequestError` for a bad or unsupported
    parameter.
    """
    fast = _fast_feeds(obj, specs)
    if fast is not None:
        params = obj.get("parameters")
        if params is None:
            return _call(Call, (fast[0], fast[1], None, False, None, None))
        binary, priority, timeout_s = request_parameters(params)
        return Call(fast[0], fast[1], None, binary, priority, timeout_s)
    # Before the schema: an input in shared memory has no data, which the schema would refuse
    # with a message about the missing data instead of the feature not offered.
    inputs = obj.get("inputs") if type(obj) is dict else None
    for t in inputs if type(inputs) is list else ():
        tparams = t.get("parameters") if type(t) is dict else None
        if type(tparams) is dict and "shared_memory_region" in tparams:
            raise not_implemented(f"input {str(t.get('name'))[:256]!r}: shared memory")
    # The message models load pydantic (about 10 MiB): only a body off the fast path pays.
    from mcp_edge.shared.protocol.codec import validate
    from mcp_edge.shared.protocol.inference import InferRequest

    req = validate(obj, InferRequest)
    feeds = tensors_to_feeds(req.inputs, specs)
    binary, priority, timeout_s = request_parameters(req.parameters)
    wanted = output_requests(obj.get("outputs"))
    return Call(req.id, feeds, wanted or None, binary, priority, timeout_s)


# Call(...) goes through a Python-level __new__; this builds the same tuple at half the cost.
_call = tuple.__new__


def _fast_feeds(
    obj: Any, specs: tuple[TensorSpec, ...]
) -> tuple[str | None, dict[str, Array]] | None:
    """The feeds of a body that plainly fits ``specs``; None means "use the full path"."""
    if type(obj) is not dict:
        return None
    inputs = obj.get("inputs")
    if type(inputs) is not list or len(inputs) != len(specs):
        return None
    rid = None
    if len(obj) > 1:  # id and parameters are optional; most bodies hold inputs alone
        if not obj.keys() <= _REQUEST_KEYS:
            return None
        rid = obj.get("id")
        if rid is not None and (type(rid) is not str or len(rid) > 256):
            return None
        params = obj.get("parameters")
        if params is not None and type(params) is not dict:
            return None
    plan = _plan(specs)
    feeds: dict[str, Array] = {}
    for t in inputs:
        if type(t) is not dict or not t.keys() <= _TENSOR_KEYS:
            return None
        # ``name`` is a str from here on (checked inline: no cast call on the hot path).
        name = t.get("name")
        entry = plan.get(name) if type(name) is str else None
        if entry is None or name in feeds:
            return None
        spec, datatype, dims, dtype, limit = entry
        shape = t.get("shape")
        data = t.get("data")
        if t.get("datatype") != datatype or type(data) is not list:
            return None
        if type(shape) is not list or len(shape) != len(dims):
            return None
        for d, s in zip(shape, dims, strict=True):
            if type(d) is not int or d < 0 or (s >= 0 and d != s):
                return None
        tparams = t.get("parameters")
        if tparams is not None and type(tparams) is not dict:
            return None
        count = math.prod(shape)
        if count > MAX_TENSOR_ELEMENTS:
            return None
        if dtype is None:  # integers, BOOL, BYTES: the protocol model's own conversion
            from mcp_edge.shared.protocol.inference import InferTensor

            tensor = InferTensor.model_construct(
                name=name,  # type: ignore[arg-type]
                shape=shape,
                datatype=spec.datatype,
                parameters=tparams,
                data=data,
            )
            feeds[name] = tensor.to_numpy()  # type: ignore[index]
            continue
        arr = _floats(data, count, limit)
        if arr is None:
            return None
        feeds[name] = arr.astype(dtype, copy=False).reshape(shape)  # type: ignore[index]
    return rid, feeds


_PlanEntry = tuple[TensorSpec, str, tuple[int, ...], "np.dtype[Any] | None", float]
_PLANS: dict[int, tuple[tuple[TensorSpec, ...], dict[str, _PlanEntry]]] = {}


def _plan(specs: tuple[TensorSpec, ...]) -> dict[str, _PlanEntry]:
    """Per signature, by input name: what the fast path checks (computed once per model)."""
    cached = _PLANS.get(id(specs))
    if cached is not None and cached[0] is specs:
        return cached[1]
    plan: dict[str, _PlanEntry] = {}
    for s in specs:
        # A request's tensor name is 1..256 characters and its shape at most 16 dims (the
        # schema's bounds): a model input outside them never takes the fast path.
        if 0 < len(s.name) <= 256 and len(s.shape) <= 16:
            limit = _FLOAT_MAX.get(s.datatype)
            dtype = None if limit is None else s.datatype.numpy_dtype
            plan[s.name] = (s, s.datatype.value, s.shape, dtype, limit or 0.0)
    if len(_PLANS) > 256:  # models come and go; keep the cache bounded
        _PLANS.clear()
    _PLANS[id(specs)] = (specs, plan)
    return plan


def _floats(data: list[Any], count: int, limit: float) -> Array | None:
    """``data`` as a float/int array of ``count`` values within ``limit``; None if unsure."""
    try:
        raw = np.array(data)
    except (ValueError, TypeError, OverflowError):
        return None
    if raw.size != count or raw.dtype.kind not in _FLOAT_KINDS:
        return None
    if limit == math.inf or not count:
        return raw
    flat = raw if raw.ndim == 1 else raw.reshape(-1)
    # Cheap bound first: every |x| <= sqrt(sum of squares) (JSON holds no NaN/Infinity).
    if raw.dtype.kind == "f" and float(flat.dot(flat)) <= limit * limit:
        return raw
    if float(np.abs(flat).max()) > limit:
        return None
    return raw


def encode_response(
    model_name: str,
    model_version: str,
    request_id: str | None,
    tensors: Sequence[tuple[str, Array, bool]],
) -> tuple[bytes, int | None]:
    """The answer body holding ``tensors`` (name, array, binary) and, when any tensor goes in
    binary (the binary tensor extension), the length of its JSON header; None: all JSON."""
    entries: list[dict[str, Any]] = []
    parts: list[bytes | memoryview] = []
    for name, arr, binary in tensors:
        if binary:
            raw = raw_from_array(arr)
            parts.append(raw)
            entries.append(_tensor_header(name, arr, len(raw)))
        else:
            entries.append(_tensor_json(name, arr))
    body: dict[str, Any] = {
        "model_name": model_name,
        "model_version": model_version,
        "outputs": entries,
    }
    if request_id is not None:
        body["id"] = request_id
    head = orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
    if not parts:
        return head, None
    return b"".join((head, *parts)), len(head)


def _tensor_header(name: str, arr: Array, size: int) -> dict[str, Any]:
    return {
        "name": name,
        "datatype": _kind(arr.dtype)[0],
        "shape": list(arr.shape),
        "parameters": {"binary_data_size": size},
    }


def _kind(dtype: np.dtype[Any]) -> tuple[str, bool]:
    kind = _ANSWER_KINDS.get(dtype)
    if kind is None:
        kind = _ANSWER_KINDS[dtype] = _answer_kind(dtype)
    return kind


def _tensor_json(name: str, arr: Array) -> dict[str, Any]:
    datatype, native = _kind(arr.dtype)
    data: Any
    if datatype == "BYTES":
        data = [v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v) for v in arr.flat]
    elif native:
        data = arr.reshape(-1)  # C-contiguous either way: a view, or a copy when it was not
    else:
        data = arr.reshape(-1).tolist()
    return {"name": name, "datatype": datatype, "shape": list(arr.shape), "data": data}


_ANSWER_KINDS: dict[np.dtype[Any], tuple[str, bool]] = {}


def _answer_kind(dtype: np.dtype[Any]) -> tuple[str, bool]:
    """(protocol datatype, whether orjson writes the array itself) for an output dtype."""
    code = dtype.str
    return Datatype.from_numpy(dtype).value, code[0] in "<|=" and code[1:] in _ORJSON_NATIVE
