"""The fleet demo: broker, control plane and two agents on this machine, driven by the real CLIs.

    python deploy/demo.py [--work-dir DIR] [--keep] [--smoke]

Starts Mosquitto with dynamic security on a free loopback port (below the kernel's ephemeral
range, as every port here: a client can never connect to itself there), a control plane on
SQLite, trains two versions of a digits classifier, signs and publishes them, enrolls and runs two
agents (`cam-1`, `cam-2`, group `demo`), deploys 1.0.0 to the group, asks both agents over HTTP
and the fleet over MQTT, then moves `cam-1` to 1.1.0 while a client keeps sending requests.
Each step prints one line and the CLI command it runs; every process logs to `DIR/logs/`.
Without `--smoke` everything keeps running until Ctrl-C; with it, every expectation is checked
and the exit status is 1, with a message naming what did not happen, when one fails.
"""

from __future__ import annotations

import argparse
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
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mcp_edge.shared.netutil import free_port_below_ephemeral
from mcp_edge.tooling.models import train_digits_mlp, write_digits_onnx
from mcp_edge.tooling.mosquitto import (
    MosquittoError,
    find_dynsec_plugin,
    find_executable,
)
from mcp_edge.tooling.processes import Client, http_json

REPO = Path(__file__).resolve().parents[1]

