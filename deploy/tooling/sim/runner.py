"""``mcp-sim run``: the whole simulated fleet in one process, one event loop, no thread per device.

:class:`FleetRunner` reads the fleet from the state directory, raises the file-descriptor limit
(soft to hard: one socket per device), and starts the devices ``connect_rate`` per second. Then
a few fleet-wide loops do the periodic work, so a device costs no task of its own while idle:

- telemetry (every second): each online device whose turn has come sends its health sample
  (every ``health_interval_s``) and its inference statistics (every stats interval: the
  ``--stats-interval`` flag when given, else the desired state's telemetry policy, else the
  behaviour file's; a window with no request sends nothing, as the agent does);
- churn (every second): ``churn_percent_per_minute`` of the fleet, picked at random among the
  online devices, leaves like a stopping agent and comes back ``churn_offline_s`` later;
- status (every ``status_interval_s``): ``--status-file`` gets the fleet's counts as JSON
  (:meth:`FleetRunner.status`), and with ``--until-version`` the run ends once every device
  reported each named version active;
- summary (every ``summary_interval_s``): one line on stdout;
- save (every ``save_interval_s`` and at the end): ``runtime.json`` (:mod:`.fleet`).

Counts of what devices run come from the reported states the broker acknowledged
(:class:`FleetTracker`), so "every device runs 1.2.0" means every device's retained report
says so. SIGINT/SIGTERM end the run: each device publishes its retained ``offline`` and
disconnects.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import resource
import signal
import ssl
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import psutil

from mcp_edge.agent.run import broker_address
from mcp_edge.shared.fsutil import atomic_write_bytes
from mcp_edge.shared.protocol.reports import InferenceReport
from mcp_edge.shared.signing import PublicKey
from mcp_edge.tooling.sim.config import Behaviour
from mcp_edge.tooling.sim.device import SimDevice, View, jitter, spawner
from mcp_edge.tooling.sim.fleet import DeviceRecord, Fleet, load_fleet, load_runtime, save_runtime
from mcp_edge.tooling.sim.repository import SharedVerdicts
from mcp_edge.tooling.sim.traffic import Traffic

log = logging.getLogger("mcp.sim")

EXIT_OK = 0
EXIT_TIMEOUT = 3
SEQ_GAP_AFTER_CRASH = 100_000
"""Event seqs skipped when the last run did not save at a clean exit (no seq is reused)."""


@dataclass(frozen=True)
class RunConfig:
    """Everything ``mcp-sim run`` was told (built once by the CLI)."""

    state_dir: Path
    behaviour: Behaviour = field(default_factory=Behaviour)
    broker: str | None = None
    """``mqtt://host:port`` for every device instead of the URL from its enrollment."""
    devices: int | None = None
    """Run the first N devices of the fleet (all when None)."""
    stats_interval_s: float | None = None
    """Given: holds over the desired state's telemetry policy."""
    status_file: Path | None = None
    status_interval_s: float = 1.0
    summary_interval_s: float = 10.0
    until: tuple[tuple[str, str], ...] = ()
    timeout_s: float | None = None
    keepalive_s: int = 30
    seed: int | None = None
    save_interval_s: float = 60.0
    profile: str = "generic-x86_64"


class FleetTracker:
    """How many devices report each ``(model, role, version)``, and when all of them first did.

    Roles: ``active`` (stable), ``canary``, ``shadow``, and ``failed`` (the version whose last
    deployment on the device failed).
    """

    def __init__(self, total: int, clock: Callable[[], float] = time.time) -> None:
        self.total = total
        self.counts: Counter[tuple[str, str, str]] = Counter()
        self.first_at: dict[tuple[str, str, str], float] = {}
        self.all_at: dict[tuple[str, str, str], float] = {}
        self._clock = clock

    def move(self, before: View, after: View) -> None:
        """One device's acknowledged report went from ``before`` to ``after``."""
        for key in before - after:
            self.counts[key] -= 1
        now = None
        for key in after - before:
            self.counts[key] += 1
            if key not in self.first_at:
                now = now or self._clock()
                self.first_at[key] = now
            if self.counts[key] >= self.total and key not in self.all_at:
                now = now or self._clock()
                self.all_at[key] = now

    def everywhere(self, model: str, version: str) -> bool:
        return self.counts[(model, "active", version)] >= self.total

    def as_json(self) -> dict[str, Any]:
        models: dict[str, dict[str, dict[str, Any]]] = {}
        for (model, role, version), n in sorted(self.counts.items()):
            if n:
                models.setdefault(model, {}).setdefault(role, {})[version] = n
        reached: dict[str, dict[str, dict[str, float]]] = {}
        for (model, role, version), at in sorted(self.all_at.items()):
            reached.setdefault(model, {}).setdefault(role, {})[version] = at
        first: dict[str, dict[str, dict[str, float]]] = {}
        for (model, role, version), at in sorted(self.first_at.items()):
            first.setdefault(model, {}).setdefault(role, {})[version] = at
        return {"models": models, "all_at": reached, "first_at": first}


