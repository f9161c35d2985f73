"""Queries on devices and their labels. Every function runs inside a caller's transaction.

Devices leave this module as :class:`DeviceView` (the row plus its labels as a dict), so
callers never hold an ORM object whose attributes could trigger lazy I/O.

Whether a device runs what it was told (:class:`ModelSync`, :func:`model_sync`) compares its
desired models (``device_models``, the newest signed document's ``seq``) with its last
reported state (``device_reported``): a model is in sync when the device applied the newest
document and reports the desired stable version active. :func:`list_devices` filters on that
in SQL, joining ``device_models`` with the reported models kept beside each document
(``device_reported_models``, :func:`reported_model_rows`) on their indexes, so a page of a
large fleet never loads the fleet nor reads its documents.
"""

from __future__ import annotations

import typing
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import (
    Select,
    and_,
    delete,
    exists,
    func,
    insert,
    literal,
    select,
    union_all,
)
from sqlalchemy.orm import aliased

from mcp_edge.controlplane.db.engine import Tx
from mcp_edge.controlplane.db.errors import NotFoundError
from mcp_edge.controlplane.db.models import (
    DeploymentEventRow,
    DesiredStateRow,
    Device,
    DeviceLabel,
    DeviceModelRow,
    InferenceStatsRow,
    Model,
    ReportedModelRow,
    ReportedStateRow,
)

SORTS = ("id", "status", "profile", "last_seen")
"""What :func:`list_devices` orders by (then by id)."""


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
    model: str | None = None
    """Devices told to run this model, or reporting it."""
    in_sync: bool | None = None
    """True: every model of the device in sync (a device without models is); False: not."""


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
        pattern = "%" + _like_escaped(f.search) + "%"
        query = query.where(Device.id.like(pattern, escape="\\"))
    if f.model is not None:
        query = query.where(Device.id.in_(_with_model(f.model)))
    if f.in_sync is not None:
        out = _out_of_sync()
        query = query.where(Device.id.not_in(out) if f.in_sync else Device.id.in_(out))
    return query


MODEL_NAME_MAX = 64
"""The longest model name (``device_models.model``); a longer reported name is no model."""
VERSION_MAX = 128
"""The longest version text; a longer reported active version counts as none."""


def reported_models(document: Any) -> dict[str, Mapping[str, Any]]:
    """The models of a reported-state document by name: the objects of its ``models`` array
    whose ``name`` is text of at most :data:`MODEL_NAME_MAX` characters (the last wins when a
    name repeats). Anything else (``models`` not an array, other members) holds no model.

    The one reading of a document that :func:`model_sync` and the ``device_reported_models``
    rows (:func:`reported_model_rows`) both use."""
    models = document.get("models") if isinstance(document, dict) else None
    return {
        m["name"]: m
        for m in (models if isinstance(models, list) else [])
        if isinstance(m, dict)
        and isinstance(m.get("name"), str)
        and 0 < len(m["name"]) <= MODEL_NAME_MAX
    }


def active_version(status: Mapping[str, Any] | None) -> str | None:
    """A reported model's active version: text of at most :data:`VERSION_MAX` characters."""
    value = _text(status, "active_version")
    return value if value is not None and len(value) <= VERSION_MAX else None


VARIANT_MAX = 64
"""The longest variant tag (an identifier); a longer reported one counts as none."""
BACKEND_MAX = 128
"""The longest ``backend/provider`` text; a longer reported one counts as none."""


def active_variant(status: Mapping[str, Any] | None) -> str | None:
    """The bundle variant a reported model's active version runs (``default``, ``int8``):
    text of 1 to :data:`VARIANT_MAX` characters, else None."""
    value = _text(status, "active_variant")
    return value if value and len(value) <= VARIANT_MAX else None


def active_backend(status: Mapping[str, Any] | None) -> str | None:
    """The ``backend/provider`` a reported model's active version runs on (``openvino/CPU``):
    text of 1 to :data:`BACKEND_MAX` characters, else None."""
    value = _text(status, "active_backend")
    return value if value and len(value) <= BACKEND_MAX else None


def reported_model_rows(device_id: str, document: Any) -> list[dict[str, Any]]:
    """The ``device_reported_models`` rows of one device's reported-state document."""
    return [
        {
            "device_id": device_id,
            "model": name,
            "active_version": active_version(status),
            "variant": active_variant(status),
            "backend": active_backend(status),
        }
        for name, status in reported_models(document).items()
    ]


def _like_escaped(text: str) -> str:
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


