"""Queries on drift: baselines, stored reports, fleet aggregates, rules and retraining triggers.

Every function runs inside a caller's transaction. Reports are inserted with one executemany
per batch; an aggregate bucket is created if missing and then locked (``SELECT ... FOR
UPDATE`` on PostgreSQL; SQLite has one writer at a time), so replicas adding to the same bucket
take turns and the rules they evaluate next see each other's triggers.
"""

from __future__ import annotations

import typing
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import orjson
from sqlalchemy import Select, Table, delete, func, insert, select, update
from sqlalchemy.dialects import postgresql, sqlite

from mcp_edge.controlplane.db.engine import Tx
from mcp_edge.controlplane.db.models import (
    Device,
    DeviceModelRow,
    DriftAggregateRow,
    DriftReportRow,
    DriftRuleRow,
    Model,
    ModelVersion,
    ReportedStateRow,
    RetrainingTriggerRow,
)

CHUNK = 500
REPORTS = typing.cast(Table, DriftReportRow.__table__)
AGGREGATES = typing.cast(Table, DriftAggregateRow.__table__)
MAX_TRIGGER_DEVICES = 1000
"""A trigger lists at most this many device ids (``device_count`` has them all)."""


@dataclass(frozen=True)
class AggregateView:
    model: str
    version: str
    bucket_start: datetime
    bucket_s: int
    samples: int
    reports: int
    devices: int
    counts: dict[str, Any]
    score: float | None
    input_psi: float | None
    class_psi: float | None
    confidence_psi: float | None
    figures: dict[str, Any]
    over: bool
    updated_at: datetime


@dataclass(frozen=True)
class ReportScore:
    """A stored report's scores without its counts: what a chart or a table of many reports
    needs (a report's counts are kilobytes)."""

    id: int
    device_id: str
    model: str
    version: str
    role: str
    received_at: datetime
    window_start: float
    window_end: float
    samples: int
    sample_every: int
    score: float | None
    input_psi: float | None
    class_psi: float | None
    confidence_psi: float | None
    hard_examples: int


@dataclass(frozen=True)
class ReportView(ReportScore):
    """A stored report with its counts (``{"features": {...}, "classes": [...],
    "confidence": [...]}``)."""

    counts: dict[str, Any]


@dataclass(frozen=True)
class RuleView:
    model: str
    threshold: float
    metric: str
    min_devices: int
    min_samples: int
    sustained: int
    cooldown_s: int
    window_s: int
    enabled: bool
    collect_hard_examples: bool
    updated_at: datetime
    updated_by: str


@dataclass(frozen=True)
class TriggerView:
    id: int
    model: str
    version: str
    raised_at: datetime
    status: str
    score: float | None
    figures: dict[str, Any]
    rule: dict[str, Any]
    device_count: int
    device_ids: list[str]
    acknowledged_at: datetime | None
    acknowledged_by: str | None
    note: str


def _chunks(items: Sequence[Any]) -> Iterable[Sequence[Any]]:
    for i in range(0, len(items), CHUNK):
        yield items[i : i + CHUNK]


def _fields(cls: type[Any], row: Any) -> dict[str, Any]:
    return {name: getattr(row, name) for name in cls.__dataclass_fields__}


def _aggregate(row: DriftAggregateRow) -> AggregateView:
    return AggregateView(**_fields(AggregateView, row))


def _trigger(row: RetrainingTriggerRow) -> TriggerView:
    view = _fields(TriggerView, row)
    view["device_ids"] = list(row.device_ids or [])
    return TriggerView(**view)


# ---------------------------------------------------------------------------- baselines
async def baseline_of(tx: Tx, model: str, version: str) -> tuple[bool, dict[str, Any] | None]:
    """``(published, drift_baseline)`` of one model version."""
    row = (
        await tx.execute(
            select(ModelVersion.id, ModelVersion.drift_baseline).where(
                ModelVersion.model == model, ModelVersion.version == version
            )
        )
    ).first()
    if row is None:
        return False, None
    return True, row[1]


