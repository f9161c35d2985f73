"""Reported models: each model of each device's latest reported state as a row (name, active
version), indexed by model and version, so the device list filters on models and sync state
without reading every reported document.

Revision ID: 0009_reported_models
Revises: 0008_drift
Create Date: 2026-12-20

The rows are filled from the stored reported states. Self-contained on purpose (no import of
``controlplane.db.models``), like ``0001_core``: the reading of a document below is the one of
``controlplane.db.devices.reported_models`` at this revision.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "0009_reported_models"
down_revision = "0008_drift"
branch_labels = None
depends_on = None

TABLE = "device_reported_models"
INDEX = "ix_device_reported_models_model_active_version"
NAME_MAX, VERSION_MAX = 64, 128
CHUNK = 1000


def _rows(device_id: str, document: Any) -> list[dict[str, Any]]:
    """The models of one reported document: objects of its ``models`` array with a name of
    1 to 64 characters (the last wins when a name repeats); an active version of more than 128
    characters, or not text, counts as none."""
    models = document.get("models") if isinstance(document, dict) else None
    by_name: dict[str, Any] = {}
    for m in models if isinstance(models, list) else []:
        name = m.get("name") if isinstance(m, dict) else None
        if isinstance(name, str) and 0 < len(name) <= NAME_MAX:
            by_name[name] = m.get("active_version")
    return [
        {
            "device_id": device_id,
            "model": name,
            "active_version": v if isinstance(v, str) and len(v) <= VERSION_MAX else None,
        }
        for name, v in by_name.items()
    ]


def upgrade() -> None:
    table = op.create_table(
        TABLE,
        sa.Column("device_id", sa.String(64), nullable=False),
        sa.Column("model", sa.String(64), nullable=False),
        sa.Column("active_version", sa.String(128), nullable=True),
        sa.ForeignKeyConstraint(
            ["device_id"],
            ["devices.id"],
            name=op.f("fk_device_reported_models_device_id_devices"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("device_id", "model", name=op.f("pk_device_reported_models")),
    )
    op.create_index(INDEX, TABLE, ["model", "active_version"])
    reported = sa.table("device_reported", sa.column("device_id"), sa.column("document", sa.JSON))
    bind = op.get_bind()
    rows: list[dict[str, Any]] = []
    stored = bind.execute(sa.select(reported.c.device_id, reported.c.document)).all()
    for device_id, document in stored:
        rows += _rows(device_id, document)
        if len(rows) >= CHUNK:
            bind.execute(sa.insert(table), rows)
            rows = []
    if rows:
        bind.execute(sa.insert(table), rows)


def downgrade() -> None:
    op.drop_index(INDEX, table_name=TABLE)
    op.drop_table(TABLE)
