"""The model repository extension over ``--model-path``: index, and explicit load and unload.

The index lists every loaded version (``READY``) and every model file under the model path
that serves nothing now (``UNAVAILABLE``, with the reason). Loading and unloading by name are
off unless the server runs with explicit model control (``--model-control explicit``, which
also stops the directory watcher, as in Triton): loading a name loads (or reloads, through the
usual warm-up and hot swap) the file that serves it; unloading drains and removes every
version. Models the control plane deployed (``mcp-agent run``) are never loaded or unloaded
here: their versions change through deployments only.
"""

from __future__ import annotations

import logging
from typing import Any

from mcp_edge.agent.runtime.manager import ModelManager
from mcp_edge.agent.serving.model_dir import ModelDirectory, scan
from mcp_edge.agent.serving.requests import RequestError
from mcp_edge.agent.serving.triton import index_entry
from mcp_edge.shared.errors import McpError
from mcp_edge.shared.protocol.wire import ErrorCode

log = logging.getLogger("mcp.agent.model_control")


def check_parameters(action: str, params: Any) -> None:
    """Refuse the ``parameters`` of a load or unload request that this server cannot honour.

    ``params``: the request's parameters by name (JSON values; None or empty: none). Loading
    takes no parameters (Triton's ``config`` and ``file:`` overrides are not offered: the model
    file loads as it is). Unloading accepts ``unload_dependents``, which ``tritonclient`` sends
    with every unload: no model here has dependents, so it changes nothing. Raises
    :class:`RequestError`: bad_request for parameters that are not an object or a
    non-boolean ``unload_dependents``, not_implemented for any other parameter.
    """
    if params is None:
        return
    if type(params) is not dict:
        raise RequestError(ErrorCode.BAD_REQUEST, f"{action} parameters must be an object")
    others = sorted(str(k) for k in params if not (action == "unload" and k == "unload_dependents"))
    if others:
        raise RequestError(
            ErrorCode.NOT_IMPLEMENTED,
            f"{action} parameters ({', '.join(others[:5])}) are not supported by this server: "
            "it loads the model file as it is",
        )
    if type(params.get("unload_dependents", False)) is not bool:
        raise RequestError(ErrorCode.BAD_REQUEST, "unload_dependents must be true or false")


class ModelControl:
    """Index, load and unload for one server (see the module docstring)."""

    def __init__(
        self, manager: ModelManager, directory: ModelDirectory | None, *, explicit: bool
    ) -> None:
        self.manager = manager
        self.directory = directory
        self.explicit = explicit

    def index(self, ready_only: bool = False) -> list[dict[str, Any]]:
        """The repository index, sorted by name."""
        entries: list[dict[str, Any]] = []
        for name in sorted(self.manager.loaded_names):
            try:
                slot = self.manager.slot(name)
            except McpError:
                continue
            entries.extend(index_entry(name, v, "READY") for v in sorted(slot.versions))
        if self.directory is not None and not ready_only:
            loaded = set(self.manager.loaded_names)
            try:
                files = scan(self.directory.model_path)
            except McpError:
                files = {}
            for path in files:
                name = self.directory.name_of(path)
                if name not in loaded:
                    entries.append(index_entry(name, "", "UNAVAILABLE", "unloaded"))
                    loaded.add(name)
        return sorted(entries, key=lambda e: (e["name"], e["version"]))

    def _check(self, name: str, action: str) -> None:
        if not self.explicit:
            raise RequestError(
                ErrorCode.FORBIDDEN,
                f"cannot {action} {name!r}: explicit model control is off (start the agent "
                "with --model-control explicit)",
            )
        owned = self.directory.owned_names() if self.directory is not None else set()
        if name in self.manager.loaded_names and name not in owned:
            raise RequestError(
                ErrorCode.FORBIDDEN,
                f"cannot {action} {name!r}: the control plane manages it; change it with a "
                "deployment",
            )

    async def load(self, name: str) -> None:
        """Load (or reload) the model file that serves ``name``. Raises RequestError."""
        self._check(name, "load")
        directory = self.directory
        if directory is None:
            raise RequestError(ErrorCode.NOT_FOUND, f"no model file serves {name!r}")
        for path in scan(directory.model_path):
            if directory.name_of(path) != name and path.suffix != ".mcpb":
                continue
            try:
                source = directory.source_for(path)
            except (McpError, OSError) as e:
                if directory.name_of(path) == name:
                    raise RequestError(
                        ErrorCode.BAD_REQUEST, f"failed to load {name!r}: {e}"
                    ) from None
                continue
            if source.name != name:
                continue
            try:
                await self.manager.load(source)
            except (McpError, OSError) as e:
                raise RequestError(ErrorCode.BAD_REQUEST, f"failed to load {name!r}: {e}") from None
            finally:
                directory.prune(self.manager)
            directory.claim(path, name)
            log.info("loaded %s %s on request (%s)", name, source.version, path.name)
            return
        raise RequestError(
            ErrorCode.NOT_FOUND, f"no model file under {directory.model_path} serves {name!r}"
        )

    async def unload(self, name: str) -> None:
        """Unload every version of ``name``. Raises RequestError."""
        self._check(name, "unload")
        if name not in self.manager.loaded_names:
            raise RequestError(ErrorCode.NOT_FOUND, f"model {name!r} is not loaded")
        await self.manager.unload(name)
        if self.directory is not None:
            self.directory.prune(self.manager)
        log.info("unloaded %s on request", name)
