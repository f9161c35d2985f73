"""Queries on the audit log (inside a caller's transaction, so an entry commits with its change)."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from sqlalchemy import select

from mcp_edge.controlplane.db.engine import Tx
from mcp_edge.controlplane.db.models import AuditEntry


async def insert_entry(
    tx: Tx,
    *,
    at: datetime,
    actor: str,
    action: str,
    target_type: str,
    target_id: str,
    detail: Mapping[str, Any] | None = None,
) -> None:
    tx.add(
        AuditEntry(
            at=at,
            actor=actor,
            action=action,
            target_type=target_type,
            target_id=target_id,
            detail=dict(detail or {}),
        )
    )


async def list_entries(
    tx: Tx,
    *,
    limit: int,
    before_id: int | None = None,
    action: str | None = None,
    target_type: str | None = None,
    target_id: str | None = None,
) -> list[AuditEntry]:
    """Newest first; page with ``before_id`` (the smallest id of the previous page)."""
    query = select(AuditEntry)
    if before_id is not None:
        query = query.where(AuditEntry.id < before_id)
    if action is not None:
        query = query.where(AuditEntry.action == action)
    if target_type is not None:
        query = query.where(AuditEntry.target_type == target_type)
    if target_id is not None:
        query = query.where(AuditEntry.target_id == target_id)
    rows = await tx.execute(query.order_by(AuditEntry.id.desc()).limit(limit))
    return list(rows.scalars())
