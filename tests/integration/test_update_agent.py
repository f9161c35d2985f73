"""The update agent end to end: real signed TUF repositories, real signed bundles of the digits
model, the file transport, the real onnxruntime model manager, and real crashes (SIGKILL).

Each attack is refused with its cause while the running version keeps answering.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tuf.api.exceptions import DownloadError

from mcp_edge.agent.fleet.session import FleetConfig, FleetSession
from mcp_edge.agent.fleet.spool import Spool
from mcp_edge.agent.runtime.manager import ModelManager, ModelSource
from mcp_edge.agent.runtime.runner import ModelRunner
from mcp_edge.agent.serving.serve import runner_factory
from mcp_edge.agent.update.machine import Cause, Phase
from mcp_edge.agent.update.steps import RetryPolicy
from mcp_edge.agent.update.store import DiskUsage
from mcp_edge.agent.update.transport import Progress
from mcp_edge.agent.update.transport_file import FileRepoTransport
from mcp_edge.agent.update.transport_mqtt import MqttRepoTransport, MqttTransportConfig
from mcp_edge.agent.update.updater import UpdateAgent
from mcp_edge.controlplane.broker.base import Credentials
from mcp_edge.controlplane.metrics import ControlPlaneMetrics
from mcp_edge.controlplane.mqtt import BrokerAddress
from mcp_edge.controlplane.repository.mqtt_service import RepoConnection, RepoMqttService
from mcp_edge.shared.errors import ExpiredError, ReplayError, SigningError
from mcp_edge.shared.mqtt import MqttClient
from mcp_edge.shared.profiles import HardwareProfile
from mcp_edge.shared.protocol.canary import CanaryPolicy
from mcp_edge.shared.protocol.state import (
    CanarySpec,
    DeploymentEvent,
    DesiredModel,
    EventOutcome,
    ReportedState,
    TargetRef,
)
from mcp_edge.shared.signing import PrivateKey
from mcp_edge.tooling.models import DigitsModels, onnx_predict
from mcp_edge.tooling.mosquitto import MosquittoBroker
from tests.support.runners import FailingAfterWarmup
from tests.support.tuf import DEVICE, SignedRepo, make_bundle, update_profile

ROOT = Path(__file__).resolve().parents[2]


class Sink:
    """Collects what the agent publishes (implements agent.update.updater.UpdateSink)."""

    def __init__(self) -> None:
        self.events: list[DeploymentEvent] = []
        self.reported: list[ReportedState] = []

    async def publish_event(self, event: DeploymentEvent) -> None:
        self.events.append(event)

    async def publish_reported(self, state: ReportedState) -> None:
        self.reported.append(state)

    def errors(self) -> list[str | None]:
        return [e.cause for e in self.events if e.outcome is EventOutcome.ERROR]


class Env:
    def __init__(self, tmp: Path, digits: DigitsModels) -> None:
        self.tmp, self.digits = tmp, digits
        self.repo = SignedRepo.create(tmp / "cp")
        self.state = tmp / "state"
        self.memory: dict[str, int | None] = {"available": None}
        self.managers: list[ModelManager] = []
        self.default_transport: Any = None

    def bundle(self, version: str, *, key: PrivateKey | str | None = "publisher",
               name: str = "digits") -> Path:  # fmt: skip
        signer = self.repo.publisher if key == "publisher" else key
        assert not isinstance(signer, str)
        return make_bundle(self.digits.onnx_path, self.tmp / "bundles" / str(id(signer)), name,
                           version, signer)  # fmt: skip

    def publish(self, version: str, **kw: Any) -> TargetRef:
        return self.repo.publish(self.bundle(version, **kw), "digits", version)

    def agent(
        self,
        *,
        profile: HardwareProfile | None = None,
        transport: Any = None,
        clock: Callable[[], float] | None = None,
        manager: ModelManager | None = None,
        sink: Sink | None = None,
        **kw: Any,
    ) -> tuple[UpdateAgent, ModelManager, Sink]:
        profile = profile or update_profile()
        if manager is None:
            manager = ModelManager(
                runner_factory(profile, workers=1, threads=1, backend=None),
                available_memory=lambda: self.memory["available"],
            )
            self.managers.append(manager)
        sink = sink or Sink()

        async def no_sleep(_: float) -> None:
            return None

        agent = UpdateAgent(
            self.state, DEVICE, profile, manager,
            transport or self.default_transport or FileRepoTransport(self.repo.directory), [self.repo.repo.director_key()],
            events=sink, tuf_root=self.repo.root_bytes(), sleep=no_sleep,
            **({"clock": clock} if clock else {}), **kw,
        )  # fmt: skip
        return agent, manager, sink

    def desired(self, seq: int, stable: TargetRef, **kw: Any) -> dict[str, Any]:
        return self.repo.desired(seq, [DesiredModel(name="digits", stable=stable, **kw)])


@contextlib.asynccontextmanager
async def mqtt_transport(env: Env, broker: MosquittoBroker) -> AsyncIterator[MqttRepoTransport]:
    """The real path: RepoMqttService serving the repository through Mosquitto to a device's
    FleetSession, whose MqttRepoTransport the agent uses."""
    service = RepoMqttService(env.repo.repo.dir, ControlPlaneMetrics())
    suffix = uuid.uuid4().hex[:8]
    await service.start(RepoConnection(
        BrokerAddress(broker.host, broker.port),
        Credentials(username="svc-cp", password="unused", client_id=f"cp-repo-{suffix}"),
    ))  # fmt: skip
    config = FleetConfig(
        device_id=DEVICE,
        client_id=f"{DEVICE}-{suffix}",
        host=broker.host,
        port=broker.port,
        health_interval_s=3600,
        inference_interval_s=3600,
    )
    mqtt = MqttClient(config.mqtt_settings())
    transport = MqttRepoTransport(
        mqtt,
        DEVICE,
        MqttTransportConfig(
            chunk_timeout_s=5.0, chunk_retries=3, backoff_initial_s=0.05, backoff_max_s=0.2
        ),
    )
    session = FleetSession(config, spool=Spool(env.tmp / "spool.db"), mqtt=mqtt, repo=transport)
    await session.start()
    try:
        await session.wait_online(10)
        yield transport
    finally:
        await session.close()
        await service.stop()


@pytest.fixture(params=["file", "mqtt"])
async def env(
    tmp_path: Path, digits: DigitsModels, request: pytest.FixtureRequest
) -> AsyncIterator[Env]:
    """An Env whose agents fetch through the file transport, or over MQTT through Mosquitto."""
    e = Env(tmp_path, digits)
    async with contextlib.AsyncExitStack() as stack:
        if request.param == "mqtt":
            broker = request.getfixturevalue("mosquitto")
            e.default_transport = await stack.enter_async_context(mqtt_transport(e, broker))
        yield e
        for m in e.managers:
            await m.close()
        if request.param == "mqtt":  # the test really went through the broker
            assert e.default_transport.requests_sent > 0


@pytest.fixture
async def file_env(tmp_path: Path, digits: DigitsModels) -> AsyncIterator[Env]:
    """An Env on the file transport (for tests that bring their own transport or processes)."""
    e = Env(tmp_path, digits)
    yield e
    for m in e.managers:
        await m.close()


async def answer(manager: ModelManager, digits: DigitsModels) -> tuple[str, np.ndarray]:
    lv = manager.route("digits")
    who, out = await manager.infer(lv, {"input": digits.X_test[:5]})
    return who.version, out["probabilities"]


async def installed_v1(env: Env) -> tuple[UpdateAgent, ModelManager, Sink]:
    agent, manager, sink = env.agent()
    await agent.resume()
    await agent.handle_desired(env.desired(1, env.publish("1.0.0")))
    assert manager.get("digits").version == "1.0.0"
    return agent, manager, sink


def record_of(agent: UpdateAgent) -> Any:
    rec = agent.store.record("digits")
    assert rec is not None
    return rec


# ---------------------------------------------------------------------- the happy path


async def test_install_serves_the_model_and_reports_every_step(env: Env) -> None:
    _agent, manager, sink = await installed_v1(env)

    version, probs = await answer(manager, env.digits)
    assert version == "1.0.0"
    np.testing.assert_allclose(probs, onnx_predict(env.digits.onnx_path, env.digits.X_test[:5]),
                               rtol=1e-5, atol=1e-6)  # fmt: skip
    ok_phases = [e.phase for e in sink.events if e.outcome is EventOutcome.OK]
    assert ok_phases == [Phase.DOWNLOADING, Phase.VERIFYING, Phase.INSTALLING, Phase.LOADING,
                         Phase.WARMING, Phase.ACTIVE]  # fmt: skip
    seqs = [e.event_seq for e in sink.events]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    assert all(e.elapsed_ms is not None for e in sink.events if e.outcome is EventOutcome.OK)
    status = sink.reported[-1]
    assert status.applied_seq == 1
    assert (status.models[0].phase, status.models[0].active_version) == (Phase.ACTIVE, "1.0.0")
    assert list((env.state / "staging").iterdir()) == []
    assert (env.state / "models" / "digits" / "1.0.0" / "install.json").is_file()

    # event numbers keep growing across a restart
    again, _, sink2 = env.agent()
    await again.resume()
    await again.handle_desired(env.desired(2, env.publish("1.1.0")))
    assert min(e.event_seq for e in sink2.events) > max(seqs)


async def test_upgrade_is_a_hot_swap_with_no_failed_request(env: Env) -> None:
    agent, manager, _ = await installed_v1(env)
    target = env.publish("1.1.0")
    seen: list[str] = []
    failures: list[BaseException] = []
    stop = asyncio.Event()

    async def client() -> None:
        while not stop.is_set():
            try:
                version, _ = await answer(manager, env.digits)
                seen.append(version)
            except Exception as e:
                failures.append(e)
            await asyncio.sleep(0)

    task = asyncio.create_task(client())
    await agent.handle_desired(env.desired(2, target))
    while "1.1.0" not in seen:
        await asyncio.sleep(0)
    stop.set()
    await task

    assert failures == []
    assert seen[0] == "1.0.0" and seen[-1] == "1.1.0"
    index = agent.store.index("digits")
    assert (index.active, index.previous) == ("1.1.0", "1.0.0")

    # a third version: the previous stays on disk for rollback, older ones are collected
    await agent.handle_desired(env.desired(3, env.publish("1.2.0")))
    assert agent.store.installed_versions("digits") == ["1.1.0", "1.2.0"]


async def test_the_same_bundle_offered_twice_is_a_no_op(env: Env) -> None:
    agent, manager, sink = await installed_v1(env)
    target = agent.store.installed("digits", "1.0.0")
    assert target is not None
    before = len(sink.events)
    ref = TargetRef(version="1.0.0", target_path=target.target_path, sha256=target.sha256,
                    length=target.length)  # fmt: skip

    await agent.handle_desired(env.desired(2, ref))

    assert len(sink.events) == before
    assert sink.reported[-1].applied_seq == 2
    assert manager.get("digits").version == "1.0.0"


async def test_canary_is_judged_by_the_policy_of_its_desired_state(file_env: Env) -> None:
    env = file_env
    failing: dict[str, list[FailingAfterWarmup]] = {}
    real = runner_factory(update_profile(), workers=1, threads=1, backend=None)

    def factory(source: ModelSource) -> Sequence[ModelRunner]:
        if source.version == "1.0.0":
            return real(source)
        failing[source.version] = [FailingAfterWarmup(r) for r in real(source)]
        return failing[source.version]

    manager = ModelManager(factory)
    env.managers.append(manager)
    agent, _, _ = env.agent(manager=manager)
    await agent.resume()
    stable = env.publish("1.0.0")
    await agent.handle_desired(env.desired(1, stable))

    async def until_out_of_rotation(version: str) -> int:
        """Requests the canary took before it left rotation; every one answered by stable."""
        taken = 0
        while manager.route("digits").version == version:
            assert (await answer(manager, env.digits))[0] == "1.0.0"
            taken += 1
            assert taken <= 100, "the canary never left rotation"
        return taken

    # min_requests 30 (not the default 20): a canary that fails every request is judged only
    # once its window holds 30 requests (the deployment's probe request among them).
    policy = CanaryPolicy(weight=1.0, max_error_rate=0.5, min_requests=30)
    await agent.handle_desired(
        env.desired(2, stable, canary=CanarySpec.of(env.publish("1.1.0"), policy))
    )
    probes = len(manager.slot("digits").canary.results)
    failing["1.1.0"][0].armed = True
    assert await until_out_of_rotation("1.1.0") == 30 - probes

    # max_error_rate 0.5 (not the default 0.05): after 20 good requests the canary stays in
    # until more than half of its window failed.
    await agent.handle_desired(
        env.desired(3, stable, canary=CanarySpec.of(env.publish("1.2.0"), policy))
    )
    for _ in range(20):
        assert (await answer(manager, env.digits))[0] == "1.2.0"
    good = len(manager.slot("digits").canary.results)
    failing["1.2.0"][0].armed = True
    assert await until_out_of_rotation("1.2.0") == good + 1

    # The policy is committed with the canary: a restarted agent serves it under the same one.
    again, restarted, _ = env.agent()
    await again.resume()
    assert restarted.slot("digits").canary.policy == policy


async def test_canary_beside_stable_then_removed(env: Env) -> None:
    agent, manager, sink = await installed_v1(env)
    v1 = agent.store.installed("digits", "1.0.0")
    assert v1 is not None
    stable = TargetRef(version="1.0.0", target_path=v1.target_path, sha256=v1.sha256,
                       length=v1.length)  # fmt: skip
    canary = CanarySpec(target=env.publish("1.1.0"), weight=1.0)

    await agent.handle_desired(env.repo.desired(2, [DesiredModel(name="digits", stable=stable,
                                                                 canary=canary)]))  # fmt: skip
    assert (await answer(manager, env.digits))[0] == "1.1.0"
    assert agent.store.index("digits").canary is not None

    # the same canary under another policy (a weight of 0): no download, applied in place and
    # committed, every answer from stable
    before = len(sink.events)
    policy = CanaryPolicy(weight=0.0, max_error_rate=0.5, min_requests=7)
    await agent.handle_desired(
        env.repo.desired(
            3,
            [
                DesiredModel(
                    name="digits", stable=stable, canary=CanarySpec.of(canary.target, policy)
                )
            ],
        )
    )
    assert len(sink.events) == before
    assert {(await answer(manager, env.digits))[0] for _ in range(20)} == {"1.0.0"}
    assert agent.store.index("digits").canary.policy == policy
    assert manager.slot("digits").canary.policy == policy

    await agent.handle_desired(env.desired(4, stable))
    assert (await answer(manager, env.digits))[0] == "1.0.0"
    assert agent.store.index("digits").canary is None


# ---------------------------------------------------------------------- refusals


async def test_desired_states_with_bad_signature_replay_or_expiry_are_refused(env: Env) -> None:
    now = {"t": datetime.now(timezone.utc).timestamp()}
    agent, manager, sink = env.agent(clock=lambda: now["t"])
    await agent.resume()
    accepted = env.desired(5, env.publish("1.0.0"))
    await agent.handle_desired(accepted)
    v2 = env.publish("1.1.0")
    # The retained document delivered again (a reconnect) is no replay: silently nothing.
    before = len(sink.events)
    await agent.handle_desired(accepted)
    assert len(sink.events) == before

    forged = env.repo.desired(6, [DesiredModel(name="digits", stable=v2)],
                              key=PrivateKey.generate())  # fmt: skip
    with pytest.raises(SigningError):
        await agent.handle_desired(forged)
    with pytest.raises(ReplayError):
        await agent.handle_desired(env.desired(5, v2))
    late = env.desired(7, v2)
    now["t"] += 2 * 3600
    with pytest.raises(ExpiredError):
        await agent.handle_desired(late)

    assert (await answer(manager, env.digits))[0] == "1.0.0"
    refusals = [(e.model, e.version, e.cause) for e in sink.events[before:]]
    assert refusals == [("digits", "1.1.0", "desired_signature"),
                        ("digits", "1.1.0", "desired_replay"),
                        ("digits", "1.1.0", "desired_expired")]  # fmt: skip
    assert all(e.outcome is EventOutcome.ERROR for e in sink.events[before:])
    # replay protection survives a restart
    again, _, _ = env.agent()
    with pytest.raises(ReplayError):
        await again.handle_desired(env.desired(5, v2))


async def refused(env: Env, agent: UpdateAgent, manager: ModelManager, sink: Sink,
                  envelope: dict[str, Any], cause: Cause) -> None:  # fmt: skip
    await agent.handle_desired(envelope)
    rec = record_of(agent)
    assert (rec.phase, rec.cause) == (Phase.FAILED, cause), rec.error
    assert cause.value in sink.errors()
    assert (await answer(manager, env.digits))[0] == "1.0.0"
    assert agent.store.index("digits").active == "1.0.0"
    assert list((env.state / "staging").iterdir()) == []
    status = sink.reported[-1].models[0]
    assert status.phase is Phase.FAILED and cause.value in (status.last_error or "")


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def repo_file(env: Env, ref: TargetRef) -> Path:
    d, _, base = ref.target_path.rpartition("/")
    return env.repo.directory / "targets" / d / f"{ref.sha256}.{base}"


Attack = Callable[[Env], Awaitable[tuple[dict[str, Any], Cause]]]


async def _expired_timestamp(env: Env) -> tuple[dict[str, Any], Cause]:
    env.repo.repo.clock = lambda: datetime.now(timezone.utc) - timedelta(days=30)
    return env.desired(2, env.publish("1.1.0")), Cause.TUF_EXPIRED


async def _bad_timestamp_signature(env: Env) -> tuple[dict[str, Any], Cause]:
    ref = env.publish("1.1.0")
    ts = env.repo.directory / "metadata" / "timestamp.json"
    doc = json.loads(ts.read_bytes())
    doc["signed"]["version"] += 1
    ts.write_text(json.dumps(doc))
    return env.desired(2, ref), Cause.TUF_METADATA


async def _target_not_listed(env: Env) -> tuple[dict[str, Any], Cause]:
    ref = env.publish("1.1.0")
    env.repo.repo.remove_target(ref.target_path)
    return env.desired(2, ref), Cause.TARGET_MISSING


async def _mix_and_match(env: Env) -> tuple[dict[str, Any], Cause]:
    ref = env.publish("1.1.0")
    other = env.repo.repo.targets().signed.targets["digits/1.0.0/digits-1.0.0.mcpb"]
    mixed = ref.model_copy(update={"sha256": other.hashes["sha256"], "length": other.length})
    return env.desired(2, mixed), Cause.TARGET_MISMATCH


async def _tampered_chunk(env: Env) -> tuple[dict[str, Any], Cause]:
    ref = env.publish("1.1.0")
    flip_byte(repo_file(env, ref), ref.length // 2)
    return env.desired(2, ref), Cause.HASH_MISMATCH


async def _endless_data(env: Env) -> tuple[dict[str, Any], Cause]:
    ref = env.publish("1.1.0")
    with open(repo_file(env, ref), "ab") as f:
        f.write(b"\0" * 1_000_000)
    return env.desired(2, ref), Cause.TOO_LONG


async def _unknown_publisher(env: Env) -> tuple[dict[str, Any], Cause]:
    ref = env.publish("1.1.0", key=PrivateKey.generate())
    return env.desired(2, ref), Cause.PUBLISHER


async def _unsigned_bundle(env: Env) -> tuple[dict[str, Any], Cause]:
    return env.desired(2, env.publish("1.1.0", key=None)), Cause.PUBLISHER


async def _wrong_version_inside(env: Env) -> tuple[dict[str, Any], Cause]:
    ref = env.repo.publish(env.bundle("1.2.0"), "digits", "1.3.0")
    return env.desired(2, ref), Cause.MANIFEST_MISMATCH


async def _downgrade(env: Env) -> tuple[dict[str, Any], Cause]:
    return env.desired(2, env.publish("0.9.0")), Cause.DOWNGRADE


async def _model_does_not_fit(env: Env) -> tuple[dict[str, Any], Cause]:
    env.memory["available"] = 1024
    return env.desired(2, env.publish("1.1.0")), Cause.LOAD_FAILED


ATTACKS: dict[str, Attack] = {
    "expired-timestamp": _expired_timestamp,
    "bad-timestamp-signature": _bad_timestamp_signature,
    "target-not-listed": _target_not_listed,
    "mix-and-match": _mix_and_match,
    "tampered-chunk": _tampered_chunk,
    "endless-data": _endless_data,
    "unknown-publisher": _unknown_publisher,
    "unsigned-bundle": _unsigned_bundle,
    "wrong-version-inside": _wrong_version_inside,
    "downgrade": _downgrade,
    "load-failure": _model_does_not_fit,
}


@pytest.mark.parametrize("attack", list(ATTACKS))
async def test_attack_is_refused_and_the_old_model_keeps_answering(env: Env, attack: str) -> None:
    agent, manager, sink = await installed_v1(env)
    envelope, cause = await ATTACKS[attack](env)
    await refused(env, agent, manager, sink, envelope, cause)
    if cause is Cause.LOAD_FAILED:
        assert agent.store.installed_versions("digits") == ["1.0.0"]


async def test_no_variant_for_this_profile_is_refused(env: Env) -> None:
    _agent, manager, sink = await installed_v1(env)
    tflite_only, _, _ = env.agent(profile=update_profile(formats=["tflite"]), manager=manager,
                                  sink=sink)  # fmt: skip
    await refused(env, tflite_only, manager, sink, env.desired(2, env.publish("1.1.0")),
                  Cause.NO_VARIANT)  # fmt: skip


async def test_explicit_rollback_may_go_below_the_release_counter(env: Env) -> None:
    agent, manager, _ = await installed_v1(env)
    await agent.handle_desired(env.desired(2, env.publish("1.1.0")))
    old = env.repo.repo.targets().signed.targets["digits/1.0.0/digits-1.0.0.mcpb"]
    ref = TargetRef(version="1.0.0", target_path=old.path, sha256=old.hashes["sha256"],
                    length=old.length)  # fmt: skip

    await agent.handle_desired(env.desired(3, ref, rollback=True))

    assert (await answer(manager, env.digits))[0] == "1.0.0"
    index = agent.store.index("digits")
    assert index.active == "1.0.0"
    assert index.release_counter == 10010009  # 1.1.0 stays the highest version activated


async def test_not_enough_disk_is_refused_before_downloading(file_env: Env) -> None:
    env = file_env
    _agent, manager, sink = await installed_v1(env)
    tight, _, _ = env.agent(disk_usage=lambda _: DiskUsage(10**9, 10**9 - 4096, 4096),
                            manager=manager, sink=sink)  # fmt: skip
    await refused(env, tight, manager, sink, env.desired(2, env.publish("1.1.0")), Cause.DISK_FULL)


class FlakyTransport(FileRepoTransport):
    """The file transport whose first ``failures`` target downloads fail mid-way."""

    def __init__(self, repo_dir: Path, failures: int) -> None:
        super().__init__(repo_dir)
        self.failures = failures
        self.calls = 0

    def download(self, url: str, dest: Path, *, length: int,
                 progress: Progress | None = None) -> int:  # fmt: skip
        self.calls += 1
        if self.calls <= self.failures:
            have = dest.stat().st_size if dest.exists() else 0
            with open(dest, "ab") as f:
                f.write(self._path(url).read_bytes()[have : have + 1000])
            raise DownloadError("connection lost")
        return super().download(url, dest, length=length, progress=progress)

    def _path(self, url: str) -> Path:
        return self.root / url[len(self.root.as_uri()) + 1 :]


async def test_transport_errors_retry_and_resume_then_give_up(file_env: Env) -> None:
    env = file_env
    _agent, manager, sink = await installed_v1(env)
    flaky = FlakyTransport(env.repo.directory, failures=2)
    retrying, _, _ = env.agent(transport=flaky, retry=RetryPolicy(max_attempts=3),
                               manager=manager, sink=sink)  # fmt: skip
    await retrying.handle_desired(env.desired(2, env.publish("1.1.0")))
    assert record_of(retrying).phase is Phase.ACTIVE and record_of(retrying).attempts == 3
    assert sink.errors().count("transport") == 2
    assert (await answer(manager, env.digits))[0] == "1.1.0"

    dead = FlakyTransport(env.repo.directory, failures=99)
    giving_up, _, _ = env.agent(transport=dead, retry=RetryPolicy(max_attempts=2),
                                manager=manager, sink=sink)  # fmt: skip
    await giving_up.handle_desired(env.desired(3, env.publish("1.2.0")))
    rec = record_of(giving_up)
    assert (rec.phase, rec.cause, rec.attempts) == (Phase.FAILED, Cause.TRANSPORT, 2)
    assert (await answer(manager, env.digits))[0] == "1.1.0"


# ---------------------------------------------------------------------- crashes


def run_child(env: Env, **args: Any) -> dict[str, Any]:
    """Run the update agent in a fresh process (tests.support.tuf); ``{"killed": True}`` when
    it was SIGKILLed. ``fsize`` caps the size of any file it writes (RLIMIT_FSIZE)."""
    limit = args.pop("fsize", None)
    spec = {
        "state_dir": str(env.state), "repo_dir": str(env.repo.directory),
        "director": env.repo.repo.director_key().raw.hex(), "tuf_root": env.repo.root_bytes().hex(),
        **args,
    }  # fmt: skip
    path = env.tmp / "child.json"
    path.write_text(json.dumps(spec))

    def limits() -> None:
        if limit is not None:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    proc = subprocess.run(
        [sys.executable, "-m", "tests.support.tuf", str(path)], cwd=ROOT, capture_output=True,
        text=True, timeout=100, preexec_fn=limits, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    if proc.returncode == -signal.SIGKILL:
        return {"killed": True}
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def assert_whole(env: Env, result: dict[str, Any]) -> None:
    for d in (env.state / "models" / "digits").iterdir():
        if d.is_dir():
            assert not d.name.startswith("."), f"leftover {d.name}"
            info = json.loads((d / "install.json").read_text())
            assert (d / info["model_file"]).stat().st_size > 0
    assert list((env.state / "staging").iterdir()) == []
    record = result["status"]["models"]["digits"]["record"]
    assert record["phase"] in ("active", "failed")


@pytest.mark.parametrize(
    ("phase", "signed", "expect"),
    [
        ("downloading", True, "1.1.0"),
        ("verifying", True, "1.1.0"),
        ("installing", True, "1.1.0"),
        ("loading", True, "1.1.0"),
        ("warming", True, "1.1.0"),
        ("rolling_back", False, "1.0.0"),
    ],
)
async def test_sigkill_at_each_phase_resumes_or_rolls_back(
    file_env: Env, phase: str, signed: bool, expect: str
) -> None:
    env = file_env
    _agent, _, _ = await installed_v1(env)
    target = env.publish("1.1.0", **({} if signed else {"key": None}))

    killed = run_child(env, envelope=env.desired(2, target), kill_at=phase, kill_version="1.1.0")
    assert killed == {"killed": True}
    rec = json.loads((env.state / "updates" / "digits.json").read_text())
    assert rec["phase"] == phase

    result = run_child(env)
    assert result["serving"]["digits"]["version"] == expect
    assert_whole(env, result)
    expected_phase = "active" if signed else "failed"
    assert result["status"]["models"]["digits"]["record"]["phase"] == expected_phase


async def test_a_real_write_failure_while_staging_rolls_back(file_env: Env) -> None:
    env = file_env
    await installed_v1(env)
    target = env.publish("1.1.0")

    result = run_child(env, envelope=env.desired(2, target), fsize=8192)

    assert result["serving"]["digits"]["version"] == "1.0.0"
    record = result["status"]["models"]["digits"]["record"]
    assert (record["phase"], record["cause"]) == ("failed", "disk_full")
    assert list((env.state / "staging").iterdir()) == []
