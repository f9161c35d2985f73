"""The build config ships every package folder under the one top-level name ``mcp_edge``."""

from __future__ import annotations

import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]


def _setuptools() -> dict[str, object]:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    return dict(config["tool"]["setuptools"])


def test_every_package_folder_is_listed_under_mcp_edge() -> None:
    setuptools = _setuptools()
    mapping: dict[str, str] = dict(setuptools["package-dir"])  # type: ignore[arg-type]
    listed = set(setuptools["packages"])  # type: ignore[arg-type]
    # A folder is named by the most specific mapping that holds it (shared/client is
    # mcp_edge.client, never also mcp_edge.shared.client).
    roots = {(REPO / folder).resolve(): package for package, folder in mapping.items()}
    on_disk: set[str] = set()
    for root in roots:
        for init in root.rglob("__init__.py"):
            folder = init.parent.resolve()
            owner = max((r for r in roots if folder.is_relative_to(r)), key=lambda r: len(r.parts))
            on_disk.add(".".join((roots[owner], *folder.relative_to(owner).parts)))
    assert on_disk - listed == set(), "package folders missing from pyproject.toml packages"
    assert listed - on_disk == set(), "pyproject.toml lists packages that do not exist"
    assert all(p.startswith("mcp_edge.") for p in listed)


def test_the_application_client_installs_as_mcp_edge_client_only() -> None:
    setuptools = _setuptools()
    mapping: dict[str, str] = dict(setuptools["package-dir"])  # type: ignore[arg-type]
    listed = set(setuptools["packages"])  # type: ignore[arg-type]
    assert mapping["mcp_edge.client"] == "shared/client"
    assert "mcp_edge.client" in listed and "mcp_edge.shared.client" not in listed


def test_console_scripts_point_into_mcp_edge() -> None:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    scripts = config["project"]["scripts"]
    assert set(scripts) == {"mcp-agent", "mcp-controlplane", "mcp-bundle", "mcp-sim"}
    assert all(target.startswith("mcp_edge.") for target in scripts.values())
