"""The console's devices pages as an operator meets them, over HTTP, on SQLite and PostgreSQL:
the list (filters, sorting, paging, models in sync or not), a device's page (facts, models,
health, the flight recorder, drift), label edits and revokes (audited, and the same as the
API's), and what a viewer, a forged form and a hostile label get.

Devices enroll through the API; deployments are made through the API; what devices report
(state, health, inference statistics, deployment events, drift reports) is written through the
query modules ingestion writes with, on the served control plane's own database.
"""

from __future__ import annotations

import html
import random
import re
import typing
from collections.abc import AsyncIterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from sqlalchemy import Table, insert, inspect, select

from mcp_edge.controlplane.api.common import SERVICES
from mcp_edge.controlplane.db import Database, registry, upgrade_head
from mcp_edge.controlplane.db import devices as device_q
from mcp_edge.controlplane.db import drift as drift_q
from mcp_edge.controlplane.db import telemetry as telemetry_q
from mcp_edge.controlplane.db.devices import DeviceFilter
from mcp_edge.controlplane.db.migrate import alembic_config, head_revision, schema_differences
from mcp_edge.controlplane.db.models import ReportedModelRow, ReportedStateRow
from mcp_edge.shared.signing import PrivateKey
from tests.support.console import ConsolePlane, console_plane, user_console
from tests.support.controlplane import ControlPlane

ROW = re.compile(r'<tr data-device="([^"]+)">')
HOSTILE = "<script>alert(1)</script>"


@pytest.fixture
async def plane(database_url: str, tmp_path: Path) -> AsyncIterator[ConsolePlane]:
    async with console_plane(database_url, tmp_path / "cp") as p:
        yield p


def db_of(cp: ControlPlane) -> Database:
    db: Database = cp.client.app[SERVICES].db
    return db


async def api(cp: ControlPlane, path: str, **params: str) -> Any:
    """The admin's GET of ``path``, which must answer 200."""
    status, answer = await cp.call("GET", path, params=params or None)
    assert status == 200, answer
    return answer


def rows(text: str) -> list[str]:
    return ROW.findall(text)


async def enroll(
    cp: ControlPlane, device_id: str, *, labels: dict[str, str] | None = None,
    profile: str = "generic-x86_64", facts: dict[str, Any] | None = None,
) -> None:  # fmt: skip
    token = await cp.new_token(labels=labels or {})
    status, answer = await cp.enroll(
        PrivateKey.generate(), token["token"], device_id=device_id, profile=profile, facts=facts
    )
    assert status == 200 and answer["status"] == "accepted", answer


async def publish(cp: ControlPlane, model: str, *versions: str) -> None:
    async with db_of(cp).transaction() as tx:
        for i, version in enumerate(versions):
            await registry.insert_version(
                tx, model=model, version=version, version_numeric=i + 1,
                target_path=f"{model}/{version}.mcpb", sha256="0" * 64, length=1,
                format="onnx", profiles=[], variants=[], publisher_keyid="", uploaded_by="",
                now=cp.clock(),
            )  # fmt: skip


async def deploy(cp: ControlPlane, model: str, version: str, device_id: str) -> None:
    status, answer = await cp.call(
        "POST", "/api/v1/deployments",
        body={"model": model, "version": version, "selector": {"device_id": device_id}},
    )  # fmt: skip
    assert status == 201, answer


async def report(
    cp: ControlPlane, device_id: str, models: list[dict[str, Any]], applied_seq: int | None = None
) -> None:
    """Store ``device_id``'s reported state (applying its newest desired state by default)."""
    async with db_of(cp).transaction() as tx:
        if applied_seq is None:
            desired = await cp.call("GET", f"/api/v1/devices/{device_id}/desired")
            applied_seq = desired[1]["seq"] if desired[0] == 200 else 0
        await telemetry_q.upsert_reported(tx, [{
            "device_id": device_id, "ts": cp.clock(), "received_at": cp.clock(),
            "applied_seq": applied_seq,
            "document": {"device_id": device_id, "applied_seq": applied_seq, "models": models},
        }])  # fmt: skip


