"""The model registry on top of the TUF repository: publishing bundles, publisher keys, the
trust root handed to devices, and the schedule that keeps timestamp metadata fresh.

One published model version is the whole signed ``.mcpb`` as a TUF target at
``{name}/{version}/{name}-{version}.mcpb`` with custom fields::

    {"model", "version", "version_numeric", "format", "profiles", "variants", "publisher",
     "parts": {"manifest": PATH, "signature": PATH, "files": {member: PATH}}}

and each of its members as a target of its own, so a device fetches only the manifest, its
signature and the files of the one variant it runs (docs/repository.md "Targets")::

    {name}/{version}/manifest.json   the bundle's manifest.json, byte for byte
    {name}/{version}/manifest.sig    its manifest.sig
    {name}/{version}/{member}        every file the manifest lists (variants, labels...)

``variants`` is ``[{"name", "file", "sha256", "size", "profiles"}]`` from the manifest;
``profiles`` is the sorted union of the hardware profiles the bundle's specific variants name
(the default variant, ``*``, fits every profile and is left out: empty means "any"). A part's
custom fields are ``{"model", "version", "part_of"}`` (``part_of``: the bundle target's path).

Publishing checks the bundle (structure, caps, hashes) and its publisher signature against the
registered, non-revoked publisher keys of the database while it copies the members out (so
what is published as a part is exactly what was hash-checked), adds the bundle and its parts
in one targets version, then inserts the ``models``/``model_versions`` rows and an audit
entry; when the database refuses, the bundle and its parts are delisted again. The same name and version with the same bytes is a no-op; other bytes are a
conflict. Publisher keys live in the database and every change re-lists the non-revoked ones
in signed targets metadata (:meth:`TufRepository.set_publishers`).

:class:`TufRepository` is synchronous file I/O: every call runs in a worker thread, under one
asyncio lock (one writer in this process) and an ``flock`` on ``repository/.lock`` (one writer
across processes, e.g. ``mcp-controlplane keys rotate`` beside a running ``serve``).

Errors (:class:`RegistryError` and subclasses) carry the :class:`ErrorCode` the REST layer
answers with.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

from mcp_edge.controlplane.db import Database
from mcp_edge.controlplane.db import audit as audit_q
from mcp_edge.controlplane.db import registry as q
from mcp_edge.controlplane.db.models import Model, ModelVersion, PublisherKey
from mcp_edge.controlplane.repository.tuf_repo import (
    ROLES,
    Clock,
    Expiry,
    KeyStore,
    NewTarget,
    TufRepository,
)
from mcp_edge.controlplane.settings import Settings
from mcp_edge.shared.bundle import BundleLimits, inspect_bundle
from mcp_edge.shared.bundle.archive import scan_bundle
from mcp_edge.shared.bundle.manifest import MANIFEST_NAME, SIGNATURE_NAME
from mcp_edge.shared.errors import BundleError, KeyFileError, McpError, MessageError, VersionError
from mcp_edge.shared.protocol.command import ErrorCode
from mcp_edge.shared.protocol.enrollment import TrustRoot
from mcp_edge.shared.protocol.repo import validate_repo_path
from mcp_edge.shared.signing import PublicKey
from mcp_edge.shared.version import SemVer

log = logging.getLogger("mcp.controlplane.registry")

T = TypeVar("T")
REPOSITORY_DIR = "repository"
KEYS_DIR = "keys"
UPLOADS_DIR = "uploads"
PARTS_STAGING_SUFFIX = ".parts"
LOCK_FILE = ".lock"
ANY_PROFILE = "*"

ACTION_PUBLISHED = "model_version.published"
ACTION_PUBLISHER_ADDED = "publisher_key.added"
ACTION_PUBLISHER_REVOKED = "publisher_key.revoked"


class RegistryError(McpError):
    """A registry request that cannot be done; ``code`` is what the REST layer answers."""

    code = ErrorCode.BAD_REQUEST


class BundleRejectedError(RegistryError):
    """The bundle is malformed, unsigned, tampered with, or its name/version are unusable."""


class UntrustedSignerError(RegistryError):
    """The bundle is signed by a key that is not a registered, non-revoked publisher key."""

    code = ErrorCode.FORBIDDEN


class VersionConflictError(RegistryError):
    """The version exists with other bytes, or a revoked publisher key is added again."""

    code = ErrorCode.CONFLICT


class UnknownPublisherError(RegistryError):
    """No publisher key with that id."""

    code = ErrorCode.NOT_FOUND


def repository_for(
    settings: Settings, clock: Clock | None = None, expiry: Expiry | None = None
) -> TufRepository:
    """The control plane's TUF repository: ``{root}/repository`` signed with ``{root}/keys``,
    where ``root`` is ``shared_dir`` when replicas share one, else the data dir."""
    root = settings.repository_root
    return TufRepository(
        root / REPOSITORY_DIR,
        KeyStore(root / KEYS_DIR),
        clock=clock,
        expiry=expiry,
    )


@contextlib.contextmanager
def repository_lock(repo: TufRepository) -> Iterator[None]:
    """Hold the cross-process writer lock of ``repo`` (blocking; call from a worker thread)."""
    repo.dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(repo.dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing drops the lock


def target_path_of(name: str, version: str) -> str:
    """The TUF target path of one model version's whole bundle."""
    return f"{name}/{version}/{name}-{version}.mcpb"


