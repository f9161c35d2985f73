"""Protocol pieces that need no schema library: tensor datatypes, error codes, capped JSON, the
inference size limits, the error reply's bytes, command names, and the enrollment status an
enrolled agent reads back at every start.

The agent's serving path (HTTP and MQTT inference on well-formed bodies) imports only these, so
a serving process never loads pydantic and the message models (about 10 MiB of RSS); an
enrolled agent's fleet session likewise (:mod:`shared.protocol.reports` for what it sends). The
message classes (:mod:`shared.protocol.inference`, :mod:`shared.protocol.command`) and
:mod:`shared.protocol.codec` re-export them.
"""

from __future__ import annotations

import enum
from typing import Any

import numpy as np
import orjson

from mcp_edge.shared.errors import MessageError

MAX_TENSOR_ELEMENTS = 16 * 1024 * 1024
MAX_INFER_REQUEST_BYTES = 8 * 1024 * 1024
"""The largest inference request body (``InferRequest.MAX_BYTES``)."""
MAX_INFER_RESPONSE_BYTES = 32 * 1024 * 1024
"""The largest inference answer (``InferResponse.MAX_BYTES``)."""
DEFAULT_MQTT_REPLY_BYTES = 4 * 1024 * 1024
"""Default cap on one reply an agent sends over MQTT and an application client accepts (a
classification or detection answer is a few KiB); configurable up to
:data:`MAX_INFER_RESPONSE_BYTES` (``InferResponse.DEFAULT_MQTT_REPLY_BYTES``)."""


class Datatype(str, enum.Enum):
    BOOL = "BOOL"
    UINT8 = "UINT8"
    UINT16 = "UINT16"
    UINT32 = "UINT32"
    UINT64 = "UINT64"
    INT8 = "INT8"
    INT16 = "INT16"
    INT32 = "INT32"
    INT64 = "INT64"
    FP16 = "FP16"
    FP32 = "FP32"
    FP64 = "FP64"
    BYTES = "BYTES"

    @property
    def numpy_dtype(self) -> np.dtype[Any]:
        return _NUMPY_DTYPES[self]

    @classmethod
    def from_numpy(cls, dtype: np.dtype[Any]) -> Datatype:
        """The protocol datatype for a numpy dtype; raises :class:`MessageError` if none fits."""
        found = _FROM_KIND_SIZE.get((dtype.kind, dtype.itemsize))
        if found is not None:
            return found
        if dtype.kind in ("U", "S", "O"):
            return cls.BYTES
        raise MessageError(f"numpy dtype {dtype} has no Open Inference Protocol datatype")


_TO_NUMPY: dict[Datatype, str] = {
    Datatype.BOOL: "bool",
    Datatype.UINT8: "uint8",
    Datatype.UINT16: "uint16",
    Datatype.UINT32: "uint32",
    Datatype.UINT64: "uint64",
    Datatype.INT8: "int8",
    Datatype.INT16: "int16",
    Datatype.INT32: "int32",
    Datatype.INT64: "int64",
    Datatype.FP16: "float16",
    Datatype.FP32: "float32",
    Datatype.FP64: "float64",
    Datatype.BYTES: "object",
}
_NUMPY_DTYPES: dict[Datatype, np.dtype[Any]] = {d: np.dtype(n) for d, n in _TO_NUMPY.items()}
# Keyed by (kind, itemsize) so any byte order maps; a dict lookup on the response hot path.
_FROM_KIND_SIZE: dict[tuple[str, int], Datatype] = {
    (dt.kind, dt.itemsize): d for d, dt in _NUMPY_DTYPES.items() if d is not Datatype.BYTES
}


class ErrorCode(str, enum.Enum):
    """Why a request failed; maps onto HTTP status codes where one is needed."""

    BAD_REQUEST = "bad_request"
    UNAUTHORIZED = "unauthorized"
    FORBIDDEN = "forbidden"
    NOT_FOUND = "not_found"
    CONFLICT = "conflict"
    TOO_LARGE = "too_large"
    UNSUPPORTED = "unsupported"
    OVERLOADED = "overloaded"
    TIMEOUT = "timeout"
    UNAVAILABLE = "unavailable"
    INTERNAL = "internal"
    NOT_IMPLEMENTED = "not_implemented"
    """A protocol feature this server does not offer (shared memory, sequence batching)."""

    @property
    def http_status(self) -> int:
        return _HTTP_STATUS[self]


_HTTP_STATUS = {
    ErrorCode.BAD_REQUEST: 400,
    ErrorCode.UNAUTHORIZED: 401,
    ErrorCode.FORBIDDEN: 403,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.CONFLICT: 409,
    ErrorCode.TOO_LARGE: 413,
    ErrorCode.UNSUPPORTED: 415,
    ErrorCode.OVERLOADED: 429,
    ErrorCode.TIMEOUT: 504,
    ErrorCode.UNAVAILABLE: 503,
    ErrorCode.INTERNAL: 500,
    ErrorCode.NOT_IMPLEMENTED: 501,
}


def error_reply_body(text: str, code: ErrorCode, retry_after_s: float | None = None) -> bytes:
    """The bytes ``encode(ErrorReply(error=text, code=code, retry_after_s=...))`` gives, built
    without the model (``text`` is not capped here: the caller keeps it short)."""
    body: dict[str, Any] = {"error": text, "code": code.value}
    if retry_after_s is not None:
        body["retry_after_s"] = float(retry_after_s)
    return orjson.dumps(body)


class CommandName(str, enum.Enum):
    """The commands a control plane may send a device (``CommandRequest.name``)."""

    PING = "ping"
    RELOAD = "reload"
    COLLECT_LOGS = "collect_logs"
    UPLOAD_HARD_EXAMPLES = "upload_hard_examples"
    REPORT_STATE = "report_state"


class EnrollmentStatus(str, enum.Enum):
    """Where a device's enrollment stands (:class:`~shared.protocol.enrollment.EnrollmentAnswer`)."""

    ACCEPTED = "accepted"
    PENDING = "pending"


def loads(payload: bytes | bytearray | memoryview | str, *, max_bytes: int) -> Any:
    """Parse JSON with a size cap; raise :class:`MessageError` for too large or invalid."""
    size = len(payload.encode("utf-8")) if isinstance(payload, str) else len(payload)
    if size > max_bytes:
        raise MessageError(f"payload of {size} bytes exceeds the {max_bytes}-byte limit")
    try:
        return orjson.loads(payload)
    except orjson.JSONDecodeError as e:
        raise MessageError(f"payload is not valid JSON: {e}") from e
