"""The Open Inference Protocol over gRPC: ``inference.GRPCInferenceService`` on grpc.aio.

The service definition is the one Triton's own clients are generated from
(``tritonclient.grpc.service_pb2`` / ``service_pb2_grpc``), so ``tritonclient.grpc`` (sync and
asyncio), KServe's gRPC clients and tools built on them talk to an agent unchanged. Answered:
ServerLive, ServerReady, ModelReady, ServerMetadata, ModelMetadata, ModelInfer (tensors in
``raw_input_contents`` or in typed ``contents``; answers in ``raw_output_contents``, as Triton
sends them), ModelStreamInfer (answers in completion order, each with its request's ``id``;
a failed request is an ``error_message`` on the stream, which stays open), ModelConfig,
ModelStatistics, RepositoryIndex and RepositoryModelLoad/Unload (explicit model control).
Shared memory, trace and log settings answer UNIMPLEMENTED.

Requests take the same path as HTTP ones (:mod:`.requests`, :mod:`.oip`): routing with canary
and ``model_version`` pinning, batching, the request's ``priority`` and ``timeout``
parameters, the client's deadline as the request's timeout, the same statistics and metrics
(``protocol="grpc"``). Metadata keys ``x-model-version``, ``x-request-key``, ``x-priority`` and
``x-timeout-ms`` are the HTTP headers' counterparts. Errors carry the HTTP API's message with
the status code that matches its error code (:data:`GRPC_STATUS`). Messages over the body cap
are refused by gRPC itself with RESOURCE_EXHAUSTED before they are read.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any, NoReturn

# The serving processes are started with fork+exec (never a bare fork): gRPC's fork handlers
# are not needed, and with them every start of a worker logs a line about skipping them.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")

import grpc
import numpy as np
from google.protobuf import json_format
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from mcp_edge.agent.runtime.manager import LoadedVersion, ModelManager, ModelNotFoundError
from mcp_edge.agent.runtime.runner import Array, InputError, TensorSpec
from mcp_edge.agent.serving.binary_tensors import array_from_raw, bytes_as_text, raw_from_array
from mcp_edge.agent.serving.model_control import check_parameters
from mcp_edge.agent.serving.oip import (
    Call,
    OutputRequest,
    answer_tensors,
    check_input,
    not_implemented,
    request_parameters,
    rows_of,
)
from mcp_edge.agent.serving.requests import (
    OptionNames,
    RequestError,
    SuccessCounter,
    classify,
    count_failure,
    parse_options,
)
from mcp_edge.agent.serving.service import FrontDoor
from mcp_edge.shared.errors import MessageError
from mcp_edge.shared.protocol.wire import MAX_INFER_RESPONSE_BYTES, Datatype, ErrorCode

log = logging.getLogger("mcp.agent.grpc")

GRPC_METADATA = OptionNames("x-model-version", "x-request-key", "x-priority", "x-timeout-ms")
GRPC_STATUS: dict[ErrorCode, grpc.StatusCode] = {
    ErrorCode.BAD_REQUEST: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.UNAUTHORIZED: grpc.StatusCode.UNAUTHENTICATED,
    ErrorCode.FORBIDDEN: grpc.StatusCode.PERMISSION_DENIED,
    ErrorCode.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorCode.CONFLICT: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorCode.TOO_LARGE: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorCode.UNSUPPORTED: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.OVERLOADED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorCode.TIMEOUT: grpc.StatusCode.DEADLINE_EXCEEDED,
    ErrorCode.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorCode.INTERNAL: grpc.StatusCode.INTERNAL,
    ErrorCode.NOT_IMPLEMENTED: grpc.StatusCode.UNIMPLEMENTED,
}
"""The gRPC status of each error code (the HTTP status of the same failure, translated)."""

STREAM_IN_FLIGHT = 64
"""Requests of one ModelStreamInfer stream run at once (more wait for one to finish)."""

# The typed contents field of each datatype (FP16 has none: it travels raw only).
_CONTENTS = {
    Datatype.BOOL: "bool_contents",
    Datatype.INT8: "int_contents",
    Datatype.INT16: "int_contents",
    Datatype.INT32: "int_contents",
    Datatype.INT64: "int64_contents",
    Datatype.UINT8: "uint_contents",
    Datatype.UINT16: "uint_contents",
    Datatype.UINT32: "uint_contents",
    Datatype.UINT64: "uint64_contents",
    Datatype.FP32: "fp32_contents",
    Datatype.FP64: "fp64_contents",
    Datatype.BYTES: "bytes_contents",
}


def _param_value(p: Any) -> Any:
    which = p.WhichOneof("parameter_choice")
    return None if which is None else getattr(p, which)


def _typed_contents(name: str, dt: Datatype, shape: list[int], contents: Any) -> Array:
    field = _CONTENTS.get(dt)
    if field is None:
        raise MessageError(f"input {name!r}: {dt.value} has no typed contents; send it raw")
    values = getattr(contents, field)
    count = int(np.prod(shape)) if shape else 1
    if len(values) != count:
        raise MessageError(
            f"input {name!r}: shape {shape} needs {count} values, {field} holds {len(values)}"
        )
    if dt is Datatype.BYTES:
        arr = np.empty(count, dtype=object)
        arr[:] = list(values)
        return bytes_as_text(name, arr.reshape(shape))
    target = dt.numpy_dtype
    wide = np.array(values, dtype=np.float64 if target.kind == "f" else np.int64 if
                    target.kind in "ib" else np.uint64)  # fmt: skip
    if target.kind in "iu" and wide.size:
        info = np.iinfo(target)
        if wide.min() < info.min or wide.max() > info.max:
            raise MessageError(f"input {name!r}: values out of range for {dt.value}")
    return wide.astype(target).reshape(shape)


_BY_NAME: dict[int, tuple[tuple[TensorSpec, ...], dict[str, TensorSpec]]] = {}


def _by_name(specs: tuple[TensorSpec, ...]) -> dict[str, TensorSpec]:
    """The model's inputs by name (once per signature: this is every request's path)."""
    cached = _BY_NAME.get(id(specs))
    if cached is not None and cached[0] is specs:
        return cached[1]
    found = {s.name: s for s in specs}
    if len(_BY_NAME) > 256:
        _BY_NAME.clear()
    _BY_NAME[id(specs)] = (specs, found)
    return found


def decode_grpc_request(request: Any, specs: tuple[TensorSpec, ...]) -> Call:
    """A ``ModelInferRequest`` as a :class:`~.oip.Call`; raises MessageError, InputError or
    RequestError with the HTTP path's messages."""
    inputs = request.inputs
    raws = request.raw_input_contents
    if not 0 < len(inputs) <= 64:
        raise MessageError("inputs must hold 1 to 64 tensors")
    if raws and len(raws) != len(inputs):
        raise MessageError(
            f"raw_input_contents holds {len(raws)} tensors for {len(inputs)} inputs: give "
            "every input raw, or none"
        )
    priority = timeout_s = None
    if request.parameters:
        params = {k: _param_value(v) for k, v in request.parameters.items()}
        _, priority, timeout_s = request_parameters(params)
    by_name = _by_name(specs)
    feeds: dict[str, Array] = {}
    for i, t in enumerate(inputs):
        if t.parameters and "shared_memory_region" in t.parameters:
            raise not_implemented(f"input {t.name!r}: shared memory")
        name, dt, shape = check_input(t.name, t.datatype, list(t.shape), by_name, feeds)
        if raws:
            if t.HasField("contents"):
                raise MessageError(f"input {name!r}: give raw_input_contents or contents, not both")
            arr = array_from_raw(name, dt, shape, memoryview(raws[i]))
            feeds[name] = bytes_as_text(name, arr) if dt is Datatype.BYTES else arr
        else:
            feeds[name] = _typed_contents(name, dt, shape, t.contents)
    missing = by_name.keys() - feeds.keys()
    if missing:
        raise InputError(f"missing input(s) {sorted(missing)}")
    outputs: tuple[OutputRequest, ...] | None = None
    if request.outputs:
        wanted = []
        for o in request.outputs:
            if "shared_memory_region" in o.parameters:
                raise not_implemented(f"output {o.name!r}: shared memory")
            count = 0
            if "classification" in o.parameters:
                value = _param_value(o.parameters["classification"])
                if type(value) is not int or not 0 <= value <= 4096:
                    raise MessageError(f"output {o.name!r}: classification must be 0 to 4096")
                count = value
            wanted.append(OutputRequest(o.name, True, count))
        outputs = tuple(wanted)
    return Call(request.id or None, feeds, outputs, True, priority, timeout_s)


