"""``mcp-controlplane rollouts`` as an operator uses it, against a real served control plane.

The control plane runs in a thread on a loopback port (``served``) with a settable clock. Model
versions are recorded the way the registry does; devices enroll through the REST API and then
"report" through the real ingestion code (:class:`IngestService` fed ``(topic, payload)`` and
flushed into the same database), so the rollout loop sees them online and running what they
say, with no agent and no broker. ``watch`` runs as a process; every wait is on its output or
on the API's answers, never a fixed sleep.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest
from click.testing import CliRunner, Result
from hypothesis import given, settings
from hypothesis import strategies as st

from mcp_edge.controlplane.cli import main
from mcp_edge.controlplane.cli.rollout_spec import (
    DEFAULT_STAGES,
    parse_stage,
    stage_text,
    stages_from_flags,
)
from mcp_edge.controlplane.db import Database, registry
from mcp_edge.controlplane.ingest import IngestService
from mcp_edge.controlplane.metrics import ControlPlaneMetrics
from mcp_edge.controlplane.rollouts.spec import parse_spec, plan_stage_sizes
from mcp_edge.controlplane.settings import Settings, load_settings
from mcp_edge.shared.protocol import topics
from mcp_edge.shared.protocol.state import ModelStatus, ReportedState
from mcp_edge.shared.signing import PrivateKey
from mcp_edge.shared.version import parse_version
from mcp_edge.tooling.processes import wait_until
from tests.support.controlplane import FakeClock, FakeProvisioner, envelope, served

T = TypeVar("T")
CLI = [sys.executable, "-m", "mcp_edge.controlplane.cli"]
PASSWORD = "admin-password-1"
GROUP = "line-a"


# ---------------------------------------------------------------------------- the fleet
@dataclass
class Watch:
    """A ``rollouts watch`` process and the lines it printed so far."""

    process: subprocess.Popen[str]
    lines: list[str] = field(default_factory=list)
    reader: threading.Thread | None = None

    def read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))

    def saw(self, text: str) -> bool:
        return any(text in line for line in self.lines)

    def wait(self) -> int:
        """Its exit status, once it ended and every line it printed was read."""
        try:
            code = self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)
            raise AssertionError("watch did not end:\n" + "\n".join(self.lines)) from None
        assert self.reader is not None
        self.reader.join(timeout=30)
        return code


@dataclass
class Plane:
    url: str
    token: str
    settings: Settings
    clock: FakeClock
    seq: int = 0

    def cli(self, *args: str, ok: bool = True) -> Result:
        env = {"MCP_SERVER": self.url, "MCP_TOKEN": self.token}
        result = CliRunner(env=env).invoke(main, list(args), catch_exceptions=False)
        if ok:
            assert result.exit_code == 0, result.output
        return result

    def api(self, method: str, path: str, body: Any = None) -> Any:
        req = urllib.request.Request(
            self.url + path,
            method=method,
            data=json.dumps(body).encode() if body is not None else None,
            headers={"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=10) as response:
            return json.loads(response.read())

    def rollout(self, rollout_id: int) -> dict[str, Any]:
        return dict(self.api("GET", f"/api/v1/rollouts/{rollout_id}")["rollout"])

    def devices(self, rollout_id: int) -> dict[str, str]:
        items = self.api("GET", f"/api/v1/rollouts/{rollout_id}/devices")["items"]
        return {d["device_id"]: d["phase"] for d in items}

    def on_db(self, work: Callable[[Database], Awaitable[T]]) -> T:
        async def run() -> T:
            db = Database(self.settings.effective_database_url)
            try:
                return await work(db)
            finally:
                await db.dispose()

        return asyncio.run(run())

    def publish(self, model: str, *versions: str) -> None:
        """Record published versions as the registry does."""

        async def work(db: Database) -> None:
            async with db.transaction() as tx:
                for v in versions:
                    await registry.insert_version(
                        tx,
                        model=model,
                        version=v,
                        version_numeric=parse_version(v).to_numeric(),
                        target_path=f"{model}/{v}/{model}-{v}.mcpb",
                        sha256=hashlib.sha256(f"{model}{v}".encode()).hexdigest(),
                        length=1000,
                        format="onnx",
                        profiles=[],
                        variants=[],
                        publisher_keyid="",
                        uploaded_by="",
                        now=self.clock(),
                    )

        self.on_db(work)

    def enroll(self, *names: str, group: str = GROUP) -> list[str]:
        token = self.api("POST", "/api/v1/enrollment-tokens", {"group": group, "max_uses": 50})
        for name in names:
            body = envelope(PrivateKey.generate(), token["token"], now=self.clock(), device_id=name)
            req = urllib.request.Request(
                self.url + "/api/v1/enroll",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=10) as response:
                assert json.loads(response.read())["status"] == "accepted"
        return list(names)

    def report(
        self, device_id: str, *, model: str | None = None, active: str | None = None
    ) -> None:
        """The device says it is online and, given ``model``, that it runs ``active`` of it:
        through the ingestion code, committed before this returns."""
        self.seq += 1
        messages = [(topics.status(device_id), b"online")]
        if model is not None:
            state = ReportedState(
                device_id=device_id,
                ts=self.clock().timestamp(),
                applied_seq=self.seq,
                profile="generic-x86_64",
                models=[ModelStatus(name=model, active_version=active)],
            )
            messages.append((topics.reported(device_id), state.model_dump_json().encode()))

        async def work(db: Database) -> None:
            ingest = IngestService(db, ControlPlaneMetrics(), self.clock)
            for topic, payload in messages:
                ingest.handle(topic, payload)
            assert await ingest.flush() == len(messages)

        self.on_db(work)

    def watch(self, rollout_id: int) -> Watch:
        env = {**os.environ, "MCP_SERVER": self.url, "MCP_TOKEN": self.token}
        process = subprocess.Popen(
            [*CLI, "rollouts", "watch", str(rollout_id), "--interval", "0.1s"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        w = Watch(process)
        w.reader = threading.Thread(target=w.read, daemon=True)
        w.reader.start()
        return w


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


def created_id(result: Result) -> int:
    """The id in the first line ``rollout N  model version ...`` of create's output."""
    first = result.stdout.splitlines()[0].split()
    assert first[0] == "rollout", result.output
    return int(first[1])


