"""Open Inference Protocol (KServe v2) request and response bodies, JSON form.

Used unchanged over HTTP (``POST /v2/models/{m}/infer``) and MQTT (``.../infer/{model}``), so
Triton's and KServe's own clients work against an agent. ``data`` is row-major, flat or nested;
:meth:`InferTensor.to_numpy` checks it against ``shape`` and ``datatype`` and
:meth:`InferTensor.from_numpy` builds one from an array.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import numpy as np
from pydantic import Field, StrictInt, field_validator

from mcp_edge.shared.errors import MessageError
from mcp_edge.shared.protocol.base import Identifier, Message
from mcp_edge.shared.protocol.wire import (
    DEFAULT_MQTT_REPLY_BYTES,
    MAX_INFER_REQUEST_BYTES,
    MAX_INFER_RESPONSE_BYTES,
    MAX_TENSOR_ELEMENTS,
    Datatype,
)

__all__ = [
    "MAX_TENSOR_ELEMENTS",
    "Datatype",
    "InferRequest",
    "InferResponse",
    "InferTensor",
    "RequestedOutput",
]


class InferTensor(Message):
    """One named tensor (a request input or a response output)."""

    name: str = Field(min_length=1, max_length=256)
    shape: list[StrictInt] = Field(max_length=16)
    datatype: Datatype
    parameters: dict[str, Any] | None = None
    data: list[Any]

    @field_validator("shape")
    @classmethod
    def _shape(cls, shape: list[int]) -> list[int]:
        if any(d < 0 for d in shape):
            raise ValueError("shape dimensions must be >= 0")
        if math.prod(shape) > MAX_TENSOR_ELEMENTS:
            raise ValueError(f"tensor has more than {MAX_TENSOR_ELEMENTS} elements")
        return shape

    @property
    def element_count(self) -> int:
        return math.prod(self.shape)

    def to_numpy(self) -> np.ndarray[Any, Any]:
        """The tensor as an array of ``shape`` and ``datatype``.

        Raises :class:`MessageError` when ``data`` does not hold exactly ``prod(shape)`` values
        of the declared type (ragged lists, strings in a numeric tensor, out-of-range ints).
        """
        want = self.element_count
        try:
            if self.datatype is Datatype.BYTES:
                arr = np.asarray(self.data, dtype=object).reshape(-1)
                if any(not isinstance(v, str | bytes) for v in arr):
                    raise MessageError(f"input {self.name!r}: BYTES data must be strings")
            else:
                raw = np.asarray(self.data)
                if raw.size == 0:
                    raw = raw.astype(self.datatype.numpy_dtype)
                if raw.dtype.kind not in "biuf":
                    raise MessageError(
                        f"input {self.name!r}: {self.datatype.value} data must be numbers"
                    )
                if (self.datatype is Datatype.BOOL) != (raw.dtype.kind == "b"):
                    raise MessageError(
                        f"input {self.name!r}: BOOL data must be true/false and only BOOL "
                        "data may be"
                    )
                dt = self.datatype.numpy_dtype
                if dt.kind in "iu" and raw.dtype.kind == "f":
                    raw = self._exact_integers(dt)
                if dt.kind in "iu" and raw.size:
                    info = np.iinfo(dt)
                    if raw.min() < info.min or raw.max() > info.max:
                        raise MessageError(
                            f"input {self.name!r}: values out of range for {self.datatype.value}"
                        )
                # JSON carries no NaN/Infinity, so one max() tells whether a value would
                # overflow a narrower float.
                narrowing = dt.kind == "f" and dt.itemsize < raw.dtype.itemsize and raw.size
                if narrowing and float(np.abs(raw).max()) > float(np.finfo(dt).max):
                    raise MessageError(
                        f"input {self.name!r}: values out of range for {self.datatype.value}"
                    )
                arr = raw.astype(dt, copy=False).reshape(-1)
        except ValueError as e:  # ragged nesting, unconvertible values
            raise MessageError(f"input {self.name!r}: data is not a regular array ({e})") from e
        if arr.size != want:
            raise MessageError(
                f"input {self.name!r}: shape {self.shape} needs {want} values, got {arr.size}"
            )
        return arr.reshape(self.shape)

    def _exact_integers(self, dt: np.dtype[Any]) -> np.ndarray[Any, Any]:
        # numpy reads [0, 2**63] as float64; keep Python ints exact, refuse real floats.
        values = np.asarray(self.data, dtype=object).reshape(-1)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            raise MessageError(f"input {self.name!r}: {self.datatype.value} data must be integers")
        info = np.iinfo(dt)
        if any(v < info.min or v > info.max for v in values):
            raise MessageError(
                f"input {self.name!r}: values out of range for {self.datatype.value}"
            )
        return values.astype(dt)

    @classmethod
    def from_numpy(
        cls, name: str, array: np.ndarray[Any, Any], parameters: dict[str, Any] | None = None
    ) -> InferTensor:
        """Build a tensor from an array (row-major flat ``data``)."""
        dt = Datatype.from_numpy(array.dtype)
        flat = array.reshape(-1)
        if dt is Datatype.BYTES:
            data: list[Any] = [
                v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v) for v in flat
            ]
        else:
            data = flat.tolist()
        return cls(
            name=name, shape=list(array.shape), datatype=dt, parameters=parameters, data=data
        )


class RequestedOutput(Message):
    name: str = Field(min_length=1, max_length=256)
    parameters: dict[str, Any] | None = None


class InferRequest(Message):
    """``POST /v2/models/{m}/infer`` body."""

    MAX_BYTES: ClassVar[int] = MAX_INFER_REQUEST_BYTES

    id: str | None = Field(default=None, max_length=256)
    parameters: dict[str, Any] | None = None
    inputs: list[InferTensor] = Field(min_length=1, max_length=64)
    outputs: list[RequestedOutput] | None = Field(default=None, max_length=64)


class InferResponse(Message):
    """Reply to an :class:`InferRequest`."""

    MAX_BYTES: ClassVar[int] = MAX_INFER_RESPONSE_BYTES
    DEFAULT_MQTT_REPLY_BYTES: ClassVar[int] = DEFAULT_MQTT_REPLY_BYTES
    """Default cap on one reply an agent sends over MQTT and an application client accepts
    (a classification or detection answer is a few KiB); configurable up to ``MAX_BYTES``."""

    model_name: Identifier
    model_version: str | None = Field(default=None, max_length=128)
    id: str | None = Field(default=None, max_length=256)
    parameters: dict[str, Any] | None = None
    outputs: list[InferTensor] = Field(max_length=64)
