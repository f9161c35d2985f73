"""``mcp-controlplane`` as an operator uses it: `init` makes a data dir and prints an API token;
the fleet commands talk to a real server on a loopback port; `serve` runs as a process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from mcp_edge.controlplane.cli import main
from mcp_edge.controlplane.db.migrate import head_revision
from mcp_edge.controlplane.settings import load_settings
from mcp_edge.shared.signing import PrivateKey
from tests.support.controlplane import FakeClock, FakeProvisioner, envelope, served

CLI = [sys.executable, "-m", "mcp_edge.controlplane.cli"]
PASSWORD = "admin-password-1"


@dataclass
class Fleet:
    url: str
    token: str
    data_dir: Path
    provisioner: FakeProvisioner
    clock: FakeClock

    def run(self, *args: str, token: str | None = None, ok: bool = True) -> Result:
        """Run a CLI command with MCP_SERVER / MCP_TOKEN set (the admin's token by default)."""
        env = {"MCP_SERVER": self.url, "MCP_TOKEN": token or self.token}
        result = CliRunner(env=env).invoke(main, list(args), catch_exceptions=False)
        if ok:
            assert result.exit_code == 0, result.output
        return result

    def enroll(self, token: str, **kwargs: object) -> dict[str, object]:
        body = json.dumps(envelope(PrivateKey.generate(), token, now=self.clock(), **kwargs))
        req = urllib.request.Request(
            self.url + "/api/v1/enroll",
            data=body.encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=10) as response:
            return dict(json.loads(response.read()))


def _init(data_dir: Path, tmp_path: Path, *extra: str) -> Result:
    password_file = tmp_path / "admin.pw"
    password_file.write_text(PASSWORD + "\n")
    return CliRunner().invoke(
        main,
        ["init", "--data-dir", str(data_dir), "--admin-password-file", str(password_file), *extra],
        catch_exceptions=False,
    )


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    data_dir = tmp_path / "cp"
    result = _init(
        data_dir, tmp_path, "--listen", "127.0.0.1:0", "--broker-url", "mqtts://broker.test:8883"
    )
    assert result.exit_code == 0, result.output
    token = result.stdout.strip().splitlines()[-1]
    assert token.startswith("mcpa_")
    settings = load_settings(data_dir, environ={})
    provisioner, clock = FakeProvisioner(), FakeClock()
    with served(settings, provisioner, clock) as url:
        yield Fleet(url, token, data_dir, provisioner, clock)


def test_init_writes_a_private_data_dir_and_is_idempotent(tmp_path: Path) -> None:
    data_dir = tmp_path / "cp"
    first = _init(data_dir, tmp_path, "--broker-url", "mqtts://b.example:8883")
    assert first.exit_code == 0, first.output
    assert first.stdout.strip().startswith("mcpa_")
    assert "shown once" in first.stderr
    assert (data_dir.stat().st_mode & 0o777) == 0o700
    assert (data_dir / "controlplane.db").exists()
    config = (data_dir / "controlplane.toml").read_text()
    assert 'broker_urls = ["mqtts://b.example:8883"]' in config
    second = CliRunner().invoke(main, ["init", "--data-dir", str(data_dir)])
    assert second.exit_code == 0 and second.stdout == ""
    assert "no admin created" in second.stderr
    third = _init(data_dir, tmp_path, "--admin-user", "admin")
    assert third.exit_code == 1 and "already exists" in third.output


def test_tokens_devices_and_users_through_the_cli(fleet: Fleet, tmp_path: Path) -> None:
    created = fleet.run(
        "tokens",
        "create",
        "--group",
        "line-a",
        "--labels",
        "site=f1",
        "--uses",
        "5",
        "--expires",
        "7d",
    )
    enrollment_token = created.stdout.strip().splitlines()[-1]
    assert enrollment_token.startswith("mcpe_") and "5 uses" in created.stderr
    a = fleet.enroll(enrollment_token, device_id="cam-a", labels={"rack": "1"})
    b = fleet.enroll(enrollment_token, device_id="cam-b", profile="raspberry-pi")
    assert a["status"] == b["status"] == "accepted"
    assert a["broker"]["urls"] == ["mqtts://broker.test:8883"]  # type: ignore[index]

    listing = fleet.run("devices", "list").stdout
    assert "cam-a" in listing and "cam-b" in listing and "site=f1" in listing
    only_pi = fleet.run("devices", "list", "--profile", "raspberry-pi").stdout
    assert "cam-b" in only_pi and "cam-a" not in only_pi
    only_rack = json.loads(fleet.run("devices", "list", "--label", "rack=1", "--json").stdout)
    assert [d["id"] for d in only_rack["items"]] == ["cam-a"]

    labelled = fleet.run("devices", "label", "cam-a", "env=prod", "rack-").stdout
    assert labelled.strip() == "cam-a: env=prod,site=f1"
    shown = json.loads(fleet.run("devices", "show", "cam-a", "--json").stdout)
    assert shown["labels"] == {"env": "prod", "site": "f1"} and shown["facts"]["os"] == "linux"

    assert "revoked" in fleet.run("devices", "revoke", "cam-b", "--reason", "stolen").stdout
    assert fleet.provisioner.disabled == ["cam-b"]
    revoked = fleet.run("devices", "list", "--status", "revoked").stdout
    assert "cam-b" in revoked and "cam-a" not in revoked

    tokens = fleet.run("tokens", "list").stdout
    assert "2/5" in tokens and "active" in tokens and enrollment_token not in tokens
    token_id = json.loads(fleet.run("tokens", "list", "--json").stdout)[0]["id"]
    assert "revoked" in fleet.run("tokens", "revoke", str(token_id)).stdout

    pw = tmp_path / "vera.pw"
    pw.write_text("vera-password\n")
    fleet.run("users", "create", "vera", "--role", "viewer", "--password-file", str(pw))
    assert "vera" in fleet.run("users", "list").stdout
    logged_in = CliRunner().invoke(
        main, ["login", "--server", fleet.url, "-u", "vera", "--password-file", str(pw)]
    )
    assert logged_in.exit_code == 0, logged_in.output
    viewer_token = logged_in.stdout.strip()
    denied = fleet.run("tokens", "create", token=viewer_token, ok=False)
    assert denied.exit_code == 1 and "needs the operator role" in denied.output
    assert "cam-a" in fleet.run("devices", "list", token=viewer_token).stdout

    audit = fleet.run("audit", "--limit", "100").stdout
    for action in (
        "device.revoked",
        "device.labels_changed",
        "enrollment_token.revoked",
        "user.created",
    ):
        assert action in audit


def test_pending_approve_reject_and_preauthorize(fleet: Fleet) -> None:
    token = fleet.run("tokens", "create", "--approval", "manual").stdout.strip().splitlines()[-1]
    assert fleet.enroll(token, device_id="gate-1")["status"] == "pending"
    assert fleet.enroll(token, device_id="gate-2")["status"] == "pending"
    pending = fleet.run("devices", "pending").stdout
    assert "gate-1" in pending and "gate-2" in pending
    assert "accepted" in fleet.run("devices", "approve", "gate-1").stdout
    assert "rejected" in fleet.run("devices", "reject", "gate-2", "--reason", "no").stdout
    again = fleet.run("devices", "approve", "gate-2", ok=False)
    assert again.exit_code == 1 and "not pending" in again.output

    key = PrivateKey.generate()
    out = fleet.run(
        "devices",
        "preauthorize",
        "--public-key",
        key.public_key.raw.hex(),
        "--device-id",
        "kiosk-1",
        "--labels",
        "site=hq",
    ).stdout
    assert "kiosk-1: preauthorized" in out


def test_env_vars_and_clear_errors(fleet: Fleet) -> None:
    env = {"MCP_SERVER": fleet.url, "MCP_TOKEN": fleet.token}
    result = CliRunner(env=env).invoke(main, ["devices", "list"])
    assert result.exit_code == 0 and result.stdout.startswith("ID")
    no_token = CliRunner(env={"MCP_SERVER": fleet.url, "MCP_TOKEN": ""}).invoke(
        main, ["devices", "list"]
    )
    assert no_token.exit_code == 1 and "no API token" in no_token.output
    bad = CliRunner(env={"MCP_SERVER": fleet.url, "MCP_TOKEN": "mcpa_wrong"}).invoke(
        main, ["devices", "list"]
    )
    assert bad.exit_code == 1 and "unknown API token (HTTP 401)" in bad.output
    missing = CliRunner(env=env).invoke(main, ["devices", "show", "ghost"])
    assert missing.exit_code == 1 and "no device 'ghost' (HTTP 404)" in missing.output
    bad_duration = CliRunner(env=env).invoke(main, ["tokens", "create", "--expires", "soon"])
    assert bad_duration.exit_code == 2 and "unit" in bad_duration.output
    unreachable = CliRunner().invoke(
        main, ["devices", "list", "--server", "http://127.0.0.1:9", "--token", "x"]
    )
    assert unreachable.exit_code == 1 and "cannot reach http://127.0.0.1:9" in unreachable.output


def test_serve_runs_as_a_process(tmp_path: Path) -> None:
    data_dir = tmp_path / "cp"
    env = {**os.environ, "MCP_DATA_DIR": str(data_dir)}
    pw = tmp_path / "pw"
    pw.write_text(PASSWORD)
    init = subprocess.run(
        [*CLI, "init", "--admin-password-file", str(pw), "--listen", "127.0.0.1:0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert init.returncode == 0, init.stderr
    token = init.stdout.strip()
    server = subprocess.Popen(
        [*CLI, "serve"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None
        url = server.stdout.readline().strip()  # printed once the socket listens
        assert url.startswith("http://127.0.0.1:"), server.stderr.read() if server.stderr else ""
        with urllib.request.urlopen(url + "/readyz", timeout=10) as response:
            assert json.loads(response.read())["schema_revision"] == head_revision()
        listed = subprocess.run(
            [*CLI, "devices", "list", "--json"],
            env={**env, "MCP_SERVER": url, "MCP_TOKEN": token},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert listed.returncode == 0, listed.stderr
        assert json.loads(listed.stdout)["total"] == 0
        made = subprocess.run(
            [*CLI, "tokens", "create"],
            env={**env, "MCP_SERVER": url, "MCP_TOKEN": token},
            capture_output=True,
            text=True,
            timeout=60,
        )
        enrollment_token = made.stdout.strip()
        now = datetime.now(timezone.utc)
        body = json.dumps(envelope(PrivateKey.generate(), enrollment_token, now=now))
        req = urllib.request.Request(
            url + "/api/v1/enroll", data=body.encode(), headers={"Content-Type": "application/json"}
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(req, timeout=10)
        # No broker is configured yet: a clear 503 rather than credentials that cannot work.
        assert refused.value.code == 503
        assert "no broker provisioner" in json.loads(refused.value.read())["error"]
    finally:
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=30) == 0
