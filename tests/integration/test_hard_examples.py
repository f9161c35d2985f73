"""Hard examples end to end: the real control plane asks devices over the real broker and
stores what they send (docs/hard-examples.md).

The control plane is the real app served in process (SQLite and PostgreSQL), with Mosquitto's dynamic
security and the real :class:`DynsecProvisioner`: devices enroll through the REST API and
connect with the credentials and ACLs they were given, and the control plane's command session
runs under the service role.

- A real agent (``mcp-agent run``, onnxruntime, the digits model in a bundle with a baseline,
  a signed desired state whose drift policy keeps every input as a hard example) is sent
  held-out digits over HTTP. Asked through ``POST .../hard-examples/collect`` with a byte budget, it sends no more
  than the budget and keeps the rest for the next ask; what ``mcp-controlplane drift examples``
  downloads (the .npz and its metadata) holds every input byte for byte as the device was
  sent it, in order, with the answers the model gave.
- Devices simulated here, over the same broker with their own credentials, break the contract:
  a batch over the budget, a tensor whose bytes do not fit its shape, and a reply to another
  device's command sent from the replier's own topic. Each is refused and counted, nothing of
  them is stored, and a good device asked in the same collection is stored.

The trigger row is written directly (the drift rules that raise triggers have their own tests).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import secrets
import subprocess
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import numpy.typing as npt
import pytest
from aiohttp.test_utils import TestClient, TestServer
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

from mcp_edge.agent.identity import save_enrollment
from mcp_edge.controlplane.api.common import SERVICES
from mcp_edge.controlplane.app import create_app
from mcp_edge.controlplane.bootstrap import initialize
from mcp_edge.controlplane.broker.base import Credentials
from mcp_edge.controlplane.broker.dynsec import DynsecProvisioner
from mcp_edge.controlplane.cli.hard_examples import examples as examples_cli
from mcp_edge.controlplane.db.models import RetrainingTriggerRow
from mcp_edge.controlplane.ingest import IngestConnection
from mcp_edge.controlplane.mqtt import BrokerAddress
from mcp_edge.controlplane.settings import PasswordCost, Settings
from mcp_edge.shared.bundle import build_bundle, sign_bundle
from mcp_edge.shared.mqtt import InboundMessage, MqttClient, MqttSettings
from mcp_edge.shared.protocol import decode, topics
from mcp_edge.shared.protocol.command import CommandReply, CommandRequest
from mcp_edge.shared.protocol.enrollment import BrokerCredentials, EnrollmentAnswer, TrustRoot
from mcp_edge.shared.protocol.state import (
    DesiredModel,
    DesiredState,
    DriftPolicy,
    TelemetryPolicy,
    sign_desired_state,
)
from mcp_edge.shared.protocol.wire import EnrollmentStatus
from mcp_edge.shared.signing import PrivateKey
from mcp_edge.tooling.models import DigitsModels
from mcp_edge.tooling.mosquitto import DynsecMosquittoBroker
from mcp_edge.tooling.processes import AGENT, REPO, free_port, process_env, stopped_at_exit
from tests.support.controlplane import ADMIN_PASSWORD, ControlPlane, FakeClock
from tests.support.tuf import SignedRepo

pytestmark = [pytest.mark.mosquitto, pytest.mark.timeout(180)]

DEADLINE_S = 60.0
MODEL, VERSION = "digits", "1.0.0"
EXAMPLE_BYTES = 64 * 4 + 10 * 4
"""One digits example: a [1, 64] FP32 input and its [1, 10] FP32 probabilities."""
Json = dict[str, Any]


async def until(check: Callable[[], Any], what: str, timeout_s: float = DEADLINE_S) -> Any:
    """Poll ``check`` (sync or async) until it gives something truthy; fail after ``timeout_s``."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return result
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


