"""Drift: each version's baseline, devices' drift reports, fleet aggregates per time bucket,
the rules that raise retraining triggers, the triggers, and the hard examples devices upload.

Revision ID: 0008_drift
Revises: 0007_rollouts
Create Date: 2026-12-15

``model_versions.drift_baseline`` is nullable: versions published before it have no baseline
(their drift reports are refused as ``no_baseline``). Self-contained on purpose (no import of
``controlplane.db.models``), like ``0001_core``.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "0008_drift"
down_revision = "0007_rollouts"
branch_labels = None
depends_on = None

BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def _time(name: str, *, nullable: bool = False) -> sa.Column[Any]:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def _scores() -> list[sa.Column[Any]]:
    return [
        sa.Column(name, sa.Float(), nullable=True)
        for name in ("score", "input_psi", "class_psi", "confidence_psi")
    ]


def upgrade() -> None:
    op.add_column("model_versions", sa.Column("drift_baseline", sa.JSON(), nullable=True))

    op.create_table(
        "drift_reports",
        sa.Column("id", BIG_ID, autoincrement=True, nullable=False),
        sa.Column("device_id", sa.String(64), nullable=False),
        sa.Column("model", sa.String(64), nullable=False),
        sa.Column("version", sa.String(128), nullable=False),
        sa.Column("role", sa.String(16), nullable=False),
        _time("received_at"),
        sa.Column("window_start", sa.Float(), nullable=False),
        sa.Column("window_end", sa.Float(), nullable=False),
        sa.Column("samples", sa.BigInteger(), nullable=False),
        sa.Column("sample_every", sa.Integer(), nullable=False),
        *_scores(),
        sa.Column("counts", sa.JSON(), nullable=False),
        sa.Column("hard_examples", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(
            ["device_id"],
            ["devices.id"],
            name=op.f("fk_drift_reports_device_id_devices"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_drift_reports")),
    )
    op.create_index(
        "ix_drift_reports_model_version_received_at",
        "drift_reports",
        ["model", "version", "received_at"],
    )
    op.create_index(
        "ix_drift_reports_device_id_received_at", "drift_reports", ["device_id", "received_at"]
    )

    op.create_table(
        "drift_aggregates",
        sa.Column("model", sa.String(64), nullable=False),
        sa.Column("version", sa.String(128), nullable=False),
        _time("bucket_start"),
        sa.Column("bucket_s", sa.Integer(), nullable=False),
        sa.Column("samples", sa.BigInteger(), nullable=False),
        sa.Column("reports", sa.BigInteger(), nullable=False),
        sa.Column("devices", sa.Integer(), nullable=False),
        sa.Column("counts", sa.JSON(), nullable=False),
        *_scores(),
        sa.Column("figures", sa.JSON(), nullable=False),
        sa.Column("over", sa.Boolean(), nullable=False),
        _time("updated_at"),
        sa.PrimaryKeyConstraint(
            "model", "version", "bucket_start", name=op.f("pk_drift_aggregates")
        ),
    )

    op.create_table(
        "drift_rules",
        sa.Column("model", sa.String(64), nullable=False),
        sa.Column("threshold", sa.Float(), nullable=False),
        sa.Column("metric", sa.String(32), nullable=False),
        sa.Column("min_devices", sa.Integer(), nullable=False),
        sa.Column("min_samples", sa.BigInteger(), nullable=False),
        sa.Column("sustained", sa.Integer(), nullable=False),
        sa.Column("cooldown_s", sa.Integer(), nullable=False),
        sa.Column("window_s", sa.Integer(), nullable=False),
        sa.Column("enabled", sa.Boolean(), nullable=False),
        sa.Column("collect_hard_examples", sa.Boolean(), nullable=False),
        _time("updated_at"),
        sa.Column("updated_by", sa.String(128), nullable=False),
        sa.PrimaryKeyConstraint("model", name=op.f("pk_drift_rules")),
    )

    op.create_table(
        "retraining_triggers",
        sa.Column("id", BIG_ID, autoincrement=True, nullable=False),
        sa.Column("model", sa.String(64), nullable=False),
        sa.Column("version", sa.String(128), nullable=False),
        _time("raised_at"),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("score", sa.Float(), nullable=True),
        sa.Column("figures", sa.JSON(), nullable=False),
        sa.Column("rule", sa.JSON(), nullable=False),
        sa.Column("device_count", sa.Integer(), nullable=False),
        sa.Column("device_ids", sa.JSON(), nullable=False),
        _time("acknowledged_at", nullable=True),
        sa.Column("acknowledged_by", sa.String(128), nullable=True),
        sa.Column("note", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_retraining_triggers")),
    )
    op.create_index(
        "ix_retraining_triggers_model_version_raised_at",
        "retraining_triggers",
        ["model", "version", "raised_at"],
    )
    op.create_index("ix_retraining_triggers_status", "retraining_triggers", ["status"])

    op.create_table(
        "hard_examples",
        sa.Column("id", BIG_ID, autoincrement=True, nullable=False),
        sa.Column("trigger_id", BIG_ID, nullable=True),
        sa.Column("device_id", sa.String(64), nullable=False),
        sa.Column("model", sa.String(64), nullable=False),
        sa.Column("version", sa.String(128), nullable=False),
        sa.Column("device_ts", sa.Float(), nullable=False),
        _time("received_at"),
        sa.Column("confidence", sa.Float(), nullable=False),
        sa.Column("predicted", sa.Integer(), nullable=True),
        sa.Column("input_name", sa.String(256), nullable=False),
        sa.Column("input_datatype", sa.String(8), nullable=False),
        sa.Column("input_shape", sa.JSON(), nullable=False),
        sa.Column("input_data", sa.LargeBinary(), nullable=False),
        sa.Column("output_name", sa.String(256), nullable=True),
        sa.Column("output_datatype", sa.String(8), nullable=True),
        sa.Column("output_shape", sa.JSON(), nullable=True),
        sa.Column("output_data", sa.LargeBinary(), nullable=True),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.ForeignKeyConstraint(
            ["trigger_id"],
            ["retraining_triggers.id"],
            name=op.f("fk_hard_examples_trigger_id_retraining_triggers"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_hard_examples")),
    )
    op.create_index("ix_hard_examples_trigger_id", "hard_examples", ["trigger_id"])
    op.create_index(
        "ix_hard_examples_model_version_received_at",
        "hard_examples",
        ["model", "version", "received_at"],
    )


def downgrade() -> None:
    op.drop_index("ix_hard_examples_model_version_received_at", table_name="hard_examples")
    op.drop_index("ix_hard_examples_trigger_id", table_name="hard_examples")
    op.drop_table("hard_examples")
    op.drop_index("ix_retraining_triggers_status", table_name="retraining_triggers")
    op.drop_index(
        "ix_retraining_triggers_model_version_raised_at", table_name="retraining_triggers"
    )
    op.drop_table("retraining_triggers")
    op.drop_table("drift_rules")
    op.drop_table("drift_aggregates")
    op.drop_index("ix_drift_reports_device_id_received_at", table_name="drift_reports")
    op.drop_index("ix_drift_reports_model_version_received_at", table_name="drift_reports")
    op.drop_table("drift_reports")
    with op.batch_alter_table("model_versions") as batch:
        batch.drop_column("drift_baseline")
