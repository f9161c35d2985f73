"""Inference over MQTT for application developers::

    from mcp_edge.client import InferenceClient

    async with InferenceClient("broker.local", 1883, client_id="app-1") as c:
        resp = await c.infer("digits", {"input": x}, device=None, timeout_s=5)
        resp.outputs[0].to_numpy()

``device=None`` sends to the fleet (``mcp/v1/fleet/infer/{model}``; one agent serving the model
answers), ``device="dev-1"`` to one device. Replies come back on this client's session reply
topic ``mcp/v1/client/{client_id}/reply/{token}`` (``token`` drawn at random per client, so
only a device that was sent one of our requests knows where to answer), matched by MQTT 5
correlation data; the request carries a Message Expiry equal to its timeout, so a broker never
delivers it after the caller gave up.

Replies are untrusted: one on another topic, one whose correlation data is not that of a
request still waiting (a spoofed, late or repeated reply) is never handed to a caller; it is
counted in :attr:`InferenceClient.dropped_replies` and logged. The client announces a Maximum
Packet Size of ``max_reply_bytes`` (default 4 MiB, the agents' default reply cap) plus room for
the headers, so the broker drops a bigger reply instead of delivering it.

Errors (all :class:`InferenceClientError`)::

    InferenceClientError
    ├── InferenceReplyError     the agent answered with a structured error (``.reply``, ``.code``)
    ├── NoResponderError        the broker says nobody subscribes to the request topic (QoS 1)
    ├── InferenceTimeoutError   no reply within ``timeout_s``
    └── InferenceTransportError the MQTT connection failed (``__cause__`` has the detail)
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import secrets
import ssl
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import orjson

from mcp_edge.shared.errors import McpError, MessageError
from mcp_edge.shared.mqtt import (
    RC_NO_MATCHING_SUBSCRIBERS,
    RETAIN_DO_NOT_SEND,
    InboundMessage,
    MqttClient,
    MqttError,
    MqttSettings,
    Subscription,
)
from mcp_edge.shared.protocol import (
    ErrorCode,
    ErrorReply,
    InferRequest,
    InferResponse,
    InferTensor,
    RequestedOutput,
    encode,
    topics,
    validate,
)

log = logging.getLogger("mcp.client")

REPLY_GRACE_S = 1.0
REPLY_HEADER_BYTES = 64 * 1024
"""Room for a reply's fixed header, topic and properties above its payload cap."""
InputsLike = InferRequest | Sequence[InferTensor] | Mapping[str, Any] | bytes


class InferenceClientError(McpError):
    """Base of the inference client's errors."""


class InferenceReplyError(InferenceClientError):
    """The agent answered with an error; ``reply`` is the structured :class:`ErrorReply`."""

    def __init__(self, reply: ErrorReply, device: str | None = None) -> None:
        super().__init__(f"{reply.code.value}: {reply.error}")
        self.reply = reply
        self.code: ErrorCode = reply.code
        self.device = device


class NoResponderError(InferenceClientError):
    """Nobody subscribes to the request topic (no agent serves the model, or the device is off)."""


class InferenceTimeoutError(InferenceClientError):
    """No reply arrived in time."""


class InferenceTransportError(InferenceClientError):
    """The MQTT connection failed or dropped."""


def build_request(
    inputs: InputsLike, *, request_id: str | None = None, outputs: Sequence[str] | None = None
) -> bytes:
    """The Open Inference Protocol body for ``inputs``: an :class:`InferRequest`, a list of
    :class:`InferTensor`, a mapping of input name to array(-like), or raw JSON bytes."""
    if isinstance(inputs, bytes | bytearray):
        return bytes(inputs)
    if isinstance(inputs, InferRequest):
        req = inputs
    else:
        if isinstance(inputs, Mapping):
            if "inputs" in inputs:
                req = validate(dict(inputs), InferRequest)
                return encode(req)
            tensors = [
                InferTensor.from_numpy(str(name), _as_array(value))
                for name, value in inputs.items()
            ]
        else:
            tensors = list(inputs)
        req = InferRequest(
            id=request_id,
            inputs=tensors,
            outputs=[RequestedOutput(name=n) for n in outputs] if outputs else None,
        )
    return encode(req)


def _as_array(value: Any) -> np.ndarray[Any, Any]:
    arr = np.asarray(value)
    if arr.dtype == np.float64:
        arr = arr.astype(np.float32)  # models take FP32; JSON numbers would otherwise be FP64
    return arr