def active(model: str, version: str) -> dict[str, Any]:
    return {"name": model, "phase": "active", "active_version": version}


# ---------------------------------------------------------------------------- the list
async def test_list_filters_sorts_and_pages(plane: ConsolePlane) -> None:
    cp, admin = plane.cp, plane.admin
    empty = await admin.get("/ui/devices")
    assert empty.status == 200 and "No devices yet" in empty.text and "tokens create" in empty.text
    await publish(cp, "digits", "1.0.0", "1.1.0")
    for i in range(7):
        await enroll(cp, f"cam-{i}", labels={"site": "f1" if i < 4 else "f2"},
                     profile="rpi5" if i % 2 else "generic-x86_64")  # fmt: skip
        cp.clock.advance(seconds=1)
    for i in range(3):
        await deploy(cp, "digits", "1.1.0", f"cam-{i}")
    await report(cp, "cam-0", [active("digits", "1.1.0")])  # in sync
    await report(cp, "cam-1", [active("digits", "1.0.0")])  # an older version
    # cam-2: told, nothing reported; cam-3: reports a model it was not told to run
    await report(cp, "cam-3", [active("digits", "1.0.0")], applied_seq=0)
    status, _ = await cp.call("POST", "/api/v1/devices/cam-6/revoke", body={"reason": "lost"})
    assert status == 200

    page = await admin.get("/ui/devices")
    assert page.status == 200 and 'aria-current="page">Devices' in page.text
    assert rows(page.text) == [f"cam-{i}" for i in range(7)]
    assert "1–7 of 7" in page.text and 'id="devices"' in page.text
    assert '<a href="/ui/devices/cam-0">cam-0</a>' in page.text
    assert '<link rel="stylesheet" href="/ui/static/devices.css">' in page.text
    for choice in ("generic-x86_64", "rpi5", "digits"):  # the filters offer what exists
        assert f'<option value="{choice}">{choice}</option>' in page.text, choice
    assert '<option value="rpi5" selected>' in (await admin.get("/ui/devices?profile=rpi5")).text
    async with cp.client.get("/ui/static/devices.css") as r:
        assert r.status == 200 and r.content_type == "text/css"

    async def shown(query: str) -> list[str]:
        answer = await admin.get("/ui/devices?" + query)
        assert answer.status == 200, answer.text
        return rows(answer.text)

    assert await shown("sync=out") == ["cam-1", "cam-2", "cam-3"]
    assert await shown("sync=in") == ["cam-0", "cam-4", "cam-5", "cam-6"]
    assert await shown("status=revoked") == ["cam-6"]
    assert await shown("status=accepted&profile=rpi5") == ["cam-1", "cam-3", "cam-5"]
    assert await shown("label=site%3Df2") == ["cam-4", "cam-5", "cam-6"]
    assert await shown("label=site%3Df2&label=site") == ["cam-4", "cam-5", "cam-6"]
    assert await shown("q=m-1") == ["cam-1"]
    assert await shown("model=digits") == ["cam-0", "cam-1", "cam-2", "cam-3"]
    assert await shown("model=digits&sync=out&profile=rpi5") == ["cam-1", "cam-3"]
    assert await shown("sort=-id") == [f"cam-{i}" for i in reversed(range(7))]
    assert (await shown("sort=status"))[-1] == "cam-6"
    assert (await shown("sort=-profile"))[:3] == ["cam-1", "cam-3", "cam-5"]
    assert await shown("sort=last_seen&status=revoked") == ["cam-6"]
    assert await shown("group=&profile=&q=&sync=&model=&label=") == [f"cam-{i}" for i in range(7)]

    text = (await admin.get("/ui/devices?q=cam-1")).text
    assert "digits</code>" in text and "1.1.0 <span" in text and "runs</span> 1.0.0" in text
    assert "not in sync" in text
    text = (await admin.get("/ui/devices?q=cam-3")).text
    assert "not desired" in text

    nothing = await admin.get("/ui/devices?q=nobody")
    assert "No device matches these filters" in nothing.text and rows(nothing.text) == []
    for bad, message in (("label=Bad%20Key", "label filter"), ("status=sleeping", "status"),
                         ("sync=maybe", "sync filter"), ("sort=colour", "cannot sort"),
                         ("page=0", "page")):  # fmt: skip
        refused = await admin.get("/ui/devices?" + bad)
        assert refused.status == 400 and message in refused.text, bad
        assert 'id="filter-error"' in refused.text and rows(refused.text) == []