# ---------------------------------------------------------------------------- who runs what
async def running_devices(
    tx: Tx, model: str, version: str, device_ids: Collection[str]
) -> set[str]:
    """The devices among ``device_ids`` told to run ``version`` of ``model`` (as stable, canary
    or shadow)."""
    out: set[str] = set()
    told = (
        (DeviceModelRow.stable_version == version)
        | (DeviceModelRow.canary_version == version)
        | (DeviceModelRow.shadow_version == version)
    )
    for chunk in _chunks(sorted(device_ids)):
        rows = await tx.scalars(
            select(DeviceModelRow.device_id).where(
                DeviceModelRow.model == model, told, DeviceModelRow.device_id.in_(list(chunk))
            )
        )
        out.update(rows)
    return out


async def reported_running(
    tx: Tx, model: str, version: str, device_ids: Collection[str]
) -> set[str]:
    """The devices among ``device_ids`` whose last reported state runs ``version`` of
    ``model`` (active, canary or shadow)."""
    out: set[str] = set()
    for chunk in _chunks(sorted(device_ids)):
        rows = await tx.execute(
            select(ReportedStateRow.device_id, ReportedStateRow.document).where(
                ReportedStateRow.device_id.in_(list(chunk))
            )
        )
        for device_id, document in rows:
            models = document.get("models") if isinstance(document, dict) else None
            for m in models if isinstance(models, list) else ():
                if (
                    isinstance(m, dict)
                    and m.get("name") == model
                    and version in (m.get("active_version"), m.get("canary_version"),
                                    m.get("shadow_version"))
                ):  # fmt: skip
                    out.add(device_id)
    return out


# ---------------------------------------------------------------------------- reports
REPORT_COLUMNS = (
    "device_id", "model", "version", "role", "received_at", "window_start", "window_end",
    "samples", "sample_every", "score", "input_psi", "class_psi", "confidence_psi", "counts",
    "hard_examples",
)  # fmt: skip
"""The order of a report row's values (:func:`insert_reports`)."""
_SQLITE_INSERT = (
    f"INSERT INTO drift_reports ({', '.join(REPORT_COLUMNS)}) "
    f"VALUES ({', '.join('?' for _ in REPORT_COLUMNS)})"
)
_RECEIVED, _COUNTS = REPORT_COLUMNS.index("received_at"), REPORT_COLUMNS.index("counts")


def _sqlite_time(at: datetime) -> str:
    """A UTC time as SQLAlchemy's SQLite ``DATETIME`` stores it (``YYYY-MM-DD HH:MM:SS.ffffff``,
    what :class:`UtcDateTime` reads back)."""
    return at.astimezone(timezone.utc).replace(tzinfo=None).isoformat(" ", "microseconds")


async def insert_reports(tx: Tx, rows: Sequence[Sequence[Any]]) -> int:
    """Insert reports, each a tuple of values in :data:`REPORT_COLUMNS` order (``received_at``
    an aware datetime, ``counts`` a JSON-able mapping). One executemany; on SQLite straight to
    the driver, whose insert costs less than the per-row parameter processing it saves."""
    if not rows:
        return 0
    if tx.get_bind().dialect.name == "sqlite":
        params = [
            (*r[:_RECEIVED], _sqlite_time(r[_RECEIVED]), *r[_RECEIVED + 1 : _COUNTS],
             orjson.dumps(r[_COUNTS]).decode(), *r[_COUNTS + 1 :])
            for r in rows
        ]  # fmt: skip
        connection = await tx.connection()
        await connection.exec_driver_sql(_SQLITE_INSERT, params)
    else:
        await tx.execute(insert(REPORTS), [dict(zip(REPORT_COLUMNS, r, strict=True)) for r in rows])
    return len(rows)


def _in_bucket(model: str, version: str, start: datetime, end: datetime) -> Any:
    return (
        (DriftReportRow.model == model)
        & (DriftReportRow.version == version)
        & (DriftReportRow.received_at >= start)
        & (DriftReportRow.received_at < end)
    )


async def bucket_devices(tx: Tx, model: str, version: str, start: datetime, end: datetime) -> int:
    """How many devices sent the reports of a version received in ``[start, end)``."""
    count = await tx.scalar(
        select(func.count(func.distinct(DriftReportRow.device_id))).where(
            _in_bucket(model, version, start, end)
        )
    )
    return int(count or 0)


