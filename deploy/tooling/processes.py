"""Helpers for tests that run the real command-line programs as processes."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mcp_edge.shared.netutil import free_port_below_ephemeral

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
