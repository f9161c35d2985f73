"""The control plane's TUF repository (DESIGN 4.4), built with ``tuf.api.metadata``.

On disk, under the repository directory (the layout the transports serve as is)::

    metadata/{N}.root.json       every root version (devices walk the chain to rotate keys)
    metadata/root.json           the newest root (what enrollment hands out as the trust root)
    metadata/{N}.targets.json    consistent snapshots: each version its own file
    metadata/{N}.snapshot.json
    metadata/timestamp.json      re-signed on a schedule so devices notice a freeze
    targets/{dir}/{sha256}.{name}  target files, named by content (consistent snapshot names)

Keys live in a :class:`KeyStore` (one Ed25519 key per top-level role plus the director key,
0600 files under ``keys/``). Root may be kept offline: :meth:`KeyStore.export_root` writes it
elsewhere and :meth:`KeyStore.remove_root` deletes it here; root changes then need it back.

Publisher keys are listed in the signed targets metadata (``x-mcp-publishers``: keyid → hex
public key), so a device learns and rotates them through TUF and never trusts an unsigned list.
Each target carries custom fields under ``custom`` (model name, version, variants, profiles,
publisher keyid). A bundle target's ``custom.parts`` names the targets its manifest, signature
and files are also published as (:func:`parts_of`); :meth:`TufRepository.add_targets` lists
them together with the bundle in one targets version and :meth:`TufRepository.remove_target`
delists them with it.

Every write is atomic (temp file, fsync, rename, directory fsync) and happens under one lock,
in this order: target file, targets, snapshot, timestamp — a reader never sees metadata naming
bytes that are not there yet.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from securesystemslib.signer import Key, Signature, Signer, SSlibKey
from tuf.api.metadata import (
    Metadata,
    MetaFile,
    Root,
    Snapshot,
    TargetFile,
    Targets,
    Timestamp,
)
from tuf.api.serialization.json import JSONSerializer

from mcp_edge.shared.errors import McpError
from mcp_edge.shared.fsutil import atomic_write_bytes, fsync_dir
from mcp_edge.shared.signing import PrivateKey, PublicKey, read_private_key, write_private_key

log = logging.getLogger("mcp.controlplane.repository")

Clock = Callable[[], datetime]
ROLES = ("root", "targets", "snapshot", "timestamp")
DIRECTOR = "director"
PUBLISHERS_FIELD = "x-mcp-publishers"
SPEC_VERSION = "1.0.31"


class RepositoryError(McpError):
    """The repository cannot do what was asked (missing key, bad target, broken metadata)."""


@dataclass(frozen=True)
class NewTarget:
    """One target for :meth:`TufRepository.add_targets`: its path, where its bytes are, its
    custom fields, and whether ``source`` may be renamed into place (same file system)."""

    path: str
    source: Path
    custom: Mapping[str, Any] | None = None
    move: bool = False


def parts_of(info: TargetFile) -> list[str]:
    """The target paths a bundle target's ``custom.parts`` names (manifest, signature, files),
    or an empty list for a target without parts (see docs/repository.md "Targets")."""
    custom = info.unrecognized_fields.get("custom")
    parts = custom.get("parts") if isinstance(custom, dict) else None
    if not isinstance(parts, dict):
        return []
    found = [parts.get("manifest"), parts.get("signature")]
    files = parts.get("files")
    if isinstance(files, dict):
        found.extend(files.values())
    return [p for p in found if isinstance(p, str)]


@dataclass(frozen=True)
class Expiry:
    """How long each role's metadata stays valid after signing."""

    root: timedelta = timedelta(days=365)
    targets: timedelta = timedelta(days=90)
    snapshot: timedelta = timedelta(days=7)
    timestamp: timedelta = timedelta(days=1)

    def of(self, role: str) -> timedelta:
        value: timedelta = getattr(self, role)
        return value


class NaclSigner(Signer):
    """A securesystemslib signer over a :class:`shared.signing.PrivateKey` (PyNaCl)."""

    def __init__(self, key: PrivateKey) -> None:
        self._key = key
        self._public = tuf_key(key.public_key)

    @property
    def public_key(self) -> Key:
        return self._public

    def sign(self, payload: bytes) -> Signature:
        return Signature(self._public.keyid, self._key.sign(payload).hex())

    @classmethod
    def from_priv_key_uri(
        cls, priv_key_uri: str, public_key: Key, secrets_handler: Any = None
    ) -> Signer:
        raise ValueError("NaclSigner is built from a key object, not a URI")


