"""Model registry: publisher keys, models, model versions (one TUF target each).

Revision ID: 0003_registry
Revises: 0002_telemetry
Create Date: 2026-11-30

Self-contained on purpose (no import of ``controlplane.db.models``), like ``0001_core``.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003_registry"
down_revision = "0002_telemetry"
branch_labels = None
depends_on = None

BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def _time(name: str, *, nullable: bool = False) -> sa.Column[object]:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    op.create_table(
        "publisher_keys",
        sa.Column("keyid", sa.String(64), nullable=False),
        sa.Column("public_key", sa.String(64), nullable=False),
        sa.Column("name", sa.String(64), nullable=False),
        _time("created_at"),
        _time("revoked_at", nullable=True),
        sa.PrimaryKeyConstraint("keyid", name=op.f("pk_publisher_keys")),
        sa.UniqueConstraint("public_key", name=op.f("uq_publisher_keys_public_key")),
    )
    op.create_table(
        "models",
        sa.Column("name", sa.String(64), nullable=False),
        _time("created_at"),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_models")),
    )
    op.create_table(
        "model_versions",
        sa.Column("id", BIG_ID, autoincrement=True, nullable=False),
        sa.Column("model", sa.String(64), nullable=False),
        sa.Column("version", sa.String(128), nullable=False),
        sa.Column("version_numeric", sa.BigInteger(), nullable=False),
        sa.Column("target_path", sa.String(512), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("length", sa.BigInteger(), nullable=False),
        sa.Column("format", sa.String(16), nullable=False),
        sa.Column("profiles", sa.JSON(), nullable=False),
        sa.Column("variants", sa.JSON(), nullable=False),
        sa.Column("publisher_keyid", sa.String(64), nullable=False),
        sa.Column("uploaded_by", sa.String(128), nullable=False),
        _time("created_at"),
        sa.ForeignKeyConstraint(
            ["model"],
            ["models.name"],
            name=op.f("fk_model_versions_model_models"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_model_versions")),
        sa.UniqueConstraint("model", "version", name="uq_model_versions_model_version"),
        sa.UniqueConstraint("target_path", name=op.f("uq_model_versions_target_path")),
    )


def downgrade() -> None:
    op.drop_table("model_versions")
    op.drop_table("models")
    op.drop_table("publisher_keys")
