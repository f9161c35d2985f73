"""Writing bundles: build one from model files, sign one.

Bundles are written deterministically (ustar, members in a fixed order — ``manifest.json``,
``manifest.sig`` when signed, then the files sorted by path — mtime 0, uid/gid 0, no owner
names, mode 0644), so the same inputs give the same bytes except for ``created``. Each write
goes to a temporary file beside the destination, is fsynced, re-read by the strict reader
(:func:`~shared.bundle.archive.scan_bundle`) and only then renamed into place: a bundle this
module writes is one the reader accepts, and a crash leaves the old file or the new one.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import secrets
import shutil
import tarfile
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, BinaryIO, TypeVar, cast

import numpy as np
from pydantic import BaseModel, ValidationError

from mcp_edge.shared.bundle._progress import Progress, progress_bar
from mcp_edge.shared.bundle.archive import (
    BundleLimits,
    load_strict_json,
    scan_bundle,
    validation_summary,
)
from mcp_edge.shared.bundle.baseline import BaselineError, compute_baseline
from mcp_edge.shared.bundle.manifest import (
    ANY_PROFILE,
    DEFAULT_TAG,
    MANIFEST_NAME,
    MAX_LABELS_BYTES,
    SCHEMA_VERSION,
    SIGNATURE_NAME,
    BundleManifest,
    Constraints,
    DriftBaseline,
    FileEntry,
    LabelsRef,
    Preprocessing,
    Variant,
    check_identifier,
    format_created,
)
from mcp_edge.shared.bundle.models import ModelInfo, detect_format, inspect_model, run_model
from mcp_edge.shared.bundle.tarstream import CHUNK, bundle_error
from mcp_edge.shared.bundle.verify import VerifiedBundle
from mcp_edge.shared.errors import BundleError, VersionError
from mcp_edge.shared.fsutil import fsync_dir
from mcp_edge.shared.signing import PrivateKey, canonical_json, make_signature
from mcp_edge.shared.version import SemVer

LABELS_MEMBER = "labels.txt"
_M = TypeVar("_M", bound=BaseModel)


@dataclass(frozen=True)
class VariantSource:
    """A variant to build: its model file and the hardware profiles it fits."""

    path: Path
    profiles: tuple[str, ...] = ()


@dataclass(frozen=True)
class _Source:
    member: str
    path: Path
    sha256: str
    size: int


def _hash_file(path: Path, member: str, limits: BundleLimits, progress: bool) -> _Source:
    size = path.stat().st_size
    if size > limits.max_member_bytes:
        raise bundle_error(
            f"{path} is {size} bytes, over the member cap of {limits.max_member_bytes}", member
        )
    digest = hashlib.sha256()
    bar = progress_bar(size, f"hash {path.name}", progress)
    try:
        with open(path, "rb") as f:
            while chunk := f.read(CHUNK):
                digest.update(chunk)
                bar.update(len(chunk))
    finally:
        bar.close()
    return _Source(member, path, digest.hexdigest(), size)


def _schema(cls: type[_M], value: _M | Mapping[str, Any] | None, what: str) -> _M | None:
    """Validate a caller's dict with JSON semantics (lists become tuples), or pass a model."""
    if value is None or isinstance(value, cls):
        return value
    try:
        return cls.model_validate_json(json.dumps(dict(value), allow_nan=False))
    except ValidationError as e:
        raise BundleError(f"invalid {what}: {validation_summary(e)}") from e
    except (TypeError, ValueError) as e:
        raise BundleError(f"invalid {what}: {e}") from e


def _variant(tag: str, source: _Source, info: ModelInfo, profiles: tuple[str, ...]) -> Variant:
    return Variant(
        tag=tag,
        file=source.member,
        format=info.format,
        sha256=source.sha256,
        size=source.size,
        profiles=profiles,
        inputs=info.inputs,
        outputs=info.outputs,
    )


def _check_inputs(name: str, version: str, variants: Mapping[str, VariantSource]) -> None:
    try:
        check_identifier(name, "bundle name")
        SemVer.parse(version)
        for tag, spec in variants.items():
            check_identifier(tag, "variant tag")
            if tag == DEFAULT_TAG:
                raise ValueError(f"the {DEFAULT_TAG!r} variant is the main model; pick another tag")
            for profile in spec.profiles:
                check_identifier(profile, f"profile of variant {tag!r}")
    except (ValueError, VersionError) as e:
        raise BundleError(str(e)) from e


