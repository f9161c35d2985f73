"""The one interface every inference backend implements, and the errors it raises.

A :class:`ModelRunner` owns one loaded model (an onnxruntime session or a TFLite interpreter)
and runs it synchronously; callers run it off the event loop. ``run`` is safe to call from
several threads at once (backends that are not thread-safe serialize internally).

Errors, by who is at fault::

    RunnerError                 base
    ├── BackendUnavailableError the backend or execution provider cannot be used here
    ├── ModelLoadError          the model file does not load in the backend
    └── InferenceError          a run failed
        └── InputError          the caller's inputs do not fit the model (name, shape, dtype)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from mcp_edge.shared.errors import McpError
from mcp_edge.shared.protocol.wire import Datatype

Array = np.ndarray[Any, Any]


class RunnerError(McpError):
    """Base class for backend errors."""


class BackendUnavailableError(RunnerError):
    """The backend or execution provider is not installed or failed to initialise."""


class ModelLoadError(RunnerError):
    """The backend could not load the model."""


class InferenceError(RunnerError):
    """The backend failed while running the model."""


class InputError(InferenceError):
    """Inputs do not match the model's signature (unknown/missing name, shape, dtype)."""


@dataclass(frozen=True)
class TensorSpec:
    """A model input or output: name, protocol datatype and shape (-1 for a dynamic dim)."""

    name: str
    datatype: Datatype
    shape: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        """Open Inference Protocol model-metadata form."""
        return {"name": self.name, "datatype": self.datatype.value, "shape": list(self.shape)}


@dataclass(frozen=True)
class RunnerInfo:
    """What was loaded and how: shown in metadata, metrics and ``mcp-agent doctor``."""

    backend: str
    """``onnxruntime``, ``openvino`` or ``tflite``."""
    provider: str
    """The execution provider or delegate actually in use (e.g. ``CPUExecutionProvider``)."""
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    batchable: bool
    """True when every input's first dimension is dynamic, so requests can be stacked."""
    fallback_reason: str | None = None
    """Why a preferred provider was skipped, if one was."""
    details: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class ModelRunner(Protocol):
    """A loaded model that turns named input arrays into named output arrays."""

    @property
    def info(self) -> RunnerInfo: ...

    def run(self, feeds: dict[str, Array]) -> dict[str, Array]:
        """Run one (possibly batched) inference; raise :class:`InputError`/:class:`InferenceError`."""
        ...

    def close(self) -> None:
        """Release the session/interpreter; further ``run`` calls raise."""
        ...
