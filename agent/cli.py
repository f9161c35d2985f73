"""``mcp-agent``: the device-side command line."""

from __future__ import annotations

import json

import click

from agent import __version__
from shared.profiles import load_profiles


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="mcp-agent")
def main() -> None:
    """MCP Edge device agent."""


@main.command("profiles")
@click.option("--json", "as_json", is_flag=True, help="Print the profiles as JSON.")
def profiles_cmd(as_json: bool) -> None:
    """List the hardware profiles this agent ships with and their backend order."""
    profiles = load_profiles()
    if as_json:
        click.echo(json.dumps({n: p.model_dump(mode="json") for n, p in profiles.items()}, indent=2))
        return
    width = max(len(n) for n in profiles)
    for name, p in profiles.items():
        order = " -> ".join(
            f"{b.provider}{' (opt-in)' if b.opt_in else ''}" for b in p.runtime.backends
        )
        click.echo(f"{name:<{width}}  {order}")
        click.echo(f"{'':<{width}}  {p.description}")
