"""Prefetch, a staged rollout's prefetch stage, on the real update path.

The desired state's ``prefetch`` (``shared.protocol.state.DesiredModel``): the device downloads
the version from a real signed TUF repository served over Mosquitto (the control plane's
``RepoMqttService`` to the device's ``FleetSession`` and ``MqttRepoTransport``), verifies it as
for an install (TUF hashes and length, the publisher's signature, manifest, variant), installs
it beside the running version without loading it, and reports it among its installed versions.
A later desired state that makes it stable or canary switches to it without downloading it
again: the test counts the target downloads the device makes and the bytes the repository sent
over the broker. A failed prefetch is reported by events and leaves the running version, its
deployment record and the reported phase alone; a prefetch killed mid-way resumes at the next
start. The documents the control plane builds and signs are checked first.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from tuf.ngclient import FetcherInterface

from mcp_edge.agent.fleet.session import FleetConfig, FleetSession
from mcp_edge.agent.fleet.spool import Spool
from mcp_edge.agent.runtime.manager import ModelManager, ModelSource
from mcp_edge.agent.runtime.runner import ModelRunner
from mcp_edge.agent.serving.serve import runner_factory
from mcp_edge.agent.update.machine import Cause, Phase
from mcp_edge.agent.update.steps import loaded_roles
from mcp_edge.agent.update.transport import Progress, RepoTransport
from mcp_edge.agent.update.transport_mqtt import MqttRepoTransport, MqttTransportConfig
from mcp_edge.agent.update.updater import UpdateAgent
from mcp_edge.controlplane.broker.base import Credentials
from mcp_edge.controlplane.db.deployments import DeviceModelView, VersionView
from mcp_edge.controlplane.desired import build_desired_state
from mcp_edge.controlplane.metrics import ControlPlaneMetrics
from mcp_edge.controlplane.mqtt import BrokerAddress
from mcp_edge.controlplane.repository.mqtt_service import RepoConnection, RepoMqttService
from mcp_edge.shared.errors import MessageError
from mcp_edge.shared.mqtt import MqttClient
from mcp_edge.shared.protocol.reports import EventOutcome
from mcp_edge.shared.protocol.state import (
    CanarySpec,
    DesiredModel,
    TargetRef,
    sign_desired_state,
    verify_desired_state,
)
from mcp_edge.shared.signing import PrivateKey, sign_document
from mcp_edge.tooling.models import DigitsModels
from mcp_edge.tooling.mosquitto import MosquittoBroker
from tests.integration.test_update_agent import (
    Env,
    Sink,
    answer,
    flip_byte,
    installed_v1,
    repo_file,
    run_child,
)
from tests.support.tuf import DEVICE, update_profile

SHA = "ab" * 32
NOW = datetime(2030, 1, 1, tzinfo=timezone.utc)
DIRECTOR = PrivateKey.generate()


# ---------------------------------------------------------------------- the document


def version_view(version: str, sha: str = SHA) -> VersionView:
    return VersionView(model="digits", version=version, version_numeric=1,
                       target_path=f"digits/{version}/digits-{version}.mcpb", sha256=sha,
                       length=4096, profiles=())  # fmt: skip


def build(view: DeviceModelView, *published: str) -> dict[str, Any]:
    """The signed document of one device wanting ``view``, ``published`` versions known."""
    versions = {("digits", v): version_view(v, f"{i:02x}" * 32) for i, v in enumerate(published)}
    state = build_desired_state(DEVICE, 3, NOW, timedelta(hours=1), [view], versions)
    return sign_desired_state(state, DIRECTOR)


def accepted(envelope: dict[str, Any]) -> DesiredModel:
    state = verify_desired_state(envelope, [DIRECTOR.public_key], device_id=DEVICE, last_seq=2,
                                 now=NOW)  # fmt: skip
    return state.models[0]


def test_the_prefetch_is_signed_into_the_desired_state_and_left_out_while_none() -> None:
    view = DeviceModelView(device_id=DEVICE, model="digits", stable_version="1.0.0",
                           prefetch_version="1.1.0")  # fmt: skip
    envelope = build(view, "1.0.0", "1.1.0")
    model = accepted(envelope)
    assert model.prefetch == TargetRef(version="1.1.0", target_path="digits/1.1.0/digits-1.1.0.mcpb",
                                       sha256="01" * 32, length=4096)  # fmt: skip
    assert model.stable.version == "1.0.0" and model.canary is None

    # Without a prefetch the model holds exactly the fields of an agent that predates it (its
    # schema refuses unknown fields), with or without a canary.
    plain = build(DeviceModelView(device_id=DEVICE, model="digits", stable_version="1.0.0",
                                  canary_version="1.1.0"), "1.0.0", "1.1.0")  # fmt: skip
    assert set(plain["signed"]["models"][0]) == {
        "name", "stable", "canary", "shadow", "rollback", "batching"}  # fmt: skip
    assert accepted(plain).prefetch is None


def test_a_prefetch_of_a_version_the_model_runs_is_refused() -> None:
    stable = TargetRef(version="1.0.0", target_path="digits/1.0.0/d.mcpb", sha256=SHA, length=9)
    other = stable.model_copy(update={"version": "1.1.0"})
    for running in (
        {"stable": stable},
        {"stable": stable, "canary": CanarySpec.of(other)},
        {"stable": stable, "shadow": other},
    ):
        same = running.get("shadow") or running.get("canary") or stable
        target = same.target if isinstance(same, CanarySpec) else same
        with pytest.raises(ValidationError, match="already runs"):
            DesiredModel(name="digits", prefetch=target, **running)
    # A signed document that breaks the rule is refused by the device as any bad schema.
    envelope = build(DeviceModelView(device_id=DEVICE, model="digits", stable_version="1.0.0"),
                     "1.0.0")  # fmt: skip
    doc = envelope["signed"]
    doc["models"][0]["prefetch"] = doc["models"][0]["stable"]
    with pytest.raises(MessageError, match="already runs"):
        accepted(sign_document(doc, DIRECTOR))


def test_the_control_plane_leaves_out_a_prefetch_it_cannot_name_and_keeps_the_model() -> None:
    gone = DeviceModelView(device_id=DEVICE, model="digits", stable_version="1.0.0",
                           prefetch_version="1.2.0")  # fmt: skip
    model = accepted(build(gone, "1.0.0", "1.1.0"))
    assert (model.stable.version, model.prefetch) == ("1.0.0", None)
    running = DeviceModelView(device_id=DEVICE, model="digits", stable_version="1.0.0",
                              canary_version="1.1.0", prefetch_version="1.1.0")  # fmt: skip
    model = accepted(build(running, "1.0.0", "1.1.0"))
    assert model.canary is not None and model.canary.target.version == "1.1.0"
    assert model.prefetch is None


# ---------------------------------------------------------------------- the device


class CountingFetcher(FetcherInterface):
    """The transport's metadata fetcher, counting the bytes it hands to ngclient."""

    def __init__(self, inner: FetcherInterface, counts: CountingTransport) -> None:
        self._inner, self._counts = inner, counts

    def _fetch(self, url: str) -> Iterator[bytes]:
        for chunk in self._inner.fetch(url):
            self._counts.metadata_bytes += len(chunk)
            yield chunk


