"""The console's routes as the browser tests walk them: every page the console registers
(``mcp_edge.controlplane.ui.all_pages()``), its path parameters filled with ids that exist in
the test fleet, so that a page added later is covered without a change here.

:data:`MAIN_PAGES` names the pages every test run screenshots and checks with axe-core; each
is a registered route (checked), and :func:`html_pages` adds every other GET page that answers
HTML (live streams and JSON counts excluded).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from mcp_edge.controlplane.ui import all_pages
from mcp_edge.controlplane.ui.core import Page

PARAMETER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)(?::[^}]*)?\}")

MAIN_PAGES: dict[str, str] = {
    "overview": "/ui/",
    "devices": "/ui/devices",
    "device": "/ui/devices/{device_id}",
    "enrollment": "/ui/enrollment",
    "models": "/ui/models",
    "model": "/ui/models/{name}",
    "model-version": "/ui/models/{name}/{version}",
    "rollouts": "/ui/rollouts",
    "rollout": "/ui/rollouts/{rollout_id}",
    "rollout-new": "/ui/rollouts/new",
    "drift": "/ui/drift",
    "trigger": "/ui/drift/triggers/{trigger_id}",
    "api": "/ui/api",
    "account": "/ui/account",
}
"""Name (the screenshot's file name) -> route, as registered."""

TABLET_PAGES = ("overview", "devices", "rollout", "rollout-new", "drift", "enrollment")
"""The pages also screenshotted at tablet width."""

NOT_HTML = re.compile(r"/live$|/target-count$")
"""GET routes that answer something other than a page: event streams and JSON counts."""


@dataclass(frozen=True)
class Ids:
    """Existing ids to put in path parameters, by parameter name; ``by_prefix`` overrides a
    name under a path prefix (``token_id`` is an enrollment token under /ui/enrollment and an
    API token under /ui/account)."""

    by_name: Mapping[str, str]
    by_prefix: Mapping[tuple[str, str], str]
    fallback: str = "1"

    def value(self, path: str, name: str) -> str:
        for (prefix, key), value in self.by_prefix.items():
            if key == name and path.startswith(prefix):
                return value
        return self.by_name.get(name, self.fallback)


def fill(path: str, ids: Ids) -> str:
    """``path`` with each ``{parameter}`` replaced by an id from ``ids``."""
    return PARAMETER.sub(lambda m: ids.value(path, m.group(1)), path)


def registered(method: str) -> list[Page]:
    return [p for p in all_pages() if p.method == method]


def main_paths(ids: Ids) -> dict[str, str]:
    """:data:`MAIN_PAGES` filled; fails naming any route the console no longer registers."""
    routes = {p.path for p in registered("GET")}
    missing = sorted(set(MAIN_PAGES.values()) - routes)
    assert not missing, f"console routes gone or renamed: {missing}; registered: {sorted(routes)}"
    return {name: fill(route, ids) for name, route in MAIN_PAGES.items()}


def html_pages(ids: Ids) -> dict[str, str]:
    """Every registered GET page that renders HTML, by route, filled with ``ids``."""
    return {p.path: fill(p.path, ids) for p in registered("GET") if not NOT_HTML.search(p.path)}


def post_routes(ids: Ids) -> list[tuple[Page, str]]:
    """Every registered POST route with its path filled."""
    return [(p, fill(p.path, ids)) for p in registered("POST")]
