"""The repository transports end to end: a real TufRepository served over real Mosquitto by
RepoMqttService to a real FleetSession's MqttRepoTransport (and over HTTP by aiohttp's static
files to HttpRepoTransport), with tuf.ngclient and TUF's own length/hash checks on top."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import orjson
import pytest
from aiohttp import web
from tuf.api.exceptions import (
    DownloadError,
    DownloadHTTPError,
    DownloadLengthMismatchError,
    LengthOrHashMismatchError,
    SlowRetrievalError,
)
from tuf.api.metadata import TargetFile  # type: ignore[attr-defined]
from tuf.ngclient.updater import Updater

from mcp_edge.agent.fleet.session import FleetConfig, FleetSession
from mcp_edge.agent.fleet.spool import Spool
from mcp_edge.agent.update.transport_http import HttpRepoTransport
from mcp_edge.agent.update.transport_mqtt import MqttRepoTransport, MqttTransportConfig
from mcp_edge.controlplane.broker.base import Credentials
from mcp_edge.controlplane.metrics import ControlPlaneMetrics
from mcp_edge.controlplane.mqtt import BrokerAddress
from mcp_edge.controlplane.repository.mqtt_service import RepoConnection, RepoMqttService
from mcp_edge.controlplane.repository.tuf_repo import KeyStore, TufRepository
from mcp_edge.shared.mqtt import (
    InboundMessage,
    MqttClient,
    MqttSettings,
    ReconnectPolicy,
    Subscription,
)
from mcp_edge.shared.protocol import topics
from mcp_edge.shared.protocol.repo import RepoReply, RepoStatus
from mcp_edge.tooling.mosquitto import MosquittoBroker

DEVICE = "dev-repo-1"
TARGET = "digits/1.0.0/digits-1.0.0.mcpb"
SIZE = 3 * 1024 * 1024 + 12345  # 25 chunks of 128 KiB, the last one short
CHUNK = 128 * 1024


@dataclass
class Published:
    repo: TufRepository
    info: TargetFile
    data: bytes

    @property
    def stored(self) -> Path:
        sha = self.info.hashes["sha256"]
        return self.repo.targets_dir / "digits" / "1.0.0" / f"{sha}.digits-1.0.0.mcpb"

    def url(self, base: str) -> str:
        return f"{base}digits/1.0.0/{self.info.hashes['sha256']}.digits-1.0.0.mcpb"


@pytest.fixture
def published(tmp_path: Path) -> Published:
    repo = TufRepository(tmp_path / "repository", KeyStore(tmp_path / "keys"))
    repo.init()
    data = os.urandom(SIZE)
    source = tmp_path / "bundle.mcpb"
    source.write_bytes(data)
    info = repo.add_target(TARGET, source, custom={"model": "digits", "version": "1.0.0"})
    return Published(repo, info, data)


def _sent(metrics: ControlPlaneMetrics, status: str = "ok") -> float:
    return metrics.registry.get_sample_value("mcp_cp_repo_requests_total", {"status": status}) or 0


def _dropped(metrics: ControlPlaneMetrics, reason: str) -> float:
    value = metrics.registry.get_sample_value("mcp_cp_repo_dropped_total", {"reason": reason})
    return value or 0


class Stack:
    """The control plane's repository service and one device session on one broker."""

    def __init__(
        self,
        broker: MosquittoBroker,
        published: Published,
        tmp_path: Path,
        config: MqttTransportConfig,
    ) -> None:
        self.broker = broker
        self.published = published
        self.metrics = ControlPlaneMetrics()
        self.service = RepoMqttService(published.repo.dir, self.metrics)
        self.connection = RepoConnection(
            BrokerAddress(broker.host, broker.port),
            Credentials(username="svc-cp", password="unused", client_id="cp-test-repo"),
        )
        fleet = FleetConfig(
            device_id=DEVICE,
            host=broker.host,
            port=broker.port,
            health_interval_s=3600,
            inference_interval_s=3600,
            reconnect=ReconnectPolicy(first_delay_s=0.05, max_delay_s=0.2),
        )
        # Wired as agent/run.py does: the transport on the session's client, handed in.
        mqtt = MqttClient(fleet.mqtt_settings())
        self.transport = MqttRepoTransport(mqtt, DEVICE, config)
        self.session = FleetSession(
            fleet, spool=Spool(tmp_path / "spool.db"), mqtt=mqtt, repo=self.transport
        )

    def updater(self, tmp_path: Path) -> Updater:
        metadata = tmp_path / "device-metadata"
        metadata.mkdir(exist_ok=True)
        return Updater(
            str(metadata),
            self.transport.metadata_url,
            target_base_url=self.transport.targets_url,
            fetcher=self.transport.fetcher(),
            bootstrap=self.published.repo.root_bytes(),
        )


