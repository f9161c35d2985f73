"""A worker process of a multi-process server: ``python -m mcp_edge.agent.serving.worker --fd N``.

Started by the primary (:mod:`.workers`) with one end of a socket pair as file descriptor N.
The primary's first call (``init``) gives it the server's configuration and ports; it builds
its own model manager (its own instances of every model), and from then on does what the
primary asks: ``prepare`` a version (load, warm, check), ``commit`` it to a role, ``listen``
(bind the HTTP and gRPC ports with SO_REUSEPORT beside the primary, once it holds every loaded
version), ``abort`` or ``unload`` one, apply a ``canary_policy``, report its ``statistics``
and ``metrics``, ``stop``. Its own requests for the whole server's statistics and metrics,
and for model control, go to the primary. The runs it counts and a bounded sample of the
requests it answered (for drift) are sent to the primary twice a second. It exits when the
primary says stop, on SIGTERM (after draining), or as soon as the primary is gone; SIGINT
(Ctrl-C reaches the whole process group) is left to the primary, which stops every worker in
order.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
from typing import TYPE_CHECKING, Any

from mcp_edge.agent.runtime.manager import LoadedVersion, ModelNotFoundError, ModelSource, Outcome
from mcp_edge.agent.runtime.runner import Array
from mcp_edge.agent.serving.ipc import Channel
from mcp_edge.agent.serving.requests import RequestError
from mcp_edge.agent.serving.workers import WorkerSettings, call_primary
from mcp_edge.shared.protocol.reports import InferenceRole
from mcp_edge.shared.protocol.wire import ErrorCode

if TYPE_CHECKING:
    from mcp_edge.agent.runtime.manager import ModelManager
    from mcp_edge.agent.serving.grpc_api import GrpcServer
    from mcp_edge.agent.serving.http_server import HttpServer
    from mcp_edge.agent.serving.service import FrontDoor
    from mcp_edge.shared.tracing import Tracing

log = logging.getLogger("mcp.agent.workers")

FLUSH_INTERVAL_S = 0.5
MAX_RUNS = 200_000
"""Counted runs held between two flushes; beyond it runs are dropped (and logged)."""
MAX_DRIFT = 256
"""Answered requests held for drift between two flushes; beyond it they are not sampled."""


class Forwarder:
    """The worker's inference and drift observers: what it counts goes to the primary."""

    def __init__(self) -> None:
        self.runs: list[tuple[Any, ...]] = []
        self.drift: list[tuple[Any, ...]] = []
        self.drift_wanted = False
        self.dropped = 0

    def record(
        self,
        model: str,
        version: str,
        latency_s: float,
        outcome: Outcome,
        *,
        role: InferenceRole = InferenceRole.STABLE,
        agreed: bool | None = None,
    ) -> None:
        if len(self.runs) >= MAX_RUNS:
            self.dropped += 1
            return
        self.runs.append((model, version, latency_s, outcome, role, agreed))

    def observe(
        self,
        source: ModelSource,
        role: InferenceRole,
        feeds: dict[str, Array],
        outputs: dict[str, Array],
    ) -> None:
        if self.drift_wanted and len(self.drift) < MAX_DRIFT:
            self.drift.append((source.name, source.version, role, feeds, outputs))

    def take(self) -> dict[str, Any]:
        batch = {"runs": self.runs, "drift": self.drift}
        self.runs, self.drift = [], []
        return batch


class PrimaryLink:
    """The worker's :class:`~.service.Cluster`: the rest of the server, through the primary."""

    def __init__(self, channel: Channel, processes: int) -> None:
        self.channel = channel
        self._processes = processes

    @property
    def processes(self) -> int:
        return self._processes

    async def statistics(self) -> list[list[dict[str, Any]]]:
        found: list[list[dict[str, Any]]] = await call_primary(self.channel, "gather", "statistics")
        return found

    async def metric_families(self) -> list[list[Any]]:
        found: list[list[Any]] = await call_primary(self.channel, "gather", "metrics")
        return found

    async def control(self, action: str, name: str) -> None:
        await call_primary(self.channel, "control", (action, name), timeout_s=600.0)

    async def index(self, ready_only: bool) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = await call_primary(self.channel, "index", ready_only)
        return found


