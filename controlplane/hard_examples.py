"""Hard examples: low-confidence inputs devices keep, collected when the control plane asks
(docs/hard-examples.md).

:meth:`HardExampleService.collect` sends ``upload_hard_examples`` (model, version, max_bytes)
to each device (:class:`~controlplane.commands.DeviceCommands`, at most ``concurrency`` at a
time; devices that are offline or not accepted are not asked) and checks every reply with
:func:`~controlplane.hard_example_checks.check_batch` (pure): each example names the model
and version asked, each tensor's length is its datatype's size times its shape's product, and
the raw bytes add up to no more than the budget asked (``max_bytes``, at most
:data:`~shared.protocol.state.MAX_HARD_EXAMPLE_BUDGET`). One bad example refuses the device's
whole batch (nothing half-written), counted in ``mcp_cp_hard_example_batches_refused_total
{reason}``.

A device's accepted batch is stored in one transaction: one row per example with the raw
tensor bytes exactly as decoded and the sha256 of the input bytes; an input already stored for
the same device under the same trigger (same sha256), or repeated in the batch, is a
duplicate and is not stored again. ``mcp_cp_hard_examples_total{outcome}`` counts ``stored``
and ``duplicate`` examples, ``mcp_cp_hard_example_collections_total{outcome}`` each device
asked, by how it ended (:class:`DeviceOutcome`).

:meth:`HardExampleService.on_trigger` is the retraining trigger service's callback: a trigger
whose rule asks for hard examples has its devices asked in the background.
"""

from __future__ import annotations

import asyncio
import logging
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from prometheus_client import CollectorRegistry, Counter

from mcp_edge.controlplane.audit import SYSTEM_ACTOR
from mcp_edge.controlplane.commands import (
    DEFAULT_TIMEOUT_S,
    CommandError,
    CommandTimeoutError,
    CommandUnavailableError,
    DeviceCommands,
)
from mcp_edge.controlplane.db import Database
from mcp_edge.controlplane.db import audit as audit_q
from mcp_edge.controlplane.db import hard_examples as q
from mcp_edge.controlplane.hard_example_checks import (
    BatchRefusedError,
    Example,
    HardExampleError,
    budget,
    check_batch,
)
from mcp_edge.shared.errors import McpError
from mcp_edge.shared.protocol.command import CommandName

log = logging.getLogger("mcp.controlplane.hard_examples")

Clock = Callable[[], datetime]
DEFAULT_CONCURRENCY = 16
Outcome = Literal["stored", "refused", "failed", "timeout", "unavailable", "offline", "unknown"]
OUTCOMES: tuple[Outcome, ...] = typing.get_args(Outcome)


class TriggerNotFoundError(HardExampleError):
    pass


# ---------------------------------------------------------------------------- results
@dataclass
class DeviceOutcome:
    """How asking one device ended. ``status``: ``stored`` (its batch was accepted, maybe
    empty), ``refused`` (its batch broke the contract), ``failed`` (it answered ok=false),
    ``timeout``, ``unavailable`` (the command could not be sent), ``offline``, ``unknown``
    (not an accepted device)."""

    device_id: str
    status: Outcome
    stored: int = 0
    duplicates: int = 0
    bytes: int = 0
    held: int = 0
    detail: str = ""


@dataclass
class CollectResult:
    trigger_id: int | None
    model: str
    version: str | None
    max_bytes: int
    devices: list[DeviceOutcome] = field(default_factory=list)

    @property
    def stored(self) -> int:
        return sum(d.stored for d in self.devices)

    @property
    def duplicates(self) -> int:
        return sum(d.duplicates for d in self.devices)

    def count(self, status: str) -> int:
        return sum(1 for d in self.devices if d.status == status)


