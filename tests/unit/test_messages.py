from __future__ import annotations

import contextlib
from datetime import datetime, timedelta, timezone

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mcp_edge.shared.errors import (
    BadSignatureError,
    ExpiredError,
    MessageError,
    ReplayError,
    UnknownSignerError,
)
from mcp_edge.shared.protocol import (
    CommandName,
    CommandRequest,
    Datatype,
    DeploymentEvent,
    DeploymentPhase,
    DesiredModel,
    DesiredState,
    EnrollmentRequest,
    ErrorCode,
    ErrorReply,
    EventOutcome,
    HealthSample,
    InferRequest,
    InferResponse,
    InferTensor,
    Message,
    ModelStatus,
    ReportedState,
    TargetRef,
    decode,
    decode_for_topic,
    encode,
    new_nonce,
    sign_desired_state,
    sign_enrollment,
    topics,
    validate,
    verify_desired_state,
    verify_enrollment,
)
from mcp_edge.shared.signing import PrivateKey

ident = st.from_regex(r"[a-z0-9][a-z0-9._-]{0,30}", fullmatch=True)
finite = st.floats(allow_nan=False, allow_infinity=False, width=64, min_value=0, max_value=1e12)
utc_dt = st.datetimes(
    min_value=datetime(2020, 1, 1), max_value=datetime(2100, 1, 1), timezones=st.just(timezone.utc)
)
version = st.builds(
    lambda a, b, c: f"{a}.{b}.{c}", st.integers(0, 99), st.integers(0, 99), st.integers(0, 99)
)
sha = st.text(alphabet="0123456789abcdef", min_size=64, max_size=64)

health = st.builds(
    HealthSample,
    device_id=ident,
    ts=finite,
    cpu_percent=st.floats(0, 100),
    mem_total_mb=finite,
    mem_used_mb=finite,
    temperatures_c=st.dictionaries(ident, st.floats(-40, 120), max_size=4),
)
event = st.builds(
    DeploymentEvent,
    device_id=ident,
    event_seq=st.integers(0, 2**40),
    ts=finite,
    model=ident,
    version=version,
    phase=st.sampled_from(DeploymentPhase),
    outcome=st.sampled_from(EventOutcome),
    message=st.text(max_size=100),
    bytes_done=st.none() | st.integers(0, 2**40),
)
target = st.builds(
    TargetRef, version=version, target_path=ident, sha256=sha, length=st.integers(1, 2**40)
)
desired = st.builds(
    lambda dev, seq, t0, models: DesiredState(
        device_id=dev, seq=seq, issued_at=t0, expires=t0 + timedelta(days=1), models=models
    ),
    ident,
    st.integers(1, 2**40),
    utc_dt,
    st.lists(
        st.builds(DesiredModel, name=ident, stable=target), max_size=3, unique_by=lambda m: m.name
    ),
)
reported = st.builds(
    ReportedState,
    device_id=ident,
    ts=finite,
    applied_seq=st.integers(0, 2**40),
    profile=ident,
    models=st.lists(
        st.builds(ModelStatus, name=ident, active_version=st.none() | version), max_size=3
    ),
)
error = st.builds(ErrorReply, error=st.text(max_size=200), code=st.sampled_from(ErrorCode))
command = st.builds(
    lambda t0, name: CommandRequest(
        command_id="ab" * 16, name=name, issued_at=t0, expires=t0 + timedelta(minutes=5)
    ),
    utc_dt,
    st.sampled_from(CommandName),
)


@st.composite
def tensors(draw: st.DrawFn) -> InferTensor:
    dt = draw(st.sampled_from([d for d in Datatype if d is not Datatype.BYTES]))
    shape = draw(st.lists(st.integers(0, 4), min_size=1, max_size=3))
    n = int(np.prod(shape))
    npdt = dt.numpy_dtype
    if npdt.kind == "b":
        values = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    elif npdt.kind in "iu":
        info = np.iinfo(npdt)
        values = draw(st.lists(st.integers(int(info.min), int(info.max)), min_size=n, max_size=n))
    else:
        values = draw(st.lists(st.floats(-1000, 1000, width=16), min_size=n, max_size=n))
    arr = np.array(values, dtype=npdt).reshape(shape)
    return InferTensor.from_numpy(draw(ident), arr)


