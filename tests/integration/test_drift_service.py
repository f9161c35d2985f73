"""Drift on the control plane against a real database (SQLite and PostgreSQL): reports through
the real ingestion path into the drift store, bad reports refused by reason without moving an
aggregate, rules raising one retraining trigger per cooldown, the signed webhook at a real HTTP
receiver (replays detectable), and the REST API with its roles."""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import orjson
import pytest
from alembic import command
from sqlalchemy import inspect
from sqlalchemy.engine import Connection

from mcp_edge.controlplane.app import DRIFT
from mcp_edge.controlplane.db import Database
from mcp_edge.controlplane.db import audit as audit_q
from mcp_edge.controlplane.db import drift as drift_q
from mcp_edge.controlplane.db import registry as registry_q
from mcp_edge.controlplane.db import telemetry as telemetry_q
from mcp_edge.controlplane.db.drift import TriggerView
from mcp_edge.controlplane.db.migrate import (
    alembic_config,
    head_revision,
    schema_differences,
    upgrade_head,
)
from mcp_edge.controlplane.drift.admin import DriftAdmin
from mcp_edge.controlplane.drift.sample import decode_drift
from mcp_edge.controlplane.settings import PasswordCost, Settings
from mcp_edge.controlplane.webhooks import verify_signature
from mcp_edge.shared.bundle.baseline import compute_baseline
from mcp_edge.shared.bundle.manifest import DriftBaseline
from mcp_edge.shared.drift import Binner
from tests.support.controlplane import ControlPlane, FakeClock, start_control_plane
from tests.support.drift import (
    SECRET,
    DriftFleet,
    Receiver,
    drift_fleet,
    running_receiver,
    secret_file,
    window,
)

DRIFT_TABLES = {"drift_reports", "drift_aggregates", "drift_rules", "retraining_triggers"}
DEVICES = ["cam-1", "cam-2", "cam-3"]
RULE = {"threshold": 0.2, "min_devices": 2, "min_samples": 300, "sustained": 2,
        "cooldown_s": 600, "window_s": 60}  # fmt: skip


def _shape(conn: Connection) -> tuple[set[str], list[str]]:
    inspector = inspect(conn)
    return set(inspector.get_table_names()), [
        c["name"] for c in inspector.get_columns("model_versions")
    ]


async def test_migration_0008_upgrades_matches_models_and_downgrades(database_url: str) -> None:
    db = Database(database_url)
    try:
        assert await upgrade_head(db) == head_revision()
        assert await schema_differences(db) == []
        async with db.engine.begin() as conn:
            await conn.run_sync(lambda c: command.downgrade(alembic_config(c), "0007_rollouts"))
        async with db.engine.connect() as conn:
            tables, columns = await conn.run_sync(_shape)
        assert not (DRIFT_TABLES | {"hard_examples"}) & tables
        assert "drift_baseline" not in columns
        assert await upgrade_head(db) == head_revision()
        async with db.engine.connect() as conn:
            tables, columns = await conn.run_sync(_shape)
        assert DRIFT_TABLES | {"hard_examples"} <= tables
        assert "drift_baseline" in columns
        assert await schema_differences(db) == []
    finally:
        await db.dispose()


# ---------------------------------------------------------------------------- the fleet
@pytest.fixture(scope="module")
def baseline() -> DriftBaseline:
    rng = np.random.default_rng(11)
    data = rng.normal(size=(5000, 8))
    return compute_baseline("x", data, output_name="p", scores=_scores(data), bins=8)


def _scores(data: Any) -> Any:
    logits = np.stack([data[:, 0], data[:, 1], -data[:, 0], -data[:, 1]], axis=1) * 2.0
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


class Traffic:
    """Device windows binned with the agent's own binner from drawn samples."""

    def __init__(self, baseline: DriftBaseline, seed: int = 0) -> None:
        self.binner = Binner(baseline)
        self.rng = np.random.default_rng(seed)

    def report(self, clock: FakeClock, device: str, *, shift: float = 0.0,
               n: int = 200, **kwargs: Any) -> dict[str, Any]:  # fmt: skip
        data = self.rng.normal(size=(n, 8)) + shift
        self.binner.add(data, _scores(data))
        samples, features, classes, confidence = self.binner.take()
        return window(device, clock(), samples, features, classes, confidence, **kwargs)


