"""Each device's drift of a rollout's new version, for the ``drift`` gate (docs/drift.md).

A device's figure is the ``score`` (the largest of input, class and confidence PSI) of the sum
of its reports of the version received since the stage started, against the version's
baseline; a device with fewer than ``min_samples`` samples in them has no figure yet (the gate
waits for ``min_devices`` devices with one). A version without a baseline gives no figures, so
its drift gate stays pending and ends inconclusive: it never passes by default.
"""

from __future__ import annotations

from collections.abc import Collection
from datetime import datetime

import orjson
from pydantic import ValidationError

from mcp_edge.controlplane.db import Tx
from mcp_edge.controlplane.db import drift as q
from mcp_edge.controlplane.drift.scoring import Layout
from mcp_edge.shared.bundle.manifest import DriftBaseline


async def device_drift(
    tx: Tx,
    model: str,
    version: str,
    device_ids: Collection[str],
    since: datetime,
    *,
    min_samples: int,
) -> dict[str, float]:
    """``device -> drift score`` of ``version`` since ``since`` (see the module docstring)."""
    _, document = await q.baseline_of(tx, model, version)
    if document is None or not device_ids:
        return {}
    try:
        layout = Layout(DriftBaseline.model_validate_json(orjson.dumps(document)))
    except ValidationError:
        return {}
    out: dict[str, float] = {}
    for device_id, reports in (
        await q.device_counts_since(tx, model, version, device_ids, since)
    ).items():
        samples = sum(n for n, _ in reports)
        if samples < max(min_samples, 1):
            continue
        total = sum((layout.from_document(counts) for _, counts in reports), start=layout.zero())
        score = layout.score(total, samples).score
        if score is not None:
            out[device_id] = score
    return out
