"""Errors of the database layer; SQLAlchemy's own exceptions never get past ``controlplane.db``.

::

    DatabaseError              base: the database could not do what was asked
    ├── DatabaseConfigError    the URL names a driver or dialect we do not support
    ├── ConflictError          a unique or foreign-key constraint refused the change
    ├── NotFoundError          the row a change was aimed at does not exist
    └── UnavailableError       the server cannot be reached, is locked, or gave no write turn
                               in time (retry later)
"""

from __future__ import annotations

from mcp_edge.shared.errors import McpError


class DatabaseError(McpError):
    """The database could not do what was asked."""


class DatabaseConfigError(DatabaseError):
    """The database URL is not one the control plane can use."""


class ConflictError(DatabaseError):
    """A constraint refused the change (a duplicate name, a key already enrolled, ...)."""


class NotFoundError(DatabaseError):
    """The row a change was aimed at does not exist."""


class UnavailableError(DatabaseError):
    """The database cannot be reached, stayed locked past the timeout, or (SQLite) gave this
    writer no turn within ``Database(write_wait_s=)``; retrying may help."""
