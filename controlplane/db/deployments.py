"""Queries on deployments, per-device desired models and signed desired states.

Every function runs inside a caller's transaction. Rows leave as frozen views, so callers never
hold an ORM object whose attributes could trigger lazy I/O. Model versions are read from the
registry's ``model_versions`` table (filled by publishing).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import and_, delete, or_, select, tuple_, update
from sqlalchemy.dialects import postgresql, sqlite

from mcp_edge.controlplane.db.engine import Tx
from mcp_edge.controlplane.db.models import (
    DeploymentRow,
    DesiredStateRow,
    Device,
    DeviceModelRow,
    Model,
    ModelVersion,
    ReportedStateRow,
)
from mcp_edge.shared.protocol.canary import DEFAULT_CANARY_POLICY, CanaryPolicy


@dataclass(frozen=True)
class VersionView:
    """A published model version: what a desired state needs to name it as a TUF target."""

    model: str
    version: str
    version_numeric: int
    target_path: str
    sha256: str
    length: int
    profiles: tuple[str, ...]


@dataclass(frozen=True)
class DeploymentView:
    """One deploy or undeploy action as the API shows it."""

    id: int
    action: str
    model: str
    version: str | None
    device_id: str | None
    group_name: str | None
    labels: dict[str, str] | None
    canary_version: str | None
    canary_weight: float | None
    canary_max_error_rate: float | None
    canary_min_requests: int | None
    shadow_version: str | None
    rollback: bool
    created_by: str
    created_at: datetime
    devices_matched: int
    prefetch_version: str | None = None
    rollout_id: int | None = None

    @property
    def canary_policy(self) -> CanaryPolicy | None:
        """The canary's policy as stored; None without a canary."""
        if self.canary_version is None:
            return None
        return stored_policy(
            self.canary_weight, self.canary_max_error_rate, self.canary_min_requests
        )


@dataclass(frozen=True)
class DeviceModelView:
    """What one device should run of one model."""

    device_id: str
    model: str
    stable_version: str
    canary_version: str | None = None
    canary_weight: float | None = None
    canary_max_error_rate: float | None = None
    canary_min_requests: int | None = None
    shadow_version: str | None = None
    rollback: bool = False
    deployment_id: int | None = None
    updated_at: datetime | None = None
    prefetch_version: str | None = None
    """Downloaded and verified ahead, not run (a rollout's prefetch stage)."""

    @property
    def canary_policy(self) -> CanaryPolicy | None:
        """The canary's policy as stored; None without a canary."""
        if self.canary_version is None:
            return None
        return stored_policy(
            self.canary_weight, self.canary_max_error_rate, self.canary_min_requests
        )


@dataclass(frozen=True)
class DesiredView:
    """A device's last signed desired state; ``published_at`` None until the broker took it."""

    device_id: str
    seq: int
    envelope: dict[str, Any]
    issued_at: datetime
    expires_at: datetime
    refresh_at: datetime
    published_at: datetime | None


@dataclass(frozen=True)
class ReportedView:
    """What the device last reported: the seq it applied and its per-model status dicts."""

    applied_seq: int
    received_at: datetime
    models: list[dict[str, Any]]


def canary_columns(policy: CanaryPolicy | None) -> dict[str, Any]:
    """The ``canary_*`` policy columns of a deployment or device model holding ``policy``
    (all None without a canary). The window is not stored: devices get the default."""
    return {
        "canary_weight": policy.weight if policy else None,
        "canary_max_error_rate": policy.max_error_rate if policy else None,
        "canary_min_requests": policy.min_requests if policy else None,
    }


def stored_policy(
    weight: float | None, max_error_rate: float | None, min_requests: int | None
) -> CanaryPolicy:
    """The policy a row's ``canary_*`` columns hold; a NULL (a row older than the column) is
    the default. Raises ValueError for stored values out of range."""
    d = DEFAULT_CANARY_POLICY
    return CanaryPolicy(
        weight=d.weight if weight is None else weight,
        max_error_rate=d.max_error_rate if max_error_rate is None else max_error_rate,
        min_requests=d.min_requests if min_requests is None else min_requests,
    )


def _version_view(row: ModelVersion) -> VersionView:
    return VersionView(
        model=row.model,
        version=row.version,
        version_numeric=int(row.version_numeric),
        target_path=row.target_path,
        sha256=row.sha256,
        length=int(row.length),
        profiles=tuple(row.profiles or ()),
    )


