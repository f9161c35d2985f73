"""A real fleet for the browser tests: Mosquitto with dynamic security, ``mcp-controlplane
serve`` (SQLite) and two enrolled agents (``mcp-agent run``), with signed model bundles
published and the REST calls the tests use to set things up and to check what the console
shows against what the API says.

- Group :data:`GROUP` holds the agents :data:`AGENTS`; both run :data:`SENSOR` 1.0.0, a digits
  classifier whose bundle carries a drift baseline (the training split's pixels).
- :data:`SENSOR`'s drift rule raises a trigger on the first window (200 requests) whose input
  PSI passes 0.2 and has no cooldown, so :meth:`ConsoleFleet.drift` raises one each time: it
  sends 200 inverted digits to an agent, which bins them, reports the window over MQTT, and the
  control plane's drift service raises the trigger.
- Further models (:data:`ROLLOUT_MODELS`) are published, never deployed, for rollouts.
"""

from __future__ import annotations

import functools
import json
import subprocess
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mcp_edge.controlplane.settings import SQLITE_FILE
from mcp_edge.shared.bundle import build_bundle, sign_bundle
from mcp_edge.shared.bundle.upload import upload_bundle
from mcp_edge.shared.signing import PrivateKey
from mcp_edge.tooling.models import DigitsModels
from mcp_edge.tooling.mosquitto import DynsecMosquittoBroker
from mcp_edge.tooling.processes import (
    ADMIN_PASSWORD,
    AGENT,
    REPO,
    free_port,
    init_control_plane,
    process_env,
    serve_control_plane,
    stopped_at_exit,
    wait_until,
)
from tests.integration.conftest import ACL_KINDS, set_default_acl_access
from tests.support.rest import AdminRest

GROUP = "ui-lab"
AGENTS = ("edge-1", "edge-2")
SENSOR = "sensor"
ROLLOUT_MODELS = ("vision", "vision-b", "spare")
VERSION = "1.0.0"
PUBLISHER = "vision-team"
DRIFT_RULE = {"metric": "input_psi", "threshold": 0.2, "min_devices": 1, "min_samples": 100,
              "sustained": 1, "cooldown_s": 0, "window_s": 60}  # fmt: skip
DRIFT_WINDOW = 200
"""Requests in an agent's drift window (the default policy's ``window_requests``)."""

Json = dict[str, Any]


