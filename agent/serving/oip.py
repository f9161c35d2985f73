"""What an Open Inference Protocol request asks for besides its tensors, shared by HTTP and gRPC.

A request decodes into a :class:`Call`: its id, the feeds, the outputs it wants and how
(:class:`OutputRequest`: binary or JSON, or the top classes of a classification), and what its
``parameters`` say. Triton's request parameters are read as Triton reads them::

    binary_data_output   bool   every output in binary unless the output says otherwise (HTTP)
    priority             int    0: the default; 1: high, 2: normal, 3 and above: low
    timeout              int    the request's deadline in microseconds
    sequence_id          any    a non-zero id is refused: sequence batching is not offered
    anything else               kept for custom backends, and ignored here

Output parameters: ``binary_data`` (bool, HTTP), ``classification`` (int, the number of top
classes: the classification extension). A ``shared_memory_region`` on an input or an output
is refused with ``not_implemented``: tensors travel in the request. :func:`classify` builds a
classification answer (``"score:index[:label]"`` strings, best first, labels from the bundle),
and :func:`answer_tensors` picks and shapes the tensors an answer holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from mcp_edge.agent.runtime.batcher import Priority
from mcp_edge.agent.runtime.runner import Array, InputError, TensorSpec
from mcp_edge.agent.serving.binary_tensors import (
    array_from_raw,
    bytes_as_text,
    element_count,
    raw_size,
)
from mcp_edge.agent.serving.requests import MAX_TIMEOUT_S, RequestError
from mcp_edge.shared.errors import MessageError
from mcp_edge.shared.protocol.wire import Datatype, ErrorCode

MAX_CLASS_COUNT = 4096
_SHARED_MEMORY = "shared_memory_region"


class OutputRequest(NamedTuple):
    """One output a request asks for."""

    name: str
    binary: bool | None = None
    """True/False as the output asks; None: the request's ``binary_data_output``."""
    class_count: int = 0
    """Above 0: answer the top ``class_count`` classes instead of the tensor."""


class Call(NamedTuple):
    """One decoded inference request."""

    request_id: str | None
    feeds: dict[str, Array]
    outputs: tuple[OutputRequest, ...] | None = None
    """None: every output of the model, in signature order."""
    binary_output: bool = False
    priority: Priority | None = None
    """From the request's ``priority`` parameter; None: the transport's option or default."""
    timeout_s: float | None = None
    """From the request's ``timeout`` parameter (µs); None: the option or default."""


def not_implemented(what: str) -> RequestError:
    return RequestError(ErrorCode.NOT_IMPLEMENTED, f"{what} is not supported by this server")


def bad(message: str) -> RequestError:
    return RequestError(ErrorCode.BAD_REQUEST, message)


def _int_param(value: Any, what: str) -> int:
    if type(value) is not int:
        raise bad(f"{what} must be an integer, not {type(value).__name__}")
    return value


def request_parameters(params: Any) -> tuple[bool, Priority | None, float | None]:
    """(binary_data_output, priority, timeout in seconds) of a request's ``parameters``.

    Raises :class:`RequestError`: bad_request for a value of the wrong type or range,
    not_implemented for a sequence id.
    """
    if params is None:
        return False, None, None
    if type(params) is not dict:
        raise bad("request parameters must be an object")
    binary = params.get("binary_data_output", False)
    if type(binary) is not bool:
        raise bad("parameter binary_data_output must be true or false")
    priority: Priority | None = None
    raw_priority = params.get("priority")
    if raw_priority is not None:
        level = _int_param(raw_priority, "parameter priority")
        if level < 0:
            raise bad("parameter priority must be >= 0")
        if level:
            priority = (
                Priority.HIGH if level == 1 else Priority.NORMAL if level == 2 else (Priority.LOW)
            )
    timeout_s: float | None = None
    raw_timeout = params.get("timeout")
    if raw_timeout is not None:
        us = _int_param(raw_timeout, "parameter timeout (microseconds)")
        if not 0 < us <= MAX_TIMEOUT_S * 1e6:
            raise bad(f"parameter timeout must be in (0, {int(MAX_TIMEOUT_S * 1e6)}] microseconds")
        timeout_s = us / 1e6
    seq = params.get("sequence_id")
    if seq not in (None, 0, ""):
        raise not_implemented("sequence batching (parameter sequence_id)")
    return binary, priority, timeout_s