HOST = "127.0.0.1"
DEVICES = ("cam-1", "cam-2")
GROUP = "demo"
MODEL = "digits"
VERSIONS = {"1.0.0": 32, "1.1.0": 64, "1.2.0": 48}  # version -> hidden units of the MLP
APP_CLIENT = "demo-app"
MARKER = ".mcp-demo"  # marks a directory this script made, so only such a one is wiped
N_SAMPLES = 5
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
        return {d["id"]: d for d in self.api("/api/v1/devices")["items"]}

    def infer_body(self) -> bytes:
        return json.dumps(
            {
                "inputs": [
                    {
                        "name": "input",
                        "shape": [N_SAMPLES, 64],
                        "datatype": "FP32",
                        "data": self.samples["data"],
                    }
                ]
            }
        ).encode()

    def predictions(self, answer: dict[str, Any]) -> list[int]:
        scores = answer["outputs"][0]["data"]
        rows = [scores[i * 10 : (i + 1) * 10] for i in range(N_SAMPLES)]
        return [row.index(max(row)) for row in rows]

    def show_answer(self, who: str, answer: dict[str, Any]) -> None:
        predicted, truth = self.predictions(answer), self.samples["labels"]
        right = sum(p == t for p, t in zip(predicted, truth, strict=True))
        say(
            f"    {who}: {MODEL} {answer['model_version']} answered {predicted}, "
            f"true {truth} ({right}/{N_SAMPLES} right)"
        )

    # ---- the steps -------------------------------------------------------------------------

    def broker(self) -> None:
        broker_dir = self.work / "broker"
        self.step("Create the broker's dynamic-security file: one admin account, default deny")
        self._show(
            "bash", [str(REPO / "deploy/mosquitto/bootstrap.sh"), "--data-dir", str(broker_dir)]
        )
        done = subprocess.run(
            ["bash", str(REPO / "deploy/mosquitto/bootstrap.sh"), "--data-dir", str(broker_dir)],
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
        lines = []
        for line in (REPO / "deploy/mosquitto/mosquitto.conf").read_text().splitlines():
            if line.split(" ", 1)[0] not in _LOCAL_KEYS:
                lines.append(line)
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
        admin_pw = self.admin_password
        admin_pw.write_text(secrets.token_urlsafe(18) + "\n")
        admin_pw.chmod(0o600)
        port = free_port_below_ephemeral(HOST)
        broker = f"mqtt://{HOST}:{self.broker_port}"
        self.step("Create the control plane: SQLite database, TUF repository and keys, admin user")
        out = self.cli(
            "mcp-controlplane",
            "init",
            "--data-dir",
            str(data),
            "--listen",
            f"{HOST}:{port}",
            "--broker-url",
            broker,
            "--broker-admin-url",
            broker,
            "--broker-admin-user",
            "admin",
            "--broker-admin-password-file",
            str(self.work / "broker/dynsec-admin.password"),
            "--admin-user",
            "admin",
            "--admin-password-file",
            str(admin_pw),
        )
        self.token = out.strip().splitlines()[-1]
        token_file = self.token_file
        token_file.write_text(self.token + "\n")
        token_file.chmod(0o600)
        self.cp_url = f"http://{HOST}:{port}"
        self.env.update(MCP_SERVER=self.cp_url, MCP_TOKEN=self.token)
        self.pipeline()
        with (data / "controlplane.toml").open("a") as config:
            config.write(
                "\n[drift_policy]\nhard_examples = true\n"
                f'\n[[webhooks]]\nname = "training"\nurl = "{self.hook_url}"\n'
                f'secret_file = "{self.hook_secret}"\nevents = ["retraining.*"]\n'
            )
        say(
            "    controlplane.toml: devices keep hard examples ([drift_policy]); retraining "
            "triggers go to the training pipeline's webhook ([[webhooks]])"
        )
        say(
            f"    admin API token saved in {token_file}; the commands below "
            f"read it from MCP_TOKEN and the server from MCP_SERVER={self.cp_url}"
        )
        self.step(f"Serve the control plane on {self.cp_url}")
        self.start(
            "controlplane",
            [
                str(self.bin / "mcp-controlplane"),
                "serve",
                "--data-dir",
                str(data),
                "--listen",
                f"{HOST}:{port}",
            ],
            show=["mcp-controlplane", "serve", "--data-dir", str(data)],
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
            self.check(found is not None, f"no sign-in form at {self.cp_url}/ui/login")
            assert found is not None
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

    def pipeline(self) -> None:
        """Start the stand-in for the ML team's training pipeline: a webhook receiver."""
        self.hook_secret = self.work / "webhook.secret"
        self.hook_secret.write_text(secrets.token_hex(32) + "\n")
        self.hook_secret.chmod(0o600)
        self.hook_events = self.work / "pipeline-events.jsonl"
        port = free_port_below_ephemeral(HOST)
        self.hook_url = f"http://{HOST}:{port}/retrain"
        self.step(f"Start the training pipeline's webhook receiver on {self.hook_url}")
        self.start(
            "pipeline",
            [
                sys.executable, "-m", "mcp_edge.tooling.webhook_receiver", "--host", HOST,
                "--port", str(port), "--secret-file", str(self.hook_secret),
                "--out", str(self.hook_events),
            ],
            show=["python", "-m", "mcp_edge.tooling.webhook_receiver", "--port", str(port),
                  "--secret-file", str(self.hook_secret), "--out", str(self.hook_events)],
        )  # fmt: skip

    def publish(self) -> None:
        models = self.work / "model"
        models.mkdir(exist_ok=True)
        self.step(
            "Train three versions of a digits classifier (scikit-learn's 8x8 images, no download)"
        )
        labels = models / "labels.txt"
        labels.write_text("\n".join(str(d) for d in range(10)) + "\n")
        for version, hidden in VERSIONS.items():
            onnx = models / f"digits-{version}.onnx"
            if onnx.exists() and (models / "inverted.npy").exists():
                say(f"    {version}: reusing {onnx}")
                continue
            mlp = train_digits_mlp(seed=0, hidden_units=hidden)
            write_digits_onnx(mlp.model, onnx)
            say(
                f"    {version}: MLP with {hidden} hidden units, held-out accuracy "
                f"{mlp.accuracy:.3f} -> {onnx}"
            )
            (models / "samples.json").write_text(
                json.dumps(
                    {
                        "data": [round(float(v), 4) for v in mlp.X_test[:N_SAMPLES].ravel()],
                        "labels": mlp.y_test[:N_SAMPLES].tolist(),
                    }
                )
            )
            # The drift baseline: the pixels the model was trained on, stored in the bundle.
            np.save(models / "baseline.npy", np.asarray(mlp.X_train, dtype=np.float32))
            # What a camera with a flipped sensor would send: the held-out digits inverted.
            np.save(models / "inverted.npy", 1.0 - np.asarray(mlp.X_test, dtype=np.float32))
        self.samples = json.loads((models / "samples.json").read_text())
        (models / "request.json").write_bytes(self.infer_body())
        key = models / "publisher.key"
        self.step("Make the ML team's publisher key and register it with the control plane")
        if not key.exists():
            self.cli("mcp-bundle", "keygen", "--out", str(key))
        self.cli(
            "mcp-controlplane",
            "publishers",
            "add",
            str(key.with_suffix(".pub")),
            "--name",
            "vision-team",
        )
        for version in VERSIONS:
            self.step(f"Build, sign and publish {MODEL} {version} (a TUF target of the repository)")
            bundle = models / f"{MODEL}-{version}.mcpb"
            if not bundle.exists():
                self.cli(
                    "mcp-bundle",
                    "build",
                    str(models / f"digits-{version}.onnx"),
                    "--name",
                    MODEL,
                    "--version",
                    version,
                    "--labels",
                    str(labels),
                    "--baseline",
                    str(models / "baseline.npy"),
                    "-o",
                    str(bundle),
                )
                self.cli("mcp-bundle", "sign", str(bundle), "--key", str(key))
            self.cli("mcp-bundle", "push", str(bundle), "--no-progress")
        say(
            "    "
            + self.cli("mcp-controlplane", "models", "show", MODEL, show=False)
            .strip()
            .replace("\n", "\n    ")
        )

    def agents(self) -> None:
        self.step(f"Create an enrollment token for group '{GROUP}' (two uses, one hour)")
        token = (
            self.cli(
                "mcp-controlplane",
                "tokens",
                "create",
                "--group",
                GROUP,
                "--uses",
                str(len(DEVICES)),
                "--expires",
                "1h",
            )
            .strip()
            .splitlines()[-1]
        )
        for name in DEVICES:
            state = self.work / "agents" / name
            self.step(f"Enroll {name} and run it with no model")
            self.cli(
                "mcp-agent",
                "enroll",
                "--server",
                self.cp_url,
                "--token",
                token,
                "--device-id",
                name,
                "--state-dir",
                str(state),
            )
            port = self.agent_ports[name] = free_port_below_ephemeral(HOST)
            args = ["run", "--port", str(port), "--state-dir", str(state), "--health-interval", "5"]
            self.start(name, [str(self.bin / "mcp-agent"), *args], show=["mcp-agent", *args])
        self.wait_for(
            f"{' and '.join(DEVICES)} online in GET /api/v1/devices",
            lambda: all(self.devices()[n].get("online") for n in DEVICES),
            60,
            self.logs / "cam-1.log",
        )
        say(f"    {' and '.join(DEVICES)} are online, serving nothing yet")

    def deploy_first(self) -> None:
        self.step(
            f"Deploy {MODEL} 1.0.0 to group '{GROUP}': each agent fetches it over MQTT "
            "through TUF, checks it and swaps it in"
        )
        self.cli("mcp-controlplane", "deploy", MODEL, "1.0.0", "--group", GROUP)
        body = self.infer_body()
        for name in DEVICES:
            url = f"http://{HOST}:{self.agent_ports[name]}/v2/models/{MODEL}/infer"

            def serving(url: str = url) -> bool:
                return bool(http_json(url, body=body)[1]["model_version"] == "1.0.0")

            self.wait_for(f"{name} serving {MODEL} 1.0.0", serving, 120, self.logs / f"{name}.log")
        self.step("Ask each agent over HTTP (Open Inference Protocol)")
        for name in DEVICES:
            url = f"http://{HOST}:{self.agent_ports[name]}/v2/models/{MODEL}/infer"
            self._show(
                "curl",
                [
                    "-s",
                    "-H",
                    "Content-Type: application/json",
                    "-d",
                    "@" + str(self.work / "model/request.json"),
                    url,
                ],
            )
            status, answer = http_json(url, body=body)
            self.check(
                status == 200 and answer["model_version"] == "1.0.0",
                f"{name} did not answer with {MODEL} 1.0.0 (HTTP {status}); "
                f"read {self.logs / (name + '.log')}",
            )
            self.show_answer(f"{name} over HTTP", answer)

    def mqtt_inference(self) -> None:
        self.step(
            f"Ask the fleet over MQTT (mcp/v1/fleet/infer/{MODEL}; one agent answers) "
            f"with an application account"
        )
        account = json.loads(
            self.cli(
                "mcp-controlplane",
                "apps",
                "create",
                APP_CLIENT,
                "--description",
                "demo MQTT client",
                "--json",
            )
        )
        say(
            f"    (the control plane made the broker account {account['username']}; it may "
            f"send requests and read {account['reply_topic']} only; the password, shown once, "
            f"goes in MCP_MQTT_PASSWORD)"
        )
        args = [
            "infer",
            "--mqtt",
            f"{HOST}:{self.broker_port}",
            "--model",
            MODEL,
            "--data",
            "@" + str(self.work / "model/request.json"),
            "--client-id",
            APP_CLIENT,
            "--username",
            account["username"],
            "--timeout",
            "10",
        ]
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

    def hot_swap(self) -> None:
        self.step(f"Deploy {MODEL} 1.1.0 to cam-1 only, while clients keep asking both agents")
        clients = {
            n: Client(
                f"http://{HOST}:{self.agent_ports[n]}/v2/models/{MODEL}/infer", self.infer_body()
            )
            for n in DEVICES
        }
        for c in clients.values():
            c.start()
        cam1 = clients["cam-1"]
        try:
            self.wait_for(
                "the clients under way",
                lambda: all(len(c.versions) >= 20 for c in clients.values()),
                30,
                self.logs / "cam-1.log",
            )
            self.cli("mcp-controlplane", "deploy", MODEL, "1.1.0", "--device", "cam-1")
            self.wait_for(
                "cam-1 answering with 1.1.0",
                lambda: cam1.versions and cam1.versions[-1] == "1.1.0",
                120,
                self.logs / "cam-1.log",
            )
            seen = len(cam1.versions)
            self.wait_for(
                "more answers after the swap",
                lambda: len(cam1.versions) >= seen + 20,
                30,
                self.logs / "cam-1.log",
            )
        finally:
            for c in clients.values():
                c.stop.set()
            for c in clients.values():
                c.join(timeout=15)
        for name, c in clients.items():
            counts = ", ".join(f"{n} by {v}" for v, n in sorted(Counter(c.versions).items()))
            say(
                f"    {name}: {len(c.versions)} requests answered ({counts}), "
                f"{len(c.failures)} failed"
            )
        failed = {n: c.failures[:3] for n, c in clients.items() if c.failures}
        self.check(
            not failed,
            f"requests failed during the update: {failed}; read {self.logs / 'cam-1.log'}",
        )
        first_new = cam1.versions.index("1.1.0")
        self.check(
            set(cam1.versions[:first_new]) == {"1.0.0"}
            and set(cam1.versions[first_new:]) == {"1.1.0"},
            "cam-1 did not go from 1.0.0 to 1.1.0 in one swap",
        )
        self.check(set(clients["cam-2"].versions) == {"1.0.0"}, "cam-2 left 1.0.0")
        say(f"    cam-1 moved to {MODEL} 1.1.0 with 0 failed requests; cam-2 stayed on 1.0.0")

    def report(self) -> None:
        self.step("The device list")
        say(
            "    "
            + self.cli("mcp-controlplane", "devices", "list").rstrip().replace("\n", "\n    ")
        )
        self.step("cam-1's flight recorder: its deployment events as the control plane stored them")
        path = "/api/v1/devices/cam-1/events?limit=200"
        say(f'    $ curl -s -H "Authorization: Bearer $MCP_TOKEN" "$MCP_SERVER{path}"')

        def events() -> list[dict[str, Any]]:
            items: list[dict[str, Any]] = self.api(path)["items"]
            return items

        self.wait_for(
            "cam-1's 1.1.0 activation event at the control plane",
            lambda: any(
                (e["version"], e["phase"], e["outcome"]) == ("1.1.0", "active", "ok")
                for e in events()
            ),
            60,
            self.logs / "controlplane.log",
        )
        say(f"    {'seq':>4}  {'version':<8} {'phase':<12} {'outcome':<9} {'ms':>6}  detail")
        for e in events():
            if e["phase"] == "downloading" and e.get("bytes_total"):
                detail = f"{e.get('bytes_done') or 0} of {e['bytes_total']} bytes"
            else:
                detail = " ".join(str(x) for x in (e.get("cause"), e.get("message")) if x)
            ms = "" if e.get("elapsed_ms") is None else f"{e['elapsed_ms']:.0f}"
            say(
                f"    {e['event_seq']:>4}  {e['version']:<8} {e['phase']:<12} {e['outcome']:<9} "
                f"{ms:>6}  {detail}"
            )

    def rollout(self) -> None:
        self.step(
            f"Roll {MODEL} 1.2.0 out to group '{GROUP}' in two stages: one device first, gated "
            "on install failures, then the rest"
        )
        answer = json.loads(
            self.cli(
                "mcp-controlplane",
                "rollouts",
                "create",
                MODEL,
                "1.2.0",
                "--group",
                GROUP,
                "--stage",
                "1:bake=3s:gate=install_failure_rate<0.5,min_devices=1",
                "--stage",
                "rest:bake=0s",
                "--json",
            )
        )
        rollout_id = str(answer["id"])
        self.step(f"Watch rollout {rollout_id}: stages, devices and gates until it ends")
        out = self.cli(
            "mcp-controlplane", "rollouts", "watch", rollout_id, "--interval", "0.5s",
            timeout_s=180,
        )  # fmt: skip
        say("    " + out.strip().replace("\n", "\n    "))
        shown = self.api(f"/api/v1/rollouts/{rollout_id}")["rollout"]
        self.check(shown["status"] == "succeeded", f"rollout {rollout_id}: {shown['reason']}")
        for name in DEVICES:
            url = f"http://{HOST}:{self.agent_ports[name]}/v2/models/{MODEL}/infer"
            self.wait_for(
                f"{name} answering with 1.2.0",
                lambda url=url: self._answering(url) == "1.2.0",
                60,
                self.logs / f"{name}.log",
            )
        say(f"    rollout {rollout_id} succeeded: cam-1 and cam-2 run {MODEL} 1.2.0")

    def drift(self) -> None:
        self.step(
            f"A drift rule for {MODEL}: a retraining trigger when the fleet's input PSI "
            "passes 0.2 over 200 samples"
        )
        self.cli(
            "mcp-controlplane", "drift", "rules", "set", MODEL, "--metric", "input_psi",
            "--threshold", "0.2", "--min-devices", "1", "--min-samples", "200",
            "--sustained", "1", "--cooldown", "1h", "--window", "60s",
        )  # fmt: skip
        url = f"http://{HOST}:{self.agent_ports['cam-1']}/v2/models/{MODEL}/infer"
        inverted = np.load(self.work / "model/inverted.npy")[:400]
        self.step(
            "cam-1's sensor flips: it sends 400 inverted digits; the agent bins them on the "
            "bundle's baseline and reports two windows of 200"
        )
        for chunk in (inverted[:200], inverted[200:]):
            body = json.dumps(
                {"inputs": [{"name": "input", "shape": list(chunk.shape), "datatype": "FP32",
                             "data": [round(float(v), 4) for v in chunk.ravel()]}]}
            ).encode()  # fmt: skip
            status, answer = http_json(url, body=body)
            self.check(status == 200, f"cam-1 refused inverted digits (HTTP {status}): {answer}")
        self.wait_for(
            "a retraining trigger for digits",
            lambda: self._triggers() != [],
            60,
            self.logs / "controlplane.log",
        )
        trigger = self._triggers()[0]
        trigger_id = str(trigger["id"])
        score = trigger["score"]
        say(
            f"    trigger {trigger_id}: {MODEL} {trigger['version']}, input PSI "
            f"{'-' if score is None else f'{float(score):.2f}'} from "
            f"{trigger['device_count']} device(s)"
        )
        out = self.cli("mcp-controlplane", "drift", "show", MODEL, "--version", "1.2.0")
        say("    " + out.strip().replace("\n", "\n    "))
        self.step("The training pipeline got the signed webhook (signature and replay checked)")
        self.wait_for(
            "the retraining.triggered webhook at the pipeline",
            lambda: "retraining.triggered" in self._pipeline_events(),
            60,
            self.logs / "pipeline.log",
        )
        event = json.loads(self._pipeline_events().splitlines()[-1])
        say(f"    {self.hook_events}: {event['event']} delivery {event['delivery']}")
        self.step(f"Collect trigger {trigger_id}'s hard examples and download them as a dataset")
        out = self.cli("mcp-controlplane", "drift", "examples", "collect", trigger_id)
        say("    " + out.strip().replace("\n", "\n    "))
        dataset = self.work / "hard-examples"
        out = self.cli(
            "mcp-controlplane", "drift", "examples", "download", trigger_id, "-o", str(dataset),
            "--no-progress",
        )  # fmt: skip
        say("    " + out.strip().replace("\n", "\n    "))
        files = sorted(dataset.glob("*.npz"))
        self.check(files != [], f"no .npz dataset in {dataset}")
        with np.load(files[0], allow_pickle=False) as npz:
            inputs = npz["inputs"]
        sent = {row.tobytes() for row in inverted}
        self.check(
            len(inputs) > 0 and all(row.tobytes() in sent for row in inputs),
            f"the dataset's inputs are not the inverted digits cam-1 was sent ({dataset})",
        )
        say(f"    {len(inputs)} hard examples, each byte-identical to an input cam-1 was sent")

    def _triggers(self) -> list[dict[str, Any]]:
        found = self.api(f"/api/v1/drift/triggers?model={MODEL}")
        return list(found.get("items", []))

    def _pipeline_events(self) -> str:
        return self.hook_events.read_text() if self.hook_events.exists() else ""

    def _answering(self, url: str) -> str | None:
        status, answer = http_json(url, body=self.infer_body())
        return str(answer.get("model_version")) if status == 200 else None

    def summary(self) -> None:
        ports = self.agent_ports
        pids = {s.name: s.process.pid for s in self.services}
        request = self.work / "model/request.json"
        cam2 = f"http://{HOST}:{ports['cam-2']}"
        say(f"""
The fleet is running ({_took(self.started)} to set up). Logs: {self.logs}/
  control plane  {self.cp_url}   (admin API token in {self.token_file})
  web console    {self.cp_url}/ui/   (user admin, password in {self.admin_password})
  broker         mqtt://{HOST}:{self.broker_port}
  cam-1          http://{HOST}:{ports["cam-1"]}   ({MODEL} 1.2.0, pid {pids["cam-1"]})
  cam-2          {cam2}   ({MODEL} 1.2.0, pid {pids["cam-2"]})

Try, in another terminal (from any directory):
  export PATH={self.bin}:$PATH MCP_SERVER={self.cp_url} MCP_TOKEN=$(cat {self.token_file})
  mcp-controlplane devices list
  mcp-controlplane desired models cam-1                        # desired vs reported
  curl -s -H 'Content-Type: application/json' -d @{request} {cam2}/v2/models/{MODEL}/infer
  mcp-controlplane rollouts history 1                          # every decision and who made it
  mcp-controlplane rollouts rollback 1 --reason "try it"       # cam-1 back to 1.1.0, cam-2 to 1.0.0
  mcp-controlplane deploy {MODEL} 1.0.0 --device cam-1          # refused: a downgrade
  mcp-controlplane deploy {MODEL} 1.0.0 --device cam-1 --rollback
  mcp-agent updates --state-dir {self.work / "agents/cam-1"}  # what cam-1 has on disk
  mcp-controlplane desired show cam-1                          # the signed desired state
  mcp-controlplane audit                                       # who did what
  mcp-controlplane drift triggers list
  mcp-controlplane drift show {MODEL} --device cam-1            # cam-1's drift reports
  mcp-controlplane drift triggers ack 1 --note "retraining"    # acknowledge the trigger
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
        """Stop agents, then the control plane, then the broker (SIGTERM, SIGKILL after 20 s).

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
        self.agents()
        self.deploy_first()
        self.mqtt_inference()
        self.hot_swap()
        self.report()
        self.rollout()
        self.drift()


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
            say("demo: agents, control plane and broker stopped")
    return status


if __name__ == "__main__":
    sys.exit(main())
