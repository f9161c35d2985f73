"""The rollout loop on the real app and database (SQLite and PostgreSQL), stepped by hand.

Devices enroll through the REST API (the fake broker provisioner stands in for accounts only);
what they report (reported state, deployment events, inference statistics) is written with the
ingestion's own queries, exactly the rows ingestion stores. The rollout's background loop is
stopped so each test steps it itself with a clock that moves only when told to: every
transition is asserted on what the REST API and the signed desired states show.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from mcp_edge.controlplane.api.common import SERVICES
from mcp_edge.controlplane.api.deployments import DEPLOYMENTS
from mcp_edge.controlplane.api.rollouts import ROLLOUTS
from mcp_edge.controlplane.db import Database
from mcp_edge.controlplane.db import deployments as deploy_q
from mcp_edge.controlplane.db import rollouts as rollout_q
from mcp_edge.controlplane.db import telemetry as telemetry_q
from mcp_edge.controlplane.rollouts.service import RolloutService
from mcp_edge.controlplane.settings import PasswordCost, Settings
from mcp_edge.shared.signing import PrivateKey
from tests.integration.test_deployments import publish_versions
from tests.support.controlplane import ControlPlane, FakeClock, start_control_plane

MODEL = "digits"
OLD, NEW = "1.0.0", "1.1.0"
EDGES = [1.0, 2.0, 5.0, 10.0, 20.0, 50.0]


@dataclass
class Fleet:
    cp: ControlPlane
    db: Database
    rollouts: RolloutService
    devices: list[str]
    event_seq: int = 0

    @property
    def clock(self) -> FakeClock:
        return self.cp.clock

    async def create(self, body: dict[str, Any], status: int = 201) -> dict[str, Any]:
        code, answer = await self.cp.call("POST", "/api/v1/rollouts", body=body)
        assert code == status, answer
        return answer  # type: ignore[no-any-return]

    async def rollout(self, rollout_id: int) -> dict[str, Any]:
        code, answer = await self.cp.call("GET", f"/api/v1/rollouts/{rollout_id}")
        assert code == 200, answer
        return answer["rollout"]  # type: ignore[no-any-return]

    async def command(self, rollout_id: int, op: str, status: int = 200) -> dict[str, Any]:
        code, answer = await self.cp.call(
            "POST", f"/api/v1/rollouts/{rollout_id}/{op}", body={"reason": f"test {op}"}
        )
        assert code == status, answer
        return answer  # type: ignore[no-any-return]

    async def desired_version(self, device_id: str) -> dict[str, Any] | None:
        """The model entry of the device's newest signed desired state."""
        async with self.db.read() as tx:
            doc = (await deploy_q.desired_states(tx, [device_id])).get(device_id)
        if doc is None:
            return None
        for m in doc.envelope["signed"]["models"]:
            if m["name"] == MODEL:
                return m  # type: ignore[no-any-return]
        return None

    async def told(self) -> dict[str, str | None]:
        """device -> the stable version its desired state names now."""
        out: dict[str, str | None] = {}
        for d in self.devices:
            m = await self.desired_version(d)
            out[d] = m["stable"]["version"] if m else None
        return out

    async def report(self, device_id: str, **status: Any) -> None:
        """The device's retained reported state, as ingestion stores it."""
        document = {
            "device_id": device_id,
            "ts": self.clock().timestamp(),
            "applied_seq": 1,
            "profile": "generic-x86_64",
            "models": [{"name": MODEL, "phase": "active", **status}],
        }
        async with self.db.transaction() as tx:
            await telemetry_q.upsert_reported(
                tx,
                [
                    {
                        "device_id": device_id,
                        "ts": self.clock(),
                        "received_at": self.clock(),
                        "applied_seq": 1,
                        "document": document,
                    }
                ],
            )

    async def running(self, device_ids: list[str], version: str) -> None:
        for d in device_ids:
            await self.report(d, active_version=version, installed_versions=[version])

    async def failed(self, device_id: str, version: str) -> None:
        self.event_seq += 1
        async with self.db.transaction() as tx:
            await telemetry_q.insert_events(
                tx,
                [
                    {
                        "device_id": device_id,
                        "event_seq": self.event_seq,
                        "ts": self.clock(),
                        "received_at": self.clock(),
                        "model": MODEL,
                        "version": version,
                        "phase": "warming",
                        "outcome": "error",
                        "message": "warm-up failed: Gather index out of range",
                        "cause": "warmup",
                        "bytes_done": None,
                        "bytes_total": None,
                        "elapsed_ms": 3.0,
                    }
                ],
            )

    async def stats(
        self,
        device_id: str,
        version: str,
        *,
        count: int,
        errors: int = 0,
        latency_bucket: int = 1,
        role: str = "stable",
        garbage: bool = False,
    ) -> None:
        """One inference-statistics window; ``garbage`` stores counts that contradict
        themselves (more errors than requests), which no schema-checked report can carry."""
        counts = [0] * (len(EDGES) + 1)
        counts[latency_bucket] = count
        async with self.db.transaction() as tx:
            await telemetry_q.insert_inference(
                tx,
                [
                    {
                        "device_id": device_id,
                        "ts": self.clock(),
                        "window_s": 1.0,
                        "model": MODEL,
                        "version": version,
                        "count": count,
                        "errors": count * 3 if garbage else errors,
                        "rejections": 0,
                        "p50_ms": EDGES[latency_bucket],
                        "p95_ms": EDGES[latency_bucket],
                        "p99_ms": EDGES[latency_bucket],
                        "queue_depth": 0,
                        "batch_size_avg": 1.0,
                        "batch_fill_ratio": None,
                        "role": role,
                        "latency_hist": {"edges_ms": EDGES, "counts": counts},
                        "shadow_compared": 0,
                        "shadow_agreed": 0,
                    }
                ],
            )

    async def step(self) -> int:
        return await self.rollouts.run_once()

    async def settle(self) -> None:
        """Step until a step changes nothing (the loop run twice on the same inputs)."""
        for _ in range(20):
            if not await self.step():
                return
        raise AssertionError("the rollout kept changing without new input")

    async def events(self, rollout_id: int) -> list[dict[str, Any]]:
        code, answer = await self.cp.call("GET", f"/api/v1/rollouts/{rollout_id}/events")
        assert code == 200, answer
        return answer["items"]  # type: ignore[no-any-return]