class HardExampleMetrics:
    """Prometheus families of hard-example collection (on the control plane's registry)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = registry or CollectorRegistry()
        self.examples = Counter(
            "mcp_cp_hard_examples_total",
            "Hard examples received, stored or found already stored.",
            ["outcome"],
            registry=r,
        )
        self.collections = Counter(
            "mcp_cp_hard_example_collections_total",
            "Devices asked for hard examples, by how it ended.",
            ["outcome"],
            registry=r,
        )
        self.refused = Counter(
            "mcp_cp_hard_example_batches_refused_total",
            "Devices' hard-example batches refused whole, by reason.",
            ["reason"],
            registry=r,
        )


# ---------------------------------------------------------------------------- the service
class HardExampleService:
    """Collect hard examples from devices and store them (see the module docstring).

    ``commands`` None (no broker configured): every device asked ends ``unavailable``.
    """

    def __init__(
        self,
        db: Database,
        commands: DeviceCommands | None,
        clock: Clock,
        *,
        registry: CollectorRegistry | None = None,
        concurrency: int = DEFAULT_CONCURRENCY,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self.db = db
        self.commands = commands
        self.clock = clock
        self.metrics = HardExampleMetrics(registry)
        self.concurrency = concurrency
        self.timeout_s = timeout_s
        self._background: set[asyncio.Task[CollectResult | None]] = set()

    async def collect_trigger(
        self,
        trigger_id: int,
        *,
        device_ids: Sequence[str] | None = None,
        max_bytes: int | None = None,
        timeout_s: float | None = None,
        actor: str = SYSTEM_ACTOR,
    ) -> CollectResult:
        """Ask the devices of trigger ``trigger_id`` (all, or those of ``device_ids``, which
        must be among them) for hard examples of its model version, stored under the trigger.

        Raises :class:`TriggerNotFoundError`, :class:`HardExampleError` (a device that is not
        the trigger's), :class:`controlplane.db.DatabaseError`.
        """
        async with self.db.read() as tx:
            trigger = await q.get_trigger(tx, trigger_id)
        if trigger is None:
            raise TriggerNotFoundError(f"no retraining trigger {trigger_id}")
        devices = trigger.device_ids
        if device_ids is not None:
            others = sorted(set(device_ids) - set(devices))
            if others:
                raise HardExampleError(
                    f"not devices of trigger {trigger_id}: {', '.join(others[:10])}"
                )
            devices = list(device_ids)
        return await self.collect(
            model=trigger.model,
            version=trigger.version,
            device_ids=devices,
            max_bytes=max_bytes,
            trigger_id=trigger_id,
            timeout_s=timeout_s,
            actor=actor,
        )

    async def collect(
        self,
        *,
        model: str,
        version: str | None,
        device_ids: Sequence[str],
        max_bytes: int | None = None,
        trigger_id: int | None = None,
        timeout_s: float | None = None,
        actor: str = SYSTEM_ACTOR,
    ) -> CollectResult:
        """Ask each of ``device_ids`` for its hard examples of ``model`` (``version``: of that
        version only) within ``max_bytes`` raw bytes each (None: the device's policy budget,
        at most the protocol's ceiling), and store what passes :func:`check_batch`. Returns
        once every device has answered or timed out; a device's failure is in its outcome,
        never raised.

        Raises ``ValueError`` for a negative ``max_bytes``,
        :class:`controlplane.db.DatabaseError`.
        """
        limit = budget(max_bytes)
        result = CollectResult(trigger_id, model, version, limit)
        async with self.db.read() as tx:
            reach = await q.reachability(tx, device_ids)
        args: dict[str, Any] = {"model": model, "max_bytes": limit}
        if version is not None:
            args["version"] = version
        gate = asyncio.Semaphore(self.concurrency)

        async def ask(device_id: str) -> DeviceOutcome:
            async with gate:
                return await self._ask(device_id, args, result, timeout_s or self.timeout_s)

        outcomes = await asyncio.gather(*(ask(d) for d in reach.online))
        by_id = {o.device_id: o for o in outcomes}
        for device_id in reach.offline:
            by_id[device_id] = DeviceOutcome(device_id, "offline", detail="not connected")
        for device_id in reach.unknown:
            by_id[device_id] = DeviceOutcome(device_id, "unknown", detail="no accepted device")
        result.devices = [by_id[d] for d in dict.fromkeys(device_ids)]
        for outcome in result.devices:
            self.metrics.collections.labels(outcome.status).inc()
        await self._audit(result, actor)
        log.info(
            "hard examples of %s %s%s: %d stored, %d duplicates from %d devices (%s)",
            model, version or "(any version)",
            f" for trigger {trigger_id}" if trigger_id is not None else "",
            result.stored, result.duplicates, len(result.devices),
            ", ".join(f"{s} {n}" for s in OUTCOMES if (n := result.count(s))) or "none asked",
        )  # fmt: skip
        return result

    async def _ask(
        self, device_id: str, args: dict[str, Any], result: CollectResult, timeout_s: float
    ) -> DeviceOutcome:
        if self.commands is None:
            return DeviceOutcome(device_id, "unavailable", detail="no broker configured")
        try:
            reply = await self.commands.send(
                device_id, CommandName.UPLOAD_HARD_EXAMPLES, args, timeout_s
            )
        except CommandTimeoutError as e:
            return DeviceOutcome(device_id, "timeout", detail=str(e))
        except CommandUnavailableError as e:
            return DeviceOutcome(device_id, "unavailable", detail=str(e))
        except CommandError as e:  # a reply that is no CommandReply
            self.metrics.refused.labels("schema").inc()
            return DeviceOutcome(device_id, "refused", detail=str(e))
        if not reply.ok:
            error = reply.error.error if reply.error is not None else "no reason given"
            return DeviceOutcome(device_id, "failed", detail=error)
        try:
            batch = check_batch(
                reply.result, model=result.model, version=result.version, max_bytes=result.max_bytes
            )
        except BatchRefusedError as e:
            self.metrics.refused.labels(e.reason).inc()
            log.warning("hard examples from %s refused (%s): %s", device_id, e.reason, e)
            return DeviceOutcome(device_id, "refused", detail=f"{e.reason}: {e}")
        stored = await self._store(device_id, result.trigger_id, batch.examples)
        duplicates = len(batch.examples) - len(stored) + batch.repeated
        self.metrics.examples.labels("stored").inc(len(stored))
        self.metrics.examples.labels("duplicate").inc(duplicates)
        return DeviceOutcome(
            device_id, "stored", stored=len(stored), duplicates=duplicates,
            bytes=sum(e.nbytes for e in stored), held=batch.held,
        )  # fmt: skip

    async def _store(
        self, device_id: str, trigger_id: int | None, examples: list[Example]
    ) -> list[Example]:
        """Store the examples not stored already; return those stored."""
        if not examples:
            return []
        now = self.clock()
        async with self.db.transaction() as tx:
            known = await q.existing_hashes(
                tx, trigger_id=trigger_id, device_id=device_id, hashes=[e.sha256 for e in examples]
            )
            new = [e for e in examples if e.sha256 not in known]
            await q.insert_examples(tx, [_row(e, device_id, trigger_id, now) for e in new])
        return new

    async def _audit(self, result: CollectResult, actor: str) -> None:
        detail: dict[str, Any] = {
            "model": result.model,
            "version": result.version,
            "max_bytes": result.max_bytes,
            "devices": len(result.devices),
            "stored": result.stored,
            "duplicates": result.duplicates,
            **{s: n for s in OUTCOMES[1:] if (n := result.count(s))},
        }
        async with self.db.transaction() as tx:
            await audit_q.insert_entry(
                tx,
                at=self.clock(),
                actor=actor,
                action="hard_examples.collected",
                target_type="retraining_trigger" if result.trigger_id is not None else "model",
                target_id=str(result.trigger_id) if result.trigger_id is not None else result.model,
                detail=detail,
            )

    # ------------------------------------------------------------------ triggers
    async def on_trigger(self, trigger: Any) -> None:
        """The trigger service's callback, after a trigger committed (``trigger``: its id or
        an object with ``id``): if its rule asks for hard examples, its devices are asked in
        the background. Never raises."""
        trigger_id = trigger if isinstance(trigger, int) else getattr(trigger, "id", None)
        if not isinstance(trigger_id, int):
            log.warning("hard examples: a trigger callback without a trigger id: %r", trigger)
            return
        try:
            async with self.db.read() as tx:
                info = await q.get_trigger(tx, trigger_id)
        except McpError as e:
            log.warning("hard examples: cannot read trigger %d: %s", trigger_id, e)
            return
        if info is None or not info.collect:
            return
        task = asyncio.create_task(self._collect_quietly(trigger_id), name="hard-examples")
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _collect_quietly(self, trigger_id: int) -> CollectResult | None:
        try:
            return await self.collect_trigger(trigger_id)
        except McpError as e:
            log.warning("hard examples of trigger %d not collected: %s", trigger_id, e)
        except Exception:
            log.exception("hard examples of trigger %d: unexpected failure", trigger_id)
        return None

    async def wait_idle(self) -> None:
        """Wait for the background collections started by :meth:`on_trigger`."""
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)

    async def stop(self) -> None:
        """Cancel background collections and wait for them to end."""
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*list(self._background), return_exceptions=True)


def _row(e: Example, device_id: str, trigger_id: int | None, now: datetime) -> dict[str, Any]:
    out = e.output
    return {
        "trigger_id": trigger_id,
        "device_id": device_id,
        "model": e.model,
        "version": e.version,
        "device_ts": e.ts,
        "received_at": now,
        "confidence": e.confidence,
        "predicted": e.predicted,
        "input_name": e.input.name,
        "input_datatype": e.input.datatype,
        "input_shape": e.input.shape,
        "input_data": e.input.data,
        "output_name": out.name if out else None,
        "output_datatype": out.datatype if out else None,
        "output_shape": out.shape if out else None,
        "output_data": out.data if out else None,
        "sha256": e.sha256,
    }
