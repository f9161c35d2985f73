"""``mcp-controlplane deploy --wait`` against a served control plane with a real
dynamic-security Mosquitto: devices enroll, get their own broker accounts, receive the signed
desired state on their topic and send deployment events and their reported state back through
the broker with their own credentials, as agents do; the control plane ingests them and the
CLI (a process of its own, the installed entry point) follows the deployment through the REST
API until each device's outcome is known."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from mcp_edge.shared.protocol import topics
from mcp_edge.shared.protocol.state import DeploymentEvent, ModelStatus, ReportedState
from mcp_edge.tooling.mosquitto import DynsecMosquittoBroker
from mcp_edge.tooling.processes import CONTROLPLANE, REPO, process_env
from tests.integration.conftest import MqttProbe
from tests.integration.test_deployments import Fleet, open_fleet, publish_versions, until

MODEL, VERSION = "digits", "1.0.0"
CLI_DEADLINE_S = 90.0


@pytest.fixture
async def fleet(
    database_url: str, tmp_path: Path, dynsec_broker: DynsecMosquittoBroker
) -> AsyncIterator[Fleet]:
    async with open_fleet(database_url, tmp_path / "cp", dynsec_broker) as f:
        await publish_versions(f.db, f.cp.clock(), MODEL, VERSION)
        yield f


@dataclass
class Device:
    """A device as the broker sees it: its id, its MQTT session and its event counter."""

    fleet: Fleet
    device_id: str
    probe: MqttProbe
    event_seq: int = 0

    async def desired_seq(self) -> int:
        return (await self.fleet.desired(self.probe)).seq

    async def event(self, phase: str, outcome: str, message: str, **extra: object) -> None:
        self.event_seq += 1
        event = DeploymentEvent.model_validate(
            {
                "device_id": self.device_id,
                "event_seq": self.event_seq,
                "ts": time.time(),
                "model": MODEL,
                "version": VERSION,
                "phase": phase,
                "outcome": outcome,
                "message": message,
                **extra,
            }
        )
        code = await self.probe.publish(
            topics.events(self.device_id), event.model_dump_json().encode()
        )
        assert code == "Success"

    async def report(self, seq: int, status: ModelStatus) -> None:
        state = ReportedState(
            device_id=self.device_id,
            ts=time.time(),
            applied_seq=seq,
            profile="generic-x86_64",
            models=[status],
        )
        code = await self.probe.publish(
            topics.reported(self.device_id), state.model_dump_json().encode(), retain=True
        )
        assert code == "Success"

    async def install(self) -> None:
        """Take the desired state and run through a successful update, as an agent reports it."""
        seq = await self.desired_seq()
        await self.event("downloading", "progress", "downloading", bytes_done=500, bytes_total=1005)
        await self.event("downloading", "ok", "downloaded", bytes_done=1005, bytes_total=1005)
        await self.event("active", "ok", "active as stable after 40 ms of work")
        await self.report(seq, ModelStatus(name=MODEL, phase="active", active_version=VERSION))

    async def close(self) -> None:
        await self.probe.publish(topics.reported(self.device_id), b"", retain=True)


async def devices(fleet: Fleet, group: str, *names: str) -> list[Device]:
    token = (await fleet.cp.new_token(group=fleet.id(group), max_uses=10))["token"]
    return [Device(fleet, fleet.id(name), await fleet.device(name, token=token)) for name in names]


@dataclass
class Finished:
    code: int
    stdout: str
    stderr: str


def outcomes(stdout: str) -> dict[str, str]:
    """The final table, ``{device: its line}`` (what comes before it is the deploy's answer)."""
    lines = stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["DEVICE", "OUTCOME"])
    return {line.split()[0]: line for line in lines[header + 1 :]}


async def start_deploy(fleet: Fleet, *args: str) -> asyncio.subprocess.Process:
    """``mcp-controlplane deploy MODEL VERSION *args`` as a process; returns once the deploy
    is recorded (the devices' desired states are on their way)."""
    url = str(fleet.cp.client.make_url("")).rstrip("/")
    env = {**process_env(), "MCP_SERVER": url, "MCP_TOKEN": fleet.cp.admin_token}
    process = await asyncio.create_subprocess_exec(
        *CONTROLPLANE,
        "deploy",
        MODEL,
        VERSION,
        *args,
        cwd=REPO,
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )

    async def deployed() -> bool:
        if process.returncode is not None:
            raise AssertionError(f"the CLI ended early: {await finished(process)}")
        return bool((await fleet.get("/api/v1/deployments"))["items"])

    await until(deployed, "the CLI's deploy")
    return process