class CountingTransport:
    """The device's real repository transport, counting what it fetches (implements
    ``agent.update.transport.RepoTransport``)."""

    def __init__(self, inner: RepoTransport) -> None:
        self.inner = inner
        self.downloads: list[str] = []
        self.target_bytes = 0
        self.metadata_bytes = 0

    @property
    def metadata_url(self) -> str:
        return self.inner.metadata_url

    @property
    def targets_url(self) -> str:
        return self.inner.targets_url

    def fetcher(self) -> FetcherInterface:
        return CountingFetcher(self.inner.fetcher(), self)

    def download(self, url: str, dest: Path, *, length: int,
                 progress: Progress | None = None) -> int:  # fmt: skip
        self.downloads.append(url)
        done = self.inner.download(url, dest, length=length, progress=progress)
        self.target_bytes += done
        return done

    def fetched(self, ref: TargetRef) -> int:
        """How many times the target of ``ref`` was downloaded."""
        return sum(url.endswith(f"{ref.sha256}.{ref.target_path.rpartition('/')[2]}")
                   for url in self.downloads)  # fmt: skip


@dataclass
class Device:
    """One device's update agent fetching over MQTT, and what it fetched and loaded."""

    env: Env
    transport: CountingTransport
    metrics: ControlPlaneMetrics
    loads: list[str] = field(default_factory=list)
    """Every version a model manager of this device was asked to load, in order."""
    managers: list[ModelManager] = field(default_factory=list)

    def served_bytes(self) -> float:
        """Bytes the control plane's repository service sent over the broker so far."""
        value = self.metrics.registry.get_sample_value("mcp_cp_repo_bytes_total")
        return value or 0.0

    def agent(self, **kw: Any) -> tuple[UpdateAgent, ModelManager, Sink]:
        real = runner_factory(update_profile(), workers=1, threads=1, backend=None)

        def factory(source: ModelSource) -> Sequence[ModelRunner]:
            self.loads.append(source.version)
            return real(source)

        manager = ModelManager(factory)
        self.managers.append(manager)
        return self.env.agent(transport=self.transport, manager=manager, **kw)

    def desired(self, seq: int, stable: TargetRef, **kw: Any) -> dict[str, Any]:
        return self.env.desired(seq, stable, **kw)


