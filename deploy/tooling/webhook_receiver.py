"""A reference receiver for the control plane's webhooks (docs/webhooks.md).

What a training pipeline's endpoint has to do, in one small aiohttp app: read the raw body
(capped), check ``X-MCP-Signature`` over it with the shared secret and a timestamp tolerance
(:func:`mcp_edge.controlplane.webhooks.verify_signature`), refuse an ``X-MCP-Delivery`` id it has
seen before (a replayed or retried delivery), answer 2xx only when the event is recorded, and
append each accepted event as one JSON line to ``--out`` (fsynced, so a crash loses nothing it
acknowledged). It records events and acts on none (deploy/retrain_receiver.py acts on
retraining triggers)::

    python -m mcp_edge.tooling.webhook_receiver --port 9100 --secret-file hook.secret \\
        --out events.jsonl

Answers: 204 recorded, 200 a duplicate (already recorded: the sender stops retrying), 400
malformed, 401 a bad or stale signature, 413 too large.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import signal
import time
from collections import OrderedDict
from pathlib import Path

from aiohttp import web

from mcp_edge.controlplane.webhooks import verify_signature

log = logging.getLogger("mcp.webhook-receiver")

MAX_BODY = 1024 * 1024
SEEN_IDS = 100_000
_DELIVERY = re.compile(r"^[0-9a-f]{32}$")


class Receiver:
    """Verifies, de-duplicates and records deliveries (see the module docstring)."""

    def __init__(self, secret: bytes, out: Path, tolerance_s: float = 300.0) -> None:
        self.secret = secret
        self.out = out
        self.tolerance_s = tolerance_s
        self.seen: OrderedDict[str, None] = OrderedDict()
        self.counts = {"recorded": 0, "duplicate": 0, "bad_signature": 0, "malformed": 0}

    async def handle(self, request: web.Request) -> web.Response:
        if request.content_length is not None and request.content_length > MAX_BODY:
            return self._refuse("malformed", 413, "body too large")
        body = await request.content.read(MAX_BODY + 1)
        if len(body) > MAX_BODY:
            return self._refuse("malformed", 413, "body too large")
        signature = request.headers.get("X-MCP-Signature", "")
        if not verify_signature(self.secret, signature, body, time.time(), self.tolerance_s):
            return self._refuse("bad_signature", 401, "bad or stale signature")
        delivery = request.headers.get("X-MCP-Delivery", "")
        if not _DELIVERY.fullmatch(delivery):
            return self._refuse("malformed", 400, "X-MCP-Delivery is not 32 hex digits")
        if delivery in self.seen:
            self.counts["duplicate"] += 1
            log.info("delivery %s seen before: not recorded again", delivery)
            return web.Response(status=200, text="duplicate\n")
        try:
            event = json.loads(body)
        except ValueError:
            return self._refuse("malformed", 400, "body is not JSON")
        line = json.dumps(
            {"delivery": delivery, "event": request.headers.get("X-MCP-Event", ""), "body": event},
            separators=(",", ":"),
        )
        with self.out.open("a", encoding="utf-8") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.seen[delivery] = None
        if len(self.seen) > SEEN_IDS:
            self.seen.popitem(last=False)
        self.counts["recorded"] += 1
        log.info("recorded %s %s", request.headers.get("X-MCP-Event", "?"), delivery)
        return web.Response(status=204)

    def _refuse(self, reason: str, status: int, text: str) -> web.Response:
        self.counts[reason] += 1
        log.warning("refused a delivery with %d: %s", status, text)
        return web.Response(status=status, text=text + "\n")


def build_app(receiver: Receiver) -> web.Application:
    app = web.Application(client_max_size=MAX_BODY)
    app.router.add_post("/", receiver.handle)
    app.router.add_post("/{path:.*}", receiver.handle)
    return app


def _read_secret(path: Path) -> bytes:
    secret = path.read_bytes().strip()
    if len(secret) < 32:
        raise SystemExit(f"{path}: a webhook secret needs at least 32 bytes")
    return secret


async def _serve(args: argparse.Namespace) -> None:
    receiver = Receiver(_read_secret(args.secret_file), args.out, args.tolerance_s)
    runner = web.AppRunner(build_app(receiver), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    log.info("receiving webhooks on http://%s:%d/ into %s", args.host, args.port, args.out)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--secret-file", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True, help="JSON lines, one per event")
    parser.add_argument("--tolerance-s", type=float, default=300.0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    asyncio.run(_serve(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