async def test_paging_keeps_the_filters(plane: ConsolePlane) -> None:
    cp, admin = plane.cp, plane.admin
    async with db_of(cp).transaction() as tx:
        for i in range(120):
            await device_q.insert_device(
                tx, device_id=f"d-{i:03d}", public_key=f"{i:064x}", status="accepted",
                now=cp.clock(), labels={"site": "x" if i % 2 else "y"},
            )  # fmt: skip
    first = await admin.get("/ui/devices")
    assert rows(first.text) == [f"d-{i:03d}" for i in range(50)]
    assert "1–50 of 120" in first.text and "page 1 of 3" in first.text
    assert 'href="?page=2" rel="next"' in first.text and 'rel="last"' in first.text
    last = await admin.get("/ui/devices?page=3")
    assert rows(last.text) == [f"d-{i:03d}" for i in range(100, 120)]
    assert "101–120 of 120" in last.text and 'rel="next"' not in last.text
    past = await admin.get("/ui/devices?page=9")
    assert rows(past.text) == rows(last.text)
    filtered = await admin.get("/ui/devices?label=site%3Dx&sort=-id&page=2")
    assert rows(filtered.text) == [f"d-{i:03d}" for i in range(19, 0, -2)]
    assert "51–60 of 60" in filtered.text
    assert 'href="?label=site%3Dx&amp;sort=-id" rel="first"' in filtered.text
    assert 'href="?label=site%3Dx&amp;sort=-id&amp;page=1" rel="prev"' in filtered.text


async def test_the_sync_filter_agrees_with_each_device_s_models(plane: ConsolePlane) -> None:
    """Random desired and reported states: the database's in-sync filter picks exactly the
    devices whose models (as the device page and the API show them) are all in sync."""
    cp = plane.cp
    rng = random.Random(7)
    now = cp.clock()
    await publish(cp, "a", "1.0.0", "2.0.0")
    await publish(cp, "b", "1.0.0", "2.0.0")
    ids = [f"r-{i:02d}" for i in range(40)]
    async with db_of(cp).transaction() as tx:
        for i, device_id in enumerate(ids):
            await device_q.insert_device(
                tx, device_id=device_id, public_key=f"{i:064x}", status="accepted", now=now
            )
    for device_id in ids:
        told = [m for m in ("a", "b") if rng.random() < 0.6]
        for model in told:
            await deploy(cp, model, "2.0.0", device_id)
        if rng.random() < 0.2:
            continue  # never reported
        reported = [
            {"name": m, "phase": "active", "active_version": rng.choice(("1.0.0", "2.0.0"))}
            for m in ("a", "b") if (m in told) != (rng.random() < 0.15)
        ]  # fmt: skip
        status, desired = await cp.call("GET", f"/api/v1/devices/{device_id}/desired")
        seq = desired["seq"] if status == 200 else 0
        await report(cp, device_id, reported, applied_seq=max(0, seq - (rng.random() < 0.2)))
    async with db_of(cp).transaction() as tx:  # documents no agent sends: read as no models
        await device_q.insert_device(tx, device_id="odd-1", public_key="e" * 64,
                                     status="accepted", now=now)  # fmt: skip
        await device_q.insert_device(tx, device_id="odd-2", public_key="f" * 64,
                                     status="accepted", now=now)  # fmt: skip
        await telemetry_q.upsert_reported(tx, [
            {"device_id": "odd-1", "ts": now, "received_at": now, "applied_seq": 0,
             "document": {"models": {"name": "a", "active_version": "1.0.0"}}},
            {"device_id": "odd-2", "ts": now, "received_at": now, "applied_seq": 0,
             "document": {"models": [1, "a", None, [], {"phase": "active"}]}},
        ])  # fmt: skip
    ids += ["odd-1", "odd-2"]
    async with db_of(cp).read() as tx:
        synced, total = await device_q.list_devices(
            tx, DeviceFilter(in_sync=True), limit=100, offset=0
        )
        unsynced, _ = await device_q.list_devices(
            tx, DeviceFilter(in_sync=False), limit=100, offset=0
        )
        models = await device_q.model_sync(tx, ids)
    expected = {d for d in ids if all(m.in_sync for m in models[d])}
    assert {d.id for d in synced} == expected and total == len(expected)
    assert {d.id for d in unsynced} == set(ids) - expected
    assert 0 < len(expected) < len(ids) and {"odd-1", "odd-2"} <= expected
    status, answer = await cp.call("GET", "/api/v1/devices", params={"limit": "100"})
    assert status == 200
    assert {d["id"] for d in answer["items"] if d["in_sync"]} == expected
    for item in (i for i in answer["items"] if i["id"].startswith("r-")):  # agrees with /models
        status, view = await cp.call("GET", f"/api/v1/devices/{item['id']}/models")
        assert {m["model"]: m["in_sync"] for m in view["items"]} == {
            m["model"]: m["in_sync"] for m in item["models"]
        }


