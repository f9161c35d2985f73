"""Triton's own clients against a real ``mcp-agent serve`` (HTTP and gRPC), and bad input.

One ``mcp-agent serve`` process per module serves five real models: the digits MLP, a small
digits convnet, an INT64+BOOL model, a BYTES (string) model and a labelled bundle of the MLP.
``tritonclient`` (HTTP and gRPC, sync and asyncio, and a gRPC stream) must get what
onnxruntime answers when it runs the same files; the extensions those clients call
(metadata, config, statistics, repository, classification, compression, version pinning,
load/unload) must answer as Triton does. Every malformed request must get a clear error
naming the problem, after which the server still answers good requests.
"""

from __future__ import annotations

import asyncio
import gzip
import http.client
import json
import queue
import shutil
import struct
import subprocess
import urllib.error
import urllib.request
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as tg
import tritonclient.grpc.aio as tga
import tritonclient.http as th
import tritonclient.http.aio as tha
from tritonclient.grpc import model_config_pb2, service_pb2_grpc
from tritonclient.grpc import service_pb2 as pb
from tritonclient.utils import InferenceServerException

from mcp_edge.shared.bundle import build_bundle
from mcp_edge.tooling.models import DigitsModels, digits_images, make_digits_convnet
from mcp_edge.tooling.processes import (
    AGENT,
    REPO,
    free_port,
    process_env,
    stopped_at_exit,
    wait_until,
)
from mcp_edge.tooling.protocol_models import (
    int64_reference,
    write_int64_model,
    write_text_model,
)

MODELS = ("digits", "convnet", "int64_scores", "text_labels")
LABELS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
DATATYPES = {np.dtype(np.float32): "FP32", np.dtype(np.int64): "INT64",
             np.dtype(np.bool_): "BOOL", np.dtype(object): "BYTES"}  # fmt: skip
ONNX_TYPES = {"tensor(float)": "FP32", "tensor(int64)": "INT64", "tensor(bool)": "BOOL",
              "tensor(string)": "BYTES"}  # fmt: skip


# ---------------------------------------------------------------------------- fixtures
@dataclass(frozen=True)
class Model:
    """One served model: its file, the request to send and what onnxruntime answers to it."""

    path: Path
    feeds: dict[str, np.ndarray]
    expected: dict[str, np.ndarray]
    session: ort.InferenceSession


@dataclass(frozen=True)
class Agent:
    http: str
    grpc: str
    log: Path


def _ort_feed(a: np.ndarray) -> np.ndarray:
    # onnxruntime takes text for string tensors (it would feed bytes as their repr).
    if a.dtype == object:
        return np.vectorize(lambda v: v.decode(), otypes=[object])(a)
    return a


def _model(path: Path, feeds: dict[str, np.ndarray]) -> Model:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    answers = session.run(None, {k: _ort_feed(v) for k, v in feeds.items()})
    return Model(path, feeds, dict(zip(names, answers, strict=True)), session)


@pytest.fixture(scope="module")
def models(digits: DigitsModels, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Model]:
    folder = tmp_path_factory.mktemp("triton-models")
    work = tmp_path_factory.mktemp("triton-work")
    convnet = make_digits_convnet(work, channels=(8, 16))
    shutil.copy(digits.onnx_path, folder / "digits.onnx")
    shutil.copy(convnet.onnx_path, folder / "convnet.onnx")
    labels = work / "labels.txt"
    labels.write_text("\n".join(LABELS))
    build_bundle(digits.onnx_path, folder / "labeled.mcpb", name="labeled", version="3.0.0",
                 labels_path=labels)  # fmt: skip
    rng = np.random.default_rng(7)
    words = [b"dog", b"zebra", "caf\u00e9".encode(), b"cat", b""]
    x = digits.X_test[:3]
    return {
        "digits": _model(folder / "digits.onnx", {"input": x}),
        "labeled": _model(digits.onnx_path, {"input": x}),
        "convnet": _model(folder / "convnet.onnx", {"input": digits_images(digits.X_test[:2])}),
        "int64_scores": _model(
            write_int64_model(folder),
            {
                "ids": rng.integers(-1000, 1000, (3, 4), dtype=np.int64),
                "mask": rng.integers(0, 2, (3, 4)).astype(np.bool_),
            },
        ),
        "text_labels": _model(
            write_text_model(folder), {"text": np.array(words, dtype=object).reshape(-1, 1)}
        ),
    }


def _ready(http: str, grpc_url: str, proc: subprocess.Popen[str], log: Path) -> bool:
    if proc.poll() is not None:
        raise AssertionError(f"mcp-agent serve exited: {log.read_text()[-3000:]}")
    try:
        with urllib.request.urlopen(f"http://{http}/v2/health/ready", timeout=5) as r:
            if r.status != 200:
                return False
    except (urllib.error.URLError, OSError):
        return False
    client = tg.InferenceServerClient(grpc_url)
    try:
        return bool(client.is_server_ready(client_timeout=5))
    except InferenceServerException:
        return False
    finally:
        client.close()


def _start_agent(model_path: Path, state: Path, *args: str) -> Iterator[Agent]:
    http_port, grpc_port = free_port(), free_port()
    log = state.parent / f"{state.name}.log"
    with stopped_at_exit() as procs, log.open("w") as out:
        proc = subprocess.Popen(
            [*AGENT, "serve", "--model-path", str(model_path), "--port", str(http_port),
             "--grpc-port", str(grpc_port), "--processes", "1", "--state-dir", str(state),
             *args],
            stdout=out, stderr=out, text=True, cwd=REPO, env=process_env(),
        )  # fmt: skip
        procs.append(proc)
        agent = Agent(f"127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}", log)
        wait_until(lambda: _ready(agent.http, agent.grpc, proc, log), "the agent to be ready", 60)
        yield agent


