"""The control plane's aiohttp application: :func:`create_app` and :func:`serve`.

Routes outside the REST table::

    GET /healthz                 the process is up (no I/O)
    GET /readyz                  the database answers and its schema is at the newest revision
    GET /metrics                 Prometheus exposition
    GET /api/v1/openapi.json     the OpenAPI 3.1 document of everything under /api/v1

Everything is passed in: settings, the broker provisioner (the dynamic-security one in
production; tests pass a fake implementing :class:`BrokerProvisioner`), the clock, the trust
source. The app owns one :class:`~controlplane.db.Database` (one AsyncEngine), migrates it to
the newest revision on startup (``settings.migrate_on_start``) and disposes of it on cleanup.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Awaitable, Callable
from datetime import datetime, timezone

import orjson
from aiohttp import web
from aiohttp.web_urldispatcher import AbstractRoute

from controlplane import __version__
from controlplane.api import all_endpoints
from controlplane.api.common import (
    SERVICES,
    EmptyTrust,
    Endpoint,
    Services,
    TrustSource,
    error_middleware,
    error_response,
    json_response,
    services,
)
from controlplane.api.schemas import Health
from controlplane.auth import PasswordHasher, Role, auth_middleware
from controlplane.broker.base import BrokerAdminError, BrokerProvisioner, Credentials
from controlplane.db import Database, DatabaseError, current_revision, head_revision, upgrade_head
from controlplane.db import devices as device_q
from controlplane.metrics import CONTENT_TYPE, ControlPlaneMetrics
from controlplane.openapi import build_openapi
from controlplane.settings import Settings
from shared.protocol.command import ErrorCode

log = logging.getLogger("mcp.controlplane")

Clock = Callable[[], datetime]
OPENAPI = web.AppKey("openapi", bytes)


def system_clock() -> datetime:
    """Now, as an aware UTC datetime."""
    return datetime.now(timezone.utc)


class UnconfiguredProvisioner:
    """Stands in until a broker is configured: every enrollment that would need credentials is
    answered 503 with this explanation, instead of handing out credentials that cannot work."""

    @staticmethod
    def _refusal() -> BrokerAdminError:
        return BrokerAdminError(
            "no broker provisioner is configured on this control plane; devices can be "
            "preauthorized and approved, but not given MQTT credentials yet"
        )

    async def provision_device(self, device_id: str) -> Credentials:
        raise self._refusal()

    async def provision_service(self, name: str) -> Credentials:
        raise self._refusal()

    async def provision_app_client(self, client_id: str) -> Credentials:
        raise self._refusal()

    async def disable_device(self, device_id: str) -> None:
        log.warning("no broker provisioner: device %s is revoked in the database only", device_id)

    async def enable_device(self, device_id: str) -> None:
        return None

    async def delete_device(self, device_id: str) -> None:
        return None


async def healthz(request: web.Request) -> web.Response:
    return json_response(Health(status="ok", version=__version__))


async def readyz(request: web.Request) -> web.Response:
    """Ready when the database answers and its schema is at the newest migration."""
    db = services(request).db
    try:
        await db.ping()
        revision = await current_revision(db)
    except DatabaseError as e:
        return error_response(ErrorCode.UNAVAILABLE, f"database not ready: {e}")
    if revision != head_revision():
        return error_response(
            ErrorCode.UNAVAILABLE,
            f"database schema is at {revision or 'nothing'}, expected {head_revision()}; "
            "run mcp-controlplane init or restart serve to migrate",
        )
    return json_response(
        Health(status="ready", version=__version__, database=db.url.get_backend_name(),
               schema_revision=revision)
    )


async def metrics_endpoint(request: web.Request) -> web.Response:
    svc = services(request)
    try:
        async with svc.db.read() as tx:
            by_status = await device_q.count_by_status(tx)
            online = await device_q.count_online(tx)
        svc.metrics.set_device_counts(by_status, online)
    except DatabaseError as e:
        log.warning("metrics: device counts unavailable: %s", e)
    return web.Response(body=svc.metrics.exposition(), headers={"Content-Type": CONTENT_TYPE})


async def openapi_document(request: web.Request) -> web.Response:
    return web.Response(body=request.app[OPENAPI], content_type="application/json")


def _infrastructure() -> list[Endpoint]:
    return [
        Endpoint("GET", "/healthz", healthz, "Liveness", None, "operations", response=Health),
        Endpoint("GET", "/readyz", readyz, "Readiness (database reachable and migrated)", None,
                 "operations", response=Health),
        Endpoint("GET", "/metrics", metrics_endpoint, "Prometheus metrics", None, "operations"),
        Endpoint("GET", "/api/v1/openapi.json", openapi_document, "This API's OpenAPI document",
                 None, "operations"),
    ]


def create_app(
    settings: Settings,
    provisioner: BrokerProvisioner,
    clock: Clock = system_clock,
    *,
    trust: TrustSource | None = None,
    metrics: ControlPlaneMetrics | None = None,
) -> web.Application:
    """Build the application. Nothing touches the database until startup.

    Raises :class:`controlplane.db.DatabaseConfigError` for an unusable database URL.
    """
    db = Database(settings.effective_database_url)
    metrics = metrics or ControlPlaneMetrics()
    route_roles: dict[AbstractRoute, Role | None] = {}
    app = web.Application(
        client_max_size=settings.max_body_bytes,
        middlewares=[error_middleware(metrics), auth_middleware(db, clock, route_roles)],
    )
    app[SERVICES] = Services(
        settings=settings, db=db, provisioner=provisioner, clock=clock,
        hasher=PasswordHasher(settings.password_cost), trust=trust or EmptyTrust(),
        metrics=metrics,
    )
    endpoints = [*all_endpoints(), *_infrastructure()]
    for ep in endpoints:
        route = app.router.add_route(ep.method, ep.path, ep.handler)
        route_roles[route] = ep.role
    app[OPENAPI] = orjson.dumps(build_openapi(endpoints, version=__version__))

    async def migrate(app: web.Application) -> None:
        if settings.migrate_on_start:
            revision = await upgrade_head(db)
            log.info("database %s at revision %s", db.display_url, revision)

    async def dispose(app: web.Application) -> None:
        await db.dispose()

    app.on_startup.append(migrate)
    app.on_cleanup.append(dispose)
    return app


async def serve(
    settings: Settings,
    provisioner: BrokerProvisioner,
    *,
    clock: Clock = system_clock,
    on_ready: Callable[[str], Awaitable[None] | None] | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Run the app on ``settings.host:settings.port`` until SIGINT/SIGTERM or ``stop`` is set.

    ``on_ready`` receives the base URL once the socket listens (port 0 picks a free port).
    """
    app = create_app(settings, provisioner, clock)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):  # not main thread / Windows
            loop.add_signal_handler(sig, stop.set)
    try:
        site = web.TCPSite(runner, settings.host, settings.port)
        await site.start()
        addresses = runner.addresses
        port = addresses[0][1] if addresses else settings.port
        host = settings.host if ":" not in settings.host else f"[{settings.host}]"
        url = f"http://{host}:{port}"
        if on_ready is not None:
            result = on_ready(url)
            if result is not None:
                await result
        await stop.wait()
    finally:
        await runner.cleanup()
