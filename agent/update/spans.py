"""Deployment spans: the device's side of a traced deployment.

When tracing is on (``--otlp-endpoint``) and a desired state carries the ``traceparent`` of
the control plane's deploy call, each deployment that state starts on the device is a span
``deployment MODEL VERSION`` in that trace, a child of the deploy call. Every phase of the
update state machine that finishes (downloading, verifying, installing, loading, warming) is
a child span covering the time the phase took, failed phases marked as errors; the
deployment span ends when the version is active (ok) or the deployment has failed (error).

Fed by the flight recorder (:class:`agent.update.updater.FlightRecorder`), which calls
:meth:`DeploymentSpans.on_event` for every event, from the event loop or the download
thread, under its lock.
"""

from __future__ import annotations

import collections
import time
from typing import TYPE_CHECKING, Any

from mcp_edge.agent.update.machine import Phase
from mcp_edge.shared.protocol.reports import EventOutcome

if TYPE_CHECKING:
    from mcp_edge.agent.update.records import UpdateRecord
    from mcp_edge.shared.tracing import Tracing

MAX_TRACED_STATES = 16
"""Desired states whose trace is remembered (a deployment starts from a recent one)."""


class DeploymentSpans:
    """Spans of the deployments of traced desired states (see the module docstring)."""

    def __init__(self, tracing: Tracing, device_id: str) -> None:
        self.tracing = tracing
        self.device_id = device_id
        self._parents: collections.OrderedDict[int, Any] = collections.OrderedDict()
        self._open: dict[tuple[str, str], Any] = {}

    def begin(self, seq: int, traceparent: str | None) -> None:
        """Desired state ``seq`` is being applied; ``traceparent``: the trace it carries."""
        context = self.tracing.context(traceparent)
        if context is None:
            return
        self._parents[seq] = context
        while len(self._parents) > MAX_TRACED_STATES:
            self._parents.popitem(last=False)

    def on_event(
        self,
        rec: UpdateRecord,
        phase: Phase,
        outcome: EventOutcome,
        message: str,
        elapsed_ms: float | None,
    ) -> None:
        """One flight-recorder event of deployment ``rec``."""
        key = (rec.model, rec.role)
        root = self._open.get(key)
        if root is None:
            parent = self._parents.get(rec.desired_seq)
            if parent is None:
                return  # not a traced deployment
            root = self.tracing.tracer.start_span(
                f"deployment {rec.model} {rec.to_version}",
                context=parent,
                kind=self.tracing.kind.CONSUMER,
                attributes={
                    "mcp.device": self.device_id,
                    "mcp.model": rec.model,
                    "mcp.version": rec.to_version,
                    "mcp.role": rec.role,
                    "mcp.from_version": rec.from_version or "",
                    "mcp.desired_seq": rec.desired_seq,
                },
            )
            self._open[key] = root
        if elapsed_ms is not None and phase is not Phase.ACTIVE and outcome is not \
                EventOutcome.PROGRESS:  # fmt: skip
            self._phase_span(root, phase, outcome, message, elapsed_ms)
        if phase is Phase.ACTIVE and outcome is EventOutcome.OK:
            root.set_attribute("mcp.outcome", "active")
            root.end()
            del self._open[key]
        elif phase is Phase.FAILED or rec.phase is Phase.FAILED:
            self.tracing.error(root, message or "deployment failed")
            root.set_attribute("mcp.outcome", "failed")
            root.end()
            del self._open[key]

    def _phase_span(
        self, root: Any, phase: Phase, outcome: EventOutcome, message: str, elapsed_ms: float
    ) -> None:
        end_ns = time.time_ns()
        span = self.tracing.tracer.start_span(
            phase.value,
            context=self.tracing.within(root),
            start_time=end_ns - int(elapsed_ms * 1e6),
            attributes={"mcp.phase": phase.value, "mcp.message": message[:500]},
        )
        if outcome is EventOutcome.ERROR:
            self.tracing.error(span, message)
        span.end(end_time=end_ns)