class FleetContext:
    """What every device of a run shares: configuration, keys, the verdict cache, counters."""

    def __init__(self, config: RunConfig, fleet: Fleet, total: int) -> None:
        self.config = config
        self.behaviour = config.behaviour
        self.profile = config.profile
        self.keepalive_s = config.keepalive_s
        self.stats_interval_override = config.stats_interval_s
        self.stats_interval_s = config.stats_interval_s or config.behaviour.fleet.stats_interval_s
        self.director_keys = [PublicKey.from_hex(k) for k in fleet.trust.director_keys]
        self.verdicts = SharedVerdicts(fleet.trust.tuf_root, config.state_dir / "scratch")
        self.traffic = Traffic(config.behaviour, seed=config.seed)
        self.py_rng = random.Random(config.seed)
        self.tracker = FleetTracker(total)
        self.counters: Counter[str] = Counter()
        self.connected = 0
        self.ever_connected: set[str] = set()
        self.deploying = 0
        self.tasks: set[asyncio.Task[Any]] = set()
        self.spawn: Callable[[Coroutine[Any, Any, Any]], None] = spawner(self.tasks)
        self._brokers: dict[str, tuple[str, int, ssl.SSLContext | None]] = {}
        self._tls: ssl.SSLContext | None = None

    def broker_of(self, record: DeviceRecord) -> tuple[str, int, ssl.SSLContext | None]:
        """``(host, port, tls)`` a device connects to (``--broker`` or its enrollment's)."""
        url = self.config.broker or record.broker_urls[0]
        known = self._brokers.get(url)
        if known is None:
            host, port, tls = broker_address(url)
            if tls and self._tls is None:
                self._tls = ssl.create_default_context()
            known = self._brokers[url] = (host, port, self._tls if tls else None)
        return known

    def came_online(self, dev: SimDevice) -> None:
        self.connected += 1
        self.ever_connected.add(dev.device_id)
        self.counters["connects"] += 1
        now = time.time()
        if not dev.next_health:
            dev.next_health = now + jitter(self.py_rng, self.behaviour.fleet.health_interval_s)
            dev.next_stats = now + jitter(self.py_rng, dev.stats_interval_s)

    def went_offline(self, dev: SimDevice) -> None:
        self.connected -= 1
        self.counters["disconnects"] += 1


