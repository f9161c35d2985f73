"""``mcp-controlplane``: the server-side command line.

    mcp-controlplane init | serve ...                              (local, see server)
    mcp-controlplane login | users | tokens | devices | audit ...   (REST client, see fleet)
    mcp-controlplane keys ... (local) | publishers | models ...    (see repo)
    mcp-controlplane deploy | undeploy | deployments | desired ... (see deploy)
    mcp-controlplane apps create | list | revoke ...               (see apps)
    mcp-controlplane rollouts create | show | watch | pause ...    (see rollouts)

Imports go one way: a command module imports the helpers (:mod:`.client`, the REST client and
output; :mod:`.datadir`, the data dir and settings), :mod:`.group` imports the command modules
and adds their ``COMMANDS`` to the click group ``main``, and only this package and
``__main__`` import :mod:`.group` (tests/unit/test_layering.py holds it so).
"""

from mcp_edge.controlplane.cli.group import main

__all__ = ["main"]
