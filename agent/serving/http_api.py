"""The agent's local HTTP API (aiohttp): Open Inference Protocol v2, ``/v1/infer``, health, metrics.

Routes::

    GET  /v2                                    server metadata
    GET  /v2/health/live | /v2/health/ready     liveness / readiness
    GET  /v2/models/{m}[/versions/{v}]          model metadata
    GET  /v2/models/{m}[/versions/{v}]/ready    model readiness
    POST /v2/models/{m}[/versions/{v}]/infer    inference (Open Inference Protocol JSON)
    POST /v1/infer                              convenience API: image or numbers in, top-k out
    GET  /healthz | /readyz | /metrics

Headers: ``X-Model-Version`` pins a version, ``X-Request-Key`` makes canary routing sticky,
``X-Priority`` is high/normal/low, ``X-Timeout-Ms`` sets the request deadline (read, with
their MQTT counterparts, by :mod:`.requests`). Every error is ``{"error": "...", "code": "..."}``
with the matching status (:func:`.requests.classify`); 429 carries ``Retry-After``; a path
no route has is 404 ``not_found``, a method the path does not take 405 ``bad_request`` with
``Allow``. Inference
requests are counted in the manager's statistics per version and role as MQTT ones are
(:mod:`.requests`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web

from mcp_edge.agent import __version__
from mcp_edge.agent.runtime.manager import LoadedVersion, ModelManager, ModelNotFoundError
from mcp_edge.agent.serving.metrics import AgentMetrics
from mcp_edge.agent.serving.preprocess import prepare_v1_inputs, top_k
from mcp_edge.agent.serving.requests import (
    HTTP_HEADERS,
    RequestError,
    classify,
    count_unrun,
    parse_options,
)
from mcp_edge.agent.serving.tensor_io import decode_feeds, encode_response, output_names
from mcp_edge.shared.protocol.wire import ErrorCode, loads

MANAGER = web.AppKey("manager", ModelManager)
METRICS = web.AppKey("metrics", AgentMetrics)
DEFAULT_MAX_BODY = 8 * 1024 * 1024
_JSON = "application/json"

_PLATFORMS = {"onnxruntime": "onnxruntime_onnx", "openvino": "openvino_onnx",
              "tflite": "tensorflow_lite"}  # fmt: skip
"""The Open Inference Protocol ``platform`` of each backend (Triton's names where it has one)."""


def _json(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        body=orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY),
        status=status,
        content_type=_JSON,
        headers=headers,
    )


def _error(e: RequestError) -> web.Response:
    body: dict[str, Any] = {"error": str(e), "code": e.code.value}
    headers = None
    if e.retry_after_s is not None:
        body["retry_after_s"] = e.retry_after_s
        headers = {"Retry-After": str(max(1, math.ceil(e.retry_after_s)))}
    return _json(body, e.code.http_status, headers)


def _classify(e: Exception) -> RequestError:
    # aiohttp refusing a body over client_max_size is the one failure only HTTP has.
    if isinstance(e, web.HTTPRequestEntityTooLarge):
        return RequestError(ErrorCode.TOO_LARGE, "request body is too large")
    return classify(e)


@web.middleware
async def _route_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """aiohttp's own 404 and 405 (no such route, wrong method) in the API's error shape."""
    try:
        return await handler(request)
    except web.HTTPMethodNotAllowed as e:
        allowed = ", ".join(sorted(e.allowed_methods))
        body = {
            "error": f"{request.method} is not allowed on {request.path[:200]}; use {allowed}",
            "code": ErrorCode.BAD_REQUEST.value,
        }
        return _json(body, 405, {"Allow": ",".join(sorted(e.allowed_methods))})
    except web.HTTPNotFound:
        body = {"error": f"no such route: {request.path[:200]}", "code": ErrorCode.NOT_FOUND.value}
        return _json(body, 404)


