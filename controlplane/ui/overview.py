"""Console pages: the overview (``/ui/``), the fleet at a glance.

Devices online, offline and pending; accepted devices by hardware profile and by label; the
model versions devices report running; active rollouts; recent deployment failures and drift
triggers.

Online and offline are the REST API's ``status=online`` / ``status=offline``
(:func:`controlplane.api.devices.device_filter`): accepted devices whose broker session is up
(``devices.online``, kept by ingestion from the devices' birth and last-will messages), and
the other accepted devices. Pending devices wait for an operator (``/ui/enrollment``).

A deployment failure is an ``error`` event a device reported (a failed download,
verification, install, warm-up or activation), except a download error the agent retries on
its own (its message ends ``; retrying in N s``), as the rollout gates count them
(:func:`controlplane.db.rollouts.failed_versions`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from aiohttp import web
from sqlalchemy import case, func, select

from mcp_edge.controlplane.api.drift import DRIFT_ADMIN
from mcp_edge.controlplane.api.rollouts import ROLLOUTS
from mcp_edge.controlplane.auth import Role
from mcp_edge.controlplane.db import rollouts as rollout_q
from mcp_edge.controlplane.db.engine import Tx
from mcp_edge.controlplane.db.models import (
    DeploymentEventRow,
    Device,
    DeviceLabel,
    ReportedStateRow,
)
from mcp_edge.controlplane.enrollment import DeviceStatus
from mcp_edge.controlplane.rollouts.model import DevicePhase, RolloutStatus
from mcp_edge.controlplane.rollouts.service import RolloutDetail
from mcp_edge.controlplane.ui.core import Ctx, Page
from mcp_edge.controlplane.ui.rollouts import DONE_PHASES, STATUS_BADGE, status_text

ACCEPTED = DeviceStatus.ACCEPTED.value
TOP_LABELS = 20
RECENT = 10
ACTIVE_ROLLOUTS_SHOWN = 20
RETRIED_DOWNLOAD = "%; retrying in %"
ROLES = ("active", "canary", "shadow")


@dataclass(frozen=True)
class FleetCounts:
    online: int
    offline: int
    pending: int
    by_status: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.by_status.values())


@dataclass(frozen=True)
class GroupCount:
    """Accepted devices sharing one value (a profile, a label), online and offline."""

    name: str
    online: int
    offline: int

    @property
    def total(self) -> int:
        return self.online + self.offline


@dataclass(frozen=True)
class RunningVersion:
    """Devices that last reported running ``version`` of ``model``, by the part it plays."""

    model: str
    version: str
    active: int
    canary: int
    shadow: int


@dataclass(frozen=True)
class Failure:
    device_id: str
    model: str
    version: str
    phase: str
    cause: str | None
    message: str
    received_at: datetime


@dataclass(frozen=True)
class RolloutProgress:
    """An active rollout as the overview lists it; ``done`` counts the devices the rollouts
    page counts as done (:data:`controlplane.ui.rollouts.DONE_PHASES`)."""

    id: int
    model: str
    version: str
    status_text: str
    badge: str
    stage: str
    target_devices: int
    done: int
    failed: int
    reason: str


# ---------------------------------------------------------------------------- queries
async def fleet_counts(tx: Tx) -> FleetCounts:
    """Devices by status, and accepted devices online and offline, in one query."""
    rows = await tx.execute(
        select(Device.status, Device.online, func.count()).group_by(Device.status, Device.online)
    )
    by_status: Counter[str] = Counter()
    online = offline = 0
    for status, is_online, n in rows:
        by_status[str(status)] += int(n)
        if status == ACCEPTED:
            if is_online:
                online += int(n)
            else:
                offline += int(n)
    return FleetCounts(online, offline, by_status[DeviceStatus.PENDING.value], dict(by_status))


def _online_sum() -> Any:
    return func.sum(case((Device.online.is_(True), 1), else_=0))


async def by_profile(tx: Tx) -> list[GroupCount]:
    """Accepted devices per hardware profile (most devices first; no profile: ``""``)."""
    rows = await tx.execute(
        select(Device.profile, func.count(), _online_sum())
        .where(Device.status == ACCEPTED)
        .group_by(Device.profile)
        .order_by(func.count().desc(), Device.profile)
    )
    return [GroupCount(p or "", int(on or 0), int(n) - int(on or 0)) for p, n, on in rows]


async def top_labels(tx: Tx, limit: int = TOP_LABELS) -> list[GroupCount]:
    """The ``limit`` label ``key=value`` pairs most accepted devices carry."""
    rows = await tx.execute(
        select(DeviceLabel.key, DeviceLabel.value, func.count(), _online_sum())
        .join(Device, Device.id == DeviceLabel.device_id)
        .where(Device.status == ACCEPTED)
        .group_by(DeviceLabel.key, DeviceLabel.value)
        .order_by(func.count().desc(), DeviceLabel.key, DeviceLabel.value)
        .limit(limit)
    )
    return [GroupCount(f"{k}={v}", int(on or 0), int(n) - int(on or 0)) for k, v, n, on in rows]


def count_running(documents: Iterable[Any]) -> list[RunningVersion]:
    """What reported-state documents say devices run: per model and version, how many devices
    run it active, as canary and as shadow. Entries that are not well formed are skipped."""
    counts: dict[tuple[str, str], Counter[str]] = {}
    for document in documents:
        models = document.get("models") if isinstance(document, Mapping) else None
        for m in models if isinstance(models, list) else ():
            if not isinstance(m, Mapping) or not isinstance(m.get("name"), str):
                continue
            for role in ROLES:
                version = m.get(f"{role}_version")
                if isinstance(version, str):
                    counts.setdefault((m["name"], version), Counter())[role] += 1
    return [
        RunningVersion(model, version, c["active"], c["canary"], c["shadow"])
        for (model, version), c in sorted(counts.items())
    ]


async def running_versions(tx: Tx) -> list[RunningVersion]:
    """The model versions accepted devices last reported running, by model then version."""
    rows = await tx.execute(
        select(ReportedStateRow.document)
        .join(Device, Device.id == ReportedStateRow.device_id)
        .where(Device.status == ACCEPTED)
    )
    return count_running(doc for (doc,) in rows)


async def recent_failures(tx: Tx, limit: int = RECENT) -> list[Failure]:
    """The newest deployment failures devices reported (see the module docstring)."""
    t = DeploymentEventRow
    rows = await tx.execute(
        select(t.device_id, t.model, t.version, t.phase, t.cause, t.message, t.received_at)
        .where(t.outcome == "error", t.message.not_like(RETRIED_DOWNLOAD))
        .order_by(t.id.desc())
        .limit(limit)
    )
    return [Failure(*row) for row in rows]


def rollout_progress(d: RolloutDetail) -> RolloutProgress:
    r, stages = d.rollout, len(d.spec.stages)
    return RolloutProgress(
        id=r.id,
        model=r.model,
        version=r.version,
        status_text=status_text(r.status),
        badge=STATUS_BADGE[RolloutStatus(r.status)],
        stage=f"{min(r.stage, stages - 1) + 1} of {stages}",
        target_devices=r.target_devices,
        done=sum(n for phase, n in d.phases.items() if DevicePhase(phase) in DONE_PHASES),
        failed=d.phases.get(DevicePhase.FAILED.value, 0),
        reason=d.state.reason,
    )


# ---------------------------------------------------------------------------- page
async def overview(ctx: Ctx) -> web.StreamResponse:
    async with ctx.svc.db.read() as tx:
        counts = await fleet_counts(tx)
        profiles = await by_profile(tx)
        labels = await top_labels(tx)
        running = await running_versions(tx)
        failures = await recent_failures(tx)
    rollouts = ctx.request.app.get(ROLLOUTS)
    active = (
        await rollouts.list_rollouts(
            limit=ACTIVE_ROLLOUTS_SHOWN, statuses=list(rollout_q.ACTIVE_STATUSES)
        )
        if rollouts is not None
        else []
    )
    drift = ctx.request.app.get(DRIFT_ADMIN)
    triggers = await drift.triggers(limit=RECENT) if drift is not None else []
    return ctx.render(
        "overview.html",
        counts=counts,
        profiles=profiles,
        labels=labels,
        running=running,
        rollouts=[rollout_progress(d) for d in active],
        failures=failures,
        triggers=triggers,
    )


PAGES: list[Page] = [Page("GET", "/ui/", overview, Role.VIEWER, nav="overview")]
