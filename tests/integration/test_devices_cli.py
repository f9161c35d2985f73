"""``mcp-controlplane devices list|show|events|health`` as an operator uses them, against a
real served control plane: the models each device runs and whether they are in sync, one
device in text and as JSON, its flight recorder, its latest health and inference figures.

Devices enroll over HTTP and models are deployed with the CLI; what devices report (state,
events, health, inference statistics) reaches the served control plane's database through the
query modules ingestion writes with."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from mcp_edge.controlplane.cli import main
from mcp_edge.controlplane.db import Database, registry
from mcp_edge.controlplane.db import telemetry as telemetry_q
from mcp_edge.controlplane.settings import Settings, load_settings
from mcp_edge.shared.signing import PrivateKey
from tests.support.controlplane import FakeClock, FakeProvisioner, envelope, served

PASSWORD = "admin-password-1"


@dataclass
class Plane:
    url: str
    token: str
    settings: Settings
    clock: FakeClock

    def cli(self, *args: str, ok: bool = True) -> Result:
        env = {"MCP_SERVER": self.url, "MCP_TOKEN": self.token}
        result = CliRunner(env=env).invoke(main, list(args), catch_exceptions=False)
        assert (result.exit_code == 0) == ok, result.output
        return result

    def enroll(self, device_id: str, **kwargs: Any) -> None:
        token = self.cli("tokens", "create").stdout.strip().splitlines()[-1]
        body = envelope(PrivateKey.generate(), token, now=self.clock(), device_id=device_id,
                        **kwargs)  # fmt: skip
        request = urllib.request.Request(
            self.url + "/api/v1/enroll", data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(request, timeout=10) as response:
            assert json.loads(response.read())["status"] == "accepted"

    def write(self, **rows: list[dict[str, Any]]) -> None:
        """Store rows as ingestion does: ``reported``, ``events``, ``health``, ``inference``,
        and published ``versions`` (``{"model", "version"}``)."""

        async def work() -> None:
            db = Database(self.settings.effective_database_url)
            try:
                async with db.transaction() as tx:
                    for i, v in enumerate(rows.get("versions", [])):
                        await registry.insert_version(
                            tx, model=v["model"], version=v["version"], version_numeric=i + 1,
                            target_path=f"{v['model']}/{v['version']}.mcpb", sha256="0" * 64,
                            length=1, format="onnx", profiles=[], variants=[],
                            publisher_keyid="", uploaded_by="", now=self.clock(),
                        )  # fmt: skip
                    await telemetry_q.upsert_reported(tx, rows.get("reported", []))
                    await telemetry_q.insert_events(tx, rows.get("events", []))
                    await telemetry_q.insert_health(tx, rows.get("health", []))
                    await telemetry_q.insert_inference(tx, rows.get("inference", []))
            finally:
                await db.dispose()

        asyncio.run(work())

    def reported(self, device_id: str, seq: int, models: list[dict[str, Any]]) -> dict[str, Any]:
        now = self.clock()
        document = {"device_id": device_id, "applied_seq": seq, "models": models}
        return {"device_id": device_id, "ts": now, "received_at": now, "applied_seq": seq,
                "document": document}  # fmt: skip


@pytest.fixture
def plane(tmp_path: Path) -> Iterator[Plane]:
    data_dir = tmp_path / "cp"
    password_file = tmp_path / "admin.pw"
    password_file.write_text(PASSWORD + "\n")
    result = CliRunner().invoke(
        main,
        ["init", "--data-dir", str(data_dir), "--admin-password-file", str(password_file),
         "--listen", "127.0.0.1:0"],
        catch_exceptions=False,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    token = result.stdout.strip().splitlines()[-1]
    settings = load_settings(data_dir, environ={})
    clock = FakeClock()
    with served(settings, FakeProvisioner(), clock) as url:
        yield Plane(url, token, settings, clock)


def active(model: str, version: str) -> dict[str, Any]:
    return {"name": model, "phase": "active", "active_version": version}


def test_list_and_show_give_each_device_s_models_and_sync_state(plane: Plane) -> None:
    plane.enroll("cam-1", labels={"site": "f1"}, profile="jetson-orin",
                 facts={"arch": "aarch64", "cpu_count": 6})  # fmt: skip
    plane.enroll("cam-2")
    plane.enroll("cam-3")
    plane.write(versions=[{"model": "digits", "version": "1.0.0"},
                          {"model": "digits", "version": "1.1.0"}])  # fmt: skip
    for device in ("cam-1", "cam-2"):
        plane.cli("deploy", "digits", "1.1.0", "--device", device)
    plane.write(reported=[plane.reported("cam-1", 1, [active("digits", "1.1.0")]),
                          plane.reported("cam-2", 1, [active("digits", "1.0.0")])])  # fmt: skip

    lines = plane.cli("devices", "list").stdout.splitlines()
    assert lines[0].split()[:2] == ["ID", "STATUS"] and "IN SYNC" in lines[0]
    rows = {line.split()[0]: line for line in lines[1:]}
    assert "digits=1.1.0 " in rows["cam-1"] and " yes " in rows["cam-1"]
    assert "digits=1.0.0 (wants 1.1.0)" in rows["cam-2"] and " no " in rows["cam-2"]
    assert rows["cam-3"].split()[-4:-2] == ["-", "-"]  # no models, nothing to be in sync with
    out = plane.cli("devices", "list", "--not-in-sync").stdout.splitlines()
    assert [line.split()[0] for line in out[1:]] == ["cam-2"]
    out = plane.cli("devices", "list", "--in-sync", "--model", "digits").stdout.splitlines()
    assert [line.split()[0] for line in out[1:]] == ["cam-1"]
    listed = json.loads(plane.cli("devices", "list", "-q", "m-2", "--json").stdout)
    (item,) = listed["items"]
    assert item["id"] == "cam-2" and item["in_sync"] is False
    assert item["models"] == [{"model": "digits", "desired_version": "1.1.0",
                               "canary_version": None, "reported_version": "1.0.0",
                               "phase": "active", "variant": None, "backend": None,
                               "in_sync": False}]  # fmt: skip

    shown = plane.cli("devices", "show", "cam-1").stdout
    assert shown.splitlines()[0] == "cam-1"
    for fact in ("accepted (offline)", "jetson-orin", "site=f1",
                 "arch=aarch64, cpu_count=6", "all models in sync"):  # fmt: skip
        assert fact in shown, fact
    table = shown.splitlines()[-2:]
    assert table[0].split() == ["MODEL", "DESIRED", "CANARY", "REPORTED", "VARIANT", "BACKEND",
                                "PHASE", "IN", "SYNC"]  # fmt: skip
    assert table[1].split() == ["digits", "1.1.0", "-", "1.1.0", "-", "-", "active", "yes"]
    document = json.loads(plane.cli("devices", "show", "cam-2", "--json").stdout)
    assert document["id"] == "cam-2" and document["facts"]["os"] == "linux"
    assert document["in_sync"] is False and document["models"][0]["reported_version"] == "1.0.0"
    assert "no models" in plane.cli("devices", "show", "cam-3").stdout

    missing = plane.cli("devices", "show", "ghost", ok=False)
    assert missing.exit_code == 1 and "no device 'ghost' (HTTP 404)" in missing.output


def test_events_is_the_flight_recorder(plane: Plane) -> None:
    plane.enroll("cam-1")
    now = plane.clock()
    steps = [
        ("downloading", "progress", 524288, 1048576, 120.0, None, ""),
        ("downloading", "ok", 1048576, 1048576, 2500.0, None, ""),
        ("verifying", "error", None, None, 14.0, "hash_mismatch", "sha256 mismatch"),
    ]
    plane.write(events=[{
        "device_id": "cam-1", "event_seq": seq, "ts": now + timedelta(seconds=seq),
        "received_at": now, "model": "digits", "version": "1.0.0", "phase": phase,
        "outcome": outcome, "message": message, "cause": cause, "bytes_done": done,
        "bytes_total": total, "elapsed_ms": took,
    } for seq, (phase, outcome, done, total, took, cause, message)
        in enumerate(steps, 1)])  # fmt: skip

    lines = plane.cli("devices", "events", "cam-1").stdout.splitlines()
    assert lines[0].split()[:3] == ["SEQ", "TIME", "MODEL"]
    assert [line.split()[0] for line in lines[1:]] == ["1", "2", "3"]  # oldest first
    assert "512.0 KiB/1.0 MiB" in lines[1] and "120 ms" in lines[1]
    assert "2.5 s" in lines[2]
    assert "hash_mismatch" in lines[3] and "sha256 mismatch" in lines[3]
    newest = plane.cli("devices", "events", "cam-1", "--limit", "2").stdout.splitlines()
    assert [line.split()[0] for line in newest[1:]] == ["2", "3"]
    events = json.loads(plane.cli("devices", "events", "cam-1", "--json", "--limit", "1").stdout)
    assert [(e["event_seq"], e["cause"]) for e in events] == [(3, "hash_mismatch")]

    plane.enroll("cam-2")
    quiet = plane.cli("devices", "events", "cam-2")
    assert quiet.stdout == "" and "no deployment events yet" in quiet.stderr
    assert "(HTTP 404)" in plane.cli("devices", "events", "ghost", ok=False).output
    assert plane.cli("devices", "events", "cam-1", "--limit", "0", ok=False).exit_code == 2


def test_health_gives_the_latest_reading_and_inference_figures(plane: Plane) -> None:
    plane.enroll("cam-1")
    now = plane.clock()
    plane.write(
        health=[{
            "device_id": "cam-1", "ts": now - timedelta(minutes=m), "cpu_percent": 30.0 + m,
            "load_1m": 0.75, "mem_used_mb": 900.0, "mem_total_mb": 4096.0,
            "disk_free_mb": 5000.0, "disk_total_mb": 16000.0, "process_rss_mb": 81.0,
            "uptime_s": 7200.0, "temperatures_c": {"soc": 51.5},
            "gpu": {"util_percent": 40.0, "power_mw": 7500.0},
        } for m in (5, 1)],
        inference=[{
            "device_id": "cam-1", "ts": now - timedelta(minutes=m), "window_s": 30.0,
            "model": "digits", "version": "1.0.0", "count": 100, "errors": 2, "rejections": 0,
            "p50_ms": 2.0, "p95_ms": 6.5, "p99_ms": 9.0, "queue_depth": 0, "role": "stable",
        } for m in (1, 2, 120)],
    )  # fmt: skip
    out = plane.cli("devices", "health", "cam-1").stdout
    assert "cam-1: health at" in out
    for figure in ("31 %, load 0.75", "900 of 4096 MB used", "5000 of 16000 MB free", "81 MB",
                   "2.0 h", "soc 51.5 °C", "40 %, power 7.5 W"):  # fmt: skip
        assert figure in out, figure
    row = out.splitlines()[-1].split()
    assert row == ["digits", "1.0.0", "stable", "200", "4", "2.00", "%", "6.5", "ms"]
    wider = plane.cli("devices", "health", "cam-1", "--window", "3h").stdout
    assert wider.splitlines()[-1].split()[3] == "300"
    document = json.loads(plane.cli("devices", "health", "cam-1", "--json").stdout)
    assert document["health"]["cpu_percent"] == 31.0
    assert document["inference"]["items"][0]["error_rate"] == 0.02

    plane.enroll("cam-2")
    quiet = plane.cli("devices", "health", "cam-2").stdout
    assert "no health reading stored" in quiet and "no inference statistics since" in quiet
    assert json.loads(plane.cli("devices", "health", "cam-2", "--json").stdout)["health"] is None
    assert plane.cli("devices", "health", "cam-1", "--window", "soon", ok=False).exit_code == 2
    refused = plane.cli("devices", "health", "cam-1", "--window", "10s", ok=False)
    assert "window_s" in refused.output and "(HTTP 400)" in refused.output
