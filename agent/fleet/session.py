"""The agent's fleet session: one MQTT 5 session to the broker, kept up for as long as it runs.

What it does (DESIGN 4.2, 4.6, 4.7):

- Connects with the device's credentials, ``clean_start=False`` and a session expiry, a
  keep-alive and TCP_NODELAY; the will is a retained ``offline`` on ``dev/{id}/status``.
- Subscribes to its ``desired`` and ``cmd`` topics, its ``infer/+`` topics and the fleet's
  shared ``infer/{model}`` subscription for each model it serves; after every (re)connect the
  subscriptions are restored first, then the retained ``online`` birth is published.
- Reconnects through :class:`mcp_edge.shared.mqtt.Session` with ``FleetConfig.reconnect``
  (exponential backoff, full jitter; reset once a connection has stayed up ``stable_after_s``).
- Sends a health sample every ``health_interval_s`` and inference statistics every
  ``inference_interval_s`` (:attr:`FleetSession.inference_interval_s`: the configured value
  until a desired state the handler accepts sets it from its ``telemetry`` policy; the collector
  it hands the model manager counts HTTP and MQTT requests alike, per version and role; a
  window without requests sends nothing), and a drift report per window of each model version
  whose bundle has a baseline (:class:`agent.fleet.drift.DriftTracker`, handed to the model
  manager like the collector; its policy is the accepted desired state's ``telemetry.drift``).
  Everything that goes upstream (telemetry, deployment events, the
  reported state) is written to the on-disk :class:`agent.fleet.spool.Spool` first and published
  from there in order, deleted only once the broker acknowledged it; while offline the spool
  fills (dropping the oldest health samples first when full, never events) and drains after
  the reconnect.
- Answers ``cmd`` (``ping``, ``report_state``, ``upload_hard_examples``, plus handlers passed
  in) and inference requests
  (:mod:`agent.fleet.mqtt_inference`); hands verified-by-the-caller desired states to a handler
  and repository replies to the :class:`RepoReplies` given (the MQTT repository transport,
  which whoever wires the agent builds on this session's client: :mod:`agent.run`).
- Every inbound message is untrusted: a malformed, wrongly shaped or oversized one is counted
  (:class:`agent.fleet.metrics.FleetMetrics`), logged in one line and dropped; nothing a peer
  sends stops the session.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import ssl
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from mcp_edge.agent import __version__
from mcp_edge.agent.fleet.control import CommandHandler, ControlChannel, DesiredHandler
from mcp_edge.agent.fleet.drift import DriftTracker
from mcp_edge.agent.fleet.drift_report import DriftWindowReport
from mcp_edge.agent.fleet.metrics import FleetMetrics
from mcp_edge.agent.fleet.mqtt_inference import (
    DEFAULT_MAX_REPLY_BYTES,
    MqttInference,
    device_infer_filter,
    fleet_infer_filter,
)
from mcp_edge.agent.fleet.outbox import Outbox
from mcp_edge.agent.fleet.spool import Spool, SpoolKind
from mcp_edge.agent.fleet.telemetry import HealthCollector, InferenceStatsCollector
from mcp_edge.agent.runtime.manager import ModelManager
from mcp_edge.shared.errors import TopicError
from mcp_edge.shared.mqtt import (
    RETAIN_DO_NOT_SEND,
    ConnectResult,
    InboundMessage,
    MqttClient,
    MqttConnectError,
    MqttError,
    MqttRefusedError,
    MqttSettings,
    ReconnectPolicy,
    Session,
    Subscription,
    Will,
)
from mcp_edge.shared.protocol import topics
from mcp_edge.shared.protocol.reports import (
    EventReport,
    HealthReport,
    InferenceReport,
    StateReport,
    encode_report,
)
from mcp_edge.shared.protocol.wire import CommandName

if TYPE_CHECKING:
    from mcp_edge.shared.protocol.command import CommandRequest
    from mcp_edge.shared.protocol.state import DeploymentEvent, ReportedState
    from mcp_edge.shared.protocol.telemetry import DriftReport, HealthSample, InferenceStats

log = logging.getLogger("mcp.agent.fleet")

_NO_RETAINED = RETAIN_DO_NOT_SEND
ONLINE = b"online"
OFFLINE = b"offline"
AGENT_RECONNECT = ReconnectPolicy(
    first_delay_s=0.5, max_delay_s=60.0, jitter=1.0, stable_after_s=30.0
)
"""A device reconnects after 0-0.5 s, doubling to 0-60 s (full jitter: a fleet that lost its
broker does not come back in one wave); the count resets after 30 s up."""


class RepoReplies(Protocol):
    """Takes the replies on the device's ``repo/reply`` topic (the MQTT repository transport)."""

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Use ``loop``, the one the session's client runs on."""

    def handle_reply(self, msg: InboundMessage) -> None:
        """Called on the loop inside the read for each reply; must not block or raise."""


