"""`deploy/mosquitto/`: bootstrap.sh and the production mosquitto.conf make a working broker
that refuses anonymous clients and denies whatever a role does not list."""

from __future__ import annotations

import json
import os
import pwd
import stat
import subprocess
from pathlib import Path

import pytest

from mcp_edge.controlplane.broker.dynsec import DynsecProvisioner
from mcp_edge.shared.protocol import topics
from mcp_edge.tooling.mosquitto import MosquittoBroker, find_dynsec_plugin
from tests.integration.conftest import ProbeFactory

pytestmark = pytest.mark.mosquitto

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "mosquitto"
REQUIRED_SETTINGS = (
    "allow_anonymous false",
    "set_tcp_nodelay true",
    "persistence true",
    "per_listener_settings false",
)
SIZED_SETTINGS = ("max_packet_size", "message_size_limit", "max_queued_bytes")


class ProductionBroker(MosquittoBroker):
    """deploy/mosquitto/mosquitto.conf with only its port, paths and user moved into a test."""

    def __init__(self, workdir: Path, data_dir: Path) -> None:
        super().__init__(workdir)
        self.data_dir = data_dir

    def _config_lines(self) -> list[str]:
        moved = {
            "listener": f"listener {self.port} {self.host}",
            "plugin": f"plugin {find_dynsec_plugin()}",
            "plugin_opt_config_file": f"plugin_opt_config_file {self.data_dir}/dynamic-security.json",
            "persistence_location": f"persistence_location {self.workdir}/",
        }
        lines = []
        for line in (DEPLOY / "mosquitto.conf").read_text().splitlines():
            key = line.split(" ", 1)[0]
            lines.append(moved.pop(key, line))
        assert not moved, f"mosquitto.conf lacks {sorted(moved)}"
        return [*lines, f"user {pwd.getpwuid(os.getuid()).pw_name}"]


def _bootstrap(data_dir: Path) -> subprocess.CompletedProcess[str]:
    owner = pwd.getpwuid(os.getuid()).pw_name
    return subprocess.run(
        ["bash", str(DEPLOY / "bootstrap.sh"), "--data-dir", str(data_dir), "--owner", owner],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_the_production_config_sets_what_the_design_asks_for() -> None:
    settings = [
        line.strip()
        for line in (DEPLOY / "mosquitto.conf").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]

    for setting in REQUIRED_SETTINGS:
        assert setting in settings
    for name in SIZED_SETTINGS:
        (value,) = [line.split()[1] for line in settings if line.split()[0] == name]
        assert int(value) >= 32 * 1024 * 1024  # the largest protocol message (InferResponse)


async def test_bootstrap_makes_a_deny_by_default_broker_the_control_plane_can_administer(
    tmp_path: Path, mqtt_probe: ProbeFactory
) -> None:
    data_dir = tmp_path / "data"
    first = _bootstrap(data_dir)
    assert first.returncode == 0, first.stderr
    dynsec_file = data_dir / "dynamic-security.json"
    password_file = data_dir / "dynsec-admin.password"
    state = dynsec_file.read_bytes()
    password = password_file.read_text().strip()

    assert json.loads(state)["defaultACLAccess"] == {
        "publishClientSend": False,
        "publishClientReceive": False,
        "subscribe": False,
        "unsubscribe": False,
    }
    assert len(password) >= 40 and password not in first.stdout + first.stderr
    for path in (dynsec_file, password_file):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    again = _bootstrap(data_dir)
    assert again.returncode == 0 and "nothing to do" in again.stderr
    assert dynsec_file.read_bytes() == state
    assert not list(data_dir.glob(".bootstrap*"))

    (tmp_path / "broker").mkdir()
    with ProductionBroker(tmp_path / "broker", data_dir) as broker:
        async with DynsecProvisioner(broker.host, broker.port, "admin", password) as provisioner:
            device = await provisioner.provision_device("dev-1")
        await mqtt_probe(broker, None, client_id="anonymous", expect="Not authorized")
        session = await mqtt_probe(broker, device)
        assert await session.subscribe(topics.desired("dev-1")) == "Granted QoS 1"
        # `mosquitto_ctrl dynsec init` alone would allow these two by default.
        assert await session.unsubscribe("elsewhere") == "Not authorized"
        published = await session.publish(topics.status("dev-1"), b"online", retain=True)
        assert not published.is_failure
    assert (tmp_path / "broker" / "mosquitto.db").exists()  # persistence is on
