"""Counters of the fleet session: connection, inbound drops, spool and telemetry.

Plain counters (``dropped``) are always kept, for tests and ``mcp-agent`` status output; the
Prometheus families are registered on the registry given (pass the agent's
``AgentMetrics.registry`` so ``GET /metrics`` shows them), or on a private one.
"""

from __future__ import annotations

import logging
from collections import Counter as PlainCounter

from prometheus_client import CollectorRegistry, Counter, Gauge

log = logging.getLogger("mcp.agent.fleet")


class FleetMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.dropped: PlainCounter[tuple[str, str]] = PlainCounter()
        """Inbound messages dropped (or answered with an error) by (channel, reason)."""
        self.connected = Gauge(
            "mcp_agent_mqtt_connected", "1 while the agent's MQTT session is online.", registry=r
        )
        self.connects = Counter(
            "mcp_agent_mqtt_connects_total",
            "MQTT connection attempts by result.",
            ["result"],
            registry=r,
        )
        self.bad_input = Counter(
            "mcp_agent_mqtt_bad_messages_total",
            "Inbound MQTT messages refused (malformed JSON, wrong schema, oversized, ...).",
            ["channel", "reason"],
            registry=r,
        )
        self.spooled = Counter(
            "mcp_agent_spool_put_total",
            "Messages written to the outbound spool, by kind.",
            ["kind"],
            registry=r,
        )
        self.delivered = Counter(
            "mcp_agent_spool_delivered_total",
            "Spooled messages the broker acknowledged.",
            ["kind"],
            registry=r,
        )
        self.spool_rows = Gauge(
            "mcp_agent_spool_rows", "Messages waiting in the outbound spool.", registry=r
        )
        self.spool_dropped = Gauge(
            "mcp_agent_spool_dropped",
            "Telemetry rows dropped to keep the spool bound.",
            ["kind"],
            registry=r,
        )

    def drop(self, channel: str, reason: str, detail: str, topic: str = "") -> None:
        """Count a refused inbound message and log one line about it."""
        self.dropped[(channel, reason)] += 1
        self.bad_input.labels(channel, reason).inc()
        log.warning(
            "dropped a %s message%s: %s: %.200s",
            channel,
            f" on {topic[:120]}" if topic else "",
            reason,
            detail,
        )