# ---------------------------------------------------------------------------- the --stage form
def test_stage_flags_become_the_spec_the_server_reads() -> None:
    stages = stages_from_flags(
        [
            "10%:canary:bake=10m:weight=0.1:gate=error_rate<0.02:gate=latency_p95_ratio<1.5",
            "1:switch:approval:prefetch:bake=5m:gate=install_failure_rate<0.1,min_devices=1",
            "rest",
        ]
    )
    assert stages == [
        {"percent": 10.0, "mode": "canary", "bake_s": 600.0, "weight": 0.1,
         "gates": [{"metric": "error_rate", "threshold": 0.02},
                   {"metric": "latency_p95_ratio", "threshold": 1.5}]},
        {"count": 1, "mode": "switch", "approval": True, "prefetch": True, "bake_s": 300.0,
         "gates": [{"metric": "install_failure_rate", "threshold": 0.1, "min_devices": 1}]},
        {"percent": 100.0},
    ]  # fmt: skip
    # Percents only: rest is what makes 100, so the spec's sum rule holds.
    assert stages_from_flags(["10%", "25%", "rest"])[-1] == {"percent": 65.0}
    gate = parse_stage("20%:shadow:gate=agreement>0.95,min_requests=500,on_fail=pause,dry_run")
    assert gate["gates"] == [
        {"metric": "agreement", "threshold": 0.95, "min_requests": 500, "on_fail": "pause",
         "dry_run": True}
    ]  # fmt: skip


def test_default_stages_are_a_valid_spec_of_three_gated_stages() -> None:
    spec = parse_spec(
        {"model": "digits", "version": "1.3.0", "target": {"group": GROUP},
         "stages": stages_from_flags(DEFAULT_STAGES)}
    )  # fmt: skip
    assert [s.percent for s in spec.stages] == [10.0, 50.0, 40.0]
    assert {s.bake_s for s in spec.stages} == {600.0}
    assert [[g.metric.value for g in s.gates] for s in spec.stages] == [
        ["install_failure_rate", "error_rate"]
    ] * 3
    assert plan_stage_sizes(spec, 10) == [1, 5, 4]


_gates = st.lists(
    st.builds(
        dict,
        metric=st.sampled_from(["install_failure_rate", "error_rate", "latency_p95_ratio"]),
        threshold=st.sampled_from([0.01, 0.05, 0.5, 0.9]),
        min_devices=st.integers(1, 50),
        min_requests=st.integers(0, 10_000),
        on_fail=st.sampled_from(["rollback", "pause"]),
        dry_run=st.booleans(),
    ),
    max_size=3,
    unique_by=lambda g: g["metric"],
)


