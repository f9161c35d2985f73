"""The schema of ``manifest.json``, the description every ``.mcpb`` bundle carries.

One pydantic model per JSON object; all are frozen and refuse unknown fields, so a manifest
either describes the bundle completely or fails to load. Cross-field rules (exactly one
``default`` variant, every variant and the labels file listed in ``files`` with the same hash,
top-level signature equal to the default variant's) live in :class:`BundleManifest`'s
validator. ``docs/bundle-format.md`` documents every field.
"""

from __future__ import annotations

import math
import re
from datetime import datetime, timezone
from itertools import pairwise
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    model_validator,
)

from mcp_edge.shared.errors import VersionError
from mcp_edge.shared.version import SemVer

SCHEMA_VERSION: Literal[1] = 1
MANIFEST_NAME = "manifest.json"
SIGNATURE_NAME = "manifest.sig"
RESERVED_NAMES = frozenset({MANIFEST_NAME, SIGNATURE_NAME})
DEFAULT_TAG = "default"
ANY_PROFILE = "*"
MAX_MEMBER_NAME = 200
MAX_LABELS_BYTES = 16 << 20

ModelFormat = Literal["onnx", "tflite"]
"""Model file formats a bundle may carry."""

Datatype = Literal[
    "BOOL",
    "UINT8",
    "UINT16",
    "UINT32",
    "UINT64",
    "INT8",
    "INT16",
    "INT32",
    "INT64",
    "FP16",
    "BF16",
    "FP32",
    "FP64",
    "BYTES",
]
"""Tensor element types, named as the Open Inference Protocol (KServe v2) names them."""

_IDENT = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")
_COMPONENT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,99}")
_RFC3339_UTC = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d{1,6})?Z")


def check_identifier(value: str, what: str = "name") -> str:
    """Return ``value`` if it matches ``^[a-z0-9][a-z0-9._-]{0,63}$``; raise ValueError if not."""
    if _IDENT.fullmatch(value) is None:
        raise ValueError(
            f"invalid {what} {value!r:.80}: use 1-64 characters of a-z 0-9 . _ -, "
            "starting with a letter or digit"
        )
    return value


def member_name_problem(name: str) -> str | None:
    """Why ``name`` is not a safe bundle member path, or None when it is.

    A safe name is relative, uses ``/`` only, and has components of ``[A-Za-z0-9._-]`` that
    start with a letter, digit or ``_`` (so no ``.``, ``..`` or hidden files).
    """
    if not name:
        return "empty member name"
    if "\\" in name:
        return "backslash in member name"
    if "\x00" in name:
        return "NUL byte in member name"
    if name.startswith("/"):
        return "absolute member path"
    if len(name) > MAX_MEMBER_NAME:
        return f"member name longer than {MAX_MEMBER_NAME} characters"
    for part in name.split("/"):
        if part == "..":
            return "'..' in member path (path traversal)"
        if part in ("", "."):
            return "empty or '.' component in member path"
        if _COMPONENT.fullmatch(part) is None:
            return f"member path component {part!r:.40} is not [A-Za-z0-9._-] starting alphanumeric"
    return None


def _member_name(value: str) -> str:
    problem = member_name_problem(value)
    if problem is not None:
        raise ValueError(f"{value!r:.80}: {problem}")
    if value in RESERVED_NAMES:
        raise ValueError(f"{value!r} is reserved for the bundle's own metadata")
    return value


def _semver(value: str) -> str:
    try:
        SemVer.parse(value)
    except VersionError as e:
        raise ValueError(str(e)) from e
    return value


def _rfc3339_utc(value: str) -> str:
    if _RFC3339_UTC.fullmatch(value) is None:
        raise ValueError(f"{value!r:.40} is not an RFC 3339 UTC time like 2024-05-01T12:00:00Z")
    datetime.fromisoformat(value[:-1])  # rejects impossible dates such as month 13
    return value


def _finite(value: float) -> float:
    if not math.isfinite(value):
        raise ValueError("must be a finite number")
    return value


