"""Hard examples: inputs a model version answered with low confidence, kept for retraining.

Policy-gated (``DriftPolicy.hard_examples``). The drift tracker (:mod:`agent.fleet.drift`) hands
each sampled row whose top score (:func:`shared.drift.confidences`) is at most
``hard_example_max_confidence`` to :class:`HardExampleReservoir`, with the input row exactly as
the agent decoded it from the request (its dtype, shape ``[1, ...]`` and bytes, little-endian)
and the model's answer to it. Nothing is sent until the control plane asks with the
``upload_hard_examples`` command (:func:`select_for_upload`).

Memory: the reservoir holds at most ``hard_example_budget_bytes`` (the raw tensor bytes of
inputs and outputs, for all model versions together: the budget is the device's). When a new
example does not fit, the **oldest** examples are evicted first, so the reservoir holds the
newest hard examples: after a drift trigger, those are the ones that show what changed. An
example larger than the whole budget is not kept.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from mcp_edge.shared.errors import MessageError, TopicError
from mcp_edge.shared.protocol.topics import validate_id
from mcp_edge.shared.protocol.wire import Datatype

if TYPE_CHECKING:
    from mcp_edge.agent.fleet.drift_rows import Rows
    from mcp_edge.shared.protocol.telemetry import HardExample, TensorBytes

MAX_UPLOAD_EXAMPLES = 4096
"""Examples one reply may carry (``HardExampleBatch.examples``)."""
MAX_UPLOAD_ENCODED = 1024 * 1024 - 16 * 1024
"""Encoded JSON of the examples in one reply: under ``CommandReply.MAX_BYTES`` (1 MiB) with
room for the reply around them."""


@dataclass(frozen=True)
class RawTensor:
    """One tensor as bytes: ``data`` is row-major, little-endian, of ``datatype``."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    data: bytes

    def wire(self) -> TensorBytes:
        import base64

        from mcp_edge.shared.protocol.telemetry import TensorBytes

        return TensorBytes(
            name=self.name,
            datatype=self.datatype,
            shape=list(self.shape),
            data_b64=base64.b64encode(self.data).decode("ascii"),
        )


def raw_tensor(name: str, array: np.ndarray[Any, Any]) -> RawTensor | None:
    """``array``'s exact values as a :class:`RawTensor`; None for a non-numeric dtype."""
    dtype = array.dtype
    if dtype.kind not in "biuf":
        return None
    try:
        datatype = Datatype.from_numpy(dtype)
    except MessageError:
        return None
    little = np.ascontiguousarray(array, dtype=dtype.newbyteorder("<"))
    return RawTensor(name, datatype.value, tuple(int(d) for d in array.shape), little.tobytes())


@dataclass(frozen=True)
class Example:
    """One hard example as held on the device."""

    model: str
    version: str
    ts: float
    confidence: float
    predicted: int | None
    input: RawTensor
    output: RawTensor | None

    @property
    def nbytes(self) -> int:
        """Raw tensor bytes (input and output): what the budget and ``max_bytes`` count."""
        return len(self.input.data) + (len(self.output.data) if self.output else 0)

    def wire(self) -> HardExample:
        from mcp_edge.shared.protocol.telemetry import HardExample

        return HardExample(
            model=self.model,
            version=self.version,
            ts=self.ts,
            confidence=min(1.0, max(0.0, self.confidence)),
            predicted=self.predicted,
            input=self.input.wire(),
            output=self.output.wire() if self.output is not None else None,
        )


class HardExampleReservoir:
    """The device's hard examples, oldest first, within ``budget_bytes`` (see the module
    docstring). Not thread-safe: used on the event loop only."""

    def __init__(self, budget_bytes: int = 0) -> None:
        self._examples: collections.deque[Example] = collections.deque()
        self._held: collections.Counter[tuple[str, str]] = collections.Counter()
        self.bytes = 0
        self.evicted = 0
        """Examples pushed out by newer ones."""
        self.refused = 0
        """Examples larger than the whole budget."""
        self._budget = 0
        self.budget_bytes = budget_bytes

    @property
    def budget_bytes(self) -> int:
        return self._budget

    @budget_bytes.setter
    def budget_bytes(self, value: int) -> None:
        """A smaller budget evicts the oldest examples at once; 0 empties the reservoir."""
        self._budget = max(0, int(value))
        self._fit(0)

    def __len__(self) -> int:
        return len(self._examples)

    def __iter__(self) -> Iterator[Example]:
        return iter(self._examples)

    def held(self, model: str, version: str | None = None) -> int:
        """How many examples of ``model`` (of ``version``, or of every version) are held."""
        if version is not None:
            return self._held[(model, version)]
        return sum(n for (m, _), n in self._held.items() if m == model)

    def add(self, example: Example) -> bool:
        """Keep ``example`` (evicting the oldest to make room); False when it is larger than
        the whole budget (or the budget is 0)."""
        size = example.nbytes
        if size > self._budget or self._budget == 0:
            self.refused += 1
            return False
        self._fit(size)
        self._examples.append(example)
        self._held[(example.model, example.version)] += 1
        self.bytes += size
        return True

    def _fit(self, size: int) -> None:
        while self._examples and self.bytes + size > self._budget:
            old = self._examples.popleft()
            self._forget(old)
            self.evicted += 1

    def _forget(self, example: Example) -> None:
        key = (example.model, example.version)
        self._held[key] -= 1
        if self._held[key] <= 0:
            del self._held[key]
        self.bytes -= example.nbytes

    def clear(self) -> None:
        self._examples.clear()
        self._held.clear()
        self.bytes = 0

    def take(
        self,
        model: str,
        version: str | None,
        max_bytes: int,
        *,
        fits: Any = None,
    ) -> list[Example]:
        """Remove and return, oldest first, the examples of ``model`` (and ``version``) whose raw
        bytes fit in ``max_bytes`` together; one that does not fit is skipped (a smaller, newer
        one may). ``fits(example) -> bool``: a further check (the reply's encoded size)."""
        chosen: list[Example] = []
        kept: collections.deque[Example] = collections.deque()
        left = max_bytes
        for ex in self._examples:
            wanted = ex.model == model and (version is None or ex.version == version)
            if (
                wanted
                and ex.nbytes <= left
                and len(chosen) < MAX_UPLOAD_EXAMPLES
                and (fits is None or fits(ex))
            ):
                chosen.append(ex)
                left -= ex.nbytes
                self._forget(ex)
            else:
                kept.append(ex)
        self._examples = kept
        return chosen