async def devices_between(
    tx: Tx, model: str, version: str, start: datetime, end: datetime
) -> tuple[int, list[str]]:
    """``(count, first ids)`` of the devices that reported a version in ``[start, end)``."""
    where = _in_bucket(model, version, start, end)
    count = await tx.scalar(
        select(func.count(func.distinct(DriftReportRow.device_id))).where(where)
    )
    ids = await tx.scalars(
        select(DriftReportRow.device_id)
        .where(where)
        .distinct()
        .order_by(DriftReportRow.device_id)
        .limit(MAX_TRIGGER_DEVICES)
    )
    return int(count or 0), list(ids)


async def list_reports(
    tx: Tx,
    *,
    device_id: str,
    model: str | None = None,
    version: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    limit: int = 1000,
) -> list[ReportView]:
    """A device's stored reports, oldest first (the newest ``limit`` of the span)."""
    query = _reports_of(select(DriftReportRow), device_id, model, version, since, until)
    rows = (await tx.scalars(query.order_by(DriftReportRow.id.desc()).limit(limit))).all()
    return [ReportView(**_fields(ReportView, r)) for r in reversed(rows)]


def _reports_of(
    query: Select[Any],
    device_id: str | None,
    model: str | None,
    version: str | None,
    since: datetime | None,
    until: datetime | None,
) -> Select[Any]:
    """``query`` restricted to one device's (or every device's) reports of a span."""
    for column, value in ((DriftReportRow.device_id, device_id), (DriftReportRow.model, model),
                          (DriftReportRow.version, version)):  # fmt: skip
        if value is not None:
            query = query.where(column == value)
    if since is not None:
        query = query.where(DriftReportRow.received_at >= since)
    if until is not None:
        query = query.where(DriftReportRow.received_at < until)
    return query


_SCORE_COLUMNS = tuple(getattr(DriftReportRow, name) for name in ReportScore.__dataclass_fields__)
SCORE_ORDERS = ("-score", "score", "device")
"""How :func:`latest_scores` sorts: by score, largest first (a report without a score
last), smallest first, or by device id."""


async def report_scores(
    tx: Tx,
    *,
    device_id: str,
    model: str | None = None,
    version: str | None = None,
    since: datetime | None = None,
    limit: int = 1000,
) -> list[ReportScore]:
    """A device's reports without their counts, oldest first (the newest ``limit``)."""
    query = _reports_of(select(*_SCORE_COLUMNS), device_id, model, version, since, None)
    rows = (await tx.execute(query.order_by(DriftReportRow.id.desc()).limit(limit))).all()
    return [ReportScore(*row) for row in reversed(rows)]


async def latest_scores(
    tx: Tx,
    *,
    model: str,
    version: str,
    since: datetime | None = None,
    order: str = "-score",
    limit: int = 100,
    offset: int = 0,
) -> tuple[int, list[ReportScore]]:
    """``(devices, page)``: how many devices reported ``version`` of ``model`` since
    ``since``, and a page of each one's newest report in ``order`` (:data:`SCORE_ORDERS`)."""
    newest = (
        _reports_of(select(func.max(DriftReportRow.id).label("id")), None, model, version,
                    since, None)
        .group_by(DriftReportRow.device_id)
        .subquery()
    )  # fmt: skip
    total = await tx.scalar(select(func.count()).select_from(newest))
    score = DriftReportRow.score
    sort = {
        "-score": (score.is_(None), score.desc(), DriftReportRow.device_id),
        "score": (score.is_(None), score, DriftReportRow.device_id),
        "device": (DriftReportRow.device_id,),
    }[order]
    rows = await tx.execute(
        select(*_SCORE_COLUMNS)
        .join(newest, DriftReportRow.id == newest.c.id)
        .order_by(*sort)
        .limit(limit)
        .offset(offset)
    )
    return int(total or 0), [ReportScore(*row) for row in rows]


async def device_counts_since(
    tx: Tx, model: str, version: str, device_ids: Collection[str], since: datetime
) -> dict[str, list[tuple[int, dict[str, Any]]]]:
    """``(samples, counts)`` of each device's reports of a version received since ``since``."""
    out: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    for chunk in _chunks(sorted(device_ids)):
        rows = await tx.execute(
            select(DriftReportRow.device_id, DriftReportRow.samples, DriftReportRow.counts).where(
                DriftReportRow.model == model,
                DriftReportRow.version == version,
                DriftReportRow.received_at >= since,
                DriftReportRow.device_id.in_(list(chunk)),
            )
        )
        for device_id, samples, counts in rows:
            out.setdefault(device_id, []).append((int(samples), counts))
    return out