async def test_a_new_report_replaces_the_models_the_filters_see(plane: ConsolePlane) -> None:
    cp, admin = plane.cp, plane.admin
    await publish(cp, "a", "1.0.0")
    await publish(cp, "b", "1.0.0")
    await enroll(cp, "cam-1")
    await enroll(cp, "cam-2")
    await report(cp, "cam-1", [active("a", "1.0.0")], applied_seq=0)
    await report(cp, "cam-2", [], applied_seq=0)
    assert rows((await admin.get("/ui/devices?model=a")).text) == ["cam-1"]
    assert rows((await admin.get("/ui/devices?sync=out")).text) == ["cam-1"]
    long_name = "c" * (device_q.MODEL_NAME_MAX + 1)
    await report(cp, "cam-1", [active("b", "1.0.0"), {"name": long_name}], applied_seq=0)
    assert rows((await admin.get("/ui/devices?model=a")).text) == []
    assert rows((await admin.get("/ui/devices?model=b")).text) == ["cam-1"]
    await report(cp, "cam-1", [{"name": "b", "active_version": 7}], applied_seq=0)
    async with db_of(cp).read() as tx:
        (model,) = (await device_q.model_sync(tx, ["cam-1"]))["cam-1"]
    assert (model.model, model.reported_version, model.in_sync) == ("b", None, False)
    await report(cp, "cam-1", [], applied_seq=0)  # reports nothing any more: in sync
    assert rows((await admin.get("/ui/devices?sync=in")).text) == ["cam-1", "cam-2"]
    assert rows((await admin.get("/ui/devices?model=b")).text) == []


