"""Many callers' dynamic-security commands in few messages: the provisioner's send queue.

Each caller of :meth:`CommandBatcher.run` hands over its own list of commands (a *unit*: the
commands of one account change, answered together) and gets back one answer per command, in
order. Units queue; one message at a time is in flight. The first unit to arrive while nothing
is in flight opens a window of ``window_s`` seconds, and every unit that arrives before it
closes (or until ``max_commands`` commands are queued) goes into the same
``{"commands": [...]}`` message; units that arrive while a message is in flight go together
into the next one, sent as soon as the answer to the current one is in. So a burst of
enrollments costs one message per window instead of two per device, and a single revocation
waits at most one window and the message ahead of it.

Mosquitto runs the commands of one message in order, each on its own, and answers with one
result per command, tagged with the command's ``correlationData`` (``{message id}:{index}``);
a command that fails fails only its own caller. Mosquitto 2.0.x rewrites its whole JSON file
after every command that changes something, whatever the message that carried it (2.1 does
it once per message), so on 2.0 a message's time grows with the changes it holds: the
deadline of a message is ``timeout_s`` per unit it carries.

No I/O here: the provisioner gives ``send`` (publish one payload on the command topic, raising
:class:`~mcp_edge.shared.mqtt.MqttError`) and feeds every payload read on the response topic to
:meth:`take_answers`. Everything runs on the event loop that created the batcher's first
future.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from mcp_edge.controlplane.broker.base import BrokerAdminError
from mcp_edge.shared.mqtt import MqttError

Command = dict[str, Any]

_log = logging.getLogger(__name__)


@dataclass
class _Unit:  # one caller's commands and the future its answers go to
    commands: list[Command]
    future: asyncio.Future[list[Command]]


@dataclass
class _Message:  # a published message waiting for its answers, by command index
    id: str
    units: list[_Unit]
    size: int
    answers: dict[int, Command] = field(default_factory=dict)
    deadline: asyncio.TimerHandle | None = None


def _names(units: Sequence[_Unit]) -> str:
    names = sorted({c["command"] for unit in units for c in unit.commands})
    return ", ".join(names)


class CommandBatcher:
    """Queues command units and sends them, merged, one message in flight at a time.

    ``send`` publishes one payload; ``timeout_s`` is the time allowed per unit of a message
    for its answer (seconds); ``window_s`` how long the first unit of a message waits for
    others (seconds); ``max_commands`` the most commands one message carries (a larger unit
    goes alone); ``where`` names the broker in error messages.
    """

    def __init__(
        self,
        send: Callable[[bytes], None],
        *,
        timeout_s: float,
        window_s: float,
        max_commands: int,
        where: str,
    ) -> None:
        if max_commands < 1 or window_s < 0 or timeout_s <= 0:
            raise ValueError("max_commands must be >= 1, window_s >= 0 and timeout_s > 0")
        self._send = send
        self._timeout_s = timeout_s
        self._window_s = window_s
        self._max_commands = max_commands
        self._where = where
        self._queue: deque[_Unit] = deque()
        self._queued_commands = 0
        self._in_flight: _Message | None = None
        self._flush: asyncio.Handle | None = None
        self.messages_sent = 0
        """Messages published on the command topic so far."""
        self.commands_sent = 0
        """Commands those messages carried."""

    async def run(self, commands: Sequence[Command]) -> list[Command]:
        """Send ``commands`` (in the next message) and return one answer per command, in order.

        Raises :class:`BrokerAdminError`: the message could not be sent, was not answered in
        time, or :meth:`fail_all` was called while it waited.
        """
        loop = asyncio.get_running_loop()
        unit = _Unit([dict(c) for c in commands], loop.create_future())
        if not unit.commands:
            return []
        self._queue.append(unit)
        self._queued_commands += len(unit.commands)
        self._schedule(loop)
        return await unit.future

    def take_answers(self, payload: bytes) -> None:
        """Match the answers in one payload from the response topic to their callers. Answers
        to a message that timed out, or that no one here sent, are ignored."""
        try:
            responses = json.loads(payload)["responses"]
            for answer in responses:
                message_id, _, index = str(answer.get("correlationData", "")).partition(":")
                message = self._in_flight
                if message is None or message.id != message_id or not index.isdigit():
                    continue
                if int(index) < message.size:
                    message.answers[int(index)] = answer
        except (ValueError, KeyError, TypeError, AttributeError):
            _log.warning("dropped a malformed dynsec answer (%d bytes)", len(payload))
            return
        message = self._in_flight
        if message is not None and len(message.answers) == message.size:
            self._finish(message)
            offset = 0
            for unit in message.units:
                size = len(unit.commands)
                if not unit.future.done():
                    unit.future.set_result([message.answers[offset + i] for i in range(size)])
                offset += size

    def fail_all(self, error: BrokerAdminError) -> None:
        """Fail the message in flight and every queued unit with ``error`` (the session was
        lost or closed)."""
        message, self._in_flight = self._in_flight, None
        if message is not None and message.deadline is not None:
            message.deadline.cancel()
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        units = [*(message.units if message else ()), *self._queue]
        self._queue.clear()
        self._queued_commands = 0
        for unit in units:
            if not unit.future.done():
                unit.future.set_exception(error)

    # ---- on the loop --------------------------------------------------------------------------

    def _schedule(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._in_flight is not None:
            return  # sent when the answer to the message in flight is in
        if self._queued_commands >= self._max_commands:
            if self._flush is not None:
                self._flush.cancel()
            self._flush = loop.call_soon(self._send_next)
        elif self._flush is None:
            self._flush = loop.call_later(self._window_s, self._send_next)

    def _finish(self, message: _Message) -> None:
        """``message`` is answered or given up: let the next one go."""
        if message.deadline is not None:
            message.deadline.cancel()
        if self._in_flight is message:
            self._in_flight = None
        if self._queue:
            loop = asyncio.get_running_loop()
            self._flush = loop.call_soon(self._send_next)

    def _take_units(self) -> list[_Unit]:
        units: list[_Unit] = []
        size = 0
        while self._queue:
            unit = self._queue[0]
            if units and size + len(unit.commands) > self._max_commands:
                break
            self._queue.popleft()
            self._queued_commands -= len(unit.commands)
            if not unit.future.done():  # a caller cancelled while queued sends nothing
                units.append(unit)
                size += len(unit.commands)
        return units

    def _send_next(self) -> None:
        self._flush = None
        if self._in_flight is not None:
            return
        units = self._take_units()
        if not units:
            return
        message = _Message(secrets.token_hex(8), units, sum(len(u.commands) for u in units))
        tagged = [
            {**command, "correlationData": f"{message.id}:{i}"}
            for i, command in enumerate(c for unit in units for c in unit.commands)
        ]
        try:
            # QoS 0: the answer is the acknowledgement, and no command lingers in a queue to be
            # replayed after a reconnect.
            self._send(json.dumps({"commands": tagged}).encode())
        except MqttError as e:  # not connected, or the message cannot be sent
            self._fail(units, BrokerAdminError(f"cannot send dynsec {_names(units)}: {e}"))
            self._finish(message)
            return
        self.messages_sent += 1
        self.commands_sent += message.size
        self._in_flight = message
        allowed = self._timeout_s * len(units)
        message.deadline = asyncio.get_running_loop().call_later(
            allowed, self._expire, message, allowed
        )

    def _expire(self, message: _Message, allowed: float) -> None:
        if self._in_flight is not message:
            return
        self._finish(message)
        self._fail(
            message.units,
            BrokerAdminError(
                f"the broker at {self._where} did not answer dynsec {_names(message.units)} "
                f"within {allowed:g} s"
            ),
        )

    @staticmethod
    def _fail(units: Sequence[_Unit], error: BrokerAdminError) -> None:
        for unit in units:
            if not unit.future.done():
                unit.future.set_exception(error)