class FleetRunner:
    """Runs the fleet until stopped, timed out, or every ``--until-version`` is everywhere."""

    def __init__(self, config: RunConfig, *, out: Callable[[str], None] | None = None) -> None:
        self.config = config
        self.fleet = load_fleet(config.state_dir)
        records = self.fleet.devices[: config.devices] if config.devices else self.fleet.devices
        self.ctx = FleetContext(config, self.fleet, len(records))
        saved, clean = load_runtime(config.state_dir)
        self.devices = [SimDevice(r, self.ctx, saved.get(r.device_id) or {}) for r in records]
        if not clean:
            for dev in self.devices:
                dev.event_seq += SEQ_GAP_AFTER_CRASH
        self._out = out or _print
        self._stop = asyncio.Event()
        self._save_lock = threading.Lock()
        self._status_lock = threading.Lock()
        self._status_seq = self._status_written = 0
        self._exit = EXIT_OK
        self._started = time.time()
        self._process = psutil.Process()
        self._cpu0 = sum(self._process.cpu_times()[:2])

    async def run(self) -> int:
        """Run (see the module docstring); return the exit status."""
        raise_fd_limit(len(self.devices))
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self._stop.set)
        self._save(clean=False)
        self._out(f"mcp-sim: {len(self.devices)} devices from {self.config.state_dir}, "
                  f"connecting {self.config.behaviour.fleet.connect_rate:g}/s")  # fmt: skip
        c = self.config
        loops = [
            loop.create_task(self._every(1.0, self._telemetry), name="sim-telemetry"),
            loop.create_task(self._every(1.0, self._churn), name="sim-churn"),
            loop.create_task(
                self._every(c.status_interval_s, self._status_soon), name="sim-status"
            ),
            loop.create_task(self._every(c.summary_interval_s, self._summary), name="sim-sum"),
            loop.create_task(self._every(c.save_interval_s, self._save_soon), name="sim-save"),
            loop.create_task(self._connect_all(), name="sim-connect"),
        ]
        timeout = self.config.timeout_s
        try:
            if timeout is None:
                await self._stop.wait()
            else:
                try:
                    await asyncio.wait_for(self._stop.wait(), timeout)
                except asyncio.TimeoutError:
                    self._out(f"mcp-sim: timed out after {timeout:g} s")
                    self._exit = EXIT_TIMEOUT if self.config.until else EXIT_OK
        finally:
            for task in loops:
                task.cancel()
            await asyncio.gather(*loops, return_exceptions=True)
            self._status()
            self._summary()
            await self._close_all()
            self._status()  # final: what was acknowledged while the devices left counts too
            self._save(clean=True)
        return self._exit

    # ------------------------------------------------------------------ loops
    async def _every(self, period_s: float, fn: Callable[[], Any]) -> None:
        while True:
            await asyncio.sleep(period_s)
            try:
                result = fn()
                if asyncio.iscoroutine(result):
                    await result
            except Exception:
                log.exception("simulator loop %s failed", getattr(fn, "__name__", fn))

    async def _connect_all(self) -> None:
        rate = self.config.behaviour.fleet.connect_rate
        t0 = time.monotonic()
        for i, dev in enumerate(self.devices):
            wait = t0 + i / rate - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            if self._stop.is_set():
                return
            await dev.start()
        self._out(f"mcp-sim: {len(self.devices)} devices started in "
                  f"{time.monotonic() - t0:.1f} s")  # fmt: skip

    def _telemetry(self) -> None:
        now = time.time()
        traffic = self.ctx.traffic
        health_s = self.config.behaviour.fleet.health_interval_s
        for dev in self.devices:
            if not dev.online:
                continue
            if dev.next_health and now >= dev.next_health:
                dev.next_health = now + health_s
                dev.send_health(traffic.health(dev.device_id, now, now - dev.started_at))
            if dev.next_stats and now >= dev.next_stats:
                window = dev.stats_interval_s
                dev.next_stats = now + window
                serving = dev.serving()
                if serving:
                    models = traffic.window(serving, window)
                    if any(m.count for m in models):
                        dev.send_stats(InferenceReport(device_id=dev.device_id, ts=now,
                                                       window_s=window, models=models))  # fmt: skip

    _churn_carry = 0.0

    def _churn(self) -> None:
        fleet = self.config.behaviour.fleet
        if fleet.churn_percent_per_minute <= 0 or self._stop.is_set():
            return
        expected = len(self.devices) * fleet.churn_percent_per_minute / 100.0 / 60.0
        expected += self._churn_carry
        n = int(expected)
        self._churn_carry = expected - n
        online = [d for d in self.devices if d.online and d.link is not None]
        for dev in self.ctx.py_rng.sample(online, min(n, len(online))):
            self.ctx.spawn(self._bounce(dev, fleet.churn_offline_s))

    async def _bounce(self, dev: SimDevice, offline_s: float) -> None:
        self.ctx.counters["churned"] += 1
        await dev.go_offline()
        await asyncio.sleep(offline_s)
        if not self._stop.is_set() and dev.link is None:
            await dev.start()

    # ------------------------------------------------------------------ status
    def status(self) -> dict[str, Any]:
        """The fleet now, as written to ``--status-file``."""
        mem = self._process.memory_info().rss / 2**20
        cpu = sum(self._process.cpu_times()[:2]) - self._cpu0
        v = self.ctx.verdicts
        return {
            "ts": time.time(), "started_at": self._started, "devices": len(self.devices),
            "connected": self.ctx.connected, "ever_connected": len(self.ctx.ever_connected),
            "deploying": self.ctx.deploying, **self.ctx.tracker.as_json(),
            "counters": {**dict(self.ctx.counters), "verifications": v.verifications,
                         "verdicts_reused": v.reused},
            "process": {"pid": os.getpid(), "rss_mb": round(mem, 1), "cpu_s": round(cpu, 2),
                        "tasks": len(self.ctx.tasks)},
        }  # fmt: skip

    async def _status_soon(self) -> None:
        # The write (with its fsyncs) off the loop, so a slow disk does not stall the fleet.
        if self.config.status_file is not None:
            self._status_seq += 1
            await asyncio.to_thread(self._write_status, self._status_seq, self.status())
        self._check_until()

    def _status(self) -> None:
        if self.config.status_file is not None:
            self._status_seq += 1
            self._write_status(self._status_seq, self.status())
        self._check_until()

    def _write_status(self, seq: int, doc: dict[str, Any]) -> None:
        """Write ``doc`` unless a later status is on disk already (a write from a thread
        may finish after the final one)."""
        assert self.config.status_file is not None
        with self._status_lock:
            if seq > self._status_written:
                atomic_write_bytes(self.config.status_file, orjson.dumps(doc))
                self._status_written = seq

    def _check_until(self) -> None:
        if self.config.until and all(self.ctx.tracker.everywhere(m, v)
                                     for m, v in self.config.until):  # fmt: skip
            if not self._stop.is_set():
                named = ", ".join(f"{m} {v}" for m, v in self.config.until)
                self._out(f"mcp-sim: every device reports {named} active")
            self._stop.set()

    def _summary(self) -> None:
        doc = self.status()
        parts = []
        for model, roles in doc["models"].items():
            for role, versions in roles.items():
                listed = " ".join(f"{v}={n}" for v, n in versions.items())
                parts.append(f"{model} {role} {listed}")
        c = doc["counters"]
        self._out(
            f"[{time.time() - self._started:7.1f}s] devices {doc['devices']} connected "
            f"{doc['connected']} deploying {doc['deploying']} | {' | '.join(parts) or '-'} | "
            f"published {c.get('published', 0)} failed {c.get('publish_failed', 0)} | "
            f"rss {doc['process']['rss_mb']:.0f} MiB cpu {doc['process']['cpu_s']:.1f} s"
        )

    # ------------------------------------------------------------------ persistence
    def _runtime(self) -> dict[str, Any]:
        # Devices of the fleet this run does not hold keep what an earlier run saved.
        saved, _ = load_runtime(self.config.state_dir)
        saved.update((d.device_id, d.saved()) for d in self.devices)
        return saved

    def _save(self, *, clean: bool) -> None:
        with self._save_lock:
            save_runtime(self.config.state_dir, self._runtime(), clean=clean)

    async def _save_soon(self) -> None:
        doc = {d.device_id: d.saved() for d in self.devices}

        def write() -> None:
            with self._save_lock:
                saved, _ = load_runtime(self.config.state_dir)
                saved.update(doc)
                save_runtime(self.config.state_dir, saved, clean=False)

        await asyncio.to_thread(write)

    async def _close_all(self) -> None:
        gate = asyncio.Semaphore(256)

        async def close(dev: SimDevice) -> None:
            async with gate:
                await dev.go_offline()

        await asyncio.gather(*(close(d) for d in self.devices if d.link is not None),
                             return_exceptions=True)  # fmt: skip
        for task in list(self.ctx.tasks):
            task.cancel()
        await asyncio.gather(*self.ctx.tasks, return_exceptions=True)


def raise_fd_limit(devices: int) -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit; return it. Warns when it is below what
    ``devices`` sockets and some headroom need."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
    if soft < devices + 256:
        log.warning("file descriptor limit %d is below %d devices plus headroom; raise the hard "
                    "limit (ulimit -Hn)", soft, devices)  # fmt: skip
    return soft


def parse_until(items: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """``MODEL=VERSION`` items → pairs; raises ValueError for an item without ``=``."""
    out = []
    for item in items:
        model, sep, version = item.partition("=")
        if not sep or not model or not version:
            raise ValueError(f"{item!r} must look like MODEL=VERSION")
        out.append((model, version))
    return tuple(out)


def _print(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
