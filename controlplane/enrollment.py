"""The enrollment decision (DESIGN 4.1), pure: no I/O, no clock of its own.

:func:`plan` takes what is known about the public key (its device row, if any), the token's
state, the server policy and whether the device asked to force a re-enrollment, and says what
to do. :class:`controlplane.enrollment_service.EnrollmentService` gathers the inputs inside one
transaction and carries the plan out.

Device life cycle::

    (token, auto)  ─────────────────────────────┐
    (token, manual) ──► pending ──approve──► accepted ──revoke──► revoked
                           └──reject──► rejected
    preauthorize ──► preauthorized ──(device enrolls)──► accepted
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime

from mcp_edge.shared.signing import key_id


class DeviceStatus(str, enum.Enum):
    PREAUTHORIZED = "preauthorized"
    PENDING = "pending"
    ACCEPTED = "accepted"
    REJECTED = "rejected"
    REVOKED = "revoked"


class Approval(str, enum.Enum):
    """What an enrollment token does with the devices it admits."""

    AUTO = "auto"
    MANUAL = "manual"


class Refusal(str, enum.Enum):
    """Why an enrollment is refused; each has its own message for the device owner."""

    TOKEN_UNKNOWN = "token_unknown"
    TOKEN_REVOKED = "token_revoked"
    TOKEN_EXPIRED = "token_expired"
    TOKEN_USED_UP = "token_used_up"
    DEVICE_REJECTED = "device_rejected"
    DEVICE_REVOKED = "device_revoked"

    @property
    def message(self) -> str:
        return _REFUSAL_MESSAGES[self]


_REFUSAL_MESSAGES = {
    Refusal.TOKEN_UNKNOWN: "enrollment token not recognised",
    Refusal.TOKEN_REVOKED: "enrollment token has been revoked",
    Refusal.TOKEN_EXPIRED: "enrollment token has expired",
    Refusal.TOKEN_USED_UP: "enrollment token has no uses left",
    Refusal.DEVICE_REJECTED: "an operator rejected this device's enrollment",
    Refusal.DEVICE_REVOKED: "this device has been revoked; it cannot enroll again with this key",
}


class Action(str, enum.Enum):
    """What the enrollment service does."""

    CREATE = "create"  # new device from a token (accepted or pending per ``status``)
    ACCEPT_PREAUTHORIZED = "accept_preauthorized"
    UNCHANGED = "unchanged"  # known device, no force: answer with its current state
    REENROLL = "reenroll"  # known accepted device, forced: refresh facts, new credentials
    REFUSE = "refuse"


@dataclass(frozen=True)
class TokenFacts:
    """What :func:`plan` needs to know about an enrollment token."""

    approval: Approval
    uses: int
    max_uses: int | None
    expires_at: datetime | None
    revoked_at: datetime | None


@dataclass(frozen=True)
class Plan:
    action: Action
    status: DeviceStatus | None = None
    refusal: Refusal | None = None


def token_refusal(token: TokenFacts | None, now: datetime) -> Refusal | None:
    """Why ``token`` cannot admit a device at ``now``, or None when it can."""
    if token is None:
        return Refusal.TOKEN_UNKNOWN
    if token.revoked_at is not None:
        return Refusal.TOKEN_REVOKED
    if token.expires_at is not None and token.expires_at <= now:
        return Refusal.TOKEN_EXPIRED
    if token.max_uses is not None and token.uses >= token.max_uses:
        return Refusal.TOKEN_USED_UP
    return None


def plan(
    *,
    existing: DeviceStatus | None,
    token: TokenFacts | None,
    manual_policy: bool,
    force: bool,
    now: datetime,
) -> Plan:
    """Decide an enrollment.

    A key the control plane already knows decides by its device's status, and needs no valid
    token (the signature already proves the device holds the key): accepted → unchanged (or a
    forced re-enroll), pending → still pending, preauthorized → accepted, rejected/revoked →
    refused. An unknown key needs a usable token; it becomes pending when the token says
    ``manual`` or the server policy is manual, accepted otherwise.
    """
    if existing is DeviceStatus.REVOKED:
        return Plan(Action.REFUSE, refusal=Refusal.DEVICE_REVOKED)
    if existing is DeviceStatus.REJECTED:
        return Plan(Action.REFUSE, refusal=Refusal.DEVICE_REJECTED)
    if existing is DeviceStatus.PREAUTHORIZED:
        return Plan(Action.ACCEPT_PREAUTHORIZED, status=DeviceStatus.ACCEPTED)
    if existing is DeviceStatus.ACCEPTED:
        return Plan(Action.REENROLL if force else Action.UNCHANGED, status=existing)
    if existing is DeviceStatus.PENDING:
        return Plan(Action.UNCHANGED, status=existing)
    refusal = token_refusal(token, now)
    if refusal is not None:
        return Plan(Action.REFUSE, refusal=refusal)
    assert token is not None
    manual = manual_policy or token.approval is Approval.MANUAL
    return Plan(Action.CREATE, status=DeviceStatus.PENDING if manual else DeviceStatus.ACCEPTED)


def default_device_id(public_key_hex: str) -> str:
    """The id a device gets when it does not ask for one: ``dev-`` + 16 hex of its key id,
    stable for a key and never chosen by anyone."""
    return "dev-" + key_id(bytes.fromhex(public_key_hex))[:16]


def merge_labels(
    device_labels: Mapping[str, str], operator_labels: Mapping[str, str]
) -> dict[str, str]:
    """The device's own labels with the operator's (token or preauthorization) on top: a device
    cannot override the scope an operator gave it."""
    return {**device_labels, **operator_labels}
