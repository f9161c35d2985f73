"""Canary policy: deployments and device models store the canary's error budget and the requests
judged before it, beside its weight.

Revision ID: 0006_canary_policy
Revises: 0005_apps
Create Date: 2026-12-15

Both columns are nullable: rows written before them (and rows without a canary) hold NULL, read
as the default of :class:`shared.protocol.canary.CanaryPolicy`, which is what devices applied
then. Self-contained on purpose (no import of ``controlplane.db.models``), like ``0001_core``.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006_canary_policy"
down_revision = "0005_apps"
branch_labels = None
depends_on = None

TABLES = ("deployments", "device_models")


def upgrade() -> None:
    for table in TABLES:
        op.add_column(table, sa.Column("canary_max_error_rate", sa.Float(), nullable=True))
        op.add_column(table, sa.Column("canary_min_requests", sa.Integer(), nullable=True))


def downgrade() -> None:
    for table in TABLES:
        with op.batch_alter_table(table) as batch:  # SQLite drops columns by copying the table
            batch.drop_column("canary_min_requests")
            batch.drop_column("canary_max_error_rate")
