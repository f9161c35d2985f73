"""``POST /api/v1/enroll``: a device joins the fleet (DESIGN 4.1 steps 2-3).

The body is the signed envelope of :func:`shared.protocol.enrollment.sign_enrollment`; no API
token is needed (the enrollment token is inside, and the signature proves the device holds the
key it names). ``?force=true`` re-enrolls an accepted device (fresh facts and credentials).

Order of checks, cheapest refusal first: size (413), JSON (400), envelope and schema (400),
signature (401), clock skew (400), nonce (409, replay; the nonce is committed on its own
before anything else, so an envelope is single-use whatever the outcome), then the decision of
:func:`controlplane.enrollment.plan` in one transaction: token (403), device state (403),
device id clash (409). Broker credentials are provisioned inside that transaction; if the
broker refuses (503) nothing is committed and the device may simply try again. A device id that
another kind of broker account holds (a control-plane service, an application) is refused with
409, naming no account, and nothing is committed either: not the device, not the token use.
"""

from __future__ import annotations

import logging
from datetime import datetime

from aiohttp import web
from pydantic import BaseModel, ConfigDict

from mcp_edge.controlplane import audit
from mcp_edge.controlplane.api.common import (
    ApiError,
    Endpoint,
    Services,
    read_json,
    read_query,
    services,
)
from mcp_edge.controlplane.api.deployments import apply_standing_deployments
from mcp_edge.controlplane.api.schemas import SignedEnrollment
from mcp_edge.controlplane.api.tokens import token_facts
from mcp_edge.controlplane.audit import AuditAction, device_actor
from mcp_edge.controlplane.auth import AuthError, secret_digest
from mcp_edge.controlplane.broker.base import AccountConflictError, Credentials
from mcp_edge.controlplane.db import Tx
from mcp_edge.controlplane.db import devices as device_q
from mcp_edge.controlplane.db import enrollment as token_q
from mcp_edge.controlplane.db.devices import DeviceView
from mcp_edge.controlplane.enrollment import (
    Action,
    DeviceStatus,
    Plan,
    Refusal,
    default_device_id,
    merge_labels,
    plan,
)
from mcp_edge.controlplane.settings import EnrollmentApproval
from mcp_edge.shared.errors import MalformedSignatureError, ReplayError, SigningError
from mcp_edge.shared.protocol.base import MAX_LABELS
from mcp_edge.shared.protocol.codec import encode
from mcp_edge.shared.protocol.command import ErrorCode
from mcp_edge.shared.protocol.enrollment import (
    BrokerCredentials,
    EnrollmentAnswer,
    EnrollmentRequest,
    EnrollmentStatus,
    nonce_retention,
    verify_enrollment,
)
from mcp_edge.shared.protocol.topics import PREFIX

log = logging.getLogger("mcp.controlplane.enroll")


class EnrollQuery(BaseModel):
    model_config = ConfigDict(extra="forbid")
    force: bool = False


class RefusedError(ApiError):
    def __init__(self, refusal: Refusal) -> None:
        super().__init__(ErrorCode.FORBIDDEN, refusal.message)
        self.refusal = refusal


def _checked_labels(labels: dict[str, str]) -> dict[str, str]:
    if len(labels) > MAX_LABELS:
        raise ApiError(
            ErrorCode.BAD_REQUEST, f"the device's and the token's labels exceed {MAX_LABELS}"
        )
    return labels


async def _create(tx: Tx, req: EnrollmentRequest, decision: Plan, now: datetime) -> DeviceView:
    token = await token_q.find_token(tx, secret_digest(req.token))
    assert token is not None and decision.status is not None
    if not await token_q.consume_token_use(tx, token.id, now):
        raise RefusedError(Refusal.TOKEN_USED_UP)  # another device took the last use
    device_id = req.device_id or default_device_id(req.public_key)
    if await device_q.device_id_taken(tx, device_id):
        raise ApiError(
            ErrorCode.CONFLICT,
            f"device id {device_id!r} belongs to another key; enroll with another id or none",
        )
    accepted = decision.status is DeviceStatus.ACCEPTED
    view = await device_q.insert_device(
        tx, device_id=device_id, public_key=req.public_key, status=decision.status.value,
        now=now, profile=req.profile, group_name=token.group_name,
        labels=_checked_labels(merge_labels(req.labels, token.labels)), facts=req.facts,
        agent_version=req.agent_version, enrollment_token_id=token.id,
        accepted_at=now if accepted else None,
    )
    await audit.record(
        tx, at=now, actor=device_actor(device_id), action=AuditAction.DEVICE_ENROLLED,
        target_type="device", target_id=device_id,
        detail={"status": decision.status.value, "token_id": token.id, "profile": req.profile},
    )
    return view


async def _refresh(
    tx: Tx, existing: DeviceView, req: EnrollmentRequest, decision: Plan, now: datetime
) -> DeviceView:
    """Preauthorized → accepted, or a forced re-enroll: take the device's new facts; labels the
    operator set stay on top of the device's own."""
    labels = _checked_labels(merge_labels(req.labels, existing.labels))
    await device_q.replace_labels(tx, existing.id, labels)
    fields: dict[str, object] = {
        "profile": req.profile, "facts": dict(req.facts), "agent_version": req.agent_version,
    }
    if decision.action is Action.ACCEPT_PREAUTHORIZED:
        fields.update(status=DeviceStatus.ACCEPTED.value, accepted_at=now)
    view = await device_q.update_device(tx, existing.id, now=now, **fields)
    action = (
        AuditAction.DEVICE_ENROLLED
        if decision.action is Action.ACCEPT_PREAUTHORIZED
        else AuditAction.DEVICE_REENROLLED
    )
    await audit.record(
        tx, at=now, actor=device_actor(existing.id), action=action, target_type="device",
        target_id=existing.id,
        detail={"status": view.status, "profile": req.profile,
                "preauthorized": decision.action is Action.ACCEPT_PREAUTHORIZED},
    )
    return view


