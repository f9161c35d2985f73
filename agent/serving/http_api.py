"""The agent's local HTTP API (aiohttp): Open Inference Protocol v2 with Triton's extensions,
``/v1/infer``, health, metrics.

Routes::

    GET  /v2                                      server metadata (extensions offered)
    GET  /v2/health/live | /v2/health/ready       liveness / readiness
    GET  /v2/models                               the served models in brief
    GET  /v2/models/{m}[/versions/{v}]            model metadata
    GET  /v2/models/{m}[/versions/{v}]/ready      model readiness
    GET  /v2/models/{m}[/versions/{v}]/config     model configuration (Triton's ModelConfig)
    GET  /v2/models[/{m}[/versions/{v}]]/stats    statistics (Triton's shape)
    POST /v2/models/{m}[/versions/{v}]/infer      inference: JSON, or the binary tensor extension
    POST /v2/repository/index                     repository index
    POST /v2/repository/models/{m}/load|unload    explicit model control (off unless enabled)
    POST /v1/infer                                convenience API: image or numbers in, top-k out
    GET  /healthz | /readyz | /metrics

Inference bodies are JSON, or (header ``Inference-Header-Content-Length``) a JSON header
followed by the raw bytes of the inputs that carry ``binary_data_size``
(:func:`.oip.decode_binary_request`); outputs come back in binary when the request or the
output asks (``binary_data_output``, ``binary_data``), with the header set on the answer.
Request bodies may be gzip or deflate compressed (``Content-Encoding``; the size cap applies
to the decompressed body); answers of 1 KiB and more are compressed (gzip, else deflate) when
``Accept-Encoding`` accepts it (:func:`accepted_coding`). Headers: ``X-Model-Version`` pins a
version, ``X-Request-Key`` makes canary routing sticky, ``X-Priority`` is high/normal/low,
``X-Timeout-Ms`` sets the request deadline (read, with their MQTT counterparts, by
:mod:`.requests`); the request's ``priority`` and ``timeout`` parameters win over them. Every error is ``{"error": "...", "code": "..."}`` with the matching
status (:func:`.requests.classify`); 429 carries ``Retry-After``; a path no route has is 404
``not_found``, a method the path does not take 405 ``bad_request`` with ``Allow``; the parts
of Triton's protocol not offered (shared memory, tracing, log settings) answer 501
``not_implemented``. Inference requests are counted in the manager's statistics per version
and role as MQTT ones are (:mod:`.requests`), and in each version's Triton statistics.
"""

from __future__ import annotations

import asyncio
import gzip
import logging
import math
import time
import zlib
from typing import TYPE_CHECKING, Any

import orjson

from mcp_edge.agent.runtime.manager import LoadedVersion, ModelManager, ModelNotFoundError
from mcp_edge.agent.serving.http_server import (
    Handler,
    HttpRequest,
    HttpResponse,
    HttpServer,
    Router,
)
from mcp_edge.agent.serving.model_control import check_parameters
from mcp_edge.agent.serving.oip import Call, answer_tensors, decode_binary_request, rows_of
from mcp_edge.agent.serving.preprocess import prepare_v1_inputs, top_k
from mcp_edge.agent.serving.requests import (
    HTTP_HEADERS,
    RequestError,
    SuccessCounter,
    classify,
    count_failure,
    parse_options,
)
from mcp_edge.agent.serving.service import FrontDoor
from mcp_edge.agent.serving.tensor_io import decode_feeds, encode_response
from mcp_edge.shared.errors import MessageError
from mcp_edge.shared.protocol.wire import ErrorCode, loads

if TYPE_CHECKING:
    from mcp_edge.shared.tracing import Tracing

DEFAULT_MAX_BODY = 8 * 1024 * 1024
HEADER_LENGTH = "Inference-Header-Content-Length"
COMPRESS_FROM = 1024
"""Answers this many bytes and larger are compressed when the client accepts it."""
_JSON = "application/json"
_OCTETS = "application/octet-stream"


def _json(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> HttpResponse:
    return HttpResponse(orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY), status, _JSON,
                        headers)  # fmt: skip


