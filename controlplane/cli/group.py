"""The ``mcp-controlplane`` click group: logging set up once, every command module's
``COMMANDS`` added. Only :mod:`controlplane.cli` and its ``__main__`` import this module."""

from __future__ import annotations

import logging
import sys

import click

from mcp_edge.controlplane import __version__
from mcp_edge.controlplane.cli.apps import COMMANDS as APPS
from mcp_edge.controlplane.cli.deploy import COMMANDS as DEPLOYMENTS
from mcp_edge.controlplane.cli.drift import COMMANDS as DRIFT
from mcp_edge.controlplane.cli.fleet import COMMANDS as FLEET
from mcp_edge.controlplane.cli.repo import COMMANDS as REPOSITORY
from mcp_edge.controlplane.cli.rollouts import COMMANDS as ROLLOUTS
from mcp_edge.controlplane.cli.server import COMMANDS as SERVER


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="mcp-controlplane")
@click.option("-v", "--verbose", is_flag=True, help="Log at debug level.")
def main(verbose: bool) -> None:
    """MCP Edge control plane."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not verbose:  # Alembic narrates every plugin and context at INFO
        logging.getLogger("alembic").setLevel(logging.WARNING)


for _command in (*SERVER, *FLEET, *REPOSITORY, *DEPLOYMENTS, *ROLLOUTS, *DRIFT, *APPS):
    main.add_command(_command)
