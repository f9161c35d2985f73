"""Console pages: drift (filled in by its own change)."""

from __future__ import annotations

from mcp_edge.controlplane.ui.core import Page

PAGES: list[Page] = []