@dataclass(frozen=True)
class FleetConfig:
    """Everything the session needs to know; built once by the CLI."""

    device_id: str
    host: str = "127.0.0.1"
    port: int = 1883
    username: str | None = None
    password: str | None = None
    client_id: str | None = None
    """Defaults to the device id (the broker binds the id to the credentials)."""
    tls: ssl.SSLContext | None = None
    keepalive_s: int = 30
    session_expiry_s: int = 900
    health_interval_s: float = 30.0
    inference_interval_s: float = 60.0
    reconnect: ReconnectPolicy = AGENT_RECONNECT
    share_group: str = "agents"
    max_infer_bytes: int = 8 * 1024 * 1024
    """Largest inference request body answered over MQTT (bytes); bigger ones get too_large."""
    max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES
    """Largest inference answer sent over MQTT (bytes, 1 KiB to 32 MiB); a bigger one is
    replaced by a too_large error reply. Application clients accept the same default."""
    max_desired_bytes: int = 512 * 1024
    max_command_bytes: int = 64 * 1024
    drain_batch: int = 64
    ack_timeout_s: float = 30.0

    def mqtt_settings(self) -> MqttSettings:
        status = topics.status(self.device_id)
        return MqttSettings(
            host=self.host,
            port=self.port,
            client_id=self.client_id or self.device_id,
            username=self.username,
            password=self.password,
            keepalive_s=self.keepalive_s,
            clean_start=False,
            session_expiry_s=self.session_expiry_s,
            tls=self.tls,
            will=Will(status, OFFLINE, qos=1, retain=True),
            ack_timeout_s=self.ack_timeout_s,
            max_packet_bytes=self.max_infer_bytes * 2,
        )


