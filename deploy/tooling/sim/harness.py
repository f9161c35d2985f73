"""Driving a simulated fleet from a test or a bench: the real programs as processes.

- :func:`publish_model` registers a publisher key and pushes signed bundles of one model file
  as versions of a model (``mcp-bundle keygen/build/sign/push``, ``mcp-controlplane
  publishers add``), as an ML team does;
- :func:`api` calls the control plane's REST API with a token;
- :class:`SimProcess` runs ``python -m mcp_edge.tooling.sim run`` with a status file and reads
  it back (:meth:`SimProcess.status`, :meth:`SimProcess.wait_for`); :func:`sim_enroll` runs
  ``enroll``;
- :class:`Stack` is a broker and a control plane kept in one work directory, started again on
  the same port, data and accounts by a later run (enrolling 10,000 devices is done once);
  its broker queues like ``deploy/mosquitto/mosquitto.conf`` (:class:`ProductionQueues`), not
  like Mosquitto's defaults, which drop a busy control plane's messages beyond 1,000.

Every wait is bounded and fails naming what it waited for, with the simulator's last output.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

from mcp_edge.tooling.mosquitto import DynsecMosquittoBroker
from mcp_edge.tooling.processes import (
    ADMIN_PASSWORD,
    BUNDLE,
    CONTROLPLANE,
    REPO,
    init_control_plane,
    process_env,
    serve_control_plane,
)

SIM = [sys.executable, "-m", "mcp_edge.tooling.sim"]
MAX_STATUS_BYTES = 64 * 1024 * 1024


def run_cli(*args: object, timeout_s: float = 300.0, env: dict[str, str] | None = None) -> str:
    """Run a command line to completion; return its stdout. Raises RuntimeError with its
    output when it fails."""
    done = subprocess.run(
        [str(a) for a in args], capture_output=True, text=True, timeout=timeout_s, cwd=REPO,
        env=env or process_env(),
    )  # fmt: skip
    if done.returncode != 0:
        shown = " ".join(str(a) for a in args[2:6])
        raise RuntimeError(f"{shown}… exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return done.stdout


def publish_model(
    cp_url: str, token: str, model_file: Path, name: str, versions: Sequence[str], work: Path
) -> dict[str, Path]:
    """Sign and push ``model_file`` as each of ``versions`` of ``name``; return the bundles.

    The publisher key is made (and registered) once per ``work`` directory.
    """
    auth = ("--server", cp_url, "--token", token)
    key = work / "publisher.key"
    if not key.exists():
        run_cli(*BUNDLE, "keygen", "--out", key)
        run_cli(*CONTROLPLANE, "publishers", "add", key, "--name", "sim-publisher", *auth)
    bundles = {}
    for version in versions:
        path = work / f"{name}-{version}.mcpb"
        run_cli(*BUNDLE, "build", model_file, "--name", name, "--version", version, "-o", path)
        run_cli(*BUNDLE, "sign", path, "--key", key)
        run_cli(*BUNDLE, "push", path, *auth)
        bundles[version] = path
    return bundles


def api(
    cp_url: str, token: str, method: str, path: str, body: Any = None, *, timeout_s: float = 60.0
) -> tuple[int, Any]:
    """One REST call; returns ``(status, decoded JSON or None)``. Raises OSError when the
    control plane cannot be reached."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    if data is not None:
        headers["Content-Type"] = "application/json"
    request = urllib.request.Request(f"{cp_url}{path}", data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as answer:
            return answer.status, json.loads(answer.read() or b"null")
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw or b"null")
        except ValueError:
            return e.code, raw[:500].decode("utf-8", "replace")


def sim_enroll(
    cp_url: str, token: str, devices: int, state_dir: Path, *extra: str, timeout_s: float = 3600
) -> str:
    """``mcp-sim enroll``; returns its output."""
    return run_cli(*SIM, "enroll", "--control-plane", cp_url, "--token", token, "--devices",
                   devices, "--state-dir", state_dir, *extra, timeout_s=timeout_s)  # fmt: skip


