"""``mcp-sim``: a simulated fleet against a real control plane and broker (docs/simulator.md).

    mcp-sim enroll --control-plane URL --token TOKEN --devices N --state-dir DIR
                   [--group G] [--label k=v ...] [--preauthorize] [--prefix sim]
    mcp-sim run    --state-dir DIR [--broker mqtt://host:port] [--behaviour FILE.toml]
                   [--devices N] [--stats-interval S] [--health-interval S]
                   [--churn PCT] [--churn-offline S] [--connect-rate N]
                   [--status-file F] [--until-version MODEL=VERSION ...] [--timeout S]
    mcp-sim status --status-file F

Flags and the behaviour file become one frozen value here (:class:`.enroll.EnrollPlan`,
:class:`.runner.RunConfig`); nothing below reads them again.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path

import click
import orjson

from mcp_edge.shared.errors import McpError
from mcp_edge.tooling.sim.config import BehaviourError, load_behaviour
from mcp_edge.tooling.sim.enroll import EnrollPlan, enroll_fleet, parse_labels
from mcp_edge.tooling.sim.runner import FleetRunner, RunConfig, parse_until

_STATE_DIR = click.option(
    "--state-dir",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Where the simulated fleet lives: device keys, broker credentials, what each runs.",
)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", is_flag=True, help="Log at debug level.")
def main(verbose: bool) -> None:
    """Simulate a fleet of MCP Edge devices in one process, over the real protocol."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.WARNING,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not verbose:
        # One device's reconnect is one line at WARNING: thousands of them say nothing.
        logging.getLogger("mcp.mqtt").setLevel(logging.ERROR)


@main.command("enroll")
@click.option("--control-plane", "control_plane", required=True, metavar="URL",
              help="The control plane's base URL, e.g. http://127.0.0.1:8080.")  # fmt: skip
@click.option("--token", required=True, envvar="MCP_SIM_TOKEN",
              help="An enrollment token (mcpe_...), or an operator API token (mcpa_...): "
              "then an enrollment token for --group/--label is created, or with "
              "--preauthorize each key is accepted in advance. Also read from MCP_SIM_TOKEN.")  # fmt: skip
@click.option("--devices", required=True, type=click.IntRange(1, 200_000),
              help="How many new devices to enroll (added to the fleet already there).")  # fmt: skip
@_STATE_DIR
@click.option("--group", default=None, help="Fleet group (needs an operator API token).")
@click.option("--label", "labels", multiple=True, metavar="KEY=VALUE",
              help="Label every new device; repeatable.")  # fmt: skip
@click.option("--preauthorize", is_flag=True,
              help="With an operator token: POST each device's key to /api/v1/preauthorizations, "
              "then enroll it without an enrollment token.")  # fmt: skip
@click.option("--prefix", default="sim", show_default=True,
              help="Device ids are PREFIX-00000, PREFIX-00001, ...")  # fmt: skip
@click.option("--profile", default="generic-x86_64", show_default=True,
              help="Hardware profile the devices claim.")  # fmt: skip
@click.option("--concurrency", default=8, show_default=True, type=click.IntRange(1, 256),
              help="Enrollment requests in flight.")  # fmt: skip
@click.option("--timeout", "timeout_s", default=120.0, show_default=True,
              type=click.FloatRange(1, 3600),
              help="Seconds one request may take before it is asked again.")  # fmt: skip
def enroll_command(
    control_plane: str, token: str, devices: int, state_dir: Path, group: str | None,
    labels: tuple[str, ...], preauthorize: bool, prefix: str, profile: str, concurrency: int,
    timeout_s: float,
) -> None:  # fmt: skip
    """Enroll N simulated devices, each with its own Ed25519 key, as `mcp-agent enroll` does.

    \b
    Examples:
      mcp-sim enroll --control-plane http://127.0.0.1:8080 --token $ENROLL_TOKEN \\
                     --devices 1000 --state-dir ./fleet
      mcp-sim enroll --control-plane http://127.0.0.1:8080 --token $OPERATOR_TOKEN \\
                     --devices 2000 --group line-a --label site=lab --state-dir ./fleet
    """
    try:
        plan = EnrollPlan(
            control_plane=control_plane, token=token, devices=devices, state_dir=state_dir,
            group=group, labels=parse_labels(labels), prefix=prefix, profile=profile,
            preauthorize=preauthorize, concurrency=concurrency, timeout_s=timeout_s,
        )  # fmt: skip

        def progress(done: int, wanted: int, seconds: float) -> None:
            click.echo(f"enrolled {done}/{wanted} ({done / seconds:.0f}/s)")

        result = asyncio.run(enroll_fleet(plan, progress=progress))
    except McpError as e:
        raise click.ClickException(str(e)) from e
    click.echo(f"enrolled {result.enrolled} devices in {result.seconds:.1f} s "
               f"({result.enrolled / max(result.seconds, 1e-9):.0f}/s); the fleet in "
               f"{state_dir} holds {result.total}")  # fmt: skip
    if result.pending:
        click.echo(f"{len(result.pending)} devices wait for an operator's approval and were "
                   "not kept: " + ", ".join(result.pending[:10]))  # fmt: skip


