"""``mcp-agent run``: the enrolled agent — local inference server plus the fleet session.

It reads the enrollment stored by ``mcp-agent enroll`` (device id, broker URL, per-device
credentials), serves the models under ``--model-path`` over HTTP exactly like ``serve``, and
keeps one MQTT 5 session to the broker: birth/will status, health and inference telemetry
(spooled on disk while offline), commands, and MQTT inference on the device's own topics and
the fleet's shared topics. Signed desired states go to the update agent
(:mod:`agent.update.updater`), which installs models into the state directory from the TUF
repository over MQTT (or ``--repo``) and serves them beside the ones under ``--model-path``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import click

from mcp_edge.agent.config import config_option
from mcp_edge.agent.runtime.manager import ModelManager
from mcp_edge.agent.serving.serve import (
    Attach,
    ServingOptions,
    model_path_option,
    serving_options,
)
from mcp_edge.shared.cli_style import log_options, setup_logging
from mcp_edge.shared.profiles import HardwareProfile

if TYPE_CHECKING:
    from mcp_edge.agent.identity import StoredTrust
    from mcp_edge.agent.update.transport import RepoTransport
    from mcp_edge.shared.signing import PublicKey
    from mcp_edge.shared.tracing import Tracing


def broker_address(url: str) -> tuple[str, int, bool]:
    """``mqtt://host:port`` / ``mqtts://host:port`` → (host, port, tls). Raises IdentityError."""
    from mcp_edge.agent.identity import IdentityError

    parts = urlsplit(url)
    if parts.scheme not in ("mqtt", "mqtts", "tcp", "ssl") or not parts.hostname:
        raise IdentityError(f"broker URL {url!r} must look like mqtt://host:1883")
    tls = parts.scheme in ("mqtts", "ssl")
    return parts.hostname, parts.port or (8883 if tls else 1883), tls


def repo_transport(url: str) -> RepoTransport:
    """The transport for ``--repo``: ``file:///dir`` or a plain path, or ``http(s)://...``.

    Raises ValueError for another scheme or a missing directory.
    """
    from mcp_edge.agent.update.transport_file import FileRepoTransport

    scheme = urlsplit(url).scheme
    if scheme in ("http", "https"):
        from mcp_edge.agent.update.transport_http import HttpRepoTransport

        return HttpRepoTransport(url)
    if scheme in ("", "file"):
        return FileRepoTransport(url)
    raise ValueError(f"--repo {url!r}: use file:///path, http:// or https://")


def fleet_attachment(
    state_dir: Path,
    *,
    health_interval_s: float,
    inference_interval_s: float,
    transport: RepoTransport | None = None,
    max_reply_bytes: int | None = None,
    tracing: Tracing | None = None,
) -> Attach:
    """The ``attach`` hook for :func:`agent.serving.serve.run_server` that runs the fleet session.

    ``transport``: where model updates come from (``--repo``); None: over MQTT. ``tracing``:
    where deployment spans go (continuing the control plane's deploy call); None: off.
    """
    # Imported here so `mcp-agent serve` does not load the enrollment and signing code.
    from mcp_edge.agent.identity import IdentityError, load_enrollment
    from mcp_edge.shared.protocol.wire import EnrollmentStatus

    enrollment = load_enrollment(state_dir)
    if enrollment is None:
        raise IdentityError(f"{state_dir}: not enrolled; run `mcp-agent enroll` first")
    answer = enrollment.answer
    if answer.status is not EnrollmentStatus.ACCEPTED or answer.broker is None:
        raise IdentityError(
            f"enrollment of {answer.device_id} is {answer.status.value}; an operator must "
            "approve it, then run `mcp-agent enroll` again"
        )
    host, port, tls = broker_address(answer.broker.urls[0])
    trust = _trust(state_dir, answer.trust)

    @contextlib.asynccontextmanager
    async def attach(manager: ModelManager, profile: HardwareProfile) -> AsyncIterator[object]:
        import ssl

        from mcp_edge.agent.fleet.metrics import FleetMetrics
        from mcp_edge.agent.fleet.session import FleetConfig, FleetSession
        from mcp_edge.agent.fleet.spool import Spool
        from mcp_edge.agent.fleet.telemetry import HealthCollector
        from mcp_edge.agent.update.transport_mqtt import MqttRepoTransport
        from mcp_edge.shared.mqtt import MqttClient

        assert answer.broker is not None
        config = FleetConfig(
            device_id=answer.device_id,
            host=host,
            port=port,
            username=answer.broker.username,
            password=answer.broker.password,
            client_id=answer.broker.client_id,
            tls=ssl.create_default_context() if tls else None,
            health_interval_s=health_interval_s,
            inference_interval_s=inference_interval_s,
        )
        if max_reply_bytes is not None:
            config = dataclasses.replace(config, max_reply_bytes=max_reply_bytes)
        from mcp_edge.agent.update.updater import UpdateAgent

        # One client for the session and the repository over MQTT: agent.fleet and
        # agent.update do not import each other; they meet here.
        mqtt = MqttClient(config.mqtt_settings())
        mqtt_repo = None if transport is not None else MqttRepoTransport(mqtt, answer.device_id)
        spool = Spool(state_dir / "spool.sqlite3")
        health = HealthCollector(sources=profile.telemetry.sources, disk_path=state_dir)
        updates: list[UpdateAgent] = []
        ready = asyncio.Event()

        async def on_desired(envelope: Any) -> None:
            await ready.wait()  # desired states wait until installed models are back
            try:
                await updates[0].handle_desired(envelope)
            finally:
                # Serve the fleet topics of what is live now, not at the next health sample.
                await session.sync_models()

        async with FleetSession(
            config,
            spool=spool,
            manager=manager,
            health=health,
            metrics=FleetMetrics(manager.metrics.registry),
            desired_handler=on_desired,
            state_provider=lambda: updates[0].reported_state(),
            mqtt=mqtt,
            repo=mqtt_repo,
        ) as session:
            repo = transport if transport is not None else mqtt_repo
            assert repo is not None
            update = UpdateAgent(
                state_dir, answer.device_id, profile, manager, repo, trust[0], events=session,
                tuf_root=trust[1], tracing=tracing,
            )  # fmt: skip
            updates.append(update)
            await update.resume()
            ready.set()
            await session.sync_models()
            yield session

    return attach