@settings(max_examples=150, deadline=None)
@given(
    size=st.one_of(
        st.builds(dict, count=st.integers(1, 10_000)),
        st.builds(dict, percent=st.sampled_from([0.5, 5.0, 12.5, 33.0, 100.0])),
    ),
    mode=st.sampled_from(["switch", "canary", "shadow"]),
    weight=st.sampled_from([0.05, 0.1, 0.25, 0.5]),
    bake_s=st.sampled_from([0.0, 1.0, 45.0, 60.0, 600.0, 5400.0, 86400.0]),
    prefetch=st.booleans(),
    approval=st.booleans(),
    gates=_gates,
)
def test_stage_text_reads_back_as_the_same_stage(
    size: dict[str, Any], mode: str, weight: float, bake_s: float, prefetch: bool,
    approval: bool, gates: list[dict[str, Any]],
) -> None:  # fmt: skip
    stage: dict[str, Any] = {**size, "mode": mode, "bake_s": bake_s, "gates": gates}
    if mode == "canary":
        stage["weight"] = weight
    if prefetch:
        stage["prefetch"] = True
    if approval:
        stage["approval"] = True
    back = parse_stage(stage_text(stage))
    defaults = {"min_devices": 1, "min_requests": 100, "on_fail": "rollback", "dry_run": False}
    full = [{**defaults, **g} for g in back.pop("gates", [])]
    assert full == gates
    assert back == {k: v for k, v in stage.items() if k != "gates"}


@pytest.mark.parametrize(
    ("flag", "says"),
    [
        ("ten", "'ten' is not a size"),
        ("10%:blue", "unknown option 'blue'"),
        ("10%:weight=0.2", "weight: applies to canary stages only"),
        ("10%:gate=error_rate>0.1", "error_rate takes a ceiling"),
        ("10%:gate=speed<2", "unknown metric 'speed'"),
        ("10%:gate=error_rate<1", "can never fail"),
        ("10%:bake=soon", "'soon' is not a duration"),
        ("10%:gate=error_rate<0.1,min_devices=two", "min_devices 'two' is not a whole number"),
    ],
)
def test_a_bad_stage_is_a_usage_error_naming_it_with_an_example(flag: str, says: str) -> None:
    result = CliRunner().invoke(
        main, ["rollouts", "create", "digits", "1.3.0", "--group", GROUP, "--stage", flag,
               "--stage", "rest", "--print-spec"],
    )  # fmt: skip
    assert result.exit_code == 2, result.output
    assert f"--stage {flag!r}: " in result.output and says in result.output
    assert "e.g. --stage '10%:canary" in result.output


def test_rest_must_be_last_and_leave_something() -> None:
    base = ["rollouts", "create", "digits", "1.3.0", "--group", GROUP, "--print-spec"]
    first = CliRunner().invoke(main, [*base, "--stage", "rest", "--stage", "10%"])
    assert first.exit_code == 2 and "rest takes what the other stages leave" in first.output
    full = CliRunner().invoke(main, [*base, "--stage", "60%", "--stage", "40%", "--stage", "rest"])
    assert full.exit_code == 2 and "already take 100%" in full.output
    over = CliRunner().invoke(main, [*base, "--stage", "60%", "--stage", "60%"])
    assert over.exit_code == 2 and "--stage: the percents sum to 120, not 100" in over.output


