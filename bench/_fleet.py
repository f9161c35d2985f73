"""Processes of the fleet-path bench (``fleet_path.py``), one role per subcommand.

Each role runs as its own process, prints ``READY`` on stdout once its broker session is up
(responders, subscribers), and ends with one JSON line on stdout. Every wait is bounded.

* ``echo``: raw paho MQTT 5 responder. Subscribes (QoS 1) to the device inference topic and
  answers every request with a fixed body on the request's ResponseTopic, with its
  CorrelationData, at the request's QoS (at most 1), like the agent does.
* ``agent``: the agent's MQTT inference path: :class:`agent.fleet.session.FleetSession` with a
  :class:`agent.runtime.manager.ModelManager` serving one ONNX model, built as ``mcp-agent run``
  builds them (hardware profile, default batching, uvloop).
* ``rtt``: closed-loop request/response client (one request in flight) using
  :class:`mcp_edge.client.InferenceClient` ``infer_raw`` with pre-encoded bytes; the same
  client for the echo responder and the agent.
* ``publish``: raw paho publisher of health samples, as fast as the in-flight window allows.
* ``subscribe``: raw paho subscriber on the ingest filter (shared subscription, QoS 1), counts.
* ``ingest``: :class:`controlplane.ingest.IngestService` on a database (migrated here, devices
  inserted as accepted through the DB layer), counts committed rows.

Timestamps are ``time.monotonic_ns()`` (CLOCK_MONOTONIC: comparable across processes).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

HOST = "127.0.0.1"
CONNECT_TIMEOUT_S = 10.0
IDLE_END_S = 3.0
"""A counting role ends when nothing new arrived for this long (after the first message)."""


def _percentiles_us(ns: list[int]) -> dict[str, float]:
    if not ns:
        return {"p50": float("nan"), "p90": float("nan"), "p99": float("nan"), "max": float("nan")}
    s = sorted(ns)

    def q(p: float) -> float:
        return round(s[min(len(s) - 1, max(0, round(p / 100.0 * (len(s) - 1))))] / 1000.0, 1)

    return {
        "p50": q(50),
        "p90": q(90),
        "p99": q(99),
        "max": round(s[-1] / 1000.0, 1),
        "mean": round(sum(s) / len(s) / 1000.0, 1),
    }


def _emit(doc: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()


def _ready() -> None:
    sys.stdout.write("READY\n")
    sys.stdout.flush()


def _paho(client_id: str) -> Any:
    import paho.mqtt.client as mqtt

    client = mqtt.Client(
        mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5
    )

    def nodelay(_c: Any, _u: Any, sock: Any) -> None:
        if isinstance(sock, socket.socket):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    client.on_socket_open = nodelay
    return client


def _wait_stop_signal(max_s: float) -> None:
    """Block until SIGTERM/SIGINT or ``max_s`` seconds."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait(max_s)


def _subscribe_blocking(client: Any, topic: str, port: int) -> None:
    subscribed = threading.Event()
    client.on_subscribe = lambda *_a: subscribed.set()
    client.on_connect = lambda c, *_a: c.subscribe(topic, qos=1)
    client.connect(HOST, port, keepalive=30)
    client.loop_start()
    if not subscribed.wait(CONNECT_TIMEOUT_S):
        raise SystemExit(f"no SUBACK for {topic} within {CONNECT_TIMEOUT_S} s")


# ---------------------------------------------------------------------------- echo
def role_echo(args: argparse.Namespace) -> None:
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    from mcp_edge.shared.protocol import topics

    answer = Path(args.answer_file).read_bytes()
    client = _paho(f"bench-echo-{args.device}")
    counts = {"answered": 0, "no_response_topic": 0}

    def on_message(c: Any, _u: Any, msg: Any) -> None:
        props = getattr(msg, "properties", None)
        reply_to = getattr(props, "ResponseTopic", None)
        if not reply_to:
            counts["no_response_topic"] += 1
            return
        out = Properties(PacketTypes.PUBLISH)
        out.CorrelationData = props.CorrelationData
        out.UserProperty = [("mcp-device", args.device)]
        c.publish(reply_to, answer, qos=min(msg.qos, 1), properties=out)
        counts["answered"] += 1

    client.on_message = on_message
    _subscribe_blocking(client, topics.device_infer(args.device, args.model), args.port)
    _ready()
    try:
        _wait_stop_signal(args.max_s)
    finally:
        client.disconnect()
        client.loop_stop()
    _emit(counts)


