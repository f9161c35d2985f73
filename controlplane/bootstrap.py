"""``mcp-controlplane init``: data dir, config file, database schema, first admin and API token.

Idempotent where it can be: an existing data dir and database are migrated, not replaced. An
admin is created when asked for by name, or when the database has no user at all; asking for
an existing name is an error (use ``mcp-controlplane login`` to get a token for it).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from mcp_edge.controlplane import audit
from mcp_edge.controlplane.api.users import issue_api_token
from mcp_edge.controlplane.audit import SYSTEM_ACTOR, AuditAction
from mcp_edge.controlplane.auth import PasswordHasher, Role
from mcp_edge.controlplane.db import ConflictError, Database, upgrade_head
from mcp_edge.controlplane.db import users as user_q
from mcp_edge.controlplane.settings import Settings, write_config_file
from mcp_edge.shared.errors import McpError

DEFAULT_ADMIN = "admin"


class InitError(McpError):
    """``init`` cannot do what it was asked (e.g. the admin name is taken)."""


@dataclass(frozen=True)
class InitResult:
    """What ``init`` did; ``api_token`` is the only copy of the secret."""

    revision: str
    config_written: bool
    admin: str | None = None
    api_token: str | None = None


def prepare_data_dir(settings: Settings, *, write_config: bool) -> bool:
    """Create the data dir (0700) and write ``controlplane.toml`` when asked or missing.
    Returns whether the config file was written."""
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(settings.data_dir, 0o700)
    if write_config or not settings.config_path.exists():
        write_config_file(settings)
        return True
    return False


async def initialize(
    settings: Settings,
    *,
    clock: Callable[[], datetime],
    admin_user: str | None = None,
    admin_password: str | Callable[[], str] | None = None,
    write_config: bool = False,
) -> InitResult:
    """Prepare the data dir, migrate the database, and create the first admin if needed.

    ``admin_password`` may be a callable, asked only when an admin is actually created.
    Raises :class:`InitError` and :mod:`controlplane.db.errors`.
    """
    config_written = prepare_data_dir(settings, write_config=write_config)
    db = Database(settings.effective_database_url)
    try:
        revision = await upgrade_head(db)
        async with db.read() as tx:
            existing_users = await user_q.count_users(tx)
            taken = admin_user is not None and await user_q.get_user(tx, admin_user) is not None
        if taken:
            raise InitError(
                f"user {admin_user!r} already exists; get a token with "
                "`mcp-controlplane login` instead"
            )
        if admin_user is None and existing_users > 0:
            return InitResult(revision=revision, config_written=config_written)
        username = admin_user or DEFAULT_ADMIN
        password = admin_password() if callable(admin_password) else admin_password
        if not password or len(password) < 8:
            raise InitError("the admin password must be at least 8 characters")
        password_hash = await PasswordHasher(settings.password_cost).hash(password)
        now = clock()
        try:
            async with db.transaction() as tx:
                user = await user_q.create_user(
                    tx,
                    username=username,
                    password_hash=password_hash,
                    role=Role.ADMIN.value,
                    now=now,
                )
                await audit.record(
                    tx,
                    at=now,
                    actor=SYSTEM_ACTOR,
                    action=AuditAction.USER_CREATED,
                    target_type="user",
                    target_id=username,
                    detail={"role": "admin"},
                )
                created = await issue_api_token(
                    tx, user, name="init", actor=SYSTEM_ACTOR, expires_in=None, now=now
                )
        except ConflictError as e:
            raise InitError(f"user {username!r} already exists") from e
        return InitResult(
            revision=revision,
            config_written=config_written,
            admin=username,
            api_token=created.token,
        )
    finally:
        await db.dispose()