@pytest.fixture
async def fleet(database_url: str, baseline: DriftBaseline) -> AsyncIterator[DriftFleet]:
    async with drift_fleet(database_url, baseline, DEVICES, clock=FakeClock()) as f:
        yield f


async def _set_rule(fleet: DriftFleet, **changes: Any) -> None:
    await DriftAdmin(fleet.db, fleet.clock).set_rule(fleet.model, changes, actor="user:t")


async def test_reports_through_ingestion_are_stored_and_summed_into_one_bucket(
    fleet: DriftFleet, baseline: DriftBaseline
) -> None:
    traffic = Traffic(baseline)
    reports = [traffic.report(fleet.clock, d) for d in DEVICES]
    for device, report in zip(DEVICES, reports, strict=True):
        fleet.send(device, report)
    assert await fleet.flush() == 3

    (bucket,) = await fleet.buckets()
    assert (bucket.reports, bucket.devices, bucket.samples) == (3, 3, 600)
    summed: dict[str, list[int]] = {}
    for r in reports:
        for f in r["features"]:
            summed[f["name"]] = [a + b for a, b in
                                 zip(summed.get(f["name"], [0] * len(f["counts"])), f["counts"],
                                     strict=True)]  # fmt: skip
    assert bucket.counts["features"] == summed
    assert bucket.score is not None and bucket.score < 0.1 and not bucket.over
    assert bucket.figures["top_features"] and len(bucket.figures["features"]) == 8
    stored = await DriftAdmin(fleet.db, fleet.clock).reports("cam-2")
    assert len(stored) == 1 and stored[0].samples == 200 and stored[0].input_psi is not None
    assert fleet.metrics.registry.get_sample_value("mcp_cp_drift_reports_total") == 3


async def test_bad_reports_are_refused_by_reason_and_never_move_an_aggregate(
    fleet: DriftFleet, baseline: DriftBaseline
) -> None:
    traffic = Traffic(baseline, seed=1)
    for device in DEVICES:
        fleet.send(device, traffic.report(fleet.clock, device))
    await fleet.flush()
    async with fleet.db.transaction() as tx:  # a second version, published, nobody runs it
        await registry_q.insert_version(
            tx, model=fleet.model, version="1.1.0", version_numeric=1_001_000,
            target_path="digits/1.1.0.mcpb", sha256="1" * 64, length=1, format="onnx",
            profiles=[], variants=[], publisher_keyid="0" * 64, uploaded_by="t",
            now=fleet.clock(), drift_baseline=baseline.model_dump(mode="json"),
        )  # fmt: skip
    before = await fleet.buckets()

    good = traffic.report(fleet.clock, "cam-1")
    bins = copy.deepcopy(good)
    bins["features"][0]["counts"] = [*bins["features"][0]["counts"], 0]
    bins["features"][0]["counts"][0] += 0  # same sum, one bin too many
    negative = copy.deepcopy(good)
    negative["features"][1]["counts"][0] = -1
    negative["features"][1]["counts"][1] += 1
    unknown_feature = copy.deepcopy(good)
    unknown_feature["features"][2]["name"] = "sample_mean"
    future = {**good, "window_end": good["window_end"] + 7200, "ts": good["ts"] + 7200}
    nan = orjson.dumps(good).replace(b'"window_start":', b'"window_start":NaN,"x":', 1)
    huge = orjson.dumps({**good, "padding": "x" * (300 * 1024)})
    cases: list[tuple[str, str, Any]] = [
        ("bins", "cam-1", bins),
        ("schema", "cam-1", negative),
        ("unknown_feature", "cam-1", unknown_feature),
        ("window", "cam-1", future),
        ("malformed_json", "cam-1", nan),
        ("too_large", "cam-1", huge),
        (
            "version_not_running",
            "cam-2",
            {**traffic.report(fleet.clock, "cam-2"), "version": "1.1.0"},
        ),
        ("unknown_version", "cam-2", {**traffic.report(fleet.clock, "cam-2"), "version": "9.0.0"}),
        ("device_mismatch", "cam-3", good),
        ("unknown_device", "cam-9", {**good, "device_id": "cam-9"}),
    ]
    for _, device, report in cases:
        fleet.send(device, report)
    await fleet.flush()

    for reason, _, _ in cases:
        assert fleet.refused(reason) == 1, reason
    assert await fleet.buckets() == before
    stored = await DriftAdmin(fleet.db, fleet.clock).reports("cam-1")
    assert len(stored) == 1


