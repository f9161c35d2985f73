"""The raw tensor codec (binary tensor extension, gRPC raw contents) and the request parts of
the Open Inference Protocol that HTTP and gRPC share (:mod:`agent.serving.oip`)."""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from mcp_edge.agent.runtime.batcher import Priority
from mcp_edge.agent.runtime.runner import InputError, TensorSpec
from mcp_edge.agent.serving.binary_tensors import (
    array_from_raw,
    bytes_as_text,
    bytes_elements_raw,
    element_count,
    raw_from_array,
    raw_size,
)
from mcp_edge.agent.serving.oip import (
    OutputRequest,
    answer_tensors,
    classify,
    decode_binary_request,
    output_requests,
    request_parameters,
)
from mcp_edge.agent.serving.requests import RequestError
from mcp_edge.shared.errors import MessageError
from mcp_edge.shared.protocol.wire import MAX_TENSOR_ELEMENTS, Datatype, ErrorCode

NUMERIC = [d for d in Datatype if d is not Datatype.BYTES]


def _roundtrip(dt: Datatype, arr: np.ndarray) -> np.ndarray:
    raw = bytes(raw_from_array(arr))
    return array_from_raw("t", dt, list(arr.shape), memoryview(raw))


# ---------------------------------------------------------------------------- the codec
@pytest.mark.parametrize("dt", NUMERIC, ids=lambda d: d.value)
def test_every_numeric_datatype_round_trips_little_endian(dt: Datatype) -> None:
    npdt = dt.numpy_dtype
    if npdt.kind == "b":
        arr = np.array([[True, False, True], [False, False, True]])
    elif npdt.kind == "f":
        arr = np.array([[0.5, -2.25, np.inf], [-0.0, 1e-3, 65504]], dtype=npdt)
    else:
        info = np.iinfo(npdt)
        arr = np.array([[info.min, 0, info.max], [1, 2, 3]], dtype=npdt)
    raw = bytes(raw_from_array(arr))
    assert raw == arr.astype(npdt.newbyteorder("<")).tobytes()  # row-major, little-endian
    assert len(raw) == raw_size(dt, arr.size) == arr.size * npdt.itemsize
    back = _roundtrip(dt, arr)
    assert back.dtype == npdt and back.shape == arr.shape
    assert back.tobytes() == arr.tobytes()


def test_bytes_elements_are_a_length_then_the_bytes() -> None:
    arr = np.array([[b"ab", b""], ["caf\u00e9", b"\x00\xff"]], dtype=object)
    raw = bytes(raw_from_array(arr))
    assert raw == (struct.pack("<I", 2) + b"ab" + struct.pack("<I", 0)
                   + struct.pack("<I", 5) + "caf\u00e9".encode() + struct.pack("<I", 2)
                   + b"\x00\xff")  # fmt: skip
    back = _roundtrip(Datatype.BYTES, arr)
    assert back.shape == (2, 2)
    assert back.tolist() == [[b"ab", b""], ["caf\u00e9".encode(), b"\x00\xff"]]
    assert raw_size(Datatype.BYTES, 4) is None  # each element carries its own length


def test_fixed_width_strings_go_out_as_bytes_elements() -> None:
    assert bytes(raw_from_array(np.array(["hi", "a"]))) == bytes_elements_raw(
        np.array([b"hi", b"a"], dtype=object)
    )


def test_big_endian_and_strided_arrays_go_out_little_endian_row_major() -> None:
    arr = np.arange(12, dtype=">i4").reshape(3, 4)[:, ::2]
    raw = bytes(raw_from_array(arr))
    assert np.frombuffer(raw, "<i4").tolist() == [0, 2, 4, 6, 8, 10]


def test_an_aligned_buffer_is_read_without_a_copy_and_an_unaligned_one_is_copied() -> None:
    buf = bytearray(np.arange(4, dtype="<f4").tobytes())
    view = array_from_raw("t", Datatype.FP32, [4], memoryview(buf))
    assert np.shares_memory(view, np.frombuffer(buf, np.uint8))
    odd = bytearray(b"\x00" + bytes(buf))
    copied = array_from_raw("t", Datatype.FP32, [2, 2], memoryview(odd)[1:])
    assert copied.flags.aligned and copied.ravel().tolist() == [0.0, 1.0, 2.0, 3.0]


