"""Base model and constrained field types every protocol message uses."""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints

from shared.protocol.topics import validate_id

Identifier = Annotated[str, AfterValidator(lambda v: validate_id(v, "identifier"))]
"""A device id, model name or client id: safe to embed in a topic (see topics.validate_id)."""

HexKey = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
"""A 32-byte key or key id as 64 lowercase hex characters."""

Nonce = Annotated[str, StringConstraints(pattern=r"^(?:[0-9a-f]{2}){16,64}$")]
"""16 to 64 random bytes as lowercase hex."""

Sha256Hex = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]

VersionText = Annotated[str, StringConstraints(min_length=5, max_length=128)]
"""A semver string; parse with shared.version.SemVer where order matters."""

ShortText = Annotated[str, StringConstraints(max_length=2048)]
"""Human-readable text such as an error message (capped)."""

_LABEL_KEY = re.compile(r"[a-z0-9]([a-z0-9._/-]{0,62})")
MAX_LABELS = 32


def _check_labels(labels: dict[str, str]) -> dict[str, str]:
    if len(labels) > MAX_LABELS:
        raise ValueError(f"at most {MAX_LABELS} labels")
    for k, v in labels.items():
        if _LABEL_KEY.fullmatch(k) is None:
            raise ValueError(
                f"label key {k!r:.70} must be 1-63 chars of a-z 0-9 . _ / -, starting with a-z 0-9"
            )
        if len(v) > 128 or not v.isprintable():
            raise ValueError(f"label {k!r} value must be at most 128 printable characters")
    return labels


Labels = Annotated[dict[str, str], AfterValidator(_check_labels)]
"""Free-form ``key=value`` labels used for grouping and rollout targets."""

Facts = Annotated[dict[str, Any], Field(max_length=128)]
"""Hardware and OS facts a device reports (flat JSON values)."""


class Message(BaseModel):
    """Base of every protocol message: strict about unknown fields, immutable once built.

    ``MAX_BYTES`` is the largest encoded payload :func:`shared.protocol.codec.decode` accepts
    for the type; transports may cap lower.
    """

    model_config = ConfigDict(
        extra="forbid", frozen=True, populate_by_name=True, protected_namespaces=()
    )
    MAX_BYTES: ClassVar[int] = 64 * 1024
