"""Drift on the control plane against a real database (SQLite and PostgreSQL)."""

from __future__ import annotations

from alembic import command
from sqlalchemy import inspect
from sqlalchemy.engine import Connection

from mcp_edge.controlplane.db import Database
from mcp_edge.controlplane.db.migrate import (
    alembic_config,
    head_revision,
    schema_differences,
    upgrade_head,
)

DRIFT_TABLES = {"drift_reports", "drift_aggregates", "drift_rules", "retraining_triggers"}


def _shape(conn: Connection) -> tuple[set[str], list[str]]:
    inspector = inspect(conn)
    return set(inspector.get_table_names()), [
        c["name"] for c in inspector.get_columns("model_versions")
    ]


async def test_migration_0008_upgrades_matches_models_and_downgrades(database_url: str) -> None:
    db = Database(database_url)
    try:
        assert await upgrade_head(db) == head_revision() == "0008_drift"
        assert await schema_differences(db) == []
        async with db.engine.begin() as conn:
            await conn.run_sync(lambda c: command.downgrade(alembic_config(c), "0007_rollouts"))
        async with db.engine.connect() as conn:
            tables, columns = await conn.run_sync(_shape)
        assert not (DRIFT_TABLES | {"hard_examples"}) & tables
        assert "drift_baseline" not in columns
        assert await upgrade_head(db) == "0008_drift"
        async with db.engine.connect() as conn:
            tables, columns = await conn.run_sync(_shape)
        assert DRIFT_TABLES | {"hard_examples"} <= tables
        assert "drift_baseline" in columns
        assert await schema_differences(db) == []
    finally:
        await db.dispose()
