"""``mcp-agent run``: the enrolled agent — local inference server plus the fleet session.

It reads the enrollment stored by ``mcp-agent enroll`` (device id, broker URL, per-device
credentials), serves the models under ``--model-path`` over HTTP exactly like ``serve``, and
keeps one MQTT 5 session to the broker: birth/will status, health and inference telemetry
(spooled on disk while offline), commands, and MQTT inference on the device's own topics and
the fleet's shared topics. Model distribution from the control plane comes with signed desired
states; until then the models are the ones on disk.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import urlsplit

import click

from agent.runtime.manager import ModelManager
from agent.serve import Attach
from shared.errors import McpError
from shared.profiles import HardwareProfile


def broker_address(url: str) -> tuple[str, int, bool]:
    """``mqtt://host:port`` / ``mqtts://host:port`` → (host, port, tls). Raises IdentityError."""
    from agent.identity import IdentityError

    parts = urlsplit(url)
    if parts.scheme not in ("mqtt", "mqtts", "tcp", "ssl") or not parts.hostname:
        raise IdentityError(f"broker URL {url!r} must look like mqtt://host:1883")
    tls = parts.scheme in ("mqtts", "ssl")
    return parts.hostname, parts.port or (8883 if tls else 1883), tls


def fleet_attachment(
    state_dir: Path, *, health_interval_s: float, inference_interval_s: float
) -> Attach:
    """The ``attach`` hook for :func:`agent.serve.run_server` that runs the fleet session."""
    # Imported here so `mcp-agent serve` does not load the enrollment and signing code.
    from agent.identity import IdentityError, load_enrollment
    from shared.protocol.enrollment import EnrollmentStatus

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

    @contextlib.asynccontextmanager
    async def attach(manager: ModelManager, profile: HardwareProfile) -> AsyncIterator[object]:
        import ssl

        from agent.fleet.metrics import FleetMetrics
        from agent.fleet.session import FleetConfig, FleetSession
        from agent.fleet.spool import Spool
        from agent.fleet.telemetry import HealthCollector

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
        spool = Spool(state_dir / "spool.sqlite3")
        health = HealthCollector(sources=profile.telemetry.sources, disk_path=state_dir)
        async with FleetSession(
            config, spool=spool, manager=manager, health=health,
            metrics=FleetMetrics(manager.metrics.registry),
        ) as session:
            yield session

    return attach


@click.command("run")
@click.option("--model-path", required=True, type=click.Path(exists=True, path_type=Path),
              help="A model file (.onnx, .tflite, .mcpb) or a directory of them.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Local HTTP address.")
@click.option("--port", default=8080, show_default=True, type=click.IntRange(0, 65535))
@click.option("--workers", default=1, show_default=True, type=click.IntRange(1, 64))
@click.option("--state-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where `mcp-agent enroll` stored the identity (default: /var/lib/mcp-agent).")
@click.option("--trust-key", "trust_keys", multiple=True,
              type=click.Path(exists=True, path_type=Path), help="Publisher public key.")
@click.option("--health-interval", default=30.0, show_default=True,
              type=click.FloatRange(1, 86_400), help="Seconds between health samples.")
@click.option("--stats-interval", default=60.0, show_default=True,
              type=click.FloatRange(1, 86_400), help="Seconds between inference statistics.")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]))
def run_command(
    model_path: Path, host: str, port: int, workers: int, state_dir: Path | None,
    trust_keys: tuple[Path, ...], health_interval: float, stats_interval: float, log_level: str,
) -> None:
    """Run enrolled: serve models locally and keep the fleet session to the broker.

    \b
    Examples:
      mcp-agent enroll --server http://cp:8080 --token $TOKEN
      mcp-agent run --model-path /var/lib/mcp-agent/models
    """
    from agent.serve import ServeConfig, configure_logging, default_state_dir, run_until_stopped
    from shared.signing import read_public_key

    configure_logging(log_level)
    state = state_dir or default_state_dir()
    try:
        attach = fleet_attachment(
            state, health_interval_s=health_interval, inference_interval_s=stats_interval
        )
        keys = tuple(read_public_key(p) for p in trust_keys)
    except McpError as e:
        raise click.ClickException(str(e)) from e
    config = ServeConfig(
        model_path=model_path, host=host, port=port, workers=workers, trusted_keys=keys,
        state_dir=state,
    )
    run_until_stopped(config, attach)
