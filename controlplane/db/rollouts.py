"""Queries on rollouts: the rollout rows, where each target device stands, the history, and the
facts the rollout loop reads about devices (online, reported state, failed events).

Every function runs inside a caller's transaction. Writes of device rows are one statement per
batch, whatever the number of devices (a rollout may move 10,000 devices in one step).
"""

from __future__ import annotations

import typing
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Table, and_, func, insert, or_, select, update
from sqlalchemy.dialects import postgresql, sqlite

from mcp_edge.controlplane.db.engine import Tx
from mcp_edge.controlplane.db.models import (
    DeploymentEventRow,
    Device,
    DeviceModelRow,
    ReportedStateRow,
    RolloutDeviceRow,
    RolloutEventRow,
    RolloutRow,
)

CHUNK = 500
ACTIVE_STATUSES = ("running", "awaiting_approval", "paused", "rolling_back")
"""Statuses of a rollout that has not ended (one per model and overlapping target)."""
STEPPED_STATUSES = ("running", "rolling_back")
"""Statuses the loop steps (the others wait for an operator)."""
DEVICES = typing.cast(Table, RolloutDeviceRow.__table__)


@dataclass(frozen=True)
class RolloutView:
    id: int
    model: str
    version: str
    status: str
    stage: int
    spec: dict[str, Any]
    state: dict[str, Any]
    target_devices: int
    created_by: str
    created_at: datetime
    updated_at: datetime
    ended_at: datetime | None
    step_seq: int
    lease_owner: str | None
    lease_until: datetime | None


@dataclass(frozen=True)
class RolloutDeviceView:
    device_id: str
    stage: int
    phase: str
    since: datetime
    told_at: datetime | None
    from_version: str | None
    mode: str | None
    moves: int


@dataclass(frozen=True)
class RolloutEventView:
    id: int
    rollout_id: int
    at: datetime
    kind: str
    stage: int | None
    actor: str
    reason: str
    detail: dict[str, Any]


@dataclass(frozen=True)
class DeviceSnapshot:
    """What the loop reads of one device: online, the stable version it is told to run, and its
    reported status of the rollout's model (a ``ModelStatus`` dict, or None)."""

    device_id: str
    online: bool
    desired_version: str | None
    reported: Mapping[str, Any] | None


def _view(row: RolloutRow) -> RolloutView:
    return RolloutView(
        id=row.id,
        model=row.model,
        version=row.version,
        status=row.status,
        stage=row.stage,
        spec=dict(row.spec),
        state=dict(row.state),
        target_devices=row.target_devices,
        created_by=row.created_by,
        created_at=row.created_at,
        updated_at=row.updated_at,
        ended_at=row.ended_at,
        step_seq=int(row.step_seq),
        lease_owner=row.lease_owner,
        lease_until=row.lease_until,
    )


def _device_view(row: Any) -> RolloutDeviceView:
    return RolloutDeviceView(
        device_id=row.device_id,
        stage=row.stage,
        phase=row.phase,
        since=row.since,
        told_at=row.told_at,
        from_version=row.from_version,
        mode=row.mode,
        moves=row.moves,
    )


def _chunks(items: Sequence[Any]) -> Iterable[Sequence[Any]]:
    for i in range(0, len(items), CHUNK):
        yield items[i : i + CHUNK]


# ---------------------------------------------------------------------------- rollouts
async def insert_rollout(tx: Tx, **fields: Any) -> RolloutView:
    row = RolloutRow(**fields)
    tx.add(row)
    await tx.flush()
    return _view(row)


async def get_rollout(tx: Tx, rollout_id: int) -> RolloutView | None:
    row = (await tx.execute(select(RolloutRow).where(RolloutRow.id == rollout_id))).scalar()
    return _view(row) if row is not None else None


async def list_rollouts(
    tx: Tx,
    *,
    limit: int,
    before_id: int | None = None,
    model: str | None = None,
    statuses: Collection[str] | None = None,
) -> list[RolloutView]:
    """Newest first; page with ``before_id``."""
    query = select(RolloutRow)
    if before_id is not None:
        query = query.where(RolloutRow.id < before_id)
    if model is not None:
        query = query.where(RolloutRow.model == model)
    if statuses:
        query = query.where(RolloutRow.status.in_(list(statuses)))
    rows = await tx.execute(query.order_by(RolloutRow.id.desc()).limit(limit))
    return [_view(r) for r in rows.scalars()]


async def count_by_status(tx: Tx) -> dict[str, int]:
    rows = await tx.execute(select(RolloutRow.status, func.count()).group_by(RolloutRow.status))
    return {str(status): int(n) for status, n in rows}