def tuf_key(public: PublicKey) -> SSlibKey:
    """The TUF key object of an Ed25519 public key (keyid as :mod:`shared.signing` computes it)."""
    return SSlibKey(public.keyid, "ed25519", "ed25519", {"public": public.raw.hex()})


class KeyStore:
    """The repository's private keys: ``{dir}/{role}.key`` (0600), one per role + director."""

    def __init__(self, directory: Path) -> None:
        self.dir = Path(directory)

    def path(self, role: str) -> Path:
        return self.dir / f"{role}.key"

    def has(self, role: str) -> bool:
        return self.path(role).exists()

    def load(self, role: str) -> PrivateKey:
        path = self.path(role)
        if not path.exists():
            hint = " (kept offline? put it back with `mcp-controlplane keys import-root`)" \
                if role == "root" else ""  # fmt: skip
            raise RepositoryError(f"no {role} key at {path}{hint}")
        return read_private_key(path)

    def create(self, role: str) -> PrivateKey:
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        key = PrivateKey.generate()
        write_private_key(self.path(role), key, overwrite=True)
        return key

    def ensure(self, role: str) -> PrivateKey:
        return self.load(role) if self.has(role) else self.create(role)

    def export_root(self, destination: Path) -> Path:
        """Copy the root key to ``destination`` (0600) for offline keeping."""
        write_private_key(destination, self.load("root"))
        return destination

    def import_root(self, source: Path) -> PrivateKey:
        key = read_private_key(source)
        write_private_key(self.path("root"), key, overwrite=True)
        return key

    def remove_root(self) -> None:
        self.path("root").unlink(missing_ok=True)


