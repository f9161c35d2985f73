"""The model manager with other serving processes (``mcp-agent serve --processes N``): every
copy counts against memory, a load is prepared everywhere before any role changes, and
commits, unloads and canary policies reach the other processes.

The other processes are a recording fake of our own ``Replicas`` interface; the real ones
(``agent.serving.workers``) run in tests/integration/test_serve_processes.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mcp_edge.agent.runtime.manager import ModelManager, ModelSource
from mcp_edge.agent.runtime.runner import ModelLoadError
from mcp_edge.shared.protocol.canary import DEFAULT_CANARY_POLICY, CanaryPolicy
from tests.support.runners import DoublingRunner

MIB = 1024 * 1024


class RecordingReplicas:
    """Other serving processes that record what they were asked (and, asked to prepare a
    version, the role it had in the local manager by then)."""

    def __init__(self, manager: ModelManager, copies: int = 1) -> None:
        self.manager = manager
        self._copies = copies
        self.fail_prepare = False
        self.calls: list[tuple[Any, ...]] = []

    @property
    def copies(self) -> int:
        return self._copies

    def _role_here(self, source: ModelSource) -> str | None:
        """The role ``source`` has in the local manager now (None: not installed)."""
        if self.manager.find(source.name, source.version) is None:
            return None
        return self.manager.slot(source.name).role_of(source.version)

    async def prepare(self, source: ModelSource) -> None:
        self.calls.append(("prepare", source.name, source.version, self._role_here(source)))
        if self.fail_prepare:
            raise ModelLoadError("serving process 1: warm-up failed: out of memory")

    async def commit(self, source: ModelSource, role: str, canary: CanaryPolicy) -> None:
        self.calls.append(("commit", source.name, source.version, role, canary))

    async def abort(self, source: ModelSource) -> None:
        self.calls.append(("abort", source.name, source.version))

    async def unload(self, name: str, version: str | None) -> None:
        self.calls.append(("unload", name, version))

    def set_canary_policy(self, name: str, policy: CanaryPolicy) -> None:
        self.calls.append(("canary_policy", name, policy))


class Factory:
    """Builds one fake runner per load and keeps them, to see which were closed."""

    def __init__(self) -> None:
        self.built: dict[str, DoublingRunner] = {}

    def __call__(self, source: ModelSource) -> list[DoublingRunner]:
        runner = self.built[source.version] = DoublingRunner()
        return [runner]


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    path = tmp_path / "m.onnx"
    path.write_bytes(b"\0" * MIB)
    return path


@pytest.fixture
def factory() -> Factory:
    return Factory()


@pytest.fixture
def manager(factory: Factory) -> Iterator[ModelManager]:
    yield ModelManager(factory, available_memory=lambda: None)


async def test_the_memory_check_counts_a_copy_in_every_process(
    model_file: Path, factory: Factory
) -> None:
    # One copy needs about 3 x 1 MiB + 16 MiB = 19 MiB: room for two, not four.
    available = 38 * MIB
    alone = ModelManager(factory, available_memory=lambda: available)
    try:
        await alone.load(ModelSource("m", "1", model_file))
        assert alone.names() == ["m"]
    finally:
        await alone.close()

    factory.built.clear()
    with_workers = ModelManager(factory, available_memory=lambda: available)
    replicas = RecordingReplicas(with_workers, copies=3)
    with_workers.replicas = replicas
    with pytest.raises(ModelLoadError) as refused:
        await with_workers.load(ModelSource("m", "1", model_file))
    assert "(4 serving processes load a copy each)" in str(refused.value)
    assert "38 MiB is available" in str(refused.value)
    # Refused before anything loaded, here or in the other processes.
    assert with_workers.names() == []
    assert factory.built == {}
    assert replicas.calls == []


async def test_a_load_the_other_processes_cannot_prepare_changes_nothing(
    manager: ModelManager, factory: Factory, model_file: Path
) -> None:
    replicas = RecordingReplicas(manager)
    manager.replicas = replicas
    await manager.load(ModelSource("m", "1", model_file))
    replicas.calls.clear()

    replicas.fail_prepare = True
    with pytest.raises(ModelLoadError, match="serving process 1: warm-up failed"):
        await manager.load(ModelSource("m", "2", model_file))
    # Version 1 still serves alone; version 2's local copy was loaded, then closed unused.
    assert manager.get("m").version == "1"
    assert manager.find("m", "2") is None
    assert factory.built["2"].closed
    assert not factory.built["1"].closed
    # The others were asked to prepare it before it had any role here, and never to commit.
    assert replicas.calls == [("prepare", "m", "2", None)]
    await manager.close()


async def test_a_load_is_prepared_everywhere_then_committed_with_its_role(
    manager: ModelManager, model_file: Path
) -> None:
    replicas = RecordingReplicas(manager)
    manager.replicas = replicas
    await manager.load(ModelSource("m", "1", model_file))
    policy = CanaryPolicy(weight=0.3, max_error_rate=0.2)
    await manager.load(ModelSource("m", "2", model_file), role="canary", canary=policy)
    await manager.load(ModelSource("m", "3", model_file), role="shadow")
    # Each version: prepared elsewhere while it had no role anywhere, then committed with its
    # role (and a canary with its policy); each has that role here too once loaded.
    assert replicas.calls == [
        ("prepare", "m", "1", None),
        ("commit", "m", "1", "stable", DEFAULT_CANARY_POLICY),
        ("prepare", "m", "2", None),
        ("commit", "m", "2", "canary", policy),
        ("prepare", "m", "3", None),
        ("commit", "m", "3", "shadow", DEFAULT_CANARY_POLICY),
    ]
    slot = manager.slot("m")
    assert [slot.role_of(v) for v in ("1", "2", "3")] == ["stable", "canary", "shadow"]
    await manager.close()


async def test_unloads_and_canary_policies_reach_the_other_processes(
    manager: ModelManager, model_file: Path
) -> None:
    replicas = RecordingReplicas(manager)
    manager.replicas = replicas
    await manager.load(ModelSource("m", "1", model_file))
    await manager.load(ModelSource("m", "2", model_file), role="canary")
    replicas.calls.clear()

    paused = CanaryPolicy(weight=0.0)
    assert manager.set_canary_policy("m", paused)
    assert not manager.set_canary_policy("other", paused)  # no such model: nothing sent
    await manager.unload("m", "2")
    assert not manager.set_canary_policy("m", paused)  # no canary any more: nothing sent
    await manager.unload("m")
    assert replicas.calls == [
        ("canary_policy", "m", paused),
        ("unload", "m", "2"),
        ("unload", "m", None),
    ]
    assert manager.names() == []