def keep_hard_examples(
    reservoir: HardExampleReservoir,
    rows: Rows,
    *,
    model: str,
    version: str,
    input_name: str,
    output_name: str | None,
    max_confidence: float,
    now: float,
) -> None:
    """Put into ``reservoir`` the rows whose top score is at most ``max_confidence``, as their
    requests held them. Only the newest that fit in the budget together are built (older ones
    of the same batch would be evicted by them at once), which bounds the work of a batch."""
    from mcp_edge.shared.drift import confidences

    has = rows.has_scores
    if not has.any() or reservoir.budget_bytes == 0:
        return
    conf = np.full(has.shape[0], np.inf)
    conf[has] = confidences(rows.scores[has])
    newest: list[Example] = []
    size = 0
    for r in reversed(np.flatnonzero(conf <= max_confidence).tolist()):
        x, y, _ = rows.source_row(r)
        tensor = raw_tensor(input_name, x)
        if tensor is None:
            continue
        out = raw_tensor(output_name, y) if y is not None and output_name else None
        ex = Example(
            model=model, version=version, ts=now, confidence=float(conf[r]),
            predicted=int(np.argmax(rows.scores[r])), input=tensor, output=out,
        )  # fmt: skip
        size += ex.nbytes
        if size > reservoir.budget_bytes and newest:
            break
        newest.append(ex)
    for ex in reversed(newest):
        reservoir.add(ex)


@dataclass(frozen=True)
class UploadRequest:
    """The arguments of an ``upload_hard_examples`` command."""

    model: str
    version: str | None
    max_bytes: int


def parse_upload_args(args: Mapping[str, Any], budget_bytes: int) -> UploadRequest:
    """Check ``upload_hard_examples``'s ``args``: ``model`` (required, a name), ``version``
    (optional), ``max_bytes`` (optional int ≥ 0; at most ``budget_bytes``, the default).
    Raises MessageError (the reply says ``bad_request``)."""
    unknown = set(args) - {"model", "version", "max_bytes"}
    if unknown:
        raise MessageError(f"upload_hard_examples: unknown argument(s) {sorted(unknown)}")
    model = args.get("model")
    if not isinstance(model, str):
        raise MessageError("upload_hard_examples needs args.model, a model name")
    try:
        validate_id(model, "model name")
    except TopicError as e:
        raise MessageError(f"upload_hard_examples: {e}") from e
    version = args.get("version")
    if version is not None and (not isinstance(version, str) or not 1 <= len(version) <= 128):
        raise MessageError("upload_hard_examples: args.version must be a version string")
    max_bytes = args.get("max_bytes", budget_bytes)
    if (
        isinstance(max_bytes, bool)
        or not isinstance(max_bytes, int | float)
        or not math.isfinite(max_bytes)
        or max_bytes < 0
    ):
        raise MessageError("upload_hard_examples: args.max_bytes must be a number of bytes >= 0")
    return UploadRequest(model, version, min(int(max_bytes), budget_bytes))


def select_for_upload(
    reservoir: HardExampleReservoir,
    request: UploadRequest,
) -> dict[str, Any]:
    """Take the examples ``request`` asks for out of ``reservoir`` and build the reply's
    ``result``: ``HardExampleBatch.model_dump(mode="json")``."""
    from mcp_edge.shared.protocol.telemetry import HardExampleBatch

    encoded = 0
    built: dict[int, HardExample] = {}

    def fits(ex: Example) -> bool:
        nonlocal encoded
        wire = ex.wire()
        size = len(wire.model_dump_json(exclude_none=True)) + 1
        if encoded + size > MAX_UPLOAD_ENCODED:
            return False
        encoded += size
        built[id(ex)] = wire
        return True

    chosen = reservoir.take(request.model, request.version, request.max_bytes, fits=fits)
    batch = HardExampleBatch(
        examples=[built[id(ex)] for ex in chosen],
        bytes=sum(ex.nbytes for ex in chosen),
        held=reservoir.held(request.model, request.version),
    )
    return batch.model_dump(mode="json", exclude_none=True)
