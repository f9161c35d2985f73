"""Rollout specs: every refusal names its field, stage sizes follow the documented rule, and
specs, states and device progress survive their JSON forms."""

from __future__ import annotations

import copy
import json
import math
import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mcp_edge.controlplane.rollouts.model import (
    DevicePhase,
    DeviceProgress,
    FailAction,
    Gate,
    GateMetric,
    GateResult,
    RolloutState,
    RolloutStatus,
    StageMode,
)
from mcp_edge.controlplane.rollouts.spec import (
    SpecError,
    parse_spec,
    plan_stage_sizes,
    progress_from_dict,
    progress_to_dict,
    spec_to_dict,
    state_from_dict,
    state_to_dict,
)
from mcp_edge.shared.errors import McpError


def base() -> dict[str, Any]:
    return {
        "model": "digits",
        "version": "1.3.0",
        "target": {"group": "lab"},
        "stages": [
            {
                "count": 2,
                "mode": "canary",
                "weight": 0.2,
                "bake_s": 60,
                "gates": [{"metric": "error_rate", "threshold": 0.05}],
            },
            {"percent": 100},
        ],
    }


def with_(path: str, value: Any) -> dict[str, Any]:
    """``base()`` with one field set (``stages.0.gates.0.threshold``); ``...`` deletes it."""
    doc = base()
    *parents, last = path.split(".")
    node: Any = doc
    for p in parents:
        node = node[int(p)] if isinstance(node, list) else node.setdefault(p, {})
    if value is ...:
        del node[int(last) if isinstance(node, list) else last]
    elif isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return doc


def refused(doc: Any) -> str:
    with pytest.raises(SpecError) as e:
        parse_spec(doc)
    assert isinstance(e.value, McpError)
    return str(e.value)


