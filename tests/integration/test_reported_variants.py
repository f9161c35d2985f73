"""Which bundle variant and backend each device runs: the agent reports the variant its active
version was installed as and the ``backend/provider`` it is loaded on; the control plane keeps
them per reported model (``device_reported_models``, migration 0010 fills them from the stored
states) and shows them in the REST API, its OpenAPI document, ``mcp-controlplane devices
list|show`` and the console's device pages.

The agent is real (signed TUF repository on disk, real bundle with an ``x86_64`` variant, real
onnxruntime); its reported state goes through the wire codec the control plane's ingestion
decodes with, on SQLite and PostgreSQL; the CLI talks HTTP to the served control plane.
"""

from __future__ import annotations

import asyncio
import shutil
import typing
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from click.testing import CliRunner, Result
from sqlalchemy import Table, insert, inspect, select

from mcp_edge.agent.runtime.manager import ModelManager
from mcp_edge.agent.serving.serve import runner_factory
from mcp_edge.agent.update.transport_file import FileRepoTransport
from mcp_edge.agent.update.updater import UpdateAgent
from mcp_edge.controlplane.api.common import SERVICES
from mcp_edge.controlplane.cli import main
from mcp_edge.controlplane.db import Database, registry, upgrade_head
from mcp_edge.controlplane.db import devices as device_q
from mcp_edge.controlplane.db import telemetry as telemetry_q
from mcp_edge.controlplane.db.migrate import alembic_config, head_revision, schema_differences
from mcp_edge.controlplane.db.models import ReportedModelRow, ReportedStateRow
from mcp_edge.shared.bundle import build_bundle, sign_bundle
from mcp_edge.shared.bundle.build import VariantSource
from mcp_edge.shared.protocol.codec import decode
from mcp_edge.shared.protocol.reports import encode_report
from mcp_edge.shared.protocol.state import DesiredModel, ReportedState
from mcp_edge.shared.signing import PrivateKey
from mcp_edge.tooling.models import DigitsModels
from tests.support.console import ConsolePlane, console_plane
from tests.support.controlplane import ControlPlane
from tests.support.tuf import DEVICE, SignedRepo, update_profile

ONNX_CPU = "onnxruntime/CPUExecutionProvider"


async def no_sleep(_: float) -> None:
    return None


async def installed_agent(tmp: Path, digits: DigitsModels) -> tuple[ReportedState, ReportedState]:
    """Install and serve digits 1.0.0 from a bundle whose ``x86_64`` variant the generic x86_64
    profile prefers; return the reported state of that agent, and of a second agent on the same
    state directory before it loads anything (both decoded as the control plane decodes them).
    """
    repo = SignedRepo.create(tmp / "cp")
    variant_file = tmp / "x86_64.onnx"
    shutil.copyfile(digits.onnx_path, variant_file)
    bundle = tmp / "digits-1.0.0.mcpb"
    build_bundle(digits.onnx_path, bundle, name="digits", version="1.0.0",
                 variants={"x86_64": VariantSource(variant_file)})  # fmt: skip
    sign_bundle(bundle, repo.publisher)
    ref = repo.publish(bundle, "digits", "1.0.0")
    profile = update_profile()
    states = []
    for serve in (True, False):
        manager = ModelManager(runner_factory(profile, workers=1, threads=1, backend=None))
        agent = UpdateAgent(
            tmp / "state", DEVICE, profile, manager, FileRepoTransport(repo.directory),
            [repo.repo.director_key()], tuf_root=repo.root_bytes(), sleep=no_sleep,
        )  # fmt: skip
        try:
            if serve:
                await agent.resume()
                await agent.handle_desired(repo.desired(1, [DesiredModel(name="digits",
                                                                         stable=ref)]))  # fmt: skip
                loaded = manager.get("digits").info
                assert f"{loaded.backend}/{loaded.provider}" == ONNX_CPU
            states.append(decode(encode_report(agent.reported_state()), ReportedState))
        finally:
            await manager.close()
    return states[0], states[1]


