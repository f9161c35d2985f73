"""axe-core in the console's pages: inject the checker (``.cache/axe``, fetched from npm by
``tests/run.sh``), run it, and write its violations so a failing test says what to fix."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mcp_edge.tooling.processes import REPO

if TYPE_CHECKING:
    from playwright.sync_api import Page

AXE_JS = REPO / ".cache" / "axe" / "node_modules" / "axe-core" / "axe.min.js"
BLOCKING = ("serious", "critical")
"""The impacts a page may not have."""


@cache
def axe_source(path: Path = AXE_JS) -> str:
    return path.read_text(encoding="utf-8")


def run_axe(page: Page) -> list[dict[str, Any]]:
    """Every axe-core violation of the page as it is now (all of axe's default rules).

    The script goes in through the DevTools protocol (``page.evaluate``), which the page's
    Content-Security-Policy does not govern, so the page is checked with its CSP in force.
    """
    if not page.evaluate("() => typeof window.axe === 'object'"):
        page.evaluate(axe_source())
    result: dict[str, Any] = page.evaluate(
        "async () => await window.axe.run(document, {resultTypes: ['violations']})"
    )
    violations: list[dict[str, Any]] = result["violations"]
    return violations


def blocking(violations: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [v for v in violations if v.get("impact") in BLOCKING]


def describe(violations: list[dict[str, Any]], *, nodes: int = 5) -> str:
    """The violations as text: rule, impact, what it asks, and the first elements at fault."""
    lines: list[str] = []
    for v in violations:
        lines.append(f"[{v.get('impact')}] {v['id']}: {v['help']} ({v['helpUrl']})")
        for node in v["nodes"][:nodes]:
            target = " ".join(str(t) for t in node.get("target", []))
            summary = " ".join(str(node.get("failureSummary", "")).split())
            lines.append(f"    at {target}: {summary[:300]}")
            lines.append(f"       {str(node.get('html', ''))[:200]}")
        if len(v["nodes"]) > nodes:
            lines.append(f"    ... and {len(v['nodes']) - nodes} more element(s)")
    return "\n".join(lines)