@pytest.fixture(scope="module")
def agent(models: dict[str, Model], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    """The agent under test: every model, HTTP and gRPC, a 1 MiB body cap."""
    folder = models["digits"].path.parent
    yield from _start_agent(
        folder, tmp_path_factory.mktemp("state") / "serve", "--max-body-mb", "1"
    )


@pytest.fixture(scope="module")
def explicit_agent(
    models: dict[str, Model], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Agent]:
    """A second agent with explicit model control, serving the MLP and the INT64 model."""
    folder = tmp_path_factory.mktemp("explicit-models")
    for name in ("digits", "int64_scores"):
        shutil.copy(models[name].path, folder / models[name].path.name)
    state = tmp_path_factory.mktemp("explicit-state") / "serve"
    yield from _start_agent(folder, state, "--model-control", "explicit")


@pytest.fixture(scope="module")
def hc(agent: Agent) -> Iterator[Any]:
    """tritonclient's HTTP client with its default settings."""
    client = th.InferenceServerClient(agent.http)
    yield client
    client.close()


@pytest.fixture(scope="module")
def gc(agent: Agent) -> Iterator[Any]:
    """tritonclient's gRPC client with its default settings."""
    client = tg.InferenceServerClient(agent.grpc)
    yield client
    client.close()


# ---------------------------------------------------------------------------- helpers
def _inputs(module: Any, feeds: dict[str, np.ndarray], **kwargs: Any) -> list[Any]:
    found = []
    for name, a in feeds.items():
        tensor = module.InferInput(name, list(a.shape), DATATYPES[a.dtype])
        tensor.set_data_from_numpy(a, **kwargs)
        found.append(tensor)
    return found


def _text(values: np.ndarray) -> list[str]:
    return [v.decode() if isinstance(v, bytes) else str(v) for v in values.ravel()]


def assert_answers(model: Model, as_numpy: Callable[[str], Any]) -> None:
    """Every output of ``model`` as the client decoded it equals onnxruntime's answer."""
    for name, want in model.expected.items():
        got = as_numpy(name)
        assert got is not None, f"output {name!r} missing"
        assert got.shape == want.shape, name
        if want.dtype == object:
            assert _text(got) == _text(want), name
        elif want.dtype.kind == "f":
            assert got.dtype == want.dtype, name
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=name)
        else:
            assert got.dtype == want.dtype, name
            np.testing.assert_array_equal(got, want, err_msg=name)


def _status(e: InferenceServerException) -> str:
    return str(e.status())


# ---------------------------------------------------------------------------- inference
@pytest.mark.parametrize("model_name", MODELS)
@pytest.mark.parametrize("mode", ["binary", "json"])
def test_http_client_answers_equal_onnxruntime(
    hc: Any, models: dict[str, Model], model_name: str, mode: str
) -> None:
    model = models[model_name]
    client = hc
    if mode == "binary":  # the client's defaults: tensors in and out as raw bytes
        result = client.infer(model_name, _inputs(th, model.feeds), request_id="req-7")
    else:
        outputs = [th.InferRequestedOutput(n, binary_data=False) for n in model.expected]
        result = client.infer(
            model_name, _inputs(th, model.feeds, binary_data=False), outputs=outputs,
            request_id="req-7",
        )  # fmt: skip
    assert_answers(model, result.as_numpy)
    answer = result.get_response()
    assert answer["id"] == "req-7" and answer["model_name"] == model_name
    for out in answer["outputs"]:
        # The answer really travelled the way asked: raw bytes, or JSON data.
        assert ("binary_data_size" in out.get("parameters", {})) == (mode == "binary"), out
        assert ("data" in out) == (mode == "json"), out


@pytest.mark.parametrize("model_name", MODELS)
def test_grpc_client_answers_equal_onnxruntime(
    gc: Any, models: dict[str, Model], model_name: str
) -> None:
    model = models[model_name]
    result = gc.infer(model_name, _inputs(tg, model.feeds), request_id="g-1")
    assert_answers(model, result.as_numpy)
    assert result.get_response().id == "g-1"
    assert result.get_response().model_version == "1"


@pytest.mark.parametrize("model_name", ["digits", "int64_scores", "text_labels"])
def test_an_empty_batch_gets_empty_outputs(
    hc: Any, gc: Any, models: dict[str, Model], model_name: str
) -> None:
    model = models[model_name]
    empty = {k: v[:0] for k, v in model.feeds.items()}
    for module, client in ((th, hc), (tg, gc)):
        result = client.infer(model_name, _inputs(module, empty))
        for name, want in model.expected.items():
            assert result.as_numpy(name).shape == (0, *want.shape[1:]), (module.__name__, name)


def test_request_parameters_the_clients_send(hc: Any, gc: Any, models: dict[str, Model]) -> None:
    model = models["int64_scores"]
    for module, client in ((th, hc), (tg, gc)):
        # priority (1: high) and timeout (µs) are honoured, so the request is answered.
        result = client.infer("int64_scores", _inputs(module, model.feeds), priority=1,
                              timeout=30_000_000)  # fmt: skip
        assert_answers(model, result.as_numpy)
        with pytest.raises(InferenceServerException) as e:
            client.infer("int64_scores", _inputs(module, model.feeds), sequence_id=42)
        assert _status(e.value) in ("501", "StatusCode.UNIMPLEMENTED")
        assert "sequence batching (parameter sequence_id) is not supported" in e.value.message()


async def test_asyncio_clients_answer_every_model_at_once(
    agent: Agent, models: dict[str, Model]
) -> None:
    async with (
        tha.InferenceServerClient(agent.http) as h,
        tga.InferenceServerClient(agent.grpc) as g,
    ):
        calls = [h.infer(n, _inputs(th, models[n].feeds)) for n in MODELS]
        calls += [g.infer(n, _inputs(tg, models[n].feeds)) for n in MODELS]
        results = await asyncio.gather(*calls)
    for name, result in zip(MODELS * 2, results, strict=True):
        assert_answers(models[name], result.as_numpy)


