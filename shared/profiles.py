"""Hardware profile documents (``firmware_profiles/*.toml``): schema and loader.

The files ship inside the wheel as package data of ``firmware_profiles`` and are read through
``importlib.resources``, so they load the same from a checkout, an installed wheel or a zip.
Detection (which profile fits this box) belongs to the agent; this module only validates and
loads the documents.
"""

from __future__ import annotations

import sys
from importlib import resources
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from shared.errors import McpError
from shared.protocol.base import Identifier

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

PROFILE_PACKAGE = "firmware_profiles"


class ProfileError(McpError):
    """A profile file is missing or does not match the schema."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Detection(_Strict):
    """Facts a device must show for the profile to fit (all given lists must match)."""

    files_present: list[str] = Field(default_factory=list)
    device_tree_model_contains: list[str] = Field(default_factory=list)
    cpuinfo_model_contains: list[str] = Field(default_factory=list)
    cpu_flags_noted: list[str] = Field(default_factory=list)
    arch: list[str] = Field(default_factory=list)
    os: list[str] = Field(default_factory=list)
    min_l4t_release: int | None = None


class BackendSpec(_Strict):
    """One entry of the backend preference order."""

    name: str = Field(pattern=r"^(onnxruntime|tflite)$")
    provider: str
    options: dict[str, Any] = Field(default_factory=dict)
    opt_in: bool = False


class RuntimeSettings(_Strict):
    formats: list[str]
    intra_op_threads: int = Field(default=0, ge=0)
    inter_op_threads: int = Field(default=1, ge=0)
    allow_spinning: bool = True
    memory_budget_mb: int = Field(default=0, ge=0)
    memory_budget_fraction: float = Field(default=0.5, gt=0, le=1)
    backends: list[BackendSpec] = Field(min_length=1)


class TelemetrySettings(_Strict):
    sources: list[str] = Field(default_factory=list)


class VariantSettings(_Strict):
    tags: list[str] = Field(min_length=1)


class HardwareProfile(_Strict):
    name: Identifier
    description: str
    priority: int = 0
    detect: Detection
    runtime: RuntimeSettings
    telemetry: TelemetrySettings = Field(default_factory=TelemetrySettings)
    variants: VariantSettings


def parse_profile(text: str, source: str = "<profile>") -> HardwareProfile:
    """Parse one TOML profile; raise :class:`ProfileError` naming ``source`` on any problem."""
    try:
        return HardwareProfile.model_validate(tomllib.loads(text))
    except tomllib.TOMLDecodeError as e:
        raise ProfileError(f"{source}: not valid TOML: {e}") from e
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        loc = ".".join(str(p) for p in first["loc"])
        raise ProfileError(f"{source}: {loc}: {first['msg']}") from e


def load_profiles() -> dict[str, HardwareProfile]:
    """Every profile shipped in ``firmware_profiles``, by name, highest priority first."""
    found: list[HardwareProfile] = []
    for entry in resources.files(PROFILE_PACKAGE).iterdir():
        if entry.name.endswith(".toml"):
            profile = parse_profile(entry.read_text(encoding="utf-8"), entry.name)
            if f"{profile.name}.toml" != entry.name:
                raise ProfileError(f"{entry.name}: name {profile.name!r} must match the file name")
            found.append(profile)
    if not found:
        raise ProfileError(f"no profiles found in package {PROFILE_PACKAGE!r}")
    found.sort(key=lambda p: (-p.priority, p.name))
    return {p.name: p for p in found}
