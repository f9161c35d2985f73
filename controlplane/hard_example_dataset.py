"""A trigger's hard examples as a dataset: an ``.npz`` and its JSON metadata
(docs/hard-examples.md "Dataset format").

The ``.npz`` (read with ``numpy.load(path)``; no object arrays, so ``allow_pickle`` stays off)::

    inputs        (N, *shape) when every input has one datatype and shape, else
    input_{i}     one array per example i
    outputs       (N, *shape) when every example has an output of one datatype and shape, else
    output_{i}    one array per example i that has an output
    ids           int64 (N,)   the stored examples' ids
    device_ids    str (N,)     the device each example came from
    times         float64 (N,) the device's clock when it kept the input (Unix seconds)
    received_at   float64 (N,) when the control plane stored it (Unix seconds)
    confidences   float64 (N,) the model's top score
    predicted     int64 (N,)   the predicted class, -1 where the device sent none
    sha256        str (N,)     sha256 of each input's raw bytes

Tensors keep the bytes the device sent: little-endian, of the datatype's numpy type
(:data:`NUMPY_TYPES`), so ``inputs[i].tobytes()`` is byte for byte what the device was sent.
The metadata (:func:`metadata`) lists the same examples in the same order.

The archive is written as it is read: the rows' tensor bytes come from the database a page of
ids at a time (:data:`PAGE_ROWS`) and go straight into the archive's members (a stacked array's
``.npy`` header is written first, then its rows), so an export holds one page in memory.
"""

from __future__ import annotations

import asyncio
import zipfile
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import IO, Any

import numpy as np
import numpy.typing as npt

from mcp_edge.controlplane.db import Database
from mcp_edge.controlplane.db import hard_examples as q
from mcp_edge.controlplane.hard_example_checks import HardExampleError

FORMAT = 1
PAGE_ROWS = 64
NUMPY_TYPES = {
    "BOOL": "|b1", "INT8": "|i1", "UINT8": "|u1", "INT16": "<i2", "UINT16": "<u2",
    "FP16": "<f2", "INT32": "<i4", "UINT32": "<u4", "FP32": "<f4", "INT64": "<i8",
    "UINT64": "<u8", "FP64": "<f8",
}  # fmt: skip
"""The numpy type of each Open Inference Protocol datatype, little-endian."""


class ExportChangedError(HardExampleError):
    """Examples were removed while the archive was written."""


def _stacked(specs: Sequence[tuple[str, tuple[int, ...]] | None]) -> bool:
    return bool(specs) and None not in specs and len(set(specs)) == 1


def layout(examples: Sequence[q.ExampleMeta]) -> dict[str, str]:
    """How inputs and outputs are laid out: ``stacked``, ``per_example`` or ``none``."""
    inputs = [(e.input_datatype, tuple(e.input_shape)) for e in examples]
    outputs = [
        (e.output_datatype, tuple(e.output_shape or ())) if e.output_datatype is not None else None
        for e in examples
    ]
    return {
        "inputs": "none" if not inputs else "stacked" if _stacked(inputs) else "per_example",
        "outputs": (
            "none"
            if all(o is None for o in outputs)
            else "stacked"
            if _stacked(outputs)
            else "per_example"
        ),
    }


def _iso(ts: float) -> str | None:
    try:
        return datetime.fromtimestamp(ts, timezone.utc).isoformat()
    except (OverflowError, OSError, ValueError):
        return None


def metadata(
    trigger: q.TriggerInfo,
    examples: Sequence[q.ExampleMeta],
    *,
    total: int,
    next_after_id: int | None,
) -> dict[str, Any]:
    """The JSON metadata of ``examples`` (one page of the trigger's ``total``)."""
    return {
        "format": FORMAT,
        "trigger_id": trigger.id,
        "model": trigger.model,
        "version": trigger.version,
        "count": len(examples),
        "total": total,
        "next_after_id": next_after_id,
        "bytes": sum(e.input_bytes + (e.output_bytes or 0) for e in examples),
        "layout": layout(examples),
        "examples": [
            {
                "index": i,
                "id": e.id,
                "device_id": e.device_id,
                "version": e.version,
                "device_ts": e.device_ts,
                "time": _iso(e.device_ts),
                "received_at": e.received_at.isoformat(),
                "confidence": e.confidence,
                "predicted": e.predicted,
                "sha256": e.sha256,
                "input": {
                    "name": e.input_name,
                    "datatype": e.input_datatype,
                    "shape": e.input_shape,
                    "bytes": e.input_bytes,
                },
                "output": (
                    {
                        "name": e.output_name,
                        "datatype": e.output_datatype,
                        "shape": e.output_shape,
                        "bytes": e.output_bytes,
                    }
                    if e.output_datatype is not None
                    else None
                ),
            }
            for i, e in enumerate(examples)
        ],
    }


