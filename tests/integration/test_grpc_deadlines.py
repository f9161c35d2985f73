"""A gRPC client's deadline is the request's deadline on the agent.

The model is gated shut (a fake of our own runner interface), so a request can only end by
its deadline. A client that gives 0.3 s gets DEADLINE_EXCEEDED, and the agent counts a
timeout rejection for the model within a few seconds: it gave up on the request when the
client did, not after its own 30-second default. A request whose ``timeout`` parameter is
shorter than the client's deadline is cut at the parameter.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from mcp_edge.agent.runtime.batcher import BatchingConfig
from mcp_edge.agent.runtime.manager import ModelManager, ModelSource
from mcp_edge.agent.serving.grpc_api import GrpcServer
from mcp_edge.agent.serving.service import FrontDoor
from tests.support.runners import DoublingRunner

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def gated(tmp_path: Path) -> AsyncIterator[tuple[str, ModelManager, DoublingRunner]]:
    runner = DoublingRunner()
    manager = ModelManager(
        lambda source: [runner],
        # Off the event loop, so a gated run holds a thread and not the server.
        batching=BatchingConfig(inline_below_s=0.0, default_timeout_s=30.0),
    )
    model_file = tmp_path / "dbl.onnx"  # the fake runner reads nothing; the manager stats it
    model_file.write_bytes(b"fake")
    await manager.load(ModelSource("dbl", "1", model_file))
    server = GrpcServer(FrontDoor(manager), "127.0.0.1", 0, max_message=1 << 20)
    port = await server.start()
    runner.gate.clear()
    try:
        yield f"127.0.0.1:{port}", manager, runner
    finally:
        runner.gate.set()
        await server.stop(1.0)
        await manager.close()


def _request(**params: int) -> pb.ModelInferRequest:
    x = np.ones((1, 4), np.float32)
    req = pb.ModelInferRequest(
        model_name="dbl",
        inputs=[pb.ModelInferRequest.InferInputTensor(name="x", datatype="FP32", shape=[1, 4])],
        raw_input_contents=[x.tobytes()],
    )
    for key, value in params.items():
        req.parameters[key].int64_param = value
    return req


async def _timeouts(manager: ModelManager) -> float:
    text = manager.metrics.exposition().decode()
    for line in text.splitlines():
        if line.startswith("mcp_agent_rejections_total{") and 'reason="timeout"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def _until_timeouts(manager: ModelManager, want: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5.0  # far below the 30 s default: only the deadline explains it
    while await _timeouts(manager) < want:
        assert loop.time() < deadline, "the agent did not give up on the request"
        await asyncio.sleep(0.02)


async def test_the_client_deadline_ends_the_request_on_the_agent(
    gated: tuple[str, ModelManager, DoublingRunner],
) -> None:
    address, manager, runner = gated
    async with grpc.aio.insecure_channel(address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.ModelInfer(_request(), timeout=0.3)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await _until_timeouts(manager, 1.0)
        # The server keeps serving once the model is free again.
        runner.gate.set()
        answer = await stub.ModelInfer(_request(), timeout=10)
        got = np.frombuffer(answer.raw_output_contents[0], np.float32)
        np.testing.assert_array_equal(got, np.full(4, 2.0, np.float32))


async def test_a_shorter_timeout_parameter_wins_over_the_deadline(
    gated: tuple[str, ModelManager, DoublingRunner],
) -> None:
    address, manager, _ = gated
    async with grpc.aio.insecure_channel(address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.ModelInfer(_request(timeout=200_000), timeout=20)  # 0.2 s in µs
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "timed out" in (e.value.details() or "")
        assert await _timeouts(manager) == 1.0
