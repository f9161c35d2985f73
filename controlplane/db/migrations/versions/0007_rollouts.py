"""Rollouts: staged rollouts with their devices and history, webhook deliveries, per-role
inference statistics, and prefetched versions.

Revision ID: 0007_rollouts
Revises: 0006_canary_policy
Create Date: 2026-12-01

Added columns are nullable: rows written before them read as before (inference statistics
without a role are the stable version's; deployments without ``rollout_id`` are an operator's).
Self-contained on purpose (no import of ``controlplane.db.models``), like ``0001_core``.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "0007_rollouts"
down_revision = "0006_canary_policy"
branch_labels = None
depends_on = None

BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def _time(name: str, *, nullable: bool = False) -> sa.Column[Any]:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def _rollout_fk(table: str) -> sa.ForeignKeyConstraint:
    return sa.ForeignKeyConstraint(
        ["rollout_id"],
        ["rollouts.id"],
        name=op.f(f"fk_{table}_rollout_id_rollouts"),
        ondelete="CASCADE",
    )


def upgrade() -> None:
    op.add_column("inference_stats", sa.Column("role", sa.String(16), nullable=True))
    op.add_column("inference_stats", sa.Column("latency_hist", sa.JSON(), nullable=True))
    op.add_column("inference_stats", sa.Column("shadow_compared", sa.BigInteger(), nullable=True))
    op.add_column("inference_stats", sa.Column("shadow_agreed", sa.BigInteger(), nullable=True))
    for table in ("deployments", "device_models"):
        op.add_column(table, sa.Column("prefetch_version", sa.String(128), nullable=True))
    op.add_column("deployments", sa.Column("rollout_id", BIG_ID, nullable=True))
    op.create_index("ix_deployments_rollout_id", "deployments", ["rollout_id"])

    op.create_table(
        "rollouts",
        sa.Column("id", BIG_ID, autoincrement=True, nullable=False),
        sa.Column("model", sa.String(64), nullable=False),
        sa.Column("version", sa.String(128), nullable=False),
        sa.Column("status", sa.String(24), nullable=False),
        sa.Column("stage", sa.Integer(), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("state", sa.JSON(), nullable=False),
        sa.Column("target_devices", sa.Integer(), nullable=False),
        sa.Column("created_by", sa.String(128), nullable=False),
        _time("created_at"),
        _time("updated_at"),
        _time("ended_at", nullable=True),
        sa.Column("step_seq", sa.BigInteger(), nullable=False),
        sa.Column("lease_owner", sa.String(128), nullable=True),
        _time("lease_until", nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_rollouts")),
    )
    op.create_index("ix_rollouts_model", "rollouts", ["model"])
    op.create_index("ix_rollouts_status", "rollouts", ["status"])

    op.create_table(
        "rollout_devices",
        sa.Column("rollout_id", BIG_ID, nullable=False),
        sa.Column("device_id", sa.String(64), nullable=False),
        sa.Column("stage", sa.Integer(), nullable=False),
        sa.Column("phase", sa.String(16), nullable=False),
        _time("since"),
        _time("told_at", nullable=True),
        sa.Column("from_version", sa.String(128), nullable=True),
        sa.Column("mode", sa.String(16), nullable=True),
        sa.Column("moves", sa.Integer(), nullable=False),
        _rollout_fk("rollout_devices"),
        sa.ForeignKeyConstraint(
            ["device_id"],
            ["devices.id"],
            name=op.f("fk_rollout_devices_device_id_devices"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("rollout_id", "device_id", name=op.f("pk_rollout_devices")),
    )
    op.create_index("ix_rollout_devices_device_id", "rollout_devices", ["device_id"])

    op.create_table(
        "rollout_events",
        sa.Column("id", BIG_ID, autoincrement=True, nullable=False),
        sa.Column("rollout_id", BIG_ID, nullable=False),
        _time("at"),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("stage", sa.Integer(), nullable=True),
        sa.Column("actor", sa.String(128), nullable=False),
        sa.Column("reason", sa.String(2048), nullable=False),
        sa.Column("detail", sa.JSON(), nullable=False),
        _rollout_fk("rollout_events"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_rollout_events")),
    )
    op.create_index("ix_rollout_events_rollout_id_id", "rollout_events", ["rollout_id", "id"])

    op.create_table(
        "webhook_deliveries",
        sa.Column("id", BIG_ID, autoincrement=True, nullable=False),
        sa.Column("event_id", sa.String(64), nullable=False),
        sa.Column("webhook", sa.String(64), nullable=False),
        sa.Column("event", sa.String(64), nullable=False),
        sa.Column("body", sa.JSON(), nullable=False),
        _time("created_at"),
        _time("next_attempt_at"),
        sa.Column("attempts", sa.Integer(), nullable=False),
        _time("delivered_at", nullable=True),
        _time("failed_at", nullable=True),
        sa.Column("last_error", sa.String(512), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_webhook_deliveries")),
    )
    op.create_index(
        "ix_webhook_deliveries_pending", "webhook_deliveries", ["delivered_at", "next_attempt_at"]
    )


def downgrade() -> None:
    op.drop_index("ix_webhook_deliveries_pending", table_name="webhook_deliveries")
    op.drop_table("webhook_deliveries")
    op.drop_index("ix_rollout_events_rollout_id_id", table_name="rollout_events")
    op.drop_table("rollout_events")
    op.drop_index("ix_rollout_devices_device_id", table_name="rollout_devices")
    op.drop_table("rollout_devices")
    op.drop_index("ix_rollouts_status", table_name="rollouts")
    op.drop_index("ix_rollouts_model", table_name="rollouts")
    op.drop_table("rollouts")
    op.drop_index("ix_deployments_rollout_id", table_name="deployments")
    with op.batch_alter_table("deployments") as batch:
        batch.drop_column("rollout_id")
        batch.drop_column("prefetch_version")
    with op.batch_alter_table("device_models") as batch:
        batch.drop_column("prefetch_version")
    with op.batch_alter_table("inference_stats") as batch:
        for column in ("shadow_agreed", "shadow_compared", "latency_hist", "role"):
            batch.drop_column(column)
