"""Two ``mcp-controlplane serve`` replicas on one PostgreSQL, one broker and one shared TUF
repository (``MCP_SHARED_DIR``), with a simulated fleet (``mcp-sim``: every device its own MQTT
session, the agent's TUF fetches over MQTT, health samples every second).

What an operator relies on, checked with real processes:

- the replicas serve one repository: the same signed metadata from either, whichever one a
  version was published through, and neither keeps a repository of its own;
- both do the work: each commits health samples and answers repository requests (the shared
  subscriptions split them);
- the replica holding the rollout is SIGKILLed while stage-one devices download the new
  version's bundle: the other carries the rollout to the end and every device converges;
- nothing the devices' broker acknowledged is lost: once the killed replica is back (same
  data dir, same broker session) every acknowledged health sample is stored.
"""

from __future__ import annotations

import asyncio
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from sqlalchemy import text

from mcp_edge.controlplane.db import Database
from mcp_edge.tooling.mosquitto import DynsecMosquittoBroker
from mcp_edge.tooling.processes import (
    init_control_plane,
    process_env,
    serve_control_plane,
    stopped_at_exit,
    wait_until,
)
from mcp_edge.tooling.sim.harness import SimProcess, active_count, api, publish_model, sim_enroll
from tests.integration.conftest import reset_postgres

pytestmark = [pytest.mark.mosquitto, pytest.mark.postgres, pytest.mark.timeout(600)]

DEVICES = 12
GROUP = "replicas"
MODEL, OLD, NEW = "wide", "1.0.0", "1.1.0"
LEASE_S = 3
WIDTH = 32768  # a 64 x 32768 float32 weight: an 8 MiB bundle, 64 chunks over MQTT per device


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[str]]]:
    with stopped_at_exit() as procs:
        yield procs


@pytest.fixture
def pg_url(postgres_url: str) -> Iterator[str]:
    url = reset_postgres(postgres_url)
    yield url
    reset_postgres(url)