class TufRepository:
    """A TUF repository in ``directory`` signed with keys from ``keys``.

    Not async: callers run the (short, file-bound) methods in a worker thread. One instance per
    directory per process; the internal lock serialises writers.
    """

    def __init__(
        self,
        directory: Path,
        keys: KeyStore,
        *,
        clock: Clock | None = None,
        expiry: Expiry | None = None,
    ) -> None:
        self.dir = Path(directory)
        self.metadata_dir = self.dir / "metadata"
        self.targets_dir = self.dir / "targets"
        self.keys = keys
        self.clock = clock or (lambda: datetime.now(timezone.utc))
        self.expiry = expiry or Expiry()
        self._lock = threading.RLock()
        self._serializer = JSONSerializer(compact=True)

    # ------------------------------------------------------------------ creation / reading
    @property
    def initialized(self) -> bool:
        return (self.metadata_dir / "root.json").exists()

    def init(self) -> None:
        """Create keys (those missing) and version 1 of every role. A no-op when initialized."""
        with self._lock:
            if self.initialized:
                return
            self.metadata_dir.mkdir(parents=True, exist_ok=True)
            self.targets_dir.mkdir(parents=True, exist_ok=True)
            for role in (*ROLES, DIRECTOR):
                self.keys.ensure(role)
            root = Root(version=1, spec_version=SPEC_VERSION, expires=self._expires("root"),
                        consistent_snapshot=True)  # fmt: skip
            for role in ROLES:
                root.add_key(tuf_key(self.keys.load(role).public_key), role)
            targets = Targets(version=1, spec_version=SPEC_VERSION,
                              expires=self._expires("targets"))  # fmt: skip
            targets.unrecognized_fields[PUBLISHERS_FIELD] = {}
            self._write_root(Metadata(root), [self.keys.load("root")])
            self._write_targets(Metadata(targets))
            log.info("initialized TUF repository in %s", self.dir)

    def _read(self, name: str) -> Metadata[Any]:
        path = self.metadata_dir / name
        try:
            return Metadata.from_bytes(path.read_bytes())
        except FileNotFoundError:
            raise RepositoryError(f"{path}: missing; run `mcp-controlplane init`") from None
        except Exception as e:
            raise RepositoryError(f"{path}: unreadable metadata: {e}") from e

    def root(self) -> Metadata[Root]:
        return self._read("root.json")

    def root_bytes(self) -> bytes:
        """The newest root metadata as stored: what a device is given to trust."""
        return (self.metadata_dir / "root.json").read_bytes()

    def timestamp(self) -> Metadata[Timestamp]:
        return self._read("timestamp.json")

    def snapshot(self) -> Metadata[Snapshot]:
        return self._read(f"{self.timestamp().signed.snapshot_meta.version}.snapshot.json")

    def targets(self) -> Metadata[Targets]:
        return self._read(f"{self.snapshot().signed.meta['targets.json'].version}.targets.json")

    def publishers(self) -> dict[str, PublicKey]:
        """Publisher keys the signed targets metadata lists (keyid → key)."""
        listed = self.targets().signed.unrecognized_fields.get(PUBLISHERS_FIELD) or {}
        return {keyid: PublicKey.from_hex(hexkey) for keyid, hexkey in listed.items()}

    def director_key(self) -> PublicKey:
        return self.keys.load(DIRECTOR).public_key

    # ------------------------------------------------------------------ changes
    def add_target(
        self,
        target_path: str,
        source: Path,
        *,
        custom: Mapping[str, Any] | None = None,
        move: bool = False,
    ) -> TargetFile:
        """Add (or replace) ``target_path`` with the bytes of ``source`` and publish.

        The file is stored as ``targets/{dir}/{sha256}.{name}``; ``move`` renames ``source``
        into place instead of copying (same filesystem). Returns the new :class:`TargetFile`.
        """
        return self.add_targets([NewTarget(target_path, Path(source), custom, move)])[0]

    def add_targets(self, new: Sequence[NewTarget]) -> list[TargetFile]:
        """Add (or replace) several targets and publish them in ONE new targets version, so a
        device sees all of them listed or none. Returns their :class:`TargetFile` in order.

        Every path is checked before anything is stored; files stored before a failure stay
        unlisted (content-addressed, they are reused when the same bytes come again).
        """
        for item in new:
            self._check_target_path(item.path)
        if len({item.path for item in new}) != len(new):
            raise RepositoryError("the same target path is added twice")
        with self._lock:
            md = self.targets()
            infos = [self._store(item) for item in new]
            for info in infos:
                md.signed.targets[info.path] = info
            md.signed.version += 1
            md.signed.expires = self._expires("targets")
            self._write_targets(md)
            return infos

    def _store(self, item: NewTarget) -> TargetFile:
        """Put the bytes of one target in place (content-addressed name); not yet listed."""
        info = TargetFile.from_file(item.path, str(item.source), ["sha256"])
        if item.custom:
            info.unrecognized_fields["custom"] = dict(item.custom)
        sha = info.hashes["sha256"]
        dirname, _, basename = item.path.rpartition("/")
        dest = self.targets_dir / dirname / f"{sha}.{basename}"
        dest.parent.mkdir(parents=True, exist_ok=True)
        if not dest.exists():
            tmp = dest.with_name(f".{dest.name}.tmp")
            if item.move:
                os.replace(item.source, tmp)
            else:
                shutil.copyfile(item.source, tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, dest)
            fsync_dir(dest.parent)
        elif item.move:
            Path(item.source).unlink(missing_ok=True)
        return info

    def remove_target(self, target_path: str) -> bool:
        """Delist ``target_path`` and the parts its ``custom.parts`` names (:func:`parts_of`),
        in one new targets version; the files stay for devices mid-download. False if absent."""
        with self._lock:
            md = self.targets()
            info = md.signed.targets.pop(target_path, None)
            if info is None:
                return False
            for part in parts_of(info):
                md.signed.targets.pop(part, None)
            md.signed.version += 1
            md.signed.expires = self._expires("targets")
            self._write_targets(md)
            return True

    def set_publishers(self, keys: Iterable[PublicKey]) -> None:
        """Replace the publisher keys listed in targets metadata and publish."""
        with self._lock:
            md = self.targets()
            md.signed.unrecognized_fields[PUBLISHERS_FIELD] = {k.keyid: k.raw.hex() for k in keys}
            md.signed.version += 1
            md.signed.expires = self._expires("targets")
            self._write_targets(md)

    def refresh_timestamp(self, *, margin: timedelta | None = None) -> bool:
        """Re-sign timestamp (and snapshot/targets when they near expiry).

        With ``margin``, only roles expiring within ``margin`` are re-signed; returns True when
        anything was written. Run on a schedule so devices can tell a live repository from a
        frozen one.
        """
        with self._lock:
            now = self.clock()
            margin = margin if margin is not None else timedelta(0)
            wrote = False
            targets = self.targets()
            if targets.signed.expires - now <= max(margin, self.expiry.targets / 4):
                targets.signed.version += 1
                targets.signed.expires = self._expires("targets")
                self._write_targets(targets)
                return True
            snapshot = self.snapshot()
            if snapshot.signed.expires - now <= max(margin, self.expiry.snapshot / 4):
                self._write_snapshot(snapshot.signed.meta["targets.json"].version)
                return True
            ts = self.timestamp()
            if ts.signed.expires - now <= max(margin, self.expiry.timestamp / 2):
                self._write_timestamp(ts.signed.snapshot_meta.version)
                wrote = True
            return wrote

    def rotate(self, role: str) -> PublicKey:
        """Give ``role`` a new key; root signs a new root version (with the old and new root
        key when rotating root), so devices follow the chain. Returns the new public key."""
        if role not in (*ROLES, DIRECTOR):
            raise RepositoryError(f"unknown role {role!r}; one of {', '.join((*ROLES, DIRECTOR))}")
        with self._lock:
            old_root_key = self.keys.load("root")  # rotating anything in root needs root
            if role == DIRECTOR:
                return self.keys.create(DIRECTOR).public_key
            old = self.keys.load(role)
            new = PrivateKey.generate()
            md = self.root()
            md.signed.revoke_key(old.keyid, role)
            md.signed.add_key(tuf_key(new.public_key), role)
            md.signed.version += 1
            md.signed.expires = self._expires("root")
            signers = [old_root_key, new] if role == "root" else [old_root_key]
            write_private_key(self.keys.path(role), new, overwrite=True)
            self._write_root(md, signers)
            if role == "targets":
                targets = self.targets()
                targets.signed.version += 1
                self._write_targets(targets)
            elif role == "snapshot":
                self._write_snapshot(self.snapshot().signed.meta["targets.json"].version)
            elif role == "timestamp":
                self._write_timestamp(self.timestamp().signed.snapshot_meta.version)
            log.info("rotated the %s key to %s (root version %d)", role, new.keyid[:16],
                     md.signed.version)  # fmt: skip
            return new.public_key

    # ------------------------------------------------------------------ helpers
    def _expires(self, role: str) -> datetime:
        return (self.clock() + self.expiry.of(role)).replace(microsecond=0)

    @staticmethod
    def _check_target_path(path: str) -> None:
        from mcp_edge.shared.protocol.repo import validate_repo_path

        validate_repo_path(f"targets/{path}")

    def _sign(self, md: Metadata[Any], keys: Iterable[PrivateKey]) -> bytes:
        md.signatures.clear()
        for key in keys:
            md.sign(NaclSigner(key), append=True)
        return md.to_bytes(self._serializer)

    def _write_root(self, md: Metadata[Root], keys: list[PrivateKey]) -> None:
        data = self._sign(md, keys)
        atomic_write_bytes(self.metadata_dir / f"{md.signed.version}.root.json", data)
        atomic_write_bytes(self.metadata_dir / "root.json", data)

    def _write_targets(self, md: Metadata[Targets]) -> None:
        data = self._sign(md, [self.keys.load("targets")])
        atomic_write_bytes(self.metadata_dir / f"{md.signed.version}.targets.json", data)
        self._write_snapshot(md.signed.version)

    def _write_snapshot(self, targets_version: int) -> None:
        previous = None
        if (self.metadata_dir / "timestamp.json").exists():
            previous = self.timestamp().signed.snapshot_meta.version
        version = (previous or 0) + 1
        snap = Snapshot(version=version, spec_version=SPEC_VERSION,
                        expires=self._expires("snapshot"),
                        meta={"targets.json": MetaFile(version=targets_version)})  # fmt: skip
        data = self._sign(Metadata(snap), [self.keys.load("snapshot")])
        atomic_write_bytes(self.metadata_dir / f"{version}.snapshot.json", data)
        self._write_timestamp(version)

    def _write_timestamp(self, snapshot_version: int) -> None:
        previous = 0
        if (self.metadata_dir / "timestamp.json").exists():
            previous = self.timestamp().signed.version
        snapshot_bytes = (self.metadata_dir / f"{snapshot_version}.snapshot.json").read_bytes()
        meta = MetaFile(version=snapshot_version, length=len(snapshot_bytes),
                        hashes={"sha256": hashlib.sha256(snapshot_bytes).hexdigest()})  # fmt: skip
        ts = Timestamp(version=previous + 1, spec_version=SPEC_VERSION,
                       expires=self._expires("timestamp"), snapshot_meta=meta)  # fmt: skip
        data = self._sign(Metadata(ts), [self.keys.load("timestamp")])
        atomic_write_bytes(self.metadata_dir / "timestamp.json", data)
