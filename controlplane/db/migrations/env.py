"""Alembic environment: runs on the connection :mod:`controlplane.db.migrate` hands over.

There is no ``alembic.ini`` and no URL here: the caller opens the connection (async engine,
``run_sync``) and puts it in ``config.attributes["connection"]``, so migrations run in the same
transaction as the caller's PostgreSQL advisory lock.
"""

from __future__ import annotations

from alembic import context

from mcp_edge.controlplane.db.models import Base

config = context.config
connection = config.attributes.get("connection")
if connection is None:
    raise RuntimeError(
        "run migrations through controlplane.db.migrate (mcp-controlplane init/serve), "
        "not the alembic command"
    )

context.configure(
    connection=connection,
    target_metadata=Base.metadata,
    render_as_batch=connection.dialect.name == "sqlite",  # SQLite ALTERs need table copies
    compare_type=True,
)
with context.begin_transaction():
    context.run_migrations()
