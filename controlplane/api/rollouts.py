"""Staged rollouts (docs/rollouts.md): create, read, and command them.

    POST /api/v1/rollouts                          operator: start a rollout
    GET  /api/v1/rollouts                          viewer: newest first, ?model=&status=
    GET  /api/v1/rollouts/{rollout_id}             viewer: status, stages, gates, devices/phase
    GET  /api/v1/rollouts/{rollout_id}/devices     viewer: where each device stands, ?phase=
    GET  /api/v1/rollouts/{rollout_id}/events      viewer: the history, ?after_id=
    POST /api/v1/rollouts/{rollout_id}/pause       operator (and resume, abort, promote,
                                                   approve, rollback)

The :class:`~controlplane.rollouts.service.RolloutService` lives in ``app[ROLLOUTS]``. The
request schema below documents the spec; :func:`controlplane.rollouts.spec.parse_spec` is what
validates it (bounds, sizes that add up, thresholds a gate can reach), so the REST API, the CLI's
``--file`` and the TOML form share one set of rules.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from aiohttp import web
from pydantic import Field, StringConstraints

from mcp_edge.controlplane.api.common import (
    ApiError,
    Endpoint,
    json_response,
    path_int,
    read_body,
    read_query,
)
from mcp_edge.controlplane.api.schemas import ReasonBody, Request, Response, RowId
from mcp_edge.controlplane.auth import Role, principal_of
from mcp_edge.controlplane.db import rollouts as q
from mcp_edge.controlplane.deployments import (
    DeploymentConflictError,
    DeploymentError,
    UnknownDeviceError,
    UnknownVersionError,
)
from mcp_edge.controlplane.rollouts import spec as spec_rules
from mcp_edge.controlplane.rollouts.service import (
    RolloutConflictError,
    RolloutDetail,
    RolloutError,
    RolloutNotFoundError,
    RolloutService,
)
from mcp_edge.controlplane.rollouts.spec import SpecError
from mcp_edge.shared.protocol.base import Identifier, Labels
from mcp_edge.shared.protocol.command import ErrorCode
from mcp_edge.shared.version import MAX_VERSION_LENGTH, SEMVER_PATTERN

ROLLOUTS = web.AppKey("rollouts", RolloutService)
Metric = Literal["install_failure_rate", "error_rate", "latency_p95_ratio", "agreement", "drift"]
STATUSES = (
    "running", "awaiting_approval", "paused", "rolling_back", "succeeded", "rolled_back",
    "aborted",
)  # fmt: skip


# ---------------------------------------------------------------------------- schemas
Semver = Annotated[
    str,
    StringConstraints(pattern=SEMVER_PATTERN, max_length=MAX_VERSION_LENGTH),
]


class TargetIn(Request):
    """Which devices; every criterion given must hold (at least one must be given)."""

    devices: Annotated[
        list[Identifier], Field(max_length=spec_rules.MAX_DEVICES, default_factory=list)
    ]
    group: Identifier | None = None
    labels: Labels | None = None
    profiles: Annotated[
        list[Identifier], Field(max_length=spec_rules.MAX_PROFILES, default_factory=list)
    ]


class GateIn(Request):
    metric: Metric
    threshold: float = Field(
        description="a ceiling (rates 0..1, latency ratio up to 100, drift) or, for "
        "agreement, a floor; one that can never fail is refused"
    )
    min_devices: int = Field(
        default=1, ge=1, le=spec_rules.MAX_MIN_DEVICES, description="valid reports to judge"
    )
    min_requests: int = Field(
        default=100, ge=0, le=spec_rules.MAX_MIN_REQUESTS, description="requests to judge"
    )
    on_fail: Literal["rollback", "pause"] = "rollback"
    dry_run: bool = Field(default=False, description="evaluated and shown, never acting")


class StageIn(Request):
    """Exactly one of ``count`` and ``percent``."""

    count: int | None = Field(
        default=None, ge=1, le=spec_rules.MAX_STAGE_COUNT, description="devices in this stage"
    )
    percent: float | None = Field(
        default=None, gt=0, le=100, description="share of the target, 0..100"
    )
    mode: Literal["switch", "canary", "shadow"] = "switch"
    weight: float = Field(
        default=0.1, gt=0, lt=1, description="canary share of routed requests (canary only)"
    )
    bake_s: float = Field(
        default=300.0,
        ge=0,
        le=spec_rules.MAX_BAKE_S,
        description="seconds settled before the gates decide",
    )
    prefetch: bool = Field(default=False, description="download and verify first, then switch")
    approval: bool = Field(default=False, description="a human approves before it starts")
    gates: Annotated[list[GateIn], Field(max_length=spec_rules.MAX_GATES, default_factory=list)]


class RateIn(Request):
    per_minute: float | None = Field(
        default=None,
        gt=0,
        le=spec_rules.MAX_PER_MINUTE,
        description="devices told per minute; null: no limit",
    )
    growth: float = Field(
        default=1.0, ge=1, le=spec_rules.MAX_GROWTH, description="the limit's factor per stage"
    )


class RolloutCreate(Request):
    """A rollout of ``version`` over ``target`` in ``stages``. Rules beyond this schema
    (docs/rollouts.md): the stage sizes add up to the target, one gate per metric and stage,
    agreement gates in shadow stages only, a weight on canary stages only."""

    model: Identifier
    version: Semver
    target: TargetIn
    stages: Annotated[list[StageIn], Field(min_length=1, max_length=spec_rules.MAX_STAGES)]
    rate: RateIn = RateIn()
    device_timeout_s: float = Field(
        default=600.0,
        ge=spec_rules.MIN_DEVICE_TIMEOUT_S,
        le=spec_rules.MAX_DEVICE_TIMEOUT_S,
        description="a device not settled by then is skipped",
    )


class GateOut(Response):
    metric: str
    verdict: str = Field(description="pass, fail, pending or inconclusive")
    value: float | None
    threshold: float
    devices: int
    requests: int
    dry_run: bool
    reason: str


class RolloutOut(Response):
    id: int
    model: str
    version: str
    status: str
    stage: int = Field(description="index of the current stage (0-based)")
    stages: int
    target_devices: int
    reason: str
    devices: dict[str, int] = Field(description="devices per phase")
    gates: list[GateOut]
    bake_started_at: datetime | None
    created_by: str
    created_at: datetime
    updated_at: datetime
    ended_at: datetime | None
    spec: dict[str, Any]


class RolloutResult(Response):
    rollout: RolloutOut


class RolloutList(Response):
    items: list[RolloutOut]


class RolloutQuery(Request):
    limit: Annotated[int, Field(ge=1, le=1000)] = 100
    before_id: RowId | None = None
    model: Identifier | None = None
    status: Literal[
        "running", "awaiting_approval", "paused", "rolling_back", "succeeded", "rolled_back",
        "aborted", "active",
    ] | None = Field(default=None, description="one status, or active: not ended")  # fmt: skip


class RolloutDeviceOut(Response):
    device_id: str
    stage: int
    phase: str
    since: datetime
    told_at: datetime | None
    from_version: str | None
    mode: str | None
    moves: int


class RolloutDeviceList(Response):
    items: list[RolloutDeviceOut]
    total: int


class DeviceQuery(Request):
    limit: Annotated[int, Field(ge=1, le=10_000)] = 1000
    offset: Annotated[int, Field(ge=0, le=1_000_000)] = 0
    phase: (
        Literal[
            "waiting", "prefetching", "prefetched", "moving", "active", "failed", "skipped",
            "reverting", "reverted",
        ]
        | None
    ) = None  # fmt: skip


class RolloutEventOut(Response):
    id: int
    at: datetime
    kind: str
    stage: int | None
    actor: str
    reason: str
    detail: dict[str, Any]


class RolloutEventList(Response):
    items: list[RolloutEventOut]


class EventQuery(Request):
    after_id: Annotated[int, Field(ge=0)] = 0
    limit: Annotated[int, Field(ge=1, le=1000)] = 200


# ---------------------------------------------------------------------------- handlers
def rollout_service(request: web.Request) -> RolloutService:
    """The app's rollout service; ApiError (503) when this control plane runs none."""
    service = request.app.get(ROLLOUTS)
    if service is None:
        raise ApiError(ErrorCode.UNAVAILABLE, "rollouts are not set up on this control plane")
    return service


