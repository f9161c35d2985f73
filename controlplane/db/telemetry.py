"""Queries on telemetry: batched writes for ingestion, reads for the REST API, retention.

Every function runs inside a caller's transaction (:meth:`Database.transaction` or
:meth:`Database.read`). Writes take lists of plain dicts and issue ONE Core statement per table
(an executemany), never an ORM add per row (DESIGN 6: ~270k rows/s against ~20k).

Deployment events are inserted with the dialect's ``INSERT ... ON CONFLICT DO NOTHING`` on
``(device_id, event_seq)``, so a device that resends an event after a reconnect changes nothing.

:func:`version_stats` is what the rollout gates read: per device, version and role, the
requests, errors, shadow agreement and latency histogram of a span of time, in one ``SELECT``
whatever the number of devices.
"""

from __future__ import annotations

import json
import math
import typing
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Integer,
    String,
    Table,
    any_,
    bindparam,
    cast,
    delete,
    func,
    insert,
    select,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite

from mcp_edge.controlplane.db.devices import reported_model_rows
from mcp_edge.controlplane.db.engine import Tx
from mcp_edge.controlplane.db.models import (
    DeploymentEventRow,
    Device,
    HealthSampleRow,
    InferenceStatsRow,
    ReportedModelRow,
    ReportedStateRow,
)

Row = Mapping[str, Any]
DOWNSAMPLE_BUCKET_S = 300
# The Core tables behind the ORM classes (executemany inserts and bulk updates use them).
HEALTH = typing.cast(Table, HealthSampleRow.__table__)
INFERENCE = typing.cast(Table, InferenceStatsRow.__table__)
DEVICES = typing.cast(Table, Device.__table__)
REPORTED_MODELS = typing.cast(Table, ReportedModelRow.__table__)


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
    """Store each device's latest reported state (one row per device, replaced) and, in the
    same transaction, the models it lists with the version, variant and backend each runs
    (``device_reported_models``, replaced; see
    :func:`controlplane.db.devices.reported_model_rows`): an upsert, a delete per thousand
    devices and an insert. The upsert comes first, so on PostgreSQL the devices' rows are
    locked before their models are replaced."""
    if not rows:
        return 0
    stmt = _dialect_insert(tx, ReportedStateRow.__table__)
    stmt = stmt.on_conflict_do_update(
        index_elements=["device_id"],
        set_={c: stmt.excluded[c] for c in ("ts", "received_at", "applied_seq", "document")},
    )
    await tx.execute(stmt, list(rows))
    latest = {row["device_id"]: row["document"] for row in rows}  # the last one of a device
    models = REPORTED_MODELS
    ids = list(latest)
    for start in range(0, len(ids), 1000):  # bound the statement's parameters
        chunk = ids[start : start + 1000]
        await tx.execute(delete(models).where(models.c.device_id.in_(chunk)))
    listed = [m for d, doc in latest.items() for m in reported_model_rows(d, doc)]
    if listed:
        await tx.execute(insert(models), listed)
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


# ------------------------------------------------------------------------------- rollout gates
@dataclass(frozen=True)
class VersionTotals:
    """One device's inference statistics for one model version in one role, summed over a span
    of time (:func:`version_stats`); latencies in milliseconds.

    ``latency_edges_ms`` and ``latency_counts`` are the merged histogram of the successful
    requests (``latency_counts[i]``: at most ``latency_edges_ms[i]``, the last: above the last
    edge), empty when the rows' histograms could not be merged. ``p95_ms``: the upper edge of
    the bucket holding the 95th-percentile request (the last edge when that is the bucket above
    it: at least that much), or without a merged histogram the request-weighted mean of the
    rows' own p95; None when no successful request was timed.
    """

    requests: int
    errors: int
    p95_ms: float | None
    latency_edges_ms: tuple[float, ...]
    latency_counts: tuple[int, ...]
    shadow_compared: int
    shadow_agreed: int


VersionKey = tuple[str, str, str]
"""``(device_id, version, role)``; role ``stable``, ``canary`` or ``shadow``."""


