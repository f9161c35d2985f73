"""Commands from the control plane to one device, their replies, and the structured error reply
every request/response exchange (commands, MQTT inference, repository requests) falls back to.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import AwareDatetime, Field

from mcp_edge.shared.protocol.base import Message, ShortText
from mcp_edge.shared.protocol.wire import CommandName, ErrorCode

__all__ = ["CommandName", "CommandReply", "CommandRequest", "ErrorCode", "ErrorReply"]


class ErrorReply(Message):
    """A structured error. ``error`` alone is the Open Inference Protocol error body."""

    error: ShortText
    code: ErrorCode = ErrorCode.INTERNAL
    retry_after_s: float | None = Field(default=None, ge=0)
    details: dict[str, Any] | None = None


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