async def test_a_flood_from_one_device_is_cut_at_its_rate(
    database_url: str, baseline: DriftBaseline
) -> None:
    clock = FakeClock()
    async with drift_fleet(database_url, baseline, DEVICES, clock=clock,
                           max_reports_per_minute=5) as fleet:  # fmt: skip
        traffic = Traffic(baseline, seed=2)
        for _ in range(12):
            fleet.send("cam-1", traffic.report(fleet.clock, "cam-1", n=20))
        fleet.send("cam-2", traffic.report(fleet.clock, "cam-2", n=20))
        await fleet.flush()
        (bucket,) = await fleet.buckets()
        assert fleet.refused("flood") == 7
        assert (bucket.reports, bucket.samples) == (6, 120)
        clock.advance(seconds=60)  # the rate refills: the device is heard again
        fleet.send("cam-1", traffic.report(fleet.clock, "cam-1", n=20))
        await fleet.flush()
        assert fleet.refused("flood") == 7


async def test_a_version_the_device_reports_running_is_accepted_without_a_desired_entry(
    fleet: DriftFleet, baseline: DriftBaseline
) -> None:
    async with fleet.db.transaction() as tx:
        await telemetry_q.upsert_reported(tx, [{
            "device_id": "cam-3", "ts": fleet.clock(), "received_at": fleet.clock(),
            "applied_seq": 1,
            "document": {"models": [{"name": fleet.model, "active_version": "1.0.0",
                                     "canary_version": "1.2.0"}]},
        }])  # fmt: skip
        await registry_q.insert_version(
            tx, model=fleet.model, version="1.2.0", version_numeric=1_002_000,
            target_path="digits/1.2.0.mcpb", sha256="2" * 64, length=1, format="onnx",
            profiles=[], variants=[], publisher_keyid="0" * 64, uploaded_by="t",
            now=fleet.clock(), drift_baseline=baseline.model_dump(mode="json"),
        )  # fmt: skip
    traffic = Traffic(baseline, seed=3)
    fleet.send(
        "cam-3", {**traffic.report(fleet.clock, "cam-3"), "version": "1.2.0", "role": "canary"}
    )
    fleet.send(
        "cam-2", {**traffic.report(fleet.clock, "cam-2"), "version": "1.2.0", "role": "canary"}
    )
    await fleet.flush()
    (bucket,) = await fleet.buckets()
    assert (bucket.version, bucket.reports) == ("1.2.0", 1)
    assert fleet.refused("version_not_running") == 1


# ---------------------------------------------------------------------------- triggers
@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    async with running_receiver(FakeClock()) as r:
        yield r


async def test_sustained_drift_raises_one_trigger_per_cooldown_and_a_signed_webhook(
    database_url: str, baseline: DriftBaseline, receiver: Receiver, tmp_path: Path
) -> None:
    clock = receiver.clock
    async with drift_fleet(
        database_url,
        baseline,
        DEVICES,
        clock=clock,
        webhook_url=receiver.url,
        secret=secret_file(tmp_path),
    ) as fleet:
        await _set_rule(fleet, **RULE)
        seen: list[TriggerView] = []

        async def callback(trigger: TriggerView) -> None:
            seen.append(trigger)

        fleet.drift.on_trigger.append(callback)
        traffic = Traffic(baseline, seed=4)
        raised_in: list[int] = []
        for minute in range(14):  # 14 buckets of 60 s, every device shifted
            for device in DEVICES:
                fleet.send(device, traffic.report(fleet.clock, device, shift=1.5))
            await fleet.flush()
            if len(await fleet.triggers()) > len(raised_in):
                raised_in.append(minute)
            clock.advance(seconds=60)
        # Over from the first bucket; sustained 2: raised at the second; cooldown 600 s: again
        # ten buckets later, never in between.
        assert raised_in == [1, 11]
        assert fleet.triggers_counted() == 2
        assert [t.id for t in seen] == sorted(t.id for t in await fleet.triggers())
        first = seen[0]
        assert (first.model, first.version, first.status) == ("digits", "1.0.0", "open")
        assert first.device_count == 3 and first.device_ids == DEVICES
        assert first.rule["sustained"] == 2 and first.rule["source"] == "model"
        assert first.figures["value"] > 0.2 and first.figures["top_features"]
        async with fleet.db.read() as tx:
            entries = await audit_q.list_entries(tx, limit=100)
        assert [e.action for e in entries].count("drift.trigger_raised") == 2

        assert await fleet.deliver() == 2
        accepted = receiver.accepted()
        assert len(accepted) == 2
        body = accepted[0].document
        assert body["type"] == "retraining.triggered"
        data = body["data"]
        assert data["trigger_id"] == first.id and data["model"] == "digits"
        assert data["version"] == "1.0.0" and data["device_ids"] == DEVICES
        assert data["url"] == f"/api/v1/drift/triggers/{first.id}"
        assert data["figures"]["value"] == first.figures["value"]
        assert data["rule"]["threshold"] == 0.2

        # A replay of a delivery: the same id again is refused; later, its timestamp is stale.
        async with aiohttp.ClientSession() as http:
            replay = accepted[0]
            async with http.post(receiver.url, data=replay.body,
                                 headers={k: v for k, v in replay.headers.items()
                                          if k.startswith("X-MCP")}) as answer:  # fmt: skip
                assert answer.status == 409
        assert receiver.deliveries[-1].verdict == "replay"
        header = replay.headers["X-MCP-Signature"]
        assert verify_signature(SECRET, header, replay.body, clock())
        assert not verify_signature(SECRET, header, replay.body, clock() + timedelta(seconds=301))
        assert not verify_signature(SECRET, header, replay.body.replace(b"digits", b"digitz"),
                                    clock())  # fmt: skip


