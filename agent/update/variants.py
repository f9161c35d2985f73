"""Which variants of a bundle this device may run, best first (docs/updates.md "Variants").

:func:`rank_variants` orders a manifest's variants for a hardware profile:

1. the variants that list the profile by name (in manifest order);
2. then those whose tag is in the profile's ``variants.tags``, in that order;
3. then ``default``.

Only variants in a format the profile runs (``runtime.formats``) are kept; a variant whose
``backend`` names a backend this device lacks is skipped, with the reason kept for the
deployment's events. Variants fitting none of the three rules are not candidates.

Whether a backend is present is asked of ``backend_available(name) -> str | None`` (None: it is
there; a string: why it is not); on a device that is
:func:`agent.runtime.loader.backend_available` (:func:`backend_check`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mcp_edge.shared.bundle.manifest import DEFAULT_TAG, BundleManifest, Variant
from mcp_edge.shared.profiles import HardwareProfile

BackendCheck = Callable[[str], "str | None"]
"""``backend name → None`` when the device has it, else the reason it does not."""


@dataclass(frozen=True)
class Ranking:
    """The candidates, best first, and the variants left out with the reason for each."""

    candidates: tuple[Variant, ...]
    skipped: tuple[tuple[str, str], ...]
    """``(tag, reason)`` of each variant that fits the profile but cannot run here."""

    def describe_skipped(self) -> str:
        """One line for an event: ``variant x skipped: ...; variant y skipped: ...``."""
        return "; ".join(f"variant {tag} skipped: {why}" for tag, why in self.skipped)


def rank_variants(
    manifest: BundleManifest, profile: HardwareProfile, backend_available: BackendCheck
) -> Ranking:
    """Order the manifest's variants for ``profile`` (see the module docstring)."""
    ordered: list[Variant] = [v for v in manifest.variants if profile.name in v.profiles]
    by_tag = {v.tag: v for v in manifest.variants}
    for tag in [*profile.variants.tags, DEFAULT_TAG]:
        v = by_tag.get(tag)
        if v is not None and v not in ordered:
            ordered.append(v)
    formats = set(profile.runtime.formats)
    candidates: list[Variant] = []
    skipped: list[tuple[str, str]] = []
    problems: dict[str, str | None] = {}
    for v in ordered:
        if v.format not in formats:
            skipped.append((v.tag, f"format {v.format} is not one profile {profile.name} runs "
                                   f"({', '.join(sorted(formats))})"))  # fmt: skip
            continue
        if v.backend is not None:
            if v.backend not in problems:
                problems[v.backend] = backend_available(v.backend)
            problem = problems[v.backend]
            if problem is not None:
                skipped.append((v.tag, f"it needs backend {v.backend}: {problem}"))
                continue
        candidates.append(v)
    return Ranking(tuple(candidates), tuple(skipped))


def variant_candidates(
    manifest: BundleManifest, profile: HardwareProfile, backend_available: BackendCheck
) -> list[Variant]:
    """The variants this device may run, best first (:func:`rank_variants` without reasons)."""
    return list(rank_variants(manifest, profile, backend_available).candidates)


def backend_check() -> BackendCheck:
    """The device's backend check: :func:`agent.runtime.loader.backend_available`."""
    from mcp_edge.agent.runtime.loader import backend_available

    return backend_available


__all__ = [
    "BackendCheck",
    "Ranking",
    "backend_check",
    "rank_variants",
    "variant_candidates",
]
