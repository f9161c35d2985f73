"""Devices joining the fleet (DESIGN 4.1): enrollment, approval, rejection, preauthorization.

:class:`EnrollmentService` carries out the pure decision of :mod:`controlplane.enrollment`
with the database, the broker provisioner, the trust source and the deployments: it takes
plain values, returns plain results (an :class:`EnrollmentAnswer`, a :class:`DeviceView`) and
knows nothing of HTTP; :mod:`controlplane.api.enroll` and :mod:`controlplane.api.approvals`
parse requests, call it, and answer.

An enrollment checks, cheapest refusal first: the envelope's shape and schema, its signature,
the clock skew, then its nonce (committed on its own before anything else, so an envelope is
single-use whatever the outcome), then in one transaction the decision: token, device state,
device id clash. Broker credentials are provisioned inside that transaction, so a broker that
refuses leaves nothing committed (the device may simply try again), and a device id that
another kind of broker account holds (a control-plane service, an application) leaves nothing
committed either: not the device, not the token use. A device accepted (by enrollment or by
approval) then gets the standing group and label deployments that select it.

Errors (all :class:`EnrollmentError`, by who is at fault; the REST layer maps them to HTTP in
one place, :mod:`controlplane.api.common`)::

    InvalidEnrollmentError      400  malformed signature, too many labels
    EnrollmentSignatureError    401  the signature does not verify with the key it names
    EnrollmentRefusedError      403  the token or the device's state refuses it (``refusal``)
    DeviceNotFoundError         404  approve/reject of a device that does not exist
    EnrollmentConflictError     409  device id or public key taken, device not pending

Raised from their own layers and left as they are: :class:`~shared.errors.ReplayError` (a nonce
seen before), :class:`~shared.errors.MessageError` and :class:`~shared.errors.ExpiredError`
(an unusable envelope, a timestamp too far from the server's clock),
:class:`~controlplane.broker.base.BrokerAdminError` (the broker did not take the account) and
:class:`~controlplane.db.DatabaseError`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Protocol

from mcp_edge.controlplane import audit
from mcp_edge.controlplane.audit import AuditAction, device_actor
from mcp_edge.controlplane.auth import secret_digest
from mcp_edge.controlplane.broker.base import (
    AccountConflictError,
    BrokerProvisioner,
    Credentials,
)
from mcp_edge.controlplane.db import Database, DatabaseError, Tx
from mcp_edge.controlplane.db import devices as device_q
from mcp_edge.controlplane.db import enrollment as token_q
from mcp_edge.controlplane.db.devices import DeviceView
from mcp_edge.controlplane.db.models import EnrollmentToken
from mcp_edge.controlplane.enrollment import (
    Action,
    Approval,
    DeviceStatus,
    Plan,
    Refusal,
    TokenFacts,
    default_device_id,
    merge_labels,
    plan,
)
from mcp_edge.controlplane.metrics import ControlPlaneMetrics
from mcp_edge.controlplane.settings import EnrollmentApproval, Settings
from mcp_edge.shared.errors import MalformedSignatureError, McpError, ReplayError, SigningError
from mcp_edge.shared.protocol.base import MAX_LABELS
from mcp_edge.shared.protocol.enrollment import (
    BrokerCredentials,
    EnrollmentAnswer,
    EnrollmentRequest,
    EnrollmentStatus,
    TrustRoot,
    nonce_retention,
    verify_enrollment,
)
from mcp_edge.shared.protocol.topics import PREFIX

log = logging.getLogger("mcp.controlplane.enroll")

Clock = Callable[[], datetime]


class TrustSource(Protocol):
    """Where enrollment answers get the trust root (TUF root, director and publisher keys)."""

    async def trust_root(self) -> TrustRoot: ...


class StandingDeployments(Protocol):
    """What gives a device just accepted the deployments that stand for it:
    :meth:`controlplane.deployments.DeploymentService.device_accepted`."""

    async def device_accepted(self, device_id: str) -> object: ...


class EnrollmentError(McpError):
    """An enrollment, approval or preauthorization that cannot be done as asked."""


class InvalidEnrollmentError(EnrollmentError):
    """The request is unusable as sent (a malformed signature, too many labels)."""


class EnrollmentSignatureError(EnrollmentError):
    """The enrollment's signature does not verify with the public key it names."""


