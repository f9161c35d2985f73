"""Queries on users and their API tokens. Every function runs inside a caller's transaction."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import func, select, update

from mcp_edge.controlplane.db.engine import Tx
from mcp_edge.controlplane.db.errors import ConflictError, NotFoundError
from mcp_edge.controlplane.db.models import ApiToken, User


async def create_user(
    tx: Tx, *, username: str, password_hash: str, role: str, now: datetime
) -> User:
    """Insert a user; raises :class:`ConflictError` if the name is taken."""
    if await get_user(tx, username) is not None:
        raise ConflictError(f"user {username!r} already exists")
    user = User(
        username=username,
        password_hash=password_hash,
        role=role,
        disabled=False,
        created_at=now,
        updated_at=now,
    )
    tx.add(user)
    await tx.flush()
    return user


async def get_user(tx: Tx, username: str) -> User | None:
    return (await tx.execute(select(User).where(User.username == username))).scalar_one_or_none()


async def list_users(tx: Tx) -> list[User]:
    return list((await tx.execute(select(User).order_by(User.username))).scalars())


async def count_users(tx: Tx) -> int:
    return int((await tx.execute(select(func.count()).select_from(User))).scalar_one())


async def update_user(
    tx: Tx,
    username: str,
    *,
    now: datetime,
    role: str | None = None,
    disabled: bool | None = None,
    password_hash: str | None = None,
) -> User:
    """Change the given fields; raises :class:`NotFoundError`."""
    user = await get_user(tx, username)
    if user is None:
        raise NotFoundError(f"no user {username!r}")
    if role is not None:
        user.role = role
    if disabled is not None:
        user.disabled = disabled
    if password_hash is not None:
        user.password_hash = password_hash
    user.updated_at = now
    await tx.flush()
    return user


async def create_api_token(
    tx: Tx,
    *,
    user: User,
    name: str,
    token_hash: str,
    prefix: str,
    now: datetime,
    expires_at: datetime | None,
) -> ApiToken:
    token = ApiToken(
        user_id=user.id,
        name=name,
        token_hash=token_hash,
        prefix=prefix,
        created_at=now,
        expires_at=expires_at,
    )
    tx.add(token)
    await tx.flush()
    return token


async def find_api_token(tx: Tx, token_hash: str) -> tuple[ApiToken, User] | None:
    """The token with this SHA-256 and its user, whatever their state (the caller judges)."""
    row = (
        await tx.execute(
            select(ApiToken, User)
            .join(User, User.id == ApiToken.user_id)
            .where(ApiToken.token_hash == token_hash)
        )
    ).one_or_none()
    return None if row is None else (row[0], row[1])


async def touch_api_token(tx: Tx, token_id: int, now: datetime) -> None:
    await tx.execute(update(ApiToken).where(ApiToken.id == token_id).values(last_used_at=now))


async def list_api_tokens(tx: Tx, user_id: int | None = None) -> list[tuple[ApiToken, str]]:
    """``(token, username)`` pairs, newest first; all users' when ``user_id`` is None."""
    query = select(ApiToken, User.username).join(User, User.id == ApiToken.user_id)
    if user_id is not None:
        query = query.where(ApiToken.user_id == user_id)
    rows = await tx.execute(query.order_by(ApiToken.id.desc()))
    return [(r[0], r[1]) for r in rows]


async def get_api_token(tx: Tx, token_id: int) -> tuple[ApiToken, str] | None:
    """The token and its user's name, or None."""
    row = (
        await tx.execute(
            select(ApiToken, User.username)
            .join(User, User.id == ApiToken.user_id)
            .where(ApiToken.id == token_id)
        )
    ).one_or_none()
    return None if row is None else (row[0], row[1])


async def revoke_api_token(tx: Tx, token_id: int, now: datetime) -> ApiToken:
    """Mark the token revoked (idempotent); raises :class:`NotFoundError`."""
    token = await tx.get(ApiToken, token_id)
    if token is None:
        raise NotFoundError(f"no API token {token_id}")
    if token.revoked_at is None:
        token.revoked_at = now
        await tx.flush()
    return token