# ---------------------------------------------------------------------------- against a server
def test_create_from_flags_then_list_show_and_history(plane: Plane) -> None:
    plane.publish("digits", "1.0.0", "1.1.0")
    devices = plane.enroll("cam-a", "cam-b", "cam-c", "cam-d")
    created = plane.cli(
        "rollouts", "create", "digits", "1.1.0", "--group", GROUP,
        "--stage", "1:canary:weight=0.2:bake=10m:gate=error_rate<0.02,min_requests=50",
        "--stage", "rest:prefetch:approval:gate=install_failure_rate<0.1",
        "--rate", "2/min", "--rate-growth", "1.5", "--device-timeout", "15m",
    )  # fmt: skip
    rollout_id = created_id(created)
    assert "watch it: mcp-controlplane rollouts watch" in created.stderr
    spec = plane.rollout(rollout_id)["spec"]
    assert spec["target"] == {"group": GROUP}
    assert spec["rate"] == {"per_minute": 2.0, "growth": 1.5}
    assert spec["device_timeout_s"] == 900.0
    assert [s.get("count") or s.get("percent") for s in spec["stages"]] == [1, 100.0]
    assert spec["stages"][0]["mode"] == "canary" and spec["stages"][0]["weight"] == 0.2
    assert spec["stages"][1]["prefetch"] and spec["stages"][1]["approval"]

    listing = plane.cli("rollouts", "list").stdout.splitlines()
    assert listing[0].split()[:5] == ["ID", "MODEL", "VERSION", "STATUS", "STAGE"]
    assert listing[1].split()[:6] == [str(rollout_id), "digits", "1.1.0", "running", "1/2", "0"]
    assert plane.cli("rollouts", "list", "--status", "paused").stdout.splitlines()[1:] == []
    active = json.loads(plane.cli("rollouts", "list", "--status", "active", "--json").stdout)
    assert [r["id"] for r in active] == [rollout_id]

    shown = plane.cli("rollouts", "show", str(rollout_id)).stdout
    assert f"rollout {rollout_id}  digits 1.1.0  running  stage 1/2  4 device(s)" in shown
    stage_rows = [line.split() for line in shown.splitlines() if line[:1] in ("1", "2")]
    assert stage_rows[0][:4] == ["1", "1", "canary", "0.2"]
    assert "error_rate<0.02,min_requests=50" in stage_rows[0] and stage_rows[0][-1] == "running"
    assert stage_rows[1][:3] == ["2", "100%", "(3)"] and "prefetch,approval" in stage_rows[1]
    # The devices are offline, so nobody is told yet: all four wait, each named.
    assert "devices: 4 waiting" in shown
    (named,) = [line for line in shown.splitlines() if line.startswith("  waiting: ")]
    assert sorted(named.split()[1:]) == sorted(devices)

    history = plane.cli("rollouts", "history", str(rollout_id)).stdout.splitlines()
    assert history[0].split() == ["AT", "KIND", "STAGE", "ACTOR", "REASON"]
    assert history[1].split()[2:5] == ["stage_started", "1", "user:admin"]
    assert "stage 1 of 2 starts: 1 device(s), canary at weight 0.2" in history[1]

    rows = json.loads(plane.cli("rollouts", "devices", str(rollout_id), "--json").stdout)
    assert rows["total"] == 4 and sorted(d["device_id"] for d in rows["items"]) == devices
    table = plane.cli("rollouts", "devices", str(rollout_id), "--phase", "waiting").stdout
    assert table.splitlines()[0].split()[:3] == ["DEVICE", "STAGE", "PHASE"]
    assert len(table.splitlines()) == 5


def test_create_from_a_toml_file_with_flags_over_it(plane: Plane, tmp_path: Path) -> None:
    plane.publish("digits", "2.0.0", "2.1.0")
    plane.enroll("cam-a", "cam-b", "cam-c")
    spec_file = tmp_path / "rollout.toml"
    spec_file.write_text(
        """
model = "digits"
version = "2.0.0"
device_timeout_s = 120

[target]
group = "line-a"

[rate]
per_minute = 5

[[stages]]
count = 1
mode = "shadow"
bake_s = 60
gates = [{ metric = "agreement", threshold = 0.97, min_requests = 20, on_fail = "pause" }]

[[stages]]
percent = 100
"""
    )
    printed = json.loads(
        plane.cli("rollouts", "create", "--file", str(spec_file), "--print-spec").stdout
    )
    assert printed["version"] == "2.0.0" and printed["rate"] == {"per_minute": 5}
    # The command line's VERSION and --rate-growth win over the file.
    created = plane.cli(
        "rollouts", "create", "digits", "2.1.0", "--file", str(spec_file), "--rate-growth", "2"
    )
    rollout = plane.rollout(created_id(created))
    assert rollout["version"] == "2.1.0" and rollout["target_devices"] == 3
    spec = rollout["spec"]
    assert spec["rate"] == {"per_minute": 5.0, "growth": 2.0} and spec["device_timeout_s"] == 120
    assert spec["stages"][0] == {
        "count": 1, "mode": "shadow", "bake_s": 60.0, "prefetch": False, "approval": False,
        "gates": [{"metric": "agreement", "threshold": 0.97, "min_devices": 1,
                   "min_requests": 20, "on_fail": "pause", "dry_run": False}],
    }  # fmt: skip
    shown = plane.cli("rollouts", "show", str(rollout["id"])).stdout
    assert "agreement>0.97,min_requests=20,on_fail=pause" in shown

    bad = tmp_path / "bad.toml"
    bad.write_text(spec_file.read_text().replace('mode = "shadow"', 'mode = "blue"'))
    refused = plane.cli("rollouts", "create", "--file", str(bad), ok=False)
    assert refused.exit_code == 2
    assert f"--file {bad}: stages[0].mode: 'blue' is not one of switch, canary, shadow" in (
        refused.output
    )