def test_grpc_stream_answers_each_request_and_survives_a_bad_one(
    agent: Agent, models: dict[str, Model]
) -> None:
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = tg.InferenceServerClient(agent.grpc)
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    for i, name in enumerate(MODELS):
        client.async_stream_infer(name, _inputs(tg, models[name].feeds), request_id=f"s{i}")
        if i == 1:  # a request the model cannot take, in the middle of the stream
            bad = tg.InferInput("nope", [1, 4], "INT64")
            bad.set_data_from_numpy(np.zeros((1, 4), np.int64))
            client.async_stream_infer("int64_scores", [bad], request_id="bad")
    client.stop_stream()  # waits for every answer
    client.close()
    got = [answers.get_nowait() for _ in range(answers.qsize())]
    errors = [str(e) for r, e in got if e is not None]
    assert len(errors) == 1 and "unknown input 'nope'" in errors[0], errors
    by_id = {r.get_response().id: r for r, e in got if e is None}
    assert sorted(by_id) == ["s0", "s1", "s2", "s3"]
    for i, name in enumerate(MODELS):
        assert_answers(models[name], by_id[f"s{i}"].as_numpy)


async def test_asyncio_grpc_stream(agent: Agent, models: dict[str, Model]) -> None:
    async def requests() -> Any:
        for i, name in enumerate(MODELS):
            yield {"model_name": name, "inputs": _inputs(tg, models[name].feeds),
                   "request_id": str(i)}  # fmt: skip

    async with tga.InferenceServerClient(agent.grpc) as client:
        got = {}
        async for result, error in client.stream_infer(requests()):
            assert error is None, error
            got[result.get_response().id] = result
            if len(got) == len(MODELS):
                break
    for i, name in enumerate(MODELS):
        assert_answers(models[name], got[str(i)].as_numpy)


# ---------------------------------------------------------------------------- extensions
def test_server_metadata_names_the_extensions(hc: Any, gc: Any) -> None:
    http_meta = hc.get_server_metadata()
    grpc_meta = gc.get_server_metadata()
    for meta in (http_meta, grpc_meta.extensions):
        extensions = set(meta["extensions"] if isinstance(meta, dict) else meta)
        assert {"binary_tensor_data", "classification", "model_configuration", "statistics",
                "model_repository"} <= extensions  # fmt: skip
    assert http_meta["name"] == grpc_meta.name == "mcp-edge-agent"


def _onnx_signature(session: ort.InferenceSession) -> tuple[list[Any], list[Any]]:
    def sig(ts: Any) -> list[Any]:
        return [(t.name, ONNX_TYPES[t.type], [d if isinstance(d, int) else -1 for d in t.shape])
                for t in ts]  # fmt: skip

    return sig(session.get_inputs()), sig(session.get_outputs())


@pytest.mark.parametrize("model_name", MODELS)
def test_model_metadata_and_config_describe_the_model_file(
    hc: Any, gc: Any, models: dict[str, Model], model_name: str
) -> None:
    inputs, outputs = _onnx_signature(models[model_name].session)
    meta = hc.get_model_metadata(model_name)
    gmeta = gc.get_model_metadata(model_name)
    assert meta["platform"] == gmeta.platform == "onnxruntime_onnx"
    assert [(t["name"], t["datatype"], t["shape"]) for t in meta["inputs"]] == inputs
    assert [(t["name"], t["datatype"], t["shape"]) for t in meta["outputs"]] == outputs
    assert [(t.name, t.datatype, list(t.shape)) for t in gmeta.inputs] == inputs
    assert [(t.name, t.datatype, list(t.shape)) for t in gmeta.outputs] == outputs

    def triton_type(datatype: str) -> str:
        return "TYPE_STRING" if datatype == "BYTES" else "TYPE_" + datatype

    config = hc.get_model_config(model_name)
    gconfig = gc.get_model_config(model_name).config
    assert config["max_batch_size"] == gconfig.max_batch_size > 1  # batched: dims drop N
    for key, tensors in (("input", inputs), ("output", outputs)):
        want = [(n, triton_type(dt), shape[1:]) for n, dt, shape in tensors]
        assert [(t["name"], t["data_type"], t["dims"]) for t in config[key]] == want
        got = [(t.name, model_config_pb2.DataType.Name(t.data_type), list(t.dims))
               for t in getattr(gconfig, key)]  # fmt: skip
        assert got == want


def _http_stats(client: Any, name: str) -> dict[str, Any]:
    (entry,) = client.get_inference_statistics(name)["model_stats"]
    return entry


def test_statistics_count_what_was_sent_per_model_and_for_all(
    hc: Any, gc: Any, models: dict[str, Model]
) -> None:
    h, g = hc, gc
    before = {n: _http_stats(h, n) for n in ("int64_scores", "text_labels")}
    model = models["int64_scores"]
    rows = len(model.feeds["ids"])
    for _ in range(2):
        h.infer("int64_scores", _inputs(th, model.feeds))
    g.infer("int64_scores", _inputs(tg, model.feeds))
    with pytest.raises(InferenceServerException, match=r"does not fit|dimension 1 must be 4"):
        h.infer("int64_scores", _inputs(th, {"ids": np.zeros((1, 5), np.int64),
                                             "mask": np.zeros((1, 5), np.bool_)}))  # fmt: skip
    after = _http_stats(h, "int64_scores")
    assert after["inference_stats"]["success"]["count"] == (
        before["int64_scores"]["inference_stats"]["success"]["count"] + 3
    )
    assert after["inference_count"] == before["int64_scores"]["inference_count"] + 3 * rows
    assert after["inference_stats"]["fail"]["count"] == (
        before["int64_scores"]["inference_stats"]["fail"]["count"] + 1
    )
    # gRPC reports the same numbers; the all-models answer holds every model.
    (gentry,) = g.get_inference_statistics("int64_scores").model_stats
    assert gentry.inference_count == after["inference_count"]
    assert gentry.inference_stats.success.count == after["inference_stats"]["success"]["count"]
    everything = {e["name"]: e for e in h.get_inference_statistics()["model_stats"]}
    assert set(everything) == {*MODELS, "labeled"}
    assert everything["int64_scores"]["inference_count"] == after["inference_count"]
    assert everything["text_labels"]["inference_count"] == before["text_labels"]["inference_count"]
    gall = {e.name: e for e in g.get_inference_statistics().model_stats}
    assert gall["int64_scores"].inference_count == after["inference_count"]