def _translate(e: RolloutError | DeploymentError | SpecError) -> ApiError:
    if isinstance(e, (RolloutNotFoundError, UnknownVersionError, UnknownDeviceError)):
        return ApiError(ErrorCode.NOT_FOUND, str(e))
    if isinstance(e, (RolloutConflictError, DeploymentConflictError)):
        return ApiError(ErrorCode.CONFLICT, str(e))
    return ApiError(ErrorCode.BAD_REQUEST, str(e))


def rollout_out(d: RolloutDetail) -> RolloutOut:
    r, state = d.rollout, d.state
    return RolloutOut(
        id=r.id,
        model=r.model,
        version=r.version,
        status=r.status,
        stage=r.stage,
        stages=len(d.spec.stages),
        target_devices=r.target_devices,
        reason=state.reason,
        devices=d.phases,
        gates=[
            GateOut(
                metric=g.metric.value,
                verdict=g.verdict,
                value=g.value,
                threshold=g.threshold,
                devices=g.devices,
                requests=g.requests,
                dry_run=g.dry_run,
                reason=g.reason,
            )
            for g in state.gates
        ],
        bake_started_at=(
            datetime.fromtimestamp(state.bake_started_at, r.created_at.tzinfo)
            if state.bake_started_at is not None
            else None
        ),
        created_by=r.created_by,
        created_at=r.created_at,
        updated_at=r.updated_at,
        ended_at=r.ended_at,
        spec=r.spec,
    )