def output_requests(outputs: Any) -> tuple[OutputRequest, ...] | None:
    """The ``outputs`` of a request body (JSON form) as :class:`OutputRequest` values."""
    if outputs is None:
        return None
    if type(outputs) is not list or len(outputs) > 64:
        raise bad("outputs must be a list of at most 64 objects")
    found: list[OutputRequest] = []
    for o in outputs:
        if type(o) is not dict:
            raise bad("each requested output must be an object")
        name = o.get("name")
        if type(name) is not str or not 0 < len(name) <= 256:
            raise bad("each requested output needs a name of 1 to 256 characters")
        params = o.get("parameters")
        if params is None:
            found.append(OutputRequest(name))
            continue
        if type(params) is not dict:
            raise bad(f"output {name!r}: parameters must be an object")
        if _SHARED_MEMORY in params:
            raise not_implemented(f"output {name!r}: shared memory")
        binary = params.get("binary_data")
        if binary is not None and type(binary) is not bool:
            raise bad(f"output {name!r}: binary_data must be true or false")
        count = params.get("classification", 0)
        count = _int_param(count, f"output {name!r}: classification")
        if not 0 <= count <= MAX_CLASS_COUNT:
            raise bad(f"output {name!r}: classification must be from 0 to {MAX_CLASS_COUNT}")
        found.append(OutputRequest(name, binary, count))
    return tuple(found)


def check_input(
    name: Any,
    datatype: Any,
    shape: Any,
    by_name: dict[str, TensorSpec],
    feeds: dict[str, Array],
) -> tuple[str, Datatype, list[int]]:
    """Check one input's header against the model's inputs before its data is read.

    Raises MessageError (malformed header) or InputError (does not fit the model), with the
    messages the JSON path gives.
    """
    if type(name) is not str or not 0 < len(name) <= 256:
        raise MessageError("each input needs a name of 1 to 256 characters")
    try:
        dt = Datatype(datatype)
    except ValueError:
        raise MessageError(f"input {name!r}: unknown datatype {str(datatype)[:20]!r}") from None
    if type(shape) is not list:
        raise MessageError(f"input {name!r}: shape must be a list of integers")
    element_count(name, shape)
    spec = by_name.get(name)
    if spec is None:
        raise InputError(f"unknown input {name!r}; the model takes {sorted(by_name)}")
    if name in feeds:
        raise InputError(f"input {name!r} given twice")
    if dt is not spec.datatype:
        raise InputError(f"input {name!r}: model expects {spec.datatype.value}, got {dt.value}")
    if len(shape) != len(spec.shape) or any(
        d >= 0 and d != s for d, s in zip(spec.shape, shape, strict=False)
    ):
        raise InputError(
            f"input {name!r}: shape {shape} does not fit the model's {list(spec.shape)}"
        )
    return name, dt, shape


