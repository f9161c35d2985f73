"""Request and response bodies of the REST API (pydantic v2).

One schema serves three purposes: request validation (``extra="forbid"``: a typo in a field
name is an error, not a silent no-op), the JSON answer, and the OpenAPI document
(:mod:`controlplane.openapi`). Times are RFC 3339 UTC strings.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    WithJsonSchema,
)

from mcp_edge.controlplane.auth import Role
from mcp_edge.controlplane.enrollment import Approval, DeviceStatus
from mcp_edge.shared.errors import KeyFileError
from mcp_edge.shared.protocol.base import (
    LABEL_KEY_PATTERN,
    LABEL_VALUE_PATTERN,
    HexKey,
    Identifier,
    LabelKey,
    Labels,
)
from mcp_edge.shared.protocol.command import ErrorCode
from mcp_edge.shared.protocol.enrollment import EnrollmentRequest
from mcp_edge.shared.protocol.repo import MAX_PATH_LENGTH, REPO_SEGMENT_PATTERN
from mcp_edge.shared.signing import check_public_key
from mcp_edge.shared.version import MAX_VERSION_LENGTH, SEMVER_PATTERN

Username = Annotated[str, StringConstraints(pattern=r"^[a-z0-9][a-z0-9._-]{0,63}$")]
Password = Annotated[str, StringConstraints(min_length=8, max_length=1024)]
Name = Annotated[str, StringConstraints(min_length=1, max_length=64)]
PublisherName = Annotated[
    str,
    StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9 ._@-]{0,63}$"),
    Field(description="1-64 of A-Z a-z 0-9 space . _ @ -, starting with a letter or digit"),
]


def _usable_public_key(value: str) -> str:
    try:
        check_public_key(bytes.fromhex(value))
    except KeyFileError as e:
        raise ValueError(str(e)) from e
    return value


PublicKeyHex = Annotated[
    HexKey,
    AfterValidator(_usable_public_key),
    Field(
        description="an Ed25519 public key, 64 lowercase hex characters; small-order and "
        "non-canonical encodings are refused"
    ),
]
MAX_EXPIRY_S = 10 * 365 * 24 * 3600
ExpiresIn = Annotated[int, Field(ge=60, le=MAX_EXPIRY_S, description="seconds from now")]
MAX_ROW_ID = 2**63 - 1
"""The largest row id (a signed 64-bit integer in every database we run on)."""
RowId = Annotated[int, Field(ge=1, le=MAX_ROW_ID)]
MAX_PATH_ID_DIGITS = 18
PathId = Annotated[int, Field(ge=0, le=10**MAX_PATH_ID_DIGITS - 1)]
"""A numeric id in a path (:func:`controlplane.api.common.path_int`: at most 18 digits)."""

CONNECTION_STATES = {"online": True, "offline": False}
"""Status filters that select accepted devices by their broker connection."""
STATUS_FILTERS = (*(s.value for s in DeviceStatus), *CONNECTION_STATES)

# ``key`` (has the label) or ``key=value`` (exactly), with the key and value rules of labels.
LABEL_FILTER_PATTERN = f"^{LABEL_KEY_PATTERN[1:-1]}(?:={LABEL_VALUE_PATTERN[1:-1]})?$"
_LABEL_FILTER = re.compile(LABEL_FILTER_PATTERN)


def _check_label_filter(item: str) -> str:
    if _LABEL_FILTER.fullmatch(item) is None:
        raise ValueError(
            f"label filter {item!r:.80} must be key or key=value, with a label key "
            "(1-63 chars of a-z 0-9 . _ / -, starting with a-z 0-9) and a printable value"
        )
    return item


LabelFilter = Annotated[
    str,
    AfterValidator(_check_label_filter),
    WithJsonSchema({"type": "string", "pattern": LABEL_FILTER_PATTERN, "maxLength": 192}),
]
StatusFilter = Annotated[str, WithJsonSchema({"type": "string", "enum": list(STATUS_FILTERS)})]


class Request(BaseModel):
    """Base of request bodies: unknown fields are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Response(BaseModel):
    """Base of response bodies: built from rows (attributes) or dicts."""

    model_config = ConfigDict(from_attributes=True, populate_by_name=True)


class ErrorBody(Response):
    """Every error answer."""

    error: str = Field(description="what went wrong, for a human")
    code: ErrorCode = Field(description="machine-readable cause; maps onto the HTTP status")


# ---------------------------------------------------------------------------- users and login
class UserCreate(Request):
    username: Username
    password: Password
    role: Role = Role.VIEWER


