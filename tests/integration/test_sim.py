"""The fleet simulator against a real control plane and a real Mosquitto (dynamic security).

Twenty simulated devices enroll with the control plane (each its own key; an operator token
makes the enrollment token for their group), run in one ``mcp-sim run`` process and come
online in the control plane's device list. A plain deployment of the digits model makes every
one of them fetch the signed bundle over MQTT and report it active; a version the behaviour
file says fails to load gives each a failed ``loading`` event and a rollback, and 1.0.0 keeps
serving. Inference statistics (at the interval of the desired state's telemetry policy) reach
the control plane's store with the per-version counts the rollout gates read.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import urllib.request
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from tuf.api.metadata import Metadata, Root

from mcp_edge.agent.update.machine import Cause, UpdateError
from mcp_edge.controlplane.db import Database
from mcp_edge.controlplane.db.telemetry import version_stats
from mcp_edge.controlplane.settings import SQLITE_FILE
from mcp_edge.shared.protocol.codec import decode
from mcp_edge.shared.protocol.reports import encode_report
from mcp_edge.shared.protocol.telemetry import ModelInferenceStats
from mcp_edge.tooling.models import DigitsModels
from mcp_edge.tooling.mosquitto import DynsecMosquittoBroker
from mcp_edge.tooling.processes import (
    init_control_plane,
    process_env,
    serve_control_plane,
    stopped_at_exit,
    wait_until,
)
from mcp_edge.tooling.sim.config import BehaviourError, behaviour_from, load_behaviour
from mcp_edge.tooling.sim.fleet import (
    DEVICES_FILE,
    DeviceRecord,
    FleetError,
    Trust,
    append_devices,
    load_fleet,
    save_fleet_header,
)
from mcp_edge.tooling.sim.harness import SimProcess, active_count, api, publish_model, sim_enroll
from mcp_edge.tooling.sim.repository import SharedVerdicts, TargetInfo
from mcp_edge.tooling.sim.traffic import Serving, Traffic

pytestmark = pytest.mark.timeout(240)

DEVICES = 20
GROUP = "sim-line"
BEHAVIOUR = """
[defaults]
request_rate = 20.0
error_rate = 0.1

