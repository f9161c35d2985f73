"""Queries on enrollment tokens and enrollment nonces (inside a caller's transaction)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime

from sqlalchemy import delete, or_, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from mcp_edge.controlplane.db.engine import Tx
from mcp_edge.controlplane.db.errors import NotFoundError
from mcp_edge.controlplane.db.models import EnrollmentNonce, EnrollmentToken


async def create_token(
    tx: Tx,
    *,
    token_hash: str,
    prefix: str,
    now: datetime,
    created_by: str,
    approval: str,
    group_name: str | None = None,
    labels: Mapping[str, str] | None = None,
    max_uses: int | None = None,
    expires_at: datetime | None = None,
    description: str = "",
) -> EnrollmentToken:
    token = EnrollmentToken(
        token_hash=token_hash,
        prefix=prefix,
        description=description,
        group_name=group_name,
        labels=dict(labels or {}),
        approval=approval,
        max_uses=max_uses,
        uses=0,
        created_at=now,
        created_by=created_by,
        expires_at=expires_at,
    )
    tx.add(token)
    await tx.flush()
    return token


async def get_token(tx: Tx, token_id: int) -> EnrollmentToken | None:
    return await tx.get(EnrollmentToken, token_id)


async def find_token(tx: Tx, token_hash: str) -> EnrollmentToken | None:
    query = select(EnrollmentToken).where(EnrollmentToken.token_hash == token_hash)
    return (await tx.execute(query)).scalar_one_or_none()


async def list_tokens(tx: Tx, *, include_revoked: bool = True) -> list[EnrollmentToken]:
    query = select(EnrollmentToken).order_by(EnrollmentToken.id.desc())
    if not include_revoked:
        query = query.where(EnrollmentToken.revoked_at.is_(None))
    return list((await tx.execute(query)).scalars())


async def revoke_token(tx: Tx, token_id: int, now: datetime) -> EnrollmentToken:
    """Mark the token revoked (idempotent); raises :class:`NotFoundError`."""
    token = await tx.get(EnrollmentToken, token_id)
    if token is None:
        raise NotFoundError(f"no enrollment token {token_id}")
    if token.revoked_at is None:
        token.revoked_at = now
        await tx.flush()
    return token


async def consume_token_use(tx: Tx, token_id: int, now: datetime) -> bool:
    """Count one use if the token is still usable at ``now``; False if it is not.

    One conditional UPDATE, so two devices racing for the last use cannot both get it.
    """
    t = EnrollmentToken
    result = await tx.execute(
        update(t)
        .where(
            t.id == token_id,
            t.revoked_at.is_(None),
            or_(t.expires_at.is_(None), t.expires_at > now),
            or_(t.max_uses.is_(None), t.uses < t.max_uses),
        )
        .values(uses=t.uses + 1)
        .execution_options(synchronize_session=False)
    )
    return bool(getattr(result, "rowcount", 0) == 1)


async def remember_nonce(tx: Tx, nonce: str, *, now: datetime, expires_at: datetime) -> bool:
    """Record ``nonce`` until ``expires_at``; False when it was already recorded (a replay).

    Expired nonces are purged first, so the table holds at most one retention window.
    """
    return nonce in await remember_nonces(tx, [nonce], now=now, expires_at=expires_at)


async def remember_nonces(
    tx: Tx, nonces: Sequence[str], *, now: datetime, expires_at: datetime
) -> set[str]:
    """Record every nonce of ``nonces`` until ``expires_at`` in one statement; return those
    recorded now (the others were seen before: replays; a nonce listed twice is recorded once).

    Expired nonces are purged first (one indexed DELETE), so the table holds at most one
    retention window whatever the number of enrollments.
    """
    await tx.execute(delete(EnrollmentNonce).where(EnrollmentNonce.expires_at < now))
    if not nonces:
        return set()
    make_insert = pg_insert if tx.get_bind().dialect.name == "postgresql" else sqlite_insert
    statement = (
        make_insert(EnrollmentNonce)
        .values([{"nonce": n, "expires_at": expires_at} for n in dict.fromkeys(nonces)])
        .on_conflict_do_nothing(index_elements=["nonce"])
        .returning(EnrollmentNonce.nonce)
    )
    return {row[0] for row in await tx.execute(statement)}