class UserUpdate(Request):
    role: Role | None = None
    disabled: bool | None = None
    password: Password | None = None


class UserOut(Response):
    username: str
    role: Role
    disabled: bool
    created_at: datetime
    updated_at: datetime


class UserList(Response):
    items: list[UserOut]


class LoginRequest(Request):
    """Trade a username and password for an API token."""

    username: Username
    password: Annotated[str, StringConstraints(max_length=1024)]
    token_name: Name = "cli"
    expires_in_s: ExpiresIn | None = 30 * 24 * 3600


class ApiTokenOut(Response):
    id: int
    name: str
    username: str
    prefix: str
    created_at: datetime
    expires_at: datetime | None
    last_used_at: datetime | None
    revoked_at: datetime | None


class ApiTokenCreated(ApiTokenOut):
    token: str = Field(description="the bearer token; shown once, never stored in clear")


class ApiTokenList(Response):
    items: list[ApiTokenOut]


class WhoAmI(Response):
    username: str
    role: Role
    token_id: int


# ---------------------------------------------------------------------------- enrollment tokens
class EnrollmentTokenCreate(Request):
    group: Identifier | None = None
    labels: Labels = Field(default_factory=dict)
    max_uses: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    expires_in_s: ExpiresIn | None = 7 * 24 * 3600
    approval: Approval = Approval.AUTO
    description: Annotated[str, StringConstraints(max_length=256)] = ""


class EnrollmentTokenOut(Response):
    id: int
    prefix: str
    description: str
    group: str | None = Field(validation_alias="group_name")
    labels: dict[str, str]
    approval: Approval
    max_uses: int | None
    uses: int
    created_at: datetime
    created_by: str
    expires_at: datetime | None
    revoked_at: datetime | None
    state: str = Field(description="active, expired, used_up or revoked (at answer time)")


class EnrollmentTokenCreated(EnrollmentTokenOut):
    token: str = Field(description="give this to `mcp-agent enroll --token`; shown once")


class EnrollmentTokenList(Response):
    items: list[EnrollmentTokenOut]


# ---------------------------------------------------------------------------- devices
class DeviceOut(Response):
    id: str
    status: DeviceStatus
    profile: str | None
    group: str | None = Field(validation_alias="group_name")
    labels: dict[str, str]
    public_key: str
    agent_version: str
    online: bool
    last_seen_at: datetime | None
    created_at: datetime
    updated_at: datetime
    accepted_at: datetime | None
    revoked_at: datetime | None
    enrollment_token_id: int | None


class DeviceDetail(DeviceOut):
    facts: dict[str, Any]


class ModelSyncOut(Response):
    """One model of a device: what it was told to run against what it reports."""

    model: str
    desired_version: str | None = Field(
        description="the stable version the device was told to run; null: it was not told to "
        "run this model, yet reports it"
    )
    canary_version: str | None = Field(description="the canary it was told to run beside it")
    reported_version: str | None = Field(description="the active version it last reported")
    phase: str | None = Field(description="the deployment phase it last reported")
    variant: str | None = Field(
        max_length=64,
        description="the bundle variant its active version runs (default, int8, a profile's "
        "tag); null: not reported",
    )
    backend: str | None = Field(
        max_length=128,
        description="backend/provider its active version runs on (openvino/CPU, "
        "onnxruntime/CPUExecutionProvider); null: not reported",
    )
    in_sync: bool = Field(
        description="the device applied its newest desired state and reports the desired "
        "stable version active"
    )


class SyncState(Response):
    models: list[ModelSyncOut] = Field(description="desired models by name, then reported ones")
    in_sync: bool = Field(description="every model in sync (true for a device without models)")


class DeviceListItem(DeviceOut, SyncState):
    """A device in a list, with its models."""


class DeviceDocument(DeviceDetail, SyncState):
    """A device with its facts and its models."""


class DeviceList(Response):
    items: list[DeviceListItem]
    total: int = Field(description="devices matching the filters, over all pages")
    limit: int
    offset: int


class DeviceQuery(Request):
    """Query parameters of ``GET /api/v1/devices``; repeated ``label`` parameters are ANDed."""

    label: list[LabelFilter] = Field(
        default_factory=list, description="key=value (exact) or key (has the label)"
    )
    profile: Identifier | None = None
    status: list[StatusFilter] = Field(
        default_factory=list,
        description="preauthorized, pending, accepted, rejected, revoked, online or offline",
    )
    group: Identifier | None = None
    q: Annotated[str, StringConstraints(max_length=64)] | None = Field(
        default=None, description="substring of the device id"
    )
    model: Identifier | None = Field(
        default=None, description="devices told to run this model, or reporting it"
    )
    in_sync: bool | None = Field(
        default=None,
        description="true: devices whose every model is in sync; false: those with one that is not",
    )
    limit: Annotated[int, Field(ge=1, le=1000)] = 100
    offset: Annotated[int, Field(ge=0, le=MAX_ROW_ID)] = 0


