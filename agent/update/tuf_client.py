"""The device's TUF client: ``tuf.ngclient.Updater`` over a :class:`RepoTransport` (DESIGN 4.4).

Trusted metadata lives in ``{state_dir}/tuf/metadata/`` (ngclient's cache: ``root.json``,
``root_history/``, ``timestamp.json``, ``snapshot.json``, ``targets.json``). The trust anchor
is the root handed out at enrollment, ``{state_dir}/tuf/bootstrap-root.json``
(:mod:`agent.update.trust_root`); every refresh walks the root chain from it (through the cache,
then the repository), so key rotations are followed and a forged newer root is refused. This
module imports python-tuf: the update agent imports it when a deployment first needs metadata.

Synchronous, like ngclient: the updater calls it from a worker thread. Errors leave as
:class:`agent.update.machine.UpdateError` with a cause::

    transport       the repository could not be reached (transient: retry)
    tuf_expired     metadata past its expiry (freeze)
    tuf_metadata    any other verification failure (signatures, versions, lengths)
    target_missing  the target is not listed
    hash_mismatch   downloaded bytes differ from the signed length/hashes
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from tuf.api import exceptions as tuf_errors
from tuf.api.metadata import Metadata, TargetFile, Targets
from tuf.ngclient.config import UpdaterConfig
from tuf.ngclient.updater import Updater

from mcp_edge.agent.update.machine import Cause, UpdateError
from mcp_edge.agent.update.transport import RepoTransport
from mcp_edge.agent.update.trust_root import tuf_dir
from mcp_edge.shared.errors import SigningError
from mcp_edge.shared.signing import PublicKey

log = logging.getLogger("mcp.agent.update")

PUBLISHERS_FIELD = "x-mcp-publishers"


class TufClient:
    """Refreshes and queries the repository's TUF metadata (see the module docstring)."""

    def __init__(
        self,
        state_dir: Path,
        transport: RepoTransport,
        *,
        bootstrap_root: bytes,
        config: UpdaterConfig | None = None,
    ) -> None:
        self.metadata_dir = tuf_dir(state_dir) / "metadata"
        self.transport = transport
        self._root = bootstrap_root
        self._config = config
        self._updater: Updater | None = None

    def refresh(self) -> None:
        """Fetch and verify timestamp, snapshot and targets now (a fresh ngclient each time:
        one ngclient refreshes once). Raises :class:`UpdateError`."""
        self.metadata_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        with _translated("refreshing repository metadata"):
            updater = Updater(
                str(self.metadata_dir),
                self.transport.metadata_url,
                target_dir=None,
                target_base_url=self.transport.targets_url,
                fetcher=self.transport.fetcher(),
                config=self._config,
                bootstrap=self._root,
            )
            updater.refresh()
        self._updater = updater

    def _ready(self) -> Updater:
        if self._updater is None:
            self.refresh()
        assert self._updater is not None
        return self._updater

    def target(self, target_path: str) -> TargetFile:
        """The verified :class:`TargetFile` of ``target_path``; ``target_missing`` if unlisted."""
        updater = self._ready()
        with _translated(f"looking up {target_path}"):
            info = updater.get_targetinfo(target_path)
        if info is None:
            raise UpdateError(
                Cause.TARGET_MISSING, f"the signed targets metadata does not list {target_path}"
            )
        return info

    def target_url(self, info: TargetFile) -> str:
        """Where the bytes of ``info`` are (consistent snapshot: hash-prefixed name)."""
        sha = info.hashes.get("sha256")
        if sha is None:
            raise UpdateError(Cause.TUF_METADATA, f"{info.path}: no sha256 in its metadata")
        dirname, sep, basename = info.path.rpartition("/")
        return f"{self.transport.targets_url}{dirname}{sep}{sha}.{basename}"

    def publishers(self) -> dict[str, PublicKey]:
        """Publisher keys the verified targets metadata lists (keyid → key)."""
        self._ready()
        try:
            md: Metadata[Targets] = Metadata.from_file(str(self.metadata_dir / "targets.json"))
        except Exception as e:
            raise UpdateError(Cause.TUF_METADATA, f"cannot read verified targets: {e}") from e
        listed: Any = md.signed.unrecognized_fields.get(PUBLISHERS_FIELD) or {}
        if not isinstance(listed, dict):
            raise UpdateError(Cause.TUF_METADATA, f"{PUBLISHERS_FIELD} is not an object")
        keys: dict[str, PublicKey] = {}
        for keyid, hexkey in listed.items():
            try:
                key = PublicKey.from_hex(str(hexkey))
            except SigningError as e:
                log.warning("publisher key %s in targets metadata is unusable: %s", keyid, e)
                continue
            if key.keyid == keyid:
                keys[keyid] = key
        return keys

    @staticmethod
    def verify_file(info: TargetFile, path: Path) -> None:
        """Check ``path`` against the signed length and hashes; ``hash_mismatch`` if not."""
        try:
            with open(path, "rb") as f:
                info.verify_length_and_hashes(f)
        except tuf_errors.LengthOrHashMismatchError as e:
            raise UpdateError(Cause.HASH_MISMATCH, f"{info.path}: {e}") from e


class _translated:
    """Context manager turning tuf's errors into :class:`UpdateError` with a cause."""

    def __init__(self, doing: str) -> None:
        self.doing = doing

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, e: BaseException | None, tb: Any) -> None:
        if e is None or isinstance(e, UpdateError):
            return
        if isinstance(e, tuf_errors.ExpiredMetadataError):
            raise UpdateError(Cause.TUF_EXPIRED, f"{self.doing}: {e}") from e
        if isinstance(e, tuf_errors.DownloadLengthMismatchError):
            raise UpdateError(Cause.TUF_METADATA, f"{self.doing}: {e}") from e
        if isinstance(e, tuf_errors.DownloadError):
            raise UpdateError(Cause.TRANSPORT, f"{self.doing}: {e}") from e
        if isinstance(e, tuf_errors.RepositoryError):
            raise UpdateError(Cause.TUF_METADATA, f"{self.doing}: {type(e).__name__}: {e}") from e
        if isinstance(e, OSError):
            raise UpdateError(Cause.INTERNAL, f"{self.doing}: {e}") from e