def _with_model(model: str) -> Select[Any]:
    """The ids of the devices told to run ``model`` or reporting it (two index lookups)."""
    told = select(DeviceModelRow.device_id).where(DeviceModelRow.model == model)
    rm = ReportedModelRow
    return told.union(select(rm.device_id).where(rm.model == model))  # type: ignore[return-value]


def _out_of_sync() -> Select[Any]:
    """The ids of the devices with a model that is not in sync (:func:`model_sync`): told to
    run a model without reporting its stable version active, told to run models without having
    applied the newest document, or reporting a model they were not told to run.

    Three anti-joins of ``device_models`` and ``device_reported_models`` on their keys, the
    same whatever the other filters (no per-device subquery, no document read)."""
    dm, ds, rs, rm = DeviceModelRow, DesiredStateRow, ReportedStateRow, ReportedModelRow
    running = aliased(ReportedModelRow, name="running")
    not_running = (
        select(dm.device_id)
        .outerjoin(
            running,
            and_(
                running.device_id == dm.device_id,
                running.model == dm.model,
                running.active_version == dm.stable_version,
            ),
        )
        .where(running.device_id.is_(None))
    )
    wanted = aliased(DeviceModelRow, name="wanted")
    not_told = (
        select(rm.device_id)
        .outerjoin(wanted, and_(wanted.device_id == rm.device_id, wanted.model == rm.model))
        .where(wanted.device_id.is_(None))
    )
    current = (
        select(ds.device_id).join(rs, rs.device_id == ds.device_id).where(rs.applied_seq >= ds.seq)
    )
    behind = select(dm.device_id).where(dm.device_id.not_in(current))
    return union_all(not_running, not_told, behind)  # type: ignore[return-value]


def _order(sort: str, descending: bool) -> list[Any]:
    """ORDER BY of :func:`list_devices`: never-seen devices count as the longest unseen, and
    devices without a profile come last either way; ties by id."""
    if sort not in SORTS:
        raise ValueError(f"cannot sort devices by {sort!r}; use one of {list(SORTS)}")
    if sort == "id":
        return [Device.id.desc() if descending else Device.id.asc()]
    key: Any
    if sort == "last_seen":
        key = (
            Device.last_seen_at.desc().nulls_last()
            if descending
            else Device.last_seen_at.asc().nulls_first()
        )
    else:
        column = Device.status if sort == "status" else Device.profile
        key = (column.desc() if descending else column.asc()).nulls_last()
    return [key, Device.id.asc()]


async def list_devices(
    tx: Tx,
    f: DeviceFilter,
    *,
    limit: int,
    offset: int,
    sort: str = "id",
    descending: bool = False,
) -> tuple[list[DeviceView], int]:
    """One page of matching devices in ``sort`` order (one of :data:`SORTS`), and the total
    number that match. One statement chooses the page's ids and counts the matches (a filter
    on sync state is evaluated once); only the page's rows are then read."""
    ids_and_total = typing.cast(Select[Any], select(Device.id, func.count().over().label("total")))
    page = (
        _filtered(ids_and_total, f).order_by(*_order(sort, descending)).limit(limit).offset(offset)
    )
    found = (await tx.execute(page)).all()
    if found:
        total = int(found[0].total)
    else:  # past the last page (or nothing matches): count alone
        counted = _filtered(select(func.count()).select_from(Device), f)
        total = int((await tx.execute(counted)).scalar_one()) if offset else 0
    ids = [row.id for row in found]
    if not ids:
        return [], total
    rows = {d.id: d for d in (await tx.execute(select(Device).where(Device.id.in_(ids)))).scalars()}
    labels = await _labels_of(tx, ids)
    return [_view(rows[i], labels[i]) for i in ids if i in rows], total


async def count_by_status(tx: Tx) -> dict[str, int]:
    rows = await tx.execute(select(Device.status, func.count()).group_by(Device.status))
    return {status: int(n) for status, n in rows}


async def count_online(tx: Tx) -> int:
    query = select(func.count()).select_from(Device).where(Device.online.is_(True))
    return int((await tx.execute(query)).scalar_one())


# ---------------------------------------------------------------------------- desired vs reported
@dataclass(frozen=True)
class ModelSync:
    """One model of a device: the stable version it was told to run (None: not told, yet it
    reports the model) against what it reports (``reported_version`` is its active version,
    None when it reports none, ``variant`` and ``backend`` what that version runs as and on,
    None when not reported), and whether the two agree."""

    model: str
    desired_version: str | None
    canary_version: str | None
    reported_version: str | None
    phase: str | None
    in_sync: bool
    variant: str | None = None
    backend: str | None = None


