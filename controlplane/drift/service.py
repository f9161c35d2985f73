"""The drift store: devices' reports refused or stored, summed per version and time bucket, and
the rules that raise retraining triggers (docs/drift.md).

Ingestion (:mod:`controlplane.ingest`) decodes each report (:func:`.sample.decode_drift`) and
hands a batch to :meth:`DriftService.store`, which

1. **refuses** what must not move an aggregate, each counted in
   ``mcp_cp_drift_reports_refused_total{reason}`` (:class:`Refusal`): a window ending far in
   the future or long ago (``window``), more than ``max_reports_per_minute`` reports from one
   device (``flood``), a model version that is not published (``unknown_version``) or has no
   baseline (``no_baseline``), counts that do not fit the baseline's bins (``bins``,
   ``unknown_feature``), a version the device neither is told to run nor reports running
   (``version_not_running``);
2. **stores** the rest in one transaction: one ``drift_reports`` row each, with the control
   plane's own scores of its counts (one vectorised pass over the batch); each touched
   ``(model, version, bucket)`` aggregate gets the batch's summed counts added and the PSI of
   the new sum computed (never an average of PSIs); the bucket is ``over`` or not by the
   model's rule (:mod:`.rules`);
3. **evaluates** each touched version's rule and raises at most one retraining trigger per
   cooldown, in the same transaction: the ``retraining_triggers`` row, an audit entry and the
   ``retraining.triggered`` webhook event; after the commit, the counter
   ``mcp_cp_retraining_triggers_total{model}``, a log line and every ``on_trigger`` callback.
"""

from __future__ import annotations

import enum
import logging
import math
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

import numpy as np
import orjson
from pydantic import ValidationError

from mcp_edge.controlplane.db import Database, Tx
from mcp_edge.controlplane.db import audit as audit_q
from mcp_edge.controlplane.db import drift as q
from mcp_edge.controlplane.db.drift import TriggerView
from mcp_edge.controlplane.drift.rules import (
    DEFAULT_MODEL,
    Bucket,
    DriftRule,
    cooled_down,
    sustained_over,
)
from mcp_edge.controlplane.drift.sample import DriftSample
from mcp_edge.controlplane.drift.scoring import Layout, RowScores, figures
from mcp_edge.controlplane.metrics import ControlPlaneMetrics
from mcp_edge.shared.bundle.manifest import DriftBaseline

log = logging.getLogger("mcp.controlplane.drift")

Clock = Callable[[], datetime]
Notify = Callable[[Tx, str, Mapping[str, Any], datetime], Awaitable[None]]
OnTrigger = Callable[[TriggerView], Awaitable[None]]
EVENT = "retraining.triggered"
SYSTEM = "system"
TRIGGER_PATH = "/api/v1/drift/triggers/{id}"
WEBHOOK_DEVICES = 500
"""A webhook event lists at most this many device ids (the trigger holds up to 1,000)."""
BASELINE_CACHE_S = 60.0
CHUNK = 1024
"""Reports aligned, scored and inserted at a time."""


class Refusal(str, enum.Enum):
    """Why a drift report was not stored (the ``reason`` of the refused counter). The first
    five are counted by ingestion before a report reaches the store."""

    SCHEMA = "schema"
    TOO_LARGE = "too_large"
    MALFORMED_JSON = "malformed_json"
    DEVICE_MISMATCH = "device_mismatch"
    UNKNOWN_DEVICE = "unknown_device"
    WINDOW = "window"
    FLOOD = "flood"
    UNKNOWN_VERSION = "unknown_version"
    NO_BASELINE = "no_baseline"
    BINS = "bins"
    UNKNOWN_FEATURE = "unknown_feature"
    VERSION_NOT_RUNNING = "version_not_running"
    BACKLOG_FULL = "backlog_full"
    DB_ERROR = "db_error"
    INTERNAL = "internal"


@dataclass(frozen=True)
class StoreResult:
    """What one :meth:`DriftService.store` did."""

    stored: int = 0
    refused: Mapping[str, int] = field(default_factory=dict)
    buckets: int = 0
    """Aggregate buckets the batch added to."""
    triggers: tuple[TriggerView, ...] = ()


class _Flood:
    """Per-device token buckets: ``per_minute`` reports a minute, bursts up to that many."""

    def __init__(self, per_minute: int) -> None:
        self.per_minute = per_minute
        self._tokens: dict[str, tuple[float, float]] = {}

    def admit(self, device_id: str, at: float) -> bool:
        rate = self.per_minute / 60.0
        tokens, last = self._tokens.get(device_id, (float(self.per_minute), at))
        tokens = min(float(self.per_minute), tokens + max(at - last, 0.0) * rate)
        if tokens < 1.0:
            self._tokens[device_id] = (tokens, at)
            return False
        self._tokens[device_id] = (tokens - 1.0, at)
        if len(self._tokens) > 200_000:  # forget the devices whose bucket is full again
            cut = at - 60.0
            self._tokens = {d: v for d, v in self._tokens.items() if v[1] >= cut}
        return True


