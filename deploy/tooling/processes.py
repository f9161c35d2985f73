"""Helpers for tests that run the real command-line programs as processes."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mcp_edge.shared.netutil import free_port_below_ephemeral

if TYPE_CHECKING:
    from mcp_edge.tooling.mosquitto import DynsecMosquittoBroker

REPO = Path(__file__).resolve().parents[2]
AGENT = [sys.executable, "-m", "mcp_edge.agent.cli"]
CONTROLPLANE = [sys.executable, "-m", "mcp_edge.controlplane.cli"]
BUNDLE = [sys.executable, "-m", "mcp_edge.shared.bundle_cli"]


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago, below the ephemeral range: a client
    polling a server that is not up yet (or restarting) cannot connect to itself there."""
    return free_port_below_ephemeral("127.0.0.1")


def wait_until(predicate: Callable[[], Any], what: str, timeout_s: float = 30.0) -> None:
    """Poll ``predicate`` until it is truthy; fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@contextmanager
def stopped_at_exit() -> Iterator[list[subprocess.Popen[str]]]:
    """A list to append started processes to; each is terminated (then killed) at exit."""
    procs: list[subprocess.Popen[str]] = []
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(timeout=10)


def http_json(url: str, *, body: bytes | None = None, token: str | None = None) -> tuple[int, Any]:
    """GET (or POST `body` as JSON) and decode the JSON answer; raises OSError when unreachable."""
    headers = {"Content-Type": "application/json"} if body is not None else {}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url, data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, json.loads(answer.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, None


class Client(threading.Thread):
    """Sends the same inference request back to back; counts answers by version and failures."""

    def __init__(self, url: str, body: bytes) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.versions: list[str] = []
        self.failures: list[str] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                status, answer = http_json(self.url, body=self.body)
                if status != 200:
                    self.failures.append(f"HTTP {status}")
                else:
                    self.versions.append(answer["model_version"])
            except (OSError, ValueError, KeyError, TypeError) as e:
                self.failures.append(repr(e))


ADMIN_PASSWORD = "correct horse battery staple"
"""The first admin's password in every control plane these helpers initialize."""


def process_env() -> dict[str, str]:
    """The environment the command-line programs run with: this one, the checkout importable."""
    return {**os.environ, "PYTHONPATH": str(REPO)}


def init_control_plane(
    data: Path,
    broker: DynsecMosquittoBroker,
    *,
    database_url: str | None = None,
    create_admin: bool = True,
    env: dict[str, str] | None = None,
) -> str:
    """``mcp-controlplane init`` of ``data`` with ``broker``'s dynamic-security admin (its
    password in a 0600 file beside ``data``) as the broker to provision and the one devices
    use; with ``create_admin`` also the first admin (password :data:`ADMIN_PASSWORD`).

    Returns the admin's API token ("" without ``create_admin``). Raises AssertionError with
    the program's stderr when init fails.
    """
    url = f"mqtt://{broker.host}:{broker.port}"
    secret = data.parent / "broker-admin.pw"
    secret.write_text(broker.admin_password)
    secret.chmod(0o600)
    admin: tuple[str, ...] = ()
    if create_admin:
        admin_pw = data.parent / "admin.pw"
        admin_pw.write_text(ADMIN_PASSWORD)
        admin = ("--admin-user", "admin", "--admin-password-file", str(admin_pw))
    database: tuple[str, ...] = ("--database-url", database_url) if database_url else ()
    done = subprocess.run(
        [*CONTROLPLANE, "init", "--data-dir", str(data), *database, "--broker-url", url,
         "--broker-admin-url", url, "--broker-admin-user", broker.admin_username,
         "--broker-admin-password-file", str(secret), *admin],
        capture_output=True, text=True, timeout=120, cwd=REPO, env=env or process_env(),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1] if create_admin else ""


def serve_control_plane(
    data: Path,
    procs: list[subprocess.Popen[str]],
    *,
    env: dict[str, str] | None = None,
    stderr: int | None = None,
) -> tuple[subprocess.Popen[str], str]:
    """Start ``mcp-controlplane serve`` of ``data`` on a free port (appended to ``procs``) and
    return it with the URL it printed once listening. Its log goes to ``stderr`` when given, else
    to ``{data}.serve.log`` beside the data dir (never to a pipe nobody reads: a full pipe would
    stall the server). Raises AssertionError (with the log's end) if it exits instead."""
    log_path = data.parent / f"{data.name}.serve.log"
    with contextlib.ExitStack() as stack:
        target = stderr if stderr is not None else stack.enter_context(log_path.open("ab"))
        proc = subprocess.Popen(
            [*CONTROLPLANE, "serve", "--data-dir", str(data), "--listen", f"127.0.0.1:{free_port()}"],
            stdout=subprocess.PIPE, stderr=target, text=True, cwd=REPO, env=env or process_env(),
        )  # fmt: skip
    procs.append(proc)
    assert proc.stdout is not None
    url = proc.stdout.readline().strip()
    if not url.startswith("http://"):
        why = url
        if proc.poll() is not None and stderr is None:
            why = log_path.read_text(errors="replace")[-4000:]
        elif proc.poll() is not None and proc.stderr is not None:
            why = proc.stderr.read()
        raise AssertionError(f"mcp-controlplane serve did not start: {why}")
    return proc, url
