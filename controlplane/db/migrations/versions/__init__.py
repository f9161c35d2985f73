"""Migration scripts, applied in ``down_revision`` order (Alembic skips this file)."""
