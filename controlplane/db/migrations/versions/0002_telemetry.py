"""Telemetry: health samples, inference statistics, deployment events, reported state.

Revision ID: 0002_telemetry
Revises: 0001_core
Create Date: 2026-05-02

Self-contained on purpose (no import of ``controlplane.db.models``), like ``0001_core``.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "0002_telemetry"
down_revision = "0001_core"
branch_labels = None
depends_on = None

BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def _time(name: str, *, nullable: bool = False) -> sa.Column[Any]:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def _float(name: str, *, nullable: bool = True) -> sa.Column[Any]:
    return sa.Column(name, sa.Float(), nullable=nullable)


def _id() -> sa.Column[Any]:
    return sa.Column("id", BIG_ID, autoincrement=True, nullable=False)


def _device(table: str) -> tuple[sa.Column[Any], sa.ForeignKeyConstraint]:
    return (
        sa.Column("device_id", sa.String(64), nullable=False),
        sa.ForeignKeyConstraint(
            ["device_id"],
            ["devices.id"],
            name=op.f(f"fk_{table}_device_id_devices"),
            ondelete="CASCADE",
        ),
    )


def upgrade() -> None:
    op.create_table(
        "health_samples",
        _id(),
        *_device("health_samples"),
        _time("ts"),
        _float("cpu_percent", nullable=False),
        _float("load_1m"),
        _float("mem_used_mb", nullable=False),
        _float("mem_total_mb", nullable=False),
        _float("disk_free_mb"),
        _float("disk_total_mb"),
        _float("process_rss_mb"),
        _float("uptime_s"),
        sa.Column("temperatures_c", sa.JSON(), nullable=False),
        sa.Column("gpu", sa.JSON(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_health_samples")),
    )
    op.create_index("ix_health_samples_device_id_ts", "health_samples", ["device_id", "ts"])
    op.create_index("ix_health_samples_ts", "health_samples", ["ts"])

    op.create_table(
        "inference_stats",
        _id(),
        *_device("inference_stats"),
        _time("ts"),
        _float("window_s", nullable=False),
        sa.Column("model", sa.String(64), nullable=False),
        sa.Column("version", sa.String(128), nullable=False),
        sa.Column("count", sa.BigInteger(), nullable=False),
        sa.Column("errors", sa.BigInteger(), nullable=False),
        sa.Column("rejections", sa.BigInteger(), nullable=False),
        _float("p50_ms"),
        _float("p95_ms"),
        _float("p99_ms"),
        sa.Column("queue_depth", sa.Integer(), nullable=False),
        _float("batch_size_avg"),
        _float("batch_fill_ratio"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_inference_stats")),
    )
    op.create_index("ix_inference_stats_device_id_ts", "inference_stats", ["device_id", "ts"])
    op.create_index(
        "ix_inference_stats_model_version_ts", "inference_stats", ["model", "version", "ts"]
    )

    op.create_table(
        "deployment_events",
        _id(),
        *_device("deployment_events"),
        sa.Column("event_seq", sa.BigInteger(), nullable=False),
        _time("ts"),
        _time("received_at"),
        sa.Column("model", sa.String(64), nullable=False),
        sa.Column("version", sa.String(128), nullable=False),
        sa.Column("phase", sa.String(32), nullable=False),
        sa.Column("outcome", sa.String(16), nullable=False),
        sa.Column("message", sa.String(2048), nullable=False),
        sa.Column("cause", sa.String(64), nullable=True),
        sa.Column("bytes_done", sa.BigInteger(), nullable=True),
        sa.Column("bytes_total", sa.BigInteger(), nullable=True),
        _float("elapsed_ms"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_deployment_events")),
        sa.UniqueConstraint(
            "device_id", "event_seq", name="uq_deployment_events_device_id_event_seq"
        ),
    )

    op.create_table(
        "device_reported",
        *_device("device_reported"),
        _time("ts"),
        _time("received_at"),
        sa.Column("applied_seq", sa.BigInteger(), nullable=False),
        sa.Column("document", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("device_id", name=op.f("pk_device_reported")),
    )


def downgrade() -> None:
    op.drop_table("device_reported")
    op.drop_table("deployment_events")
    op.drop_index("ix_inference_stats_model_version_ts", table_name="inference_stats")
    op.drop_index("ix_inference_stats_device_id_ts", table_name="inference_stats")
    op.drop_table("inference_stats")
    op.drop_index("ix_health_samples_ts", table_name="health_samples")
    op.drop_index("ix_health_samples_device_id_ts", table_name="health_samples")
    op.drop_table("health_samples")
