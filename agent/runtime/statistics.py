"""Per-version inference statistics in the shape of Triton's statistics extension.

One :class:`VersionStatistics` per loaded model version counts what Triton's
``GET /v2/models/{m}[/versions/{v}]/stats`` and gRPC ``ModelStatistics`` report, so the
clients and dashboards built for Triton read an agent unchanged:

- ``success`` / ``fail``: client requests answered / failed after they reached the version,
  with their whole time in the server (receipt to answer);
- ``queue``: each request's wait in the batch queue; ``compute_infer``: the run of the batch
  that carried it (stacking and splitting included); ``compute_input`` / ``compute_output``:
  the transport's decoding of the request's tensors and encoding of the answer;
- ``inference_count``: rows answered; ``execution_count``: backend runs (batches), with
  ``batch_stats`` per batch size (count and run time).

Updated on the event loop only (no lock); :meth:`VersionStatistics.to_json` gives the
protocol's JSON form, which the gRPC service turns into its message and which
:func:`merge_model_stats` sums across serving processes. Durations are integer nanoseconds.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any


class VersionStatistics:
    """Counters of one model version (see the module docstring).

    Durations are kept as float seconds on the hot path and written as integer nanoseconds
    by :meth:`to_json`.
    """

    __slots__ = (
        "_batches",
        "_compute_infer",
        "_compute_input",
        "_compute_output",
        "_fail",
        "_queue",
        "_success",
        "execution_count",
        "inference_count",
        "last_inference_ms",
    )

    def __init__(self) -> None:
        self.last_inference_ms = 0
        self.inference_count = 0
        self.execution_count = 0
        # [count, seconds] each
        self._success = [0, 0.0]
        self._fail = [0, 0.0]
        self._queue = [0, 0.0]
        self._compute_input = [0, 0.0]
        self._compute_infer = [0, 0.0]
        self._compute_output = [0, 0.0]
        # batch size -> [runs, seconds]
        self._batches: dict[int, list[float]] = {}

    def on_batch(self, rows: int, requests: int, queue_total_s: float, run_s: float) -> None:
        """One backend run of ``rows`` rows for ``requests`` requests that waited
        ``queue_total_s`` seconds in all."""
        self.execution_count += 1
        q = self._queue
        q[0] += requests
        q[1] += queue_total_s
        c = self._compute_infer
        c[0] += requests
        c[1] += run_s * requests
        b = self._batches.get(rows)
        if b is None:
            b = self._batches[rows] = [0, 0.0]
        b[0] += 1
        b[1] += run_s

    def on_success(self, total_s: float, rows: int, input_s: float, output_s: float) -> None:
        """One client request answered by this version after ``total_s`` seconds, ``rows``
        rows; ``input_s``/``output_s``: its decoding and encoding time."""
        s = self._success
        s[0] += 1
        s[1] += total_s
        self.inference_count += rows
        self.last_inference_ms = int(time.time() * 1000)
        ci = self._compute_input
        ci[0] += 1
        ci[1] += input_s
        co = self._compute_output
        co[0] += 1
        co[1] += output_s

    def on_failure(self, total_s: float) -> None:
        """One client request that reached this version and failed after ``total_s``."""
        f = self._fail
        f[0] += 1
        f[1] += total_s

    def to_json(self, name: str, version: str) -> dict[str, Any]:
        """Triton's ``model_stats`` entry for this version."""
        durations = {
            "success": self._success,
            "fail": self._fail,
            "queue": self._queue,
            "compute_input": self._compute_input,
            "compute_infer": self._compute_infer,
            "compute_output": self._compute_output,
            "cache_hit": (0, 0.0),
            "cache_miss": (0, 0.0),
        }
        return {
            "name": name,
            "version": version,
            "last_inference": self.last_inference_ms,
            "inference_count": self.inference_count,
            "execution_count": self.execution_count,
            "inference_stats": {k: _duration(c, s) for k, (c, s) in durations.items()},
            "batch_stats": [
                {"batch_size": size, "compute_infer": _duration(c, s)}
                for size, (c, s) in sorted(self._batches.items())
            ],
            "memory_usage": [],
        }


def _duration(count: float, seconds: float) -> dict[str, int]:
    return {"count": int(count), "ns": int(seconds * 1e9)}


def merge_model_stats(groups: Iterable[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Sum ``model_stats`` lists from several serving processes, entry by (name, version).

    Counts and durations add up; ``last_inference`` is the latest. Order: by name, then version
    as first seen.
    """
    merged: dict[tuple[str, str], dict[str, Any]] = {}
    for entries in groups:
        for e in entries:
            key = (e["name"], e["version"])
            have = merged.get(key)
            if have is None:
                merged[key] = _copy(e)
                continue
            have["last_inference"] = max(have["last_inference"], e["last_inference"])
            have["inference_count"] += e["inference_count"]
            have["execution_count"] += e["execution_count"]
            for k, v in e["inference_stats"].items():
                slot = have["inference_stats"].setdefault(k, {"count": 0, "ns": 0})
                slot["count"] += v["count"]
                slot["ns"] += v["ns"]
            sizes = {b["batch_size"]: b for b in have["batch_stats"]}
            for b in e["batch_stats"]:
                mine = sizes.get(b["batch_size"])
                if mine is None:
                    sizes[b["batch_size"]] = _copy(b)
                else:
                    mine["compute_infer"]["count"] += b["compute_infer"]["count"]
                    mine["compute_infer"]["ns"] += b["compute_infer"]["ns"]
            have["batch_stats"] = [sizes[s] for s in sorted(sizes)]
    return [merged[k] for k in sorted(merged, key=lambda k: k[0])]


def _copy(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _copy(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_copy(v) for v in obj]
    return obj