class EnrollmentRefusedError(EnrollmentError):
    """The token or the device's state refuses the enrollment; ``refusal`` says which."""

    def __init__(self, refusal: Refusal) -> None:
        super().__init__(refusal.message)
        self.refusal = refusal


class DeviceNotFoundError(EnrollmentError):
    """No device has the id an operator named."""


class EnrollmentConflictError(EnrollmentError):
    """A device id or public key is taken, or the device is not in the state the change needs."""


def token_facts(token: EnrollmentToken) -> TokenFacts:
    """What :func:`controlplane.enrollment.plan` needs of a stored enrollment token."""
    return TokenFacts(
        approval=Approval(token.approval),
        uses=token.uses,
        max_uses=token.max_uses,
        expires_at=token.expires_at,
        revoked_at=token.revoked_at,
    )


def _checked_labels(labels: dict[str, str]) -> dict[str, str]:
    if len(labels) > MAX_LABELS:
        raise InvalidEnrollmentError(f"the device's and the token's labels exceed {MAX_LABELS}")
    return labels


def _verify(envelope: object, now: datetime) -> EnrollmentRequest:
    try:
        return verify_enrollment(envelope, now=now)
    except MalformedSignatureError as e:
        raise InvalidEnrollmentError(f"enrollment signature: {e}") from e
    except SigningError as e:
        raise EnrollmentSignatureError(f"enrollment signature does not verify: {e}") from e