@pytest.fixture
async def fleet(database_url: str, tmp_path: Path) -> AsyncIterator[Fleet]:
    settings = Settings(
        data_dir=tmp_path / "cp", database_url=database_url, password_cost=PasswordCost.MIN
    )
    cp = await start_control_plane(settings, FakeClock())
    app = cp.client.server.app
    service = app[ROLLOUTS]
    await service.stop()  # the test steps it
    db = app[SERVICES].db
    try:
        token = (await cp.new_token(max_uses=50))["token"]
        suffix = secrets.token_hex(3)
        devices = []
        for i in range(10):
            device_id = f"cam-{i}-{suffix}"
            status, answer = await cp.enroll(
                PrivateKey.generate(), token, device_id=device_id, labels={"site": suffix}
            )
            assert status == 200 and answer["status"] == "accepted", answer
            devices.append(device_id)
        await publish_versions(db, cp.clock(), MODEL, OLD, NEW, "1.2.0", "0.9.0")
        code, answer = await cp.call(
            "POST",
            "/api/v1/deployments",
            body={"model": MODEL, "version": OLD, "selector": {"labels": {"site": suffix}}},
        )
        assert code == 201, answer
        f = Fleet(cp, db, service, devices)
        await f.running(devices, OLD)
        async with db.transaction() as tx:  # online, as their birth messages make them
            await telemetry_q.mark_seen(tx, devices, devices, [], cp.clock())
        yield f
    finally:
        await cp.client.close()


def spec(fleet: Fleet, *stages: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "version": NEW,
        "target": {"devices": fleet.devices},
        "stages": list(stages),
        **extra,
    }


ERROR_GATE = {"metric": "error_rate", "threshold": 0.05, "min_requests": 20}


