"""``mcp-controlplane drift`` as an operator uses it, against a real served control plane: rules
set and read, the fleet's buckets and a device's reports, triggers listed, shown and
acknowledged. Reports reach the served control plane's database through the drift store (the
code ingestion hands them to), with the same settable clock."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import orjson
import pytest
from click.testing import CliRunner, Result

from mcp_edge.controlplane.cli import main
from mcp_edge.controlplane.db import Database
from mcp_edge.controlplane.db import drift as q
from mcp_edge.controlplane.drift.sample import decode_drift
from mcp_edge.controlplane.drift.service import DriftService
from mcp_edge.controlplane.metrics import ControlPlaneMetrics
from mcp_edge.controlplane.settings import Settings, load_settings
from mcp_edge.shared.bundle.baseline import compute_baseline
from mcp_edge.shared.drift import Binner
from tests.support.controlplane import FakeClock, FakeProvisioner, served
from tests.support.drift import window

PASSWORD = "admin-password-1"
DEVICES = ["cam-1", "cam-2"]


@dataclass
class Plane:
    url: str
    token: str
    settings: Settings
    clock: FakeClock

    def cli(self, *args: str, ok: bool = True) -> Result:
        env = {"MCP_SERVER": self.url, "MCP_TOKEN": self.token}
        result = CliRunner(env=env).invoke(main, list(args), catch_exceptions=False)
        assert (result.exit_code == 0) == ok, result.output
        return result

    def drifting_window(self, shift: float) -> list[int]:
        """Every device sends one window (shifted by ``shift``); the trigger ids raised."""
        baseline = compute_baseline("x", np.random.default_rng(0).normal(size=(3000, 4)), bins=6)
        binner = Binner(baseline)
        rng = np.random.default_rng(int(shift * 10) + 1)

        async def work() -> list[int]:
            db = Database(self.settings.effective_database_url)
            try:
                async with db.transaction() as tx:
                    published, _ = await q.baseline_of(tx, "digits", "1.0.0")
                    if not published:
                        await q.seed_fleet(tx, device_ids=DEVICES, model="digits",
                                           version="1.0.0", version_numeric=1_000_000,
                                           baseline=baseline.model_dump(mode="json"),
                                           now=self.clock())  # fmt: skip
                drift = DriftService(db, self.clock, metrics=ControlPlaneMetrics())
                samples = []
                for device in DEVICES:
                    binner.add(rng.normal(size=(300, 4)) + shift)
                    n, features, _, _ = binner.take()
                    report = window(device, self.clock(), n, features)
                    samples.append(decode_drift(orjson.dumps(report), device,
                                                self.clock().timestamp()))  # fmt: skip
                result = await drift.store(samples)
                return [t.id for t in result.triggers]
            finally:
                await db.dispose()

        return asyncio.run(work())


@pytest.fixture
def plane(tmp_path: Path) -> Iterator[Plane]:
    data_dir = tmp_path / "cp"
    password_file = tmp_path / "admin.pw"
    password_file.write_text(PASSWORD + "\n")
    result = CliRunner().invoke(
        main,
        ["init", "--data-dir", str(data_dir), "--admin-password-file", str(password_file),
         "--listen", "127.0.0.1:0"],
        catch_exceptions=False,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    token = result.stdout.strip().splitlines()[-1]
    settings = load_settings(data_dir, environ={})
    clock = FakeClock()
    with served(settings, FakeProvisioner(), clock) as url:
        yield Plane(url, token, settings, clock)


def test_rules_figures_and_triggers_from_the_command_line(plane: Plane) -> None:
    shown = plane.cli("drift", "rules", "get", "digits").stdout
    assert "built-in default" in shown and "input_psi > 0.2" in shown
    out = plane.cli("drift", "rules", "set", "*", "--min-devices", "2", "--window", "1m").stdout
    assert out.startswith("*: the default rule (*)") and "bucket(s) of 1m" in out
    out = plane.cli("drift", "rules", "set", "digits", "--threshold", "0.3", "--sustained",
                    "1", "--cooldown", "1h", "--metric", "input_psi").stdout  # fmt: skip
    assert "input_psi > 0.3 in 1 bucket(s) of 1m" in out and "at most one per 1h" in out
    rule = json.loads(plane.cli("drift", "rules", "get", "digits", "--json").stdout)
    assert (rule["source"], rule["min_devices"], rule["updated_by"]) == ("model", 2, "user:admin")
    assert plane.cli("drift", "rules", "set", "digits", ok=False).exit_code == 2
    refused = plane.cli("drift", "rules", "set", "digits", "--window", "2s", ok=False)
    assert "window_s" in refused.output and "HTTP 400" in refused.output
    listed = plane.cli("drift", "rules", "list").stdout.splitlines()
    assert [line.split()[0] for line in listed[1:]] == ["*", "digits"]

    assert plane.drifting_window(0.0) == []
    plane.clock.advance(seconds=60)
    (trigger_id,) = plane.drifting_window(2.0)

    table = plane.cli("drift", "show", "digits", "--since", "400d").stdout.splitlines()
    assert len(table) == 3 and " yes " in table[-1] and " yes " not in table[1]
    figures = json.loads(plane.cli("drift", "show", "digits", "--since", "400d", "--json").stdout)
    first, second = figures["buckets"]
    assert (first["over"], second["over"]) == (False, True)
    assert second["input_psi"] > 0.3 > first["input_psi"]
    mine = json.loads(plane.cli("drift", "show", "digits", "--device", "cam-2", "--since",
                                "400d", "--json").stdout)  # fmt: skip
    assert [r["samples"] for r in mine["reports"]] == [300, 300]

    listed = plane.cli("drift", "triggers", "list", "--status", "open").stdout.splitlines()
    assert listed[1].split()[:3] == [str(trigger_id), "digits", "1.0.0"]
    shown = plane.cli("drift", "triggers", "show", str(trigger_id)).stdout
    assert f"trigger {trigger_id}  digits 1.0.0  open" in shown
    assert "2 device(s): cam-1, cam-2" in shown and "most drifted: f" in shown
    acked = plane.cli("drift", "triggers", "ack", str(trigger_id), "--note", "retrain").stdout
    assert "acknowledged by user:admin" in acked and "retrain" in acked
    assert plane.cli("drift", "triggers", "list", "--status", "open").stdout.count("\n") == 1
    missing = plane.cli("drift", "triggers", "show", "999", ok=False)
    assert "no retraining trigger 999" in missing.output
    reset = plane.cli("drift", "rules", "reset", "digits").stdout
    assert reset.startswith("digits: the default rule (*)")