def test_the_servers_refusals_are_shown_with_their_status(plane: Plane) -> None:
    plane.publish("digits", "1.0.0")
    plane.enroll("cam-a", "cam-b", "cam-c", "cam-d")
    unknown = plane.cli("rollouts", "create", "digits", "9.9.9", "--group", GROUP, ok=False)
    assert unknown.exit_code == 1
    assert "model 'digits' has no published version '9.9.9' (HTTP 404)" in unknown.output
    nobody = plane.cli("rollouts", "create", "digits", "1.0.0", "--group", "empty", ok=False)
    assert nobody.exit_code == 1 and "(HTTP 409)" in nobody.output
    assert "no accepted device" in nobody.output
    plane.cli("rollouts", "create", "digits", "1.0.0", "--group", GROUP)
    busy = plane.cli(
        "rollouts", "create", "digits", "1.0.0", "--device", "cam-a", "--stage", "rest", ok=False
    )
    assert busy.exit_code == 1 and "already targets these devices" in busy.output
    missing = plane.cli("rollouts", "show", "999", ok=False)
    assert missing.exit_code == 1 and "no rollout 999 (HTTP 404)" in missing.output


def test_pause_resume_and_abort(plane: Plane) -> None:
    plane.publish("digits", "1.0.0")
    plane.enroll("cam-a", "cam-b", "cam-c", "cam-d")
    rollout_id = created_id(plane.cli("rollouts", "create", "digits", "1.0.0", "--group", GROUP))
    rid = str(rollout_id)

    paused = plane.cli("rollouts", "pause", rid, "--reason", "night shift").stdout
    assert paused.strip() == f"rollout {rid}: paused: paused by user:admin: night shift"
    assert plane.rollout(rollout_id)["status"] == "paused"
    again = plane.cli("rollouts", "pause", rid, ok=False)
    assert again.exit_code == 1 and "pause applies to a rollout that is" in again.output
    assert "(HTTP 409)" in again.output

    resumed = plane.cli("rollouts", "resume", rid).stdout
    assert resumed.strip() == f"rollout {rid}: running: resumed by user:admin"
    answer = json.loads(
        plane.cli("rollouts", "abort", rid, "--reason", "wrong build", "--json").stdout
    )
    assert answer["status"] == "aborted" and answer["ended_at"] is not None

    history = plane.cli("rollouts", "history", rid).stdout.splitlines()[1:]
    kinds = [line.split()[2] for line in history]
    assert kinds == ["stage_started", "paused", "resumed", "aborted"]
    assert history[-1].split("  ")[-2:] == ["user:admin", "aborted by user:admin: wrong build"]
    after = plane.cli("rollouts", "resume", rid, ok=False)
    assert after.exit_code == 1 and "it has ended and takes no command" in after.output


def test_promote_approve_and_rollback(plane: Plane) -> None:
    plane.publish("digits", "1.0.0")
    plane.enroll("cam-a", "cam-b", "cam-c", "cam-d")
    created = plane.cli(
        "rollouts", "create", "digits", "1.0.0", "--group", GROUP,
        "--stage", "1", "--stage", "rest:approval",
    )  # fmt: skip
    rid = str(created_id(created))
    promoted = plane.cli("rollouts", "promote", rid).stdout.strip()
    assert (
        promoted
        == f"rollout {rid}: awaiting_approval: stage 2 of 2 awaits approval: 3 device(s), switch"
    )
    # The offline device of stage 1 was never told: promoting skipped it.
    assert "devices: 3 waiting, 1 skipped" in plane.cli("rollouts", "show", rid).stdout
    approved = plane.cli("rollouts", "approve", rid, "--reason", "change 42").stdout.strip()
    assert approved == f"rollout {rid}: running: stage 2 of 2 starts: 3 device(s), switch"
    rolled = plane.cli("rollouts", "rollback", rid).stdout.strip()
    assert rolled.startswith(f"rollout {rid}: rolled_back: rolled back: 0 device(s)")
    kinds = [e["kind"] for e in json.loads(plane.cli("rollouts", "history", rid, "--json").stdout)]
    assert kinds == [
        "stage_started", "promoted", "devices_skipped", "stage_passed", "awaiting_approval",
        "approved", "stage_started", "rolling_back", "rolled_back",
    ]  # fmt: skip


