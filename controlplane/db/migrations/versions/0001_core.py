"""Core tables: users, API tokens, enrollment tokens and nonces, devices and labels, audit log.

Revision ID: 0001_core
Revises:
Create Date: 2026-05-01

Self-contained on purpose (no import of ``controlplane.db.models``): a migration must keep
describing the schema of its time after the models move on.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "0001_core"
down_revision = None
branch_labels = None
depends_on = None

BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def _time(name: str, *, nullable: bool = False) -> sa.Column[Any]:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    op.create_table(
        "users",
        sa.Column("id", BIG_ID, autoincrement=True, nullable=False),
        sa.Column("username", sa.String(64), nullable=False),
        sa.Column("password_hash", sa.String(255), nullable=False),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("disabled", sa.Boolean(), nullable=False),
        _time("created_at"),
        _time("updated_at"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_users")),
        sa.UniqueConstraint("username", name=op.f("uq_users_username")),
    )
    op.create_table(
        "api_tokens",
        sa.Column("id", BIG_ID, autoincrement=True, nullable=False),
        sa.Column("user_id", BIG_ID, nullable=False),
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("token_hash", sa.String(64), nullable=False),
        sa.Column("prefix", sa.String(16), nullable=False),
        _time("created_at"),
        _time("expires_at", nullable=True),
        _time("last_used_at", nullable=True),
        _time("revoked_at", nullable=True),
        sa.ForeignKeyConstraint(
            ["user_id"], ["users.id"], name=op.f("fk_api_tokens_user_id_users"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_tokens")),
        sa.UniqueConstraint("token_hash", name=op.f("uq_api_tokens_token_hash")),
    )
    op.create_index(op.f("ix_api_tokens_user_id"), "api_tokens", ["user_id"])
    op.create_table(
        "enrollment_tokens",
        sa.Column("id", BIG_ID, autoincrement=True, nullable=False),
        sa.Column("token_hash", sa.String(64), nullable=False),
        sa.Column("prefix", sa.String(16), nullable=False),
        sa.Column("description", sa.String(256), nullable=False),
        sa.Column("group_name", sa.String(64), nullable=True),
        sa.Column("labels", sa.JSON(), nullable=False),
        sa.Column("approval", sa.String(16), nullable=False),
        sa.Column("max_uses", sa.Integer(), nullable=True),
        sa.Column("uses", sa.Integer(), nullable=False),
        _time("created_at"),
        sa.Column("created_by", sa.String(64), nullable=False),
        _time("expires_at", nullable=True),
        _time("revoked_at", nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_enrollment_tokens")),
        sa.UniqueConstraint("token_hash", name=op.f("uq_enrollment_tokens_token_hash")),
    )
    op.create_table(
        "enrollment_nonces",
        sa.Column("nonce", sa.String(128), nullable=False),
        _time("expires_at"),
        sa.PrimaryKeyConstraint("nonce", name=op.f("pk_enrollment_nonces")),
    )
    op.create_index(op.f("ix_enrollment_nonces_expires_at"), "enrollment_nonces", ["expires_at"])
    op.create_table(
        "devices",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("public_key", sa.String(64), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("profile", sa.String(64), nullable=True),
        sa.Column("group_name", sa.String(64), nullable=True),
        sa.Column("facts", sa.JSON(), nullable=False),
        sa.Column("agent_version", sa.String(64), nullable=False),
        sa.Column("enrollment_token_id", BIG_ID, nullable=True),
        sa.Column("online", sa.Boolean(), nullable=False),
        _time("last_seen_at", nullable=True),
        _time("created_at"),
        _time("updated_at"),
        _time("accepted_at", nullable=True),
        _time("revoked_at", nullable=True),
        sa.ForeignKeyConstraint(
            ["enrollment_token_id"],
            ["enrollment_tokens.id"],
            name=op.f("fk_devices_enrollment_token_id_enrollment_tokens"),
            ondelete="SET NULL",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_devices")),
        sa.UniqueConstraint("public_key", name=op.f("uq_devices_public_key")),
    )
    op.create_index(op.f("ix_devices_group_name"), "devices", ["group_name"])
    op.create_index(op.f("ix_devices_profile"), "devices", ["profile"])
    op.create_index(op.f("ix_devices_status"), "devices", ["status"])
    op.create_table(
        "device_labels",
        sa.Column("device_id", sa.String(64), nullable=False),
        sa.Column("key", sa.String(63), nullable=False),
        sa.Column("value", sa.String(128), nullable=False),
        sa.ForeignKeyConstraint(
            ["device_id"],
            ["devices.id"],
            name=op.f("fk_device_labels_device_id_devices"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("device_id", "key", name=op.f("pk_device_labels")),
    )
    op.create_index("ix_device_labels_key_value", "device_labels", ["key", "value"])
    op.create_table(
        "audit_log",
        sa.Column("id", BIG_ID, autoincrement=True, nullable=False),
        _time("at"),
        sa.Column("actor", sa.String(128), nullable=False),
        sa.Column("action", sa.String(64), nullable=False),
        sa.Column("target_type", sa.String(32), nullable=False),
        sa.Column("target_id", sa.String(128), nullable=False),
        sa.Column("detail", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_audit_log")),
    )
    op.create_index(op.f("ix_audit_log_action"), "audit_log", ["action"])
    op.create_index(op.f("ix_audit_log_at"), "audit_log", ["at"])


def downgrade() -> None:
    for table in (
        "audit_log",
        "device_labels",
        "devices",
        "enrollment_nonces",
        "enrollment_tokens",
        "api_tokens",
        "users",
    ):
        op.drop_table(table)
