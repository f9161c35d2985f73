"""The agent's on-disk model store and the persisted update records (DESIGN 4.4-4.5, 6).

Layout under the state directory::

    staging/{sha256}.mcpb             a download in progress or done (kept for resume)
    staging/{sha256}.parts/           the parts of that bundle fetched one by one instead: each
                                      file named by its own sha256 (kept for resume)
    staging/{name}-{version}.unpack/  a bundle being unpacked and verified
    models/{name}/{version}/          an installed version: manifest.json, manifest.sig, the
                                      model files, install.json (what was verified, when)
    models/{name}/index.json          active, previous, canary, shadow, prefetch, release counter
    updates/{name}.json               the deployment record of the state machine
    updates/prefetch/{name}.json      the record of the model's latest prefetch (apart, so a
                                      prefetch never hides how the model's deployment went)
    event-seq.json                    the next deployment event sequence number
    desired-state.json                the last accepted desired state (written by the updater)

An installed version appears by one rename of a fully written, fsynced directory and leaves by
a rename to a hidden ``.trash-`` name before it is deleted, so a version directory that exists
is always whole. Every JSON file is written atomically (temp file, fsync, rename, directory
fsync). Nothing here is async: the updater calls it from a worker thread where it may block.

The documents (:mod:`agent.update.records`, pydantic) are imported by the methods that read
one, so listing an empty store (an agent with nothing deployed) loads no pydantic.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import secrets
import shutil
from collections.abc import Callable, Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from mcp_edge.agent.update.machine import Cause, UpdateError
from mcp_edge.shared.fsutil import atomic_write_bytes, fsync_dir

if TYPE_CHECKING:
    from mcp_edge.agent.update.records import InstallInfo, ModelIndex, UpdateRecord

log = logging.getLogger("mcp.agent.update")

INSTALL_INFO = "install.json"
INDEX = "index.json"
NO_SPACE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


class DiskUsage(NamedTuple):
    total: int
    used: int
    free: int


DiskUsageFn = Callable[[Path], Any]
"""``shutil.disk_usage``-like: returns an object with ``free`` (bytes)."""


def is_disk_full(e: OSError) -> bool:
    return e.errno in NO_SPACE


class ModelStore:
    """Files under ``state_dir`` (see the module docstring)."""

    def __init__(
        self,
        state_dir: Path,
        *,
        disk_usage: DiskUsageFn = shutil.disk_usage,
        reserve_bytes: int = 16 * 1024 * 1024,
    ) -> None:
        self.state_dir = Path(state_dir)
        self.staging_dir = self.state_dir / "staging"
        self.models_dir = self.state_dir / "models"
        self.updates_dir = self.state_dir / "updates"
        self.prefetch_dir = self.updates_dir / "prefetch"
        self._disk_usage = disk_usage
        self.reserve_bytes = reserve_bytes

    def ensure_dirs(self) -> None:
        for d in (self.staging_dir, self.models_dir, self.updates_dir):
            d.mkdir(parents=True, exist_ok=True, mode=0o755)

    # ------------------------------------------------------------------ paths
    def staged_bundle(self, sha256: str) -> Path:
        return self.staging_dir / f"{sha256}.mcpb"

    def staged_parts(self, sha256: str) -> Path:
        """Where the parts of the bundle ``sha256`` are fetched to (files named by their own
        sha256, so a resumed download continues the right file)."""
        return self.staging_dir / f"{sha256}.parts"

    def unpack_dir(self, name: str, version: str) -> Path:
        return self.staging_dir / f"{_safe(name)}-{_safe(version)}.unpack"

    def model_dir(self, name: str) -> Path:
        return self.models_dir / _safe(name)

    def version_dir(self, name: str, version: str) -> Path:
        return self.model_dir(name) / _safe(version)

    # ------------------------------------------------------------------ disk space
    def free_bytes(self) -> int:
        self.staging_dir.mkdir(parents=True, exist_ok=True)
        return int(self._disk_usage(self.staging_dir).free)

    def check_free(self, length: int, *, already: int = 0) -> None:
        """Refuse with ``disk_full`` unless the rest of a ``length``-byte download, its unpacked
        copy and the reserve fit on the disk. ``already``: bytes of it already staged."""
        need = (length - already) + length + self.reserve_bytes
        free = self.free_bytes()
        if free < need:
            raise UpdateError(
                Cause.DISK_FULL,
                f"{free >> 20} MiB free in {self.staging_dir}, {need >> 20} MiB needed "
                f"(a {length} byte bundle, unpacked beside it, plus a reserve)",
            )

    # ------------------------------------------------------------------ installed versions
    def installed(self, name: str, version: str) -> InstallInfo | None:
        """The install info of a whole installed version, or None."""
        from mcp_edge.agent.update.records import InstallInfo

        info: InstallInfo | None = _read(
            self.version_dir(name, version) / INSTALL_INFO, InstallInfo
        )
        if info is None or (info.name, info.version) != (name, version):
            return None
        return info

    def installed_versions(self, name: str) -> list[str]:
        d = self.model_dir(name)
        if not d.is_dir():
            return []
        return sorted(p.name for p in d.iterdir() if p.is_dir() and not p.name.startswith("."))

    def write_install_info(self, directory: Path, info: InstallInfo) -> None:
        atomic_write_bytes(directory / INSTALL_INFO, info.to_bytes())

    def install(self, unpacked: Path, name: str, version: str) -> Path:
        """Move a verified, fsynced directory into ``models/{name}/{version}`` by one rename.

        An existing whole install of that version is kept and ``unpacked`` is removed.
        """
        dest = self.version_dir(name, version)
        if self.installed(name, version) is not None:
            shutil.rmtree(unpacked, ignore_errors=True)
            return dest
        if dest.exists():
            self._trash(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.rename(unpacked, dest)
        fsync_dir(dest.parent)
        return dest

    def remove_version(self, name: str, version: str) -> None:
        """Delete an installed version (renamed aside first, so it never looks whole)."""
        path = self.version_dir(name, version)
        if path.exists():
            self._trash(path)

    def _trash(self, path: Path) -> None:
        aside = path.with_name(f".trash-{path.name}-{secrets.token_hex(4)}")
        os.rename(path, aside)
        fsync_dir(path.parent)
        shutil.rmtree(aside, ignore_errors=True)

    def gc(self, name: str, keep: Collection[str]) -> list[str]:
        """Remove installed versions of ``name`` not in ``keep`` (and leftover trash)."""
        removed = []
        d = self.model_dir(name)
        if not d.is_dir():
            return []
        for p in d.iterdir():
            if p.name.startswith(".trash-") or p.name.startswith(".tmp"):
                shutil.rmtree(p, ignore_errors=True)
            elif p.is_dir() and p.name not in keep:
                self.remove_version(name, p.name)
                removed.append(p.name)
        if removed:
            log.info("removed old versions of %s: %s", name, ", ".join(sorted(removed)))
        return sorted(removed)

    # ------------------------------------------------------------------ staging
    def clean_staging(self, keep: Collection[Path] = ()) -> None:
        """Remove everything in ``staging/`` except the paths in ``keep``."""
        if not self.staging_dir.is_dir():
            return
        kept = {Path(p) for p in keep}
        for p in self.staging_dir.iterdir():
            if p in kept:
                continue
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()

    @staticmethod
    def discard_unpacked(path: Path) -> None:
        shutil.rmtree(path, ignore_errors=True)

    def discard_staged(self, record: UpdateRecord) -> None:
        """Remove the download (whole bundle or parts) and unpack directory of one deployment."""
        with contextlib.suppress(FileNotFoundError):
            self.staged_bundle(record.sha256).unlink()
        shutil.rmtree(self.staged_parts(record.sha256), ignore_errors=True)
        shutil.rmtree(self.unpack_dir(record.model, record.to_version), ignore_errors=True)

    # ------------------------------------------------------------------ index
    def index(self, name: str) -> ModelIndex:
        from mcp_edge.agent.update.records import ModelIndex

        found = _read(self.model_dir(name) / INDEX, ModelIndex)
        return found if found is not None and found.name == name else ModelIndex(name=name)

    def save_index(self, index: ModelIndex) -> None:
        d = self.model_dir(index.name)
        d.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(d / INDEX, index.to_bytes())

    def indexed_models(self) -> list[str]:
        if not self.models_dir.is_dir():
            return []
        return sorted(p.name for p in self.models_dir.iterdir() if (p / INDEX).is_file())

    # ------------------------------------------------------------------ records
    def record_path(self, name: str, *, prefetch: bool = False) -> Path:
        """Where the record of ``name``'s deployment (or, with ``prefetch``, of its prefetch)
        is kept."""
        return (self.prefetch_dir if prefetch else self.updates_dir) / f"{_safe(name)}.json"

    def record(self, name: str, *, prefetch: bool = False) -> UpdateRecord | None:
        """The stored record of ``name``'s deployment or prefetch; None when there is none or
        it is unreadable (then set aside as ``.bad``)."""
        path = self.record_path(name, prefetch=prefetch)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        from mcp_edge.agent.update.records import UpdateRecord

        try:
            return UpdateRecord.from_bytes(data)
        except ValueError as e:
            log.error("%s: unreadable update record, set aside: %s", path, e)
            with contextlib.suppress(OSError):
                os.replace(path, path.with_suffix(".bad"))
            return None

    def save_record(self, record: UpdateRecord) -> None:
        path = self.record_path(record.model, prefetch=record.role == "prefetch")
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, record.to_bytes())

    def records(self, *, prefetch: bool = False) -> list[UpdateRecord]:
        """Every stored deployment record (with ``prefetch``: every prefetch record)."""
        directory = self.prefetch_dir if prefetch else self.updates_dir
        if not directory.is_dir():
            return []
        found = []
        for p in sorted(directory.glob("*.json")):
            rec = self.record(p.stem, prefetch=prefetch)
            if rec is not None:
                found.append(rec)
        return found

    # ------------------------------------------------------------------ event counter
    def next_event_seq(self) -> int:
        """Take the next deployment event number (persisted, so it grows across restarts)."""
        path = self.state_dir / "event-seq.json"
        current = 0
        with contextlib.suppress(FileNotFoundError, ValueError, TypeError, KeyError):
            current = int(json.loads(path.read_bytes()[:4096])["next_seq"])
        self.state_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, b'{"next_seq": %d}\n' % (current + 1))
        return current


def _safe(part: str) -> str:
    """A model name or version as one path segment (they are validated upstream; this is the
    last line of defence against ``..`` or ``/``)."""
    if not part or part.startswith(".") or "/" in part or "\\" in part or "\0" in part:
        raise UpdateError(Cause.INTERNAL, f"{part!r} cannot be used as a file name")
    if len(part) > 128:
        raise UpdateError(Cause.INTERNAL, f"{part[:40]!r}... is too long for a file name")
    return part


def _read(path: Path, model: type[InstallInfo | ModelIndex]) -> Any:
    from mcp_edge.agent.update.records import MAX_JSON_BYTES

    try:
        data = path.read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        return None
    if len(data) > MAX_JSON_BYTES:
        log.error("%s: %d bytes is too large; ignored", path, len(data))
        return None
    try:
        return model.model_validate_json(data)
    except ValueError as e:
        log.error("%s: malformed, ignored: %s", path, e)
        return None


__all__ = ["DiskUsage", "ModelStore", "is_disk_full"]
