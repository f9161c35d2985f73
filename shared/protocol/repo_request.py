"""The repository request's schema (:mod:`shared.protocol.repo` describes the protocol).

A module of its own because it is a pydantic model: the control plane validates each request
with it, while a device writes requests as plain JSON and keeps :mod:`shared.protocol.repo`
free of pydantic.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field, field_validator

from mcp_edge.shared.errors import MessageError
from mcp_edge.shared.protocol.base import Message
from mcp_edge.shared.protocol.repo import MAX_CHUNK_BYTES, MAX_PATH_LENGTH, validate_repo_path

__all__ = ["RepoRequest"]


class RepoRequest(Message):
    """One chunk of one repository file."""

    MAX_BYTES: ClassVar[int] = 2048

    path: str = Field(min_length=1, max_length=MAX_PATH_LENGTH)
    offset: int = Field(default=0, ge=0, le=2**53)
    length: int = Field(default=MAX_CHUNK_BYTES, ge=1, le=MAX_CHUNK_BYTES)

    @field_validator("path")
    @classmethod
    def _safe_path(cls, value: str) -> str:
        try:
            return validate_repo_path(value)
        except MessageError as e:
            raise ValueError(str(e)) from e