@pytest.fixture
async def stack(
    fresh_mosquitto: MosquittoBroker,
    published: Published,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> AsyncIterator[Stack]:
    config = getattr(request, "param", None) or MqttTransportConfig(
        chunk_timeout_s=5.0, chunk_retries=3, backoff_initial_s=0.05, backoff_max_s=0.2
    )
    s = Stack(fresh_mosquitto, published, tmp_path, config)
    await s.service.start(s.connection)
    await s.session.start()
    await s.session.wait_online(10)
    try:
        yield s
    finally:
        await s.session.close()
        await s.service.stop()


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


async def test_ngclient_refresh_and_download_over_mqtt(stack: Stack, tmp_path: Path) -> None:
    updater = stack.updater(tmp_path)
    await asyncio.to_thread(updater.refresh)  # also probes for 2.root.json: not_found → 404
    info = await asyncio.to_thread(updater.get_targetinfo, TARGET)
    assert info is not None and info.length == SIZE
    dest = tmp_path / "staging.mcpb"
    seen: list[tuple[int, int]] = []
    got = await asyncio.to_thread(
        stack.transport.download,
        stack.published.url(stack.transport.targets_url),
        dest,
        length=info.length,
        progress=lambda done, total: seen.append((done, total)),
    )
    assert got == SIZE
    with dest.open("rb") as f:
        info.verify_length_and_hashes(f)
    assert dest.read_bytes() == stack.published.data
    assert seen[-1] == (SIZE, SIZE)
    assert _sent(stack.metrics, "not_found") >= 1  # ngclient's probe for the next root


async def test_not_found_is_http_404(
    stack: Stack, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="mcp.controlplane.repository.mqtt")
    fetcher = stack.transport.fetcher()
    with pytest.raises(DownloadHTTPError) as e:
        await asyncio.to_thread(
            fetcher.download_bytes, stack.transport.metadata_url + "7.root.json", 10_000
        )
    assert e.value.status_code == 404
    # Every update probes for the next root until it is not found: that is no warning.
    assert not [r for r in caplog.records if "not_found" in r.getMessage()]
    url = stack.transport.targets_url + "digits/9.9.9/" + "0" * 64 + ".digits-9.9.9.mcpb"
    with pytest.raises(DownloadHTTPError) as e:
        await asyncio.to_thread(stack.transport.download, url, tmp_path / "x", length=100)
    assert e.value.status_code == 404
    missing = [r.getMessage() for r in caplog.records if "not_found" in r.getMessage()]
    assert len(missing) == 1 and "digits-9.9.9.mcpb" in missing[0], missing


async def test_file_longer_than_allowed_is_refused_before_writing(
    stack: Stack, tmp_path: Path
) -> None:
    dest = tmp_path / "capped.mcpb"
    allowed = SIZE - 1000
    with pytest.raises(DownloadLengthMismatchError):
        await asyncio.to_thread(
            stack.transport.download,
            stack.published.url(stack.transport.targets_url),
            dest,
            length=allowed,
        )
    assert dest.stat().st_size <= allowed
    # A partial file already at the cap: the probe still learns the file is longer.
    dest.write_bytes(stack.published.data[:allowed])
    with pytest.raises(DownloadLengthMismatchError):
        await asyncio.to_thread(
            stack.transport.download,
            stack.published.url(stack.transport.targets_url),
            dest,
            length=allowed,
        )
    assert dest.stat().st_size == allowed


@pytest.mark.parametrize(
    "stack",
    [MqttTransportConfig(chunk_timeout_s=2.0, chunk_retries=0, backoff_initial_s=0.05)],
    indirect=True,
)
async def test_broker_killed_mid_transfer_resumes_with_at_most_one_window_resent(
    stack: Stack, tmp_path: Path
) -> None:
    dest = tmp_path / "resume.mcpb"
    url = stack.published.url(stack.transport.targets_url)
    killed = False

    def kill_midway(done: int, total: int) -> None:
        nonlocal killed
        if not killed and done >= total // 3:
            killed = True
            stack.broker.kill()

    before = _sent(stack.metrics)
    with pytest.raises(DownloadError):
        await asyncio.to_thread(
            stack.transport.download, url, dest, length=SIZE, progress=kill_midway
        )
    partial = dest.stat().st_size
    assert 0 < partial < SIZE and partial % CHUNK == 0
    assert dest.read_bytes() == stack.published.data[:partial]

    stack.broker.start()
    await stack.session.wait_online(20)
    got, resumed_from = None, 0
    for _ in range(40):  # the service's paho session reconnects on its own 1 s backoff
        resumed_from = dest.stat().st_size
        try:
            got = await asyncio.to_thread(stack.transport.download, url, dest, length=SIZE)
            break
        except SlowRetrievalError:
            continue
    assert got == SIZE - resumed_from and resumed_from >= partial  # only the rest was fetched
    assert _sha256(dest) == stack.published.info.hashes["sha256"]
    chunks = -(-SIZE // CHUNK)
    resent = _sent(stack.metrics) - before - chunks
    assert resent <= stack.transport.config.window


@pytest.mark.parametrize(
    "stack",
    [
        MqttTransportConfig(
            chunk_timeout_s=0.3, chunk_retries=2, backoff_initial_s=0.05, backoff_max_s=0.1
        )
    ],
    indirect=True,
)
async def test_stalled_server_raises_slow_retrieval(stack: Stack, tmp_path: Path) -> None:
    await stack.service.stop()
    with pytest.raises(SlowRetrievalError):
        await asyncio.to_thread(
            stack.transport.download,
            stack.published.url(stack.transport.targets_url),
            tmp_path / "stalled.mcpb",
            length=SIZE,
        )
    assert stack.transport.retries >= 2


async def test_total_timeout_raises_slow_retrieval(
    fresh_mosquitto: MosquittoBroker, published: Published, tmp_path: Path
) -> None:
    config = MqttTransportConfig(
        chunk_timeout_s=0.2,
        chunk_retries=1000,
        backoff_initial_s=0.01,
        backoff_max_s=0.05,
        total_timeout_s=1.0,
    )
    s = Stack(fresh_mosquitto, published, tmp_path, config)
    await s.session.start()
    try:
        await s.session.wait_online(10)
        with pytest.raises(SlowRetrievalError, match="total timeout"):
            await asyncio.to_thread(
                s.transport.download,
                published.url(s.transport.targets_url),
                tmp_path / "t.mcpb",
                length=SIZE,
            )
    finally:
        await s.session.close()


async def test_tampered_chunk_fails_the_hash_check(stack: Stack, tmp_path: Path) -> None:
    stored = stack.published.stored
    with stored.open("r+b") as f:
        f.seek(SIZE // 2)
        byte = f.read(1)
        f.seek(SIZE // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    dest = tmp_path / "tampered.mcpb"
    await asyncio.to_thread(
        stack.transport.download,
        stack.published.url(stack.transport.targets_url),
        dest,
        length=SIZE,
    )
    with dest.open("rb") as f, pytest.raises(LengthOrHashMismatchError):
        stack.published.info.verify_length_and_hashes(f)


class Prober:
    """A raw client speaking the repository protocol by hand, as a misbehaving device would."""

    def __init__(self, broker: MosquittoBroker) -> None:
        self.client = MqttClient(
            MqttSettings(host=broker.host, port=broker.port, client_id="prober", clean_start=True)
        )
        self.replies: asyncio.Queue[InboundMessage] = asyncio.Queue()
        self.client.set_handler(self.replies.put_nowait)

    async def start(self) -> None:
        await self.client.connect()
        await self.client.subscribe(
            Subscription(topics.repo_reply(DEVICE)), Subscription(topics.repo_reply("someone-else"))
        )

    async def ask(
        self, payload: bytes, *, reply_to: str | None = None, correlation: bytes = b"c1"
    ) -> None:
        await self.client.publish(
            topics.repo_request(DEVICE),
            payload,
            1,
            response_topic=reply_to or topics.repo_reply(DEVICE),
            correlation_data=correlation,
        )

    async def reply(self) -> tuple[RepoReply, InboundMessage]:
        msg = await asyncio.wait_for(self.replies.get(), 10)
        return RepoReply.from_user_properties(msg.user_properties), msg


async def test_bad_requests_are_answered_or_dropped_and_counted(
    stack: Stack, tmp_path: Path
) -> None:
    prober = Prober(stack.broker)
    await prober.start()
    try:
        await prober.ask(b"{not json")
        reply, msg = await prober.reply()
        assert reply.status is RepoStatus.BAD_REQUEST and reply.error and msg.payload == b""

        await prober.ask(orjson.dumps({"path": "metadata/../../etc/passwd"}))
        reply, _ = await prober.reply()
        assert reply.status is RepoStatus.BAD_REQUEST and "path" in reply.error

        await prober.ask(orjson.dumps({"path": "metadata/root.json", "pad": "x" * 4000}))
        reply, _ = await prober.reply()
        assert reply.status is RepoStatus.BAD_REQUEST and "exceeds" in reply.error

        os.symlink("/etc/hostname", stack.published.repo.metadata_dir / "link.json")
        await prober.ask(orjson.dumps({"path": "metadata/link.json"}))
        reply, _ = await prober.reply()
        assert reply.status is RepoStatus.NOT_FOUND and reply.error

        await prober.ask(
            orjson.dumps({"path": "metadata/root.json"}),
            reply_to=topics.repo_reply("someone-else"),
            correlation=b"c2",
        )
        await prober.ask(
            orjson.dumps({"path": "metadata/root.json", "length": 64}), correlation=b"c3"
        )
        reply, msg = await prober.reply()  # the misdirected request got no reply at all
        assert msg.topic == topics.repo_reply(DEVICE) and msg.correlation_data == b"c3"
        root = stack.published.repo.root_bytes()
        assert reply.status is RepoStatus.OK and reply.size == len(root)
        assert msg.payload == root[:64]
        assert _dropped(stack.metrics, "bad_response_topic") == 1
        assert _sent(stack.metrics, "bad_request") == 3
    finally:
        await prober.client.close()
    # The service still serves a real client after all that.
    dest = tmp_path / "after.mcpb"
    await asyncio.to_thread(
        stack.transport.download,
        stack.published.url(stack.transport.targets_url),
        dest,
        length=SIZE,
    )
    assert _sha256(dest) == stack.published.info.hashes["sha256"]


# ---- HTTP ------------------------------------------------------------------------------------


@pytest.fixture
async def http_repo(published: Published) -> AsyncIterator[str]:
    async def endless(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        for _ in range(64):
            await response.write(b"\0" * 65536)
        return response

    app = web.Application()
    app.router.add_get("/endless", endless)
    app.router.add_static("/repo/", published.repo.dir)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}/"
    finally:
        await runner.cleanup()


async def test_http_refresh_download_and_resume(
    http_repo: str, published: Published, tmp_path: Path
) -> None:
    transport = HttpRepoTransport(http_repo + "repo")
    metadata = tmp_path / "http-metadata"
    metadata.mkdir()
    updater = Updater(
        str(metadata),
        transport.metadata_url,
        target_base_url=transport.targets_url,
        fetcher=transport.fetcher(),
        bootstrap=published.repo.root_bytes(),
    )
    await asyncio.to_thread(updater.refresh)
    info = await asyncio.to_thread(updater.get_targetinfo, TARGET)
    assert info is not None
    dest = tmp_path / "http.mcpb"
    dest.write_bytes(published.data[:1_000_000])  # a partial download from before
    got = await asyncio.to_thread(
        transport.download, published.url(transport.targets_url), dest, length=info.length
    )
    assert got == SIZE - 1_000_000
    with dest.open("rb") as f:
        info.verify_length_and_hashes(f)
    assert (
        await asyncio.to_thread(
            transport.download, published.url(transport.targets_url), dest, length=info.length
        )
        == 0
    )


async def test_http_404_and_length_cap(
    http_repo: str, published: Published, tmp_path: Path
) -> None:
    transport = HttpRepoTransport(http_repo + "repo/")
    with pytest.raises(DownloadHTTPError) as e:
        await asyncio.to_thread(
            transport.download,
            transport.targets_url + "nope/x.mcpb",
            tmp_path / "missing",
            length=10,
        )
    assert e.value.status_code == 404
    capped = tmp_path / "capped"
    with pytest.raises(DownloadLengthMismatchError):
        await asyncio.to_thread(
            transport.download, published.url(transport.targets_url), capped, length=SIZE - 1
        )
    assert capped.stat().st_size == 0
    endless = tmp_path / "endless"
    with pytest.raises(DownloadLengthMismatchError):
        await asyncio.to_thread(
            HttpRepoTransport(http_repo).download, http_repo + "endless", endless, length=100_000
        )
    assert endless.stat().st_size <= 100_000