[[version]]
model = "digits"
version = "1.1.0"
fail_load = true
"""


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[str]]]:
    with stopped_at_exit() as procs:
        yield procs


def _devices(cp: str, token: str, query: str) -> dict[str, Any]:
    status, body = api(cp, token, "GET", f"/api/v1/devices?group={GROUP}&limit=1000{query}")
    assert status == 200, body
    return dict(body)


def _events(cp: str, token: str, device: str) -> list[dict[str, Any]]:
    status, body = api(cp, token, "GET", f"/api/v1/devices/{device}/events?limit=500")
    assert status == 200, body
    return list(body["items"])


def _deploy(cp: str, token: str, version: str) -> None:
    body = {"model": "digits", "version": version, "selector": {"group": GROUP}}
    status, answer = api(cp, token, "POST", "/api/v1/deployments", body)
    assert status == 201, answer
    assert len(answer["devices"]) == DEVICES, answer


@pytest.mark.mosquitto
def test_simulated_fleet_enrolls_deploys_fails_a_load_and_reports_statistics(
    fresh_dynsec_broker: DynsecMosquittoBroker,
    digits: DigitsModels,
    tmp_path: Path,
    processes: list[subprocess.Popen[str]],
) -> None:
    data = tmp_path / "cp"
    token = init_control_plane(data, fresh_dynsec_broker)
    env = {**process_env(), "MCP_INFERENCE_INTERVAL_S": "1"}
    with (tmp_path / "cp.log").open("wb") as cp_log:
        _, cp = serve_control_plane(data, processes, env=env, stderr=cp_log.fileno())
    bundles = publish_model(cp, token, digits.onnx_path, "digits", ["1.0.0", "1.1.0"], tmp_path)

    fleet = tmp_path / "fleet"
    out = sim_enroll(cp, token, DEVICES, fleet, "--group", GROUP, timeout_s=120)
    assert f"holds {DEVICES}" in out, out
    assert _devices(cp, token, "")["total"] == DEVICES
    (tmp_path / "behaviour.toml").write_text(BEHAVIOUR)
    sim = SimProcess(fleet, tmp_path / "status.json", "--behaviour",
                     str(tmp_path / "behaviour.toml"), "--summary-interval", "2",
                     log=tmp_path / "sim.log")  # fmt: skip
    try:
        wait_until(lambda: _devices(cp, token, "&status=online")["total"] == DEVICES,
                   "every simulated device online in the control plane's list", 60)  # fmt: skip

        # A plain deployment: each device fetches the bundle over MQTT and reports it active.
        _deploy(cp, token, "1.0.0")
        status = sim.wait_for(lambda s: active_count(s, "digits", "1.0.0") == DEVICES,
                              "every device reporting 1.0.0 active", 60)  # fmt: skip
        assert status["counters"].get("deployments_ok") == DEVICES

        def in_sync(device: str) -> bool:
            code, models = api(cp, token, "GET", f"/api/v1/devices/{device}/models")
            return code == 200 and bool(models["items"]) and models["items"][0]["in_sync"]

        ids = [d["id"] for d in _devices(cp, token, "")["items"]]
        wait_until(lambda: all(in_sync(d) for d in ids),
                   "the control plane seeing 1.0.0 in sync on every device", 30)  # fmt: skip
        size = bundles["1.0.0"].stat().st_size
        first = _events(cp, token, ids[0])
        assert [(e["phase"], e["outcome"]) for e in first if e["version"] == "1.0.0"] == [
            ("idle", "progress"), ("downloading", "ok"), ("verifying", "ok"),
            ("installing", "ok"), ("loading", "progress"), ("loading", "ok"), ("warming", "ok"),
            ("active", "ok"),
        ]  # fmt: skip
        downloaded = next(e for e in first if e["phase"] == "downloading")
        assert downloaded["bytes_done"] == downloaded["bytes_total"] == size

        # A version that fails to load: a failed event everywhere, 1.0.0 serves on.
        _deploy(cp, token, "1.1.0")
        sim.wait_for(lambda s: active_count(s, "digits", "1.1.0", "failed") == DEVICES,
                     "every device reporting 1.1.0 failed", 60)  # fmt: skip

        def failed_load(device: str) -> bool:
            return any(e["version"] == "1.1.0" and e["phase"] == "loading"
                       and e["outcome"] == "error" and e["cause"] == "load_failed"
                       for e in _events(cp, token, device))  # fmt: skip

        wait_until(lambda: all(failed_load(d) for d in ids),
                   "a load_failed event of 1.1.0 from every device", 30)  # fmt: skip
        code, models = api(cp, token, "GET", f"/api/v1/devices/{ids[-1]}/models")
        reported = models["items"][0]["reported"]
        assert reported["active_version"] == "1.0.0" and reported["phase"] == "failed"
        assert reported["last_error"].startswith("load_failed")
        assert not models["items"][0]["in_sync"]

        # Inference statistics, every second (the desired state's policy), stored per version.
        since = datetime.now(timezone.utc) - timedelta(minutes=10)

        def stats() -> dict[Any, Any]:
            return asyncio.run(_version_stats(data, ids, since))

        wait_until(lambda: {k[0] for k, v in stats().items() if v.requests > 0} == set(ids),
                   "inference statistics of every device in the control plane", 30)  # fmt: skip
        totals = stats()
        assert {(version, role) for _, version, role in totals} == {("1.0.0", "stable")}
        requests = sum(v.requests for v in totals.values())
        errors = sum(v.errors for v in totals.values())
        assert requests > 0 and 0.02 < errors / requests < 0.3  # 10 % configured
        with urllib.request.urlopen(f"{cp}/metrics", timeout=10) as answer:
            metrics = answer.read().decode()
        assert "mcp_cp_ingest_dropped_total{" not in metrics  # nothing the devices sent refused
    finally:
        code = sim.stop()
    assert code == 0, sim.output()
    wait_until(lambda: _devices(cp, token, "&status=offline")["total"] == DEVICES,
               "every device offline after the simulator stopped", 30)  # fmt: skip
    saved = json.loads((fleet / "runtime.json").read_bytes())
    assert saved["clean"] is True
    assert {d["models"]["digits"]["active"] for d in saved["devices"].values()} == {"1.0.0"}
    assert os.stat(fleet / "devices.jsonl").st_mode & 0o077 == 0


async def _version_stats(data: Path, ids: list[str], since: datetime) -> dict[Any, Any]:
    db = Database(f"sqlite:///{(data / SQLITE_FILE).resolve()}")
    try:
        async with db.read() as tx:
            return await version_stats(tx, ids, "digits", since)
    finally:
        await db.dispose()


# ------------------------------------------------------------------------------- pure parts
def test_behaviour_file_refuses_unknown_keys_and_values_out_of_range(tmp_path: Path) -> None:
    good = tmp_path / "good.toml"
    good.write_text(BEHAVIOUR + "\n[fleet]\nchurn_percent_per_minute = 5\n")
    behaviour = load_behaviour(good)
    assert behaviour.of("digits", "1.1.0").fail_load
    assert behaviour.of("digits", "1.1.0").error_rate == 0.1  # from [defaults]
    assert not behaviour.of("digits", "1.0.0").fail_load
    assert behaviour.fleet.churn_percent_per_minute == 5.0
    for text, named in [
        ("[defaults]\nerror_rat = 0.1\n", "error_rat"),
        ("[defaults]\nerror_rate = 1.5\n", "error_rate"),
        ("[[version]]\nmodel = 'm'\nversion = '1.0.0'\nfail_load = 'yes'\n", "fail_load"),
        ("[fleet]\nconnect_rate = 0\n", "connect_rate"),
        ("[defaults\n", "not TOML"),
    ]:
        bad = tmp_path / "bad.toml"
        bad.write_text(text)
        with pytest.raises(BehaviourError, match=named):
            load_behaviour(bad)


def test_drawn_statistics_pass_the_control_planes_schema_for_every_role() -> None:
    behaviour = behaviour_from({
        "defaults": {"request_rate": 50.0, "error_rate": 0.1},
        "version": [{"model": "digits", "version": "2.0.0", "latency_factor": 4.0,
                     "agreement": 0.5}],
    })  # fmt: skip
    traffic = Traffic(behaviour, seed=1)
    serving = [
        Serving("digits", "1.0.0", canary="2.0.0", canary_weight=0.25),
        Serving("digits", "1.0.0", shadow="2.0.0"),
    ]
    for s in serving:
        reports = traffic.window([s], 100.0)
        checked = [decode(encode_report(r), ModelInferenceStats) for r in reports]
        roles = {m.role.value: m for m in checked}
        assert set(roles) == {"stable", "canary" if s.canary else "shadow"}
        stable = roles["stable"]
        assert 0.08 < stable.errors / stable.count < 0.12
        assert stable.latency is not None
        candidate = roles.get("canary") or roles["shadow"]
        assert candidate.latency is not None
        assert candidate.latency.p50_ms == pytest.approx(4 * stable.latency.p50_ms)
        if s.canary:
            share = candidate.count / (candidate.count + stable.count)
            assert 0.2 < share < 0.3
        else:
            assert candidate.count == stable.count  # a copy of each of stable's requests
            assert 0.45 < candidate.shadow_agreed / candidate.shadow_compared < 0.55


async def test_a_device_with_tampered_bundle_bytes_fails_its_hash_check(tmp_path: Path) -> None:
    # Only the bytes' own hash and length are checked before any shared verdict is used.
    root = Metadata(Root(consistent_snapshot=True)).to_bytes()
    verdicts = SharedVerdicts(root, tmp_path / "scratch")
    data = b"bundle bytes" * 100
    info = TargetInfo("digits/1.0.0.mcpb", len(data), {"sha256": hashlib.sha256(data).hexdigest()})
    tampered = bytes([data[0] ^ 1]) + data[1:]
    with pytest.raises(UpdateError) as refused:
        await verdicts.check_bundle(tampered, info, "digits", "1.0.0", ())
    assert refused.value.cause is Cause.HASH_MISMATCH
    with pytest.raises(UpdateError) as short:
        await verdicts.check_bundle(data[:-1], info, "digits", "1.0.0", ())
    assert short.value.cause is Cause.HASH_MISMATCH
    with pytest.raises(UpdateError) as unsigned:  # right bytes, but no publisher to check
        await verdicts.check_bundle(data, info, "digits", "1.0.0", ())
    assert unsigned.value.cause is Cause.PUBLISHER
    assert verdicts.verifications == 1


def test_state_directory_refuses_malformed_and_open_files(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet"
    trust = Trust(tuf_root=b'{"signed": {}}', director_keys=("ab" * 32,))
    save_fleet_header(fleet, "http://cp", trust)
    record = DeviceRecord("sim-00000", "cd" * 32, ("mqtt://127.0.0.1:1883",), "dev-sim-00000",
                          "secret", "sim-00000")  # fmt: skip
    assert append_devices(fleet, [record]) == 1
    assert load_fleet(fleet).devices == (record,)
    with (fleet / DEVICES_FILE).open("a") as f:
        f.write('{"id": "../etc", "key": "00"}\n')
    with pytest.raises(FleetError, match=r"devices.jsonl:2"):
        load_fleet(fleet)
    (fleet / DEVICES_FILE).write_text(json.dumps(record.as_json()) + "\n")
    (fleet / DEVICES_FILE).chmod(0o644)
    with pytest.raises(FleetError, match="readable by others"):
        load_fleet(fleet)
    with pytest.raises(FleetError, match="no simulated fleet"):
        load_fleet(tmp_path / "elsewhere")