def _trust(state_dir: Path, trust: StoredTrust | None) -> tuple[list[PublicKey], bytes | None]:
    """Director keys and the TUF root this device was given at enrollment."""
    import json

    from mcp_edge.agent.update.trust_root import load_bootstrap_root
    from mcp_edge.shared.signing import PublicKey

    if trust is None:
        return [], load_bootstrap_root(state_dir)
    keys = [PublicKey.from_hex(k) for k in trust.director_keys]
    root = load_bootstrap_root(state_dir)
    if root is None and trust.tuf_root is not None:
        root = json.dumps(trust.tuf_root).encode()
    return keys, root


@click.command("run")
@config_option()
@model_path_option(
    required=False,
    help="Also serve this model file (.onnx, .tflite, .mcpb) or directory of them, "
    "beside the models the control plane deploys.",
)
@serving_options
@click.option(
    "--repo",
    "repo_url",
    default=None,
    metavar="URL",
    help="Fetch model updates from this TUF repository (file:///media/usb/repo, "
    "https://cdn/repo) instead of over MQTT from the control plane.",
)
@click.option(
    "--health-interval",
    default=30.0,
    show_default=True,
    type=click.FloatRange(1, 86_400),
    help="Seconds between health samples.",
)
@click.option(
    "--stats-interval",
    default=60.0,
    show_default=True,
    type=click.FloatRange(1, 86_400),
    help="Seconds between inference statistics.",
)
@click.option(
    "--max-reply-mb",
    default=None,
    type=click.FloatRange(0.001, 32),
    help="Largest inference answer sent over MQTT, in MiB (default 4: "
    "InferResponse.DEFAULT_MQTT_REPLY_BYTES); a bigger one becomes a too_large "
    "error reply. Application clients accept 4 MiB unless told more.",
)
@log_options
def run_command(
    model_path: Path | None,
    serving: ServingOptions,
    repo_url: str | None,
    health_interval: float,
    stats_interval: float,
    max_reply_mb: float | None,
    log_level: str,
    log_format: str,
) -> None:
    """Run enrolled: serve models locally and keep the fleet session to the broker.

    Every option can also come from a TOML file (--config, default /etc/mcp-agent/agent.toml
    when it exists; docs/agent.md): the command line wins over MCP_* variables, which win
    over the file.

    \b
    Examples:
      mcp-agent enroll --server http://cp:8080 --token $TOKEN
      mcp-agent run                       # models come from the control plane
      mcp-agent run --model-path ./models # plus local ones
      mcp-agent run --config agent.toml --port 8001
    """
    from mcp_edge.agent.serving.serve import agent_tracing, run_until_stopped

    setup_logging(log_level.lower(), log_format)
    try:
        transport = repo_transport(repo_url) if repo_url else None
    except ValueError as e:
        raise click.UsageError(str(e)) from e
    config = serving.config(model_path)
    tracing = agent_tracing(config.otlp_endpoint)
    attach = fleet_attachment(
        serving.state,
        health_interval_s=health_interval,
        inference_interval_s=stats_interval,
        transport=transport,
        max_reply_bytes=None if max_reply_mb is None else int(max_reply_mb * 1024 * 1024),
        tracing=tracing,
    )
    run_until_stopped(config, attach, tracing)
