"""Desired state (control plane → device), reported state and deployment events (device → CP).

A desired state is signed by the director key (``shared.signing`` envelope). A device applies
one only when :func:`verify_desired_state` passes: the signature is by a trusted director key,
the document is for this device, its ``seq`` is above the last one applied (no replay), and it
has not expired (no freeze).

The agent builds its reported state and events as the plain twins in
:mod:`shared.protocol.reports` (which also holds :class:`DeploymentPhase` and
:class:`EventOutcome`); the models here are their schema.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any, ClassVar

from pydantic import (
    AwareDatetime,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

from mcp_edge.shared.errors import ExpiredError, MessageError, ReplayError
from mcp_edge.shared.protocol.base import Identifier, Message, Sha256Hex, ShortText, VersionText
from mcp_edge.shared.protocol.canary import DEFAULT_CANARY_POLICY, MAX_CANARY_WINDOW, CanaryPolicy
from mcp_edge.shared.protocol.reports import DeploymentPhase, EventOutcome
from mcp_edge.shared.signing import PrivateKey, PublicKey, sign_document, verify_document


class TargetRef(Message):
    """One model version as a TUF target: where to fetch it and what it must hash to."""

    version: VersionText
    target_path: str = Field(min_length=1, max_length=512)
    sha256: Sha256Hex
    length: int = Field(gt=0)


_DEFAULT = DEFAULT_CANARY_POLICY
_JUDGING = ("min_requests", "window")
"""Policy fields newer than the first canary documents: left out when they hold the default."""


class CanarySpec(Message):
    """A candidate served beside stable, with its :class:`CanaryPolicy` fields beside ``target``
    (flat, as in documents that predate ``min_requests`` and ``window``; each field left out
    takes its default). Build one with :meth:`of`; read the policy as :attr:`policy`.

    ``min_requests`` and ``window`` are left out of the encoded document when they hold their
    defaults, so an agent that predates them still accepts a canary with the default judging.
    """

    target: TargetRef
    weight: float = Field(
        default=_DEFAULT.weight,
        ge=0.0,
        le=1.0,
        description="share of routed requests the canary answers, 0..1",
    )
    max_error_rate: float = Field(
        default=_DEFAULT.max_error_rate,
        ge=0.0,
        le=1.0,
        description="share of failed requests in the window that takes the canary out, 0..1",
    )
    min_requests: int = Field(
        default=_DEFAULT.min_requests,
        ge=1,
        le=MAX_CANARY_WINDOW,
        description="canary requests in the window before its error rate is judged",
    )
    window: int = Field(
        default=_DEFAULT.window,
        ge=1,
        le=MAX_CANARY_WINDOW,
        description="the canary's latest requests the error rate is taken over",
    )

    @model_validator(mode="after")
    def _judged(self) -> CanarySpec:
        _ = self.policy  # building it runs the policy's cross-field checks (ValueError)
        return self

    @model_serializer(mode="wrap")
    def _compact(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        for name in _JUDGING:
            if data.get(name) == getattr(_DEFAULT, name):
                del data[name]
        return data

    @property
    def policy(self) -> CanaryPolicy:
        return CanaryPolicy(self.weight, self.max_error_rate, self.min_requests, self.window)

    @classmethod
    def of(cls, target: TargetRef, policy: CanaryPolicy = DEFAULT_CANARY_POLICY) -> CanarySpec:
        """The spec serving ``target`` under ``policy``."""
        return cls(target=target, **policy.as_dict())


class BatchingPolicy(Message):
    max_batch_size: int = Field(default=32, ge=1, le=4096)
    max_queue_delay_ms: float = Field(default=2.0, ge=0.0, le=10_000.0)
    max_queue: int = Field(default=1024, ge=1, le=1_000_000)


class DesiredModel(Message):
    """What one model should look like on the device.

    ``prefetch`` names a version the device downloads, verifies as it would for an install and
    keeps installed without loading it (a staged rollout's prefetch stage: a later desired state
    makes it stable or canary and the switch needs no download). It differs from every version
    the model runs, and it is left out of the encoded document while None, so an agent that
    predates it still accepts documents without one.
    """

    name: Identifier
    stable: TargetRef
    canary: CanarySpec | None = None
    shadow: TargetRef | None = None
    rollback: bool = False
    """True when ``stable`` is deliberately older than what is installed (explicit rollback)."""
    batching: BatchingPolicy = Field(default_factory=BatchingPolicy)
    prefetch: TargetRef | None = None
    """Downloaded and verified ahead, not run: a version neither stable, canary nor shadow."""

    @model_validator(mode="after")
    def _one_candidate(self) -> DesiredModel:
        if self.canary is not None and self.shadow is not None:
            raise ValueError("a model takes a canary or a shadow, not both")
        if self.prefetch is not None:
            running = {self.stable.version, self.shadow.version if self.shadow else None,
                       self.canary.target.version if self.canary else None}  # fmt: skip
            if self.prefetch.version in running:
                raise ValueError(
                    f"prefetch {self.prefetch.version} is a version the model already runs"
                )
        return self

    @model_serializer(mode="wrap")
    def _compact(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        if data.get("prefetch") is None:
            data.pop("prefetch", None)
        return data


MAX_HARD_EXAMPLE_BUDGET = 512 * 1024
"""Raw bytes of hard examples one device sends per request: base64 in a command reply of at
most 1 MiB (:class:`shared.protocol.command.CommandReply`)."""


class DriftPolicy(Message):
    """How the agent measures drift of the versions it runs (docs/drift.md).

    A window closes after ``window_requests`` sampled requests or ``window_s`` seconds,
    whichever comes first (a window with no sample sends nothing). ``sample_every``: 1 in N
    answered requests is binned, so the cost stays bounded at any load. ``hard_examples``: keep
    up to ``hard_example_budget_bytes`` of inputs whose top score is at most
    ``hard_example_max_confidence``, sent only when the control plane asks.
    """

    enabled: bool = True
    window_requests: int = Field(default=200, ge=10, le=1_000_000)
    window_s: float = Field(default=300.0, ge=1.0, le=7 * 86_400.0)
    sample_every: int = Field(default=1, ge=1, le=1_000_000)
    hard_examples: bool = False
    hard_example_max_confidence: float = Field(default=0.5, gt=0.0, le=1.0)
    hard_example_budget_bytes: int = Field(default=256 * 1024, ge=0, le=MAX_HARD_EXAMPLE_BUDGET)


class TelemetryPolicy(Message):
    health_interval_s: float = Field(default=30.0, ge=1.0, le=86_400.0)
    inference_interval_s: float = Field(default=60.0, ge=1.0, le=86_400.0)
    drift: DriftPolicy = Field(default_factory=DriftPolicy)


class DesiredState(Message):
    """The signed document a device converges to."""

    MAX_BYTES: ClassVar[int] = 256 * 1024

    device_id: Identifier
    seq: int = Field(ge=1)
    issued_at: AwareDatetime
    expires: AwareDatetime
    models: list[DesiredModel] = Field(default_factory=list, max_length=64)
    telemetry: TelemetryPolicy = Field(default_factory=TelemetryPolicy)
    traceparent: str | None = Field(
        default=None, pattern=r"^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$"
    )
    """The W3C trace context of the deploy call that issued this state (tracing on at the
    control plane): the device's deployment spans continue that trace. Left out of the
    encoded document while None, so an agent that predates it accepts documents without."""

    @model_serializer(mode="wrap")
    def _compact(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        if data.get("traceparent") is None:
            data.pop("traceparent", None)
        return data

    @model_validator(mode="after")
    def _consistent(self) -> DesiredState:
        if self.expires <= self.issued_at:
            raise ValueError("expires must be after issued_at")
        names = [m.name for m in self.models]
        if len(names) != len(set(names)):
            raise ValueError("each model may appear once")
        return self


def sign_desired_state(state: DesiredState, *keys: PrivateKey) -> dict[str, Any]:
    """Signed envelope for publishing (retained) on the device's ``desired`` topic."""
    return sign_document(state.model_dump(mode="json"), *keys)