class InferenceClient:
    """An MQTT inference client (see the module docstring). One connection, many requests."""

    def __init__(
        self,
        host: str,
        port: int = 1883,
        *,
        client_id: str | None = None,
        username: str | None = None,
        password: str | None = None,
        tls: ssl.SSLContext | None = None,
        qos: int = 1,
        keepalive_s: int = 30,
        connect_timeout_s: float = 10.0,
        max_reply_bytes: int = InferResponse.DEFAULT_MQTT_REPLY_BYTES,
    ) -> None:
        """``max_reply_bytes``: the largest reply payload accepted (bytes; raise it together
        with the agents' ``--max-reply-mb``). Raises :class:`TopicError` for a bad client id."""
        self.client_id = topics.validate_id(client_id or f"app-{secrets.token_hex(6)}", "client id")
        self.reply_topic = str(topics.ClientReplyTopic.new(self.client_id))
        """This client's session reply topic; its token is secret to it and the agents asked."""
        self.dropped_replies: Counter[str] = Counter()
        """Replies never handed to a caller, by reason: ``foreign_topic``, ``unmatched``
        (correlation data of no waiting request: spoofed, or after its timeout), ``duplicate``."""
        self.qos = qos
        self.mqtt = MqttClient(
            MqttSettings(
                host=host,
                port=port,
                client_id=self.client_id,
                username=username,
                password=password,
                tls=tls,
                keepalive_s=keepalive_s,
                clean_start=True,
                session_expiry_s=0,
                connect_timeout_s=connect_timeout_s,
                max_packet_bytes=max_reply_bytes + REPLY_HEADER_BYTES,
            )
        )
        self._waiting: dict[bytes, asyncio.Future[InboundMessage]] = {}

    async def connect(self) -> None:
        """Connect and subscribe to the reply topic. Raises :class:`InferenceTransportError`."""
        try:
            self.mqtt.set_handler(self._on_reply)
            await self.mqtt.subscribe(
                Subscription(self.reply_topic, qos=1, retain_handling=RETAIN_DO_NOT_SEND)
            )
            await self.mqtt.connect()
        except MqttError as e:
            raise InferenceTransportError(f"cannot connect: {e}") from e

    async def close(self) -> None:
        await self.mqtt.close()
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(InferenceTransportError("client closed"))

    async def __aenter__(self) -> InferenceClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _on_reply(self, msg: InboundMessage) -> None:
        """Resolve the waiting request whose correlation data ``msg`` carries; drop the rest."""
        if msg.topic != self.reply_topic:
            self._drop_reply("foreign_topic", msg)
            return
        fut = self._waiting.get(msg.correlation_data or b"")
        if fut is None:
            self._drop_reply("unmatched", msg)
        elif fut.done():
            self._drop_reply("duplicate", msg)
        else:
            fut.set_result(msg)

    def _drop_reply(self, reason: str, msg: InboundMessage) -> None:
        self.dropped_replies[reason] += 1
        count = self.dropped_replies[reason]
        # Log the 1st, 2nd, 4th, 8th... of each reason: a flood of spoofed replies must not
        # become a flood of log lines, yet each kind shows up at once.
        if count & (count - 1) == 0:
            log.warning(
                "dropped a reply on %.120s: %s (%d so far; mcp-device %.64s)",
                msg.topic, reason, count, msg.user_property("mcp-device") or "not given",
            )  # fmt: skip

    async def infer(
        self,
        model: str,
        inputs: InputsLike,
        *,
        device: str | None = None,
        timeout_s: float = 5.0,
        version: str | None = None,
        priority: str | None = None,
        request_key: str | None = None,
        request_id: str | None = None,
        outputs: Sequence[str] | None = None,
        qos: int | None = None,
    ) -> InferResponse:
        """Send one request and return the agent's :class:`InferResponse`.

        Raises :class:`InferenceReplyError` (the agent's structured error),
        :class:`NoResponderError`, :class:`InferenceTimeoutError` or
        :class:`InferenceTransportError`.
        """
        msg = await self.infer_raw(
            model,
            build_request(inputs, request_id=request_id, outputs=outputs),
            device=device,
            timeout_s=timeout_s,
            version=version,
            priority=priority,
            request_key=request_key,
            qos=qos,
        )
        return parse_reply(msg)

    async def infer_raw(
        self,
        model: str,
        body: bytes,
        *,
        device: str | None = None,
        timeout_s: float = 5.0,
        version: str | None = None,
        priority: str | None = None,
        request_key: str | None = None,
        qos: int | None = None,
    ) -> InboundMessage:
        """Send a prepared body; return the reply message as received (for benchmarks)."""
        topic = topics.fleet_infer(model) if device is None else topics.device_infer(device, model)
        qos = self.qos if qos is None else qos
        props: list[tuple[str, str]] = [("timeout-ms", str(int(timeout_s * 1000)))]
        if version:
            props.append(("model-version", version))
        if priority:
            props.append(("priority", priority))
        if request_key:
            props.append(("request-key", request_key))
        corr = os.urandom(16)
        loop = asyncio.get_running_loop()
        reply: asyncio.Future[InboundMessage] = loop.create_future()
        self._waiting[corr] = reply
        # The agent gets timeout_s as its deadline; waiting a little longer lets its structured
        # "timeout" answer arrive instead of a local timeout.
        deadline = loop.time() + timeout_s + REPLY_GRACE_S
        try:
            try:
                ack = self.mqtt.publish_nowait(
                    topic,
                    body,
                    qos,
                    response_topic=self.reply_topic,
                    correlation_data=corr,
                    user_properties=props,
                    message_expiry_s=max(1, math.ceil(timeout_s)),
                )
                rc = await asyncio.wait_for(ack, timeout_s)
            except MqttError as e:
                raise InferenceTransportError(f"request on {topic} failed: {e}") from e
            except asyncio.TimeoutError:
                raise InferenceTimeoutError(f"the broker did not acknowledge {topic}") from None
            if rc == RC_NO_MATCHING_SUBSCRIBERS:
                where = f"device {device!r}" if device else "the fleet"
                raise NoResponderError(f"no agent of {where} serves model {model!r} right now")
            try:
                return await asyncio.wait_for(reply, max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                raise InferenceTimeoutError(
                    f"no reply from {topic} within {timeout_s + REPLY_GRACE_S} s"
                ) from None
        finally:
            self._waiting.pop(corr, None)


def parse_reply(msg: InboundMessage) -> InferResponse:
    """Turn a reply into an :class:`InferResponse` or raise :class:`InferenceReplyError`."""
    device = msg.user_property("mcp-device")
    try:
        doc = orjson.loads(msg.payload)
    except orjson.JSONDecodeError as e:
        raise InferenceClientError(f"reply is not JSON: {e}") from e
    try:
        if isinstance(doc, dict) and "error" in doc:
            raise InferenceReplyError(validate(doc, ErrorReply), device)
        return validate(doc, InferResponse)
    except MessageError as e:
        raise InferenceClientError(f"reply does not match the protocol: {e}") from e