# ---------------------------------------------------------------------------- agent
async def _agent_main(args: argparse.Namespace) -> None:
    import tempfile

    from mcp_edge.agent.fleet.session import FleetConfig, FleetSession
    from mcp_edge.agent.fleet.spool import Spool
    from mcp_edge.agent.runtime.manager import ModelManager, ModelSource
    from mcp_edge.agent.serving.serve import choose_profile, runner_factory

    profile, _ = choose_profile(None)
    manager = ModelManager(runner_factory(profile, workers=1, threads=None, backend=None))
    await manager.load(ModelSource(args.model, "1", Path(args.model_path)))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    config = FleetConfig(
        device_id=args.device,
        host=HOST,
        port=args.port,
        health_interval_s=3600,
        inference_interval_s=3600,
    )
    try:
        with tempfile.TemporaryDirectory(prefix="mcp-bench-agent-") as tmp:
            spool = Spool(Path(tmp) / "spool.sqlite3")
            async with FleetSession(config, spool=spool, manager=manager) as session:
                await session.wait_online(CONNECT_TIMEOUT_S)
                _ready()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), args.max_s)
                counters = dataclasses.asdict(session.inference.counters)
    finally:
        await manager.close()
    _emit({"profile": profile.name, "counters": counters})


def role_agent(args: argparse.Namespace) -> None:
    from mcp_edge.agent.serving.serve import _install_event_loop

    _install_event_loop()
    asyncio.run(_agent_main(args))


# ---------------------------------------------------------------------------- rtt client
async def _rtt_main(args: argparse.Namespace) -> dict[str, Any]:
    from mcp_edge.client import InferenceClient

    body = Path(args.body_file).read_bytes()
    lat: list[int] = []
    sizes = 0
    errors = 0
    async with InferenceClient(HOST, args.port, qos=args.qos) as client:
        warm_end = time.monotonic() + args.warmup_s
        warmup = 0
        while time.monotonic() < warm_end:
            await client.infer_raw(args.model, body, device=args.device, timeout_s=5)
            warmup += 1
        cpu0 = time.process_time()
        t_start = time.perf_counter_ns()
        deadline = t_start + int(args.max_s * 1e9)
        for _ in range(args.requests):
            t0 = time.perf_counter_ns()
            msg = await client.infer_raw(args.model, body, device=args.device, timeout_s=5)
            lat.append(time.perf_counter_ns() - t0)
            sizes += len(msg.payload)
            if msg.payload[:9] == b'{"error":':
                errors += 1
            if t0 > deadline:
                break
        seconds = (time.perf_counter_ns() - t_start) / 1e9
        cpu_measured = time.process_time() - cpu0
        if args.save_reply:
            reply = await client.infer_raw(args.model, body, device=args.device, timeout_s=5)
            Path(args.save_reply).write_bytes(reply.payload)
    n = len(lat)
    return {
        "qos": args.qos,
        "requests": n,
        "warmup_requests": warmup,
        "error_replies": errors,
        "seconds": round(seconds, 3),
        "rps": round(n / seconds, 1) if seconds else 0.0,
        "latency_us": _percentiles_us(lat),
        "request_bytes": len(body),
        "response_bytes_mean": round(sizes / n, 1) if n else 0,
        "client_cpu_us_per_request": round(cpu_measured / n * 1e6, 1) if n else 0.0,
    }


def role_rtt(args: argparse.Namespace) -> None:
    from mcp_edge.agent.serving.serve import _install_event_loop

    _install_event_loop()
    _emit(asyncio.run(_rtt_main(args)))


# ---------------------------------------------------------------------------- telemetry
def health_payload(device_id: str, ts: float, i: int) -> bytes:
    """A HealthSample JSON body of about 256 bytes (the shape the agent sends)."""
    import orjson

    return orjson.dumps(
        {
            "device_id": device_id,
            "ts": ts,
            "cpu_percent": float(i % 100),
            "load_1m": 0.42,
            "mem_total_mb": 1024.0,
            "mem_used_mb": 512.0,
            "disk_free_mb": 900.0,
            "disk_total_mb": 4096.0,
            "process_rss_mb": 60.0,
            "uptime_s": 1000.0 + i,
            "temperatures_c": {"cpu": 41.5},
            "gpu": {"util_percent": 3.0},
        }
    )


def device_ids(n: int) -> list[str]:
    return [f"bench-dev-{i:03d}" for i in range(n)]