async def start_rollout(
    service: RolloutService, body: RolloutCreate, *, actor: str
) -> RolloutDetail:
    """Create the rollout ``body`` asks for, as ``actor`` (``POST /api/v1/rollouts`` and the
    console's form both call this). Raises :class:`ApiError`: 400 a bad spec, 404 no such
    model, version or device, 409 a conflict with the fleet or another rollout."""
    try:
        return await service.create(
            body.model_dump(exclude_unset=True, exclude_none=True), actor=actor
        )
    except (RolloutError, DeploymentError, SpecError) as e:
        raise _translate(e) from e


async def command_rollout(
    service: RolloutService, rollout_id: int, op: str, *, actor: str, reason: str = ""
) -> RolloutDetail:
    """Carry out the operator command ``op`` (pause, resume, abort, promote, approve,
    rollback) as ``actor``: what ``POST /api/v1/rollouts/{id}/{op}`` and the console's buttons
    do. Raises :class:`ApiError`: 404 no such rollout, 409 not in this status."""
    try:
        return await service.command(rollout_id, op, actor=actor, reason=reason)
    except RolloutError as e:
        raise _translate(e) from e


async def create_rollout(request: web.Request) -> web.Response:
    service, who = rollout_service(request), principal_of(request)
    body = await read_body(request, RolloutCreate)
    detail = await start_rollout(service, body, actor=who.actor)
    return json_response(RolloutResult(rollout=rollout_out(detail)), 201)


async def list_rollouts(request: web.Request) -> web.Response:
    query = read_query(request, RolloutQuery)
    statuses: list[str] | None = None
    if query.status == "active":
        statuses = list(q.ACTIVE_STATUSES)
    elif query.status is not None:
        statuses = [query.status]
    details = await rollout_service(request).list_rollouts(
        limit=query.limit, before_id=query.before_id, model=query.model, statuses=statuses
    )
    return json_response(RolloutList(items=[rollout_out(d) for d in details]))


async def get_rollout(request: web.Request) -> web.Response:
    try:
        detail = await rollout_service(request).get(path_int(request, "rollout_id"))
    except RolloutError as e:
        raise _translate(e) from e
    return json_response(RolloutResult(rollout=rollout_out(detail)))


