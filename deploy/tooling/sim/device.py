"""One simulated device: a real MQTT session through the project's adapter, and small state.

Per device the simulator holds one :class:`~mcp_edge.shared.mqtt.MqttClient` kept up by a
:class:`~mcp_edge.shared.mqtt.Session` (no thread: every socket is watched by the one event
loop), what it runs per model (:class:`ModelState`), a few counters, and its outbound queue
while offline. What it says on the wire is what ``mcp-agent run`` says
(:mod:`agent.fleet.session`, :mod:`agent.update.updater`):

- connects with the agent's settings (:meth:`agent.fleet.session.FleetConfig.mqtt_settings`:
  clean_start off, session expiry, keep-alive, the retained ``offline`` will on
  ``dev/{id}/status``), subscribes to ``desired``, ``cmd`` and ``repo/reply`` (the last two
  never from retained messages), then publishes the retained ``online`` birth; the first
  connection of a run also publishes the reported state (the agent's start-up report);
- verifies each desired state (:func:`shared.protocol.state.verify_desired_state` with the
  director keys from enrollment, the seq above the last accepted), converges every model
  through :mod:`.deploy` and publishes the retained reported state; a refused document gives
  the agent's refusal event (phase ``idle``, cause ``desired_signature``/``_replay``/...);
- answers the ``ping`` and ``report_state`` commands; any other is ``unsupported``;
- sends health samples and inference statistics when the fleet's scheduler asks
  (:mod:`.runner`), deployment events and the reported state as they happen, all QoS 1.

While offline, events and the latest reported state wait in a small queue and go out after the
reconnect (the agent spools them on disk); health samples and statistics of that time are not
sent. It does not serve inference: no ``infer`` subscription, no model is run.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import deque
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from mcp_edge.agent import __version__ as agent_version
from mcp_edge.agent.fleet.session import AGENT_RECONNECT, OFFLINE, ONLINE, FleetConfig
from mcp_edge.agent.update.transport_mqtt import MqttRepoTransport
from mcp_edge.shared.errors import ExpiredError, McpError, MessageError, ReplayError, SigningError
from mcp_edge.shared.mqtt import (
    RETAIN_DO_NOT_SEND,
    ConnectResult,
    InboundMessage,
    MqttClient,
    MqttError,
    Session,
    Subscription,
)
from mcp_edge.shared.protocol import topics
from mcp_edge.shared.protocol.reports import (
    DeploymentPhase,
    EventOutcome,
    EventReport,
    HealthReport,
    InferenceReport,
    ModelStatusReport,
    StateReport,
    encode_report,
)
from mcp_edge.shared.protocol.wire import loads
from mcp_edge.tooling.sim.fleet import DeviceRecord
from mcp_edge.tooling.sim.traffic import Serving

if TYPE_CHECKING:
    from mcp_edge.tooling.sim.runner import FleetContext

log = logging.getLogger("mcp.sim.device")

MAX_DESIRED_BYTES = 512 * 1024
MAX_COMMAND_BYTES = 64 * 1024
MAX_QUEUED = 1024
"""Events waiting while offline, per device; older ones are dropped beyond (counted)."""
View = frozenset[tuple[str, str, str]]
"""What a reported state says, as ``(model, role, version)``; role ``failed`` for a version
whose last deployment failed."""


@dataclass(slots=True)
class ModelState:
    """What one model looks like on a simulated device (the agent's model index, in memory)."""

    name: str
    phase: DeploymentPhase = DeploymentPhase.IDLE
    active: str | None = None
    previous: str | None = None
    canary: str | None = None
    canary_weight: float = 0.0
    shadow: str | None = None
    prefetch: str | None = None
    installed: dict[str, str] = field(default_factory=dict)
    """version → sha256 of what is installed."""
    release_counter: int = 0
    last_error: str | None = None
    failed_version: str | None = None

    def referenced(self) -> set[str]:
        return {v for v in (self.active, self.previous, self.canary, self.shadow,
                            self.prefetch) if v is not None}  # fmt: skip

    def collect(self) -> None:
        """Forget installed versions no role names (the agent's garbage collection)."""
        keep = self.referenced()
        for version in [v for v in self.installed if v not in keep]:
            del self.installed[version]

    def as_json(self) -> dict[str, Any]:
        return {
            "active": self.active, "previous": self.previous, "canary": self.canary,
            "canary_weight": self.canary_weight, "shadow": self.shadow,
            "prefetch": self.prefetch, "installed": self.installed,
            "release_counter": self.release_counter, "phase": self.phase.value,
            "last_error": self.last_error, "failed_version": self.failed_version,
        }  # fmt: skip

    @classmethod
    def from_json(cls, name: str, doc: Mapping[str, Any]) -> ModelState:
        """Rebuild from :meth:`as_json`; raises ValueError/TypeError/KeyError when malformed."""
        phase = DeploymentPhase(doc.get("phase", "idle"))
        if phase not in (DeploymentPhase.IDLE, DeploymentPhase.ACTIVE, DeploymentPhase.FAILED):
            phase = DeploymentPhase.FAILED  # a run stopped mid-deployment: it did not finish
        installed = doc.get("installed") or {}
        if not isinstance(installed, dict):
            raise TypeError("installed must be an object")
        return cls(
            name=name, phase=phase, active=_opt(doc, "active"), previous=_opt(doc, "previous"),
            canary=_opt(doc, "canary"), canary_weight=float(doc.get("canary_weight") or 0.0),
            shadow=_opt(doc, "shadow"), prefetch=_opt(doc, "prefetch"),
            installed={str(k): str(v) for k, v in installed.items()},
            release_counter=int(doc.get("release_counter") or 0),
            last_error=_opt(doc, "last_error"), failed_version=_opt(doc, "failed_version"),
        )  # fmt: skip


def _opt(doc: Mapping[str, Any], name: str) -> str | None:
    value = doc.get(name)
    return None if value is None else str(value)


class SimDevice:
    """One simulated device (see the module docstring)."""

    __slots__ = (
        "_busy", "_desired", "_first_up", "_queue", "_reported_dirty", "_t_cmd", "_t_desired",
        "_t_events", "_t_repo", "_t_reported", "accepted_seq", "applied_seq", "client", "connected_at", "ctx",
        "device_id", "event_seq", "link", "models", "next_health", "next_stats", "online",
        "record", "repo", "started_at", "stats_interval_s", "view",
    )  # fmt: skip

    def __init__(self, record: DeviceRecord, ctx: FleetContext, saved: Mapping[str, Any]) -> None:
        self.record = record
        self.ctx = ctx
        self.device_id = record.device_id
        self.client: MqttClient | None = None
        self.link: Session | None = None
        self.repo: MqttRepoTransport | None = None
        self.online = False
        self.connected_at = 0.0
        self.started_at = time.time()
        self._first_up = True
        self._t_desired = topics.desired(self.device_id)
        self._t_cmd = topics.command(self.device_id)
        self._t_repo = topics.repo_reply(self.device_id)
        self._t_events = topics.events(self.device_id)
        self._t_reported = topics.reported(self.device_id)
        self._queue: deque[tuple[str, bytes, bool]] | None = None
        self._reported_dirty = False
        self._busy = False
        self._desired: Any = None
        self.view: View = frozenset()
        self.next_health = 0.0
        self.next_stats = 0.0
        self.stats_interval_s = ctx.stats_interval_s
        self.models: dict[str, ModelState] = {}
        self.accepted_seq = self.applied_seq = self.event_seq = 0
        self._restore(saved)

    # ------------------------------------------------------------------ persisted state
    def _restore(self, saved: Mapping[str, Any]) -> None:
        try:
            self.accepted_seq = int(saved.get("accepted_seq", 0))
            self.applied_seq = int(saved.get("applied_seq", 0))
            self.event_seq = int(saved.get("event_seq", 0))
            models = saved.get("models") or {}
            self.models = {
                topics.validate_id(name, "model name"): ModelState.from_json(name, doc)
                for name, doc in models.items()
            }
        except (ValueError, TypeError, KeyError, AttributeError, McpError) as e:
            log.warning("%s: saved state unusable (%s); starting empty", self.device_id, e)
            self.accepted_seq = self.applied_seq = 0
            self.models = {}

    def saved(self) -> dict[str, Any]:
        """What ``runtime.json`` keeps of this device."""
        return {
            "accepted_seq": self.accepted_seq, "applied_seq": self.applied_seq,
            "event_seq": self.event_seq,
            "models": {n: m.as_json() for n, m in self.models.items()},
        }  # fmt: skip

    # ------------------------------------------------------------------ session
    async def start(self) -> None:
        """Start connecting (in the background; the session keeps the connection up)."""
        if self.client is None:
            self.client = self._new_client()
            # Remembered, not sent yet: the client subscribes with each connect.
            await self.client.subscribe(
                Subscription(self._t_desired),
                Subscription(self._t_cmd, retain_handling=RETAIN_DO_NOT_SEND),
                Subscription(self._t_repo, retain_handling=RETAIN_DO_NOT_SEND),
            )
        self.link = Session(
            self.client, name=self.device_id, policy=AGENT_RECONNECT, rng=self.ctx.py_rng,
            on_up=self._came_online, on_down=self._went_offline,
            on_failed=lambda _e: self._went_offline(""), require_subscriptions=False,
        )  # fmt: skip
        await self.link.start(wait=False)

    def _new_client(self) -> MqttClient:
        host, port, tls = self.ctx.broker_of(self.record)
        config = FleetConfig(
            device_id=self.device_id, host=host, port=port, username=self.record.username,
            password=self.record.password, client_id=self.record.client_id, tls=tls,
            keepalive_s=self.ctx.keepalive_s,
        )  # fmt: skip
        client = MqttClient(config.mqtt_settings())
        client.set_handler(self._on_message)
        return client

    async def go_offline(self) -> None:
        """Leave like a stopping agent: retained ``offline``, then DISCONNECT."""
        link, client = self.link, self.client
        self.link = None
        if client is not None and client.connected:
            with contextlib.suppress(MqttError):
                await client.publish(topics.status(self.device_id), OFFLINE, 1, True,
                                     timeout_s=5.0)  # fmt: skip
        if link is not None:
            await link.close()
        self._went_offline("")

    async def _came_online(self, result: ConnectResult) -> None:
        assert self.client is not None
        await self.client.publish(topics.status(self.device_id), ONLINE, 1, True)
        self.online = True
        self.connected_at = time.time()
        self.ctx.came_online(self)
        if self._first_up:
            self._first_up = False
            self._reported_dirty = True
        self._drain()

    def _went_offline(self, _why: str) -> None:
        if self.online:
            self.online = False
            self.ctx.went_offline(self)

    # ------------------------------------------------------------------ outbound
    def _send(self, topic: str, payload: bytes, *, retain: bool = False, keep: bool = True,
              on_acked: Callable[[], None] | None = None) -> None:  # fmt: skip
        """Publish at QoS 1 now; ``keep``: queue it while offline and again if not acked."""
        client = self.client
        if client is None or not self.online:
            if keep:
                self._enqueue(topic, payload, retain)
            else:
                self.ctx.counters["telemetry_skipped_offline"] += 1
            return
        try:
            ack = client.publish_nowait(topic, payload, 1, retain)
        except MqttError:
            if keep:
                self._enqueue(topic, payload, retain)
            return
        self.ctx.counters["published"] += 1

        def done(fut: asyncio.Future[int]) -> None:
            if fut.cancelled() or fut.exception() is not None:
                self.ctx.counters["publish_failed"] += 1
                if keep:
                    self._enqueue(topic, payload, retain)
            elif on_acked is not None:
                on_acked()

        ack.add_done_callback(done)

    def _enqueue(self, topic: str, payload: bytes, retain: bool) -> None:
        if topic == self._t_reported:
            self._reported_dirty = True  # the latest is built again when the device is back
            return
        if self._queue is None:
            self._queue = deque()
        if len(self._queue) >= MAX_QUEUED:
            self._queue.popleft()
            self.ctx.counters["events_dropped"] += 1
        self._queue.append((topic, payload, retain))

    def _drain(self) -> None:
        queue, self._queue = self._queue, None
        while queue:
            topic, payload, retain = queue.popleft()
            self._send(topic, payload, retain=retain)
        if self._reported_dirty:
            self.report()

    def emit(self, model: str, version: str, phase: DeploymentPhase, outcome: EventOutcome,
             message: str = "", *, cause: str | None = None, bytes_done: int | None = None,
             bytes_total: int | None = None, elapsed_ms: float | None = None) -> None:  # fmt: skip
        """Send one deployment event (the flight recorder's, numbered per device)."""
        self.event_seq += 1
        event = EventReport(
            device_id=self.device_id, event_seq=self.event_seq, ts=time.time(), model=model,
            version=version, phase=phase, outcome=outcome, message=message[:2048], cause=cause,
            bytes_done=bytes_done, bytes_total=bytes_total, elapsed_ms=elapsed_ms,
        )  # fmt: skip
        self._send(self._t_events, encode_report(event))

    def report(self) -> None:
        """Send the retained reported state; the fleet counts it once the broker acked it."""
        self._reported_dirty = False
        models = []
        view: set[tuple[str, str, str]] = set()
        for name in sorted(self.models)[:64]:
            m = self.models[name]
            phase = m.phase
            if phase is DeploymentPhase.IDLE and m.active is not None:
                phase = DeploymentPhase.ACTIVE
            models.append(ModelStatusReport(
                name=name, phase=phase, active_version=m.active, canary_version=m.canary,
                shadow_version=m.shadow, installed_versions=sorted(m.installed)[:16],
                last_error=m.last_error if phase is DeploymentPhase.FAILED else None,
            ))  # fmt: skip
            for role, version in (("active", m.active), ("canary", m.canary),
                                  ("shadow", m.shadow), ("failed", m.failed_version)):  # fmt: skip
                if version is not None:
                    view.add((name, role, version))
        state = StateReport(
            device_id=self.device_id, ts=time.time(), applied_seq=self.applied_seq,
            profile=self.ctx.profile, agent_version=agent_version, models=models,
        )  # fmt: skip
        seen = frozenset(view)

        def acked() -> None:
            self.ctx.tracker.move(self.view, seen)
            self.view = seen

        self._send(self._t_reported, encode_report(state), retain=True,
                   on_acked=acked)  # fmt: skip

    def send_health(self, sample: HealthReport) -> None:
        counters = self.ctx.counters

        def acked() -> None:  # the broker took it: the control plane must store it
            counters["health_acked"] += 1

        if self.client is not None and self.online:
            counters["health_sent"] += 1
        self._send(topics.telemetry(self.device_id, "health"), encode_report(sample), keep=False,
                   on_acked=acked)  # fmt: skip

    def send_stats(self, stats: InferenceReport) -> None:
        self._send(topics.telemetry(self.device_id, "inference"), encode_report(stats),
                   keep=False)  # fmt: skip

    def serving(self) -> list[Serving]:
        """What each model serves now (for the traffic it reports)."""
        return [
            Serving(m.name, m.active, m.canary, m.canary_weight, m.shadow)
            for m in self.models.values()
            if m.active is not None
        ]

    # ------------------------------------------------------------------ inbound
    def _on_message(self, msg: InboundMessage) -> None:
        topic = msg.topic
        if topic == self._t_repo:
            if self.repo is not None:
                self.repo.handle_reply(msg)
            else:
                self.ctx.counters["repo_reply_unexpected"] += 1
        elif topic == self._t_desired:
            self._on_desired(msg.payload)
        elif topic == self._t_cmd:
            self.ctx.spawn(self._on_command(msg))
        else:
            self.ctx.counters["dropped_unknown_topic"] += 1

    def transport(self) -> MqttRepoTransport:
        """The device's repository transport on its MQTT client (made on first use)."""
        if self.repo is None:
            assert self.client is not None
            self.repo = MqttRepoTransport(self.client, self.device_id,
                                          loop=asyncio.get_running_loop())  # fmt: skip
        return self.repo

    def _on_desired(self, payload: bytes) -> None:
        if not payload:
            return  # a retained desired state was cleared
        if len(payload) > MAX_DESIRED_BYTES:
            self.ctx.counters["desired_too_large"] += 1
            return
        try:
            doc = loads(payload, max_bytes=MAX_DESIRED_BYTES)
        except MessageError:
            self.ctx.counters["desired_malformed"] += 1
            return
        if not isinstance(doc, dict):
            self.ctx.counters["desired_malformed"] += 1
            return
        self._desired = doc  # the newest waits; one that it replaces is never applied
        if not self._busy:
            self._busy = True
            self.ctx.spawn(self._apply_desired())

    async def _apply_desired(self) -> None:
        from mcp_edge.tooling.sim.deploy import converge

        try:
            while self._desired is not None:
                envelope, self._desired = self._desired, None
                state = self._verify(envelope)
                if state is not None:
                    self.ctx.deploying += 1
                    try:
                        await converge(self, state)
                    finally:
                        self.ctx.deploying -= 1
        except Exception:
            log.exception("%s: applying a desired state failed", self.device_id)
            self.ctx.counters["desired_internal_error"] += 1
        finally:
            self._busy = False

    def _verify(self, envelope: dict[str, Any]) -> Any:
        from mcp_edge.shared.protocol.state import verify_desired_state

        try:
            state = verify_desired_state(
                envelope, self.ctx.director_keys, device_id=self.device_id,
                last_seq=self.accepted_seq, now=datetime.now(timezone.utc),
            )  # fmt: skip
        except ReplayError:
            signed = envelope.get("signed")
            if isinstance(signed, dict) and signed.get("seq") == self.accepted_seq:
                return None  # the retained document again (a new subscription): accepted before
            self._refused(envelope, "desired_replay", "replayed")
            return None
        except McpError as e:
            cause = "desired_signature" if isinstance(e, SigningError) else (
                "desired_expired" if isinstance(e, ExpiredError) else "desired_invalid")  # fmt: skip
            self._refused(envelope, cause, str(e))
            return None
        self.accepted_seq = state.seq
        self.ctx.counters["desired_accepted"] += 1
        interval = state.telemetry.inference_interval_s
        if self.ctx.stats_interval_override is None and interval != self.stats_interval_s:
            # The policy's interval from now on: the window open now closes at the new one.
            self.stats_interval_s = interval
            if self.next_stats:
                self.next_stats = min(self.next_stats, time.time() + interval)
        return state

    def _refused(self, envelope: dict[str, Any], cause: str, why: str) -> None:
        self.ctx.counters["desired_refused"] += 1
        signed = envelope.get("signed")
        models = signed.get("models") if isinstance(signed, dict) else None
        for m in models[:64] if isinstance(models, list) else []:
            stable = m.get("stable") if isinstance(m, dict) else None
            name = m.get("name") if isinstance(m, dict) else None
            version = stable.get("version") if isinstance(stable, dict) else None
            if isinstance(name, str) and isinstance(version, str) and 5 <= len(version) <= 128:
                with contextlib.suppress(McpError):
                    topics.validate_id(name, "model name")
                    self.emit(name, version, DeploymentPhase.IDLE, EventOutcome.ERROR,
                              why, cause=cause)  # fmt: skip

    async def _on_command(self, msg: InboundMessage) -> None:
        from mcp_edge.shared.protocol.codec import encode, validate
        from mcp_edge.shared.protocol.command import (
            CommandName,
            CommandReply,
            CommandRequest,
            ErrorCode,
            ErrorReply,
        )

        if len(msg.payload) > MAX_COMMAND_BYTES:
            self.ctx.counters["command_too_large"] += 1
            return
        try:
            req = validate(loads(msg.payload, max_bytes=MAX_COMMAND_BYTES), CommandRequest)
        except MessageError:
            self.ctx.counters["command_malformed"] += 1
            return
        if req.expires.timestamp() <= time.time():
            reply = CommandReply(command_id=req.command_id, ok=False, error=ErrorReply(
                error="command expired", code=ErrorCode.CONFLICT))  # fmt: skip
        elif req.name is CommandName.PING:
            reply = CommandReply(command_id=req.command_id, ok=True, result={
                "pong": True, "ts": time.time(), "agent_version": agent_version,
                "models": sorted(self.models), "simulated": True})  # fmt: skip
        elif req.name is CommandName.REPORT_STATE:
            self.report()
            reply = CommandReply(command_id=req.command_id, ok=True,
                                 result={"applied_seq": self.applied_seq})  # fmt: skip
        else:
            reply = CommandReply(command_id=req.command_id, ok=False, error=ErrorReply(
                error=f"command {req.name.value!r} is not supported by the simulator",
                code=ErrorCode.UNSUPPORTED))  # fmt: skip
        if self.client is not None and self.online:
            with contextlib.suppress(MqttError):
                await self.client.publish(topics.command_reply(self.device_id), encode(reply), 1,
                                          correlation_data=msg.correlation_data,
                                          content_type="application/json")  # fmt: skip


def spawner(tasks: set[asyncio.Task[Any]]) -> Callable[[Coroutine[Any, Any, Any]], None]:
    """A fire-and-forget task starter that keeps a reference until each task ends and logs
    what one raised."""

    def spawn(coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        tasks.add(task)
        task.add_done_callback(_finished(tasks))

    return spawn


def _finished(tasks: set[asyncio.Task[Any]]) -> Callable[[asyncio.Task[Any]], None]:
    def done(task: asyncio.Task[Any]) -> None:
        tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("a simulator task failed: %r", task.exception())

    return done


def jitter(rng: random.Random, period_s: float) -> float:
    """A uniform offset in ``[0, period_s)``: spreads the fleet's periodic messages."""
    return rng.uniform(0.0, period_s)