def _deployment_view(row: DeploymentRow) -> DeploymentView:
    return DeploymentView(
        id=row.id,
        action=row.action,
        model=row.model,
        version=row.version,
        device_id=row.device_id,
        group_name=row.group_name,
        labels=dict(row.labels) if row.labels is not None else None,
        canary_version=row.canary_version,
        canary_weight=row.canary_weight,
        canary_max_error_rate=row.canary_max_error_rate,
        canary_min_requests=row.canary_min_requests,
        shadow_version=row.shadow_version,
        rollback=row.rollback,
        created_by=row.created_by,
        created_at=row.created_at,
        devices_matched=row.devices_matched,
        prefetch_version=row.prefetch_version,
        rollout_id=row.rollout_id,
    )


def _device_model_view(row: DeviceModelRow) -> DeviceModelView:
    return DeviceModelView(
        device_id=row.device_id,
        model=row.model,
        stable_version=row.stable_version,
        canary_version=row.canary_version,
        canary_weight=row.canary_weight,
        canary_max_error_rate=row.canary_max_error_rate,
        canary_min_requests=row.canary_min_requests,
        shadow_version=row.shadow_version,
        rollback=row.rollback,
        deployment_id=row.deployment_id,
        updated_at=row.updated_at,
        prefetch_version=row.prefetch_version,
    )


def _desired_view(row: DesiredStateRow) -> DesiredView:
    return DesiredView(
        device_id=row.device_id,
        seq=int(row.seq),
        envelope=dict(row.envelope),
        issued_at=row.issued_at,
        expires_at=row.expires_at,
        refresh_at=row.refresh_at,
        published_at=row.published_at,
    )


# ---------------------------------------------------------------------------- registry reads
async def model_exists(tx: Tx, model: str) -> bool:
    return (await tx.execute(select(Model.name).where(Model.name == model))).first() is not None


async def lock_model(tx: Tx, model: str) -> None:
    """Hold the model's row until the transaction ends (``SELECT ... FOR UPDATE`` on
    PostgreSQL; SQLite's write transactions are serial already), so two rollouts of one model
    are never created at once past each other's overlap check."""
    await tx.execute(select(Model.name).where(Model.name == model).with_for_update())


async def get_versions(
    tx: Tx, pairs: Collection[tuple[str, str]]
) -> dict[tuple[str, str], VersionView]:
    """The published versions among ``(model, version)`` pairs, keyed by the pair."""
    if not pairs:
        return {}
    rows = await tx.execute(
        select(ModelVersion).where(
            tuple_(ModelVersion.model, ModelVersion.version).in_(list(pairs))
        )
    )
    return {(r.model, r.version): _version_view(r) for r in rows.scalars()}


async def get_version(tx: Tx, model: str, version: str) -> VersionView | None:
    return (await get_versions(tx, [(model, version)])).get((model, version))


# ---------------------------------------------------------------------------- deployments
async def insert_deployment(tx: Tx, **fields: Any) -> DeploymentView:
    """Insert a deployment row (columns of :class:`DeploymentRow` as keywords)."""
    row = DeploymentRow(**fields)
    tx.add(row)
    await tx.flush()
    return _deployment_view(row)


async def list_deployments(
    tx: Tx, *, limit: int, before_id: int | None = None, model: str | None = None
) -> list[DeploymentView]:
    """Newest first; page with ``before_id`` (the smallest id of the previous page)."""
    query = select(DeploymentRow)
    if before_id is not None:
        query = query.where(DeploymentRow.id < before_id)
    if model is not None:
        query = query.where(DeploymentRow.model == model)
    rows = await tx.execute(query.order_by(DeploymentRow.id.desc()).limit(limit))
    return [_deployment_view(r) for r in rows.scalars()]


async def standing_deployments(
    tx: Tx, *, device_id: str, group_name: str | None
) -> list[DeploymentView]:
    """Deployments that may apply to a newly accepted device, newest first: those naming the
    device, its group, or any label selector (the caller matches labels)."""
    conditions = [DeploymentRow.device_id == device_id, DeploymentRow.labels.is_not(None)]
    if group_name is not None:
        conditions.append(DeploymentRow.group_name == group_name)
    rows = await tx.execute(
        select(DeploymentRow).where(or_(*conditions)).order_by(DeploymentRow.id.desc())
    )
    return [_deployment_view(r) for r in rows.scalars()]


