"""Console devices bench: ``/ui/devices`` on a fleet of 10,000 devices, against its 300 ms goal.

The bench makes a fleet in a fresh database through the control plane's query modules, in
bulk (one executemany per table): ``--devices`` devices (10,000) in five statuses, five hardware
profiles, ten groups and three labels each, three published models, one or two desired models
per accepted device with its signed-state sequence number, and a reported state that mostly
agrees (about one device in seven runs an older version, lags a document behind or reports a
model it was not told to run).

It then serves the real control plane app in process (aiohttp's test server on 127.0.0.1, no
broker), signs in to the console, and requests each case ``--requests`` times (after one
warm-up request): the first, a middle and the last page; each filter (status, profile, label,
group, id search, model, not in sync, and all of them together); each sort, both ways. A
middleware placed before every other one times each request inside the server (``server_ms``:
session check, queries, template) and the CPU time the process spent on it
(``process_cpu_ms``: SQLite's work included, PostgreSQL's not, which runs in its own process);
the client's round trip is reported beside it. Each case reports the median and the maximum,
and whether the maximum is under the goal. The one-minute load average at the start and the
end says how busy the machine was: server time on a shared machine includes waiting for a
core.

The baseline, from the same run and the same database, is the REST API's
``GET /api/v1/devices`` for the same page (50 devices with their models, as JSON): what the
console page costs on top of the rows it shows.

SQLite always (a file in a temporary directory); PostgreSQL too when ``MCP_TEST_POSTGRES_URL``
names a server (a throw-away database is created and dropped).

    .venv/bin/python bench/ui_devices.py [--devices N] [--requests N] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import secrets
import statistics
import sys
import tempfile
import time
import typing
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from aiohttp import ClientSession, CookieJar, web  # noqa: E402
from aiohttp.test_utils import TestServer  # noqa: E402
from sqlalchemy import Table, insert, text  # noqa: E402

from mcp_edge.controlplane.app import UnconfiguredProvisioner, create_app  # noqa: E402
from mcp_edge.controlplane.bootstrap import initialize  # noqa: E402
from mcp_edge.controlplane.db import Database, registry  # noqa: E402
from mcp_edge.controlplane.db import deployments as deployment_q  # noqa: E402
from mcp_edge.controlplane.db import telemetry as telemetry_q  # noqa: E402
from mcp_edge.controlplane.db.deployments import DesiredView, DeviceModelView  # noqa: E402
from mcp_edge.controlplane.db.models import Device, DeviceLabel  # noqa: E402
from mcp_edge.controlplane.settings import PasswordCost, Settings  # noqa: E402

GOAL_MS = 300.0
PAGE_SIZE = 50
PASSWORD = "bench-password-1"
NOW = datetime.now(timezone.utc).replace(microsecond=0)
STATUSES = [("accepted", 90), ("pending", 4), ("revoked", 3), ("preauthorized", 2),
            ("rejected", 1)]  # fmt: skip
PROFILES = ["generic-x86_64", "generic-arm64", "jetson-orin", "rpi5", "coral-tpu"]
MODELS = {"digits": ["1.0.0", "1.1.0"], "iris": ["0.1.0", "0.2.0"], "convnet": ["2.0.0", "2.1.0"]}
SERVER_MS = web.AppKey("bench_server_ms", list)


# ---------------------------------------------------------------------------- the fleet
@dataclass
class Fleet:
    """Rows of every table for the bench's fleet."""

    devices: list[dict[str, Any]] = field(default_factory=list)
    labels: list[dict[str, Any]] = field(default_factory=list)
    models: list[DeviceModelView] = field(default_factory=list)
    desired: list[DesiredView] = field(default_factory=list)
    reported: list[dict[str, Any]] = field(default_factory=list)


