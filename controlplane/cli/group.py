"""The ``mcp-controlplane`` click group: the house error style (:mod:`shared.cli_style`),
logging set up once, every command module's ``COMMANDS`` added, and every option readable from
an ``MCP_...`` environment variable. Only :mod:`controlplane.cli` and its ``__main__`` import
this module."""

from __future__ import annotations

import logging
import sys

import click

from mcp_edge.controlplane import __version__
from mcp_edge.controlplane.cli.account import COMMANDS as ACCOUNT
from mcp_edge.controlplane.cli.apps import COMMANDS as APPS
from mcp_edge.controlplane.cli.deploy import COMMANDS as DEPLOYMENTS
from mcp_edge.controlplane.cli.drift import COMMANDS as DRIFT
from mcp_edge.controlplane.cli.fleet import COMMANDS as FLEET
from mcp_edge.controlplane.cli.repo import COMMANDS as REPOSITORY
from mcp_edge.controlplane.cli.rollouts import COMMANDS as ROLLOUTS
from mcp_edge.controlplane.cli.server import COMMANDS as SERVER
from mcp_edge.shared.cli_style import TEXT_FORMAT, StyledGroup, env_options
from mcp_edge.shared.errors import McpError


class ControlPlaneCli(StyledGroup):
    """``Error: ...`` and exit 1 for a failed request, a refused setting or an unreadable file;
    exit 2 for a usage error; with ``--json`` a JSON error object carrying the API's code."""

    prog = "mcp-controlplane"
    failures = (McpError, OSError)


@click.group(
    "mcp-controlplane",
    cls=ControlPlaneCli,
    context_settings={"help_option_names": ["-h", "--help"]},
)
@click.version_option(__version__, prog_name="mcp-controlplane")
@click.option("-v", "--verbose", is_flag=True, help="Log at debug level (wins over --log-level).")
def main(verbose: bool) -> None:
    """MCP Edge control plane.

    Every option can also be set by the environment variable shown beside it in a command's
    --help (MCP_ and the option's name: --data-dir is MCP_DATA_DIR, --json is MCP_JSON).
    """
    # Short commands log little; serve and deploy --wait configure logging again with their
    # --log-level and --log-format.
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO, stream=sys.stderr, format=TEXT_FORMAT
    )
    if not verbose:  # Alembic narrates every plugin and context at INFO
        logging.getLogger("alembic").setLevel(logging.WARNING)


for _command in (
    *SERVER,
    *FLEET,
    *ACCOUNT,
    *REPOSITORY,
    *DEPLOYMENTS,
    *ROLLOUTS,
    *DRIFT,
    *APPS,
):
    main.add_command(_command)
env_options(main)