MAX_INFERENCE_WINDOW_S = 7 * 24 * 3600


class InferenceQuery(Request):
    """Query parameters of ``GET /api/v1/devices/{device_id}/inference``."""

    window_s: Annotated[int, Field(ge=60, le=MAX_INFERENCE_WINDOW_S)] = Field(
        default=3600, description="how far back from now, in seconds"
    )


class VersionFiguresOut(Response):
    """One model version in one role on one device, summed over the window."""

    model: str
    version: str
    role: str = Field(description="stable, canary or shadow")
    requests: int
    errors: int
    error_rate: float | None = Field(description="errors / requests; null without requests")
    p95_ms: float | None = Field(description="95th-percentile latency of successful requests")


class DeviceInference(Response):
    device_id: str
    since: datetime
    items: list[VersionFiguresOut]


class LabelsPatch(Request):
    """Set some labels and remove others in one change (a key is not both set and removed)."""

    set: Labels = Field(default_factory=dict)
    remove: list[LabelKey] = Field(default_factory=list, max_length=32)


class PreauthorizeRequest(Request):
    public_key: PublicKeyHex
    device_id: Identifier | None = None
    group: Identifier | None = None
    labels: Labels = Field(default_factory=dict)


class ReasonBody(Request):
    reason: Annotated[str, StringConstraints(max_length=256)] = ""


class ApprovalList(Response):
    items: list[DeviceOut]


# ---------------------------------------------------------------------------- enrollment
class SignatureOut(BaseModel):
    # shared.signing refuses an envelope or signature with any other key (documented here).
    model_config = ConfigDict(extra="forbid")

    keyid: HexKey
    sig: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{128}$")]


class SignedEnrollment(BaseModel):
    """What ``POST /api/v1/enroll`` takes: an enrollment request signed by the device key it
    names (``shared.protocol.enrollment.sign_enrollment``), an Ed25519 key, with a timestamp
    near the server's clock."""

    model_config = ConfigDict(extra="forbid")

    signed: EnrollmentRequest
    signatures: list[SignatureOut] = Field(min_length=1, max_length=4)


# ---------------------------------------------------------------------------- audit
class AuditQuery(Request):
    limit: Annotated[int, Field(ge=1, le=1000)] = 100
    before_id: RowId | None = None
    action: Annotated[str, StringConstraints(max_length=64)] | None = None
    target_type: Annotated[str, StringConstraints(max_length=32)] | None = None
    target_id: Annotated[str, StringConstraints(max_length=128)] | None = None


class AuditEntryOut(Response):
    id: int
    at: datetime
    actor: str
    action: str
    target_type: str
    target_id: str
    detail: dict[str, Any]


class AuditList(Response):
    items: list[AuditEntryOut]


# ---------------------------------------------------------------------------- health
class Health(Response):
    status: str
    version: str
    database: str | None = None
    schema_revision: str | None = None


# ---------------------------------------------------------------------------- path parameters
_REPO_TARGET_PATTERN = f"^{REPO_SEGMENT_PATTERN}(?:/{REPO_SEGMENT_PATTERN}){{0,7}}$"
PATH_PARAMETERS: dict[str, Any] = {
    "device_id": Identifier,
    "client_id": Identifier,
    "model": Identifier,
    "name": Identifier,
    "version": Annotated[
        str,
        WithJsonSchema(
            {"type": "string", "pattern": SEMVER_PATTERN, "maxLength": MAX_VERSION_LENGTH}
        ),
    ],
    "username": Username,
    "keyid": HexKey,
    "token_id": PathId,
    "rollout_id": PathId,
    "trigger_id": PathId,
    "file": Annotated[
        str, WithJsonSchema({"type": "string", "pattern": f"^{REPO_SEGMENT_PATTERN}$"})
    ],
    "path": Annotated[
        str,
        WithJsonSchema(
            {
                "type": "string",
                "pattern": _REPO_TARGET_PATTERN,
                "maxLength": MAX_PATH_LENGTH - len("targets/"),
            }
        ),
    ],
}
"""The type of every path parameter, by name, as the OpenAPI document gives it. Ids are
validated when their objects are made, so one that breaks its pattern names nothing: the
answer is 404, like any other unknown id (a repository file's path that breaks it: 400)."""