async def test_too_few_devices_or_samples_hold_a_trigger_back(
    fleet: DriftFleet, baseline: DriftBaseline
) -> None:
    await _set_rule(fleet, **RULE)
    traffic = Traffic(baseline, seed=5)
    for _ in range(4):  # one device drifting: below min_devices
        fleet.send("cam-1", traffic.report(fleet.clock, "cam-1", shift=2.0, n=400))
        await fleet.flush()
        fleet.clock.advance(seconds=60)
    for _ in range(4):  # two devices, 100 samples: below min_samples
        for device in DEVICES[:2]:
            fleet.send(device, traffic.report(fleet.clock, device, shift=2.0, n=50))
        await fleet.flush()
        fleet.clock.advance(seconds=60)
    buckets = await fleet.buckets()
    assert len(buckets) == 8 and all(b.score and b.score > 0.2 for b in buckets)
    assert not any(b.over for b in buckets)
    assert await fleet.triggers() == []


async def test_a_rule_whose_window_changes_judges_new_buckets_of_its_own_length(
    fleet: DriftFleet, baseline: DriftBaseline
) -> None:
    """Buckets are a start and a length: after the window shrinks from 300 s to 10 s, the
    10 s bucket that starts at the same instant as the running 300 s one is a bucket of its
    own, scored and judged by the rule (it used to be added to the 300 s row and never seen)."""
    await _set_rule(fleet, **{**RULE, "window_s": 300, "sustained": 1})
    start = fleet.clock().timestamp()
    fleet.clock.advance(seconds=300 - start % 300 + 2)  # 2 s into a 300 s (and 10 s) bucket
    traffic = Traffic(baseline, seed=6)
    for device in DEVICES:  # undrifted traffic opens the 300 s bucket
        fleet.send(device, traffic.report(fleet.clock, device))
    await fleet.flush()
    assert await fleet.triggers() == []
    (opened,) = await fleet.buckets()
    assert opened.bucket_s == 300 and not opened.over

    await _set_rule(fleet, **{**RULE, "window_s": 10, "sustained": 1})
    fleet.clock.advance(seconds=3)  # same 10 s bucket start as the 300 s one
    for device in DEVICES:
        fleet.send(device, traffic.report(fleet.clock, device, shift=1.5, n=400))
    await fleet.flush()
    buckets = {b.bucket_s: b for b in await fleet.buckets()}
    assert set(buckets) == {10, 300}
    assert buckets[10].bucket_start == buckets[300].bucket_start
    assert buckets[10].over and buckets[300].samples == opened.samples
    (trigger,) = await fleet.triggers()
    assert trigger.rule["window_s"] == 10


# ---------------------------------------------------------------------------- REST
@pytest.fixture
async def cp(database_url: str, tmp_path: Path) -> AsyncIterator[ControlPlane]:
    settings = Settings(data_dir=tmp_path / "cp", database_url=database_url,
                        password_cost=PasswordCost.MIN)  # fmt: skip
    plane = await start_control_plane(settings, FakeClock())
    yield plane
    await plane.client.close()


