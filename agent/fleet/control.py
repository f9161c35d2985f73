"""The control plane's two inbound channels to one device: ``desired`` and ``cmd``.

Both are untrusted input (DESIGN 5.3). Each message is size-capped, parsed as JSON and
schema-checked; a failure is counted in :class:`agent.fleet.metrics.FleetMetrics` by
``(channel, reason)`` with one log line, and the message is dropped. Reasons: ``too_large``,
``json``, ``schema``, ``signature``, ``replay``, ``expired``, ``refused``, ``unhandled``,
``handler_error``.

- A desired-state envelope (a JSON object) goes to the handler given, one at a time, in
  arrival order; the handler verifies it (signature, seq, expiry: see
  :func:`shared.protocol.verify_desired_state`) and raises an McpError to refuse it.
- A :class:`CommandRequest` runs its handler (unless expired) and is answered with a
  :class:`CommandReply` on ``dev/{id}/cmd/reply`` with the request's correlation data; an
  unknown command gets ``ok=false`` with ``unsupported``.

Nothing here loads pydantic until a command arrives (the command schema) or the desired-state
handler verifies a document (docs/agent.md "Memory").
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from mcp_edge.agent.fleet.metrics import FleetMetrics
from mcp_edge.shared.errors import (
    ExpiredError,
    MalformedSignatureError,
    McpError,
    MessageError,
    ReplayError,
    SigningError,
    TopicError,
)
from mcp_edge.shared.mqtt import InboundMessage, MqttClient, MqttError
from mcp_edge.shared.protocol import topics
from mcp_edge.shared.protocol.wire import CommandName, ErrorCode, loads

if TYPE_CHECKING:
    from mcp_edge.shared.protocol.command import CommandReply, CommandRequest

log = logging.getLogger("mcp.agent.fleet")

DesiredHandler = Callable[[Any], Awaitable[None]]
"""Gets the parsed JSON of a desired-state envelope; raises an McpError to refuse it."""
CommandHandler = Callable[["CommandRequest"], Awaitable[dict[str, Any]]]
"""Runs a command; returns the reply's ``result``; raises an McpError to fail it."""


def refusal_reason(e: McpError) -> str:
    """The drop reason counted for an error a handler raised."""
    if isinstance(e, MessageError | TopicError | MalformedSignatureError):
        return "schema"
    if isinstance(e, SigningError):
        return "signature"
    if isinstance(e, ReplayError):
        return "replay"
    if isinstance(e, ExpiredError):
        return "expired"
    return "refused"


class ControlChannel:
    def __init__(
        self,
        device_id: str,
        mqtt: MqttClient,
        metrics: FleetMetrics,
        *,
        desired_handler: DesiredHandler | None,
        command_handlers: Mapping[CommandName, CommandHandler],
        max_desired_bytes: int,
        max_command_bytes: int,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.device_id = device_id
        self.mqtt = mqtt
        self.metrics = metrics
        self.desired_handler = desired_handler
        self.commands = dict(command_handlers)
        self.max_desired_bytes = max_desired_bytes
        self.max_command_bytes = max_command_bytes
        self.clock = clock
        self._desired_lock = asyncio.Lock()

    def _parse_json(self, channel: str, msg: InboundMessage, cap: int) -> Any:
        """Size cap and JSON; counts and returns None when either fails."""
        if len(msg.payload) > cap:
            self.metrics.drop(channel, "too_large", f"{len(msg.payload)} bytes > {cap}", msg.topic)
            return None
        try:
            return loads(msg.payload, max_bytes=cap)
        except MessageError as e:
            self.metrics.drop(channel, "json", str(e), msg.topic)
            return None

    async def on_desired(self, msg: InboundMessage) -> None:
        if not msg.payload:
            return  # a retained desired state was cleared
        doc = self._parse_json("desired", msg, self.max_desired_bytes)
        if doc is None:
            return
        if not isinstance(doc, dict):
            self.metrics.drop("desired", "schema", "not a JSON object", msg.topic)
            return
        if self.desired_handler is None:
            self.metrics.drop("desired", "unhandled", "no desired-state handler", msg.topic)
            return
        async with self._desired_lock:
            try:
                await self.desired_handler(doc)
            except McpError as e:
                self.metrics.drop("desired", refusal_reason(e), str(e), msg.topic)
            except Exception as e:
                log.exception("desired-state handler failed")
                self.metrics.drop("desired", "handler_error", repr(e), msg.topic)

    async def on_command(self, msg: InboundMessage) -> None:
        # The command schema (pydantic) loads with the first command, not with the session.
        from mcp_edge.shared.protocol.codec import encode, validate
        from mcp_edge.shared.protocol.command import CommandRequest

        doc = self._parse_json("cmd", msg, self.max_command_bytes)
        if doc is None:
            return
        try:
            req = validate(doc, CommandRequest)
        except MessageError as e:
            self.metrics.drop("cmd", "schema", str(e), msg.topic)
            return
        reply = await self.run(req)
        try:
            await self.mqtt.publish(
                topics.command_reply(self.device_id), encode(reply), 1,
                correlation_data=msg.correlation_data, content_type="application/json",
            )  # fmt: skip
        except MqttError as e:
            log.info("could not send the reply to command %s: %s", req.command_id, e)

    async def run(self, req: CommandRequest) -> CommandReply:
        """Run one command and build its reply (never raises)."""
        from mcp_edge.shared.protocol.command import CommandReply, ErrorReply

        def fail(code: ErrorCode, text: str) -> CommandReply:
            error = ErrorReply(error=text[:2000], code=code)
            return CommandReply(command_id=req.command_id, ok=False, error=error)

        if req.expires.timestamp() <= self.clock():
            return fail(ErrorCode.CONFLICT, f"command expired at {req.expires.isoformat()}")
        handler = self.commands.get(req.name)
        if handler is None:
            return fail(ErrorCode.UNSUPPORTED, f"command {req.name.value!r} is not supported")
        try:
            result = await handler(req)
        except McpError as e:
            return fail(ErrorCode.BAD_REQUEST, str(e))
        except Exception as e:
            log.exception("command %s failed", req.name.value)
            return fail(ErrorCode.INTERNAL, f"{type(e).__name__}: {e}")
        return CommandReply(command_id=req.command_id, ok=True, result=result)