async def test_the_agent_reports_the_variant_installed_and_the_backend_loaded(
    tmp_path: Path, digits: DigitsModels
) -> None:
    serving, not_loaded = await installed_agent(tmp_path, digits)
    (model,) = serving.models
    assert (model.name, model.active_version) == ("digits", "1.0.0")
    assert (model.active_variant, model.active_backend) == ("x86_64", ONNX_CPU)
    install = (tmp_path / "state" / "models" / "digits" / "1.0.0" / "install.json").read_text()
    assert '"variant": "x86_64"' in install
    # installed but not loaded (yet): the variant is known, the backend is not
    (model,) = not_loaded.models
    assert (model.active_version, model.active_variant, model.active_backend) == (
        "1.0.0", "x86_64", None,
    )  # fmt: skip


# ---------------------------------------------------------------------------- control plane
@pytest.fixture
async def plane(database_url: str, tmp_path: Path) -> AsyncIterator[ConsolePlane]:
    async with console_plane(database_url, tmp_path / "plane") as p:
        yield p


def db_of(cp: ControlPlane) -> Database:
    db: Database = cp.client.app[SERVICES].db
    return db


async def enroll(cp: ControlPlane, device_id: str) -> None:
    token = await cp.new_token()
    status, answer = await cp.enroll(PrivateKey.generate(), token["token"], device_id=device_id)
    assert status == 200 and answer["status"] == "accepted", answer


async def report(cp: ControlPlane, device_id: str, document: dict[str, Any]) -> None:
    """Store ``document`` as ``device_id``'s reported state, as ingestion does."""
    async with db_of(cp).transaction() as tx:
        await telemetry_q.upsert_reported(tx, [{
            "device_id": device_id, "ts": cp.clock(), "received_at": cp.clock(),
            "applied_seq": document["applied_seq"], "document": document,
        }])  # fmt: skip