@dataclass
class Site:
    """The served control plane, its broker, and what the test set up on them."""

    cp: ControlPlane
    broker: DynsecMosquittoBroker
    service: Credentials
    enroll_token: str
    clients: list[MqttClient] = field(default_factory=list)
    devices: list[str] = field(default_factory=list)

    async def enroll(self, device_id: str) -> Credentials:
        status, answer = await self.cp.enroll(
            PrivateKey.generate(), self.enroll_token, device_id=device_id
        )
        assert status == 200 and answer["status"] == "accepted", answer
        self.devices.append(device_id)
        broker = answer["broker"]
        return Credentials(broker["username"], broker["password"], broker["client_id"])

    async def connect(self, creds: Credentials) -> MqttClient:
        settings = MqttSettings(
            self.broker.host, self.broker.port, client_id=creds.client_id,
            username=creds.username, password=creds.password, clean_start=True,
            session_expiry_s=0,
        )  # fmt: skip
        client = MqttClient(settings)
        await client.connect()
        self.clients.append(client)
        return client

    async def online(self, device_id: str) -> None:
        async def up() -> bool:
            status, answer = await self.cp.call("GET", f"/api/v1/devices/{device_id}")
            return status == 200 and bool(answer.get("online"))

        await until(up, f"{device_id} online at the control plane")

    async def trigger(self, device_ids: list[str]) -> int:
        db = self.cp.client.app[SERVICES].db
        async with db.transaction() as tx:
            row = RetrainingTriggerRow(
                model=MODEL, version=VERSION, raised_at=self.cp.clock(), status="open",
                score=0.5, figures={}, rule={}, device_count=len(device_ids),
                device_ids=device_ids, note="",
            )  # fmt: skip
            tx.add(row)
            await tx.flush()
            return int(row.id)

    async def collect(self, trigger_id: int, **body: Any) -> Json:
        status, answer = await self.cp.call(
            "POST", f"/api/v1/drift/triggers/{trigger_id}/hard-examples/collect", body=body
        )
        assert status == 200, answer
        return dict(answer)

    async def dataset(self, trigger_id: int) -> Json:
        status, answer = await self.cp.call(
            "GET", f"/api/v1/drift/triggers/{trigger_id}/hard-examples"
        )
        assert status == 200, answer
        return dict(answer)

    async def counters(self) -> dict[tuple[str, str], float]:
        async with self.cp.client.get("/metrics") as response:
            text = await response.text()
        return {
            (s.name, s.labels.get("reason", "")): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name.startswith(("mcp_cp_hard_example", "mcp_cp_command"))
        }


@pytest.fixture
async def site(
    tmp_path: Path, dynsec_broker: DynsecMosquittoBroker, database_url: str
) -> AsyncIterator[Site]:
    settings = Settings(
        data_dir=tmp_path / "cp",
        database_url=database_url,
        password_cost=PasswordCost.MIN,
        broker_urls=(f"mqtt://{dynsec_broker.host}:{dynsec_broker.port}",),
    )
    clock = FakeClock()
    result = await initialize(
        settings, clock=clock, admin_user="admin", admin_password=ADMIN_PASSWORD
    )
    assert result.api_token is not None
    async with DynsecProvisioner(
        dynsec_broker.host,
        dynsec_broker.port,
        dynsec_broker.admin_username,
        dynsec_broker.admin_password,
    ) as provisioner:
        service = await provisioner.provision_service(f"cp-hx-{secrets.token_hex(3)}")
        ingest = IngestConnection(BrokerAddress(dynsec_broker.host, dynsec_broker.port), service)
        app = create_app(settings, provisioner, clock, ingest=ingest)
        client: TestClient[Any, Any] = TestClient(TestServer(app))
        await client.start_server()
        cp = ControlPlane(client, provisioner, clock, result.api_token, settings)  # type: ignore[arg-type]
        token = (await cp.new_token(max_uses=20))["token"]
        s = Site(cp, dynsec_broker, service, token)
        try:
            yield s
        finally:
            for c in s.clients:
                await c.close()
            await client.close()
            # Clear what this test left retained, as the service account (now free).
            cleaner = await s.connect(service)
            for device_id in s.devices:
                await cleaner.publish(topics.status(device_id), b"", 1, True)
                await cleaner.publish(topics.desired(device_id), b"", 1, True)
            await cleaner.close()


