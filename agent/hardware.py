"""What this box is (:class:`HostFacts`) and which hardware profile fits it.

I/O lives only in :func:`collect_facts`: it reads a few small files under a root (``/``, or a
fake tree in tests) and never raises on missing, unreadable or garbage files. The rest is pure:
facts in, a :class:`ProfileChoice` with its reasons out. Rules of ``[detect]`` (all must match):
``os``/``arch`` one of the list; every ``files_present`` exists; the device-tree or cpuinfo model
contains any ``*_contains`` entry (case-insensitive); L4T major >= ``min_l4t_release`` (failing only
this *refuses* the profile, with the reason kept); ``cpu_flags_noted`` are reported, never decide.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import platform
import re
import stat
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mcp_edge.shared.errors import McpError
from mcp_edge.shared.profiles import HardwareProfile, load_profiles

READ_CAP_BYTES = 2 * 1024 * 1024
"""Most bytes read from any one file; a 512-core ``/proc/cpuinfo`` is about 1 MiB."""
MAX_TEXT_CHARS, MAX_FLAGS, MAX_FLAG_CHARS = 200, 256, 32
"""Caps on what facts keep (model strings; CPU flags), so they fit in an enrollment request."""

BACKEND_DISTRIBUTIONS: Mapping[str, tuple[str, ...]] = {
    "onnxruntime": ("onnxruntime", "onnxruntime-gpu", "onnxruntime-openvino"),
    "openvino": ("openvino",),
    "tflite": ("ai-edge-litert", "tflite-runtime"),
    "tensorrt": ("tensorrt",),
}
"""The distributions that bring each backend: ``onnxruntime-gpu`` adds the CUDA and TensorRT
providers, ``onnxruntime-openvino`` the OpenVINO execution provider (``--backend openvino-ep``);
``openvino`` is the OpenVINO runtime itself (the ``openvino`` backend, reading ``.onnx``);
``tensorrt`` the libraries onnxruntime's TensorRT provider loads."""

RELEVANT_PACKAGES = tuple(name for names in BACKEND_DISTRIBUTIONS.values() for name in names)
"""Distributions whose presence decides which backends can load (looked up by name)."""

JETPACK_BY_L4T = {32: "4.x", 35: "5.x", 36: "6.x", 38: "7.x"}
"""L4T major release -> JetPack line (NVIDIA's release table)."""

_GPU_MARKERS = (
    ("/dev/nvhost-ctrl-gpu", "Tegra integrated GPU"),
    ("/dev/nvgpu/igpu0/ctrl", "Tegra GPU"),
    ("/dev/nvidia0", "NVIDIA GPU device node"),
    ("/dev/dri/renderD128", "DRM render node"),
)
_L4T_RE = re.compile(r"#\s*R([0-9]{1,4})\s*\(release\),\s*REVISION:\s*([0-9][0-9.]{0,15})")
# ARM Ltd. (implementer 0x41) core part numbers, as printed in /proc/cpuinfo "CPU part".
_ARM_PARTS = {
    "0xd03": "Cortex-A53",
    "0xd07": "Cortex-A57",
    "0xd08": "Cortex-A72",
    "0xd0b": "Cortex-A76",
    "0xd0c": "Neoverse-N1",
    "0xd40": "Neoverse-V1",
    "0xd42": "Cortex-A78AE",
    "0xd49": "Neoverse-N2",
    "0xd4f": "Neoverse-V2",
}


class HardwareError(McpError):
    """Base of hardware-detection errors."""


class UnknownProfileError(HardwareError, ValueError):
    """``--profile`` named a profile this agent does not ship; ``valid`` lists the names."""

    def __init__(self, name: str, valid: Iterable[str]) -> None:
        self.name = name
        self.valid = sorted(valid)
        super().__init__(f"unknown profile {name!r}; valid profiles: {', '.join(self.valid)}")


class NoProfileError(HardwareError):
    """No profile's rules match this box; ``rejected`` says why each one does not fit."""

    def __init__(self, rejected: Mapping[str, str]) -> None:
        self.rejected = dict(rejected)
        super().__init__("no hardware profile matches this box; choose one with --profile NAME")