# ---------------------------------------------------------------------------- handlers
class Handlers:
    def __init__(self, manager: ModelManager, metrics: AgentMetrics, max_body: int) -> None:
        self.manager = manager
        self.metrics = metrics
        self.max_body = max_body
        self._ok: dict[tuple[str, str, str], tuple[Any, Any]] = {}
        self._active = 0  # /v2 inference requests in progress (a hint for batching)
        self._payload = {p: metrics.payload_bytes.labels(p) for p in ("v1", "v2")}

    def _model_label(self, model: str) -> str:
        # Only loaded models become label values: a URL must not mint metric series.
        return model if model in self.manager.loaded_names else "_unknown"

    def _failed(
        self, model: str, protocol: str, e: Exception, unrun: LoadedVersion | None, started: float
    ) -> web.Response:
        """The error answer; ``unrun``: the version the request was routed to when it failed
        before running there (counted in the statistics as its request)."""
        m = self.metrics
        err = _classify(e)
        count_unrun(self.manager, unrun, err, time.perf_counter() - started)
        label = self._model_label(model)
        if err.code in (ErrorCode.OVERLOADED, ErrorCode.TIMEOUT):
            m.rejections.labels(label, err.code.value).inc()
        else:
            m.errors.labels(label, err.code.value).inc()
        m.requests.labels(label, protocol, str(err.code.http_status)).inc()
        return _error(err)

    def _succeeded(self, lv: LoadedVersion, protocol: str, started: float) -> None:
        key = (lv.name, lv.version, protocol)
        children = self._ok.get(key)
        if children is None:
            children = (
                self.metrics.requests.labels(lv.name, protocol, "200"),
                self.metrics.latency.labels(lv.name, lv.version),
            )
            self._ok[key] = children
        children[0].inc()
        children[1].observe(time.perf_counter() - started)

    async def _body(self, request: web.Request, protocol: str) -> bytes:
        if request.content_length is not None and request.content_length > self.max_body:
            raise RequestError(
                ErrorCode.TOO_LARGE,
                f"request body too large: {request.content_length} bytes, limit {self.max_body}",
            )
        body = await request.read()
        self._payload[protocol].observe(len(body))
        return body

    async def infer_v2(self, request: web.Request) -> web.Response:
        # Straight-line on purpose: this is the hot path (see bench/local_inference.py).
        model = request.match_info["model"]
        t0 = time.perf_counter()
        active = self.metrics.active
        active.inc()
        self._active += 1
        lv: LoadedVersion | None = None
        ran = False
        try:
            body = await self._body(request, "v2")
            obj = loads(body, max_bytes=self.max_body)
            # Options before the model lookup: a bad option is a 400 for any model, as over MQTT.
            version, key, priority, timeout = parse_options(
                request.headers.get, HTTP_HEADERS, request.match_info.get("version")
            )
            lv = self.manager.route(model, version, key)
            rid, feeds, wanted = decode_feeds(obj, lv.info.inputs)
            ran = True
            answered, outputs = await self.manager.infer(
                lv,
                feeds,
                pinned=version is not None,
                priority=priority,
                timeout_s=timeout,
                busy=self._active > 1,
                counted=True,
            )
            names = output_names(outputs, wanted, answered.output_names)
            response = web.Response(
                body=encode_response(answered.name, answered.version, rid, outputs, names),
                content_type=_JSON,
            )
        except Exception as e:
            return self._failed(model, "v2", e, None if ran else lv, t0)
        finally:
            active.dec()
            self._active -= 1
        self._succeeded(answered, "v2", t0)
        return response

    async def infer_v1(self, request: web.Request) -> web.Response:
        names = self.manager.names()
        model = "unknown"
        t0 = time.perf_counter()
        self.metrics.active.inc()
        lv: LoadedVersion | None = None
        ran = False
        try:
            body = await self._body(request, "v1")
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
            return self._failed(model, "v1", e, None if ran else lv, t0)
        finally:
            self.metrics.active.dec()
        self._succeeded(answered, "v1", t0)
        return response

    # --- metadata and health
    async def server_metadata(self, request: web.Request) -> web.Response:
        return _json({"name": "mcp-edge-agent", "version": __version__, "extensions": []})

    async def live(self, request: web.Request) -> web.Response:
        return _json({"live": True})

    async def ready(self, request: web.Request) -> web.Response:
        ok = self.manager.ready
        return _json({"ready": ok}, 200 if ok else 503)

    async def model_metadata(self, request: web.Request) -> web.Response:
        try:
            model = request.match_info["model"]
            slot = self.manager.slot(model)
            lv = self.manager.get(model, request.match_info.get("version"))
        except ModelNotFoundError as e:
            return _error(RequestError(ErrorCode.NOT_FOUND, str(e)))
        info = lv.info
        return _json(
            {
                "name": lv.name,
                "versions": sorted(slot.versions),
                "platform": _PLATFORMS.get(info.backend, info.backend),
                "inputs": [s.to_json() for s in info.inputs],
                "outputs": [s.to_json() for s in info.outputs],
                "parameters": {
                    "version": lv.version,
                    "role": slot.role_of(lv.version),
                    "backend": info.backend,
                    "provider": info.provider,
                    "stable": slot.stable,
                    "canary": None
                    if slot.canary is None
                    else {
                        "version": slot.canary.version,
                        "weight": slot.canary.weight,
                        "enabled": slot.canary.enabled,
                        "error_rate": slot.canary.error_rate,
                    },
                    "shadow": None
                    if slot.shadow is None
                    else {
                        "version": slot.shadow.version,
                        "compared": slot.shadow.compared,
                        "agreement": slot.shadow.agreement,
                    },
                },
            }
        )

    async def model_ready(self, request: web.Request) -> web.Response:
        model = request.match_info["model"]
        try:
            lv = self.manager.get(model, request.match_info.get("version"))
        except ModelNotFoundError as e:
            return _error(RequestError(ErrorCode.NOT_FOUND, str(e)))
        return _json({"name": lv.name, "version": lv.version, "ready": True})

    async def metrics_endpoint(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self.metrics.exposition(),
            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
        )


def build_app(manager: ModelManager, *, max_body: int = DEFAULT_MAX_BODY) -> web.Application:
    """The aiohttp application serving ``manager``'s models."""
    app = web.Application(client_max_size=max_body, middlewares=[_route_errors])
    app[MANAGER] = manager
    app[METRICS] = manager.metrics
    h = Handlers(manager, manager.metrics, max_body)
    r = app.router
    # aiohttp resolves routes in registration order: the inference routes come first.
    r.add_post("/v2/models/{model}/infer", h.infer_v2)
    r.add_post("/v2/models/{model}/versions/{version}/infer", h.infer_v2)
    r.add_post("/v1/infer", h.infer_v1)
    r.add_get("/v2", h.server_metadata)
    r.add_get("/v2/health/live", h.live)
    r.add_get("/v2/health/ready", h.ready)
    r.add_get("/v2/models/{model}", h.model_metadata)
    r.add_get("/v2/models/{model}/versions/{version}", h.model_metadata)
    r.add_get("/v2/models/{model}/ready", h.model_ready)
    r.add_get("/v2/models/{model}/versions/{version}/ready", h.model_ready)
    r.add_get("/healthz", h.live)
    r.add_get("/readyz", h.ready)
    r.add_get("/metrics", h.metrics_endpoint)
    return app
