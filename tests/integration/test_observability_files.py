"""The Prometheus rules, scrape config and Grafana dashboards under deploy/observability.

- promtool checks the rules and the config, and runs the rules' unit tests (alerts_test.yml);
- every metric a rule or a dashboard query names is exported by the code: the names come from
  the real registries (the agent's ``AgentMetrics`` with ``FleetMetrics``, the control plane's
  app with every service that registers a family), so renaming a metric in the code fails here;
- the dashboards are valid Grafana JSON, exactly what deploy/observability/build_dashboards.py
  writes, and every query parses as PromQL;
- every alert is documented in docs/operations-observability.md, where its runbook_url points.

promtool comes from Debian's ``prometheus`` package (tests/run.sh installs it when missing).
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from mcp_edge.agent.fleet.metrics import FleetMetrics
from mcp_edge.agent.serving.metrics import AgentMetrics
from mcp_edge.agent.serving.serve import DEFAULT_PORT as AGENT_PORT
from mcp_edge.controlplane.api.common import SERVICES
from mcp_edge.controlplane.app import create_app
from mcp_edge.controlplane.broker.base import Credentials
from mcp_edge.controlplane.ingest import IngestConnection
from mcp_edge.controlplane.mqtt import BrokerAddress
from mcp_edge.controlplane.settings import Settings
from tests.support.controlplane import FakeProvisioner
from tests.support.promql import PromQLError, metric_names, sample_names, unknown_metrics

ROOT = Path(__file__).resolve().parents[2]
OBS = ROOT / "deploy" / "observability"
PROM = OBS / "prometheus"
ALERTS = PROM / "alerts.yml"
ALERTS_TEST = PROM / "alerts_test.yml"
CONFIG = PROM / "prometheus.yml"
GRAFANA = OBS / "grafana"
DASHBOARDS = ("fleet.json", "device.json", "model-version.json", "rollout.json")
DOC = ROOT / "docs" / "operations-observability.md"

# Series Prometheus writes itself for every scrape target; no code of ours exports them.
PROMETHEUS_SERIES = frozenset(
    {
        "up",
        "scrape_duration_seconds",
        "scrape_samples_scraped",
        "scrape_samples_post_metric_relabeling",
        "scrape_series_added",
    }
)
SEVERITIES = {"critical", "warning", "info"}
JOBS = {"mcp-agent", "mcp-controlplane"}


def promtool(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("promtool") or "/usr/bin/promtool"
    if not Path(exe).exists():
        pytest.fail("promtool is missing: install Debian's prometheus package (tests/run.sh does)")
    return subprocess.run(
        [exe, *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False
    )


def alert_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def dashboard(name: str) -> dict[str, Any]:
    return dict(json.loads((GRAFANA / name).read_text()))


def all_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from all_panels(panel.get("panels", []))


def variable_query(variable: dict[str, Any]) -> str:
    query = variable.get("query", "")
    return str(query["query"] if isinstance(query, dict) else query)


def variable_exprs(variable: dict[str, Any]) -> list[str]:
    """The PromQL inside a Grafana Prometheus variable query."""
    query = variable_query(variable)
    m = re.fullmatch(r"\s*label_values\((.*),\s*\w+\s*\)\s*", query, re.S)
    if m:
        return [m.group(1)]
    if re.fullmatch(r"\s*label_values\(\s*\w+\s*\)\s*", query):
        return []  # a label's values over every series
    m = re.fullmatch(r"\s*query_result\((.*)\)\s*", query, re.S)
    if m:
        return [m.group(1)]
    if query.startswith(("label_names(", "metrics(")):
        return []
    return [query]


def dashboard_exprs() -> dict[str, list[str]]:
    """Every PromQL expression of every dashboard: panel targets and variable queries."""
    exprs: dict[str, list[str]] = {}
    for name in DASHBOARDS:
        d = dashboard(name)
        found = [t["expr"] for p in all_panels(d["panels"]) for t in p.get("targets", [])]
        for v in d["templating"]["list"]:
            if v["type"] == "query":
                found += variable_exprs(v)
        exprs[name] = found
    return exprs


@pytest.fixture(scope="module")
def exported() -> set[str]:
    """Sample names the agent's and the control plane's /metrics expose, from their registries."""
    agent = AgentMetrics()
    FleetMetrics(agent.registry)  # `mcp-agent run` registers the fleet families beside them
    # With a broker connection the app also registers the command families; building it touches
    # neither the broker nor the database (that happens at startup).
    ingest = IngestConnection(BrokerAddress("127.0.0.1", 1), Credentials("cp", "pw", "cp-test"))
    app = create_app(Settings(data_dir=Path("unused")), FakeProvisioner(), ingest=ingest)
    names = sample_names([agent.registry, app[SERVICES].metrics.registry])
    # Sanity: one family of each component that registers on the app's registry.
    for name in (
        "mcp_agent_request_latency_seconds_bucket",
        "mcp_agent_mqtt_connected",
        "process_resident_memory_bytes",
        "mcp_cp_devices_online",
        "mcp_cp_rollout_devices",
        "mcp_cp_webhook_pending",
        "mcp_cp_hard_examples_total",
        "mcp_cp_commands_total",
    ):
        assert name in names
    return names


# ------------------------------------------------------------------------------------ promtool
def test_promtool_checks_the_rules() -> None:
    r = promtool("check", "rules", str(ALERTS.relative_to(ROOT)))
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in r.stdout


def test_promtool_checks_the_config_from_anywhere(tmp_path: Path) -> None:
    """rule_files and file_sd paths are relative to prometheus.yml, not to the working dir."""
    r = promtool("check", "config", str(CONFIG), cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS: 1 rule files found" in r.stdout
    assert "WARNING" not in r.stdout + r.stderr  # e.g. a file_sd glob matching no file


def test_promtool_unit_tests_of_the_rules_pass() -> None:
    r = promtool("test", "rules", str(ALERTS_TEST.relative_to(ROOT)))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


def test_every_alert_is_unit_tested_firing_and_quiet() -> None:
    fires: set[str] = set()
    quiet: set[str] = set()
    for case in yaml.safe_load(ALERTS_TEST.read_text())["tests"]:
        for check in case.get("alert_rule_test", []):
            (fires if check.get("exp_alerts") else quiet).add(check["alertname"])
    names = {r["alert"] for r in alert_rules()}
    assert names - fires == set(), "alerts never shown firing"
    assert names - quiet == set(), "alerts never shown quiet"
    assert (fires | quiet) - names == set(), "tests of alerts that do not exist"


def test_dashboard_queries_are_valid_promql(tmp_path: Path) -> None:
    """promtool parses each query as a recording rule (Grafana's variables substituted)."""
    rules: list[dict[str, str]] = []
    for name, exprs in dashboard_exprs().items():
        for expr in exprs:
            expr = expr.replace("$__rate_interval", "5m").replace("$__interval", "1m")
            expr = re.sub(r"\$\{(\w+)\}|\$(\w+)", "x", expr)
            rules.append({"record": f"dashboard:{name.split('.')[0]}:{len(rules)}", "expr": expr})
    rules = [{**r, "record": r["record"].replace("-", "_")} for r in rules]
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    r = promtool("check", "rules", str(path))
    assert r.returncode == 0, r.stdout + r.stderr


# ----------------------------------------------------------------------------- the rules' shape
def test_every_alert_has_for_severity_annotations_and_a_documented_runbook() -> None:
    doc = DOC.read_text()
    headings = {m.group(1) for m in re.finditer(r"^### (\w+)\s*$", doc, re.M)}
    names = [r["alert"] for r in alert_rules()]
    assert len(names) == len(set(names))
    for rule in alert_rules():
        name = rule["alert"]
        assert re.fullmatch(r"\d+[smh]", rule.get("for", "")), f"{name}: no for:"
        assert rule["labels"]["severity"] in SEVERITIES, name
        assert rule["labels"]["component"] in {"agent", "controlplane"}, name
        ann = rule["annotations"]
        assert "{{" in ann["summary"] and "{{" in ann["description"], name
        assert ann["runbook_url"] == f"docs/operations-observability.md#{name.lower()}", name
        assert name in headings, f"{name} has no '### {name}' section in {DOC.name}"
    assert headings >= set(names)


def test_the_doc_table_of_alerts_matches_the_rules() -> None:
    rows = re.findall(r"^\| \[(\w+)\]\(#(\w+)\) \| (\w+) \|.*\| (\w+) \|$", DOC.read_text(), re.M)
    table = {name: (anchor, severity, for_) for name, anchor, severity, for_ in rows}
    rules = {
        r["alert"]: (r["alert"].lower(), r["labels"]["severity"], r["for"]) for r in alert_rules()
    }
    assert table == rules


def slug(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_the_doc_links_resolve() -> None:
    doc = DOC.read_text()
    for file, anchor in re.findall(r"\]\(([\w.-]*\.md)?#([\w-]+)\)", doc):
        target = (DOC.parent / file) if file else DOC
        assert target.exists(), file
        anchors = {slug(h) for h in re.findall(r"^#+ (.+)$", target.read_text(), re.M)}
        assert anchor in anchors, f"{file or DOC.name}#{anchor}"


def test_the_scrape_jobs_are_the_ones_the_rules_and_dashboards_name() -> None:
    config = yaml.safe_load(CONFIG.read_text())
    assert config["rule_files"] == ["alerts.yml"]
    jobs = {c["job_name"] for c in config["scrape_configs"]}
    assert jobs == JOBS
    exprs = [r["expr"] for r in alert_rules()]
    exprs += [e for found in dashboard_exprs().values() for e in found]
    named = {m.group(1) for e in exprs for m in re.finditer(r'job="([^"]+)"', e)}
    assert named == JOBS


def test_the_example_targets_use_the_default_ports_and_metrics_paths() -> None:
    ports = {"mcp-controlplane": Settings(data_dir=Path("unused")).port, "mcp-agent": AGENT_PORT}
    for job in yaml.safe_load(CONFIG.read_text())["scrape_configs"]:
        assert job["metrics_path"] == "/metrics"
        targets = [t for group in job["static_configs"] for t in group["targets"]]
        assert targets, job["job_name"]
        assert {int(t.rsplit(":", 1)[1]) for t in targets} == {ports[job["job_name"]]}


# -------------------------------------------------------------- every metric named is exported
def test_every_metric_a_rule_names_is_exported(exported: set[str]) -> None:
    exprs = [r["expr"] for r in alert_rules()]
    assert unknown_metrics(exprs, exported | PROMETHEUS_SERIES) == {}
    named = set().union(*(metric_names(e) for e in exprs))
    assert {"mcp_agent_request_latency_seconds_bucket", "mcp_agent_batch_fill_ratio_sum",
            "mcp_cp_devices_online", "mcp_cp_rollout_devices", "mcp_cp_broker_session_up",
            "mcp_cp_retraining_triggers_total"} <= named  # fmt: skip


def test_every_metric_a_dashboard_names_is_exported(exported: set[str]) -> None:
    for name, exprs in dashboard_exprs().items():
        assert exprs, name
        assert unknown_metrics(exprs, exported | PROMETHEUS_SERIES) == {}, name


def test_a_metric_renamed_in_the_code_is_reported(exported: set[str]) -> None:
    """What a rename does: the family's old names leave the exported set, and the rules and
    dashboards that read them are reported with the name they miss."""
    renamed = {n for n in exported if n.startswith("mcp_agent_batch_fill_ratio")}
    assert renamed
    after = (exported - renamed) | PROMETHEUS_SERIES
    missing = unknown_metrics([r["expr"] for r in alert_rules()], after)
    assert list(missing.values()) == [
        {"mcp_agent_batch_fill_ratio_sum", "mcp_agent_batch_fill_ratio_count"}
    ]
    missing = unknown_metrics(dashboard_exprs()["device.json"], after)
    assert set().union(*missing.values()) == {
        "mcp_agent_batch_fill_ratio_sum",
        "mcp_agent_batch_fill_ratio_count",
    }
    fake = 'histogram_quantile(0.95, sum by (le) (rate(mcp_agent_request_latency_secs_bucket{model="m"}[5m])))'
    assert unknown_metrics([fake], exported) == {fake: {"mcp_agent_request_latency_secs_bucket"}}


def test_sample_names_expand_each_family_as_the_text_format_writes_it() -> None:
    r = CollectorRegistry()
    Counter("c_total", "a counter", ["l"], registry=r)  # labelled: no sample yet
    Histogram("h_seconds", "a histogram", registry=r)
    Gauge("g", "a gauge", registry=r)
    assert sample_names([r]) == {
        "c_total",
        "c_created",
        "h_seconds_bucket",
        "h_seconds_sum",
        "h_seconds_count",
        "h_seconds_created",
        "g",
    }


# ------------------------------------------------------------------------- the PromQL reader
@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ("up", {"up"}),
        ('up{job="mcp-agent"} == 0', {"up"}),
        (
            "histogram_quantile(0.95, sum by (le, model) "
            "(rate(mcp_agent_request_latency_seconds_bucket[5m]))) > 0.12",
            {"mcp_agent_request_latency_seconds_bucket"},
        ),
        # aggregation clause after the argument; on/group_left label lists; bool; offset
        (
            "sum(rate(a_total[5m])) by (le) / on (instance) group_left (version) "
            "b_info offset 1h > bool 1",
            {"a_total", "b_info"},
        ),
        ("x / ignoring (reason) group_left sum by (instance) (y)", {"x", "y"}),
        ("(x unless x offset 15m) or increase(x[15m])", {"x"}),
        # label names in matchers are not metrics, nor are strings or regexes
        ('sum by (model) (m{model=~"a|b", cause!="bad_request"})', {"m"}),
        ('label_replace(m, "dst", "$1", "src", "(.*)")', {"m"}),
        ('count_values("version", m)', {"m"}),
        ("topk(5, m) and on () vector(1)", {"m"}),
        ('{__name__="by_name", job="x"}', {"by_name"}),
        # durations, subqueries, @, numbers and keywords
        ("max_over_time(deriv(g[30m])[1h:5m]) @ end() > 1e3", {"g"}),
        ("time() - process_start_time_seconds", {"process_start_time_seconds"}),
        ("m > Inf or m < -inf", {"m"}),
        ("atan2(m, n)", {"m", "n"}),
        ("m atan2 n", {"m", "n"}),
        # a recording rule's name with colons
        ("job:requests:rate5m > 0", {"job:requests:rate5m"}),
        # Grafana template variables
        ('rate(m{instance="$device", model=~"${model}"}[$__rate_interval])', {"m"}),
        ("sum(m) # a comment naming not_a_metric", {"m"}),
        ("1 + 2", set()),
    ],
)
def test_metric_names_of_an_expression(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


@pytest.mark.parametrize(
    ("expr", "error"),
    [
        ("rates(m[5m])", "unknown function 'rates'"),
        ('m{job="a"', "unclosed"),
        ("sum(m) by le", "without a label list"),
        ('{__name__=~"mcp_.*"}', "regex names no metric"),
        ("m ! n", "cannot read"),
    ],
)
def test_expressions_it_cannot_read_are_errors(expr: str, error: str) -> None:
    with pytest.raises(PromQLError, match=re.escape(error)):
        metric_names(expr)


# ------------------------------------------------------------------------------ the dashboards
def test_dashboards_are_what_the_script_writes() -> None:
    spec = importlib.util.spec_from_file_location("build_dashboards", OBS / "build_dashboards.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        rendered = module.render()
    finally:
        del sys.modules[spec.name]
    assert sorted(rendered) == sorted(DASHBOARDS)
    for name, text in rendered.items():
        assert (GRAFANA / name).read_text() == text, (
            f"{name} is stale: run python deploy/observability/build_dashboards.py"
        )


@pytest.mark.parametrize("name", DASHBOARDS)
def test_a_dashboard_is_valid_grafana_json(name: str) -> None:
    d = dashboard(name)
    assert 36 <= d["schemaVersion"] <= 41
    assert d["title"] and re.fullmatch(r"[a-z0-9-]{1,40}", d["uid"])
    variables = {v["name"]: v for v in d["templating"]["list"]}
    ds = variables["DS_PROMETHEUS"]
    assert (ds["type"], ds["query"]) == ("datasource", "prometheus")
    for v in variables.values():
        if v["type"] == "query":
            assert v["datasource"]["uid"] == "${DS_PROMETHEUS}", v["name"]
    panels = list(all_panels(d["panels"]))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), f"duplicate panel ids in {name}"
    cells: set[tuple[int, int]] = set()
    for p in panels:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["w"] > 0 and g["x"] + g["w"] <= 24, p["title"]
        covered = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not covered & cells, f"{p['title']} overlaps another panel"
        cells |= covered
        if p["type"] == "row":
            continue
        assert p["title"] and p.get("description"), p["id"]
        assert p["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}, p["title"]
        targets = p.get("targets", [])
        assert targets, f"{p['title']} has no target"
        assert len({t["refId"] for t in targets}) == len(targets), p["title"]
        for t in targets:
            assert t["expr"].strip(), p["title"]
            assert t.get("datasource", p["datasource"]) == p["datasource"], p["title"]
            # every template variable a query uses is defined
            for var in re.findall(r"\$\{?(\w+)\}?", t["expr"]):
                assert var.startswith("__") or var in variables, f"{p['title']}: ${var}"


def test_dashboards_have_distinct_uids_and_link_to_each_other() -> None:
    uids = [dashboard(n)["uid"] for n in DASHBOARDS]
    assert len(set(uids)) == len(uids)
    for name in DASHBOARDS:
        d = dashboard(name)
        assert "mcp-edge" in d["tags"]
        assert any(link["tags"] == ["mcp-edge"] for link in d["links"])


def test_grafana_provisioning_loads_the_data_source_and_the_dashboards() -> None:
    prov = GRAFANA / "provisioning"
    sources = yaml.safe_load((prov / "datasources" / "prometheus.yml").read_text())
    assert sources["apiVersion"] == 1
    (source,) = sources["datasources"]
    assert source["type"] == "prometheus" and source["isDefault"] is True
    providers = yaml.safe_load((prov / "dashboards" / "mcp-edge.yml").read_text())
    assert providers["apiVersion"] == 1
    (provider,) = providers["providers"]
    assert provider["type"] == "file" and provider["options"]["path"].startswith("/")
    # The doc shows the mounts that make the provider's path hold these dashboards.
    doc = DOC.read_text()
    assert f"deploy/observability/grafana:{provider['options']['path']}" in doc
    assert "deploy/observability/grafana/provisioning:/etc/grafana/provisioning" in doc
    for name in DASHBOARDS:
        assert name in doc