def test_the_base_spec_parses_with_its_defaults() -> None:
    spec = parse_spec(base())
    assert (spec.model, spec.version, spec.target.group) == ("digits", "1.3.0", "lab")
    first, last = spec.stages
    assert (first.count, first.mode, first.weight, first.bake_s) == (2, StageMode.CANARY, 0.2, 60)
    assert first.gates == (Gate(GateMetric.ERROR_RATE, 0.05),)
    assert (last.percent, last.mode, last.bake_s, last.gates) == (100, StageMode.SWITCH, 300, ())
    assert (spec.rate.per_minute, spec.rate.growth, spec.device_timeout_s) == (None, 1.0, 600)


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        ("colour", "red", "spec: unknown key(s) 'colour'"),
        ("target.site", "a", "target: unknown key(s) 'site'"),
        ("stages.0.size", 3, "stages[0]: unknown key(s) 'size'"),
        ("stages.0.gates.0.max", 1, "stages[0].gates[0]: unknown key(s) 'max'"),
        ("rate.burst", 1, "rate: unknown key(s) 'burst'"),
        ("model", ..., "spec: missing model"),
        ("stages.0.gates.0.threshold", ..., "stages[0].gates[0]: missing threshold"),
        ("model", "digits/x", "model: 'digits/x' is not an identifier"),
        ("model", "-digits", "model: '-digits' is not an identifier"),
        ("model", "d" * 65, "is not an identifier"),
        ("version", "1.3", "version: '1.3' is not a semantic version"),
        ("version", "1.3.0-" + "a" * 130, "is not a semantic version"),
        ("version", 130, "version: 130 is not a semantic version"),
        ("stages", [], "stages: a rollout needs at least one stage"),
        ("stages", [{"percent": 2}] * 50 + [{"count": 1}], "stages: 51 entries; at most 50"),
        ("stages", {"count": 1}, "stages: expected a list"),
        ("stages.0", 7, "stages[0]: expected an object, got int"),
        (
            "stages.0.gates",
            [{"metric": "error_rate", "threshold": 0.1}] * 17,
            "stages[0].gates: 17 entries; at most 16",
        ),
        (
            "target",
            {"devices": [f"d{i}" for i in range(10_001)]},
            "target.devices: 10001 entries; at most 10000",
        ),
        ("target", {"devices": ["a", "b", "a"]}, "target.devices: 'a' is listed twice"),
        ("target", {"devices": ["ok", "no way"]}, "target.devices[1]: 'no way' is not an"),
        (
            "target",
            {"labels": {f"k{i}": "v" for i in range(33)}},
            "target.labels: 33 labels; at most 32",
        ),
        ("target", {"labels": {"Site": "a"}}, "target.labels: key 'Site' must be 1-63 chars"),
        ("target", {"labels": {"site": "a\nb"}}, "target.labels.site: the value must be"),
        ("target", {"labels": {"site": 3}}, "target.labels.site: the value must be"),
        ("target", {"group": "lab one"}, "target.group: 'lab one' is not an identifier"),
        ("target", {"profiles": ["jetson orin"]}, "target.profiles[0]: 'jetson orin'"),
        (
            "target",
            {},
            "target: the target selects nothing: name devices, a group, labels or profiles",
        ),
        ("target", {"devices": [], "labels": {}}, "the target selects nothing"),
        ("stages.0.percent", 10, "stages[0]: give exactly one of count or percent"),
        ("stages.0.count", ..., "stages[0]: give exactly one of count or percent"),
        ("stages.0.count", 0, "stages[0].count: 0 is out of range"),
        ("stages.0.count", 2.0, "stages[0].count: expected an integer, got 2.0"),
        ("stages.0.count", True, "stages[0].count: expected an integer, got True"),
        ("stages.1.percent", 0, "stages[1].percent: 0 is out of range: must be > 0"),
        ("stages.1.percent", 100.5, "stages[1].percent: 100.5 is out of range"),
        ("stages.1.percent", "50", "stages[1].percent: expected a number, got '50'"),
        ("stages.1.percent", math.nan, "stages[1].percent: nan is out of range"),
        (
            "stages.0.mode",
            "blue-green",
            "stages[0].mode: 'blue-green' is not one of switch, canary, shadow",
        ),
        ("stages.0.weight", 0, "stages[0].weight: 0 is out of range: must be > 0 and < 1"),
        ("stages.0.weight", 1, "stages[0].weight: 1 is out of range: must be > 0 and < 1"),
        ("stages.1.weight", 0.3, "stages[1].weight: applies to canary stages only, not switch"),
        ("stages.0.bake_s", -1, "stages[0].bake_s: -1 is out of range: must be >= 0 and <= 604800"),
        ("stages.0.bake_s", 7 * 86_400 + 1, "stages[0].bake_s: 604801 is out of range"),
        ("stages.0.prefetch", "yes", "stages[0].prefetch: expected true or false"),
        ("stages.0.approval", 1, "stages[0].approval: expected true or false"),
        ("stages.0.gates.0.metric", "cpu", "stages[0].gates[0].metric: 'cpu' is not one of"),
        (
            "stages.0.gates.0.threshold",
            1.0,
            "stages[0].gates[0].threshold: a error_rate gate at 1 can never fail: use < 1",
        ),
        ("stages.0.gates.0.threshold", 1.5, "stages[0].gates[0].threshold: 1.5 is out of range"),
        ("stages.0.gates.0.threshold", -0.01, "stages[0].gates[0].threshold: -0.01 is out of"),
        (
            "stages.0.gates.0",
            {"metric": "install_failure_rate", "threshold": 1},
            "a install_failure_rate gate at 1 can never fail",
        ),
        (
            "stages.0.gates.0",
            {"metric": "latency_p95_ratio", "threshold": 0},
            "stages[0].gates[0].threshold: 0 is out of range: must be > 0 and <= 100",
        ),
        (
            "stages.0.gates.0",
            {"metric": "latency_p95_ratio", "threshold": 101},
            "stages[0].gates[0].threshold: 101 is out of range",
        ),
        (
            "stages.0.gates.0",
            {"metric": "agreement", "threshold": 0.9},
            "stages[0].gates[0].metric: an agreement gate needs a shadow stage, not canary",
        ),
        (
            "stages.0.gates.0",
            {"metric": "drift", "threshold": 0},
            "stages[0].gates[0].threshold: 0 is out of range: must be > 0",
        ),
        ("stages.0.gates.0.min_devices", 0, "stages[0].gates[0].min_devices: 0 is out of range"),
        ("stages.0.gates.0.min_requests", -1, "stages[0].gates[0].min_requests: -1 is out of"),
        ("stages.0.gates.0.on_fail", "ignore", "stages[0].gates[0].on_fail: 'ignore' is not one"),
        ("stages.0.gates.0.dry_run", "no", "stages[0].gates[0].dry_run: expected true or false"),
        (
            "stages.0.gates",
            [
                {"metric": "error_rate", "threshold": 0.1},
                {"metric": "error_rate", "threshold": 0.2},
            ],
            "stages[0].gates: two error_rate gates; one per metric and stage",
        ),
        ("rate", {"per_minute": 0}, "rate.per_minute: 0 is out of range: must be > 0"),
        ("rate", {"per_minute": -3}, "rate.per_minute: -3 is out of range"),
        ("rate", {"growth": 0.5}, "rate.growth: 0.5 is out of range: must be >= 1 and <= 10"),
        ("rate", {"growth": 11}, "rate.growth: 11 is out of range"),
        ("device_timeout_s", 5, "device_timeout_s: 5 is out of range: must be >= 10"),
        ("device_timeout_s", 8 * 86_400, "device_timeout_s: 691200 is out of range"),
    ],
)
def test_every_refusal_names_its_field(path: str, value: Any, message: str) -> None:
    assert message in refused(with_(path, value))