@dataclass(frozen=True)
class HostFacts:
    """What detection saw on this box. JSON-friendly through :meth:`to_dict` (sent at enrollment).

    ``mem_total_mb`` is MiB; ``l4t_release`` the L4T major (36 for "R36"); ``jetpack`` the JetPack
    line it belongs to ("6.x") when known; ``packages`` maps distribution name to version.
    """

    os: str
    arch: str
    cpu_model: str | None = None
    cpu_flags: frozenset[str] = frozenset()
    cpu_count: int | None = None
    mem_total_mb: int | None = None
    device_tree_model: str | None = None
    l4t_release: int | None = None
    l4t_revision: str | None = None
    jetpack: str | None = None
    packages: Mapping[str, str] = field(default_factory=dict)
    gpu_hints: tuple[str, ...] = ()
    files_present: frozenset[str] = frozenset()

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types only: sets become sorted lists, mappings plain dicts."""
        return {
            **asdict(self),
            "cpu_flags": sorted(self.cpu_flags),
            "gpu_hints": list(self.gpu_hints),
            "files_present": sorted(self.files_present),
            "packages": dict(sorted(self.packages.items())),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> HostFacts:
        """Inverse of :meth:`to_dict` (unknown keys are ignored, so newer agents stay readable)."""
        kw = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        for key, kind in (
            ("cpu_flags", frozenset),
            ("files_present", frozenset),
            ("gpu_hints", tuple),
            ("packages", dict),
        ):
            kw[key] = kind(kw.get(key) or ())
        return cls(**kw)


@dataclass(frozen=True)
class ProfileChoice:
    """The profile picked with every reason, why each other one was not; ``detected``: the
    auto-detected profile (differs from ``profile`` only under an override)."""

    profile: HardwareProfile
    reasons: list[str]
    rejected: dict[str, str]
    overridden: bool = False
    detected: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON form: the profile by name."""
        return {
            "profile": self.profile.name,
            "overridden": self.overridden,
            "detected": self.detected,
            "reasons": list(self.reasons),
            "rejected": dict(self.rejected),
        }


def _read_text(path: Path, cap: int = READ_CAP_BYTES) -> str | None:
    """At most ``cap`` bytes of a regular file as text, or ``None`` if it is absent or unusable.

    Opens non-blocking and insists on a regular file so a FIFO or device in a fake root cannot
    hang detection; undecodable bytes become U+FFFD, NULs are dropped.
    """
    nonblocking = getattr(os, "O_NONBLOCK", 0)
    try:
        with open(path, "rb", opener=lambda p, flags: os.open(p, flags | nonblocking)) as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                return None
            raw = f.read(cap)  # buffered: loops to ``cap`` or EOF (a /proc read may come short)
    except (OSError, ValueError):
        return None
    return raw.decode("utf-8", errors="replace").replace("\x00", "")


def _under(root: Path, path: str) -> Path:
    return root / path.lstrip("/")


def _installed(names: Iterable[str]) -> dict[str, str]:
    found: dict[str, str] = {}
    for name in names:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError, ValueError):
            found[name] = importlib.metadata.version(name)
    return found


def collect_facts(
    root: Path = Path("/"),
    *,
    system: str | None = None,
    machine: str | None = None,
    packages: Mapping[str, str] | None = None,
    probe_files: Iterable[str] | None = None,
) -> HostFacts:
    """Read what this box is from files under ``root``; never raises on missing or garbage files.

    ``system``/``machine`` default to :func:`platform.system`/:func:`platform.machine`;
    ``packages`` to the installed versions of :data:`RELEVANT_PACKAGES`; ``probe_files`` (the
    absolute paths whose presence profiles ask about) to those named by the shipped profiles.
    CPU count and memory fall back to the running process's view only when ``root`` is ``/``
    (macOS has no ``/proc``).
    """
    root = Path(root)
    real_root = root.resolve() == Path("/").resolve()
    if probe_files is None:
        probe_files = {f for p in load_profiles().values() for f in p.detect.files_present}
    cpu = _parse_cpuinfo(_read_text(_under(root, "/proc/cpuinfo")) or "")
    dt_model = _clean(_read_text(_under(root, "/proc/device-tree/model"), 4096))
    mem = _parse_meminfo(_read_text(_under(root, "/proc/meminfo"), 64 * 1024) or "")
    count = cpu.get("count") or (os.cpu_count() if real_root else None)
    mem = mem or (_sysconf_mem_mb() if real_root else None)
    major, revision = _parse_l4t(_read_text(_under(root, "/etc/nv_tegra_release"), 4096) or "")
    return HostFacts(
        os=system if system is not None else platform.system(),
        arch=machine if machine is not None else platform.machine(),
        cpu_model=_clean(cpu.get("model")),
        cpu_flags=frozenset(cpu.get("flags") or ()),
        cpu_count=count,
        mem_total_mb=mem,
        device_tree_model=dt_model,
        l4t_release=major,
        l4t_revision=revision,
        jetpack=JETPACK_BY_L4T.get(major) if major is not None else None,
        packages=dict(packages) if packages is not None else _installed(RELEVANT_PACKAGES),
        gpu_hints=_gpu_hints(root),
        files_present=frozenset(f for f in probe_files if os.path.lexists(_under(root, f))),
    )


