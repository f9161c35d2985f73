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

Enrollments are carried out in groups, as a database commits in groups: requests that arrive
together (within ``batch_window_s`` of the first, or while the group before is being carried
out; at most ``max_batch``) share one nonce transaction and one decision transaction, in which
each request's changes sit in a savepoint of their own and every accepted device's broker
account is provisioned at once (the provisioner merges those into few broker messages). Each
request still gets its own answer or error: a refusal or conflict undoes only that request's
savepoint; a broker that refuses one account rolls the whole transaction back, that request
fails, and the others are carried out again without it, so nothing of the refused request
and everything of the others is committed. Two requests for one key or one device id never
share a group (the second waits for the next). The answer goes out only once the group has
committed and the broker has confirmed the account, so a device can connect at once.

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

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
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
from mcp_edge.controlplane.db import ConflictError, Database, DatabaseError, NotFoundError, Tx
from mcp_edge.controlplane.db import devices as device_q
from mcp_edge.controlplane.db import enrollment as token_q
from mcp_edge.controlplane.db.devices import DeviceView
from mcp_edge.controlplane.db.engine import savepoint
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

BATCH_WINDOW_S = 0.005
"""How long the first enrollment of a group waits for others to join it (seconds)."""
MAX_BATCH = 32
"""The most enrollments one group carries."""


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