def decode_binary_request(obj: Any, binary: memoryview, specs: tuple[TensorSpec, ...]) -> Call:
    """A request of the binary tensor extension: ``obj`` is its JSON header, ``binary`` the
    bytes after it, claimed in order by the inputs that carry ``binary_data_size``.

    Every size is checked against the bytes left before the tensor is read. Raises
    MessageError, InputError or :class:`RequestError`.
    """
    if type(obj) is not dict:
        raise MessageError("the inference header must be a JSON object")
    inputs = obj.get("inputs")
    if type(inputs) is not list or not 0 < len(inputs) <= 64:
        raise MessageError("inputs must be a list of 1 to 64 tensors")
    rid = obj.get("id")
    if rid is not None and (type(rid) is not str or len(rid) > 256):
        raise MessageError("id must be a string of at most 256 characters")
    binary_output, priority, timeout_s = request_parameters(obj.get("parameters"))
    outputs = output_requests(obj.get("outputs"))
    by_name = {s.name: s for s in specs}
    feeds: dict[str, Array] = {}
    offset = 0
    for t in inputs:
        if type(t) is not dict:
            raise MessageError("each input must be a JSON object")
        params = t.get("parameters")
        if params is not None and type(params) is not dict:
            raise MessageError("input parameters must be an object")
        size = None if params is None else params.get("binary_data_size")
        if params is not None and _SHARED_MEMORY in params:
            raise not_implemented(f"input {t.get('name')!r}: shared memory")
        name, dt, shape = check_input(t.get("name"), t.get("datatype"), t.get("shape"),
                                      by_name, feeds)  # fmt: skip
        if size is None:
            feeds[name] = _json_tensor(t)
            continue
        if "data" in t:
            raise MessageError(f"input {name!r}: give data or binary_data_size, not both")
        if type(size) is not int or size < 0:
            raise MessageError(f"input {name!r}: binary_data_size must be an integer >= 0")
        left = len(binary) - offset
        if size > left:
            raise MessageError(
                f"input {name!r}: binary_data_size {size} runs past the end of the body "
                f"({left} bytes left)"
            )
        fixed = raw_size(dt, element_count(name, shape))
        if fixed is not None and fixed != size:
            raise MessageError(
                f"input {name!r}: {dt.value} {shape} takes {fixed} bytes, "
                f"binary_data_size says {size}"
            )
        arr = array_from_raw(name, dt, shape, binary[offset : offset + size])
        feeds[name] = bytes_as_text(name, arr) if dt is Datatype.BYTES else arr
        offset += size
    if offset != len(binary):
        raise MessageError(
            f"{len(binary) - offset} bytes after the inference header are claimed by no input"
        )
    missing = by_name.keys() - feeds.keys()
    if missing:
        raise InputError(f"missing input(s) {sorted(missing)}")
    return Call(rid, feeds, outputs, binary_output, priority, timeout_s)


def _json_tensor(t: dict[str, Any]) -> Array:
    # A tensor given as JSON beside binary ones: the schema's own checks and conversion.
    from mcp_edge.shared.protocol.codec import validate
    from mcp_edge.shared.protocol.inference import InferTensor

    return validate(t, InferTensor).to_numpy()


def rows_of(feeds: dict[str, Array]) -> int:
    """The rows a request holds: its first input's first dimension (1 for a scalar)."""
    for arr in feeds.values():
        return int(arr.shape[0]) if arr.ndim else 1
    return 1


def classify(arr: Array, class_count: int, labels: Sequence[str]) -> Array:
    """The classification extension: the top ``class_count`` classes of ``arr`` per row, as
    BYTES ``"score:index"`` or ``"score:index:label"`` (Triton's form), best first.

    A 1-D output is one row; otherwise the first dimension is the batch and the rest are the
    classes. Raises InputError for an output that holds no numbers.
    """
    if arr.dtype.kind not in "biuf":
        raise InputError("classification needs a numeric output")
    rows = arr.reshape(1, -1) if arr.ndim <= 1 else arr.reshape(arr.shape[0], -1)
    k = min(class_count, rows.shape[1])
    order = np.argsort(-rows.astype(np.float64, copy=False), axis=1, kind="stable")[:, :k]
    out = np.empty((rows.shape[0], k), dtype=object)
    for r in range(rows.shape[0]):
        for j, idx in enumerate(order[r]):
            i = int(idx)
            text = f"{float(rows[r, i]):f}:{i}"
            if i < len(labels):
                text += f":{labels[i]}"
            out[r, j] = text.encode("utf-8")
    return out.reshape(k) if arr.ndim <= 1 else out


def answer_tensors(
    outputs: dict[str, Array],
    wanted: tuple[OutputRequest, ...] | None,
    default: Sequence[str],
    labels: Sequence[str],
    binary_output: bool,
) -> list[tuple[str, Array, bool]]:
    """(name, array, binary) of each tensor an answer holds, in the order asked.

    Raises InputError for an output the model does not have.
    """
    if wanted is None:
        return [(n, outputs[n], binary_output) for n in default]
    unknown = [o.name for o in wanted if o.name not in outputs]
    if unknown:
        raise InputError(f"unknown output(s) {unknown}; the model has {sorted(outputs)}")
    found: list[tuple[str, Array, bool]] = []
    for o in wanted:
        arr = outputs[o.name]
        if o.class_count:
            arr = classify(arr, o.class_count, labels)
        found.append((o.name, arr, binary_output if o.binary is None else o.binary))
    return found
