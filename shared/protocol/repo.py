"""Repository transport: TUF metadata and target bytes over MQTT request/response (DESIGN 4.4).

A device asks on its own ``mcp/v1/dev/{device}/repo`` topic, with the MQTT 5 response topic
``mcp/v1/dev/{device}/repo/reply`` and a fresh correlation data per request. The request
payload is a small JSON object (:class:`~shared.protocol.repo_request.RepoRequest`, the
schema the control plane validates it with; the device writes it with orjson)::

    {"path": "metadata/3.snapshot.json", "offset": 0, "length": 131072}

``path`` is relative to the repository root: ``metadata/<file>`` (what ngclient asks for under
its metadata base URL) or ``targets/<dir>/<hash>.<name>`` (consistent-snapshot target names).

The reply carries the bytes themselves as the payload (no JSON, no base64: a chunk is copied
once) and says what they are in MQTT 5 user properties (:class:`RepoReply`)::

    status   ok | not_found | bad_request | error
    size     the whole file's length in bytes (status ok)
    offset   the offset the payload starts at (status ok)
    error    a reason (any other status)

A request for an offset at or past the end answers ``ok`` with an empty payload and the size,
so a reader learns the length without a special request. ``not_found`` is explicit: the
device's TUF fetcher raises it as HTTP 404, which ngclient relies on while probing for newer
root versions.

Nothing here imports pydantic: an agent holds its repository transport from the start and
loads the message models only when something needs them (docs/agent.md "Memory").
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable
from dataclasses import dataclass

from mcp_edge.shared.errors import MessageError

MAX_CHUNK_BYTES = 128 * 1024
"""The most bytes one reply carries."""

MAX_PATH_LENGTH = 512
REPO_SEGMENT_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._+-]{0,127}"
"""One segment of a repository path (unanchored): never ``..``, never a hidden file."""
_PATH = re.compile(rf"(?:metadata|targets)(?:/{REPO_SEGMENT_PATTERN}){{1,8}}")


def validate_repo_path(path: str) -> str:
    """Return ``path`` when it is a safe repository path; raise MessageError otherwise.

    Safe: ``metadata/...`` or ``targets/...``, segments of ``[A-Za-z0-9._+-]`` that start with a
    letter or digit (so never ``..``, never absolute, never a hidden file), at most 8 deep.
    """
    if not isinstance(path, str) or len(path) > MAX_PATH_LENGTH or not _PATH.fullmatch(path):
        raise MessageError(
            f"repository path {str(path)[:80]!r} is not metadata/<file> or targets/<path> "
            "made of [A-Za-z0-9._+-] segments"
        )
    return path


class RepoStatus(str, enum.Enum):
    OK = "ok"
    NOT_FOUND = "not_found"
    BAD_REQUEST = "bad_request"
    ERROR = "error"


@dataclass(frozen=True)
class RepoReply:
    """What a reply's user properties say about its payload."""

    status: RepoStatus
    size: int | None = None
    offset: int | None = None
    error: str = ""

    def user_properties(self) -> list[tuple[str, str]]:
        props = [("status", self.status.value)]
        if self.size is not None:
            props.append(("size", str(self.size)))
        if self.offset is not None:
            props.append(("offset", str(self.offset)))
        if self.error:
            props.append(("error", self.error[:512]))
        return props

    @classmethod
    def from_user_properties(cls, props: Iterable[tuple[str, str]]) -> RepoReply:
        """Parse a reply's user properties; raises MessageError when they make no sense."""
        values: dict[str, str] = {}
        for key, value in props:
            values.setdefault(key.lower(), value)
        try:
            status = RepoStatus(values.get("status", ""))
        except ValueError:
            raise MessageError(f"repository reply status {values.get('status')!r:.40}") from None
        if status is not RepoStatus.OK:
            return cls(status, error=values.get("error", "")[:512])
        try:
            size = int(values["size"])
            offset = int(values["offset"])
        except (KeyError, ValueError):
            raise MessageError("repository reply without a numeric size and offset") from None
        if size < 0 or offset < 0:
            raise MessageError("repository reply with a negative size or offset")
        return cls(status, size=size, offset=offset)
