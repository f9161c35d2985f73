"""A session kept up: connect, restore subscriptions, announce, and reconnect after a loss.

:class:`Session` drives one :class:`~mcp_edge.shared.mqtt.client.MqttClient` for as long as it
runs. Each attempt connects (the client restores its subscriptions in one SUBSCRIBE), checks
that the broker granted them (``require_subscriptions``), then awaits ``on_up`` (where a device
publishes its birth message: after the subscriptions, as Home Assistant does). When an attempt
fails or the connection ends, the session waits ``Backoff.next_delay()`` of its
:class:`~mcp_edge.shared.mqtt.reconnect.ReconnectPolicy` and tries again; a connection that
stayed up ``stable_after_s`` resets the backoff. The control plane's sessions, the broker admin
session and the agent's fleet session all reconnect through this class, each with its policy.

:attr:`Session.up` and :attr:`Session.problem` say whether the session is usable and, if not,
why (a refused login, an unreachable broker), for readiness checks and metrics.
``on_subscribed`` runs on the loop inside the read that brought the SUBACK of every
(re)subscription the broker granted whole, before the retained messages that follow it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Callable

from mcp_edge.shared.mqtt.client import MqttClient
from mcp_edge.shared.mqtt.errors import (
    MqttConnectError,
    MqttError,
    MqttRefusedError,
    MqttTimeoutError,
)
from mcp_edge.shared.mqtt.reconnect import Backoff, ReconnectPolicy
from mcp_edge.shared.mqtt.values import ConnectResult

log = logging.getLogger("mcp.mqtt")
_RC_NOT_AUTHORIZED = 0x87


class Session:
    """Keeps ``client`` connected (see the module docstring). Use from one event loop.

    Hooks, all called on the loop: ``on_up(result)`` after each connect (awaited; raising
    :class:`MqttError` there counts as a failed attempt: the connection is dropped and retried),
    ``on_down(reason)`` when a connection that was up ended, ``on_failed(error)`` for each
    failed attempt, ``on_subscribed()`` (see the module docstring). ``sleep`` waits between
    attempts (tests pass a gate). ``end_session_on_close``: :meth:`close` sends DISCONNECT with
    a session expiry of 0, so the broker drops the session (and its share of shared
    subscriptions) at once instead of at its expiry.
    """

    def __init__(
        self,
        client: MqttClient,
        *,
        name: str,
        policy: ReconnectPolicy | None = None,
        rng: random.Random | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        on_up: Callable[[ConnectResult], Awaitable[None]] | None = None,
        on_down: Callable[[str], None] | None = None,
        on_failed: Callable[[MqttError], None] | None = None,
        on_subscribed: Callable[[], None] | None = None,
        require_subscriptions: bool = True,
        end_session_on_close: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.name = name
        self.policy = policy or ReconnectPolicy()
        self.backoff = Backoff(self.policy, rng)
        self._sleep = sleep
        self._on_up = on_up
        self._on_down = on_down
        self._on_failed = on_failed
        self._require_subscriptions = require_subscriptions
        self._end_session = end_session_on_close
        self._clock = clock
        if on_subscribed is not None:
            hook = on_subscribed
            client.set_restored_hook(lambda refused: None if refused else hook())
        self._keeper: asyncio.Task[None] | None = None
        self._up = False
        self._up_event = asyncio.Event()
        self._problem: str | None = "not started"
        self._failures = 0  # failed attempts in a row
        self._started = False
        self._closed = False

    @property
    def where(self) -> str:
        return self.client.where

    @property
    def up(self) -> bool:
        """Whether the session is connected, subscribed and announced right now."""
        return self._up and not self._closed and self.client.connected

    @property
    def problem(self) -> str | None:
        """Why the session is not up (a refused login, an unreachable broker); None when up."""
        if self.up:
            return None
        return "closed" if self._closed else (self._problem or "connecting")

    # ------------------------------------------------------------------ lifecycle
    async def start(self, *, wait: bool = True) -> None:
        """Start keeping the session up.

        With ``wait`` the first attempt happens now and its failure is raised (nothing is left
        running): :class:`MqttConnectError`, :class:`MqttRefusedError` (a subscription),
        :class:`MqttConnectionLostError` or :class:`MqttTimeoutError`, or what ``on_up``
        raised. Without it, attempts run in the background from the start.
        """
        if self._started:
            raise MqttError(f"the {self.name} session was already started")
        self._started = True
        if wait:
            await self._attempt()
        self._keeper = asyncio.get_running_loop().create_task(
            self._keep(connected=wait), name=f"mqtt-{self.name}"
        )

    async def stop_reconnecting(self) -> None:
        """Stop the keeper; the connection, if up, stays open (for a last publish)."""
        task, self._keeper = self._keeper, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def close(self) -> None:
        """Stop reconnecting and disconnect (see ``end_session_on_close``). Safe twice."""
        if self._closed:
            return
        self._closed = True
        await self.stop_reconnecting()
        self._up = False
        self._up_event.clear()
        await self.client.close(session_expiry_s=0 if self._end_session else None)

    async def wait_up(self, timeout_s: float) -> None:
        """Wait until the session is up. Raises :class:`MqttTimeoutError` after ``timeout_s``."""
        try:
            await asyncio.wait_for(self._up_event.wait(), timeout_s)
        except asyncio.TimeoutError:
            raise MqttTimeoutError(
                f"no {self.name} session to the broker at {self.where} within {timeout_s} s"
                f" ({self.problem})"
            ) from None

    # ------------------------------------------------------------------ the keeper
    async def _keep(self, *, connected: bool) -> None:
        while True:
            if not connected:
                with contextlib.suppress(Exception):  # _attempt logged it and set the problem
                    await self._attempt()
                    connected = True
            if connected:
                up_since = self._clock()
                why = await self.client.wait_disconnected()
                self._down(why)
                if self._clock() - up_since >= self.policy.stable_after_s:
                    self.backoff.reset()
                connected = False
            await self._sleep(self.backoff.next_delay())

    async def _attempt(self) -> ConnectResult:
        try:
            result = await self.client.connect()
            if result.refused and self._require_subscriptions:
                raise MqttRefusedError(
                    f"the broker at {self.where} refused the subscription(s) "
                    f"{list(result.refused)}", _RC_NOT_AUTHORIZED,
                )  # fmt: skip
            if self._on_up is not None:
                await self._on_up(result)
        except MqttError as e:
            await self.client.disconnect()
            self._failed(e)
            raise
        except Exception as e:  # a bug in a hook: log it, and keep trying like any failure
            await self.client.disconnect()
            log.exception("%s session: unexpected error while connecting", self.name)
            self._problem = f"unexpected error while connecting: {e!r}"
            raise
        except BaseException:
            await self.client.disconnect()
            raise
        if self._failures or self.backoff.attempt:
            log.info("%s session to %s up again", self.name, self.where)
        self._failures = 0
        self._up, self._problem = True, None
        self._up_event.set()
        return result

    def _down(self, why: str) -> None:
        self._up = False
        self._up_event.clear()
        self._problem = f"connection to the broker at {self.where} lost: {why}"
        log.warning("%s session to %s lost (%s); reconnecting", self.name, self.where, why)
        if self._on_down is not None:
            self._on_down(why)

    def _failed(self, e: MqttError) -> None:
        self._problem = str(e)
        self._failures += 1
        if isinstance(e, MqttConnectError) and e.auth_refused:
            level = logging.ERROR
        else:
            level = logging.WARNING if self._failures == 1 else logging.INFO
        log.log(level, "%s session (attempt %d): %s", self.name, self._failures, e)
        if self._on_failed is not None:
            self._on_failed(e)