# ---------------------------------------------------------------------------- the happy path
async def test_a_good_version_goes_stage_by_stage_to_every_device(fleet: Fleet) -> None:
    answer = await fleet.create(
        spec(
            fleet,
            {"count": 2, "bake_s": 60, "gates": [ERROR_GATE]},
            {"percent": 30, "bake_s": 60, "gates": [ERROR_GATE]},
            {"percent": 50, "bake_s": 0},
        )
    )
    rollout_id = answer["rollout"]["id"]
    assert answer["rollout"]["status"] == "running"
    assert answer["rollout"]["target_devices"] == 10

    await fleet.settle()
    told = await fleet.told()
    first = [d for d, v in told.items() if v == NEW]
    assert len(first) == 2, told  # stage 1 only; the other eight still told the old version
    assert sum(1 for v in told.values() if v == OLD) == 8

    await fleet.running(first, NEW)
    await fleet.settle()
    shown = await fleet.rollout(rollout_id)
    assert shown["devices"] == {"active": 2, "waiting": 8}
    gate = shown["gates"][0]
    assert gate["metric"] == "error_rate" and gate["verdict"] == "pending"

    for d in first:
        await fleet.stats(d, NEW, count=40, errors=0)
    fleet.clock.advance(seconds=61)
    await fleet.settle()
    told = await fleet.told()
    second = [d for d, v in told.items() if v == NEW and d not in first]
    assert len(second) == 3, told

    await fleet.running(second, NEW)
    await fleet.settle()
    for d in second:
        await fleet.stats(d, NEW, count=40, errors=1)
    fleet.clock.advance(seconds=61)
    await fleet.settle()
    rest = [d for d in fleet.devices if d not in first + second]
    assert all(v == NEW for v in (await fleet.told()).values())
    await fleet.running(rest, NEW)
    await fleet.settle()

    shown = await fleet.rollout(rollout_id)
    assert shown["status"] == "succeeded", shown
    assert shown["ended_at"] is not None
    kinds = [e["kind"] for e in await fleet.events(rollout_id)]
    assert kinds.count("stage_started") == 3 and kinds[-1] == "succeeded", kinds
    async with fleet.db.read() as tx:
        rows = await rollout_q.rollout_devices(tx, rollout_id)
    assert {r.moves for r in rows} == {1}  # every device told exactly once


# ---------------------------------------------------------------------------- gates
@pytest.mark.parametrize("fault", ["warmup", "errors", "latency"])
async def test_a_bad_version_is_stopped_at_the_first_stage_and_reverted(
    fleet: Fleet, fault: str
) -> None:
    gates = [
        {"metric": "install_failure_rate", "threshold": 0.2, "min_devices": 1},
        ERROR_GATE,
        {"metric": "latency_p95_ratio", "threshold": 1.5, "min_requests": 20},
    ]
    for d in fleet.devices:  # what the old version measured before the rollout
        await fleet.stats(d, OLD, count=50, latency_bucket=1)
    fleet.clock.advance(seconds=5)
    answer = await fleet.create(
        spec(
            fleet,
            {"count": 3, "bake_s": 300, "gates": gates},
            {"percent": 70, "bake_s": 0},
        )
    )
    rollout_id = answer["rollout"]["id"]
    await fleet.settle()
    first = [d for d, v in (await fleet.told()).items() if v == NEW]
    untouched = [d for d in fleet.devices if d not in first]
    assert len(first) == 3

    if fault == "warmup":
        for d in first:
            await fleet.failed(d, NEW)  # the device stays on the old version by itself
    else:
        await fleet.running(first, NEW)
        await fleet.settle()
        fleet.clock.advance(seconds=5)
        for d in first:
            if fault == "errors":
                await fleet.stats(d, NEW, count=50, errors=10)
            else:
                await fleet.stats(d, NEW, count=50, latency_bucket=3)  # 2 ms -> 10 ms
    # The failing gate acts before the bake ends.
    await fleet.settle()
    shown = await fleet.rollout(rollout_id)
    # After a failed warm-up the devices still run the old version: nothing to wait for.
    assert shown["status"] == ("rolled_back" if fault == "warmup" else "rolling_back"), shown
    metric = {"warmup": "install_failure_rate", "errors": "error_rate"}.get(
        fault, "latency_p95_ratio"
    )
    failed = [g for g in shown["gates"] if g["verdict"] == "fail"]
    assert [g["metric"] for g in failed] == [metric], shown["gates"]
    history = await fleet.events(rollout_id)
    assert any(e["kind"] == "gate_failed" and metric in e["reason"] for e in history), history

    told = await fleet.told()
    assert all(told[d] == OLD for d in fleet.devices), told
    for d in first:
        m = await fleet.desired_version(d)
        assert m is not None and m["rollback"] is True
    await fleet.running(first, OLD)
    await fleet.settle()
    assert (await fleet.rollout(rollout_id))["status"] == "rolled_back"
    # Untouched devices never had a desired state naming the new version.
    async with fleet.db.read() as tx:
        from_rollout = await deploy_q.list_deployments(tx, limit=100, model=MODEL)
    for d in untouched:
        m = await fleet.desired_version(d)
        assert m is not None and NEW not in str(m)
    assert all(d.rollout_id == rollout_id for d in from_rollout[:2])