async def finished(process: asyncio.subprocess.Process) -> Finished:
    try:
        out, err = await asyncio.wait_for(process.communicate(), CLI_DEADLINE_S)
    except asyncio.TimeoutError:
        process.kill()
        out, err = await process.communicate()
        raise AssertionError(f"the CLI did not finish: {err.decode()}") from None
    assert process.returncode is not None
    return Finished(process.returncode, out.decode(), err.decode())


async def test_wait_ends_with_exit_0_once_every_device_reports_the_version_active(
    fleet: Fleet,
) -> None:
    cams = await devices(fleet, "line-a", "cam-a", "cam-b")
    process = await start_deploy(fleet, "--group", fleet.id("line-a"), "--wait", "--timeout", "1m")
    try:
        for cam in cams:
            await cam.install()
        result = await finished(process)
    finally:
        for cam in cams:
            await cam.close()
    assert result.code == 0, result.stderr
    rows = outcomes(result.stdout)
    assert set(rows) == {cam.device_id for cam in cams}
    for cam in cams:
        assert rows[cam.device_id].split()[1:4] == ["active", MODEL, VERSION], result.stdout
    assert "active on all 2 device(s)" in result.stderr
    assert "2 of 2 device(s) done, 2 active, 0 failed" in result.stderr  # the progress line


async def test_wait_exits_1_naming_the_failed_devices_and_their_causes(fleet: Fleet) -> None:
    good, by_events, by_report = await devices(fleet, "line-b", "cam-ok", "cam-ev", "cam-rep")
    process = await start_deploy(
        fleet, "--group", fleet.id("line-b"), "--wait", "--log-format", "json"
    )
    try:
        await good.install()
        # One device's events say the download did not hash right and it rolled back (its
        # reported state never comes): the events alone end its wait.
        await by_events.desired_seq()
        await by_events.event("downloading", "ok", "downloaded")
        await by_events.event(
            "verifying", "error", "sha256 of the download differs", cause="hash_mismatch"
        )
        await by_events.event("rolling_back", "ok", "rolled back")
        # Another's reported state says the model failed to load.
        seq = await by_report.desired_seq()
        await by_report.report(
            seq,
            ModelStatus(name=MODEL, phase="failed", last_error="load_failed: out of memory"),
        )
        result = await finished(process)
    finally:
        for cam in (good, by_events, by_report):
            await cam.close()
    assert result.code == 1, result.stderr
    rows = outcomes(result.stdout)
    assert rows[good.device_id].split()[1] == "active"
    assert rows[by_events.device_id].split()[1] == "failed"
    assert "hash_mismatch: sha256 of the download differs; rolled back" in rows[by_events.device_id]
    assert rows[by_report.device_id].split()[1] == "failed"
    assert "load_failed: out of memory" in rows[by_report.device_id]
    *logs, error = result.stderr.strip().splitlines()
    assert error.startswith("Error: ") and "2 device(s) failed" in error
    assert by_events.device_id in error and "hash_mismatch" in error
    progress = [json.loads(line) for line in logs if line.startswith("{")]
    assert progress and all(p["logger"] == "mcp.controlplane.deploy" for p in progress)
    assert "1 active, 2 failed" in progress[-1]["message"]


async def test_wait_exits_1_at_the_timeout_naming_the_devices_still_pending(
    fleet: Fleet,
) -> None:
    good, silent = await devices(fleet, "line-c", "cam-ok", "cam-silent")
    process = await start_deploy(
        fleet, "--group", fleet.id("line-c"), "--wait", "--timeout", "3s", "--json"
    )
    try:
        await good.install()
        await silent.desired_seq()  # it got the desired state and says nothing
        result = await finished(process)
    finally:
        for cam in (good, silent):
            await cam.close()
    assert result.code == 1, result.stderr
    error = json.loads(result.stderr.strip().splitlines()[-1])
    assert error["code"] == "timeout"
    assert f"1 still pending after 3s: {silent.device_id}" in error["error"]
    outcomes = {o["device_id"]: o["outcome"] for o in json.loads(result.stdout)["outcomes"]}
    assert outcomes == {good.device_id: "active", silent.device_id: "pending"}