infer = st.builds(
    InferRequest, id=st.none() | ident, inputs=st.lists(tensors(), min_size=1, max_size=3)
)


@given(st.one_of(health, event, desired, reported, error, command, infer))
def test_every_message_round_trips(message: Message) -> None:
    assert decode(encode(message), type(message)) == message


@given(tensors())
def test_tensor_to_numpy_preserves_values(tensor: InferTensor) -> None:
    arr = tensor.to_numpy()
    assert list(arr.shape) == tensor.shape
    assert arr.dtype == tensor.datatype.numpy_dtype
    again = InferTensor.from_numpy(tensor.name, arr)
    assert again == tensor


@given(st.binary(max_size=300))
def test_decode_never_raises_anything_but_message_error(payload: bytes) -> None:
    with contextlib.suppress(MessageError):
        decode(payload, HealthSample)


def test_size_cap_checked_before_parsing() -> None:
    with pytest.raises(MessageError, match="exceeds the 16384-byte limit"):
        decode(b" " * (16 * 1024 + 1), HealthSample)
    with pytest.raises(MessageError, match="exceeds the 10-byte limit"):
        decode(b'{"a": 1234}', HealthSample, max_bytes=10)


def test_schema_errors_name_the_field() -> None:
    with pytest.raises(MessageError, match="cpu_percent"):
        decode(
            b'{"device_id":"d","ts":1,"cpu_percent":-5,"mem_total_mb":1,"mem_used_mb":1}',
            HealthSample,
        )
    with pytest.raises(MessageError, match="Extra inputs"):
        decode(
            b'{"device_id":"d","ts":1,"cpu_percent":5,"mem_total_mb":1,"mem_used_mb":1,"x":1}',
            HealthSample,
        )
    with pytest.raises(MessageError, match="not valid JSON"):
        decode(b'{"device_id": NaN}', HealthSample)


def test_open_inference_protocol_body_from_the_spec() -> None:
    body = (
        b'{"id":"42","inputs":[{"name":"input0","shape":[2,2],"datatype":"UINT32",'
        b'"data":[1,2,3,4]},{"name":"input1","shape":[3],"datatype":"BOOL","data":[true,false,true]}],'
        b'"outputs":[{"name":"output0"}]}'
    )
    req = decode(body, InferRequest)
    assert req.inputs[0].to_numpy().tolist() == [[1, 2], [3, 4]]
    assert req.inputs[1].to_numpy().dtype == np.bool_
    nested = decode(
        b'{"inputs":[{"name":"x","shape":[2,2],"datatype":"FP32","data":[[1,2],[3,4]]}]}',
        InferRequest,
    )
    assert nested.inputs[0].to_numpy().sum() == 10
    resp = InferResponse(model_name="digits", model_version="1.0.0", outputs=[req.inputs[0]])
    assert decode(encode(resp), InferResponse) == resp


@pytest.mark.parametrize(
    ("tensor", "reason"),
    [
        ({"name": "x", "shape": [2, 2], "datatype": "FP32", "data": [1, 2, 3]}, "needs 4 values"),
        ({"name": "x", "shape": [2], "datatype": "INT8", "data": [1, 300]}, "out of range"),
        ({"name": "x", "shape": [2], "datatype": "INT32", "data": [1.5, 2]}, "must be integers"),
        ({"name": "x", "shape": [2], "datatype": "FP32", "data": ["a", "b"]}, "must be numbers"),
        ({"name": "x", "shape": [2], "datatype": "BOOL", "data": [1, 0]}, "true/false"),
        ({"name": "x", "shape": [2, 2], "datatype": "FP32", "data": [[1, 2], [3]]}, "regular"),
        ({"name": "x", "shape": [2], "datatype": "BYTES", "data": [1, 2]}, "strings"),
        ({"name": "x", "shape": [2], "datatype": "FP32", "data": [True, False]}, "true/false"),
        ({"name": "x", "shape": [1], "datatype": "FP16", "data": [1e6]}, "out of range"),
    ],
)
def test_bad_tensors_are_refused_with_a_reason(tensor: dict[str, object], reason: str) -> None:
    req = InferRequest.model_validate({"inputs": [tensor]})
    with pytest.raises(MessageError, match=reason):
        req.inputs[0].to_numpy()


