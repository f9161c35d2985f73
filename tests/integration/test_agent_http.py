"""The agent's local HTTP API end to end: real onnxruntime/TFLite models behind real aiohttp."""

from __future__ import annotations

import asyncio
import base64
import io
import os
import shutil
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from mcp_edge.agent.runtime.batcher import BatchingConfig
from mcp_edge.agent.runtime.loader import load_runner
from mcp_edge.agent.runtime.manager import ModelManager, ModelSource
from mcp_edge.agent.runtime.runner import ModelRunner
from mcp_edge.agent.serving.model_dir import ModelDirectory, ModelDirectoryWatcher
from mcp_edge.shared.bundle import build_bundle, sign_bundle
from mcp_edge.shared.profiles import load_profiles
from mcp_edge.shared.protocol.canary import CanaryPolicy
from mcp_edge.shared.signing import PrivateKey
from mcp_edge.tooling.models import DigitsModels, make_digits_models, onnx_predict
from tests.support.agent_http import AgentClient, serve_manager
from tests.support.runners import DoublingRunner, FailingAfterWarmup

PROFILE = load_profiles()["generic-x86_64"]


def real_factory(source: ModelSource) -> Sequence[ModelRunner]:
    return [load_runner(source.model_path, PROFILE, threads=1)]


def v2_body(x: np.ndarray, name: str = "input") -> dict[str, Any]:
    return {
        "inputs": [
            {"name": name, "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}
        ]
    }


def scores(resp: dict[str, Any]) -> np.ndarray:
    out = resp["outputs"][0]
    return np.asarray(out["data"], dtype=np.float32).reshape(out["shape"])


@pytest.fixture(scope="module")
def other_digits(tmp_path_factory: pytest.TempPathFactory) -> DigitsModels:
    """A second digits model (another seed): same signature, slightly different answers."""
    return make_digits_models(tmp_path_factory.mktemp("other-digits"), seed=1)


@pytest.fixture
async def serve(tmp_path: Path) -> AsyncIterator[Callable[..., Any]]:
    """Start the agent app on a model path; returns (client, manager, model dir, known files)."""
    started: list[tuple[AgentClient, ModelManager]] = []

    async def start(
        model_path: Path,
        *,
        factory: Any = real_factory,
        batching: BatchingConfig | None = None,
        trusted: Sequence[Any] = (),
        max_body: int = 8 * 1024 * 1024,
    ) -> tuple[AgentClient, ModelManager, ModelDirectory, Any]:
        manager = ModelManager(factory, batching=batching or BatchingConfig())
        model_dir = ModelDirectory(
            model_path, state_dir=tmp_path / "state", profile=PROFILE, trusted_keys=trusted
        )
        known = await model_dir.load_all(manager)
        client = await serve_manager(manager, max_body=max_body)
        started.append((client, manager))
        return client, manager, model_dir, known

    yield start
    for client, manager in started:
        await client.close()
        await manager.close()


async def test_digits_answers_match_the_model_over_v2_for_onnx_and_tflite(
    digits: DigitsModels, tmp_path: Path, serve: Any
) -> None:
    models = tmp_path / "models"
    models.mkdir()
    shutil.copy(digits.onnx_path, models / "digits.onnx")
    shutil.copy(digits.tflite_path, models / "digits_lite.tflite")
    client, *_ = await serve(models)
    x = digits.X_test.astype(np.float32)
    for name in ("digits", "digits_lite"):
        resp = await client.post(f"/v2/models/{name}/infer", json={**v2_body(x), "id": "r1"})
        assert resp.status == 200, await resp.text()
        body = await resp.json()
        assert body["model_name"] == name and body["id"] == "r1" and body["model_version"] == "1"
        accuracy = float((scores(body).argmax(1) == digits.y_test).mean())
        assert accuracy == pytest.approx(digits.accuracy, abs=0.01)
    # Row by row over /v2/.../versions/1 gives the same answers as onnxruntime itself.
    expected = onnx_predict(digits.onnx_path, x[:20]).argmax(1)
    for i in range(20):
        resp = await client.post("/v2/models/digits/versions/1/infer", json=v2_body(x[i : i + 1]))
        assert scores(await resp.json()).argmax(1)[0] == expected[i]


def _png(pixels: np.ndarray) -> str:
    img = Image.fromarray(np.clip(pixels * 255.0 / 16.0, 0, 255).round().astype(np.uint8), "L")
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


async def test_v1_infer_with_images_through_a_signed_bundle(
    digits: DigitsModels, tmp_path: Path, serve: Any
) -> None:
    labels = tmp_path / "labels.txt"
    labels.write_text(
        "\n".join(["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"])
    )
    models = tmp_path / "models"
    models.mkdir()
    bundle = models / "digits-2.0.0.mcpb"
    build_bundle(
        digits.onnx_path,
        bundle,
        name="digits",
        version="2.0.0",
        labels_path=labels,
        preprocessing={
            "kind": "image",
            "grayscale": True,
            "size": [8, 8],
            "scale": 1 / 255,
            "layout": "flat",
        },
    )
    key = PrivateKey.generate()
    sign_bundle(bundle, key)
    client, *_ = await serve(models, trusted=[key.public_key])
    pixels = digits.X_test[:40] * 16.0
    resp = await client.post(
        "/v1/infer", json={"images": [_png(p.reshape(8, 8)) for p in pixels], "top_k": 3}
    )
    assert resp.status == 200, await resp.text()
    body = await resp.json()
    assert body["model_version"] == "2.0.0"
    names = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
    top1 = [p[0]["label"] for p in body["predictions"]]
    assert all(len(p) == 3 for p in body["predictions"])
    correct = sum(t == names[y] for t, y in zip(top1, digits.y_test[:40], strict=True))
    assert correct >= 36
    # Numbers work too, and the bundle's scale applies to them (pixels 0..255).
    resp = await client.post(
        "/v1/infer", json={"data": (pixels[0] * 255 / 16).tolist(), "top_k": 1}
    )
    assert (await resp.json())["predictions"][0][0]["label"] == names[digits.y_test[0]]


async def test_unsigned_bundle_refused_when_a_trust_key_is_set(
    digits: DigitsModels, tmp_path: Path, serve: Any
) -> None:
    models = tmp_path / "models"
    models.mkdir()
    build_bundle(digits.onnx_path, models / "digits.mcpb", name="digits", version="1.0.0")
    with pytest.raises(Exception, match="no model could be loaded"):
        await serve(models, trusted=[PrivateKey.generate().public_key])


async def test_hot_swap_under_load_drops_nothing_and_switches_versions(
    digits: DigitsModels, other_digits: DigitsModels, tmp_path: Path, serve: Any
) -> None:
    other = other_digits
    models = tmp_path / "models"
    models.mkdir()
    target = models / "digits.onnx"
    shutil.copy(digits.onnx_path, target)
    client, manager, model_dir, known = await serve(models)
    watcher = ModelDirectoryWatcher(model_dir, manager, known, interval_s=3600)
    x = digits.X_test[:4].astype(np.float32)
    failures: list[str] = []
    versions: list[int] = []
    stop = asyncio.Event()

    async def client_loop() -> None:
        while not stop.is_set():
            resp = await client.post("/v2/models/digits/infer", json=v2_body(x))
            if resp.status != 200:
                failures.append(await resp.text())
            else:
                versions.append(int((await resp.json())["model_version"]))

    clients = [asyncio.create_task(client_loop()) for _ in range(8)]
    await until(lambda: len(versions) >= 5)  # traffic is flowing on version 1
    for i in range(10):
        src = other.onnx_path if i % 2 == 0 else digits.onnx_path
        tmp = models / ".incoming"
        shutil.copy(src, tmp)
        os.replace(tmp, target)
        await watcher.poll()  # sees the change
        await watcher.poll()  # unchanged since: loads it
        assert manager.get("digits").version == str(i + 2)
        n = len(versions)
        await until(lambda n=n: len(versions) >= n + 5)  # traffic runs on the new version
    stop.set()
    await asyncio.gather(*clients)
    await manager.drain_retired()
    assert failures == []
    assert watcher.reloads == 10
    assert set(versions) == set(range(1, 12))  # every version answered, the last one last
    assert versions[-1] == 11
    assert len(manager.slot("digits").versions) == 1  # old versions released after draining


async def test_broken_replacement_keeps_the_old_version_serving(
    digits: DigitsModels, tmp_path: Path, serve: Any
) -> None:
    models = tmp_path / "models"
    models.mkdir()
    target = models / "digits.onnx"
    shutil.copy(digits.onnx_path, target)
    client, manager, model_dir, known = await serve(models)
    watcher = ModelDirectoryWatcher(model_dir, manager, known, interval_s=3600)
    target.write_bytes(b"not an onnx model")
    await watcher.poll()
    await watcher.poll()
    assert manager.get("digits").version == "1"
    resp = await client.post("/v2/models/digits/infer", json=v2_body(digits.X_test[:1]))
    assert resp.status == 200


async def test_canary_that_fails_is_taken_out_and_stable_answers(
    digits: DigitsModels, tmp_path: Path, serve: Any
) -> None:
    models = tmp_path / "models"
    models.mkdir()
    shutil.copy(digits.onnx_path, models / "digits.onnx")

    broken: list[FailingAfterWarmup] = []

    def factory(source: ModelSource) -> Sequence[ModelRunner]:
        runner = load_runner(source.model_path, PROFILE, threads=1)
        if source.version != "9.9.9":
            return [runner]
        broken.append(FailingAfterWarmup(runner))
        return broken

    client, manager, *_ = await serve(models, factory=factory)
    await manager.load(
        ModelSource("digits", "9.9.9", digits.onnx_path),
        role="canary",
        canary=CanaryPolicy(weight=0.5),
    )
    broken[0].armed = True
    x = digits.X_test[:1].astype(np.float32)
    answered = []
    for i in range(120):
        resp = await client.post(
            "/v2/models/digits/infer", json=v2_body(x), headers={"X-Request-Key": f"user-{i}"}
        )
        assert resp.status == 200, await resp.text()
        answered.append((await resp.json())["model_version"])
    assert set(answered) == {"1"}  # every canary failure was answered by stable
    meta = await (await client.get("/v2/models/digits")).json()
    assert meta["parameters"]["canary"]["enabled"] is False
    metrics = await (await client.get("/metrics")).text()
    assert 'mcp_agent_canary_fallbacks_total{model="digits"} 1.0' in metrics
    # X-Model-Version pins a version even when it is out of rotation; its error is reported.
    pinned = await client.post(
        "/v2/models/digits/infer", json=v2_body(x), headers={"X-Model-Version": "9.9.9"}
    )
    assert pinned.status == 500 and "simulated backend fault" in (await pinned.json())["error"]
    pinned = await client.post("/v2/models/digits/versions/1/infer", json=v2_body(x))
    assert (await pinned.json())["model_version"] == "1"


async def test_sticky_canary_routing_and_shadow_agreement(
    digits: DigitsModels, other_digits: DigitsModels, tmp_path: Path, serve: Any
) -> None:
    other = other_digits
    models = tmp_path / "models"
    models.mkdir()
    shutil.copy(digits.onnx_path, models / "digits.onnx")
    client, manager, *_ = await serve(models)
    await manager.load(
        ModelSource("digits", "2", other.onnx_path), role="canary", canary=CanaryPolicy(weight=0.5)
    )
    x = digits.X_test[:1].astype(np.float32)
    seen: dict[str, set[str]] = {}
    for i in range(40):
        key = f"user-{i % 8}"
        resp = await client.post(
            "/v2/models/digits/infer", json=v2_body(x), headers={"X-Request-Key": key}
        )
        seen.setdefault(key, set()).add((await resp.json())["model_version"])
    assert all(len(v) == 1 for v in seen.values())  # sticky per key
    assert {next(iter(v)) for v in seen.values()} == {"1", "2"}  # both get traffic

    await manager.unload("digits", "2")
    await manager.load(ModelSource("digits", "3", other.onnx_path), role="shadow")
    xs = digits.X_test[:60].astype(np.float32)
    for i in range(60):
        resp = await client.post("/v2/models/digits/infer", json=v2_body(xs[i : i + 1]))
        assert (await resp.json())["model_version"] == "1"  # only stable answers
    await manager.wait_for_shadows()
    shadow = (await (await client.get("/v2/models/digits")).json())["parameters"]["shadow"]
    assert shadow["compared"] == 60
    assert 0.8 <= shadow["agreement"] < 1.0 or shadow["agreement"] == 1.0
    metrics = await (await client.get("/metrics")).text()
    assert 'mcp_agent_shadow_agreement_ratio{model="digits",version="3"}' in metrics


async def test_overload_gets_429_and_deadline_gets_504(tmp_path: Path, serve: Any) -> None:
    model = tmp_path / "models" / "fake.onnx"
    model.parent.mkdir()
    model.write_bytes(b"placeholder: the fake factory does not read it")
    runner = DoublingRunner()
    client, manager, *_ = await serve(
        model.parent,
        factory=lambda s: [runner],
        batching=BatchingConfig(max_batch_size=1, max_queue=4, inline_below_s=0),
    )
    runner.gate.clear()
    runner.entered.clear()
    body = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}
    batcher = manager.get("fake").batcher
    post = lambda: asyncio.create_task(client.post("/v2/models/fake/infer", json=body))  # noqa: E731
    accepted = [post()]
    await asyncio.to_thread(runner.entered.wait, 10)  # one request holds the only instance
    for depth in range(1, 5):
        accepted.append(post())
        await until(lambda d=depth: batcher.queue_depth == d)
    flood = [post() for _ in range(30)]
    rejected = await asyncio.gather(*flood)
    assert {r.status for r in rejected} == {429}
    assert all(int(r.headers["Retry-After"]) >= 1 for r in rejected)
    assert (await rejected[0].json())["code"] == "overloaded"
    runner.gate.set()
    assert [r.status for r in await asyncio.gather(*accepted)] == [200] * 5
    # A request that waits past its deadline gets 504.
    runner.gate.clear()
    blocked = asyncio.create_task(client.post("/v2/models/fake/infer", json=body))
    timed = await client.post("/v2/models/fake/infer", json=body, headers={"X-Timeout-Ms": "30"})
    assert timed.status == 504 and (await timed.json())["code"] == "timeout"
    runner.gate.set()
    assert (await blocked).status == 200
    metrics = await (await client.get("/metrics")).text()
    assert 'mcp_agent_rejections_total{model="fake",reason="overloaded"}' in metrics