Identifier = Annotated[str, AfterValidator(check_identifier)]
MemberName = Annotated[str, AfterValidator(_member_name)]
Sha256Hex = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
VersionText = Annotated[str, StringConstraints(max_length=128), AfterValidator(_semver)]
Timestamp = Annotated[str, AfterValidator(_rfc3339_utc)]
Finite = Annotated[float, AfterValidator(_finite)]
ProfileName = Annotated[str, StringConstraints(pattern=r"^(\*|[a-z0-9][a-z0-9._-]{0,63})$")]
ShortText = Annotated[str, StringConstraints(max_length=4096)]


def format_created(when: datetime) -> str:
    """RFC 3339 UTC form used for ``created`` (second precision, ``Z`` suffix)."""
    if when.tzinfo is None:
        raise ValueError("created time must be timezone-aware")
    return when.astimezone(timezone.utc).replace(microsecond=0).strftime("%Y-%m-%dT%H:%M:%SZ")


class _Schema(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class TensorSpec(_Schema):
    """One model input or output: name, OIP datatype, shape (-1 for a dynamic dimension)."""

    name: Annotated[str, StringConstraints(min_length=1, max_length=256)]
    datatype: Datatype
    shape: tuple[Annotated[int, Field(ge=-1)], ...] = Field(max_length=16)


class Preprocessing(_Schema):
    """How a client turns raw data into the model's input (informative; the agent may apply it).

    ``kind`` "image": ``size`` is [height, width]; pixels are multiplied by ``scale``, then
    ``(x - mean) / std`` per channel (one value applies to all channels); ``grayscale``
    converts to one channel first; ``layout`` says how the tensor is arranged (``flat`` is
    one row of height*width*channels values). ``kind`` "tensor": data is already numeric and
    only ``scale``/``mean``/``std`` apply.
    """

    kind: Literal["image", "tensor"]
    layout: Literal["NCHW", "NHWC", "flat"] | None = None
    size: (
        tuple[Annotated[int, Field(ge=1, le=65536)], Annotated[int, Field(ge=1, le=65536)]] | None
    ) = None
    scale: Finite | None = None
    mean: tuple[Finite, ...] | None = Field(default=None, min_length=1, max_length=4)
    std: tuple[Annotated[float, Field(gt=0), AfterValidator(_finite)], ...] | None = Field(
        default=None, min_length=1, max_length=4
    )
    grayscale: bool = False


class LabelsRef(_Schema):
    """The class names file: UTF-8 text, one label per line, ``count`` non-empty lines."""

    file: MemberName
    count: int = Field(ge=0)

    @staticmethod
    def count_labels(data: bytes) -> int:
        """Number of non-empty lines; raises ValueError for non-UTF-8 or oversized data."""
        if len(data) > MAX_LABELS_BYTES:
            raise ValueError(f"labels file is over {MAX_LABELS_BYTES} bytes")
        return sum(1 for line in data.decode("utf-8").splitlines() if line.strip())


class FileEntry(_Schema):
    """A member of the bundle other than manifest.json / manifest.sig."""

    path: MemberName
    sha256: Sha256Hex
    size: int = Field(ge=0)


class Quantization(_Schema):
    """How a quantized variant was made from another variant, and what it cost in accuracy.

    Measured by ``mcp-bundle build --quantize`` on the calibration samples (the drift
    baseline's samples): both models run on every sample and their answers are compared.
    """

    scheme: Literal["int8-dynamic", "int8-static"]
    reference: Identifier
    """The tag of the variant it was quantized from (the FP32 model)."""
    samples: int = Field(ge=1)
    """How many samples the figures below were measured on."""
    measured_on: Literal["samples", "synthetic"] = "samples"
    """``samples``: the build's baseline samples; ``synthetic``: seeded random inputs (a
    dynamic quantization built without ``--baseline``), a weaker measure of real accuracy."""
    top1_agreement: Finite = Field(ge=0, le=1)
    """Share of samples whose arg-max output equals the reference's."""
    max_abs_diff: Finite = Field(ge=0)
    """Largest absolute difference of any output value against the reference."""
    accuracy_delta: Finite | None = None
    """Top-1 accuracy in points (quantized minus reference) on labelled samples, when the
    build was given their labels; None otherwise."""


class Variant(_Schema):
    """One model file and the hardware profiles it suits, with the I/O signature it has."""

    tag: Identifier
    file: MemberName
    format: ModelFormat
    sha256: Sha256Hex
    size: int = Field(ge=0)
    profiles: tuple[ProfileName, ...] = Field(min_length=1, max_length=64)
    inputs: tuple[TensorSpec, ...] = Field(min_length=1, max_length=64)
    outputs: tuple[TensorSpec, ...] = Field(min_length=1, max_length=64)
    backend: Identifier | None = None
    """The one backend this file is made for (``openvino``, ``tensorrt``, ``onnxruntime``,
    ``tflite``...); None: any backend that runs its format. A device without that backend
    skips the variant."""
    quantization: Quantization | None = None
    """Set on a quantized variant: how it was made and its measured accuracy cost."""


_OPTIONAL_VARIANT_FIELDS = ("backend", "quantization")
"""Left out of manifest.json when None, so manifests without them keep their exact bytes."""


class Constraints(_Schema):
    """Where the model can run: memory it needs, chips it prefers, runtimes it needs."""

    min_memory_mb: int | None = Field(default=None, ge=0)
    chip_affinity: tuple[Identifier, ...] = Field(default=(), max_length=32)
    min_runtime: dict[Identifier, int | str] = Field(default_factory=dict, max_length=32)


class Histogram(_Schema):
    """Counts on fixed bins. ``edges`` has one more entry than ``counts`` and increases strictly.

    Values below ``edges[0]`` count in the first bin and values above ``edges[-1]`` in the
    last, so every observation lands in a bin (see :func:`shared.bundle.baseline.bin_counts`).
    """

    edges: tuple[Finite, ...] = Field(min_length=2, max_length=257)
    counts: tuple[Annotated[int, Field(ge=0)], ...] = Field(min_length=1, max_length=256)

    @model_validator(mode="after")
    def _check(self) -> Histogram:
        if len(self.edges) != len(self.counts) + 1:
            raise ValueError("a histogram needs exactly one more edge than counts")
        if any(b <= a for a, b in pairwise(self.edges)):
            raise ValueError("histogram edges must increase strictly")
        return self


class FeatureBaseline(_Schema):
    """Statistics of one input feature (or one per-sample summary) over the baseline samples."""

    name: Annotated[str, StringConstraints(min_length=1, max_length=128)]
    histogram: Histogram
    mean: Finite
    std: Finite
    min: Finite
    max: Finite


class OutputBaseline(_Schema):
    """What the model answered on the baseline samples: class shares and confidence."""

    output: Annotated[str, StringConstraints(min_length=1, max_length=256)]
    class_counts: tuple[Annotated[int, Field(ge=0)], ...] = Field(min_length=1, max_length=4096)
    confidence: Histogram


class DriftBaseline(_Schema):
    """Reference statistics drift is measured against (see docs/bundle-format.md)."""

    input: Annotated[str, StringConstraints(min_length=1, max_length=256)]
    sample_count: int = Field(ge=1)
    mode: Literal["per_feature", "summary"]
    feature_count: int = Field(ge=1)
    features: tuple[FeatureBaseline, ...] = Field(min_length=1, max_length=512)
    output: OutputBaseline | None = None
    projection_seed: int | None = Field(default=None, ge=0, le=2**32 - 1)
    """``summary`` mode: the seed of the random-projection sketch (features ``p0``..``p{k-1}``
    after ``sample_mean`` and ``sample_std``; see :func:`shared.bundle.baseline.projection_matrix`).
    None: no sketch (bundles built before it)."""
    projections: int = Field(default=0, ge=0, le=64)

    @model_validator(mode="after")
    def _sketch(self) -> DriftBaseline:
        names = [f.name for f in self.features]
        if len(set(names)) != len(names):
            raise ValueError("drift baseline features must have distinct names")
        if self.projections and (self.mode != "summary" or self.projection_seed is None):
            raise ValueError("a projection sketch needs summary mode and a projection_seed")
        if self.mode == "per_feature" and names != [f"f{i}" for i in range(self.feature_count)]:
            raise ValueError("per_feature baselines name their features f0..f{feature_count-1}")
        if self.mode == "summary":
            want = ["sample_mean", "sample_std", *(f"p{i}" for i in range(self.projections))]
            if names != want:
                raise ValueError(
                    "summary baselines name their features sample_mean, sample_std, p0..p{k-1}"
                )
        return self


class BundleManifest(_Schema):
    """``manifest.json``: what the bundle is, what it holds, and how to check it."""

    schema_version: Literal[1]
    name: Identifier
    version: VersionText
    format: ModelFormat
    created: Timestamp
    inputs: tuple[TensorSpec, ...] = Field(min_length=1, max_length=64)
    outputs: tuple[TensorSpec, ...] = Field(min_length=1, max_length=64)
    preprocessing: Preprocessing | None = None
    labels: LabelsRef | None = None
    variants: tuple[Variant, ...] = Field(min_length=1, max_length=32)
    files: tuple[FileEntry, ...] = Field(min_length=1, max_length=62)
    constraints: Constraints = Field(default_factory=Constraints)
    metadata_props: dict[
        Annotated[str, StringConstraints(min_length=1, max_length=256)], ShortText
    ] = Field(default_factory=dict, max_length=256)
    drift_baseline: DriftBaseline | None = None

    @model_validator(mode="after")
    def _check_consistency(self) -> BundleManifest:
        by_path = {f.path: f for f in self.files}
        if len(by_path) != len(self.files):
            raise ValueError("files lists the same path twice")
        folded = {p.casefold() for p in by_path}
        if len(folded) != len(by_path):
            raise ValueError("files lists paths that differ only in letter case")
        for path in by_path:
            parts = path.casefold().split("/")
            clash = next(
                (
                    "/".join(parts[:i])
                    for i in range(1, len(parts))
                    if "/".join(parts[:i]) in folded
                ),
                None,
            )
            if clash is not None:
                raise ValueError(f"{path!r} would need {clash!r}, a listed file, as a directory")
        tags = [v.tag for v in self.variants]
        if len(set(tags)) != len(tags):
            raise ValueError("two variants share a tag")
        if tags.count(DEFAULT_TAG) != 1:
            raise ValueError(f"exactly one variant must have the tag {DEFAULT_TAG!r}")
        if len({v.file for v in self.variants}) != len(self.variants):
            raise ValueError("two variants name the same file")
        for v in self.variants:
            entry = by_path.get(v.file)
            if entry is None:
                raise ValueError(f"variant {v.tag!r} names {v.file!r}, which files does not list")
            if (entry.sha256, entry.size) != (v.sha256, v.size):
                raise ValueError(f"variant {v.tag!r}: sha256/size differ from the files entry")
            if v.tag == DEFAULT_TAG and v.profiles != (ANY_PROFILE,):
                raise ValueError(f"the {DEFAULT_TAG!r} variant must have profiles ['*']")
            if v.tag != DEFAULT_TAG and ANY_PROFILE in v.profiles:
                raise ValueError(f"variant {v.tag!r}: only the default variant may use '*'")
        default = self.default_variant
        if (default.format, default.inputs, default.outputs) != (
            self.format,
            self.inputs,
            self.outputs,
        ):
            raise ValueError("format/inputs/outputs must equal those of the default variant")
        if self.labels is not None and self.labels.file not in by_path:
            raise ValueError(f"labels names {self.labels.file!r}, which files does not list")
        return self

    @property
    def default_variant(self) -> Variant:
        """The variant every device can fall back to."""
        return next(v for v in self.variants if v.tag == DEFAULT_TAG)

    def variant(self, tag: str) -> Variant:
        """The variant with ``tag``; raises KeyError if there is none."""
        for v in self.variants:
            if v.tag == tag:
                return v
        raise KeyError(tag)

    def file_entry(self, path: str) -> FileEntry:
        """The ``files`` entry for ``path``; raises KeyError if it is not listed."""
        for f in self.files:
            if f.path == path:
                return f
        raise KeyError(path)

    def variant_for_profiles(self, profiles: list[str] | tuple[str, ...]) -> Variant:
        """The first non-default variant listing one of ``profiles`` (in the caller's order of
        preference), else the default variant."""
        for profile in profiles:
            for v in self.variants:
                if v.tag != DEFAULT_TAG and profile in v.profiles:
                    return v
        return self.default_variant

    def to_json_dict(self) -> dict[str, object]:
        """The manifest as plain JSON values (what manifest.json holds and what is signed)."""
        doc: dict[str, object] = self.model_dump(mode="json")
        variants = doc["variants"]
        assert isinstance(variants, list)
        for v in variants:
            for key in _OPTIONAL_VARIANT_FIELDS:
                if v.get(key, 0) is None:
                    del v[key]
        return doc
