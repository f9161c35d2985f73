"""``python -m mcp_edge.controlplane.cli``: the same command line as ``mcp-controlplane``."""

from mcp_edge.controlplane.cli.group import main

if __name__ == "__main__":
    main()