async def stepped_rollout_ids(tx: Tx) -> list[int]:
    rows = await tx.execute(
        select(RolloutRow.id).where(RolloutRow.status.in_(STEPPED_STATUSES)).order_by(RolloutRow.id)
    )
    return list(rows.scalars())


async def claim(tx: Tx, rollout_id: int, owner: str, now: datetime, until: datetime) -> bool:
    """Take (or renew) the lease on a rollout for ``owner``: granted when nobody holds it, the
    owner already does, or the holder's lease ran out. One conditional ``UPDATE``."""
    result = await tx.execute(
        update(RolloutRow)
        .where(
            RolloutRow.id == rollout_id,
            or_(
                RolloutRow.lease_owner.is_(None),
                RolloutRow.lease_owner == owner,
                RolloutRow.lease_until.is_(None),
                RolloutRow.lease_until < now,
            ),
        )
        .values(lease_owner=owner, lease_until=until)
    )
    return bool(getattr(result, "rowcount", 0) == 1)


async def release(tx: Tx, owner: str) -> None:
    """Give up every lease ``owner`` holds (a replica stopping cleanly)."""
    await tx.execute(
        update(RolloutRow)
        .where(RolloutRow.lease_owner == owner)
        .values(lease_owner=None, lease_until=None)
    )


async def write_step(
    tx: Tx,
    rollout_id: int,
    *,
    expected_seq: int,
    status: str,
    stage: int,
    state: Mapping[str, Any],
    now: datetime,
    ended: bool,
) -> bool:
    """Store a new step over ``expected_seq``; False when another writer stepped it first
    (nothing is written then, and the caller rolls its transaction back)."""
    values: dict[str, Any] = {
        "status": status,
        "stage": stage,
        "state": dict(state),
        "updated_at": now,
        "step_seq": RolloutRow.step_seq + 1,
    }
    values["ended_at"] = now if ended else None  # a finished rollout rolled back is live again
    result = await tx.execute(
        update(RolloutRow)
        .where(RolloutRow.id == rollout_id, RolloutRow.step_seq == expected_seq)
        .values(**values)
    )
    return bool(getattr(result, "rowcount", 0) == 1)


async def active_targets(tx: Tx, model: str, device_ids: Collection[str]) -> dict[int, int]:
    """Rollouts of ``model`` that have not ended and share target devices with
    ``device_ids``: ``{rollout id: shared devices}``."""
    out: dict[int, int] = {}
    ids = list(device_ids)
    for chunk in _chunks(ids):
        rows = await tx.execute(
            select(RolloutDeviceRow.rollout_id, func.count())
            .join(RolloutRow, RolloutRow.id == RolloutDeviceRow.rollout_id)
            .where(
                RolloutRow.model == model,
                RolloutRow.status.in_(ACTIVE_STATUSES),
                RolloutDeviceRow.device_id.in_(list(chunk)),
            )
            .group_by(RolloutDeviceRow.rollout_id)
        )
        for rollout_id, n in rows:
            out[int(rollout_id)] = out.get(int(rollout_id), 0) + int(n)
    return out


# ---------------------------------------------------------------------------- devices
async def rollout_devices(tx: Tx, rollout_id: int) -> list[RolloutDeviceView]:
    rows = await tx.execute(
        select(DEVICES).where(DEVICES.c.rollout_id == rollout_id).order_by(DEVICES.c.device_id)
    )
    return [_device_view(r) for r in rows]


async def page_devices(
    tx: Tx, rollout_id: int, *, limit: int, offset: int, phase: str | None = None
) -> tuple[list[RolloutDeviceView], int]:
    condition = DEVICES.c.rollout_id == rollout_id
    if phase is not None:
        condition = and_(condition, DEVICES.c.phase == phase)
    total = (await tx.execute(select(func.count()).select_from(DEVICES).where(condition))).scalar()
    rows = await tx.execute(
        select(DEVICES)
        .where(condition)
        .order_by(DEVICES.c.stage, DEVICES.c.device_id)
        .limit(limit)
        .offset(offset)
    )
    return [_device_view(r) for r in rows], int(total or 0)


async def phase_counts(tx: Tx, rollout_ids: Collection[int]) -> dict[int, dict[str, int]]:
    """``{rollout: {phase: devices}}``."""
    out: dict[int, dict[str, int]] = {i: {} for i in rollout_ids}
    if not rollout_ids:
        return out
    rows = await tx.execute(
        select(DEVICES.c.rollout_id, DEVICES.c.phase, func.count())
        .where(DEVICES.c.rollout_id.in_(list(rollout_ids)))
        .group_by(DEVICES.c.rollout_id, DEVICES.c.phase)
    )
    for rollout_id, phase, n in rows:
        out[int(rollout_id)][str(phase)] = int(n)
    return out


