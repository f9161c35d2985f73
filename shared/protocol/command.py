"""Commands from the control plane to one device, their replies, and the structured error reply
every request/response exchange (commands, MQTT inference, repository requests) falls back to.
"""

from __future__ import annotations

import enum
from typing import Any, ClassVar

from pydantic import AwareDatetime, Field

from shared.protocol.base import Message, ShortText


class ErrorCode(str, enum.Enum):
    """Why a request failed; maps onto HTTP status codes where one is needed."""

    BAD_REQUEST = "bad_request"
    UNAUTHORIZED = "unauthorized"
    FORBIDDEN = "forbidden"
    NOT_FOUND = "not_found"
    CONFLICT = "conflict"
    TOO_LARGE = "too_large"
    UNSUPPORTED = "unsupported"
    OVERLOADED = "overloaded"
    TIMEOUT = "timeout"
    UNAVAILABLE = "unavailable"
    INTERNAL = "internal"

    @property
    def http_status(self) -> int:
        return _HTTP_STATUS[self]


_HTTP_STATUS = {
    ErrorCode.BAD_REQUEST: 400,
    ErrorCode.UNAUTHORIZED: 401,
    ErrorCode.FORBIDDEN: 403,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.CONFLICT: 409,
    ErrorCode.TOO_LARGE: 413,
    ErrorCode.UNSUPPORTED: 415,
    ErrorCode.OVERLOADED: 429,
    ErrorCode.TIMEOUT: 504,
    ErrorCode.UNAVAILABLE: 503,
    ErrorCode.INTERNAL: 500,
}


class ErrorReply(Message):
    """A structured error. ``error`` alone is the Open Inference Protocol error body."""

    error: ShortText
    code: ErrorCode = ErrorCode.INTERNAL
    retry_after_s: float | None = Field(default=None, ge=0)
    details: dict[str, Any] | None = None


class CommandName(str, enum.Enum):
    PING = "ping"
    RELOAD = "reload"
    COLLECT_LOGS = "collect_logs"
    UPLOAD_HARD_EXAMPLES = "upload_hard_examples"
    REPORT_STATE = "report_state"


class CommandRequest(Message):
    command_id: str = Field(pattern=r"^[0-9a-f]{32}$")
    name: CommandName
    args: dict[str, Any] = Field(default_factory=dict, max_length=32)
    issued_at: AwareDatetime
    expires: AwareDatetime


class CommandReply(Message):
    MAX_BYTES: ClassVar[int] = 1024 * 1024

    command_id: str = Field(pattern=r"^[0-9a-f]{32}$")
    ok: bool
    result: dict[str, Any] = Field(default_factory=dict)
    error: ErrorReply | None = None