def test_repository_index_and_readiness(hc: Any, gc: Any) -> None:
    h, g = hc, gc
    want = {("convnet", "1"), ("digits", "1"), ("int64_scores", "1"), ("labeled", "3.0.0"),
            ("text_labels", "1")}  # fmt: skip
    index = h.get_model_repository_index()
    assert {(e["name"], e["version"]) for e in index} == want
    assert {e["state"] for e in index} == {"READY"}
    gindex = g.get_model_repository_index().models
    assert {(e.name, e.version) for e in gindex} == want
    for client in (h, g):
        assert all(client.is_model_ready(n) for n in MODELS)
        assert client.is_model_ready("labeled", "3.0.0")
        assert not client.is_model_ready("labeled", "1")
        assert not client.is_model_ready("no_such_model")


def _top(text: bytes | str) -> tuple[float, int, str | None]:
    parts = (text.decode() if isinstance(text, bytes) else text).split(":")
    return float(parts[0]), int(parts[1]), parts[2] if len(parts) > 2 else None


@pytest.mark.parametrize("model_name", ["digits", "labeled"])
@pytest.mark.parametrize("how", ["http-binary", "http-json", "grpc"])
def test_classification_gives_the_top_classes_of_onnxruntime(
    hc: Any, gc: Any, models: dict[str, Model], model_name: str, how: str
) -> None:
    model = models[model_name]
    if how == "grpc":
        client: Any = gc
        wanted = [tg.InferRequestedOutput("probabilities", class_count=3)]
        result = client.infer(model_name, _inputs(tg, model.feeds), outputs=wanted)
    else:
        client = hc
        binary = how == "http-binary"
        wanted = [th.InferRequestedOutput("probabilities", binary_data=binary, class_count=3)]
        result = client.infer(model_name, _inputs(th, model.feeds), outputs=wanted)
    classes = result.as_numpy("probabilities")
    scores = model.expected["probabilities"]
    assert classes.shape == (len(scores), 3)
    for row, tops in zip(scores, classes, strict=True):
        parsed = [_top(t) for t in tops]
        assert [i for _, i, _ in parsed] == list(np.argsort(-row, kind="stable")[:3])
        np.testing.assert_allclose([s for s, _, _ in parsed], row[[i for _, i, _ in parsed]],
                                   atol=2e-6)  # fmt: skip
        labels = [label for *_, label in parsed]
        if model_name == "labeled":
            assert labels == [LABELS[i] for _, i, _ in parsed]
        else:
            assert labels == [None, None, None]


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_http_compression_both_ways(
    agent: Agent, hc: Any, models: dict[str, Model], algorithm: str
) -> None:
    model = models["digits"]
    client = hc
    for binary in (True, False):  # the header length counts the uncompressed header
        outputs = [th.InferRequestedOutput("probabilities", binary_data=binary)]
        result = client.infer(
            "digits", _inputs(th, model.feeds, binary_data=binary), outputs=outputs,
            request_compression_algorithm=algorithm, response_compression_algorithm=algorithm,
        )  # fmt: skip
        assert_answers(model, result.as_numpy)
    # What the client hides: the answer really comes back compressed (and a compressed
    # request body is read), here with 16 rows so that the answer is over 1 KiB.
    x = np.repeat(model.feeds["input"], 6, axis=0)[:16]
    body = json.dumps({"inputs": [{"name": "input", "shape": [16, 64], "datatype": "FP32",
                                   "data": x.ravel().tolist()}]}).encode()  # fmt: skip
    packed = gzip.compress(body) if algorithm == "gzip" else zlib.compress(body)
    status, headers, raw = _post(agent, "/v2/models/digits/infer", packed,
                                 {"Content-Encoding": algorithm, "Accept-Encoding": algorithm})  # fmt: skip
    assert status == 200 and headers.get("content-encoding") == algorithm
    answer = json.loads(gzip.decompress(raw) if algorithm == "gzip" else zlib.decompress(raw))
    want = model.session.run(None, {"input": x})[0]
    got = np.asarray(answer["outputs"][0]["data"], np.float32).reshape(16, 10)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("accept", "coding"),
    [("gzip;q=0", None), ("gzip;q=0, deflate", "deflate"), ("deflate;q=0.5, gzip", "gzip"),
     ("*", "gzip"), ("identity", None), ("br", None)],
)  # fmt: skip
def test_answers_are_compressed_only_as_accept_encoding_allows(
    agent: Agent, models: dict[str, Model], accept: str, coding: str | None
) -> None:
    x = np.repeat(models["digits"].feeds["input"], 6, axis=0)[:16]
    body = json.dumps({"inputs": [{"name": "input", "shape": [16, 64], "datatype": "FP32",
                                   "data": x.ravel().tolist()}]}).encode()  # fmt: skip
    status, headers, raw = _post(
        agent, "/v2/models/digits/infer", body, {"Accept-Encoding": accept}
    )
    assert status == 200 and headers.get("content-encoding") == coding
    if coding is None:
        assert json.loads(raw)["outputs"][0]["shape"] == [16, 10]


def test_model_version_pinning(hc: Any, gc: Any, models: dict[str, Model]) -> None:
    model = models["labeled"]
    h, g = hc, gc
    r = h.infer("labeled", _inputs(th, model.feeds), model_version="3.0.0")
    assert r.get_response()["model_version"] == "3.0.0"
    assert_answers(model, r.as_numpy)
    r = g.infer("labeled", _inputs(tg, model.feeds), model_version="3.0.0")
    assert r.get_response().model_version == "3.0.0"
    assert_answers(model, r.as_numpy)
    with pytest.raises(InferenceServerException) as e:
        h.infer("labeled", _inputs(th, model.feeds), model_version="7")
    assert _status(e.value) == "404" and "no loaded version '7'" in e.value.message()
    with pytest.raises(InferenceServerException) as e:
        g.infer("labeled", _inputs(tg, model.feeds), model_version="7")
    assert "NOT_FOUND" in _status(e.value) and "no loaded version '7'" in e.value.message()


