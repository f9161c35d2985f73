"""``mcp-controlplane serve`` as real processes beside a real broker: a second serve on the same
data dir is refused before it touches the broker, replicas on one database keep their own
broker accounts whatever order they start and restart in, and ``/readyz`` and
``mcp_cp_broker_session_up`` say so when a broker session cannot log in."""

from __future__ import annotations

import signal
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from mcp_edge.tooling.models import DigitsModels
from mcp_edge.tooling.mosquitto import DynsecMosquittoBroker
from mcp_edge.tooling.processes import (
    AGENT,
    CONTROLPLANE,
    REPO,
    free_port,
    http_json,
    init_control_plane,
    process_env,
    serve_control_plane,
    stopped_at_exit,
    wait_until,
)
from tests.integration.conftest import dynsec_request

pytestmark = pytest.mark.mosquitto
ENV = process_env()


@dataclass
class Site:
    """One broker, the admin's API token, and the files every data dir's init needs."""

    broker: DynsecMosquittoBroker
    tmp: Path
    database_url: str
    token: str = ""

    def init(self, data: Path) -> None:
        """``init`` a data dir on the shared database; the first one creates the admin."""
        token = init_control_plane(
            data, self.broker, database_url=self.database_url, create_admin=not self.token
        )
        self.token = self.token or token

    def admin(self, commands: list[dict[str, object]]) -> list[dict[str, object]]:
        b = self.broker
        return dynsec_request(b.host, b.port, b.admin_username, b.admin_password, commands)


@dataclass
class Serve:
    proc: subprocess.Popen[str]
    url: str

    def ready(self) -> tuple[int, object]:
        return http_json(f"{self.url}/readyz")

    def session_metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as answer:
            text = answer.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("mcp_cp_broker_session_up{"):
                labels, value = line.rsplit(" ", 1)
                out[labels.split('session="')[1].split('"')[0]] = float(value)
        return out


@pytest.fixture
def site(fresh_dynsec_broker: DynsecMosquittoBroker, tmp_path: Path) -> Site:
    return Site(fresh_dynsec_broker, tmp_path, f"sqlite:///{tmp_path / 'shared.db'}")


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[str]]]:
    with stopped_at_exit() as procs:
        yield procs


def start_serve(
    data: Path, procs: list[subprocess.Popen[str]], *, env: dict[str, str] | None = None
) -> Serve:
    proc, url = serve_control_plane(data, procs, env=env or ENV)
    serve = Serve(proc, url)
    wait_until(lambda: serve.ready()[0] == 200, f"{url}/readyz ready", 60)
    return serve


def all_sessions_up(serve: Serve) -> bool:
    up = serve.session_metrics()
    names = {"ingest", "repository", "desired", "commands"}
    return set(up) == names and all(v == 1.0 for v in up.values())


def test_a_second_serve_on_the_same_data_dir_is_refused_and_the_first_keeps_working(
    site: Site,
    digits: DigitsModels,
    processes: list[subprocess.Popen[str]],
) -> None:
    data = site.tmp / "cp"
    site.init(data)
    first = start_serve(data, processes)
    assert all_sessions_up(first)

    second = subprocess.run(
        [*CONTROLPLANE, "serve", "--data-dir", str(data), "--listen", f"127.0.0.1:{free_port()}"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env=ENV,
    )
    assert second.returncode != 0
    assert "another mcp-controlplane serve is running" in second.stderr
    assert str(first.proc.pid) in second.stderr

    # The running replica's broker sessions were never reset: a device enrolled now comes
    # online through its ingestion, and it stays ready.
    token = subprocess.run(
        [
            *CONTROLPLANE,
            "tokens",
            "create",
            "--uses",
            "1",
            "--expires",
            "1h",
            "--server",
            first.url,
            "--token",
            site.token,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env=ENV,
    )
    assert token.returncode == 0, token.stderr
    state = site.tmp / "cam"
    enrolled = subprocess.run(
        [
            *AGENT,
            "enroll",
            "--server",
            first.url,
            "--token",
            token.stdout.strip().splitlines()[-1],
            "--device-id",
            "cam-1",
            "--state-dir",
            str(state),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env=ENV,
    )
    assert enrolled.returncode == 0, enrolled.stderr
    processes.append(
        subprocess.Popen(
            [
                *AGENT,
                "run",
                "--model-path",
                str(digits.onnx_path),
                "--port",
                str(free_port()),
                "--state-dir",
                str(state),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            text=True,
            cwd=REPO,
            env=ENV,
        )
    )

    def online() -> bool:
        code, body = http_json(f"{first.url}/api/v1/devices/cam-1", token=site.token)
        return code == 200 and isinstance(body, dict) and bool(body.get("online"))

    wait_until(online, "cam-1 online through the first replica's ingestion", 60)
    assert first.ready()[0] == 200 and all_sessions_up(first)


def test_readyz_and_the_metric_turn_unready_when_a_session_cannot_log_in(
    site: Site,
    processes: list[subprocess.Popen[str]],
) -> None:
    data = site.tmp / "cp"
    site.init(data)
    serve = start_serve(data, processes, env={**ENV, "MCP_REPLICA_NAME": "cp-test-a"})
    assert all_sessions_up(serve)

    # Someone resets the ingest account's password: Mosquitto drops the session and refuses
    # every login after it.
    site.admin(
        [
            {
                "command": "setClientPassword",
                "username": "svc-cp-test-a",
                "password": "not-the-replicas",
            }
        ]
    )
    # First the session is lost; the reconnect that follows is refused.
    wait_until(
        lambda: "refused the login" in get_text(f"{serve.url}/readyz")[1],
        "/readyz naming the refused login",
        30,
    )
    code, body = get_text(f"{serve.url}/readyz")
    assert code == 503
    assert "broker session ingest" in body and "refused the login" in body, body
    up = serve.session_metrics()
    assert up["ingest"] == 0.0 and up["repository"] == 1.0 and up["desired"] == 1.0


def get_text(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_two_replicas_on_one_database_start_and_restart_in_any_order(
    site: Site,
    processes: list[subprocess.Popen[str]],
) -> None:
    a_dir, b_dir = site.tmp / "cp-a", site.tmp / "cp-b"
    site.init(a_dir)
    site.init(b_dir)
    a = start_serve(a_dir, processes)
    b = start_serve(b_dir, processes)
    assert all_sessions_up(a) and all_sessions_up(b)
    (listed,) = site.admin([{"command": "listClients"}])
    accounts = set(listed["data"]["clients"])  # type: ignore[index]
    assert len({u for u in accounts if u.startswith("svc-cp-") and u.endswith("-desired")}) == 2

    a.proc.terminate()
    a.proc.wait(timeout=30)
    a = start_serve(a_dir, processes)
    assert all_sessions_up(b) and all_sessions_up(a)

    b.proc.send_signal(signal.SIGKILL)
    b.proc.wait(timeout=30)
    b = start_serve(b_dir, processes)
    assert all_sessions_up(a) and all_sessions_up(b)
    assert a.ready()[0] == 200 and b.ready()[0] == 200
