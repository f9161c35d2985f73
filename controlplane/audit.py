"""The audit log: every change made through the API, written in the change's own transaction
(so an entry exists exactly when its change committed).

Actors are ``user:<name>`` for operators, ``device:<id>`` for enrollment, and ``system`` for
``mcp-controlplane init``. Details never hold secrets (tokens, passwords): only ids and
prefixes.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from mcp_edge.controlplane.db import Tx
from mcp_edge.controlplane.db import audit as audit_queries

SYSTEM_ACTOR = "system"


class AuditAction(str, enum.Enum):
    USER_CREATED = "user.created"
    USER_UPDATED = "user.updated"
    API_TOKEN_CREATED = "api_token.created"
    API_TOKEN_REVOKED = "api_token.revoked"
    ENROLLMENT_TOKEN_CREATED = "enrollment_token.created"
    ENROLLMENT_TOKEN_REVOKED = "enrollment_token.revoked"
    DEVICE_ENROLLED = "device.enrolled"
    DEVICE_REENROLLED = "device.reenrolled"
    DEVICE_PREAUTHORIZED = "device.preauthorized"
    DEVICE_APPROVED = "device.approved"
    DEVICE_REJECTED = "device.rejected"
    DEVICE_LABELS_CHANGED = "device.labels_changed"
    DEVICE_REVOKED = "device.revoked"


def device_actor(device_id: str) -> str:
    return f"device:{device_id}"


async def record(
    tx: Tx,
    *,
    at: datetime,
    actor: str,
    action: AuditAction,
    target_type: str,
    target_id: str | int,
    detail: Mapping[str, Any] | None = None,
) -> None:
    """Add one entry to the transaction ``tx`` (committed or rolled back with it)."""
    await audit_queries.insert_entry(
        tx,
        at=at,
        actor=actor,
        action=action.value,
        target_type=target_type,
        target_id=str(target_id),
        detail=detail,
    )