# ---------------------------------------------------------------------------- a real agent
@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[str]]]:
    with stopped_at_exit() as procs:
        yield procs


def _desired(repo: SignedRepo, digits: DigitsModels, tmp_path: Path, device_id: str) -> Json:
    samples = tmp_path / "train.npy"
    np.save(samples, digits.mlp.X_train)
    bundle = tmp_path / "digits-1.0.0.mcpb"
    build_bundle(digits.onnx_path, bundle, name=MODEL, version=VERSION, baseline_npy=samples)
    sign_bundle(bundle, repo.publisher)
    ref = repo.publish(bundle, MODEL, VERSION)
    now = datetime.now(timezone.utc)
    drift = DriftPolicy(window_requests=200, window_s=3600, hard_examples=True,
                        hard_example_max_confidence=1.0, hard_example_budget_bytes=64 * 1024)  # fmt: skip
    state = DesiredState(
        device_id=device_id, seq=1, issued_at=now, expires=now + timedelta(hours=1),
        models=[DesiredModel(name=MODEL, stable=ref)], telemetry=TelemetryPolicy(drift=drift),
    )  # fmt: skip
    return sign_desired_state(state, repo.director)


async def test_a_real_agent_sends_what_fits_the_budget_byte_for_byte(
    site: Site,
    digits: DigitsModels,
    tmp_path: Path,
    processes: list[subprocess.Popen[str]],
) -> None:
    device = "cam-hx-agent"
    creds = await site.enroll(device)
    repo = SignedRepo.create(tmp_path / "tuf")
    state = tmp_path / "agent"
    save_enrollment(state, str(site.cp.client.make_url("")), EnrollmentAnswer(
        status=EnrollmentStatus.ACCEPTED, device_id=device,
        broker=BrokerCredentials(urls=list(site.cp.settings.broker_urls), username=creds.username,
                                 password=creds.password, client_id=creds.client_id),
        trust=TrustRoot(tuf_root=json.loads(repo.root_bytes()),
                        director_keys=[repo.director.public_key.raw.hex()]),
    ))  # fmt: skip
    port = free_port()
    with (tmp_path / "agent.log").open("w") as log:  # the agent's log, for when this fails
        processes.append(subprocess.Popen(
            [*AGENT, "run", "--repo", repo.directory.as_uri(), "--port", str(port),
             "--state-dir", str(state), "--health-interval", "3600", "--stats-interval", "3600"],
            stdout=subprocess.DEVNULL, stderr=log, text=True, cwd=REPO, env=process_env(),
        ))  # fmt: skip
    # The desired state goes out as the control plane would send it (retained, service role).
    publisher = await site.connect(site.service)
    envelope = _desired(repo, digits, tmp_path, device)
    await publisher.publish(topics.desired(device), json.dumps(envelope).encode(), 1, True)
    base = f"http://127.0.0.1:{port}"
    sent = digits.X_test[:24].astype(np.float32)
    async with aiohttp.ClientSession() as http:

        async def serving() -> bool:
            try:
                async with http.get(f"{base}/v2/models/{MODEL}") as r:
                    return r.status == 200
            except aiohttp.ClientError:
                return False

        async def infer(row: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
            body = {"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32",
                                "data": row.tolist()}]}  # fmt: skip
            async with http.post(f"{base}/v2/models/{MODEL}/infer", json=body) as r:
                assert r.status == 200, await r.text()
                return np.asarray((await r.json())["outputs"][0]["data"], np.float32)

        await until(serving, "digits 1.0.0 served")
        await site.online(device)
        # The model may answer a moment before the desired state's drift policy is in force:
        # one warm-up request, collected under a trigger of its own, until one is kept.
        warmup = await site.trigger([device])

        async def keeping() -> bool:
            await infer(digits.X_test[-1].astype(np.float32))
            return int((await site.collect(warmup))["stored"]) > 0

        await until(keeping, "the agent keeping hard examples")
        answers = [await infer(row) for row in sent]
    trigger_id = await site.trigger([device])

    budget = 10 * EXAMPLE_BYTES + 100  # room for ten examples, not eleven
    first = await site.collect(trigger_id, max_bytes=budget)
    (outcome,) = first["devices"]
    assert (outcome["status"], outcome["stored"], outcome["held"]) == ("stored", 10, 14), outcome
    assert outcome["bytes"] == 10 * EXAMPLE_BYTES <= budget
    rest = await site.collect(trigger_id)  # the device's own budget: everything it holds
    assert [(d["status"], d["stored"], d["held"]) for d in rest["devices"]] == [("stored", 14, 0)]
    empty = await site.collect(trigger_id)
    assert [(d["status"], d["stored"]) for d in empty["devices"]] == [("stored", 0)]

    # What the operator downloads: byte for byte what the device was sent, in order.
    out = tmp_path / "dataset"
    url, token = str(site.cp.client.make_url("")), site.cp.admin_token
    runner = CliRunner()
    result = await asyncio.to_thread(
        runner.invoke, examples_cli,
        [str(trigger_id), "-o", str(out), "--server", url, "--token", token],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "24 hard examples of digits 1.0.0" in result.output
    npz_path = out / f"trigger-{trigger_id}-hard-examples.npz"
    meta = json.loads(npz_path.with_suffix(".json").read_text())
    with np.load(npz_path, allow_pickle=False) as npz:
        assert npz["inputs"].shape == (24, 1, 64) and npz["inputs"].dtype == np.dtype("<f4")
        assert [r.tobytes() for r in npz["inputs"]] == [r.tobytes() for r in sent]
        assert [r.tobytes() for r in npz["outputs"]] == [a.tobytes() for a in answers]
        assert npz["device_ids"].tolist() == [device] * 24
        assert npz["predicted"].tolist() == [int(a.argmax()) for a in answers]
    assert [e["sha256"] for e in meta["examples"]] == [
        hashlib.sha256(r.tobytes()).hexdigest() for r in sent
    ]
    assert (meta["model"], meta["version"], meta["count"], meta["total"]) == (
        MODEL, VERSION, 24, 24,
    )  # fmt: skip

    collect = await asyncio.to_thread(
        runner.invoke, examples_cli,
        ["collect", str(trigger_id), "--server", url, "--token", token],
    )  # fmt: skip
    assert collect.exit_code == 0, collect.output
    assert f"0 stored, 0 duplicates from 1 device(s) for trigger {trigger_id}" in collect.output


# ---------------------------------------------------------------------------- simulated devices
def _tensor(array: npt.NDArray[Any], **change: Any) -> Json:
    data = array.astype("<f4").tobytes()
    wire = {"name": "input", "datatype": "FP32", "shape": list(array.shape),
            "data_b64": base64.b64encode(data).decode()}  # fmt: skip
    return wire | change


def _batch(rows: list[Json]) -> Json:
    size = sum(len(base64.b64decode(r["data_b64"])) for r in rows)
    examples = [
        {"model": MODEL, "version": VERSION, "ts": 1.0, "confidence": 0.2, "input": r} for r in rows
    ]
    return {"examples": examples, "bytes": size, "held": 0}


Answer = Callable[[CommandRequest, InboundMessage], Json | None]


async def _simulate(site: Site, device_id: str, answer: Answer) -> list[InboundMessage]:
    """A device that answers its commands with ``answer(request, message)`` (None: silence);
    returns the command messages it got."""
    client = await site.connect(await site.enroll(device_id))
    got: list[InboundMessage] = []

    def on_message(msg: InboundMessage) -> None:
        got.append(msg)
        request = decode(msg.payload, CommandRequest)
        result = answer(request, msg)
        if result is not None:
            reply = CommandReply(command_id=request.command_id, ok=True, result=result)
            client.send(topics.command_reply(device_id), reply.model_dump_json().encode(), 1,
                        correlation_data=msg.correlation_data)  # fmt: skip

    client.set_handler(on_message)
    await client.subscribe(topics.command(device_id))
    await client.publish(topics.status(device_id), b"online", 1, True)
    await site.online(device_id)
    return got


async def test_devices_that_break_the_contract_are_refused_counted_and_not_stored(
    site: Site,
) -> None:
    rng = np.random.default_rng(7)
    good_rows = [rng.random((1, 64), dtype=np.float32) for _ in range(2)]
    asked: list[Json] = []

    def good(req: CommandRequest, _msg: InboundMessage) -> Json:
        asked.append(dict(req.args))
        return _batch([_tensor(r) for r in good_rows])

    def greedy(_req: CommandRequest, _msg: InboundMessage) -> Json:  # 5 x 256 > 1000 bytes
        return _batch([_tensor(rng.random((1, 64), dtype=np.float32)) for _ in range(5)])

    def misshapen(_req: CommandRequest, _msg: InboundMessage) -> Json:
        return _batch([_tensor(good_rows[0], shape=[1, 65])])

    spoofer_client = await site.connect(await site.enroll("hx-spoofer"))

    def quiet(req: CommandRequest, msg: InboundMessage) -> None:
        # Another device answers this device's command, from its own reply topic.
        reply = CommandReply(command_id=req.command_id, ok=True, result=_batch([]))
        spoofer_client.send(topics.command_reply("hx-spoofer"), reply.model_dump_json().encode(),
                            1, correlation_data=msg.correlation_data)  # fmt: skip
        return None

    await _simulate(site, "hx-good", good)
    await _simulate(site, "hx-greedy", greedy)
    await _simulate(site, "hx-misshapen", misshapen)
    silent = await _simulate(site, "hx-quiet", quiet)
    await site.enroll("hx-offline")  # accepted, never connected
    devices = ["hx-good", "hx-greedy", "hx-misshapen", "hx-quiet", "hx-offline"]
    trigger_id = await site.trigger(devices)

    result = await site.collect(trigger_id, max_bytes=1000, timeout_s=2)
    by_device = {d["device_id"]: d for d in result["devices"]}
    assert {d: o["status"] for d, o in by_device.items()} == {
        "hx-good": "stored", "hx-greedy": "refused", "hx-misshapen": "refused",
        "hx-quiet": "timeout", "hx-offline": "offline",
    }, by_device  # fmt: skip
    assert by_device["hx-greedy"]["detail"].startswith("over_budget")
    assert by_device["hx-misshapen"]["detail"].startswith("shape")
    assert len(silent) == 1  # it was asked; the reply it got "from" another device was not its
    assert asked == [{"model": MODEL, "version": VERSION, "max_bytes": 1000}]

    dataset = await site.dataset(trigger_id)
    assert dataset["total"] == 2 and {e["device_id"] for e in dataset["examples"]} == {"hx-good"}
    assert [e["sha256"] for e in dataset["examples"]] == [
        hashlib.sha256(r.tobytes()).hexdigest() for r in good_rows
    ]
    counters = await site.counters()
    assert counters[("mcp_cp_hard_example_batches_refused_total", "over_budget")] == 1
    assert counters[("mcp_cp_hard_example_batches_refused_total", "shape")] == 1
    assert counters[("mcp_cp_command_replies_dropped_total", "wrong_device")] == 1

    # The same good inputs again are duplicates, not new rows.
    again = await site.collect(trigger_id, devices=["hx-good"], timeout_s=2)
    assert (again["stored"], again["duplicates"]) == (0, 2)
    assert (await site.dataset(trigger_id))["total"] == 2