async def test_a_gate_short_of_samples_when_the_bake_ends_pauses_for_a_human(
    fleet: Fleet,
) -> None:
    answer = await fleet.create(
        spec(fleet, {"count": 2, "bake_s": 30, "gates": [ERROR_GATE]}, {"percent": 80, "bake_s": 0})
    )
    rollout_id = answer["rollout"]["id"]
    await fleet.settle()
    first = [d for d, v in (await fleet.told()).items() if v == NEW]
    await fleet.running(first, NEW)
    await fleet.stats(first[0], NEW, count=5)
    await fleet.settle()
    fleet.clock.advance(seconds=31)
    await fleet.settle()
    shown = await fleet.rollout(rollout_id)
    assert shown["status"] == "paused", shown
    assert "inconclusive" in shown["reason"]
    assert sum(1 for v in (await fleet.told()).values() if v == NEW) == 2  # nothing more moved

    await fleet.command(rollout_id, "promote")
    await fleet.settle()
    assert all(v == NEW for v in (await fleet.told()).values())


async def test_a_device_sending_garbage_cannot_pass_a_gate_alone(fleet: Fleet) -> None:
    answer = await fleet.create(
        spec(fleet, {"count": 2, "bake_s": 10, "gates": [ERROR_GATE]}, {"percent": 80, "bake_s": 0})
    )
    rollout_id = answer["rollout"]["id"]
    await fleet.settle()
    first = [d for d, v in (await fleet.told()).items() if v == NEW]
    await fleet.running(first, NEW)
    await fleet.settle()  # both active: the bake starts
    await fleet.stats(first[0], NEW, count=1000, garbage=True)
    fleet.clock.advance(seconds=11)
    await fleet.settle()
    shown = await fleet.rollout(rollout_id)
    assert shown["status"] == "paused", shown  # inconclusive: the garbage was ignored
    kinds = [e["kind"] for e in await fleet.events(rollout_id)]
    assert "ignored_stats" in kinds


# ---------------------------------------------------------------------------- operations
async def test_pause_resume_abort_and_manual_rollback(fleet: Fleet) -> None:
    answer = await fleet.create(
        spec(fleet, {"count": 2, "bake_s": 0}, {"count": 3, "bake_s": 0}, {"percent": 50})
    )
    rollout_id = answer["rollout"]["id"]
    paused = await fleet.command(rollout_id, "pause")
    assert paused["rollout"]["status"] == "paused"
    await fleet.settle()
    assert all(v == OLD for v in (await fleet.told()).values())  # paused: nobody moved
    await fleet.command(rollout_id, "pause", status=409)

    await fleet.command(rollout_id, "resume")
    await fleet.settle()
    first = [d for d, v in (await fleet.told()).items() if v == NEW]
    assert len(first) == 2
    await fleet.running(first, NEW)
    await fleet.settle()

    rolled = await fleet.command(rollout_id, "rollback")
    assert rolled["rollout"]["status"] == "rolling_back"
    assert all(v == OLD for v in (await fleet.told()).values())
    await fleet.running(first, OLD)
    await fleet.settle()
    assert (await fleet.rollout(rollout_id))["status"] == "rolled_back"
    await fleet.command(rollout_id, "abort", status=409)

    again = await fleet.create(spec(fleet, {"count": 2, "bake_s": 0}, {"percent": 80}))
    second = again["rollout"]["id"]
    aborted = await fleet.command(second, "abort")
    assert aborted["rollout"]["status"] == "aborted"
    await fleet.settle()
    assert all(v == OLD for v in (await fleet.told()).values())

    code, audit = await fleet.cp.call("GET", "/api/v1/audit", params={"limit": "50"})
    assert code == 200
    actions = [e["action"] for e in audit["items"]]
    for action in ("rollout.created", "rollout.pause", "rollout.resume", "rollout.rollback",
                   "rollout.abort"):  # fmt: skip
        assert action in actions, actions