def _error(e: RequestError) -> HttpResponse:
    body: dict[str, Any] = {"error": str(e), "code": e.code.value}
    headers = None
    if e.retry_after_s is not None:
        body["retry_after_s"] = e.retry_after_s
        headers = {"Retry-After": str(max(1, math.ceil(e.retry_after_s)))}
    return _json(body, e.code.http_status, headers)


def _classify(e: Exception) -> RequestError:
    return classify(e)


async def _no_route(request: HttpRequest, allowed: set[str]) -> HttpResponse:
    """Every request no route takes: 405 with ``Allow`` when another method would take the
    path, else 404, both in the API's error shape."""
    if allowed:
        methods = sorted("*" if m == "*" else m for m in allowed)
        text = ", ".join(methods)
        body = {
            "error": f"{request.method} is not allowed on {request.path[:200]}; use {text}",
            "code": ErrorCode.BAD_REQUEST.value,
        }
        return _json(body, 405, {"Allow": ",".join(methods)})
    body = {"error": f"no such route: {request.path[:200]}", "code": ErrorCode.NOT_FOUND.value}
    return _json(body, 404)


def split_binary_body(body: bytes, header_length: str) -> tuple[memoryview, memoryview]:
    """A binary-extension body cut into its JSON header and the bytes after it.

    Raises MessageError when ``Inference-Header-Content-Length`` is not a byte count within
    the body.
    """
    # isascii: str.isdigit() also takes digits int() refuses ("²", a UTF-8 header byte pair).
    if not (header_length.isascii() and header_length.isdigit()) or len(header_length) > 12:
        raise MessageError(f"{HEADER_LENGTH} must be a byte count, not {header_length[:20]!r}")
    n = int(header_length)
    if n == 0 or n > len(body):
        raise MessageError(
            f"{HEADER_LENGTH} {n} does not fit the {len(body)}-byte body "
            "(the JSON header must be 1 byte or more and within the body)"
        )
    view = memoryview(body)
    return view[:n], view[n:]


def accepted_coding(accept_encoding: str) -> str | None:
    """The compression an ``Accept-Encoding`` header accepts, gzip before deflate; None when
    it accepts neither (``q=0`` refuses a coding, ``*`` stands for those not named)."""
    weights: dict[str, float] = {}
    for item in accept_encoding.lower().split(","):
        name, _, params = item.partition(";")
        q = 1.0
        for param in params.split(";"):
            key, _, value = param.partition("=")
            if key.strip() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
        weights[name.strip()] = q
    for coding in ("gzip", "deflate"):
        if weights.get(coding, weights.get("*", 0.0)) > 0:  # NaN is not > 0
            return coding
    return None


async def compress_if_asked(request: HttpRequest, response: HttpResponse) -> None:
    """Compress ``response`` (1 KiB and more) with the coding the request accepts, off the
    event loop when it is large."""
    body = response.body
    if len(body) < COMPRESS_FROM:
        return
    # Not a match on the names alone: "gzip;q=0" refuses gzip.
    coding = accepted_coding(request.headers.get("Accept-Encoding", ""))
    if coding is None:
        return
    squeeze = gzip.compress if coding == "gzip" else zlib.compress
    if len(body) > 256 * 1024:
        body = await asyncio.get_running_loop().run_in_executor(None, squeeze, body)
    else:
        body = squeeze(body)
    response.body = body
    response.headers = {**(response.headers or {}), "Content-Encoding": coding,
                        "Vary": "Accept-Encoding"}  # fmt: skip