def verify_desired_state(
    envelope: object,
    director_keys: Mapping[str, PublicKey] | Iterable[PublicKey],
    *,
    device_id: str,
    last_seq: int,
    now: datetime,
) -> DesiredState:
    """Verify a desired-state envelope for ``device_id`` and return the state.

    Raises :class:`shared.errors.SigningError` subclasses for signature problems,
    :class:`MessageError` for schema problems or a document for another device,
    :class:`ReplayError` when ``seq <= last_seq``, :class:`ExpiredError` when expired.
    """
    signed = verify_document(envelope, director_keys)
    try:
        state = DesiredState.model_validate(signed)
    except ValueError as e:
        raise MessageError(f"desired state does not match its schema: {e}") from e
    if state.device_id != device_id:
        raise MessageError(f"desired state is for device {state.device_id!r}, not {device_id!r}")
    if state.seq <= last_seq:
        raise ReplayError(f"desired state seq {state.seq} is not above the applied {last_seq}")
    if now >= state.expires:
        raise ExpiredError(f"desired state seq {state.seq} expired at {state.expires.isoformat()}")
    return state


class ModelStatus(Message):
    name: Identifier
    phase: DeploymentPhase = DeploymentPhase.IDLE
    active_version: VersionText | None = None
    canary_version: VersionText | None = None
    shadow_version: VersionText | None = None
    installed_versions: list[VersionText] = Field(default_factory=list, max_length=16)
    last_error: ShortText | None = None
    active_variant: Identifier | None = None
    """The bundle variant the active version runs (``default``, ``int8``, a profile's tag)."""
    active_backend: str | None = Field(default=None, max_length=128)
    """``backend/provider`` the active version runs on (``openvino/CPU``)."""


class ReportedState(Message):
    """What the device says it runs (retained on its ``reported`` topic)."""

    device_id: Identifier
    ts: float = Field(description="Unix time, seconds")
    applied_seq: int = Field(ge=0)
    profile: Identifier
    backends: list[str] = Field(default_factory=list, max_length=16)
    agent_version: str = Field(default="", max_length=64)
    models: list[ModelStatus] = Field(default_factory=list, max_length=64)


class DeploymentEvent(Message):
    """One step of a deployment: the device's flight recorder.

    ``event_seq`` increases per device and survives restarts, so the control plane can store
    events idempotently and see gaps.
    """

    MAX_BYTES: ClassVar[int] = 16 * 1024

    device_id: Identifier
    event_seq: int = Field(ge=0)
    ts: float
    model: Identifier
    version: VersionText
    phase: DeploymentPhase
    outcome: EventOutcome
    message: ShortText = ""
    cause: str | None = Field(default=None, max_length=64)
    bytes_done: int | None = Field(default=None, ge=0)
    bytes_total: int | None = Field(default=None, ge=0)
    elapsed_ms: float | None = Field(default=None, ge=0)
