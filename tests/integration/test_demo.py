"""The README's main command, `bash deploy/demo.sh --smoke`, as a user runs it, and the
retraining receiver it runs (deploy/retrain_receiver.py) as a webhook endpoint on its own.

One run does the whole closed loop with real processes (Mosquitto with dynamic security, the
control plane on SQLite, three agents on three hardware profiles, 20 simulated devices, the
retraining receiver): 1.0.0 rolls out in two stages, 2.0.0 as a canary gated on live traffic
without a failed request, inverted digits raise a retraining trigger, the receiver trains
3.0.0 on the trigger's hard examples and starts its rollout, and the whole fleet ends on
3.0.0. Interrupted (Ctrl-C), the demo stops what it started and exits 130.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from mcp_edge.controlplane.webhooks import signature_header
from mcp_edge.shared.signing import PrivateKey, write_private_key
from mcp_edge.tooling.processes import free_port, wait_until

REPO = Path(__file__).resolve().parents[2]


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


@pytest.mark.mosquitto
@pytest.mark.timeout(300)
def test_demo_smoke_closes_the_loop_to_v3_and_stops_everything(tmp_path: Path) -> None:
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
        demo.terminate()  # the demo stops every process it started on SIGTERM
        out, _ = demo.communicate(timeout=60)
        pytest.fail(f"the demo ran past 270 s:\n{out[-8000:]}")
    assert demo.returncode == 0, out[-8000:]

    # The console's sign-in with the user and password file the demo names.
    assert re.search(r"signed in as admin: http://127\.0\.0\.1:\d+/ui/ answers", out), out
    # Three agents, each enrolled and running with its own hardware profile.
    for device, profile in (
        ("cam-1", "generic-x86_64"),
        ("cam-2", "intel-xeon"),
        ("cam-3", "raspberry-pi"),
    ):
        assert re.search(rf"{device}: profile {profile}, runs digits 1\.0\.0 on \S+", out), out
        assert re.search(rf"{device} over HTTP: digits 1\.0\.0 answered \[[\d, ]+\]", out), out
    assert "23 devices online (3 agents, 20 simulated)" in out
    assert re.search(r"the fleet over MQTT: digits 1\.0\.0 answered", out), out
    # 1.0.0 in two stages, the first gated on install failures.
    assert re.search(r"gate_passed\s+stage 1\s+system: gate install_failure_rate passes", out)
    assert "rollout of digits 1.0.0 succeeded: 23 device(s) run it" in out
    # 2.0.0 as a canary judged on the error rate of live requests; no request failed.
    assert re.search(r"stage_started\s+stage 1\s+user:admin: .* canary at weight 0\.5", out)
    gate = re.search(r"gate error_rate passes: 0 <= 0\.02 over (\d+) requests", out)
    assert gate and int(gate[1]) >= 50, out
    assert "rollout of digits 2.0.0 succeeded: 23 device(s) run it" in out
    assert "the fleet moved to digits 2.0.0 with 0 failed requests" in out
    for device in ("cam-1", "cam-2", "cam-3"):
        answered = re.search(
            rf"{device}: \d+ requests answered \((\d+) by 2\.0\.0, (\d+) by 3\.0\.0\), 0 failed",
            out,
        )
        assert answered and int(answered[1]) > 0 and int(answered[2]) > 0, out
    # Drift raises a trigger; the receiver gets its signed webhook and closes the loop.
    assert re.search(r"trigger 1: digits 2\.0\.0, input PSI \d+\.\d+ from \d+ device", out), out
    assert re.search(r"receiver: trigger 1: accepted delivery [0-9a-f]{32} \(digits 2\.0\.0\)", out)
    labelled = re.search(r"receiver: trigger 1: (\d+) of \1 hard examples have a label", out)
    assert labelled and int(labelled[1]) > 0, out
    assert re.search(r"receiver: trigger 1: trained digits 3\.0\.0 .* on \d+ images", out), out
    assert "receiver: trigger 1: pushed digits 3.0.0: published" in out
    assert "receiver: trigger 1: started rollout 3 of digits 3.0.0" in out
    assert re.search(r"\d+ hard examples, each byte-identical to an input an agent was sent", out)
    assert re.search(r"stage_started\s+stage 1\s+user:trainer: ", out), out
    assert "rollout of digits 3.0.0 succeeded: 23 device(s) run it" in out
    assert re.search(r"3\.0\.0\s+[0-9a-f]{16}\s+\d+\s+onnx .* user:trainer", out), out
    assert "v3 rolled out: digits 3.0.0 runs on all 23 devices" in out
    assert "demo: every step worked" in out
    assert "simulator, agents, receiver, control plane and broker stopped" in out

    # What is left on disk says the same: the receiver's record of what it published, and
    # every simulated device ended on 3.0.0.
    result = json.loads((work / "retrain/trigger-1/result.json").read_text())
    assert result == {"trigger": 1, "model": "digits", "version": "3.0.0", "rollout": 3}
    status = json.loads((work / "sim/status.json").read_text())
    assert status["models"]["digits"]["active"] == {"3.0.0": 20}
    # Each process logged to its own file, and none of them is left running.
    logs = {p.name for p in (work / "logs").iterdir()}
    assert {
        "mosquitto.log", "controlplane.log", "cam-1.log", "cam-2.log", "cam-3.log", "sim.log",
        "retrain-receiver.log",
    } <= logs  # fmt: skip
    assert _processes_mentioning(str(work)) == []


@pytest.mark.mosquitto
@pytest.mark.timeout(300)
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
    assert "simulator, agents, receiver, control plane and broker stopped" in text
    assert _processes_mentioning(str(work)) == []


def _post(port: int, body: bytes, headers: dict[str, str]) -> tuple[int, str]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/retrain", data=body, headers=headers, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_the_retraining_receiver_acts_only_on_signed_fresh_deliveries(tmp_path: Path) -> None:
    secret = secrets.token_hex(32).encode()
    files = {"secret": tmp_path / "hook.secret", "token": tmp_path / "trainer.token"}
    files["secret"].write_bytes(secret + b"\n")
    files["token"].write_text("mcpa_not-a-real-token\n")
    for f in files.values():
        f.chmod(0o600)
    key = tmp_path / "publisher.key"
    write_private_key(key, PrivateKey.generate())
    port, nowhere = free_port(), free_port()  # no control plane listens on `nowhere`
    log = tmp_path / "receiver.log"

    def start() -> subprocess.Popen[bytes]:
        with log.open("ab") as sink:
            return subprocess.Popen(
                [
                    sys.executable, "deploy/retrain_receiver.py",
                    "--control-plane", f"http://127.0.0.1:{nowhere}",
                    "--token-file", str(files["token"]), "--secret-file", str(files["secret"]),
                    "--publisher-key", str(key), "--group", "demo",
                    "--work-dir", str(tmp_path / "work"), "--listen", f"127.0.0.1:{port}",
                ],
                cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

    def stop(receiver: subprocess.Popen[bytes]) -> None:
        receiver.send_signal(signal.SIGTERM)
        assert receiver.wait(timeout=30) == 0, log.read_text()

    def event(model: str = "digits") -> bytes:
        data = {"trigger_id": 7, "model": model, "version": "2.0.0", "url": "/x"}
        body = {"id": "0" * 32, "type": "retraining.triggered", "data": data}
        return json.dumps({**body, "created_at": "2026-05-01T12:00:00Z"}).encode()

    def headers(
        body: bytes, delivery: str, at: float | None = None, hmac_key: bytes = secret
    ) -> dict[str, str]:
        signed = signature_header(hmac_key, int(time.time() if at is None else at), body)
        return {"X-MCP-Signature": signed, "X-MCP-Delivery": delivery,
                "X-MCP-Event": "retraining.triggered", "Content-Type": "application/json"}  # fmt: skip

    receiver = start()
    try:
        wait_until(lambda: "receiving retraining.triggered" in log.read_text(), "listening", 60)
        body, delivery = event(), secrets.token_hex(16)
        assert _post(port, body, {"X-MCP-Delivery": delivery})[0] == 401  # unsigned
        assert _post(port, body, headers(body, delivery, hmac_key=b"x" * 64))[0] == 401
        assert _post(port, body, headers(body, delivery, at=time.time() - 3600))[0] == 401
        assert _post(port, body + b" ", headers(body, delivery))[0] == 401  # body changed
        big = b"{" + b" " * (300 * 1024) + b"}"
        assert _post(port, big, headers(big, delivery))[0] == 413
        assert _post(port, b"not json", headers(b"not json", delivery))[0] == 400
        assert _post(port, body, headers(body, "not-hex"))[0] == 400
        status, text = _post(port, b"[]", headers(b"[]", secrets.token_hex(16)))
        assert status == 400 and "not a webhook event" in text
        other = event("another-model")
        assert _post(port, other, headers(other, secrets.token_hex(16))) == (200, "ignored\n")
        assert not (tmp_path / "work/accepted.jsonl").exists()

        assert _post(port, body, headers(body, delivery)) == (202, "accepted\n")
        journal = (tmp_path / "work/accepted.jsonl").read_text().splitlines()
        assert [json.loads(line)["trigger"] for line in journal] == [7]
        # The same delivery again, even freshly signed: recorded once, not acted on twice.
        assert _post(port, body, headers(body, delivery)) == (200, "duplicate\n")
        assert len((tmp_path / "work/accepted.jsonl").read_text().splitlines()) == 1
        # The work runs after the answer; a control plane that cannot be reached is retried.
        wait_until(lambda: "trying again in 5 s" in log.read_text(), "a retried step", 60)
        assert receiver.poll() is None, log.read_text()
    finally:
        stop(receiver)

    # Restarted, it takes up the trigger it accepted and still remembers the delivery.
    receiver = start()
    try:
        wait_until(
            lambda: "trigger 7: accepted before, not finished: taking it up" in log.read_text(),
            "the unfinished trigger taken up",
            60,
        )
        wait_until(lambda: log.read_text().count("receiving retraining") == 2, "listening", 60)
        assert _post(port, body, headers(body, delivery)) == (200, "duplicate\n")
    finally:
        stop(receiver)
    assert "Traceback" not in log.read_text()