@contextlib.asynccontextmanager
async def repository_over_mqtt(
    env: Env, broker: MosquittoBroker, metrics: ControlPlaneMetrics
) -> AsyncIterator[MqttRepoTransport]:
    """The control plane's repository service and a device's fleet session on Mosquitto; the
    session's MQTT repository transport."""
    service = RepoMqttService(env.repo.repo.dir, metrics)
    suffix = uuid.uuid4().hex[:8]
    await service.start(RepoConnection(
        BrokerAddress(broker.host, broker.port),
        Credentials(username="svc-cp", password="unused", client_id=f"cp-repo-{suffix}"),
    ))  # fmt: skip
    config = FleetConfig(device_id=DEVICE, client_id=f"{DEVICE}-{suffix}", host=broker.host,
                         port=broker.port, health_interval_s=3600, inference_interval_s=3600)  # fmt: skip
    mqtt = MqttClient(config.mqtt_settings())
    transport = MqttRepoTransport(mqtt, DEVICE, MqttTransportConfig(
        chunk_timeout_s=5.0, chunk_retries=3, backoff_initial_s=0.05, backoff_max_s=0.2))  # fmt: skip
    session = FleetSession(config, spool=Spool(env.tmp / "spool.db"), mqtt=mqtt, repo=transport)
    await session.start()
    try:
        await session.wait_online(10)
        yield transport
    finally:
        await session.close()
        await service.stop()


@pytest.fixture
async def device(
    tmp_path: Path, digits: DigitsModels, mosquitto: MosquittoBroker
) -> AsyncIterator[Device]:
    env = Env(tmp_path, digits)
    metrics = ControlPlaneMetrics()
    async with repository_over_mqtt(env, mosquitto, metrics) as mqtt:
        d = Device(env, CountingTransport(mqtt), metrics)
        yield d
        for m in d.managers:
            await m.close()
        assert mqtt.requests_sent > 0  # the test really went through the broker


async def answers(manager: ModelManager, env: Env, n: int = 10) -> set[str]:
    return {(await answer(manager, env.digits))[0] for _ in range(n)}


def ok_phases(sink: Sink, version: str, since: int = 0) -> list[Phase]:
    return [e.phase for e in sink.events[since:]
            if e.version == version and e.outcome is EventOutcome.OK]  # fmt: skip


