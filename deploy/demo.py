"""The closed-loop fleet demo on this machine, driven by the real CLIs.

    python deploy/demo.py [--work-dir DIR] [--keep] [--smoke]

Starts Mosquitto with dynamic security on a free loopback port (below the kernel's ephemeral
range, as every port here: a client can never connect to itself there), a control plane on
SQLite, three agents enrolled with three hardware profiles (`cam-1` generic-x86_64, `cam-2`
intel-xeon, `cam-3` raspberry-pi, group `demo`) and 20 `mcp-sim` devices in the same group.
It trains a digits classifier and rolls 1.0.0 out in two stages, rolls 2.0.0 out as a canary
gated on the error rate of live traffic, then sends cam-1 inverted digits until the control
plane raises a retraining trigger; the retraining receiver (deploy/retrain_receiver.py) gets
the signed webhook, trains 3.0.0 on the original data plus the trigger's labelled hard
examples, publishes it and starts its rollout, and the demo waits until the whole fleet runs
3.0.0. Each step prints one line and the CLI command it runs; every process logs to
`DIR/logs/`. Without `--smoke` everything keeps running until Ctrl-C; with it, every
expectation is checked and the exit status is 1, with a message naming what did not happen,
when one fails.
"""

from __future__ import annotations

import argparse
import hashlib
import http.cookiejar
import json
import os
import pwd
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from sklearn.datasets import load_digits

from mcp_edge.shared.fsutil import atomic_write_bytes
from mcp_edge.shared.netutil import free_port_below_ephemeral
from mcp_edge.tooling.models import train_digits_mlp, write_digits_onnx
from mcp_edge.tooling.mosquitto import (
    MosquittoError,
    find_dynsec_plugin,
    find_executable,
)
from mcp_edge.tooling.processes import http_json

REPO = Path(__file__).resolve().parents[1]

HOST = "127.0.0.1"
AGENTS = {"cam-1": "generic-x86_64", "cam-2": "intel-xeon", "cam-3": "raspberry-pi"}
"""The real agents and the hardware profile each is enrolled and run with."""
SIM_DEVICES = 20
GROUP = "demo"
MODEL = "digits"
VERSIONS = {"1.0.0": 32, "2.0.0": 48}  # version -> hidden units; the receiver makes 3.0.0
RETRAINED = "3.0.0"
DRIFTED = "cam-1"
N_DRIFTED = 1000
APP_CLIENT = "demo-app"
MARKER = ".mcp-demo"  # marks a directory this script made, so only such a one is wiped
N_SAMPLES = 5
LIVE_RATE = 25.0
"""Requests per second the live-traffic client sends each agent."""
# Rollouts sized for a demo that must finish in a few minutes on a small machine; an operator
# bakes for minutes and asks for hundreds of requests (docs/demo.md, docs/rollouts.md).
V1_STAGES = ("20%:bake=2s:gate=install_failure_rate<0.1,min_devices=2", "rest:bake=0s")
CANARY = {"percent": 20, "mode": "canary", "weight": 0.5, "bake_s": 8}
CANARY_GATE = {"metric": "error_rate", "threshold": 0.02, "min_devices": 2, "min_requests": 50}
V2_STAGES = (
    "20%:canary:weight=0.5:bake=8s:gate=error_rate<0.02,min_devices=2,min_requests=50",
    "rest:bake=0s",
)
V3_ROLLOUT = {
    "target": {"group": GROUP},
    "stages": [{**CANARY, "gates": [CANARY_GATE]}, {"percent": 80, "bake_s": 0}],
}
# Settings of deploy/mosquitto/mosquitto.conf that name a port or a path on this machine.
_LOCAL_KEYS = {"listener", "plugin", "plugin_opt_config_file", "persistence_location", "log_dest"}


class DemoError(Exception):
    """An expectation of the demo failed; the message names what and the log to read."""


