"""Jetson ``tegrastats``: a parser for its lines and a reader that keeps the latest one.

:func:`parse_tegrastats_line` understands the TX1/Nano (``POM_5V_*``, unit-less rails),
Xavier (``GPU 467mW/467mW`` … ``SYS5V``, upper-case sensors) and Orin (``VDD_GPU_SOC``,
``VDD_IN``, ``GR3D_FREQ 0%@[305]``, leading timestamps, ``off`` cores) formats. Fields a board
does not print come back as None or empty.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from mcp_edge.shared.protocol.reports import GpuReport

log = logging.getLogger("mcp.agent.telemetry")

_RAM = re.compile(r"\bRAM (\d+)/(\d+)MB")
_SWAP = re.compile(r"\bSWAP (\d+)/(\d+)MB(?: \(cached (\d+)MB\))?")
_CPU = re.compile(r"\bCPU \[([^\]]*)\](?:@(\d+))?", re.IGNORECASE)
_CORE = re.compile(r"(\d+)%(?:@(\d+))?")
_EMC = re.compile(r"\bEMC(?:_FREQ)? (\d+)%(?:@(\d+))?")
_GR3D = re.compile(r"\bGR3D(?:_FREQ)? (\d+)%(?:@\[?(\d+)[^\s]*)?")
_TEMP = re.compile(r"(?<![\w@])([A-Za-z][\w-]*)@(-?\d+(?:\.\d+)?)C(?=\s|$)")
_RAIL_MW = re.compile(r"\b([A-Z][A-Z0-9_]*) (\d+)mW(?:/(\d+)mW)?(?=\s|$)")
_RAIL_BARE = re.compile(r"\b([A-Z][A-Z0-9_]*) (\d+)/(\d+)(?=\s|$)")
_GPU_RAILS = ("GPU", "VDD_GPU", "POM_5V_GPU", "VDD_GPU_SOC", "VDD_SYS_GPU", "VDD_CPU_GPU_CV")
_INPUT_RAILS = ("VDD_IN", "POM_5V_IN")


class TegrastatsParseError(ValueError):
    """The line is not tegrastats output (no RAM figure)."""


@dataclass(frozen=True)
class CpuCore:
    load_percent: float | None
    """None when the core is powered down (``off``)."""
    freq_mhz: int | None


@dataclass(frozen=True)
class TegrastatsReading:
    """One tegrastats line. Power rails are ``name -> (instant mW, average mW or None)``."""

    ram_used_mb: float
    ram_total_mb: float
    swap_used_mb: float | None = None
    swap_total_mb: float | None = None
    swap_cached_mb: float | None = None
    cpus: tuple[CpuCore, ...] = ()
    emc_percent: float | None = None
    emc_freq_mhz: int | None = None
    gr3d_percent: float | None = None
    gr3d_freq_mhz: int | None = None
    temperatures_c: dict[str, float] = field(default_factory=dict)
    rails_mw: dict[str, tuple[float, float | None]] = field(default_factory=dict)

    @property
    def gpu_power_mw(self) -> float | None:
        """The rail that carries the GPU (alone on Xavier/Nano; shared with SoC or CPU on Orin)."""
        for name in _GPU_RAILS:
            if name in self.rails_mw:
                return self.rails_mw[name][0]
        for name, (mw, _) in self.rails_mw.items():
            if "GPU" in name:
                return mw
        return None

    @property
    def input_power_mw(self) -> float | None:
        """Total module input power where a rail measures it (``VDD_IN``, ``POM_5V_IN``)."""
        for name in _INPUT_RAILS:
            if name in self.rails_mw:
                return self.rails_mw[name][0]
        return None

    @property
    def gpu(self) -> GpuReport:
        """The protocol's GPU figures. Jetson GPUs share system RAM, so no GPU memory figure."""
        return GpuReport(
            util_percent=self.gr3d_percent,
            emc_percent=self.emc_percent,
            power_mw=self.gpu_power_mw,
        )