def test_load_and_unload_are_refused_without_explicit_model_control(
    hc: Any, gc: Any, models: dict[str, Model]
) -> None:
    h, g = hc, gc
    for call in (h.load_model, h.unload_model):
        with pytest.raises(InferenceServerException) as e:
            call("digits")
        assert _status(e.value) == "403"
        assert "explicit model control is off" in e.value.message()
        assert "--model-control explicit" in e.value.message()
    for call in (g.load_model, g.unload_model):
        with pytest.raises(InferenceServerException) as e:
            call("digits")
        assert "PERMISSION_DENIED" in _status(e.value)
        assert "explicit model control is off" in e.value.message()
    assert_answers(
        models["digits"], h.infer("digits", _inputs(th, models["digits"].feeds)).as_numpy
    )


@pytest.mark.parametrize("transport", ["http", "grpc"])
def test_explicit_model_control_unloads_and_loads_again(
    explicit_agent: Agent, models: dict[str, Model], transport: str
) -> None:
    name = "digits" if transport == "http" else "int64_scores"
    module: Any = th if transport == "http" else tg
    client = module.InferenceServerClient(
        explicit_agent.http if transport == "http" else explicit_agent.grpc
    )
    model = models[name]
    assert client.is_model_ready(name)
    client.unload_model(name)  # tritonclient sends unload_dependents=false with it
    assert not client.is_model_ready(name)
    with pytest.raises(InferenceServerException, match=f"model '{name}' is not loaded"):
        client.infer(name, _inputs(module, model.feeds))
    index = th.InferenceServerClient(explicit_agent.http).get_model_repository_index()
    assert {"name": name, "version": "", "state": "UNAVAILABLE", "reason": "unloaded"} in index
    with pytest.raises(InferenceServerException, match=r"no model file under .* serves 'nope'"):
        client.load_model("nope")
    client.load_model(name)
    assert client.is_model_ready(name)
    assert_answers(model, client.infer(name, _inputs(module, model.feeds)).as_numpy)


# ---------------------------------------------------------------------------- bad HTTP input
def _post(
    agent: Agent, path: str, body: bytes | None, headers: dict[str, Any], method: str = "POST"
) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection(*agent.http.split(":"), timeout=30)
    try:
        conn.request(method, path, body=body, headers=headers)
        answer = conn.getresponse()
        return answer.status, {k.lower(): v for k, v in answer.getheaders()}, answer.read()
    finally:
        conn.close()


def _binary(header: dict[str, Any], *parts: bytes) -> tuple[bytes, dict[str, Any]]:
    head = json.dumps(header).encode()
    return head + b"".join(parts), {"Inference-Header-Content-Length": str(len(head))}


IDS = np.array([[3, -1, 7, 2]], np.int64)
MASK = np.array([[1, 0, 1, 1]], np.uint8)


def _int64_header(ids_size: int = 32, mask_size: int = 4, **changes: Any) -> dict[str, Any]:
    ids = {"name": "ids", "datatype": "INT64", "shape": [1, 4],
           "parameters": {"binary_data_size": ids_size}}  # fmt: skip
    ids.update(changes)
    mask = {"name": "mask", "datatype": "BOOL", "shape": [1, 4],
            "parameters": {"binary_data_size": mask_size}}  # fmt: skip
    return {"inputs": [ids, mask]}


def _text_request(raw: bytes) -> tuple[bytes, dict[str, Any]]:
    t = {"name": "text", "datatype": "BYTES", "shape": [1, 1],
         "parameters": {"binary_data_size": len(raw)}}  # fmt: skip
    return _binary({"inputs": [t]}, raw)


def _good_int64() -> tuple[bytes, dict[str, Any]]:
    return _binary(_int64_header(), IDS.tobytes(), MASK.tobytes())


def _with(pair: tuple[bytes, dict[str, Any]], **headers: Any) -> tuple[bytes, dict[str, Any]]:
    return pair[0], {**pair[1], **headers}


def _bomb() -> tuple[bytes, dict[str, Any]]:
    # 2 MiB of JSON that gzips to a few KiB: the cap applies to the decompressed body.
    body = json.dumps({"id": "x" * (2 << 20), "inputs": []}).encode()
    return gzip.compress(body), {"Content-Encoding": "gzip"}


_EXTRA = {"sequence": ({"parameters": {"sequence_id": 12}}),
            "shm": ({"inputs": [{"name": "ids", "datatype": "INT64", "shape": [1, 4],
                                 "parameters": {"shared_memory_region": "r0"}}]})}  # fmt: skip

