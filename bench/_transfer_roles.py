"""Server-side roles of ``bench/transfer.py``, each run as its own process.

    python bench/_transfer_roles.py raw-server --port P --file F
        raw paho MQTT 5 responder: answers each ``{path, offset, length}`` request on the shared
        ``repo`` subscription with ``os.pread`` of one file, on the response topic with the
        correlation data and RepoReply's user properties (the baseline: no validation, no
        asyncio, nothing but paho);
    python bench/_transfer_roles.py cp-server --port P --repo DIR
        the control plane's ``RepoMqttService`` serving a TufRepository directory.

Each prints ``READY`` once subscribed and runs until SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
for _p in (str(BENCH_DIR), str(REPO_ROOT)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import orjson  # noqa: E402

HOST = "127.0.0.1"
SHARED_FILTER = "$share/cp/mcp/v1/dev/+/repo"
CONNECT_TIMEOUT_S = 10.0


def paho_client(client_id: str) -> Any:
    """A paho MQTT 5 client with TCP_NODELAY set on its socket."""
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion

    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)

    def nodelay(_c: Any, _u: Any, sock: Any) -> None:
        if isinstance(sock, socket.socket):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    client.on_socket_open = nodelay
    client.max_inflight_messages_set(256)
    return client


def _ready() -> None:
    sys.stdout.write("READY\n")
    sys.stdout.flush()


def role_raw_server(args: argparse.Namespace) -> None:
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    fd = os.open(args.file, os.O_RDONLY)
    size = os.fstat(fd).st_size
    client = paho_client("raw-repo-server")
    subscribed = threading.Event()

    def on_message(c: Any, _u: Any, msg: Any) -> None:
        req = orjson.loads(msg.payload)
        offset, length = int(req["offset"]), int(req["length"])
        data = os.pread(fd, min(length, max(0, size - offset)), offset)
        props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
        props.CorrelationData = msg.properties.CorrelationData
        props.UserProperty = [("status", "ok"), ("size", str(size)), ("offset", str(offset))]
        c.publish(msg.properties.ResponseTopic, data, qos=msg.qos, properties=props)

    client.on_message = on_message
    client.on_subscribe = lambda *_a: subscribed.set()
    client.on_connect = lambda c, *_a: c.subscribe(SHARED_FILTER, qos=1)
    client.connect(HOST, args.port, keepalive=30)
    client.loop_start()
    if not subscribed.wait(CONNECT_TIMEOUT_S):
        raise SystemExit("raw server: no SUBACK")
    _ready()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    client.disconnect()
    client.loop_stop()


async def _cp_server(args: argparse.Namespace) -> None:
    from mcp_edge.controlplane.broker.base import Credentials
    from mcp_edge.controlplane.metrics import ControlPlaneMetrics
    from mcp_edge.controlplane.mqtt import BrokerAddress
    from mcp_edge.controlplane.repository.mqtt_service import RepoConnection, RepoMqttService

    service = RepoMqttService(Path(args.repo), ControlPlaneMetrics())
    await service.start(
        RepoConnection(
            BrokerAddress(HOST, args.port),
            Credentials(username="svc-bench", password="unused", client_id="cp-bench-repo"),
        )
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    _ready()
    await stop.wait()
    await service.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description="server roles of bench/transfer.py")
    parser.add_argument("role", choices=["raw-server", "cp-server"])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--file", type=Path)
    parser.add_argument("--repo", type=Path)
    args = parser.parse_args()
    if args.role == "raw-server":
        role_raw_server(args)
    else:
        asyncio.run(_cp_server(args))


if __name__ == "__main__":
    main()