def _arrays_of(dt: Datatype) -> st.SearchStrategy[np.ndarray]:
    shapes = hnp.array_shapes(min_dims=1, max_dims=3, min_side=0, max_side=4)
    if dt is Datatype.BYTES:
        return shapes.flatmap(
            lambda s: st.lists(st.binary(max_size=12), min_size=int(np.prod(s)),
                               max_size=int(np.prod(s))).map(
                lambda v: np.array([*v, b""], dtype=object)[:-1].reshape(s))
        )  # fmt: skip
    return hnp.arrays(dt.numpy_dtype, shapes)


@given(st.sampled_from(list(Datatype)).flatmap(lambda d: st.tuples(st.just(d), _arrays_of(d))))
def test_array_from_raw_undoes_raw_from_array(case: tuple[Datatype, np.ndarray]) -> None:
    dt, arr = case
    back = _roundtrip(dt, arr)
    assert back.shape == arr.shape
    if dt is Datatype.BYTES:
        assert back.tolist() == arr.tolist()
    else:  # bit for bit: NaN payloads and -0.0 included
        assert back.dtype == arr.dtype and back.tobytes() == arr.tobytes()


@pytest.mark.parametrize(
    ("dt", "shape", "raw", "message"),
    [
        (Datatype.FP32, [2, 2], bytes(12), "tensor 't': FP32 [2, 2] takes 16 bytes, the request holds 12"),
        (Datatype.INT64, [1], bytes(9), "INT64 [1] takes 8 bytes, the request holds 9"),
        (Datatype.BOOL, [3], bytes([0, 1, 2]), "tensor 't': BOOL bytes must be 0 or 1"),
        (Datatype.BYTES, [2], struct.pack("<I", 1) + b"a", "2 BYTES elements need at least 8 bytes, the request holds 5"),
        (Datatype.BYTES, [1], struct.pack("<I", 9) + b"abc", "BYTES element 0 declares 9 bytes; only 3 remain"),
        (Datatype.BYTES, [2], struct.pack("<I", 3) + b"abcdef", "BYTES element 1 has no length prefix"),
        (Datatype.BYTES, [1], struct.pack("<I", 1) + b"ab", "1 bytes left over after its 1 BYTES elements"),
        (Datatype.FP32, [-1, 2], bytes(8), "shape [-1, 2] must hold integers >= 0"),
        (Datatype.FP32, [1 << 31, 1 << 31], bytes(8), f"has more than {MAX_TENSOR_ELEMENTS} elements"),
        (Datatype.FP32, [1] * 17, bytes(4), "shape has 17 dimensions; at most 16"),
        (Datatype.FP32, [2.0, 1], bytes(8), "must hold integers >= 0"),
    ],
    ids=["short", "long", "bool-2", "bytes-no-room", "bytes-past-end", "bytes-no-prefix",
         "bytes-leftover", "negative", "over-cap", "rank-17", "float-dim"],
)  # fmt: skip
def test_refusals_name_the_tensor_and_the_problem(
    dt: Datatype, shape: list[Any], raw: bytes, message: str
) -> None:
    with pytest.raises(MessageError) as e:
        array_from_raw("t", dt, shape, memoryview(raw))
    assert message in str(e.value)


def test_element_count_stops_at_the_cap_before_multiplying_further() -> None:
    assert element_count("t", [4, 0, 1 << 62]) == 0  # no elements at all
    with pytest.raises(MessageError, match="more than"):
        element_count("t", [1 << 62, 1 << 62, 1 << 62])
    assert element_count("t", []) == 1
    assert element_count("t", [MAX_TENSOR_ELEMENTS]) == MAX_TENSOR_ELEMENTS