# (id, method, path, request (body, headers), status, code, what the message must say)
HTTP_CASES: list[tuple[str, str, str, Callable[[], tuple[bytes | None, dict[str, Any]]], int, str, str]] = [
    ("truncated-binary", "POST", "/v2/models/int64_scores/infer",
     lambda: _binary(_int64_header(), IDS.tobytes(), MASK.tobytes()[:2]), 400, "bad_request",
     "input 'mask': binary_data_size 4 runs past the end of the body (2 bytes left)"),
    ("header-length-past-body", "POST", "/v2/models/int64_scores/infer",
     lambda: _with(_good_int64(), **{"Inference-Header-Content-Length": "9999"}), 400,
     "bad_request", "Inference-Header-Content-Length 9999 does not fit the"),
    ("header-length-not-a-number", "POST", "/v2/models/int64_scores/infer",
     lambda: _with(_good_int64(), **{"Inference-Header-Content-Length": "12abc"}), 400,
     "bad_request", "Inference-Header-Content-Length must be a byte count, not '12abc'"),
    ("header-length-unicode-digit", "POST", "/v2/models/int64_scores/infer",
     lambda: _with(_good_int64(), **{"Inference-Header-Content-Length": "\u00b2".encode()}),
     400, "bad_request", "Inference-Header-Content-Length must be a byte count"),
    ("header-length-negative", "POST", "/v2/models/int64_scores/infer",
     lambda: _with(_good_int64(), **{"Inference-Header-Content-Length": "-3"}), 400,
     "bad_request", "must be a byte count, not '-3'"),
    ("header-not-json", "POST", "/v2/models/int64_scores/infer",
     lambda: (b"{nope" + IDS.tobytes(), {"Inference-Header-Content-Length": "5"}), 400,
     "bad_request", "not valid JSON"),
    ("size-does-not-match-shape", "POST", "/v2/models/int64_scores/infer",
     lambda: _binary(_int64_header(ids_size=24), IDS.tobytes()[:24], MASK.tobytes()), 400,
     "bad_request", "input 'ids': INT64 [1, 4] takes 32 bytes, binary_data_size says 24"),
    ("shape-over-element-cap", "POST", "/v2/models/int64_scores/infer",
     lambda: _binary(_int64_header(shape=[65536, 65536]), IDS.tobytes(), MASK.tobytes()), 400,
     "bad_request", "shape [65536, 65536] has more than 16777216 elements"),
    ("shape-product-overflows-int64", "POST", "/v2/models/int64_scores/infer",
     lambda: _binary(_int64_header(shape=[2**62, 2**62, 4]), IDS.tobytes(), MASK.tobytes()),
     400, "bad_request", "has more than 16777216 elements"),
    ("negative-dimension", "POST", "/v2/models/int64_scores/infer",
     lambda: _binary(_int64_header(shape=[-1, 4]), IDS.tobytes(), MASK.tobytes()), 400,
     "bad_request", "shape [-1, 4] must hold integers >= 0"),
    ("wrong-datatype", "POST", "/v2/models/int64_scores/infer",
     lambda: _binary(_int64_header(ids_size=16, datatype="INT32"),
                     IDS.astype(np.int32).tobytes(), MASK.tobytes()), 400,
     "bad_request", "input 'ids': model expects INT64, got INT32"),
    ("wrong-datatype-json", "POST", "/v2/models/int64_scores/infer",
     lambda: (json.dumps({"inputs": [
         {"name": "ids", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]},
         {"name": "mask", "datatype": "BOOL", "shape": [1, 4], "data": [True] * 4}]}).encode(),
         {}), 400, "bad_request", "model expects INT64, got FP32"),
    ("bytes-length-past-end", "POST", "/v2/models/text_labels/infer",
     lambda: _text_request(struct.pack("<I", 100) + b"dog"), 400, "bad_request",
     "BYTES element 0 declares 100 bytes; only 3 remain"),
    ("bytes-no-length-prefix", "POST", "/v2/models/text_labels/infer",
     lambda: _text_request(b"do"), 400, "bad_request",
     "1 BYTES elements need at least 4 bytes, the request holds 2"),
    ("bytes-not-utf8", "POST", "/v2/models/text_labels/infer",
     lambda: _text_request(struct.pack("<I", 3) + b"\xffog"), 400, "bad_request",
     "BYTES element 0 is not UTF-8 text"),
    ("bool-not-0-or-1", "POST", "/v2/models/int64_scores/infer",
     lambda: _binary(_int64_header(), IDS.tobytes(), bytes([1, 0, 2, 1])), 400, "bad_request",
     "tensor 'mask': BOOL bytes must be 0 or 1"),
    ("leftover-bytes", "POST", "/v2/models/int64_scores/infer",
     lambda: _binary(_int64_header(), IDS.tobytes(), MASK.tobytes(), b"xyz"), 400,
     "bad_request", "3 bytes after the inference header are claimed by no input"),
    ("data-and-binary-size", "POST", "/v2/models/int64_scores/infer",
     lambda: _binary(_int64_header(data=[1, 2, 3, 4]), IDS.tobytes(), MASK.tobytes()), 400,
     "bad_request", "give data or binary_data_size, not both"),
    ("classification-of-text", "POST", "/v2/models/text_labels/infer",
     lambda: (json.dumps({"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1, 1],
                                      "data": ["dog"]}],
                          "outputs": [{"name": "label", "parameters": {"classification": 2}}]
                          }).encode(), {}),
     400, "bad_request", "classification needs a numeric output"),
    ("sequence-id", "POST", "/v2/models/int64_scores/infer",
     lambda: _binary({**_int64_header(), **_EXTRA["sequence"]}, IDS.tobytes(),
                     MASK.tobytes()), 501, "not_implemented",
     "sequence batching (parameter sequence_id) is not supported"),
    ("shared-memory-input", "POST", "/v2/models/int64_scores/infer",
     lambda: (json.dumps(_EXTRA["shm"]).encode(), {}), 501, "not_implemented",
     "input 'ids': shared memory is not supported"),
    ("decompressed-body-over-cap", "POST", "/v2/models/digits/infer", _bomb, 413, "too_large",
     "request body too large"),
    ("body-not-gzip", "POST", "/v2/models/digits/infer",
     lambda: (b"\x1f\x8b not really gzip", {"Content-Encoding": "gzip"}), 400, "bad_request",
     "cannot read the request body"),
    ("unknown-model", "POST", "/v2/models/nope/infer", _good_int64, 404, "not_found",
     "model 'nope' is not loaded"),
    ("unknown-route", "GET", "/v2/nothing/here", lambda: (None, {}), 404, "not_found",
     "no such route: /v2/nothing/here"),
    ("wrong-method", "GET", "/v2/models/digits/infer", lambda: (None, {}), 405, "bad_request",
     "GET is not allowed on /v2/models/digits/infer; use POST"),
    ("system-shared-memory", "GET", "/v2/systemsharedmemory/status", lambda: (None, {}), 501,
     "not_implemented", "system shared memory is not supported"),
    ("cuda-shared-memory", "POST", "/v2/cudasharedmemory/region/r0/register",
     lambda: (b"{}", {}), 501, "not_implemented", "CUDA shared memory is not supported"),
    ("trace", "GET", "/v2/trace/setting", lambda: (None, {}), 501, "not_implemented",
     "trace settings is not supported"),
    ("model-trace", "POST", "/v2/models/digits/trace/setting", lambda: (b"{}", {}), 501,
     "not_implemented", "trace settings is not supported"),
    ("logging", "GET", "/v2/logging", lambda: (None, {}), 501, "not_implemented",
     "log settings is not supported"),
    ("load-parameters-not-an-object", "POST", "/v2/repository/models/digits/load",
     lambda: (b'{"parameters": 5}', {}), 400, "bad_request", "load parameters must be an object"),
    ("load-config-override", "POST", "/v2/repository/models/digits/load",
     lambda: (b'{"parameters": {"config": "{}"}}', {}), 501, "not_implemented",
     "load parameters (config) are not supported"),
]  # fmt: skip


