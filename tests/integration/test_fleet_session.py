"""The agent's fleet session against a real Mosquitto: birth and will, broker restarts with the
spool, commands, inference statistics, and hostile input on every subscribed topic."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import secrets
import signal
import sys
import textwrap
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mcp_edge.agent.fleet.session import FleetConfig, FleetSession
from mcp_edge.agent.fleet.spool import Spool, SpoolKind
from mcp_edge.agent.fleet.telemetry import HealthCollector
from mcp_edge.agent.runtime.loader import load_runner
from mcp_edge.agent.runtime.manager import ModelManager, ModelSource
from mcp_edge.client import InferenceClient, InferenceReplyError, parse_reply
from mcp_edge.shared.mqtt import InboundMessage, MqttClient, MqttSettings, ReconnectPolicy
from mcp_edge.shared.profiles import load_profiles
from mcp_edge.shared.protocol import (
    CommandReply,
    DeploymentEvent,
    DeploymentPhase,
    DesiredState,
    ErrorCode,
    EventOutcome,
    HealthSample,
    InferenceStats,
    ReportedState,
    decode,
    sign_desired_state,
    topics,
    verify_desired_state,
)
from mcp_edge.shared.signing import PrivateKey, sign_document
from mcp_edge.tooling.models import DigitsModels
from mcp_edge.tooling.mosquitto import MosquittoBroker

pytestmark = pytest.mark.mosquitto
PROFILE = load_profiles()["generic-x86_64"]


async def until(condition: Callable[[], bool], timeout_s: float = 15.0) -> None:
    """Wait for ``condition`` (polling the loop), failing after ``timeout_s``."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.005)


class Watcher:
    """A plain MQTT client that records everything on its filters."""

    def __init__(self, broker: MosquittoBroker, *filters: str) -> None:
        self.client = MqttClient(MqttSettings(
            broker.host, broker.port, client_id=f"watch-{secrets.token_hex(4)}",
            clean_start=True, session_expiry_s=0,
        ))  # fmt: skip
        self.filters = filters
        self.messages: list[InboundMessage] = []
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> Watcher:
        await self.client.subscribe(*self.filters)
        await self.client.connect()
        self._task = asyncio.create_task(self._read())
        return self

    async def _read(self) -> None:
        async for m in self.client.messages():
            self.messages.append(m)

    def on(self, topic: str) -> list[InboundMessage]:
        return [m for m in self.messages if m.topic == topic]

    def payloads(self, topic: str) -> list[bytes]:
        return [m.payload for m in self.on(topic)]

    async def close(self) -> None:
        await self.client.close()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)


@asynccontextmanager
async def watching(broker: MosquittoBroker, *filters: str) -> AsyncIterator[Watcher]:
    w = await Watcher(broker, *filters).start()
    try:
        yield w
    finally:
        await w.close()


def command(name: str, **kw: Any) -> bytes:
    now = datetime.now(timezone.utc)
    return json.dumps({
        "command_id": secrets.token_hex(16), "name": name, "args": {},
        "issued_at": now.isoformat(), "expires": (now + timedelta(minutes=5)).isoformat(), **kw,
    }).encode()  # fmt: skip


def event(device: str, seq: int) -> DeploymentEvent:
    return DeploymentEvent(
        device_id=device, event_seq=seq, ts=1000.0 + seq, model="digits", version="1.2.0",
        phase=DeploymentPhase.DOWNLOADING, outcome=EventOutcome.PROGRESS,
        bytes_done=seq * 1024, bytes_total=10 * 1024,
    )  # fmt: skip


def first_seen(values: list[Any]) -> list[Any]:
    """Drop repeats (delivery is at least once) keeping first arrivals in order."""
    seen: set[Any] = set()
    return [v for v in values if not (v in seen or seen.add(v))]