# ---------------------------------------------------------------------------- device models
async def device_models(tx: Tx, device_ids: Iterable[str]) -> dict[str, list[DeviceModelView]]:
    """Every desired model of each device (an empty list for a device without any)."""
    ids = list(device_ids)
    out: dict[str, list[DeviceModelView]] = {i: [] for i in ids}
    if not ids:
        return out
    rows = await tx.execute(
        select(DeviceModelRow)
        .where(DeviceModelRow.device_id.in_(ids))
        .order_by(DeviceModelRow.device_id, DeviceModelRow.model)
    )
    for row in rows.scalars():
        out[row.device_id].append(_device_model_view(row))
    return out


async def put_device_model(tx: Tx, view: DeviceModelView, *, now: datetime) -> None:
    """Create or replace what ``view.device_id`` should run of ``view.model``."""
    row = await tx.get(DeviceModelRow, (view.device_id, view.model))
    if row is None:
        row = DeviceModelRow(device_id=view.device_id, model=view.model)
        tx.add(row)
    row.stable_version = view.stable_version
    row.canary_version = view.canary_version
    row.canary_weight = view.canary_weight
    row.canary_max_error_rate = view.canary_max_error_rate
    row.canary_min_requests = view.canary_min_requests
    row.shadow_version = view.shadow_version
    row.rollback = view.rollback
    row.prefetch_version = view.prefetch_version
    row.deployment_id = view.deployment_id
    row.updated_at = now
    await tx.flush()


async def put_device_models(tx: Tx, views: Sequence[DeviceModelView], *, now: datetime) -> None:
    """Create or replace many device models at once, as one executemany upsert (a rollout
    step may place a version on thousands of devices)."""
    table = DeviceModelRow.__table__
    dialect_insert: Any = (
        sqlite.insert if tx.get_bind().dialect.name == "sqlite" else postgresql.insert
    )
    columns = (
        "stable_version", "canary_version", "canary_weight", "canary_max_error_rate",
        "canary_min_requests", "shadow_version", "rollback", "prefetch_version",
        "deployment_id", "updated_at",
    )  # fmt: skip
    rows = [
        {
            "device_id": v.device_id,
            "model": v.model,
            **{c: getattr(v, c) for c in columns if c != "updated_at"},
            "updated_at": now,
        }
        for v in views
    ]
    if rows:  # one executemany: the statement is compiled once, whatever the rows
        stmt = dialect_insert(table)
        stmt = stmt.on_conflict_do_update(
            index_elements=["device_id", "model"], set_={c: stmt.excluded[c] for c in columns}
        )
        await tx.execute(stmt, rows)


async def remove_device_models(tx: Tx, model: str, device_ids: Collection[str]) -> None:
    if device_ids:
        await tx.execute(
            delete(DeviceModelRow).where(
                DeviceModelRow.model == model, DeviceModelRow.device_id.in_(list(device_ids))
            )
        )


async def devices_with_model(
    tx: Tx, model: str, *, device_id: str | None = None, group_name: str | None = None
) -> list[str]:
    """Ids of devices that have ``model`` desired, narrowed to one device or one group."""
    query = select(DeviceModelRow.device_id).where(DeviceModelRow.model == model)
    if device_id is not None:
        query = query.where(DeviceModelRow.device_id == device_id)
    if group_name is not None:
        query = query.join(Device, Device.id == DeviceModelRow.device_id).where(
            Device.group_name == group_name
        )
    return list((await tx.execute(query.order_by(DeviceModelRow.device_id))).scalars())


# ---------------------------------------------------------------------------- desired states
async def desired_states(
    tx: Tx, device_ids: Iterable[str], *, lock: bool = False
) -> dict[str, DesiredView]:
    """The stored documents of these devices (absent: never issued). ``lock`` takes row locks
    on PostgreSQL until the transaction ends, so two writers cannot both take the next seq."""
    ids = list(device_ids)
    if not ids:
        return {}
    query = select(DesiredStateRow).where(DesiredStateRow.device_id.in_(ids))
    if lock:  # in id order, so two writers lock the rows they share in the same order
        query = query.order_by(DesiredStateRow.device_id)
        query = query.with_for_update()
    return {r.device_id: _desired_view(r) for r in (await tx.execute(query)).scalars()}


