"""Base model and constrained field types every protocol message uses."""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, WithJsonSchema

from mcp_edge.shared.protocol.topics import IDENTIFIER_PATTERN, validate_id

IdentifierSchema = WithJsonSchema(
    {"type": "string", "pattern": IDENTIFIER_PATTERN, "minLength": 1, "maxLength": 64}
)
"""The JSON Schema of a string :func:`~shared.protocol.topics.validate_id` accepts; give it to
every type that validates with ``validate_id``, so documents say what the check enforces."""

Identifier = Annotated[
    str, AfterValidator(lambda v: validate_id(v, "identifier")), IdentifierSchema
]
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

LABEL_KEY_PATTERN = r"^[a-z0-9][a-z0-9._/-]{0,62}$"
"""A label key: 1-63 characters of ``a-z 0-9 . _ / -``, starting with a letter or digit."""

MAX_LABEL_VALUE = 128
# Characters a label value may not hold: Unicode 14.0's control (Cc), format (Cf) and
# private-use (Co) characters and its separators (Z*) other than the space, spelled as ranges
# so that one pattern is both the check and what the JSON Schema says. Frozen here rather than
# read from unicodedata, so every Python version agrees with the published document.
_NOT_IN_LABEL_VALUE = (
    r"\x00-\x1f\x7f-\xa0\xad\u0600-\u0605\u061c\u06dd\u070f\u0890\u0891\u08e2\u1680"
    r"\u180e\u2000-\u200f\u2028-\u202f\u205f-\u2064\u2066-\u206f\u3000\ue000-\uf8ff"
    r"\ufeff\ufff9-\ufffb"
    # Outside the BMP the characters themselves: Python's ``re`` and ECMA-262 (the dialect of
    # JSON Schema) share no escape for them.
    "\U000110bd\U000110cd\U00013430-\U00013438\U0001bca0-\U0001bca3\U0001d173-\U0001d17a"
    "\U000e0001\U000e0020-\U000e007f\U000f0000-\U000ffffd\U00100000-\U0010fffd"
)
LABEL_VALUE_PATTERN = f"^[^{_NOT_IN_LABEL_VALUE}]{{0,{MAX_LABEL_VALUE}}}$"
"""A label value: at most 128 printable characters (no control, format, private-use or
separator character other than the space)."""

_LABEL_KEY = re.compile(LABEL_KEY_PATTERN)
_LABEL_VALUE = re.compile(LABEL_VALUE_PATTERN)
_SURROGATE = re.compile("[\ud800-\udfff]")
MAX_LABELS = 32

LabelKey = Annotated[str, StringConstraints(pattern=LABEL_KEY_PATTERN)]


def _check_labels(labels: dict[str, str]) -> dict[str, str]:
    if len(labels) > MAX_LABELS:
        raise ValueError(f"at most {MAX_LABELS} labels")
    for k, v in labels.items():
        if _LABEL_KEY.fullmatch(k) is None:
            raise ValueError(
                f"label key {k!r:.70} must be 1-63 chars of a-z 0-9 . _ / -, starting with a-z 0-9"
            )
        # Lone surrogates cannot travel in JSON (so the schema need not name them), but a
        # command line decoded with surrogateescape can carry them.
        if _LABEL_VALUE.fullmatch(v) is None or _SURROGATE.search(v):
            raise ValueError(f"label {k!r} value must be at most 128 printable characters")
    return labels


LABELS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "maxProperties": MAX_LABELS,
    "propertyNames": {"pattern": LABEL_KEY_PATTERN, "maxLength": 63},
    "additionalProperties": {
        "type": "string",
        "pattern": LABEL_VALUE_PATTERN,
        "maxLength": MAX_LABEL_VALUE,
    },
}
"""The JSON Schema of :data:`Labels`: exactly what its check accepts."""

Labels = Annotated[dict[str, str], AfterValidator(_check_labels), WithJsonSchema(LABELS_SCHEMA)]
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