def _at(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, timezone.utc)


def rule_of(row: q.RuleView | None, model: str) -> DriftRule:
    """The rule a stored row describes (the built-in default without one)."""
    if row is None:
        return DriftRule(model=model)
    return DriftRule(
        model=model, threshold=row.threshold, metric=row.metric, min_devices=row.min_devices,
        min_samples=row.min_samples, sustained=row.sustained, cooldown_s=row.cooldown_s,
        window_s=row.window_s, enabled=row.enabled,
        collect_hard_examples=row.collect_hard_examples,
    )  # fmt: skip


async def effective_rule(tx: Tx, model: str) -> tuple[DriftRule, str]:
    """The rule that applies to ``model`` and where it comes from (``model``, ``default``
    or ``builtin``)."""
    own = await q.get_rule(tx, model)
    if own is not None:
        return rule_of(own, model), "model"
    default = await q.get_rule(tx, DEFAULT_MODEL)
    return rule_of(default, model), "default" if default is not None else "builtin"


class DriftService:
    """Stores drift reports, keeps the fleet aggregates and raises retraining triggers.

    ``notify`` queues webhook events (:meth:`controlplane.webhooks.WebhookDispatcher.notify`).
    ``on_trigger``: coroutines called with each trigger once its transaction committed (a
    failing one is logged, the others still run).
    """

    def __init__(
        self,
        db: Database,
        clock: Clock,
        *,
        metrics: ControlPlaneMetrics,
        notify: Notify | None = None,
        max_reports_per_minute: int = 60,
        future_s: float = 600.0,
        stale_s: float = 3600.0,
    ) -> None:
        self.db = db
        self._clock = clock
        self._metrics = metrics
        self._notify = notify
        self._flood = _Flood(max_reports_per_minute)
        self._future_s = future_s
        self._stale_s = stale_s
        self._baselines: dict[tuple[str, str], tuple[float, Layout | None, bool]] = {}
        self.on_trigger: list[OnTrigger] = []

    # ------------------------------------------------------------------ counting
    def refused(self, reason: Refusal | str, count: int = 1) -> None:
        """Count ``count`` reports refused for ``reason``."""
        value = reason.value if isinstance(reason, Refusal) else reason
        self._metrics.drift_refused.labels(value).inc(count)

    # ------------------------------------------------------------------ baselines
    async def layout(self, tx: Tx, model: str, version: str) -> tuple[bool, Layout | None]:
        """``(published, layout of its baseline)``, cached for a minute."""
        key = (model, version)
        now = time.monotonic()
        cached = self._baselines.get(key)
        if cached is not None and now - cached[0] < BASELINE_CACHE_S:
            return cached[2], cached[1]
        published, document = await q.baseline_of(tx, model, version)
        layout = None
        if document is not None:
            try:
                layout = Layout(DriftBaseline.model_validate_json(orjson.dumps(document)))
            except ValidationError as e:
                log.warning(
                    "drift: the stored baseline of %s %s is unusable: %s", model, version, e
                )
        if len(self._baselines) > 1024:
            self._baselines.clear()
        self._baselines[key] = (now, layout, published)
        return published, layout

    # ------------------------------------------------------------------ the store
    def _screen(self, samples: Sequence[DriftSample], refused: Counter[str]) -> list[DriftSample]:
        kept = []
        for s in samples:
            if (
                s.window_end > s.received_at + self._future_s
                or s.window_end < s.received_at - self._stale_s
            ):
                refused[Refusal.WINDOW.value] += 1
            elif not self._flood.admit(s.device_id, s.received_at):
                refused[Refusal.FLOOD.value] += 1
            else:
                kept.append(s)
        return kept

    async def store(self, samples: Sequence[DriftSample]) -> StoreResult:
        """Refuse, store and aggregate one batch, and evaluate the rules it touched (see the
        module docstring). Raises :mod:`controlplane.db.errors` (nothing is stored then)."""
        started = time.process_time()
        refused: Counter[str] = Counter()
        kept = self._screen(samples, refused)
        now = self._clock()
        raised: list[TriggerView] = []
        stored = buckets = 0
        if kept:
            async with self.db.transaction() as tx:
                groups = await self._fitting(tx, kept, refused)
                for (model, version), (layout, group) in sorted(groups.items()):
                    rule, source = await effective_rule(tx, model)
                    sums = await self._insert(tx, rule, layout, group)
                    stored += len(group)
                    touched = await self._aggregate(tx, rule, layout, model, version, sums, now)
                    buckets += len(touched)
                    current = max(touched)
                    trigger = await self._evaluate(
                        tx, rule, source, version, current, touched[current], now
                    )
                    if trigger is not None:
                        raised.append(trigger)
        for reason, n in refused.items():
            self.refused(reason, n)
        self._metrics.drift_reports.inc(stored)
        self._metrics.drift_store_cpu.observe(time.process_time() - started)
        for trigger in raised:
            await self._announce(trigger)
        return StoreResult(stored, dict(refused), buckets, tuple(raised))

    async def _fitting(
        self, tx: Tx, samples: Sequence[DriftSample], refused: Counter[str]
    ) -> dict[tuple[str, str], tuple[Layout, list[DriftSample]]]:
        """The samples that fit their version's baseline and that their device runs, grouped
        by version."""
        by_version: dict[tuple[str, str], list[DriftSample]] = defaultdict(list)
        for s in samples:
            by_version[(s.model, s.version)].append(s)
        fitting: dict[tuple[str, str], tuple[Layout, list[DriftSample]]] = {}
        for key, group in by_version.items():
            published, layout = await self.layout(tx, *key)
            if layout is None:
                reason = Refusal.NO_BASELINE if published else Refusal.UNKNOWN_VERSION
                refused[reason.value] += len(group)
                continue
            ok = []
            for sample in group:
                reason_of = layout.misfit(sample)
                if reason_of is None:
                    ok.append(sample)
                else:
                    refused[reason_of] += 1
            if ok:
                fitting[key] = (layout, ok)
        out = {}
        for (model, version), (layout, group) in fitting.items():
            ids = {s.device_id for s in group}
            running = await q.running_devices(tx, model, version, ids)
            if len(running) < len(ids):
                running |= await q.reported_running(tx, model, version, ids - running)
            keep = [s for s in group if s.device_id in running]
            if len(keep) < len(group):
                refused[Refusal.VERSION_NOT_RUNNING.value] += len(group) - len(keep)
            if keep:
                out[(model, version)] = (layout, keep)
        return out

    async def _insert(
        self, tx: Tx, rule: DriftRule, layout: Layout, group: Sequence[DriftSample]
    ) -> dict[float, tuple[np.ndarray[Any, Any], int, int]]:
        """Store the reports, ``CHUNK`` at a time (their counts aligned, scored and summed per
        bucket chunk by chunk: the batch's counts are never one large matrix in memory).
        Returns ``bucket start -> (summed counts, samples, reports)``."""
        sums: dict[float, tuple[np.ndarray[Any, Any], int, int]] = {}
        w = rule.window_s
        for at in range(0, len(group), CHUNK):
            chunk = group[at : at + CHUNK]
            rows = layout.rows(chunk)
            scores = layout.score_rows(rows)
            starts = [math.floor(s.received_at / w) * float(w) for s in chunk]
            for start in set(starts):
                mask = np.fromiter((b == start for b in starts), dtype=bool, count=len(starts))
                total, samples, reports = sums.get(start, (layout.zero(), 0, 0))
                sums[start] = (
                    total + rows[mask].sum(axis=0),
                    samples + sum(s.samples for s, m in zip(chunk, mask, strict=True) if m),
                    reports + int(mask.sum()),
                )
            await q.insert_reports(tx, _report_rows(chunk, scores))
        return sums

    async def _aggregate(
        self,
        tx: Tx,
        rule: DriftRule,
        layout: Layout,
        model: str,
        version: str,
        sums: Mapping[float, tuple[np.ndarray[Any, Any], int, int]],
        now: datetime,
    ) -> dict[float, tuple[dict[str, Any], float | None]]:
        """Add the batch's sums to their buckets; return each touched bucket's start with its
        new figures and score."""
        touched = {}
        for start in sorted(sums):
            added, samples, reports = sums[start]
            at = _at(start)
            current = await q.lock_aggregate(tx, model, version, at, rule.window_s, now)
            total = layout.from_document(current.counts) + added
            samples += current.samples
            devices = await q.bucket_devices(
                tx, model, version, at, at + timedelta(seconds=rule.window_s)
            )
            scores = layout.score(total, samples)
            shown = figures(scores)
            await q.update_aggregate(
                tx, model, version, at, rule.window_s,
                samples=samples, reports=current.reports + reports, devices=devices,
                counts=layout.to_document(total), score=scores.score, input_psi=scores.input_psi,
                class_psi=scores.class_psi, confidence_psi=scores.confidence_psi, figures=shown,
                over=rule.bucket_over(shown, samples, devices), updated_at=now,
            )  # fmt: skip
            touched[start] = (shown, scores.score)
        return touched

    async def _evaluate(
        self,
        tx: Tx,
        rule: DriftRule,
        source: str,
        version: str,
        current: float,
        newest: tuple[dict[str, Any], float | None],
        now: datetime,
    ) -> TriggerView | None:
        """Raise a trigger when the rule says so (see :mod:`.rules`)."""
        model = rule.model
        if not rule.enabled:
            return None
        recent = await q.recent_buckets(
            tx, model, version, rule.window_s, _at(current), rule.sustained
        )
        buckets = [Bucket(start.timestamp(), over) for start, over in recent]
        if not sustained_over(rule, buckets, current):
            return None
        last = await q.last_raised(tx, model, version)
        if not cooled_down(rule, last.timestamp() if last else None, now.timestamp()):
            return None
        first = _at(current - (rule.sustained - 1) * rule.window_s)
        count, ids = await q.devices_between(
            tx, model, version, first, _at(current + rule.window_s)
        )
        shown, score = dict(newest[0]), newest[1]
        shown.update(metric=rule.metric, value=shown.get(rule.metric),
                     buckets=[[_at(b.start).isoformat(), b.over] for b in buckets])  # fmt: skip
        trigger = await q.insert_trigger(
            tx, model=model, version=version, raised_at=now, status="open",
            score=score, figures=shown, rule={**rule.as_dict(), "source": source},
            device_count=count,
            device_ids=ids, note="",
        )  # fmt: skip
        await audit_q.insert_entry(
            tx, at=now, actor=SYSTEM, action="drift.trigger_raised",
            target_type="retraining_trigger", target_id=str(trigger.id),
            detail={"model": model, "version": version, "metric": rule.metric,
                    "value": shown.get(rule.metric), "devices": count},
        )  # fmt: skip
        if self._notify is not None:
            await self._notify(tx, EVENT, webhook_body(trigger), now)
        return trigger

    async def _announce(self, trigger: TriggerView) -> None:
        self._metrics.retraining_triggers.labels(trigger.model).inc()
        rule = trigger.rule
        log.warning(
            "retraining trigger %d: %s %s drifted (%s %.3g > %.3g over %d bucket(s) of %d s, "
            "%d device(s))",
            trigger.id, trigger.model, trigger.version, rule.get("metric"),
            trigger.figures.get("value") or 0.0, rule.get("threshold"), rule.get("sustained"),
            rule.get("window_s"), trigger.device_count,
        )  # fmt: skip
        for callback in self.on_trigger:
            try:
                await callback(trigger)
            except Exception:
                log.exception("drift: a trigger callback failed for trigger %d", trigger.id)

    # ------------------------------------------------------------------ retention
    async def expire(self, *, reports_older: timedelta, aggregates_older: timedelta) -> int:
        """Delete old reports and buckets; return the reports deleted."""
        now = self._clock()
        async with self.db.transaction() as tx:
            return await q.expire(
                tx, reports_before=now - reports_older, aggregates_before=now - aggregates_older
            )