async def test_migration_0009_lists_the_models_of_states_stored_before_it(
    database_url: str,
) -> None:
    """Reported states stored at 0008 are read into ``device_reported_models`` by 0009, which
    matches the models and downgrades."""
    db = Database(database_url)
    now = datetime(2030, 1, 1, tzinfo=timezone.utc)
    documents: dict[str, Any] = {
        "cam-1": {"models": [active("a", "1.0.0"), active("b", "2.0.0"), active("a", "1.1.0")]},
        "cam-2": {"models": [{"name": "b"}, {"name": 5}, "a", {"name": "x" * 65}]},
        "cam-3": {"models": {"name": "a"}},
    }
    try:
        assert await upgrade_head(db, "0008_drift") == "0008_drift"
        async with db.transaction() as tx:
            for i, device_id in enumerate(documents):
                await device_q.insert_device(
                    tx, device_id=device_id, public_key=f"{i:064x}", status="accepted", now=now
                )
            await tx.execute(insert(typing.cast(Table, ReportedStateRow.__table__)), [
                {"device_id": d, "ts": now, "received_at": now, "applied_seq": 0, "document": doc}
                for d, doc in documents.items()
            ])  # fmt: skip
        assert await upgrade_head(db, "0009_reported_models") == "0009_reported_models"
        columns = (
            ReportedModelRow.device_id,
            ReportedModelRow.model,
            ReportedModelRow.active_version,
        )
        async with db.read() as tx:
            stored = (await tx.execute(select(*columns))).all()
        assert sorted(tuple(r) for r in stored) == sorted(
            (r["device_id"], r["model"], r["active_version"]) for d, doc in documents.items()
            for r in device_q.reported_model_rows(d, doc)
        ) == [("cam-1", "a", "1.1.0"), ("cam-1", "b", "2.0.0"), ("cam-2", "b", None)]  # fmt: skip
        assert await upgrade_head(db) == head_revision()
        assert await schema_differences(db) == []
        async with db.read() as tx:
            with_a, _ = await device_q.list_devices(tx, DeviceFilter(model="a"), limit=10, offset=0)
            synced, _ = await device_q.list_devices(
                tx, DeviceFilter(in_sync=True), limit=10, offset=0
            )
        assert [d.id for d in with_a] == ["cam-1"] and [d.id for d in synced] == ["cam-3"]
        async with db.engine.begin() as conn:
            await conn.run_sync(lambda c: command.downgrade(alembic_config(c), "0008_drift"))
        async with db.engine.connect() as conn:
            tables = await conn.run_sync(lambda c: inspect(c).get_table_names())
        assert "device_reported_models" not in tables and "device_reported" in tables
        assert await upgrade_head(db) == head_revision()
        assert await schema_differences(db) == []
    finally:
        await db.dispose()


