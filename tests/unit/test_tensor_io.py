"""The fast request decoder accepts exactly what full validation accepts, with the same arrays.

Every body here goes through :func:`agent.serving.tensor_io.decode_feeds` (fast path first) and through
full schema validation + :func:`tensors_to_feeds`; the outcomes must agree: the same arrays
(values, dtype, shape) or a refusal. Removing a check from the fast path makes a case here fail.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from mcp_edge.agent.runtime.runner import InputError, TensorSpec
from mcp_edge.agent.serving.tensor_io import (
    _fast_feeds,
    decode_feeds,
    encode_response,
    tensors_to_feeds,
)
from mcp_edge.shared.errors import MessageError
from mcp_edge.shared.protocol import InferRequest, validate
from mcp_edge.shared.protocol.inference import Datatype

F32 = (TensorSpec("input", Datatype.FP32, (-1, 4)),)
F16 = (TensorSpec("input", Datatype.FP16, (-1, 2)),)
F64 = (TensorSpec("input", Datatype.FP64, (-1, 2)),)
I64 = (TensorSpec("ids", Datatype.INT64, (-1, 3)),)
TWO = (TensorSpec("a", Datatype.FP32, (1, 2)), TensorSpec("b", Datatype.INT32, (-1,)))


def _body(
    data: Any, shape: Any = (1, 4), name: Any = "input", datatype: Any = "FP32", **extra: Any
) -> dict[str, Any]:
    tensor = {
        "name": name,
        "shape": list(shape) if isinstance(shape, tuple) else shape,
        "datatype": datatype,
        "data": data,
    }
    return {"inputs": [tensor], **extra}


def _full(obj: Any, specs: tuple[TensorSpec, ...]) -> tuple[str | None, dict[str, np.ndarray]]:
    req = validate(obj, InferRequest)
    return req.id, tensors_to_feeds(req.inputs, specs)


CASES: list[tuple[str, Any, tuple[TensorSpec, ...]]] = [
    ("plain floats", _body([0.0, 0.5, 1.0, 2.0]), F32),
    ("ints for floats", _body([0, 1, 2, 3]), F32),
    ("mixed ints and floats", _body([0, 1.5, 2, 3.25]), F32),
    ("nested rows", _body([[0.0, 0.5, 1.0, 2.0]]), F32),
    ("batch of two", _body([1.0] * 8, shape=(2, 4)), F32),
    ("with id and parameters", _body([1.0] * 4, id="r-1", parameters={"x": 1}), F32),
    (
        "tensor parameters",
        {
            "inputs": [
                {
                    "name": "input",
                    "shape": [1, 4],
                    "datatype": "FP32",
                    "parameters": {"binary": False},
                    "data": [1.0] * 4,
                }
            ]
        },
        F32,
    ),
    ("empty batch", _body([], shape=(0, 4)), F32),
    ("float32 overflow", _body([3.5e38, 0.0, 0.0, 0.0]), F32),
    ("float32 max", _body([3.4e38, -3.4e38, 0.0, 0.0]), F32),
    ("fp16 overflow", _body([70000.0, 0.0], shape=(1, 2), datatype="FP16"), F16),
    ("fp16 int overflow", _body([70000, 0], shape=(1, 2), datatype="FP16"), F16),
    ("fp16 fits", _body([65000.0, -1.5], shape=(1, 2), datatype="FP16"), F16),
    ("fp64 huge", _body([1e300, -1e300], shape=(1, 2), datatype="FP64"), F64),
    ("strings", _body(["1.5", "2", "3", "4"]), F32),
    ("bools", _body([True, False, True, False]), F32),
    ("bool among floats", _body([True, 0.5, 1.0, 2.0]), F32),
    ("null element", _body([None, 0.5, 1.0, 2.0]), F32),
    ("ragged", _body([[1.0, 2.0], [3.0]], shape=(1, 4)), F32),
    ("too few values", _body([1.0, 2.0, 3.0]), F32),
    ("too many values", _body([1.0] * 5), F32),
    ("wrong datatype", _body([1.0] * 4, datatype="FP64"), F32),
    ("unknown datatype", _body([1.0] * 4, datatype="FLOAT"), F32),
    ("wrong rank", _body([1.0] * 4, shape=(4,)), F32),
    ("wrong fixed dim", _body([1.0] * 5, shape=(1, 5)), F32),
    ("negative dim", _body([1.0] * 4, shape=[-1, 4]), F32),
    ("float dim", _body([1.0] * 4, shape=[1.0, 4]), F32),
    ("bool dim", _body([1.0] * 4, shape=[True, 4]), F32),
    ("unknown input", _body([1.0] * 4, name="other"), F32),
    ("empty name", _body([1.0] * 4, name=""), F32),
    ("name not a string", _body([1.0] * 4, name=["input"]), F32),
    ("data not a list", _body({"a": 1}), F32),
    ("extra request key", _body([1.0] * 4, extra=1), F32),
    (
        "extra tensor key",
        {
            "inputs": [
                {
                    "name": "input",
                    "shape": [1, 4],
                    "datatype": "FP32",
                    "data": [1.0] * 4,
                    "contents": {},
                }
            ]
        },
        F32,
    ),
    ("id too long", _body([1.0] * 4, id="x" * 300), F32),
    ("id not a string", _body([1.0] * 4, id=7), F32),
    ("parameters not an object", _body([1.0] * 4, parameters=[1]), F32),
    ("outputs requested", _body([1.0] * 4, outputs=[{"name": "probabilities"}]), F32),
    ("no inputs", {"inputs": []}, F32),
    ("inputs not a list", {"inputs": {"name": "input"}}, F32),
    ("not an object", [1, 2, 3], F32),
    ("input given twice", {"inputs": [_body([1.0] * 4)["inputs"][0]] * 2}, F32),
    ("int64 exact", _body([1, 2, 2**62], shape=(1, 3), name="ids", datatype="INT64"), I64),
    ("int64 from floats", _body([1.0, 2.0, 3.0], shape=(1, 3), name="ids", datatype="INT64"), I64),
    ("int64 fraction", _body([1.5, 2.0, 3.0], shape=(1, 3), name="ids", datatype="INT64"), I64),
    (
        "two inputs",
        {
            "inputs": [
                {"name": "b", "shape": [2], "datatype": "INT32", "data": [1, 2]},
                {"name": "a", "shape": [1, 2], "datatype": "FP32", "data": [0.5, 1.5]},
            ]
        },
        TWO,
    ),
    (
        "two inputs, one missing",
        {
            "inputs": [
                {"name": "a", "shape": [1, 2], "datatype": "FP32", "data": [0.5, 1.5]},
            ]
        },
        TWO,
    ),
]


@pytest.mark.parametrize(("obj", "specs"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_fast_path_agrees_with_full_validation(obj: Any, specs: tuple[TensorSpec, ...]) -> None:
    try:
        want_id, want = _full(obj, specs)
    except (MessageError, InputError) as e:
        with pytest.raises(type(e)) as got:
            decode_feeds(obj, specs)
        assert str(got.value) == str(e)  # the full path's message, word for word
        try:  # the fast path on its own refuses too (None hands over to the full path)
            assert _fast_feeds(obj, specs) is None
        except (MessageError, InputError) as fast_error:
            assert str(fast_error) == str(e)
        return
    call = decode_feeds(obj, specs)
    rid, feeds, wanted = call.request_id, call.feeds, call.outputs
    assert rid == want_id
    assert feeds.keys() == want.keys()
    for name, arr in want.items():
        assert feeds[name].dtype == arr.dtype
        assert feeds[name].shape == arr.shape
        np.testing.assert_array_equal(feeds[name], arr)
    if wanted is None and "outputs" not in obj:
        assert _fast_feeds(obj, specs) is not None  # the common bodies do take the fast path


def test_requested_outputs_come_back_from_the_full_path() -> None:
    obj = _body([1.0] * 4, outputs=[{"name": "probabilities"}])
    wanted = decode_feeds(obj, F32).outputs
    assert wanted is not None and [o.name for o in wanted] == ["probabilities"]


def test_answer_body_holds_values_shape_and_datatype() -> None:
    import orjson

    outputs = {
        "probabilities": np.array([[0.25, 0.75]], dtype=np.float32),
        "label": np.array([1], dtype=np.int64),
        "half": np.array([0.5], dtype=np.float16),
        "big_endian": np.array([1.0, 2.0], dtype=">f4"),
        "names": np.array(["cat", "dog"], dtype=object),
    }
    raw, head = encode_response(
        "digits", "1.0.0", "r-1", [(n, a, False) for n, a in outputs.items()]
    )
    assert head is None
    doc = orjson.loads(raw)
    assert doc["model_name"] == "digits" and doc["model_version"] == "1.0.0"
    assert doc["id"] == "r-1"
    by_name = {o["name"]: o for o in doc["outputs"]}
    assert by_name["probabilities"] == {
        "name": "probabilities",
        "datatype": "FP32",
        "shape": [1, 2],
        "data": [0.25, 0.75],
    }
    assert by_name["label"]["datatype"] == "INT64" and by_name["label"]["data"] == [1]
    assert by_name["half"]["datatype"] == "FP16" and by_name["half"]["data"] == [0.5]
    assert by_name["big_endian"]["data"] == [1.0, 2.0]
    assert by_name["names"] == {
        "name": "names",
        "datatype": "BYTES",
        "shape": [2],
        "data": ["cat", "dog"],
    }
