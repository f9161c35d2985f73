"""Queries on telemetry: batched writes for ingestion, reads for the REST API, retention.

Every function runs inside a caller's transaction (:meth:`Database.transaction` or
:meth:`Database.read`). Writes take lists of plain dicts and issue ONE Core statement per table
(an executemany), never an ORM add per row (DESIGN 6: ~270k rows/s against ~20k).

Deployment events are inserted with the dialect's ``INSERT ... ON CONFLICT DO NOTHING`` on
``(device_id, event_seq)``, so a device that resends an event after a reconnect changes nothing.
"""

from __future__ import annotations

import typing
from collections.abc import Collection, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, Integer, Table, cast, delete, func, insert, select, update
from sqlalchemy.dialects import postgresql, sqlite

from mcp_edge.controlplane.db.engine import Tx
from mcp_edge.controlplane.db.models import (
    DeploymentEventRow,
    Device,
    HealthSampleRow,
    InferenceStatsRow,
    ReportedStateRow,
)

Row = Mapping[str, Any]
DOWNSAMPLE_BUCKET_S = 300
# The Core tables behind the ORM classes (executemany inserts and bulk updates use them).
HEALTH = typing.cast(Table, HealthSampleRow.__table__)
INFERENCE = typing.cast(Table, InferenceStatsRow.__table__)
DEVICES = typing.cast(Table, Device.__table__)


def _dialect_insert(tx: Tx, table: Any) -> Any:
    """The dialect-specific ``insert`` (both offer ``on_conflict_do_*``)."""
    if tx.get_bind().dialect.name == "sqlite":
        return sqlite.insert(table)
    return postgresql.insert(table)


async def accepted_among(tx: Tx, device_ids: Collection[str]) -> set[str]:
    """The ids in ``device_ids`` that belong to accepted devices."""
    if not device_ids:
        return set()
    rows = await tx.execute(
        select(Device.id).where(Device.id.in_(list(device_ids)), Device.status == "accepted")
    )
    return {r for (r,) in rows}


async def insert_health(tx: Tx, rows: Sequence[Row]) -> int:
    """Insert health samples (one executemany); return how many."""
    if rows:
        await tx.execute(insert(HEALTH), list(rows))
    return len(rows)


async def insert_inference(tx: Tx, rows: Sequence[Row]) -> int:
    """Insert inference-statistics rows (one executemany); return how many."""
    if rows:
        await tx.execute(insert(INFERENCE), list(rows))
    return len(rows)


async def insert_events(tx: Tx, rows: Sequence[Row]) -> int:
    """Insert deployment events, skipping any ``(device_id, event_seq)`` already stored.

    Returns how many rows were offered (the database does not report skipped ones portably
    for an executemany).
    """
    if rows:
        stmt = _dialect_insert(tx, DeploymentEventRow.__table__).on_conflict_do_nothing(
            index_elements=["device_id", "event_seq"]
        )
        await tx.execute(stmt, list(rows))
    return len(rows)


async def upsert_reported(tx: Tx, rows: Sequence[Row]) -> int:
    """Store each device's latest reported state (one row per device, replaced)."""
    if not rows:
        return 0
    stmt = _dialect_insert(tx, ReportedStateRow.__table__)
    stmt = stmt.on_conflict_do_update(
        index_elements=["device_id"],
        set_={c: stmt.excluded[c] for c in ("ts", "received_at", "applied_seq", "document")},
    )
    await tx.execute(stmt, list(rows))
    return len(rows)


async def mark_seen(
    tx: Tx,
    seen: Collection[str],
    online: Collection[str],
    offline: Collection[str],
    now: datetime,
) -> None:
    """Set ``last_seen_at = now`` for ``seen``, and ``online`` true/false for the other two.

    Three statements at most, whatever the number of devices.
    """
    table = DEVICES
    if seen:
        await tx.execute(update(table).where(table.c.id.in_(list(seen))).values(last_seen_at=now))
    if online:
        await tx.execute(update(table).where(table.c.id.in_(list(online))).values(online=True))
    if offline:
        await tx.execute(update(table).where(table.c.id.in_(list(offline))).values(online=False))


async def recent_health(tx: Tx, device_id: str, limit: int) -> list[dict[str, Any]]:
    """The ``limit`` newest health samples of a device, oldest first."""
    t = HealthSampleRow.__table__
    newest = (
        select(t)
        .where(t.c.device_id == device_id)
        .order_by(t.c.ts.desc(), t.c.id.desc())
        .limit(limit)
    )
    rows = [dict(r._mapping) for r in await tx.execute(newest)]
    rows.reverse()
    return rows


async def list_events(tx: Tx, device_id: str, after_seq: int, limit: int) -> list[dict[str, Any]]:
    """Deployment events of a device with ``event_seq > after_seq``, in ``event_seq`` order."""
    t = DeploymentEventRow.__table__
    query = (
        select(t)
        .where(t.c.device_id == device_id, t.c.event_seq > after_seq)
        .order_by(t.c.event_seq)
        .limit(limit)
    )
    return [dict(r._mapping) for r in await tx.execute(query)]


def _bucket(tx: Tx, ts: Any) -> ColumnElement[Any]:
    """``ts`` as a whole number of :data:`DOWNSAMPLE_BUCKET_S` periods since the epoch."""
    if tx.get_bind().dialect.name == "sqlite":
        seconds = cast(func.strftime("%s", ts), Integer)
        return seconds // DOWNSAMPLE_BUCKET_S
    return func.floor(func.extract("epoch", ts) / DOWNSAMPLE_BUCKET_S)


async def expire_telemetry(
    tx: Tx, now: datetime, *, retention: timedelta, downsample_after: timedelta
) -> tuple[int, int]:
    """Retention: delete health samples and inference statistics older than ``retention``;
    thin health samples older than ``downsample_after`` to the first one per device and
    :data:`DOWNSAMPLE_BUCKET_S` period. Returns ``(expired, thinned)`` health-sample counts.

    Deployment events are the flight recorder and are kept.
    """
    h, s = HEALTH, INFERENCE
    expire_before = now - retention
    expired = await tx.execute(delete(h).where(h.c.ts < expire_before))
    await tx.execute(delete(s).where(s.c.ts < expire_before))
    thin_before = now - downsample_after
    keep = (
        select(func.min(h.c.id))
        .where(h.c.ts < thin_before)
        .group_by(h.c.device_id, _bucket(tx, h.c.ts))
    )
    thinned = await tx.execute(delete(h).where(h.c.ts < thin_before, h.c.id.not_in(keep)))
    return int(expired.rowcount or 0), int(thinned.rowcount or 0)  # type: ignore[attr-defined]