# ---------------------------------------------------------------------------- one device
async def test_device_page_shows_facts_models_telemetry_events_and_drift(
    plane: ConsolePlane,
) -> None:
    cp, admin = plane.cp, plane.admin
    await enroll(cp, "cam-1", labels={"site": "f1"}, profile="jetson-orin",
                 facts={"cpu_count": 6, "os": "linux", "arch": "aarch64"})  # fmt: skip
    await publish(cp, "digits", "1.0.0")
    await deploy(cp, "digits", "1.0.0", "cam-1")
    now = cp.clock()
    async with db_of(cp).transaction() as tx:
        await telemetry_q.insert_health(tx, [{
            "device_id": "cam-1", "ts": now - timedelta(minutes=10 - i), "cpu_percent": 20.0 + i,
            "load_1m": 0.5, "mem_used_mb": 900.0, "mem_total_mb": 4096.0, "disk_free_mb": 5000.0,
            "disk_total_mb": 16000.0, "process_rss_mb": 80.0, "uptime_s": 3600.0 + i,
            "temperatures_c": {"soc": 51.5}, "gpu": {"util_percent": 40.0, "power_mw": 7500.0},
        } for i in range(5)])  # fmt: skip
        await telemetry_q.insert_inference(tx, [{
            "device_id": "cam-1", "ts": now - timedelta(minutes=5 - i), "window_s": 30.0,
            "model": "digits", "version": "1.0.0", "count": 100, "errors": i, "rejections": 0,
            "p50_ms": 2.0, "p95_ms": 4.0 + i, "p99_ms": 9.0, "queue_depth": 0,
            "batch_size_avg": None, "batch_fill_ratio": None, "role": "stable",
            "latency_hist": None, "shadow_compared": None, "shadow_agreed": None,
        } for i in range(3)])  # fmt: skip
        await telemetry_q.insert_events(tx, [
            {"device_id": "cam-1", "event_seq": 1, "ts": now, "received_at": now,
             "model": "digits", "version": "1.0.0", "phase": "downloading",
             "outcome": "progress", "message": "", "cause": None, "bytes_done": 524288,
             "bytes_total": 1048576, "elapsed_ms": 250.0},
            {"device_id": "cam-1", "event_seq": 2, "ts": now, "received_at": now,
             "model": "digits", "version": "1.0.0", "phase": "verifying", "outcome": "error",
             "message": "sha256 mismatch", "cause": "hash_mismatch", "bytes_done": None,
             "bytes_total": None, "elapsed_ms": 12.0},
        ])  # fmt: skip
        await drift_q.insert_reports(tx, [(
            "cam-1", "digits", "1.0.0", "stable", now, 0.0, 60.0, 500, 1, 0.31, 0.31, 0.05,
            0.02, {"features": {}, "classes": [], "confidence": []}, 0,
        )])  # fmt: skip
    await report(cp, "cam-1", [{"name": "digits", "phase": "downloading"}])

    page = await admin.get("/ui/devices/cam-1")
    assert page.status == 200
    assert re.search(r"<h1>cam-1</h1>", page.text) and page.text.count("<h1") == 1
    for fact in ("jetson-orin", "aarch64", "6 cores", "0.1.0", "site=f1"):
        assert fact in page.text, fact
    models = page.text[page.text.index('id="device-models"') :]
    assert "<code>digits</code>" in models and "none reported" in models
    assert "downloading" in models and "not in sync" in models
    assert 'href="/ui/drift?model=digits"' in page.text
    for title in ("CPU", "Memory", "Temperature", "GPU", "Power", "Inference p95 latency",
                  "Inference error rate"):  # fmt: skip
        assert f'aria-label="{title}"' in page.text, title
    assert "soc 51.5 °C" in page.text
    events = page.text[page.text.index('id="device-events"') :]
    assert events.index('data-event="2"') < events.index('data-event="1"')  # newest first
    assert "512.0 KiB of 1.0 MiB" in events and "hash_mismatch" in events
    assert "sha256 mismatch" in events and "250 ms" in events
    drift = page.text[page.text.index('id="device-drift"') :]
    assert "0.310" in drift and "500" in drift

    await report(cp, "cam-1", [active("digits", "1.0.0")])
    page = await admin.get("/ui/devices/cam-1")
    assert "The device runs what it was told to run." in page.text
    missing = await admin.get("/ui/devices/nobody")
    assert missing.status == 404 and "no device" in missing.text


async def test_a_device_without_telemetry_says_so(plane: ConsolePlane) -> None:
    await enroll(plane.cp, "quiet-1")
    page = await plane.admin.get("/ui/devices/quiet-1")
    assert page.status == 200
    assert "No health readings stored" in page.text and "No deployment events yet" in page.text
    assert "No models." in page.text and "deploy MODEL VERSION --device quiet-1" in page.text
    assert "Inference p95 latency: no data yet." in page.text


# ---------------------------------------------------------------------------- actions
async def test_label_edit_is_saved_audited_and_validated(plane: ConsolePlane) -> None:
    cp, admin = plane.cp, plane.admin
    await enroll(cp, "cam-1", labels={"site": "f1", "rack": "3"})
    page = await admin.get("/ui/devices/cam-1")
    assert 'id="device-labels"' in page.text and "rack=3\nsite=f1</textarea>" in page.text
    saved = await admin.post("/ui/devices/cam-1/labels", {"labels": "site = f2\n\nenv=prod\n"})
    assert saved.status == 200 and "cam-1: labels saved" in saved.text
    device = await api(cp, "/api/v1/devices/cam-1")
    assert device["labels"] == {"env": "prod", "site": "f2"}
    entries = await api(cp, "/api/v1/audit", action="device.labels_changed")
    (entry,) = entries["items"]
    assert entry["actor"] == "user:admin" and entry["target_id"] == "cam-1"
    assert entry["detail"] == {"set": {"env": "prod", "site": "f2"}, "remove": ["rack"]}
    unchanged = await admin.post("/ui/devices/cam-1/labels", {"labels": "env=prod\nsite=f2"})
    assert "labels unchanged" in unchanged.text

    for text, message in (("Bad Key=1", "label key"), ("justakey", "is not key=value"),
                          ("a=1\na=2", "given twice"), ("v=" + "x" * 129, "128"),
                          ("\n".join(f"k{i}=v" for i in range(33)), "at most 32")):  # fmt: skip
        refused = await admin.post("/ui/devices/cam-1/labels", {"labels": text})
        assert refused.status == 400 and message in html.unescape(refused.text), text
        assert 'id="labels-error"' in refused.text
    device = await api(cp, "/api/v1/devices/cam-1")
    assert device["labels"] == {"env": "prod", "site": "f2"}
    assert (await admin.post("/ui/devices/nobody/labels", {"labels": "a=1"})).status == 404