async def test_prefetch_stores_a_verified_version_unrun_and_the_switch_downloads_nothing(
    device: Device,
) -> None:
    env = device.env
    seen: list[tuple[Phase, list[str]]] = []
    holder: list[UpdateAgent] = []

    def hook(phase: Phase, record: Any) -> None:
        if record.role == "prefetch":  # what the device reports while the prefetch runs
            seen.append((phase, holder[0].reported_state().models[0].installed_versions))

    agent, manager, sink = device.agent(phase_hook=hook)
    holder.append(agent)
    await agent.resume()
    v1 = env.publish("1.0.0")
    await agent.handle_desired(device.desired(1, v1))
    v2 = env.publish("1.1.0")
    before, bytes_before = len(sink.events), device.served_bytes()

    await agent.handle_desired(device.desired(2, v1, prefetch=v2))

    # Downloaded once, every byte over the broker, verified as for an install...
    assert device.transport.fetched(v2) == 1
    assert device.served_bytes() - bytes_before >= v2.length
    info = agent.store.installed("digits", "1.1.0")
    assert info is not None and (info.sha256, info.length) == (v2.sha256, v2.length)
    assert info.signer_keyid == env.repo.publisher.keyid
    assert ok_phases(sink, "1.1.0", before) == [Phase.DOWNLOADING, Phase.VERIFYING,
                                                Phase.INSTALLING]  # fmt: skip
    assert "prefetched" in [e for e in sink.events if e.phase is Phase.INSTALLING][-1].message
    # ...never loaded: 1.0.0 alone serves, and no event of 1.1.0 reaches loading.
    assert device.loads == ["1.0.0"]
    assert loaded_roles(manager, "digits") == {"1.0.0": "stable"}
    assert await answers(manager, env) == {"1.0.0"}
    assert not {Phase.LOADING, Phase.WARMING, Phase.ACTIVE} & {
        e.phase for e in sink.events if e.version == "1.1.0"}  # fmt: skip
    # Reported among the installed versions once stored, not before.
    assert seen == [(Phase.DOWNLOADING, ["1.0.0"]), (Phase.VERIFYING, ["1.0.0"]),
                    (Phase.INSTALLING, ["1.0.0"]), (Phase.IDLE, ["1.0.0", "1.1.0"])]  # fmt: skip
    status = sink.reported[-1]
    assert status.applied_seq == 2
    model = status.models[0]
    assert (model.phase, model.active_version, model.installed_versions, model.last_error) == (
        Phase.ACTIVE, "1.0.0", ["1.0.0", "1.1.0"], None)  # fmt: skip
    assert list((env.state / "staging").iterdir()) == []

    # The same prefetch asked again: nothing to do.
    before = len(sink.events)
    await agent.handle_desired(device.desired(3, v1, prefetch=v2))
    assert len(sink.events) == before and device.transport.fetched(v2) == 1

    # The switch: 1.1.0 becomes stable from the store; only TUF metadata moves.
    bytes_before, metadata_before = device.served_bytes(), device.transport.metadata_bytes
    await agent.handle_desired(device.desired(4, v2))
    assert (
        device.transport.fetched(v2) == 1 and device.transport.target_bytes == v1.length + v2.length
    )
    assert device.served_bytes() - bytes_before < v2.length
    assert device.transport.metadata_bytes > metadata_before  # TUF was refreshed for the switch
    assert await answers(manager, env) == {"1.1.0"}
    assert device.loads == ["1.0.0", "1.1.0"]
    assert ok_phases(sink, "1.1.0", before) == [Phase.DOWNLOADING, Phase.VERIFYING,
                                                Phase.INSTALLING, Phase.LOADING, Phase.WARMING,
                                                Phase.ACTIVE]  # fmt: skip
    index = agent.store.index("digits")
    assert (index.active, index.previous, index.prefetch) == ("1.1.0", "1.0.0", None)


