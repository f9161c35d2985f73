"""Queries on devices and their labels. Every function runs inside a caller's transaction.

Devices leave this module as :class:`DeviceView` (the row plus its labels as a dict), so
callers never hold an ORM object whose attributes could trigger lazy I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Select, delete, exists, func, insert, select

from mcp_edge.controlplane.db.engine import Tx
from mcp_edge.controlplane.db.errors import NotFoundError
from mcp_edge.controlplane.db.models import Device, DeviceLabel


@dataclass(frozen=True)
class DeviceView:
    """A device as the API shows it."""

    id: str
    public_key: str
    status: str
    profile: str | None
    group_name: str | None
    labels: dict[str, str]
    facts: dict[str, Any]
    agent_version: str
    enrollment_token_id: int | None
    online: bool
    last_seen_at: datetime | None
    created_at: datetime
    updated_at: datetime
    accepted_at: datetime | None
    revoked_at: datetime | None


@dataclass(frozen=True)
class DeviceFilter:
    """Conditions ANDed together; ``labels`` must all match; ``online`` None means either."""

    labels: Mapping[str, str] | None = None
    label_keys: Sequence[str] = ()
    profile: str | None = None
    statuses: Sequence[str] = ()
    group: str | None = None
    online: bool | None = None
    search: str | None = None


def _view(device: Device, labels: Mapping[str, str]) -> DeviceView:
    return DeviceView(
        id=device.id,
        public_key=device.public_key,
        status=device.status,
        profile=device.profile,
        group_name=device.group_name,
        labels=dict(labels),
        facts=dict(device.facts or {}),
        agent_version=device.agent_version,
        enrollment_token_id=device.enrollment_token_id,
        online=device.online,
        last_seen_at=device.last_seen_at,
        created_at=device.created_at,
        updated_at=device.updated_at,
        accepted_at=device.accepted_at,
        revoked_at=device.revoked_at,
    )


async def _labels_of(tx: Tx, ids: Iterable[str]) -> dict[str, dict[str, str]]:
    ids = list(ids)
    out: dict[str, dict[str, str]] = {i: {} for i in ids}
    if not ids:
        return out
    rows = await tx.execute(
        select(DeviceLabel.device_id, DeviceLabel.key, DeviceLabel.value)
        .where(DeviceLabel.device_id.in_(ids))
        .order_by(DeviceLabel.key)
    )
    for device_id, key, value in rows:
        out[device_id][key] = value
    return out


async def _one(tx: Tx, query: Select[Any], *, lock: bool) -> DeviceView | None:
    if lock:
        query = query.with_for_update()
    device: Device | None = (await tx.execute(query)).scalar_one_or_none()
    if device is None:
        return None
    return _view(device, (await _labels_of(tx, [device.id]))[device.id])


async def get_device(tx: Tx, device_id: str, *, lock: bool = False) -> DeviceView | None:
    """The device, or None. ``lock`` takes a row lock on PostgreSQL until the transaction ends."""
    return await _one(tx, select(Device).where(Device.id == device_id), lock=lock)


async def get_device_by_key(tx: Tx, public_key: str, *, lock: bool = False) -> DeviceView | None:
    return await _one(tx, select(Device).where(Device.public_key == public_key), lock=lock)


async def device_id_taken(tx: Tx, device_id: str) -> bool:
    return bool((await tx.execute(select(exists().where(Device.id == device_id)))).scalar())


async def insert_device(
    tx: Tx,
    *,
    device_id: str,
    public_key: str,
    status: str,
    now: datetime,
    profile: str | None = None,
    group_name: str | None = None,
    labels: Mapping[str, str] | None = None,
    facts: Mapping[str, Any] | None = None,
    agent_version: str = "",
    enrollment_token_id: int | None = None,
    accepted_at: datetime | None = None,
) -> DeviceView:
    """Insert a device and its labels (one INSERT each, no read back). A duplicate id or public
    key surfaces as :class:`controlplane.db.errors.ConflictError` when the transaction ends."""
    device = Device(
        id=device_id,
        public_key=public_key,
        status=status,
        profile=profile,
        group_name=group_name,
        facts=dict(facts or {}),
        agent_version=agent_version,
        enrollment_token_id=enrollment_token_id,
        online=False,
        last_seen_at=None,
        created_at=now,
        updated_at=now,
        accepted_at=accepted_at,
        revoked_at=None,
    )
    tx.add(device)
    await tx.flush()
    labels = dict(labels or {})
    if labels:
        await tx.execute(
            insert(DeviceLabel),
            [{"device_id": device_id, "key": k, "value": v} for k, v in labels.items()],
        )
    return _view(device, dict(sorted(labels.items())))


async def update_device(tx: Tx, device_id: str, *, now: datetime, **fields: Any) -> DeviceView:
    """Set columns of a device (``status``, ``profile``, ``facts``, ``accepted_at``, ...).

    Raises :class:`NotFoundError`.
    """
    device = await tx.get(Device, device_id)
    if device is None:
        raise NotFoundError(f"no device {device_id!r}")
    for name, value in fields.items():
        if not hasattr(Device, name) or name in ("id", "public_key"):
            raise ValueError(f"cannot update device field {name!r}")
        setattr(device, name, value)
    device.updated_at = now
    await tx.flush()
    return _view(device, (await _labels_of(tx, [device_id]))[device_id])


async def replace_labels(tx: Tx, device_id: str, labels: Mapping[str, str]) -> None:
    """Make the device's labels exactly ``labels`` (one DELETE, one multi-row INSERT)."""
    await tx.execute(delete(DeviceLabel).where(DeviceLabel.device_id == device_id))
    if labels:
        await tx.execute(
            insert(DeviceLabel),
            [{"device_id": device_id, "key": k, "value": v} for k, v in labels.items()],
        )


def _filtered(query: Select[Any], f: DeviceFilter) -> Select[Any]:
    for key, value in (f.labels or {}).items():
        query = query.where(
            exists().where(
                DeviceLabel.device_id == Device.id,
                DeviceLabel.key == key,
                DeviceLabel.value == value,
            )
        )
    for key in f.label_keys:
        query = query.where(
            exists().where(DeviceLabel.device_id == Device.id, DeviceLabel.key == key)
        )
    if f.profile is not None:
        query = query.where(Device.profile == f.profile)
    if f.statuses:
        query = query.where(Device.status.in_(list(f.statuses)))
    if f.group is not None:
        query = query.where(Device.group_name == f.group)
    if f.online is not None:
        query = query.where(Device.online.is_(f.online))
    if f.search:
        pattern = "%" + f.search.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
        query = query.where(Device.id.like(pattern, escape="\\"))
    return query


async def list_devices(
    tx: Tx, f: DeviceFilter, *, limit: int, offset: int
) -> tuple[list[DeviceView], int]:
    """One page of matching devices ordered by id, and the total number that match."""
    total = (await tx.execute(_filtered(select(func.count()).select_from(Device), f))).scalar_one()
    devices = list(
        (
            await tx.execute(
                _filtered(select(Device), f).order_by(Device.id).limit(limit).offset(offset)
            )
        ).scalars()
    )
    labels = await _labels_of(tx, [d.id for d in devices])
    return [_view(d, labels[d.id]) for d in devices], int(total)


async def count_by_status(tx: Tx) -> dict[str, int]:
    rows = await tx.execute(select(Device.status, func.count()).group_by(Device.status))
    return {status: int(n) for status, n in rows}


async def count_online(tx: Tx) -> int:
    query = select(func.count()).select_from(Device).where(Device.online.is_(True))
    return int((await tx.execute(query)).scalar_one())
