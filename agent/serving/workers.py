"""Serving on every core: the primary process's side of ``mcp-agent serve --processes N``.

The process the operator started is the *primary*: it loads the models, watches the model
path, runs the fleet session and the update agent (``mcp-agent run``), and answers requests
like any other. It starts N-1 *workers* (:mod:`.worker`), each a process of its own with its
own model instances, serving the same HTTP (and gRPC) port: every process binds it with
SO_REUSEPORT and the kernel spreads connections across them.

:class:`ReplicaGroup` keeps the workers in step with the primary's :class:`ModelManager` (it
is the manager's :class:`~agent.runtime.manager.Replicas`): a load is prepared (loaded, warmed,
checked) in every process before any of them changes a role, so a hot swap or a new canary
takes effect everywhere or nowhere; unloads and canary policies follow. It is also the
primary's :class:`~.service.Cluster`: statistics and ``/metrics`` sum every process, model
control runs here. A worker that exits unexpectedly is started again (1 s, doubling up to
30 s while it keeps failing) and given every loaded version before it serves; a worker whose
copy falls out of step (a failed commit) is restarted the same way. Workers forward the runs
they count (inference statistics for the fleet session) and a bounded sample of answered
requests for drift; the primary feeds them to its own observers.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import socket
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mcp_edge.agent.runtime.manager import ModelManager, ModelSource
from mcp_edge.agent.runtime.runner import ModelLoadError
from mcp_edge.agent.serving.ipc import Channel, ChannelClosedError, RemoteError
from mcp_edge.agent.serving.requests import RequestError
from mcp_edge.shared.protocol.canary import CanaryPolicy
from mcp_edge.shared.protocol.wire import ErrorCode

if TYPE_CHECKING:
    from mcp_edge.agent.serving.serve import ServeConfig
    from mcp_edge.agent.serving.service import FrontDoor

log = logging.getLogger("mcp.agent.workers")

MAX_PROCESSES = 64
RESTART_MIN_S = 1.0
RESTART_MAX_S = 30.0


def auto_processes(cpu_count: int | None = None) -> int:
    """Serving processes for a profile that says ``processes = 0``: one per four cores,
    from 1 to 8."""
    cpus = cpu_count if cpu_count is not None else (os.cpu_count() or 1)
    return max(1, min(8, cpus // 4))


@dataclass(frozen=True)
class WorkerSettings:
    """What a worker needs to serve as the primary does (sent at its start)."""

    config: ServeConfig
    http_port: int
    grpc_port: int | None
    index: int
    processes: int
    log_level: str
    log_format: str


@dataclass
class _Worker:
    index: int
    proc: asyncio.subprocess.Process | None = None
    channel: Channel | None = None
    ready: bool = False
    failures: int = 0
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)


class ReplicaGroup:
    """The primary's view of its workers (see the module docstring)."""

    def __init__(
        self,
        config: ServeConfig,
        manager: ModelManager,
        front: FrontDoor,
        *,
        processes: int,
        http_port: int,
        grpc_port: int | None,
        log_level: str = "info",
        log_format: str = "text",
    ) -> None:
        self.config = dataclasses.replace(config, trusted_keys=())
        self.manager = manager
        self.front = front
        self._processes = processes
        self.http_port, self.grpc_port = http_port, grpc_port
        self.log_level, self.log_format = log_level, log_format
        self._workers = [_Worker(i) for i in range(1, processes)]
        self._lock = asyncio.Lock()
        self._stopping = False
        self._background: set[asyncio.Task[Any]] = set()
        self.restarts = 0

    # ----------------------------------------------------------------- lifecycle
    @property
    def processes(self) -> int:
        return self._processes

    @property
    def copies(self) -> int:
        return len(self._workers)

    async def start(self) -> None:
        """Start every worker and give it the loaded versions; raises ModelLoadError (after
        stopping the others) when one cannot start."""
        results = await asyncio.gather(
            *(self._start(w) for w in self._workers), return_exceptions=True
        )
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            await self.stop()
            raise ModelLoadError(f"a serving process did not start: {failed[0]}")
        for w in self._workers:
            self._spawn(self._supervise(w))
        log.info("%d serving processes on one port (this one and %d workers)",
                 self._processes, len(self._workers))  # fmt: skip

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _start(self, w: _Worker) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            w.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "mcp_edge.agent.serving.worker", "--fd",
                str(child.fileno()), pass_fds=(child.fileno(),),
            )  # fmt: skip
        finally:
            child.close()
        reader, writer = await asyncio.open_unix_connection(sock=parent)
        w.channel = Channel(reader, writer, lambda op, payload: self._handle(w, op, payload))
        task = asyncio.get_running_loop().create_task(w.channel.run())
        w.tasks.add(task)
        settings = WorkerSettings(
            self.config, self.http_port, self.grpc_port, w.index, self._processes,
            self.log_level, self.log_format,
        )  # fmt: skip
        await w.channel.call("init", settings, timeout_s=120.0)
        async with self._lock:
            for lv, role, policy in self.manager.snapshot():
                source = lv.source
                await w.channel.call("prepare", source, timeout_s=600.0)
                await w.channel.call("commit", (source, role, policy))
            # Only now does it bind the ports: a request never reaches a worker that is still
            # loading what the others serve.
            await w.channel.call("listen", None)
            w.ready = True
        log.info("serving process %d (pid %d) is serving", w.index, w.proc.pid)

    async def _supervise(self, w: _Worker) -> None:
        while not self._stopping:
            assert w.proc is not None
            code = await w.proc.wait()
            w.ready = False
            if w.channel is not None:
                w.channel.close()
            if self._stopping:
                return
            w.failures += 1
            delay = min(RESTART_MAX_S, RESTART_MIN_S * 2 ** (w.failures - 1))
            log.warning("serving process %d (pid %d) exited with code %s; starting another in "
                        "%.0f s", w.index, w.proc.pid, code, delay)  # fmt: skip
            await asyncio.sleep(delay)
            if self._stopping:
                return
            try:
                await self._start(w)
            except Exception as e:
                log.error("serving process %d did not start again: %s", w.index, e)
                if w.proc is not None and w.proc.returncode is None:
                    w.proc.kill()
                continue
            self.restarts += 1
            w.failures = 0

    async def stop(self, timeout_s: float = 30.0) -> None:
        """Ask every worker to finish its requests and exit; kill those still running after
        ``timeout_s``."""
        self._stopping = True
        for w in self._workers:
            if w.channel is not None:
                with contextlib.suppress(Exception):
                    await w.channel.call("stop", None, timeout_s=5.0)
        for w in self._workers:
            if w.proc is None or w.proc.returncode is not None:
                continue
            try:
                await asyncio.wait_for(w.proc.wait(), timeout_s)
            except asyncio.TimeoutError:
                log.warning("serving process %d did not stop in %.0f s: killing it",
                            w.index, timeout_s)  # fmt: skip
                w.proc.kill()
                await w.proc.wait()
        for task in list(self._background):
            task.cancel()
        for w in self._workers:
            if w.channel is not None:
                w.channel.close()

    def _restart(self, w: _Worker, why: str) -> None:
        """Kill a worker that fell out of step; its supervisor starts it again in step."""
        log.error("serving process %d is out of step (%s): restarting it", w.index, why)
        w.ready = False
        if w.proc is not None and w.proc.returncode is None:
            w.proc.kill()

    def _ready(self) -> list[_Worker]:
        return [w for w in self._workers if w.ready and w.channel is not None]

    async def _each(
        self, workers: Iterable[_Worker], op: str, payload: Any, timeout_s: float = 120.0
    ) -> list[tuple[_Worker, Any]]:
        """Call ``op`` on each worker at once: (worker, answer or exception) pairs; workers
        that are gone are left out."""
        chosen = list(workers)

        async def one(w: _Worker) -> Any:
            assert w.channel is not None
            return await w.channel.call(op, payload, timeout_s=timeout_s)

        results = await asyncio.gather(*(one(w) for w in chosen), return_exceptions=True)
        return [
            (w, r) for w, r in zip(chosen, results, strict=True)
            if not isinstance(r, ChannelClosedError)
        ]  # fmt: skip

    # ----------------------------------------------------------------- Replicas
    async def prepare(self, source: ModelSource) -> None:
        async with self._lock:
            results = await self._each(self._ready(), "prepare", source, timeout_s=600.0)
        failed = [(w, r) for w, r in results if isinstance(r, BaseException)]
        if not failed:
            return
        await self.abort(source)
        w, err = failed[0]
        raise ModelLoadError(f"serving process {w.index}: {err}")

    async def commit(self, source: ModelSource, role: str, canary: CanaryPolicy) -> None:
        async with self._lock:
            for w, r in await self._each(self._ready(), "commit", (source, role, canary)):
                if isinstance(r, BaseException):
                    self._restart(w, f"commit of {source.name} {source.version} failed: {r}")

    async def abort(self, source: ModelSource) -> None:
        async with self._lock:
            await self._each(self._ready(), "abort", (source.name, source.version))

    async def unload(self, name: str, version: str | None) -> None:
        async with self._lock:
            for w, r in await self._each(self._ready(), "unload", (name, version)):
                if isinstance(r, BaseException):
                    self._restart(w, f"unload of {name} failed: {r}")

    def set_canary_policy(self, name: str, policy: CanaryPolicy) -> None:
        async def send() -> None:
            async with self._lock:
                await self._each(self._ready(), "canary_policy", (name, policy))

        self._spawn(send())

    # ----------------------------------------------------------------- Cluster
    async def statistics(self) -> list[list[dict[str, Any]]]:
        return await self._gather("statistics", exclude=None)

    async def metric_families(self) -> list[list[Any]]:
        return await self._gather("metrics", exclude=None)

    async def _gather(self, op: str, exclude: int | None) -> list[Any]:
        workers = [w for w in self._ready() if w.index != exclude]
        return [r for _, r in await self._each(workers, op, None, timeout_s=10.0)
                if not isinstance(r, BaseException)]  # fmt: skip

    async def control(self, action: str, name: str) -> None:
        await (self.front.load(name) if action == "load" else self.front.unload(name))

    async def index(self, ready_only: bool) -> list[dict[str, Any]]:
        return await self.front.index(ready_only)

    # ----------------------------------------------------------------- calls from workers
    async def _handle(self, w: _Worker, op: str, payload: Any) -> Any:
        if op == "observed":
            self._replay(payload)
            return {"drift": self.manager.drift is not None}
        if op == "gather":
            what = payload
            mine = (
                self.front.local_statistics()
                if what == "statistics"
                else list(self.manager.metrics.registry.collect())
            )
            return [mine, *await self._gather(what, exclude=w.index)]
        if op == "control":
            action, name = payload
            await self.control(action, name)
            return None
        if op == "index":
            return await self.front.index(bool(payload))
        raise RequestError(ErrorCode.BAD_REQUEST, f"unknown call {op!r} from a serving process")

    def _replay(self, payload: dict[str, Any]) -> None:
        """Runs a worker counted and answers it sampled: into this process's observers."""
        stats, drift = self.manager.stats, self.manager.drift
        if stats is not None:
            for model, version, latency_s, outcome, role, agreed in payload.get("runs", ()):
                stats.record(model, version, latency_s, outcome, role=role, agreed=agreed)
        if drift is not None:
            for model, version, role, feeds, outputs in payload.get("drift", ()):
                lv = self.manager.find(model, version)
                if lv is not None:
                    drift.observe(lv.source, role, feeds, outputs)


async def call_primary(channel: Channel, op: str, payload: Any, timeout_s: float = 30.0) -> Any:
    """A worker's call to the primary, with a primary that is gone as ``unavailable``."""
    try:
        return await channel.call(op, payload, timeout_s=timeout_s)
    except ChannelClosedError:
        raise RequestError(ErrorCode.UNAVAILABLE, "the primary serving process is gone") from None
    except RemoteError:
        raise