def role_publish(args: argparse.Namespace) -> None:
    import paho.mqtt.client as mqtt

    from mcp_edge.shared.protocol import topics
    from mcp_edge.shared.protocol.topics import TelemetryKind

    devices = device_ids(args.devices)
    dev_topics = [topics.telemetry(d, TelemetryKind.HEALTH) for d in devices]
    t0 = 1_777_000_000.0
    payloads = [
        health_payload(devices[i % len(devices)], t0 + i * 0.001, i) for i in range(args.count)
    ]
    client = _paho(f"bench-pub-{args.tag}")
    client.max_inflight_messages_set(args.inflight)
    acked = 0
    done = threading.Event()
    t_last_ack = 0

    def on_publish(*_a: Any) -> None:
        nonlocal acked, t_last_ack
        acked += 1
        if acked >= args.count:
            t_last_ack = time.monotonic_ns()
            done.set()

    connected = threading.Event()
    client.on_connect = lambda *_a: connected.set()
    client.on_publish = on_publish
    client.connect(HOST, args.port, keepalive=30)
    client.loop_start()
    if not connected.wait(CONNECT_TIMEOUT_S):
        raise SystemExit("publisher: no CONNACK")
    try:
        t_first = time.monotonic_ns()
        for i, payload in enumerate(payloads):
            info = client.publish(dev_topics[i % len(dev_topics)], payload, qos=args.qos)
            if info.rc != mqtt.MQTT_ERR_SUCCESS:
                raise SystemExit(f"publish failed: {mqtt.error_string(info.rc)}")
        all_acked = done.wait(args.max_s)
    finally:
        client.disconnect()
        client.loop_stop()
    seconds = ((t_last_ack if all_acked else time.monotonic_ns()) - t_first) / 1e9
    _emit(
        {
            "count": args.count,
            "acked": acked,
            "all_acked": all_acked,
            "t_first_ns": t_first,
            "t_last_ack_ns": t_last_ack,
            "seconds": round(seconds, 3),
            "msgs_per_s": round(acked / seconds, 1) if seconds else 0.0,
            "payload_bytes_mean": round(sum(map(len, payloads)) / len(payloads), 1),
            "inflight": args.inflight,
            "qos": args.qos,
            "cpu_s": round(time.process_time(), 3),
        }
    )


def _ingest_filter() -> str:
    from mcp_edge.controlplane.ingest import SHARE_GROUP
    from mcp_edge.shared.protocol import topics
    from mcp_edge.shared.protocol.topics import Channel

    return topics.shared_subscription(SHARE_GROUP, topics.all_devices(Channel.TELEMETRY))


def role_subscribe(args: argparse.Namespace) -> None:
    received = 0
    t_first = t_last = 0
    lock = threading.Lock()

    def on_message(*_a: Any) -> None:
        nonlocal received, t_first, t_last
        with lock:
            t_last = time.monotonic_ns()
            if not received:
                t_first = t_last
            received += 1

    client = _paho(f"bench-sub-{args.tag}")
    client.on_message = on_message
    _subscribe_blocking(client, _ingest_filter(), args.port)
    _ready()
    hard = time.monotonic() + args.max_s
    try:
        while received < args.expect and time.monotonic() < hard:
            time.sleep(0.01)
            if received and time.monotonic_ns() - t_last > IDLE_END_S * 1e9:
                break
    finally:
        client.disconnect()
        client.loop_stop()
    seconds = (t_last - t_first) / 1e9
    _emit(
        {
            "received": received,
            "t_first_ns": t_first,
            "t_last_ns": t_last,
            "seconds": round(seconds, 3),
            "msgs_per_s": round((received - 1) / seconds, 1) if seconds > 0 else 0.0,
            "cpu_s": round(time.process_time(), 3),
        }
    )


async def _prepare_db(url: str, devices: list[str]) -> Any:
    from datetime import datetime, timezone

    from mcp_edge.controlplane.db import Database, upgrade_head
    from mcp_edge.controlplane.db.devices import insert_device

    db = Database(url)
    await upgrade_head(db)
    now = datetime.now(timezone.utc)
    async with db.transaction() as tx:
        for d in devices:
            await insert_device(
                tx,
                device_id=d,
                public_key=f"bench-key-{d}",
                status="accepted",
                now=now,
                accepted_at=now,
            )
    return db


