"""``shared/`` must stay sans-io: no asyncio, paho, aiohttp or SQLAlchemy, statically or at import.

Imports are named by their root, with ``mcp_edge.X`` counted as ``X`` (the distribution's one
top-level package maps the repository's folders under it).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from mcp_edge import shared

FORBIDDEN = ("asyncio", "paho", "aiohttp", "sqlalchemy", "aiomqtt", "uvloop", "aiosqlite")
SHARED_DIR = Path(shared.__file__).parent


def _root(name: str) -> str:
    parts = name.split(".")
    return parts[1] if parts[0] == "mcp_edge" and len(parts) > 1 else parts[0]


def _imported_roots(path: Path) -> set[str]:
    roots: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            roots.update(_root(a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(_root(node.module))
            if node.module == "mcp_edge":
                roots.update(a.name for a in node.names)
    return roots


def test_no_module_in_shared_imports_an_io_framework() -> None:
    files = sorted(SHARED_DIR.rglob("*.py"))
    assert len(files) > 10
    offenders = {
        str(f.relative_to(SHARED_DIR)): sorted(_imported_roots(f) & set(FORBIDDEN)) for f in files
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_shared_never_imports_agent_or_controlplane() -> None:
    for f in SHARED_DIR.rglob("*.py"):
        assert not _imported_roots(f) & {"agent", "controlplane"}, f


def test_importing_all_of_shared_loads_no_io_framework() -> None:
    modules = sorted(
        "mcp_edge.shared." + ".".join(p.relative_to(SHARED_DIR).with_suffix("").parts)
        for p in SHARED_DIR.rglob("*.py")
        if p.name != "__init__.py" or p.parent != SHARED_DIR
    )
    modules = [m.removesuffix(".__init__") for m in modules]
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        f"print(','.join(sorted({{n.split('.')[0] for n in sys.modules}} & set({FORBIDDEN!r}))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
