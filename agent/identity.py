"""What an enrolled agent keeps in its state directory, written atomically and privately.

    {state_dir}/identity/device.key    Ed25519 device key (0600; never leaves the device)
    {state_dir}/enrollment.json        the control plane's answer + its URL (0600: it holds
                                       the broker password)

``mcp-agent enroll`` writes them, ``mcp-agent run`` reads them.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from mcp_edge.shared.errors import McpError, MessageError
from mcp_edge.shared.fsutil import atomic_write_bytes
from mcp_edge.shared.protocol.codec import validate
from mcp_edge.shared.protocol.enrollment import EnrollmentAnswer
from mcp_edge.shared.signing import PrivateKey, read_private_key, write_private_key

MAX_ENROLLMENT_BYTES = 512 * 1024


class IdentityError(McpError):
    """The state directory holds no usable identity or enrollment."""


@dataclass(frozen=True)
class Enrollment:
    server: str
    answer: EnrollmentAnswer


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
        server = doc["server"]
        if not isinstance(server, str):
            raise TypeError("server must be a string")
        answer = validate(doc["answer"], EnrollmentAnswer)
    except (ValueError, KeyError, TypeError, MessageError) as e:
        raise IdentityError(f"{path}: not a valid enrollment record ({e})") from e
    return Enrollment(server, answer)