async def _ingest_main(args: argparse.Namespace) -> dict[str, Any]:
    from datetime import datetime, timezone

    from sqlalchemy import text

    from mcp_edge.controlplane.broker.base import Credentials
    from mcp_edge.controlplane.ingest import IngestConnection, IngestService
    from mcp_edge.controlplane.metrics import ControlPlaneMetrics
    from mcp_edge.controlplane.mqtt import BrokerAddress

    db = await _prepare_db(args.db_url, device_ids(args.devices))
    metrics = ControlPlaneMetrics()
    marks = {"first": 0, "last": 0, "received": 0, "last_commit": 0, "committed": 0, "flushes": 0}

    class TimedIngest(IngestService):
        def handle(self, topic: str, payload: bytes, ack: int = 0) -> None:
            now = time.monotonic_ns()
            if not marks["received"]:
                marks["first"] = now
            marks["last"] = now
            marks["received"] += 1
            super().handle(topic, payload, ack)

        async def flush(self) -> int:
            n = await super().flush()
            if n:
                marks["last_commit"] = time.monotonic_ns()
                marks["committed"] += n
                marks["flushes"] += 1
            return n

    service = TimedIngest(db, metrics, lambda: datetime.now(timezone.utc))
    # An anonymous broker: no username or password (paho sends none when username is None).
    creds = Credentials(None, None, f"bench-ingest-{args.tag}")  # type: ignore[arg-type]
    await service.start(IngestConnection(BrokerAddress(HOST, args.port), creds))
    _ready()
    hard = time.monotonic() + args.max_s
    try:
        while marks["committed"] < args.expect and time.monotonic() < hard:
            await asyncio.sleep(0.01)
            if marks["received"] and time.monotonic_ns() - marks["last"] > IDLE_END_S * 1e9:
                break
    finally:
        await service.stop()
    async with db.read() as tx:
        rows = (await tx.execute(text("SELECT count(*) FROM health_samples"))).scalar_one()
    await db.dispose()
    dropped = {
        s.labels["reason"]: s.value
        for fam in metrics.registry.collect()
        if fam.name == "mcp_cp_ingest_dropped"
        for s in fam.samples
        if s.name.endswith("_total")
    }
    recv_s = (marks["last"] - marks["first"]) / 1e9
    commit_s = (marks["last_commit"] - marks["first"]) / 1e9
    return {
        "received": marks["received"],
        "committed": marks["committed"],
        "rows_in_db": int(rows),
        "flushes": marks["flushes"],
        "rows_per_flush": round(marks["committed"] / marks["flushes"], 1)
        if marks["flushes"]
        else 0,
        "dropped": dropped,
        "t_first_ns": marks["first"],
        "t_last_recv_ns": marks["last"],
        "t_last_commit_ns": marks["last_commit"],
        "received_per_s": round((marks["received"] - 1) / recv_s, 1) if recv_s > 0 else 0.0,
        "committed_per_s": round(marks["committed"] / commit_s, 1) if commit_s > 0 else 0.0,
        "cpu_s": round(time.process_time(), 3),
    }


def role_ingest(args: argparse.Namespace) -> None:
    import logging

    from mcp_edge.controlplane.cli.server import install_event_loop

    logging.basicConfig(level=logging.WARNING)
    loop = install_event_loop()  # as `mcp-controlplane serve` runs
    result = asyncio.run(_ingest_main(args))
    result["event_loop"] = loop
    _emit(result)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="role", required=True)
    for name in ("echo", "agent", "rtt", "publish", "subscribe", "ingest"):
        s = sub.add_parser(name)
        s.add_argument("--port", type=int, required=True)
        s.add_argument("--max-s", type=float, default=120.0)
        s.add_argument("--tag", default="0")
        if name in ("echo", "agent", "rtt"):
            s.add_argument("--device", required=True)
            s.add_argument("--model", default="digits")
        if name in ("publish", "subscribe", "ingest"):
            s.add_argument("--devices", type=int, default=20)
        if name in ("subscribe", "ingest"):
            s.add_argument("--expect", type=int, required=True)
    sub.choices["echo"].add_argument("--answer-file", required=True)
    sub.choices["agent"].add_argument("--model-path", required=True)
    r = sub.choices["rtt"]
    r.add_argument("--body-file", required=True)
    r.add_argument("--qos", type=int, choices=(0, 1), required=True)
    r.add_argument("--requests", type=int, default=2000)
    r.add_argument("--warmup-s", type=float, default=0.5)
    r.add_argument("--save-reply", default=None)
    pub = sub.choices["publish"]
    pub.add_argument("--count", type=int, required=True)
    pub.add_argument("--qos", type=int, default=1)
    pub.add_argument("--inflight", type=int, default=100)
    sub.choices["ingest"].add_argument("--db-url", required=True)
    args = p.parse_args(argv)
    {
        "echo": role_echo,
        "agent": role_agent,
        "rtt": role_rtt,
        "publish": role_publish,
        "subscribe": role_subscribe,
        "ingest": role_ingest,
    }[args.role](args)


if __name__ == "__main__":
    main()