def _header(fp: IO[bytes], datatype: str, shape: tuple[int, ...]) -> None:
    np.lib.format.write_array_header_1_0(
        fp, {"descr": NUMPY_TYPES[datatype], "fortran_order": False, "shape": shape}
    )


def _write_array(zf: zipfile.ZipFile, name: str, array: npt.NDArray[Any]) -> None:
    with zf.open(f"{name}.npy", "w", force_zip64=True) as member:
        np.lib.format.write_array(member, np.ascontiguousarray(array), allow_pickle=False)


async def _tensors(
    db: Database,
    zf: zipfile.ZipFile,
    examples: Sequence[q.ExampleMeta],
    *,
    outputs: bool,
    stacked: bool,
) -> None:
    """Write the inputs (or outputs) of ``examples`` into ``zf``, a page at a time."""
    chosen = [(i, e) for i, e in enumerate(examples) if not outputs or e.output_datatype]
    if not chosen:
        return
    member: IO[bytes] | None = None
    if stacked:
        first = examples[0]
        datatype = first.output_datatype if outputs else first.input_datatype
        shape = (first.output_shape or []) if outputs else first.input_shape
        member = zf.open("outputs.npy" if outputs else "inputs.npy", "w", force_zip64=True)
        _header(member, str(datatype), (len(examples), *shape))
    try:
        for start in range(0, len(chosen), PAGE_ROWS):
            page = chosen[start : start + PAGE_ROWS]
            async with db.read() as tx:
                data = await q.example_data(tx, [e.id for _, e in page], outputs=outputs)
            missing = [e.id for _, e in page if data.get(e.id) is None]
            if missing:
                raise ExportChangedError(
                    f"hard examples {missing[:5]} were removed during the export; ask again"
                )
            await asyncio.to_thread(_write_page, zf, member, page, data, outputs)
    finally:
        if member is not None:
            member.close()


def _write_page(
    zf: zipfile.ZipFile,
    member: IO[bytes] | None,
    page: Sequence[tuple[int, q.ExampleMeta]],
    data: dict[int, bytes | None],
    outputs: bool,
) -> None:
    for i, e in page:
        raw = data[e.id] or b""
        if member is not None:
            member.write(raw)
            continue
        datatype = e.output_datatype if outputs else e.input_datatype
        shape = (e.output_shape or []) if outputs else e.input_shape
        with zf.open(f"{'output' if outputs else 'input'}_{i}.npy", "w", force_zip64=True) as m:
            _header(m, str(datatype), tuple(shape))
            m.write(raw)


async def write_npz(db: Database, examples: Sequence[q.ExampleMeta], out: IO[bytes]) -> None:
    """Write the ``.npz`` of ``examples`` (in their order) to ``out``.

    Raises :class:`ExportChangedError` when a row vanished meanwhile,
    :class:`controlplane.db.DatabaseError`.
    """
    shape = layout(examples)
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
        await _tensors(db, zf, examples, outputs=False, stacked=shape["inputs"] == "stacked")
        await _tensors(db, zf, examples, outputs=True, stacked=shape["outputs"] == "stacked")
        columns: dict[str, npt.NDArray[Any]] = {
            "ids": np.array([e.id for e in examples], dtype=np.int64),
            "device_ids": np.array([e.device_id for e in examples], dtype="<U64"),
            "times": np.array([e.device_ts for e in examples], dtype=np.float64),
            "received_at": np.array(
                [e.received_at.timestamp() for e in examples], dtype=np.float64
            ),
            "confidences": np.array([e.confidence for e in examples], dtype=np.float64),
            "predicted": np.array(
                [-1 if e.predicted is None else e.predicted for e in examples], dtype=np.int64
            ),
            "sha256": np.array([e.sha256 for e in examples], dtype="<U64"),
        }
        await asyncio.to_thread(_write_columns, zf, columns)


def _write_columns(zf: zipfile.ZipFile, columns: dict[str, npt.NDArray[Any]]) -> None:
    for name, array in columns.items():
        _write_array(zf, name, array)