class Stop(Exception):
    """SIGTERM or SIGHUP arrived; ``signum`` is which."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@dataclass
class Service:
    """A long-running process of the demo and the file it logs to."""

    name: str
    process: subprocess.Popen[bytes]
    log: Path


def say(text: str) -> None:
    print(text, flush=True)


def indent(text: str) -> str:
    return "    " + text.strip().replace("\n", "\n    ")


class PacedClient(threading.Thread):
    """Sends inference requests, `rate` a second, taking `bodies` in turn; counts answers by
    version."""

    def __init__(self, url: str, bodies: Sequence[bytes], rate: float) -> None:
        super().__init__(daemon=True)
        self.url, self.bodies, self.rate = url, bodies, rate
        self.versions: list[str] = []
        self.failures: list[str] = []
        self.stop = threading.Event()

    def run(self) -> None:
        sent = 0
        while not self.stop.is_set():
            started = time.monotonic()
            try:
                body = self.bodies[sent % len(self.bodies)]
                sent += 1
                status, answer = http_json(self.url, body=body)
                if status != 200:
                    self.failures.append(f"HTTP {status}")
                else:
                    self.versions.append(str(answer["model_version"]))
            except (OSError, ValueError, KeyError, TypeError) as e:
                self.failures.append(repr(e))
            self.stop.wait(max(0.0, 1 / self.rate - (time.monotonic() - started)))

    def counts(self) -> str:
        by = ", ".join(f"{n} by {v}" for v, n in sorted(Counter(self.versions).items()))
        return f"{len(self.versions)} requests answered ({by}), {len(self.failures)} failed"


class Demo:
    """One run of the demo in `work`; `stop_all()` ends every process it started."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.logs = work / "logs"
        self.bin = Path(sys.executable).parent
        self.services: list[Service] = []
        self.env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
        self.token = ""
        self.cp_url = ""
        self.broker_port = 0
        self.agent_ports: dict[str, int] = {}
        self.samples: dict[str, Any] = {}
        self.step_no = 0
        self.admin_password = work / "admin.password"
        self.token_file = work / "api-token"
        self.hook_secret = work / "webhook.secret"
        self.hook_url = ""
        self.annotations: dict[str, int] = {}
        self.trigger_id = 0
        self.sent: set[bytes] = set()
        self.started = time.monotonic()

    # ---- helpers ---------------------------------------------------------------------------

    def step(self, text: str) -> None:
        self.step_no += 1
        say(f"\n[{self.step_no}] {text}")

    def _show(self, tool: str, args: Sequence[str]) -> None:
        say("    $ " + shlex.join([tool, *args]))

    def cli(
        self,
        tool: str,
        *args: str,
        env: dict[str, str] | None = None,
        show: bool = True,
        timeout_s: float = 120,
    ) -> str:
        """Run one CLI command as a user would, returning its stdout.

        Raises:
            DemoError: it exited with a non-zero status or ran past `timeout_s` seconds.
        """
        if show:
            self._show(tool, args)
        with (self.logs / "commands.log").open("a") as log:
            log.write(f"$ {shlex.join([tool, *args])}\n")
            try:
                done = subprocess.run(
                    [str(self.bin / tool), *args],
                    capture_output=True,
                    text=True,
                    env={**self.env, **(env or {})},
                    cwd=REPO,
                    timeout=timeout_s,
                    start_new_session=True,
                    check=False,
                )
            except subprocess.TimeoutExpired as e:
                raise DemoError(f"`{tool} {args[0]}` ran past {timeout_s:.0f} s") from e
            log.write(done.stdout + done.stderr)
        if done.returncode != 0:
            raise DemoError(
                f"`{tool} {' '.join(args[:2])}` failed (status {done.returncode}):"
                f"\n{(done.stderr or done.stdout).strip()[-3000:]}"
            )
        return done.stdout

    def start(self, name: str, argv: Sequence[str], show: Sequence[str] | None = None) -> Service:
        """Start a long-running process, its stdout and stderr going to logs/NAME.log."""
        if show is not None:
            self._show(show[0], show[1:])
        log = self.logs / f"{name}.log"
        with log.open("ab") as out:
            process = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=REPO,
                env=self.env,
                start_new_session=True,
            )
        service = Service(name, process, log)
        self.services.append(service)
        return service

    def wait_for(
        self,
        what: str,
        predicate: Callable[[], object],
        timeout_s: float,
        log: Path,
        *,
        quiet: bool = False,
    ) -> None:
        """Poll `predicate` until it is true.

        `quiet` also counts a DemoError of `predicate` (a failed CLI command) as "not yet".

        Raises:
            DemoError: a demo process exited, or `timeout_s` seconds passed; the message names
                `what` did not happen and the log to read.
        """
        deadline = time.monotonic() + timeout_s
        last = ""
        while True:
            for s in self.services:
                if s.process.poll() is not None:
                    raise DemoError(
                        f"{s.name} exited with status {s.process.returncode} while "
                        f"waiting for {what}; read {s.log}"
                    )
            try:
                if predicate():
                    return
            except (OSError, ValueError, KeyError, TypeError):
                pass
            except DemoError as e:
                if not quiet:
                    raise
                last = f" (last attempt: {e})"
            if time.monotonic() > deadline:
                raise DemoError(f"{what} did not happen within {timeout_s:.0f} s{last}; read {log}")
            time.sleep(0.1)

    def check(self, ok: bool, what: str) -> None:
        if not ok:
            raise DemoError(what)

    def api(self, path: str) -> Any:
        status, body = http_json(self.cp_url + path, token=self.token)
        if status != 200:
            raise DemoError(
                f"GET {path} answered HTTP {status}; read {self.logs / 'controlplane.log'}"
            )
        return body

    def devices(self) -> dict[str, Any]:
        return {d["id"]: d for d in self.api(f"/api/v1/devices?group={GROUP}&limit=1000")["items"]}

    def running(self, version: str) -> list[str]:
        """The devices of the group whose reported active version of the model is `version`."""
        return [
            name
            for name, d in self.devices().items()
            if any(m["model"] == MODEL and m["reported_version"] == version for m in d["models"])
        ]

    def infer_url(self, name: str) -> str:
        return f"http://{HOST}:{self.agent_ports[name]}/v2/models/{MODEL}/infer"

    def infer_body(self, data: Sequence[float] | None = None, rows: int = N_SAMPLES) -> bytes:
        data = self.samples["data"] if data is None else data
        tensor = {"name": "input", "shape": [rows, 64], "datatype": "FP32", "data": list(data)}
        return json.dumps({"inputs": [tensor]}).encode()

    def predictions(self, answer: dict[str, Any], rows: int = N_SAMPLES) -> list[int]:
        scores = np.asarray(answer["outputs"][0]["data"], dtype=np.float32).reshape(rows, -1)
        return [int(i) for i in scores.argmax(axis=1)]

    def show_answer(self, who: str, answer: dict[str, Any]) -> None:
        predicted, truth = self.predictions(answer), self.samples["labels"]
        right = sum(p == t for p, t in zip(predicted, truth, strict=True))
        say(
            f"    {who}: {MODEL} {answer['model_version']} answered {predicted}, "
            f"true {truth} ({right}/{N_SAMPLES} right)"
        )

    def annotate(self, data: Sequence[float], labels: Sequence[int]) -> None:
        """Note the true class of each 64-pixel row of `data` as a person labelling it would,
        keyed by the sha256 of the row's bytes as an agent keeps it (float32, little-endian),
        into DIR/annotations.json for the retraining receiver."""
        rows = np.asarray(data, dtype="<f4").reshape(-1, 64)
        for row, label in zip(rows, labels, strict=True):
            self.sent.add(row.tobytes())
            self.annotations[hashlib.sha256(row.tobytes()).hexdigest()] = int(label)
        atomic_write_bytes(
            self.work / "annotations.json", json.dumps(self.annotations).encode(), mode=0o600
        )

    @contextmanager
    def live_traffic(self) -> Iterator[dict[str, PacedClient]]:
        """Clients asking each agent LIVE_RATE times a second, stopped on leaving; each
        request holds the next N_SAMPLES held-out digits (always the same ones would be a
        drift of their own)."""
        held_out = self.samples["test_data"]
        size = N_SAMPLES * 64
        bodies = [
            self.infer_body(held_out[i : i + size])
            for i in range(0, len(held_out) - size + 1, size)
        ]
        clients = {n: PacedClient(self.infer_url(n), bodies, LIVE_RATE) for n in AGENTS}
        for c in clients.values():
            c.start()
        try:
            self.wait_for(
                "the live-traffic clients under way",
                lambda: all(c.versions for c in clients.values()),
                30,
                self.logs / "cam-1.log",
            )
            yield clients
        finally:
            for c in clients.values():
                c.stop.set()
            for c in clients.values():
                c.join(timeout=15)

    def check_live(self, clients: dict[str, PacedClient], version: str) -> None:
        """Every agent answered its latest requests with `version`, and no request failed."""
        self.wait_for(
            f"every agent answering the live traffic with {version}",
            lambda: all(c.versions[-1] == version for c in clients.values()),
            60,
            self.logs / "cam-1.log",
        )
        for name, c in clients.items():
            say(f"    {name}: {c.counts()}")
        failed = {n: c.failures[:3] for n, c in clients.items() if c.failures}
        self.check(not failed, f"live requests failed during the rollout: {failed}")

    def rollout(self, version: str, stages: Sequence[str] | None, what: str) -> None:
        """Create (when `stages` are given) and watch the rollout of `version` until it
        succeeds; print its stages' devices and its history."""
        if stages is not None:
            args = ["rollouts", "create", MODEL, version, "--group", GROUP]
            for s in stages:
                args += ["--stage", s]
            rid = str(json.loads(self.cli("mcp-controlplane", *args, "--json"))["id"])
        else:
            listed = self.api(f"/api/v1/rollouts?model={MODEL}&limit=100")["items"]
            found = [r["id"] for r in listed if r["version"] == version]
            self.check(found != [], f"no rollout of {MODEL} {version}")
            rid = str(found[0])
        devices = self.api(f"/api/v1/rollouts/{rid}/devices?limit=10000")["items"]
        by_stage: dict[int, list[str]] = {}
        for d in devices:
            by_stage.setdefault(d["stage"], []).append(d["device_id"])
        for stage, names in sorted(by_stage.items()):
            agents = sorted(set(names) & set(AGENTS))
            say(
                f"    stage {stage + 1}: {len(names)} devices"
                + (f", among them {' and '.join(agents)}" if agents else ", all simulated")
            )
        self.step(f"Watch rollout {rid} ({what}) until it ends")
        self.cli("mcp-controlplane", "rollouts", "watch", rid, "--interval", "0.5s", timeout_s=240)
        for e in self.api(f"/api/v1/rollouts/{rid}/events?limit=1000")["items"]:
            where = "" if e["stage"] is None else f"stage {e['stage'] + 1}"
            say(f"    {e['kind']:<14} {where:<8} {e['actor']}: {e['reason']}")
        shown = self.api(f"/api/v1/rollouts/{rid}")["rollout"]
        self.check(shown["status"] == "succeeded", f"rollout {rid}: {shown['reason']}")

    # ---- the steps -------------------------------------------------------------------------

    def broker(self) -> None:
        broker_dir = self.work / "broker"
        self.step("Create the broker's dynamic-security file: one admin account, default deny")
        bootstrap = ["bash", str(REPO / "deploy/mosquitto/bootstrap.sh"), "--data-dir"]
        self._show(bootstrap[0], [*bootstrap[1:], str(broker_dir)])
        done = subprocess.run(
            [*bootstrap, str(broker_dir)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            start_new_session=True,
        )
        (self.logs / "bootstrap.log").write_text(done.stdout + done.stderr)
        if done.returncode != 0:
            raise DemoError(f"deploy/mosquitto/bootstrap.sh failed: {done.stderr.strip()}")
        self.broker_port = free_port_below_ephemeral(HOST)
        conf = broker_dir / "mosquitto.conf"
        lines = [
            line
            for line in (REPO / "deploy/mosquitto/mosquitto.conf").read_text().splitlines()
            if line.split(" ", 1)[0] not in _LOCAL_KEYS
        ]
        lines += [
            f"listener {self.broker_port} {HOST}",
            f"plugin {find_dynsec_plugin()}",
            f"plugin_opt_config_file {broker_dir / 'dynamic-security.json'}",
            f"persistence_location {broker_dir}/",
            f"log_dest file {self.logs / 'mosquitto.log'}",
            f"user {pwd.getpwuid(os.getuid()).pw_name}",
        ]
        conf.write_text("\n".join(lines) + "\n")
        self.step(f"Start Mosquitto on {HOST}:{self.broker_port} (config from deploy/mosquitto/)")
        self.start(
            "mosquitto",
            [str(find_executable("mosquitto")), "-c", str(conf)],
            show=["mosquitto", "-c", str(conf)],
        )

        def accepting() -> bool:
            with socket.create_connection((HOST, self.broker_port), timeout=1):
                return True

        self.wait_for(
            f"Mosquitto accepting connections on port {self.broker_port}",
            accepting,
            20,
            self.logs / "mosquitto.log",
        )

    def control_plane(self) -> None:
        data = self.work / "cp"
        self.admin_password.write_text(secrets.token_urlsafe(18) + "\n")
        self.admin_password.chmod(0o600)
        port = free_port_below_ephemeral(HOST)
        broker = f"mqtt://{HOST}:{self.broker_port}"
        self.step("Create the control plane: SQLite database, TUF repository and keys, admin user")
        out = self.cli(
            "mcp-controlplane", "init", "--data-dir", str(data), "--listen", f"{HOST}:{port}",
            "--broker-url", broker, "--broker-admin-url", broker, "--broker-admin-user", "admin",
            "--broker-admin-password-file", str(self.work / "broker/dynsec-admin.password"),
            "--admin-user", "admin", "--admin-password-file", str(self.admin_password),
        )  # fmt: skip
        self.token = out.strip().splitlines()[-1]
        self.token_file.write_text(self.token + "\n")
        self.token_file.chmod(0o600)
        self.cp_url = f"http://{HOST}:{port}"
        self.env.update(MCP_SERVER=self.cp_url, MCP_TOKEN=self.token)
        self.hook_secret.write_text(secrets.token_hex(32) + "\n")
        self.hook_secret.chmod(0o600)
        self.hook_url = f"http://{HOST}:{free_port_below_ephemeral(HOST)}/retrain"
        config = data / "controlplane.toml"
        text, n = re.subn(
            r"(?m)^inference_interval_s = .*$", "inference_interval_s = 2.0", config.read_text()
        )
        self.check(n == 1, f"no inference_interval_s line in {config}")
        config.write_text(
            text
            + "\n[drift_policy]\nhard_examples = true\nhard_example_max_confidence = 0.95\n"
            + f'\n[[webhooks]]\nname = "training"\nurl = "{self.hook_url}"\n'
            + f'secret_file = "{self.hook_secret}"\nevents = ["retraining.*"]\n'
        )
        say(
            "    controlplane.toml: devices send statistics every 2 s (inference_interval_s) and "
            "keep inputs answered with a top score up to 0.95 ([drift_policy]); retraining "
            f"triggers go to {self.hook_url} ([[webhooks]])"
        )
        say(
            f"    admin API token saved in {self.token_file}; the commands below "
            f"read it from MCP_TOKEN and the server from MCP_SERVER={self.cp_url}"
        )
        self.step(f"Serve the control plane on {self.cp_url}")
        argv = ["serve", "--data-dir", str(data), "--listen", f"{HOST}:{port}"]
        self.start(
            "controlplane",
            [str(self.bin / "mcp-controlplane"), *argv],
            show=["mcp-controlplane", *argv[:3]],
        )
        self.wait_for(
            "the control plane answering /healthz",
            lambda: http_json(self.cp_url + "/healthz")[0] == 200,
            60,
            self.logs / "controlplane.log",
        )
        self.console()

    def console(self) -> None:
        """Sign in to the web console as the admin, as a person would in a browser."""
        url = f"{self.cp_url}/ui/"
        self.step(
            f"The web console at {url}: sign in as admin with the password in {self.admin_password}"
        )
        opener = urllib.request.build_opener(
            urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar())
        )
        try:
            with opener.open(f"{self.cp_url}/ui/login", timeout=10) as page:
                form = page.read(1 << 20).decode("utf-8", "replace")
            found = re.search(r'name="csrf" value="([^"]+)"', form)
            if found is None:
                raise DemoError(f"no sign-in form at {self.cp_url}/ui/login")
            fields = {
                "username": "admin",
                "password": self.admin_password.read_text().strip(),
                "csrf": found[1],
            }
            body = urllib.parse.urlencode(fields).encode()
            with opener.open(f"{self.cp_url}/ui/login", data=body, timeout=10) as landed:
                where, status = landed.geturl(), landed.status
        except urllib.error.HTTPError as e:
            raise DemoError(
                f"signing in to the console answered HTTP {e.code}; "
                f"read {self.logs / 'controlplane.log'}"
            ) from e
        self.check(
            status == 200 and where == url,
            f"signing in to the console ended at {where} (HTTP {status}), not {url}",
        )
        say(f"    signed in as admin: {url} answers with the console's overview")

    def publish(self) -> None:
        models = self.work / "model"
        models.mkdir(exist_ok=True)
        self.step(
            f"Train {MODEL} {' and '.join(VERSIONS)} (scikit-learn's 8x8 images, no download)"
        )
        labels = models / "labels.txt"
        labels.write_text("\n".join(str(d) for d in range(10)) + "\n")
        for version, hidden in VERSIONS.items():
            onnx = models / f"digits-{version}.onnx"
            if onnx.exists() and "test_data" in (_read_json(models / "samples.json") or {}):
                say(f"    {version}: reusing {onnx}")
                continue
            mlp = train_digits_mlp(seed=0, hidden_units=hidden)
            write_digits_onnx(mlp.model, onnx)
            say(
                f"    {version}: MLP with {hidden} hidden units, held-out accuracy "
                f"{mlp.accuracy:.3f} -> {onnx}"
            )
            held_out = [round(float(v), 4) for v in mlp.X_test.ravel()]
            samples = {
                "data": held_out[: N_SAMPLES * 64],
                "labels": mlp.y_test[:N_SAMPLES].tolist(),
                "test_data": held_out,
                "test_labels": mlp.y_test.tolist(),
            }
            (models / "samples.json").write_text(json.dumps(samples))
            # The drift baseline: the pixels the model was trained on, stored in the bundle.
            np.save(models / "baseline.npy", np.asarray(mlp.X_train, dtype=np.float32))
        self.samples = json.loads((models / "samples.json").read_text())
        (models / "request.json").write_bytes(self.infer_body())
        self.annotate(self.samples["test_data"], self.samples["test_labels"])
        key = models / "publisher.key"
        self.step("Make the ML team's publisher key and register it with the control plane")
        if not key.exists():
            self.cli("mcp-bundle", "keygen", "--out", str(key))
        self.cli(
            "mcp-controlplane", "publishers", "add", str(key.with_suffix(".pub")),
            "--name", "vision-team",
        )  # fmt: skip
        self.step(f"Build, sign and publish {MODEL} {' and '.join(VERSIONS)} (TUF targets)")
        for version in VERSIONS:
            bundle = models / f"{MODEL}-{version}.mcpb"
            if not bundle.exists():
                self.cli(
                    "mcp-bundle", "build", str(models / f"digits-{version}.onnx"),
                    "--name", MODEL, "--version", version, "--labels", str(labels),
                    "--baseline", str(models / "baseline.npy"), "-o", str(bundle),
                )  # fmt: skip
                self.cli("mcp-bundle", "sign", str(bundle), "--key", str(key))
            self.cli("mcp-bundle", "push", str(bundle), "--no-progress")

    def drift_rule(self) -> None:
        self.step(
            f"A drift rule for {MODEL}: a retraining trigger when the fleet's input PSI "
            "passes 0.2 over 200 samples in a 10 s bucket"
        )
        self.cli(
            "mcp-controlplane", "drift", "rules", "set", MODEL, "--metric", "input_psi",
            "--threshold", "0.2", "--min-devices", "1", "--min-samples", "200",
            "--sustained", "1", "--cooldown", "1h", "--window", "10s",
        )  # fmt: skip

    def receiver(self) -> None:
        """Start the retraining receiver with an operator account of its own."""
        password, token = self.work / "trainer.password", self.work / "trainer.token"
        password.write_text(secrets.token_urlsafe(18) + "\n")
        password.chmod(0o600)
        self.step("Give the training pipeline an operator account of its own and an API token")
        self.cli(
            "mcp-controlplane", "users", "create", "trainer", "--role", "operator",
            "--password-file", str(password),
        )  # fmt: skip
        login = ["login", "-u", "trainer", "--password-file", str(password)]
        out = self.cli("mcp-controlplane", *login, "--name", "retrain-receiver")
        atomic_write_bytes(token, out.strip().splitlines()[-1].encode() + b"\n", mode=0o600)
        spec = self.work / "retrain-rollout.json"
        spec.write_text(json.dumps(V3_ROLLOUT, indent=1) + "\n")
        self.step(
            f"Start the retraining receiver on {self.hook_url}: it retrains {MODEL} when a "
            "trigger's webhook comes"
        )
        listen = urllib.parse.urlsplit(self.hook_url).netloc
        args = [
            "--control-plane", self.cp_url, "--token-file", str(token),
            "--secret-file", str(self.hook_secret),
            "--publisher-key", str(self.work / "model/publisher.key"),
            "--annotations", str(self.work / "annotations.json"),
            "--rollout-spec", str(spec), "--work-dir", str(self.work / "retrain"),
            "--listen", listen,
        ]  # fmt: skip
        script = str(REPO / "deploy/retrain_receiver.py")
        self.start(
            "retrain-receiver", [sys.executable, script, *args], show=["python", script, *args]
        )
        self.wait_for(
            "the retraining receiver listening",
            lambda: "receiving" in (self.logs / "retrain-receiver.log").read_text(),
            60,
            self.logs / "retrain-receiver.log",
        )

    def fleet(self) -> None:
        self.step(f"Create an enrollment token for group '{GROUP}' ({len(AGENTS)} uses, one hour)")
        out = self.cli(
            "mcp-controlplane", "tokens", "create", "--group", GROUP,
            "--uses", str(len(AGENTS)), "--expires", "1h",
        )  # fmt: skip
        token = out.strip().splitlines()[-1]
        self.step(
            f"Enroll {', '.join(AGENTS)} with three hardware profiles and run them with no model"
        )
        for name, profile in AGENTS.items():
            state = self.work / "agents" / name
            self.cli(
                "mcp-agent", "enroll", "--server", self.cp_url, "--token", token,
                "--device-id", name, "--profile", profile, "--state-dir", str(state),
            )  # fmt: skip
            port = self.agent_ports[name] = free_port_below_ephemeral(HOST)
            args = ["run", "--port", str(port), "--state-dir", str(state), "--profile", profile,
                    "--health-interval", "5"]  # fmt: skip
            self.start(name, [str(self.bin / "mcp-agent"), *args], show=["mcp-agent", *args])
        sims = self.work / "sim"
        self.step(
            f"Enroll {SIM_DEVICES} simulated devices in group '{GROUP}' and run them (mcp-sim)"
        )
        args = ["enroll", "--control-plane", self.cp_url, "--devices", str(SIM_DEVICES),
                "--group", GROUP, "--state-dir", str(sims)]  # fmt: skip
        say("    $ " + shlex.join(["mcp-sim", *args]) + ' --token "$MCP_TOKEN"')
        self.cli("mcp-sim", *args, env={"MCP_SIM_TOKEN": self.token}, show=False)
        args = ["run", "--state-dir", str(sims), "--status-file", str(sims / "status.json"),
                "--health-interval", "5", "--summary-interval", "30"]  # fmt: skip
        self.start("sim", [str(self.bin / "mcp-sim"), *args], show=["mcp-sim", *args])
        want = len(AGENTS) + SIM_DEVICES
        self.wait_for(
            f"{want} devices of group {GROUP} online in GET /api/v1/devices",
            lambda: sum(d["online"] for d in self.devices().values()) == want,
            90,
            self.logs / "sim.log",
        )
        say(f"    {want} devices online ({len(AGENTS)} agents, {SIM_DEVICES} simulated), no model")

    def first_version(self) -> None:
        self.step(
            f"Roll {MODEL} 1.0.0 out to group '{GROUP}' in two stages: 20 % first, gated on "
            "install failures, then the rest"
        )
        self.rollout("1.0.0", V1_STAGES, "two stages")
        devices = self.devices()
        for name, profile in AGENTS.items():
            d = devices[name]
            model: dict[str, Any] = next((m for m in d["models"] if m["model"] == MODEL), {})
            say(
                f"    {name}: profile {d['profile']}, runs {MODEL} "
                f"{model.get('reported_version')} on {model.get('backend')}"
            )
            self.check(d["profile"] == profile, f"{name} reports profile {d['profile']}")
        self.wait_for(
            f"every device of group {GROUP} running {MODEL} 1.0.0",
            lambda: len(self.running("1.0.0")) == len(AGENTS) + SIM_DEVICES,
            60,
            self.logs / "sim.log",
        )
        self.step("Ask each agent over HTTP (Open Inference Protocol)")
        body = self.infer_body()
        for name in AGENTS:
            url = self.infer_url(name)
            request = "@" + str(self.work / "model/request.json")
            self._show("curl", ["-s", "-H", "Content-Type: application/json", "-d", request, url])
            status, answer = http_json(url, body=body)
            self.check(
                status == 200 and answer["model_version"] == "1.0.0",
                f"{name} did not answer with {MODEL} 1.0.0 (HTTP {status}); "
                f"read {self.logs / (name + '.log')}",
            )
            self.show_answer(f"{name} over HTTP", answer)
        self.mqtt_inference()

    def mqtt_inference(self) -> None:
        self.step(
            f"Ask the fleet over MQTT (mcp/v1/fleet/infer/{MODEL}; one agent answers) "
            f"with an application account"
        )
        create = ["apps", "create", APP_CLIENT, "--description", "demo MQTT client", "--json"]
        account = json.loads(self.cli("mcp-controlplane", *create))
        say(
            f"    (the control plane made the broker account {account['username']}; it may "
            f"send requests and read {account['reply_topic']} only; the password, shown once, "
            f"goes in MCP_MQTT_PASSWORD)"
        )
        args = [
            "infer", "--mqtt", f"{HOST}:{self.broker_port}", "--model", MODEL,
            "--data", "@" + str(self.work / "model/request.json"), "--client-id", APP_CLIENT,
            "--username", account["username"], "--timeout", "10",
        ]  # fmt: skip
        env = {"MCP_MQTT_PASSWORD": account["password"]}
        # An agent joins a model's fleet topic right after the deployment that made it live;
        # the HTTP check above can pass a moment before that subscription is granted.
        self.wait_for(
            "an agent subscribed to the fleet topic",
            lambda: self.cli("mcp-agent", *args, env=env, show=False),
            30,
            self.logs / "cam-1.log",
            quiet=True,
        )
        answer = json.loads(self.cli("mcp-agent", *args, env=env))
        self.check(
            answer["model_version"] == "1.0.0",
            f"the fleet answered with {answer['model_version']}, not 1.0.0",
        )
        self.show_answer("the fleet over MQTT", answer)

    def canary(self) -> None:
        self.step(
            f"Roll {MODEL} 2.0.0 out as a canary: half the requests of 20 % of the group, "
            "gated on the error rate of live traffic, then the rest; clients keep asking "
            f"each agent {LIVE_RATE:.0f} times a second"
        )
        with self.live_traffic() as clients:
            self.rollout("2.0.0", V2_STAGES, "a canary gated on live traffic")
            self.check_live(clients, "2.0.0")
        say(f"    the fleet moved to {MODEL} 2.0.0 with 0 failed requests")

    def drift(self) -> None:
        digits = load_digits()
        chosen = np.random.default_rng(1).permutation(len(digits.target))[:N_DRIFTED]
        inverted = [round(float(v), 4) for v in (1.0 - digits.data[chosen] / 16.0).ravel()]
        truth = [int(t) for t in digits.target[chosen]]
        self.annotate(inverted, truth)
        self.step(
            f"{DRIFTED}'s sensor flips: it is sent {N_DRIFTED} inverted digits, which the agent "
            "bins on the bundle's baseline (windows of 200) and keeps where it is unsure"
        )
        status, answer = http_json(
            self.infer_url(DRIFTED), body=self.infer_body(inverted, N_DRIFTED)
        )
        self.check(status == 200, f"{DRIFTED} refused inverted digits (HTTP {status})")
        right = sum(p == t for p, t in zip(self.predictions(answer, N_DRIFTED), truth, strict=True))
        say(
            f"    {MODEL} {answer['model_version']} got {right} of {N_DRIFTED} inverted digits right"
        )
        self.wait_for(
            "a retraining trigger for digits",
            lambda: self._triggers() != [],
            60,
            self.logs / "controlplane.log",
        )
        trigger = self._triggers()[0]
        self.trigger_id = int(trigger["id"])
        score = trigger["score"]
        say(
            f"    trigger {trigger['id']}: {MODEL} {trigger['version']}, input PSI "
            f"{'-' if score is None else f'{float(score):.2f}'} from "
            f"{trigger['device_count']} device(s)"
        )
        out = self.cli(
            "mcp-controlplane", "drift", "show", MODEL, "--version", "2.0.0", "--since", "30s"
        )
        say(indent(out))

    def retrain(self) -> None:
        log = self.logs / "retrain-receiver.log"
        self.step(
            "The retraining receiver gets the signed webhook, collects the hard examples, "
            f"trains {MODEL} {RETRAINED}, signs and pushes it, and starts its rollout "
            f"(deploy/retrain_receiver.py; log {log})"
        )
        shown = 0

        def follow(marker: str) -> bool:
            nonlocal shown
            mine = f" trigger {self.trigger_id}: "
            lines = [ln for ln in log.read_text().splitlines() if mine in ln]
            for line in lines[shown:]:
                say("    receiver: " + line.split(" ", 3)[-1])
                if "giving up" in line:
                    raise DemoError(f"the retraining receiver gave up: {line}; read {log}")
            shown = len(lines)
            return any(marker in ln for ln in lines)

        self.wait_for(
            "the receiver's download of the hard examples", lambda: follow(" downloaded "), 90, log
        )
        dataset = sorted((self.work / "retrain").glob("trigger-*/hard-examples-*.npz"))
        with np.load(dataset[0], allow_pickle=False) as npz:
            inputs = npz["inputs"]
        self.check(
            len(inputs) > 0 and all(row.astype("<f4").tobytes() in self.sent for row in inputs),
            f"the hard examples in {dataset[0]} are not inputs the agents were sent",
        )
        with self.live_traffic() as clients:
            self.wait_for("the receiver's rollout", lambda: follow(" started rollout "), 180, log)
            self.rollout(RETRAINED, None, "the retrained version, a canary gated on live traffic")
            self.check_live(clients, RETRAINED)
        self.wait_for(
            "the receiver acknowledging the trigger", lambda: follow(" acknowledged"), 30, log
        )
        say(f"    {len(inputs)} hard examples, each byte-identical to an input an agent was sent")
        want = len(AGENTS) + SIM_DEVICES
        self.wait_for(
            f"all {want} devices reporting {MODEL} {RETRAINED}",
            lambda: len(self.running(RETRAINED)) == want,
            60,
            self.logs / "sim.log",
        )
        triggers = [f"{t['id']} ({t['version']})" for t in self._triggers()]
        self.check(
            len(triggers) == 1,
            f"ordinary traffic raised retraining triggers as well: {', '.join(triggers)}",
        )
        out = self.cli("mcp-controlplane", "models", "show", MODEL)
        say(indent(out))
        say(
            f"\nv3 rolled out: {MODEL} {RETRAINED} runs on all {want} devices of group "
            f"'{GROUP}' ({len(AGENTS)} agents, {SIM_DEVICES} simulated), 0 failed requests"
        )

    def _triggers(self) -> list[dict[str, Any]]:
        found = self.api(f"/api/v1/drift/triggers?model={MODEL}")
        return list(found.get("items", []))

    def summary(self) -> None:
        ports = self.agent_ports
        pids = {s.name: s.process.pid for s in self.services}
        request = self.work / "model/request.json"
        agents = "\n".join(
            f"  {n}          http://{HOST}:{ports[n]}   ({p}, pid {pids[n]})"
            for n, p in AGENTS.items()
        )
        say(f"""
The fleet is running ({_took(self.started)} to set up). Logs: {self.logs}/
  control plane  {self.cp_url}   (admin API token in {self.token_file})
  web console    {self.cp_url}/ui/   (user admin, password in {self.admin_password})
  broker         mqtt://{HOST}:{self.broker_port}
{agents}
  simulated      {SIM_DEVICES} devices (mcp-sim, pid {pids["sim"]}), state in {self.work / "sim"}
  receiver       {self.hook_url}   (pid {pids["retrain-receiver"]}), work dir {self.work / "retrain"}

Try, in another terminal (from any directory):
  export PATH={self.bin}:$PATH MCP_SERVER={self.cp_url} MCP_TOKEN=$(cat {self.token_file})
  mcp-controlplane devices list --group {GROUP}
  mcp-controlplane rollouts list                               # 1.0.0, 2.0.0 and 3.0.0
  mcp-controlplane rollouts history 3                          # every decision and who made it
  mcp-controlplane drift triggers show 1                       # acknowledged by the receiver
  curl -s -H 'Content-Type: application/json' -d @{request} http://{HOST}:{ports["cam-2"]}/v2/models/{MODEL}/infer
  mcp-controlplane rollouts rollback 3 --reason "try it"       # the fleet back to 2.0.0
  mcp-controlplane desired show cam-1                          # the signed desired state
  mcp-agent updates --state-dir {self.work / "agents/cam-1"}  # what cam-1 has on disk
  mcp-controlplane audit                                       # who did what
""")

    def watch(self) -> None:
        """Return never; say so once when a process of the fleet exits (the rest keeps running)."""
        gone: set[str] = set()
        while True:
            for s in self.services:
                if s.name not in gone and s.process.poll() is not None:
                    gone.add(s.name)
                    say(f"demo: {s.name} exited with status {s.process.returncode}; read {s.log}")
            time.sleep(0.5)

    def stop_all(self) -> list[str]:
        """Stop the simulator, agents, receiver, control plane, then the broker (SIGTERM,
        SIGKILL after 20 s).

        Returns:
            One line per process that did not exit cleanly.
        """
        unclean = []
        for s in reversed(self.services):
            if s.process.poll() is None:
                s.process.terminate()
                try:
                    s.process.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    s.process.kill()
                    s.process.wait()
                    unclean.append(f"{s.name} needed SIGKILL; read {s.log}")
                    continue
                if s.process.returncode != 0:
                    unclean.append(
                        f"{s.name} exited with status {s.process.returncode} on "
                        f"SIGTERM; read {s.log}"
                    )
        self.services.clear()
        return unclean

    def run(self) -> None:
        self.broker()
        self.control_plane()
        self.publish()
        self.drift_rule()
        self.receiver()
        self.fleet()
        self.first_version()
        self.canary()
        self.drift()
        self.retrain()