async def insert_devices(tx: Tx, rollout_id: int, rows: Sequence[Mapping[str, Any]]) -> None:
    """Insert the target devices of a new rollout (dicts of :class:`RolloutDeviceRow` columns
    without ``rollout_id``)."""
    for chunk in _chunks(list(rows)):
        await tx.execute(insert(DEVICES), [{**r, "rollout_id": rollout_id} for r in chunk])


async def update_devices(tx: Tx, rollout_id: int, rows: Sequence[Mapping[str, Any]]) -> None:
    """Replace the changed device rows of a rollout (each dict: every column but
    ``rollout_id``; its ``moves`` is what to add to the stored count), as one executemany
    upsert."""
    if not rows:
        return
    table: Any = (
        sqlite.insert(DEVICES)
        if tx.get_bind().dialect.name == "sqlite"
        else postgresql.insert(DEVICES)
    )
    columns = ("stage", "phase", "since", "told_at", "from_version", "mode")
    stmt = table.on_conflict_do_update(
        index_elements=["rollout_id", "device_id"],
        set_={
            **{c: table.excluded[c] for c in columns},
            "moves": DEVICES.c.moves + table.excluded.moves,
        },
    )
    await tx.execute(stmt, [{**r, "rollout_id": rollout_id} for r in rows])


# ---------------------------------------------------------------------------- events
async def insert_events(tx: Tx, rows: Sequence[Mapping[str, Any]]) -> None:
    if rows:
        await tx.execute(insert(typing.cast(Table, RolloutEventRow.__table__)), list(rows))


async def list_events(
    tx: Tx, rollout_id: int, *, after_id: int = 0, limit: int = 200
) -> list[RolloutEventView]:
    """Oldest first, after ``after_id`` (so a watcher reads only what is new)."""
    rows = await tx.execute(
        select(RolloutEventRow)
        .where(RolloutEventRow.rollout_id == rollout_id, RolloutEventRow.id > after_id)
        .order_by(RolloutEventRow.id)
        .limit(limit)
    )
    return [
        RolloutEventView(
            id=r.id,
            rollout_id=r.rollout_id,
            at=r.at,
            kind=r.kind,
            stage=r.stage,
            actor=r.actor,
            reason=r.reason,
            detail=dict(r.detail),
        )
        for r in rows.scalars()
    ]


# ---------------------------------------------------------------------------- device facts
async def snapshots(tx: Tx, model: str, device_ids: Sequence[str]) -> dict[str, DeviceSnapshot]:
    """Online flag, desired stable version and reported status of ``model`` for each device
    (three statements per 500 devices)."""
    out: dict[str, DeviceSnapshot] = {}
    for chunk in _chunks(list(device_ids)):
        ids = list(chunk)
        online = dict(
            (await tx.execute(select(Device.id, Device.online).where(Device.id.in_(ids)))).all()
        )
        desired = dict(
            (
                await tx.execute(
                    select(DeviceModelRow.device_id, DeviceModelRow.stable_version).where(
                        DeviceModelRow.model == model, DeviceModelRow.device_id.in_(ids)
                    )
                )
            ).all()
        )
        documents: dict[str, Any] = dict(
            (
                await tx.execute(
                    select(ReportedStateRow.device_id, ReportedStateRow.document).where(
                        ReportedStateRow.device_id.in_(ids)
                    )
                )
            ).all()
        )
        for device_id in ids:
            if device_id not in online:
                continue  # deleted since the rollout started
            status = None
            document = documents.get(device_id)
            models = document.get("models") if isinstance(document, dict) else None
            for m in models if isinstance(models, list) else ():
                if isinstance(m, dict) and m.get("name") == model:
                    status = m
                    break
            out[device_id] = DeviceSnapshot(
                device_id=device_id,
                online=bool(online[device_id]),
                desired_version=desired.get(device_id),
                reported=status,
            )
    return out


async def failed_versions(
    tx: Tx, model: str, device_ids: Sequence[str], since: datetime
) -> dict[str, set[str]]:
    """Versions of ``model`` each device reported an ``error`` deployment event for since
    ``since`` (a failed download, verification, install, warm-up or activation). A download
    error the agent retries (its message ends ``; retrying in N s``) is not a failure."""
    out: dict[str, set[str]] = {}
    for chunk in _chunks(list(device_ids)):
        rows = await tx.execute(
            select(DeploymentEventRow.device_id, DeploymentEventRow.version)
            .where(
                DeploymentEventRow.model == model,
                DeploymentEventRow.outcome == "error",
                DeploymentEventRow.received_at >= since,
                DeploymentEventRow.message.not_like("%; retrying in %"),
                DeploymentEventRow.device_id.in_(list(chunk)),
            )
            .distinct()
        )
        for device_id, version in rows:
            out.setdefault(str(device_id), set()).add(str(version))
    return out