@pytest.mark.parametrize(
    ("path", "payload", "headers", "status", "reason"),
    [
        ("/v2/models/digits/infer", b"{not json", {}, 400, "not valid JSON"),
        ("/v2/models/digits/infer", b'{"inputs": "x"}', {}, 400, "inputs"),
        (
            "/v2/models/digits/infer",
            b'{"inputs":[{"name":"input","shape":[1,63],"datatype":"FP32","data":[0]}]}',
            {},
            400,
            "does not fit",
        ),
        (
            "/v2/models/digits/infer",
            b'{"inputs":[{"name":"input","shape":[1,64],"datatype":"INT64","data":[0]}]}',
            {},
            400,
            "expects FP32",
        ),
        (
            "/v2/models/digits/infer",
            b'{"inputs":[{"name":"input","shape":[1,64],"datatype":"FP32","data":[0,1]}]}',
            {},
            400,
            "needs 64 values",
        ),
        (
            "/v2/models/digits/infer",
            b'{"inputs":[{"name":"pixels","shape":[1,64],"datatype":"FP32","data":[0]}]}',
            {},
            400,
            "unknown input",
        ),
        (
            "/v2/models/nope/infer",
            b'{"inputs":[{"name":"input","shape":[1,64],"datatype":"FP32","data":[0]}]}',
            {},
            404,
            "not loaded",
        ),
        (
            "/v2/models/digits/versions/7/infer",
            b'{"inputs":[{"name":"input","shape":[1,64],"datatype":"FP32","data":[0]}]}',
            {},
            404,
            "no loaded version",
        ),
        ("/v2/models/digits/infer", b"[" + b"0," * 700_000 + b"0]", {}, 413, "too large"),
        (
            "/v2/models/digits/infer",
            b'{"inputs":[{"name":"input","shape":[1,64],"datatype":"FP32","data":[0]}]}',
            {"X-Priority": "urgent"},
            400,
            "priority",
        ),
        (
            "/v2/models/digits/infer",
            b'{"inputs":[{"name":"input","shape":[1,64],"datatype":"FP32","data":[0]}]}',
            {"X-Timeout-Ms": "soon"},
            400,
            "X-Timeout-Ms must be a number",
        ),
        (
            "/v2/models/digits/infer",
            b'{"inputs":[{"name":"input","shape":[1,64],"datatype":"FP32","data":[0]}]}',
            {"X-Timeout-Ms": "0"},
            400,
            "X-Timeout-Ms must be in (0, 3600000]",
        ),
        # Options are read before the model is looked up, as over MQTT: the bad option is named.
        (
            "/v2/models/nope/infer",
            b'{"inputs":[{"name":"input","shape":[1,64],"datatype":"FP32","data":[0]}]}',
            {"X-Priority": "urgent"},
            400,
            "priority",
        ),
        (
            "/v1/infer",
            b'{"model": "nope", "data": [1]}',
            {"X-Timeout-Ms": "nan"},
            400,
            "X-Timeout-Ms must be in",
        ),
        ("/v1/infer", b'{"image": "%%%"}', {}, 400, "image preprocessing"),
        ("/v1/infer", b'{"data": [1, 2]}', {}, 400, "64 values"),
        ("/v1/infer", b'{"data": [[1], [1, 2]]}', {}, 400, "regular array"),
    ],
)
async def test_bad_requests_get_4xx_with_a_reason(
    digits: DigitsModels,
    tmp_path: Path,
    serve: Any,
    path: str,
    payload: bytes,
    headers: dict[str, str],
    status: int,
    reason: str,
) -> None:
    client, *_ = await serve(_single(tmp_path, digits), max_body=1024 * 1024)
    resp = await client.post(
        path, data=payload, headers={"Content-Type": "application/json", **headers}
    )
    assert resp.status == status
    body = await resp.json()
    assert reason in body["error"], body
    # The server keeps serving after a bad request.
    ok = await client.post("/v2/models/digits/infer", json=v2_body(digits.X_test[:1]))
    assert ok.status == 200