class EnrollmentService:
    """Enrollment and the operator's decisions on devices; one per control-plane process.

    ``deployments`` None: accepted devices get no standing deployments (nothing deploys).
    """

    def __init__(
        self,
        db: Database,
        provisioner: BrokerProvisioner,
        trust: TrustSource,
        settings: Settings,
        clock: Clock,
        metrics: ControlPlaneMetrics,
        deployments: StandingDeployments | None = None,
    ) -> None:
        self._db = db
        self._provisioner = provisioner
        self._trust = trust
        self._settings = settings
        self._clock = clock
        self._outcomes = metrics.enrollments
        self._deployments = deployments

    # ------------------------------------------------------------------ enrollment
    def count_unreadable(self) -> None:
        """Count an enrollment request that could not even be read (size, JSON, query) as
        ``invalid``, like one whose signature or labels are unusable."""
        self._outcomes.labels("invalid").inc()

    async def enroll(self, envelope: object, *, force: bool = False) -> EnrollmentAnswer:
        """Enroll the device that signed ``envelope`` (a decoded JSON value, untrusted).

        ``force`` re-enrolls an accepted device (fresh facts and credentials). The answer is
        accepted (with broker credentials and the trust root) or pending. Raises the errors of
        the module docstring; nothing is committed but the nonce when it raises after the
        nonce check.
        """
        try:
            now = self._clock()
            req = _verify(envelope, now)
            async with self._db.transaction() as tx:
                fresh = await token_q.remember_nonce(
                    tx, req.nonce, now=now, expires_at=now + nonce_retention()
                )
            if not fresh:
                raise ReplayError("enrollment request replayed: its nonce was seen before")
            answer = await self._decide_and_apply(req, force, now)
        except EnrollmentRefusedError as e:
            self._outcomes.labels(e.refusal.value).inc()
            log.info("enrollment refused: %s", e)
            raise
        except ReplayError:
            self._outcomes.labels("replayed").inc()
            raise
        except (InvalidEnrollmentError, EnrollmentSignatureError, EnrollmentConflictError):
            self._outcomes.labels("invalid").inc()
            raise
        if answer.status is EnrollmentStatus.ACCEPTED:
            await self._apply_standing_deployments(answer.device_id)
        return answer

    async def _decide_and_apply(
        self, req: EnrollmentRequest, force: bool, now: datetime
    ) -> EnrollmentAnswer:
        async with self._db.transaction() as tx:
            existing = await device_q.get_device_by_key(tx, req.public_key, lock=True)
            token = None
            if existing is None:
                found = await token_q.find_token(tx, secret_digest(req.token))
                token = token_facts(found) if found is not None else None
            decision = plan(
                existing=DeviceStatus(existing.status) if existing else None,
                token=token,
                manual_policy=self._settings.enrollment_approval is EnrollmentApproval.MANUAL,
                force=force,
                now=now,
            )
            if decision.action is Action.REFUSE:
                assert decision.refusal is not None
                raise EnrollmentRefusedError(decision.refusal)
            if decision.action is Action.CREATE:
                view = await self._create(tx, req, decision, now)
            elif decision.action in (Action.ACCEPT_PREAUTHORIZED, Action.REENROLL):
                assert existing is not None
                view = await self._refresh(tx, existing, req, decision, now)
            else:
                assert existing is not None
                view = existing
            broker = None
            if view.status == DeviceStatus.ACCEPTED.value:
                creds = await self._provision(view.id, decision)
                broker = BrokerCredentials(
                    urls=list(self._settings.broker_urls),
                    username=creds.username,
                    password=creds.password,
                    client_id=creds.client_id,
                )
        outcome = "unchanged" if decision.action is Action.UNCHANGED else view.status
        if decision.action is Action.REENROLL:
            outcome = "reenrolled"
        self._outcomes.labels(outcome).inc()
        log.info("enrollment of %s: %s", view.id, outcome)
        if broker is None:
            return EnrollmentAnswer(
                status=EnrollmentStatus.PENDING,
                device_id=view.id,
                topic_prefix=PREFIX,
                message="waiting for an operator to approve this device",
                poll_after_s=self._settings.poll_after_s,
            )
        message = {
            Action.UNCHANGED: "already enrolled; nothing changed (fresh broker credentials issued)",
            Action.REENROLL: "re-enrolled",
        }.get(decision.action, "enrolled")
        return EnrollmentAnswer(
            status=EnrollmentStatus.ACCEPTED,
            device_id=view.id,
            topic_prefix=PREFIX,
            broker=broker,
            trust=await self._trust.trust_root(),
            message=message,
        )

    async def _create(
        self, tx: Tx, req: EnrollmentRequest, decision: Plan, now: datetime
    ) -> DeviceView:
        token = await token_q.find_token(tx, secret_digest(req.token))
        assert token is not None and decision.status is not None
        if not await token_q.consume_token_use(tx, token.id, now):
            # another device took the last use
            raise EnrollmentRefusedError(Refusal.TOKEN_USED_UP)
        device_id = req.device_id or default_device_id(req.public_key)
        if await device_q.device_id_taken(tx, device_id):
            raise EnrollmentConflictError(
                f"device id {device_id!r} belongs to another key; enroll with another id or none"
            )
        accepted = decision.status is DeviceStatus.ACCEPTED
        view = await device_q.insert_device(
            tx,
            device_id=device_id,
            public_key=req.public_key,
            status=decision.status.value,
            now=now,
            profile=req.profile,
            group_name=token.group_name,
            labels=_checked_labels(merge_labels(req.labels, token.labels)),
            facts=req.facts,
            agent_version=req.agent_version,
            enrollment_token_id=token.id,
            accepted_at=now if accepted else None,
        )
        await audit.record(
            tx,
            at=now,
            actor=device_actor(device_id),
            action=AuditAction.DEVICE_ENROLLED,
            target_type="device",
            target_id=device_id,
            detail={"status": decision.status.value, "token_id": token.id, "profile": req.profile},
        )
        return view

    async def _refresh(
        self, tx: Tx, existing: DeviceView, req: EnrollmentRequest, decision: Plan, now: datetime
    ) -> DeviceView:
        """Preauthorized → accepted, or a forced re-enroll: take the device's new facts; labels
        the operator set stay on top of the device's own."""
        labels = _checked_labels(merge_labels(req.labels, existing.labels))
        await device_q.replace_labels(tx, existing.id, labels)
        fields: dict[str, object] = {
            "profile": req.profile,
            "facts": dict(req.facts),
            "agent_version": req.agent_version,
        }
        preauthorized = decision.action is Action.ACCEPT_PREAUTHORIZED
        if preauthorized:
            fields.update(status=DeviceStatus.ACCEPTED.value, accepted_at=now)
        view = await device_q.update_device(tx, existing.id, now=now, **fields)
        await audit.record(
            tx,
            at=now,
            actor=device_actor(existing.id),
            action=AuditAction.DEVICE_ENROLLED if preauthorized else AuditAction.DEVICE_REENROLLED,
            target_type="device",
            target_id=existing.id,
            detail={"status": view.status, "profile": req.profile, "preauthorized": preauthorized},
        )
        return view

    async def _provision(self, device_id: str, decision: Plan) -> Credentials:
        """The device's broker credentials; :class:`EnrollmentConflictError` when its id is
        taken by another kind of broker account (raised inside the transaction: nothing is
        committed). The answer names no account; the log does."""
        try:
            return await self._provisioner.provision_device(device_id)
        except AccountConflictError as e:
            log.warning("enrollment of %s refused: %s", device_id, e)
            hint = (
                "enroll with another id or none"
                if decision.action is Action.CREATE
                else "ask an operator to give this device another id"
            )
            raise EnrollmentConflictError(
                f"device id {device_id!r} is not available; {hint}"
            ) from e

    # ------------------------------------------------------------------ operator decisions
    async def approve(self, device_id: str, *, actor: str, reason: str = "") -> DeviceView:
        """Pending → accepted, audited as ``actor`` with ``reason``; the device gets its broker
        credentials the next time it asks, and its standing deployments now.

        Raises :class:`DeviceNotFoundError`, :class:`EnrollmentConflictError` (not pending).
        """
        view = await self._decide(device_id, DeviceStatus.ACCEPTED, actor=actor, reason=reason)
        await self._apply_standing_deployments(device_id)
        return view

    async def reject(self, device_id: str, *, actor: str, reason: str = "") -> DeviceView:
        """Pending → rejected (its enrollment is refused from then on), audited as ``actor``.

        Raises :class:`DeviceNotFoundError`, :class:`EnrollmentConflictError` (not pending).
        """
        return await self._decide(device_id, DeviceStatus.REJECTED, actor=actor, reason=reason)

    async def _decide(
        self, device_id: str, status: DeviceStatus, *, actor: str, reason: str
    ) -> DeviceView:
        now = self._clock()
        approve = status is DeviceStatus.ACCEPTED
        async with self._db.transaction() as tx:
            view = await device_q.get_device(tx, device_id, lock=True)
            if view is None:
                raise DeviceNotFoundError(f"no device {device_id!r}")
            if view.status != DeviceStatus.PENDING.value:
                raise EnrollmentConflictError(f"device {device_id!r} is {view.status}, not pending")
            fields: dict[str, object] = {"status": status.value}
            if approve:
                fields["accepted_at"] = now
            view = await device_q.update_device(tx, device_id, now=now, **fields)
            await audit.record(
                tx,
                at=now,
                actor=actor,
                action=AuditAction.DEVICE_APPROVED if approve else AuditAction.DEVICE_REJECTED,
                target_type="device",
                target_id=device_id,
                detail={"reason": reason},
            )
        return view

    async def preauthorize(
        self,
        public_key: str,
        *,
        actor: str,
        device_id: str | None = None,
        group: str | None = None,
        labels: Mapping[str, str] | None = None,
    ) -> DeviceView:
        """Accept ``public_key`` (hex) in advance: the device it belongs to is accepted when it
        enrolls, token or not. ``device_id`` None: the key's default id.

        Raises :class:`EnrollmentConflictError` (the key or the id is taken).
        """
        device_id = device_id or default_device_id(public_key)
        labels = dict(labels or {})
        now = self._clock()
        async with self._db.transaction() as tx:
            known = await device_q.get_device_by_key(tx, public_key)
            if known is not None:
                raise EnrollmentConflictError(
                    f"this public key already belongs to device {known.id!r}"
                )
            if await device_q.device_id_taken(tx, device_id):
                raise EnrollmentConflictError(f"device id {device_id!r} is taken")
            view = await device_q.insert_device(
                tx,
                device_id=device_id,
                public_key=public_key,
                status=DeviceStatus.PREAUTHORIZED.value,
                now=now,
                group_name=group,
                labels=labels,
            )
            await audit.record(
                tx,
                at=now,
                actor=actor,
                action=AuditAction.DEVICE_PREAUTHORIZED,
                target_type="device",
                target_id=device_id,
                detail={"public_key": public_key, "group": group, "labels": labels},
            )
        return view

    # ------------------------------------------------------------------ deployments
    async def _apply_standing_deployments(self, device_id: str) -> None:
        """Give a device just accepted the group and label deployments that select it. A
        failure is logged, never fails the acceptance that already committed."""
        if self._deployments is None:
            return
        try:
            await self._deployments.device_accepted(device_id)
        except (DatabaseError, McpError) as e:
            log.warning(
                "device %s accepted, but its standing deployments were not applied: %s",
                device_id,
                e,
            )
