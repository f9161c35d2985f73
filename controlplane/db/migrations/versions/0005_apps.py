"""Application MQTT accounts: the clients that send inference requests over MQTT.

Revision ID: 0005_apps
Revises: 0004_deployments
Create Date: 2026-12-08

Self-contained on purpose (no import of ``controlplane.db.models``), like ``0001_core``.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005_apps"
down_revision = "0004_deployments"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "app_clients",
        sa.Column("client_id", sa.String(64), nullable=False),
        sa.Column("description", sa.String(256), nullable=False),
        sa.Column("created_by", sa.String(128), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("client_id", name=op.f("pk_app_clients")),
    )


def downgrade() -> None:
    op.drop_table("app_clients")
