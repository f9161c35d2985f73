"""``shared/`` stays sans-io, with one marked exception, checked statically and at import.

The rule: no module in ``shared/`` imports an I/O framework (asyncio, paho, aiohttp,
SQLAlchemy, ...), except the two I/O packages inside it: ``shared/mqtt`` (the one MQTT adapter,
:mod:`mcp_edge.shared.mqtt`) and ``shared/client`` (the application client, installed as
:mod:`mcp_edge.client`), which may import asyncio and paho and no other I/O framework. Only
``shared/mqtt`` may import paho itself (``tests/unit/test_layering.py``). Importing every
other module of ``shared`` loads none of them.

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
IO_ALLOWED = ("asyncio", "paho")
"""What the I/O packages below may import of :data:`FORBIDDEN`."""
SHARED_DIR = Path(shared.__file__).parent
IO_PACKAGES = (SHARED_DIR / "mqtt", SHARED_DIR / "client")


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


def _in_io_package(path: Path) -> bool:
    return any(path.is_relative_to(p) for p in IO_PACKAGES)


def _pure_files() -> list[Path]:
    return sorted(f for f in SHARED_DIR.rglob("*.py") if not _in_io_package(f))


def test_no_module_in_shared_imports_an_io_framework_outside_the_io_packages() -> None:
    files = _pure_files()
    assert len(files) > 10
    offenders = {
        str(f.relative_to(SHARED_DIR)): sorted(_imported_roots(f) & set(FORBIDDEN)) for f in files
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_io_packages_import_only_asyncio_and_paho_of_the_io_frameworks() -> None:
    files = sorted(f for p in IO_PACKAGES for f in p.rglob("*.py"))
    assert {f.parent.name for f in files} == {"mqtt", "client"}
    allowed_not = set(FORBIDDEN) - set(IO_ALLOWED)
    offenders = {
        str(f.relative_to(SHARED_DIR)): sorted(_imported_roots(f) & allowed_not) for f in files
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_shared_never_imports_agent_or_controlplane() -> None:
    for f in SHARED_DIR.rglob("*.py"):
        assert not _imported_roots(f) & {"agent", "controlplane"}, f


def test_importing_all_of_shared_but_the_io_packages_loads_no_io_framework() -> None:
    modules = sorted(
        "mcp_edge.shared." + ".".join(p.relative_to(SHARED_DIR).with_suffix("").parts)
        for p in _pure_files()
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
