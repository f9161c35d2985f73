"""Queries on the webhook outbox (``webhook_deliveries``): one row per event and webhook.

Every function runs inside a caller's transaction. A row is *pending* while ``delivered_at``
and ``failed_at`` are both NULL, and *due* once ``next_attempt_at`` has passed.

Claiming (:func:`claim_due`) is a lease: in one short transaction the due rows are locked (on
PostgreSQL with ``FOR UPDATE SKIP LOCKED``, so concurrent replicas pass over each other's rows
instead of waiting), their ``attempts`` counted up and ``next_attempt_at`` pushed past the end
of the POST. Once that commits no other dispatcher sees them as due until the lease ends, and
the POST itself runs outside any transaction (SQLite's single write lock is never held across
the network). A dispatcher that dies mid-POST leaves the row to be claimed again when its
lease ends. :func:`record_outcomes` writes what happened, and only to rows still held under the
claim it made (same ``attempts``), so a late answer never overwrites a newer claim.
"""

from __future__ import annotations

import typing
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Table, and_, bindparam, event, func, insert, select, update
from sqlalchemy.orm import Session

from mcp_edge.controlplane.db.engine import Tx
from mcp_edge.controlplane.db.models import WebhookDeliveryRow

DELIVERIES = typing.cast(Table, WebhookDeliveryRow.__table__)
MAX_ERROR_CHARS = 512
_AFTER_COMMIT = "mcp_webhooks_after_commit"


@dataclass(frozen=True)
class DeliveryView:
    """One row of the outbox. ``attempts`` counts the POSTs begun (the current one included
    for a claimed row)."""

    id: int
    event_id: str
    webhook: str
    event: str
    body: dict[str, Any]
    created_at: datetime
    next_attempt_at: datetime
    attempts: int
    delivered_at: datetime | None
    failed_at: datetime | None
    last_error: str

    @property
    def pending(self) -> bool:
        return self.delivered_at is None and self.failed_at is None


@dataclass(frozen=True)
class Outcome:
    """What one claimed delivery came to, for :func:`record_outcomes`.

    ``delivered``: ``delivered_at`` is set. Otherwise ``give_up`` sets ``failed_at``, and
    without it the row waits until ``retry_at``. ``attempts`` is the claim's count (the guard).
    """

    id: int
    attempts: int
    delivered: bool
    error: str = ""
    retry_at: datetime | None = None
    give_up: bool = False


def _view(row: WebhookDeliveryRow) -> DeliveryView:
    return DeliveryView(
        id=row.id,
        event_id=row.event_id,
        webhook=row.webhook,
        event=row.event,
        body=dict(row.body),
        created_at=row.created_at,
        next_attempt_at=row.next_attempt_at,
        attempts=row.attempts,
        delivered_at=row.delivered_at,
        failed_at=row.failed_at,
        last_error=row.last_error,
    )


def _pending() -> Any:
    return and_(WebhookDeliveryRow.delivered_at.is_(None), WebhookDeliveryRow.failed_at.is_(None))


async def insert_deliveries(
    tx: Tx,
    *,
    event_id: str,
    event: str,
    body: Mapping[str, Any],
    webhooks: Sequence[str],
    now: datetime,
) -> int:
    """Insert one pending row per name in ``webhooks`` (one executemany), due at ``now``."""
    if not webhooks:
        return 0
    rows = [
        {
            "event_id": event_id,
            "webhook": name,
            "event": event,
            "body": dict(body),
            "created_at": now,
            "next_attempt_at": now,
            "attempts": 0,
            "last_error": "",
        }
        for name in webhooks
    ]
    await tx.execute(insert(DELIVERIES), rows)
    return len(rows)


def call_after_commit(tx: Tx, callback: Callable[[], None]) -> None:
    """Call ``callback`` (once) when ``tx`` commits; never when it rolls back. Further calls in
    the same transaction add nothing."""
    if tx.info.get(_AFTER_COMMIT):
        return
    tx.info[_AFTER_COMMIT] = True

    def committed(session: Session) -> None:
        callback()

    event.listen(tx.sync_session, "after_commit", committed, once=True)