def _read_json(path: Path) -> Any:
    """The JSON document in `path`, or None when there is none to read."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _took(since: float) -> str:
    """The time since the monotonic clock read ``since``, as ``3 min 5 s``."""
    seconds = round(time.monotonic() - since)
    return f"{seconds // 60} min {seconds % 60} s" if seconds >= 60 else f"{seconds} s"


def _prepare_work_dir(work: Path, keep: bool) -> None:
    """Wipe `work` (only one this script made, or an empty one) unless `keep`.

    Raises:
        DemoError: `work` holds files that are not the demo's.
    """
    if work.exists() and any(work.iterdir()) and not (work / MARKER).exists():
        raise DemoError(f"{work} is not empty and not a demo work dir; pick another --work-dir")
    if work.exists():
        for child in work.iterdir():
            if keep and child.name == "model":
                continue  # trained models, publisher key and bundles are reused
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()
    work.mkdir(parents=True, exist_ok=True)
    (work / MARKER).write_text("made by deploy/demo.py; wiped on its next run\n")
    (work / "logs").mkdir()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="deploy/demo.sh", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--work-dir",
        type=Path,
        default=REPO / ".cache/demo",
        help="where every file and log goes, wiped at start (default .cache/demo)",
    )
    parser.add_argument(
        "--keep",
        action="store_true",
        help="reuse the trained models, publisher key and bundles in the work dir",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="run every step, check every expectation, stop everything",
    )
    args = parser.parse_args(argv)
    work = args.work_dir.resolve()

    def stop_request(signum: int, _frame: object) -> None:
        raise Stop(signum)

    # A shell starts background jobs with SIGINT ignored; Ctrl-C must still stop the demo.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, stop_request)
    signal.signal(signal.SIGHUP, stop_request)

    demo: Demo | None = None
    status = 0
    try:
        _prepare_work_dir(work, args.keep)
        demo = Demo(work)
        demo.run()
        if args.smoke:
            say(f"\ndemo: every step worked ({_took(demo.started)})")
        else:
            demo.summary()
            say("Press Ctrl-C to stop everything.")
            demo.watch()
    except (DemoError, MosquittoError) as e:
        say(f"\ndemo: FAILED: {e}")
        status = 1
    except KeyboardInterrupt:
        say("\ndemo: interrupted; stopping everything")
        status = 130
    except Stop as e:
        say(f"\ndemo: {e}; stopping everything")
        status = 128 + e.signum
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut shutdown short
        if demo is not None:
            unclean = demo.stop_all()
            for line in unclean:
                say(f"demo: {line}")
            if unclean and args.smoke:
                status = 1
            say("demo: simulator, agents, receiver, control plane and broker stopped")
    return status


if __name__ == "__main__":
    sys.exit(main())
