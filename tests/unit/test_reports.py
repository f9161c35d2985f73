"""The agent's pydantic-free encoders write the very bytes the pydantic models do.

The control plane validates what devices send with the models in shared/protocol/telemetry.py
and state.py; the agent builds the plain twins in shared/protocol/reports.py. For random valid
values, each twin encodes to the same bytes as its model built from the same values, and the
model reads those bytes back as the same message.
"""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mcp_edge.shared.protocol import (
    DeploymentEvent,
    ErrorCode,
    ErrorReply,
    HealthSample,
    InferenceStats,
    Message,
    ModelInferenceStats,
    ReportedState,
    decode,
    encode,
)
from mcp_edge.shared.protocol.reports import (
    DeploymentPhase,
    EventOutcome,
    EventReport,
    GpuReport,
    HealthReport,
    InferenceReport,
    InferenceRole,
    LatencyReport,
    ModelInferenceReport,
    ModelStatusReport,
    StateReport,
    as_wire,
    encode_report,
)
from mcp_edge.shared.protocol.wire import error_reply_body

ids = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,20}", fullmatch=True)
versions = st.text(min_size=5, max_size=40)
counts = st.integers(0, 2**40)


def number(lo: float = 0.0, hi: float = 1e12) -> st.SearchStrategy[float]:
    """A float field's value: a float, or an int (the model takes it and writes a float)."""
    return st.floats(lo, hi, allow_nan=False) | st.integers(math.ceil(lo), int(min(hi, 2**31)))