# ---------------------------------------------------------------------------- bad input
async def test_bad_rollouts_are_refused_with_the_reason(fleet: Fleet) -> None:
    async def refused(body: dict[str, Any], status: int, words: str) -> None:
        answer = await fleet.create(body, status=status)
        assert words in answer["error"], answer

    one = {"percent": 100, "bake_s": 0}
    await refused({**spec(fleet, one), "model": "nope"}, 404, "no model 'nope'")
    await refused({**spec(fleet, one), "version": "9.9.9"}, 404, "no published version")
    await refused({**spec(fleet, one), "target": {}}, 400, "target")
    await refused(
        {**spec(fleet, one), "target": {"devices": ["ghost-1"]}}, 404, "no device 'ghost-1'"
    )
    await refused(spec(fleet, {"percent": 30}, {"percent": 30}), 400, "100")
    await refused(
        spec(fleet, {"percent": 100, "gates": [{"metric": "error_rate", "threshold": 1.5}]}),
        400,
        "threshold",
    )
    await refused({**spec(fleet, one), "version": "0.9.0"}, 409, "below the current version")

    first = await fleet.create(spec(fleet, {"count": 2}, {"percent": 80}))
    answer = await fleet.create(
        {**spec(fleet, one), "version": "1.2.0", "target": {"devices": fleet.devices[:3]}},
        status=409,
    )
    assert f"rollout {first['rollout']['id']}" in answer["error"], answer
    code, _ = await fleet.cp.call("GET", "/api/v1/rollouts/999999")
    assert code == 404


# ---------------------------------------------------------------------------- replicas
async def test_two_replicas_step_a_rollout_once(fleet: Fleet) -> None:
    """Two services on one database: only the lease holder steps; both stepping at once write
    one step; when the holder stops renewing, the other carries on from the database."""
    app = fleet.cp.client.server.app
    other = RolloutService(fleet.db, app[DEPLOYMENTS], fleet.clock, owner="replica-b", lease_s=15.0)
    answer = await fleet.create(
        spec(fleet, {"count": 4, "bake_s": 0}, {"percent": 60, "bake_s": 0})
    )
    rollout_id = answer["rollout"]["id"]
    assert await fleet.step() == 1
    assert await other.run_once() == 0  # replica A holds the lease
    first = [d for d, v in (await fleet.told()).items() if v == NEW]
    assert len(first) == 4

    await fleet.running(first, NEW)
    results = await asyncio.gather(fleet.rollouts.step(rollout_id), other.step(rollout_id))
    assert sorted(results) == [False, True]  # one write landed, the other found it stale

    fleet.clock.advance(seconds=16)  # A stopped renewing: B takes the lease and goes on
    await fleet.running([d for d in fleet.devices if d not in first], NEW)
    for _ in range(5):
        await other.run_once()
    assert (await fleet.rollout(rollout_id))["status"] == "succeeded"
    async with fleet.db.read() as tx:
        rows = await rollout_q.rollout_devices(tx, rollout_id)
        row = await rollout_q.get_rollout(tx, rollout_id)
    assert {r.moves for r in rows} == {1}
    assert row is not None and row.lease_owner == "replica-b"
    assert row.lease_until is not None and row.lease_until > fleet.clock() - timedelta(seconds=1)
