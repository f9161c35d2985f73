"""Enrollment: a device proves it holds its key and asks to join (DESIGN 4.1).

The request travels as a signed envelope (``shared.signing``) whose signature is made with the
device key named inside it, so the control plane learns the public key and a proof of
possession at once. The nonce makes each request unique; the control plane keeps the nonces it
has seen until the request's timestamp falls out of :data:`MAX_CLOCK_SKEW_S`, so a captured
request cannot be replayed.
"""

from __future__ import annotations

import secrets
from datetime import datetime, timedelta
from typing import Any, ClassVar

from pydantic import AwareDatetime, Field

from mcp_edge.shared.errors import ExpiredError, MessageError, SigningError, WrongKeyError
from mcp_edge.shared.protocol.base import (
    Facts,
    HexKey,
    Identifier,
    Labels,
    Message,
    Nonce,
    ShortText,
)
from mcp_edge.shared.protocol.wire import EnrollmentStatus
from mcp_edge.shared.signing import PrivateKey, PublicKey, sign_document, verify_document

__all__ = [
    "MAX_CLOCK_SKEW_S", "BrokerCredentials", "EnrollmentAnswer", "EnrollmentRequest",
    "EnrollmentStatus", "TrustRoot", "new_nonce", "nonce_retention", "sign_enrollment",
    "verify_enrollment",
]  # fmt: skip

MAX_CLOCK_SKEW_S = 300.0


class EnrollmentRequest(Message):
    """What ``mcp-agent enroll`` sends, signed by the device key."""

    MAX_BYTES: ClassVar[int] = 32 * 1024

    device_id: Identifier | None = None
    public_key: HexKey
    token: str = Field(min_length=8, max_length=256)
    nonce: Nonce
    timestamp: AwareDatetime
    profile: Identifier
    labels: Labels = Field(default_factory=dict)
    facts: Facts = Field(default_factory=dict)
    agent_version: str = Field(default="", max_length=64)


class BrokerCredentials(Message):
    """Per-device MQTT credentials; the client id is bound to the username at the broker."""

    urls: list[str] = Field(min_length=1, max_length=8)
    username: str = Field(min_length=1, max_length=128)
    password: str = Field(min_length=1, max_length=256)
    client_id: Identifier


class TrustRoot(Message):
    """What the device trusts from now on: TUF root metadata and signing keys (hex)."""

    tuf_root: dict[str, Any] | None = None
    director_keys: list[HexKey] = Field(default_factory=list, max_length=16)
    publisher_keys: list[HexKey] = Field(default_factory=list, max_length=64)


class EnrollmentAnswer(Message):
    """The control plane's answer. ``broker`` and ``trust`` are absent while pending."""

    MAX_BYTES: ClassVar[int] = 256 * 1024

    status: EnrollmentStatus
    device_id: Identifier
    topic_prefix: str = "mcp/v1"
    broker: BrokerCredentials | None = None
    trust: TrustRoot | None = None
    message: ShortText = ""
    poll_after_s: float | None = Field(default=None, ge=0)


def new_nonce() -> str:
    """A fresh 16-byte random nonce as hex."""
    return secrets.token_hex(16)


def sign_enrollment(request: EnrollmentRequest, key: PrivateKey) -> dict[str, Any]:
    """Envelope of ``request`` signed by the device key it names.

    Raises :class:`WrongKeyError` if ``key`` is not the key in ``request.public_key``.
    """
    if key.public_key.raw.hex() != request.public_key:
        raise WrongKeyError("the enrollment request must be signed by the device key it carries")
    return sign_document(request.model_dump(mode="json"), key)


def verify_enrollment(envelope: object, *, now: datetime) -> EnrollmentRequest:
    """Check a signed enrollment envelope and return the request inside.

    Checks, in order: envelope shape, schema, the signature by the embedded public key, and a
    timestamp within :data:`MAX_CLOCK_SKEW_S` of ``now``. Nonce freshness is the caller's
    (it needs storage). Raises :class:`MessageError`, :class:`SigningError` subclasses, or
    :class:`ExpiredError`.
    """
    if not isinstance(envelope, dict) or not isinstance(envelope.get("signed"), dict):
        raise MessageError(
            'enrollment must be a signed envelope {"signed": ..., "signatures": [...]}'
        )
    try:
        request = EnrollmentRequest.model_validate(envelope["signed"])
    except ValueError as e:
        raise MessageError(f"enrollment request: {_first_error(e)}") from e
    try:
        key = PublicKey.from_hex(request.public_key)
    except SigningError as e:
        raise MessageError(f"enrollment request: public_key: {e}") from e
    verify_document(envelope, [key])
    skew = abs((now - request.timestamp).total_seconds())
    if skew > MAX_CLOCK_SKEW_S:
        raise ExpiredError(
            f"enrollment timestamp is {skew:.0f} s from the server clock "
            f"(limit {MAX_CLOCK_SKEW_S:.0f} s); check the device clock"
        )
    return request


def nonce_retention() -> timedelta:
    """How long a server must remember a nonce to refuse every replay."""
    return timedelta(seconds=2 * MAX_CLOCK_SKEW_S)


def _first_error(e: ValueError) -> str:
    errors = getattr(e, "errors", None)
    if callable(errors):
        first = errors()[0]
        loc = ".".join(str(p) for p in first.get("loc", ())) or "body"
        return f"{loc}: {first.get('msg', 'invalid')}"
    return str(e).splitlines()[0]
