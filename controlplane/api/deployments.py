"""Deployments and desired state (DESIGN 4.2): who should run what, and the signed documents.

    POST   /api/v1/deployments                          operator: deploy a version to a selector
    POST   /api/v1/deployments/undeploy                 operator: remove a model from a selector
    GET    /api/v1/deployments                          viewer: newest first, ?model=&before_id=
    GET    /api/v1/devices/{device_id}/desired          viewer: the current signed document
    GET    /api/v1/devices/{device_id}/models           viewer: desired vs reported per model
    DELETE /api/v1/devices/{device_id}/models/{model}   operator: remove one model from a device

The :class:`~controlplane.deployments.DeploymentService` lives in ``app[DEPLOYMENTS]``;
:func:`attach_deployments` wires it (and its MQTT session, when a broker is configured) into
the app's startup and cleanup. Every change is audited in its own transaction.
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Annotated, Any

from aiohttp import web
from pydantic import ConfigDict, Field, model_validator

from mcp_edge.controlplane.api.common import (
    ApiError,
    Endpoint,
    json_response,
    read_body,
    read_query,
    services,
)
from mcp_edge.controlplane.api.schemas import Request, Response, RowId
from mcp_edge.controlplane.auth import Role, principal_of
from mcp_edge.controlplane.broker.base import BrokerProvisioner
from mcp_edge.controlplane.db import deployments as q
from mcp_edge.controlplane.db import devices as device_q
from mcp_edge.controlplane.deployments import (
    DeploymentConflictError,
    DeploymentError,
    DeploymentService,
    Outcome,
    Selector,
    UnknownDeviceError,
    UnknownVersionError,
)
from mcp_edge.controlplane.desired_reconcile import DesiredReconciler
from mcp_edge.controlplane.ingest import IngestConnection
from mcp_edge.controlplane.mqtt import MqttSubscriber
from mcp_edge.shared.protocol import topics
from mcp_edge.shared.protocol.base import Identifier, Labels, VersionText
from mcp_edge.shared.protocol.canary import DEFAULT_CANARY_POLICY, CanaryPolicy
from mcp_edge.shared.protocol.command import ErrorCode
from mcp_edge.shared.protocol.topics import Channel

log = logging.getLogger("mcp.controlplane.deployments")

DEPLOYMENTS = web.AppKey("deployments", DeploymentService)
NOT_PUBLISHED = (
    "stored and signed, not published: this control plane has no broker configured "
    "(mcp-controlplane init --broker-admin-url ...); it publishes them once one is"
)


# ---------------------------------------------------------------------------- schemas
class SelectorIn(Request):
    """Exactly one of: one device, a group, or labels that must all match."""

    # What _exactly_one checks, for the document: one field set (not null; labels not empty).
    model_config = ConfigDict(
        json_schema_extra={
            "oneOf": [
                {"required": ["device_id"], "properties": {"device_id": {"type": "string"}}},
                {"required": ["group"], "properties": {"group": {"type": "string"}}},
                {
                    "required": ["labels"],
                    "properties": {"labels": {"type": "object", "minProperties": 1}},
                },
            ]
        }
    )

    device_id: Identifier | None = None
    group: Identifier | None = None
    labels: Labels | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> SelectorIn:
        if len([x for x in (self.device_id, self.group, self.labels) if x]) != 1:
            raise ValueError("give exactly one of device_id, group, labels")
        return self

    def selector(self) -> Selector:
        return Selector(self.device_id, self.group, self.labels)


_CANARY = DEFAULT_CANARY_POLICY


class CanaryIn(Request):
    """A canary version and its policy; a field left out takes the policy's default. The
    window (the canary's latest requests judged) is the default for every device."""

    version: VersionText
    weight: Annotated[
        float,
        Field(
            ge=0.0,
            le=1.0,
            description="share of routed requests the canary answers, 0..1",
        ),
    ] = _CANARY.weight
    max_error_rate: Annotated[
        float,
        Field(
            ge=0.0,
            le=1.0,
            description="share of failed canary requests, over the device's window of the "
            f"canary's latest {_CANARY.window}, that takes the canary out of rotation, 0..1",
        ),
    ] = _CANARY.max_error_rate
    min_requests: Annotated[
        int,
        Field(
            ge=1,
            le=_CANARY.window,
            description="canary requests the device's window must hold before it judges the "
            "error rate",
        ),
    ] = _CANARY.min_requests

    def policy(self) -> CanaryPolicy:
        return CanaryPolicy(
            weight=self.weight, max_error_rate=self.max_error_rate, min_requests=self.min_requests
        )


class DeploymentCreate(Request):
    """Make ``version`` the stable version of ``model`` on the selected accepted devices.

    A canary or a shadow version, not both; either must differ from ``version``.
    """

    # A canary and a shadow together are refused (InvalidDeploymentError, 400).
    model_config = ConfigDict(
        json_schema_extra={
            "not": {
                "required": ["canary", "shadow"],
                "properties": {"canary": {"type": "object"}, "shadow": {"type": "string"}},
            }
        }
    )

    model: Identifier
    version: VersionText
    selector: SelectorIn
    canary: CanaryIn | None = None
    shadow: VersionText | None = None
    rollback: bool = Field(default=False, description="allow going below the current version")


class UndeployRequest(Request):
    model: Identifier
    selector: SelectorIn


class DeploymentOut(Response):
    id: int
    action: str = Field(description="deploy or undeploy")
    model: str
    version: str | None
    device_id: str | None
    group: str | None = Field(validation_alias="group_name")
    labels: dict[str, str] | None
    canary_version: str | None
    canary_weight: float | None
    canary_max_error_rate: float | None = Field(description="null: the default policy's")
    canary_min_requests: int | None = Field(description="null: the default policy's")
    shadow_version: str | None
    rollback: bool
    created_by: str
    created_at: datetime
    devices_matched: int


class IssuedOut(Response):
    device_id: str
    seq: int
    published: bool = Field(description="the broker took the retained document")


class DeploymentResult(Response):
    deployment: DeploymentOut
    devices: list[IssuedOut]
    skipped: dict[str, str] = Field(description="device id → why it was left out")
    message: str


class DeploymentList(Response):
    items: list[DeploymentOut]


class DeploymentQuery(Request):
    limit: Annotated[int, Field(ge=1, le=1000)] = 100
    before_id: RowId | None = None
    model: Identifier | None = None


class DesiredOut(Response):
    device_id: str
    seq: int
    issued_at: datetime
    expires_at: datetime
    published_at: datetime | None
    published: bool
    envelope: dict[str, Any] = Field(description="the director-signed document")


class DesiredModelOut(Response):
    stable_version: str
    canary_version: str | None
    canary_weight: float | None
    canary_max_error_rate: float | None = Field(description="null: the default policy's")
    canary_min_requests: int | None = Field(description="null: the default policy's")
    shadow_version: str | None
    rollback: bool
    deployment_id: int | None
    updated_at: datetime | None


class DeviceModelOut(Response):
    model: str
    desired: DesiredModelOut | None
    reported: dict[str, Any] | None = Field(description="the device's ModelStatus, as reported")
    in_sync: bool = Field(description="the device applied the newest document and runs stable")


class DeviceModels(Response):
    device_id: str
    desired_seq: int | None
    applied_seq: int | None
    reported_at: datetime | None
    items: list[DeviceModelOut]


# ---------------------------------------------------------------------------- handlers
def _service(request: web.Request) -> DeploymentService:
    service = request.app.get(DEPLOYMENTS)
    if service is None:
        raise ApiError(ErrorCode.UNAVAILABLE, "deployments are not set up on this control plane")
    return service


def _translate(e: DeploymentError) -> ApiError:
    if isinstance(e, (UnknownVersionError, UnknownDeviceError)):
        return ApiError(ErrorCode.NOT_FOUND, str(e))
    if isinstance(e, DeploymentConflictError):
        return ApiError(ErrorCode.CONFLICT, str(e))
    return ApiError(ErrorCode.BAD_REQUEST, str(e))


def _result(outcome: Outcome) -> DeploymentResult:
    issued = [
        IssuedOut(device_id=i.device_id, seq=i.seq, published=i.published) for i in outcome.issued
    ]
    if not outcome.publisher:
        message = f"{len(issued)} desired state(s) {NOT_PUBLISHED}"
    else:
        waiting = sum(1 for i in issued if not i.published)
        message = f"{len(issued) - waiting} desired state(s) published"
        if waiting:
            message += f"; {waiting} wait for the broker and go out when it answers"
    return DeploymentResult(
        deployment=DeploymentOut.model_validate(outcome.deployment),
        devices=issued,
        skipped=outcome.skipped,
        message=message,
    )


async def create_deployment(request: web.Request) -> web.Response:
    service, who = _service(request), principal_of(request)
    body = await read_body(request, DeploymentCreate)
    try:
        outcome = await service.deploy(
            body.model,
            body.version,
            body.selector.selector(),
            canary=(body.canary.version, body.canary.policy()) if body.canary else None,
            shadow=body.shadow,
            rollback=body.rollback,
            actor=who.actor,
        )
    except DeploymentError as e:
        raise _translate(e) from e
    return json_response(_result(outcome), 201)


async def undeploy(request: web.Request) -> web.Response:
    service, who = _service(request), principal_of(request)
    body = await read_body(request, UndeployRequest)
    try:
        outcome = await service.undeploy(body.model, body.selector.selector(), actor=who.actor)
    except DeploymentError as e:
        raise _translate(e) from e
    return json_response(_result(outcome))


async def remove_device_model(request: web.Request) -> web.Response:
    service, who = _service(request), principal_of(request)
    device_id, model = request.match_info["device_id"], request.match_info["model"]
    try:
        outcome = await service.undeploy(model, Selector(device_id=device_id), actor=who.actor)
    except DeploymentError as e:
        raise _translate(e) from e
    return json_response(_result(outcome))


async def list_deployments(request: web.Request) -> web.Response:
    query = read_query(request, DeploymentQuery)
    async with services(request).db.read() as tx:
        rows = await q.list_deployments(
            tx, limit=query.limit, before_id=query.before_id, model=query.model
        )
    return json_response(DeploymentList(items=[DeploymentOut.model_validate(r) for r in rows]))


async def _known_device(request: web.Request) -> str:
    device_id = request.match_info["device_id"]
    async with services(request).db.read() as tx:
        if await device_q.get_device(tx, device_id) is None:
            raise ApiError(ErrorCode.NOT_FOUND, f"no device {device_id!r}")
    return device_id


async def get_desired(request: web.Request) -> web.Response:
    device_id = await _known_device(request)
    async with services(request).db.read() as tx:
        doc = (await q.desired_states(tx, [device_id])).get(device_id)
    if doc is None:
        raise ApiError(
            ErrorCode.NOT_FOUND,
            f"device {device_id!r} has no desired state yet; deploy a model to it first",
        )
    return json_response(
        DesiredOut(
            device_id=device_id,
            seq=doc.seq,
            issued_at=doc.issued_at,
            expires_at=doc.expires_at,
            published_at=doc.published_at,
            published=doc.published_at is not None,
            envelope=doc.envelope,
        )
    )


async def get_device_models(request: web.Request) -> web.Response:
    device_id = await _known_device(request)
    async with services(request).db.read() as tx:
        desired = (await q.device_models(tx, [device_id]))[device_id]
        doc = (await q.desired_states(tx, [device_id])).get(device_id)
        reported = await q.reported(tx, device_id)
    by_name = {str(m.get("name")): m for m in reported.models} if reported else {}
    applied = reported.applied_seq if reported else None
    current = doc is not None and applied is not None and applied >= doc.seq
    items: list[DeviceModelOut] = []
    for m in desired:
        status = by_name.pop(m.model, None)
        items.append(
            DeviceModelOut(
                model=m.model,
                desired=DesiredModelOut.model_validate(m),
                reported=status,
                in_sync=current
                and status is not None
                and status.get("active_version") == m.stable_version,
            )
        )
    items.extend(
        DeviceModelOut(model=name, desired=None, reported=status, in_sync=False)
        for name, status in sorted(by_name.items())
    )
    return json_response(
        DeviceModels(
            device_id=device_id,
            desired_seq=doc.seq if doc else None,
            applied_seq=applied,
            reported_at=reported.received_at if reported else None,
            items=items,
        )
    )


# ---------------------------------------------------------------------------- wiring
def desired_account_name(service_client_id: str) -> str:
    """The service account (and client id) of a replica's desired-state session:
    ``{id}-desired``, within the 64-character limit."""
    return f"{service_client_id[:56]}-desired"


def attach_deployments(
    app: web.Application,
    service: DeploymentService,
    *,
    broker: IngestConnection | None,
    provisioner: BrokerProvisioner,
    sessions: list[MqttSubscriber] | None = None,
) -> None:
    """Store ``service`` in ``app[DEPLOYMENTS]``; at startup open its MQTT session (with its
    own service account, provisioned then) when ``broker`` is given, and start its background
    task; at cleanup stop both. Append it after the migration and before the database's
    disposal. Raises :class:`controlplane.mqtt.MqttError` at startup when the broker is unusable.
    """
    app[DEPLOYMENTS] = service
    opened: list[MqttSubscriber] = []
    reconciler = DesiredReconciler(service.db, service.wake)

    async def start(app: web.Application) -> None:
        if broker is None:
            log.warning("no broker configured: desired states are %s", NOT_PUBLISHED)
        else:
            name = desired_account_name(broker.credentials.client_id)
            credentials = await provisioner.provision_service(name)
            # Subscribed to every desired topic: the reconciler compares what the broker
            # retains with the database after each (re)connect and on every publish by anyone.
            session = MqttSubscriber(
                broker.address,
                credentials,
                [topics.all_devices(Channel.DESIRED)],
                reconciler.handle,
                on_subscribed=reconciler.subscribed,
                name="desired",
            )
            await session.start()
            opened.append(session)
            if sessions is not None:
                sessions.append(session)
            service.use_publisher(session)
        await service.start()

    async def stop(app: web.Application) -> None:
        await service.stop()
        service.use_publisher(None)
        for session in opened:
            await session.close()
        await reconciler.close()

    app.on_startup.append(start)
    app.on_cleanup.append(stop)


ENDPOINTS = [
    Endpoint(
        "POST",
        "/api/v1/deployments",
        create_deployment,
        "Deploy a model version to a device, group or labels; signs and publishes each "
        "device's desired state",
        Role.OPERATOR,
        "deployments",
        body=DeploymentCreate,
        response=DeploymentResult,
        status=201,
        answers={
            400: "invalid request: the body breaks its schema, or the canary or shadow "
            "version equals the stable one",
            404: "no such model version, or no such device",
            409: "the device is not accepted or does not fit the version, a "
            "downgrade without rollback, or a new desired state would be invalid or "
            "too large",
        },
    ),
    Endpoint(
        "POST",
        "/api/v1/deployments/undeploy",
        undeploy,
        "Remove a model from a device, group or labels",
        Role.OPERATOR,
        "deployments",
        body=UndeployRequest,
        response=DeploymentResult,
        answers={
            404: "no such device, or it does not have the model",
            409: "a new desired state would be invalid or too large",
        },
    ),
    Endpoint(
        "GET",
        "/api/v1/deployments",
        list_deployments,
        "Deployments, newest first",
        Role.VIEWER,
        "deployments",
        query=DeploymentQuery,
        response=DeploymentList,
    ),
    Endpoint(
        "GET",
        "/api/v1/devices/{device_id}/desired",
        get_desired,
        "The device's current signed desired state and its seq",
        Role.VIEWER,
        "deployments",
        response=DesiredOut,
    ),
    Endpoint(
        "GET",
        "/api/v1/devices/{device_id}/models",
        get_device_models,
        "Desired versus reported state of each model of a device",
        Role.VIEWER,
        "deployments",
        response=DeviceModels,
    ),
    Endpoint(
        "DELETE",
        "/api/v1/devices/{device_id}/models/{model}",
        remove_device_model,
        "Remove one model from one device",
        Role.OPERATOR,
        "deployments",
        response=DeploymentResult,
        answers={
            404: "no such device, or it does not have the model",
            409: "a new desired state would be invalid or too large",
        },
    ),
]
