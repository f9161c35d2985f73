"""``mcp-controlplane``: the server-side command line.

    mcp-controlplane init | serve ...                              (local, see server)
    mcp-controlplane login | users | tokens | devices | audit ...   (REST client, see fleet)
    mcp-controlplane whoami | api-tokens list | revoke             (see account)
    mcp-controlplane keys ... (local) | publishers | models ...    (see repo)
    mcp-controlplane deploy [--wait] | undeploy | deployments | desired ... (see deploy)
    mcp-controlplane apps create | list | revoke ...               (see apps)
    mcp-controlplane rollouts create | show | watch | pause ...    (see rollouts)

Imports go one way: a command module imports the helpers (:mod:`.client`, the REST client and
output; :mod:`.datadir`, the data dir and settings), :mod:`.group` imports the command modules
and adds their ``COMMANDS`` to the click group ``main``, and only this package and
``__main__`` import :mod:`.group` (tests/unit/test_layering.py holds it so).

``main`` runs in the house style of :mod:`shared.cli_style` whether the console script or
click's test runner calls it: ``Error: ...`` on stderr, exit 1 for a failure and 2 for a usage
error, a JSON error object under ``--json``, every option readable from ``MCP_<OPTION>``.
"""

from mcp_edge.controlplane.cli.group import main

__all__ = ["main"]
