"""``mcp-agent serve``: the standalone local inference server (no control plane needed)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from mcp_edge.agent.runtime.batcher import BatchingConfig
from mcp_edge.agent.runtime.manager import ModelManager, ModelSource, RunnerFactory
from mcp_edge.agent.runtime.runner import ModelRunner
from mcp_edge.agent.serving.http_api import DEFAULT_MAX_BODY, build_server
from mcp_edge.agent.serving.http_server import HttpServer
from mcp_edge.agent.serving.model_control import ModelControl
from mcp_edge.agent.serving.model_dir import (
    ModelDirectory,
    ModelDirectoryWatcher,
)
from mcp_edge.agent.serving.service import FrontDoor
from mcp_edge.shared.cli_style import JsonFormatter, log_options, setup_logging
from mcp_edge.shared.errors import McpError
from mcp_edge.shared.profiles import HardwareProfile
from mcp_edge.shared.protocol.canary import DEFAULT_CANARY_POLICY, CanaryPolicy

if TYPE_CHECKING:
    from mcp_edge.agent.serving.grpc_api import GrpcServer
    from mcp_edge.agent.serving.workers import ReplicaGroup
    from mcp_edge.shared.signing import PublicKey
    from mcp_edge.shared.tracing import Tracing

log = logging.getLogger("mcp.agent")

DEFAULT_PORT = 8000
"""The agent's HTTP port unless told otherwise; the control plane's is 8080, so both fit on
one machine with their defaults."""


class ListenError(McpError):
    """The HTTP server cannot listen on the address it was given."""


@dataclass(frozen=True)
class Candidate:
    """A second version of a served model: a weighted canary or a shadow."""

    role: str
    path: Path
    weight: float = 0.0


def parse_canary(text: str) -> Candidate:
    """``FILE[:WEIGHT]`` (weight 0..1, default the canary policy's) → a canary candidate.
    Raises ValueError."""
    path, _, weight = text.rpartition(":") if ":" in text else (text, "", "")
    try:
        w = float(weight) if weight else DEFAULT_CANARY_POLICY.weight
    except ValueError:
        raise ValueError(f"--canary {text!r}: weight must be a number from 0 to 1") from None
    if not 0.0 <= w <= 1.0:
        raise ValueError(f"--canary {text!r}: weight must be from 0 to 1")
    if not Path(path).is_file():
        raise ValueError(f"--canary {text!r}: {path} is not a file")
    return Candidate("canary", Path(path), w)


@dataclass(frozen=True)
class ServeConfig:
    """Everything ``serve`` needs, parsed once from flags."""

    model_path: Path | None
    """A model file or directory to serve and watch; None: only what ``attach`` installs."""
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    """0: any free port (the one bound is printed)."""
    workers: int = 1
    """Model instances per model version (sessions the batcher dispatches between)."""
    threads: int | None = None
    """Backend threads per instance; None: the profile's default split across instances."""
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    profile: str | None = None
    backend: str | None = None
    trusted_keys: tuple[PublicKey, ...] = ()
    watch_interval_s: float | None = 1.0
    state_dir: Path = field(default_factory=lambda: default_state_dir())
    max_body: int = DEFAULT_MAX_BODY
    access_log: bool = False
    candidates: tuple[Candidate, ...] = ()
    canary_max_error_rate: float = DEFAULT_CANARY_POLICY.max_error_rate
    grpc_port: int | None = None
    """Also serve ``inference.GRPCInferenceService`` here (0: any free port); None: no gRPC."""
    processes: int | None = None
    """Serving processes (each with its own model instances); 0: one per four cores; None:
    the profile's ``runtime.processes``."""
    model_control: str = "poll"
    """``poll``: reload model files as they change; ``explicit``: load and unload only through
    the repository API (no watcher)."""
    otlp_endpoint: str | None = None
    """Where traces go (OTLP/HTTP); None: no tracing (:mod:`shared.tracing`)."""


def serving_processes(config: ServeConfig, profile: HardwareProfile) -> int:
    """How many processes serve: ``--processes``, else the profile's (0: one per four cores)."""
    from mcp_edge.agent.serving.workers import MAX_PROCESSES, auto_processes

    wanted = config.processes if config.processes is not None else profile.runtime.processes
    return min(MAX_PROCESSES, wanted or auto_processes())


def build_manager(config: ServeConfig, profile: HardwareProfile, processes: int) -> ModelManager:
    """The model manager one serving process runs (the primary and each worker alike)."""
    return ModelManager(
        runner_factory(
            profile,
            workers=config.workers,
            threads=config.threads,
            backend=config.backend,
            cache_dir=config.state_dir / "cache",
            processes=processes,
        ),
        batching=config.batching,
    )


def default_state_dir() -> Path:
    """``/var/lib/mcp-agent`` for root, else ``$XDG_STATE_HOME/mcp-agent`` (~/.local/state)."""
    if os.geteuid() == 0:
        return Path("/var/lib/mcp-agent")
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "mcp-agent"


def choose_profile(name: str | None) -> tuple[HardwareProfile, list[str]]:
    """The profile for this box (or ``name``) and the reasons it was chosen."""
    from mcp_edge.agent.hardware import collect_facts, select_profile
    from mcp_edge.shared.profiles import load_profiles

    choice = select_profile(collect_facts(), load_profiles(), override=name)
    return choice.profile, list(choice.reasons)


def runner_factory(
    profile: HardwareProfile,
    *,
    workers: int,
    threads: int | None,
    backend: str | None,
    cache_dir: Path | None = None,
    processes: int = 1,
) -> RunnerFactory:
    """Open ``workers`` runners per model version with :func:`load_runner`.

    ``cache_dir``: the agent's cache directory (``STATE_DIR/cache``), where backends keep
    compiled models and engines; None: no caches. With several instances or serving
    processes and no ``threads``, the cores are split between all of them.
    """
    from mcp_edge.agent.runtime.loader import load_runner

    per_instance = threads
    if per_instance is None and workers * processes > 1:
        per_instance = max(1, (os.cpu_count() or 1) // (workers * processes))

    def build(source: ModelSource) -> Sequence[ModelRunner]:
        runners: list[ModelRunner] = []
        try:
            for _ in range(workers):
                runners.append(
                    load_runner(
                        source.model_path,
                        profile,
                        backend=source.backend or backend,
                        threads=per_instance,
                        cache_dir=cache_dir,
                    )
                )
        except BaseException:
            for r in runners:
                r.close()
            raise
        return runners

    return build


def listen_url(host: str, addresses: Sequence[Any]) -> str:
    """``http://HOST:PORT`` with the port the server really bound (``--port 0`` picks one)."""
    port = addresses[0][1] if addresses else 0
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"


Attach = Callable[[ModelManager, HardwareProfile], AbstractAsyncContextManager[object]]
"""Something that runs beside the local server for as long as it serves (the fleet session)."""


async def run_server(
    config: ServeConfig,
    *,
    ready: asyncio.Event | None = None,
    attach: Attach | None = None,
    tracing: Tracing | None = None,
) -> None:
    """Load the models, serve until SIGINT/SIGTERM (or cancellation), then drain and stop.

    ``attach`` is entered once the models are loaded and the HTTP server listens, and left
    before the server stops (``mcp-agent run`` attaches its fleet session here). ``tracing``:
    where inference spans go (the caller owns it and shuts it down); None: no tracing.
    """
    profile, reasons = choose_profile(config.profile)
    log.info("profile %s (%s)", profile.name, "; ".join(reasons[:3]))
    processes = serving_processes(config, profile)
    manager = build_manager(config, profile, processes)
    watcher = None
    model_dir = None
    if config.model_path is not None:
        model_dir = ModelDirectory(
            config.model_path,
            state_dir=config.state_dir,
            profile=profile,
            trusted_keys=config.trusted_keys,
        )
        model_dir.reset_bundle_dir()
        known = await model_dir.load_all(manager)
        for cand in config.candidates:
            source = model_dir.source_for(cand.path)
            await manager.load(
                source,
                role=cand.role,
                canary=CanaryPolicy(
                    weight=cand.weight, max_error_rate=config.canary_max_error_rate
                ),
            )
        if config.watch_interval_s and config.model_control != "explicit":
            watcher = ModelDirectoryWatcher(
                model_dir, manager, known, interval_s=config.watch_interval_s
            )
            watcher.start()
    control = ModelControl(manager, model_dir, explicit=config.model_control == "explicit")
    front = FrontDoor(manager, control=control, tracing=tracing)
    http = build_server(
        manager,
        max_body=config.max_body,
        front=front,
        access_log=log if config.access_log else None,
    )
    grpc_server: GrpcServer | None = None
    group: ReplicaGroup | None = None
    try:
        try:
            await http.start(config.host, config.port, reuse_port=processes > 1)
        except OSError as e:
            reason = os.strerror(e.errno) if e.errno else str(e)
            raise ListenError(f"cannot listen on {config.host}:{config.port}: {reason}") from e
        if config.grpc_port is not None:
            grpc_server = await _start_grpc(front, config)
        if processes > 1:
            group = await _start_workers(config, manager, front, processes, http, grpc_server)
        for name in manager.names():
            lv = manager.get(name)
            log.info("serving %s %s on %s/%s", name, lv.version, lv.info.backend, lv.info.provider)
        # Stopping works from the moment the address is announced.
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, stop.set)
        where = listen_url(config.host, http.addresses)
        _announce(where, profile, manager.names(), attach, watching=watcher is not None)
        if grpc_server is not None:
            _say(
                f"gRPC (inference.GRPCInferenceService) on {_host_port(config.host, grpc_server.port)}"
            )
        if processes > 1:
            _say(f"{processes} serving processes share these ports")
        if config.model_control == "explicit":
            _say("explicit model control: POST /v2/repository/models/NAME/load|unload")
        async with contextlib.AsyncExitStack() as stack:
            if attach is not None:
                await stack.enter_async_context(attach(manager, profile))
            if ready is not None:
                ready.set()
            await stop.wait()
    finally:
        log.info("shutting down: draining requests")
        if watcher is not None:
            await watcher.stop()
        if group is not None:
            manager.replicas = None
            front.cluster = None
            await group.stop()
        if grpc_server is not None:
            await grpc_server.stop()
        await http.stop()
        await manager.close()


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def _start_grpc(front: FrontDoor, config: ServeConfig) -> GrpcServer:
    """The gRPC service on ``config.grpc_port``. Raises ListenError (also when the grpc extra
    is not installed)."""
    assert config.grpc_port is not None
    try:
        from mcp_edge.agent.serving.grpc_api import GrpcServer
    except ImportError as e:
        raise ListenError(
            f"--grpc-port needs grpcio and tritonclient ({e.name or e}); "
            "pip install 'mcp-edge[grpc]'"
        ) from e
    server = GrpcServer(front, config.host, config.grpc_port, max_message=config.max_body)
    try:
        await server.start()
    except OSError as e:
        raise ListenError(str(e)) from e
    return server


async def _start_workers(
    config: ServeConfig,
    manager: ModelManager,
    front: FrontDoor,
    processes: int,
    http: HttpServer,
    grpc_server: GrpcServer | None,
) -> ReplicaGroup:
    """Start the worker processes on the ports this process bound and put them in step."""
    from mcp_edge.agent.serving.workers import ReplicaGroup

    root = logging.getLogger()
    json_logs = any(isinstance(h.formatter, JsonFormatter) for h in root.handlers)
    group = ReplicaGroup(
        config,
        manager,
        front,
        processes=processes,
        http_port=http.addresses[0][1],
        grpc_port=None if grpc_server is None else grpc_server.port,
        log_level=logging.getLevelName(root.level).lower(),
        log_format="json" if json_logs else "text",
    )
    await group.start()
    manager.replicas = group
    front.cluster = group
    manager.metrics.processes.set(processes)
    return group


def _say(line: str) -> None:
    """A start-up line for the operator on stderr; a log record when the log is JSON, so
    that stderr stays one JSON object per line."""
    if any(isinstance(h.formatter, JsonFormatter) for h in logging.getLogger().handlers):
        log.info("%s", line)
    else:
        click.echo(f"mcp-agent: {line}", err=True)


def _announce(
    where: str,
    profile: HardwareProfile,
    names: Sequence[str],
    attach: Attach | None,
    *,
    watching: bool,
) -> None:
    """Where the server listens (the port really bound) and what it serves."""
    _say(f"listening on {where} (profile {profile.name})")
    if names:
        _say(f"serving {', '.join(names)} on {where}; try GET {where}/v2/models/{names[0]}")
    elif attach is not None:
        _say("no model yet; models come from the state dir and the control plane's desired state")
    elif watching:
        _say("no model yet; model files put under --model-path load as they appear")


def agent_tracing(endpoint: str | None) -> Tracing | None:
    """The agent's :class:`Tracing` for ``endpoint`` (None: off). Raises McpError."""
    from mcp_edge.shared.tracing import setup_tracing

    return setup_tracing("mcp-agent", endpoint)


def _install_event_loop() -> None:
    try:
        import uvloop
    except ImportError:
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def run_until_stopped(
    config: ServeConfig, attach: Attach | None = None, tracing: Tracing | None = None
) -> None:
    """The CLI side of :func:`run_server`: uvloop where available; ``tracing`` is shut down
    (its last spans sent) when the server has stopped. Expected failures
    (:class:`McpError`, OSError) propagate for the command line to print in one line."""
    _install_event_loop()
    try:
        asyncio.run(run_server(config, attach=attach, tracing=tracing))
    finally:
        if tracing is not None:
            tracing.shutdown()


# ---------------------------------------------------------------------------- options
# The options `mcp-agent serve` and `mcp-agent run` share: defined once, here.
_OptionDecorator = Callable[[Callable[..., Any]], Callable[..., Any]]

_SERVING_OPTIONS: tuple[_OptionDecorator, ...] = (
    click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on."),
    click.option(
        "--port",
        default=DEFAULT_PORT,
        show_default=True,
        type=click.IntRange(0, 65535),
        help="HTTP port (0: any free port; the port bound is printed).",
    ),
    click.option(
        "--workers",
        default=1,
        show_default=True,
        type=click.IntRange(1, 64),
        help="Model instances per model; requests go to the least loaded.",
    ),
    click.option(
        "--threads",
        type=click.IntRange(1, 256),
        default=None,
        help="Backend threads per instance (default: the profile's).",
    ),
    click.option(
        "--max-batch-size",
        default=32,
        show_default=True,
        type=click.IntRange(1, 4096),
        help="Most rows one backend call runs.",
    ),
    click.option(
        "--max-queue-delay-ms",
        default=0.0,
        show_default=True,
        type=click.FloatRange(0, 10_000),
        help="How long a partial batch may wait for more requests.",
    ),
    click.option(
        "--max-queue",
        default=1024,
        show_default=True,
        type=click.IntRange(1, 1_000_000),
        help="Requests waiting per model version before answering 429.",
    ),
    click.option(
        "--timeout-ms",
        default=30_000.0,
        show_default=True,
        type=click.FloatRange(1, 3_600_000),
        help="Default per-request deadline (504 past it).",
    ),
    click.option("--no-batching", is_flag=True, help="Run every request on its own."),
    click.option(
        "--inline-below-us",
        default=200.0,
        show_default=True,
        type=click.FloatRange(0, 1_000_000),
        help="Batches faster than this run on the event loop (0: always on worker threads).",
    ),
    click.option(
        "--profile", default=None, help="Hardware profile to use instead of detecting one."
    ),
    click.option(
        "--backend",
        default=None,
        help="Runtime or provider to try first: onnxruntime, openvino, tflite, or an "
        "onnxruntime provider (cpu, cuda, tensorrt, coreml, openvino-ep, xnnpack).",
    ),
    click.option(
        "--trust-key",
        "trust_keys",
        multiple=True,
        type=click.Path(exists=True, dir_okay=False, path_type=Path),
        help="Publisher public key; when given, bundles under --model-path must be signed by "
        "one of them (repeatable).",
    ),
    click.option(
        "--watch-interval",
        default=1.0,
        show_default=True,
        type=click.FloatRange(0, 3600),
        help="Seconds between checks for replaced model files (0: no hot reload).",
    ),
    click.option(
        "--state-dir",
        type=click.Path(file_okay=False, path_type=Path),
        default=None,
        help="The agent's state: enrollment, installed models, unpacked bundles (default: "
        "/var/lib/mcp-agent for root, else $XDG_STATE_HOME/mcp-agent).",
    ),
    click.option(
        "--max-body-mb",
        default=8,
        show_default=True,
        type=click.IntRange(1, 1024),
        help="Largest HTTP request body, in MiB (413 above it).",
    ),
    click.option("--access-log", is_flag=True, help="Log every request."),
    click.option(
        "--grpc-port",
        default=None,
        type=click.IntRange(0, 65535),
        help="Also serve the Open Inference Protocol over gRPC (inference.GRPCInferenceService, "
        "what tritonclient.grpc speaks) on this port (0: any free port, printed).",
    ),
    click.option(
        "--processes",
        default=None,
        type=click.IntRange(0, 64),
        help="Serving processes sharing the port(s), each with its own model instances "
        "(0: one per four cores, 1 to 8; default: the profile's runtime.processes).",
    ),
    click.option(
        "--otlp-endpoint",
        default=None,
        metavar="URL",
        help="Send OpenTelemetry traces (each inference request; with run, each deployment) "
        "over OTLP/HTTP to URL (an OpenTelemetry Collector: http://collector:4318). Default: "
        "no tracing.",
    ),
    click.option(
        "--model-control",
        type=click.Choice(["poll", "explicit"]),
        default="poll",
        show_default=True,
        help="poll: reload model files as they change; explicit: load and unload models only "
        "through POST /v2/repository/models/NAME/load|unload (and gRPC), no file watching.",
    ),
)


@dataclass(frozen=True)
class ServingOptions:
    """The values of the serving options, as the command line (or config file) gave them."""

    host: str
    port: int
    workers: int
    threads: int | None
    max_batch_size: int
    max_queue_delay_ms: float
    max_queue: int
    timeout_ms: float
    no_batching: bool
    inline_below_us: float
    profile: str | None
    backend: str | None
    trust_keys: tuple[Path, ...]
    watch_interval: float
    state_dir: Path | None
    max_body_mb: int
    access_log: bool
    grpc_port: int | None
    processes: int | None
    otlp_endpoint: str | None
    model_control: str

    @property
    def state(self) -> Path:
        return self.state_dir or default_state_dir()

    def config(
        self,
        model_path: Path | None,
        *,
        candidates: tuple[Candidate, ...] = (),
        canary_max_error_rate: float = DEFAULT_CANARY_POLICY.max_error_rate,
    ) -> ServeConfig:
        """The server's configuration. Raises McpError for an unreadable trust key."""
        keys: tuple[PublicKey, ...] = ()
        if self.trust_keys:  # PyNaCl is loaded only when keys are given: ~1 MiB of RSS
            from mcp_edge.shared.signing import read_public_key

            keys = tuple(read_public_key(p) for p in self.trust_keys)
        return ServeConfig(
            model_path=model_path,
            host=self.host,
            port=self.port,
            workers=self.workers,
            threads=self.threads,
            batching=BatchingConfig(
                max_batch_size=1 if self.no_batching else self.max_batch_size,
                max_queue_delay_s=self.max_queue_delay_ms / 1000.0,
                max_queue=self.max_queue,
                default_timeout_s=self.timeout_ms / 1000.0,
                inline_below_s=self.inline_below_us / 1e6,
            ),
            profile=self.profile,
            backend=self.backend,
            trusted_keys=keys,
            watch_interval_s=self.watch_interval or None,
            state_dir=self.state,
            max_body=self.max_body_mb * 1024 * 1024,
            access_log=self.access_log,
            candidates=candidates,
            canary_max_error_rate=canary_max_error_rate,
            grpc_port=self.grpc_port,
            processes=self.processes,
            model_control=self.model_control,
            otlp_endpoint=self.otlp_endpoint,
        )


_SERVING_FIELDS = tuple(f.name for f in fields(ServingOptions))


def serving_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Add the serving options to a command function, which receives them as one
    ``serving: ServingOptions`` argument."""

    @functools.wraps(command)
    def wrapper(**kwargs: Any) -> Any:
        serving = ServingOptions(**{name: kwargs.pop(name) for name in _SERVING_FIELDS})
        return command(serving=serving, **kwargs)

    decorated: Callable[..., Any] = wrapper
    for option in reversed(_SERVING_OPTIONS):
        decorated = option(decorated)
    return decorated


def model_path_option(*, required: bool, help: str) -> _OptionDecorator:
    return click.option(
        "--model-path",
        required=required,
        default=None,
        type=click.Path(exists=True, path_type=Path),
        help=help,
    )


@click.command("serve")
@model_path_option(
    required=True, help="A model file (.onnx, .tflite, .mcpb) or a directory of them."
)
@serving_options
@click.option(
    "--canary",
    "canaries",
    multiple=True,
    metavar="FILE[:WEIGHT]",
    help="Serve FILE as a canary of the model it names, for WEIGHT of traffic "
    f"({DEFAULT_CANARY_POLICY.weight}).",
)
@click.option(
    "--shadow",
    "shadows",
    multiple=True,
    metavar="FILE",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Run FILE in shadow beside the model it names; only stable answers.",
)
@click.option(
    "--canary-max-error-rate",
    default=DEFAULT_CANARY_POLICY.max_error_rate,
    show_default=True,
    type=click.FloatRange(0, 1),
    help="Canary error rate that takes it out of rotation (over its last "
    f"{DEFAULT_CANARY_POLICY.window} requests, from {DEFAULT_CANARY_POLICY.min_requests} on).",
)
@click.option(
    "--drift/--no-drift",
    default=False,
    show_default=True,
    help="Measure drift of the bundles that carry a baseline and log each window "
    "(docs/agent.md, Drift).",
)
@click.option(
    "--drift-sample-every",
    default=1,
    show_default=True,
    type=click.IntRange(1, 1_000_000),
    help="With --drift: bin 1 in N answered requests.",
)
@log_options
def serve_command(
    model_path: Path,
    serving: ServingOptions,
    canaries: tuple[str, ...],
    shadows: tuple[Path, ...],
    canary_max_error_rate: float,
    drift: bool,
    drift_sample_every: int,
    log_level: str,
    log_format: str,
) -> None:
    """Serve models over HTTP and gRPC (Open Inference Protocol v2 with Triton's extensions, and
    /v1/infer) with no control plane.

    \b
    Examples:
      mcp-agent serve --model-path digits.onnx
      mcp-agent serve --model-path models/ --workers 2 --trust-key publisher.pub
      mcp-agent serve --model-path digits.onnx --canary next/digits.onnx:0.2
      mcp-agent serve --model-path digits.onnx --port 0   # any free port, printed
      mcp-agent serve --model-path models/ --grpc-port 8001 --processes 2
      curl localhost:8000/v2/models/digits
    """
    setup_logging(log_level.lower(), log_format)
    try:
        candidates = tuple(parse_canary(c) for c in canaries)
    except ValueError as e:
        raise click.UsageError(str(e)) from e
    candidates += tuple(Candidate("shadow", p) for p in shadows)
    config = serving.config(
        model_path, candidates=candidates, canary_max_error_rate=canary_max_error_rate
    )
    attach = None
    if drift:  # pydantic (the policy) and the drift maths load only when asked
        from mcp_edge.agent.fleet.drift import local_drift
        from mcp_edge.shared.protocol.state import DriftPolicy

        attach = local_drift(DriftPolicy(sample_every=drift_sample_every))
    run_until_stopped(config, attach, agent_tracing(config.otlp_endpoint))