async def test_rules_triggers_and_figures_over_rest_with_roles(
    cp: ControlPlane, baseline: DriftBaseline
) -> None:
    viewer = await cp.user_token("vera", "viewer")
    operator = await cp.user_token("otto", "operator")
    status, rule = await cp.call("GET", "/api/v1/drift/rules/digits", token=viewer)
    assert status == 200 and rule["source"] == "builtin" and rule["threshold"] == 0.2
    status, _ = await cp.call("PUT", "/api/v1/drift/rules/digits", token=viewer,
                              body={"threshold": 0.3})  # fmt: skip
    assert status == 403
    status, rule = await cp.call(
        "PUT",
        "/api/v1/drift/default-rule",
        token=operator,
        body={"sustained": 1, "min_devices": 1, "window_s": 60},
    )
    assert status == 200 and rule["model"] == "*" and rule["source"] == "default"
    status, rule = await cp.call("GET", "/api/v1/drift/rules/digits", token=viewer)
    assert (rule["source"], rule["sustained"], rule["updated_by"]) == ("default", 1, "user:otto")
    status, rule = await cp.call(
        "PUT",
        "/api/v1/drift/rules/digits",
        token=operator,
        body={"threshold": 0.25, "metric": "input_psi"},
    )
    assert (status, rule["source"], rule["threshold"], rule["sustained"]) == (
        200, "model", 0.25, 1)  # fmt: skip
    status, listed = await cp.call("GET", "/api/v1/drift/rules", token=viewer)
    assert [r["model"] for r in listed["items"]] == ["*", "digits"]
    status, _ = await cp.call("PUT", "/api/v1/drift/rules/digits", token=operator,
                              body={"sustained": 0})  # fmt: skip
    assert status == 400

    # Reports straight into the app's drift store; one bucket over the rule: a trigger.
    drift = cp.client.app[DRIFT]
    async with drift.db.transaction() as tx:
        await drift_q.seed_fleet(tx, device_ids=DEVICES, model="digits", version="1.0.0",
                           version_numeric=1_000_000, baseline=baseline.model_dump(mode="json"),
                           now=cp.clock())  # fmt: skip
    traffic = Traffic(baseline, seed=6)
    samples = [decode_drift(orjson.dumps(traffic.report(cp.clock, d, shift=2.0)), d,
                            cp.clock().timestamp()) for d in DEVICES]  # fmt: skip
    result = await drift.store(samples)
    assert result.stored == 3 and len(result.triggers) == 1
    trigger_id = result.triggers[0].id

    status, figures = await cp.call("GET", "/api/v1/drift", token=viewer,
                                    params={"model": "digits"})  # fmt: skip
    assert status == 200 and len(figures["buckets"]) == 1
    bucket = figures["buckets"][0]
    assert bucket["devices"] == 3 and bucket["over"] and bucket["features"]["f0"] > 0.2
    status, mine = await cp.call(
        "GET", "/api/v1/drift", token=viewer, params={"model": "digits", "device": "cam-2"}
    )
    assert status == 200 and figures["reports"] == [] and len(mine["reports"]) == 1
    status, listed = await cp.call("GET", "/api/v1/drift/triggers", token=viewer,
                                   params={"status": "open"})  # fmt: skip
    assert [t["id"] for t in listed["items"]] == [trigger_id]
    status, _ = await cp.call("POST", f"/api/v1/drift/triggers/{trigger_id}/acknowledge",
                              token=viewer, body={"note": "x"})  # fmt: skip
    assert status == 403
    status, acked = await cp.call(
        "POST",
        f"/api/v1/drift/triggers/{trigger_id}/acknowledge",
        token=operator,
        body={"note": "retraining on line-a data"},
    )
    assert status == 200
    trigger = acked["trigger"]
    assert (trigger["status"], trigger["acknowledged_by"], trigger["note"]) == (
        "acknowledged", "user:otto", "retraining on line-a data")  # fmt: skip
    status, shown = await cp.call("GET", f"/api/v1/drift/triggers/{trigger_id}", token=viewer)
    assert status == 200 and shown["trigger"]["status"] == "acknowledged"
    status, _ = await cp.call("GET", "/api/v1/drift/triggers/999", token=viewer)
    assert status == 404
    status, rule = await cp.call("DELETE", "/api/v1/drift/rules/digits", token=operator)
    assert status == 200 and rule["source"] == "default"
    status, _ = await cp.call("DELETE", "/api/v1/drift/rules/digits", token=operator)
    assert status == 404
