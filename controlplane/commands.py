"""Commands from the control plane to one device over MQTT (DESIGN 4.7, docs/hard-examples.md).

:meth:`DeviceCommands.send` publishes a :class:`~shared.protocol.command.CommandRequest` on
``mcp/v1/dev/{device}/cmd`` with the MQTT 5 response topic ``mcp/v1/dev/{device}/cmd/reply``
and 16 random bytes of correlation data (the request's ``command_id``), and waits for the
:class:`~shared.protocol.command.CommandReply`. The client's session, ``{replica}-cmd``,
subscribes to every device's reply topic (``mcp/v1/dev/+/cmd/reply``; the control plane's
broker role allows it, see :func:`controlplane.broker.acl.service_acls`), so every replica
sees every reply and keeps only those whose correlation data it sent.

A reply is untrusted input (DESIGN 5.3). Dropped, and counted in
``mcp_cp_command_replies_dropped_total{reason}``, without disturbing the wait:

    bad_topic          not a device's ``cmd/reply`` topic
    no_correlation     no correlation data
    unknown            correlation data this replica is not waiting for (late, or another
                       replica's)
    wrong_device       the correlation data of a request to another device: a device may
                       publish on its own reply topic only, so this reply was not its to give

Refused, which ends the wait with :class:`CommandReplyError` (the addressed device answered on
its own topic, with the request's correlation data, but unusably): ``too_large`` (over
``max_reply_bytes``), ``json``, ``schema`` (not a CommandReply), ``command_id`` (another
request's id). ``mcp_cp_commands_total{command,outcome}`` counts every send: ``ok``,
``failed`` (the device answered ``ok=false``), ``timeout``, ``refused``, ``unavailable``.

Errors (:class:`CommandError` and below): :class:`CommandUnavailableError` (no session, not
connected, the broker refused the publish, too many commands in flight: nothing reached the
device), :class:`CommandTimeoutError` (no valid reply in time: the device may be offline, busy,
or may still run it), :class:`CommandReplyError` (a reply that breaks the contract).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter

from mcp_edge.controlplane.broker.base import Credentials
from mcp_edge.controlplane.mqtt import BrokerAddress, MqttSubscriber
from mcp_edge.shared.errors import McpError, MessageError, TopicError
from mcp_edge.shared.mqtt import InboundMessage, MqttError
from mcp_edge.shared.protocol import topics
from mcp_edge.shared.protocol.codec import encode, validate
from mcp_edge.shared.protocol.command import CommandName, CommandReply, CommandRequest
from mcp_edge.shared.protocol.topics import Channel, DeviceTopic
from mcp_edge.shared.protocol.wire import loads

log = logging.getLogger("mcp.controlplane.commands")

DEFAULT_TIMEOUT_S = 10.0
MAX_TIMEOUT_S = 300.0
MAX_PENDING = 10_000
"""Commands one replica waits on at once; more are refused as unavailable."""
LOG_INTERVAL_S = 10.0


class CommandError(McpError):
    """A command did not come back with a usable reply."""


class CommandUnavailableError(CommandError):
    """The command could not be sent (no broker session, not connected, refused)."""


class CommandTimeoutError(CommandError):
    """No valid reply came in time."""


class CommandReplyError(CommandError):
    """The device answered, but not with a valid reply to this command."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def commands_account_name(service_client_id: str) -> str:
    """The service account (and client id) of a replica's command session: ``{id}-cmd``,
    within the 64-character limit."""
    return f"{service_client_id[:60]}-cmd"


