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
    on_disk: set[str] = set()
    for package, folder in mapping.items():
        root = REPO / folder
        for init in root.rglob("__init__.py"):
            rel = init.parent.relative_to(root).parts
            on_disk.add(".".join((package, *rel)))
    assert on_disk - listed == set(), "package folders missing from pyproject.toml packages"
    assert listed - on_disk == set(), "pyproject.toml lists packages that do not exist"
    assert all(p.startswith("mcp_edge.") for p in listed)


def test_console_scripts_point_into_mcp_edge() -> None:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    scripts = config["project"]["scripts"]
    assert set(scripts) == {"mcp-agent", "mcp-controlplane", "mcp-bundle"}
    assert all(target.startswith("mcp_edge.") for target in scripts.values())
