"""The checks every device's hard-example batch passes before anything of it is stored
(docs/hard-examples.md). Pure: a reply's ``result`` in, checked examples or a counted refusal
out.

:func:`check_batch` refuses a whole batch at its first fault with :class:`BatchRefusedError`,
whose ``reason`` is the label counted in ``mcp_cp_hard_example_batches_refused_total``:

    schema        not a HardExampleBatch (shared/protocol/telemetry.py)
    model         an example of another model than the one asked for
    version       an example of another version than the one asked for
    base64        a tensor whose data is not base64
    shape         a tensor whose bytes are not its datatype's size times its shape's product
    over_budget   the raw bytes of the examples (inputs and outputs) exceed the budget asked
    bytes         the reply's ``bytes`` is not what its examples hold
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import math
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from mcp_edge.shared.errors import McpError
from mcp_edge.shared.protocol.codec import describe_validation_error
from mcp_edge.shared.protocol.state import MAX_HARD_EXAMPLE_BUDGET
from mcp_edge.shared.protocol.telemetry import HardExampleBatch, TensorBytes

ITEM_BYTES = {
    "BOOL": 1, "INT8": 1, "UINT8": 1, "INT16": 2, "UINT16": 2, "FP16": 2,
    "INT32": 4, "UINT32": 4, "FP32": 4, "INT64": 8, "UINT64": 8, "FP64": 8,
}  # fmt: skip
"""Bytes per element of each Open Inference Protocol datatype."""


class HardExampleError(McpError):
    """A collection or export that cannot be made as asked."""


class BatchRefusedError(HardExampleError):
    """A device's reply broke the contract; ``reason`` is the counted label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Tensor:
    """A decoded tensor: raw little-endian bytes as the device sent them."""

    name: str
    datatype: str
    shape: list[int]
    data: bytes


@dataclass(frozen=True)
class Example:
    """One checked hard example, ready to store."""

    model: str
    version: str
    ts: float
    confidence: float
    predicted: int | None
    input: Tensor
    output: Tensor | None
    sha256: str

    @property
    def nbytes(self) -> int:
        return len(self.input.data) + (len(self.output.data) if self.output else 0)


def decode_tensor(tensor: TensorBytes, where: str) -> Tensor:
    """The bytes of ``tensor``, checked against its datatype and shape.

    Raises :class:`BatchRefusedError` (``base64``, ``shape``).
    """
    try:
        data = base64.b64decode(tensor.data_b64, validate=True)
    except (binascii.Error, ValueError) as e:
        raise BatchRefusedError("base64", f"{where}: data is not base64: {e}") from e
    expected = ITEM_BYTES[tensor.datatype] * math.prod(tensor.shape)
    if len(data) != expected:
        raise BatchRefusedError(
            "shape",
            f"{where}: {len(data)} bytes, but {tensor.datatype} of shape {tensor.shape} is "
            f"{expected}",
        )
    return Tensor(tensor.name, tensor.datatype, list(tensor.shape), data)


@dataclass(frozen=True)
class CheckedBatch:
    """A device's batch that passed :func:`check_batch`: its examples (an input repeated in
    the batch kept once; ``repeated`` counts the others) and how many the device still holds."""

    examples: list[Example]
    held: int
    repeated: int


def check_batch(result: Any, *, model: str, version: str | None, max_bytes: int) -> CheckedBatch:
    """Validate a reply's ``result`` as the hard examples of ``model`` (and ``version`` when
    given) within ``max_bytes`` raw bytes (inputs and outputs).

    Raises :class:`BatchRefusedError` for the whole batch at its first fault.
    """
    try:
        batch = HardExampleBatch.model_validate(result)
    except ValidationError as e:
        raise BatchRefusedError(
            "schema", f"not a HardExampleBatch: {describe_validation_error(e)}"
        ) from e
    examples: list[Example] = []
    seen: set[str] = set()
    total = 0
    for i, ex in enumerate(batch.examples):
        where = f"example {i}"
        if ex.model != model:
            raise BatchRefusedError("model", f"{where} is of model {ex.model!r}, not {model!r}")
        if version is not None and ex.version != version:
            raise BatchRefusedError("version", f"{where} is of version {ex.version}, not {version}")
        inp = decode_tensor(ex.input, f"{where} input")
        out = decode_tensor(ex.output, f"{where} output") if ex.output is not None else None
        total += len(inp.data) + (len(out.data) if out else 0)
        if total > max_bytes:
            raise BatchRefusedError(
                "over_budget",
                f"{len(batch.examples)} examples exceed the budget of {max_bytes} bytes "
                f"(over it at example {i})",
            )
        digest = hashlib.sha256(inp.data).hexdigest()
        if digest in seen:
            continue
        seen.add(digest)
        examples.append(
            Example(ex.model, ex.version, ex.ts, ex.confidence, ex.predicted, inp, out, digest)
        )
    if batch.bytes != total:
        raise BatchRefusedError(
            "bytes", f"the reply says {batch.bytes} bytes, its examples hold {total}"
        )
    return CheckedBatch(examples, batch.held, len(batch.examples) - len(examples))


def budget(max_bytes: int | None) -> int:
    """The byte budget a collection enforces: ``max_bytes`` capped at the protocol's ceiling.

    Raises ``ValueError`` for a negative budget.
    """
    if max_bytes is not None and max_bytes < 0:
        raise ValueError(f"max_bytes must be at least 0, not {max_bytes}")
    return MAX_HARD_EXAMPLE_BUDGET if max_bytes is None else min(max_bytes, MAX_HARD_EXAMPLE_BUDGET)