def part_path_of(name: str, version: str, member: str) -> str:
    """The TUF target path of one member of a version's bundle (``manifest.json``,
    ``manifest.sig`` or a file the manifest lists)."""
    return f"{name}/{version}/{member}"


@dataclass(frozen=True)
class PublishResult:
    """A published version; ``created`` is False when the same bytes were published before."""

    version: ModelVersion
    created: bool


@dataclass(frozen=True)
class _Candidate:
    """A verified bundle about to be published, and its target's custom fields."""

    name: str
    version: str
    numeric: int
    target_path: str
    sha256: str
    length: int
    format: str
    signer: str
    custom: dict[str, Any]
    drift_baseline: dict[str, Any] | None = None
    parts: tuple[NewTarget, ...] = ()
    """The manifest, signature and member files, staged for :meth:`TufRepository.add_targets`."""


@dataclass(frozen=True)
class RoleStatus:
    role: str
    version: int
    expires: datetime
    keyids: list[str]


@dataclass(frozen=True)
class RepositoryStatus:
    """What ``GET /api/v1/repository`` shows: role versions, expiry times, keys, counts."""

    roles: list[RoleStatus]
    targets: int
    publishers: list[str]
    director_keyid: str
    root_key_online: bool
    consistent_snapshot: bool


class RepositoryService:
    """The registry and the repository of one control plane (see the module docstring)."""

    def __init__(
        self,
        settings: Settings,
        db: Database,
        clock: Clock,
        *,
        expiry: Expiry | None = None,
    ) -> None:
        self.settings = settings
        self.db = db
        self.clock = clock
        self.repo = repository_for(settings, clock, expiry)
        self.uploads_dir = settings.data_dir / UPLOADS_DIR
        self._lock = asyncio.Lock()

    # ------------------------------------------------------------------ plumbing
    async def _locked(self, func: Callable[[], T]) -> T:
        """Run ``func`` in a worker thread holding both writer locks."""

        def call() -> T:
            with repository_lock(self.repo):
                return func()

        return await asyncio.to_thread(call)

    async def _read(self, func: Callable[[], T]) -> T:
        return await asyncio.to_thread(func)

    # ------------------------------------------------------------------ lifecycle
    async def init(self) -> bool:
        """Create keys and metadata when missing, drop stale uploads, list the database's
        publisher keys in targets metadata, and re-sign metadata near expiry (a control plane
        that was down for a while serves fresh metadata at once). Returns True when the
        repository was created."""
        async with self._lock:
            created = not self.repo.initialized
            await self._locked(self.repo.init)
            self.uploads_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            for stale in self.uploads_dir.glob("*.upload"):
                stale.unlink(missing_ok=True)
            for stale in self.uploads_dir.glob(f"*{PARTS_STAGING_SUFFIX}"):
                shutil.rmtree(stale, ignore_errors=True)
            await self._sync_publishers()
        await self.refresh_timestamp()
        return created

    async def refresh_timestamp(self) -> bool:
        """Re-sign timestamp (and snapshot/targets near expiry); True when anything was written."""
        async with self._lock:
            wrote = await self._locked(self.repo.refresh_timestamp)
        if wrote:
            log.info("re-signed repository metadata nearing expiry")
        return wrote

    async def run_refresh(self, interval_s: float, stop: asyncio.Event) -> None:
        """Call :meth:`refresh_timestamp` every ``interval_s`` seconds until ``stop`` is set
        (the first call after one interval: :meth:`init` has just refreshed).

        A failure is logged and retried at the next tick; it never ends the loop.
        """
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), interval_s)
            if stop.is_set():
                return
            try:
                await self.refresh_timestamp()
            except Exception:
                log.exception(
                    "refreshing the repository timestamp failed; retrying in %.0f s", interval_s
                )

    def upload_path(self) -> Path:
        """A fresh file name for one upload, on the data dir's file system."""
        self.uploads_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        return self.uploads_dir / f"{os.urandom(12).hex()}.upload"

    # ------------------------------------------------------------------ trust
    async def trust_root(self) -> TrustRoot:
        """The trust root for enrollment answers
        (:class:`~controlplane.enrollment_service.TrustSource`): the newest root.json, the
        director key and the publisher keys targets lists."""

        def read() -> TrustRoot:
            root = json.loads(self.repo.root_bytes())
            publishers = self.repo.publishers()
            return TrustRoot(
                tuf_root=root,
                director_keys=[self.repo.director_key().raw.hex()],
                publisher_keys=[k.raw.hex() for k in publishers.values()],
            )

        return await self._read(read)

    async def status(self) -> RepositoryStatus:
        """Role versions, expiry times and key ids of the current metadata."""

        def read() -> RepositoryStatus:
            root = self.repo.root()
            signed = {
                "root": root.signed,
                "targets": self.repo.targets().signed,
                "snapshot": self.repo.snapshot().signed,
                "timestamp": self.repo.timestamp().signed,
            }
            roles = [
                RoleStatus(
                    role,
                    signed[role].version,
                    signed[role].expires,
                    list(root.signed.roles[role].keyids),
                )
                for role in ROLES
            ]
            return RepositoryStatus(
                roles=roles,
                targets=len(self.repo.targets().signed.targets),
                publishers=sorted(self.repo.publishers()),
                director_keyid=self.repo.director_key().keyid,
                root_key_online=self.repo.keys.has("root"),
                consistent_snapshot=bool(root.signed.consistent_snapshot),
            )

        return await self._read(read)

    # ------------------------------------------------------------------ publisher keys
    async def list_publishers(self) -> list[PublisherKey]:
        async with self.db.read() as tx:
            return await q.list_publishers(tx)

    async def add_publisher(
        self, key: PublicKey, *, name: str, actor: str
    ) -> tuple[PublisherKey, bool]:
        """Register ``key``; returns ``(row, created)`` (False: it was registered already).

        Raises :class:`VersionConflictError` for a key that was revoked: revocation is final.
        """
        async with self._lock:
            now = self.clock()
            async with self.db.transaction() as tx:
                row = await q.get_publisher(tx, key.keyid)
                if row is not None and row.revoked_at is not None:
                    raise VersionConflictError(
                        f"publisher key {key.keyid[:16]} was revoked at "
                        f"{row.revoked_at.isoformat()}; a revoked key cannot be registered "
                        "again (make a new one with `mcp-bundle keygen`)"
                    )
                created = row is None
                if row is None:
                    row = await q.add_publisher(
                        tx, keyid=key.keyid, public_key=key.raw.hex(), name=name, now=now
                    )
                    await audit_q.insert_entry(
                        tx, at=now, actor=actor, action=ACTION_PUBLISHER_ADDED,
                        target_type="publisher_key", target_id=key.keyid, detail={"name": name},
                    )  # fmt: skip
            await self._sync_publishers()
        if created:
            log.info("publisher key %s (%s) registered by %s", key.keyid[:16], name, actor)
        return row, created

    async def revoke_publisher(self, keyid: str, *, actor: str) -> PublisherKey:
        """Revoke a key and delist it from targets metadata; a no-op when already revoked.

        Raises :class:`UnknownPublisherError`.
        """
        async with self._lock:
            now = self.clock()
            async with self.db.transaction() as tx:
                row = await q.get_publisher(tx, keyid)
                if row is None:
                    raise UnknownPublisherError(f"no publisher key {keyid!r}")
                if row.revoked_at is None:
                    row = await q.revoke_publisher(tx, keyid, now=now)
                    await audit_q.insert_entry(
                        tx, at=now, actor=actor, action=ACTION_PUBLISHER_REVOKED,
                        target_type="publisher_key", target_id=keyid, detail={"name": row.name},
                    )  # fmt: skip
                    log.info("publisher key %s (%s) revoked by %s", keyid[:16], row.name, actor)
            await self._sync_publishers()
        return row

    async def _sync_publishers(self) -> None:
        """List exactly the database's non-revoked keys in targets metadata (write only when
        the listing differs). Caller holds ``self._lock``."""
        async with self.db.read() as tx:
            rows = await q.list_publishers(tx, active_only=True)
        wanted: dict[str, PublicKey] = {}
        for row in rows:
            try:
                wanted[row.keyid] = PublicKey.from_hex(row.public_key)
            except KeyFileError as e:  # registered before unusable keys were refused
                log.warning(
                    "publisher key %s (%s) is left out of targets metadata: %s",
                    row.keyid[:16],
                    row.name,
                    e,
                )

        def sync() -> bool:
            try:
                if self.repo.publishers() == wanted:
                    return False
            except KeyFileError:  # the listing holds a key refused since: write it anew
                pass
            self.repo.set_publishers(wanted.values())
            return True

        if await self._locked(sync):
            log.info("targets metadata now lists %d publisher key(s)", len(wanted))

    # ------------------------------------------------------------------ models
    async def publish_bundle(self, path: Path, *, actor: str) -> PublishResult:
        """Verify the bundle at ``path`` and publish it with its parts (see the module docstring).

        ``path`` is consumed: moved into the repository or left for the caller to delete.
        Raises :class:`BundleRejectedError` (400), :class:`UntrustedSignerError` (403),
        :class:`VersionConflictError` (409), :mod:`controlplane.db.errors`.
        """
        self.uploads_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        stage = Path(tempfile.mkdtemp(suffix=PARTS_STAGING_SUFFIX, dir=self.uploads_dir))
        try:
            return await self._publish(path, stage, actor)
        finally:
            await asyncio.to_thread(shutil.rmtree, stage, True)

    async def _publish(self, path: Path, stage: Path, actor: str) -> PublishResult:
        c = await self._candidate(path, stage)
        async with self._lock:
            async with self.db.read() as tx:
                existing = await q.get_version(tx, c.name, c.version)
                signer = await q.get_publisher(tx, c.signer)
            if existing is not None:
                if existing.sha256 == c.sha256:
                    log.info("%s %s pushed again by %s: same bytes, nothing to do",
                             c.name, c.version, actor)  # fmt: skip
                    return PublishResult(existing, created=False)
                raise VersionConflictError(
                    f"{c.name} {c.version} is already published with other bytes (sha256 "
                    f"{existing.sha256[:16]}); publish a new version instead"
                )
            if signer is None or signer.revoked_at is not None:
                raise UntrustedSignerError(
                    f"publisher key {c.signer[:16]} was revoked while the bundle was checked"
                )
            move = _same_file_system(path, self.repo.dir)
            bundle = NewTarget(c.target_path, path, c.custom, move)
            infos = await self._locked(lambda: self.repo.add_targets([bundle, *c.parts]))
            try:
                info = infos[0]
                if info.hashes.get("sha256") != c.sha256 or info.length != c.length:
                    raise BundleRejectedError("the bundle changed while it was being published")
                row = await self._record(c, actor)
            except BaseException:
                await self._locked(lambda: self.repo.remove_target(c.target_path))
                raise
        log.info("published %s %s (%d bytes, sha256 %s, signed by %s, %d parts) for %s", c.name,
                 c.version, c.length, c.sha256[:16], c.signer[:16], len(c.parts), actor)  # fmt: skip
        return PublishResult(row, created=True)

    async def _candidate(self, path: Path, stage: Path) -> _Candidate:
        """Check the bundle end to end against its signer's key, copying its members into
        ``stage`` as they are hash-checked; describe the bundle target and its parts."""
        key = await self._check_signer(path)
        limits = BundleLimits(max_bundle_bytes=self.settings.max_bundle_bytes)
        members = stage / "members"
        members.mkdir(mode=0o700)
        try:
            verified = await asyncio.to_thread(
                scan_bundle, path, trusted_keys=[key], signature="require", limits=limits,
                stage_dir=members, validate_models=False,
            )  # fmt: skip
        except BundleError as e:
            raise BundleRejectedError(_bundle_message(e)) from e
        m = verified.manifest
        try:
            numeric = SemVer.parse(m.version).to_numeric()
        except VersionError as e:
            raise BundleRejectedError(f"{m.name} {m.version} cannot be published: {e}") from e
        target_path = target_path_of(m.name, m.version)
        _check_stored_path(target_path, verified.bundle_sha256, "name and version")
        move = _same_file_system(stage, self.repo.dir)
        part_custom = {"model": m.name, "version": m.version, "part_of": target_path}
        sources: dict[str, tuple[Path, str]] = {}
        manifest_file = stage / MANIFEST_NAME
        await asyncio.to_thread(manifest_file.write_bytes, verified.manifest_bytes)
        sources[MANIFEST_NAME] = (manifest_file, _sha256(verified.manifest_bytes))
        if verified.signature_bytes is not None:
            signature_file = stage / SIGNATURE_NAME
            await asyncio.to_thread(signature_file.write_bytes, verified.signature_bytes)
            sources[SIGNATURE_NAME] = (signature_file, _sha256(verified.signature_bytes))
        for entry in m.files:
            if part_path_of(m.name, m.version, entry.path) == target_path:
                raise BundleRejectedError(
                    f"bundle refused ({entry.path}): a member may not be named like the bundle "
                    "target itself"
                )
            sources[entry.path] = (verified.staged[entry.path], entry.sha256)
        parts: list[NewTarget] = []
        for member, (source, sha) in sources.items():
            part = part_path_of(m.name, m.version, member)
            _check_stored_path(part, sha, f"member {member!r} with that name and version")
            parts.append(NewTarget(part, source, part_custom, move))
        files = {e.path: part_path_of(m.name, m.version, e.path) for e in m.files}
        parts_field = {"manifest": part_path_of(m.name, m.version, MANIFEST_NAME),
                       "signature": part_path_of(m.name, m.version, SIGNATURE_NAME),
                       "files": files}  # fmt: skip
        variants = [{"name": v.tag, "file": v.file, "sha256": v.sha256, "size": v.size,
                     "profiles": list(v.profiles)} for v in m.variants]  # fmt: skip
        profiles = sorted({p for v in m.variants for p in v.profiles} - {ANY_PROFILE})
        custom = {"model": m.name, "version": m.version, "version_numeric": numeric,
                  "format": m.format, "profiles": profiles, "variants": variants,
                  "publisher": key.keyid, "parts": parts_field}  # fmt: skip
        baseline = m.drift_baseline.model_dump(mode="json") if m.drift_baseline else None
        return _Candidate(m.name, m.version, numeric, target_path, verified.bundle_sha256,
                          verified.size, m.format, key.keyid, custom, baseline,
                          tuple(parts))  # fmt: skip

    async def _record(self, c: _Candidate, actor: str) -> ModelVersion:
        """Insert the version rows and the audit entry in one transaction."""
        now = self.clock()
        async with self.db.transaction() as tx:
            row = await q.insert_version(
                tx, model=c.name, version=c.version, version_numeric=c.numeric,
                target_path=c.target_path, sha256=c.sha256, length=c.length, format=c.format,
                profiles=c.custom["profiles"], variants=c.custom["variants"],
                publisher_keyid=c.signer, uploaded_by=actor, now=now,
                drift_baseline=c.drift_baseline,
            )  # fmt: skip
            await audit_q.insert_entry(
                tx, at=now, actor=actor, action=ACTION_PUBLISHED, target_type="model_version",
                target_id=f"{c.name}@{c.version}",
                detail={"sha256": c.sha256, "length": c.length, "publisher": c.signer,
                        "target_path": c.target_path},
            )  # fmt: skip
        return row

    async def _check_signer(self, path: Path) -> PublicKey:
        """The registered, non-revoked key that claims to have signed the bundle.

        Reads only the manifest and signature; raises :class:`BundleRejectedError` for a bundle
        that is malformed or unsigned and :class:`UntrustedSignerError` for any other signer.
        """
        limits = BundleLimits(max_bundle_bytes=self.settings.max_bundle_bytes)
        try:
            info = await asyncio.to_thread(inspect_bundle, path, limits=limits)
        except BundleError as e:
            raise BundleRejectedError(_bundle_message(e)) from e
        claimed = (info.get("signature") or {}).get("keyid")
        if not claimed:
            raise BundleRejectedError(
                "the bundle is not signed; sign it with `mcp-bundle sign --key PUBLISHER.key` "
                "before pushing"
            )
        async with self.db.read() as tx:
            row = await q.get_publisher(tx, claimed)
        if row is None:
            raise UntrustedSignerError(
                f"the bundle is signed by key {claimed[:16]}, which is not a registered "
                "publisher key (register it with `mcp-controlplane publishers add`)"
            )
        if row.revoked_at is not None:
            raise UntrustedSignerError(
                f"the bundle is signed by publisher key {claimed[:16]} ({row.name}), revoked "
                f"at {row.revoked_at.isoformat()}"
            )
        try:
            return PublicKey.from_hex(row.public_key)
        except KeyFileError as e:  # registered before unusable keys were refused
            raise UntrustedSignerError(
                f"publisher key {claimed[:16]} ({row.name}) is not a usable Ed25519 key ({e}); "
                "revoke it and register a new one"
            ) from e

    async def list_models(self) -> list[q.ModelSummary]:
        async with self.db.read() as tx:
            return await q.list_models(tx)

    async def model_detail(self, name: str) -> tuple[Model, list[ModelVersion]] | None:
        """Model ``name`` and its versions (newest first), or None when there is no such model."""
        async with self.db.read() as tx:
            model = await q.get_model(tx, name)
            if model is None:
                return None
            return model, await q.list_versions(tx, name)

    async def model_version(self, name: str, version: str) -> ModelVersion | None:
        async with self.db.read() as tx:
            return await q.get_version(tx, name, version)


def _bundle_message(e: BundleError) -> str:
    where = f" ({e.member})" if e.member else ""
    return f"bundle refused{where}: {e}"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _check_stored_path(target_path: str, sha256: str, what: str) -> None:
    """Refuse (400) a target whose content-addressed file name fails the repository's path
    rules (``targets/{dir}/{sha256}.{name}``: segments of at most 128 characters, 8 deep)."""
    directory, _, basename = target_path.rpartition("/")
    try:
        validate_repo_path(f"targets/{directory}/{sha256}.{basename}")
    except MessageError as e:
        raise BundleRejectedError(f"{what} too long for a target path: {e}") from e


def _same_file_system(a: Path, b: Path) -> bool:
    b.mkdir(parents=True, exist_ok=True)
    return os.stat(a).st_dev == os.stat(b).st_dev
