"""ngclient's ``FetcherInterface`` over a transport's own reader.

In a module of its own because subclassing ``tuf.ngclient.FetcherInterface`` imports the whole
of ``tuf.ngclient`` (securesystemslib, cryptography, urllib3: about 10 MiB of RSS); a transport
imports this when ngclient first asks it for a fetcher, so an agent with no deployment to run
never loads the TUF client (docs/agent.md "Memory").
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from tuf.ngclient.fetcher import FetcherInterface

Reader = Callable[[str], Iterator[bytes]]
"""``url`` → the file's bytes in chunks; raises ``tuf.api.exceptions.DownloadError`` kinds."""


class ReaderFetcher(FetcherInterface):
    """Fetches each URL through ``read`` (``name`` is for logs and ``repr``)."""

    def __init__(self, read: Reader, name: str) -> None:
        self._read = read
        self._name = name

    def _fetch(self, url: str) -> Iterator[bytes]:
        return self._read(url)

    def __repr__(self) -> str:
        return f"ReaderFetcher({self._name!r})"