def parse_tegrastats_line(line: str) -> TegrastatsReading:
    """Parse one line of ``tegrastats`` output.

    Raises :class:`TegrastatsParseError` when the line carries no ``RAM used/totalMB`` figure.
    Fields a board does not print are None/empty.
    """
    ram = _RAM.search(line)
    if ram is None:
        raise TegrastatsParseError(f"not a tegrastats line: {line[:80]!r}")
    swap = _SWAP.search(line)
    cpus: list[CpuCore] = []
    cpu = _CPU.search(line)
    if cpu is not None:
        shared_freq = int(cpu.group(2)) if cpu.group(2) else None
        for entry in cpu.group(1).split(","):
            entry = entry.strip()
            if entry == "off":
                cpus.append(CpuCore(None, None))
                continue
            m = _CORE.fullmatch(entry)
            if m is not None:
                freq = int(m.group(2)) if m.group(2) else shared_freq
                cpus.append(CpuCore(float(m.group(1)), freq))
    emc = _EMC.search(line)
    gr3d = _GR3D.search(line)
    temps: dict[str, float] = {}
    for name, value in _TEMP.findall(line):
        v = float(value)
        if -100.0 < v < 250.0:  # boards print -256C for a sensor that is not there
            temps[name.lower()] = v
    rails: dict[str, tuple[float, float | None]] = {}
    for name, now, avg in _RAIL_MW.findall(line):
        rails[name] = (float(now), float(avg) if avg else None)
    for name, now, avg in _RAIL_BARE.findall(line):
        rails.setdefault(name, (float(now), float(avg)))
    return TegrastatsReading(
        ram_used_mb=float(ram.group(1)),
        ram_total_mb=float(ram.group(2)),
        swap_used_mb=float(swap.group(1)) if swap else None,
        swap_total_mb=float(swap.group(2)) if swap else None,
        swap_cached_mb=float(swap.group(3)) if swap and swap.group(3) else None,
        cpus=tuple(cpus),
        emc_percent=float(emc.group(1)) if emc else None,
        emc_freq_mhz=int(emc.group(2)) if emc and emc.group(2) else None,
        gr3d_percent=float(gr3d.group(1)) if gr3d else None,
        gr3d_freq_mhz=int(gr3d.group(2)) if gr3d and gr3d.group(2) else None,
        temperatures_c=temps,
        rails_mw=rails,
    )


class TegrastatsReader:
    """Runs ``tegrastats --interval MS`` and keeps the latest parsed line.

    ``command`` is injectable (tests run a script printing recorded lines). Lines that do not
    parse are counted and skipped.
    """

    def __init__(self, command: list[str] | None = None, interval_ms: int = 1000) -> None:
        exe = shutil.which("tegrastats") or "/usr/bin/tegrastats"
        self.command = command or [exe, "--interval", str(interval_ms)]
        self.latest: TegrastatsReading | None = None
        self.bad_lines = 0
        self._proc: asyncio.subprocess.Process | None = None
        self._task: asyncio.Task[None] | None = None
        self.first_reading = asyncio.Event()

    @staticmethod
    def available() -> bool:
        return shutil.which("tegrastats") is not None or Path("/usr/bin/tegrastats").exists()

    async def start(self) -> None:
        self._proc = await asyncio.create_subprocess_exec(
            *self.command,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
            stdin=asyncio.subprocess.DEVNULL,
        )
        self._task = asyncio.get_running_loop().create_task(self._read(self._proc))

    async def _read(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None
        while True:
            raw = await proc.stdout.readline()
            if not raw:
                log.warning("tegrastats exited (status %s); GPU figures stop", proc.returncode)
                return
            try:
                self.latest = parse_tegrastats_line(raw.decode("utf-8", "replace"))
                self.first_reading.set()
            except TegrastatsParseError:
                self.bad_lines += 1

    async def close(self) -> None:
        if self._proc is not None and self._proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.terminate()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._proc.wait(), 5)
            if self._proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    self._proc.kill()
                await self._proc.wait()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
