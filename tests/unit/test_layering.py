"""Who may import whom, checked on the source: the product never imports the tests or the
tooling, and the tooling never reaches into the tests."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PRODUCT = ("agent", "controlplane", "shared", "firmware_profiles")
TOOLING = "deploy/tooling"


def imports_of(path: Path) -> set[str]:
    """Every module name ``path`` imports (absolute imports only; the tree uses no others)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def sources(*folders: str) -> list[Path]:
    files = [p for f in folders for p in sorted((REPO / f).rglob("*.py"))]
    assert files, folders
    return files


def test_no_product_or_tooling_module_imports_the_tests() -> None:
    offenders = {
        str(p.relative_to(REPO)): sorted(n for n in imports_of(p) if n.split(".")[0] == "tests")
        for p in sources(*PRODUCT, TOOLING, "bench")
    } | {
        "deploy/demo.py": sorted(
            n for n in imports_of(REPO / "deploy/demo.py") if n.split(".")[0] == "tests"
        )
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_product_never_imports_the_tooling() -> None:
    offenders = {
        str(p.relative_to(REPO)): sorted(
            n for n in imports_of(p) if n.startswith("mcp_edge.tooling")
        )
        for p in sources(*PRODUCT)
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_mqtt_inference_shares_the_request_rules_not_the_http_app() -> None:
    # Options, error codes and messages come from serving.requests for every transport; the
    # fleet code never reaches into the HTTP app, and the shared module imports no transport.
    fleet = {
        str(p.relative_to(REPO)): sorted(
            n for n in imports_of(p) if n.startswith("mcp_edge.agent.serving.http_api")
        )
        for p in sources("agent/fleet")
    }
    assert {k: v for k, v in fleet.items() if v} == {}
    assert "mcp_edge.agent.serving.requests" in imports_of(REPO / "agent/fleet/mqtt_inference.py")
    shared = imports_of(REPO / "agent/serving/requests.py")
    assert (
        sorted(
            n
            for n in shared
            if n.split(".")[0] in {"aiohttp", "paho"}
            or n.startswith(("mcp_edge.agent.fleet", "mcp_edge.agent.serving.http_api"))
        )
        == []
    )


CLI = "controlplane/cli"
CLI_PACKAGE = "mcp_edge.controlplane.cli"


def _cli_module(path: Path) -> str:
    rel = path.relative_to(REPO / CLI).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join((CLI_PACKAGE, *parts))


def test_cli_imports_go_one_way() -> None:
    """Commands import helpers, the group imports the commands, and only the package and its
    ``__main__`` import the group (or the package, which is the group): no cycle in the CLI."""
    modules = {_cli_module(p): p for p in sources(CLI)}
    graph = {
        name: {n for n in imports_of(path) if n in modules and n != name}
        for name, path in modules.items()
    }
    group = f"{CLI_PACKAGE}.group"
    entry = {CLI_PACKAGE, f"{CLI_PACKAGE}.__main__"}
    reach_group = {
        name: sorted(deps & {group, CLI_PACKAGE})
        for name, deps in graph.items()
        if name not in entry
    }
    assert {k: v for k, v in reach_group.items() if v} == {}

    def cycle_from(start: str, path: tuple[str, ...]) -> tuple[str, ...] | None:
        for dep in sorted(graph[start]):
            if dep in path:
                return (*path, dep)
            found = cycle_from(dep, (*path, dep))
            if found:
                return found
        return None

    assert [c for name in sorted(graph) if (c := cycle_from(name, (name,)))] == []


MQTT_ADAPTER = "shared/mqtt"
PAHO_RULE_FOLDERS = ("agent", "controlplane", "shared", "deploy")
"""Where only the adapter may import paho. Not bench/ (its baselines measure raw paho on
purpose) and not tests/ (tests of the adapter, and probes that play a plain MQTT client)."""


def test_only_the_mqtt_adapter_imports_paho() -> None:
    offenders = {
        str(p.relative_to(REPO)): sorted(n for n in imports_of(p) if n.split(".")[0] == "paho")
        for p in sources(*PAHO_RULE_FOLDERS)
        if not p.is_relative_to(REPO / MQTT_ADAPTER)
    }
    assert {k: v for k, v in offenders.items() if v} == {}
    # And the adapter really is where paho comes in.
    assert any(n.startswith("paho") for p in sources(MQTT_ADAPTER) for n in imports_of(p))


def test_paho_private_api_is_touched_in_one_module_only() -> None:
    private = ("_sock_recv", "_sock_close")
    touching = sorted(
        str(p.relative_to(REPO)) for p in sources(*PAHO_RULE_FOLDERS)
        if any(name in p.read_text() for name in private)
    )  # fmt: skip
    assert touching == ["shared/mqtt/_paho.py"]


def test_agent_update_and_agent_fleet_do_not_import_each_other() -> None:
    # One direction only, and here none: agent/run.py wires the MQTT repository transport
    # (agent.update) onto the fleet session's client (agent.fleet) and hands it in.
    def offenders(folder: str, other: str) -> dict[str, list[str]]:
        found = {
            str(p.relative_to(REPO)): sorted(
                n for n in imports_of(p) if n.startswith(f"mcp_edge.agent.{other}")
            )
            for p in sources(f"agent/{folder}")
        }
        return {k: v for k, v in found.items() if v}

    assert offenders("update", "fleet") == {}
    assert offenders("fleet", "update") == {}


def test_the_mqtt_adapter_imports_nothing_above_it() -> None:
    # The adapter is used by the agent, the control plane and the application client, and
    # uses none of them.
    above = ("mcp_edge.agent", "mcp_edge.controlplane", "mcp_edge.client", "mcp_edge.tooling")
    offenders = {
        str(p.relative_to(REPO)): sorted(n for n in imports_of(p) if n.startswith(above))
        for p in sources(MQTT_ADAPTER)
    }
    assert {k: v for k, v in offenders.items() if v} == {}
