"""A bundle read as separate parts: its manifest and signature fetched on their own, then only
the member files a device needs (docs/repository.md "Targets", docs/updates.md "Variants").

The whole-bundle reader (:func:`shared.bundle.archive.scan_bundle`) checks the manifest and its
signature before anything else; :func:`verify_manifest_parts` applies exactly those checks, in
the same order, to a manifest and a signature that came as files of their own:

1. sizes within ``max_manifest_bytes`` / ``max_signature_bytes``;
2. the manifest is strict JSON (no duplicate keys, no NaN) in canonical form;
3. the signature is well-formed and made by one of the trusted keys over the canonical manifest
   (required: a part set without a valid signature is refused);
4. the manifest passes its schema and its listed sizes and member count fit the caps.

:func:`check_member_file` then checks one member file against the manifest's listed size and
sha256 (the repository's TUF hashes are checked by the caller as well: both must agree).
Errors are :class:`~shared.errors.BundleError` with ``member`` naming the part at fault.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

from mcp_edge.shared.bundle.archive import (
    BundleLimits,
    _check_canonical,
    _check_signature,
    _parse_manifest,
    load_strict_json,
)
from mcp_edge.shared.bundle.manifest import MANIFEST_NAME, SIGNATURE_NAME, BundleManifest
from mcp_edge.shared.bundle.tarstream import bundle_error
from mcp_edge.shared.signing import PublicKey

_CHUNK = 1 << 20


def verify_manifest_parts(
    manifest_bytes: bytes,
    signature_bytes: bytes,
    trusted_keys: Iterable[PublicKey],
    limits: BundleLimits | None = None,
) -> tuple[BundleManifest, str]:
    """Check a manifest and its signature fetched as separate files (see the module docstring).

    Returns ``(manifest, signer keyid)``. Raises :class:`BundleError` (``member`` is
    ``manifest.json`` or ``manifest.sig``) and ValueError when no trusted keys are given.
    """
    limits = limits or BundleLimits()
    trusted = {k.keyid: k for k in trusted_keys}
    if not trusted:
        raise ValueError("a signature is required but no trusted keys were given")
    if len(manifest_bytes) > limits.max_manifest_bytes:
        raise bundle_error(
            f"{len(manifest_bytes)} bytes is over the cap of {limits.max_manifest_bytes} bytes",
            MANIFEST_NAME,
        )
    if len(signature_bytes) > limits.max_signature_bytes:
        raise bundle_error(
            f"{len(signature_bytes)} bytes is over the cap of {limits.max_signature_bytes} bytes",
            SIGNATURE_NAME,
        )
    doc = load_strict_json(manifest_bytes, MANIFEST_NAME)
    _check_canonical(doc, manifest_bytes)
    signer, _claimed = _check_signature(doc, signature_bytes, trusted, "require")
    if signer is None:  # "require" with trusted keys either verifies or raises
        raise bundle_error("signature could not be checked", SIGNATURE_NAME)
    return _parse_manifest(doc, limits), signer


def check_member_file(manifest: BundleManifest, member: str, path: Path) -> None:
    """Check the file at ``path`` against the size and sha256 the manifest lists for
    ``member``. Raises :class:`BundleError` (an unlisted member, other size, other hash)."""
    try:
        entry = manifest.file_entry(member)
    except KeyError:
        raise bundle_error("not listed in the manifest", member) from None
    size = path.stat().st_size
    if size != entry.size:
        raise bundle_error(f"{size} bytes, but the manifest lists {entry.size}", member)
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    if digest.hexdigest() != entry.sha256:
        raise bundle_error(
            f"sha256 mismatch: manifest lists {entry.sha256[:16]}..., content is "
            f"{digest.hexdigest()[:16]}... (file tampered with or corrupt)",
            member,
        )


__all__ = ["check_member_file", "verify_manifest_parts"]