def test_watch_follows_a_rollout_to_success_and_exits_0(plane: Plane) -> None:
    plane.publish("digits", "1.0.0")
    a, b = plane.enroll("cam-a", "cam-b")
    for device in (a, b):
        plane.report(device)  # online, not running the model yet
    created = plane.cli(
        "rollouts", "create", "digits", "1.0.0", "--device", a, "--device", b,
        "--stage", "1:bake=0", "--stage", "rest:bake=0",
    )  # fmt: skip
    rollout_id = created_id(created)
    watch = plane.watch(rollout_id)
    wait_until(lambda: watch.saw(f"rollout {rollout_id}  digits 1.0.0  running"), "a first block")

    running: list[str] = []

    def told() -> str | None:
        moving = [
            d for d, phase in plane.devices(rollout_id).items()
            if phase == "moving" and d not in running
        ]  # fmt: skip
        return moving[0] if moving else None

    for stage in (1, 2):
        # The device of this stage is told to move; it then reports the version running.
        wait_until(told, f"the device of stage {stage} told to move")
        device = told()
        assert device is not None
        line = f"  moving: {device}"
        wait_until(lambda line=line: watch.saw(line), "watch naming the moving device")
        plane.report(device, model="digits", active="1.0.0")
        running.append(device)
    assert watch.wait() == 0, "\n".join(watch.lines)
    out = "\n".join(watch.lines)
    assert watch.lines[-1].startswith(f"rollout {rollout_id} succeeded: rollout of digits 1.0.0 ")
    assert "2 device(s) run it" in watch.lines[-1]
    for kind in ("stage_started", "bake_started", "stage_passed", "succeeded"):
        assert kind in out
    assert "\x1b[" not in out  # not a terminal: blocks, no redraw
    assert (
        plane.cli("rollouts", "list", "--status", "succeeded", "--json").stdout.count('"id"') == 1
    )


def test_watch_exits_1_when_the_rollout_is_aborted(plane: Plane) -> None:
    plane.publish("digits", "1.0.0")
    plane.enroll("cam-a", "cam-b", "cam-c", "cam-d")
    rollout_id = created_id(plane.cli("rollouts", "create", "digits", "1.0.0", "--group", GROUP))
    watch = plane.watch(rollout_id)
    wait_until(lambda: watch.saw(f"rollout {rollout_id}  digits"), "a first block")
    plane.cli("rollouts", "abort", str(rollout_id), "--reason", "from the test")
    assert watch.wait() == 1, "\n".join(watch.lines)
    assert watch.lines[-1] == (
        f"rollout {rollout_id} aborted: aborted by user:admin: from the test"
    )
    # The block after the abort carries the new history line, once.
    assert sum("user:admin: aborted by user:admin: from the test" in line
               for line in watch.lines) == 1  # fmt: skip


def test_watch_ends_130_on_ctrl_c_and_1_for_no_such_rollout(plane: Plane) -> None:
    plane.publish("digits", "1.0.0")
    plane.enroll("cam-a", "cam-b", "cam-c", "cam-d")
    rollout_id = created_id(plane.cli("rollouts", "create", "digits", "1.0.0", "--group", GROUP))
    watch = plane.watch(rollout_id)
    wait_until(lambda: watch.saw(f"rollout {rollout_id}  digits"), "a first block")
    watch.process.send_signal(signal.SIGINT)
    assert watch.wait() == 130
    assert not any("Traceback" in line for line in watch.lines)
    missing = plane.watch(rollout_id + 100)
    assert missing.wait() == 1
    assert any(f"no rollout {rollout_id + 100} (HTTP 404)" in line for line in missing.lines)