def test_bytes_as_text_decodes_utf8_and_names_the_element_that_is_not() -> None:
    arr = np.array([[b"dog"], ["caf\u00e9".encode()]], dtype=object)
    text = bytes_as_text("words", arr)
    assert text.shape == (2, 1) and text.tolist() == [["dog"], ["caf\u00e9"]]
    assert all(type(v) is str for v in text.ravel())
    with pytest.raises(MessageError, match=r"tensor 'words': BYTES element 1 is not UTF-8"):
        bytes_as_text("words", np.array([b"ok", b"\xff"], dtype=object))


# ---------------------------------------------------------------------------- oip: requests
def test_request_parameters_read_as_triton_reads_them() -> None:
    assert request_parameters(None) == (False, None, None)
    assert request_parameters({"binary_data_output": True, "custom": "kept"}) == (True, None, None)
    assert request_parameters({"priority": 0})[1] is None  # 0: the default
    assert request_parameters({"priority": 1})[1] is Priority.HIGH
    assert request_parameters({"priority": 2})[1] is Priority.NORMAL
    assert request_parameters({"priority": 9})[1] is Priority.LOW
    assert request_parameters({"timeout": 250_000})[2] == 0.25
    assert request_parameters({"sequence_id": 0}) == (False, None, None)


@pytest.mark.parametrize(
    ("params", "code", "message"),
    [
        ({"sequence_id": 7}, ErrorCode.NOT_IMPLEMENTED, "sequence batching (parameter sequence_id) is not supported"),
        ({"sequence_id": "abc"}, ErrorCode.NOT_IMPLEMENTED, "sequence batching"),
        ({"binary_data_output": "yes"}, ErrorCode.BAD_REQUEST, "binary_data_output must be true or false"),
        ({"priority": "high"}, ErrorCode.BAD_REQUEST, "parameter priority must be an integer, not str"),
        ({"priority": True}, ErrorCode.BAD_REQUEST, "parameter priority must be an integer, not bool"),
        ({"priority": -1}, ErrorCode.BAD_REQUEST, "parameter priority must be >= 0"),
        ({"timeout": 0}, ErrorCode.BAD_REQUEST, "parameter timeout must be in (0, 3600000000]"),
        ({"timeout": 1.5}, ErrorCode.BAD_REQUEST, "parameter timeout (microseconds) must be an integer"),
        ([1], ErrorCode.BAD_REQUEST, "request parameters must be an object"),
    ],
)  # fmt: skip
def test_bad_request_parameters_are_refused(params: Any, code: ErrorCode, message: str) -> None:
    with pytest.raises(RequestError) as e:
        request_parameters(params)
    assert e.value.code is code and message in str(e.value)


def test_output_requests_read_binary_data_and_classification() -> None:
    assert output_requests(None) is None
    got = output_requests([
        {"name": "a"},
        {"name": "b", "parameters": {"binary_data": False, "classification": 3}},
    ])  # fmt: skip
    assert got == (OutputRequest("a"), OutputRequest("b", False, 3))


@pytest.mark.parametrize(
    ("outputs", "code", "message"),
    [
        ({"name": "a"}, ErrorCode.BAD_REQUEST, "outputs must be a list of at most 64 objects"),
        ([{"name": ""}], ErrorCode.BAD_REQUEST, "needs a name of 1 to 256 characters"),
        ([{"name": "a", "parameters": {"binary_data": 1}}], ErrorCode.BAD_REQUEST, "output 'a': binary_data must be true or false"),
        ([{"name": "a", "parameters": {"classification": 4097}}], ErrorCode.BAD_REQUEST, "classification must be from 0 to 4096"),
        ([{"name": "a", "parameters": {"classification": "3"}}], ErrorCode.BAD_REQUEST, "classification must be an integer"),
        ([{"name": "a", "parameters": {"shared_memory_region": "r"}}], ErrorCode.NOT_IMPLEMENTED, "output 'a': shared memory is not supported"),
    ],
)  # fmt: skip
def test_bad_output_requests_are_refused(outputs: Any, code: ErrorCode, message: str) -> None:
    with pytest.raises(RequestError) as e:
        output_requests(outputs)
    assert e.value.code is code and message in str(e.value)