def make_session(broker: MosquittoBroker, tmp_path: Path, device: str, **kw: Any) -> FleetSession:
    config_keys = set(FleetConfig.__dataclass_fields__)
    config = {k: v for k, v in kw.items() if k in config_keys}
    rest = {k: v for k, v in kw.items() if k not in config_keys}
    config.setdefault("health_interval_s", 3600)
    config.setdefault("inference_interval_s", 3600)
    spool = rest.pop("spool", None) or Spool(tmp_path / f"{device}.spool")
    cfg = FleetConfig(device_id=device, host=broker.host, port=broker.port, **config)
    return FleetSession(cfg, spool=spool, **rest)


@pytest.mark.parametrize("sizes", [(3, 20, 0, 64), (0, 1, 250, 70_000, 9)], ids=["tiny", "mixed"])
async def test_a_burst_of_messages_arrives_whole_and_in_order(
    mosquitto: MosquittoBroker, sizes: tuple[int, ...]
) -> None:
    # The client reads the socket in 64 KiB chunks: many packets per read, some across reads.
    def payload(i: int) -> bytes:
        return (i.to_bytes(4, "big") * (sizes[i % len(sizes)] // 4 + 1))[: sizes[i % len(sizes)]]

    topic = f"burst/{secrets.token_hex(4)}"
    got: list[bytes] = []
    sub = MqttClient(
        MqttSettings(
            mosquitto.host,
            mosquitto.port,
            client_id=f"sub-{topic[6:]}",
            clean_start=True,
            session_expiry_s=0,
        )
    )
    sub.set_handler(lambda m: got.append(m.payload))
    async with (
        sub,
        MqttClient(
            MqttSettings(mosquitto.host, mosquitto.port, client_id=f"pub-{topic[6:]}")
        ) as pub,
    ):
        await sub.subscribe(topic)
        acks = [pub.publish_nowait(topic, payload(i), qos=1) for i in range(300)]
        await asyncio.gather(*acks)
        await until(lambda: len(got) >= 300)
    assert got == [payload(i) for i in range(300)]


# ------------------------------------------------------------------------------ birth / will
AGENT_SCRIPT = textwrap.dedent("""
    import asyncio, sys
    from mcp_edge.agent.fleet.session import FleetConfig, FleetSession
    from mcp_edge.agent.fleet.spool import Spool

    async def main() -> None:
        device, host, port, spool = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
        cfg = FleetConfig(device_id=device, host=host, port=port, health_interval_s=3600,
                          inference_interval_s=3600)
        async with FleetSession(cfg, spool=Spool(spool)):
            await asyncio.Event().wait()

    asyncio.run(main())
""")


async def test_birth_comes_after_subscriptions_and_the_will_says_offline_when_killed(
    mosquitto: MosquittoBroker, tmp_path: Path
) -> None:
    device = "dev-will"
    status = topics.status(device)
    script = tmp_path / "run_agent.py"
    script.write_text(AGENT_SCRIPT)
    async with watching(mosquitto, status, topics.command_reply(device)) as w:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(script), device, mosquitto.host, str(mosquitto.port),
            str(tmp_path / "spool.db"), cwd=os.getcwd(),
        )  # fmt: skip
        try:
            await until(lambda: w.payloads(status) == [b"online"] or proc.returncode is not None,
                        60)  # fmt: skip
            assert proc.returncode is None, "the agent process exited"
            assert w.on(status)[0].retain is False  # live delivery of a retained publish
            # The birth comes after the subscriptions are in place: a command sent the moment
            # "online" is seen is answered.
            await w.client.publish(topics.command(device), command("ping"), 1,
                                   correlation_data=b"c-1")  # fmt: skip
            await until(lambda: len(w.on(topics.command_reply(device))) == 1)
            reply = w.on(topics.command_reply(device))[0]
            assert reply.correlation_data == b"c-1"
            assert decode(reply.payload, CommandReply).result["pong"] is True
        finally:
            if proc.returncode is None:
                proc.send_signal(signal.SIGKILL)  # no DISCONNECT: the broker publishes the will
            await proc.wait()
        await until(lambda: w.payloads(status) == [b"online", b"offline"])
    # A subscriber arriving later sees the retained "offline".
    async with watching(mosquitto, status) as late:
        await until(lambda: late.payloads(status) == [b"offline"])
        assert late.on(status)[0].retain


async def test_a_graceful_close_publishes_offline_itself(
    mosquitto: MosquittoBroker, tmp_path: Path
) -> None:
    status = topics.status("dev-bye")
    async with watching(mosquitto, status) as w:
        session = make_session(mosquitto, tmp_path, "dev-bye")
        await session.start()
        await session.wait_online(10)
        assert session.mqtt.tcp_nodelay
        await until(lambda: w.payloads(status) == [b"online"])
        await session.close()
        await until(lambda: w.payloads(status) == [b"online", b"offline"])


# ------------------------------------------------------------------------------ broker restarts
class GatedSleep:
    """The session's backoff sleep: records each delay; lets ``free`` attempts through, then
    waits for the test to open the gate (so a test decides when the agent may reconnect)."""

    def __init__(self) -> None:
        self.delays: list[float] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.free = 0
        self.blocked = asyncio.Event()

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)
        if self.gate.is_set():
            return
        if self.free > 0:
            self.free -= 1
            return
        self.blocked.set()
        await self.gate.wait()
        self.blocked.clear()


