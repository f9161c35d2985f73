"""Signed model bundles (``.mcpb``): build, sign, verify, open, inspect.

A bundle is an uncompressed POSIX ustar archive holding ``manifest.json``, optionally
``manifest.sig`` (Ed25519 over the canonical manifest) and the files the manifest lists with
their sha256 and size. ``docs/bundle-format.md`` is the reference.

Typical use::

    from mcp_edge.shared.bundle import build_bundle, sign_bundle, verify_bundle, open_bundle

    build_bundle("model.onnx", "digits-1.3.0.mcpb", name="digits", version="1.3.0")
    build_bundle("model.onnx", "digits-1.3.0.mcpb", name="digits", version="1.3.0",
                 baseline_npy="samples.npy", quantize="int8")   # + an INT8 variant
    sign_bundle("digits-1.3.0.mcpb", publisher_key)
    verified = verify_bundle("digits-1.3.0.mcpb", [publisher_key.public_key])
    opened = open_bundle("digits-1.3.0.mcpb", models_dir / "digits-1.3.0", trusted_keys)

Every failure is a :class:`~shared.errors.BundleError` whose ``member`` names the file at
fault (:class:`~shared.errors.ModelValidationError` for a model that fails its checks,
:class:`RuntimeUnavailableError` when the TFLite runtime is missing). onnx, onnxruntime and
the TFLite runtime are imported only when a model is validated or run.
"""

from mcp_edge.shared.bundle.archive import BundleLimits
from mcp_edge.shared.bundle.build import VariantSource, build_bundle, encode_manifest, sign_bundle
from mcp_edge.shared.bundle.manifest import (
    SCHEMA_VERSION,
    BundleManifest,
    Constraints,
    DriftBaseline,
    FeatureBaseline,
    FileEntry,
    Histogram,
    LabelsRef,
    OutputBaseline,
    Preprocessing,
    Quantization,
    TensorSpec,
    Variant,
)
from mcp_edge.shared.bundle.models import RuntimeUnavailableError
from mcp_edge.shared.bundle.quantize import measure_quantized, quantize_int8
from mcp_edge.shared.bundle.verify import (
    OpenedBundle,
    VerifiedBundle,
    inspect_bundle,
    open_bundle,
    verify_bundle,
)

__all__ = [
    "SCHEMA_VERSION",
    "BundleLimits",
    "BundleManifest",
    "Constraints",
    "DriftBaseline",
    "FeatureBaseline",
    "FileEntry",
    "Histogram",
    "LabelsRef",
    "OpenedBundle",
    "OutputBaseline",
    "Preprocessing",
    "Quantization",
    "RuntimeUnavailableError",
    "TensorSpec",
    "Variant",
    "VariantSource",
    "VerifiedBundle",
    "build_bundle",
    "encode_manifest",
    "inspect_bundle",
    "measure_quantized",
    "open_bundle",
    "quantize_int8",
    "sign_bundle",
    "verify_bundle",
]