# ---------------------------------------------------------------------------- handlers
class Handlers:
    def __init__(self, front: FrontDoor, max_body: int) -> None:
        manager = front.manager
        self.front = front
        self._tracing = front.tracing
        self.manager = manager
        self.metrics = manager.metrics
        self.max_body = max_body
        self._ok = SuccessCounter(manager)
        self._active = 0  # /v2 inference requests in progress (a hint for batching)
        self._payload = {p: self.metrics.payload_bytes.labels(p) for p in ("v1", "v2")}

    def _failed(
        self, model: str, protocol: str, e: Exception, lv: LoadedVersion | None, ran: bool,
        started: float,
    ) -> HttpResponse:  # fmt: skip
        """The error answer; ``lv``: the version the request was routed to (None: never
        routed); ``ran``: whether it reached the version's queue (its runs are counted there)."""
        err = _classify(e)
        count_failure(self.manager, model, protocol, err, lv, ran, time.perf_counter() - started)
        return _error(err)

    def _body(self, request: HttpRequest, protocol: str) -> bytes:
        # The server has read the whole body within the cap (413 past it) before routing.
        body = request.body
        self._payload[protocol].observe(len(body))
        return body

    async def infer_v2(self, request: HttpRequest) -> HttpResponse:
        # Straight-line on purpose: this is the hot path (see bench/local_inference.py).
        model = request.match_info["model"]
        t0 = time.perf_counter()
        active = self.metrics.active
        active.inc()
        self._active += 1
        lv: LoadedVersion | None = None
        ran = False
        try:
            body = self._body(request, "v2")
            headers = request.headers
            header_length = headers.get(HEADER_LENGTH)
            if header_length is None:
                obj = loads(body, max_bytes=self.max_body)
                binary = None
            else:
                head, binary = split_binary_body(body, header_length)
                obj = loads(head, max_bytes=self.max_body)
            # Options before the model lookup: a bad option is a 400 for any model, as over MQTT.
            version, key, priority, timeout = parse_options(
                headers.get, HTTP_HEADERS, request.match_info.get("version")
            )
            lv = self.manager.route(model, version, key)
            call: Call = (
                decode_feeds(obj, lv.info.inputs)
                if binary is None
                else decode_binary_request(obj, binary, lv.info.inputs)
            )
            if call.priority is not None:
                priority = call.priority
            if call.timeout_s is not None:
                timeout = call.timeout_s
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
            if call.outputs is None and not call.binary_output:
                # The common answer: every output as JSON (no per-tensor choices to make).
                tensors = [(n, outputs[n], False) for n in answered.output_names]
            else:
                tensors = answer_tensors(
                    outputs, call.outputs, answered.output_names, answered.source.labels,
                    call.binary_output,
                )  # fmt: skip
            payload, head_len = encode_response(
                answered.name, answered.version, call.request_id, tensors
            )
            if head_len is None:
                response = HttpResponse(payload, 200, _JSON)
            else:
                response = HttpResponse(payload, 200, _OCTETS, {HEADER_LENGTH: str(head_len)})
            if len(payload) >= COMPRESS_FROM:
                await compress_if_asked(request, response)
        except Exception as e:
            return self._failed(model, "v2", e, lv, ran, t0)
        finally:
            active.dec()
            self._active -= 1
        if self._tracing is not None:
            self._tracing.annotate(mcp_version=answered.version)
        elapsed = self._ok.count(answered, "v2", t0)
        answered.statistics.on_success(
            elapsed, rows_of(call.feeds), t_in - t0, time.perf_counter() - t_out
        )
        return response

    async def infer_v1(self, request: HttpRequest) -> HttpResponse:
        names = self.manager.names()
        model = "unknown"
        t0 = time.perf_counter()
        self.metrics.active.inc()
        lv: LoadedVersion | None = None
        ran = False
        try:
            body = self._body(request, "v1")
            try:
                doc = orjson.loads(body)
            except orjson.JSONDecodeError as e:
                raise RequestError(ErrorCode.BAD_REQUEST, f"body is not valid JSON: {e}") from None
            if not isinstance(doc, dict):
                raise RequestError(ErrorCode.BAD_REQUEST, "body must be a JSON object")
            model = doc.get("model") or (names[0] if len(names) == 1 else "")
            if not isinstance(model, str) or not model:
                raise RequestError(
                    ErrorCode.BAD_REQUEST, f'name the model with "model": one of {names}'
                )
            version, key, priority, timeout = parse_options(request.headers.get, HTTP_HEADERS)
            lv = self.manager.route(model, version, key)
            feeds, k = prepare_v1_inputs(doc, lv)
            ran = True
            answered, outputs = await self.manager.infer(
                lv,
                feeds,
                pinned=version is not None,
                priority=priority,
                timeout_s=timeout,
                counted=True,
            )
            first = answered.info.outputs[0].name
            result = {
                "model_name": answered.name,
                "model_version": answered.version,
                "predictions": top_k(outputs[first], answered.source.labels, k),
            }
            response = _json(result)
        except Exception as e:
            return self._failed(model, "v1", e, lv, ran, t0)
        finally:
            self.metrics.active.dec()
        elapsed = self._ok.count(answered, "v1", t0)
        answered.statistics.on_success(elapsed, rows_of(feeds), 0.0, 0.0)
        return response

    # --- metadata and health
    async def server_metadata(self, request: HttpRequest) -> HttpResponse:
        return _json(self.front.server_metadata())

    async def live(self, request: HttpRequest) -> HttpResponse:
        return _json({"live": True})

    async def ready(self, request: HttpRequest) -> HttpResponse:
        ok = self.manager.ready
        return _json({"ready": ok}, 200 if ok else 503)

    async def models(self, request: HttpRequest) -> HttpResponse:
        return _json({"models": self.front.models()})

    async def model_metadata(self, request: HttpRequest) -> HttpResponse:
        try:
            doc = self.front.model_metadata(
                request.match_info["model"], request.match_info.get("version")
            )
        except ModelNotFoundError as e:
            return _error(RequestError(ErrorCode.NOT_FOUND, str(e)))
        return _json(doc)

    async def model_ready(self, request: HttpRequest) -> HttpResponse:
        model = request.match_info["model"]
        try:
            lv = self.manager.get(model, request.match_info.get("version"))
        except ModelNotFoundError as e:
            return _error(RequestError(ErrorCode.NOT_FOUND, str(e)))
        return _json({"name": lv.name, "version": lv.version, "ready": True})

    async def model_config(self, request: HttpRequest) -> HttpResponse:
        try:
            doc = self.front.model_config(
                request.match_info["model"], request.match_info.get("version")
            )
        except ModelNotFoundError as e:
            return _error(RequestError(ErrorCode.NOT_FOUND, str(e)))
        return _json(doc)

    async def statistics(self, request: HttpRequest) -> HttpResponse:
        try:
            doc = await self.front.statistics(
                request.match_info.get("model"), request.match_info.get("version")
            )
        except ModelNotFoundError as e:
            return _error(RequestError(ErrorCode.NOT_FOUND, str(e)))
        return _json(doc)

    async def _small_json(self, request: HttpRequest) -> dict[str, Any]:
        """An optional JSON object body of a control request (at most 64 KiB)."""
        raw = request.body
        if len(raw) > 65536:
            raise RequestError(ErrorCode.TOO_LARGE, "control request body over 64 KiB")
        if not raw.strip():
            return {}
        obj = loads(raw, max_bytes=65536)
        if type(obj) is not dict:
            raise RequestError(ErrorCode.BAD_REQUEST, "the body must be a JSON object")
        return obj

    async def repository_index(self, request: HttpRequest) -> HttpResponse:
        try:
            body = await self._small_json(request)
            ready = body.get("ready", False)
            if type(ready) is not bool:
                raise RequestError(ErrorCode.BAD_REQUEST, "ready must be true or false")
            return _json(await self.front.index(ready))
        except Exception as e:
            return _error(_classify(e))

    async def repository_load(self, request: HttpRequest) -> HttpResponse:
        return await self._control(request, "load")

    async def repository_unload(self, request: HttpRequest) -> HttpResponse:
        return await self._control(request, "unload")

    async def _control(self, request: HttpRequest, action: str) -> HttpResponse:
        name = request.match_info["model"]
        try:
            body = await self._small_json(request)
            check_parameters(action, body.get("parameters"))
            await (self.front.load(name) if action == "load" else self.front.unload(name))
        except Exception as e:
            return _error(_classify(e))
        return _json({})

    async def not_offered(self, request: HttpRequest) -> HttpResponse:
        path = request.path
        if "systemsharedmemory" in path:
            what = "system shared memory"
        elif "cudasharedmemory" in path:
            what = "CUDA shared memory"
        elif path.endswith("/trace/setting"):
            what = "trace settings"
        else:
            what = "log settings"
        return _error(
            RequestError(
                ErrorCode.NOT_IMPLEMENTED,
                f"{what} is not supported by this server ({request.method} {path[:200]})",
            )
        )

    async def metrics_endpoint(self, request: HttpRequest) -> HttpResponse:
        return HttpResponse(
            await self.front.metrics_text(), 200, "text/plain; version=0.0.4; charset=utf-8"
        )


