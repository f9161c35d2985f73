"""Prometheus metrics of the control plane (``GET /metrics``).

One :class:`ControlPlaneMetrics` per app on its own registry, so tests and several apps in one
process never share counters. Families:

- ``mcp_cp_http_requests_total{method,route,status}`` and
  ``mcp_cp_http_request_seconds{method,route}``: every REST request;
- ``mcp_cp_enrollments_total{outcome}``: accepted, pending, unchanged, reenrolled, refused
  reasons, replayed, invalid;
- ``mcp_cp_devices{status}`` and ``mcp_cp_devices_online``: refreshed from the database at each
  scrape;
- ingestion (:mod:`controlplane.ingest`): ``mcp_cp_ingest_received_total{kind}`` (valid messages
  taken in), ``mcp_cp_ingest_committed_total{kind}`` (rows committed), ``mcp_cp_ingest_dropped_total
  {reason}`` (bad or undeliverable messages), ``mcp_cp_ingest_flush_seconds`` and
  ``mcp_cp_ingest_backlog`` (rows waiting for the next flush).
- repository over MQTT (:mod:`controlplane.repository.mqtt_service`):
  ``mcp_cp_repo_requests_total{status}`` (answered: ok, not_found, bad_request, error),
  ``mcp_cp_repo_bytes_total`` (payload bytes sent) and ``mcp_cp_repo_dropped_total{reason}``
  (unanswerable requests: wrong response topic, no correlation data, not connected).
- drift (:mod:`controlplane.drift`): ``mcp_cp_drift_reports_total`` (reports stored),
  ``mcp_cp_drift_reports_refused_total{reason}`` (refused, by reason: see
  :class:`controlplane.drift.service.Refusal`), ``mcp_cp_retraining_triggers_total{model}``
  and ``mcp_cp_drift_store_cpu_seconds`` (CPU time of storing one batch).
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ControlPlaneMetrics:
    """Every metric family the control plane exports."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        self.requests = Counter(
            "mcp_cp_http_requests_total",
            "REST requests answered.",
            ["method", "route", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "mcp_cp_http_request_seconds",
            "Time to answer a REST request.",
            ["method", "route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.enrollments = Counter(
            "mcp_cp_enrollments_total",
            "Enrollment requests by outcome.",
            ["outcome"],
            registry=r,
        )
        self.devices = Gauge(
            "mcp_cp_devices",
            "Devices known to the control plane, by status.",
            ["status"],
            registry=r,
        )
        self.devices_online = Gauge(
            "mcp_cp_devices_online",
            "Accepted devices whose last status was online.",
            registry=r,
        )

        self.ingest_received = Counter(
            "mcp_cp_ingest_received_total",
            "Valid device messages taken in, by kind.",
            ["kind"],
            registry=r,
        )
        self.ingest_committed = Counter(
            "mcp_cp_ingest_committed_total",
            "Ingested messages committed to the database.",
            ["kind"],
            registry=r,
        )
        self.ingest_dropped = Counter(
            "mcp_cp_ingest_dropped_total",
            "Device messages dropped, by reason.",
            ["reason"],
            registry=r,
        )
        self.ingest_flush = Histogram(
            "mcp_cp_ingest_flush_seconds",
            "Time to commit one ingestion batch.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ingest_backlog = Gauge(
            "mcp_cp_ingest_backlog",
            "Ingested messages waiting for the next flush.",
            registry=r,
        )

        self.repo_requests = Counter(
            "mcp_cp_repo_requests_total",
            "Repository requests over MQTT answered, by reply status.",
            ["status"],
            registry=r,
        )
        self.repo_bytes = Counter(
            "mcp_cp_repo_bytes_total",
            "Repository bytes sent to devices over MQTT.",
            registry=r,
        )
        self.repo_dropped = Counter(
            "mcp_cp_repo_dropped_total",
            "Repository requests over MQTT dropped unanswered, by reason.",
            ["reason"],
            registry=r,
        )

        self.drift_reports = Counter(
            "mcp_cp_drift_reports_total",
            "Drift reports stored and added to the fleet aggregates.",
            registry=r,
        )
        self.drift_refused = Counter(
            "mcp_cp_drift_reports_refused_total",
            "Drift reports refused (never added to an aggregate), by reason.",
            ["reason"],
            registry=r,
        )
        self.retraining_triggers = Counter(
            "mcp_cp_retraining_triggers_total",
            "Retraining triggers raised, by model.",
            ["model"],
            registry=r,
        )
        self.drift_store_cpu = Histogram(
            "mcp_cp_drift_store_cpu_seconds",
            "CPU time to refuse, store and aggregate one batch of drift reports.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )

        self.broker_session_up = Gauge(
            "mcp_cp_broker_session_up",
            "1 while the broker session is logged in and subscribed, 0 while it is not (a "
            "refused login, an unreachable broker).",
            ["session"],
            registry=r,
        )

    def observe_request(self, method: str, route: str, status: int, seconds: float) -> None:
        self.requests.labels(method, route, str(status)).inc()
        self.latency.labels(method, route).observe(seconds)

    def set_device_counts(self, by_status: Mapping[str, int], online: int) -> None:
        for status in ("preauthorized", "pending", "accepted", "rejected", "revoked"):
            self.devices.labels(status).set(by_status.get(status, 0))
        self.devices_online.set(online)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