def _gpu_hints(root: Path) -> tuple[str, ...]:
    hints = [f"{p} ({what})" for p, what in _GPU_MARKERS if os.path.lexists(_under(root, p))]
    driver = _read_text(_under(root, "/proc/driver/nvidia/version"), 4096)
    line = _clean((driver or "").strip().split("\n", 1)[0])
    if line:
        hints.append(f"NVIDIA driver: {line}")
    return tuple(hints)


def _clean(text: str | None) -> str | None:
    """Printable characters only, at most :data:`MAX_TEXT_CHARS`; ``None`` when nothing is left."""
    kept = "".join(ch for ch in (text or "")[: MAX_TEXT_CHARS * 4] if ch.isprintable()).strip()
    return kept[:MAX_TEXT_CHARS] or None


def _sysconf_mem_mb() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1024 * 1024)
    except (AttributeError, ValueError, OSError):
        return None


def _parse_cpuinfo(text: str) -> dict[str, Any]:
    """Model name, flags and processor count from ``/proc/cpuinfo`` text (x86 or arm)."""
    fields: dict[str, str] = {}
    count = 0
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key, value = key.strip().lower(), value.strip()
        if key == "processor" and value.isdecimal():
            count += 1
        fields.setdefault(key, value[:4096])
    model = fields.get("model name")
    part = fields.get("cpu part", "").lower()
    if not model and part:
        core = _ARM_PARTS.get(part) if fields.get("cpu implementer", "").lower() == "0x41" else None
        model = f"ARM {core}" if core else f"CPU part {part}"
    board = fields.get("model", "")
    model = model or (board if board and not board.isdecimal() else None) or fields.get("hardware")
    flags = (fields.get("flags") or fields.get("features") or "").split()
    flags = [f[:MAX_FLAG_CHARS] for f in flags if f.isascii() and f.isprintable()][:MAX_FLAGS]
    return {"model": model, "flags": flags, "count": count}


def _parse_l4t(text: str) -> tuple[int | None, str | None]:
    """``(36, "3.0")`` from ``# R36 (release), REVISION: 3.0, ...``; ``(None, None)`` otherwise."""
    match = _L4T_RE.search(text)
    return (int(match.group(1)), match.group(2).rstrip(".")) if match else (None, None)


def _parse_meminfo(text: str) -> int | None:
    """``MemTotal`` in MiB."""
    match = re.search(r"^MemTotal:\s+([0-9]{1,15})\s*kB", text, re.MULTILINE)
    return int(match.group(1)) // 1024 if match else None


@dataclass(frozen=True)
class _Rule:
    ok: bool
    text: str
    refusal: bool = False  # a version gate: failing it refuses a profile that otherwise fits


def _contains(what: str, value: str | None, needles: list[str]) -> _Rule:
    hit = next((n for n in needles if value and n.casefold() in value.casefold()), None)
    wanted = " or ".join(map(repr, needles))
    if hit:
        return _Rule(True, f"{what} {value!r} contains {hit!r}")
    return _Rule(
        False,
        f"{what} {value!r} does not contain {wanted}" if value else f"no {what} (needs {wanted})",
    )