class SimProcess:
    """``mcp-sim run`` as a process with a status file; ``stop`` ends it with SIGTERM."""

    def __init__(self, state_dir: Path, status_file: Path, *args: str, log: Path) -> None:
        self.status_file = status_file
        self.log_path = log
        self._log: IO[bytes] = log.open("wb")
        self.proc = subprocess.Popen(
            [*SIM, "run", "--state-dir", str(state_dir), "--status-file", str(status_file),
             *args],
            stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO, env=process_env(),
        )  # fmt: skip

    @property
    def pid(self) -> int:
        return self.proc.pid

    def status(self) -> dict[str, Any] | None:
        """The last status the simulator wrote, or None before the first."""
        try:
            with self.status_file.open("rb") as f:
                data = f.read(MAX_STATUS_BYTES)
        except FileNotFoundError:
            return None
        try:
            doc = json.loads(data)
        except ValueError:
            return None
        return doc if isinstance(doc, dict) else None

    def output(self, last: int = 4000) -> str:
        """The last ``last`` bytes the simulator printed."""
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_bytes()[-last:].decode("utf-8", "replace")

    def wait_for(
        self, predicate: Callable[[dict[str, Any]], bool], what: str, timeout_s: float
    ) -> dict[str, Any]:
        """Poll the status file until ``predicate`` holds; return that status. Raises
        AssertionError naming ``what`` (with the simulator's output) on timeout or exit."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"mcp-sim exited ({self.proc.returncode}) while waiting "
                                     f"for {what}:\n{self.output()}")  # fmt: skip
            doc = self.status()
            if doc is not None and predicate(doc):
                return doc
            time.sleep(0.1)
        raise AssertionError(f"timed out after {timeout_s} s waiting for {what}; last status "
                             f"{json.dumps(self.status())[:2000]}\n{self.output()}")  # fmt: skip

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM, then SIGKILL after ``timeout_s``; returns the exit status."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        self._log.close()
        return self.proc.returncode


def active_count(status: dict[str, Any], model: str, version: str, role: str = "active") -> int:
    """How many devices the status says report ``version`` of ``model`` in ``role``."""
    return int(status.get("models", {}).get(model, {}).get(role, {}).get(version, 0))


class ProductionQueues(DynsecMosquittoBroker):
    """A dynamic-security broker with the queue and size limits of
    ``deploy/mosquitto/mosquitto.conf`` (Mosquitto's default ``max_queued_messages 1000``
    drops repository requests and telemetry for a control plane busy with thousands of
    devices)."""

    def _config_lines(self) -> list[str]:
        return [
            *super()._config_lines(), "max_queued_messages 100000",
            "max_queued_bytes 67108864", "max_packet_size 34603008",
            "message_size_limit 33554432", "max_keepalive 300",
        ]  # fmt: skip


class Stack:
    """Mosquitto (dynamic security, :class:`ProductionQueues`) and ``mcp-controlplane serve``
    kept in ``work``; :meth:`start` initializes them the first time and starts them again on
    the same port, data and accounts later. ``cp_env`` is added to the control plane's
    environment. Use as a context manager; the control plane's log is ``work/cp.log``."""

    def __init__(self, work: Path, *, cp_env: dict[str, str] | None = None) -> None:
        self.work = work
        self.cp_env = cp_env or {}
        self.state_file = work / "stack.json"
        self.broker: DynsecMosquittoBroker | None = None
        self.cp: subprocess.Popen[str] | None = None
        self.url = ""
        self.token = ""
        self.reused = False
        self._procs: list[subprocess.Popen[str]] = []

    def start(self) -> None:
        """Start both; raises RuntimeError naming what failed."""
        self.work.mkdir(parents=True, exist_ok=True)
        (self.work / "broker").mkdir(exist_ok=True)
        saved = json.loads(self.state_file.read_text()) if self.state_file.exists() else None
        self.reused = saved is not None
        broker = ProductionQueues(self.work / "broker", port=saved["port"] if saved else None)
        if saved is not None:
            broker.admin_password = saved["broker_admin_password"]
        broker.start()
        self.broker = broker
        env = {**process_env(), **self.cp_env}
        if saved is None:
            self.token = init_control_plane(self.work / "cp", broker, env=env)
            self.state_file.write_text(json.dumps(
                {"port": broker.port, "broker_admin_password": broker.admin_password}))  # fmt: skip
            self.state_file.chmod(0o600)
        with (self.work / "cp.log").open("ab") as log:
            self.cp, self.url = serve_control_plane(self.work / "cp", self._procs, env=env,
                                                    stderr=log.fileno())  # fmt: skip
        if saved is not None:
            status, answer = api(self.url, "", "POST", "/api/v1/auth/login",
                                 {"username": "admin", "password": ADMIN_PASSWORD})  # fmt: skip
            if status != 201 or not isinstance(answer, dict):
                raise RuntimeError(f"cannot log in to the reused control plane: {answer}")
            self.token = str(answer["token"])

    def stop(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)
        if self.broker is not None:
            self.broker.stop()

    def __enter__(self) -> Stack:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