async def save_desired_states(tx: Tx, views: Sequence[DesiredView]) -> None:
    """Create or replace each device's document (a new document is unpublished), as one
    executemany upsert."""
    table = DesiredStateRow.__table__
    dialect_insert: Any = (
        sqlite.insert if tx.get_bind().dialect.name == "sqlite" else postgresql.insert
    )
    columns = ("seq", "envelope", "issued_at", "expires_at", "refresh_at", "published_at")
    rows = [
        {
            "device_id": v.device_id,
            "seq": v.seq,
            "envelope": v.envelope,
            "issued_at": v.issued_at,
            "expires_at": v.expires_at,
            "refresh_at": v.refresh_at,
            "published_at": v.published_at,
        }
        for v in views
    ]
    if rows:  # one executemany: the statement is compiled once, whatever the rows
        stmt = dialect_insert(table)
        stmt = stmt.on_conflict_do_update(
            index_elements=["device_id"], set_={c: stmt.excluded[c] for c in columns}
        )
        await tx.execute(stmt, rows)


async def unpublished(
    tx: Tx, *, limit: int, device_ids: Collection[str] | None = None
) -> list[DesiredView]:
    """Documents the broker has not taken yet, oldest issue first."""
    query = select(DesiredStateRow).where(DesiredStateRow.published_at.is_(None))
    if device_ids is not None:
        query = query.where(DesiredStateRow.device_id.in_(list(device_ids)))
    rows = await tx.execute(query.order_by(DesiredStateRow.issued_at).limit(limit))
    return [_desired_view(r) for r in rows.scalars()]


async def mark_published(tx: Tx, published: Mapping[str, int], now: datetime) -> list[str]:
    """Set ``published_at`` of each device whose document still has the seq published.

    Returns the devices whose document changed meanwhile; those are marked unpublished so the
    newer document goes out after the older one.
    """
    changed: list[str] = []
    for device_id, seq in published.items():
        result = await tx.execute(
            update(DesiredStateRow)
            .where(DesiredStateRow.device_id == device_id, DesiredStateRow.seq == seq)
            .values(published_at=now)
        )
        if getattr(result, "rowcount", 0) == 0:
            changed.append(device_id)
    if changed:
        await tx.execute(
            update(DesiredStateRow)
            .where(DesiredStateRow.device_id.in_(changed))
            .values(published_at=None)
        )
    return changed


async def published_devices(tx: Tx) -> list[str]:
    """Devices whose newest document the broker took (``published_at`` set)."""
    rows = await tx.execute(
        select(DesiredStateRow.device_id).where(DesiredStateRow.published_at.is_not(None))
    )
    return list(rows.scalars())


async def mark_unpublished(tx: Tx, device_ids: Collection[str]) -> None:
    """Clear ``published_at`` of these devices' documents: they go out again."""
    ids = list(device_ids)
    for start in range(0, len(ids), 500):
        await tx.execute(
            update(DesiredStateRow)
            .where(DesiredStateRow.device_id.in_(ids[start : start + 500]))
            .values(published_at=None)
        )


async def due_for_refresh(tx: Tx, now: datetime, *, limit: int) -> list[str]:
    """Accepted devices whose document has reached its refresh time, most urgent first."""
    rows = await tx.execute(
        select(DesiredStateRow.device_id)
        .join(Device, Device.id == DesiredStateRow.device_id)
        .where(and_(DesiredStateRow.refresh_at <= now, Device.status == "accepted"))
        .order_by(DesiredStateRow.refresh_at)
        .limit(limit)
    )
    return list(rows.scalars())


async def reported(tx: Tx, device_id: str) -> ReportedView | None:
    """The device's last reported state, or None when it never reported."""
    row = await tx.get(ReportedStateRow, device_id)
    if row is None:
        return None
    models = row.document.get("models") if isinstance(row.document, dict) else None
    return ReportedView(
        applied_seq=int(row.applied_seq),
        received_at=row.received_at,
        models=[m for m in models or [] if isinstance(m, dict)],
    )


async def reported_active_versions(
    tx: Tx, device_ids: Collection[str], model: str
) -> dict[str, str]:
    """``{device_id: active_version}`` of ``model`` as the devices last reported it."""
    if not device_ids:
        return {}
    rows = await tx.execute(
        select(ReportedStateRow.device_id, ReportedStateRow.document).where(
            ReportedStateRow.device_id.in_(list(device_ids))
        )
    )
    out: dict[str, str] = {}
    for device_id, document in rows:
        for m in (document or {}).get("models") or []:
            if (
                isinstance(m, dict)
                and m.get("name") == model
                and isinstance(m.get("active_version"), str)
            ):
                out[device_id] = m["active_version"]
    return out
