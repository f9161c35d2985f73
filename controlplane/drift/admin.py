"""What operators do with drift (the REST API and the CLI call these): read and change rules,
read and acknowledge retraining triggers, read the fleet's buckets and a device's reports.

Every change is written with its audit entry in one transaction (actions ``drift.rule_set``,
``drift.rule_deleted``, ``drift.trigger_acknowledged``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from mcp_edge.controlplane.db import Database
from mcp_edge.controlplane.db import audit as audit_q
from mcp_edge.controlplane.db import drift as q
from mcp_edge.controlplane.db import hard_examples as examples_q
from mcp_edge.controlplane.db import webhooks as webhooks_q
from mcp_edge.controlplane.db.drift import AggregateView, ReportScore, ReportView, TriggerView
from mcp_edge.controlplane.db.webhooks import DeliveryView
from mcp_edge.controlplane.drift.rules import DEFAULT_MODEL, DriftRule, RuleError
from mcp_edge.controlplane.drift.service import EVENT, effective_rule, rule_of
from mcp_edge.shared.errors import McpError

Clock = Callable[[], datetime]
STATUSES = ("open", "acknowledged")
RULE_FIELDS = (
    "threshold", "metric", "min_devices", "min_samples", "sustained", "cooldown_s", "window_s",
    "enabled", "collect_hard_examples",
)  # fmt: skip


class DriftAdminError(McpError):
    """A drift request that cannot be done as asked."""


class TriggerNotFoundError(DriftAdminError):
    pass


class RuleNotFoundError(DriftAdminError):
    pass


class InvalidRuleError(DriftAdminError):
    pass


@dataclass(frozen=True)
class RuleInForce:
    """The rule that applies to a model, and where it comes from: ``model`` (its own),
    ``default`` (the ``*`` rule) or ``builtin`` (no rule stored)."""

    rule: DriftRule
    source: str
    updated_at: datetime | None = None
    updated_by: str | None = None


@dataclass(frozen=True)
class TriggerRecord:
    """A trigger with what followed it: the webhook deliveries of its ``retraining.triggered``
    event (one per webhook that wanted it, oldest first) and the hard examples collected."""

    trigger: TriggerView
    deliveries: list[DeliveryView]
    hard_examples: int


class DriftAdmin:
    def __init__(self, db: Database, clock: Clock) -> None:
        self.db = db
        self._clock = clock

    # ------------------------------------------------------------------ rules
    async def rule(self, model: str) -> RuleInForce:
        """The rule in force for ``model`` (``*``: the default rule)."""
        async with self.db.read() as tx:
            if model == DEFAULT_MODEL:
                row = await q.get_rule(tx, DEFAULT_MODEL)
                rule = rule_of(row, DEFAULT_MODEL)
                source = "default" if row is not None else "builtin"
            else:
                rule, source = await effective_rule(tx, model)
                row = await q.get_rule(tx, model if source == "model" else DEFAULT_MODEL)
        return RuleInForce(
            rule, source, row.updated_at if row else None, row.updated_by if row else None
        )

    async def rules(self) -> list[RuleInForce]:
        """Every stored rule (the default first when there is one)."""
        async with self.db.read() as tx:
            rows = await q.list_rules(tx)
        out = []
        for row in sorted(rows, key=lambda r: (r.model != DEFAULT_MODEL, r.model)):
            rule = DriftRule(model=row.model, **{k: getattr(row, k) for k in RULE_FIELDS})
            source = "default" if row.model == DEFAULT_MODEL else "model"
            out.append(RuleInForce(rule, source, row.updated_at, row.updated_by))
        return out

    async def set_rule(self, model: str, changes: Mapping[str, Any], *, actor: str) -> RuleInForce:
        """Store ``model``'s rule: ``changes`` over the rule in force now. Raises
        :class:`InvalidRuleError` for settings out of bounds."""
        unknown = set(changes) - set(RULE_FIELDS)
        if unknown:
            raise InvalidRuleError(f"unknown rule setting(s): {', '.join(sorted(unknown))}")
        now = self._clock()
        async with self.db.transaction() as tx:
            current, _ = await effective_rule(tx, model)
            try:
                rule = replace(current, model=model, **changes)
            except (RuleError, TypeError) as e:
                raise InvalidRuleError(str(e)) from e
            values = {k: getattr(rule, k) for k in RULE_FIELDS}
            row = await q.upsert_rule(
                tx, {"model": model, **values, "updated_at": now, "updated_by": actor}
            )
            await audit_q.insert_entry(
                tx, at=now, actor=actor, action="drift.rule_set", target_type="drift_rule",
                target_id=model, detail={"changed": dict(changes), "rule": values},
            )  # fmt: skip
        source = "default" if model == DEFAULT_MODEL else "model"
        return RuleInForce(rule, source, row.updated_at, row.updated_by)

    async def delete_rule(self, model: str, *, actor: str) -> RuleInForce:
        """Remove ``model``'s own rule (it falls back on the default); return what applies now.
        Raises :class:`RuleNotFoundError` when it had none."""
        now = self._clock()
        async with self.db.transaction() as tx:
            if not await q.delete_rule(tx, model):
                raise RuleNotFoundError(f"{model} has no drift rule of its own")
            await audit_q.insert_entry(
                tx, at=now, actor=actor, action="drift.rule_deleted", target_type="drift_rule",
                target_id=model, detail={},
            )  # fmt: skip
        return await self.rule(model)

    # ------------------------------------------------------------------ triggers
    async def triggers(
        self,
        *,
        model: str | None = None,
        version: str | None = None,
        status: str | None = None,
        before_id: int | None = None,
        limit: int = 100,
    ) -> list[TriggerView]:
        async with self.db.read() as tx:
            return await q.list_triggers(
                tx, model=model, version=version, status=status, before_id=before_id, limit=limit
            )

    async def trigger(self, trigger_id: int) -> TriggerView:
        async with self.db.read() as tx:
            found = await q.get_trigger(tx, trigger_id)
        if found is None:
            raise TriggerNotFoundError(f"no retraining trigger {trigger_id}")
        return found

    async def record(self, trigger_id: int, *, max_deliveries: int = 100) -> TriggerRecord:
        """A trigger with its webhook deliveries and hard-example count. Raises
        :class:`TriggerNotFoundError`."""
        async with self.db.read() as tx:
            found = await q.get_trigger(tx, trigger_id)
            if found is None:
                raise TriggerNotFoundError(f"no retraining trigger {trigger_id}")
            deliveries = await webhooks_q.list_deliveries(
                tx, event=EVENT, data={"trigger_id": trigger_id}, limit=max_deliveries
            )
            examples = await examples_q.count_examples(tx, trigger_id)
        return TriggerRecord(found, deliveries, examples)

    async def acknowledge(self, trigger_id: int, *, actor: str, note: str = "") -> TriggerView:
        """Mark a trigger acknowledged by ``actor`` (again: the note and time are replaced)."""
        now = self._clock()
        async with self.db.transaction() as tx:
            found = await q.acknowledge(tx, trigger_id, actor=actor, note=note, now=now)
            if found is None:
                raise TriggerNotFoundError(f"no retraining trigger {trigger_id}")
            await audit_q.insert_entry(
                tx, at=now, actor=actor, action="drift.trigger_acknowledged",
                target_type="retraining_trigger", target_id=str(trigger_id),
                detail={"model": found.model, "version": found.version, "note": note[:256]},
            )  # fmt: skip
        return found

    # ------------------------------------------------------------------ figures
    async def buckets(
        self,
        model: str,
        *,
        version: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        limit: int = 1000,
    ) -> list[AggregateView]:
        async with self.db.read() as tx:
            return await q.list_aggregates(
                tx, model=model, version=version, since=since, until=until, limit=limit
            )

    async def reports(
        self,
        device_id: str,
        *,
        model: str | None = None,
        version: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        limit: int = 1000,
    ) -> list[ReportView]:
        async with self.db.read() as tx:
            return await q.list_reports(
                tx, device_id=device_id, model=model, version=version, since=since,
                until=until, limit=limit,
            )  # fmt: skip

    async def report_scores(
        self,
        device_id: str,
        *,
        model: str | None = None,
        since: datetime | None = None,
        limit: int = 1000,
    ) -> list[ReportScore]:
        """A device's reports without their counts, oldest first (the newest ``limit``)."""
        async with self.db.read() as tx:
            return await q.report_scores(
                tx, device_id=device_id, model=model, since=since, limit=limit
            )

    async def latest_by_device(
        self,
        model: str,
        version: str,
        *,
        since: datetime | None = None,
        order: str = "-score",
        limit: int = 100,
        offset: int = 0,
    ) -> tuple[int, list[ReportScore]]:
        """How many devices reported a version since ``since``, and a page of each one's
        newest report (``order``: :data:`controlplane.db.drift.SCORE_ORDERS`)."""
        async with self.db.read() as tx:
            return await q.latest_scores(
                tx, model=model, version=version, since=since, order=order, limit=limit,
                offset=offset,
            )  # fmt: skip