def _assert_int64_serves(agent: Agent) -> None:
    body, headers = _good_int64()
    status, _, raw = _post(agent, "/v2/models/int64_scores/infer", body, headers)
    assert status == 200, raw
    answer = json.loads(raw)  # no binary output asked: all JSON
    by_name = {o["name"]: o["data"] for o in answer["outputs"]}
    scores, total = int64_reference(IDS, MASK.astype(np.bool_))
    assert by_name["total"] == total.ravel().tolist()
    np.testing.assert_allclose(by_name["scores"], scores.ravel(), rtol=1e-6)


@pytest.mark.parametrize(
    ("method", "path", "request_of", "status", "code", "message"),
    [pytest.param(*case[1:], id=case[0]) for case in HTTP_CASES],
)
def test_bad_http_request_gets_a_clear_error_and_the_server_goes_on(
    agent: Agent, method: str, path: str, request_of: Callable[[], Any], status: int,
    code: str, message: str,
) -> None:  # fmt: skip
    body, headers = request_of()
    got, answer_headers, raw = _post(agent, path, body, headers, method)
    assert got == status, raw
    assert answer_headers["content-type"].startswith("application/json")
    answer = json.loads(raw)
    assert answer["code"] == code
    assert message in answer["error"], answer["error"]
    if status == 405:
        assert answer_headers["allow"] == "POST"
    _assert_int64_serves(agent)


# ---------------------------------------------------------------------------- bad gRPC input
@pytest.fixture(scope="module")
def stub(agent: Agent) -> Iterator[Any]:
    options = [("grpc.max_send_message_length", 64 << 20)]
    with grpc.insecure_channel(agent.grpc, options=options) as channel:
        yield service_pb2_grpc.GRPCInferenceServiceStub(channel)


_T = pb.ModelInferRequest.InferInputTensor


def _ids(shape: list[int] | None = None, datatype: str = "INT64", **kw: Any) -> Any:
    return _T(name="ids", datatype=datatype, shape=shape or [1, 4], **kw)


def _mask(**kw: Any) -> Any:
    return _T(name="mask", datatype="BOOL", shape=[1, 4], **kw)


def _int64_raw(*inputs: Any, raws: list[bytes] | None = None, **kw: Any) -> Any:
    return pb.ModelInferRequest(
        model_name="int64_scores",
        inputs=list(inputs) or [_ids(), _mask()],
        raw_input_contents=[IDS.tobytes(), MASK.tobytes()] if raws is None else raws,
        **kw,
    )


def _text_raw(raw: bytes) -> Any:
    return pb.ModelInferRequest(
        model_name="text_labels", inputs=[_T(name="text", datatype="BYTES", shape=[1, 1])],
        raw_input_contents=[raw],
    )  # fmt: skip


def _param(**kw: Any) -> Any:
    return pb.InferParameter(**kw)


def _out(name: str, **params: Any) -> Any:
    return pb.ModelInferRequest.InferRequestedOutputTensor(name=name, parameters=params)


