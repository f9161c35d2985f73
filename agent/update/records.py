"""The documents the update agent keeps on disk: deployment records, model indexes, install info.

    updates/{name}.json               :class:`UpdateRecord`, the state machine's record
    updates/prefetch/{name}.json      :class:`UpdateRecord` of the model's latest prefetch
    models/{name}/index.json          :class:`ModelIndex` (with its :class:`CanaryRef`)
    models/{name}/{version}/install.json  :class:`InstallInfo`

Pydantic models (read from disk, so validated), in a module of their own so that pydantic loads
with the first document read or written: :mod:`agent.update.store` and
:mod:`agent.update.machine` import this module only when they need one, and an agent whose state
directory holds no deployment never does (about 10 MiB of RSS saved; docs/agent.md "Memory").
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

from mcp_edge.agent.update.machine import TERMINAL, WORKING, Cause, Phase
from mcp_edge.shared.protocol.canary import DEFAULT_CANARY_POLICY, CanaryPolicy

MAX_JSON_BYTES = 64 * 1024
"""The largest index or install info read (bytes); a record has its own ``MAX_BYTES``."""


class UpdateRecord(BaseModel):
    """Everything the agent must know to resume or roll back one deployment after a crash.

    Stored as ``{state_dir}/updates/{model}.json``. Times are Unix seconds; ``timings_ms``
    holds how long each finished phase took, in milliseconds.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    MAX_BYTES: ClassVar[int] = 64 * 1024

    model: str = Field(min_length=1, max_length=128)
    role: str = Field(pattern=r"^(stable|canary|shadow|prefetch)$")
    """The role the version takes; ``prefetch``: installed and kept, never loaded."""
    from_version: str | None = None
    to_version: str = Field(min_length=1, max_length=128)
    target_path: str = Field(min_length=1, max_length=512)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    length: int = Field(gt=0)
    desired_seq: int = Field(ge=0)
    rollback: bool = False
    """The desired state marked this an explicit rollback (may go below the release counter)."""
    canary: CanaryPolicy | None = None
    """The policy the version serves under as a canary (None in the other roles)."""
    phase: Phase = Phase.IDLE
    failed_phase: Phase | None = None
    """The working phase the deployment failed in (what the rollback has to undo)."""
    attempts: int = Field(default=0, ge=0)
    bytes_done: int = Field(default=0, ge=0)
    started_at: float = 0.0
    phase_since: float = 0.0
    updated_at: float = 0.0
    timings_ms: dict[str, float] = Field(default_factory=dict)
    cause: Cause | None = None
    error: str | None = Field(default=None, max_length=2048)
    variant: str | None = Field(default=None, max_length=64)
    """The variant a deployment of the bundle's parts fetches and installs (chosen in
    ``downloading``, or by measurement in ``verifying``); None: the whole bundle."""
    failed_variants: dict[str, str] = Field(default_factory=dict, max_length=32)
    """Variants that failed loading or warm-up in this deployment and why; the next candidate
    is tried instead, and these are not chosen again (docs/updates.md "Variants")."""

    @model_validator(mode="before")
    @classmethod
    def _flat_canary_fields(cls, data: Any) -> Any:
        # Records written before the policy was one value held its weight and error budget as
        # two flat fields; a deployment interrupted across the upgrade resumes with them.
        if isinstance(data, dict) and ("canary_weight" in data or "max_error_rate" in data):
            data = dict(data)
            flat = {
                "weight": data.pop("canary_weight", None),
                "max_error_rate": data.pop("max_error_rate", None),
            }
            if data.get("role") == "canary" and data.get("canary") is None:
                data["canary"] = {k: v for k, v in flat.items() if v is not None}
        return data

    @property
    def terminal(self) -> bool:
        return self.phase in TERMINAL

    @property
    def interrupted(self) -> bool:
        """True for a record a crash left mid-deployment."""
        return self.phase in WORKING or self.phase is Phase.ROLLING_BACK

    def to_bytes(self) -> bytes:
        return self.model_dump_json(indent=2).encode() + b"\n"

    @classmethod
    def from_bytes(cls, data: bytes) -> UpdateRecord:
        """Parse a stored record; raises ValueError when it is too large or malformed."""
        if len(data) > cls.MAX_BYTES:
            raise ValueError(f"update record of {len(data)} bytes is too large")
        return cls.model_validate_json(data)


class _Stored(BaseModel):
    """Base of the index and install info: strict about unknown fields, written indented."""

    model_config = ConfigDict(extra="forbid")
    MAX_BYTES: ClassVar[int] = MAX_JSON_BYTES

    def to_bytes(self) -> bytes:
        return self.model_dump_json(indent=2).encode() + b"\n"


class InstallInfo(_Stored):
    """``install.json``: what was verified before this version was installed."""

    name: str
    version: str
    version_numeric: int = Field(ge=0)
    variant: str
    model_file: str
    target_path: str
    sha256: str
    length: int
    signer_keyid: str | None = None
    installed_at: float
    backend: str | None = None
    """The backend chosen at install (by measurement, or the first that fit); None: the
    profile's order at load time."""
    choice: dict[str, Any] | None = None
    """The measurement that chose ``variant`` and ``backend``, as reported in the events."""


class CanaryRef(_Stored):
    """The committed canary of a model: its version and the policy it serves under."""

    version: str
    policy: CanaryPolicy = DEFAULT_CANARY_POLICY

    @model_validator(mode="before")
    @classmethod
    def _flat_policy(cls, data: Any) -> Any:
        # Indexes written before the policy was one value held ``weight`` and
        # ``max_error_rate`` beside ``version``.
        if isinstance(data, dict) and "policy" not in data:
            flat = {k: data[k] for k in ("weight", "max_error_rate") if k in data}
            if flat:
                data = {**{k: v for k, v in data.items() if k not in flat}, "policy": flat}
        return data


class ModelIndex(_Stored):
    """What is committed for one model: the versions serving, the version prefetched and the
    release counter.

    ``release_counter`` is the highest ``version_numeric`` ever activated as stable; a version
    below it needs an explicit rollback (DESIGN 4.4). ``prefetch`` is the installed version the
    desired state asks to keep for a later switch; it is left out of the file while None, so an
    agent that predates it still reads the index.
    """

    name: str
    active: str | None = None
    previous: str | None = None
    canary: CanaryRef | None = None
    shadow: str | None = None
    release_counter: int = Field(default=0, ge=0)
    prefetch: str | None = None

    @model_serializer(mode="wrap")
    def _compact(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        if data.get("prefetch") is None:
            data.pop("prefetch", None)
        return data

    def referenced(self) -> set[str]:
        """Versions that must stay on disk (garbage collection keeps them)."""
        refs = {
            self.active,
            self.previous,
            self.shadow,
            self.canary.version if self.canary else None,
            self.prefetch,
        }
        return {v for v in refs if v is not None}


__all__ = ["MAX_JSON_BYTES", "CanaryRef", "InstallInfo", "ModelIndex", "UpdateRecord"]