def encode_grpc_response(
    lv: LoadedVersion, request_id: str | None, tensors: Sequence[tuple[str, Array, bool]]
) -> Any:
    """A ``ModelInferResponse`` holding ``tensors`` in ``raw_output_contents``. Raises
    RequestError (too_large) for tensors over :data:`MAX_INFER_RESPONSE_BYTES`."""
    outs = []
    raws = []
    size = 0
    for name, arr, _ in tensors:
        datatype = _DATATYPES.get(arr.dtype)
        if datatype is None:
            datatype = _DATATYPES[arr.dtype] = Datatype.from_numpy(arr.dtype).value
        outs.append(_OUTPUT(name=name, datatype=datatype, shape=arr.shape))
        raw = bytes(raw_from_array(arr))
        size += len(raw)
        raws.append(raw)
    if size > MAX_INFER_RESPONSE_BYTES:
        raise RequestError(
            ErrorCode.TOO_LARGE,
            f"the answer's tensors are {size} bytes, over the {MAX_INFER_RESPONSE_BYTES}-byte "
            "limit; ask for fewer rows or outputs",
        )
    return pb.ModelInferResponse(
        model_name=lv.name,
        model_version=lv.version,
        id=request_id or "",
        outputs=outs,
        raw_output_contents=raws,
    )