def _fleet_rows(n: int, rng: random.Random) -> Fleet:
    """Rows of every table for ``n`` devices (deterministic for a seed)."""
    statuses = [s for s, weight in STATUSES for _ in range(weight)]
    rows = Fleet()
    for i in range(n):
        device_id = f"dev-{i:05d}"
        status = rng.choice(statuses)
        accepted = status in ("accepted", "revoked")
        seen = NOW - timedelta(seconds=rng.randint(0, 2 * 86400)) if accepted else None
        rows.devices.append({
            "id": device_id, "public_key": f"{i:064x}", "status": status,
            "profile": PROFILES[i % len(PROFILES)], "group_name": f"line-{i % 10}",
            "facts": {"cpu_count": 4, "os": "linux", "arch": "x86_64"},
            "agent_version": "0.1.0", "online": status == "accepted" and rng.random() < 0.8,
            "last_seen_at": seen, "created_at": NOW - timedelta(days=30), "updated_at": NOW,
            "accepted_at": NOW - timedelta(days=30) if accepted else None,
            "revoked_at": NOW if status == "revoked" else None,
        })  # fmt: skip
        labels = {"site": f"site-{i % 20}", "env": "prod" if i % 4 else "staging",
                  "rack": str(i % 50)}  # fmt: skip
        rows.labels += [{"device_id": device_id, "key": k, "value": v} for k, v in labels.items()]
        if status != "accepted":
            continue
        told = sorted(rng.sample(sorted(MODELS), rng.choice((1, 1, 2))))
        seq = rng.randint(1, 6)
        reported_models = []
        for model in told:
            old, new = MODELS[model]
            rows.models.append(DeviceModelView(device_id, model, new))
            active = old if rng.random() < 0.07 else new
            reported_models.append({"name": model, "phase": "active", "active_version": active,
                                    "installed_versions": [old, new]})  # fmt: skip
        if rng.random() < 0.02:
            extra = next(m for m in sorted(MODELS) if m not in told)
            reported_models.append({"name": extra, "phase": "active",
                                    "active_version": MODELS[extra][0]})  # fmt: skip
        applied = seq - 1 if rng.random() < 0.05 else seq
        rows.desired.append(DesiredView(
            device_id=device_id, seq=seq, envelope={"signed": {"seq": seq}}, issued_at=NOW,
            expires_at=NOW + timedelta(days=7), refresh_at=NOW + timedelta(days=3),
            published_at=NOW,
        ))  # fmt: skip
        rows.reported.append({
            "device_id": device_id, "ts": seen or NOW, "received_at": seen or NOW,
            "applied_seq": applied,
            "document": {"device_id": device_id, "applied_seq": applied,
                         "profile": PROFILES[i % len(PROFILES)], "models": reported_models},
        })  # fmt: skip
    return rows


async def make_fleet(db: Database, n: int) -> float:
    """Write the fleet; return the seconds it took."""
    started = time.perf_counter()
    rows = _fleet_rows(n, random.Random(20260501))
    async with db.transaction() as tx:
        for model, versions in MODELS.items():
            for j, version in enumerate(versions):
                await registry.insert_version(
                    tx, model=model, version=version, version_numeric=j + 1,
                    target_path=f"{model}/{version}.mcpb", sha256="0" * 64, length=0,
                    format="onnx", profiles=[], variants=[], publisher_keyid="0" * 64,
                    uploaded_by="bench", now=NOW,
                )  # fmt: skip
        await tx.execute(insert(typing.cast(Table, Device.__table__)), rows.devices)
        await tx.execute(insert(typing.cast(Table, DeviceLabel.__table__)), rows.labels)
        await deployment_q.put_device_models(tx, rows.models, now=NOW)
        await deployment_q.save_desired_states(tx, rows.desired)
        await telemetry_q.upsert_reported(tx, rows.reported)
    if db.url.get_backend_name() == "postgresql":  # what autovacuum does after a bulk load
        async with db.transaction() as tx:
            await tx.execute(text("ANALYZE"))
    return time.perf_counter() - started


# ---------------------------------------------------------------------------- measuring
CASES: list[tuple[str, str]] = [
    ("page_first", ""),
    ("page_middle", "page=100"),
    ("page_last", "page={last}"),
    ("filter_status_pending", "status=pending"),
    ("filter_status_online", "status=online"),
    ("filter_profile", "profile=jetson-orin"),
    ("filter_label", "label=site%3Dsite-7"),
    ("filter_group", "group=line-3"),
    ("filter_search", "q=12"),
    ("filter_model", "model=iris"),
    ("filter_not_in_sync", "sync=out"),
    ("filter_not_in_sync_last_page", "sync=out&page={last_out}"),
    ("filter_all", "status=accepted&profile=rpi5&label=env%3Dprod&model=digits&sync=out&q=0"),
    *[(f"sort_{key}_{way}", f"sort={'-' if way == 'desc' else ''}{key}&page=50")
      for key in ("id", "status", "profile", "last_seen") for way in ("asc", "desc")],
]  # fmt: skip
_RANGE = re.compile(r"(\d[\d,]*)–(\d[\d,]*) of (\d[\d,]*)")


@web.middleware
async def _timer(request: web.Request, handler: Callable[..., Awaitable[Any]]) -> Any:
    started, cpu = time.perf_counter(), time.process_time()
    try:
        return await handler(request)
    finally:
        wall = (time.perf_counter() - started) * 1000
        request.app[SERVER_MS].append((wall, (time.process_time() - cpu) * 1000))


async def _sign_in(session: ClientSession, base: str) -> None:
    async with session.get(base + "/ui/login") as r:
        nonce = re.search(r'name="csrf" value="([^"]+)"', await r.text())
    assert nonce is not None, "no sign-in form"
    form = {"username": "admin", "password": PASSWORD, "csrf": nonce.group(1), "next": "/ui/"}
    async with session.post(base + "/ui/login", data=form, allow_redirects=False) as r:
        assert r.status == 303, f"sign-in failed: HTTP {r.status}"


