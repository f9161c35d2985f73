"""The rollout ``drift`` gate on the real app and database: a canary stage whose devices' inputs
drift against the new version's baseline fails its gate and is rolled back; one whose inputs
match the baseline passes it. Devices, reported state and the rollout loop are those of
test_rollouts_service (stepped by hand); drift reports go through the drift store."""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson
import pytest
from sqlalchemy import update

from mcp_edge.controlplane.db import deployments as deploy_q
from mcp_edge.controlplane.db.models import ModelVersion
from mcp_edge.controlplane.drift.sample import decode_drift
from mcp_edge.controlplane.drift.service import DriftService
from mcp_edge.controlplane.metrics import ControlPlaneMetrics
from mcp_edge.shared.bundle.baseline import compute_baseline
from mcp_edge.shared.drift import Binner
from tests.integration.test_rollouts_service import MODEL, NEW, OLD, Fleet, spec
from tests.integration.test_rollouts_service import fleet as fleet  # the fixture
from tests.support.drift import window

DRIFT_GATE = {"metric": "drift", "threshold": 0.2, "min_devices": 2, "min_requests": 150}


async def _publish_baseline(fleet: Fleet) -> Any:
    data = np.random.default_rng(21).normal(size=(4000, 6))
    baseline = compute_baseline("x", data, bins=8)
    async with fleet.db.transaction() as tx:
        await tx.execute(
            update(ModelVersion)
            .where(ModelVersion.model == MODEL, ModelVersion.version == NEW)
            .values(drift_baseline=baseline.model_dump(mode="json"))
        )
    return baseline


async def _canary_stage(fleet: Fleet) -> tuple[int, list[str]]:
    answer = await fleet.create(
        spec(
            fleet,
            {"count": 3, "mode": "canary", "weight": 0.5, "bake_s": 300, "gates": [DRIFT_GATE]},
            {"percent": 70, "bake_s": 0},
        )
    )
    rollout_id = answer["rollout"]["id"]
    await fleet.settle()
    async with fleet.db.read() as tx:
        models = await deploy_q.device_models(tx, fleet.devices)
    canaries = [d for d, ms in models.items() if any(m.canary_version == NEW for m in ms)]
    assert len(canaries) == 3
    for d in canaries:
        await fleet.report(d, active_version=OLD, canary_version=NEW,
                           installed_versions=[OLD, NEW])  # fmt: skip
    await fleet.settle()
    fleet.clock.advance(seconds=5)
    return rollout_id, canaries


async def _send(fleet: Fleet, baseline: Any, devices: list[str], shift: float) -> None:
    drift = DriftService(fleet.db, fleet.clock, metrics=ControlPlaneMetrics())
    binner, rng = Binner(baseline), np.random.default_rng(int(shift * 7) + 3)
    samples = []
    for d in devices:
        binner.add(rng.normal(size=(200, 6)) + shift)
        n, features, _, _ = binner.take()
        report = window(d, fleet.clock(), n, features, model=MODEL, version=NEW)
        report["role"] = "canary"
        samples.append(decode_drift(orjson.dumps(report), d, fleet.clock().timestamp()))
    result = await drift.store(samples)
    assert result.stored == len(devices), result


@pytest.mark.parametrize("shift", [1.0, 0.0])
async def test_a_canary_whose_inputs_drift_fails_its_drift_gate(fleet: Fleet, shift: float) -> None:
    baseline = await _publish_baseline(fleet)
    rollout_id, canaries = await _canary_stage(fleet)
    await _send(fleet, baseline, canaries[:1], shift)  # one device: below min_devices
    await fleet.settle()
    (gate,) = (await fleet.rollout(rollout_id))["gates"]
    assert (gate["metric"], gate["verdict"], gate["devices"]) == ("drift", "pending", 1)

    await _send(fleet, baseline, canaries[1:], shift)
    await fleet.settle()
    shown = await fleet.rollout(rollout_id)
    (gate,) = shown["gates"]
    assert gate["devices"] == 3
    if shift:
        assert gate["verdict"] == "fail" and gate["value"] > 0.2, gate
        assert shown["status"] == "rolling_back", shown
        history = await fleet.events(rollout_id)
        assert any(e["kind"] == "gate_failed" and "drift" in e["reason"] for e in history)
        told = await fleet.told()
        assert all(told[d] == OLD for d in fleet.devices)
    else:
        assert gate["value"] < 0.2 and gate["verdict"] in ("pending", "pass"), gate
        fleet.clock.advance(seconds=301)  # the bake ends: the gate decides
        await fleet.settle()
        shown = await fleet.rollout(rollout_id)
        assert shown["stage"] == 1 and shown["status"] == "running", shown