def test_unknown_datatype_and_negative_shape_refused() -> None:
    with pytest.raises(MessageError, match="datatype"):
        decode(b'{"inputs":[{"name":"x","shape":[1],"datatype":"FP8","data":[1]}]}', InferRequest)
    with pytest.raises(MessageError, match="shape"):
        decode(b'{"inputs":[{"name":"x","shape":[-1],"datatype":"FP32","data":[1]}]}', InferRequest)


def test_decode_for_topic_picks_the_schema_and_binds_the_device() -> None:
    sample = HealthSample(device_id="dev-a", ts=1.0, cpu_percent=3, mem_total_mb=1, mem_used_mb=1)
    parsed, msg = decode_for_topic(topics.telemetry("dev-a", "health"), encode(sample))
    assert msg == sample
    assert parsed == topics.DeviceTopic("dev-a", topics.Channel.TELEMETRY, "health")
    with pytest.raises(MessageError, match="claims device 'dev-a'"):
        decode_for_topic(topics.telemetry("dev-b", "health"), encode(sample))
    with pytest.raises(MessageError, match="HealthSample"):
        decode_for_topic(topics.telemetry("dev-a", "health"), encode(ErrorReply(error="x")))


NOW = datetime(2026, 11, 29, 12, 0, tzinfo=timezone.utc)


def _state(seq: int, expires: datetime, device: str = "dev-a") -> DesiredState:
    stable = TargetRef(version="1.2.0", target_path="digits/1.2.0.mcpb", sha256="a" * 64, length=10)
    return DesiredState(
        device_id=device,
        seq=seq,
        issued_at=NOW - timedelta(minutes=1),
        expires=expires,
        models=[DesiredModel(name="digits", stable=stable)],
    )


def test_desired_state_verification() -> None:
    director, other = PrivateKey.generate(), PrivateKey.generate()
    trusted = [director.public_key]
    env = sign_desired_state(_state(5, NOW + timedelta(hours=1)), director)
    state = verify_desired_state(env, trusted, device_id="dev-a", last_seq=4, now=NOW)
    assert state.seq == 5 and state.models[0].stable.version == "1.2.0"

    with pytest.raises(ReplayError, match="not above the applied 5"):
        verify_desired_state(env, trusted, device_id="dev-a", last_seq=5, now=NOW)
    with pytest.raises(ExpiredError):
        verify_desired_state(
            env, trusted, device_id="dev-a", last_seq=0, now=NOW + timedelta(hours=2)
        )
    with pytest.raises(MessageError, match="not 'dev-b'"):
        verify_desired_state(env, trusted, device_id="dev-b", last_seq=0, now=NOW)
    with pytest.raises(UnknownSignerError):
        verify_desired_state(
            sign_desired_state(_state(6, NOW + timedelta(hours=1)), other),
            trusted,
            device_id="dev-a",
            last_seq=0,
            now=NOW,
        )
    tampered = {**env, "signed": {**env["signed"], "seq": 99}}
    with pytest.raises(BadSignatureError):
        verify_desired_state(tampered, trusted, device_id="dev-a", last_seq=0, now=NOW)


def test_enrollment_request_proves_possession_and_freshness() -> None:
    key = PrivateKey.generate()
    req = EnrollmentRequest(
        public_key=key.public_key.raw.hex(),
        token="tok-123456789",
        nonce=new_nonce(),
        timestamp=NOW,
        profile="generic-x86_64",
        labels={"site": "f1"},
    )
    env = sign_enrollment(req, key)
    assert verify_enrollment(env, now=NOW + timedelta(seconds=10)) == req
    with pytest.raises(ExpiredError, match="device clock"):
        verify_enrollment(env, now=NOW + timedelta(hours=1))
    forged = {**env, "signed": {**env["signed"], "labels": {"site": "other"}}}
    with pytest.raises(BadSignatureError):
        verify_enrollment(forged, now=NOW)
    # Signed by a different key than the one it claims: refused.
    swapped = {
        **env,
        "signed": {**env["signed"], "public_key": PrivateKey.generate().public_key.raw.hex()},
    }
    with pytest.raises(UnknownSignerError):
        verify_enrollment(swapped, now=NOW)
    with pytest.raises(MessageError, match="labels"):
        validate({**req.model_dump(mode="json"), "labels": {"Bad Key": "x"}}, EnrollmentRequest)