SPECS = (
    TensorSpec("ids", Datatype.INT64, (-1, 4)),
    TensorSpec("mask", Datatype.BOOL, (-1, 4)),
    TensorSpec("text", Datatype.BYTES, (-1, 1)),
)


def _header(*inputs: dict[str, Any], **rest: Any) -> dict[str, Any]:
    return {"inputs": list(inputs), **rest}


def _raw_input(name: str, datatype: str, shape: list[int], size: int, **kw: Any) -> dict[str, Any]:
    return {"name": name, "datatype": datatype, "shape": shape,
            "parameters": {"binary_data_size": size}, **kw}  # fmt: skip


def test_decode_binary_request_reads_each_input_from_its_slice() -> None:
    ids = np.array([[1, -2, 3, 4], [5, 6, 7, -8]], np.int64)
    text = struct.pack("<I", 3) + b"dog" + struct.pack("<I", 5) + "caf\u00e9".encode()
    header = _header(
        _raw_input("ids", "INT64", [2, 4], 64),
        {"name": "mask", "datatype": "BOOL", "shape": [2, 4], "data": [True, False] * 4},
        _raw_input("text", "BYTES", [2, 1], len(text)),
        id="r1", parameters={"binary_data_output": True, "priority": 1, "timeout": 5000},
        outputs=[{"name": "x", "parameters": {"classification": 2}}],
    )  # fmt: skip
    call = decode_binary_request(header, memoryview(ids.tobytes() + text), SPECS)
    assert call.request_id == "r1" and call.binary_output
    assert call.priority is Priority.HIGH and call.timeout_s == 0.005
    assert call.outputs == (OutputRequest("x", None, 2),)
    np.testing.assert_array_equal(call.feeds["ids"], ids)
    assert call.feeds["mask"].tolist() == [[True, False] * 2] * 2
    assert call.feeds["text"].tolist() == [["dog"], ["caf\u00e9"]]  # text, as JSON gives it


def _good_parts() -> tuple[list[dict[str, Any]], bytes]:
    inputs = [
        _raw_input("ids", "INT64", [1, 4], 32),
        _raw_input("mask", "BOOL", [1, 4], 4),
        _raw_input("text", "BYTES", [1, 1], 5),
    ]
    return inputs, bytes(32) + bytes([1, 0, 1, 0]) + struct.pack("<I", 1) + b"a"


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        (lambda i, b: (i, b[:-2]), MessageError, "input 'text': binary_data_size 5 runs past the end of the body (3 bytes left)"),
        (lambda i, b: (i, b + b"zz"), MessageError, "2 bytes after the inference header are claimed by no input"),
        (lambda i, b: ([{**i[0], "parameters": {"binary_data_size": 24}}, *i[1:]], b[8:]), MessageError, "input 'ids': INT64 [1, 4] takes 32 bytes, binary_data_size says 24"),
        (lambda i, b: ([{**i[0], "parameters": {"binary_data_size": -1}}, *i[1:]], b), MessageError, "binary_data_size must be an integer >= 0"),
        (lambda i, b: ([{**i[0], "datatype": "INT32", "parameters": {"binary_data_size": 16}}, *i[1:]], b[16:]), InputError, "input 'ids': model expects INT64, got INT32"),
        (lambda i, b: ([{**i[0], "datatype": "INT99"}, *i[1:]], b), MessageError, "input 'ids': unknown datatype 'INT99'"),
        (lambda i, b: ([{**i[0], "shape": [1, 5]}, *i[1:]], b), InputError, "shape [1, 5] does not fit the model's [-1, 4]"),
        (lambda i, b: ([{**i[0], "shape": [1 << 40, 1 << 40]}, *i[1:]], b), MessageError, "more than 16777216 elements"),
        (lambda i, b: ([{**i[0], "name": "nope"}, *i[1:]], b), InputError, "unknown input 'nope'"),
        (lambda i, b: ([i[0], i[0], *i[1:]], b), InputError, "input 'ids' given twice"),
        (lambda i, b: (i[:2], b[:36]), InputError, "missing input(s) ['text']"),
        (lambda i, b: ([{**i[0], "data": [1, 2, 3, 4]}, *i[1:]], b), MessageError, "give data or binary_data_size, not both"),
        (lambda i, b: (i, b[:32] + bytes([1, 0, 7, 0]) + b[36:]), MessageError, "BOOL bytes must be 0 or 1"),
        (lambda i, b: (i, b[:-1] + b"\xff"), MessageError, "BYTES element 0 is not UTF-8 text"),
        (lambda i, b: ([{**i[0], "parameters": {"shared_memory_region": "r"}}, *i[1:]], b), RequestError, "input 'ids': shared memory is not supported"),
    ],
    ids=["truncated", "leftover", "size-vs-shape", "negative-size", "wrong-datatype", "unknown-datatype",
         "shape", "over-cap", "unknown-input", "twice", "missing", "data-and-size", "bool", "utf8", "shm"],
)  # fmt: skip
def test_decode_binary_request_refusals(change: Any, error: type, message: str) -> None:
    inputs, body = change(*_good_parts())
    with pytest.raises(error) as e:
        decode_binary_request(_header(*inputs), memoryview(body), SPECS)
    assert message in str(e.value)


