"""The README's main command, `bash deploy/demo.sh --smoke`, as a user runs it.

One run does the whole loop with real processes (Mosquitto with dynamic security, the control
plane on SQLite, two enrolled agents): both devices serve digits 1.0.0 over HTTP and MQTT, cam-1
moves to 1.1.0 under load without a failed request, a two-stage rollout takes both to 1.2.0,
and everything stops at the end. Interrupted (Ctrl-C), it stops what it started and exits 130.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from mcp_edge.tooling.processes import wait_until

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.timeout(300), pytest.mark.mosquitto]


def _processes_mentioning(text: str) -> list[str]:
    """Command lines of running processes that contain `text`."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # the process ended while we looked
            continue
        if text in args:
            found.append(args)
    return found


def test_demo_smoke_runs_the_fleet_loop_and_stops_everything(tmp_path: Path) -> None:
    work = tmp_path / "demo"
    env = {**os.environ, "MCP_VENV": sys.prefix}
    demo = subprocess.Popen(
        ["bash", "deploy/demo.sh", "--smoke", "--work-dir", str(work)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = demo.communicate(timeout=270)
    except subprocess.TimeoutExpired:
        demo.terminate()  # the demo stops its broker, control plane and agents on SIGTERM
        out, _ = demo.communicate(timeout=25)
        pytest.fail(f"the demo ran past 270 s:\n{out[-8000:]}")
    assert demo.returncode == 0, out[-8000:]

    # The console's sign-in with the user and password file the demo names.
    assert re.search(r"signed in as admin: http://127\.0\.0\.1:\d+/ui/ answers", out), out
    for device in ("cam-1", "cam-2"):
        assert re.search(rf"{device} over HTTP: digits 1\.0\.0 answered \[[\d, ]+\]", out), out
    assert re.search(r"the fleet over MQTT: digits 1\.0\.0 answered", out), out
    swap = re.search(
        r"cam-1: \d+ requests answered \((\d+) by 1\.0\.0, (\d+) by 1\.1\.0\), "
        r"0 failed",
        out,
    )
    assert swap and int(swap[1]) > 0 and int(swap[2]) > 0, out
    assert re.search(r"cam-2: \d+ requests answered \(\d+ by 1\.0\.0\), 0 failed", out), out
    assert "cam-1 moved to digits 1.1.0 with 0 failed requests" in out
    assert re.search(r"\d+\s+1\.1\.0\s+active\s+ok", out), out  # the flight recorder
    assert "rollout 1 succeeded: cam-1 and cam-2 run digits 1.2.0" in out
    assert re.search(r"gate_passed\s+stage 1\s+system: gate install_failure_rate passes", out), out
    # Drift: inverted digits raise a trigger, the pipeline gets the signed webhook, and the
    # hard examples come back as the inputs the camera was sent.
    assert re.search(r"trigger 1: digits 1\.2\.0, input PSI \d+\.\d+ from 1 device", out), out
    assert re.search(r"pipeline-events\.jsonl: retraining\.triggered delivery [0-9a-f]{32}", out)
    assert re.search(r"\d+ hard examples, each byte-identical to an input cam-1 was sent", out)
    assert "demo: every step worked" in out
    assert "agents, control plane and broker stopped" in out

    # Each process logged to its own file, and none of them is left running.
    logs = {p.name for p in (work / "logs").iterdir()}
    assert {"mosquitto.log", "controlplane.log", "cam-1.log", "cam-2.log", "pipeline.log"} <= logs
    assert _processes_mentioning(str(work)) == []


def test_an_interrupted_demo_stops_what_it_started_and_exits_130(tmp_path: Path) -> None:
    work = tmp_path / "demo"
    out = tmp_path / "demo.out"
    env = {**os.environ, "MCP_VENV": sys.prefix}
    with out.open("w") as sink:
        demo = subprocess.Popen(
            ["bash", "deploy/demo.sh", "--work-dir", str(work)],
            cwd=REPO,
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
    try:
        # Once the control plane is being created the broker runs: something to clean up.
        wait_until(lambda: "[3] Create the control plane" in out.read_text(), "step 3", 120)
        assert _processes_mentioning(str(work)) != []
        demo.send_signal(signal.SIGINT)  # what Ctrl-C sends
        assert demo.wait(timeout=60) == 130, out.read_text()
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
    text = out.read_text()
    assert "demo: interrupted; stopping everything" in text
    assert "agents, control plane and broker stopped" in text
    assert _processes_mentioning(str(work)) == []
