"""Queries on the model registry: publisher keys, models and their versions (migration
``0003_registry``). Every function runs inside a caller's transaction."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import func, select

from mcp_edge.controlplane.db.engine import Tx
from mcp_edge.controlplane.db.errors import ConflictError, NotFoundError
from mcp_edge.controlplane.db.models import Model, ModelVersion, PublisherKey


# ---------------------------------------------------------------------------- publisher keys
async def get_publisher(tx: Tx, keyid: str) -> PublisherKey | None:
    return await tx.get(PublisherKey, keyid)


async def list_publishers(tx: Tx, *, active_only: bool = False) -> list[PublisherKey]:
    """Publisher keys by name then key id; ``active_only`` leaves out revoked ones."""
    query = select(PublisherKey)
    if active_only:
        query = query.where(PublisherKey.revoked_at.is_(None))
    rows = await tx.execute(query.order_by(PublisherKey.name, PublisherKey.keyid))
    return list(rows.scalars())


async def add_publisher(
    tx: Tx, *, keyid: str, public_key: str, name: str, now: datetime
) -> PublisherKey:
    """Insert a publisher key; raises :class:`ConflictError` when the key id is known."""
    if await get_publisher(tx, keyid) is not None:
        raise ConflictError(f"publisher key {keyid[:16]} is already registered")
    row = PublisherKey(
        keyid=keyid, public_key=public_key, name=name, created_at=now, revoked_at=None
    )
    tx.add(row)
    await tx.flush()
    return row


async def revoke_publisher(tx: Tx, keyid: str, *, now: datetime) -> PublisherKey:
    """Mark a key revoked (a no-op when it already is); raises :class:`NotFoundError`."""
    row = await get_publisher(tx, keyid)
    if row is None:
        raise NotFoundError(f"no publisher key {keyid!r}")
    if row.revoked_at is None:
        row.revoked_at = now
        await tx.flush()
    return row


# ---------------------------------------------------------------------------- models
@dataclass(frozen=True)
class ModelSummary:
    """A model with how many versions it has and its newest one (by release counter)."""

    name: str
    created_at: datetime
    version_count: int
    latest_version: str | None
    latest_published_at: datetime | None


async def list_models(tx: Tx) -> list[ModelSummary]:
    """Every model by name, with its version count and newest version."""
    counts = (
        select(
            ModelVersion.model,
            func.count().label("n"),
            func.max(ModelVersion.version_numeric).label("top"),
        )
        .group_by(ModelVersion.model)
        .subquery()
    )
    latest = await tx.execute(
        select(Model, counts.c.n, ModelVersion)
        .outerjoin(counts, counts.c.model == Model.name)
        .outerjoin(
            ModelVersion,
            (ModelVersion.model == Model.name) & (ModelVersion.version_numeric == counts.c.top),
        )
        .order_by(Model.name, ModelVersion.id.desc())
    )
    seen: dict[str, ModelSummary] = {}
    for model, count, version in latest.all():
        if model.name in seen:  # two versions share the top release counter (build metadata)
            continue
        seen[model.name] = ModelSummary(
            name=model.name,
            created_at=model.created_at,
            version_count=int(count or 0),
            latest_version=version.version if version is not None else None,
            latest_published_at=version.created_at if version is not None else None,
        )
    return list(seen.values())


async def get_model(tx: Tx, name: str) -> Model | None:
    return await tx.get(Model, name)


async def list_versions(tx: Tx, model: str) -> list[ModelVersion]:
    """The versions of ``model``, newest release first."""
    rows = await tx.execute(
        select(ModelVersion)
        .where(ModelVersion.model == model)
        .order_by(ModelVersion.version_numeric.desc(), ModelVersion.id.desc())
    )
    return list(rows.scalars())


async def get_version(tx: Tx, model: str, version: str) -> ModelVersion | None:
    rows = await tx.execute(
        select(ModelVersion).where(ModelVersion.model == model, ModelVersion.version == version)
    )
    return rows.scalar_one_or_none()


async def insert_version(
    tx: Tx,
    *,
    model: str,
    version: str,
    version_numeric: int,
    target_path: str,
    sha256: str,
    length: int,
    format: str,
    profiles: list[str],
    variants: list[dict[str, Any]],
    publisher_keyid: str,
    uploaded_by: str,
    now: datetime,
    drift_baseline: dict[str, Any] | None = None,
) -> ModelVersion:
    """Insert one published version (and its model when new).

    Raises :class:`ConflictError` when ``model``/``version`` or ``target_path`` exists.
    """
    if await get_model(tx, model) is None:
        tx.add(Model(name=model, created_at=now))
        await tx.flush()
    if await get_version(tx, model, version) is not None:
        raise ConflictError(f"{model} {version} is already published")
    row = ModelVersion(
        model=model,
        version=version,
        version_numeric=version_numeric,
        target_path=target_path,
        sha256=sha256,
        length=length,
        format=format,
        profiles=list(profiles),
        variants=list(variants),
        publisher_keyid=publisher_keyid,
        uploaded_by=uploaded_by,
        created_at=now,
        drift_baseline=drift_baseline,
    )
    tx.add(row)
    await tx.flush()
    return row
