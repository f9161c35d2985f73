"""Enrollment in groups and the broker's merged command messages (DESIGN 4.1 at fleet scale).

The enrollment service runs on a real database (SQLite and PostgreSQL) and, where broker
accounts matter, provisions them on the real Mosquitto with dynamic security through
:class:`DynsecProvisioner`. What a fleet operator would notice: many devices enrolling at once
all get working credentials while the broker sees a handful of command messages; one device
refused (by its token, its nonce, its id, or the broker) fails alone and leaves nothing behind,
the others are enrolled; a revocation among them still takes effect; SQLite writers queue
instead of failing; and the agent's client asks again after a 503.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from mcp_edge.agent.enroll import ServerUnavailableError, enroll, retry_delay_s
from mcp_edge.controlplane.app import create_app
from mcp_edge.controlplane.auth import ENROLLMENT_TOKEN_PREFIX, issue_secret
from mcp_edge.controlplane.bootstrap import initialize
from mcp_edge.controlplane.broker.base import (
    AccountConflictError,
    BrokerAdminError,
    BrokerProvisioner,
    Credentials,
)
from mcp_edge.controlplane.broker.batching import CommandBatcher
from mcp_edge.controlplane.broker.dynsec import DynsecProvisioner
from mcp_edge.controlplane.db import Database, UnavailableError
from mcp_edge.controlplane.db import devices as device_q
from mcp_edge.controlplane.db import enrollment as token_q
from mcp_edge.controlplane.enrollment import Approval
from mcp_edge.controlplane.enrollment_service import (
    EnrollmentConflictError,
    EnrollmentRefusedError,
    EnrollmentService,
)
from mcp_edge.controlplane.metrics import ControlPlaneMetrics
from mcp_edge.controlplane.settings import PasswordCost, Settings
from mcp_edge.shared.errors import ReplayError
from mcp_edge.shared.protocol.enrollment import (
    EnrollmentAnswer,
    EnrollmentStatus,
    TrustRoot,
    new_nonce,
)
from mcp_edge.shared.signing import PrivateKey
from mcp_edge.tooling.mosquitto import DynsecMosquittoBroker
from tests.integration.conftest import ProbeFactory
from tests.support.controlplane import ADMIN_PASSWORD, FakeClock, FakeProvisioner, envelope

GROUP = 8


class NoTrust:
    async def trust_root(self) -> TrustRoot:
        return TrustRoot()


@dataclass
class Fleet:
    """An enrollment service, its database and one auto-approving token of ``uses`` uses."""

    service: EnrollmentService
    db: Database
    clock: FakeClock
    token: str
    token_id: int

    async def enroll(self, key: PrivateKey, **kwargs: Any) -> EnrollmentAnswer:
        return await self.service.enroll(envelope(key, self.token, now=self.clock(), **kwargs))

    async def device_ids(self) -> set[str]:
        async with self.db.read() as tx:
            views, _ = await device_q.list_devices(
                tx, device_q.DeviceFilter(), limit=1000, offset=0
            )
        return {v.id for v in views}

    async def uses(self) -> int:
        async with self.db.read() as tx:
            token = await token_q.get_token(tx, self.token_id)
        assert token is not None
        return token.uses


FleetFactory = Callable[..., Awaitable[Fleet]]


@pytest.fixture
async def fleet(tmp_path: Path, database_url: str) -> AsyncIterator[FleetFactory]:
    """``await fleet(provisioner, max_uses=None)``: an initialized control-plane database, a
    token, and an enrollment service provisioning through ``provisioner``, groups of at most
    :data:`GROUP`."""
    made: list[Database] = []

    async def make(provisioner: BrokerProvisioner, max_uses: int | None = None) -> Fleet:
        settings = Settings(
            data_dir=tmp_path / "cp",
            database_url=database_url,
            password_cost=PasswordCost.MIN,
            broker_urls=("mqtt://broker.test:1883",),
        )
        clock = FakeClock()
        await initialize(settings, clock=clock, admin_user="admin", admin_password=ADMIN_PASSWORD)
        db = Database(settings.effective_database_url)
        made.append(db)
        secret = issue_secret(ENROLLMENT_TOKEN_PREFIX)
        async with db.transaction() as tx:
            token = await token_q.create_token(
                tx,
                token_hash=secret.digest,
                prefix=secret.prefix,
                now=clock(),
                created_by="admin",
                approval=Approval.AUTO.value,
                max_uses=max_uses,
            )
        service = EnrollmentService(
            db, provisioner, NoTrust(), settings, clock, ControlPlaneMetrics(), max_batch=GROUP
        )
        return Fleet(service, db, clock, secret.token, token.id)

    yield make
    for db in made:
        await db.dispose()


@pytest.fixture
async def provisioner(
    fresh_dynsec_broker: DynsecMosquittoBroker,
) -> AsyncIterator[DynsecProvisioner]:
    broker = fresh_dynsec_broker
    async with DynsecProvisioner(
        broker.host, broker.port, broker.admin_username, broker.admin_password, timeout_s=30
    ) as provisioner:
        yield provisioner


def _broker_usernames(broker: DynsecMosquittoBroker) -> set[str]:
    document = json.loads(broker.dynsec_path.read_text())
    return {client["username"] for client in document["clients"]}


@pytest.mark.mosquitto
async def test_a_burst_of_enrollments_costs_few_broker_messages_and_every_device_logs_in(
    fleet: FleetFactory,
    provisioner: DynsecProvisioner,
    fresh_dynsec_broker: DynsecMosquittoBroker,
    mqtt_probe: ProbeFactory,
) -> None:
    devices = 3 * GROUP
    enrolling = await fleet(provisioner)
    before = provisioner.messages_sent
    answers = await asyncio.gather(
        *(enrolling.enroll(PrivateKey.generate()) for _ in range(devices))
    )

    assert [a.status for a in answers] == [EnrollmentStatus.ACCEPTED] * devices
    ids = {a.device_id for a in answers}
    assert len(ids) == devices and await enrolling.device_ids() == ids
    assert {f"dev-{i}" for i in ids} <= _broker_usernames(fresh_dynsec_broker)
    # Three groups, each one probe message and one change message for all of its devices.
    assert enrolling.service.groups_run == 3
    assert provisioner.messages_sent - before == 2 * 3
    for answer in answers:  # the account exists by the time the answer is out
        assert answer.broker is not None
        credentials = Credentials(
            answer.broker.username, answer.broker.password, answer.broker.client_id
        )
        await mqtt_probe(fresh_dynsec_broker, credentials)


@pytest.mark.mosquitto
async def test_a_broker_refusal_fails_only_its_device_and_leaves_nothing_of_it(
    fleet: FleetFactory,
    provisioner: DynsecProvisioner,
    fresh_dynsec_broker: DynsecMosquittoBroker,
    mqtt_probe: ProbeFactory,
) -> None:
    enrolling = await fleet(provisioner)
    await provisioner.provision_app_client("clash-1")  # this client id is an application's
    names = [f"cam-{i}" for i in range(GROUP - 1)]
    results = await asyncio.gather(
        *(enrolling.enroll(PrivateKey.generate(), device_id=n) for n in [*names, "clash-1"]),
        return_exceptions=True,
    )

    refused = results[-1]
    assert isinstance(refused, EnrollmentConflictError), refused
    assert "not available" in str(refused) and "app-" not in str(refused)
    accepted = [r for r in results[:-1] if isinstance(r, EnrollmentAnswer)]
    assert [a.device_id for a in accepted] == names
    # Nothing of the refused device: no row, no token use; everything of the others.
    assert await enrolling.device_ids() == set(names)
    assert await enrolling.uses() == len(names)
    assert "dev-clash-1" not in _broker_usernames(fresh_dynsec_broker)
    for answer in accepted:
        assert answer.broker is not None
        await mqtt_probe(
            fresh_dynsec_broker,
            Credentials(answer.broker.username, answer.broker.password, answer.broker.client_id),
        )


async def test_refusals_in_one_group_stay_with_their_own_requests(fleet: FleetFactory) -> None:
    fake = FakeProvisioner()
    enrolling = await fleet(fake)
    owner, thief, twin = PrivateKey.generate(), PrivateKey.generate(), PrivateKey.generate()
    await enrolling.enroll(owner, device_id="gate-1")
    nonce = new_nonce()
    reused = envelope(twin, enrolling.token, now=enrolling.clock(), nonce=nonce)
    copied = envelope(PrivateKey.generate(), enrolling.token, now=enrolling.clock(), nonce=nonce)
    good = [PrivateKey.generate() for _ in range(3)]

    results = await asyncio.gather(
        enrolling.enroll(good[0]),
        enrolling.service.enroll(
            envelope(PrivateKey.generate(), "mcpe_not-a-token", now=enrolling.clock())
        ),
        enrolling.enroll(thief, device_id="gate-1"),
        enrolling.service.enroll(reused),
        enrolling.service.enroll(copied),
        enrolling.enroll(good[1]),
        enrolling.enroll(good[2]),
        return_exceptions=True,
    )

    assert isinstance(results[1], EnrollmentRefusedError)
    assert results[1].refusal.value == "token_unknown"
    assert isinstance(results[2], EnrollmentConflictError) and "gate-1" in str(results[2])
    assert isinstance(results[3], EnrollmentAnswer)  # the first with that nonce
    assert isinstance(results[4], ReplayError)
    ok = [results[i] for i in (0, 3, 5, 6)]
    assert all(
        isinstance(r, EnrollmentAnswer) and r.status is EnrollmentStatus.ACCEPTED for r in ok
    )
    assert await enrolling.uses() == 1 + len(ok)
    assert len(await enrolling.device_ids()) == 1 + len(ok)


async def test_a_use_freed_by_a_broker_refusal_goes_to_the_next_device_in_the_group(
    fleet: FleetFactory,
) -> None:
    enrolling = await fleet(RefusingProvisioner(refuse={"cam-0"}), max_uses=3)
    results = await asyncio.gather(
        *(enrolling.enroll(PrivateKey.generate(), device_id=f"cam-{i}") for i in range(4)),
        return_exceptions=True,
    )
    assert isinstance(results[0], EnrollmentConflictError)
    assert [r.device_id for r in results[1:] if isinstance(r, EnrollmentAnswer)] == [
        "cam-1",
        "cam-2",
        "cam-3",
    ]
    assert await enrolling.uses() == 3
    assert await enrolling.device_ids() == {"cam-1", "cam-2", "cam-3"}


async def test_two_requests_for_one_key_in_a_burst_get_one_device(fleet: FleetFactory) -> None:
    enrolling = await fleet(FakeProvisioner())
    key = PrivateKey.generate()
    first, second = await asyncio.gather(enrolling.enroll(key), enrolling.enroll(key))
    assert first.device_id == second.device_id
    assert first.message == "enrolled"
    assert second.message.startswith("already enrolled")
    assert await enrolling.uses() == 1
    assert enrolling.service.groups_run == 2  # the second waited for the next group


async def test_a_broker_that_is_down_fails_the_group_and_commits_nothing(
    fleet: FleetFactory,
) -> None:
    fake = FakeProvisioner(fail=True)
    enrolling = await fleet(fake)
    results = await asyncio.gather(
        *(enrolling.enroll(PrivateKey.generate()) for _ in range(4)), return_exceptions=True
    )
    assert all(isinstance(r, BrokerAdminError) for r in results), results
    assert await enrolling.device_ids() == set()
    assert await enrolling.uses() == 0
    fake.fail = False
    assert (await enrolling.enroll(PrivateKey.generate())).status is EnrollmentStatus.ACCEPTED


@pytest.mark.mosquitto
async def test_a_revocation_among_enrollments_disconnects_and_refuses_the_device(
    fleet: FleetFactory,
    provisioner: DynsecProvisioner,
    fresh_dynsec_broker: DynsecMosquittoBroker,
    mqtt_probe: ProbeFactory,
) -> None:
    enrolling = await fleet(provisioner)
    answer = await enrolling.enroll(PrivateKey.generate(), device_id="old-cam")
    assert answer.broker is not None
    credentials = Credentials(
        answer.broker.username, answer.broker.password, answer.broker.client_id
    )
    session = await mqtt_probe(fresh_dynsec_broker, credentials)

    burst = asyncio.gather(*(enrolling.enroll(PrivateKey.generate()) for _ in range(GROUP)))
    await provisioner.disable_device("old-cam")
    assert (await session.disconnect_reason()).is_failure
    await mqtt_probe(fresh_dynsec_broker, credentials, expect="Not authorized")
    assert all(a.status is EnrollmentStatus.ACCEPTED for a in await burst)


async def _sqlite(tmp_path: Path, **kwargs: Any) -> Database:
    settings = Settings(data_dir=tmp_path / "cp", database_url=f"sqlite:///{tmp_path / 'q.db'}")
    await initialize(settings, clock=FakeClock(), admin_user="admin", admin_password=ADMIN_PASSWORD)
    return Database(settings.effective_database_url, **kwargs)


async def _add_token(db: Database, i: int, order: list[int] | None = None) -> None:
    async with db.transaction() as tx:
        await token_q.create_token(
            tx,
            token_hash=f"{i:064d}",
            prefix=f"p{i}",
            now=FakeClock()(),
            created_by="test",
            approval="auto",
        )
        if order is not None:
            order.append(i)


async def _hold_the_writer(db: Database, holding: asyncio.Event, release: asyncio.Event) -> None:
    async with db.transaction() as tx:
        await token_q.remember_nonce(tx, new_nonce(), now=FakeClock()(), expires_at=FakeClock()())
        holding.set()
        await release.wait()


async def test_sqlite_writers_queue_behind_a_long_writer_and_all_commit_in_order(
    tmp_path: Path,
) -> None:
    db = await _sqlite(tmp_path)
    holding, release = asyncio.Event(), asyncio.Event()
    held = asyncio.create_task(_hold_the_writer(db, holding, release))
    await holding.wait()
    order: list[int] = []
    writers = [asyncio.create_task(_add_token(db, i, order)) for i in range(40)]
    release.set()
    await asyncio.gather(held, *writers)
    assert order == list(range(40))
    async with db.read() as tx:
        assert len(await token_q.list_tokens(tx)) == 40
    await db.dispose()


async def test_a_sqlite_writer_gives_up_only_after_its_bound(tmp_path: Path) -> None:
    db = await _sqlite(tmp_path, write_wait_s=0.2)
    holding, release = asyncio.Event(), asyncio.Event()
    held = asyncio.create_task(_hold_the_writer(db, holding, release))
    await holding.wait()
    with pytest.raises(UnavailableError, match=r"database busy: no write turn within 0\.2 s"):
        await _add_token(db, 1)
    release.set()
    await held
    await _add_token(db, 2)  # the queue moved on
    async with db.read() as tx:
        assert [t.token_hash for t in await token_q.list_tokens(tx)] == [f"{2:064d}"]
    await db.dispose()


async def test_the_agent_asks_again_after_a_503_and_gives_up_after_its_retries(
    tmp_path: Path,
) -> None:
    down = FlakyProvisioner(failures=2)
    settings = Settings(
        data_dir=tmp_path / "cp",
        database_url=f"sqlite:///{tmp_path / 'cp.db'}",
        password_cost=PasswordCost.MIN,
        broker_urls=("mqtt://broker.test:1883",),
    )
    clock = FakeClock()
    result = await initialize(
        settings, clock=clock, admin_user="admin", admin_password=ADMIN_PASSWORD
    )
    client: TestClient[Any, Any] = TestClient(TestServer(create_app(settings, down, clock)))
    await client.start_server()
    try:
        base = str(client.make_url(""))
        headers = {"Authorization": f"Bearer {result.api_token}"}
        async with client.post("/api/v1/enrollment-tokens", json={}, headers=headers) as r:
            token = (await r.json())["token"]
        waits: list[float] = []

        async def sleep(seconds: float) -> None:
            waits.append(seconds)

        answer = await enroll(
            base, token, state_dir=tmp_path / "dev", profile="generic-x86_64", facts={},
            clock=clock, retry_s=0.5, sleep=sleep,
        )  # fmt: skip
        assert answer.status is EnrollmentStatus.ACCEPTED
        assert len(waits) == 2 and 0.25 <= waits[0] < 0.5 and 0.5 <= waits[1] < 1.0

        down.failures = 10
        with pytest.raises(ServerUnavailableError, match="503"):
            await enroll(
                base, token, state_dir=tmp_path / "dev2", profile="generic-x86_64", facts={},
                clock=clock, retries=3, sleep=sleep,
            )  # fmt: skip
        assert len(waits) == 2 + 3
    finally:
        await client.close()
    assert all(retry_delay_s(n, cap_s=4.0) < 4.0 for n in range(1, 20))


@dataclass
class FlakyProvisioner(FakeProvisioner):
    """Refuses the next ``failures`` device accounts like a broker that is down, then works."""

    failures: int = 0

    async def provision_device(self, device_id: str) -> Credentials:
        if self.failures > 0:
            self.failures -= 1
            raise BrokerAdminError("broker did not answer (fake)")
        return await super().provision_device(device_id)


@dataclass
class RefusingProvisioner(FakeProvisioner):
    """Refuses the device ids in ``refuse`` as a broker does a client id another kind of
    account holds."""

    refuse: frozenset[str] | set[str] = frozenset()

    async def provision_device(self, device_id: str) -> Credentials:
        if device_id in self.refuse:
            raise AccountConflictError(device_id, f"app-{device_id}")
        return await super().provision_device(device_id)


# ---- the command batcher on its own: the provisioner's send queue, without a broker ----------


class Broker:
    """Answers each sent message like the dynsec plugin: one result per command, an error for
    the usernames in ``refuse``; with ``hold`` the answers wait for :meth:`release`. ``sent`` is
    set whenever a message goes out."""

    def __init__(self) -> None:
        self.messages: list[list[dict[str, Any]]] = []
        self.refuse: set[str] = set()
        self.hold = False
        self.sent = asyncio.Event()
        self.batcher: CommandBatcher | None = None
        self._held: list[bytes] = []

    def send(self, payload: bytes) -> None:
        commands = json.loads(payload)["commands"]
        self.messages.append(commands)
        self.sent.set()
        answer = {
            "responses": [
                {"command": c["command"], "correlationData": c["correlationData"]}
                | ({"error": "Client not found"} if c.get("username") in self.refuse else {})
                for c in commands
            ]
        }
        self._held.append(json.dumps(answer).encode())
        if not self.hold:
            self.release()

    def release(self) -> None:
        assert self.batcher is not None
        held, self._held = self._held, []
        for payload in held:
            asyncio.get_running_loop().call_soon(self.batcher.take_answers, payload)


def _batcher(broker: Broker, **kwargs: Any) -> CommandBatcher:
    options: dict[str, Any] = {"timeout_s": 5.0, "window_s": 0.001, "max_commands": 64}
    options.update(kwargs)
    broker.batcher = CommandBatcher(broker.send, where="test", **options)
    return broker.batcher


def _get(user: str) -> dict[str, Any]:
    return {"command": "getClient", "username": user}


async def test_concurrent_units_share_a_message_and_each_gets_its_own_answers() -> None:
    broker = Broker()
    batcher = _batcher(broker)
    broker.refuse = {"u3"}
    answers = await asyncio.gather(*(batcher.run([_get(f"u{i}"), _get("x")]) for i in range(10)))
    assert len(broker.messages) == 1 and len(broker.messages[0]) == 20
    assert batcher.messages_sent == 1 and batcher.commands_sent == 20
    for i, answer in enumerate(answers):
        assert [a["command"] for a in answer] == ["getClient", "getClient"]
        assert ("error" in answer[0]) == (i == 3) and "error" not in answer[1]


async def test_units_queued_behind_a_message_in_flight_follow_it_in_few_messages() -> None:
    broker = Broker()
    batcher = _batcher(broker, max_commands=4)
    broker.hold = True
    first = asyncio.gather(*(batcher.run([_get(f"a{i}")]) for i in range(3)))
    await broker.sent.wait()
    rest = asyncio.gather(*(batcher.run([_get(f"b{i}")]) for i in range(6)))
    broker.hold = False
    broker.release()
    assert len(await first) == 3 and len(await rest) == 6
    assert [len(m) for m in broker.messages] == [3, 4, 2]  # at most max_commands a message


async def test_an_unanswered_message_fails_its_callers_and_the_queue_moves_on() -> None:
    broker = Broker()
    batcher = _batcher(broker, timeout_s=0.05)
    broker.hold = True
    with pytest.raises(BrokerAdminError, match=r"did not answer dynsec getClient within 0\.05 s"):
        await batcher.run([_get("lost")])
    broker.hold = False
    assert (await batcher.run([_get("next")]))[0]["command"] == "getClient"

    broker.hold, broker.sent = True, asyncio.Event()
    cut = asyncio.ensure_future(batcher.run([_get("cut")]))
    queued = asyncio.ensure_future(batcher.run([_get("queued")]))
    await broker.sent.wait()
    batcher.fail_all(BrokerAdminError("connection lost (test)"))
    for call in (cut, queued):
        with pytest.raises(BrokerAdminError, match="connection lost"):
            await call