class FleetSession:
    """The running session (see the module docstring). ``async with FleetSession(...)`` starts
    it and closes it gracefully (retained ``offline``, then DISCONNECT)."""

    def __init__(
        self,
        config: FleetConfig,
        *,
        spool: Spool,
        manager: ModelManager | None = None,
        health: HealthCollector | None = None,
        stats: InferenceStatsCollector | None = None,
        drift: DriftTracker | None = None,
        desired_handler: DesiredHandler | None = None,
        state_provider: Callable[[], StateReport | ReportedState] | None = None,
        command_handlers: Mapping[CommandName, CommandHandler] | None = None,
        metrics: FleetMetrics | None = None,
        mqtt: MqttClient | None = None,
        repo: RepoReplies | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``mqtt`` defaults to a client on ``config.mqtt_settings()``; ``repo`` gets the
        repository replies (built on the same client). ``sleep`` waits between connection
        attempts and ``rng`` draws their jitter (tests pass their own). ``drift`` defaults to a
        tracker that publishes through :meth:`publish_drift`."""
        self.config = config
        self.device_id = topics.validate_id(config.device_id, "device id")
        self.spool = spool
        self.manager = manager
        self.health = health or HealthCollector()
        self.stats = stats or InferenceStatsCollector()
        if manager is not None and manager.stats is None:
            manager.stats = self.stats  # every transport's requests, not only MQTT's
        self.drift = drift or DriftTracker(
            self.device_id,
            self.publish_drift,
            metrics=manager.metrics if manager is not None else None,
        )
        """Measures drift of the versions the manager runs (see :mod:`agent.fleet.drift`)."""
        if manager is not None and manager.drift is None:
            manager.drift = self.drift
        self.inference_interval_s = config.inference_interval_s
        """Seconds between inference statistics: the desired state's policy once one is
        accepted (:meth:`apply_telemetry_policy`)."""
        self._interval_changed = asyncio.Event()
        self.metrics = metrics or FleetMetrics()
        self.mqtt = mqtt or MqttClient(config.mqtt_settings())
        self.link = Session(
            self.mqtt, name="fleet", policy=config.reconnect, rng=rng, sleep=sleep,
            on_up=self._came_online, on_down=self._went_offline, on_failed=self._connect_failed,
            require_subscriptions=False,
        )  # fmt: skip
        """Keeps the connection up (reconnects with ``config.reconnect``)."""
        self._clock = clock
        self._state_provider = state_provider
        builtin: dict[CommandName, CommandHandler] = {
            CommandName.PING: self._ping,
            CommandName.UPLOAD_HARD_EXAMPLES: self.drift.upload_hard_examples,
        }
        if state_provider is not None:
            builtin[CommandName.REPORT_STATE] = self._report_state
        self.control = ControlChannel(
            self.device_id, self.mqtt, self.metrics,
            desired_handler=None if desired_handler is None else self._accepting(desired_handler),
            command_handlers={**builtin, **(command_handlers or {})},
            max_desired_bytes=config.max_desired_bytes,
            max_command_bytes=config.max_command_bytes, clock=clock,
        )  # fmt: skip
        self.inference = (
            MqttInference(
                manager,
                self.device_id,
                self.mqtt,
                metrics=self.metrics,
                max_request_bytes=config.max_infer_bytes,
                max_reply_bytes=config.max_reply_bytes,
            )
            if manager is not None
            else None
        )
        self.repo = repo
        """Where replies on ``repo/reply`` go (None: not subscribed)."""
        self.online = asyncio.Event()
        """Set while connected with subscriptions restored and the birth message sent."""
        self.outbox = Outbox(
            spool,
            self.mqtt,
            self.metrics,
            self.online,
            batch=config.drain_batch,
            ack_timeout_s=config.ack_timeout_s,
        )
        self.connections = 0
        self.health_samples = 0
        self._fleet_filters: set[str] = set()
        self._routes: list[tuple[str, Callable[[InboundMessage], Coroutine[Any, Any, None]]]] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._handlers: set[asyncio.Task[None]] = set()
        self._closing = False

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Remember the subscriptions and start connecting, sampling and draining."""
        t = topics
        # Requests and commands are never taken from retained messages (a retained request would
        # be answered again after every reconnect); the desired state is retained by design.
        subs = [
            Subscription(t.desired(self.device_id)),
            Subscription(t.command(self.device_id), retain_handling=_NO_RETAINED),
        ]
        if self.repo is not None:
            self.repo.bind(asyncio.get_running_loop())
            subs.append(Subscription(t.repo_reply(self.device_id), retain_handling=_NO_RETAINED))
        if self.inference is not None:
            subs.append(
                Subscription(device_infer_filter(self.device_id), retain_handling=_NO_RETAINED)
            )
        self.mqtt.set_handler(self._on_message)
        await self.mqtt.subscribe(*subs)
        await self.sync_models()
        await self.health.start()
        await self.drift.start()
        await self.link.start(wait=False)
        loop = asyncio.get_running_loop()
        for coro, name in (
            (self.outbox.run(), "fleet-drain"),
            (self._health_loop(), "fleet-health"),
            (self._stats_loop(), "fleet-stats"),
        ):
            self._tasks.append(loop.create_task(coro, name=name))

    async def close(self) -> None:
        """Stop: answer requests in progress, publish retained ``offline``, disconnect."""
        if self._closing:
            return
        self._closing = True
        await self.link.stop_reconnecting()
        # The open drift windows close now and go to the spool with the rest.
        try:
            await self.drift.close()
        except Exception:
            log.exception("closing the drift tracker failed")
        if self.manager is not None and self.manager.drift is self.drift:
            self.manager.drift = None
        keep = {"fleet-drain"}
        await _cancel([t for t in self._tasks if t.get_name() not in keep])
        if self.mqtt.connected:
            with contextlib.suppress(MqttError):
                if self._fleet_filters:
                    # Leave the share group first, so the broker stops routing requests here.
                    await self.mqtt.unsubscribe(*self._fleet_filters)
            if self.inference is not None:
                await self.inference.close()
            with contextlib.suppress(MqttError):
                await self.mqtt.publish(
                    topics.status(self.device_id), OFFLINE, 1, True, timeout_s=5.0
                )
        await _cancel(self._tasks)
        await _cancel(list(self._handlers))
        if self.manager is not None and self.manager.stats is self.stats:
            self.manager.stats = None
        self.online.clear()
        self.metrics.connected.set(0)
        await self.link.close()
        await self.health.close()
        await self.outbox.close()

    async def __aenter__(self) -> FleetSession:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def wait_online(self, timeout_s: float | None = None) -> None:
        """Wait until the session is online (raises TimeoutError after ``timeout_s``)."""
        await asyncio.wait_for(self.online.wait(), timeout_s)

    # ------------------------------------------------------------------ connection
    async def _came_online(self, result: ConnectResult) -> None:
        """Subscriptions are back: publish the retained birth, then drain the spool."""
        self.connections += 1
        self.metrics.connects.labels("ok").inc()
        await self.mqtt.publish(topics.status(self.device_id), ONLINE, 1, True)
        self.online.set()
        self.metrics.connected.set(1)
        log.info(
            "online as %s at %s:%s (session %s)",
            self.device_id,
            self.config.host,
            self.config.port,
            "resumed" if result.session_present else "new",
        )
        self.outbox.wake()

    def _went_offline(self, _why: str) -> None:
        self.online.clear()
        self.metrics.connected.set(0)

    def _connect_failed(self, e: MqttError) -> None:
        if isinstance(e, MqttConnectError):
            self.metrics.connects.labels("failed").inc()
        self._went_offline(str(e))

    # ------------------------------------------------------------------ models
    async def sync_models(self) -> None:
        """Hold one fleet shared subscription per model the manager serves (call after loads)."""
        if self.manager is None or self.inference is None:
            return
        group = self.config.share_group
        want = {fleet_infer_filter(m, group) for m in self.manager.names()}
        add, remove = want - self._fleet_filters, self._fleet_filters - want
        self._fleet_filters = want
        try:
            if add:
                await self.mqtt.subscribe(
                    *(Subscription(f, retain_handling=_NO_RETAINED) for f in sorted(add))
                )
            if remove:
                await self.mqtt.unsubscribe(*sorted(remove))
        except MqttRefusedError as e:
            log.error("fleet inference subscription refused: %s", e)
        except MqttError as e:
            log.info("fleet subscriptions change deferred to the next connection: %s", e)

    async def add_route(
        self,
        topic_filter: str,
        handler: Callable[[InboundMessage], Coroutine[Any, Any, None]],
        qos: int = 1,
    ) -> None:
        """Subscribe (kept across reconnects) and hand matching messages to ``handler``."""
        topics.validate_filter(topic_filter)
        self._routes.append((topic_filter, handler))
        await self.mqtt.subscribe(Subscription(topic_filter, qos))

    # ------------------------------------------------------------------ outbound (spooled)
    # Each takes the plain report (shared.protocol.reports: what the agent builds, encoded
    # without pydantic) or its pydantic model; both give the same bytes.
    async def publish_event(self, event: EventReport | DeploymentEvent) -> None:
        """Queue a deployment event; it is delivered even across outages, never dropped."""
        self._own(event.device_id)
        await self.enqueue(SpoolKind.EVENT, topics.events(self.device_id), encode_report(event))

    async def publish_reported(self, state: StateReport | ReportedState) -> None:
        """Queue the retained reported state (replaces an older one not yet sent)."""
        self._own(state.device_id)
        await self.enqueue(
            SpoolKind.STATE, topics.reported(self.device_id), encode_report(state), retain=True
        )

    async def publish_health(self, sample: HealthReport | HealthSample) -> None:
        self._own(sample.device_id)
        await self.enqueue(
            SpoolKind.HEALTH, topics.telemetry(self.device_id, "health"), encode_report(sample)
        )

    async def publish_inference_stats(self, stats: InferenceReport | InferenceStats) -> None:
        self._own(stats.device_id)
        payload = encode_report(stats)
        await self.enqueue(
            SpoolKind.INFERENCE, topics.telemetry(self.device_id, "inference"), payload
        )

    async def publish_drift(self, report: DriftWindowReport | DriftReport) -> None:
        """Queue one drift window (:mod:`agent.fleet.drift`); when the spool is over its bound,
        drift reports are dropped last among telemetry (oldest first)."""
        self._own(report.device_id)
        await self.enqueue(
            SpoolKind.DRIFT, topics.telemetry(self.device_id, "drift"), encode_report(report)
        )

    async def enqueue(
        self, kind: SpoolKind, topic: str, payload: bytes, *, retain: bool = False
    ) -> None:
        """Write to the spool and wake the drainer. A spool failure is logged, not raised."""
        await self.outbox.put(kind, topic, payload, retain)

    def _own(self, device_id: str) -> None:
        if device_id != self.device_id:
            raise ValueError(f"message for device {device_id!r} on {self.device_id!r}'s session")

    # ------------------------------------------------------------------ periodic telemetry
    async def sample_health(self) -> HealthReport:
        """Take one health sample now and queue it."""
        sample = await asyncio.to_thread(self.health.collect, self.device_id)
        await self.publish_health(sample)
        self.health_samples += 1
        return sample

    async def _health_loop(self) -> None:
        while True:
            try:
                await self.sample_health()
                await self.sync_models()
            except Exception:
                log.exception("health sample failed")
            await asyncio.sleep(self.config.health_interval_s)

    def _accepting(self, handler: DesiredHandler) -> DesiredHandler:
        """``handler``, then the telemetry policy of the desired state it accepted (returned
        without raising: verified, and for this device)."""

        async def handle(envelope: Any) -> None:
            await handler(envelope)
            self.apply_telemetry_policy(envelope)

        return handle

    def apply_telemetry_policy(self, envelope: Any) -> None:
        """Apply the ``signed.telemetry`` policy of an accepted desired-state envelope.

        Inference statistics are sent every ``inference_interval_s`` from now on (the window
        open now closes at the new interval); drift is measured under ``drift``
        (:class:`DriftPolicy`, see :meth:`DriftTracker.apply_policy`). A document without a
        field keeps what is in force; a value the schema refuses is logged and ignored."""
        signed = envelope.get("signed") if isinstance(envelope, dict) else None
        policy = signed.get("telemetry") if isinstance(signed, dict) else None
        if not isinstance(policy, dict):
            return
        if policy.get("drift") is not None:
            self._apply_drift_policy(policy["drift"])
        value = policy.get("inference_interval_s")
        if value is None:
            return
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not 1 <= value <= 86_400
        ):
            log.warning("desired state's inference_interval_s %r ignored", value)
            return
        if float(value) != self.inference_interval_s:
            log.info("inference statistics every %g s (desired state)", value)
            self.inference_interval_s = float(value)
            self._interval_changed.set()

    def _apply_drift_policy(self, value: Any) -> None:
        # The handler verified the document with pydantic already: no new import cost.
        from pydantic import ValidationError

        from mcp_edge.shared.protocol.state import DriftPolicy

        try:
            drift = DriftPolicy.model_validate(value)
        except ValidationError as e:
            errors = e.errors()
            why = (
                f"{'.'.join(str(p) for p in errors[0]['loc'])}: {errors[0]['msg']}"
                if errors
                else str(e)
            )
            log.warning("desired state's drift policy ignored: %s", why)
            return
        self.drift.apply_policy(drift)

    async def _stats_loop(self) -> None:
        loop = asyncio.get_running_loop()
        last = loop.time()
        while True:
            delay = last + self.inference_interval_s - loop.time()
            if delay > 0:
                self._interval_changed.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._interval_changed.wait(), delay)
                continue
            last = loop.time()
            try:
                snap = self.stats.snapshot(self.device_id, now=self._clock(), manager=self.manager)
                if snap.models:
                    await self.publish_inference_stats(snap)
            except Exception:
                log.exception("inference statistics failed")

    # ------------------------------------------------------------------ inbound
    def _on_message(self, msg: InboundMessage) -> None:
        try:
            self._dispatch(msg)
        except Exception:
            log.exception("failed to dispatch a message on %.120s", msg.topic)
            self.metrics.drop("any", "internal", "dispatch failed", msg.topic)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._handlers.add(task)
        task.add_done_callback(self._handlers.discard)

    def _dispatch(self, msg: InboundMessage) -> None:
        for topic_filter, handler in self._routes:
            if topics.matches(topic_filter, msg.topic):
                self._spawn(handler(msg))
                return
        try:
            parsed = topics.parse(msg.topic)
        except TopicError as e:
            self.metrics.drop("unknown", "topic", str(e), msg.topic)
            return
        if isinstance(parsed, topics.FleetInferTopic) and self.inference is not None:
            self.inference.submit(msg, parsed.model, fleet=True)
            return
        if isinstance(parsed, topics.DeviceTopic) and parsed.device_id == self.device_id:
            ch = parsed.channel
            if ch is topics.Channel.INFER and self.inference is not None:
                self.inference.submit(msg, str(parsed.detail), fleet=False)
                return
            if ch is topics.Channel.DESIRED:
                self._spawn(self.control.on_desired(msg))
                return
            if ch is topics.Channel.COMMAND:
                self._spawn(self.control.on_command(msg))
                return
            if ch is topics.Channel.REPO_REPLY and self.repo is not None:
                self.repo.handle_reply(msg)
                return
        self.metrics.drop("unknown", "topic", "no handler for this topic", msg.topic)

    async def _ping(self, req: CommandRequest) -> dict[str, Any]:
        models = self.manager.names() if self.manager else []
        return {"pong": True, "ts": self._clock(), "agent_version": __version__, "models": models}

    async def _report_state(self, req: CommandRequest) -> dict[str, Any]:
        assert self._state_provider is not None
        state = self._state_provider()
        await self.publish_reported(state)
        return {"applied_seq": state.applied_seq}

    # ------------------------------------------------------------------ status
    def status(self) -> dict[str, Any]:
        """A snapshot for logs and ``mcp-agent`` status output."""
        return {
            "device_id": self.device_id,
            "online": self.online.is_set(),
            "connections": self.connections,
            "tcp_nodelay": self.mqtt.tcp_nodelay,
            "spool_rows": self.spool.rows,
            "spool_dropped": dict(self.spool.dropped),
            "bad_messages": {f"{c}/{r}": n for (c, r), n in self.metrics.dropped.items()},
            "fleet_models": sorted(self._fleet_filters),
        }


async def _cancel(tasks: list[asyncio.Task[None]]) -> None:
    for t in tasks:
        t.cancel()
    if tasks:
        await asyncio.gather(*tasks, return_exceptions=True)