def _load_samples(path: Path) -> np.ndarray[Any, Any]:
    try:
        samples = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise BundleError(f"{path}: cannot load baseline samples (.npy, no pickles): {e}") from e
    if not isinstance(samples, np.ndarray):
        raise BundleError(f"{path}: expected one array in a .npy file")
    return samples


def _baseline(path: Path, info: ModelInfo, samples_path: Path) -> DriftBaseline:
    if len(info.inputs) != 1:
        raise BundleError("a drift baseline needs a model with exactly one input")
    samples = _load_samples(samples_path)
    spec = info.inputs[0]
    try:
        outputs = run_model(path, info.format, spec, samples) if samples.size else {}
        scores = [
            (name, value)
            for name, value in outputs.items()
            if value.ndim == 2 and value.shape[1] >= 2 and value.dtype.kind == "f"
        ]
        name, value = scores[0] if scores else (None, None)
        return compute_baseline(spec.name, samples, output_name=name, scores=value)
    except BaselineError as e:
        raise BundleError(f"{samples_path}: {e}") from e


def build_bundle(
    model_path: Path | str,
    out_path: Path | str,
    *,
    name: str,
    version: str,
    labels_path: Path | str | None = None,
    variants: Mapping[str, VariantSource] | None = None,
    baseline_npy: Path | str | None = None,
    preprocessing: Preprocessing | Mapping[str, Any] | None = None,
    constraints: Constraints | Mapping[str, Any] | None = None,
    metadata: Mapping[str, str] | None = None,
    created: datetime | None = None,
    limits: BundleLimits | None = None,
    progress: bool = False,
) -> BundleManifest:
    """Validate ``model_path`` (and each variant), record what they are, write ``out_path``.

    ``variants`` maps a tag (not ``default``) to its file and the profiles it fits (the tag
    itself when none are given). ``baseline_npy`` holds samples ``[N, ...]`` for the single
    input; the model is run on them for the output baseline. ``metadata`` adds to (and
    overrides) the ONNX model's own metadata_props. ``created`` defaults to now (UTC).
    Raises :class:`BundleError` (:class:`~shared.errors.ModelValidationError` for a model
    that fails its checks).
    """
    limits = limits or BundleLimits()
    variants = dict(variants or {})
    _check_inputs(name, version, variants)
    model_path = Path(model_path)
    fmt = detect_format(model_path)
    info = inspect_model(model_path, fmt)
    default = _hash_file(model_path, f"models/model.{fmt}", limits, progress)
    built = [_variant(DEFAULT_TAG, default, info, (ANY_PROFILE,))]
    sources = [default]
    for tag in sorted(variants):
        spec = variants[tag]
        vpath = Path(spec.path)
        vfmt = detect_format(vpath)
        vinfo = inspect_model(vpath, vfmt)
        source = _hash_file(vpath, f"models/model.{tag}.{vfmt}", limits, progress)
        built.append(_variant(tag, source, vinfo, tuple(spec.profiles) or (tag,)))
        sources.append(source)
    labels = None
    if labels_path is not None:
        labels_source, labels = _labels(Path(labels_path), limits, progress)
        sources.append(labels_source)
    baseline = _baseline(model_path, info, Path(baseline_npy)) if baseline_npy else None
    merged = _schema(Constraints, constraints, "constraints") or Constraints()
    merged = merged.model_copy(update={"min_runtime": {**info.min_runtime, **merged.min_runtime}})
    try:
        manifest = BundleManifest(
            schema_version=SCHEMA_VERSION,
            name=name,
            version=version,
            format=fmt,
            created=format_created(created or datetime.now(timezone.utc)),
            inputs=info.inputs,
            outputs=info.outputs,
            preprocessing=_schema(Preprocessing, preprocessing, "preprocessing"),
            labels=labels,
            variants=tuple(built),
            files=tuple(
                FileEntry(path=s.member, sha256=s.sha256, size=s.size)
                for s in sorted(sources, key=lambda s: s.member)
            ),
            constraints=Constraints.model_validate_json(merged.model_dump_json()),
            metadata_props={**info.metadata_props, **(metadata or {})},
            drift_baseline=baseline,
        )
    except ValidationError as e:
        raise BundleError(f"invalid manifest: {validation_summary(e)}") from e
    manifest_bytes = encode_manifest(manifest)
    if len(manifest_bytes) > limits.max_manifest_bytes:
        raise bundle_error(
            f"{len(manifest_bytes)} bytes is over the cap of {limits.max_manifest_bytes}",
            MANIFEST_NAME,
        )
    members: list[tuple[str, bytes | Path]] = [(MANIFEST_NAME, manifest_bytes)]
    members += [(s.member, s.path) for s in sorted(sources, key=lambda s: s.member)]
    _write_bundle(Path(out_path), members, limits=limits, check_key=None, progress=progress)
    return manifest


