"""Repository transfer bench: a bundle through TUF over MQTT against raw paho, in one run.

Everything goes through one Mosquitto started here (anonymous, ``set_tcp_nodelay true``,
127.0.0.1). A random bundle (50 MiB; 8 MiB with ``--quick``) is published through a real
``TufRepository``. The server side runs in its own process (``bench/_transfer_roles.py``):

1. Baseline: a raw paho responder (``pread`` + publish, nothing else) and, in this process, a
   raw paho requester keeping the same window of the same chunk size in flight at the same QoS,
   writing each chunk at its offset, then fsync.
2. Under test: ``RepoMqttService`` serving the repository directory, and in this process the
   agent's ``MqttClient`` + ``MqttRepoTransport``: ``tuf.ngclient.Updater.refresh`` +
   ``get_targetinfo`` + ``MqttRepoTransport.download`` (fsyncs) +
   ``TargetFile.verify_length_and_hashes``. ``download_mb_s`` times the download alone (the
   same work as the baseline); ``end_to_end_mb_s`` adds the refresh and the hash check.
3. Resume: the same download, with the client's connection dropped (DISCONNECT) a third of the
   way through and reopened 0.2 s later; the transport retries and resumes. Reported:
   ``rerequested_chunks``, chunk requests beyond one per chunk (goal: at most one window).

Each throughput is the best of ``--runs`` (3; 1 with ``--quick``). MB is 10^6 bytes. Prints one
JSON document (and writes it to ``--out``).

    .venv/bin/python bench/transfer.py [--quick] [--out FILE] [--runs N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
for _p in (str(BENCH_DIR), str(REPO_ROOT)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import orjson  # noqa: E402
from _transfer_roles import CONNECT_TIMEOUT_S, HOST, paho_client  # noqa: E402

from mcp_edge.agent.update.transport_mqtt import MqttRepoTransport, MqttTransportConfig  # noqa: E402
from mcp_edge.controlplane.repository.tuf_repo import KeyStore, TufRepository  # noqa: E402
from mcp_edge.shared.mqtt import MqttClient, MqttSettings, Subscription  # noqa: E402
from mcp_edge.shared.protocol import topics  # noqa: E402
from mcp_edge.tooling.mosquitto import MosquittoBroker  # noqa: E402

TARGET = "bench/1.0.0/bench-1.0.0.mcpb"
DEVICE = "bench-dev"
WINDOW = 8
CHUNK = 128 * 1024
QOS = 1


@contextmanager
def server(role: str, port: int, *extra: str) -> Iterator[None]:
    """Run a ``_transfer_roles.py`` role until the block ends."""
    proc = subprocess.Popen(
        [sys.executable, str(BENCH_DIR / "_transfer_roles.py"), role, "--port", str(port), *extra],
        stdout=subprocess.PIPE,
        cwd=REPO_ROOT,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode().strip()
        if line != "READY":
            raise SystemExit(f"{role} did not start (said {line!r})")
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def raw_transfer(port: int, path: str, size: int, dest: Path) -> float:
    """The baseline requester; returns seconds from the first request to the fsync."""
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    client = paho_client("raw-bench-dev")
    reply_topic = topics.repo_reply(DEVICE)
    request_topic = topics.repo_request(DEVICE)
    fd = os.open(dest, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    subscribed, done = threading.Event(), threading.Event()
    offsets = iter(range(0, size, CHUNK))
    outstanding = [0]
    lock = threading.Lock()

    def ask(c: Any) -> None:
        with lock:
            offset = next(offsets, None)
            if offset is None:
                return
            outstanding[0] += 1
        props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
        props.ResponseTopic = reply_topic
        props.CorrelationData = offset.to_bytes(8, "big")
        c.publish(
            request_topic,
            orjson.dumps({"path": path, "offset": offset, "length": CHUNK}),
            qos=QOS,
            properties=props,
        )

    def on_message(c: Any, _u: Any, msg: Any) -> None:
        offset = int.from_bytes(msg.properties.CorrelationData, "big")
        os.pwrite(fd, msg.payload, offset)
        ask(c)
        with lock:
            outstanding[0] -= 1
            if outstanding[0] == 0:
                done.set()

    client.on_message = on_message
    client.on_subscribe = lambda *_a: subscribed.set()
    client.on_connect = lambda c, *_a: c.subscribe(reply_topic, qos=1)
    client.connect(HOST, port, keepalive=30)
    client.loop_start()
    try:
        if not subscribed.wait(CONNECT_TIMEOUT_S):
            raise SystemExit("raw client: no SUBACK")
        start = time.perf_counter()
        for _ in range(WINDOW):
            ask(client)
        if not done.wait(600):
            raise SystemExit("raw transfer did not finish")
        os.fsync(fd)
        return time.perf_counter() - start
    finally:
        os.close(fd)
        client.disconnect()
        client.loop_stop()


class Device:
    """The agent's MQTT client and repository transport, on this process's event loop."""

    def __init__(self, port: int, config: MqttTransportConfig) -> None:
        self.mqtt = MqttClient(
            MqttSettings(
                host=HOST, port=port, client_id=DEVICE, clean_start=True, max_packet_bytes=16 << 20
            )
        )
        self.transport = MqttRepoTransport(self.mqtt, DEVICE, config)
        self.mqtt.set_handler(self.transport.handle_reply)

    async def start(self) -> None:
        await self.mqtt.connect()
        await self.mqtt.subscribe(Subscription(self.transport.reply_topic, retain_handling=2))


def _updater(repo: TufRepository, transport: MqttRepoTransport, tmp: Path) -> Any:
    from tuf.ngclient.updater import Updater

    metadata = tmp / f"device-metadata-{time.monotonic_ns()}"
    metadata.mkdir()
    return Updater(
        str(metadata),
        transport.metadata_url,
        target_base_url=transport.targets_url,
        fetcher=transport.fetcher(),
        bootstrap=repo.root_bytes(),
    )


def _target_url(transport: MqttRepoTransport, info: Any) -> str:
    dirname, _, name = info.path.rpartition("/")
    return f"{transport.targets_url}{dirname}/{info.hashes['sha256']}.{name}"


async def mcp_transfer(device: Device, repo: TufRepository, tmp: Path) -> dict[str, float]:
    """One refresh + download + verify; seconds per phase."""

    def run() -> dict[str, float]:
        t0 = time.perf_counter()
        updater = _updater(repo, device.transport, tmp)
        updater.refresh()
        info = updater.get_targetinfo(TARGET)
        t1 = time.perf_counter()
        dest = tmp / "mcp.mcpb"
        dest.unlink(missing_ok=True)
        device.transport.download(_target_url(device.transport, info), dest, length=info.length)
        t2 = time.perf_counter()
        with dest.open("rb") as f:
            info.verify_length_and_hashes(f)
        t3 = time.perf_counter()
        return {"refresh_s": t1 - t0, "download_s": t2 - t1, "verify_s": t3 - t2}

    return await asyncio.to_thread(run)


async def resume_transfer(device: Device, repo: TufRepository, tmp: Path) -> dict[str, Any]:
    """Download with the connection dropped a third of the way; count re-requested chunks."""
    loop = asyncio.get_running_loop()
    updater = _updater(repo, device.transport, tmp)
    await asyncio.to_thread(updater.refresh)
    info = await asyncio.to_thread(updater.get_targetinfo, TARGET)
    dest = tmp / "resume.mcpb"
    dest.unlink(missing_ok=True)
    dropped = threading.Event()
    dropped_at = [0]

    async def drop_and_reconnect() -> None:
        await device.mqtt.disconnect()
        await asyncio.sleep(0.2)  # the outage
        await device.start()

    def progress(done: int, total: int) -> None:
        if not dropped.is_set() and done >= total // 3:
            dropped.set()
            dropped_at[0] = done
            asyncio.run_coroutine_threadsafe(drop_and_reconnect(), loop)

    before = device.transport.requests_sent
    calls, started = 0, time.perf_counter()
    while True:
        calls += 1
        try:
            await asyncio.to_thread(
                device.transport.download,
                _target_url(device.transport, info),
                dest,
                length=info.length,
                progress=progress,
            )
            break
        except Exception as e:  # a failed call is retried: that is the resume under test
            if calls >= 5:
                raise SystemExit(f"resume did not complete: {e}") from e
    seconds = time.perf_counter() - started
    with dest.open("rb") as f:
        info.verify_length_and_hashes(f)
    chunks = -(-info.length // CHUNK)
    sent = device.transport.requests_sent - before
    return {
        "dropped_at_bytes": dropped_at[0],
        "download_calls": calls,
        "chunk_requests": sent,
        "chunks": chunks,
        "rerequested_chunks": sent - chunks,
        "window": WINDOW,
        "within_one_window": sent - chunks <= WINDOW,
        "seconds": round(seconds, 3),
        "verified": True,
    }


def _mb_s(size: int, seconds: float) -> float:
    return round(size / seconds / 1e6, 1)


async def bench(args: argparse.Namespace, tmp: Path, port: int) -> dict[str, Any]:
    size = (8 if args.quick else 50) * 1024 * 1024
    runs = args.runs or (1 if args.quick else 3)
    repo = TufRepository(tmp / "repository", KeyStore(tmp / "keys"))
    repo.init()
    source = tmp / "bundle.mcpb"
    source.write_bytes(os.urandom(size))
    info = repo.add_target(TARGET, source, custom={"model": "bench", "version": "1.0.0"})
    stored = repo.targets_dir / "bench" / "1.0.0" / f"{info.hashes['sha256']}.bench-1.0.0.mcpb"
    path = str(stored.relative_to(repo.dir))

    with server("raw-server", port, "--file", str(stored)):
        raw = [
            await asyncio.to_thread(raw_transfer, port, path, size, tmp / "raw.mcpb")
            for _ in range(runs)
        ]
    config = MqttTransportConfig(window=WINDOW, chunk_bytes=CHUNK, qos=QOS)
    with server("cp-server", port, "--repo", str(repo.dir)):
        device = Device(port, config)
        await device.start()
        try:
            mcp = [await mcp_transfer(device, repo, tmp) for _ in range(runs)]
            resume = await resume_transfer(device, repo, tmp)
        finally:
            await device.mqtt.close()
    best_raw = min(raw)
    best = min(mcp, key=lambda r: r["download_s"])
    download_mb_s = _mb_s(size, best["download_s"])
    raw_mb_s = _mb_s(size, best_raw)
    return {
        "bench": "transfer",
        "size_bytes": size,
        "window": WINDOW,
        "chunk_bytes": CHUNK,
        "qos": QOS,
        "runs": runs,
        "raw_paho": {
            "mb_s": raw_mb_s,
            "seconds": round(best_raw, 3),
            "all_seconds": [round(s, 3) for s in raw],
        },
        "mcp": {
            "download_mb_s": download_mb_s,
            "end_to_end_mb_s": _mb_s(size, sum(best.values())),
            **{k: round(v, 3) for k, v in best.items()},
            "all_download_seconds": [round(r["download_s"], 3) for r in mcp],
        },
        "ratio": round(_mb_s(size, sum(best.values())) / raw_mb_s, 3),
        "ratio_is": "end to end (refresh + download + TUF hash check + fsync) / raw paho",
        "download_only_ratio": round(download_mb_s / raw_mb_s, 3),
        "goal_ratio": 0.5,
        "resume": resume,
        "env": {
            "python": platform.python_version(),
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
        },
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 MiB, one run (a few seconds)")
    parser.add_argument("--runs", type=int, default=0, help="runs per side (best is kept)")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="mcp-transfer-") as tmp_name:
        tmp = Path(tmp_name)
        (tmp / "broker").mkdir()
        with MosquittoBroker(tmp / "broker") as broker:
            doc = asyncio.run(bench(args, tmp, broker.port))
    text = json.dumps(doc, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