# ---------------------------------------------------------------------------- aggregates
def _dialect_insert(tx: Tx, table: Any) -> Any:
    if tx.get_bind().dialect.name == "sqlite":
        return sqlite.insert(table)
    return postgresql.insert(table)


async def lock_aggregate(
    tx: Tx, model: str, version: str, start: datetime, bucket_s: int, now: datetime
) -> AggregateView:
    """The bucket's row, created empty if missing, locked until ``tx`` ends."""
    empty = {
        "model": model, "version": version, "bucket_start": start, "bucket_s": bucket_s,
        "samples": 0, "reports": 0, "devices": 0, "counts": {}, "figures": {}, "over": False,
        "updated_at": now,
    }  # fmt: skip
    await tx.execute(_dialect_insert(tx, AGGREGATES).values(**empty).on_conflict_do_nothing())
    row = (
        await tx.scalars(
            select(DriftAggregateRow)
            .where(
                DriftAggregateRow.model == model,
                DriftAggregateRow.version == version,
                DriftAggregateRow.bucket_start == start,
                DriftAggregateRow.bucket_s == bucket_s,
            )
            .with_for_update()
            .execution_options(populate_existing=True)
        )
    ).one()
    return _aggregate(row)


async def update_aggregate(
    tx: Tx, model: str, version: str, start: datetime, bucket_s: int, **values: Any
) -> None:
    await tx.execute(
        update(AGGREGATES)
        .where(
            AGGREGATES.c.model == model,
            AGGREGATES.c.version == version,
            AGGREGATES.c.bucket_start == start,
            AGGREGATES.c.bucket_s == bucket_s,
        )
        .values(**values)
    )


async def recent_buckets(
    tx: Tx, model: str, version: str, bucket_s: int, upto: datetime, limit: int
) -> list[tuple[datetime, bool]]:
    """``(bucket_start, over)`` of a version's newest ``limit`` buckets of ``bucket_s`` at or
    before ``upto``, newest first."""
    rows = await tx.execute(
        select(DriftAggregateRow.bucket_start, DriftAggregateRow.over)
        .where(
            DriftAggregateRow.model == model,
            DriftAggregateRow.version == version,
            DriftAggregateRow.bucket_s == bucket_s,
            DriftAggregateRow.bucket_start <= upto,
        )
        .order_by(DriftAggregateRow.bucket_start.desc())
        .limit(limit)
    )
    return [(start, bool(over)) for start, over in rows]


async def list_aggregates(
    tx: Tx,
    *,
    model: str,
    version: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    limit: int = 1000,
) -> list[AggregateView]:
    """A model's buckets (every version, or one), oldest first (the newest ``limit``)."""
    query = select(DriftAggregateRow).where(DriftAggregateRow.model == model)
    if version is not None:
        query = query.where(DriftAggregateRow.version == version)
    if since is not None:
        query = query.where(DriftAggregateRow.bucket_start >= since)
    if until is not None:
        query = query.where(DriftAggregateRow.bucket_start < until)
    query = query.order_by(DriftAggregateRow.bucket_start.desc(), DriftAggregateRow.version)
    rows = (await tx.scalars(query.limit(limit))).all()
    return [_aggregate(r) for r in reversed(rows)]


# ---------------------------------------------------------------------------- rules
async def get_rule(tx: Tx, model: str) -> RuleView | None:
    row = await tx.get(DriftRuleRow, model)
    return RuleView(**_fields(RuleView, row)) if row is not None else None


async def list_rules(tx: Tx) -> list[RuleView]:
    rows = (await tx.scalars(select(DriftRuleRow).order_by(DriftRuleRow.model))).all()
    return [RuleView(**_fields(RuleView, r)) for r in rows]


async def upsert_rule(tx: Tx, values: dict[str, Any]) -> RuleView:
    row = await tx.get(DriftRuleRow, values["model"], with_for_update=True)
    if row is None:
        row = DriftRuleRow(**values)
        tx.add(row)
    else:
        for key, value in values.items():
            setattr(row, key, value)
    await tx.flush()
    return RuleView(**_fields(RuleView, row))


async def delete_rule(tx: Tx, model: str) -> bool:
    result = await tx.execute(delete(DriftRuleRow).where(DriftRuleRow.model == model))
    return bool(getattr(result, "rowcount", 0))