def _verify(envelope: object, now: datetime) -> EnrollmentRequest:
    try:
        return verify_enrollment(envelope, now=now)
    except MalformedSignatureError as e:
        raise ApiError(ErrorCode.BAD_REQUEST, f"enrollment signature: {e}") from e
    except SigningError as e:
        raise AuthError(f"enrollment signature does not verify: {e}") from e


async def enroll(request: web.Request) -> web.Response:
    svc = services(request)
    metrics = svc.metrics.enrollments
    try:
        force = read_query(request, EnrollQuery).force
        envelope = await read_json(request, EnrollmentRequest.MAX_BYTES)
        now = svc.clock()
        req = _verify(envelope, now)
        async with svc.db.transaction() as tx:
            fresh = await token_q.remember_nonce(
                tx, req.nonce, now=now, expires_at=now + nonce_retention()
            )
        if not fresh:
            raise ReplayError("enrollment request replayed: its nonce was seen before")
        answer = await _decide_and_apply(svc, req, force, now)
    except RefusedError as e:
        metrics.labels(e.refusal.value).inc()
        log.info("enrollment refused: %s", e)
        raise
    except ReplayError:
        metrics.labels("replayed").inc()
        raise
    except (ApiError, AuthError):
        metrics.labels("invalid").inc()
        raise
    if answer.status is EnrollmentStatus.ACCEPTED:
        await apply_standing_deployments(request, answer.device_id)
    body = encode(answer)
    return web.Response(body=body, status=200, content_type="application/json")


async def _decide_and_apply(
    svc: Services, req: EnrollmentRequest, force: bool, now: datetime
) -> EnrollmentAnswer:
    async with svc.db.transaction() as tx:
        existing = await device_q.get_device_by_key(tx, req.public_key, lock=True)
        token = None
        if existing is None:
            found = await token_q.find_token(tx, secret_digest(req.token))
            token = token_facts(found) if found is not None else None
        decision = plan(
            existing=DeviceStatus(existing.status) if existing else None, token=token,
            manual_policy=svc.settings.enrollment_approval is EnrollmentApproval.MANUAL,
            force=force, now=now,
        )
        if decision.action is Action.REFUSE:
            assert decision.refusal is not None
            raise RefusedError(decision.refusal)
        if decision.action is Action.CREATE:
            view = await _create(tx, req, decision, now)
        elif decision.action in (Action.ACCEPT_PREAUTHORIZED, Action.REENROLL):
            assert existing is not None
            view = await _refresh(tx, existing, req, decision, now)
        else:
            assert existing is not None
            view = existing
        broker = None
        if view.status == DeviceStatus.ACCEPTED.value:
            creds = await _provision(svc, view.id, decision)
            broker = BrokerCredentials(
                urls=list(svc.settings.broker_urls), username=creds.username,
                password=creds.password, client_id=creds.client_id,
            )
    outcome = "unchanged" if decision.action is Action.UNCHANGED else view.status
    if decision.action is Action.REENROLL:
        outcome = "reenrolled"
    svc.metrics.enrollments.labels(outcome).inc()
    log.info("enrollment of %s: %s", view.id, outcome)
    if broker is None:
        return EnrollmentAnswer(
            status=EnrollmentStatus.PENDING, device_id=view.id, topic_prefix=PREFIX,
            message="waiting for an operator to approve this device",
            poll_after_s=svc.settings.poll_after_s,
        )
    message = {
        Action.UNCHANGED: "already enrolled; nothing changed (fresh broker credentials issued)",
        Action.REENROLL: "re-enrolled",
    }.get(decision.action, "enrolled")
    return EnrollmentAnswer(
        status=EnrollmentStatus.ACCEPTED, device_id=view.id, topic_prefix=PREFIX,
        broker=broker, trust=await svc.trust.trust_root(), message=message,
    )


async def _provision(svc: Services, device_id: str, decision: Plan) -> Credentials:
    """The device's broker credentials; a 409 :class:`ApiError` when its id is taken by
    another kind of broker account (raised inside the transaction: nothing is committed)."""
    try:
        return await svc.provisioner.provision_device(device_id)
    except AccountConflictError as e:
        log.warning("enrollment of %s refused: %s", device_id, e)
        hint = (
            "enroll with another id or none" if decision.action is Action.CREATE
            else "ask an operator to give this device another id"
        )
        raise ApiError(
            ErrorCode.CONFLICT, f"device id {device_id!r} is not available; {hint}"
        ) from e


ENDPOINTS = [
    Endpoint("POST", "/api/v1/enroll", enroll,
             "Enroll a device with a signed request (no API token; ?force=true re-enrolls)",
             None, "enrollment", body=SignedEnrollment, query=EnrollQuery,
             response=EnrollmentAnswer, max_body=EnrollmentRequest.MAX_BYTES,
             answers={401: "the signature does not verify with the key the request names",
                      403: "the enrollment token or the device's state refuses it",
                      409: "the request was seen before (replay), or the device id is taken",
                      503: "database or broker unavailable; nothing changed, retry later"}),
]