async def model_sync(tx: Tx, device_ids: Iterable[str]) -> dict[str, list[ModelSync]]:
    """Every model of each device, desired ones first (by name), then those it reports without
    being told to. Three queries whatever the number of devices."""
    ids = list(dict.fromkeys(device_ids))
    out: dict[str, list[ModelSync]] = {i: [] for i in ids}
    if not ids:
        return out
    dm, ds, rs = DeviceModelRow, DesiredStateRow, ReportedStateRow
    desired = await tx.execute(
        select(dm.device_id, dm.model, dm.stable_version, dm.canary_version)
        .where(dm.device_id.in_(ids))
        .order_by(dm.device_id, dm.model)
    )
    documents = await tx.execute(select(ds.device_id, ds.seq).where(ds.device_id.in_(ids)))
    seqs = {d: int(seq) for d, seq in documents}
    reported: dict[str, tuple[int, dict[str, Mapping[str, Any]]]] = {}
    for device_id, applied, document in await tx.execute(
        select(rs.device_id, rs.applied_seq, rs.document).where(rs.device_id.in_(ids))
    ):
        reported[device_id] = (int(applied), reported_models(document))
    told: dict[str, list[tuple[str, str, str | None]]] = {i: [] for i in ids}
    for device_id, model, stable, canary in desired:
        told[device_id].append((model, stable, canary))
    for device_id in ids:
        applied, by_name = reported.get(device_id, (None, {}))
        by_name = dict(by_name)
        seq = seqs.get(device_id)
        current = seq is not None and applied is not None and applied >= seq
        for model, stable, canary in told[device_id]:
            status = by_name.pop(model, None)
            active = active_version(status)
            out[device_id].append(
                ModelSync(model, stable, canary, active, _text(status, "phase"),
                          current and active == stable, active_variant(status),
                          active_backend(status))
            )  # fmt: skip
        out[device_id].extend(
            ModelSync(name, None, None, active_version(status), _text(status, "phase"), False,
                      active_variant(status), active_backend(status))
            for name, status in sorted(by_name.items())
        )  # fmt: skip
    return out


def _text(status: Mapping[str, Any] | None, key: str) -> str | None:
    value = status.get(key) if status is not None else None
    return value if isinstance(value, str) else None


# ---------------------------------------------------------------------------- a device's page
async def recent_events(tx: Tx, device_id: str, limit: int) -> list[dict[str, Any]]:
    """The ``limit`` newest deployment events of a device (its flight recorder), newest first."""
    t = DeploymentEventRow.__table__
    query = select(t).where(t.c.device_id == device_id).order_by(t.c.event_seq.desc()).limit(limit)
    return [dict(r._mapping) for r in await tx.execute(query)]


async def recent_inference(
    tx: Tx, device_id: str, since: datetime, limit: int
) -> list[dict[str, Any]]:
    """A device's inference-statistics windows since ``since`` (the newest ``limit``), oldest
    first: ``ts``, ``model``, ``version``, ``role``, ``count``, ``errors``, ``rejections``,
    ``p95_ms``."""
    t = InferenceStatsRow
    query = (
        select(t.ts, t.model, t.version, t.role, t.count, t.errors, t.rejections, t.p95_ms)
        .where(t.device_id == device_id, t.ts >= since)
        .order_by(t.ts.desc(), t.id.desc())
        .limit(limit)
    )
    rows = [dict(r._mapping) for r in await tx.execute(query)]
    rows.reverse()
    return rows


async def inference_models(tx: Tx, device_id: str, since: datetime) -> list[str]:
    """The models a device sent inference statistics of since ``since``, by name."""
    t = InferenceStatsRow
    query = (
        select(t.model).where(t.device_id == device_id, t.ts >= since).distinct().order_by(t.model)
    )
    return [m for (m,) in await tx.execute(query)]


@dataclass(frozen=True)
class FilterChoices:
    """The values the device list's filters offer: every profile and group devices have, and
    every published model name."""

    profiles: list[str]
    groups: list[str]
    models: list[str]


async def filter_choices(tx: Tx) -> FilterChoices:
    """One query: the distinct profiles and groups (their indexes), and the model names."""
    kinds = union_all(
        select(literal("profile").label("kind"), Device.profile.label("value"))
        .where(Device.profile.is_not(None))
        .distinct(),
        select(literal("group"), Device.group_name)
        .where(Device.group_name.is_not(None))
        .distinct(),
        select(literal("model"), Model.name),
    ).subquery()
    found: dict[str, list[str]] = {"profile": [], "group": [], "model": []}
    for kind, value in await tx.execute(select(kinds).order_by(kinds.c.kind, kinds.c.value)):
        found[kind].append(value)
    return FilterChoices(profiles=found["profile"], groups=found["group"], models=found["model"])
