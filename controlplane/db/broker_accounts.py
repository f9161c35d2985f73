"""Queries on the broker accounts the control plane keeps itself (inside a caller's transaction).

The rows back :class:`~controlplane.broker.http_auth.HttpAuthProvisioner`: brokers that call
the control plane's HTTP authentication and ACL endpoint find their accounts here. Rows go in
and out as :class:`BrokerAccount` values, so nothing above this module holds a live ORM object.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import delete, select
from sqlalchemy.exc import IntegrityError

from mcp_edge.controlplane.db.engine import Tx
from mcp_edge.controlplane.db.errors import ConflictError
from mcp_edge.controlplane.db.models import BrokerAccountRow


@dataclass(frozen=True)
class BrokerAccount:
    """One account: ``kind`` is ``device``, ``service`` or ``app``; ``password_hash`` is the
    encoded salted hash (:mod:`controlplane.broker.http_auth`), never the password."""

    username: str
    client_id: str
    kind: str
    password_hash: str
    enabled: bool
    created_at: datetime
    updated_at: datetime


def _value(row: BrokerAccountRow) -> BrokerAccount:
    return BrokerAccount(
        username=row.username,
        client_id=row.client_id,
        kind=row.kind,
        password_hash=row.password_hash,
        enabled=row.enabled,
        created_at=row.created_at,
        updated_at=row.updated_at,
    )


async def get_account(tx: Tx, username: str, *, lock: bool = False) -> BrokerAccount | None:
    """The account called ``username``, or None; ``lock`` takes a row lock on PostgreSQL
    (SQLite writers are serial)."""
    row = await tx.get(BrokerAccountRow, username, with_for_update=True if lock else None)
    return None if row is None else _value(row)


async def holder_of(tx: Tx, client_id: str) -> str | None:
    """The username of the account bound to ``client_id``, or None."""
    query = select(BrokerAccountRow.username).where(BrokerAccountRow.client_id == client_id)
    return (await tx.execute(query)).scalar_one_or_none()


async def list_accounts(tx: Tx) -> list[BrokerAccount]:
    """Every account, by username."""
    rows = await tx.execute(select(BrokerAccountRow).order_by(BrokerAccountRow.username))
    return [_value(row) for row in rows.scalars()]


async def put_account(tx: Tx, account: BrokerAccount) -> None:
    """Insert ``account``, or overwrite the row of that username with it (its first
    ``created_at`` is kept). Flushed at once, so a clash surfaces here.

    Raises :class:`ConflictError` when another account is bound to the client id.
    """
    row = await tx.get(BrokerAccountRow, account.username, with_for_update=True)
    if row is None:
        tx.add(
            BrokerAccountRow(
                username=account.username,
                client_id=account.client_id,
                kind=account.kind,
                password_hash=account.password_hash,
                enabled=account.enabled,
                created_at=account.created_at,
                updated_at=account.updated_at,
            )
        )
    else:
        row.client_id = account.client_id
        row.kind = account.kind
        row.password_hash = account.password_hash
        row.enabled = account.enabled
        row.updated_at = account.updated_at
    try:
        await tx.flush()
    except IntegrityError as e:
        raise ConflictError(
            f"client id {account.client_id!r} is bound to another broker account"
        ) from e


async def delete_account(tx: Tx, username: str) -> bool:
    """Delete the account; whether there was one."""
    result = await tx.execute(delete(BrokerAccountRow).where(BrokerAccountRow.username == username))
    return bool(getattr(result, "rowcount", 0))
