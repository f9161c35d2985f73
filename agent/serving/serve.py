"""``mcp-agent serve``: the standalone local inference server (no control plane needed)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import click
from aiohttp import web

from mcp_edge.agent.runtime.batcher import BatchingConfig
from mcp_edge.agent.runtime.manager import ModelManager, ModelSource, RunnerFactory
from mcp_edge.agent.runtime.runner import ModelRunner
from mcp_edge.agent.serving.http_api import DEFAULT_MAX_BODY, build_app
from mcp_edge.agent.serving.model_dir import (
    ModelDirectory,
    ModelDirectoryError,
    ModelDirectoryWatcher,
)
from mcp_edge.shared.errors import McpError
from mcp_edge.shared.profiles import HardwareProfile
from mcp_edge.shared.protocol.canary import DEFAULT_CANARY_POLICY, CanaryPolicy

if TYPE_CHECKING:
    from mcp_edge.shared.signing import PublicKey

log = logging.getLogger("mcp.agent")


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
    port: int = 8080
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
    profile: HardwareProfile, *, workers: int, threads: int | None, backend: str | None
) -> RunnerFactory:
    from mcp_edge.agent.runtime.loader import load_runner

    per_instance = threads
    if per_instance is None and workers > 1:
        per_instance = max(1, (os.cpu_count() or 1) // workers)

    def build(source: ModelSource) -> Sequence[ModelRunner]:
        runners: list[ModelRunner] = []
        try:
            for _ in range(workers):
                runners.append(
                    load_runner(source.model_path, profile, backend=backend, threads=per_instance)
                )
        except BaseException:
            for r in runners:
                r.close()
            raise
        return runners

    return build


Attach = Callable[[ModelManager, HardwareProfile], AbstractAsyncContextManager[object]]
"""Something that runs beside the local server for as long as it serves (the fleet session)."""


async def run_server(
    config: ServeConfig, *, ready: asyncio.Event | None = None, attach: Attach | None = None
) -> None:
    """Load the models, serve until SIGINT/SIGTERM (or cancellation), then drain and stop.

    ``attach`` is entered once the models are loaded and the HTTP server listens, and left
    before the server stops (``mcp-agent run`` attaches its fleet session here).
    """
    profile, reasons = choose_profile(config.profile)
    log.info("profile %s (%s)", profile.name, "; ".join(reasons[:3]))
    manager = ModelManager(
        runner_factory(
            profile, workers=config.workers, threads=config.threads, backend=config.backend
        ),
        batching=config.batching,
    )
    watcher = None
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
        if config.watch_interval_s:
            watcher = ModelDirectoryWatcher(
                model_dir, manager, known, interval_s=config.watch_interval_s
            )
            watcher.start()
    app = build_app(manager, max_body=config.max_body)
    runner = web.AppRunner(app, access_log=log if config.access_log else None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port, reuse_address=True)
    await site.start()
    for name in manager.names():
        lv = manager.get(name)
        log.info("serving %s %s on %s/%s", name, lv.version, lv.info.backend, lv.info.provider)
    names = manager.names()
    where = f"http://{config.host}:{config.port}"
    if names:
        click.echo(
            f"mcp-agent: serving {', '.join(names)} on {where} "
            f"(profile {profile.name}; try GET /v2/models/{names[0]})",
            err=True,
        )
    else:
        click.echo(
            f"mcp-agent: listening on {where} (profile {profile.name}); models come from the "
            "state dir and the control plane's desired state",
            err=True,
        )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    try:
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
        await runner.cleanup()
        await manager.close()


def _install_event_loop() -> None:
    try:
        import uvloop
    except ImportError:
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


def run_until_stopped(config: ServeConfig, attach: Attach | None = None) -> None:
    """The CLI side of :func:`run_server`: uvloop where available, errors as one clean line."""
    _install_event_loop()
    try:
        asyncio.run(run_server(config, attach=attach))
    except (ModelDirectoryError, McpError, ValueError) as e:
        raise click.ClickException(str(e)) from e
    except OSError as e:
        raise click.ClickException(
            f"cannot listen on {config.host}:{config.port}: {e.strerror or e}"
        ) from e


@click.command("serve")
@click.option(
    "--model-path",
    required=True,
    type=click.Path(exists=True, path_type=Path),
    help="A model file (.onnx, .tflite, .mcpb) or a directory of them.",
)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8080, show_default=True, type=click.IntRange(0, 65535))
@click.option(
    "--workers",
    default=1,
    show_default=True,
    type=click.IntRange(1, 64),
    help="Model instances per model; requests go to the least loaded.",
)
@click.option(
    "--threads",
    type=click.IntRange(1, 256),
    default=None,
    help="Backend threads per instance (default: the profile's).",
)
@click.option("--max-batch-size", default=32, show_default=True, type=click.IntRange(1, 4096))
@click.option(
    "--max-queue-delay-ms",
    default=0.0,
    show_default=True,
    type=click.FloatRange(0, 10_000),
    help="How long a partial batch may wait for more requests.",
)
@click.option(
    "--max-queue",
    default=1024,
    show_default=True,
    type=click.IntRange(1, 1_000_000),
    help="Requests waiting per model version before answering 429.",
)
@click.option(
    "--timeout-ms",
    default=30_000.0,
    show_default=True,
    type=click.FloatRange(1, 3_600_000),
    help="Default per-request deadline (504 past it).",
)
@click.option("--no-batching", is_flag=True, help="Run every request on its own.")
@click.option(
    "--inline-below-us",
    default=200.0,
    show_default=True,
    type=click.FloatRange(0, 1_000_000),
    help="Batches faster than this run on the event loop (0: always on worker threads).",
)
@click.option("--profile", default=None, help="Hardware profile to use instead of detecting one.")
@click.option(
    "--backend",
    default=None,
    help="Backend or provider to try first (cpu, cuda, tensorrt, coreml, openvino, xnnpack).",
)
@click.option(
    "--trust-key",
    "trust_keys",
    multiple=True,
    type=click.Path(exists=True, path_type=Path),
    help="Publisher public key; when given, bundles must be signed by one of them.",
)
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
    "--watch-interval",
    default=1.0,
    show_default=True,
    type=click.FloatRange(0, 3600),
    help="Seconds between checks for replaced model files (0: no hot reload).",
)
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where bundles are unpacked (default: /var/lib/mcp-agent or ~/.local/state).",
)
@click.option("--max-body-mb", default=8, show_default=True, type=click.IntRange(1, 1024))
@click.option("--access-log", is_flag=True, help="Log every request.")
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
@click.option(
    "--log-level",
    default="info",
    show_default=True,
    type=click.Choice(["debug", "info", "warning", "error"]),
)
def serve_command(
    model_path: Path,
    host: str,
    port: int,
    workers: int,
    threads: int | None,
    max_batch_size: int,
    max_queue_delay_ms: float,
    max_queue: int,
    timeout_ms: float,
    no_batching: bool,
    inline_below_us: float,
    profile: str | None,
    backend: str | None,
    trust_keys: tuple[Path, ...],
    canaries: tuple[str, ...],
    shadows: tuple[Path, ...],
    canary_max_error_rate: float,
    watch_interval: float,
    state_dir: Path | None,
    max_body_mb: int,
    access_log: bool,
    drift: bool,
    drift_sample_every: int,
    log_level: str,
) -> None:
    """Serve models over HTTP (Open Inference Protocol v2 and /v1/infer) with no control plane.

    \b
    Examples:
      mcp-agent serve --model-path digits.onnx --port 8080
      mcp-agent serve --model-path models/ --workers 2 --trust-key publisher.pub
      mcp-agent serve --model-path digits.onnx --canary next/digits.onnx:0.2
      curl localhost:8080/v2/models/digits
    """
    configure_logging(log_level)
    try:
        keys: tuple[PublicKey, ...] = ()
        if trust_keys:  # PyNaCl is loaded only when keys are given: ~1 MiB of RSS otherwise
            from mcp_edge.shared.signing import read_public_key

            keys = tuple(read_public_key(p) for p in trust_keys)
        candidates = tuple(parse_canary(c) for c in canaries)
    except (McpError, ValueError) as e:
        raise click.ClickException(str(e)) from e
    candidates += tuple(Candidate("shadow", p) for p in shadows)
    config = ServeConfig(
        model_path=model_path,
        host=host,
        port=port,
        workers=workers,
        threads=threads,
        batching=BatchingConfig(
            max_batch_size=1 if no_batching else max_batch_size,
            max_queue_delay_s=max_queue_delay_ms / 1000.0,
            max_queue=max_queue,
            default_timeout_s=timeout_ms / 1000.0,
            inline_below_s=inline_below_us / 1e6,
        ),
        profile=profile,
        backend=backend,
        trusted_keys=keys,
        watch_interval_s=watch_interval or None,
        state_dir=state_dir or default_state_dir(),
        max_body=max_body_mb * 1024 * 1024,
        access_log=access_log,
        candidates=candidates,
        canary_max_error_rate=canary_max_error_rate,
    )
    attach = None
    if drift:  # pydantic (the policy) and the drift maths load only when asked
        from mcp_edge.agent.fleet.drift import local_drift
        from mcp_edge.shared.protocol.state import DriftPolicy

        attach = local_drift(DriftPolicy(sample_every=drift_sample_every))
    run_until_stopped(config, attach)