class CommandMetrics:
    """Prometheus families of device commands (on the control plane's registry)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = registry or CollectorRegistry()
        self.sent = Counter(
            "mcp_cp_commands_total",
            "Commands sent to devices, by how they ended.",
            ["command", "outcome"],
            registry=r,
        )
        self.dropped = Counter(
            "mcp_cp_command_replies_dropped_total",
            "Command replies dropped or refused, by reason.",
            ["reason"],
            registry=r,
        )


class CommandPublisher(Protocol):
    """What sending needs of a session (:class:`~controlplane.mqtt.MqttSubscriber` has it)."""

    @property
    def up(self) -> bool: ...

    @property
    def problem(self) -> str | None: ...

    async def publish(
        self,
        topic: str,
        payload: bytes,
        *,
        qos: int = 1,
        retain: bool = False,
        user_properties: Sequence[tuple[str, str]] = (),
        correlation_data: bytes | None = None,
        response_topic: str | None = None,
    ) -> None: ...


@dataclass
class _Pending:
    device_id: str
    command_id: str
    future: asyncio.Future[CommandReply]


class DeviceCommands:
    """Send commands to devices and wait for their replies (see the module docstring).

    ``start`` opens the client's own session; a test or another owner may instead hand an
    open session to :meth:`use_session` and route its messages to :meth:`on_message`.
    """

    def __init__(
        self,
        *,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.time,
        max_reply_bytes: int = CommandReply.MAX_BYTES,
    ) -> None:
        self.metrics = CommandMetrics(registry)
        self._clock = clock
        self._max_reply_bytes = max_reply_bytes
        self._pending: dict[bytes, _Pending] = {}
        self._session: CommandPublisher | None = None
        self._owned: MqttSubscriber | None = None
        self._logged_at: dict[str, float] = {}

    @staticmethod
    def filters() -> list[str]:
        """What the session subscribes to: every device's command reply topic."""
        return [topics.all_devices(Channel.COMMAND_REPLY)]

    @property
    def session(self) -> MqttSubscriber | None:
        """The session :meth:`start` opened (None before, after :meth:`stop`, or when
        another owner's session was handed in)."""
        return self._owned

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    async def start(self, address: BrokerAddress, credentials: Credentials) -> None:
        """Open the session ``commands``, subscribed to :meth:`filters`.

        Raises :class:`~shared.mqtt.MqttError` when the broker is unusable.
        """
        session = MqttSubscriber(
            address, credentials, self.filters(), on_message=self.on_message, name="commands"
        )
        await session.start()
        self._owned = session
        self.use_session(session)

    def use_session(self, session: CommandPublisher | None) -> None:
        """Publish requests through ``session`` (None: sending is unavailable)."""
        self._session = session

    async def stop(self) -> None:
        """Fail every wait with :class:`CommandUnavailableError` and close an owned session."""
        for pending in list(self._pending.values()):
            if not pending.future.done():
                pending.future.set_exception(
                    CommandUnavailableError("the control plane's command session closed")
                )
        self._pending.clear()
        self._session = None
        if self._owned is not None:
            await self._owned.close()
            self._owned = None

    async def send(
        self,
        device_id: str,
        name: CommandName,
        args: Mapping[str, Any] | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> CommandReply:
        """Send ``name`` with ``args`` to ``device_id`` and return its reply (``ok`` true or
        false: a device's refusal is an answer). The request expires ``timeout_s`` after it is
        issued, so a device that gets it later (a queued message) refuses it.

        Raises :class:`CommandUnavailableError`, :class:`CommandTimeoutError`,
        :class:`CommandReplyError`; :class:`~shared.errors.TopicError` for an invalid id;
        ``ValueError`` for a timeout outside (0, 300] s.
        """
        topics.validate_id(device_id, "device id")
        if not 0 < timeout_s <= MAX_TIMEOUT_S:
            raise ValueError(f"timeout_s must be in (0, {MAX_TIMEOUT_S:g}], not {timeout_s}")
        session = self._session
        if session is None or not session.up:
            why = "no broker session" if session is None else session.problem or "not connected"
            self._count(name, "unavailable")
            raise CommandUnavailableError(f"cannot send {name.value} to {device_id}: {why}")
        if len(self._pending) >= MAX_PENDING:
            self._count(name, "unavailable")
            raise CommandUnavailableError(
                f"cannot send {name.value} to {device_id}: {MAX_PENDING} commands in flight"
            )
        command_id = secrets.token_hex(16)
        correlation = bytes.fromhex(command_id)
        issued = datetime.fromtimestamp(self._clock(), timezone.utc)
        request = CommandRequest(
            command_id=command_id,
            name=name,
            args=dict(args or {}),
            issued_at=issued,
            expires=issued + timedelta(seconds=timeout_s),
        )
        future: asyncio.Future[CommandReply] = asyncio.get_running_loop().create_future()
        self._pending[correlation] = _Pending(device_id, command_id, future)
        try:
            try:
                await session.publish(
                    topics.command(device_id),
                    encode(request),
                    response_topic=topics.command_reply(device_id),
                    correlation_data=correlation,
                )
            except MqttError as e:
                self._count(name, "unavailable")
                raise CommandUnavailableError(
                    f"cannot send {name.value} to {device_id}: {e}"
                ) from e
            try:
                reply = await asyncio.wait_for(future, timeout_s)
            except TimeoutError:
                self._count(name, "timeout")
                raise CommandTimeoutError(
                    f"device {device_id} did not answer {name.value} within {timeout_s:g} s "
                    "(offline, busy, or its reply was refused)"
                ) from None
            except CommandReplyError:
                self._count(name, "refused")
                raise
        finally:
            self._pending.pop(correlation, None)
        self._count(name, "ok" if reply.ok else "failed")
        return reply

    def _count(self, name: CommandName, outcome: str) -> None:
        self.metrics.sent.labels(name.value, outcome).inc()

    # ------------------------------------------------------------------ replies
    def on_message(self, msg: InboundMessage) -> None:
        """Handle one message of the session (on the loop, inside the read)."""
        try:
            parsed = topics.parse(msg.topic)
        except TopicError:
            parsed = None
        if not isinstance(parsed, DeviceTopic) or parsed.channel is not Channel.COMMAND_REPLY:
            self._drop("bad_topic", msg.topic, "not a command reply topic")
            return
        if not msg.correlation_data:
            self._drop("no_correlation", msg.topic, "no correlation data")
            return
        pending = self._pending.get(bytes(msg.correlation_data))
        if pending is None or pending.future.done():
            self._drop("unknown", msg.topic, "correlation data of no command waiting here")
            return
        if parsed.device_id != pending.device_id:
            self._drop(
                "wrong_device",
                msg.topic,
                f"the reply to a command sent to {pending.device_id} came from {parsed.device_id}",
            )
            return
        try:
            reply = self._parse(msg.payload, pending.command_id)
        except CommandReplyError as e:
            self._drop(e.reason, msg.topic, str(e))
            pending.future.set_exception(
                CommandReplyError(f"device {pending.device_id}: {e}", e.reason)
            )
            return
        pending.future.set_result(reply)

    def _parse(self, payload: bytes, command_id: str) -> CommandReply:
        if len(payload) > self._max_reply_bytes:
            raise CommandReplyError(
                f"reply of {len(payload)} bytes exceeds the {self._max_reply_bytes}-byte limit",
                "too_large",
            )
        try:
            doc = loads(payload, max_bytes=self._max_reply_bytes)
        except MessageError as e:
            raise CommandReplyError(f"reply is not JSON: {e}", "json") from e
        try:
            reply = validate(doc, CommandReply)
        except MessageError as e:
            raise CommandReplyError(f"invalid reply: {e}", "schema") from e
        if reply.command_id != command_id:
            raise CommandReplyError(
                f"reply names command {reply.command_id}, not {command_id}", "command_id"
            )
        return reply

    def _drop(self, reason: str, topic: str, detail: str) -> None:
        self.metrics.dropped.labels(reason).inc()
        now = time.monotonic()
        if now - self._logged_at.get(reason, -LOG_INTERVAL_S) >= LOG_INTERVAL_S:
            self._logged_at[reason] = now
            log.warning("commands: dropped a reply on %.120s (%s): %.200s", topic, reason, detail)