def traced(tracing: Tracing, route: str, handler: Handler) -> Handler:
    """``handler`` inside a server span (``POST {route}``) that continues the caller's trace
    (a ``traceparent`` header) and records the model, version and status."""
    tracer, kind = tracing.tracer, tracing.kind.SERVER

    async def run(request: HttpRequest) -> HttpResponse:
        parent = tracing.context(request.headers.get("traceparent"))
        attributes = {"http.request.method": request.method, "http.route": route,
                      "mcp.protocol": "http"}  # fmt: skip
        with tracer.start_as_current_span(
            f"{request.method} {route}", context=parent, kind=kind, attributes=attributes
        ) as span:
            model = request.match_info.get("model")
            if model:
                span.set_attribute("mcp.model", model)
            response = await handler(request)
            span.set_attribute("http.response.status_code", response.status)
            if response.status >= 400:
                tracing.error(span, f"HTTP {response.status}")
        return response

    return run


def build_router(handlers: Handlers, tracing: Tracing | None = None) -> Router:
    """Every route of the API to its handler (inference inside spans with ``tracing``)."""
    h = handlers

    def infer(route: str, handler: Handler) -> Handler:
        return handler if tracing is None else traced(tracing, route, handler)

    r = Router()
    r.add("POST", "/v2/models/{model}/infer", infer("/v2/models/{model}/infer", h.infer_v2))
    r.add("POST", "/v2/models/{model}/versions/{version}/infer",
          infer("/v2/models/{model}/versions/{version}/infer", h.infer_v2))  # fmt: skip
    r.add("POST", "/v1/infer", infer("/v1/infer", h.infer_v1))
    r.add("GET", "/v2", h.server_metadata)
    r.add("GET", "/v2/health/live", h.live)
    r.add("GET", "/v2/health/ready", h.ready)
    r.add("GET", "/v2/models", h.models)
    r.add("GET", "/v2/models/stats", h.statistics)
    r.add("GET", "/v2/models/{model}", h.model_metadata)
    r.add("GET", "/v2/models/{model}/versions/{version}", h.model_metadata)
    r.add("GET", "/v2/models/{model}/ready", h.model_ready)
    r.add("GET", "/v2/models/{model}/versions/{version}/ready", h.model_ready)
    r.add("GET", "/v2/models/{model}/config", h.model_config)
    r.add("GET", "/v2/models/{model}/versions/{version}/config", h.model_config)
    r.add("GET", "/v2/models/{model}/stats", h.statistics)
    r.add("GET", "/v2/models/{model}/versions/{version}/stats", h.statistics)
    r.add("POST", "/v2/repository/index", h.repository_index)
    r.add("POST", "/v2/repository/models/{model}/load", h.repository_load)
    r.add("POST", "/v2/repository/models/{model}/unload", h.repository_unload)
    for prefix in ("/v2/systemsharedmemory", "/v2/cudasharedmemory"):
        r.add("*", prefix + "/{tail*}", h.not_offered)
    r.add("*", "/v2/trace/setting", h.not_offered)
    r.add("*", "/v2/models/{model}/trace/setting", h.not_offered)
    r.add("*", "/v2/logging", h.not_offered)
    r.add("GET", "/healthz", h.live)
    r.add("GET", "/readyz", h.ready)
    r.add("GET", "/metrics", h.metrics_endpoint)
    return r


def build_server(
    manager: ModelManager,
    *,
    max_body: int = DEFAULT_MAX_BODY,
    front: FrontDoor | None = None,
    access_log: logging.Logger | None = None,
) -> HttpServer:
    """The HTTP server for ``manager``'s models (``front``: what answers the protocol's other
    calls; by default one with no model control and no other processes). Start it with
    :meth:`HttpServer.start`."""
    front = front or FrontDoor(manager)
    handlers = Handlers(front, max_body)
    router = build_router(handlers, front.tracing)
    return HttpServer(router, _no_route, max_body=max_body, access_log=access_log)
