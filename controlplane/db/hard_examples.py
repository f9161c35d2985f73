"""Queries on hard examples (``hard_examples``) and the little of ``retraining_triggers`` and
``devices`` that collecting them needs. Every function runs inside a caller's transaction.

A collection's rows are written by one executemany (:func:`insert_examples`); listing never
loads the tensor bytes (:func:`list_examples`), which are read a page of ids at a time
(:func:`example_data`), so an export holds one page in memory, not a trigger's whole dataset.
"""

from __future__ import annotations

import typing
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Table, func, insert, select

from mcp_edge.controlplane.db.engine import Tx
from mcp_edge.controlplane.db.models import Device, HardExampleRow, RetrainingTriggerRow

HARD_EXAMPLES = typing.cast(Table, HardExampleRow.__table__)
ACCEPTED = "accepted"


@dataclass(frozen=True)
class TriggerInfo:
    """What collecting a trigger's hard examples needs of it. ``collect``: its rule asked
    for hard examples when it was raised."""

    id: int
    model: str
    version: str
    device_ids: list[str]
    collect: bool


@dataclass(frozen=True)
class ExampleMeta:
    """One stored hard example without its tensor bytes (their lengths instead)."""

    id: int
    trigger_id: int | None
    device_id: str
    model: str
    version: str
    device_ts: float
    received_at: datetime
    confidence: float
    predicted: int | None
    input_name: str
    input_datatype: str
    input_shape: list[int]
    input_bytes: int
    output_name: str | None
    output_datatype: str | None
    output_shape: list[int] | None
    output_bytes: int | None
    sha256: str


@dataclass(frozen=True)
class Reachability:
    """Which of a list of devices can be asked now: accepted and online, accepted and
    offline, and the rest (unknown, pending, revoked...)."""

    online: list[str]
    offline: list[str]
    unknown: list[str]


async def get_trigger(tx: Tx, trigger_id: int) -> TriggerInfo | None:
    row = await tx.get(RetrainingTriggerRow, trigger_id)
    if row is None:
        return None
    rule = row.rule if isinstance(row.rule, dict) else {}
    return TriggerInfo(
        id=row.id,
        model=row.model,
        version=row.version,
        device_ids=[str(d) for d in (row.device_ids or [])],
        collect=bool(rule.get("collect_hard_examples", False)),
    )


async def reachability(tx: Tx, device_ids: Sequence[str]) -> Reachability:
    """Sort ``device_ids`` (order kept, duplicates dropped) by whether they can be asked."""
    wanted = list(dict.fromkeys(device_ids))
    found: dict[str, tuple[str, bool]] = {}
    for start in range(0, len(wanted), 500):
        chunk = wanted[start : start + 500]
        rows = await tx.execute(
            select(Device.id, Device.status, Device.online).where(Device.id.in_(chunk))
        )
        found.update({r.id: (r.status, bool(r.online)) for r in rows})
    online: list[str] = []
    offline: list[str] = []
    unknown: list[str] = []
    for device_id in wanted:
        status, up = found.get(device_id, ("", False))
        if status != ACCEPTED:
            unknown.append(device_id)
        else:
            (online if up else offline).append(device_id)
    return Reachability(online, offline, unknown)


def _scope(trigger_id: int | None) -> Any:
    column = HardExampleRow.trigger_id
    return column.is_(None) if trigger_id is None else column == trigger_id


async def existing_hashes(
    tx: Tx, *, trigger_id: int | None, device_id: str, hashes: Collection[str]
) -> set[str]:
    """Which of ``hashes`` (input sha256) are stored already for ``device_id`` under
    ``trigger_id`` (None: examples collected without a trigger)."""
    found: set[str] = set()
    wanted = sorted(set(hashes))
    for start in range(0, len(wanted), 500):
        rows = await tx.execute(
            select(HardExampleRow.sha256).where(
                _scope(trigger_id),
                HardExampleRow.device_id == device_id,
                HardExampleRow.sha256.in_(wanted[start : start + 500]),
            )
        )
        found.update(rows.scalars())
    return found


async def insert_examples(tx: Tx, rows: Sequence[Mapping[str, Any]]) -> int:
    """Insert example rows (one executemany); return how many."""
    if rows:
        await tx.execute(insert(HARD_EXAMPLES), list(rows))
    return len(rows)


_META = (
    HardExampleRow.id,
    HardExampleRow.trigger_id,
    HardExampleRow.device_id,
    HardExampleRow.model,
    HardExampleRow.version,
    HardExampleRow.device_ts,
    HardExampleRow.received_at,
    HardExampleRow.confidence,
    HardExampleRow.predicted,
    HardExampleRow.input_name,
    HardExampleRow.input_datatype,
    HardExampleRow.input_shape,
    func.length(HardExampleRow.input_data).label("input_bytes"),
    HardExampleRow.output_name,
    HardExampleRow.output_datatype,
    HardExampleRow.output_shape,
    func.length(HardExampleRow.output_data).label("output_bytes"),
    HardExampleRow.sha256,
)


async def list_examples(
    tx: Tx, trigger_id: int | None, *, after_id: int = 0, limit: int = 1000
) -> list[ExampleMeta]:
    """Examples of ``trigger_id`` with ``id > after_id``, oldest first, at most ``limit``."""
    rows = await tx.execute(
        select(*_META)
        .where(_scope(trigger_id), HardExampleRow.id > after_id)
        .order_by(HardExampleRow.id)
        .limit(limit)
    )
    return [ExampleMeta(**{**r._asdict(), "input_shape": list(r.input_shape or [])}) for r in rows]


async def example_data(tx: Tx, ids: Sequence[int], *, outputs: bool) -> dict[int, bytes | None]:
    """The input (or, with ``outputs``, output) bytes of the examples ``ids``, by id."""
    column = HardExampleRow.output_data if outputs else HardExampleRow.input_data
    rows = await tx.execute(select(HardExampleRow.id, column).where(HardExampleRow.id.in_(ids)))
    return {r[0]: (bytes(r[1]) if r[1] is not None else None) for r in rows}


async def count_examples(tx: Tx, trigger_id: int | None) -> int:
    """How many examples ``trigger_id`` holds."""
    result = await tx.execute(
        select(func.count()).select_from(HARD_EXAMPLES).where(_scope(trigger_id))
    )
    return int(result.scalar_one())