@dataclass
class _Job:
    """One enrollment request waiting in the queue, and the future its answer goes to."""

    req: EnrollmentRequest
    force: bool
    now: datetime
    future: asyncio.Future[EnrollmentAnswer]

    @property
    def claims(self) -> frozenset[str]:
        """What two requests in one group must not share: the key, the device id asked for."""
        key = self.req.public_key
        return frozenset({"key:" + key, "id:" + (self.req.device_id or default_device_id(key))})

    def fail(self, error: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(error)


@dataclass
class _Staged:
    """A request's changes, made in its savepoint, waiting for the broker and the commit."""

    job: _Job
    decision: Plan
    view: DeviceView


@dataclass
class _BrokerRefused(Exception):
    """Some accounts of a group were refused: raised inside the group's transaction to roll it
    back; ``failures`` fail, ``others`` are carried out again."""

    failures: list[tuple[_Job, Exception]]
    others: list[_Job]


class EnrollmentService:
    """Enrollment and the operator's decisions on devices; one per control-plane process.

    ``deployments`` None: accepted devices get no standing deployments (nothing deploys).
    ``batch_window_s`` and ``max_batch`` shape the groups enrollments are carried out in (see
    the module docstring).
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
        *,
        batch_window_s: float = BATCH_WINDOW_S,
        max_batch: int = MAX_BATCH,
    ) -> None:
        if max_batch < 1 or batch_window_s < 0:
            raise ValueError("max_batch must be >= 1 and batch_window_s >= 0")
        self._db = db
        self._provisioner = provisioner
        self._trust = trust
        self._settings = settings
        self._clock = clock
        self._outcomes = metrics.enrollments
        self._deployments = deployments
        self._window_s = batch_window_s
        self._max_batch = max_batch
        self._queue: deque[_Job] = deque()
        self._runner: asyncio.Task[None] | None = None
        self.groups_run = 0
        """Decision transactions run so far (one per group, plus one per broker refusal)."""

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
            answer = await self._submit(req, force, now)
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
        return answer

    async def _submit(self, req: EnrollmentRequest, force: bool, now: datetime) -> EnrollmentAnswer:
        """Queue the request and wait for its group to be carried out."""
        loop = asyncio.get_running_loop()
        job = _Job(req, force, now, loop.create_future())
        self._queue.append(job)
        if self._runner is None or self._runner.done():
            self._runner = loop.create_task(self._run(), name="enrollment-groups")
        return await job.future

    async def _run(self) -> None:
        """Carry out groups until the queue is empty. A burst arriving at an idle service waits
        ``batch_window_s`` to gather; requests that arrive during a group form the next."""
        if self._window_s > 0 and len(self._queue) < self._max_batch:
            await asyncio.sleep(self._window_s)
        while self._queue:
            jobs = self._take_group()
            if not jobs:
                continue
            try:
                await self._run_group(jobs)
            except Exception as e:  # a database or trust failure: every request of the group
                log.warning("enrollment of %d devices failed: %s", len(jobs), e)
                for job in jobs:
                    job.fail(e)
            except BaseException:
                for job in jobs:
                    job.future.cancel()
                raise

    def _take_group(self) -> list[_Job]:
        """Up to ``max_batch`` queued requests, no two with a claim in common; a request that
        shares one with an earlier request stays queued, in order, for the next group."""
        group: list[_Job] = []
        later: list[_Job] = []
        claimed: set[str] = set()
        while self._queue and len(group) < self._max_batch:
            job = self._queue.popleft()
            if job.future.done():  # its caller went away
                continue
            if job.claims & claimed:
                later.append(job)
                continue
            claimed |= job.claims
            group.append(job)
        self._queue.extendleft(reversed(later))
        return group

    async def _run_group(self, jobs: list[_Job]) -> None:
        group = await self._remember_nonces(jobs)
        while True:
            if not group:
                return
            try:
                staged, credentials, refused = await self._decide_group(group)
                break
            except _BrokerRefused as broker_refused:
                for job, error in broker_refused.failures:
                    job.fail(error)
                group = broker_refused.others
        for job, error in refused:
            job.fail(error)
        trust = await self._trust.trust_root() if credentials else None
        answers = [(s, self._answer(s, credentials.get(s.view.id), trust)) for s in staged]
        for s, _ in answers:
            if s.view.status == DeviceStatus.ACCEPTED.value:
                await self._apply_standing_deployments(s.view.id)
        for s, answer in answers:
            if not s.job.future.done():
                s.job.future.set_result(answer)

    async def _remember_nonces(self, jobs: Sequence[_Job]) -> list[_Job]:
        """Commit the nonces of ``jobs`` on their own, first; fail the replays and return the
        others (of two requests with one nonce in a group, the second is a replay)."""
        now = max(job.now for job in jobs)
        async with self._db.transaction() as tx:
            fresh = await token_q.remember_nonces(
                tx, [job.req.nonce for job in jobs], now=now, expires_at=now + nonce_retention()
            )
        first: list[_Job] = []
        for job in jobs:
            if job.req.nonce in fresh:
                fresh.discard(job.req.nonce)
                first.append(job)
            else:
                job.fail(ReplayError("enrollment request replayed: its nonce was seen before"))
        return first

    async def _decide_group(
        self, jobs: Sequence[_Job]
    ) -> tuple[list[_Staged], dict[str, Credentials], list[tuple[_Job, Exception]]]:
        """One transaction: each request's decision and changes in its savepoint, then every
        accepted device's broker account; committed only when the broker took them all.

        Returns what was committed, the accounts by device id, and the requests refused or in
        conflict (each on its own). Raises :class:`_BrokerRefused` (after the rollback) when the
        broker refused some accounts: every other request is to be decided again, refused ones
        included (a token use they lacked may be free once the refused request is gone).
        """
        self.groups_run += 1
        staged: list[_Staged] = []
        refused: list[tuple[_Job, Exception]] = []
        credentials: dict[str, Credentials] = {}
        tokens: dict[str, EnrollmentToken | None] = {}
        async with self._db.transaction() as tx:
            for job in jobs:
                try:
                    async with savepoint(tx):
                        staged.append(await self._stage(tx, job, tokens))
                except (EnrollmentError, ConflictError, NotFoundError) as e:
                    refused.append((job, e))
            accepted = [s for s in staged if s.view.status == DeviceStatus.ACCEPTED.value]
            results = await asyncio.gather(
                *(self._provision(s.view.id, s.decision) for s in accepted),
                return_exceptions=True,
            )
            failures: list[tuple[_Job, Exception]] = []
            for s, result in zip(accepted, results, strict=True):
                if isinstance(result, Credentials):
                    credentials[s.view.id] = result
                elif isinstance(result, Exception):
                    failures.append((s.job, result))
                else:
                    raise result
            if failures:
                failed = {id(job) for job, _ in failures}
                raise _BrokerRefused(failures, [j for j in jobs if id(j) not in failed])
        return staged, credentials, refused

    async def _stage(self, tx: Tx, job: _Job, tokens: dict[str, EnrollmentToken | None]) -> _Staged:
        """Decide ``job`` and make its changes in ``tx``; ``tokens`` caches the group's token
        lookups by digest (the use itself is counted by one conditional UPDATE each)."""
        req, now = job.req, job.now
        existing = await device_q.get_device_by_key(tx, req.public_key, lock=True)
        token = None
        if existing is None:
            digest = secret_digest(req.token)
            if digest not in tokens:
                tokens[digest] = await token_q.find_token(tx, digest)
            token = tokens[digest]
        decision = plan(
            existing=DeviceStatus(existing.status) if existing else None,
            token=token_facts(token) if token is not None else None,
            manual_policy=self._settings.enrollment_approval is EnrollmentApproval.MANUAL,
            force=job.force,
            now=now,
        )
        if decision.action is Action.REFUSE:
            assert decision.refusal is not None
            raise EnrollmentRefusedError(decision.refusal)
        if decision.action is Action.CREATE:
            assert token is not None
            view = await self._create(tx, req, decision, now, token)
        elif decision.action in (Action.ACCEPT_PREAUTHORIZED, Action.REENROLL):
            assert existing is not None
            view = await self._refresh(tx, existing, req, decision, now)
        else:
            assert existing is not None
            view = existing
        return _Staged(job, decision, view)

    def _answer(
        self, staged: _Staged, creds: Credentials | None, trust: TrustRoot | None
    ) -> EnrollmentAnswer:
        decision, view = staged.decision, staged.view
        outcome = "unchanged" if decision.action is Action.UNCHANGED else view.status
        if decision.action is Action.REENROLL:
            outcome = "reenrolled"
        self._outcomes.labels(outcome).inc()
        log.info("enrollment of %s: %s", view.id, outcome)
        if creds is None:
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
            broker=BrokerCredentials(
                urls=list(self._settings.broker_urls),
                username=creds.username,
                password=creds.password,
                client_id=creds.client_id,
            ),
            trust=trust,
            message=message,
        )

    async def _create(
        self, tx: Tx, req: EnrollmentRequest, decision: Plan, now: datetime, token: EnrollmentToken
    ) -> DeviceView:
        assert decision.status is not None
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