@main.command("run")
@_STATE_DIR
@click.option("--broker", default=None, metavar="URL",
              help="mqtt://host:port every device connects to (default: its enrollment's).")  # fmt: skip
@click.option("--behaviour", "behaviour_file", default=None,
              type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="TOML file: per model version request rate, error rate, latency, load "
              "failure; fleet churn and connect rate (see docs/simulator.md).")  # fmt: skip
@click.option("--devices", default=None, type=click.IntRange(1),
              help="Run only the first N devices of the fleet.")  # fmt: skip
@click.option("--stats-interval", default=None, type=click.FloatRange(1, 86_400),
              help="Seconds between inference statistics per device; given, it holds over "
              "the desired state's telemetry policy.")  # fmt: skip
@click.option("--health-interval", default=None, type=click.FloatRange(1, 86_400),
              help="Seconds between health samples per device (default 30).")  # fmt: skip
@click.option("--churn", default=None, type=click.FloatRange(0, 100), metavar="PCT",
              help="Percent of the fleet that goes offline per minute (default 0).")  # fmt: skip
@click.option("--churn-offline", default=None, type=click.FloatRange(0, 86_400), metavar="S",
              help="Seconds a churned device stays offline (default 30).")  # fmt: skip
@click.option("--connect-rate", default=None, type=click.FloatRange(0.1, 1e6),
              help="Devices connecting per second at start (default 500).")  # fmt: skip
@click.option("--status-file", default=None, type=click.Path(dir_okay=False, path_type=Path),
              help="Write the fleet's counts here as JSON every --status-interval seconds.")  # fmt: skip
@click.option("--status-interval", default=1.0, show_default=True,
              type=click.FloatRange(0.1, 3600), help="Seconds between status file writes.")  # fmt: skip
@click.option("--summary-interval", default=10.0, show_default=True,
              type=click.FloatRange(0.5, 3600), help="Seconds between summary lines.")  # fmt: skip
@click.option("--until-version", "until", multiple=True, metavar="MODEL=VERSION",
              help="Exit 0 once every device reports VERSION of MODEL active; repeatable.")  # fmt: skip
@click.option("--timeout", default=None, type=click.FloatRange(1), metavar="S",
              help="Stop after S seconds (exit 3 when --until-version was not reached).")  # fmt: skip
@click.option("--keepalive", default=30, show_default=True, type=click.IntRange(5, 3600),
              help="MQTT keep-alive of each device, seconds.")  # fmt: skip
@click.option("--seed", default=None, type=int, help="Seed the traffic draws (repeatable runs).")
def run_command(
    state_dir: Path, broker: str | None, behaviour_file: Path | None, devices: int | None,
    stats_interval: float | None, health_interval: float | None, churn: float | None,
    churn_offline: float | None, connect_rate: float | None, status_file: Path | None,
    status_interval: float, summary_interval: float, until: tuple[str, ...],
    timeout: float | None, keepalive: int, seed: int | None,
) -> None:  # fmt: skip
    """Run the enrolled fleet: every device online over MQTT, following desired states.

    Prints progress and a summary line every --summary-interval seconds; Ctrl-C stops it
    (each device leaves with its retained offline status).

    \b
    Examples:
      mcp-sim run --state-dir ./fleet
      mcp-sim run --state-dir ./fleet --behaviour slow-canary.toml --churn 5
      mcp-sim run --state-dir ./fleet --status-file s.json --until-version digits=1.2.0
    """
    try:
        behaviour = load_behaviour(behaviour_file).with_fleet(
            health_interval_s=health_interval, churn_percent_per_minute=churn,
            churn_offline_s=churn_offline, connect_rate=connect_rate,
            stats_interval_s=stats_interval,
        )  # fmt: skip
        config = RunConfig(
            state_dir=state_dir, behaviour=behaviour, broker=broker, devices=devices,
            stats_interval_s=stats_interval, status_file=status_file,
            status_interval_s=status_interval, summary_interval_s=summary_interval,
            until=parse_until(until), timeout_s=timeout, keepalive_s=keepalive, seed=seed,
        )  # fmt: skip
        if broker is not None:
            from mcp_edge.agent.run import broker_address

            broker_address(broker)
        code = _run(config)
    except (McpError, ValueError, BehaviourError) as e:
        raise click.ClickException(str(e)) from e
    sys.exit(code)


def _run(config: RunConfig) -> int:
    async def main() -> int:
        return await FleetRunner(config).run()

    try:
        import uvloop
    except ImportError:  # pragma: no cover
        return asyncio.run(main())
    return uvloop.run(main())


@main.command("status")
@click.option("--status-file", required=True,
              type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="The file `mcp-sim run --status-file` writes.")  # fmt: skip
def status_command(status_file: Path) -> None:
    """Print a running fleet's status file as indented JSON."""
    data = status_file.read_bytes()[: 16 * 1024 * 1024]
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise click.ClickException(f"{status_file}: not JSON: {e}") from e
    click.echo(orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode())