# ---------------------------------------------------------------------------- triggers
async def last_raised(tx: Tx, model: str, version: str) -> datetime | None:
    value: datetime | None = await tx.scalar(
        select(func.max(RetrainingTriggerRow.raised_at)).where(
            RetrainingTriggerRow.model == model, RetrainingTriggerRow.version == version
        )
    )
    return value


async def insert_trigger(tx: Tx, **fields: Any) -> TriggerView:
    row = RetrainingTriggerRow(**fields)
    tx.add(row)
    await tx.flush()
    return _trigger(row)


async def get_trigger(tx: Tx, trigger_id: int, *, lock: bool = False) -> TriggerView | None:
    query = select(RetrainingTriggerRow).where(RetrainingTriggerRow.id == trigger_id)
    if lock:
        query = query.with_for_update()
    row = (await tx.scalars(query)).one_or_none()
    return _trigger(row) if row is not None else None


async def list_triggers(
    tx: Tx,
    *,
    model: str | None = None,
    version: str | None = None,
    status: str | None = None,
    before_id: int | None = None,
    limit: int = 100,
) -> list[TriggerView]:
    """Triggers, newest first."""
    query = select(RetrainingTriggerRow)
    if model is not None:
        query = query.where(RetrainingTriggerRow.model == model)
    if version is not None:
        query = query.where(RetrainingTriggerRow.version == version)
    if status is not None:
        query = query.where(RetrainingTriggerRow.status == status)
    if before_id is not None:
        query = query.where(RetrainingTriggerRow.id < before_id)
    rows = (await tx.scalars(query.order_by(RetrainingTriggerRow.id.desc()).limit(limit))).all()
    return [_trigger(r) for r in rows]


async def acknowledge(
    tx: Tx, trigger_id: int, *, actor: str, note: str, now: datetime
) -> TriggerView | None:
    """Mark a trigger acknowledged (again: the note and time are replaced); None if absent."""
    row = await tx.get(RetrainingTriggerRow, trigger_id, with_for_update=True)
    if row is None:
        return None
    row.status = "acknowledged"
    row.acknowledged_at = now
    row.acknowledged_by = actor
    row.note = note
    await tx.flush()
    return _trigger(row)


# ---------------------------------------------------------------------------- retention
async def expire(tx: Tx, *, reports_before: datetime, aggregates_before: datetime) -> int:
    """Delete reports received before ``reports_before`` and buckets that started before
    ``aggregates_before``; return the reports deleted."""
    result = await tx.execute(delete(REPORTS).where(REPORTS.c.received_at < reports_before))
    await tx.execute(delete(AGGREGATES).where(AGGREGATES.c.bucket_start < aggregates_before))
    return int(getattr(result, "rowcount", 0) or 0)


# ---------------------------------------------------------------------------- measurement
async def seed_fleet(
    tx: Tx,
    *,
    device_ids: Sequence[str],
    model: str,
    version: str,
    version_numeric: int,
    baseline: dict[str, Any],
    now: datetime,
) -> None:
    """Accepted devices told to run one published version with ``baseline``, written with one
    executemany per table (for :mod:`controlplane.drift.measure` and tests of many devices)."""
    await tx.execute(
        insert(typing.cast(Table, Model.__table__)), [{"name": model, "created_at": now}]
    )
    await tx.execute(
        insert(typing.cast(Table, ModelVersion.__table__)),
        [{
            "model": model, "version": version, "version_numeric": version_numeric,
            "target_path": f"{model}/{version}.mcpb", "sha256": "0" * 64, "length": 0,
            "format": "onnx", "profiles": [], "variants": [], "publisher_keyid": "0" * 64,
            "uploaded_by": "measure", "created_at": now, "drift_baseline": baseline,
        }],
    )  # fmt: skip
    await tx.execute(
        insert(typing.cast(Table, Device.__table__)),
        [{
            "id": d, "public_key": f"{i:064x}", "status": "accepted", "facts": {},
            "agent_version": "", "online": True, "created_at": now, "updated_at": now,
            "accepted_at": now,
        } for i, d in enumerate(device_ids)],
    )  # fmt: skip
    await tx.execute(
        insert(typing.cast(Table, DeviceModelRow.__table__)),
        [{"device_id": d, "model": model, "stable_version": version, "rollback": False,
          "updated_at": now} for d in device_ids],
    )  # fmt: skip
