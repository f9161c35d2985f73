"""Warm-up and answer checks: synthetic inputs from a signature and output validation (the
agreement test shadow mode uses is :func:`agent.runtime.canary.answers_agree`)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mcp_edge.agent.runtime.runner import (
    Array,
    ModelLoadError,
    ModelRunner,
    RunnerError,
    RunnerInfo,
)


def synthetic_inputs(info: RunnerInfo, batch: int) -> dict[str, Array]:
    """Deterministic warm-up inputs that fit the signature (dynamic dims → ``batch`` first, 1 after)."""
    rng = np.random.default_rng(0)
    feeds: dict[str, Array] = {}
    for spec in info.inputs:
        shape = tuple((batch if i == 0 else 1) if d < 0 else d for i, d in enumerate(spec.shape))
        dt = spec.datatype.numpy_dtype
        if dt.kind == "f":
            feeds[spec.name] = rng.random(shape).astype(dt)
        elif dt.kind == "b":
            feeds[spec.name] = np.zeros(shape, dtype=dt)
        elif dt.kind in "iu":
            feeds[spec.name] = rng.integers(0, 2, shape).astype(dt)
        else:
            feeds[spec.name] = np.full(shape, "", dtype=object)
    return feeds


def check_outputs(info: RunnerInfo, outputs: dict[str, Array], batch: int) -> None:
    """Raise :class:`ModelLoadError` unless outputs match the signature and hold no NaN/Inf."""
    for spec in info.outputs:
        arr = outputs.get(spec.name)
        if arr is None:
            raise ModelLoadError(f"warm-up: output {spec.name!r} missing")
        if arr.dtype != spec.datatype.numpy_dtype and spec.datatype.value != "BYTES":
            raise ModelLoadError(
                f"warm-up: output {spec.name!r} is {arr.dtype}, signature says {spec.datatype.value}"
            )
        if len(arr.shape) != len(spec.shape) or any(
            d >= 0 and d != s for d, s in zip(spec.shape, arr.shape, strict=True)
        ):
            raise ModelLoadError(
                f"warm-up: output {spec.name!r} has shape {list(arr.shape)}, "
                f"signature says {list(spec.shape)}"
            )
        if info.batchable and arr.ndim and arr.shape[0] != batch:
            raise ModelLoadError(f"warm-up: output {spec.name!r} batch {arr.shape[0]} != {batch}")
        if arr.dtype.kind == "f" and not np.isfinite(arr).all():
            raise ModelLoadError(f"warm-up: output {spec.name!r} holds NaN or infinity")


@dataclass(frozen=True)
class WarmUp:
    seconds: float
    """Time the whole warm-up took."""
    run_s: float
    """Median time of one batch-1 run after the first (what a lone request costs)."""


def warm_up(runners: Sequence[ModelRunner], repeats: int = 5) -> WarmUp:
    """Run synthetic inputs through every instance (batch 1, and 8 when batchable), check the
    outputs, and time a few more batch-1 runs. Raises :class:`ModelLoadError`."""
    t0 = time.perf_counter()
    timings: list[float] = []
    for runner in runners:
        info = runner.info
        for batch in (1, 8) if info.batchable else (1,):
            try:
                out = runner.run(synthetic_inputs(info, batch))
            except RunnerError as e:
                raise ModelLoadError(f"warm-up failed: {e}") from e
            check_outputs(info, out, batch)
    feeds = synthetic_inputs(runners[0].info, 1)
    for _ in range(repeats):
        t = time.perf_counter()
        try:
            runners[0].run(feeds)
        except RunnerError as e:
            raise ModelLoadError(f"warm-up failed: {e}") from e
        timings.append(time.perf_counter() - t)
    return WarmUp(time.perf_counter() - t0, statistics.median(timings))