async def version_stats(
    tx: Tx,
    device_ids: Collection[str],
    model: str,
    since: datetime,
    until: datetime | None = None,
) -> dict[VersionKey, VersionTotals]:
    """The inference statistics of ``model`` on ``device_ids`` from ``since`` (inclusive) to
    ``until`` (exclusive; None: now), per device, version and role (rows stored before roles,
    role NULL, count as ``stable``).

    Requests, errors and shadow counters are summed. Latency histograms are merged when every
    row with requests has one, all with the same edges; otherwise the histogram is dropped and
    ``p95_ms`` is the mean of the rows' p95 weighted by their requests. One ``SELECT`` whatever
    the number of devices: the ids travel as one array (PostgreSQL) or one JSON text (SQLite)
    parameter, never as one parameter each.
    """
    ids = sorted(set(device_ids))
    if not ids:
        return {}
    t = INFERENCE
    query = select(
        t.c.device_id, t.c.version, t.c.role, t.c["count"], t.c.errors, t.c.p95_ms,
        t.c.latency_hist, t.c.shadow_compared, t.c.shadow_agreed,
    ).where(t.c.model == model, t.c.ts >= since, _among(tx, t.c.device_id, ids))  # fmt: skip
    if until is not None:
        query = query.where(t.c.ts < until)
    totals: dict[VersionKey, _Totals] = {}
    for row in await tx.execute(query):
        key = (row.device_id, row.version, row.role or "stable")
        acc = totals.get(key)
        if acc is None:
            acc = totals[key] = _Totals()
        acc.add(row)
    return {key: acc.result() for key, acc in totals.items()}


def _among(tx: Tx, column: Any, ids: list[str]) -> ColumnElement[bool]:
    """``column`` is one of ``ids``, bound as a single parameter."""
    if tx.get_bind().dialect.name == "sqlite":
        each = func.json_each(bindparam("device_ids", json.dumps(ids))).table_valued("value")
        return typing.cast(ColumnElement[bool], column.in_(select(each.c.value)))
    array = bindparam("device_ids", ids, type_=postgresql.ARRAY(String))
    return typing.cast(ColumnElement[bool], column == any_(array))


class _Totals:
    """The sums of one ``(device, version, role)`` while its rows are read."""

    def __init__(self) -> None:
        self.requests = self.errors = self.compared = self.agreed = 0
        self.edges: tuple[float, ...] | None = None
        self.counts: list[int] = []
        self.mergeable = True
        self.p95_weighted = 0.0
        self.p95_requests = 0

    def add(self, row: Any) -> None:
        count = int(row.count or 0)
        self.requests += count
        self.errors += int(row.errors or 0)
        self.compared += int(row.shadow_compared or 0)
        self.agreed += int(row.shadow_agreed or 0)
        if row.p95_ms is not None and count > 0:
            self.p95_weighted += float(row.p95_ms) * count
            self.p95_requests += count
        if count == 0 or not self.mergeable:
            return
        hist = _histogram(row.latency_hist)
        if hist is None or (self.edges is not None and hist[0] != self.edges):
            self.mergeable = False
            return
        if self.edges is None:
            self.edges, self.counts = hist[0], list(hist[1])
        else:
            self.counts = [a + b for a, b in zip(self.counts, hist[1], strict=True)]

    def result(self) -> VersionTotals:
        if self.mergeable and self.edges is not None:
            edges, counts = self.edges, tuple(self.counts)
            p95 = histogram_p95(edges, counts)
        else:
            edges, counts = (), ()
            p95 = self.p95_weighted / self.p95_requests if self.p95_requests else None
        return VersionTotals(
            requests=self.requests,
            errors=self.errors,
            p95_ms=p95,
            latency_edges_ms=edges,
            latency_counts=counts,
            shadow_compared=self.compared,
            shadow_agreed=self.agreed,
        )


def _histogram(doc: Any) -> tuple[tuple[float, ...], tuple[int, ...]] | None:
    """A stored ``{"edges_ms", "counts"}`` as tuples, or None when absent or not well formed."""
    if not isinstance(doc, dict):
        return None
    edges, counts = doc.get("edges_ms"), doc.get("counts")
    if not isinstance(edges, list) or not isinstance(counts, list) or len(counts) != len(edges) + 1:
        return None
    try:
        return tuple(float(e) for e in edges), tuple(int(c) for c in counts)
    except (TypeError, ValueError):
        return None


def histogram_p95(edges: Sequence[float], counts: Sequence[int]) -> float | None:
    """The upper edge (ms) of the bucket holding the 95th-percentile request of a histogram
    (``counts`` has one more entry than ``edges``; the last edge when it is the bucket above
    the last edge); None for an empty histogram or one without edges."""
    total = sum(counts)
    if total <= 0 or not edges:
        return None
    rank = math.ceil(0.95 * total)
    seen = 0
    for i, n in enumerate(counts):
        seen += n
        if seen >= rank:
            return float(edges[min(i, len(edges) - 1)])
    return float(edges[-1])
