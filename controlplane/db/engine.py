"""One :class:`Database` per app: the AsyncEngine, its sessions, and error translation.

URLs are accepted the way operators write them and mapped to the async drivers:
``sqlite:///path`` → ``sqlite+aiosqlite``, ``postgresql://`` / ``postgres://`` →
``postgresql+psycopg`` (psycopg 3 in async mode); ``postgresql+asyncpg://`` is kept if given.

SQLite connections get ``journal_mode=WAL``, ``foreign_keys=ON``, ``synchronous=NORMAL`` and a
busy timeout. Write transactions on SQLite start with ``BEGIN IMMEDIATE`` so two writers queue
on the busy timeout instead of failing when a read lock cannot be upgraded.

Every SQLAlchemy exception raised inside :meth:`Database.transaction` or :meth:`Database.read`
leaves as one of :mod:`controlplane.db.errors`, chained to the original.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import orjson
from sqlalchemy import event, text
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import (
    ArgumentError,
    DBAPIError,
    IntegrityError,
    NoResultFound,
    OperationalError,
    SQLAlchemyError,
)
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)

from mcp_edge.controlplane.db.errors import (
    ConflictError,
    DatabaseConfigError,
    DatabaseError,
    NotFoundError,
    UnavailableError,
)

SQLITE_BUSY_TIMEOUT_MS = 10_000
_IMMEDIATE = "mcp_sqlite_immediate"
_DRIVERS = {
    "sqlite": "sqlite+aiosqlite",
    "sqlite+aiosqlite": "sqlite+aiosqlite",
    "postgres": "postgresql+psycopg",
    "postgresql": "postgresql+psycopg",
    "postgresql+psycopg": "postgresql+psycopg",
    "postgresql+asyncpg": "postgresql+asyncpg",
}

Tx = AsyncSession
"""What a transaction hands to the query functions of ``controlplane.db``."""


def async_url(url: str) -> URL:
    """The async-driver form of a database URL; raises :class:`DatabaseConfigError`."""
    try:
        parsed = make_url(url)
    except ArgumentError as e:
        raise DatabaseConfigError(f"cannot parse database URL: {e}") from e
    driver = _DRIVERS.get(parsed.drivername)
    if driver is None:
        raise DatabaseConfigError(
            f"unsupported database {parsed.drivername!r}: use sqlite:///PATH or "
            "postgresql://USER@HOST/DB"
        )
    if driver.startswith("sqlite") and parsed.database in (None, "", ":memory:"):
        raise DatabaseConfigError("an in-memory SQLite database cannot be shared; give a file path")
    return parsed.set(drivername=driver)


def _sqlite_connect(dbapi_connection: Any, _record: Any) -> None:
    # Take transaction control away from the driver so the begin hook below decides.
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    for pragma in (
        "PRAGMA journal_mode=WAL",
        "PRAGMA foreign_keys=ON",
        "PRAGMA synchronous=NORMAL",
        f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}",
    ):
        cursor.execute(pragma)
    cursor.close()


def _sqlite_begin(conn: Any) -> None:
    immediate = conn.get_execution_options().get(_IMMEDIATE, False)
    conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")


def translate(e: SQLAlchemyError) -> DatabaseError:
    """The :mod:`controlplane.db.errors` exception for a SQLAlchemy one."""
    detail = str(getattr(e, "orig", None) or e).splitlines()[0][:300]
    if isinstance(e, IntegrityError):
        return ConflictError(f"the change conflicts with existing data: {detail}")
    if isinstance(e, NoResultFound):
        return NotFoundError("no such row")
    if isinstance(e, OperationalError) or (isinstance(e, DBAPIError) and e.connection_invalidated):
        return UnavailableError(f"database unavailable: {detail}")
    return DatabaseError(f"database error: {detail}")


def _json_text(value: Any) -> str:
    """JSON columns' serializer: orjson (telemetry ingestion writes two per health row), the
    standard library for what orjson refuses (integers beyond 64 bits, non-string keys)."""
    try:
        return orjson.dumps(value).decode()
    except TypeError:
        return json.dumps(value)


class Database:
    """The engine of one app and the transactions handlers run in."""

    def __init__(self, url: str, *, echo: bool = False) -> None:
        self.url = async_url(url)
        self.is_sqlite = self.url.get_backend_name() == "sqlite"
        kwargs: dict[str, Any] = {"echo": echo, "json_serializer": _json_text}
        if not self.is_sqlite:
            kwargs.update(pool_pre_ping=True, pool_size=10, max_overflow=20)
        self.engine: AsyncEngine = create_async_engine(self.url, **kwargs)
        writer = self.engine
        if self.is_sqlite:
            event.listen(self.engine.sync_engine, "connect", _sqlite_connect)
            event.listen(self.engine.sync_engine, "begin", _sqlite_begin)
            writer = self.engine.execution_options(**{_IMMEDIATE: True})
        self._writer = async_sessionmaker(writer, expire_on_commit=False)
        self._reader = async_sessionmaker(self.engine, expire_on_commit=False)

    @property
    def display_url(self) -> str:
        """The URL with any password masked, for logs."""
        return self.url.render_as_string(hide_password=True)

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[Tx]:
        """A read-write transaction: committed when the block ends, rolled back on any error.

        Raises :mod:`controlplane.db.errors` for database failures; other exceptions from the
        block pass through unchanged (after the rollback).
        """
        try:
            async with self._writer() as session, session.begin():
                yield session
        except SQLAlchemyError as e:
            raise translate(e) from e

    @asynccontextmanager
    async def read(self) -> AsyncIterator[Tx]:
        """A read-only unit of work (a deferred transaction on SQLite)."""
        try:
            async with self._reader() as session, session.begin():
                yield session
        except SQLAlchemyError as e:
            raise translate(e) from e

    async def ping(self) -> None:
        """Run ``SELECT 1``; raises :class:`UnavailableError` when that fails."""
        try:
            async with self.engine.connect() as conn:
                await conn.execute(text("SELECT 1"))
        except (SQLAlchemyError, OSError) as e:
            raise UnavailableError(f"database unavailable: {e}") from e

    async def dispose(self) -> None:
        """Close every pooled connection."""
        await self.engine.dispose()