GRPC_CASES: list[tuple[str, str, Callable[[], Any], grpc.StatusCode, str]] = [
    ("raw-count-mismatch", "ModelInfer", lambda: _int64_raw(raws=[IDS.tobytes()]),
     grpc.StatusCode.INVALID_ARGUMENT, "raw_input_contents holds 1 tensors for 2 inputs"),
    ("raw-size-does-not-match-shape", "ModelInfer",
     lambda: _int64_raw(raws=[IDS.tobytes()[:24], MASK.tobytes()]),
     grpc.StatusCode.INVALID_ARGUMENT, "INT64 [1, 4] takes 32 bytes, the request holds 24"),
    ("wrong-datatype", "ModelInfer",
     lambda: _int64_raw(_ids(datatype="INT32"), _mask(),
                        raws=[IDS.astype(np.int32).tobytes(), MASK.tobytes()]),
     grpc.StatusCode.INVALID_ARGUMENT, "input 'ids': model expects INT64, got INT32"),
    ("shape-over-element-cap", "ModelInfer", lambda: _int64_raw(_ids([1 << 40, 4]), _mask()),
     grpc.StatusCode.INVALID_ARGUMENT, "has more than 16777216 elements"),
    ("bool-not-0-or-1", "ModelInfer",
     lambda: _int64_raw(raws=[IDS.tobytes(), bytes([0, 3, 1, 1])]),
     grpc.StatusCode.INVALID_ARGUMENT, "BOOL bytes must be 0 or 1"),
    ("bytes-length-past-end", "ModelInfer",
     lambda: _text_raw(struct.pack("<I", 100) + b"dog"),
     grpc.StatusCode.INVALID_ARGUMENT, "BYTES element 0 declares 100 bytes; only 3 remain"),
    ("bytes-leftover", "ModelInfer", lambda: _text_raw(struct.pack("<I", 3) + b"dogxx"),
     grpc.StatusCode.INVALID_ARGUMENT, "2 bytes left over after its 1 BYTES elements"),
    ("bytes-not-utf8", "ModelInfer", lambda: _text_raw(struct.pack("<I", 2) + b"\xc3("),
     grpc.StatusCode.INVALID_ARGUMENT, "BYTES element 0 is not UTF-8 text"),
    ("typed-count-mismatch", "ModelInfer",
     lambda: _int64_raw(_ids(contents=pb.InferTensorContents(int64_contents=[1, 2, 3])),
                        _mask(contents=pb.InferTensorContents(bool_contents=[True] * 4)),
                        raws=[]),
     grpc.StatusCode.INVALID_ARGUMENT, "shape [1, 4] needs 4 values, int64_contents holds 3"),
    ("raw-and-typed", "ModelInfer",
     lambda: _int64_raw(_ids(contents=pb.InferTensorContents(int64_contents=[1, 2, 3, 4])),
                        _mask()),
     grpc.StatusCode.INVALID_ARGUMENT, "give raw_input_contents or contents, not both"),
    ("message-over-the-cap", "ModelInfer",
     lambda: pb.ModelInferRequest(model_name="digits", inputs=[
         _T(name="input", datatype="FP32", shape=[8192, 64])],
         raw_input_contents=[bytes(8192 * 64 * 4)]),
     grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max"),
    ("sequence-id", "ModelInfer",
     lambda: _int64_raw(parameters={"sequence_id": _param(int64_param=5)}),
     grpc.StatusCode.UNIMPLEMENTED, "sequence batching (parameter sequence_id)"),
    ("bad-priority", "ModelInfer",
     lambda: _int64_raw(parameters={"priority": _param(string_param="urgent")}),
     grpc.StatusCode.INVALID_ARGUMENT, "parameter priority must be an integer"),
    ("shared-memory-input", "ModelInfer",
     lambda: _int64_raw(_ids(parameters={"shared_memory_region": _param(string_param="r")}),
                        _mask()),
     grpc.StatusCode.UNIMPLEMENTED, "input 'ids': shared memory is not supported"),
    ("unknown-output", "ModelInfer", lambda: _int64_raw(outputs=[_out("zzz")]),
     grpc.StatusCode.INVALID_ARGUMENT, "unknown output(s) ['zzz']"),
    ("classification-out-of-range", "ModelInfer",
     lambda: _int64_raw(outputs=[_out("scores", classification=_param(int64_param=-1))]),
     grpc.StatusCode.INVALID_ARGUMENT, "classification must be 0 to 4096"),
    ("unknown-model", "ModelInfer", lambda: pb.ModelInferRequest(
        model_name="nope", inputs=[_ids()], raw_input_contents=[IDS.tobytes()]),
     grpc.StatusCode.NOT_FOUND, "model 'nope' is not loaded"),
    ("unknown-version", "ModelInfer", lambda: _int64_raw(model_version="9"),
     grpc.StatusCode.NOT_FOUND, "has no loaded version '9'"),
    ("no-inputs", "ModelInfer", lambda: pb.ModelInferRequest(model_name="digits"),
     grpc.StatusCode.INVALID_ARGUMENT, "inputs must hold 1 to 64 tensors"),
    ("system-shared-memory", "SystemSharedMemoryStatus", pb.SystemSharedMemoryStatusRequest,
     grpc.StatusCode.UNIMPLEMENTED, "system shared memory is not supported"),
    ("cuda-shared-memory", "CudaSharedMemoryRegister", pb.CudaSharedMemoryRegisterRequest,
     grpc.StatusCode.UNIMPLEMENTED, "CUDA shared memory is not supported"),
    ("trace", "TraceSetting", pb.TraceSettingRequest,
     grpc.StatusCode.UNIMPLEMENTED, "trace settings is not supported"),
    ("logging", "LogSettings", pb.LogSettingsRequest,
     grpc.StatusCode.UNIMPLEMENTED, "log settings is not supported"),
    ("metadata-of-unknown-model", "ModelMetadata", partial(pb.ModelMetadataRequest, name="x"),
     grpc.StatusCode.NOT_FOUND, "model 'x' is not loaded"),
    ("config-of-unknown-model", "ModelConfig", partial(pb.ModelConfigRequest, name="x"),
     grpc.StatusCode.NOT_FOUND, "model 'x' is not loaded"),
    ("load-config-override", "RepositoryModelLoad",
     lambda: pb.RepositoryModelLoadRequest(
         model_name="digits", parameters={"config": pb.ModelRepositoryParameter(string_param="{}")}),
     grpc.StatusCode.UNIMPLEMENTED, "load parameters (config) are not supported"),
]  # fmt: skip


def _assert_int64_serves_grpc(stub: Any) -> None:
    answer = stub.ModelInfer(_int64_raw(), timeout=30)
    by_name = dict(zip([o.name for o in answer.outputs], answer.raw_output_contents, strict=True))
    scores, total = int64_reference(IDS, MASK.astype(np.bool_))
    assert np.frombuffer(by_name["total"], "<i8").tolist() == total.ravel().tolist()
    np.testing.assert_allclose(np.frombuffer(by_name["scores"], "<f4"), scores.ravel(), rtol=1e-6)


@pytest.mark.parametrize(
    ("rpc", "request_of", "status", "message"),
    [pytest.param(*case[1:], id=case[0]) for case in GRPC_CASES],
)
def test_bad_grpc_request_gets_a_status_naming_the_problem_and_the_server_goes_on(
    stub: Any, rpc: str, request_of: Callable[[], Any], status: grpc.StatusCode, message: str
) -> None:
    with pytest.raises(grpc.RpcError) as e:
        getattr(stub, rpc)(request_of(), timeout=30)
    assert e.value.code() == status, e.value.details()
    assert message in e.value.details(), e.value.details()
    _assert_int64_serves_grpc(stub)