def maybe(s: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.none() | s


gpus = st.builds(
    GpuReport, util_percent=maybe(number(0, 100)), mem_used_mb=maybe(number()),
    mem_total_mb=maybe(number()), emc_percent=maybe(number(0, 100)), power_mw=maybe(number()),
)  # fmt: skip
health = st.builds(
    HealthReport, device_id=ids, ts=number(-1e10, 1e10), cpu_percent=number(0, 100 * 1024),
    load_1m=maybe(number()), mem_total_mb=number(), mem_used_mb=number(),
    disk_total_mb=maybe(number()), disk_free_mb=maybe(number()), process_rss_mb=maybe(number()),
    uptime_s=maybe(number()),
    temperatures_c=st.dictionaries(st.text(max_size=20), number(-100, 250), max_size=8),
    gpu=maybe(gpus), energy_j=maybe(number()),
)  # fmt: skip


@st.composite
def model_stats(draw: st.DrawFn) -> ModelInferenceReport:
    """Counters the schema accepts: a histogram (or none) adding up to the successful requests,
    strictly increasing edges, no more agreed shadow answers than compared ones."""
    edges = sorted(set(draw(st.lists(number(0, 1e6), max_size=16))))
    buckets = st.lists(st.integers(0, 2**30), min_size=len(edges) + 1, max_size=len(edges) + 1)
    hist = draw(maybe(buckets)) or []
    succeeded = sum(hist) if hist else draw(counts)
    errors, rejections, compared = draw(counts), draw(counts), draw(counts)
    return ModelInferenceReport(
        model=draw(ids), version=draw(versions), role=draw(st.sampled_from(InferenceRole)),
        count=succeeded + errors + rejections, errors=errors, rejections=rejections,
        latency=draw(maybe(st.builds(LatencyReport, p50_ms=number(), p95_ms=number(),
                                     p99_ms=number()))),
        latency_bucket_edges_ms=edges, latency_bucket_counts=hist, queue_depth=draw(counts),
        batch_size_avg=draw(maybe(number())), batch_fill_ratio=draw(maybe(number(0, 1))),
        shadow_compared=compared, shadow_agreed=draw(st.integers(0, compared)),
    )  # fmt: skip


inference = st.builds(
    InferenceReport, device_id=ids, ts=number(), window_s=number(1e-3, 1e6),
    models=st.lists(model_stats(), max_size=4),
)  # fmt: skip
statuses = st.builds(
    ModelStatusReport, name=ids, phase=st.sampled_from(DeploymentPhase),
    active_version=maybe(versions), canary_version=maybe(versions),
    shadow_version=maybe(versions), installed_versions=st.lists(versions, max_size=4),
    last_error=maybe(st.text(max_size=200)),
)  # fmt: skip
states = st.builds(
    StateReport, device_id=ids, ts=number(), applied_seq=counts, profile=ids,
    backends=st.lists(st.text(max_size=20), max_size=4), agent_version=st.text(max_size=64),
    models=st.lists(statuses, max_size=4),
)  # fmt: skip
events = st.builds(
    EventReport, device_id=ids, event_seq=counts, ts=number(), model=ids, version=versions,
    phase=st.sampled_from(DeploymentPhase), outcome=st.sampled_from(EventOutcome),
    message=st.text(max_size=300), cause=maybe(st.text(max_size=64)),
    bytes_done=maybe(counts), bytes_total=maybe(counts), elapsed_ms=maybe(number()),
)  # fmt: skip

TWINS: list[tuple[st.SearchStrategy[Any], type[Message]]] = [
    (health, HealthSample),
    (inference, InferenceStats),
    (states, ReportedState),
    (events, DeploymentEvent),
]


@pytest.mark.parametrize(("reports", "model"), TWINS, ids=[m.__name__ for _, m in TWINS])
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_plain_report_encodes_to_the_bytes_of_its_model(
    reports: st.SearchStrategy[Any], model: type[Message], data: st.DataObject
) -> None:
    report = data.draw(reports)
    message = model.model_validate(dataclasses.asdict(report))
    payload = encode_report(report)
    assert payload == encode(message)
    assert decode(payload, model) == message
    assert encode_report(message) == payload  # a model given to encode_report: the same bytes


def test_an_int_in_a_float_field_is_written_as_a_float_and_none_is_left_out() -> None:
    report = HealthReport(device_id="cam-1", ts=1700000000, cpu_percent=3, mem_total_mb=512,
                          mem_used_mb=100.5, gpu=GpuReport(power_mw=250))  # fmt: skip
    assert encode_report(report) == (
        b'{"device_id":"cam-1","ts":1700000000.0,"cpu_percent":3.0,"mem_total_mb":512.0,'
        b'"mem_used_mb":100.5,"temperatures_c":{},"gpu":{"power_mw":250.0}}'
    )
    assert as_wire(StateReport(device_id="cam-1", ts=1.0, applied_seq=3, profile="p",
                               models=[ModelStatusReport(name="digits")])) == {
        "device_id": "cam-1", "ts": 1.0, "applied_seq": 3, "profile": "p", "backends": [],
        "agent_version": "", "models": [{"name": "digits", "phase": "idle",
                                         "installed_versions": []}],
    }  # fmt: skip
    with pytest.raises(TypeError):
        encode_report({"device_id": "cam-1"})


def test_building_and_encoding_reports_loads_no_pydantic() -> None:
    code = (
        "import sys\n"
        "from mcp_edge.shared.protocol.reports import HealthReport, encode_report\n"
        "encode_report(HealthReport(device_id='d', ts=1.0, cpu_percent=0.0, mem_total_mb=1.0,"
        " mem_used_mb=1.0))\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('pydantic', 'pydantic_core')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(max_size=300),
    code=st.sampled_from(ErrorCode),
    retry_after_s=maybe(number(0, 3600)),
)
def test_the_plain_error_reply_is_the_bytes_of_the_model(
    text: str, code: ErrorCode, retry_after_s: float | None
) -> None:
    # MQTT inference answers every failure with it, without loading the models.
    model = ErrorReply(error=text, code=code, retry_after_s=retry_after_s)
    assert error_reply_body(text, code, retry_after_s) == encode(model)


def _stats(**fields: Any) -> dict[str, Any]:
    return {"model": "digits", "version": "1.2.0", "count": 10, "errors": 1, **fields}


def test_inference_stats_of_an_older_agent_still_validate_as_stable() -> None:
    # Before roles: no role, no shadow counters, a histogram of the successful requests.
    old = ModelInferenceStats.model_validate(
        _stats(latency_bucket_edges_ms=[1.0, 10.0], latency_bucket_counts=[4, 4, 1])
    )
    assert old.role is InferenceRole.STABLE and (old.shadow_compared, old.shadow_agreed) == (0, 0)
    assert ModelInferenceStats.model_validate(_stats()).latency_bucket_counts == []
    shadow = ModelInferenceStats.model_validate(
        _stats(role="shadow", shadow_compared=9, shadow_agreed=8)
    )
    assert shadow.role is InferenceRole.SHADOW


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ({"role": "retiring"}, "role"),
        ({"errors": 6, "rejections": 5}, "more than count"),
        ({"latency_bucket_edges_ms": [1.0, 1.0], "latency_bucket_counts": [9, 0, 0]},
         "strictly increasing"),
        ({"latency_bucket_edges_ms": [5.0, 1.0], "latency_bucket_counts": [9, 0, 0]},
         "strictly increasing"),
        ({"latency_bucket_edges_ms": [-1.0, 1.0], "latency_bucket_counts": [9, 0, 0]}, ">= 0"),
        ({"latency_bucket_edges_ms": [1.0, 2.0], "latency_bucket_counts": [9, 0]}, "one more"),
        ({"latency_bucket_counts": [9, 0]}, "one more"),
        ({"latency_bucket_edges_ms": [1.0], "latency_bucket_counts": [10, 0]}, "add up to 10"),
        ({"latency_bucket_edges_ms": [1.0], "latency_bucket_counts": [10, -1]}, ">= 0"),
        ({"shadow_compared": 3, "shadow_agreed": 4}, "shadow_agreed"),
        ({"shadow_compared": -1}, "greater than or equal"),
    ],
)  # fmt: skip
def test_inference_stats_that_contradict_themselves_are_refused(
    fields: dict[str, Any], why: str
) -> None:
    with pytest.raises(ValueError, match=why):
        ModelInferenceStats.model_validate(_stats(**fields))
