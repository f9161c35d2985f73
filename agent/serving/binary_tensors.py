"""Tensors as raw bytes: Triton's binary tensor extension (HTTP) and gRPC raw contents.

Both carry a tensor as its elements in row-major order, little-endian, with no padding:
``BOOL`` one byte (0 or 1) each, ``FP16`` two, and so on; ``BYTES`` as each element's length
(4 bytes, little-endian, unsigned) followed by its bytes. :func:`array_from_raw` checks the
declared size against the bytes at hand before anything is allocated and returns a numpy view
of the caller's buffer (no copy) when the buffer is aligned for the element type;
:func:`raw_from_array` is the reverse. :func:`bytes_as_text` turns BYTES elements into the
text model runtimes take. Pure numpy; no transport here.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

from mcp_edge.agent.runtime.runner import Array
from mcp_edge.shared.errors import MessageError
from mcp_edge.shared.protocol.wire import MAX_TENSOR_ELEMENTS, Datatype

_LEN = struct.Struct("<I")
_LITTLE: dict[Datatype, np.dtype[Any]] = {
    d: d.numpy_dtype.newbyteorder("<") for d in Datatype if d is not Datatype.BYTES
}


def element_count(name: str, shape: Sequence[int]) -> int:
    """The number of elements of ``shape``; raises MessageError for a negative dimension or
    more than :data:`MAX_TENSOR_ELEMENTS` (checked as it multiplies, so no overflow)."""
    if len(shape) > 16:
        raise MessageError(f"tensor {name!r}: shape has {len(shape)} dimensions; at most 16")
    count = 1
    for d in shape:
        if type(d) is not int or d < 0:
            raise MessageError(f"tensor {name!r}: shape {list(shape)} must hold integers >= 0")
        count *= d
        if count > MAX_TENSOR_ELEMENTS:
            raise MessageError(
                f"tensor {name!r}: shape {list(shape)} has more than {MAX_TENSOR_ELEMENTS} elements"
            )
    return count


def raw_size(datatype: Datatype, count: int) -> int | None:
    """Bytes ``count`` elements take (None for BYTES: each element carries its length)."""
    if datatype is Datatype.BYTES:
        return None
    return count * _LITTLE[datatype].itemsize


def array_from_raw(name: str, datatype: Datatype, shape: Sequence[int], raw: memoryview) -> Array:
    """The tensor ``name`` held in ``raw`` (exactly its bytes), shaped ``shape``.

    Numeric tensors are a read-only view of ``raw`` where its start is aligned for the element
    type, a copy otherwise. Raises :class:`MessageError` when the byte count does not match
    the shape, a BOOL byte is not 0 or 1, or a BYTES element runs past the end.
    """
    count = element_count(name, shape)
    if datatype is Datatype.BYTES:
        return _bytes_elements(name, raw, count).reshape(tuple(shape))
    dtype = _LITTLE[datatype]
    want = count * dtype.itemsize
    if len(raw) != want:
        raise MessageError(
            f"tensor {name!r}: {datatype.value} {list(shape)} takes {want} bytes, "
            f"the request holds {len(raw)}"
        )
    arr: Array = np.frombuffer(raw, dtype=dtype, count=count)
    if not arr.flags.aligned:
        arr = arr.copy()
    if datatype is Datatype.BOOL:
        as_bytes = np.frombuffer(raw, dtype=np.uint8, count=count)
        if count and int(as_bytes.max()) > 1:
            raise MessageError(f"tensor {name!r}: BOOL bytes must be 0 or 1")
    return arr.reshape(tuple(shape))


def _bytes_elements(name: str, raw: memoryview, count: int) -> Array:
    size = len(raw)
    if count * _LEN.size > size:
        raise MessageError(
            f"tensor {name!r}: {count} BYTES elements need at least {count * _LEN.size} bytes, "
            f"the request holds {size}"
        )
    out = np.empty(count, dtype=object)
    offset = 0
    unpack = _LEN.unpack_from
    for i in range(count):
        if offset + _LEN.size > size:
            raise MessageError(f"tensor {name!r}: BYTES element {i} has no length prefix")
        (n,) = unpack(raw, offset)
        offset += _LEN.size
        if offset + n > size:
            raise MessageError(
                f"tensor {name!r}: BYTES element {i} declares {n} bytes; "
                f"only {size - offset} remain"
            )
        out[i] = bytes(raw[offset : offset + n])
        offset += n
    if offset != size:
        raise MessageError(
            f"tensor {name!r}: {size - offset} bytes left over after its {count} BYTES elements"
        )
    return out


def bytes_as_text(name: str, arr: Array) -> Array:
    """A BYTES tensor's elements decoded from UTF-8 to ``str``, as its JSON form gives them.

    Model runtimes take text for string tensors (onnxruntime would feed a ``bytes`` element as
    its repr, ``"b'...'"``, and answer wrongly without an error), so BYTES inputs that arrive
    raw are handed to the model as text. Raises :class:`MessageError` naming the first
    element that is not UTF-8.
    """
    flat = arr.reshape(-1)
    out: Array = np.empty(flat.shape[0], dtype=object)
    for i, v in enumerate(flat):
        if isinstance(v, bytes):
            try:
                v = v.decode("utf-8")
            except UnicodeDecodeError:
                raise MessageError(
                    f"tensor {name!r}: BYTES element {i} is not UTF-8 text (this server hands "
                    "BYTES inputs to the model as text)"
                ) from None
        out[i] = v
    text: Array = out.reshape(arr.shape)
    return text


def raw_from_array(arr: Array) -> bytes | memoryview:
    """``arr``'s elements as the raw bytes of its protocol datatype (a view where the array is
    already C-contiguous little-endian)."""
    kind = arr.dtype.kind
    if kind in "OUS":
        return bytes_elements_raw(arr)
    # Flat first: memoryview.cast refuses a shape with a zero in it (an empty batch).
    if kind == "b":
        return np.ascontiguousarray(arr).reshape(-1).view(np.uint8).data.cast("B")
    little = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<"))
    return little.reshape(-1).data.cast("B")


def bytes_elements_raw(arr: Array) -> bytes:
    """A BYTES tensor's raw form: each element's 4-byte length, then its bytes (``str``
    elements as UTF-8)."""
    parts: list[bytes] = []
    pack = _LEN.pack
    for v in arr.reshape(-1):
        b = v if isinstance(v, bytes) else str(v).encode("utf-8")
        parts.append(pack(len(b)))
        parts.append(b)
    return b"".join(parts)
