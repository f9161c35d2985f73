"""``mcp-agent enroll`` command line."""

from __future__ import annotations

import asyncio
from pathlib import Path
from urllib.parse import urlsplit

import click

from mcp_edge.agent.serving.serve import default_state_dir
from mcp_edge.shared.errors import McpError


def _labels(values: tuple[str, ...]) -> dict[str, str]:
    labels: dict[str, str] = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{item!r}: use key=value", param_hint="--labels")
        labels[key] = value
    return labels


def server_url(ctx: click.Context | None, param: click.Parameter | None, value: str) -> str:
    """The control plane's base URL as given, once it is an http(s) URL with a host.

    Raises click.BadParameter, saying what to add when the scheme is missing."""
    parts = urlsplit(value)
    if "://" not in value:
        raise click.BadParameter(
            f"{value!r} has no scheme; add one: http://{value} or https://{value}",
            ctx,
            param,
        )
    if parts.scheme not in ("http", "https"):
        raise click.BadParameter(
            f"{value!r}: the scheme must be http:// or https://, not {parts.scheme}://",
            ctx,
            param,
        )
    if not parts.hostname:
        raise click.BadParameter(f"{value!r} names no host", ctx, param)
    return value


def _one_line(e: ValueError) -> str:
    """A validation error of the enrollment request as ``field: problem; ...``."""
    from pydantic import ValidationError

    if isinstance(e, ValidationError):
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'request'}: {err['msg']}"
            for err in e.errors()
        )
        return f"the enrollment request is invalid: {problems}"
    return str(e)


@click.command("enroll")
@click.option(
    "--server",
    required=True,
    envvar="MCP_SERVER",
    callback=server_url,
    help="Control plane URL with its scheme, e.g. https://cp.example:8080.",
)
@click.option("--token", required=True, envvar="MCP_ENROLL_TOKEN", help="Enrollment token.")
@click.option(
    "--labels",
    "labels",
    multiple=True,
    metavar="KEY=VALUE",
    help="Labels for this device (repeatable).",
)
@click.option("--device-id", default=None, help="Ask for this device id (default: assigned).")
@click.option("--profile", default=None, help="Hardware profile instead of detecting one.")
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where the identity and credentials live (default: /var/lib/mcp-agent).",
)
@click.option("--force", is_flag=True, help="Enroll again even if this device is enrolled.")
@click.option(
    "--wait",
    "wait_s",
    default=0.0,
    type=click.FloatRange(0, 86_400),
    help="Seconds to wait for a manual approval.",
)
def enroll_command(
    server: str,
    token: str,
    labels: tuple[str, ...],
    device_id: str | None,
    profile: str | None,
    state_dir: Path | None,
    force: bool,
    wait_s: float,
) -> None:
    """Join a fleet: create this device's key, prove it to the control plane, store the answer.

    \b
    Examples:
      mcp-agent enroll --server http://cp:8080 --token $TOKEN --labels site=f1
      mcp-agent enroll --server http://cp:8080 --token $TOKEN --wait 600
    """
    # Imported here so `mcp-agent serve` does not load the enrollment and signing code.
    from mcp_edge.agent.enroll import AlreadyEnrolled, enroll
    from mcp_edge.agent.hardware import collect_facts, select_profile
    from mcp_edge.agent.identity import enrollment_path
    from mcp_edge.shared.profiles import load_profiles
    from mcp_edge.shared.protocol.enrollment import EnrollmentStatus

    state = state_dir or default_state_dir()
    try:
        facts = collect_facts()
        choice = select_profile(facts, load_profiles(), override=profile)
        answer = asyncio.run(
            enroll(
                server,
                token,
                state_dir=state,
                profile=choice.profile.name,
                facts=facts.to_dict(),
                labels=_labels(labels),
                device_id=device_id,
                force=force,
                wait_s=wait_s,
            )
        )
    except AlreadyEnrolled as e:
        click.echo(str(e))
        return
    except McpError:
        raise  # one line through mcp-agent's error handling, with its code
    except ValueError as e:  # the request's schema refused a value given here
        raise click.ClickException(_one_line(e)) from e
    if answer.status is EnrollmentStatus.PENDING:
        click.echo(
            f"enrollment of {answer.device_id} is pending approval; an operator can run\n"
            f"  mcp-controlplane devices approve {answer.device_id}\n"
            f"then run this command again (or pass --wait SECONDS)."
        )
        raise SystemExit(3)
    brokers = ", ".join(answer.broker.urls) if answer.broker else "-"
    click.echo(
        f"enrolled as {answer.device_id} (profile {choice.profile.name}); broker {brokers}; "
        f"credentials stored in {enrollment_path(state)}"
    )