async def test_revoke_does_what_the_api_does(plane: ConsolePlane) -> None:
    cp, admin = plane.cp, plane.admin
    await enroll(cp, "cam-1")
    page = await admin.get("/ui/devices/cam-1")
    assert 'id="revoke-device"' in page.text and 'data-confirm="Revoke cam-1?' in page.text
    done = await admin.post("/ui/devices/cam-1/revoke", {"reason": "stolen"})
    assert done.status == 200 and "revoked cam-1" in done.text
    device = await api(cp, "/api/v1/devices/cam-1")
    assert device["status"] == "revoked" and device["revoked_at"] and not device["online"]
    assert cp.provisioner.disabled == ["cam-1"]
    entries = await api(cp, "/api/v1/audit", action="device.revoked")
    (entry,) = entries["items"]
    assert entry["actor"] == "user:admin" and entry["detail"] == {"reason": "stolen"}
    assert 'id="revoke-device"' not in done.text and "This device is revoked" in done.text
    again = await admin.post("/ui/devices/cam-1/revoke", {})
    assert "was already revoked" in again.text and cp.provisioner.disabled == ["cam-1"]
    assert (await admin.post("/ui/devices/nobody/revoke", {})).status == 404


async def test_revoke_with_the_broker_down_changes_nothing(plane: ConsolePlane) -> None:
    cp = plane.cp
    await enroll(cp, "cam-1")
    cp.provisioner.fail = True
    refused = await plane.admin.post("/ui/devices/cam-1/revoke", {"reason": "x"})
    assert refused.status == 503 and "broker" in refused.text
    device = await api(cp, "/api/v1/devices/cam-1")
    assert device["status"] == "accepted"


async def test_a_viewer_sees_but_cannot_change(plane: ConsolePlane) -> None:
    cp = plane.cp
    await enroll(cp, "cam-1", labels={"site": "f1"})
    viewer = await user_console(cp, "vera", "viewer")
    try:
        assert rows((await viewer.get("/ui/devices")).text) == ["cam-1"]
        page = await viewer.get("/ui/devices/cam-1")
        assert page.status == 200 and "site=f1" in page.text
        assert 'id="device-labels"' not in page.text and 'id="revoke-device"' not in page.text
        for path, form in (("/ui/devices/cam-1/labels", {"labels": "site=f9"}),
                           ("/ui/devices/cam-1/revoke", {"reason": "x"})):  # fmt: skip
            refused = await viewer.post(path, form)
            assert refused.status == 403 and "operator" in refused.text, path
    finally:
        await viewer.close()
    device = await api(cp, "/api/v1/devices/cam-1")
    assert device["status"] == "accepted" and device["labels"] == {"site": "f1"}


async def test_forms_without_the_csrf_token_are_refused(plane: ConsolePlane) -> None:
    cp, admin = plane.cp, plane.admin
    await enroll(cp, "cam-1")
    await admin.get("/ui/devices/cam-1")
    for path, form in (("/ui/devices/cam-1/labels", {"labels": "a=1"}),
                       ("/ui/devices/cam-1/revoke", {})):  # fmt: skip
        for token in ("", "f" * 64):
            refused = await admin.post(path, form, csrf=token)
            assert refused.status == 403 and "CSRF" in refused.text
    device = await api(cp, "/api/v1/devices/cam-1")
    assert device["status"] == "accepted" and device["labels"] == {}


