"""What an enrolled agent keeps in its state directory, written atomically and privately.

    {state_dir}/identity/device.key    Ed25519 device key (0600; never leaves the device)
    {state_dir}/enrollment.json        the control plane's answer + its URL (0600: it holds
                                       the broker password)

``mcp-agent enroll`` writes them, ``mcp-agent run`` reads them. The enrollment is written from
the control plane's :class:`~shared.protocol.enrollment.EnrollmentAnswer` and read back as the
plain :class:`StoredAnswer`, each field ``run`` uses checked here: reading it at every start
loads no pydantic (docs/agent.md "Memory").
"""

from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mcp_edge.shared.errors import McpError, TopicError
from mcp_edge.shared.fsutil import atomic_write_bytes
from mcp_edge.shared.protocol.topics import validate_id
from mcp_edge.shared.protocol.wire import EnrollmentStatus
from mcp_edge.shared.signing import PrivateKey, read_private_key, write_private_key

if TYPE_CHECKING:
    from mcp_edge.shared.protocol.enrollment import EnrollmentAnswer

MAX_ENROLLMENT_BYTES = 512 * 1024
_HEX_KEY = re.compile(r"[0-9a-f]{64}")


class IdentityError(McpError):
    """The state directory holds no usable identity or enrollment."""


@dataclass(frozen=True)
class BrokerAccess:
    """The device's MQTT credentials (``EnrollmentAnswer.broker``)."""

    urls: tuple[str, ...]
    username: str
    password: str
    client_id: str


@dataclass(frozen=True)
class StoredTrust:
    """What the device trusts (``EnrollmentAnswer.trust``): keys as 64 hex characters."""

    tuf_root: dict[str, Any] | None
    director_keys: tuple[str, ...]
    publisher_keys: tuple[str, ...]


@dataclass(frozen=True)
class StoredAnswer:
    """The stored enrollment answer: the fields ``mcp-agent run`` and ``enroll`` read."""

    status: EnrollmentStatus
    device_id: str
    broker: BrokerAccess | None
    trust: StoredTrust | None


@dataclass(frozen=True)
class Enrollment:
    server: str
    answer: StoredAnswer


def key_path(state_dir: Path) -> Path:
    return state_dir / "identity" / "device.key"


def enrollment_path(state_dir: Path) -> Path:
    return state_dir / "enrollment.json"


def load_or_create_device_key(state_dir: Path) -> PrivateKey:
    """The device key, generated (0600, in a 0700 directory) on first use."""
    path = key_path(state_dir)
    if path.exists():
        return read_private_key(path)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path.parent, 0o700)
    key = PrivateKey.generate()
    write_private_key(path, key)
    return key


def save_enrollment(state_dir: Path, server: str, answer: EnrollmentAnswer) -> Path:
    """Store the answer atomically with mode 0600; returns the path."""
    state_dir.mkdir(parents=True, exist_ok=True)
    doc = {"server": server, "answer": answer.model_dump(mode="json", exclude_none=True)}
    path = enrollment_path(state_dir)
    atomic_write_bytes(path, json.dumps(doc, indent=2).encode() + b"\n", mode=0o600)
    return path


def load_enrollment(state_dir: Path) -> Enrollment | None:
    """The stored enrollment, or None when this device has not enrolled.

    Raises :class:`IdentityError` for a file that is unreadable, too open or malformed.
    """
    path = enrollment_path(state_dir)
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise IdentityError(f"{path}: readable by others; it holds broker credentials (chmod 600)")
    if st.st_size > MAX_ENROLLMENT_BYTES:
        raise IdentityError(f"{path}: {st.st_size} bytes is too large")
    try:
        doc = json.loads(path.read_bytes())
        if not isinstance(doc, dict):
            raise ValueError("not a JSON object")
        server = _text(doc, "server", 1, 2048)
        answer = _answer(_object(doc, "answer"))
    except (ValueError, TopicError) as e:
        raise IdentityError(f"{path}: not a valid enrollment record ({e})") from e
    return Enrollment(server, answer)


def _answer(doc: dict[str, Any]) -> StoredAnswer:
    """Check the fields of a stored ``EnrollmentAnswer`` the agent uses (ValueError, TopicError).

    Fields it does not use (``topic_prefix``, ``message``, ``poll_after_s``) are not read."""
    try:
        status = EnrollmentStatus(doc.get("status"))
    except ValueError:
        raise ValueError(f"status {doc.get('status')!r:.40} is not accepted or pending") from None
    broker = trust = None
    if doc.get("broker") is not None:
        b = _object(doc, "broker")
        urls = b.get("urls")
        if not isinstance(urls, list) or not 1 <= len(urls) <= 8:
            raise ValueError("broker.urls must be a list of 1 to 8 URLs")
        broker = BrokerAccess(
            urls=tuple(_string(u, "broker.urls item", 1, 2048) for u in urls),
            username=_text(b, "username", 1, 128),
            password=_text(b, "password", 1, 256),
            client_id=validate_id(b.get("client_id"), "broker client id"),  # type: ignore[arg-type]
        )
    if doc.get("trust") is not None:
        t = _object(doc, "trust")
        root = t.get("tuf_root")
        if root is not None and not isinstance(root, dict):
            raise ValueError("trust.tuf_root must be an object")
        trust = StoredTrust(
            tuf_root=root,
            director_keys=_keys(t, "director_keys", 16),
            publisher_keys=_keys(t, "publisher_keys", 64),
        )
    device_id = validate_id(doc.get("device_id"), "device id")  # type: ignore[arg-type]
    return StoredAnswer(status=status, device_id=device_id, broker=broker, trust=trust)


def _object(doc: dict[str, Any], name: str) -> dict[str, Any]:
    value = doc.get(name)
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be an object")
    return value


def _text(doc: dict[str, Any], name: str, lo: int, hi: int) -> str:
    return _string(doc.get(name), name, lo, hi)


def _string(value: Any, name: str, lo: int, hi: int) -> str:
    if not isinstance(value, str) or not lo <= len(value) <= hi:
        raise ValueError(f"{name} must be a string of {lo} to {hi} characters")
    return value


def _keys(doc: dict[str, Any], name: str, most: int) -> tuple[str, ...]:
    value = doc.get(name, [])
    if not isinstance(value, list) or len(value) > most:
        raise ValueError(f"trust.{name} must be a list of at most {most} keys")
    for key in value:
        if not isinstance(key, str) or _HEX_KEY.fullmatch(key) is None:
            raise ValueError(f"trust.{name} must hold keys of 64 lowercase hex characters")
    return tuple(value)