def _labels(path: Path, limits: BundleLimits, progress: bool) -> tuple[_Source, LabelsRef]:
    source = _hash_file(path, LABELS_MEMBER, limits, progress)
    try:
        with open(path, "rb") as f:
            count = LabelsRef.count_labels(f.read(MAX_LABELS_BYTES + 1))
    except ValueError as e:
        raise BundleError(f"{path}: labels must be UTF-8 text, one label per line: {e}") from e
    return source, LabelsRef(file=LABELS_MEMBER, count=count)


def encode_manifest(manifest: BundleManifest) -> bytes:
    """manifest.json's bytes: the canonical JSON that gets signed, plus a final newline.

    Storing the canonical form means the signature covers manifest.json byte for byte:
    any change to the file, even whitespace, is refused by the reader.
    """
    return canonical_json(manifest.to_json_dict()) + b"\n"


def sign_bundle(
    path: Path | str,
    key: PrivateKey,
    out_path: Path | str | None = None,
    *,
    limits: BundleLimits | None = None,
    validate_models: bool = True,
    progress: bool = False,
) -> VerifiedBundle:
    """Add (or replace) ``manifest.sig`` and rewrite the bundle atomically.

    The bundle is fully checked first (hashes, structure, models unless ``validate_models``
    is false; an existing signature is ignored), so a tampered bundle is never signed. The
    result goes to ``out_path`` (default: over ``path``). Raises :class:`BundleError`.
    """
    path = Path(path)
    out = Path(out_path) if out_path is not None else path
    limits = limits or BundleLimits()
    stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.sign-", dir=out.parent))
    try:
        result = scan_bundle(
            path,
            signature="ignore",
            limits=limits,
            stage_dir=stage,
            validate_models=validate_models,
            progress=progress,
        )
        doc = load_strict_json(result.manifest_bytes, MANIFEST_NAME)
        signature = canonical_json(make_signature(canonical_json(doc), key)) + b"\n"
        members: list[tuple[str, bytes | Path]] = [
            (MANIFEST_NAME, result.manifest_bytes),
            (SIGNATURE_NAME, signature),
        ]
        members += [
            (f.path, result.staged[f.path])
            for f in sorted(result.manifest.files, key=lambda f: f.path)
        ]
        _write_bundle(out, members, limits=limits, check_key=key, progress=progress)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return VerifiedBundle(
        result.manifest, key.keyid, key.keyid, _sha256_of(out), out.stat().st_size
    )


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


class _CountingReader:
    """A file wrapper that advances a progress bar by what is read through it."""

    def __init__(self, f: BinaryIO, bar: Progress) -> None:
        self._f, self._bar = f, bar

    def read(self, n: int = -1) -> bytes:
        data = self._f.read(n)
        self._bar.update(len(data))
        return data


def _tar_info(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = size, 0, 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.type = tarfile.REGTYPE
    return info


def write_tar(path: Path, members: Sequence[tuple[str, bytes | Path]], progress: bool) -> None:
    """Write ``members`` (bytes or a file to copy) as a deterministic ustar file, fsynced."""
    total = sum(len(s) if isinstance(s, bytes) else s.stat().st_size for _, s in members)
    bar = progress_bar(total, f"write {path.name}", progress)
    try:
        with open(path, "xb") as f:
            with tarfile.open(fileobj=f, mode="w", format=tarfile.USTAR_FORMAT) as tar:
                for name, source in members:
                    if isinstance(source, bytes):
                        tar.addfile(_tar_info(name, len(source)), io.BytesIO(source))
                        bar.update(len(source))
                        continue
                    with open(source, "rb") as src:
                        size = os.fstat(src.fileno()).st_size
                        reader = cast(BinaryIO, _CountingReader(src, bar))
                        tar.addfile(_tar_info(name, size), reader)
            f.flush()
            os.fsync(f.fileno())
    finally:
        bar.close()


def _write_bundle(
    out: Path,
    members: Sequence[tuple[str, bytes | Path]],
    *,
    limits: BundleLimits,
    check_key: PrivateKey | None,
    progress: bool,
) -> None:
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        write_tar(tmp, members, progress)
        # Re-read what was written: catches a source file that changed after it was hashed.
        scan_bundle(
            tmp,
            trusted_keys=[check_key.public_key] if check_key else (),
            signature="require" if check_key else "ignore",
            limits=limits,
            validate_models=False,
        )
        os.chmod(tmp, 0o644)
        os.replace(tmp, out)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(out.parent)