_OUTPUT = pb.ModelInferResponse.InferOutputTensor
_DATATYPES: dict[Any, str] = {}


class GrpcError(Exception):
    """An RPC to end with ``status`` and ``details``."""

    def __init__(self, status: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.status = status


class InferenceServicer(service_pb2_grpc.GRPCInferenceServiceServicer):  # type: ignore[misc]
    """``inference.GRPCInferenceService`` over one server's :class:`FrontDoor`."""

    def __init__(self, front: FrontDoor) -> None:
        self.front = front
        self.tracing = front.tracing
        self.manager: ModelManager = front.manager
        self.metrics = front.manager.metrics
        self._payload = self.metrics.payload_bytes.labels("grpc")
        self._active = 0
        self._ok = SuccessCounter(front.manager)

    # ----------------------------------------------------------------- health, metadata
    async def ServerLive(self, request: Any, context: Any) -> Any:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any, context: Any) -> Any:
        return pb.ServerReadyResponse(ready=self.manager.ready)

    async def ModelReady(self, request: Any, context: Any) -> Any:
        try:
            self.manager.get(request.name, request.version or None)
        except ModelNotFoundError:
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=True)

    async def ServerMetadata(self, request: Any, context: Any) -> Any:
        doc = self.front.server_metadata()
        return pb.ServerMetadataResponse(
            name=doc["name"], version=doc["version"], extensions=doc["extensions"]
        )

    async def ModelMetadata(self, request: Any, context: Any) -> Any:
        try:
            doc = self.front.model_metadata(request.name, request.version or None)
        except ModelNotFoundError as e:
            await _abort(context, RequestError(ErrorCode.NOT_FOUND, str(e)))
        meta = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name=doc["name"],
            versions=doc["versions"],
            platform=doc["platform"],
            inputs=[meta(**t) for t in doc["inputs"]],
            outputs=[meta(**t) for t in doc["outputs"]],
        )

    async def ModelConfig(self, request: Any, context: Any) -> Any:
        try:
            config = self.front.model_config(request.name, request.version or None)
        except ModelNotFoundError as e:
            await _abort(context, RequestError(ErrorCode.NOT_FOUND, str(e)))
        return json_format.ParseDict({"config": config}, pb.ModelConfigResponse())

    async def ModelStatistics(self, request: Any, context: Any) -> Any:
        try:
            doc = await self.front.statistics(request.name or None, request.version or None)
        except ModelNotFoundError as e:
            await _abort(context, RequestError(ErrorCode.NOT_FOUND, str(e)))
        return json_format.ParseDict(doc, pb.ModelStatisticsResponse())

    # ----------------------------------------------------------------- repository
    async def RepositoryIndex(self, request: Any, context: Any) -> Any:
        entries = await self.front.index(bool(request.ready))
        index = pb.RepositoryIndexResponse.ModelIndex
        return pb.RepositoryIndexResponse(models=[index(**e) for e in entries])

    async def RepositoryModelLoad(self, request: Any, context: Any) -> Any:
        await self._control(context, "load", request)
        return pb.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(self, request: Any, context: Any) -> Any:
        await self._control(context, "unload", request)
        return pb.RepositoryModelUnloadResponse()

    async def _control(self, context: Any, action: str, request: Any) -> None:
        try:
            params = {k: _param_value(v) for k, v in request.parameters.items()}
            check_parameters(action, params)
            name = request.model_name
            await (self.front.load(name) if action == "load" else self.front.unload(name))
        except RequestError as e:
            await _abort(context, e)

    # ----------------------------------------------------------------- not offered
    async def _not_offered(self, context: Any, what: str) -> NoReturn:
        await _abort(context, not_implemented(what))

    async def SystemSharedMemoryStatus(self, request: Any, context: Any) -> Any:
        await self._not_offered(context, "system shared memory")

    async def SystemSharedMemoryRegister(self, request: Any, context: Any) -> Any:
        await self._not_offered(context, "system shared memory")

    async def SystemSharedMemoryUnregister(self, request: Any, context: Any) -> Any:
        await self._not_offered(context, "system shared memory")

    async def CudaSharedMemoryStatus(self, request: Any, context: Any) -> Any:
        await self._not_offered(context, "CUDA shared memory")

    async def CudaSharedMemoryRegister(self, request: Any, context: Any) -> Any:
        await self._not_offered(context, "CUDA shared memory")

    async def CudaSharedMemoryUnregister(self, request: Any, context: Any) -> Any:
        await self._not_offered(context, "CUDA shared memory")

    async def TraceSetting(self, request: Any, context: Any) -> Any:
        await self._not_offered(context, "trace settings")

    async def LogSettings(self, request: Any, context: Any) -> Any:
        await self._not_offered(context, "log settings")

    # ----------------------------------------------------------------- inference
    async def ModelInfer(self, request: Any, context: Any) -> Any:
        if self.tracing is not None:
            return await self._infer_traced(request, context)
        try:
            return await self._infer(request, context)
        except GrpcError as e:
            await context.abort(e.status, str(e))
            raise  # abort raises; this line is never reached

    async def _infer_traced(self, request: Any, context: Any) -> Any:
        """ModelInfer inside a server span continuing the caller's trace (a ``traceparent``
        metadata entry)."""
        tracing = self.tracing
        assert tracing is not None
        meta = dict((k, v) for k, v in (context.invocation_metadata() or ()) if isinstance(v, str))
        attributes = {"rpc.system": "grpc", "rpc.service": "inference.GRPCInferenceService",
                      "rpc.method": "ModelInfer", "mcp.protocol": "grpc",
                      "mcp.model": request.model_name}  # fmt: skip
        with tracing.tracer.start_as_current_span(
            "inference.GRPCInferenceService/ModelInfer",
            context=tracing.context(meta.get("traceparent")),
            kind=tracing.kind.SERVER,
            attributes=attributes,
        ) as span:
            try:
                response = await self._infer(request, context)
            except GrpcError as e:
                span.set_attribute("rpc.grpc.status_code", e.status.value[0])
                tracing.error(span, str(e))
                await context.abort(e.status, str(e))
                raise
            span.set_attribute("rpc.grpc.status_code", 0)
            span.set_attribute("mcp.version", response.model_version)
            return response

    async def ModelStreamInfer(
        self, request_iterator: AsyncIterator[Any], context: Any
    ) -> AsyncIterator[Any]:
        answers: asyncio.Queue[Any] = asyncio.Queue()
        slots = asyncio.Semaphore(STREAM_IN_FLIGHT)
        tasks: set[asyncio.Task[None]] = set()

        async def one(req: Any) -> None:
            try:
                answer = await self._infer(req, context)
                await answers.put(pb.ModelStreamInferResponse(infer_response=answer))
            except GrpcError as e:
                failed = pb.ModelInferResponse(
                    model_name=req.model_name, model_version=req.model_version, id=req.id
                )
                await answers.put(
                    pb.ModelStreamInferResponse(error_message=str(e), infer_response=failed)
                )
            finally:
                slots.release()

        async def read() -> None:
            async for req in request_iterator:
                await slots.acquire()
                task = asyncio.get_running_loop().create_task(one(req))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            while tasks:
                await asyncio.gather(*list(tasks), return_exceptions=True)
            await answers.put(None)

        reader = asyncio.get_running_loop().create_task(read())
        try:
            while True:
                item = await answers.get()
                if item is None:
                    break
                yield item
        finally:
            reader.cancel()
            for task in list(tasks):
                task.cancel()

    async def _infer(self, request: Any, context: Any) -> Any:
        """One inference; raises :class:`GrpcError` with the status and message to send."""
        t0 = time.perf_counter()
        model = request.model_name
        m = self.metrics
        m.active.inc()
        self._active += 1
        lv: LoadedVersion | None = None
        ran = False
        try:
            self._payload.observe(request.ByteSize())
            meta = context.invocation_metadata()
            lookup = _lookup(meta) if meta else _none
            version, key, priority, timeout = parse_options(
                lookup, GRPC_METADATA, request.model_version or None
            )
            lv = self.manager.route(model, version, key)
            call = decode_grpc_request(request, lv.info.inputs)
            if call.priority is not None:
                priority = call.priority
            if call.timeout_s is not None:
                timeout = call.timeout_s
            remaining = context.time_remaining()
            if remaining is not None and (timeout is None or remaining < timeout):
                timeout = max(remaining, 1e-3)
            t_in = time.perf_counter()
            ran = True
            answered, outputs = await self.manager.infer(
                lv,
                call.feeds,
                pinned=version is not None,
                priority=priority,
                timeout_s=timeout,
                busy=self._active > 1,
                counted=True,
            )
            t_out = time.perf_counter()
            tensors = answer_tensors(
                outputs, call.outputs, answered.output_names, answered.source.labels, True
            )
            response = encode_grpc_response(answered, call.request_id, tensors)
        except Exception as e:
            raise self._failed(model, e, lv, ran, t0) from None
        finally:
            m.active.dec()
            self._active -= 1
        elapsed = self._ok.count(answered, "grpc", t0)
        answered.statistics.on_success(
            elapsed, rows_of(call.feeds), t_in - t0, time.perf_counter() - t_out
        )
        return response

    def _failed(
        self, model: str, e: Exception, lv: LoadedVersion | None, ran: bool, started: float
    ) -> GrpcError:
        err = classify(e)
        count_failure(self.manager, model, "grpc", err, lv, ran, time.perf_counter() - started)
        return GrpcError(GRPC_STATUS[err.code], str(err))