async def _measure(
    session: ClientSession, base: str, app: web.Application, path: str, repeats: int,
    headers: dict[str, str] | None = None,
) -> tuple[dict[str, Any], str]:  # fmt: skip
    server: list[float] = []
    cpu: list[float] = []
    client: list[float] = []
    text = ""
    for i in range(repeats + 1):
        app[SERVER_MS].clear()
        started = time.perf_counter()
        async with session.get(base + path, headers=headers) as r:
            text = await r.text()
            assert r.status == 200, f"{path}: HTTP {r.status}: {text[:300]}"
        elapsed = (time.perf_counter() - started) * 1000
        if i == 0:
            continue  # warm-up: compiled statements and templates
        wall, spent = app[SERVER_MS][-1]
        server.append(wall)
        cpu.append(spent)
        client.append(elapsed)
    figures = {
        "server_ms_median": round(statistics.median(server), 2),
        "server_ms_max": round(max(server), 2),
        "process_cpu_ms_median": round(statistics.median(cpu), 2),
        "client_ms_median": round(statistics.median(client), 2),
        "pass": max(server) < GOAL_MS,
    }
    return figures, text


async def measure_database(url: str, data_dir: Path, devices: int, repeats: int) -> dict[str, Any]:
    settings = Settings(
        data_dir=data_dir, database_url=url, password_cost=PasswordCost.MIN,
        broker_urls=("mqtt://broker.invalid:1883",),
    )  # fmt: skip
    result = await initialize(
        settings, clock=lambda: datetime.now(timezone.utc), admin_user="admin",
        admin_password=PASSWORD,
    )  # fmt: skip
    db = Database(settings.effective_database_url)
    try:
        seed_s = await make_fleet(db, devices)
    finally:
        await db.dispose()
    app = create_app(settings, UnconfiguredProvisioner())
    app[SERVER_MS] = []
    app.middlewares.insert(0, _timer)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    base = str(server.make_url("")).rstrip("/")
    cases: dict[str, Any] = {}
    try:
        async with ClientSession(cookie_jar=CookieJar(unsafe=True)) as session:
            await _sign_in(session, base)
            last = -(-devices // PAGE_SIZE)
            last_out = 1
            for name, query in CASES:
                path = "/ui/devices?" + query.format(last=last, last_out=last_out)
                figures, text = await _measure(session, base, app, path, repeats)
                shown = _RANGE.search(text)
                figures["shown"] = shown.group(0) if shown else "none"
                figures["rows"] = text.count("<tr data-device=")
                if name == "filter_not_in_sync" and shown:
                    last_out = -(-int(shown.group(3).replace(",", "")) // PAGE_SIZE)
                cases[name] = figures
            api = {}
            auth = {"Authorization": f"Bearer {result.api_token}"}
            for name, query in (("page_first", "offset=0"), ("page_middle", "offset=4950"),
                                ("page_last", f"offset={(last - 1) * PAGE_SIZE}"),
                                ("filter_not_in_sync", "in_sync=false")):  # fmt: skip
                path = f"/api/v1/devices?limit={PAGE_SIZE}&{query}"
                api[name], _ = await _measure(session, base, app, path, repeats, auth)
    finally:
        await server.close()
    worst = max(c["server_ms_max"] for c in cases.values())
    return {
        "backend": url.split(":", 1)[0],
        "devices": devices,
        "seed_s": round(seed_s, 2),
        "requests_per_case": repeats,
        "ui_devices": cases,
        "baseline_api_devices": api,
        "worst_server_ms": worst,
        "pass": all(c["pass"] for c in cases.values()),
    }


def _postgres_database(server_url: str) -> tuple[str, Callable[[], None]]:
    import psycopg
    from psycopg import sql

    name = f"mcp_bench_{secrets.token_hex(6)}"
    with psycopg.connect(server_url, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))

    def drop() -> None:
        with psycopg.connect(server_url, autocommit=True) as admin:
            admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )

    parts = urlsplit(server_url)
    return urlunsplit(parts._replace(path="/" + name)), drop


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    load_start = round(os.getloadavg()[0], 2)
    runs = []
    with tempfile.TemporaryDirectory(prefix="mcp-bench-ui-") as tmp:
        sqlite_url = f"sqlite:///{Path(tmp) / 'cp.db'}"
        runs.append(await measure_database(sqlite_url, Path(tmp) / "sqlite", args.devices,
                                           args.requests))  # fmt: skip
        server_url = os.environ.get("MCP_TEST_POSTGRES_URL")
        if server_url:
            url, drop = _postgres_database(server_url)
            try:
                runs.append(await measure_database(url, Path(tmp) / "pg", args.devices,
                                                   args.requests))  # fmt: skip
            finally:
                drop()
    return {
        "bench": "ui_devices",
        "load_average_1m": {"start": load_start, "end": round(os.getloadavg()[0], 2)},
        "goal": f"every /ui/devices page and filter under {GOAL_MS:.0f} ms server time "
        f"with {args.devices:,} devices",
        "goal_ms": GOAL_MS,
        "page_size": PAGE_SIZE,
        "runs": runs,
        "pass": all(r["pass"] for r in runs),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=10_000)
    parser.add_argument("--requests", type=int, default=15, help="timed requests per case")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args()
    if args.devices < PAGE_SIZE * 3 or args.requests < 1:
        parser.error(f"--devices must be at least {PAGE_SIZE * 3} and --requests at least 1")
    report = asyncio.run(main_async(args))
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