def _l4t_rule(facts: HostFacts, profile: HardwareProfile, minimum: int) -> _Rule:
    label = profile.name.replace("-", " ").title()
    need_jp = JETPACK_BY_L4T.get(minimum, "").replace(".x", ".0+")
    need = (
        f"{label} needs JetPack {need_jp} (L4T R{minimum})"
        if need_jp
        else f"{label} needs L4T R{minimum} or newer"
    )
    have = facts.l4t_release
    if have is None:
        return _Rule(False, f"L4T release unknown; {need}", True)
    if have >= minimum:
        return _Rule(True, f"L4T R{have} (JetPack {facts.jetpack or '?'}) meets R{minimum}+")
    jp = JETPACK_BY_L4T.get(have)
    seen = f"JetPack {jp.split('.')[0]} / L4T R{have}" if jp else f"L4T R{have}"
    return _Rule(False, f"{seen} is not supported; {need}", True)


def _evaluate(facts: HostFacts, profile: HardwareProfile) -> list[_Rule]:
    """Every rule of ``profile.detect`` checked against ``facts``, in a stable order."""
    d = profile.detect
    rules: list[_Rule] = []
    for what, value, allowed in (("os", facts.os, d.os), ("arch", facts.arch, d.arch)):
        if allowed:
            ok = value.casefold() in {a.casefold() for a in allowed}
            verb = "matches" if ok else "is not"
            rules.append(_Rule(ok, f"{what} {value} {verb} {' or '.join(allowed)}"))
    for path in d.files_present:
        ok = path in facts.files_present
        rules.append(_Rule(ok, f"file {path} {'present' if ok else 'missing'}"))
    if d.device_tree_model_contains:
        rules.append(
            _contains("device-tree model", facts.device_tree_model, d.device_tree_model_contains)
        )
    if d.cpuinfo_model_contains:
        rules.append(_contains("cpu model", facts.cpu_model, d.cpuinfo_model_contains))
    if d.min_l4t_release is not None:
        rules.append(_l4t_rule(facts, profile, d.min_l4t_release))
    for flag in d.cpu_flags_noted:
        seen = "present" if flag in facts.cpu_flags else "absent"
        rules.append(_Rule(True, f"cpu flag {flag} {seen} (noted, does not decide)"))
    return rules


def select_profile(
    facts: HostFacts, profiles: Mapping[str, HardwareProfile], *, override: str | None = None
) -> ProfileChoice:
    """The highest-priority profile whose rules all match ``facts`` (ties: by name).

    A profile that fails only a version gate (Jetson on L4T older than ``min_l4t_release``) is
    refused and the refusal is the first reason of the profile chosen instead. ``override`` picks
    a profile by name even when its rules do not match (the reasons then say which fail).

    Raises :class:`UnknownProfileError` for an override that names no profile, and
    :class:`NoProfileError` when nothing matches and no override is given.
    """
    if override is not None and override not in profiles:
        raise UnknownProfileError(override, profiles)
    ordered = sorted(profiles.values(), key=lambda p: (-p.priority, p.name))
    results = {p.name: _evaluate(facts, p) for p in ordered}
    rejected: dict[str, str] = {}
    refusals: list[str] = []  # only those that outrank the profile finally detected
    detected: HardwareProfile | None = None
    for p in ordered:
        failed = [r for r in results[p.name] if not r.ok]
        if not failed:
            detected = detected or p
            if detected is not p:
                rejected[p.name] = f"matches, but {detected.name} has higher priority"
            continue
        rejected[p.name] = "; ".join(r.text for r in failed)
        if detected is None and all(r.refusal for r in failed):
            refusals.append(f"refused {p.name}: {rejected[p.name]}")
    if override is None:
        if detected is None:
            raise NoProfileError(rejected)
        why = (
            f"{detected.name}: highest-priority profile whose rules all match "
            f"(priority {detected.priority})"
        )
        reasons = [*refusals, why, *(r.text for r in results[detected.name])]
        return ProfileChoice(detected, reasons, rejected, False, detected.name)
    chosen = profiles[override]
    misses = [r.text for r in results[override] if not r.ok]
    head = f"{override}: chosen by --profile; " + (
        "its rules all match this box"
        if not misses
        else f"its rules do NOT match this box ({'; '.join(misses)})"
    )
    auto = detected.name if detected else None
    reasons = [
        head,
        f"auto-detection would pick {auto or 'no profile'}",
        *(r.text for r in results[override] if r.ok),
    ]
    rejected.pop(override, None)
    if detected is not None and detected.name != override:
        rejected[detected.name] = f"matches, but --profile {override} was given"
    return ProfileChoice(chosen, reasons, rejected, True, auto)