def test_agreement_gates_belong_to_shadow_stages_and_refuse_a_floor_that_cannot_fail() -> None:
    shadow = with_(
        "stages.0",
        {"count": 2, "mode": "shadow", "gates": [{"metric": "agreement", "threshold": 0.9}]},
    )
    assert parse_spec(shadow).stages[0].gates[0].metric is GateMetric.AGREEMENT
    shadow["stages"][0]["gates"][0]["threshold"] = 0
    assert "an agreement gate at 0 can never fail: use > 0" in refused(shadow)
    shadow["stages"][0]["gates"][0]["threshold"] = 1.01
    assert "stages[0].gates[0].threshold: 1.01 is out of range" in refused(shadow)


def test_percents_must_sum_to_100_and_mixed_sizes_end_in_a_percent_stage() -> None:
    doc = with_("stages", [{"percent": 10}, {"percent": 40}, {"percent": 40}])
    assert "stages: the percents sum to 90, not 100" in refused(doc)
    doc = with_("stages", [{"percent": 10}, {"percent": 90.0000001}])
    assert [s.percent for s in parse_spec(doc).stages] == [10, 90.0000001]
    doc = with_("stages", [{"percent": 10}, {"count": 5}])
    assert "the last stage must be a percent stage" in refused(doc)
    assert parse_spec(with_("stages", [{"count": 3}, {"count": 5}])).stages[1].count == 5


def test_not_a_mapping_is_refused() -> None:
    assert "spec: expected an object, got list" in refused([])
    assert "target: expected an object, got str" in refused(with_("target", "lab"))


# ------------------------------------------------------------------------------ stage sizes
def sized(*stages: dict[str, Any]) -> Any:
    return parse_spec(with_("stages", list(stages)))


def test_stage_sizes_round_half_up_take_at_least_one_and_leave_the_rest_to_the_last() -> None:
    assert plan_stage_sizes(sized({"percent": 10}, {"percent": 40}, {"percent": 50}), 7) == [
        1,
        3,
        3,
    ]
    assert plan_stage_sizes(sized({"percent": 25}, {"percent": 75}), 10) == [3, 7]  # 2.5 -> 3
    assert plan_stage_sizes(sized({"percent": 1}, {"percent": 99}), 10) == [1, 9]
    assert plan_stage_sizes(sized({"count": 2}, {"percent": 10}, {"percent": 100}), 40) == [
        2,
        4,
        34,
    ]
    assert plan_stage_sizes(sized({"count": 2}, {"count": 3}), 5) == [2, 3]
    assert plan_stage_sizes(sized({"percent": 100}), 1) == [1]


