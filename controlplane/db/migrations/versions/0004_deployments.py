"""Deployments: operator actions, per-device desired models, signed desired-state documents.

Revision ID: 0004_deployments
Revises: 0003_registry
Create Date: 2026-12-01

Self-contained on purpose (no import of ``controlplane.db.models``), like ``0001_core``.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "0004_deployments"
down_revision = "0003_registry"
branch_labels = None
depends_on = None

BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def _time(name: str, *, nullable: bool = False) -> sa.Column[Any]:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def _version(name: str, *, nullable: bool = True) -> sa.Column[Any]:
    return sa.Column(name, sa.String(128), nullable=nullable)


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
        "deployments",
        sa.Column("id", BIG_ID, autoincrement=True, nullable=False),
        sa.Column("action", sa.String(16), nullable=False),
        sa.Column("model", sa.String(64), nullable=False),
        _version("version"),
        sa.Column("device_id", sa.String(64), nullable=True),
        sa.Column("group_name", sa.String(64), nullable=True),
        sa.Column("labels", sa.JSON(), nullable=True),
        _version("canary_version"),
        sa.Column("canary_weight", sa.Float(), nullable=True),
        _version("shadow_version"),
        sa.Column("rollback", sa.Boolean(), nullable=False),
        sa.Column("created_by", sa.String(128), nullable=False),
        _time("created_at"),
        sa.Column("devices_matched", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_deployments")),
    )
    op.create_index("ix_deployments_model", "deployments", ["model"])
    op.create_index("ix_deployments_group_name", "deployments", ["group_name"])

    op.create_table(
        "device_models",
        *_device("device_models"),
        sa.Column("model", sa.String(64), nullable=False),
        _version("stable_version", nullable=False),
        _version("canary_version"),
        sa.Column("canary_weight", sa.Float(), nullable=True),
        _version("shadow_version"),
        sa.Column("rollback", sa.Boolean(), nullable=False),
        sa.Column("deployment_id", BIG_ID, nullable=True),
        _time("updated_at"),
        sa.ForeignKeyConstraint(
            ["deployment_id"],
            ["deployments.id"],
            name=op.f("fk_device_models_deployment_id_deployments"),
            ondelete="SET NULL",
        ),
        sa.PrimaryKeyConstraint("device_id", "model", name=op.f("pk_device_models")),
    )

    op.create_table(
        "desired_states",
        *_device("desired_states"),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("envelope", sa.JSON(), nullable=False),
        _time("issued_at"),
        _time("expires_at"),
        _time("refresh_at"),
        _time("published_at", nullable=True),
        sa.PrimaryKeyConstraint("device_id", name=op.f("pk_desired_states")),
    )
    op.create_index("ix_desired_states_refresh_at", "desired_states", ["refresh_at"])


def downgrade() -> None:
    op.drop_index("ix_desired_states_refresh_at", table_name="desired_states")
    op.drop_table("desired_states")
    op.drop_table("device_models")
    op.drop_index("ix_deployments_group_name", table_name="deployments")
    op.drop_index("ix_deployments_model", table_name="deployments")
    op.drop_table("deployments")
