"""What a multi-process server (``mcp-agent serve --processes N``) reports as one: ``/metrics``
summed over every process's registry (:func:`merge_families`) and the Triton statistics summed
over every process's counters (:func:`merge_model_stats`). Real prometheus_client registries
(each process's :class:`AgentMetrics`) and real :class:`VersionStatistics`."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.parser import text_string_to_metric_families

from mcp_edge.agent.runtime.statistics import VersionStatistics, merge_model_stats
from mcp_edge.agent.serving.metrics import AgentMetrics, merge_families

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _samples(text: bytes) -> Samples:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text.decode())
        for s in fam.samples
    }


def _merged(*registries: CollectorRegistry, processes: int = 2) -> Samples:
    return _samples(merge_families([list(r.collect()) for r in registries], processes=processes))


def _created(registry: CollectorRegistry, name: str) -> float:
    return next(
        s.value for fam in registry.collect() for s in fam.samples if s.name == name + "_created"
    )


# ---------------------------------------------------------------------------- /metrics
def test_counters_and_histograms_add_up_sample_by_sample() -> None:
    a, b = AgentMetrics(), AgentMetrics()
    a.requests.labels("digits", "v2", "200").inc(3)
    b.requests.labels("digits", "v2", "200").inc(4)
    b.requests.labels("digits", "v2", "404").inc()
    a.latency.labels("digits", "1").observe(0.003)
    b.latency.labels("digits", "1").observe(0.003)
    b.latency.labels("digits", "1").observe(7.0)
    a.errors.labels("digits", "internal").inc()
    b.errors.labels("digits", "internal").inc(2)
    a.load_seconds.labels("digits").observe(0.2)
    b.load_seconds.labels("digits").observe(0.3)
    a.queue_depth.labels("digits", "1").set(2)  # waiting requests: every process's add up
    b.queue_depth.labels("digits", "1").set(3)

    m = _merged(a.registry, b.registry)

    ok = (("code", "200"), ("model", "digits"), ("protocol", "v2"))
    assert m[("mcp_agent_requests_total", ok)] == 7
    assert m[("mcp_agent_requests_total", (("code", "404"), *ok[1:]))] == 1
    latency = (("model", "digits"), ("version", "1"))
    assert m[("mcp_agent_request_latency_seconds_bucket", (("le", "0.005"), *latency))] == 2
    assert m[("mcp_agent_request_latency_seconds_bucket", (("le", "+Inf"), *latency))] == 3
    assert m[("mcp_agent_request_latency_seconds_count", latency)] == 3
    assert m[("mcp_agent_request_latency_seconds_sum", latency)] == pytest.approx(7.006)
    cause = (("cause", "internal"), ("model", "digits"))
    assert m[("mcp_agent_inference_errors_total", cause)] == 3
    assert m[("mcp_agent_model_load_seconds_count", (("model", "digits"),))] == 2
    assert m[("mcp_agent_model_load_seconds_sum", (("model", "digits"),))] == pytest.approx(0.5)
    assert m[("mcp_agent_queue_depth", latency)] == 5
    # A counter's creation time is a time, not a quantity: the earliest, never a sum.
    earliest = min(_created(a.registry, "mcp_agent_inference_errors"),
                   _created(b.registry, "mcp_agent_inference_errors"))  # fmt: skip
    assert m[("mcp_agent_inference_errors_created", cause)] == earliest


def test_gauges_that_state_one_fact_for_the_server_are_not_added() -> None:
    a, b = AgentMetrics(), AgentMetrics()
    for m in (a, b):
        m.models_loaded.set(2)
        m.model_info.labels("digits", "1", "stable", "onnxruntime", "cpu").set(1)
        m.canary_weight.labels("digits").set(0.25)
    a.shadow_agreement.labels("digits", "2").set(0.5)
    b.shadow_agreement.labels("digits", "2").set(1.0)

    m = _merged(a.registry, b.registry, processes=3)

    assert m[("mcp_agent_model_versions_loaded", ())] == 2
    info = (("backend", "onnxruntime"), ("model", "digits"), ("provider", "cpu"),
            ("role", "stable"), ("version", "1"))  # fmt: skip
    assert m[("mcp_agent_model_info", info)] == 1
    assert m[("mcp_agent_canary_weight", (("model", "digits"),))] == 0.25
    assert m[("mcp_agent_shadow_agreement_ratio", (("model", "digits"), ("version", "2")))] == 0.75
    # However many each process says, the server says how many processes serve.
    assert m[("mcp_agent_serving_processes", ())] == 3


def test_process_start_time_is_the_earliest_and_one_process_series_are_kept() -> None:
    regs = []
    for started, extra in ((200.0, None), (100.0, "only-here")):
        r = CollectorRegistry()
        Gauge("process_start_time_seconds", "Start time.", registry=r).set(started)
        g = Gauge("mcp_agent_queue_depth", "Queued.", ["model", "version"], registry=r)
        g.labels("digits", "1").set(1)
        if extra:
            g.labels(extra, "1").set(4)
        regs.append(r)

    m = _merged(*regs)

    assert m[("process_start_time_seconds", ())] == 100.0
    assert m[("mcp_agent_queue_depth", (("model", "digits"), ("version", "1")))] == 2
    assert m[("mcp_agent_queue_depth", (("model", "only-here"), ("version", "1")))] == 4


def test_the_merged_exposition_has_each_family_once() -> None:
    a, b = AgentMetrics(), AgentMetrics()
    text = merge_families([list(a.registry.collect()), list(b.registry.collect())], processes=2)
    types = [line for line in text.decode().splitlines() if line.startswith("# TYPE ")]
    assert len(types) == len(set(types))
    assert "# TYPE mcp_agent_requests_total counter" in types


# ---------------------------------------------------------------------------- statistics
def _events_1(s: VersionStatistics) -> None:
    s.on_batch(2, 2, 0.004, 0.002)
    s.on_success(0.010, 1, 0.0001, 0.0002)
    s.on_success(0.011, 1, 0.0001, 0.0002)


def _events_2(s: VersionStatistics) -> None:
    s.on_batch(1, 1, 0.001, 0.001)
    s.on_batch(2, 1, 0.003, 0.0025)
    s.on_batch(4, 1, 0.0, 0.004)
    s.on_success(0.020, 4, 0.0003, 0.0001)
    s.on_failure(0.500)


def test_statistics_of_two_processes_sum_to_what_one_process_would_have_counted() -> None:
    one, two, whole = VersionStatistics(), VersionStatistics(), VersionStatistics()
    _events_1(one)
    _events_2(two)
    _events_1(whole)
    _events_2(whole)
    groups = [[one.to_json("digits", "1")], [two.to_json("digits", "1")]]
    given = copy.deepcopy(groups)

    [merged] = merge_model_stats(groups)

    expected = whole.to_json("digits", "1")
    assert {k: v for k, v in merged.items() if k != "last_inference"} == {
        k: v for k, v in expected.items() if k != "last_inference"
    }
    assert merged["inference_count"] == 6
    assert merged["execution_count"] == 4
    assert [b["batch_size"] for b in merged["batch_stats"]] == [1, 2, 4]
    assert merged["batch_stats"][1]["compute_infer"]["count"] == 2
    assert merged["last_inference"] == max(one.last_inference_ms, two.last_inference_ms)
    assert groups == given  # the processes' own answers are not changed


def test_statistics_keep_versions_apart_and_list_models_by_name() -> None:
    def entry(name: str, version: str, count: int, last: int) -> dict[str, Any]:
        s = VersionStatistics()
        for _ in range(count):
            s.on_success(0.001, 1, 0.0, 0.0)
        e = s.to_json(name, version)
        e["last_inference"] = last
        return e

    merged = merge_model_stats([
        [entry("zeta", "1", 1, 10), entry("digits", "2", 2, 50)],
        [entry("digits", "1", 3, 30), entry("digits", "2", 4, 40)],
    ])  # fmt: skip

    assert [(e["name"], e["version"], e["inference_count"], e["last_inference"]) for e in merged] \
        == [("digits", "2", 6, 50), ("digits", "1", 3, 30), ("zeta", "1", 1, 10)]  # fmt: skip
    success = merged[0]["inference_stats"]["success"]
    assert success["count"] == 6