def test_stage_sizes_that_do_not_add_up_are_refused_with_the_numbers() -> None:
    with pytest.raises(
        SpecError,
        match=r"the stages' counts add up to 5 device\(s\) but the "
        r"target has 6",
    ):
        plan_stage_sizes(sized({"count": 2}, {"count": 3}), 6)
    with pytest.raises(
        SpecError,
        match=r"stages 1 to 2 take 5 of the target's 5 device\(s\) "
        r"\(2, 3\); the last stage would get nothing",
    ):
        plan_stage_sizes(sized({"count": 2}, {"count": 3}, {"percent": 100}), 5)
    with pytest.raises(SpecError, match="the last stage would get nothing"):
        plan_stage_sizes(sized({"percent": 1}, {"percent": 1}, {"percent": 98}), 2)
    with pytest.raises(SpecError, match="the target selects no device"):
        plan_stage_sizes(sized({"percent": 100}), 0)


# ------------------------------------------------------------------------------ round trips
identifiers = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,10}", fullmatch=True)
floats01 = st.floats(0.0, 0.99, allow_nan=False)


@st.composite
def gate_docs(draw: st.DrawFn, mode: str) -> list[dict[str, Any]]:
    metrics = ["install_failure_rate", "error_rate", "latency_p95_ratio", "drift"]
    if mode == "shadow":
        metrics.append("agreement")
    chosen = draw(st.lists(st.sampled_from(metrics), unique=True, max_size=len(metrics)))
    gates = []
    for m in chosen:
        if m == "agreement":
            threshold = draw(st.floats(0.01, 1.0))
        elif m in ("latency_p95_ratio", "drift"):
            threshold = draw(st.floats(0.01, 100.0))
        else:
            threshold = draw(floats01)
        gate: dict[str, Any] = {"metric": m, "threshold": threshold}
        if draw(st.booleans()):
            gate |= {
                "min_devices": draw(st.integers(1, 50)),
                "min_requests": draw(st.integers(0, 10**6)),
                "on_fail": draw(st.sampled_from(["rollback", "pause"])),
                "dry_run": draw(st.booleans()),
            }
        gates.append(gate)
    return gates


@st.composite
def spec_docs(draw: st.DrawFn) -> dict[str, Any]:
    k = draw(st.integers(1, 6))
    stages: list[dict[str, Any]] = []
    counts = draw(st.booleans())
    cuts = sorted(draw(st.lists(st.integers(1, 99), unique=True, min_size=k - 1, max_size=k - 1)))
    percents = [b - a for a, b in zip([0, *cuts], [*cuts, 100], strict=True)]
    for i in range(k):
        mode = draw(st.sampled_from(["switch", "canary", "shadow"]))
        stage: dict[str, Any] = (
            {"count": draw(st.integers(1, 1000))}
            if counts and i < k - 1
            else {"percent": float(percents[i]) if not counts else 100.0}
        )
        stage["mode"] = mode
        if mode == "canary" and draw(st.booleans()):
            stage["weight"] = draw(st.floats(0.01, 0.99))
        stage |= {
            "bake_s": draw(st.floats(0, 7 * 86_400)),
            "prefetch": draw(st.booleans()),
            "approval": draw(st.booleans()),
            "gates": draw(gate_docs(mode)),
        }
        stages.append(stage)
    target: dict[str, Any] = {"devices": draw(st.lists(identifiers, unique=True, max_size=5))}
    if draw(st.booleans()) or not target["devices"]:
        target["group"] = draw(identifiers)
    target["labels"] = draw(
        st.dictionaries(
            st.from_regex(r"[a-z][a-z0-9]{0,5}", fullmatch=True),
            st.text(max_size=8).filter(str.isprintable),
            max_size=3,
        )
    )
    target["profiles"] = sorted(draw(st.sets(identifiers, max_size=2)))
    return {
        "model": draw(identifiers),
        "version": draw(st.sampled_from(["1.0.0", "2.1.0-rc1", "v0.3.9+build.7"])),
        "target": target,
        "stages": stages,
        "rate": {
            "per_minute": draw(st.none() | st.floats(0.1, 1000)),
            "growth": draw(st.floats(1, 10)),
        },
        "device_timeout_s": draw(st.floats(10, 7 * 86_400)),
    }


