"""Broker accounts kept by the control plane, for brokers that call its HTTP authentication and
ACL endpoint (EMQX, VerneMQ, mosquitto-go-auth) instead of holding accounts themselves.

Revision ID: 0011_broker_accounts
Revises: 0010_reported_variants
Create Date: 2026-12-22

One row per account: its username, the one client id it may connect with (unique: one client
id belongs to one account), its kind (device, service, app), a salted scrypt hash of its
password, and whether it is enabled. Self-contained on purpose (no import of
``controlplane.db.models``), like ``0001_core``.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011_broker_accounts"
down_revision = "0010_reported_variants"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "broker_accounts",
        sa.Column("username", sa.String(80), nullable=False),
        sa.Column("client_id", sa.String(64), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("password_hash", sa.String(255), nullable=False),
        sa.Column("enabled", sa.Boolean(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("username", name=op.f("pk_broker_accounts")),
        sa.UniqueConstraint("client_id", name=op.f("uq_broker_accounts_client_id")),
    )


def downgrade() -> None:
    op.drop_table("broker_accounts")
