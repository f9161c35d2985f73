"""Schema migrations, run programmatically: ``mcp-controlplane init`` and every app start call
:func:`upgrade_head`.

The scripts live in :mod:`controlplane.db.migrations` (a package, so they ship in the wheel).
On PostgreSQL the upgrade holds a transaction-scoped advisory lock, so replicas starting at once
migrate one after the other instead of racing. On both databases the whole upgrade is one
transaction: it applies completely or not at all.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util import CommandError
from sqlalchemy import text
from sqlalchemy.engine import Connection
from sqlalchemy.exc import SQLAlchemyError

from mcp_edge.controlplane.db.engine import Database, translate
from mcp_edge.controlplane.db.errors import DatabaseError

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
_ADVISORY_LOCK_KEY = 0x6D63_7065_6467_6501  # "mcpedge" + 1: any constant unique to us


def alembic_config(connection: Connection | None = None) -> Config:
    """An Alembic config pointing at the shipped scripts (no ``alembic.ini`` needed)."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.attributes["connection"] = connection
    return cfg


def head_revision() -> str:
    """The newest revision the shipped scripts define."""
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    if head is None:  # pragma: no cover - the package always ships 0001
        raise DatabaseError("no migration scripts found")
    return head


def _upgrade(connection: Connection, target: str) -> None:
    command.upgrade(alembic_config(connection), target)


def _current(connection: Connection) -> str | None:
    return MigrationContext.configure(connection).get_current_revision()


async def upgrade_head(db: Database, target: str = "head") -> str:
    """Bring the schema to ``target`` (default: the newest revision); return the revision now
    current. Raises :class:`DatabaseError` subclasses."""
    try:
        async with db.engine.begin() as conn:
            if not db.is_sqlite:
                await conn.execute(
                    text("SELECT pg_advisory_xact_lock(:key)"), {"key": _ADVISORY_LOCK_KEY}
                )
            await conn.run_sync(_upgrade, target)
            current = await conn.run_sync(_current)
    except SQLAlchemyError as e:
        raise translate(e) from e
    except CommandError as e:
        raise DatabaseError(f"migration failed: {e}") from e
    return current or "base"


async def current_revision(db: Database) -> str | None:
    """The revision the database is at; None for an empty database."""
    try:
        async with db.engine.connect() as conn:
            return await conn.run_sync(_current)
    except SQLAlchemyError as e:
        raise translate(e) from e


async def schema_differences(db: Database) -> list[Any]:
    """What differs between the live schema and :mod:`controlplane.db.models` (empty when the
    migrations and the models agree). For tests and ``mcp-controlplane`` diagnostics."""
    from alembic.autogenerate import compare_metadata

    from mcp_edge.controlplane.db.models import Base

    def compare(connection: Connection) -> list[Any]:
        ctx = MigrationContext.configure(connection, opts={"compare_type": True})
        return list(compare_metadata(ctx, Base.metadata))

    try:
        async with db.engine.connect() as conn:
            return await conn.run_sync(compare)
    except SQLAlchemyError as e:
        raise translate(e) from e
