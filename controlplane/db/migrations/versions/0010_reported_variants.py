"""Reported variants: each reported model's row names the bundle variant its active version
runs (``default``, ``int8``, a profile's tag) and the ``backend/provider`` it runs on
(``openvino/CPU``), so the device list and a device's page show them without reading the
reported documents.

Revision ID: 0010_reported_variants
Revises: 0009_reported_models
Create Date: 2026-12-21

Both columns are nullable: a device whose agent does not report them has none. They are filled
from the stored reported states. Self-contained on purpose (no import of
``controlplane.db.models``), like ``0001_core``: the reading of a document below is the one of
``controlplane.db.devices.reported_model_rows`` at this revision.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "0010_reported_variants"
down_revision = "0009_reported_models"
branch_labels = None
depends_on = None

TABLE = "device_reported_models"
NAME_MAX, VARIANT_MAX, BACKEND_MAX = 64, 64, 128
CHUNK = 1000


def _text(status: dict[str, Any], key: str, longest: int) -> str | None:
    value = status.get(key)
    return value if isinstance(value, str) and 0 < len(value) <= longest else None


def _updates(device_id: str, document: Any) -> list[dict[str, Any]]:
    """The variant and backend of each model of one reported document that names either: the
    objects of its ``models`` array with a name of 1 to 64 characters (the last wins when a
    name repeats, as in 0009); a variant of more than 64 characters, a backend of more than
    128, or either not text, counts as none."""
    models = document.get("models") if isinstance(document, dict) else None
    by_name: dict[str, dict[str, Any]] = {}
    for m in models if isinstance(models, list) else []:
        name = m.get("name") if isinstance(m, dict) else None
        if isinstance(name, str) and 0 < len(name) <= NAME_MAX:
            by_name[name] = m
    out = []
    for name, status in by_name.items():
        variant = _text(status, "active_variant", VARIANT_MAX)
        backend = _text(status, "active_backend", BACKEND_MAX)
        if variant is not None or backend is not None:
            out.append({"d": device_id, "m": name, "v": variant, "b": backend})
    return out


def upgrade() -> None:
    op.add_column(TABLE, sa.Column("variant", sa.String(VARIANT_MAX), nullable=True))
    op.add_column(TABLE, sa.Column("backend", sa.String(BACKEND_MAX), nullable=True))
    table = sa.table(
        TABLE, sa.column("device_id"), sa.column("model"), sa.column("variant"),
        sa.column("backend"),
    )  # fmt: skip
    reported = sa.table("device_reported", sa.column("device_id"), sa.column("document", sa.JSON))
    fill = (
        sa.update(table)
        .where(table.c.device_id == sa.bindparam("d"), table.c.model == sa.bindparam("m"))
        .values(variant=sa.bindparam("v"), backend=sa.bindparam("b"))
    )
    bind = op.get_bind()
    rows: list[dict[str, Any]] = []
    stored = bind.execute(sa.select(reported.c.device_id, reported.c.document)).all()
    for device_id, document in stored:
        rows += _updates(device_id, document)
        if len(rows) >= CHUNK:
            bind.execute(fill, rows)
            rows = []
    if rows:
        bind.execute(fill, rows)


def downgrade() -> None:
    with op.batch_alter_table(TABLE) as batch:  # SQLite drops columns by copying the table
        batch.drop_column("backend")
        batch.drop_column("variant")