async def test_a_chunked_body_over_the_limit_is_413(
    digits: DigitsModels, tmp_path: Path, serve: Any
) -> None:
    # No Content-Length: aiohttp itself stops reading at the limit; the answer is still ours.
    client, *_ = await serve(_single(tmp_path, digits), max_body=1024 * 1024)

    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(20):
            yield b" " * 65536

    resp = await client.post(
        "/v2/models/digits/infer", data=chunks(), headers={"Content-Type": "application/json"}
    )
    assert resp.status == 413
    assert await resp.json() == {
        "error": "request body too large: over 1048576 bytes",
        "code": "too_large",
    }


async def test_an_empty_version_header_pins_nothing(
    digits: DigitsModels, tmp_path: Path, serve: Any
) -> None:
    # As an empty model-version user property over MQTT: the request is routed, not refused.
    client, *_ = await serve(_single(tmp_path, digits))
    resp = await client.post(
        "/v2/models/digits/infer",
        json=v2_body(digits.X_test[:1]),
        headers={"X-Model-Version": "", "X-Request-Key": ""},
    )
    assert resp.status == 200, await resp.text()
    assert (await resp.json())["model_version"] == "1"


async def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Wait for ``condition`` to hold (polling the event loop), failing after ``timeout_s``."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.002)


