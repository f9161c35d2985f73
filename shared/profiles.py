"""Hardware profile documents (``firmware_profiles/*.toml``): schema and loader.

The files ship inside the wheel as package data of ``mcp_edge.firmware_profiles`` and are read through
``importlib.resources``, so they load the same from a checkout, an installed wheel or a zip.
Detection (which profile fits this box) belongs to the agent; this module only validates and
loads the documents.
"""

from __future__ import annotations

import dataclasses
import operator
import re
import sys
import types
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Union, get_args, get_origin, get_type_hints

from mcp_edge.shared.errors import McpError, TopicError
from mcp_edge.shared.protocol.topics import validate_id

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

PROFILE_PACKAGE = "mcp_edge.firmware_profiles"


class ProfileError(McpError):
    """A profile file is missing or does not match the schema."""


# The schema is plain frozen dataclasses checked by :func:`_build` (unknown keys, types, and
# the bounds in each field's metadata), not pydantic: every agent process loads a profile, and
# a serving agent otherwise never imports pydantic (about 10 MiB of RSS).


@dataclass(frozen=True)
class Detection:
    """Facts a device must show for the profile to fit (all given lists must match)."""

    files_present: list[str] = field(default_factory=list)
    device_tree_model_contains: list[str] = field(default_factory=list)
    cpuinfo_model_contains: list[str] = field(default_factory=list)
    cpu_flags_noted: list[str] = field(default_factory=list)
    arch: list[str] = field(default_factory=list)
    os: list[str] = field(default_factory=list)
    min_l4t_release: int | None = None


@dataclass(frozen=True)
class BackendSpec:
    """One entry of the backend preference order."""

    name: str = field(metadata={"pattern": r"onnxruntime|tflite|openvino"})
    """The runtime: ``onnxruntime`` (``provider`` is an execution provider), ``openvino``
    (the OpenVINO runtime reading ONNX itself; ``provider`` is its device: ``CPU``, ``GPU``,
    ``AUTO``) or ``tflite`` (``provider`` is ``XNNPACK`` or ``CPU``; ``options.implementation``
    may insist on ``ai-edge-litert`` or ``tflite-runtime``)."""
    provider: str
    options: dict[str, Any] = field(default_factory=dict)
    opt_in: bool = False


@dataclass(frozen=True)
class SelectionSettings:
    """Choosing by measurement at install: when a version offers several variants or
    backends that fit this device, time each on the warm-up inputs and keep the fastest that
    passes the output checks (``agent.runtime.selection``)."""

    measure: bool = False
    budget_s: float = field(default=10.0, metadata={"gt": 0, "le": 300})
    """Wall time the whole measurement may take; candidates left when it runs out are not tried."""
    max_candidates: int = field(default=4, metadata={"ge": 1, "le": 16})


@dataclass(frozen=True)
class RuntimeSettings:
    formats: list[str]
    backends: list[BackendSpec] = field(metadata={"min_length": 1})
    intra_op_threads: int = field(default=0, metadata={"ge": 0})
    inter_op_threads: int = field(default=1, metadata={"ge": 0})
    allow_spinning: bool = True
    memory_budget_mb: int = field(default=0, metadata={"ge": 0})
    memory_budget_fraction: float = field(default=0.5, metadata={"gt": 0, "le": 1})
    selection: SelectionSettings = field(default_factory=SelectionSettings)
    processes: int = field(default=1, metadata={"ge": 0, "le": 64})
    """Serving processes on the agent's ports (``mcp-agent serve/run --processes``), each with
    its own model instances; 0: one per four cores, from 1 to 8."""


@dataclass(frozen=True)
class TelemetrySettings:
    sources: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class VariantSettings:
    tags: list[str] = field(metadata={"min_length": 1})


@dataclass(frozen=True)
class HardwareProfile:
    name: str = field(metadata={"identifier": True})
    description: str
    detect: Detection
    runtime: RuntimeSettings
    variants: VariantSettings
    priority: int = 0
    telemetry: TelemetrySettings = field(default_factory=TelemetrySettings)

    def to_dict(self) -> dict[str, Any]:
        """The profile as plain JSON-able data (the TOML document's shape)."""
        return dataclasses.asdict(self)


def parse_profile(text: str, source: str = "<profile>") -> HardwareProfile:
    """Parse one TOML profile; raise :class:`ProfileError` naming ``source`` on any problem."""
    try:
        profile: HardwareProfile = _build(HardwareProfile, tomllib.loads(text), ())
        return profile
    except tomllib.TOMLDecodeError as e:
        raise ProfileError(f"{source}: not valid TOML: {e}") from e
    except _Invalid as e:
        loc = ".".join(str(p) for p in e.loc) or "document"
        raise ProfileError(f"{source}: {loc}: {e}") from e


class _Invalid(ValueError):
    def __init__(self, loc: tuple[str | int, ...], message: str) -> None:
        super().__init__(message)
        self.loc = loc


def _build(cls: Any, data: Any, loc: tuple[str | int, ...]) -> Any:
    if not isinstance(data, dict):
        raise _Invalid(loc, "must be a table")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            raise _Invalid((*loc, key), "unknown key")
    hints = get_type_hints(cls)
    values: dict[str, Any] = {}
    for name, f in fields.items():
        if name in data:
            values[name] = _value(hints[name], data[name], (*loc, name), f.metadata)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise _Invalid((*loc, name), "missing")
    return cls(**values)


_BOUNDS = {"ge": (">=", operator.ge), "gt": (">", operator.gt), "le": ("<=", operator.le)}


def _value(tp: Any, v: Any, loc: tuple[str | int, ...], meta: Any) -> Any:
    origin = get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, v, loc)
    if origin in (Union, types.UnionType):  # X | None: TOML has no null, so X
        (tp,) = [a for a in get_args(tp) if a is not type(None)]
        return _value(tp, v, loc, meta)
    if origin is list:
        if not isinstance(v, list):
            raise _Invalid(loc, "must be a list")
        if len(v) < meta.get("min_length", 0):
            raise _Invalid(loc, f"needs at least {meta['min_length']} item(s)")
        (item,) = get_args(tp)
        return [_value(item, x, (*loc, i), {}) for i, x in enumerate(v)]
    if origin is dict:
        if not isinstance(v, dict):
            raise _Invalid(loc, "must be a table")
        return dict(v)
    if tp is bool:
        if type(v) is not bool:
            raise _Invalid(loc, "must be a boolean")
        return v
    if tp is str:
        if type(v) is not str:
            raise _Invalid(loc, "must be a string")
        if "pattern" in meta and re.fullmatch(meta["pattern"], v) is None:
            raise _Invalid(loc, f"must match {meta['pattern']}")
        if meta.get("identifier"):
            try:
                validate_id(v)
            except TopicError as e:
                raise _Invalid(loc, str(e)) from None
        return v
    if tp is int or tp is float:
        if isinstance(v, bool) or not isinstance(v, (int, float) if tp is float else int):
            raise _Invalid(loc, f"must be {'a number' if tp is float else 'an integer'}")
        for key, (symbol, holds) in _BOUNDS.items():
            if key in meta and not holds(v, meta[key]):
                raise _Invalid(loc, f"must be {symbol} {meta[key]}")
        return tp(v)
    raise TypeError(f"no check for {tp!r}")  # a schema bug, not a document error


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
