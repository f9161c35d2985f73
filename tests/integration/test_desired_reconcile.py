"""The control plane repairs what the broker forgot or was told wrongly about desired states.

A real dynamic-security Mosquitto with persistence is SIGKILLed mid-deployment and started again
from its last save: some devices' retained desired states are then older than the database's,
one device's is gone. Every device must end up with its newest signed document, with no operator
doing anything. Likewise an old envelope that someone allowed to publish leaves retained on a
device's topic is replaced. Devices are MQTT sessions logged in with their own accounts, reading
their ``desired`` topic and verifying each document as an agent does.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from mcp_edge.shared.protocol import topics
from mcp_edge.tooling.mosquitto import DynsecMosquittoBroker, MosquittoError
from tests.integration.conftest import ACL_KINDS, MqttProbe, set_default_acl_access
from tests.integration.test_deployments import (
    Fleet,
    open_fleet,
    publish_versions,
    until,
)

pytestmark = pytest.mark.mosquitto


class PersistentBroker(DynsecMosquittoBroker):
    """Keeps retained messages on disk, saved only when :meth:`save` asks (SIGUSR1)."""

    def _config_lines(self) -> list[str]:
        lines = [line for line in super()._config_lines() if not line.startswith("persistence")]
        return [
            *lines,
            "persistence true",
            f"persistence_location {self.workdir}/",
            "autosave_interval 3600",
        ]

    def save(self, timeout_s: float = 10.0) -> None:
        """Write the in-memory database now and wait until the broker says it did."""
        before = self.log_text().count("Saving in-memory database")
        os.kill(self.pid, signal.SIGUSR1)
        deadline = time.monotonic() + timeout_s
        while self.log_text().count("Saving in-memory database") <= before:
            if time.monotonic() > deadline:
                raise MosquittoError(f"no save logged within {timeout_s} s:\n{self.log_text()}")
            time.sleep(0.02)


@pytest.fixture
def persistent_broker(tmp_path: Path) -> Iterator[PersistentBroker]:
    workdir = tmp_path / "mosquitto"
    workdir.mkdir()
    with PersistentBroker(workdir) as broker:
        set_default_acl_access(broker, dict.fromkeys(ACL_KINDS, False))
        yield broker


@pytest.fixture
async def fleet(
    database_url: str, tmp_path: Path, dynsec_broker: DynsecMosquittoBroker
) -> AsyncIterator[Fleet]:
    async with open_fleet(database_url, tmp_path / "cp", dynsec_broker) as f:
        yield f


async def newest_seq_seen(fleet: Fleet, answer: dict[str, object], want: int) -> int:
    """Connect as the device, read its desired topic until the document with ``want`` arrives
    (retained or published later), verifying each one; return its seq."""
    probe = await fleet.connect(answer)  # type: ignore[arg-type]
    seen = 0

    async def arrived() -> bool:
        nonlocal seen
        state = await fleet.desired(probe)
        seen = state.seq
        return seen == want

    await until(arrived, f"seq {want} for {answer['device_id']}")
    return seen


async def test_a_broker_killed_mid_deployment_comes_back_and_every_device_converges(
    tmp_path: Path,
    persistent_broker: PersistentBroker,
) -> None:
    broker = persistent_broker
    url = f"sqlite:///{tmp_path / 'cp.db'}"
    async with open_fleet(url, tmp_path / "cp", broker) as fleet:
        await publish_versions(fleet.db, fleet.cp.clock(), "digits", "1.0.0", "1.1.0", "1.2.0")
        answers = {name: await fleet.enroll(name) for name in ("a", "b", "c")}
        for name in answers:
            await fleet.deploy("digits", "1.0.0", selector={"device_id": fleet.id(name)})
        broker.save()  # what the broker will come back with: seq 1 everywhere

        for name in answers:
            await fleet.deploy("digits", "1.1.0", selector={"device_id": fleet.id(name)})
        await fleet.deploy("digits", "1.2.0", selector={"device_id": fleet.id("c")})
        answers["d"] = await fleet.enroll("d")  # deployed after the save: nothing on disk
        await fleet.deploy("digits", "1.0.0", selector={"device_id": fleet.id("d")})
        desired = await fleet.get(f"/api/v1/devices/{fleet.id('c')}/desired")
        assert desired["seq"] == 3

        broker.kill()
        broker.start()  # same port, from the save: stale copies for a-c, none for d

        want = {"a": 2, "b": 2, "c": 3, "d": 1}
        for name, answer in answers.items():
            assert await newest_seq_seen(fleet, answer, want[name]) == want[name]


async def test_an_old_envelope_left_retained_by_someone_else_is_replaced(fleet: Fleet) -> None:
    await publish_versions(fleet.db, fleet.cp.clock(), "digits", "1.0.0", "1.1.0")
    cam = fleet.id("cam")
    answer = await fleet.enroll("cam")
    probe = await fleet.connect(answer)
    await fleet.deploy("digits", "1.0.0", selector={"device_id": cam})
    first = await probe.next_message()
    assert json.loads(first.payload)["signed"]["seq"] == 1
    await fleet.deploy("digits", "1.1.0", selector={"device_id": cam})
    assert (await fleet.desired(probe, last_seq=1)).seq == 2

    # Another control-plane account (any may publish desired states) puts seq 1 back.
    other = await fleet.cp.provisioner.provision_service("cp-stale-writer")
    writer = MqttProbe(fleet.broker, other.client_id, other.username, other.password)
    fleet.probes.append(writer)
    assert await writer.connect() == "Success"
    await writer.publish(topics.desired(cam), first.payload, retain=True)

    stale = await fleet.desired(probe)
    assert stale.seq == 1  # the device saw the old copy go by ...
    assert (await fleet.desired(probe, last_seq=1)).seq == 2  # ... and the newest one after it
    await probe.close()
    fresh = await fleet.connect(answer)
    assert (await fleet.desired(fresh)).seq == 2  # and it is what the broker retains now
