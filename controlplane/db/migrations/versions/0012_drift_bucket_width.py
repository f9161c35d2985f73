"""Drift buckets are keyed by their start and their length.

Revision ID: 0012_drift_bucket_width
Revises: 0011_broker_accounts
Create Date: 2026-12-23

``drift_aggregates`` was keyed by ``(model, version, bucket_start)``: after a rule's
``window_s`` changed, a new bucket starting at the same instant as an old one (10 s buckets
from 12:00:00 after 300 s ones) added its reports to the old row, kept the old length, and was
never seen by the rule, which reads buckets of its own length: no trigger. The key now includes
``bucket_s``. Existing rows keep their values (no two of them share a start today).

The downgrade keeps, of buckets sharing a start, the longest.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012_drift_bucket_width"
down_revision = "0011_broker_accounts"
branch_labels = None
depends_on = None

TABLE = "drift_aggregates"
PK = "pk_drift_aggregates"


def upgrade() -> None:
    with op.batch_alter_table(TABLE) as batch:
        batch.drop_constraint(PK, type_="primary")
        batch.create_primary_key(PK, ["model", "version", "bucket_start", "bucket_s"])


def downgrade() -> None:
    op.execute(
        sa.text(
            f"DELETE FROM {TABLE} WHERE EXISTS (SELECT 1 FROM {TABLE} AS longer"
            f" WHERE longer.model = {TABLE}.model AND longer.version = {TABLE}.version"
            f" AND longer.bucket_start = {TABLE}.bucket_start"
            f" AND longer.bucket_s > {TABLE}.bucket_s)"
        )
    )
    with op.batch_alter_table(TABLE) as batch:
        batch.drop_constraint(PK, type_="primary")
        batch.create_primary_key(PK, ["model", "version", "bucket_start"])
