"""One ``serve`` per data dir, and a broker identity per replica that no other process resets.

The broker accounts a replica's sessions log in with (``svc-{name}``, ``svc-{name}-repo``,
``svc-{name}-desired``) get a new password each time ``serve`` provisions them, and Mosquitto
drops any live session of an account whose password changes. Two rules keep a second process
from locking a running replica out of the broker:

- :class:`ServeLock`: ``serve`` holds an exclusive ``flock`` on ``{data_dir}/serve.lock`` for
  its whole life and takes it before it touches the broker, the database or the port. A second
  ``serve`` on the same data dir stops at once with :class:`DataDirInUseError`, naming the
  holder's pid and host. The kernel drops the lock when the holder dies, SIGKILL included, so a
  restart never waits.
- :func:`replica_name`: the name is ``cp-{host}-{id}``, ``id`` drawn once per data dir and kept
  in ``{data_dir}/replica-id``. Replicas on other data dirs (on one host or many, sharing one
  PostgreSQL) therefore have accounts of their own, whatever order they start and restart in;
  ``replica_name`` in the config overrides it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import socket
from pathlib import Path
from types import TracebackType

from mcp_edge.shared.errors import McpError
from mcp_edge.shared.fsutil import atomic_write_bytes

LOCK_FILE = "serve.lock"
REPLICA_ID_FILE = "replica-id"
_ID = re.compile(r"^[0-9a-f]{8}$")
MAX_NAME = 52
"""Room for ``-desired`` and the ``svc-`` prefix within Mosquitto's 64-character usernames."""


class DataDirInUseError(McpError):
    """Another ``serve`` holds this data dir."""


class ServeLock:
    """The exclusive lock of ``{data_dir}/serve.lock``; use as a context manager.

    Raises :class:`DataDirInUseError` when another process holds it, ``OSError`` when the file
    cannot be opened. The file keeps ``pid host`` of the holder for the error message.
    """

    def __init__(self, data_dir: Path) -> None:
        self.path = Path(data_dir) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "unknown"
            os.close(fd)
            raise DataDirInUseError(
                f"another mcp-controlplane serve is running on {self.path.parent} "
                f"(pid and host: {holder}); stop it first, or give this replica a data dir "
                "of its own"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
            os.close(fd)  # closing drops the lock

    def __enter__(self) -> ServeLock:
        self.acquire()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


def replica_id(data_dir: Path) -> str:
    """This data dir's replica id: read from ``replica-id``, drawn and written on first use.
    A file that does not hold one (edited by hand, truncated) is replaced."""
    path = Path(data_dir) / REPLICA_ID_FILE
    with contextlib.suppress(FileNotFoundError, UnicodeDecodeError):
        text = path.read_text(encoding="utf-8").strip()
        if _ID.match(text):
            return text
    new = secrets.token_hex(4)
    atomic_write_bytes(path, f"{new}\n".encode(), mode=0o600)
    return new


def replica_name(
    data_dir: Path, *, configured: str | None = None, hostname: str | None = None
) -> str:
    """The replica's broker identity: ``configured`` when given, else ``cp-{host}-{id}`` with
    the host name reduced to identifier characters (and cut to fit the length limit)."""
    if configured:
        return configured
    host = re.sub(r"[^A-Za-z0-9._-]+", "-", hostname or socket.gethostname()).strip(".-_")
    suffix = replica_id(data_dir)
    room = MAX_NAME - len("cp--") - len(suffix)
    return f"cp-{host[:room]}-{suffix}" if host else f"cp-{suffix}"


def valid_replica_name(value: str) -> str:
    """``value`` when it is a usable configured replica name; raises ``ValueError``."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", value) or len(value) > MAX_NAME:
        raise ValueError(
            f"replica_name {value!r} must be 1-{MAX_NAME} letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return value
