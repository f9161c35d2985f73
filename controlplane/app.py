"""The control plane's aiohttp application: :func:`create_app` and :func:`serve`.

Routes outside the REST table::

    GET /healthz                 the process is up (no I/O)
    GET /readyz                  the database answers and its schema is at the newest revision
    GET /metrics                 Prometheus exposition
    GET /api/v1/openapi.json     the OpenAPI 3.1 document of everything under /api/v1
    GET /repo/metadata/{file}    TUF metadata, public (:mod:`controlplane.repository.http`)
    GET /repo/targets/{path}     TUF targets (signed bundles), public, Range requests
    POST /broker/v1/...          brokers' authentication and ACL questions, shared secret
                                 (only with an HttpAuthProvisioner: controlplane.broker.http_hooks)

Telemetry read routes (viewer), next to the REST table of :mod:`controlplane.api`::

    GET /api/v1/devices/{device_id}/health?limit=N        newest N health samples, oldest first
    GET /api/v1/devices/{device_id}/events?after_seq=S&limit=N   deployment events by event_seq

Everything is passed in: settings, the broker provisioner (the dynamic-security one in
production; tests pass a fake implementing :class:`BrokerProvisioner`), the clock, the trust
source. The app owns one :class:`~controlplane.db.Database` (one AsyncEngine), migrates it to
the newest revision on startup (``settings.migrate_on_start``) and disposes of it on cleanup.
Given an :class:`~controlplane.ingest.IngestConnection`, it also runs telemetry ingestion
(:mod:`controlplane.ingest`) from startup to cleanup, and serves ``{data_dir}/repository`` to
devices over MQTT (:mod:`controlplane.repository.mqtt_service`) in a second session, under the
service account ``{ingest client id}-repo`` it provisions at startup (an account's client id is
bound to it, so each session needs its own). Deployments (:mod:`controlplane.deployments`)
sign and store desired states always, and publish them through a third session,
``{ingest client id}-desired``, when a broker is configured.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta, timezone
from typing import Annotated, Any

import orjson
from aiohttp import web
from aiohttp.web_urldispatcher import AbstractRoute
from pydantic import Field

from mcp_edge.controlplane import __version__
from mcp_edge.controlplane.api import all_endpoints
from mcp_edge.controlplane.api.common import (
    SERVICES,
    ApiError,
    Endpoint,
    Services,
    error_middleware,
    error_response,
    json_response,
    read_query,
    services,
)
from mcp_edge.controlplane.api.deployments import attach_deployments
from mcp_edge.controlplane.api.drift import DRIFT_ADMIN
from mcp_edge.controlplane.api.enroll import ENROLLMENT
from mcp_edge.controlplane.api.hard_examples import attach_hard_examples
from mcp_edge.controlplane.api.rollouts import ROLLOUTS
from mcp_edge.controlplane.api.schemas import Health, Request, Response
from mcp_edge.controlplane.auth import PasswordHasher, Role, auth_middleware
from mcp_edge.controlplane.broker.base import BrokerAdminError, BrokerProvisioner, Credentials
from mcp_edge.controlplane.broker.http_auth import HttpAuthProvisioner
from mcp_edge.controlplane.broker.http_hooks import attach_broker_hooks
from mcp_edge.controlplane.db import (
    Database,
    DatabaseError,
    current_revision,
    head_revision,
    upgrade_head,
)
from mcp_edge.controlplane.db import devices as device_q
from mcp_edge.controlplane.db import telemetry as telemetry_q
from mcp_edge.controlplane.deployments import DeploymentService
from mcp_edge.controlplane.drift.admin import DriftAdmin
from mcp_edge.controlplane.drift.service import DriftService
from mcp_edge.controlplane.enrollment_service import EnrollmentService, TrustSource
from mcp_edge.controlplane.httplog import server_logging
from mcp_edge.controlplane.ingest import IngestConnection, IngestService
from mcp_edge.controlplane.metrics import CONTENT_TYPE, ControlPlaneMetrics
from mcp_edge.controlplane.mqtt import MqttSubscriber
from mcp_edge.controlplane.openapi import build_openapi
from mcp_edge.controlplane.repository.http import ENDPOINTS as REPO_ENDPOINTS
from mcp_edge.controlplane.repository.http import attach_repository
from mcp_edge.controlplane.repository.mqtt_service import (
    RepoConnection,
    RepoMqttService,
    repo_account_name,
)
from mcp_edge.controlplane.repository.service import RepositoryService
from mcp_edge.controlplane.rollouts.service import RolloutService
from mcp_edge.controlplane.settings import Settings
from mcp_edge.controlplane.ui import attach_ui
from mcp_edge.controlplane.webhooks import WebhookDispatcher, load_webhooks
from mcp_edge.shared.protocol.command import ErrorCode

log = logging.getLogger("mcp.controlplane")

Clock = Callable[[], datetime]
OPENAPI = web.AppKey("openapi", bytes)
INGEST = web.AppKey("ingest", IngestService)
REPO_MQTT = web.AppKey("repo_mqtt", RepoMqttService)
BROKER_SESSIONS = web.AppKey("broker_sessions", list[MqttSubscriber])
"""The control plane's own broker sessions (ingest, repository, desired), once started."""
WEBHOOKS = web.AppKey("webhooks", WebhookDispatcher)
DRIFT = web.AppKey("drift", DriftService)
"""The drift store: ingestion's drift reports, aggregates, rules, retraining triggers (its
``on_trigger`` list takes callbacks run after a trigger commits)."""


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
            "preauthorized and approved, but neither devices nor applications can be given "
            "MQTT credentials yet"
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

    async def disable_app_client(self, client_id: str) -> None:
        log.warning(
            "no broker provisioner: app client %s is revoked in the database only", client_id
        )

    async def delete_app_client(self, client_id: str) -> None:
        return None


