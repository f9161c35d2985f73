"""The public reading API: verify a bundle, open (unpack) it, inspect it.

All three walk the bundle with :func:`~shared.bundle.archive.scan_bundle`, which applies the
checks in the order docs/bundle-format.md lists. Only :func:`open_bundle` leaves files behind,
and only in the caller's destination after every check passed.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mcp_edge.shared.bundle.archive import BundleLimits, SignaturePolicy, scan_bundle
from mcp_edge.shared.bundle.manifest import MANIFEST_NAME, SIGNATURE_NAME, BundleManifest
from mcp_edge.shared.fsutil import fsync_dir
from mcp_edge.shared.signing import PublicKey


@dataclass(frozen=True)
class VerifiedBundle:
    """A bundle that passed every check.

    ``signer_keyid`` is the trusted key that signed it, or None when it was accepted unsigned
    (or its signature could not be checked because no trusted keys were given).
    ``claimed_keyid`` is the key id manifest.sig names, verified or not.
    """

    manifest: BundleManifest
    signer_keyid: str | None
    claimed_keyid: str | None
    bundle_sha256: str
    size: int


@dataclass(frozen=True)
class OpenedBundle(VerifiedBundle):
    """A verified bundle unpacked under ``root`` (manifest.json and manifest.sig included)."""

    root: Path

    def path_of(self, member: str) -> Path:
        """Where a listed member lies on disk; raises KeyError for an unlisted one."""
        self.manifest.file_entry(member)
        return self.root / member

    def variant_path(self, tag: str) -> Path:
        """The model file of variant ``tag``; raises KeyError if there is no such variant."""
        return self.root / self.manifest.variant(tag).file


def verify_bundle(
    path: Path | str,
    trusted_keys: Iterable[PublicKey] = (),
    *,
    require_signature: bool = True,
    limits: BundleLimits | None = None,
    validate_models: bool = True,
    work_dir: Path | None = None,
    progress: bool = False,
) -> VerifiedBundle:
    """Check a bundle end to end without keeping anything.

    A signature present is always checked when ``trusted_keys`` are given; with
    ``require_signature`` a bundle without one, or with no trusted keys to check it against,
    is refused. With ``validate_models`` the members are unpacked into a private temporary
    directory (under ``work_dir`` or the system's), the models are validated there and the
    directory is removed. Raises :class:`BundleError`; ValueError when a signature is
    required but no trusted keys are given.
    """
    keys = list(trusted_keys)
    if require_signature and not keys:
        raise ValueError("a signature is required but no trusted keys were given")
    policy: SignaturePolicy = "require" if require_signature else "optional"
    stage = Path(tempfile.mkdtemp(prefix="mcpb-verify-", dir=work_dir)) if validate_models else None
    try:
        result = scan_bundle(
            path,
            trusted_keys=keys,
            signature=policy,
            limits=limits,
            stage_dir=stage,
            validate_models=validate_models,
            progress=progress,
        )
    finally:
        if stage is not None:
            shutil.rmtree(stage, ignore_errors=True)
    return VerifiedBundle(
        result.manifest,
        result.signer_keyid,
        result.claimed_keyid,
        result.bundle_sha256,
        result.size,
    )


def open_bundle(
    path: Path | str,
    dest: Path | str,
    trusted_keys: Iterable[PublicKey] = (),
    *,
    require_signature: bool = True,
    limits: BundleLimits | None = None,
    validate_models: bool = True,
    progress: bool = False,
) -> OpenedBundle:
    """Verify a bundle and unpack it into the new directory ``dest``.

    Members are staged in a private directory beside ``dest`` (same file system), fsynced,
    checked, and the directory is renamed to ``dest`` only when everything passed; on any
    failure the staging directory is removed and ``dest`` is not created. ``dest`` must not
    exist; its parent must. Raises :class:`BundleError`, :class:`FileExistsError`, ValueError
    (signature required without trusted keys).
    """
    keys = list(trusted_keys)
    if require_signature and not keys:
        raise ValueError("a signature is required but no trusted keys were given")
    dest = Path(dest)
    if dest.exists() or dest.is_symlink():
        raise FileExistsError(f"{dest} already exists")
    stage = Path(tempfile.mkdtemp(prefix=f".{dest.name}.staging-", dir=dest.parent))
    try:
        result = scan_bundle(
            path,
            trusted_keys=keys,
            signature="require" if require_signature else "optional",
            limits=limits,
            stage_dir=stage,
            validate_models=validate_models,
            progress=progress,
        )
        _write_small(stage / MANIFEST_NAME, result.manifest_bytes)
        if result.signature_bytes is not None:
            _write_small(stage / SIGNATURE_NAME, result.signature_bytes)
        for directory in {p.parent for p in result.staged.values()} | {stage}:
            os.chmod(directory, 0o755)
            fsync_dir(directory)
        os.rename(stage, dest)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    fsync_dir(dest.parent)
    return OpenedBundle(
        result.manifest,
        result.signer_keyid,
        result.claimed_keyid,
        result.bundle_sha256,
        result.size,
        root=dest,
    )


def _write_small(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def inspect_bundle(path: Path | str, *, limits: BundleLimits | None = None) -> dict[str, Any]:
    """Describe a bundle from its manifest and signature, reading nothing after them.

    Neither hashes nor the signature are checked (use :func:`verify_bundle`); the manifest
    must still pass its schema and caps. Returns ``{"path", "size", "manifest",
    "signature"}`` where ``signature`` is ``{"keyid", "verified": False}`` or None.
    """
    result = scan_bundle(path, signature="optional", limits=limits, metadata_only=True)
    signature: dict[str, Any] | None = None
    if result.claimed_keyid is not None:
        signature = {"keyid": result.claimed_keyid, "verified": False}
    return {
        "path": str(path),
        "size": result.size,
        "manifest": result.manifest.to_json_dict(),
        "signature": signature,
    }
