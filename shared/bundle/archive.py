"""Reading bundles safely: one strict pass over the archive that every reader shares.

Nothing here calls ``tarfile.extractall`` or trusts a header. :func:`scan_bundle` walks the
archive once, in this order, and stops at the first failure with a :class:`BundleError`
whose ``member`` names the file at fault:

1. the bundle is a regular file no larger than ``max_bundle_bytes``;
2. the first member is ``manifest.json`` (at most ``max_manifest_bytes``), strict JSON
   (no duplicate keys, no NaN) stored in canonical form;
3. ``manifest.sig`` (at most ``max_signature_bytes``) directly follows when present; it is
   checked against the trusted keys over ``canonical_json(manifest)``; a missing one is an
   error when a signature is required;
4. the manifest passes its schema (:class:`~shared.bundle.manifest.BundleManifest`) and its
   listed sizes and member count fit the caps;
5. every further header: a safe relative name, not seen before (also ignoring letter case),
   listed in the manifest, with the listed size; only then is its data streamed (to a file in
   the staging directory, or just hashed) and its sha256 compared;
6. the end-of-archive marker, only zeros after it, and no listed file missing;
7. each variant's model validates and has the I/O signature the manifest records; the labels
   file is UTF-8 with the recorded number of labels.

Files are written only inside the staging directory the caller passes (one made with
:func:`tempfile.mkdtemp`); :func:`shared.bundle.verify.open_bundle` renames it to the
caller's destination only after every check passed.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import ValidationError

from mcp_edge.shared.bundle._progress import progress_bar
from mcp_edge.shared.bundle.manifest import (
    MANIFEST_NAME,
    MAX_LABELS_BYTES,
    RESERVED_NAMES,
    SIGNATURE_NAME,
    BundleManifest,
    LabelsRef,
    member_name_problem,
)
from mcp_edge.shared.bundle.models import inspect_model
from mcp_edge.shared.bundle.tarstream import MemberHeader, TarStream, bundle_error
from mcp_edge.shared.errors import (
    BadSignatureError,
    MalformedSignatureError,
    SigningError,
    UnknownSignerError,
)
from mcp_edge.shared.signing import PublicKey, canonical_json, parse_signature, verify_signature

SignaturePolicy = Literal["require", "optional", "ignore"]


@dataclass(frozen=True)
class BundleLimits:
    """Size caps applied while reading a bundle (bytes, except ``max_members``)."""

    max_manifest_bytes: int = 1 << 20
    max_signature_bytes: int = 4096
    max_member_bytes: int = 2 << 30
    max_members: int = 64
    max_bundle_bytes: int = 8 << 30


@dataclass
class ScanResult:
    """Everything :func:`scan_bundle` learned; ``staged`` maps member names to files."""

    manifest: BundleManifest
    manifest_bytes: bytes
    signature_bytes: bytes | None
    signer_keyid: str | None
    claimed_keyid: str | None
    bundle_sha256: str
    size: int
    staged: dict[str, Path]


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate key {key!r:.60}")
        result[key] = value
    return result


def _bad_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed in JSON")


def load_strict_json(data: bytes, member: str) -> dict[str, Any]:
    """Parse a JSON object, refusing duplicate keys, NaN/Infinity and invalid UTF-8."""
    try:
        doc = json.loads(
            data.decode("utf-8"),
            object_pairs_hook=_no_duplicate_keys,
            parse_constant=_bad_constant,
        )
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise bundle_error(f"not valid JSON: {e}", member) from e
    if not isinstance(doc, dict):
        raise bundle_error("must hold a JSON object", member)
    return doc


def validation_summary(error: ValidationError) -> str:
    """One line naming the first few fields that failed and why."""
    parts = []
    for item in error.errors()[:3]:
        loc = ".".join(str(p) for p in item["loc"]) or "manifest"
        parts.append(f"{loc}: {item['msg']}")
    more = error.error_count() - len(parts)
    return "; ".join(parts) + (f" (and {more} more)" if more > 0 else "")


def _check_signature(
    manifest_doc: dict[str, Any],
    signature_bytes: bytes | None,
    trusted: dict[str, PublicKey],
    policy: SignaturePolicy,
) -> tuple[str | None, str | None]:
    """Return ``(verified signer keyid, claimed keyid)`` or raise BundleError."""
    if policy == "ignore":
        return None, None
    if signature_bytes is None:
        if policy == "require":
            raise bundle_error(
                "bundle is not signed but a signature is required (sign it with `mcp-bundle sign`)",
                SIGNATURE_NAME,
            )
        return None, None
    sig_doc = load_strict_json(signature_bytes, SIGNATURE_NAME)
    try:
        claimed, _ = parse_signature(sig_doc)
    except MalformedSignatureError as e:
        raise bundle_error(f"malformed signature: {e}", SIGNATURE_NAME) from e
    if not trusted:
        return None, claimed
    try:
        data = canonical_json(manifest_doc)
        return verify_signature(data, sig_doc, trusted), claimed
    except UnknownSignerError as e:
        raise bundle_error(
            f"signed by key {claimed[:16]}, which is not among the trusted keys", SIGNATURE_NAME
        ) from e
    except BadSignatureError as e:
        raise bundle_error(
            f"signature in {SIGNATURE_NAME} by key {claimed[:16]} does not match the manifest "
            "(manifest tampered with, or a wrong signature)",
            MANIFEST_NAME,
        ) from e
    except SigningError as e:
        raise bundle_error(f"signature unusable: {e}", SIGNATURE_NAME) from e


def _check_canonical(doc: dict[str, Any], data: bytes) -> None:
    try:
        canonical = canonical_json(doc) + b"\n"
    except SigningError as e:
        raise bundle_error(f"cannot be canonicalised: {e}", MANIFEST_NAME) from e
    if data != canonical:
        raise bundle_error(
            "not in canonical form (sorted keys, no spaces, one final newline); the "
            "signature covers the canonical bytes",
            MANIFEST_NAME,
        )


def _parse_manifest(doc: dict[str, Any], limits: BundleLimits) -> BundleManifest:
    try:
        manifest = BundleManifest.model_validate_json(canonical_json(doc))
    except (ValidationError, SigningError) as e:
        detail = validation_summary(e) if isinstance(e, ValidationError) else str(e)
        raise bundle_error(f"invalid manifest: {detail}", MANIFEST_NAME) from e
    members = len(manifest.files) + 2
    if members > limits.max_members:
        raise bundle_error(
            f"lists {len(manifest.files)} files; at most {limits.max_members - 2} are allowed",
            MANIFEST_NAME,
        )
    for entry in manifest.files:
        if entry.size > limits.max_member_bytes:
            raise bundle_error(
                f"{entry.size} bytes is over the member cap of {limits.max_member_bytes}",
                entry.path,
            )
    return manifest


def _capped_small(stream: TarStream, header: MemberHeader, cap: int) -> bytes:
    if header.size > cap:
        raise bundle_error(f"{header.size} bytes is over the cap of {cap} bytes", header.name)
    return stream.read_small(header)


def _stage_file(stage_dir: Path, name: str) -> tuple[Path, int]:
    target = stage_dir / name
    target.parent.mkdir(parents=True, exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    return target, os.open(target, flags, 0o644)


def _read_member(
    stream: TarStream, header: MemberHeader, manifest: BundleManifest, stage_dir: Path | None
) -> Path | None:
    entry = manifest.file_entry(header.name)
    if header.size != entry.size:
        raise bundle_error(
            f"header says {header.size} bytes but the manifest lists {entry.size}", header.name
        )
    if stage_dir is None:
        digest = stream.copy_data(header, None)
        target = None
    else:
        target, fd = _stage_file(stage_dir, header.name)
        with os.fdopen(fd, "wb") as out:
            digest = stream.copy_data(header, out.write)
            out.flush()
            os.fsync(out.fileno())
    if digest != entry.sha256:
        raise bundle_error(
            f"sha256 mismatch: manifest lists {entry.sha256[:16]}..., content is "
            f"{digest[:16]}... (file tampered with or corrupt)",
            header.name,
        )
    return target


def _check_header(
    header: MemberHeader, manifest: BundleManifest, seen: set[str], limits: BundleLimits
) -> None:
    name = header.name
    problem = member_name_problem(name)
    if problem is not None:
        raise bundle_error(problem, name)
    if name.casefold() in seen:
        raise bundle_error("duplicate member (appears twice in the archive)", name)
    if name in RESERVED_NAMES:
        raise bundle_error(f"{name} may appear only at the start of the bundle", name)
    if len(seen) + 1 > limits.max_members:
        raise bundle_error(f"more than {limits.max_members} members", name)
    if header.size > limits.max_member_bytes:
        raise bundle_error(
            f"{header.size} bytes is over the member cap of {limits.max_member_bytes}", name
        )
    if not any(f.path == name for f in manifest.files):
        raise bundle_error("not listed in the manifest", name)


def _read_metadata(
    stream: TarStream, limits: BundleLimits
) -> tuple[bytes, bytes | None, MemberHeader | None]:
    first = stream.next_header()
    if first is None:
        raise bundle_error("bundle is empty (no manifest.json)")
    if first.name != MANIFEST_NAME:
        raise bundle_error(f"the first member must be {MANIFEST_NAME}", first.name)
    manifest_bytes = _capped_small(stream, first, limits.max_manifest_bytes)
    header = stream.next_header()
    signature_bytes = None
    if header is not None and header.name == SIGNATURE_NAME:
        signature_bytes = _capped_small(stream, header, limits.max_signature_bytes)
        header = stream.next_header()
    return manifest_bytes, signature_bytes, header


def scan_bundle(
    path: Path | str,
    *,
    trusted_keys: Iterable[PublicKey] = (),
    signature: SignaturePolicy = "require",
    limits: BundleLimits | None = None,
    stage_dir: Path | None = None,
    validate_models: bool = True,
    metadata_only: bool = False,
    progress: bool = False,
) -> ScanResult:
    """Walk and check a bundle in one pass (see the module docstring for the order).

    With ``stage_dir``, member data is written below it (it must be an empty private
    directory); ``validate_models`` needs ``stage_dir``. With ``metadata_only``, stop after
    the manifest and signature checks (nothing after them is read).
    Raises :class:`BundleError`, or :class:`OSError` when the file cannot be read.
    """
    limits = limits or BundleLimits()
    trusted = {k.keyid: k for k in trusted_keys}
    if validate_models and stage_dir is None and not metadata_only:
        raise ValueError("validate_models needs a stage_dir")
    path = Path(path)
    if not stat.S_ISREG(path.stat().st_mode):  # before open(): a FIFO would block it
        raise bundle_error(f"{path} is not a regular file")
    whole = hashlib.sha256()
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise bundle_error(f"{path} is not a regular file")
        if st.st_size > limits.max_bundle_bytes:
            raise bundle_error(
                f"{path} is {st.st_size} bytes, over the bundle cap of {limits.max_bundle_bytes}"
            )
        bar = progress_bar(st.st_size, "verify", progress and not metadata_only)
        try:
            stream = TarStream(f, whole.update, bar)
            manifest_bytes, signature_bytes, header = _read_metadata(stream, limits)
            doc = load_strict_json(manifest_bytes, MANIFEST_NAME)
            _check_canonical(doc, manifest_bytes)
            signer, claimed = _check_signature(doc, signature_bytes, trusted, signature)
            manifest = _parse_manifest(doc, limits)
            result = ScanResult(
                manifest, manifest_bytes, signature_bytes, signer, claimed, "", st.st_size, {}
            )
            if metadata_only:
                return result
            seen = {MANIFEST_NAME} | ({SIGNATURE_NAME} if signature_bytes is not None else set())
            while header is not None:
                _check_header(header, manifest, seen, limits)
                seen.add(header.name.casefold())
                staged = _read_member(stream, header, manifest, stage_dir)
                if staged is not None:
                    result.staged[header.name] = staged
                header = stream.next_header()
            stream.finish()
        finally:
            bar.close()
    for entry in manifest.files:
        if entry.path.casefold() not in seen:
            raise bundle_error("listed in the manifest but missing from the bundle", entry.path)
    result.bundle_sha256 = whole.hexdigest()
    if validate_models and stage_dir is not None:
        check_contents(manifest, stage_dir)
    return result


def check_contents(manifest: BundleManifest, root: Path) -> None:
    """Validate each variant's model and the labels file of an unpacked bundle at ``root``.

    Raises :class:`BundleError` (:class:`~shared.errors.ModelValidationError` for a model).
    """
    for variant in manifest.variants:
        info = inspect_model(root / variant.file, variant.format, member=variant.file)
        if (info.inputs, info.outputs) != (variant.inputs, variant.outputs):
            raise bundle_error(
                "model inputs/outputs differ from those the manifest records", variant.file
            )
    labels = manifest.labels
    if labels is not None:
        path = root / labels.file
        if path.stat().st_size > MAX_LABELS_BYTES:
            raise bundle_error(f"labels file is over {MAX_LABELS_BYTES} bytes", labels.file)
        try:
            count = LabelsRef.count_labels(path.read_bytes())
        except ValueError as e:
            raise bundle_error(f"labels file unusable: {e}", labels.file) from e
        if count != labels.count:
            raise bundle_error(
                f"holds {count} labels, the manifest says {labels.count}", labels.file
            )