def wide_model(path: Path) -> Path:
    """A valid ONNX model big enough that downloading it takes a while (the simulator never
    runs it; the weight is random so nothing compresses it away)."""
    weight = np.random.default_rng(7).standard_normal((64, WIDTH)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "wide",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", WIDTH])],
        [numpy_helper.from_array(weight, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def metrics(url: str) -> dict[str, float]:
    """The replica's ``/metrics`` as ``{"name{labels}": value}``."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as answer:
        lines = answer.read().decode().splitlines()
    out: dict[str, float] = {}
    for line in lines:
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def fetch(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as answer:
        return bytes(answer.read())


def call(url: str, token: str, method: str, path: str, body: Any = None) -> Any:
    status, answer = api(url, token, method, path, body)
    assert status in (200, 201), (method, path, status, answer)
    return answer


def stored_health(pg_url: str, devices: list[str]) -> int:
    """Distinct health samples (device, time) stored for ``devices``."""

    async def work() -> int:
        db = Database(pg_url)
        try:
            async with db.read() as tx:
                result = await tx.execute(
                    text(
                        "SELECT count(*) FROM (SELECT DISTINCT device_id, ts FROM health_samples"
                        " WHERE device_id = ANY(:ids)) AS s"
                    ),
                    {"ids": devices},
                )
                return int(result.scalar_one())
        finally:
            await db.dispose()

    return asyncio.run(work())


def lease_owner(pg_url: str, rollout_id: str) -> str | None:
    async def work() -> str | None:
        db = Database(pg_url)
        try:
            async with db.read() as tx:
                result = await tx.execute(
                    text("SELECT lease_owner FROM rollouts WHERE id = :id"), {"id": rollout_id}
                )
                value = result.scalar_one_or_none()
                return None if value is None else str(value)
        finally:
            await db.dispose()

    return asyncio.run(work())


def test_two_replicas_share_the_repository_and_the_work_and_lose_nothing_to_a_sigkill(
    fresh_dynsec_broker: DynsecMosquittoBroker,
    pg_url: str,
    tmp_path: Path,
    processes: list[subprocess.Popen[str]],
) -> None:
    shared = tmp_path / "shared"
    env = {
        **process_env(),
        "MCP_SHARED_DIR": str(shared),
        "MCP_ROLLOUT_LEASE_S": str(LEASE_S),
        "MCP_INFERENCE_INTERVAL_S": "1",
    }
    dirs = {"a": tmp_path / "cp-a", "b": tmp_path / "cp-b"}
    token = init_control_plane(dirs["a"], fresh_dynsec_broker, database_url=pg_url, env=env)
    init_control_plane(
        dirs["b"], fresh_dynsec_broker, database_url=pg_url, create_admin=False, env=env
    )
    procs: dict[str, subprocess.Popen[str]] = {}
    urls: dict[str, str] = {}
    for name, data in dirs.items():
        procs[name], urls[name] = serve_control_plane(data, processes, env=env)

    # One repository: in the shared dir only, the same signed metadata from both replicas.
    assert (shared / "repository" / "metadata" / "root.json").is_file()
    assert (shared / "keys" / "timestamp.key").is_file()
    for data in dirs.values():
        assert not (data / "repository").exists() and not (data / "keys").exists()
    model = wide_model(tmp_path / "wide.onnx")
    publish_model(urls["a"], token, model, MODEL, [OLD], tmp_path)
    publish_model(urls["b"], token, model, MODEL, [NEW], tmp_path)
    for name in ("root.json", "timestamp.json"):
        assert fetch(f"{urls['a']}/repo/metadata/{name}") == fetch(
            f"{urls['b']}/repo/metadata/{name}"
        ), name
    for url in urls.values():
        versions = call(url, token, "GET", f"/api/v1/models/{MODEL}")["versions"]
        assert {v["version"] for v in versions} == {OLD, NEW}

    fleet = tmp_path / "fleet"
    out = sim_enroll(urls["b"], token, DEVICES, fleet, "--group", GROUP, timeout_s=180)
    assert f"holds {DEVICES}" in out, out
    devices = [d["id"] for d in call(urls["a"], token, "GET", "/api/v1/devices?limit=100")["items"]]
    assert len(devices) == DEVICES
    sim = SimProcess(
        fleet, tmp_path / "status.json", "--health-interval", "1", "--status-interval", "0.2",
        "--summary-interval", "2", "--seed", "1", log=tmp_path / "sim.log",
    )  # fmt: skip
    try:
        sim.wait_for(lambda s: s["connected"] == DEVICES, "every device connected", 60)
        call(urls["a"], token, "POST", "/api/v1/deployments",
             {"model": MODEL, "version": OLD, "selector": {"group": GROUP}})  # fmt: skip
        sim.wait_for(lambda s: active_count(s, MODEL, OLD) == DEVICES,
                     f"every device reporting {OLD} active", 120)  # fmt: skip

        # Both replicas work: each committed health samples and answered repository requests.
        def both_working() -> bool:
            for url in urls.values():
                m = metrics(url)
                if m.get('mcp_cp_ingest_committed_total{kind="health"}', 0) <= 0:
                    return False
                if m.get('mcp_cp_repo_requests_total{status="ok"}', 0) <= 0:
                    return False
            return True

        wait_until(both_working, "health commits and repository answers from each replica", 30)

        rollout = call(urls["b"], token, "POST", "/api/v1/rollouts", {
            "model": MODEL, "version": NEW, "target": {"devices": devices},
            "stages": [{"count": 4, "bake_s": 0}, {"percent": 100, "bake_s": 0}],
        })["rollout"]  # fmt: skip
        rollout_id = str(rollout["id"])

        # Stage one downloading: kill the replica that holds the rollout, mid-download.
        at_kill = sim.wait_for(lambda s: s["deploying"] > 0,
                               "stage-one devices downloading the new bundle", 60)  # fmt: skip
        owner = lease_owner(pg_url, rollout_id)
        assert owner is not None
        killed = next(n for n, d in dirs.items() if owner.endswith(_replica_id(d)))
        survivor = "b" if killed == "a" else "a"
        procs[killed].kill()
        procs[killed].wait(timeout=30)
        assert at_kill["deploying"] > 0

        sim.wait_for(lambda s: active_count(s, MODEL, NEW) == DEVICES,
                     f"every device reporting {NEW} active after the SIGKILL", 180)  # fmt: skip

        def status() -> str:
            got = call(urls[survivor], token, "GET", f"/api/v1/rollouts/{rollout_id}")
            return str(got["rollout"]["status"])

        wait_until(lambda: status() == "succeeded", "the rollout succeeded", 60)
        items = call(urls[survivor], token, "GET", f"/api/v1/rollouts/{rollout_id}/devices")
        assert sorted(d["device_id"] for d in items["items"]) == sorted(devices)
        assert {d["moves"] for d in items["items"]} == {1}

        # The killed replica comes back on its data dir: its broker session kept its share.
        procs[killed], urls[killed] = serve_control_plane(dirs[killed], processes, env=env)
    finally:
        code = sim.stop()
    assert code == 0, sim.output()
    final = sim.status()
    assert final is not None
    counters = final["counters"]
    acked, sent = int(counters["health_acked"]), int(counters["health_sent"])
    assert acked > 0

    # Nothing lost: every health sample the broker acknowledged is stored (once per sample;
    # one sent but unacknowledged when the fleet stopped may be stored too).
    wait_until(lambda: stored_health(pg_url, devices) >= acked,
               f"all {acked} acknowledged health samples stored", 60)  # fmt: skip
    assert acked <= stored_health(pg_url, devices) <= sent
    for url in urls.values():
        dropped = {k: v for k, v in metrics(url).items() if k.startswith("mcp_cp_ingest_dropped")}
        assert not dropped, dropped


def _replica_id(data: Path) -> str:
    return (data / "replica-id").read_text().strip()
