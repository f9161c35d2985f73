"""Queries on application MQTT accounts (inside a caller's transaction)."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from mcp_edge.controlplane.db.engine import Tx
from mcp_edge.controlplane.db.errors import ConflictError, NotFoundError
from mcp_edge.controlplane.db.models import AppClient, Device


async def create_app_client(
    tx: Tx, *, client_id: str, description: str, created_by: str, now: datetime
) -> AppClient:
    """Insert the row now (flushed), so a concurrent create of the same id fails here, before
    any broker account is touched.

    Raises :class:`ConflictError` when the client id is already an application's (active or
    revoked).
    """
    app = AppClient(
        client_id=client_id, description=description, created_by=created_by, created_at=now
    )
    tx.add(app)
    try:
        await tx.flush()
    except IntegrityError as e:
        raise ConflictError(f"app client {client_id!r} already exists") from e
    return app


async def get_app_client(tx: Tx, client_id: str, *, lock: bool = False) -> AppClient | None:
    """The row, or None; ``lock`` takes a row lock on PostgreSQL (SQLite writers are serial)."""
    query = select(AppClient).where(AppClient.client_id == client_id)
    if lock:
        query = query.with_for_update()
    return (await tx.execute(query)).scalar_one_or_none()


async def list_app_clients(tx: Tx, *, include_revoked: bool = True) -> list[AppClient]:
    """Every application account, ordered by client id."""
    query = select(AppClient).order_by(AppClient.client_id)
    if not include_revoked:
        query = query.where(AppClient.revoked_at.is_(None))
    return list((await tx.execute(query)).scalars())


async def revoke_app_client(tx: Tx, client_id: str, now: datetime) -> AppClient:
    """Mark the account revoked (idempotent: the first revocation time stays).

    Raises :class:`NotFoundError`.
    """
    app = await get_app_client(tx, client_id, lock=True)
    if app is None:
        raise NotFoundError(f"no app client {client_id!r}")
    if app.revoked_at is None:
        app.revoked_at = now
        await tx.flush()
    return app


async def is_device_id(tx: Tx, client_id: str) -> bool:
    """Whether a device (in any status) has this id: device and application accounts share the
    broker's client-id space, so one id cannot be both."""
    found = await tx.execute(select(Device.id).where(Device.id == client_id))
    return found.first() is not None
