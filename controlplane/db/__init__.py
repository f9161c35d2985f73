"""The control plane's database: engine, models, migrations and queries.

Only this package imports SQLAlchemy. Callers open a unit of work with
:meth:`Database.transaction` (or :meth:`Database.read`) and pass the handle to the query
functions of :mod:`~controlplane.db.users`, :mod:`~controlplane.db.devices`,
:mod:`~controlplane.db.enrollment` and :mod:`~controlplane.db.audit`; failures come out as
:mod:`controlplane.db.errors`.
"""

from mcp_edge.controlplane.db.engine import Database, Tx, async_url
from mcp_edge.controlplane.db.errors import (
    ConflictError,
    DatabaseConfigError,
    DatabaseError,
    NotFoundError,
    UnavailableError,
)
from mcp_edge.controlplane.db.migrate import current_revision, head_revision, upgrade_head

__all__ = [
    "ConflictError",
    "Database",
    "DatabaseConfigError",
    "DatabaseError",
    "NotFoundError",
    "Tx",
    "UnavailableError",
    "async_url",
    "current_revision",
    "head_revision",
    "upgrade_head",
]
