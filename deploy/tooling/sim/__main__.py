"""``python -m mcp_edge.tooling.sim``: the ``mcp-sim`` command line."""

from mcp_edge.tooling.sim.cli import main

main()
