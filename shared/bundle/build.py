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
import logging
import os
import secrets
import shutil
import tarfile
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, BinaryIO, Literal, TypeVar, cast

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
    ModelFormat,
    Preprocessing,
    Quantization,
    Variant,
    check_identifier,
    format_created,
)
from mcp_edge.shared.bundle.models import ModelInfo, detect_format, inspect_model, run_model
from mcp_edge.shared.bundle.quantize import (
    INT8_TAG,
    QUANTIZE_MODES,
    QuantizeMode,
    measure_quantized,
    quantize_int8,
    synthetic_samples,
)
from mcp_edge.shared.bundle.tarstream import CHUNK, bundle_error
from mcp_edge.shared.bundle.verify import VerifiedBundle
from mcp_edge.shared.errors import BundleError, VersionError
from mcp_edge.shared.fsutil import fsync_dir
from mcp_edge.shared.signing import PrivateKey, canonical_json, make_signature
from mcp_edge.shared.version import SemVer

LABELS_MEMBER = "labels.txt"
QUANTIZE_CHOICES = ("int8",)
"""What ``build_bundle(quantize=...)`` accepts."""
_log = logging.getLogger(__name__)
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


def _variant(
    tag: str,
    source: _Source,
    info: ModelInfo,
    profiles: tuple[str, ...],
    quantization: Quantization | None = None,
) -> Variant:
    return Variant(
        tag=tag,
        file=source.member,
        format=info.format,
        sha256=source.sha256,
        size=source.size,
        profiles=profiles,
        inputs=info.inputs,
        outputs=info.outputs,
        quantization=quantization,
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


def _load_samples(path: Path, what: str = "baseline samples") -> np.ndarray[Any, Any]:
    try:
        samples = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise BundleError(f"{path}: cannot load {what} (.npy, no pickles): {e}") from e
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
    quantize: str | None = None,
    quantize_mode: str | None = None,
    calibration_labels: Path | str | None = None,
) -> BundleManifest:
    """Validate ``model_path`` (and each variant), record what they are, write ``out_path``.

    ``variants`` maps a tag (not ``default``) to its file and the profiles it fits (the tag
    itself when none are given). ``baseline_npy`` holds samples ``[N, ...]`` for the single
    input; the model is run on them for the output baseline. ``metadata`` adds to (and
    overrides) the ONNX model's own metadata_props. ``created`` defaults to now (UTC).

    ``quantize="int8"`` adds the variant ``int8`` (``models/model.int8.onnx``, profile
    ``int8``) quantized from the ONNX default model by
    :func:`~shared.bundle.quantize.quantize_int8`, with its measured cost in
    ``quantization``: ``quantize_mode`` "static"
    (calibrated on the baseline samples, which it needs) or "dynamic"; by default static when
    ``baseline_npy`` is given, else dynamic. The figures are measured on the baseline samples
    (on :data:`~shared.bundle.quantize.SYNTHETIC_SAMPLES` seeded uniform [0, 1) inputs when
    there are none); ``calibration_labels`` (``.npy``, one integer class per baseline sample)
    adds ``accuracy_delta``.
    Raises :class:`BundleError` (:class:`~shared.errors.ModelValidationError` for a model
    that fails its checks).
    """
    limits = limits or BundleLimits()
    variants = dict(variants or {})
    _check_inputs(name, version, variants)
    model_path = Path(model_path)
    fmt = detect_format(model_path)
    mode = _check_quantize(quantize, quantize_mode, fmt, variants, baseline_npy, calibration_labels)
    info = inspect_model(model_path, fmt)
    work = Path(tempfile.mkdtemp(prefix=".quantize-", dir=Path(out_path).parent)) if mode else None
    try:
        return _build(
            model_path,
            Path(out_path),
            fmt,
            info,
            name=name,
            version=version,
            labels_path=labels_path,
            variants=variants,
            baseline_npy=baseline_npy,
            preprocessing=preprocessing,
            constraints=constraints,
            metadata=metadata,
            created=created,
            limits=limits,
            progress=progress,
            quantize=(mode, work, calibration_labels) if mode and work else None,
        )
    finally:
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)