def test_decode_binary_request_accepts_the_good_parts() -> None:
    inputs, body = _good_parts()
    call = decode_binary_request(json.loads(json.dumps(_header(*inputs))), memoryview(body), SPECS)
    assert sorted(call.feeds) == ["ids", "mask", "text"] and call.outputs is None


@pytest.mark.parametrize(
    ("header", "message"),
    [([], "the inference header must be a JSON object"), ({"inputs": []}, "inputs must be a list of 1 to 64"),
     ({"inputs": [1]}, "each input must be a JSON object"),
     ({"inputs": [{"name": "ids"}], "id": 5}, "id must be a string")],
)  # fmt: skip
def test_decode_binary_request_refuses_a_malformed_header(header: Any, message: str) -> None:
    with pytest.raises(MessageError, match=message):
        decode_binary_request(header, memoryview(b""), SPECS)


# ---------------------------------------------------------------------------- oip: answers
def test_classify_gives_the_top_classes_best_first_with_labels_where_known() -> None:
    scores = np.array([[0.1, 0.7, 0.2, 0.0], [0.5, 0.25, 0.25, 0.9]], np.float32)
    got = classify(scores, 3, ["a", "b"])  # labels for the first two classes only
    assert got.shape == (2, 3) and got.dtype == object
    assert got.tolist() == [
        [b"0.700000:1:b", b"0.200000:2", b"0.100000:0:a"],
        [b"0.900000:3", b"0.500000:0:a", b"0.250000:1:b"],  # a tie keeps class order
    ]


def test_classify_a_single_row_integers_and_more_classes_than_there_are() -> None:
    assert classify(np.array([3, 9, 1], np.int64), 5, []).tolist() == [
        b"9.000000:1", b"3.000000:0", b"1.000000:2",
    ]  # fmt: skip
    with pytest.raises(InputError, match="classification needs a numeric output"):
        classify(np.array([b"x"], dtype=object), 1, [])


def test_answer_tensors_in_the_order_asked_with_each_outputs_own_format() -> None:
    outputs = {"p": np.array([[0.2, 0.8]], np.float32), "q": np.array([[1]], np.int64)}
    assert [(n, b) for n, _, b in answer_tensors(outputs, None, ["q", "p"], [], True)] == [
        ("q", True), ("p", True),
    ]  # fmt: skip
    wanted = (OutputRequest("p", False, 1), OutputRequest("q"))
    (p_name, p_arr, p_bin), (q_name, _, q_bin) = answer_tensors(
        outputs, wanted, [], ["no", "yes"], True
    )
    assert (p_name, p_bin, q_name, q_bin) == ("p", False, "q", True)
    assert p_arr.tolist() == [[b"0.800000:1:yes"]]
    with pytest.raises(
        InputError, match=r"unknown output\(s\) \['z'\]; the model has \['p', 'q'\]"
    ):
        answer_tensors(outputs, (OutputRequest("z"),), [], [], False)
