"""A repository in a local directory (``file:///media/usb/repo``): air-gapped sites and tests.

The directory has the control plane's layout (``metadata/`` and ``targets/``, see
:mod:`controlplane.repository.tuf_repo`). Its contents are as untrusted as anything from the
network: TUF verifies every byte. Paths are confined to the directory (no ``..``, no links out
of it), a missing file is ``DownloadHTTPError(404)`` as ngclient expects, and a download never
writes more than the length it is given.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO
from urllib.parse import unquote, urlsplit

from tuf.api.exceptions import DownloadError, DownloadHTTPError, DownloadLengthMismatchError
from tuf.ngclient.fetcher import FetcherInterface

from mcp_edge.agent.update.transport import Progress
from mcp_edge.shared.errors import MessageError
from mcp_edge.shared.protocol.repo import validate_repo_path

CHUNK_BYTES = 128 * 1024


def repo_dir_of(location: str | Path) -> Path:
    """The directory of ``file:///path`` or a plain path. Raises ValueError for other URLs."""
    text = str(location)
    if "://" in text:
        parts = urlsplit(text)
        if parts.scheme != "file" or parts.netloc not in ("", "localhost"):
            raise ValueError(f"{text!r} is not a file:// URL")
        text = unquote(parts.path)
    return Path(text).resolve()


class _DirectoryReader:
    """Maps a repository URL to a file inside ``root`` and refuses anything else."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.base = root.as_uri().rstrip("/") + "/"

    def path_of(self, url: str) -> Path:
        if not url.startswith(self.base):
            raise DownloadError(f"{url!r} is not inside the repository {self.base}")
        relative = url[len(self.base) :]
        try:
            validate_repo_path(relative)
        except MessageError as e:
            raise DownloadError(str(e)) from e
        path = self.root / relative
        try:
            real = path.resolve(strict=True)
        except (FileNotFoundError, NotADirectoryError):
            raise DownloadHTTPError(f"{relative}: not found", 404) from None
        except OSError as e:
            raise DownloadError(f"{relative}: {e}") from e
        if not real.is_relative_to(self.root) or not real.is_file():
            raise DownloadHTTPError(f"{relative}: not found", 404)
        return real


class FileFetcher(FetcherInterface):
    """ngclient's fetcher over a repository directory, in chunks of :data:`CHUNK_BYTES`."""

    def __init__(self, reader: _DirectoryReader) -> None:
        self._reader = reader

    def _fetch(self, url: str) -> Iterator[bytes]:
        path = self._reader.path_of(url)
        try:
            f = open(path, "rb")  # noqa: SIM115 - closed by the generator
        except FileNotFoundError:
            raise DownloadHTTPError(f"{url}: not found", 404) from None
        except OSError as e:
            raise DownloadError(f"{url}: {e}") from e
        return _chunks(f)


def _chunks(f: BinaryIO) -> Iterator[bytes]:
    with f:
        while chunk := f.read(CHUNK_BYTES):
            yield chunk


class FileRepoTransport:
    """:class:`agent.update.transport.RepoTransport` over a local repository directory."""

    def __init__(self, repo_dir: str | Path) -> None:
        root = repo_dir_of(repo_dir)
        if not root.is_dir():
            raise ValueError(f"{root}: no such repository directory")
        self._reader = _DirectoryReader(root)
        self.root = root

    @property
    def metadata_url(self) -> str:
        return f"{self._reader.base}metadata/"

    @property
    def targets_url(self) -> str:
        return f"{self._reader.base}targets/"

    def fetcher(self) -> FetcherInterface:
        return FileFetcher(self._reader)

    def download(
        self, url: str, dest: Path, *, length: int, progress: Progress | None = None
    ) -> int:
        """Copy ``url`` into ``dest`` from the bytes ``dest`` already holds on (see
        :meth:`agent.update.transport.RepoTransport.download`). Raises ``DownloadHTTPError``
        (404), ``DownloadLengthMismatchError`` (the file is longer than ``length``),
        ``DownloadError`` (unreadable) and OSError (writing ``dest``)."""
        source = self._reader.path_of(url)
        try:
            size = source.stat().st_size
        except OSError as e:
            raise DownloadError(f"{url}: {e}") from e
        if size > length:
            raise DownloadLengthMismatchError(
                f"{url} is {size} bytes, more than the {length} bytes expected"
            )
        have = dest.stat().st_size if dest.exists() else 0
        if have > size:
            have = 0  # a stale partial file from another target: start over
        try:
            src = open(source, "rb")  # noqa: SIM115 - closed below
        except OSError as e:
            raise DownloadError(f"{url}: {e}") from e
        flags = os.O_WRONLY | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
        done = 0
        with src, os.fdopen(os.open(dest, flags, 0o644), "r+b") as out:
            out.truncate(have)
            out.seek(have)
            src.seek(have)
            while chunk := src.read(min(CHUNK_BYTES, length - have - done + 1)):
                if have + done + len(chunk) > length:
                    raise DownloadLengthMismatchError(
                        f"{url} grew past the {length} bytes expected"
                    )
                out.write(chunk)
                done += len(chunk)
                if progress is not None:
                    progress(have + done, size)
            out.flush()
            os.fsync(out.fileno())
        return done