def _report_rows(chunk: Sequence[DriftSample], scores: RowScores) -> list[tuple[Any, ...]]:
    """The ``drift_reports`` rows of a chunk (:data:`controlplane.db.drift.REPORT_COLUMNS`),
    with the control plane's own scores."""
    return [
        (s.device_id, s.model, s.version, s.role, _at(s.received_at), s.window_start,
         s.window_end, s.samples, s.sample_every, score, inp, cls, conf, s.counts_document(),
         s.hard_examples)
        for s, score, inp, cls, conf in zip(
            chunk,
            _optional(scores.score),
            _optional(scores.input_psi),
            _optional(scores.class_psi),
            _optional(scores.confidence_psi),
            strict=True,
        )
    ]  # fmt: skip


def _optional(values: np.ndarray[Any, Any]) -> list[float | None]:
    return [None if v != v else v for v in values.tolist()]  # NaN is the one value != itself


def webhook_body(trigger: TriggerView) -> dict[str, Any]:
    """The ``data`` of a ``retraining.triggered`` event (docs/drift.md#the-webhook)."""
    ids = trigger.device_ids[:WEBHOOK_DEVICES]
    body: dict[str, Any] = {
        "trigger_id": trigger.id,
        "model": trigger.model,
        "version": trigger.version,
        "raised_at": trigger.raised_at.isoformat().replace("+00:00", "Z"),
        "status": trigger.status,
        "score": trigger.score,
        "metric": trigger.rule.get("metric"),
        "value": trigger.figures.get("value"),
        "threshold": trigger.rule.get("threshold"),
        "figures": trigger.figures,
        "rule": trigger.rule,
        "device_count": trigger.device_count,
        "device_ids": ids,
        "device_ids_truncated": len(ids) < trigger.device_count,
        "url": TRIGGER_PATH.format(id=trigger.id),
    }
    while len(orjson.dumps(body)) > 60_000 and ids:
        ids = ids[: len(ids) // 2]
        body.update(device_ids=ids, device_ids_truncated=True)
    return body
