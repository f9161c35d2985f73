"""How the agent reaches the control plane's TUF repository: one interface, several transports.

A :class:`RepoTransport` gives ``tuf.ngclient.Updater`` a metadata fetcher and downloads target
files with resume. Implementations: MQTT request/response (:mod:`agent.update.transport_mqtt`,
the default), HTTP(S) (:mod:`agent.update.transport_http`) and a local directory
(:mod:`agent.update.transport_file`, for air-gapped sites and tests).

Everything here is synchronous: ngclient is, so the updater runs in a worker thread and a
transport bridges to its own I/O (the MQTT one to the agent's event loop).

Errors (all from ``tuf.api.exceptions``, so ngclient handles them as it does for HTTP)::

    DownloadError                    transport trouble: retry later
    ├── DownloadHTTPError(404)       the repository says the file does not exist
    ├── DownloadLengthMismatchError  the file is longer than the caller allows (endless data)
    └── SlowRetrievalError           no progress within the per-chunk or total timeout
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from tuf.ngclient import FetcherInterface

log = logging.getLogger("mcp.agent.update")

Progress = Callable[[int, int], None]
"""Called with ``(bytes_done, bytes_total)`` as a download advances."""


class RepoTransport(Protocol):
    """A way to the repository: metadata for ngclient, target bytes with resume."""

    @property
    def metadata_url(self) -> str:
        """Base URL ngclient appends metadata file names to (ends with ``/``)."""
        ...

    @property
    def targets_url(self) -> str:
        """Base URL target paths (``{dir}/{sha256}.{name}``) are appended to (ends with ``/``)."""
        ...

    def fetcher(self) -> FetcherInterface:
        """The ``FetcherInterface`` ngclient uses for metadata (and may use for targets)."""
        ...

    def download(
        self, url: str, dest: Path, *, length: int, progress: Progress | None = None
    ) -> int:
        """Fetch ``url`` into ``dest``, resuming after the bytes ``dest`` already holds.

        Writes at most ``length`` bytes in all: a file the repository says is longer raises
        ``DownloadLengthMismatchError`` before anything past ``length`` is written. ``dest`` is
        fsynced before returning. Returns the number of bytes transferred by this call (a resume
        transfers only the rest). Does not check hashes: the caller verifies against TUF.
        """
        ...


def open_partial(dest: Path, length: int) -> tuple[int, int]:
    """Open (or create) the partial download ``dest``; return ``(fd, bytes already there)``.

    A partial file longer than ``length`` cannot be a prefix of the target: it is emptied and
    the download starts over. Raises ValueError for a negative ``length``, OSError from the
    file system. The caller closes the descriptor.
    """
    if length < 0:
        raise ValueError("length must not be negative")
    fd = os.open(dest, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        start = os.fstat(fd).st_size
        if start > length:
            log.warning(
                "partial %s is longer than the %d bytes allowed; starting over", dest, length
            )
            os.ftruncate(fd, 0)
            start = 0
    except BaseException:
        os.close(fd)
        raise
    return fd, start