async def _existing(request: web.Request) -> tuple[RolloutService, int]:
    service, rollout_id = rollout_service(request), path_int(request, "rollout_id")
    async with service.db.read() as tx:
        if await q.get_rollout(tx, rollout_id) is None:
            raise ApiError(ErrorCode.NOT_FOUND, f"no rollout {rollout_id}")
    return service, rollout_id


async def rollout_devices(request: web.Request) -> web.Response:
    query = read_query(request, DeviceQuery)
    service, rollout_id = await _existing(request)
    async with service.db.read() as tx:
        rows, total = await q.page_devices(
            tx, rollout_id, limit=query.limit, offset=query.offset, phase=query.phase
        )
    return json_response(
        RolloutDeviceList(items=[RolloutDeviceOut.model_validate(r) for r in rows], total=total)
    )


async def rollout_events(request: web.Request) -> web.Response:
    query = read_query(request, EventQuery)
    service, rollout_id = await _existing(request)
    async with service.db.read() as tx:
        rows = await q.list_events(tx, rollout_id, after_id=query.after_id, limit=query.limit)
    return json_response(RolloutEventList(items=[RolloutEventOut.model_validate(r) for r in rows]))


def _commander(op: str) -> Any:
    async def handler(request: web.Request) -> web.Response:
        service, who = rollout_service(request), principal_of(request)
        rollout_id = path_int(request, "rollout_id")
        body = await read_body(request, ReasonBody)
        detail = await command_rollout(service, rollout_id, op, actor=who.actor, reason=body.reason)
        return json_response(RolloutResult(rollout=rollout_out(detail)))

    handler.__name__ = f"{op}_rollout"
    return handler


_COMMANDS = {
    "pause": "Pause a rollout: no device is moved until it resumes",
    "resume": "Resume a paused rollout (the current stage's bake starts again)",
    "abort": "Stop a rollout for good; devices stay where they are",
    "promote": "Count the current stage as passed now (skips its bake and gates)",
    "approve": "Approve the stage waiting for a human",
    "rollback": "Put every device the rollout touched back on its previous version",
}

ENDPOINTS = [
    Endpoint(
        "POST",
        "/api/v1/rollouts",
        create_rollout,
        "Start a staged rollout of a model version, gated on what the devices measure",
        Role.OPERATOR,
        "rollouts",
        body=RolloutCreate,
        response=RolloutResult,
        status=201,
        answers={
            404: "no such model version, or a listed device does not exist",
            409: "another rollout of the model holds some of the devices, the target "
            "matches no accepted device that fits, a listed device is not accepted, or "
            "the version is below what devices run",
        },
    ),
    Endpoint(
        "GET",
        "/api/v1/rollouts",
        list_rollouts,
        "Rollouts, newest first",
        Role.VIEWER,
        "rollouts",
        query=RolloutQuery,
        response=RolloutList,
    ),
    Endpoint(
        "GET",
        "/api/v1/rollouts/{rollout_id}",
        get_rollout,
        "A rollout: status, current stage, gate values and devices per phase",
        Role.VIEWER,
        "rollouts",
        response=RolloutResult,
    ),
    Endpoint(
        "GET",
        "/api/v1/rollouts/{rollout_id}/devices",
        rollout_devices,
        "Where each device of a rollout stands",
        Role.VIEWER,
        "rollouts",
        query=DeviceQuery,
        response=RolloutDeviceList,
    ),
    Endpoint(
        "GET",
        "/api/v1/rollouts/{rollout_id}/events",
        rollout_events,
        "A rollout's history: every decision and operator action, oldest first",
        Role.VIEWER,
        "rollouts",
        query=EventQuery,
        response=RolloutEventList,
    ),
    *(
        Endpoint(
            "POST",
            f"/api/v1/rollouts/{{rollout_id}}/{op}",
            _commander(op),
            summary,
            Role.OPERATOR,
            "rollouts",
            body=ReasonBody,
            response=RolloutResult,
            answers={409: "the command does not apply in the rollout's status"},
        )
        for op, summary in _COMMANDS.items()
    ),
]
