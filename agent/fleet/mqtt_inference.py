"""Inference over MQTT 5: Open Inference Protocol JSON in, the same JSON (or an error) out.

Requests arrive on ``mcp/v1/dev/{device}/infer/{model}`` (this device) and on
``$share/agents/mcp/v1/fleet/infer/{model}`` (any agent serving the model; the broker gives
each request to one of them). The body is the ``POST /v2/models/{m}/infer`` body; user
properties play the part of the HTTP headers:

    model-version   pin a version (X-Model-Version)     priority    high | normal | low
    request-key     sticky canary routing (X-Request-Key) timeout-ms  request deadline

:mod:`mcp_edge.agent.serving.requests` reads them as it reads the headers (same defaults, same
refusals) and maps every failure to its error code, for this path and HTTP alike.

The reply goes to the request's MQTT 5 Response Topic with its Correlation Data copied, at the
request's QoS (at most 1), with user properties ``mcp-status`` (the HTTP status the same
request gets from the HTTP API) and ``mcp-device``. (No Content Type: every body is JSON, and
each MQTT 5 property costs paho tens of µs to parse on the receiving side.) Success is the
Open Inference Protocol response; every failure is a structured error, byte for byte what
HTTP answers (``{"error", "code", "retry_after_s"?}``): unknown model → ``not_found``, bad
shape or body → ``bad_request``, body over the cap → ``too_large``, full queue →
``overloaded`` with ``retry_after_s``, deadline → ``timeout``, an answer over
``max_reply_bytes`` (default :attr:`InferResponse.DEFAULT_MQTT_REPLY_BYTES`, 4 MiB) →
``too_large`` naming both sizes, sent instead of the answer. Never silence, except for a request that names no Response Topic, or
one that is not a session reply topic ``mcp/v1/client/{id}/reply/{token}`` (a request must not
make a device publish where it likes, and the broker lets devices answer on nothing else):
those are counted and dropped with a log line.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from mcp_edge.agent.fleet.metrics import FleetMetrics
from mcp_edge.agent.runtime.manager import LoadedVersion, ModelManager
from mcp_edge.agent.serving.oip import Call, answer_tensors, rows_of
from mcp_edge.agent.serving.requests import (
    MQTT_PROPERTIES,
    RequestError,
    SuccessCounter,
    classify,
    count_failure,
    parse_options,
)
from mcp_edge.agent.serving.tensor_io import decode_feeds, encode_response
from mcp_edge.shared.errors import MessageError, TopicError
from mcp_edge.shared.mqtt import InboundMessage, MqttClient, MqttError
from mcp_edge.shared.protocol import topics
from mcp_edge.shared.protocol.wire import (
    DEFAULT_MQTT_REPLY_BYTES,
    MAX_INFER_REQUEST_BYTES,
    MAX_INFER_RESPONSE_BYTES,
    ErrorCode,
    error_reply_body,
    loads,
)

log = logging.getLogger("mcp.agent.mqtt_inference")

SHARE_GROUP = "agents"
DEFAULT_MAX_REQUEST_BYTES = MAX_INFER_REQUEST_BYTES
DEFAULT_MAX_REPLY_BYTES = DEFAULT_MQTT_REPLY_BYTES
_MAX_ERROR_TEXT = 2000


def device_infer_filter(device_id: str) -> str:
    """``mcp/v1/dev/{device}/infer/+``: every model's request topic of one device.

    Built from :func:`shared.protocol.topics.device_infer` (topics.py has no builder for this
    one-device wildcard yet) and checked as a filter.
    """
    base = topics.device_infer(device_id, "model").rsplit("/", 1)[0]
    return topics.validate_filter(base + "/+")


def fleet_infer_filter(model: str, group: str = SHARE_GROUP) -> str:
    """``$share/{group}/mcp/v1/fleet/infer/{model}``."""
    return topics.FleetInferTopic(model).shared(group)


@dataclass
class InferenceCounters:
    received_device: int = 0
    received_fleet: int = 0
    answered_ok: int = 0
    answered_error: int = 0
    dropped: int = 0


def error_body(err: RequestError) -> bytes:
    """The structured error reply, the same JSON the HTTP API answers with."""
    text = str(err)
    if len(text) > _MAX_ERROR_TEXT:
        text = text[:_MAX_ERROR_TEXT] + "…"
    return error_reply_body(text, err.code, err.retry_after_s)


class MqttInference:
    """Answers inference requests for one device (see the module docstring)."""

    def __init__(
        self,
        manager: ModelManager,
        device_id: str,
        mqtt: MqttClient,
        *,
        metrics: FleetMetrics,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES,
        max_pending: int = 256,
    ) -> None:
        """``max_request_bytes`` caps a request body, ``max_reply_bytes`` an answer (bytes).

        Raises :class:`ValueError` when ``max_reply_bytes`` is not in 1 KiB ..
        ``InferResponse.MAX_BYTES`` (an error reply must fit; clients decode no more).
        """
        if not 1024 <= max_reply_bytes <= MAX_INFER_RESPONSE_BYTES:
            raise ValueError(
                f"max_reply_bytes must be in 1024..{MAX_INFER_RESPONSE_BYTES}, not {max_reply_bytes}"
            )
        self.manager = manager
        self._ok = SuccessCounter(manager)
        self.device_id = topics.validate_id(device_id, "device id")
        self.mqtt = mqtt
        self.metrics = metrics
        self.max_request_bytes = max_request_bytes
        self.max_reply_bytes = max_reply_bytes
        self.max_pending = max_pending
        self.counters = InferenceCounters()
        self._tasks: set[asyncio.Task[None]] = set()
        self._status_props = (("mcp-device", self.device_id),)

    def submit(self, msg: InboundMessage, model: str, *, fleet: bool) -> None:
        """Handle one request in its own task (requests run concurrently so they can batch)."""
        if fleet:
            self.counters.received_fleet += 1
        else:
            self.counters.received_device += 1
        if msg.response_topic is None:
            self._drop("no_response_topic", "request without a Response Topic", msg.topic)
            return
        try:
            reply_to = topics.parse(msg.response_topic)
        except TopicError as e:
            self._drop("bad_response_topic", str(e), msg.topic)
            return
        if not isinstance(reply_to, topics.ClientReplyTopic):
            self._drop(
                "bad_response_topic",
                f"Response Topic {msg.response_topic!r:.100} is not a client session reply topic",
                msg.topic,
            )
            return
        if len(self._tasks) >= self.max_pending:
            err = RequestError(
                ErrorCode.OVERLOADED,
                f"overloaded: {len(self._tasks)} MQTT requests in progress",
                1.0,
            )
            self.manager.metrics.rejections.labels(model, "overloaded").inc()
            self._spawn(self._reply(msg, error_body(err), err.code))
            return
        self._spawn(self.handle(msg, model))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _drop(self, reason: str, detail: str, topic: str) -> None:
        self.counters.dropped += 1
        self.metrics.drop("infer", reason, detail, topic)

    async def handle(self, msg: InboundMessage, model: str) -> None:
        body, code = await self.answer(model, msg)
        await self._reply(msg, body, code)

    async def _reply(self, msg: InboundMessage, body: bytes, code: ErrorCode | None) -> None:
        status = "200" if code is None else str(code.http_status)
        if code is None:
            self.counters.answered_ok += 1
        else:
            self.counters.answered_error += 1
        assert msg.response_topic is not None
        try:
            await self.mqtt.publish(
                msg.response_topic,
                body,
                min(msg.qos, 1),
                correlation_data=msg.correlation_data,
                user_properties=(("mcp-status", status), *self._status_props),
            )
        except MqttError as e:
            log.info("could not send the inference reply to %s: %s", msg.response_topic, e)

    async def answer(self, model: str, msg: InboundMessage) -> tuple[bytes, ErrorCode | None]:
        """The reply body for a request and its error code (None on success).

        The request goes to the manager's statistics as HTTP requests do
        (:mod:`agent.serving.requests`): its runs counted by the manager, a failure between
        routing and running counted here.
        """
        m = self.manager.metrics
        t0 = time.perf_counter()
        m.active.inc()
        lv: LoadedVersion | None = None
        ran = False
        try:
            m.payload_bytes.labels("mqtt").observe(len(msg.payload))
            obj = self._parse(msg)
            opts = parse_options(msg.user_property, MQTT_PROPERTIES)
            lv = self.manager.route(model, opts.version, opts.request_key)
            call = self._feeds(msg, obj, lv)
            ran = True
            answered, outputs = await self.manager.infer(
                lv,
                call.feeds,
                pinned=opts.version is not None,
                priority=opts.priority if call.priority is None else call.priority,
                timeout_s=opts.timeout_s if call.timeout_s is None else call.timeout_s,
                counted=True,
            )
            # MQTT answers are JSON: a binary_data request is answered as JSON.
            tensors = answer_tensors(
                outputs, call.outputs, answered.output_names, answered.source.labels, False
            )
            body, _ = encode_response(
                answered.name, answered.version, call.request_id,
                [(n, a, False) for n, a, _ in tensors],
            )  # fmt: skip
            self._check_reply_size(model, len(body))
        except Exception as e:
            err = classify(e)
            count_failure(self.manager, model, "mqtt", err, lv, ran, time.perf_counter() - t0)
            return error_body(err), err.code
        finally:
            m.active.dec()
        elapsed = self._ok.count(answered, "mqtt", t0)
        answered.statistics.on_success(elapsed, rows_of(call.feeds), 0.0, 0.0)
        return body, None

    def _check_reply_size(self, model: str, size: int) -> None:
        """Raises :class:`RequestError` (too_large) for an answer of ``size`` bytes over the cap."""
        if size <= self.max_reply_bytes:
            return
        log.warning(
            "answer of %s is %d bytes, over the %d-byte MQTT reply limit: sent an error instead",
            model, size, self.max_reply_bytes,
        )  # fmt: skip
        raise RequestError(
            ErrorCode.TOO_LARGE,
            f"reply too large: the answer is {size} bytes, the limit for MQTT replies is "
            f"{self.max_reply_bytes} bytes; ask for fewer rows or outputs per request",
        )

    def _parse(self, msg: InboundMessage) -> Any:
        """Size and JSON checks, each counted as a bad message when it fails."""
        size = len(msg.payload)
        if size > self.max_request_bytes:
            self._drop_counted("too_large", msg.topic, f"{size} bytes")
            raise RequestError(
                ErrorCode.TOO_LARGE,
                f"request body too large: {size} bytes, limit {self.max_request_bytes}",
            )
        try:
            obj = loads(msg.payload, max_bytes=self.max_request_bytes)
        except MessageError:
            self._drop_counted("json", msg.topic, "not JSON")
            raise
        return obj

    def _feeds(self, msg: InboundMessage, obj: Any, lv: LoadedVersion) -> Call:
        """Schema and signature checks; a schema failure is counted as a bad message."""
        try:
            return decode_feeds(obj, lv.info.inputs)
        except MessageError as e:
            self._drop_counted("schema", msg.topic, str(e))
            raise

    def _drop_counted(self, reason: str, topic: str, detail: str) -> None:
        # Bad requests are answered (with an error) and also counted as bad input.
        self.metrics.drop("infer", reason, detail + " (answered with an error)", topic)

    async def close(self, timeout_s: float = 10.0) -> None:
        """Wait for requests in progress to be answered (up to ``timeout_s``), then cancel."""
        if not self._tasks:
            return
        _, pending = await asyncio.wait(list(self._tasks), timeout=timeout_s)
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
