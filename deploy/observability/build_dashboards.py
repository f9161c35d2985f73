"""Writes the Grafana dashboards of MCP Edge (deploy/observability/grafana/*.json).

    python deploy/observability/build_dashboards.py           # rewrite the JSON files
    python deploy/observability/build_dashboards.py --check   # exit 1 when a file differs

The dashboards are kept here as code (panels, queries, layout) so that four dashboards share one
style and every query is in one place; the JSON files are what Grafana loads (provisioning or
import) and are committed. tests/integration/test_observability_files.py checks that the files
are what this script writes, and that every metric a query names is exported by the code.

Every panel reads the data source chosen in the ``DS_PROMETHEUS`` variable. Agent metrics are
scraped per device: the ``instance`` label of job ``mcp-agent`` names the device. Control plane
gauges of fleet-wide state are the same on every replica, so they are read with ``max``.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Json = dict[str, Any]

OUT = Path(__file__).resolve().parent / "grafana"
DS = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
RATE = "$__rate_interval"
LATENCY_SLO_S = 0.12  # the p95 SLO of alerts.yml (MCPInferenceLatencyP95High)
FILL_FLOOR = 0.4  # the batch fill floor of alerts.yml (MCPBatchFillRatioLow)


# ------------------------------------------------------------------------------ building blocks
def target(expr: str, legend: str = "", *, instant: bool = False, table: bool = False) -> Json:
    t: dict[str, Any] = {"datasource": DS, "expr": expr, "legendFormat": legend or "__auto"}
    if instant:
        t |= {"instant": True, "range": False}
    else:
        t |= {"instant": False, "range": True}
    if table:
        t["format"] = "table"
    return t


@dataclass
class Panel:
    kind: str  # timeseries, stat, table, bargauge
    title: str
    description: str
    targets: list[Json]
    unit: str = "short"
    w: int = 12
    h: int = 8
    threshold: float | None = None  # a red line (timeseries) or the red step (stat)
    floor: bool = False  # the threshold is a floor: red below it
    stacked: bool = False
    bars: bool = False
    decimals: int | None = None
    hide_columns: tuple[str, ...] = ()
    extra: Json = field(default_factory=dict)

    def to_json(self, pid: int, x: int, y: int) -> Json:
        for i, t in enumerate(self.targets):
            t["refId"] = chr(ord("A") + i)
        steps: list[dict[str, Any]]
        if self.threshold is None:
            steps = [{"color": "green", "value": None}]
        elif self.floor:
            steps = [{"color": "red", "value": None}, {"color": "green", "value": self.threshold}]
        else:
            steps = [{"color": "green", "value": None}, {"color": "red", "value": self.threshold}]
        defaults: dict[str, Any] = {
            "unit": self.unit,
            "color": {"mode": "palette-classic" if self.kind == "timeseries" else "thresholds"},
            "thresholds": {"mode": "absolute", "steps": steps},
            "mappings": [],
        }
        if self.decimals is not None:
            defaults["decimals"] = self.decimals
        panel: dict[str, Any] = {
            "id": pid,
            "type": self.kind,
            "title": self.title,
            "description": self.description,
            "datasource": DS,
            "gridPos": {"h": self.h, "w": self.w, "x": x, "y": y},
            "targets": self.targets,
        }
        if self.kind == "timeseries":
            defaults["custom"] = {
                "drawStyle": "bars" if self.bars else "line",
                "lineWidth": 1,
                "fillOpacity": 80 if self.bars else (30 if self.stacked else 10),
                "showPoints": "never",
                "spanNulls": False,
                "stacking": {"mode": "normal" if self.stacked else "none", "group": "A"},
                "thresholdsStyle": {"mode": "off" if self.threshold is None else "line"},
            }
            options: dict[str, Any] = {
                "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                "tooltip": {"mode": "multi", "sort": "desc"},
            }
        elif self.kind == "stat":
            options = {
                "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                "colorMode": "value",
                "graphMode": "area",
                "justifyMode": "auto",
                "orientation": "auto",
                "textMode": "auto",
            }
        elif self.kind == "bargauge":
            options = {
                "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                "displayMode": "gradient",
                "orientation": "horizontal",
                "showUnfilled": True,
            }
        elif self.kind == "table":
            options = {"showHeader": True, "cellHeight": "sm"}
            hidden = {c: True for c in ("Time", "__name__", *self.hide_columns)}
            panel["transformations"] = [
                {"id": "organize", "options": {"excludeByName": hidden, "renameByName": {}}}
            ]
        else:
            raise ValueError(self.kind)
        panel["fieldConfig"] = {"defaults": defaults, "overrides": []}
        panel["options"] = options | self.extra
        return panel


@dataclass
class Row:
    title: str


def ts(title: str, description: str, *targets: Json, **kw: Any) -> Panel:
    return Panel("timeseries", title, description, list(targets), **kw)


def stat(title: str, description: str, expr: str, **kw: Any) -> Panel:
    kw.setdefault("w", 4)
    kw.setdefault("h", 4)
    return Panel("stat", title, description, [target(expr)], **kw)


def datasource_variable() -> Json:
    return {
        "name": "DS_PROMETHEUS",
        "label": "Data source",
        "type": "datasource",
        "query": "prometheus",
        "current": {},
        "hide": 0,
        "includeAll": False,
        "multi": False,
        "options": [],
        "refresh": 1,
        "regex": "",
    }


def query_variable(
    name: str, label: str, query: str, *, multi: bool = True, include_all: bool = True
) -> Json:
    v: dict[str, Any] = {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DS,
        "definition": query,
        "query": {"query": query, "refId": "PrometheusVariableQueryEditor-VariableQuery"},
        "current": {},
        "hide": 0,
        "includeAll": include_all,
        "multi": multi,
        "options": [],
        "refresh": 2,
        "regex": "",
        "sort": 1,
    }
    if include_all:
        v["allValue"] = ".*"
    return v


def dashboard(
    uid: str, title: str, description: str, variables: list[Json], items: list[Panel | Row]
) -> Json:
    panels: list[Json] = []
    pid, x, y, line_h = 1, 0, 0, 0
    for item in items:
        if isinstance(item, Row):
            y += line_h
            x, line_h = 0, 0
            panels.append(
                {
                    "id": pid,
                    "type": "row",
                    "title": item.title,
                    "collapsed": False,
                    "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                    "panels": [],
                }
            )
            y += 1
        else:
            if x + item.w > 24:
                y += line_h
                x, line_h = 0, 0
            panels.append(item.to_json(pid, x, y))
            x += item.w
            line_h = max(line_h, item.h)
        pid += 1
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": ["mcp-edge"],
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"},
        "timepicker": {},
        "timezone": "browser",
        "fiscalYearStartMonth": 0,
        "liveNow": False,
        "weekStart": "",
        "annotations": {
            "list": [
                {
                    "builtIn": 1,
                    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                    "enable": True,
                    "hide": True,
                    "iconColor": "rgba(0, 211, 255, 1)",
                    "name": "Annotations & Alerts",
                    "type": "dashboard",
                }
            ]
        },
        "links": [
            {
                "title": "MCP Edge",
                "type": "dashboards",
                "tags": ["mcp-edge"],
                "asDropdown": True,
                "includeVars": False,
                "keepTime": True,
                "targetBlank": False,
                "icon": "external link",
                "tooltip": "",
                "url": "",
            }
        ],
        "templating": {"list": [datasource_variable(), *variables]},
        "panels": panels,
    }


def quantile(q: float, metric: str, selector: str, by: str) -> str:
    return (
        f"histogram_quantile({q}, sum by (le, {by}) (rate({metric}_bucket{{{selector}}}[{RATE}])))"
    )


def mean(metric: str, selector: str, by: str) -> str:
    return (
        f"sum by ({by}) (rate({metric}_sum{{{selector}}}[{RATE}]))\n"
        f"/\nsum by ({by}) (rate({metric}_count{{{selector}}}[{RATE}]))"
    )


# ------------------------------------------------------------------------------------- fleet
def fleet() -> Json:
    m = 'model=~"$model"'
    items: list[Panel | Row] = [
        Row("Devices (control plane)"),
        stat(
            "Accepted devices",
            'Devices the control plane accepted (mcp_cp_devices{status="accepted"}).',
            'max(mcp_cp_devices{status="accepted"})',
        ),
        stat(
            "Online",
            "Accepted devices whose last status message said online (mcp_cp_devices_online).",
            "max(mcp_cp_devices_online)",
        ),
        stat(
            "Offline",
            "Accepted devices not online: alert MCPDevicesOffline at 10 %, "
            "MCPDevicesMostlyOffline at 50 %.",
            'max(mcp_cp_devices{status="accepted"}) - max(mcp_cp_devices_online)',
            threshold=1,
        ),
        stat(
            "Pending approval",
            "Devices that enrolled and wait for an operator (mcp-controlplane devices pending).",
            'max(mcp_cp_devices{status="pending"})',
            threshold=1,
        ),
        stat(
            "Agents up",
            "Agents Prometheus scraped at the last scrape, over the agents it knows.",
            'sum(up{job="mcp-agent"})',
        ),
        stat(
            "Control plane replicas up",
            "Control plane replicas answering /metrics.",
            'sum(up{job="mcp-controlplane"})',
        ),
        ts(
            "Devices by status",
            "Enrollment status of every known device, and the accepted ones online.",
            target("max by (status) (mcp_cp_devices)", "{{status}}"),
            target("max(mcp_cp_devices_online)", "online"),
            w=8,
        ),
        Panel(
            "bargauge",
            "Scraped agents by profile",
            "Agents answering scrapes, by the `profile` label of their scrape target "
            "(prometheus.yml, file_sd targets). The control plane does not export devices "
            "per hardware profile; agents without the label count under an empty profile.",
            [target('count by (profile) (up{job="mcp-agent"} == 1)', "{{profile}}", instant=True)],
            w=8,
        ),
        Panel(
            "bargauge",
            "Loaded model versions by backend",
            "Model versions loaded on the scraped agents, by backend and execution provider "
            "(mcp_agent_model_info).",
            [
                target(
                    f"count by (backend, provider) (mcp_agent_model_info{{{m}}})",
                    "{{backend}} {{provider}}",
                    instant=True,
                )
            ],
            w=8,
        ),
        Row("Inference (agents)"),
        ts(
            "Requests/s by model",
            "Inference requests answered by the scraped agents, every outcome.",
            target(f"sum by (model) (rate(mcp_agent_requests_total{{{m}}}[{RATE}]))", "{{model}}"),
            unit="reqps",
            w=8,
        ),
        ts(
            "Requests/s by code",
            "HTTP-style status of the answers (200, 4xx client errors, 429 overloaded, 504 "
            "deadline, 5xx server errors); MQTT and gRPC answers use the same codes.",
            target(f"sum by (code) (rate(mcp_agent_requests_total{{{m}}}[{RATE}]))", "{{code}}"),
            unit="reqps",
            w=8,
            stacked=True,
        ),
        ts(
            "Errors and rejections (share of requests)",
            "Server errors (internal, unavailable: alert MCPInferenceErrorRateHigh at 2 %) and "
            "requests refused before running (overloaded, timeout: alert MCPAgentOverloaded at "
            "5 %), over the requests answered.",
            target(
                "sum by (model) (rate(mcp_agent_inference_errors_total"
                f'{{{m}, cause=~"internal|unavailable"}}[{RATE}]))\n'
                f"/\nsum by (model) (rate(mcp_agent_requests_total{{{m}}}[{RATE}]))",
                "{{model}} server errors",
            ),
            target(
                f"sum by (model) (rate(mcp_agent_rejections_total{{{m}}}[{RATE}]))\n"
                f"/\nsum by (model) (rate(mcp_agent_requests_total{{{m}}}[{RATE}]))",
                "{{model}} rejections",
            ),
            unit="percentunit",
            w=8,
        ),
        ts(
            "p95 latency by model (SLO 120 ms)",
            "95th percentile of request latency over every agent, from the "
            "mcp_agent_request_latency_seconds buckets; the red line is the SLO of alert "
            "MCPInferenceLatencyP95High.",
            target(quantile(0.95, "mcp_agent_request_latency_seconds", m, "model"), "{{model}}"),
            unit="s",
            threshold=LATENCY_SLO_S,
        ),
        ts(
            "Batch fill ratio by model (mean)",
            "Rows per batch over the maximum batch size, averaged over every batch of every "
            "agent; alert MCPBatchFillRatioLow under 40 % per agent while its backend is busy.",
            target(mean("mcp_agent_batch_fill_ratio", m, "model"), "{{model}}"),
            unit="percentunit",
            threshold=FILL_FLOOR,
            floor=True,
        ),
        Row("Drift and retraining"),
        ts(
            "Retraining triggers (last hour)",
            "Triggers raised by the drift rules (mcp_cp_retraining_triggers_total): each goes "
            "to the retraining webhook; alert MCPRetrainingTriggered.",
            target(
                f"sum by (model) (increase(mcp_cp_retraining_triggers_total{{{m}}}[1h]))",
                "{{model}}",
            ),
            w=8,
        ),
        ts(
            "Drift reports/s",
            "Drift reports stored by the control plane, and those refused by reason.",
            target(f"sum(rate(mcp_cp_drift_reports_total[{RATE}]))", "stored"),
            target(
                f"sum by (reason) (rate(mcp_cp_drift_reports_refused_total[{RATE}]))",
                "refused: {{reason}}",
            ),
            w=8,
        ),
        ts(
            "Rows binned for drift on agents/s",
            "Rows of answered requests the agents binned for drift measurement.",
            target(
                f"sum by (model) (rate(mcp_agent_drift_samples_total{{{m}}}[{RATE}]))", "{{model}}"
            ),
            w=8,
        ),
        Row("Control plane"),
        ts(
            "Rollouts by status",
            "Rollouts that have not ended (mcp_cp_rollouts); the rollout dashboard has the detail.",
            target(
                "max by (status) "
                '(mcp_cp_rollouts{status=~"running|awaiting_approval|paused|rolling_back"})',
                "{{status}}",
            ),
            w=8,
        ),
        ts(
            "Broker sessions",
            "1 while a replica's broker session (ingest, repository, desired) is logged in; "
            "alert MCPBrokerSessionDown.",
            target(
                "min by (instance, session) (mcp_cp_broker_session_up)", "{{instance}} {{session}}"
            ),
            w=8,
            decimals=0,
        ),
        ts(
            "Agents with an MQTT session",
            "Scraped agents connected to the broker (mcp_agent_mqtt_connected).",
            target("sum(mcp_agent_mqtt_connected)", "connected"),
            target("count(mcp_agent_mqtt_connected)", "fleet agents scraped"),
            w=8,
        ),
        ts(
            "Telemetry ingested/s",
            "Device messages taken in by kind, and those dropped by reason (backlog_full and "
            "db_error lose valid telemetry: alert MCPTelemetryLost).",
            target(f"sum by (kind) (rate(mcp_cp_ingest_received_total[{RATE}]))", "{{kind}}"),
            target(
                f"sum by (reason) (rate(mcp_cp_ingest_dropped_total[{RATE}]))",
                "dropped: {{reason}}",
            ),
        ),
        ts(
            "REST requests/s by status",
            "Requests answered by the control plane's API (every replica).",
            target(f"sum by (status) (rate(mcp_cp_http_requests_total[{RATE}]))", "{{status}}"),
            unit="reqps",
            stacked=True,
        ),
    ]
    return dashboard(
        "mcp-fleet",
        "MCP Edge / Fleet",
        "The fleet at a glance: devices, inference on the agents, drift, control plane.",
        [
            query_variable("model", "Model", "label_values(mcp_agent_model_info, model)"),
        ],
        items,
    )


# ------------------------------------------------------------------------------------ device
def device() -> Json:
    d = 'instance="$device"'
    dm = f'{d}, model=~"$model"'
    items: list[Panel | Row] = [
        Row("Agent"),
        stat("Up", "1 while Prometheus scrapes the agent.", f'up{{job="mcp-agent", {d}}}', w=3),
        stat(
            "Serving processes",
            "Processes serving the ports (mcp-agent serve --processes).",
            f"mcp_agent_serving_processes{{{d}}}",
            w=3,
        ),
        stat(
            "MQTT session",
            "1 while the agent's fleet session is connected (absent for `serve` without a "
            "control plane).",
            f"mcp_agent_mqtt_connected{{{d}}}",
            w=3,
        ),
        stat(
            "Model versions loaded",
            "Stable, canary and shadow versions loaded.",
            f"mcp_agent_model_versions_loaded{{{d}}}",
            w=3,
        ),
        stat(
            "Uptime",
            "Since the agent's process started.",
            f"time() - process_start_time_seconds{{{d}}}",
            unit="s",
            w=3,
        ),
        stat(
            "Requests/s",
            "Every answered request, all models.",
            f"sum(rate(mcp_agent_requests_total{{{d}}}[{RATE}]))",
            unit="reqps",
            w=3,
        ),
        stat(
            "In flight",
            "Inference requests being handled now.",
            f"mcp_agent_active_requests{{{d}}}",
            w=3,
        ),
        stat(
            "Hard examples held",
            "Raw tensor bytes of the hard examples waiting for upload.",
            f"mcp_agent_hard_example_bytes{{{d}}}",
            unit="bytes",
            w=3,
        ),
        Panel(
            "table",
            "Model versions loaded",
            "Each loaded version, its role (stable, canary, shadow), backend and execution "
            "provider (mcp_agent_model_info).",
            [target(f"mcp_agent_model_info{{{dm}}}", instant=True, table=True)],
            w=24,
            h=6,
            hide_columns=("Value", "job", "instance"),
        ),
        Row("Requests"),
        ts(
            "Requests/s by model and code",
            "Answered requests by status code (429: overloaded, 504: deadline passed).",
            target(
                f"sum by (model, code) (rate(mcp_agent_requests_total{{{dm}}}[{RATE}]))",
                "{{model}} {{code}}",
            ),
            unit="reqps",
        ),
        ts(
            "Latency percentiles",
            "p50, p95 and p99 of the time from request received to answer sent, per model; "
            "the red line is the 120 ms p95 SLO.",
            target(
                quantile(0.5, "mcp_agent_request_latency_seconds", dm, "model"), "{{model}} p50"
            ),
            target(
                quantile(0.95, "mcp_agent_request_latency_seconds", dm, "model"), "{{model}} p95"
            ),
            target(
                quantile(0.99, "mcp_agent_request_latency_seconds", dm, "model"), "{{model}} p99"
            ),
            unit="s",
            threshold=LATENCY_SLO_S,
        ),
        ts(
            "In flight and queued",
            "Requests being handled, and requests waiting in each version's batch queue.",
            target(f"mcp_agent_active_requests{{{d}}}", "in flight"),
            target(
                f"sum by (model, version) (mcp_agent_queue_depth{{{dm}}})",
                "queued {{model}} {{version}}",
            ),
            w=8,
        ),
        ts(
            "Queue wait p95",
            "How long the oldest request of a batch waited before it ran.",
            target(quantile(0.95, "mcp_agent_queue_wait_seconds", dm, "model"), "{{model}}"),
            unit="s",
            w=8,
        ),
        ts(
            "Errors and rejections/s",
            "Failed requests by cause, and requests refused before running by reason.",
            target(
                f"sum by (model, cause) (rate(mcp_agent_inference_errors_total{{{dm}}}[{RATE}]))",
                "error {{model}} {{cause}}",
            ),
            target(
                f"sum by (model, reason) (rate(mcp_agent_rejections_total{{{dm}}}[{RATE}]))",
                "refused {{model}} {{reason}}",
            ),
            w=8,
        ),
        Row("Batching and backend"),
        ts(
            "Batches/s",
            "Backend runs per second.",
            target(
                f"sum by (model) (rate(mcp_agent_batch_size_count{{{dm}}}[{RATE}]))", "{{model}}"
            ),
            w=6,
        ),
        ts(
            "Batch size (mean rows)",
            "Rows per backend run.",
            target(mean("mcp_agent_batch_size", dm, "model"), "{{model}}"),
            w=6,
        ),
        ts(
            "Batch fill ratio (mean)",
            "Rows per batch over the maximum batch size; alert MCPBatchFillRatioLow under 40 % "
            "while the backend is busy more than half the time.",
            target(mean("mcp_agent_batch_fill_ratio", dm, "model"), "{{model}}"),
            unit="percentunit",
            threshold=FILL_FLOOR,
            floor=True,
            w=6,
        ),
        ts(
            "Backend run time per batch",
            "p50 and p95 of the backend's time per batch (mcp_agent_inference_run_seconds).",
            target(quantile(0.5, "mcp_agent_inference_run_seconds", dm, "model"), "{{model}} p50"),
            target(quantile(0.95, "mcp_agent_inference_run_seconds", dm, "model"), "{{model}} p95"),
            unit="s",
            w=6,
        ),
        Row("Process"),
        ts(
            "Resident memory",
            "RSS of the agent's main process (process_resident_memory_bytes).",
            target(f"process_resident_memory_bytes{{{d}}}", "RSS"),
            unit="bytes",
            w=8,
        ),
        ts(
            "CPU",
            "CPU seconds per second of the agent's main process (1 = one core).",
            target(f"rate(process_cpu_seconds_total{{{d}}}[{RATE}])", "CPU"),
            unit="short",
            w=8,
        ),
        ts(
            "Request payload p95",
            "Size of inference request bodies, by protocol.",
            target(
                quantile(0.95, "mcp_agent_request_payload_bytes", d, "protocol"), "{{protocol}}"
            ),
            unit="bytes",
            w=8,
        ),
        Row("Model loads, canary and shadow"),
        ts(
            "Load and warm-up time p95",
            "Time to load a model version into its backend, and to warm and check it.",
            target(quantile(0.95, "mcp_agent_model_load_seconds", dm, "model"), "load {{model}}"),
            target(
                quantile(0.95, "mcp_agent_model_warmup_seconds", dm, "model"), "warm-up {{model}}"
            ),
            unit="s",
            w=8,
        ),
        ts(
            "Load failures, swaps, canary fallbacks (last hour)",
            "Versions that failed to load or warm (alert MCPModelLoadFailed), hot swaps of the "
            "stable version, canaries taken out of rotation (alert MCPCanaryFallback).",
            target(
                "sum by (model, stage) "
                f"(increase(mcp_agent_model_load_failures_total{{{dm}}}[1h]))",
                "failed {{stage}} {{model}}",
            ),
            target(
                f"sum by (model) (increase(mcp_agent_model_swaps_total{{{dm}}}[1h]))",
                "swaps {{model}}",
            ),
            target(
                f"sum by (model) (increase(mcp_agent_canary_fallbacks_total{{{dm}}}[1h]))",
                "canary fallbacks {{model}}",
            ),
            w=8,
        ),
        ts(
            "Canary weight",
            "Share of routed requests sent to each model's canary (0 after a fallback).",
            target(f"mcp_agent_canary_weight{{{dm}}}", "{{model}}"),
            unit="percentunit",
            w=8,
        ),
        ts(
            "Shadow agreement",
            "Share of shadow answers agreeing with stable, per shadow version.",
            target(f"mcp_agent_shadow_agreement_ratio{{{dm}}}", "{{model}} {{version}}"),
            unit="percentunit",
            w=8,
        ),
        ts(
            "Shadow comparisons/s",
            "Shadow answers compared with stable, by outcome (agree, disagree, error, skipped).",
            target(
                "sum by (model, outcome) "
                f"(rate(mcp_agent_shadow_comparisons_total{{{dm}}}[{RATE}]))",
                "{{model}} {{outcome}}",
            ),
            w=8,
        ),
        ts(
            "Shadow latency p95",
            "Latency of the shadow version's inference.",
            target(quantile(0.95, "mcp_agent_shadow_latency_seconds", dm, "model"), "{{model}}"),
            unit="s",
            w=8,
        ),
        Row("Fleet link: spool, drift, MQTT"),
        ts(
            "Outbound spool",
            "Messages waiting for the broker, and telemetry rows dropped to keep the spool "
            "bound (alert MCPAgentTelemetryDropped).",
            target(f"mcp_agent_spool_rows{{{d}}}", "waiting"),
            target(f"sum by (kind) (mcp_agent_spool_dropped{{{d}}})", "dropped {{kind}} (total)"),
            w=8,
        ),
        ts(
            "Spooled and delivered/s",
            "Messages written to the spool and acknowledged by the broker, by kind.",
            target(
                f"sum by (kind) (rate(mcp_agent_spool_put_total{{{d}}}[{RATE}]))", "put {{kind}}"
            ),
            target(
                f"sum by (kind) (rate(mcp_agent_spool_delivered_total{{{d}}}[{RATE}]))",
                "delivered {{kind}}",
            ),
            w=8,
        ),
        ts(
            "Drift sampling",
            "Rows binned for drift, windows queued for the control plane, and rows not binned "
            "by reason.",
            target(
                f"sum by (model) (rate(mcp_agent_drift_samples_total{{{dm}}}[{RATE}]))",
                "binned rows/s {{model}}",
            ),
            target(
                f"sum by (model) (rate(mcp_agent_drift_windows_total{{{dm}}}[{RATE}]))",
                "windows/s {{model}}",
            ),
            target(
                f"sum by (model, reason) (rate(mcp_agent_drift_dropped_total{{{dm}}}[{RATE}]))",
                "not binned/s {{model}} {{reason}}",
            ),
            w=8,
        ),
        ts(
            "MQTT connects and refused messages (last hour)",
            "Connection attempts by result, and inbound messages refused by channel and reason.",
            target(
                f"sum by (result) (increase(mcp_agent_mqtt_connects_total{{{d}}}[1h]))",
                "connect {{result}}",
            ),
            target(
                "sum by (channel, reason) "
                f"(increase(mcp_agent_mqtt_bad_messages_total{{{d}}}[1h]))",
                "refused {{channel}} {{reason}}",
            ),
            w=24,
        ),
    ]
    return dashboard(
        "mcp-device",
        "MCP Edge / Device",
        "One agent: requests, latency, batching, backend, process, models, canary and shadow, "
        "its link to the fleet.",
        [
            query_variable(
                "device",
                "Device",
                'label_values(up{job="mcp-agent"}, instance)',
                multi=False,
                include_all=False,
            ),
            query_variable(
                "model", "Model", 'label_values(mcp_agent_model_info{instance="$device"}, model)'
            ),
        ],
        items,
    )


# ----------------------------------------------------------------------------- model version
def model_version() -> Json:
    m = 'model="$model"'
    mv = f'{m}, version=~"$version"'
    gate_join = (
        "\n* on (rollout) group_left (model)\n"
        f"group by (rollout, model) (mcp_cp_rollout_devices{{{m}}})"
    )
    items: list[Panel | Row] = [
        Row("Where it runs"),
        Panel(
            "table",
            "Agents per version, role and backend",
            "How many scraped agents run each version of the model in each role (stable, "
            "canary, shadow), on which backend and execution provider.",
            [
                target(
                    f"count by (version, role, backend, provider) (mcp_agent_model_info{{{mv}}})",
                    instant=True,
                    table=True,
                )
            ],
            hide_columns=(),
            extra={"sortBy": [{"displayName": "version", "desc": True}]},
        ),
        ts(
            "Agents running each version",
            "Scraped agents with each version loaded, by role.",
            target(
                f"count by (version, role) (mcp_agent_model_info{{{mv}}})", "{{version}} {{role}}"
            ),
        ),
        Row("Traffic and latency"),
        ts(
            "Answered requests/s by version",
            "Requests answered by each version (the latency histogram's count: the agent's "
            "request and error counters carry the model, not the version).",
            target(
                f"sum by (version) (rate(mcp_agent_request_latency_seconds_count{{{mv}}}[{RATE}]))",
                "{{version}}",
            ),
            unit="reqps",
            w=8,
        ),
        ts(
            "p95 latency by version (SLO 120 ms)",
            "95th percentile of request latency of each version over every agent.",
            target(
                quantile(0.95, "mcp_agent_request_latency_seconds", mv, "version"), "{{version}}"
            ),
            unit="s",
            threshold=LATENCY_SLO_S,
            w=8,
        ),
        ts(
            "p50 and p99 by version",
            "Median and 99th percentile of request latency of each version.",
            target(
                quantile(0.5, "mcp_agent_request_latency_seconds", mv, "version"), "{{version}} p50"
            ),
            target(
                quantile(0.99, "mcp_agent_request_latency_seconds", mv, "version"),
                "{{version}} p99",
            ),
            unit="s",
            w=8,
        ),
        ts(
            "Errors and rejections of the model (share of requests)",
            "Server errors and refusals over the requests answered, all versions of the model "
            "together (the agent counts them per model).",
            target(
                "sum(rate(mcp_agent_inference_errors_total"
                f'{{{m}, cause=~"internal|unavailable"}}[{RATE}]))\n'
                f"/\nsum(rate(mcp_agent_requests_total{{{m}}}[{RATE}]))",
                "server errors",
            ),
            target(
                f"sum by (reason) (rate(mcp_agent_rejections_total{{{m}}}[{RATE}]))\n"
                f"/ ignoring (reason) group_left\nsum(rate(mcp_agent_requests_total{{{m}}}[{RATE}]))",
                "refused: {{reason}}",
            ),
            unit="percentunit",
        ),
        ts(
            "Errors/s of the model by cause",
            "Failed requests by cause (bad_request, not_found, ... are the clients').",
            target(
                f"sum by (cause) (rate(mcp_agent_inference_errors_total{{{m}}}[{RATE}]))",
                "{{cause}}",
            ),
        ),
        Row("Canary and shadow"),
        ts(
            "Canary error rate (rollout gate)",
            "The error_rate gate of the model's running rollouts: failed requests over requests "
            "answered by the new version on the devices of the current stage (the canary, on a "
            "canary stage), as the control plane computed it from the devices' telemetry.",
            target(
                'max by (rollout, metric) (mcp_cp_rollout_gate_value{metric="error_rate"})'
                + gate_join,
                "rollout {{rollout}}",
            ),
            unit="percentunit",
            w=8,
        ),
        ts(
            "Canary weight per agent",
            "Share of requests each agent routes to the model's canary (0: none, or fallen back).",
            target(f"mcp_agent_canary_weight{{{m}}}", "{{instance}}"),
            unit="percentunit",
            w=8,
        ),
        ts(
            "Canary fallbacks (last hour)",
            "Canaries taken out of rotation because their error rate passed the limit.",
            target(
                f"sum by (instance) (increase(mcp_agent_canary_fallbacks_total{{{m}}}[1h]))",
                "{{instance}}",
            ),
            w=8,
        ),
        ts(
            "Shadow agreement by version",
            "Share of shadow answers agreeing with stable, averaged over the agents.",
            target(f"avg by (version) (mcp_agent_shadow_agreement_ratio{{{mv}}})", "{{version}}"),
            unit="percentunit",
            w=8,
        ),
        ts(
            "Shadow comparisons/s by outcome",
            "Shadow answers compared with stable, over every agent.",
            target(
                f"sum by (outcome) (rate(mcp_agent_shadow_comparisons_total{{{m}}}[{RATE}]))",
                "{{outcome}}",
            ),
            w=8,
        ),
        ts(
            "Gates of the model's rollouts",
            "Every gate value of the current stage of the model's running rollouts "
            "(error_rate, latency_p95_ratio, agreement, drift, install_failure_rate).",
            target(
                "max by (rollout, metric) (mcp_cp_rollout_gate_value)" + gate_join,
                "{{rollout}} {{metric}}",
            ),
            w=8,
        ),
        Row("Drift, loads"),
        ts(
            "Retraining triggers (last hour)",
            "Triggers the drift rule of the model raised.",
            target(f"sum(increase(mcp_cp_retraining_triggers_total{{{m}}}[1h]))", "triggers"),
            w=8,
        ),
        ts(
            "Drift sampling on agents",
            "Rows binned for drift and windows sent, over every agent.",
            target(f"sum(rate(mcp_agent_drift_samples_total{{{m}}}[{RATE}]))", "binned rows/s"),
            target(f"sum(rate(mcp_agent_drift_windows_total{{{m}}}[{RATE}]))", "windows/s"),
            w=8,
        ),
        ts(
            "Load failures and swaps (last hour)",
            "Versions that failed to load or warm on the agents, and hot swaps of stable.",
            target(
                f"sum by (stage) (increase(mcp_agent_model_load_failures_total{{{m}}}[1h]))",
                "failed {{stage}}",
            ),
            target(f"sum(increase(mcp_agent_model_swaps_total{{{m}}}[1h]))", "swaps"),
            w=8,
        ),
    ]
    return dashboard(
        "mcp-model-version",
        "MCP Edge / Model version",
        "One model, its versions side by side: where they run, traffic, latency, errors, "
        "canary and shadow, rollout gates, drift.",
        [
            query_variable(
                "model",
                "Model",
                "label_values(mcp_agent_model_info, model)",
                multi=False,
                include_all=False,
            ),
            query_variable(
                "version", "Version", 'label_values(mcp_agent_model_info{model="$model"}, version)'
            ),
        ],
        items,
    )


# ----------------------------------------------------------------------------------- rollout
def rollout() -> Json:
    sel = 'rollout=~"$rollout", model=~"$model"'

    def per(phase: str = "") -> str:
        """Devices per rollout and phase; both replicas export the same counts."""
        where = sel + (f', phase="{phase}"' if phase else "")
        return f"max by (rollout, model, phase) (mcp_cp_rollout_devices{{{where}}})"

    def phase_stat(title: str, description: str, phase: str, **kw: Any) -> Panel:
        return stat(title, description, f"sum({per(phase)})", **kw)

    items: list[Panel | Row] = [
        Row("Rollouts"),
        *(
            stat(
                title,
                description,
                f'max(mcp_cp_rollouts{{status="{status}"}})',
                threshold=threshold,
                w=6,
            )
            for title, description, status, threshold in (
                ("Running", "Rollouts telling, settling or baking a stage.", "running", None),
                (
                    "Awaiting approval",
                    "Rollouts whose next stage waits for `approve` (alert "
                    "MCPRolloutAwaitingApproval after an hour).",
                    "awaiting_approval",
                    None,
                ),
                (
                    "Paused",
                    "Paused by an operator or a gate (alert MCPRolloutPaused after 30 minutes).",
                    "paused",
                    1,
                ),
                (
                    "Rolling back",
                    "Rollouts returning their devices to the previous version.",
                    "rolling_back",
                    1,
                ),
            )
        ),
        Row("Progress of the selected rollouts"),
        phase_stat("Updated (active)", "Devices reporting the new version in its role.", "active"),
        phase_stat(
            "Moving", "Devices told to run the new version, not yet reporting it.", "moving"
        ),
        phase_stat(
            "Waiting", "Devices of later stages, offline, or held by the rate limit.", "waiting"
        ),
        phase_stat(
            "Failed",
            "Devices whose download, install or activation failed (alert MCPRolloutDevicesFailed).",
            "failed",
            threshold=1,
        ),
        phase_stat("Skipped", "Offline or stuck past device_timeout_s.", "skipped", threshold=1),
        phase_stat("Reverted", "Devices back on the version they ran before.", "reverted"),
        ts(
            "Devices by phase",
            "The selected rollouts' devices in each phase (stacked: the total is the target).",
            target(f"sum by (phase) ({per()})", "{{phase}}"),
            stacked=True,
            w=16,
        ),
        Panel(
            "bargauge",
            "Share of devices updated, per rollout",
            "Devices in phase active over every device of the rollout.",
            [
                target(
                    f"sum by (rollout, model) ({per('active')})\n"
                    f"/\nsum by (rollout, model) ({per()})",
                    "rollout {{rollout}} ({{model}})",
                    instant=True,
                )
            ],
            unit="percentunit",
            w=8,
            extra={"minVizHeight": 10},
        ),
        Panel(
            "table",
            "Devices per rollout and phase",
            "Every rollout not ended, by phase (both replicas export the same counts).",
            [target(per(), instant=True, table=True)],
            w=24,
            h=7,
        ),
        Row("Gates and decisions"),
        ts(
            "Gate values of the current stage",
            "The last value of each gate of the selected rollouts' current stage (absent while "
            "a gate has no value yet). Ceilings: error_rate, latency_p95_ratio, drift, "
            "install_failure_rate; floor: agreement.",
            target(
                'max by (rollout, metric) (mcp_cp_rollout_gate_value{rollout=~"$rollout"})',
                "{{rollout}} {{metric}}",
            ),
        ),
        ts(
            "Decisions",
            "Rollout decisions and operator actions by kind, over every rollout "
            "(stage_started, gate_passed, gate_failed, paused, rolling_back, succeeded, ...).",
            target(
                f"sum by (kind) (increase(mcp_cp_rollout_transitions_total[{RATE}]))", "{{kind}}"
            ),
            bars=True,
            stacked=True,
        ),
        stat(
            "Rollbacks started (24 h)",
            "Rollouts that began rolling back (alert MCPRolloutRolledBack).",
            'sum(increase(mcp_cp_rollout_transitions_total{kind="rolling_back"}[24h]))',
            threshold=1,
            decimals=0,
            w=6,
        ),
        stat(
            "Gate failures (24 h)",
            "Gates that failed, dry runs included.",
            'sum(increase(mcp_cp_rollout_transitions_total{kind="gate_failed"}[24h]))',
            threshold=1,
            decimals=0,
            w=6,
        ),
        ts(
            "Steps written/s by replica",
            "Rollout steps stored, and those lost to another replica that was first "
            "(conflict): with two replicas the work moves between them.",
            target(
                f"sum by (instance, outcome) (rate(mcp_cp_rollout_steps_total[{RATE}]))",
                "{{instance}} {{outcome}}",
            ),
            h=4,
        ),
        Row("Delivery to devices"),
        ts(
            "Scraped agents by version of the model",
            "Agents with each version of the rolled-out models loaded, by role.",
            target(
                'count by (model, version, role) (mcp_agent_model_info{model=~"$model"})',
                "{{model}} {{version}} {{role}}",
            ),
            w=8,
        ),
        ts(
            "Repository over MQTT",
            "Repository requests from devices (metadata, targets) answered by status, and "
            "payload bytes sent.",
            target(f"sum by (status) (rate(mcp_cp_repo_requests_total[{RATE}]))", "{{status}}"),
            target(f"sum(rate(mcp_cp_repo_bytes_total[{RATE}]))", "bytes/s"),
            w=8,
        ),
        ts(
            "Load failures and canary fallbacks on agents (last hour)",
            "Failures of the agents to load or warm a version of the rolled-out models, and "
            "canaries they took out of rotation.",
            target(
                "sum by (model, stage) "
                '(increase(mcp_agent_model_load_failures_total{model=~"$model"}[1h]))',
                "failed {{stage}} {{model}}",
            ),
            target(
                'sum by (model) (increase(mcp_agent_canary_fallbacks_total{model=~"$model"}[1h]))',
                "canary fallback {{model}}",
            ),
            w=8,
        ),
    ]
    return dashboard(
        "mcp-rollout",
        "MCP Edge / Rollouts",
        "Rollouts: status, devices per phase, gates of the current stage, decisions, delivery. "
        "A rollout's per-device series end when it ends.",
        [
            query_variable("model", "Model", "label_values(mcp_cp_rollout_devices, model)"),
            query_variable(
                "rollout",
                "Rollout",
                'label_values(mcp_cp_rollout_devices{model=~"$model"}, rollout)',
            ),
        ],
        items,
    )


DASHBOARDS = {
    "fleet.json": fleet,
    "device.json": device,
    "model-version.json": model_version,
    "rollout.json": rollout,
}


def render() -> dict[str, str]:
    """File name -> the JSON text this script writes."""
    return {name: json.dumps(build(), indent=2) + "\n" for name, build in DASHBOARDS.items()}


def main(argv: list[str]) -> int:
    check = "--check" in argv
    stale = []
    for name, text in render().items():
        path = OUT / name
        if check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
    if stale:
        print(f"out of date (run {Path(__file__).name}): {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