async def test_broker_restart_spools_telemetry_and_events_and_drains_them_in_order(
    fresh_mosquitto: MosquittoBroker, tmp_path: Path
) -> None:
    broker, device = fresh_mosquitto, "dev-restart"
    sleep = GatedSleep()
    ticks = itertools.count()
    session = make_session(
        broker, tmp_path, device, health_interval_s=0.02, sleep=sleep,
        health=HealthCollector(clock=lambda: float(next(ticks))),
        reconnect=ReconnectPolicy(first_delay_s=0.05, max_delay_s=0.2), rng=random.Random(3),
    )  # fmt: skip
    health_t, events_t = topics.telemetry(device, "health"), topics.events(device)
    w = await Watcher(broker, topics.device_subtree(device)).start()
    await session.start()
    try:
        await session.wait_online(10)
        await until(lambda: len(w.on(health_t)) >= 3)

        sleep.gate.clear()
        sleep.free = 3  # three failed attempts while the broker is down, then wait
        connections = session.connections
        broker.stop()
        await until(lambda: not session.online.is_set())
        for seq in range(1, 6):
            await session.publish_event(event(device, seq))
        produced_offline = session.health_samples
        await until(lambda: session.health_samples >= produced_offline + 10)  # still sampling
        await asyncio.wait_for(sleep.blocked.wait(), 15)
        assert session.spool.count(SpoolKind.EVENT) == 5
        assert session.spool.count(SpoolKind.HEALTH) >= 10
        # Three refused attempts, each waiting a jittered, growing backoff below its ceiling.
        tail = sleep.delays[-4:]
        assert all(0 <= d <= 0.2 for d in tail) and session.link.backoff.attempt >= 4

        broker.start()
        await w.client.connect()  # the watcher is back (and subscribed) before the agent
        sleep.gate.set()
        await until(lambda: session.connections == connections + 1)
        last = session.health_samples
        await until(lambda: len({decode(p, DeploymentEvent).event_seq
                                 for p in w.payloads(events_t)}) == 5)  # fmt: skip
        await until(lambda: max(decode(p, HealthSample).ts for p in w.payloads(health_t))
                    >= last - 1)  # fmt: skip
    finally:
        await session.close()
        await w.close()
    seqs = first_seen([decode(p, DeploymentEvent).event_seq for p in w.payloads(events_t)])
    assert seqs == [1, 2, 3, 4, 5]  # every event, in order
    ts = first_seen([decode(p, HealthSample).ts for p in w.payloads(health_t)])
    assert ts == sorted(ts)  # health samples in order
    assert ts == [float(i) for i in range(len(ts))]  # and none missing: the bound was not hit
    assert session.spool.dropped["health"] == 0


