"""Fakes of our own ModelRunner interface, for batching, overload and canary tests.

Real models run through the real backends elsewhere; these exist to make a backend slow, gated
or failing on demand, which a real model cannot be made to do deterministically.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from mcp_edge.agent.runtime.runner import (
    Array,
    InferenceError,
    ModelRunner,
    RunnerInfo,
    TensorSpec,
)
from mcp_edge.shared.protocol.inference import Datatype

DOUBLER_INFO = RunnerInfo(
    backend="fake",
    provider="fake",
    inputs=(TensorSpec("x", Datatype.FP32, (-1, 4)),),
    outputs=(TensorSpec("y", Datatype.FP32, (-1, 4)),),
    batchable=True,
)


class DoublingRunner:
    """Returns ``x * 2``; records the batch sizes it ran; can be gated shut."""

    def __init__(self, info: RunnerInfo = DOUBLER_INFO) -> None:
        self._info = info
        self.batches: list[int] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.closed = False

    @property
    def info(self) -> RunnerInfo:
        return self._info

    def run(self, feeds: dict[str, Array]) -> dict[str, Array]:
        self.entered.set()
        if not self.gate.wait(timeout=30):
            raise InferenceError("gate never opened")
        x = feeds["x"]
        self.batches.append(int(x.shape[0]))
        return {"y": (x * 2).astype(np.float32)}

    def close(self) -> None:
        self.closed = True


class FailingAfterWarmup:
    """Wraps a real runner; once ``armed`` (after loading and warm-up), every run raises
    InferenceError, as a backend that breaks in production would."""

    def __init__(self, inner: ModelRunner) -> None:
        self.inner = inner
        self.armed = False

    @property
    def info(self) -> RunnerInfo:
        return self.inner.info

    def run(self, feeds: dict[str, Array]) -> dict[str, Any]:
        if self.armed:
            raise InferenceError("simulated backend fault")
        return self.inner.run(feeds)

    def close(self) -> None:
        self.inner.close()