@settings(max_examples=60, deadline=None)
@given(spec_docs())
def test_a_spec_survives_its_json_form(doc: dict[str, Any]) -> None:
    spec = parse_spec(doc)
    text = json.dumps(spec_to_dict(spec), allow_nan=False)
    assert parse_spec(json.loads(text)) == spec
    assert spec_to_dict(parse_spec(json.loads(text))) == spec_to_dict(spec)


def test_the_json_form_of_a_spec_keeps_every_setting() -> None:
    doc = base()
    doc["stages"][0]["gates"][0] |= {
        "min_devices": 2,
        "min_requests": 7,
        "on_fail": "pause",
        "dry_run": True,
    }
    doc["rate"] = {"per_minute": 4, "growth": 2}
    spec = parse_spec(doc)
    gate = spec.stages[0].gates[0]
    assert (gate.min_devices, gate.min_requests, gate.on_fail, gate.dry_run) == (
        2,
        7,
        FailAction.PAUSE,
        True,
    )
    again = spec_to_dict(spec)
    assert again["stages"][0]["gates"][0] == {
        "metric": "error_rate",
        "threshold": 0.05,
        "min_devices": 2,
        "min_requests": 7,
        "on_fail": "pause",
        "dry_run": True,
    }
    assert again["rate"] == {"per_minute": 4, "growth": 2}
    assert "weight" not in again["stages"][1]  # a switch stage has no weight to give


def a_state() -> RolloutState:
    gates = (
        GateResult(GateMetric.LATENCY_P95_RATIO, "fail", math.inf, 1.5, 2, 300, False, "slow"),
        GateResult(GateMetric.ERROR_RATE, "pending", None, 0.05, 0, 0, True, "waiting"),
    )
    return RolloutState(
        RolloutStatus.PAUSED,
        stage=2,
        stage_started_at=1000.5,
        bake_started_at=1100.0,
        approved=frozenset({0, 2}),
        gates=gates,
        reason="paused by ann",
        finalized=False,
        reported_invalid=frozenset({"cam-1"}),
        reported_dry_run=frozenset({GateMetric.ERROR_RATE}),
    )


def test_a_state_survives_its_json_form_without_its_devices() -> None:
    progress = DeviceProgress(
        "cam-1", 2, DevicePhase.MOVING, 1000.5, 1000.5, "1.0.0", StageMode.CANARY
    )
    state = a_state()
    text = json.dumps(state_to_dict(replace_devices(state, {"cam-1": progress})), allow_nan=False)
    back = state_from_dict(json.loads(text))
    assert back == state and back.devices == {}
    assert state_from_dict(json.loads(text), {"cam-1": progress}).devices == {"cam-1": progress}
    assert math.isinf(back.gates[0].value or 0.0)
    for p in (progress, DeviceProgress("cam-2", 0)):
        assert progress_from_dict(json.loads(json.dumps(progress_to_dict(p)))) == p


def replace_devices(state: RolloutState, devices: dict[str, DeviceProgress]) -> RolloutState:
    return RolloutState(**{**state.__dict__, "devices": devices})


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"status": "sleeping"}, "state.status: 'sleeping' is unknown"),
        ({"stage": -1}, "state.stage: expected a count"),
        ({"approved": "0"}, "state.approved: expected a list"),
        ({"extra": 1}, "unknown key(s) 'extra'"),
        ({"stage_started_at": "noon"}, "state.stage_started_at: expected a number"),
        ({"bake_started_at": "inf"}, "state.bake_started_at: expected a time"),
        ({"reported_dry_run": ["cpu"]}, "state.reported_dry_run[]: 'cpu' is unknown"),
    ],
)
def test_a_stored_state_that_is_not_one_is_refused(change: dict[str, Any], message: str) -> None:
    doc = copy.deepcopy(state_to_dict(a_state())) | change
    with pytest.raises(SpecError, match=re.escape(message)):
        state_from_dict(doc)


def test_a_stored_device_that_is_not_one_is_refused() -> None:
    doc = progress_to_dict(DeviceProgress("cam-1", 0))
    with pytest.raises(SpecError, match=re.escape("device.phase: 'lost' is unknown")):
        progress_from_dict(doc | {"phase": "lost"})
    with pytest.raises(SpecError, match="missing since"):
        progress_from_dict({k: v for k, v in doc.items() if k != "since"})