async def test_a_prefetch_stays_through_upgrades_and_restarts_until_let_go(
    device: Device,
) -> None:
    env = device.env
    agent, _, sink = device.agent()
    await agent.resume()
    v = {ver: env.publish(ver) for ver in ("1.0.0", "1.1.0", "1.2.0", "1.3.0")}
    await agent.handle_desired(device.desired(1, v["1.0.0"]))
    await agent.handle_desired(device.desired(2, v["1.0.0"], prefetch=v["1.2.0"]))

    # An upgrade commits and collects old versions: the prefetch stays.
    await agent.handle_desired(device.desired(3, v["1.1.0"], prefetch=v["1.2.0"]))
    assert agent.store.installed_versions("digits") == ["1.0.0", "1.1.0", "1.2.0"]
    assert sink.reported[-1].models[0].installed_versions == ["1.0.0", "1.1.0", "1.2.0"]
    # So does a restart (which collects too); the restarted agent loads only what serves.
    again, restarted, sink = device.agent()
    await again.resume()
    assert again.store.installed_versions("digits") == ["1.0.0", "1.1.0", "1.2.0"]
    assert loaded_roles(restarted, "digits") == {"1.1.0": "stable"}
    assert await answers(restarted, env) == {"1.1.0"}

    # Another prefetch replaces it: the old one is collected, and the new one becomes the
    # canary from the store.
    await again.handle_desired(device.desired(4, v["1.1.0"], prefetch=v["1.3.0"]))
    assert again.store.installed_versions("digits") == ["1.0.0", "1.1.0", "1.3.0"]
    await again.handle_desired(
        device.desired(5, v["1.1.0"], canary=CanarySpec(target=v["1.3.0"], weight=1.0))
    )
    assert await answers(restarted, env) == {"1.3.0"}
    assert [device.transport.fetched(ref) for ref in v.values()] == [1, 1, 1, 1]
    assert device.loads == ["1.0.0", "1.1.0", "1.1.0", "1.3.0"]
    committed = again.store.index("digits")
    assert committed.canary is not None and committed.canary.version == "1.3.0"

    # A prefetch the desired state stops naming is let go.
    canary = CanarySpec(target=v["1.3.0"], weight=1.0)
    await again.handle_desired(device.desired(6, v["1.1.0"], canary=canary, prefetch=v["1.2.0"]))
    assert "1.2.0" in again.store.installed_versions("digits")
    await again.handle_desired(device.desired(7, v["1.1.0"], canary=canary))
    assert again.store.installed_versions("digits") == ["1.0.0", "1.1.0", "1.3.0"]
    assert sink.reported[-1].models[0].installed_versions == ["1.0.0", "1.1.0", "1.3.0"]
    assert again.store.index("digits").prefetch is None


BadPrefetch = Callable[[Env], Awaitable[tuple[TargetRef, Cause, Phase]]]