async def healthz(request: web.Request) -> web.Response:
    return json_response(Health(status="ok", version=__version__))


async def readyz(request: web.Request) -> web.Response:
    """Ready when the database answers, its schema is at the newest migration, and every
    broker session is logged in (a refused login or a lost broker makes it 503)."""
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
    down = [s for s in request.app.get(BROKER_SESSIONS, []) if not s.up]
    if down:
        return error_response(
            ErrorCode.UNAVAILABLE,
            "; ".join(f"broker session {s.name}: {s.problem}" for s in down),
        )
    return json_response(
        Health(
            status="ready",
            version=__version__,
            database=db.url.get_backend_name(),
            schema_revision=revision,
        )
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
    for session in request.app.get(BROKER_SESSIONS, []):
        svc.metrics.broker_session_up.labels(session.name).set(1 if session.up else 0)
    return web.Response(body=svc.metrics.exposition(), headers={"Content-Type": CONTENT_TYPE})


async def openapi_document(request: web.Request) -> web.Response:
    return web.Response(body=request.app[OPENAPI], content_type="application/json")


class HealthQuery(Request):
    limit: Annotated[int, Field(ge=1, le=10_000)] = 100


class HealthOut(Response):
    """One stored health sample (``ts`` is the device's clock)."""

    ts: datetime
    cpu_percent: float
    load_1m: float | None
    mem_used_mb: float
    mem_total_mb: float
    disk_free_mb: float | None
    disk_total_mb: float | None
    process_rss_mb: float | None
    uptime_s: float | None
    temperatures_c: dict[str, float]
    gpu: dict[str, Any] | None


class HealthList(Response):
    items: list[HealthOut]


class EventsQuery(Request):
    after_seq: Annotated[int, Field(ge=-1)] = -1
    limit: Annotated[int, Field(ge=1, le=10_000)] = 1000


class EventOut(Response):
    """One deployment event, as the device reported it."""

    event_seq: int
    ts: datetime
    received_at: datetime
    model: str
    version: str
    phase: str
    outcome: str
    message: str
    cause: str | None
    bytes_done: int | None
    bytes_total: int | None
    elapsed_ms: float | None


class EventList(Response):
    items: list[EventOut]


async def _existing_device(request: web.Request) -> str:
    device_id = request.match_info["device_id"]
    async with services(request).db.read() as tx:
        if await device_q.get_device(tx, device_id) is None:
            raise ApiError(ErrorCode.NOT_FOUND, f"no device {device_id!r}")
    return device_id


async def device_health(request: web.Request) -> web.Response:
    query = read_query(request, HealthQuery)
    device_id = await _existing_device(request)
    async with services(request).db.read() as tx:
        rows = await telemetry_q.recent_health(tx, device_id, query.limit)
    return json_response(HealthList(items=[HealthOut.model_validate(r) for r in rows]))


async def device_events(request: web.Request) -> web.Response:
    query = read_query(request, EventsQuery)
    device_id = await _existing_device(request)
    async with services(request).db.read() as tx:
        rows = await telemetry_q.list_events(tx, device_id, query.after_seq, query.limit)
    return json_response(EventList(items=[EventOut.model_validate(r) for r in rows]))


def _telemetry_endpoints() -> list[Endpoint]:
    return [
        Endpoint(
            "GET",
            "/api/v1/devices/{device_id}/health",
            device_health,
            "Recent health samples of a device, oldest first",
            Role.VIEWER,
            "telemetry",
            query=HealthQuery,
            response=HealthList,
        ),
        Endpoint(
            "GET",
            "/api/v1/devices/{device_id}/events",
            device_events,
            "Deployment events of a device, by event_seq",
            Role.VIEWER,
            "telemetry",
            query=EventsQuery,
            response=EventList,
        ),
    ]


def _infrastructure() -> list[Endpoint]:
    return [
        Endpoint("GET", "/healthz", healthz, "Liveness", None, "operations", response=Health),
        Endpoint(
            "GET",
            "/readyz",
            readyz,
            "Readiness (database reachable and migrated)",
            None,
            "operations",
            response=Health,
            answers={
                503: "not ready: the database is unreachable or not migrated, or a "
                "broker session is not logged in"
            },
        ),
        Endpoint(
            "GET",
            "/metrics",
            metrics_endpoint,
            "Prometheus metrics",
            None,
            "operations",
            media_type="text/plain",
        ),
        Endpoint(
            "GET",
            "/api/v1/openapi.json",
            openapi_document,
            "This API's OpenAPI document",
            None,
            "operations",
            media_type="application/json",
        ),
    ]


def create_app(
    settings: Settings,
    provisioner: BrokerProvisioner,
    clock: Clock = system_clock,
    *,
    trust: TrustSource | None = None,
    metrics: ControlPlaneMetrics | None = None,
    ingest: IngestConnection | None = None,
    database: Database | None = None,
) -> web.Application:
    """Build the application. Nothing touches the database until startup.

    With ``ingest``, startup subscribes to device telemetry at the broker (after migrating) and
    cleanup stops it, committing what is buffered; :data:`INGEST` holds the service.
    ``database``: the one to use (its owner disposes of it) instead of one of the app's own.
    With an :class:`HttpAuthProvisioner`, the brokers' endpoints are served under
    ``/broker/v1/`` (:mod:`controlplane.broker.http_hooks`), to callers presenting
    ``settings.broker_auth_secret()`` (read now: a missing secret stops the start).

    Raises :class:`controlplane.db.DatabaseConfigError` for an unusable database URL.
    """
    db = database if database is not None else Database(settings.effective_database_url)
    metrics = metrics or ControlPlaneMetrics()
    route_roles: dict[AbstractRoute, Role | None] = {}
    app = web.Application(
        client_max_size=settings.max_body_bytes,
        middlewares=[error_middleware(metrics), auth_middleware(db, clock, route_roles)],
    )
    repository = RepositoryService(settings, db, clock)
    trust = trust or repository
    app[SERVICES] = Services(
        settings=settings,
        db=db,
        provisioner=provisioner,
        clock=clock,
        hasher=PasswordHasher(settings.password_cost),
        trust=trust,
        metrics=metrics,
    )
    endpoints = [*all_endpoints(), *_telemetry_endpoints(), *_infrastructure()]
    for ep in endpoints:
        route = app.router.add_route(ep.method, ep.path, ep.handler)
        route_roles[route] = ep.role
    attach_ui(app)  # the console (/ui/...), after the API routes it shares the port with
    if isinstance(provisioner, HttpAuthProvisioner):
        attach_broker_hooks(app, provisioner, settings.broker_auth_secret())
    sessions = app[BROKER_SESSIONS] = []
    app[OPENAPI] = orjson.dumps(build_openapi([*endpoints, *REPO_ENDPOINTS], version=__version__))

    async def migrate(app: web.Application) -> None:
        if settings.migrate_on_start:
            revision = await upgrade_head(db)
            log.info("database %s at revision %s", db.display_url, revision)

    async def dispose(app: web.Application) -> None:
        if database is None:
            await db.dispose()

    app.on_startup.append(migrate)
    attach_repository(app, repository)  # after migrate: it reads publisher keys
    # Reads the webhook secrets now, so a missing or unreadable one stops serve before it starts.
    webhooks = app[WEBHOOKS] = WebhookDispatcher(
        db, load_webhooks(settings.webhooks), clock, metrics=metrics
    )
    # ---- drift (docs/drift.md): ingestion hands it the reports; triggers go to the webhooks.
    drift = app[DRIFT] = DriftService(
        db, clock, metrics=metrics, notify=webhooks.notify,
        max_reports_per_minute=settings.drift_max_reports_per_minute,
    )  # fmt: skip
    app[DRIFT_ADMIN] = DriftAdmin(db, clock)
    if ingest is not None:
        service = app[INGEST] = IngestService(
            db,
            metrics,
            clock,
            retention=timedelta(days=settings.telemetry_retention_days),
            drift=drift,
            drift_retention=timedelta(hours=settings.drift_report_retention_hours),
        )

        async def start_ingest(app: web.Application) -> None:
            await service.start(ingest)
            if service.session is not None:
                sessions.append(service.session)

        async def stop_ingest(app: web.Application) -> None:
            await service.stop()

        app.on_startup.append(start_ingest)
        app.on_cleanup.append(stop_ingest)
        repo = app[REPO_MQTT] = RepoMqttService(repository.repo.dir, metrics)
        broker = ingest

        async def start_repo(app: web.Application) -> None:
            name = repo_account_name(broker.credentials.client_id)
            credentials = await provisioner.provision_service(name)
            await repo.start(RepoConnection(broker.address, credentials))
            if repo.session is not None:
                sessions.append(repo.session)

        async def stop_repo(app: web.Application) -> None:
            await repo.stop()

        app.on_startup.append(start_repo)
        app.on_cleanup.append(stop_repo)
    else:
        log.info("no broker configured: telemetry ingestion is off")
    from mcp_edge.shared.tracing import setup_tracing

    tracing = setup_tracing("mcp-controlplane", settings.otlp_endpoint)
    deployments = DeploymentService(
        db, repository.repo.keys, None, clock, settings, tracing=tracing
    )
    if tracing is not None:

        async def stop_tracing(app: web.Application) -> None:
            await asyncio.to_thread(tracing.shutdown)

        app.on_cleanup.append(stop_tracing)
    attach_deployments(app, deployments, broker=ingest, provisioner=provisioner, sessions=sessions)
    rollouts = app[ROLLOUTS] = RolloutService(
        db,
        deployments,
        clock,
        owner=ingest.credentials.client_id if ingest is not None else f"cp-{os.getpid()}",
        notify=webhooks.notify,
        registry=metrics.registry,
        lease_s=settings.rollout_lease_s,
    )

    async def start_rollouts(app: web.Application) -> None:
        await webhooks.start()
        await rollouts.start()

    async def stop_rollouts(app: web.Application) -> None:
        await rollouts.stop()
        await webhooks.stop()

    app.on_startup.append(start_rollouts)
    app.on_cleanup.append(stop_rollouts)
    # ---- hard examples (docs/hard-examples.md): devices are asked over a command session,
    # opened at startup when a broker is configured; the reading routes need only the database.
    hard_examples = attach_hard_examples(
        app, db, clock, broker=ingest, provisioner=provisioner, sessions=sessions,
        registry=metrics.registry,
    )  # fmt: skip
    drift.on_trigger.append(hard_examples.on_trigger)  # a rule with collect_hard_examples
    app[ENROLLMENT] = EnrollmentService(
        db, provisioner, trust, settings, clock, metrics, deployments=deployments
    )
    app.on_cleanup.append(dispose)
    return app


async def serve(
    settings: Settings,
    provisioner: BrokerProvisioner,
    *,
    clock: Clock = system_clock,
    on_ready: Callable[[str], Awaitable[None] | None] | None = None,
    stop: asyncio.Event | None = None,
    ingest: IngestConnection | None = None,
    database: Database | None = None,
) -> None:
    """Run the app on ``settings.host:settings.port`` until SIGINT/SIGTERM or ``stop`` is set.

    ``on_ready`` receives the base URL once the socket listens (port 0 picks a free port);
    ``ingest`` turns on telemetry ingestion and ``database`` replaces the app's own (see
    :func:`create_app`).
    """
    app = create_app(settings, provisioner, clock, ingest=ingest, database=database)
    runner = web.AppRunner(app, access_log=None, **server_logging())
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
