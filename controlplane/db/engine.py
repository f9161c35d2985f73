"""One :class:`Database` per app: the AsyncEngine, its sessions, and error translation.

URLs are accepted the way operators write them and mapped to the async drivers:
``sqlite:///path`` → ``sqlite+aiosqlite``, ``postgresql://`` / ``postgres://`` →
``postgresql+psycopg`` (psycopg 3 in async mode); ``postgresql+asyncpg://`` is kept if given.

SQLite connections get ``journal_mode=WAL``, ``foreign_keys=ON``, ``synchronous=NORMAL`` and a
busy timeout. Write transactions on SQLite start with ``BEGIN IMMEDIATE`` so two writers queue
instead of failing when a read lock cannot be upgraded. SQLite has one writer at a time, so the
write transactions of one process take turns in arrival order (:class:`_WriteTurns`) before
they open a connection: a writer waits on the event loop, without a pooled connection and
without the busy handler's polling, up to ``write_wait_s`` (then
:class:`~controlplane.db.errors.UnavailableError`); the busy timeout covers only writers in
other processes. A burst of writers (a fleet enrolling) thus waits for the lock instead of
failing with "database is locked" once the busy timeout runs out.

Every SQLAlchemy exception raised inside :meth:`Database.transaction` or :meth:`Database.read`
leaves as one of :mod:`controlplane.db.errors`, chained to the original.
"""

from __future__ import annotations

import asyncio
import json
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
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
WRITE_WAIT_S = 30.0
"""How long a SQLite write transaction waits for its turn before it fails as unavailable (s)."""
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


class _WriteTurns:
    """First come, first served turns at SQLite's single writer, for the tasks of one loop.

    :meth:`release` hands the turn straight to the first waiter, so no newcomer overtakes the
    queue; a waiter that gives up (timeout or cancellation) after being handed the turn passes
    it on.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._busy = False
        self._waiters: deque[asyncio.Future[None]] = deque()

    async def acquire(self, timeout_s: float) -> None:
        """Wait for the turn; raises :class:`UnavailableError` after ``timeout_s`` seconds."""
        if not self._busy and not self._waiters:
            self._busy = True
            return
        turn: asyncio.Future[None] = self.loop.create_future()
        self._waiters.append(turn)
        expiry = self.loop.call_later(timeout_s, _expire, turn, timeout_s)
        try:
            await turn
        except BaseException:
            if turn.done() and not turn.cancelled() and turn.exception() is None:
                self.release()  # handed the turn just as this waiter gave up
            else:
                with suppress(ValueError):
                    self._waiters.remove(turn)
            raise
        finally:
            expiry.cancel()

    def release(self) -> None:
        while self._waiters:
            turn = self._waiters.popleft()
            if not turn.done():
                turn.set_result(None)
                return
        self._busy = False


def _expire(turn: asyncio.Future[None], timeout_s: float) -> None:
    if not turn.done():
        turn.set_exception(UnavailableError(f"database busy: no write turn within {timeout_s:g} s"))


@asynccontextmanager
async def savepoint(tx: Tx) -> AsyncIterator[None]:
    """A savepoint inside ``tx``: an error in the block undoes only the block's changes, and
    leaves as a :mod:`controlplane.db.errors` exception (others pass through unchanged); the
    transaction goes on. Lets one transaction carry many independent changes (a batch of
    enrollments) where one failing must not fail the others."""
    try:
        async with tx.begin_nested():
            yield
    except SQLAlchemyError as e:
        raise translate(e) from e


class Database:
    """The engine of one app and the transactions handlers run in.

    ``write_wait_s``: how long a SQLite write transaction waits for its turn (seconds).
    """

    def __init__(self, url: str, *, echo: bool = False, write_wait_s: float = WRITE_WAIT_S) -> None:
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
        self._write_wait_s = write_wait_s
        self._turns: _WriteTurns | None = None

    @property
    def display_url(self) -> str:
        """The URL with any password masked, for logs."""
        return self.url.render_as_string(hide_password=True)

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[Tx]:
        """A read-write transaction: committed when the block ends, rolled back on any error.

        Raises :mod:`controlplane.db.errors` for database failures (on SQLite
        :class:`UnavailableError` when no turn came within ``write_wait_s``); other exceptions
        from the block pass through unchanged (after the rollback).
        """
        turns = self._write_turns()
        if turns is not None:
            await turns.acquire(self._write_wait_s)
        try:
            async with self._writer() as session, session.begin():
                yield session
        except SQLAlchemyError as e:
            raise translate(e) from e
        finally:
            if turns is not None:
                turns.release()

    def _write_turns(self) -> _WriteTurns | None:
        """This loop's turns at the SQLite writer (None on PostgreSQL: its writers do not
        exclude each other)."""
        if not self.is_sqlite:
            return None
        loop = asyncio.get_running_loop()
        if self._turns is None or self._turns.loop is not loop:
            self._turns = _WriteTurns(loop)
        return self._turns

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