async def _tampered_chunk(env: Env) -> tuple[TargetRef, Cause, Phase]:
    ref = env.publish("1.1.0")
    flip_byte(repo_file(env, ref), ref.length // 2)
    return ref, Cause.HASH_MISMATCH, Phase.VERIFYING


async def _unknown_publisher(env: Env) -> tuple[TargetRef, Cause, Phase]:
    return env.publish("1.1.0", key=PrivateKey.generate()), Cause.PUBLISHER, Phase.VERIFYING


async def _target_not_listed(env: Env) -> tuple[TargetRef, Cause, Phase]:
    ref = env.publish("1.1.0")
    env.repo.repo.remove_target(ref.target_path)
    return ref, Cause.TARGET_MISSING, Phase.DOWNLOADING


async def _mix_and_match(env: Env) -> tuple[TargetRef, Cause, Phase]:
    ref = env.publish("1.1.0")
    other = env.repo.repo.targets().signed.targets["digits/1.0.0/digits-1.0.0.mcpb"]
    mixed = ref.model_copy(update={"sha256": other.hashes["sha256"], "length": other.length})
    return mixed, Cause.TARGET_MISMATCH, Phase.DOWNLOADING


async def _downgrade(env: Env) -> tuple[TargetRef, Cause, Phase]:
    return env.publish("0.9.0"), Cause.DOWNGRADE, Phase.DOWNLOADING


BAD_PREFETCHES: dict[str, BadPrefetch] = {
    "tampered-chunk": _tampered_chunk,
    "unknown-publisher": _unknown_publisher,
    "target-not-listed": _target_not_listed,
    "mix-and-match": _mix_and_match,
    "downgrade": _downgrade,
}


@pytest.mark.parametrize("bad", list(BAD_PREFETCHES))
async def test_a_failed_prefetch_is_reported_and_what_serves_is_untouched(
    device: Device, bad: str
) -> None:
    env = device.env
    agent, manager, sink = device.agent()
    await agent.resume()
    v1 = env.publish("1.0.0")
    await agent.handle_desired(device.desired(1, v1))
    ref, cause, phase = await BAD_PREFETCHES[bad](env)
    before = len(sink.events)

    await agent.handle_desired(device.desired(2, v1, prefetch=ref))

    errors = [(e.phase, e.cause) for e in sink.events[before:]
              if e.outcome is EventOutcome.ERROR]  # fmt: skip
    assert errors == [(phase, cause.value)]
    assert all(e.version == ref.version for e in sink.events[before:])
    assert ok_phases(sink, ref.version, before)[-1] is Phase.ROLLING_BACK
    # The running version, its deployment record and the reported state are as before.
    assert await answers(manager, env) == {"1.0.0"}
    assert device.loads == ["1.0.0"]
    record = agent.store.record("digits")
    assert record is not None and (record.to_version, record.phase) == ("1.0.0", Phase.ACTIVE)
    model = sink.reported[-1].models[0]
    assert (model.phase, model.active_version, model.installed_versions, model.last_error) == (
        Phase.ACTIVE, "1.0.0", ["1.0.0"], None)  # fmt: skip
    prefetch = agent.store.record("digits", prefetch=True)
    assert prefetch is not None and (prefetch.phase, prefetch.cause) == (Phase.FAILED, cause)
    assert agent.store.index("digits").prefetch is None
    assert list((env.state / "staging").iterdir()) == []

    # A good version prefetches after it, and the switch to it downloads nothing more.
    good = env.publish("1.2.0")
    await agent.handle_desired(device.desired(3, v1, prefetch=good))
    assert sink.reported[-1].models[0].installed_versions == ["1.0.0", "1.2.0"]
    await agent.handle_desired(device.desired(4, good))
    assert await answers(manager, env) == {"1.2.0"}
    assert device.transport.fetched(good) == 1


@pytest.fixture
async def file_env(tmp_path: Path, digits: DigitsModels) -> AsyncIterator[Env]:
    e = Env(tmp_path, digits)
    yield e
    for m in e.managers:
        await m.close()


@pytest.mark.parametrize("phase", ["downloading", "verifying", "installing"])
async def test_a_prefetch_killed_mid_way_resumes_at_the_next_start(
    file_env: Env, phase: str
) -> None:
    env = file_env
    await installed_v1(env)
    v1 = env.repo.repo.targets().signed.targets["digits/1.0.0/digits-1.0.0.mcpb"]
    stable = TargetRef(version="1.0.0", target_path=v1.path, sha256=v1.hashes["sha256"],
                       length=v1.length)  # fmt: skip
    target = env.publish("1.1.0")

    killed = run_child(env, envelope=env.desired(2, stable, prefetch=target), kill_at=phase,
                       kill_version="1.1.0")  # fmt: skip
    assert killed == {"killed": True}
    stored = json.loads((env.state / "updates" / "prefetch" / "digits.json").read_text())
    assert (stored["role"], stored["phase"]) == ("prefetch", phase)

    result = run_child(env)
    assert result["serving"]["digits"]["version"] == "1.0.0"
    status = result["status"]["models"]["digits"]
    assert status["installed"] == ["1.0.0", "1.1.0"]
    assert status["index"]["prefetch"] == "1.1.0"
    assert (status["record"]["to_version"], status["record"]["phase"]) == ("1.0.0", "active")
    assert status["prefetch_record"]["phase"] == "idle"
    assert list((env.state / "staging").iterdir()) == []