class Worker:
    """One worker's state and its answers to the primary's calls."""

    def __init__(self) -> None:
        self.channel: Channel | None = None
        self.settings: WorkerSettings | None = None
        self.manager: ModelManager | None = None
        self.front: FrontDoor | None = None
        self.http: HttpServer | None = None
        self.tracing: Tracing | None = None
        self.grpc: GrpcServer | None = None
        self.forwarder = Forwarder()
        self.pending: dict[tuple[str, str], LoadedVersion] = {}
        self.stop = asyncio.Event()

    async def handle(self, op: str, payload: Any) -> Any:
        if op == "init":
            return await self._init(payload)
        manager = self.manager
        if manager is None:
            raise RequestError(ErrorCode.UNAVAILABLE, "worker not initialised")
        if op == "prepare":
            source: ModelSource = payload
            key = (source.name, source.version)
            if key not in self.pending and manager.find(*key) is None:
                self.pending[key] = await manager.prepare(source)
            return None
        if op == "commit":
            source, role, policy = payload
            key = (source.name, source.version)
            lv = self.pending.pop(key, None)
            if lv is None:
                if manager.find(*key) is not None:
                    return None  # already serving here
                lv = await manager.prepare(source)
            await manager.commit(lv, role, policy)
            return None
        if op == "abort":
            lv = self.pending.pop(tuple(payload), None)
            if lv is not None:
                await lv.close()
            return None
        if op == "unload":
            name, version = payload
            with contextlib.suppress(ModelNotFoundError):
                await manager.unload(name, version)
            return None
        if op == "listen":
            await self._listen()
            return None
        if op == "canary_policy":
            name, policy = payload
            manager.set_canary_policy(name, policy)
            return None
        if op == "statistics":
            assert self.front is not None
            return self.front.local_statistics()
        if op == "metrics":
            return list(manager.metrics.registry.collect())
        if op == "stop":
            self.stop.set()
            return None
        raise RequestError(ErrorCode.BAD_REQUEST, f"unknown call {op!r}")

    async def _init(self, settings: WorkerSettings) -> int:
        from mcp_edge.agent.serving.http_api import build_server
        from mcp_edge.agent.serving.serve import agent_tracing, build_manager, choose_profile
        from mcp_edge.agent.serving.service import FrontDoor
        from mcp_edge.shared.cli_style import setup_logging

        setup_logging(settings.log_level, settings.log_format)
        _name_records(settings.index)
        self.settings = settings
        config = settings.config
        profile, _ = choose_profile(config.profile)
        manager = build_manager(config, profile, settings.processes)
        manager.stats = self.forwarder
        manager.drift = self.forwarder
        manager.metrics.processes.set(settings.processes)
        assert self.channel is not None
        self.tracing = agent_tracing(config.otlp_endpoint)
        front = FrontDoor(
            manager,
            cluster=PrimaryLink(self.channel, settings.processes),
            tracing=self.tracing,
        )
        self.manager, self.front = manager, front
        access = logging.getLogger("mcp.agent") if config.access_log else None
        self.http = build_server(manager, max_body=config.max_body, front=front, access_log=access)
        return os.getpid()

    async def _listen(self) -> None:
        """Bind the ports beside the primary: called once every loaded version is in step, so
        that no request reaches a worker that does not serve the models yet."""
        settings, http, front = self.settings, self.http, self.front
        assert settings is not None and http is not None and front is not None
        config = settings.config
        await http.start(config.host, settings.http_port, reuse_port=True)
        if settings.grpc_port is not None:
            from mcp_edge.agent.serving.grpc_api import GrpcServer

            self.grpc = GrpcServer(front, config.host, settings.grpc_port,
                                   max_message=config.max_body)  # fmt: skip
            await self.grpc.start()

    async def flush(self) -> None:
        """Send what the worker counted to the primary, twice a second."""
        assert self.channel is not None
        while True:
            await asyncio.sleep(FLUSH_INTERVAL_S)
            if self.manager is None:
                continue
            if self.forwarder.dropped:
                log.warning("%d counted runs were not forwarded (buffer full)",
                            self.forwarder.dropped)  # fmt: skip
                self.forwarder.dropped = 0
            try:
                answer = await self.channel.call("observed", self.forwarder.take(), 30.0)
            except Exception as e:  # the primary going away ends the worker elsewhere
                log.debug("could not forward statistics: %s", e)
                continue
            self.forwarder.drift_wanted = bool(answer.get("drift"))

    async def close(self) -> None:
        if self.grpc is not None:
            await self.grpc.stop()
        if self.http is not None:
            await self.http.stop()
        for lv in self.pending.values():
            await lv.close()
        if self.manager is not None:
            await self.manager.close()
        if self.tracing is not None:
            await asyncio.to_thread(self.tracing.shutdown)


def _name_records(index: int) -> None:
    """Log lines of this worker say which one it is (``mcp.agent[worker 2]``)."""

    def tag(record: logging.LogRecord) -> bool:
        record.name = f"{record.name}[worker {index}]"
        return True

    for handler in logging.getLogger().handlers:
        handler.addFilter(tag)


async def serve_worker(sock: socket.socket) -> None:
    """Serve as a worker until the primary says stop, SIGTERM comes, or the primary is gone."""
    reader, writer = await asyncio.open_unix_connection(sock=sock)
    worker = Worker()
    channel = Channel(reader, writer, worker.handle)
    worker.channel = channel
    loop = asyncio.get_running_loop()
    with contextlib.suppress(NotImplementedError, RuntimeError):
        loop.add_signal_handler(signal.SIGTERM, worker.stop.set)
    reading = loop.create_task(channel.run())
    flushing = loop.create_task(worker.flush())
    gone = loop.create_task(channel.closed.wait())
    stopping = loop.create_task(worker.stop.wait())
    try:
        await asyncio.wait({gone, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if channel.closed.is_set():
            log.info("the primary serving process is gone: stopping")
        await worker.close()
    finally:
        for task in (flushing, gone, stopping, reading):
            task.cancel()
        channel.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="A worker process of `mcp-agent serve`.")
    parser.add_argument("--fd", type=int, required=True, help="the socket to the primary")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the primary stops the workers on Ctrl-C
    sock = socket.socket(fileno=args.fd)
    try:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass
    try:
        asyncio.run(serve_worker(sock))
    except Exception as e:
        print(f"mcp-agent worker: {e}", file=sys.stderr)
        raise SystemExit(1) from e


if __name__ == "__main__":
    main()
