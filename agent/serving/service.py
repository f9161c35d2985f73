"""What the HTTP API and the gRPC service both answer besides inference itself.

:class:`FrontDoor` holds one server's model manager and answers the protocol's questions the
same way for both transports: server and model metadata, readiness, Triton's model
configuration, statistics (summed over every serving process), the repository index with
explicit load and unload (:mod:`.model_control`), and the Prometheus exposition (one set for
the whole server). A multi-process server (:mod:`.workers`) passes a :class:`Cluster` that
reaches the other processes; a single process has none.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from mcp_edge.agent import __version__
from mcp_edge.agent.runtime.batcher import BatchingConfig
from mcp_edge.agent.runtime.manager import ModelManager, ModelNotFoundError
from mcp_edge.agent.runtime.statistics import merge_model_stats
from mcp_edge.agent.serving.metrics import merge_families
from mcp_edge.agent.serving.model_control import ModelControl
from mcp_edge.agent.serving.requests import RequestError
from mcp_edge.agent.serving.triton import EXTENSIONS, PLATFORMS, model_config
from mcp_edge.shared.protocol.wire import ErrorCode

if TYPE_CHECKING:
    from mcp_edge.shared.tracing import Tracing

SERVER_NAME = "mcp-edge-agent"


class Cluster(Protocol):
    """The other processes of a multi-process server, as one process sees them."""

    @property
    def processes(self) -> int:
        """Serving processes in all, this one included."""

    async def statistics(self) -> list[list[dict[str, Any]]]:
        """Every other process's ``model_stats`` entries (all models and versions)."""

    async def metric_families(self) -> list[list[Any]]:
        """Every other process's metric families (prometheus_client ``Metric`` objects)."""

    async def control(self, action: str, name: str) -> None:
        """Run ``load``/``unload`` of ``name`` where model control lives (the primary)."""

    async def index(self, ready_only: bool) -> list[dict[str, Any]]:
        """The repository index where model control lives."""


class FrontDoor:
    """One server's answers to the protocol's non-inference calls."""

    def __init__(
        self,
        manager: ModelManager,
        *,
        control: ModelControl | None = None,
        cluster: Cluster | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self.manager = manager
        self.control = control
        self.cluster = cluster
        self.tracing = tracing
        """Where inference spans go (HTTP and gRPC); None: tracing off."""

    @property
    def batching(self) -> BatchingConfig:
        return self.manager.batching

    @property
    def processes(self) -> int:
        return 1 if self.cluster is None else self.cluster.processes

    # ----------------------------------------------------------------- metadata
    def server_metadata(self) -> dict[str, Any]:
        return {"name": SERVER_NAME, "version": __version__, "extensions": list(EXTENSIONS)}

    def model_metadata(self, model: str, version: str | None) -> dict[str, Any]:
        """Raises ModelNotFoundError."""
        slot = self.manager.slot(model)
        lv = self.manager.get(model, version)
        info = lv.info
        return {
            "name": lv.name,
            "versions": sorted(slot.versions),
            "platform": PLATFORMS.get(info.backend, info.backend),
            "inputs": [s.to_json() for s in info.inputs],
            "outputs": [s.to_json() for s in info.outputs],
            "parameters": {
                "version": lv.version,
                "role": slot.role_of(lv.version),
                "backend": info.backend,
                "provider": info.provider,
                "stable": slot.stable,
                "canary": None
                if slot.canary is None
                else {
                    "version": slot.canary.version,
                    "weight": slot.canary.weight,
                    "enabled": slot.canary.enabled,
                    "error_rate": slot.canary.error_rate,
                },
                "shadow": None
                if slot.shadow is None
                else {
                    "version": slot.shadow.version,
                    "compared": slot.shadow.compared,
                    "agreement": slot.shadow.agreement,
                },
            },
        }

    def models(self) -> list[dict[str, Any]]:
        """Every served model in brief (``GET /v2/models``)."""
        found = []
        for name in self.manager.names():
            slot = self.manager.slot(name)
            lv = self.manager.get(name)
            found.append(
                {
                    "name": name,
                    "versions": sorted(slot.versions),
                    "stable": slot.stable,
                    "platform": PLATFORMS.get(lv.info.backend, lv.info.backend),
                }
            )
        return found

    def model_config(self, model: str, version: str | None) -> dict[str, Any]:
        """Triton's ``ModelConfig`` of a loaded version. Raises ModelNotFoundError."""
        slot = self.manager.slot(model)
        lv = self.manager.get(model, version)
        return model_config(lv, slot, self.batching, processes=self.processes)

    # ----------------------------------------------------------------- statistics
    async def statistics(self, model: str | None, version: str | None) -> dict[str, Any]:
        """``{"model_stats": [...]}`` for one version, every version of ``model``, or every
        model (None), summed over the serving processes. Raises ModelNotFoundError."""
        if model is not None:
            self.manager.get(model, version)  # raises for an unknown model or version
        mine = self.local_statistics()
        groups: list[list[dict[str, Any]]] = [mine]
        if self.cluster is not None:
            groups.extend(await self.cluster.statistics())
        merged = merge_model_stats(groups)
        if model is not None:
            merged = [
                e
                for e in merged
                if e["name"] == model and (version is None or e["version"] == version)
            ]
        return {"model_stats": merged}

    def local_statistics(self) -> list[dict[str, Any]]:
        """This process's ``model_stats`` entries, every loaded version."""
        entries = []
        for name in sorted(self.manager.loaded_names):
            try:
                slot = self.manager.slot(name)
            except ModelNotFoundError:
                continue
            for v, lv in sorted(slot.versions.items()):
                entries.append(lv.statistics.to_json(name, v))
        return entries

    # ----------------------------------------------------------------- repository
    async def index(self, ready_only: bool = False) -> list[dict[str, Any]]:
        if self.control is not None:
            return self.control.index(ready_only)
        if self.cluster is not None:
            return await self.cluster.index(ready_only)
        return []

    async def load(self, name: str) -> None:
        """Raises RequestError."""
        await self._control("load", name)

    async def unload(self, name: str) -> None:
        """Raises RequestError."""
        await self._control("unload", name)

    async def _control(self, action: str, name: str) -> None:
        if self.control is not None:
            await (self.control.load(name) if action == "load" else self.control.unload(name))
        elif self.cluster is not None:
            await self.cluster.control(action, name)
        else:
            raise RequestError(ErrorCode.FORBIDDEN, "this server has no model repository")

    # ----------------------------------------------------------------- metrics
    async def metrics_text(self) -> bytes:
        """The Prometheus text exposition of the whole server."""
        if self.cluster is None:
            return self.manager.metrics.exposition()
        groups: Sequence[list[Any]] = [
            list(self.manager.metrics.registry.collect()),
            *await self.cluster.metric_families(),
        ]
        return merge_families(groups, processes=self.processes)