def _single(tmp_path: Path, digits: DigitsModels) -> Path:
    d = tmp_path / "single"
    d.mkdir(exist_ok=True)
    shutil.copy(digits.onnx_path, d / "digits.onnx")
    return d


async def test_health_metadata_and_metrics(
    digits: DigitsModels, tmp_path: Path, serve: Any
) -> None:
    client, *_ = await serve(_single(tmp_path, digits))
    assert (await (await client.get("/v2")).json())["name"] == "mcp-edge-agent"
    for path in (
        "/v2/health/live",
        "/v2/health/ready",
        "/healthz",
        "/readyz",
        "/v2/models/digits/ready",
        "/v2/models/digits/versions/1/ready",
    ):
        assert (await client.get(path)).status == 200, path
    assert (await client.get("/v2/models/other/ready")).status == 404
    meta = await (await client.get("/v2/models/digits/versions/1")).json()
    assert meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 64]}]
    assert meta["platform"] == "onnxruntime_onnx"
    await client.post("/v2/models/digits/infer", json=v2_body(digits.X_test[:3]))
    text = await (await client.get("/metrics")).text()
    families = {
        line.split()[2] for line in text.splitlines() if line.startswith("# TYPE mcp_agent_")
    }
    assert len(families) >= 18, sorted(families)
    assert (
        'mcp_agent_model_info{backend="onnxruntime",model="digits",provider="CPUExecutionProvider",role="stable",version="1"} 1.0'
        in text
    )
    assert 'mcp_agent_requests_total{code="200",model="digits",protocol="v2"} 1.0' in text