@dataclass
class ConsoleFleet(AdminRest):
    """The running control plane and agents, and REST calls as the admin."""

    url: str
    token: str
    work: Path
    digits: DigitsModels
    ports: dict[str, int] = field(default_factory=dict)
    logs: dict[str, Path] = field(default_factory=dict)
    procs: list[subprocess.Popen[str]] = field(default_factory=list)
    admin_password: str = ADMIN_PASSWORD

    def wait(self, predicate: Callable[[], Any], what: str, timeout_s: float) -> None:
        """:func:`wait_until`, with the processes' logs in the failure."""
        try:
            wait_until(predicate, what, timeout_s)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{self.log_tail()}") from None

    def log_tail(self, chars: int = 3000) -> str:
        return "\n".join(
            f"--- {name}\n{path.read_text(errors='replace')[-chars:]}"
            for name, path in self.logs.items()
            if path.exists()
        )

    # -------------------------------------------------------------- what the API says
    def devices(self) -> dict[str, Json]:
        items = self.get("/api/v1/devices?limit=1000")["items"]
        return {d["id"]: d for d in items}

    def online(self) -> list[str]:
        return sorted(d for d, v in self.devices().items() if v["online"])

    def active(self, device: str, model: str) -> str | None:
        for item in self.get(f"/api/v1/devices/{device}/models")["items"]:
            if item["model"] == model:
                version = (item["reported"] or {}).get("active_version")
                return str(version) if version is not None else None
        return None

    def rollout(self, rollout_id: int) -> Json:
        answer: Json = self.get(f"/api/v1/rollouts/{rollout_id}")["rollout"]
        return answer

    def rollouts(self) -> list[Json]:
        items: list[Json] = self.get("/api/v1/rollouts")["items"]
        return items

    def triggers(self) -> list[Json]:
        items: list[Json] = self.get("/api/v1/drift/triggers")["items"]
        return items

    def pending(self) -> list[str]:
        return [d["id"] for d in self.get("/api/v1/approvals")["items"]]

    @property
    def database_url(self) -> str:
        """The control plane's SQLite database (``mcp-controlplane init``'s default)."""
        return f"sqlite:///{(self.work / 'cp' / SQLITE_FILE).resolve()}"

    def last_audit_id(self) -> int:
        items = self.get("/api/v1/audit?limit=1")["items"]
        return int(items[0]["id"]) if items else 0

    def state(self) -> Json:
        """What a console action could change, as the API shows it (not what moves by
        itself: online flags, last-seen times, a running rollout's devices)."""
        return {
            "devices": {k: (v["status"], v["labels"]) for k, v in self.devices().items()},
            "pending": self.pending(),
            "tokens": [(t["id"], t["state"], t["description"])
                       for t in self.get("/api/v1/enrollment-tokens")["items"]],
            "rollouts": [(r["id"], r["status"]) for r in self.rollouts()],
            "triggers": [(t["id"], t["status"], t["note"]) for t in self.triggers()],
            "api_tokens": [(t["id"], t["revoked_at"])
                           for t in self.get("/api/v1/api-tokens")["items"]],
        }  # fmt: skip

    # -------------------------------------------------------------- making things happen
    def publish(self, key: PrivateKey, model: str, version: str = VERSION) -> None:
        """Build, sign and push the digits model as ``model`` ``version``, with its baseline."""
        baseline = self.work / "baseline.npy"
        if not baseline.exists():
            np.save(baseline, np.asarray(self.digits.mlp.X_train, dtype=np.float32))
        bundle = self.work / f"{model}-{version}.mcpb"
        build_bundle(
            self.digits.onnx_path, bundle, name=model, version=version, baseline_npy=baseline
        )
        sign_bundle(bundle, key)
        status, answer = upload_bundle(self.url, self.token, bundle, timeout=60, progress=False)
        assert status == 201, f"push {model} {version}: {status} {answer}"

    def deploy(self, model: str, version: str = VERSION) -> None:
        """Make ``version`` the group's version of ``model``; wait until every agent runs it."""
        body = {"model": model, "version": version, "selector": {"group": GROUP}}
        self.post("/api/v1/deployments", body, 201)
        for device in AGENTS:
            self.wait(
                functools.partial(self.runs, device, model, version),
                f"{device} running {model} {version}",
                90,
            )

    def runs(self, device: str, model: str, version: str) -> bool:
        return self.active(device, model) == version

    def create_rollout(self, model: str, stages: list[Json]) -> int:
        spec = {"model": model, "version": VERSION, "target": {"group": GROUP}, "stages": stages}
        rollout = self.post("/api/v1/rollouts", spec, 201)["rollout"]
        return int(rollout["id"])

    def drift(self, device: str = AGENTS[0]) -> None:
        """Send ``device`` one drift window of inverted digits (a flipped sensor)."""
        x = 1.0 - self.digits.X_test[:DRIFT_WINDOW].astype(np.float32)
        tensor = {"name": "input", "shape": list(x.shape), "datatype": "FP32",
                  "data": [round(float(v), 4) for v in x.ravel()]}  # fmt: skip
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.ports[device]}/v2/models/{SENSOR}/infer",
            json.dumps({"inputs": [tensor]}).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as answer:
            assert answer.status == 200

    def enroll(self, device: str, token: str, *, wait_s: float = 0) -> subprocess.Popen[str]:
        """Start ``mcp-agent enroll`` of ``device`` (its state in ``work/device``)."""
        proc = subprocess.Popen(
            [*AGENT, "enroll", "--server", self.url, "--token", token, "--device-id", device,
             "--state-dir", str(self.work / device), "--wait", str(wait_s)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
            env=process_env(),
        )  # fmt: skip
        self.procs.append(proc)
        return proc

    # -------------------------------------------------------------- things some tests need
    def any_rollout(self) -> int:
        """A rollout's id: the newest, or a new one of ``spare`` that waits in its first
        stage's bake (a running rollout)."""
        found = self.rollouts()
        if found:
            return int(found[0]["id"])
        stages = [{"count": 1, "bake_s": 3600}, {"percent": 100, "bake_s": 0}]
        return self.create_rollout("spare", stages)

    def any_trigger(self) -> int:
        """A retraining trigger's id: the newest, or one raised by :meth:`drift`."""
        if not self.triggers():
            self.drift()
            self.wait(lambda: self.triggers() != [], "a retraining trigger", 60)
        return int(self.triggers()[0]["id"])


def _start_agent(state: Path, port: int, log: Path) -> subprocess.Popen[str]:
    with log.open("w") as out:
        return subprocess.Popen(
            [*AGENT, "run", "--port", str(port), "--state-dir", str(state),
             "--health-interval", "2", "--stats-interval", "2"],
            stdout=subprocess.DEVNULL, stderr=out, text=True, cwd=REPO, env=process_env(),
        )  # fmt: skip


@contextmanager
def console_fleet(work: Path, digits: DigitsModels) -> Iterator[ConsoleFleet]:
    """Start the fleet described in the module docstring in ``work``; stop it at exit."""
    (work / "broker").mkdir()
    broker = DynsecMosquittoBroker(work / "broker")
    with broker, stopped_at_exit() as procs:
        set_default_acl_access(broker, dict.fromkeys(ACL_KINDS, False))
        data = work / "cp"
        token = init_control_plane(data, broker)
        logs = {"controlplane": work / "controlplane.log"}
        with logs["controlplane"].open("w") as cp_log:
            env = {**process_env(), "MCP_INFERENCE_INTERVAL_S": "2"}
            _, url = serve_control_plane(data, procs, env=env, stderr=cp_log.fileno())
        fleet = ConsoleFleet(url, token, work, digits, logs=logs, procs=procs)
        key = PrivateKey.generate()
        fleet.post(
            "/api/v1/publishers", {"name": PUBLISHER, "public_key": key.public_key.raw.hex()}, 201
        )
        enroll_token = fleet.post(
            "/api/v1/enrollment-tokens",
            {"group": GROUP, "max_uses": len(AGENTS), "expires_in_s": 3600,
             "description": "browser test fleet"},
            201,
        )["token"]  # fmt: skip
        enrolling = {d: fleet.enroll(d, enroll_token) for d in AGENTS}
        for model in (SENSOR, *ROLLOUT_MODELS):
            fleet.publish(key, model)
        for device, proc in enrolling.items():
            out, err = proc.communicate(timeout=90)
            assert proc.returncode == 0 and f"enrolled as {device}" in out, err
        for device in AGENTS:
            fleet.ports[device] = free_port()
            logs[device] = work / f"{device}.log"
            procs.append(_start_agent(work / device, fleet.ports[device], logs[device]))
        fleet.wait(lambda: fleet.online() == sorted(AGENTS), "both agents online", 90)
        status, answer = fleet.call("PUT", f"/api/v1/drift/rules/{SENSOR}", DRIFT_RULE)
        assert status == 200, answer
        fleet.deploy(SENSOR)
        yield fleet
