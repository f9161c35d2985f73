"""Application MQTT accounts: what an application that sends inference requests over MQTT
(``mcp-agent infer --mqtt``, :class:`mcp_edge.client.InferenceClient`) logs in with.

    GET    /api/v1/apps                  viewer
    POST   /api/v1/apps                  operator: the answer holds the password, once
    DELETE /api/v1/apps/{client_id}      operator: revoke (the row stays for the audit trail)

An account may publish fleet and per-device inference requests and read only its own reply
topics ``mcp/v1/client/{client_id}/reply/+`` (the last level is the random token each client
session draws; :func:`controlplane.broker.acl.app_client_acls`).
The broker account is made inside the database transaction that stores the row: when the
broker refuses (503) nothing is stored, and when the commit fails the new account is deleted
again. Revoking disables the account at the broker (a live session is disconnected) in the
transaction that marks the row revoked. Client ids are never given out twice, and never to an
application when a device or a control-plane service has the same id (one client id, one broker
account): 409, naming no broker account.
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Annotated

from aiohttp import web
from pydantic import AfterValidator, Field, StringConstraints

from mcp_edge.controlplane.api.common import (
    ApiError,
    Endpoint,
    Services,
    json_response,
    read_body,
    services,
)
from mcp_edge.controlplane.api.schemas import Request, Response
from mcp_edge.controlplane.auth import Role, principal_of
from mcp_edge.controlplane.broker.base import AccountConflictError, BrokerAdminError
from mcp_edge.controlplane.db import DatabaseError, Tx
from mcp_edge.controlplane.db import apps as q
from mcp_edge.controlplane.db import audit as audit_q
from mcp_edge.controlplane.db.models import AppClient
from mcp_edge.shared.protocol import topics
from mcp_edge.shared.protocol.base import IdentifierSchema
from mcp_edge.shared.protocol.command import ErrorCode
from mcp_edge.shared.protocol.topics import validate_id

log = logging.getLogger("mcp.controlplane.apps")

APP_CREATED = "app_client.created"
APP_REVOKED = "app_client.revoked"
Description = Annotated[str, StringConstraints(max_length=256)]
ClientId = Annotated[str, AfterValidator(lambda v: validate_id(v, "client id")), IdentifierSchema]


class AppClientCreate(Request):
    """A new application account; ``client_id`` is the MQTT client id it must connect with."""

    client_id: ClientId = Field(description="1-64 of A-Z a-z 0-9 . _ -, starting alphanumeric")
    description: Description = ""


class AppClientOut(Response):
    client_id: str
    description: str
    created_by: str
    created_at: datetime
    revoked_at: datetime | None
    state: str = Field(description="active or revoked")
    reply_topic: str = Field(
        description="the only topic filter this account may subscribe to: its sessions' reply "
        "topics, whose last level is a random token each client session draws"
    )


class AppClientCreated(AppClientOut):
    """The new account with its credentials; the password is in this answer only."""

    username: str
    password: str
    broker_urls: list[str]


class AppClientList(Response):
    items: list[AppClientOut]


def app_out(app: AppClient) -> AppClientOut:
    return AppClientOut(
        client_id=app.client_id,
        description=app.description,
        created_by=app.created_by,
        created_at=app.created_at,
        revoked_at=app.revoked_at,
        state="revoked" if app.revoked_at is not None else "active",
        reply_topic=topics.client_replies(app.client_id),
    )


async def list_app_clients(request: web.Request) -> web.Response:
    async with services(request).db.read() as tx:
        apps = await q.list_app_clients(tx)
    return json_response(AppClientList(items=[app_out(a) for a in apps]))


async def create_app_client(request: web.Request) -> web.Response:
    svc, who = services(request), principal_of(request)
    body = await read_body(request, AppClientCreate)
    client_id, now = body.client_id, svc.clock()
    provisioned = False
    try:
        async with svc.db.transaction() as tx:
            await _refuse_taken(tx, client_id)
            app = await q.create_app_client(
                tx,
                client_id=client_id,
                description=body.description,
                created_by=who.username,
                now=now,
            )
            try:
                credentials = await svc.provisioner.provision_app_client(client_id)
            except AccountConflictError as e:  # a service's, or a device's not in the database
                log.warning("app client %s refused: %s", client_id, e)
                raise ApiError(
                    ErrorCode.CONFLICT, f"client id {client_id!r} is not available; pick another"
                ) from e
            provisioned = True
            await audit_q.insert_entry(
                tx,
                at=now,
                actor=who.actor,
                action=APP_CREATED,
                target_type="app_client",
                target_id=client_id,
                detail={"username": credentials.username, "description": body.description},
            )
    except DatabaseError:
        if provisioned:
            await _delete_account(svc, client_id)
        raise
    log.info(
        "app client %s created by %s (broker account %s)",
        client_id,
        who.actor,
        credentials.username,
    )
    created = AppClientCreated(
        **app_out(app).model_dump(),
        username=credentials.username,
        password=credentials.password,
        broker_urls=list(svc.settings.broker_urls),
    )
    return json_response(created, 201)


async def revoke_app_client(request: web.Request) -> web.Response:
    """Revoke: the broker disables the account inside the transaction, so a broker failure
    (503) leaves the row active and the operator can retry. Revoking twice is a no-op."""
    svc, who = services(request), principal_of(request)
    client_id = request.match_info["client_id"]
    now = svc.clock()
    async with svc.db.transaction() as tx:
        app = await q.get_app_client(tx, client_id, lock=True)
        if app is None:
            raise ApiError(ErrorCode.NOT_FOUND, f"no app client {client_id!r}")
        if app.revoked_at is None:
            await svc.provisioner.disable_app_client(client_id)
            app = await q.revoke_app_client(tx, client_id, now)
            await audit_q.insert_entry(
                tx,
                at=now,
                actor=who.actor,
                action=APP_REVOKED,
                target_type="app_client",
                target_id=client_id,
            )
            log.info("app client %s revoked by %s", client_id, who.actor)
    return json_response(app_out(app))


async def _refuse_taken(tx: Tx, client_id: str) -> None:
    """Raise a 409 :class:`ApiError` when ``client_id`` is an application's or a device's."""
    existing = await q.get_app_client(tx, client_id)
    if existing is not None and existing.revoked_at is not None:
        raise ApiError(
            ErrorCode.CONFLICT,
            f"app client {client_id!r} was revoked; client ids are not reused, pick another",
        )
    if existing is not None:
        raise ApiError(
            ErrorCode.CONFLICT,
            f"app client {client_id!r} already exists (its password was shown once, when it "
            "was created); revoke it and create another client id for new credentials",
        )
    if await q.is_device_id(tx, client_id):
        raise ApiError(
            ErrorCode.CONFLICT, f"client id {client_id!r} is a device's id; pick another"
        )


async def _delete_account(svc: Services, client_id: str) -> None:
    """Remove a broker account whose row was not stored; a failure only leaves an account
    whose password nobody has."""
    try:
        await svc.provisioner.delete_app_client(client_id)
    except BrokerAdminError as e:
        log.warning(
            "app client %s was not stored, and its broker account could not be deleted: %s",
            client_id,
            e,
        )


ENDPOINTS = [
    Endpoint(
        "GET",
        "/api/v1/apps",
        list_app_clients,
        "List application MQTT accounts",
        Role.VIEWER,
        "apps",
        response=AppClientList,
    ),
    Endpoint(
        "POST",
        "/api/v1/apps",
        create_app_client,
        "Create an application MQTT account (the password is in this answer only)",
        Role.OPERATOR,
        "apps",
        body=AppClientCreate,
        response=AppClientCreated,
        status=201,
        answers={
            409: "the client id is taken, or was used before",
            503: "database or broker unavailable; nothing changed, retry later",
        },
    ),
    Endpoint(
        "DELETE",
        "/api/v1/apps/{client_id}",
        revoke_app_client,
        "Revoke an application MQTT account: disabled at the broker, live session closed",
        Role.OPERATOR,
        "apps",
        response=AppClientOut,
        answers={503: "database or broker unavailable; nothing changed, retry later"},
    ),
]
