"""OpenTelemetry traces from real processes, received by an OTLP/HTTP receiver in the test.

- ``mcp-agent serve --otlp-endpoint``: an HTTP and a gRPC inference request that carry a W3C
  ``traceparent`` each become a server span in the caller's trace (child of the caller's span)
  with the model, the version that answered and the status; a request for an unknown model is
  a span marked as an error; without the option nothing is sent.
- A deployment: ``mcp-controlplane serve`` and an enrolled ``mcp-agent run``, both with
  ``MCP_OTLP_ENDPOINT``; ``mcp-controlplane deploy`` is a span ``deploy digits 1.0.0``, and the
  device's ``deployment digits 1.0.0`` span is its child in the same trace, with one child
  span per phase of the update state machine, ending when the version is active.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import subprocess
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from mcp_edge.tooling.models import DigitsModels
from mcp_edge.tooling.mosquitto import DynsecMosquittoBroker
from mcp_edge.tooling.processes import (
    AGENT,
    BUNDLE,
    CONTROLPLANE,
    REPO,
    free_port,
    init_control_plane,
    process_env,
    serve_control_plane,
    stopped_at_exit,
    wait_until,
)

pytestmark = pytest.mark.timeout(240)


@dataclass
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, Any]
    error: bool


@dataclass
class OtlpReceiver:
    """An OTLP/HTTP trace receiver (``POST /v1/traces``, protobuf) on a thread of its own."""

    port: int = 0
    spans: list[Span] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def find(self, **want: Any) -> list[Span]:
        with self._lock:
            return [s for s in self.spans if all(getattr(s, k) == v for k, v in want.items())]

    async def traces(self, request: web.Request) -> web.Response:
        message = trace_service_pb2.ExportTraceServiceRequest.FromString(await request.read())
        found = []
        for rs in message.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    found.append(
                        Span(
                            service=str(resource.get("service.name")),
                            name=s.name,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_id=s.parent_span_id.hex(),
                            attributes={a.key: _value(a.value) for a in s.attributes},
                            error=s.status.code == 2,  # STATUS_CODE_ERROR
                        )
                    )
        with self._lock:
            self.spans.extend(found)
        body = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
        return web.Response(body=body, content_type="application/x-protobuf")


def _value(v: Any) -> Any:
    which = v.WhichOneof("value")
    return getattr(v, which) if which else None


@contextlib.contextmanager
def running_receiver() -> Iterator[OtlpReceiver]:
    """An :class:`OtlpReceiver` listening on a free port until the block ends."""
    receiver = OtlpReceiver()
    loop = asyncio.new_event_loop()
    runners: list[web.AppRunner] = []

    async def start() -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/traces", receiver.traces)
        runner = web.AppRunner(app)
        await runner.setup()
        receiver.port = free_port()
        await web.TCPSite(runner, "127.0.0.1", receiver.port).start()
        runners.append(runner)

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    try:
        yield receiver
    finally:
        asyncio.run_coroutine_threadsafe(runners[0].cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with running_receiver() as r:
        yield r


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[str]]]:
    with stopped_at_exit() as procs:
        yield procs


def _traceparent() -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def _post(url: str, body: bytes, headers: dict[str, str]) -> int:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json",
                                                          **headers})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


def _body(x: np.ndarray) -> bytes:
    tensor = {"name": "input", "shape": list(x.shape), "datatype": "FP32",
              "data": x.ravel().tolist()}  # fmt: skip
    return json.dumps({"inputs": [tensor]}).encode()


def test_inference_requests_continue_the_callers_trace_over_http_and_grpc(
    receiver: OtlpReceiver, digits: DigitsModels, tmp_path: Path,
    processes: list[subprocess.Popen[str]],
) -> None:  # fmt: skip
    port, grpc_port = free_port(), free_port()
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen(
        [*AGENT, "serve", "--model-path", str(digits.onnx_path), "--port", str(port),
         "--grpc-port", str(grpc_port), "--state-dir", str(tmp_path / "state"),
         "--otlp-endpoint", receiver.url],
        stdout=subprocess.DEVNULL, stderr=log, text=True, cwd=REPO, env=process_env(),
    )  # fmt: skip
    processes.append(proc)
    base = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        try:
            with urllib.request.urlopen(f"{base}/v2/health/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    wait_until(ready, "the agent serving", 60)
    x = digits.X_test[:2].astype(np.float32)
    http_parent, http_trace, http_span = _traceparent()
    status = _post(f"{base}/v2/models/digits/infer", _body(x), {"traceparent": http_parent})
    assert status == 200
    missing_parent, missing_trace, _ = _traceparent()
    assert _post(f"{base}/v2/models/nope/infer", _body(x), {"traceparent": missing_parent}) == 404

    grpc_parent, grpc_trace, grpc_span = _traceparent()
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        req = pb.ModelInferRequest(
            model_name="digits",
            inputs=[
                pb.ModelInferRequest.InferInputTensor(
                    name="input", datatype="FP32", shape=list(x.shape)
                )
            ],
            raw_input_contents=[x.tobytes()],
        )
        answer = stub.ModelInfer(req, timeout=10, metadata=(("traceparent", grpc_parent),))
        assert answer.model_version == "1"

    wait_until(lambda: receiver.find(trace_id=http_trace) and receiver.find(trace_id=grpc_trace)
               and receiver.find(trace_id=missing_trace), "the three spans exported", 30)  # fmt: skip
    [h] = receiver.find(trace_id=http_trace)
    assert (h.service, h.name, h.parent_id) == ("mcp-agent", "POST /v2/models/{model}/infer",
                                                http_span)  # fmt: skip
    assert h.attributes["mcp.model"] == "digits" and h.attributes["mcp.version"] == "1"
    assert h.attributes["http.response.status_code"] == 200 and not h.error
    [g] = receiver.find(trace_id=grpc_trace)
    assert (g.name, g.parent_id) == ("inference.GRPCInferenceService/ModelInfer", grpc_span)
    assert g.attributes["mcp.version"] == "1" and g.attributes["rpc.grpc.status_code"] == 0
    [m] = receiver.find(trace_id=missing_trace)
    assert m.error and m.attributes["http.response.status_code"] == 404


def test_a_deployment_is_one_trace_from_the_deploy_call_to_the_active_device(
    receiver: OtlpReceiver, fresh_dynsec_broker: DynsecMosquittoBroker, digits: DigitsModels,
    tmp_path: Path, processes: list[subprocess.Popen[str]],
) -> None:  # fmt: skip
    env = {**process_env(), "MCP_OTLP_ENDPOINT": receiver.url}

    def sh(*args: Any) -> str:
        done = subprocess.run([str(a) for a in args], capture_output=True, text=True,
                              timeout=120, cwd=REPO, env=env)  # fmt: skip
        assert done.returncode == 0, f"{args[2:5]}: {done.stdout}\n{done.stderr}"
        return done.stdout

    data = tmp_path / "cp"
    api = init_control_plane(data, fresh_dynsec_broker, env=env)
    _, cp_url = serve_control_plane(data, processes, env=env)
    auth = ("--server", cp_url, "--token", api)
    key = tmp_path / "publisher.key"
    sh(*BUNDLE, "keygen", "--out", key)
    sh(*CONTROLPLANE, "publishers", "add", key, "--name", "ml", *auth)
    bundle = tmp_path / "digits-1.0.0.mcpb"
    sh(*BUNDLE, "build", digits.onnx_path, "--name", "digits", "--version", "1.0.0", "-o", bundle)
    sh(*BUNDLE, "sign", bundle, "--key", key)
    sh(*BUNDLE, "push", bundle, *auth)
    token = sh(*CONTROLPLANE, "tokens", "create", "--uses", "1", "--expires", "1h", *auth)
    state = tmp_path / "agent"
    sh(*AGENT, "enroll", "--server", cp_url, "--token", token.strip().splitlines()[-1],
       "--device-id", "cam-t", "--state-dir", state)  # fmt: skip
    port = free_port()
    log = (tmp_path / "agent.log").open("w")
    processes.append(subprocess.Popen(
        [*AGENT, "run", "--port", str(port), "--state-dir", str(state)],
        stdout=subprocess.DEVNULL, stderr=log, text=True, cwd=REPO, env=env,
    ))  # fmt: skip

    def online() -> bool:
        req = urllib.request.Request(f"{cp_url}/api/v1/devices",
                                     headers={"Authorization": f"Bearer {api}"})  # fmt: skip
        with urllib.request.urlopen(req, timeout=10) as r:
            return bool(json.loads(r.read())["items"][0].get("online"))

    wait_until(online, "cam-t online", 90)
    sh(*CONTROLPLANE, "deploy", "digits", "1.0.0", "--device", "cam-t", *auth)

    def deployed() -> list[Span]:
        return [s for s in receiver.find(service="mcp-agent", name="deployment digits 1.0.0")
                if s.attributes.get("mcp.outcome") == "active"]  # fmt: skip

    def deploy_spans() -> list[Span]:
        return receiver.find(service="mcp-controlplane", name="deploy digits 1.0.0")

    wait_until(deployed, "the device's deployment span, ended active", 120)
    # Each process exports on its own schedule: the device's span may come first.
    wait_until(deploy_spans, "the control plane's deploy span", 60)
    [device] = deployed()
    [deploy] = deploy_spans()
    assert device.trace_id == deploy.trace_id and device.parent_id == deploy.span_id
    assert deploy.attributes["mcp.devices"] == 1 and not deploy.error
    assert device.attributes["mcp.device"] == "cam-t" and device.attributes["mcp.role"] == "stable"
    phases = {s.name for s in receiver.find(trace_id=deploy.trace_id, parent_id=device.span_id)}
    assert {"downloading", "verifying", "installing", "loading"} <= phases, phases