async def test_hostile_labels_and_names_are_shown_as_text(plane: ConsolePlane) -> None:
    cp, admin = plane.cp, plane.admin
    await enroll(cp, "cam-1", labels={"note": HOSTILE}, facts={"board": HOSTILE})
    await report(cp, "cam-1", [active("x", "1.0.0") | {"phase": HOSTILE}])
    escaped = html.escape(HOSTILE, quote=False)
    for path in ("/ui/devices", "/ui/devices/cam-1", "/ui/devices?label=note%3D" + HOSTILE):
        page = await admin.get(path)
        assert page.status == 200 and HOSTILE not in page.text, path
        assert escaped in page.text or html.escape(HOSTILE) in page.text, path
    saved = await admin.post("/ui/devices/cam-1/labels", {"labels": f"note={HOSTILE}\nx=1"})
    assert saved.status == 200 and HOSTILE not in saved.text


# ---------------------------------------------------------------------------- REST
async def test_the_api_lists_models_and_filters_on_them(plane: ConsolePlane) -> None:
    cp = plane.cp
    await publish(cp, "digits", "1.0.0")
    await enroll(cp, "cam-1")
    await enroll(cp, "cam-2")
    await deploy(cp, "digits", "1.0.0", "cam-1")
    status, answer = await cp.call("GET", "/api/v1/devices", params={"in_sync": "false"})
    assert status == 200 and [d["id"] for d in answer["items"]] == ["cam-1"]
    (item,) = answer["items"]
    assert item["in_sync"] is False and item["models"] == [{
        "model": "digits", "desired_version": "1.0.0", "canary_version": None,
        "reported_version": None, "phase": None, "variant": None, "backend": None,
        "in_sync": False,
    }]  # fmt: skip
    await report(cp, "cam-1", [active("digits", "1.0.0")])
    status, answer = await cp.call("GET", "/api/v1/devices", params={"in_sync": "true"})
    assert [d["id"] for d in answer["items"]] == ["cam-1", "cam-2"]
    status, answer = await cp.call("GET", "/api/v1/devices", params={"model": "digits"})
    assert [d["id"] for d in answer["items"]] == ["cam-1"]
    device = await api(cp, "/api/v1/devices/cam-1")
    assert device["in_sync"] is True and device["models"][0]["reported_version"] == "1.0.0"
    assert (await cp.call("GET", "/api/v1/devices", params={"in_sync": "perhaps"}))[0] == 400


async def test_the_api_gives_a_device_s_inference_figures(plane: ConsolePlane) -> None:
    cp = plane.cp
    await enroll(cp, "cam-1")
    now: datetime = cp.clock()
    async with db_of(cp).transaction() as tx:
        await telemetry_q.insert_inference(tx, [{
            "device_id": "cam-1", "ts": now - timedelta(minutes=m), "window_s": 30.0,
            "model": "digits", "version": "1.0.0", "count": 100, "errors": 5, "rejections": 0,
            "p50_ms": 2.0, "p95_ms": 8.0, "p99_ms": 9.0, "queue_depth": 0, "role": "stable",
        } for m in (1, 2, 90)])  # fmt: skip
    status, answer = await cp.call("GET", "/api/v1/devices/cam-1/inference")
    assert status == 200
    assert answer["items"] == [{"model": "digits", "version": "1.0.0", "role": "stable",
                                "requests": 200, "errors": 10, "error_rate": 0.05,
                                "p95_ms": 8.0}]  # fmt: skip
    status, answer = await cp.call("GET", "/api/v1/devices/cam-1/inference",
                                   params={"window_s": "7200"})  # fmt: skip
    assert answer["items"][0]["requests"] == 300
    assert (await cp.call("GET", "/api/v1/devices/nobody/inference"))[0] == 404
    assert (await cp.call("GET", "/api/v1/devices/cam-1/inference",
                          params={"window_s": "5"}))[0] == 400  # fmt: skip