def _none(name: str) -> str | None:
    return None


def _lookup(meta: Sequence[Any]) -> Any:
    found = {k: v for k, v in meta if isinstance(v, str)}
    return found.get


async def _abort(context: Any, e: RequestError) -> NoReturn:
    await context.abort(GRPC_STATUS[e.code], str(e))
    raise e  # context.abort raises; this line is never reached


class GrpcServer:
    """The gRPC service on ``host:port`` (several processes may bind one port: SO_REUSEPORT)."""

    def __init__(self, front: FrontDoor, host: str, port: int, *, max_message: int) -> None:
        self.front = front
        self.host, self.port = host, port
        self.max_message = max_message
        self._server: Any = None

    async def start(self) -> int:
        """Listen and serve; returns the port bound. Raises OSError when it cannot listen."""
        options = [
            ("grpc.max_receive_message_length", self.max_message),
            ("grpc.max_send_message_length", MAX_INFER_RESPONSE_BYTES + 65536),
            ("grpc.so_reuseport", 1),
        ]
        server = grpc.aio.server(options=options)
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(
            InferenceServicer(self.front), server
        )
        shown = f"[{self.host}]" if ":" in self.host else self.host
        try:
            port = server.add_insecure_port(f"{shown}:{self.port}")
        except RuntimeError as e:
            raise OSError(f"cannot listen on {shown}:{self.port} for gRPC: {e}") from e
        if not port:
            raise OSError(f"cannot listen on {shown}:{self.port} for gRPC")
        await server.start()
        self._server = server
        self.port = int(port)
        return self.port

    async def stop(self, grace_s: float = 5.0) -> None:
        """Stop taking calls and let those in progress finish (up to ``grace_s``)."""
        if self._server is not None:
            await self._server.stop(grace_s)
            self._server = None
