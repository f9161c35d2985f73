"""The canary policy: one value, its defaults taken by every place that sets a canary, and the
device's judging of a canary by it."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from mcp_edge.agent.runtime.canary import CanaryState
from mcp_edge.agent.runtime.manager import ModelManager, ModelSource
from mcp_edge.agent.serving import serve
from mcp_edge.agent.update.machine import new_record
from mcp_edge.agent.update.records import CanaryRef, ModelIndex, UpdateRecord
from mcp_edge.controlplane.api.deployments import CanaryIn
from mcp_edge.controlplane.db.deployments import DeviceModelView, VersionView, canary_columns
from mcp_edge.controlplane.desired import build_desired_state
from mcp_edge.shared.protocol.canary import DEFAULT_CANARY_POLICY, CanaryPolicy
from mcp_edge.shared.protocol.state import CanarySpec, TargetRef
from tests.support.runners import DoublingRunner

SHA = "ab" * 32
START = datetime(2030, 1, 1, tzinfo=timezone.utc)
TARGET = TargetRef(version="1.1.0", target_path="digits/1.1.0/d.mcpb", sha256=SHA, length=10)


def _version(version: str) -> VersionView:
    return VersionView(model="digits", version=version, version_numeric=1,
                       target_path=f"digits/{version}/d.mcpb", sha256=SHA, length=10,
                       profiles=())  # fmt: skip


# ---------------------------------------------------------------------- one set of defaults
def test_the_rest_api_desired_state_and_database_rows_default_to_the_one_policy() -> None:
    assert CanaryPolicy() == DEFAULT_CANARY_POLICY
    # REST: a canary given only its version, and what the OpenAPI document says it defaults to.
    assert CanaryIn(version="1.1.0").policy() == DEFAULT_CANARY_POLICY
    documented = CanaryIn.model_json_schema()["properties"]
    assert {k: documented[k]["default"] for k in ("weight", "max_error_rate", "min_requests")} \
        == {k: getattr(DEFAULT_CANARY_POLICY, k)
            for k in ("weight", "max_error_rate", "min_requests")}  # fmt: skip
    # Desired state: a spec given only its target, and a device model row from before the
    # policy columns (all NULL) built into a document.
    assert CanarySpec(target=TARGET).policy == DEFAULT_CANARY_POLICY
    row = DeviceModelView("cam", "digits", "1.0.0", canary_version="1.1.0")
    state = build_desired_state(
        "cam",
        1,
        START,
        timedelta(days=1),
        [row],
        {("digits", "1.0.0"): _version("1.0.0"), ("digits", "1.1.0"): _version("1.1.0")},
    )
    canary = state.models[0].canary
    assert canary is not None and canary.policy == DEFAULT_CANARY_POLICY


async def test_the_agent_and_serve_default_to_the_one_policy(tmp_path: Path) -> None:
    # The update machine's records and the committed index of an older agent (flat fields).
    assert CanaryRef.model_validate({"version": "1.1.0"}).policy == DEFAULT_CANARY_POLICY
    # ``mcp-agent serve``: a ``--canary FILE`` without a weight, and the error-rate flag.
    model = tmp_path / "digits.onnx"
    model.write_bytes(b"x")
    assert serve.parse_canary(str(model)).weight == DEFAULT_CANARY_POLICY.weight
    flag = next(p for p in serve.serve_command.params if p.name == "canary_max_error_rate")
    assert flag.default == DEFAULT_CANARY_POLICY.max_error_rate
    # The model manager: a canary loaded without a policy.
    manager = ModelManager(lambda source: [DoublingRunner()])
    try:
        await manager.load(ModelSource("m", "1", model))
        await manager.load(ModelSource("m", "2", model), role="canary")
        canary = manager.slot("m").canary
        assert canary is not None and canary.policy == DEFAULT_CANARY_POLICY
    finally:
        await manager.close()


# ---------------------------------------------------------------------- the value
@pytest.mark.parametrize(("fields", "message"), [
    ({"weight": 1.5}, "weight 1.5 is outside 0..1"),
    ({"weight": float("nan")}, "weight nan is outside 0..1"),
    ({"max_error_rate": -0.1}, "max_error_rate -0.1 is outside 0..1"),
    ({"min_requests": 0}, "min_requests 0 is outside 1..10000"),
    ({"window": 10_001}, "window 10001 is outside 1..10000"),
    ({"min_requests": 50, "window": 40}, "above its window of 40 requests"),
])  # fmt: skip
def test_a_policy_out_of_range_is_refused_everywhere_it_is_read(
    fields: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        CanaryPolicy(**fields)
    doc = {"target": TARGET.model_dump(mode="json"), **fields}
    with pytest.raises(ValidationError):
        CanarySpec.model_validate(doc)
    with pytest.raises(ValidationError, match=message.split(" ")[0]):
        CanaryRef.model_validate({"version": "1.1.0", "policy": fields})


def test_a_policy_built_in_code_takes_numbers_only() -> None:
    with pytest.raises(ValueError, match="min_requests must be a whole number"):
        CanaryPolicy(min_requests=True)
    with pytest.raises(ValueError, match="weight must be a number from 0 to 1"):
        CanaryPolicy(weight="0.5")  # type: ignore[arg-type]


def test_the_rest_api_refuses_what_the_policy_refuses_and_states_the_bounds() -> None:
    with pytest.raises(ValidationError):
        CanaryIn(version="1.1.0", min_requests=DEFAULT_CANARY_POLICY.window + 1)
    with pytest.raises(ValidationError):
        CanaryIn(version="1.1.0", max_error_rate=1.01)
    schema = CanaryIn.model_json_schema()["properties"]["min_requests"]
    assert (schema["minimum"], schema["maximum"]) == (1, DEFAULT_CANARY_POLICY.window)
    policy = CanaryIn(version="1.1.0", weight=0.3, max_error_rate=0.5, min_requests=7).policy()
    assert policy == CanaryPolicy(weight=0.3, max_error_rate=0.5, min_requests=7)
    assert canary_columns(policy) == {"canary_weight": 0.3, "canary_max_error_rate": 0.5,
                                      "canary_min_requests": 7}  # fmt: skip


def test_documents_from_before_the_policy_fields_still_validate() -> None:
    old = {"target": TARGET.model_dump(mode="json"), "weight": 0.2, "max_error_rate": 0.05}
    assert CanarySpec.model_validate(old).policy == CanaryPolicy(weight=0.2)


def test_the_encoded_spec_carries_what_was_set_and_leaves_out_default_judging() -> None:
    # An agent that predates min_requests and window refuses unknown fields: a canary with the
    # default judging encodes exactly as before, and a policy that sets them carries them.
    plain = json.loads(CanarySpec.of(TARGET, CanaryPolicy(weight=0.2)).model_dump_json())
    assert set(plain) == {"target", "weight", "max_error_rate"}
    policy = CanaryPolicy(weight=0.2, max_error_rate=0.5, min_requests=7, window=50)
    encoded = json.loads(CanarySpec.of(TARGET, policy).model_dump_json())
    assert {k: encoded[k] for k in ("weight", "max_error_rate", "min_requests", "window")} == {
        "weight": 0.2,
        "max_error_rate": 0.5,
        "min_requests": 7,
        "window": 50,
    }
    assert CanarySpec.model_validate(encoded).policy == policy


def test_records_and_indexes_of_an_older_agent_keep_their_canary_policy() -> None:
    record = new_record(model="digits", role="canary", from_version=None, to_version="1.1.0",
                        target_path="digits/1.1.0/d.mcpb", sha256=SHA, length=10, desired_seq=2,
                        now=1.0, canary=CanaryPolicy(weight=0.3))  # fmt: skip
    old = json.loads(record.to_bytes())
    del old["canary"]
    old |= {"canary_weight": 0.3, "max_error_rate": 0.25}
    resumed = UpdateRecord.from_bytes(json.dumps(old).encode())
    assert resumed.canary == CanaryPolicy(weight=0.3, max_error_rate=0.25)
    assert UpdateRecord.from_bytes(resumed.to_bytes()) == resumed

    index = ModelIndex.model_validate(
        {
            "name": "digits",
            "active": "1.0.0",
            "canary": {"version": "1.1.0", "weight": 0.4, "max_error_rate": 0.2},
        }
    )
    assert index.canary is not None
    assert index.canary.policy == CanaryPolicy(weight=0.4, max_error_rate=0.2)


# ---------------------------------------------------------------------- judging on the device
def test_a_canary_is_not_judged_before_min_requests_and_leaves_past_max_error_rate() -> None:
    state = CanaryState("1.1.0", CanaryPolicy(weight=1.0, max_error_rate=0.5, min_requests=10))
    for _ in range(9):  # every request fails, but fewer than min_requests are in the window
        assert not state.record(failed=True)
    assert state.enabled and state.takes("any-key")
    assert state.record(failed=True)  # the tenth: judged, 100 % > 50 %
    assert not state.enabled and not state.takes("any-key")

    state = CanaryState("1.2.0", CanaryPolicy(weight=1.0, max_error_rate=0.5, min_requests=10))
    for _ in range(10):
        state.record(failed=False)
    tripped = [state.record(failed=True) for _ in range(11)]
    assert tripped == [False] * 10 + [True]  # 10 of 20 is not above 50 %; 11 of 21 is
    assert state.error_rate == pytest.approx(11 / 21)


def test_the_window_holds_the_latest_requests_only() -> None:
    state = CanaryState("1.1.0", CanaryPolicy(max_error_rate=0.5, min_requests=4, window=4))
    for failed in (True, True, False, False, False, False):
        assert not state.record(failed=failed)
    assert len(state.results) == 4 and state.error_rate == 0.0
    assert [state.record(failed=True) for _ in range(3)] == [False, False, True]
