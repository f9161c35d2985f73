"""The repository over HTTP(S): a :class:`RepoTransport` for sites where a web server or CDN
is nearer than the broker.

``base_url`` is the repository root, e.g. ``https://cp.example:8443/repo/``; metadata lives
under ``{base_url}metadata/`` and targets under ``{base_url}targets/`` (the control plane
serves both with aiohttp's ``FileResponse``, which honours ``Range``). Metadata goes through
tuf's own ``Urllib3Fetcher``; :meth:`HttpRepoTransport.download` streams a target with urllib3
and resumes a partial file with ``Range: bytes={size}-``:

- ``206`` with a ``Content-Range`` starting at the partial size: append;
- ``200`` (the server ignored the range): start over from byte 0;
- ``416``: the partial file is already complete (``Content-Range: bytes */{size}`` equal to its
  size) or longer than the file (truncated, then an error so the next call starts over);
- ``404`` and other errors: ``DownloadHTTPError`` with the status.

The file's total length (from ``Content-Range`` or ``Content-Length``) is checked against
``length`` before a byte is written, and the stream is cut at ``length`` whatever the headers
said (``DownloadLengthMismatchError``). ``read_timeout_s`` bounds each gap between received
bytes and ``total_timeout_s`` the whole call (``SlowRetrievalError``).
"""

from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path

import urllib3
from tuf.api.exceptions import (
    DownloadError,
    DownloadHTTPError,
    DownloadLengthMismatchError,
    SlowRetrievalError,
)
from tuf.ngclient.fetcher import FetcherInterface
from tuf.ngclient.urllib3_fetcher import Urllib3Fetcher

from mcp_edge.agent import __version__
from mcp_edge.agent.update.transport import Progress, open_partial

log = logging.getLogger("mcp.agent.update.http")

_CONTENT_RANGE = re.compile(r"bytes\s+(?:(\d+)-(\d+)|\*)/(\d+)")
_STREAM_BYTES = 256 * 1024


class HttpRepoTransport:
    """:class:`agent.update.transport.RepoTransport` over HTTP(S) (see the module docstring).

    ``pool`` may be given (a ``PoolManager`` with a TLS context for a private CA); otherwise one
    is made with urllib3's defaults.
    """

    def __init__(
        self,
        base_url: str,
        *,
        connect_timeout_s: float = 10.0,
        read_timeout_s: float = 30.0,
        total_timeout_s: float = 3600.0,
        pool: urllib3.PoolManager | None = None,
    ) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"repository URL {base_url!r} must start with http:// or https://")
        self.base_url = base_url if base_url.endswith("/") else base_url + "/"
        self._timeout = urllib3.Timeout(connect=connect_timeout_s, read=read_timeout_s)
        self._read_timeout_s = read_timeout_s
        self._total_timeout_s = total_timeout_s
        self._pool = pool or urllib3.PoolManager(
            retries=False, headers={"User-Agent": f"mcp-agent/{__version__}"}
        )

    @property
    def metadata_url(self) -> str:
        return self.base_url + "metadata/"

    @property
    def targets_url(self) -> str:
        return self.base_url + "targets/"

    def fetcher(self) -> FetcherInterface:
        return Urllib3Fetcher(
            socket_timeout=max(1, round(self._read_timeout_s)), app_user_agent="mcp-agent"
        )

    def download(
        self, url: str, dest: Path, *, length: int, progress: Progress | None = None
    ) -> int:
        """See :meth:`agent.update.transport.RepoTransport.download`."""
        deadline = time.monotonic() + self._total_timeout_s
        fd, start = open_partial(dest, length)
        try:
            try:
                return self._download(fd, url, start, length, deadline, progress)
            finally:
                os.fsync(fd)
        finally:
            os.close(fd)

    def _download(
        self, fd: int, url: str, start: int, length: int, deadline: float, progress: Progress | None
    ) -> int:
        headers = {"Range": f"bytes={start}-"} if start else {}
        try:
            response = self._pool.request(
                "GET",
                url,
                headers=headers,
                preload_content=False,
                timeout=self._timeout,
                redirect=True,
            )
        except urllib3.exceptions.TimeoutError as e:
            raise SlowRetrievalError(f"{url}: no answer in time") from e
        except urllib3.exceptions.HTTPError as e:
            raise DownloadError(f"{url}: {e}") from e
        try:
            offset, declared = self._plan(fd, response, url, start)
            if declared is not None and declared > length:
                raise DownloadLengthMismatchError(
                    f"{url} is {declared} bytes, more than the {length} bytes allowed"
                )
            total = length if declared is None else declared
            if offset >= total and declared is not None:
                return 0
            written = 0
            try:
                for data in response.stream(_STREAM_BYTES):
                    if offset + len(data) > length:
                        raise DownloadLengthMismatchError(
                            f"{url} sent more than the {length} bytes allowed"
                        )
                    os.pwrite(fd, data, offset)
                    offset += len(data)
                    written += len(data)
                    if progress is not None:
                        progress(offset, total)
                    if time.monotonic() > deadline:
                        raise SlowRetrievalError(f"{url}: total timeout reached at {offset} bytes")
            except urllib3.exceptions.TimeoutError as e:
                raise SlowRetrievalError(f"{url}: stalled at {offset} bytes") from e
            except urllib3.exceptions.HTTPError as e:
                raise DownloadError(f"{url}: interrupted at {offset} bytes: {e}") from e
            if declared is not None and offset < declared:
                raise DownloadError(f"{url}: the connection ended at {offset} of {total} bytes")
            return written
        except BaseException:
            response.close()  # a half-read body: never hand this connection back to the pool
            raise
        finally:
            response.release_conn()

    @staticmethod
    def _plan(
        fd: int, response: urllib3.BaseHTTPResponse, url: str, start: int
    ) -> tuple[int, int | None]:
        """From the response's status and headers: ``(offset the body starts at, file size)``;
        the size is None when the server did not say."""
        status = response.status
        content_range = response.headers.get("Content-Range", "")
        match = _CONTENT_RANGE.fullmatch(content_range.strip())
        if status == 416:
            total = int(match.group(3)) if match else -1
            if total == start:
                return start, total
            os.ftruncate(fd, 0)
            raise DownloadError(
                f"{url}: the partial download ({start} bytes) does not fit the "
                f"file ({total} bytes); it was discarded"
            )
        if status == 404:
            raise DownloadHTTPError(f"{url}: not found", 404)
        if status == 206:
            if match is None or match.group(1) is None:
                raise DownloadError(f"{url}: 206 without a usable Content-Range")
            if int(match.group(1)) != start:
                raise DownloadError(
                    f"{url}: asked for bytes from {start}, got {content_range!r:.80}"
                )
            return start, int(match.group(3))
        if status == 200:
            if start:
                log.info("%s: the server ignored the range; downloading from byte 0", url)
                os.ftruncate(fd, 0)
            declared = response.headers.get("Content-Length")
            return 0, int(declared) if declared and declared.isdigit() else None
        raise DownloadHTTPError(f"{url}: HTTP {status}", status)
