"""``mcp-controlplane``: the server-side command line."""

from __future__ import annotations

import click

from controlplane import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="mcp-controlplane")
def main() -> None:
    """MCP Edge control plane."""