async def claim_due(
    tx: Tx, *, webhooks: Collection[str], now: datetime, lease_until: datetime, limit: int
) -> list[DeliveryView]:
    """Lease up to ``limit`` due rows of the named webhooks, oldest due first.

    Each claimed row has ``attempts`` counted up and ``next_attempt_at`` set to
    ``lease_until``; the views returned carry those new values.
    """
    if not webhooks or limit < 1:
        return []
    query = (
        select(WebhookDeliveryRow.id)
        .where(
            _pending(),
            WebhookDeliveryRow.next_attempt_at <= now,
            WebhookDeliveryRow.webhook.in_(list(webhooks)),
        )
        .order_by(WebhookDeliveryRow.next_attempt_at, WebhookDeliveryRow.id)
        .limit(limit)
    )
    if tx.get_bind().dialect.name != "sqlite":  # SQLite has one writer and no row locks
        query = query.with_for_update(skip_locked=True)
    ids = list((await tx.execute(query)).scalars())
    if not ids:
        return []
    await tx.execute(
        update(WebhookDeliveryRow)
        .where(WebhookDeliveryRow.id.in_(ids))
        .values(attempts=WebhookDeliveryRow.attempts + 1, next_attempt_at=lease_until)
        .execution_options(synchronize_session=False)
    )
    rows = await tx.execute(
        select(WebhookDeliveryRow)
        .where(WebhookDeliveryRow.id.in_(ids))
        .order_by(WebhookDeliveryRow.next_attempt_at, WebhookDeliveryRow.id)
        .execution_options(populate_existing=True)
    )
    return [_view(r) for r in rows.scalars()]


async def record_outcomes(tx: Tx, outcomes: Sequence[Outcome], *, now: datetime) -> None:
    """Write each outcome to its row, if the row is still pending under the same claim."""
    guard = and_(
        DELIVERIES.c.id == bindparam("b_id"),
        DELIVERIES.c.attempts == bindparam("b_attempts"),
        DELIVERIES.c.delivered_at.is_(None),
        DELIVERIES.c.failed_at.is_(None),
    )
    delivered = [{"b_id": o.id, "b_attempts": o.attempts} for o in outcomes if o.delivered]
    if delivered:
        await tx.execute(
            update(DELIVERIES).where(guard).values(delivered_at=now, last_error=""), delivered
        )
    failed = [
        {
            "b_id": o.id,
            "b_attempts": o.attempts,
            "b_error": o.error[:MAX_ERROR_CHARS],
            "b_next": o.retry_at or now,
            "b_failed": now if o.give_up else None,
        }
        for o in outcomes
        if not o.delivered
    ]
    if failed:
        await tx.execute(
            update(DELIVERIES)
            .where(guard)
            .values(
                last_error=bindparam("b_error"),
                next_attempt_at=bindparam("b_next"),
                failed_at=bindparam("b_failed"),
            ),
            failed,
        )


async def pending_by_webhook(tx: Tx) -> dict[str, int]:
    """How many rows are pending, per webhook name (configured or not)."""
    rows = await tx.execute(
        select(WebhookDeliveryRow.webhook, func.count())
        .where(_pending())
        .group_by(WebhookDeliveryRow.webhook)
    )
    return {name: int(count) for name, count in rows}


async def next_due(tx: Tx, *, webhooks: Collection[str]) -> datetime | None:
    """The earliest ``next_attempt_at`` among pending rows of the named webhooks."""
    if not webhooks:
        return None
    value = await tx.scalar(
        select(func.min(WebhookDeliveryRow.next_attempt_at)).where(
            _pending(), WebhookDeliveryRow.webhook.in_(list(webhooks))
        )
    )
    return value


async def list_deliveries(
    tx: Tx,
    *,
    event_id: str | None = None,
    webhook: str | None = None,
    event: str | None = None,
    data: Mapping[str, int | str] | None = None,
    limit: int = 100,
) -> list[DeliveryView]:
    """Rows oldest first, optionally of one event, one webhook, one event type, and events
    whose ``data`` has each of the fields in ``data`` with that value (``{"trigger_id": 7}``:
    the deliveries about retraining trigger 7)."""
    query = select(WebhookDeliveryRow)
    if event_id is not None:
        query = query.where(WebhookDeliveryRow.event_id == event_id)
    if webhook is not None:
        query = query.where(WebhookDeliveryRow.webhook == webhook)
    if event is not None:
        query = query.where(WebhookDeliveryRow.event == event)
    for key, value in (data or {}).items():
        field = WebhookDeliveryRow.body[key]
        query = query.where(
            field.as_integer() == value if isinstance(value, int) else field.as_string() == value
        )
    rows = await tx.execute(query.order_by(WebhookDeliveryRow.id).limit(limit))
    return [_view(r) for r in rows.scalars()]