def status(version: str, variant: str | None, backend: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {"name": "digits", "phase": "active", "active_version": version}
    if variant is not None:
        out["active_variant"] = variant
    if backend is not None:
        out["active_backend"] = backend
    return out


async def cli(cp: ControlPlane, *args: str) -> Result:
    """``mcp-controlplane ARGS`` against the served control plane, over HTTP (in a thread, so
    the test server on this loop answers)."""
    env = {"MCP_SERVER": str(cp.client.make_url("")).rstrip("/"), "MCP_TOKEN": cp.admin_token}
    result = await asyncio.to_thread(
        CliRunner(env=env).invoke, main, list(args), catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    return result


def section(text: str, start: str) -> str:
    return text[text.index(start) :]


async def test_variants_and_backends_are_stored_and_shown_everywhere(
    plane: ConsolePlane, tmp_path: Path, digits: DigitsModels
) -> None:
    cp, admin = plane.cp, plane.admin
    for device_id in (DEVICE, "cam-2", "cam-3"):
        await enroll(cp, device_id)
    async with db_of(cp).transaction() as tx:
        await registry.insert_version(
            tx, model="digits", version="1.0.0", version_numeric=1,
            target_path="digits/1.0.0.mcpb", sha256="0" * 64, length=1, format="onnx",
            profiles=[], variants=[], publisher_keyid="", uploaded_by="", now=cp.clock(),
        )  # fmt: skip
    for device_id in (DEVICE, "cam-2"):
        code, answer = await cp.call("POST", "/api/v1/deployments", body={
            "model": "digits", "version": "1.0.0", "selector": {"device_id": device_id},
        })  # fmt: skip
        assert code == 201, answer
    serving, _ = await installed_agent(tmp_path / "agent", digits)
    await report(cp, DEVICE, serving.model_dump(mode="json"))
    await report(cp, "cam-2", {"device_id": "cam-2", "applied_seq": 1,
                               "models": [status("1.0.0", "int8", "openvino/CPU")]})  # fmt: skip
    await report(cp, "cam-3", {"device_id": "cam-3", "applied_seq": 0,
                               "models": [status("1.0.0", None, None)]})  # fmt: skip

    async with db_of(cp).read() as tx:
        r = ReportedModelRow
        stored = (await tx.execute(select(r.device_id, r.variant, r.backend))).all()
    assert sorted(tuple(row) for row in stored) == [
        ("cam-2", "int8", "openvino/CPU"), ("cam-3", None, None), (DEVICE, "x86_64", ONNX_CPU),
    ]  # fmt: skip

    # REST: the list's models and a device's models
    code, listed = await cp.call("GET", "/api/v1/devices")
    assert code == 200, listed
    runs = {d["id"]: [(m["model"], m["reported_version"], m["variant"], m["backend"])
                      for m in d["models"]] for d in listed["items"]}  # fmt: skip
    assert runs == {
        DEVICE: [("digits", "1.0.0", "x86_64", ONNX_CPU)],
        "cam-2": [("digits", "1.0.0", "int8", "openvino/CPU")],
        "cam-3": [("digits", "1.0.0", None, None)],
    }
    code, device = await cp.call("GET", "/api/v1/devices/cam-2")
    assert code == 200 and device["in_sync"] is True, device
    assert (device["models"][0]["variant"], device["models"][0]["backend"]) == (
        "int8", "openvino/CPU",
    )  # fmt: skip
    code, document = await cp.call("GET", "/api/v1/openapi.json")
    assert code == 200
    fields = document["components"]["schemas"]["ModelSyncOut"]["properties"]
    for name, longest in (("variant", 64), ("backend", 128)):
        assert {"type": "string", "maxLength": longest} in fields[name]["anyOf"], fields[name]
        assert "null: not reported" in fields[name]["description"]

    # CLI
    lines = (await cli(cp, "devices", "list")).stdout.splitlines()
    rows = {line.split()[0]: line for line in lines[1:]}
    assert "digits=1.0.0 (x86_64) " in rows[DEVICE] and "digits=1.0.0 (int8) " in rows["cam-2"]
    assert "digits=1.0.0 (not desired) " in rows["cam-3"]
    table = (await cli(cp, "devices", "show", "cam-2")).stdout.splitlines()[-2:]
    assert table[0].split()[3:6] == ["REPORTED", "VARIANT", "BACKEND"]
    assert table[1].split() == ["digits", "1.0.0", "-", "1.0.0", "int8", "openvino/CPU",
                                "active", "yes"]  # fmt: skip
    table = (await cli(cp, "devices", "show", "cam-3")).stdout.splitlines()[-2:]
    assert table[1].split()[1:7] == ["(not", "desired)", "-", "1.0.0", "-", "-"]

    # console: a device's models table, and the variant next to the version in the list
    page = await admin.get("/ui/devices/cam-2")
    assert page.status == 200
    models = section(page.text, 'id="device-models"')
    models = models[: models.index("</table>")]
    assert '<th scope="col">Variant</th><th scope="col">Backend</th>' in models
    assert "<td><code>int8</code></td>" in models
    assert "<td><code>openvino/CPU</code></td>" in models
    page = await admin.get(f"/ui/devices/{DEVICE}")
    assert f"<td><code>{ONNX_CPU}</code></td>" in section(page.text, 'id="device-models"')
    listing = (await admin.get("/ui/devices")).text
    cam2 = section(listing, '<tr data-device="cam-2">')
    cam2 = cam2[: cam2.index("</tr>")]
    assert '1.0.0 <span class="badge variant" title="bundle variant">int8</span>' in cam2
    cam3 = section(listing, '<tr data-device="cam-3">')
    assert "badge variant" not in cam3[: cam3.index("</tr>")]

    # a new report replaces what the rows say
    await report(cp, "cam-2", {"device_id": "cam-2", "applied_seq": 1,
                               "models": [status("1.0.0", "default", ONNX_CPU)]})  # fmt: skip
    code, device = await cp.call("GET", "/api/v1/devices/cam-2")
    assert (device["models"][0]["variant"], device["models"][0]["backend"]) == (
        "default", ONNX_CPU,
    )  # fmt: skip
    async with db_of(cp).read() as tx:
        r = ReportedModelRow
        row = (await tx.execute(select(r.variant, r.backend).where(r.device_id == "cam-2"))).one()
    assert tuple(row) == ("default", ONNX_CPU)


async def test_migration_0010_fills_variants_from_states_stored_before_it(
    database_url: str,
) -> None:
    """Reported states stored at 0009 give their models' variant and backend to the rows 0010
    adds them to (text too long or not text counts as none); the downgrade drops the columns
    and keeps the rows."""
    db = Database(database_url)
    now = datetime(2030, 1, 1, tzinfo=timezone.utc)
    documents: dict[str, Any] = {
        "cam-1": {
            "models": [
                status("1.0.0", "int8", "openvino/CPU"),
                {"name": "b", "active_version": "2.0.0"},
                status("1.1.0", "fp16", "onnxruntime/CUDAExecutionProvider"),  # the last one wins
            ]
        },
        "cam-2": {
            "models": [
                {"name": "b", "active_variant": "v" * 65, "active_backend": "b" * 129},
                {"name": "c", "active_variant": 7, "active_backend": ["x"]},
                {"name": "d", "active_variant": "", "active_backend": "tflite/cpu"},
            ]
        },
        "cam-3": {"models": "digits"},
    }
    expected = [
        ("cam-1", "b", None, None), ("cam-1", "digits", "fp16", "onnxruntime/CUDAExecutionProvider"),
        ("cam-2", "b", None, None), ("cam-2", "c", None, None), ("cam-2", "d", None, "tflite/cpu"),
    ]  # fmt: skip
    r = ReportedModelRow
    try:
        assert await upgrade_head(db, "0009_reported_models") == "0009_reported_models"
        async with db.transaction() as tx:
            for i, device_id in enumerate(documents):
                await device_q.insert_device(
                    tx, device_id=device_id, public_key=f"{i:064x}", status="accepted", now=now
                )
            await tx.execute(insert(typing.cast(Table, ReportedStateRow.__table__)), [
                {"device_id": d, "ts": now, "received_at": now, "applied_seq": 0, "document": doc}
                for d, doc in documents.items()
            ])  # fmt: skip
            await tx.execute(insert(typing.cast(Table, r.__table__)), [
                {"device_id": row["device_id"], "model": row["model"],
                 "active_version": row["active_version"]}
                for d, doc in documents.items() for row in device_q.reported_model_rows(d, doc)
            ])  # fmt: skip
        assert await upgrade_head(db) == head_revision()
        assert await schema_differences(db) == []
        async with db.read() as tx:
            stored = (await tx.execute(select(r.device_id, r.model, r.variant, r.backend))).all()
        assert sorted(tuple(row) for row in stored) == sorted(
            (row["device_id"], row["model"], row["variant"], row["backend"])
            for d, doc in documents.items() for row in device_q.reported_model_rows(d, doc)
        ) == expected  # fmt: skip
        async with db.read() as tx:
            shown = await device_q.model_sync(tx, ["cam-1"])
        assert [(m.model, m.variant, m.backend) for m in shown["cam-1"]] == [
            ("b", None, None), ("digits", "fp16", "onnxruntime/CUDAExecutionProvider"),
        ]  # fmt: skip

        async with db.engine.begin() as conn:
            await conn.run_sync(
                lambda c: command.downgrade(alembic_config(c), "0009_reported_models")
            )
        async with db.engine.connect() as conn:
            columns = await conn.run_sync(
                lambda c: [col["name"] for col in inspect(c).get_columns("device_reported_models")]
            )
            kept = (await conn.execute(select(r.device_id, r.model, r.active_version))).all()
        assert sorted(columns) == ["active_version", "device_id", "model"]
        assert len(kept) == len(expected) and ("cam-1", "digits", "1.1.0") in kept
        assert await upgrade_head(db) == head_revision()
        assert await schema_differences(db) == []
        async with db.read() as tx:
            stored = (await tx.execute(select(r.device_id, r.model, r.variant, r.backend))).all()
        assert sorted(tuple(row) for row in stored) == expected
    finally:
        await db.dispose()