async def test_a_full_spool_drops_the_oldest_health_samples_and_never_events(
    fresh_mosquitto: MosquittoBroker, tmp_path: Path
) -> None:
    broker, device = fresh_mosquitto, "dev-full"
    sleep = GatedSleep()
    ticks = itertools.count()
    session = make_session(
        broker, tmp_path, device, sleep=sleep, spool=Spool(tmp_path / "s.db", max_rows=8),
        health=HealthCollector(clock=lambda: float(next(ticks))),
    )  # fmt: skip
    health_t, events_t = topics.telemetry(device, "health"), topics.events(device)
    w = await Watcher(broker, topics.device_subtree(device)).start()
    await session.start()
    try:
        await session.wait_online(10)
        await until(lambda: len(w.on(health_t)) == 1)  # the first sample, sent online
        sleep.gate.clear()
        broker.stop()
        await until(lambda: not session.online.is_set())
        for i in range(30):  # interleaved, so events sit between health samples
            await session.sample_health()
            if i % 10 == 0:
                await session.publish_event(event(device, i // 10 + 1))
        pending = [(i.kind, json.loads(i.payload)) for i in session.spool.peek(100)]
        kept = [p["ts"] for k, p in pending if k is SpoolKind.HEALTH]
        assert [p["event_seq"] for k, p in pending if k is SpoolKind.EVENT] == [1, 2, 3]
        assert kept == [26.0, 27.0, 28.0, 29.0, 30.0]  # the newest five of 1..30
        assert session.spool.dropped["health"] == 25 and session.spool.dropped["event"] == 0

        broker.start()
        await w.client.connect()
        sleep.gate.set()
        await until(lambda: len(first_seen(w.payloads(health_t))) == 1 + len(kept)
                    and len(first_seen(w.payloads(events_t))) == 3)  # fmt: skip
    finally:
        await session.close()
        await w.close()
    ts = first_seen([decode(p, HealthSample).ts for p in w.payloads(health_t)])
    assert ts == [0.0, *kept]
    seqs = first_seen([decode(p, DeploymentEvent).event_seq for p in w.payloads(events_t)])
    assert seqs == [1, 2, 3]


async def test_spooled_messages_survive_an_agent_restart(
    fresh_mosquitto: MosquittoBroker, tmp_path: Path
) -> None:
    broker, device = fresh_mosquitto, "dev-reboot"
    broker.stop()
    path = tmp_path / "spool.db"
    first = make_session(broker, tmp_path, device, spool=Spool(path), sleep=GatedSleep())
    await first.start()
    for seq in (1, 2):
        await first.publish_event(event(device, seq))
    await first.close()  # the agent stops while offline
    broker.start()
    async with watching(broker, topics.events(device)) as w:
        second = make_session(broker, tmp_path, device, spool=Spool(path))
        await second.start()
        try:
            await until(lambda: len(w.on(topics.events(device))) == 2)
        finally:
            await second.close()
    assert [decode(p, DeploymentEvent).event_seq for p in w.payloads(topics.events(device))] == [
        1, 2]  # fmt: skip


# ------------------------------------------------------------------------------ commands, stats
async def test_report_state_command_publishes_retained_state_and_unknown_commands_fail(
    mosquitto: MosquittoBroker, tmp_path: Path
) -> None:
    device = "dev-cmd"
    state = ReportedState(device_id=device, ts=1.0, applied_seq=7, profile="generic-x86_64")
    session = make_session(mosquitto, tmp_path, device, state_provider=lambda: state)
    reply_t = topics.command_reply(device)
    async with watching(mosquitto, reply_t, topics.reported(device)) as w:
        await session.start()
        try:
            await session.wait_online(10)
            past = datetime.now(timezone.utc) - timedelta(minutes=1)
            sent = {
                "report": command("report_state"),
                "unknown": command("collect_logs"),
                "expired": command("ping", issued_at=(past - timedelta(minutes=1)).isoformat(),
                                   expires=past.isoformat()),
            }  # fmt: skip
            for payload in sent.values():
                await w.client.publish(topics.command(device), payload, 1)
            await until(lambda: len(w.on(reply_t)) == 3 and len(w.on(topics.reported(device))))
        finally:
            await session.close()
    by_id = {r.command_id: r for r in (decode(p, CommandReply) for p in w.payloads(reply_t))}
    replies = {k: by_id[json.loads(v)["command_id"]] for k, v in sent.items()}
    assert replies["report"].ok and replies["report"].result == {"applied_seq": 7}
    unknown, expired = replies["unknown"], replies["expired"]
    assert not unknown.ok and unknown.error and unknown.error.code is ErrorCode.UNSUPPORTED
    assert not expired.ok and expired.error and "expired" in expired.error.error
    assert decode(w.payloads(topics.reported(device))[0], ReportedState) == state
    async with watching(mosquitto, topics.reported(device)) as late:  # retained
        await until(lambda: len(late.on(topics.reported(device))) == 1)


async def test_inference_statistics_are_published_per_model_version(
    mosquitto: MosquittoBroker, digits: DigitsModels, tmp_path: Path
) -> None:
    manager = ModelManager(lambda s: [load_runner(s.model_path, PROFILE, threads=1)])
    await manager.load(ModelSource("digits", "1", digits.onnx_path))
    device = "dev-stats"
    session = make_session(mosquitto, tmp_path, device, manager=manager, inference_interval_s=0.1)
    stats_t = topics.telemetry(device, "inference")
    try:
        async with watching(mosquitto, stats_t) as w:
            await session.start()
            await session.wait_online(10)
            async with InferenceClient(mosquitto.host, mosquitto.port) as client:
                for i in range(20):
                    await client.infer("digits", {"input": digits.X_test[i : i + 1]},
                                       device=device)  # fmt: skip
                with pytest.raises(InferenceReplyError):
                    await client.infer("digits", {"input": np.zeros((1, 3), np.float32)},
                                       device=device)  # fmt: skip

            def totals() -> tuple[int, int]:
                ms = [m for p in w.payloads(stats_t)
                      for m in decode(p, InferenceStats).models]  # fmt: skip
                return sum(m.count for m in ms), sum(m.errors for m in ms)

            await until(lambda: totals() == (21, 1))
    finally:
        await session.close()
        await manager.close()
    snaps = [decode(p, InferenceStats) for p in w.payloads(stats_t)]
    busy = [m for s in snaps for m in s.models if m.count]
    assert {(m.model, m.version) for m in busy} == {("digits", "1.0.0")}
    assert all(m.latency is not None and 0 < m.latency.p50_ms <= m.latency.p99_ms
               for m in busy if m.count > m.errors)  # fmt: skip


# ------------------------------------------------------------------------------ bad input
async def test_bad_input_on_every_subscribed_topic_is_counted_dropped_and_serving_goes_on(
    mosquitto: MosquittoBroker, digits: DigitsModels, tmp_path: Path
) -> None:
    device = "dev-hostile"
    director = PrivateKey.generate()
    applied: list[DesiredState] = []

    async def on_desired(envelope: Any) -> None:
        last = applied[-1].seq if applied else 0
        applied.append(
            verify_desired_state(
                envelope,
                [director.public_key],
                device_id=device,
                last_seq=last,
                now=datetime.now(timezone.utc),
            )
        )

    def desired(seq: Any) -> bytes:
        now = datetime.now(timezone.utc)
        doc = {"device_id": device, "seq": seq, "issued_at": now.isoformat(),
               "expires": (now + timedelta(hours=1)).isoformat()}  # fmt: skip
        return json.dumps(sign_document(doc, director)).encode()

    manager = ModelManager(lambda s: [load_runner(s.model_path, PROFILE, threads=1)])
    await manager.load(ModelSource("digits", "1", digits.onnx_path))
    session = make_session(mosquitto, tmp_path, device, manager=manager,
                           desired_handler=on_desired, max_desired_bytes=8192,
                           max_command_bytes=4096, max_infer_bytes=32 * 1024)  # fmt: skip
    dropped = session.metrics.dropped
    reply_t = topics.command_reply(device)
    try:
        async with watching(mosquitto, reply_t) as w, \
                InferenceClient(mosquitto.host, mosquitto.port) as client:  # fmt: skip
            await session.start()
            await session.wait_online(10)
            pub = w.client.publish
            bad = [b"{not json", b"\xff\xfe\x00", b'"a string"', b"[1, 2]"]
            # desired: malformed JSON, wrong schema, bad signature, oversized
            for payload in bad:
                await pub(topics.desired(device), payload, 1)
            await pub(topics.desired(device), desired("not-a-number"), 1)
            forged = json.loads(desired(5))
            forged["signed"]["seq"] = 6
            await pub(topics.desired(device), json.dumps(forged).encode(), 1)
            await pub(topics.desired(device), b'{"x": "' + b"y" * 10_000 + b'"}', 1)
            await until(lambda: dropped[("desired", "json")] == 2
                        and dropped[("desired", "schema")] == 3
                        and dropped[("desired", "signature")] == 1
                        and dropped[("desired", "too_large")] == 1)  # fmt: skip
            await pub(topics.desired(device), sign_desired(director, device, 3), 1, retain=False)
            await until(lambda: [s.seq for s in applied] == [3])  # still applies a good one
            # cmd: malformed JSON, wrong schema, oversized
            for payload in bad:
                await pub(topics.command(device), payload, 1)
            await pub(topics.command(device), b'{"name": "ping"}', 1)
            await pub(topics.command(device), command("ping", args={"pad": "x" * 5000}), 1)
            await until(lambda: dropped[("cmd", "json")] == 2
                        and dropped[("cmd", "schema")] == 3
                        and dropped[("cmd", "too_large")] == 1)  # fmt: skip
            await pub(topics.command(device), command("ping"), 1)
            await until(lambda: len(w.on(reply_t)) == 1)
            assert decode(w.payloads(reply_t)[0], CommandReply).ok
            # infer (device and fleet topics): answered with errors, and counted
            for dev in (device, None):
                for payload in (b"{not json", b'{"inputs": 5}', b"[" + b"1," * 20_000 + b"1]"):
                    with pytest.raises(InferenceReplyError):
                        parse_reply(await client.infer_raw("digits", payload, device=dev))
            assert dropped[("infer", "json")] == 2 and dropped[("infer", "schema")] == 2
            assert dropped[("infer", "too_large")] == 2
            # A topic under a subscription that is not a valid topic at all.
            await pub(f"mcp/v1/dev/{device}/infer/" + "m" * 80, b"{}", 1)
            await until(lambda: dropped[("unknown", "topic")] == 1)
            resp = await client.infer("digits", {"input": digits.X_test[:1]}, device=device)
            assert resp.model_name == "digits"
            assert session.online.is_set()
            metrics = session.metrics.registry
            assert (
                metrics.get_sample_value(
                    "mcp_agent_mqtt_bad_messages_total", {"channel": "cmd", "reason": "json"}
                )
                == 2
            )
    finally:
        await session.close()
        await manager.close()


def sign_desired(key: PrivateKey, device: str, seq: int) -> bytes:
    now = datetime.now(timezone.utc)
    state = DesiredState(device_id=device, seq=seq, issued_at=now,
                         expires=now + timedelta(hours=1))  # fmt: skip
    return json.dumps(sign_desired_state(state, key)).encode()
