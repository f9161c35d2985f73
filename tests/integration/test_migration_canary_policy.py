"""Migration 0006 (the canary policy columns) on SQLite and PostgreSQL, over rows written before
it: they keep their weight and take the default error budget and requests judged."""

from __future__ import annotations

from datetime import datetime, timezone

from sqlalchemy import text

from mcp_edge.controlplane.db import Database
from mcp_edge.controlplane.db import deployments as q
from mcp_edge.controlplane.db.migrate import head_revision, schema_differences, upgrade_head
from mcp_edge.shared.protocol.canary import DEFAULT_CANARY_POLICY, CanaryPolicy

BEFORE = "0005_apps"


async def test_rows_from_before_the_policy_columns_read_as_the_default_policy(
    database_url: str,
) -> None:
    db = Database(database_url)
    try:
        assert await upgrade_head(db, BEFORE) == BEFORE
        async with db.engine.begin() as conn:
            await conn.execute(
                text(
                    "INSERT INTO deployments (action, model, version, group_name, canary_version, "
                    "canary_weight, rollback, created_by, created_at, devices_matched) VALUES "
                    "('deploy', 'digits', '1.0.0', 'line-a', '1.1.0', 0.25, false, 'user:admin', "
                    ":at, 0), ('deploy', 'digits', '1.0.0', 'line-b', NULL, NULL, false, "
                    "'user:admin', :at, 0)"
                ),
                {"at": datetime(2030, 1, 1, tzinfo=timezone.utc)},
            )

        assert await upgrade_head(db) == head_revision()
        assert await schema_differences(db) == []
        async with db.read() as tx:
            plain, with_canary = await q.list_deployments(tx, limit=10)
        assert with_canary.canary_policy == CanaryPolicy(weight=0.25)
        assert (with_canary.canary_max_error_rate, with_canary.canary_min_requests) == (None, None)
        assert plain.canary_policy is None

        async with db.transaction() as tx:
            policy = CanaryPolicy(weight=0.5, max_error_rate=0.3, min_requests=9)
            row = await q.insert_deployment(
                tx,
                action="deploy",
                model="digits",
                version="1.0.0",
                group_name="line-c",
                canary_version="1.1.0",
                **q.canary_columns(policy),
                rollback=False,
                created_by="user:admin",
                created_at=datetime(2030, 1, 2, tzinfo=timezone.utc),
                devices_matched=0,
            )
        async with db.read() as tx:
            newest = (await q.list_deployments(tx, limit=1))[0]
        assert newest.id == row.id and newest.canary_policy == policy
        assert newest.canary_policy != DEFAULT_CANARY_POLICY
    finally:
        await db.dispose()