def _check_quantize(
    quantize: str | None,
    quantize_mode: str | None,
    fmt: str,
    variants: Mapping[str, VariantSource],
    baseline_npy: Path | str | None,
    calibration_labels: Path | str | None,
) -> QuantizeMode | None:
    """The quantization mode to use (None: no quantized variant), or a clear BundleError."""
    if quantize is None:
        if quantize_mode is not None or calibration_labels is not None:
            raise BundleError("a quantization mode or baseline labels need --quantize int8")
        return None
    if quantize not in QUANTIZE_CHOICES:
        raise BundleError(
            f"cannot quantize to {quantize!r}; supported: {', '.join(QUANTIZE_CHOICES)}"
        )
    if fmt != "onnx":
        raise BundleError(
            f"--quantize {quantize} quantizes an ONNX default model with onnxruntime; "
            f"the default model is {fmt}"
        )
    if INT8_TAG in variants:
        raise BundleError(
            f"the bundle already has a variant tagged {INT8_TAG!r}; drop it or --quantize"
        )
    if calibration_labels is not None and baseline_npy is None:
        raise BundleError("baseline labels need the baseline samples they label (--baseline)")
    mode = quantize_mode or ("static" if baseline_npy is not None else "dynamic")
    if mode not in QUANTIZE_MODES:
        raise BundleError(f"unknown quantization mode {mode!r}; use static or dynamic")
    if mode == "static" and baseline_npy is None:
        raise BundleError(
            "static INT8 quantization calibrates on the baseline samples; pass --baseline "
            "SAMPLES.npy (or --quantize-mode dynamic)"
        )
    return "static" if mode == "static" else "dynamic"


def _int8_variant(
    model_path: Path,
    info: ModelInfo,
    mode: QuantizeMode,
    work: Path,
    baseline_npy: Path | str | None,
    labels_npy: Path | str | None,
    limits: BundleLimits,
    progress: bool,
) -> tuple[Variant, _Source]:
    if len(info.inputs) != 1:
        raise BundleError("--quantize needs a model with exactly one input")
    spec = info.inputs[0]
    samples = _load_samples(Path(baseline_npy)) if baseline_npy is not None else None
    labels = None
    if labels_npy is not None:
        labels = _load_samples(Path(labels_npy), "baseline labels")
        count = samples.shape[0] if samples is not None and samples.ndim else 0
        if labels.ndim != 1 or labels.dtype.kind not in "iu" or labels.shape[0] != count:
            raise BundleError(
                f"{labels_npy}: baseline labels must be one integer class per baseline sample: "
                f"{count} samples, labels of shape {list(labels.shape)} ({labels.dtype})"
            )
    path = quantize_int8(
        model_path,
        work / "model.int8.onnx",
        mode=mode,
        calibration=samples if mode == "static" else None,
        input_name=spec.name,
    )
    qinfo = inspect_model(path, "onnx", member=f"models/model.{INT8_TAG}.onnx")
    measured = samples if samples is not None else synthetic_samples(spec)
    scheme: Literal["int8-dynamic", "int8-static"] = (
        "int8-static" if mode == "static" else "int8-dynamic"
    )
    figures = measure_quantized(
        model_path, path, measured, labels, scheme=scheme, reference_tag=DEFAULT_TAG
    )
    if samples is None:
        figures = figures.model_copy(update={"measured_on": "synthetic"})
    _log.info("%s", describe_quantization(INT8_TAG, figures))
    source = _hash_file(path, f"models/model.{INT8_TAG}.onnx", limits, progress)
    return _variant(INT8_TAG, source, qinfo, (INT8_TAG,), figures), source


def describe_quantization(tag: str, q: Quantization) -> str:
    """One line of what was measured, e.g. ``int8 (static): top-1 agreement 99.4 % on 200
    samples, accuracy -0.3 points, max |Δ| 0.021``."""
    return f"{tag} ({q.scheme.removeprefix('int8-')}): {quantization_figures(q)}"


def quantization_figures(q: Quantization) -> str:
    """The measured part of :func:`describe_quantization`: agreement, accuracy, max |Δ|."""
    kind = "samples" if q.measured_on == "samples" else "synthetic inputs"
    text = f"top-1 agreement {100 * q.top1_agreement:.1f} % on {q.samples} {kind}"
    if q.accuracy_delta is not None:
        text += f", accuracy {q.accuracy_delta:+.1f} points"
    return text + f", max |Δ| {q.max_abs_diff:.3g}"


def _build(
    model_path: Path,
    out_path: Path,
    fmt: ModelFormat,
    info: ModelInfo,
    *,
    name: str,
    version: str,
    labels_path: Path | str | None,
    variants: Mapping[str, VariantSource],
    baseline_npy: Path | str | None,
    preprocessing: Preprocessing | Mapping[str, Any] | None,
    constraints: Constraints | Mapping[str, Any] | None,
    metadata: Mapping[str, str] | None,
    created: datetime | None,
    limits: BundleLimits,
    progress: bool,
    quantize: tuple[QuantizeMode, Path, Path | str | None] | None,
) -> BundleManifest:
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
    if quantize is not None:
        mode, work, labels_npy = quantize
        variant, source = _int8_variant(
            model_path, info, mode, work, baseline_npy, labels_npy, limits, progress
        )
        built.append(variant)
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
