"""The update state machine (DESIGN 4.5): one transition table and the moves of the record.

Pure: no I/O here. The record itself (:class:`~agent.update.records.UpdateRecord`) is defined
with the other persisted documents in :mod:`agent.update.records`, :mod:`agent.update.store`
writes it to disk, :mod:`agent.update.steps` runs one handler per phase and
:mod:`agent.update.updater` drives deployments. Nothing here imports pydantic: an agent with no
deployment to run never loads it for the update machinery.

One deployment moves one model version into one role (stable, canary or shadow), or stores it
for a later switch without running it (the role ``prefetch``)::

    idle ─start─▶ downloading ─downloaded─▶ verifying ─verified─▶ installing ─installed─▶
    loading ─loaded─▶ warming ─warmed─▶ active

    installing ─stored─▶ idle                 (a prefetch: verified and installed, never loaded)
    downloading ─retry─▶ downloading          (transient: transport trouble, with backoff)
    loading | warming ─next_variant─▶ downloading  (the variant failed; fetch the next one)
    any working phase ─fail─▶ rolling_back ─rolled_back─▶ failed
    idle | active | failed ─start─▶ downloading  (the next deployment of the same model)

A fatal error (verification, signature, downgrade, profile, disk, load or warm-up failure)
rolls back; a transient one (the repository cannot be reached) retries and stays in
``downloading`` until the attempts run out, then rolls back too. The record is written
atomically *before* each step that changes the disk or what is served, so a crash resumes or
rolls back on the next start.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any

from mcp_edge.shared.errors import McpError
from mcp_edge.shared.protocol.reports import DeploymentPhase

if TYPE_CHECKING:
    from mcp_edge.agent.update.records import UpdateRecord
    from mcp_edge.shared.protocol.canary import CanaryPolicy

Phase = DeploymentPhase


class Trigger(str, enum.Enum):
    """What a phase handler reports when it is done."""

    START = "start"
    RETRY = "retry"
    DOWNLOADED = "downloaded"
    VERIFIED = "verified"
    INSTALLED = "installed"
    STORED = "stored"
    """A prefetch is installed and kept: it ends here, never loaded."""
    LOADED = "loaded"
    WARMED = "warmed"
    FAIL = "fail"
    ROLLED_BACK = "rolled_back"
    NEXT_VARIANT = "next_variant"
    """The variant installed from the bundle's parts failed loading or warm-up and another
    candidate is left: fetch that one (the record lists the failed variant)."""


WORKING = (Phase.DOWNLOADING, Phase.VERIFYING, Phase.INSTALLING, Phase.LOADING, Phase.WARMING)
"""Phases a deployment is in progress in (a record left in one of them was interrupted)."""
TERMINAL = (Phase.IDLE, Phase.ACTIVE, Phase.FAILED)
"""Phases a deployment rests in."""

TRANSITIONS: dict[tuple[Phase, Trigger], Phase] = {
    (Phase.IDLE, Trigger.START): Phase.DOWNLOADING,
    (Phase.ACTIVE, Trigger.START): Phase.DOWNLOADING,
    (Phase.FAILED, Trigger.START): Phase.DOWNLOADING,
    (Phase.DOWNLOADING, Trigger.RETRY): Phase.DOWNLOADING,
    (Phase.DOWNLOADING, Trigger.DOWNLOADED): Phase.VERIFYING,
    (Phase.VERIFYING, Trigger.VERIFIED): Phase.INSTALLING,
    (Phase.INSTALLING, Trigger.INSTALLED): Phase.LOADING,
    (Phase.INSTALLING, Trigger.STORED): Phase.IDLE,
    (Phase.LOADING, Trigger.LOADED): Phase.WARMING,
    (Phase.WARMING, Trigger.WARMED): Phase.ACTIVE,
    (Phase.LOADING, Trigger.NEXT_VARIANT): Phase.DOWNLOADING,
    (Phase.WARMING, Trigger.NEXT_VARIANT): Phase.DOWNLOADING,
    **{(p, Trigger.FAIL): Phase.ROLLING_BACK for p in WORKING},
    (Phase.ROLLING_BACK, Trigger.FAIL): Phase.FAILED,
    (Phase.ROLLING_BACK, Trigger.ROLLED_BACK): Phase.FAILED,
}
"""The whole machine: (phase, trigger) → next phase. Anything absent is a bug."""


class TransitionError(McpError, RuntimeError):
    """A handler asked for a transition the table does not have (a programming error)."""


def next_phase(phase: Phase, trigger: Trigger) -> Phase:
    """The phase after ``phase`` on ``trigger``; raises :class:`TransitionError` if none."""
    try:
        return TRANSITIONS[(phase, trigger)]
    except KeyError:
        raise TransitionError(f"no transition from {phase.value} on {trigger.value}") from None


class Cause(str, enum.Enum):
    """Why a deployment failed: the ``cause`` of its events and of its record."""

    TRANSPORT = "transport"
    """The repository could not be reached or stopped answering (transient: retried)."""
    TUF_EXPIRED = "tuf_expired"
    """Repository metadata is past its expiry (a freeze attack, or the repository is down)."""
    TUF_METADATA = "tuf_metadata"
    """Repository metadata failed TUF's checks (bad signature, rollback, wrong version)."""
    TARGET_MISSING = "target_missing"
    """The signed targets metadata does not list the target the desired state names."""
    TARGET_MISMATCH = "target_mismatch"
    """TUF lists the target with another sha256 or length than the desired state (mix-and-match)."""
    TOO_LONG = "too_long"
    """The repository sent more bytes than the target's length (endless data)."""
    HASH_MISMATCH = "hash_mismatch"
    """The downloaded bytes do not hash to what TUF signed (tampered in transit or at rest)."""
    PUBLISHER = "publisher"
    """The bundle is not signed by a publisher key the signed TUF metadata lists."""
    BUNDLE = "bundle"
    """The bundle is malformed or its files do not match its manifest."""
    MANIFEST_MISMATCH = "manifest_mismatch"
    """The bundle names another model or version than the one asked for."""
    NO_VARIANT = "no_variant"
    """No variant of the bundle runs on this device's hardware profile."""
    DOWNGRADE = "downgrade"
    """The version is below the release counter and the desired state is no explicit rollback."""
    DISK_FULL = "disk_full"
    """Not enough free disk for the download, or a write failed for lack of space."""
    LOAD_FAILED = "load_failed"
    """The model did not load, did not fit in memory, or failed its warm-up checks."""
    INTERRUPTED = "interrupted"
    """The agent stopped mid-deployment and the step could not be resumed safely."""
    INTERNAL = "internal"
    """An unexpected error in the agent itself."""

    @property
    def transient(self) -> bool:
        """True when retrying later may succeed without anything changing on the device."""
        return self is Cause.TRANSPORT


class UpdateError(McpError):
    """A deployment step failed; ``cause`` says why and decides retry (transient) or rollback."""

    def __init__(self, cause: Cause, message: str) -> None:
        super().__init__(message)
        self.cause = cause

    @property
    def transient(self) -> bool:
        return self.cause.transient


def advance(
    record: UpdateRecord,
    trigger: Trigger,
    *,
    now: float,
    cause: Cause | None = None,
    error: str | None = None,
    **changes: Any,
) -> UpdateRecord:
    """The record after ``trigger``: next phase, the time spent in the phase it leaves, and
    ``attempts``/``cause``/``error`` kept as the trigger implies. Raises :class:`TransitionError`.

    ``changes`` sets other fields (``bytes_done``...). A ``fail`` remembers the phase it failed
    in; a ``start`` begins a fresh deployment record.
    """
    phase = next_phase(record.phase, trigger)
    timings = dict(record.timings_ms)
    if record.phase in WORKING or record.phase is Phase.ROLLING_BACK:
        spent = max(0.0, now - record.phase_since) * 1000.0
        timings[record.phase.value] = round(timings.get(record.phase.value, 0.0) + spent, 3)
    update: dict[str, Any] = {"phase": phase, "phase_since": now, "updated_at": now}
    if trigger is Trigger.START:
        update |= {"started_at": now, "attempts": 1, "bytes_done": 0, "cause": None,
                   "error": None, "failed_phase": None}  # fmt: skip
        timings = {}
    elif trigger is Trigger.RETRY:
        update |= {"attempts": record.attempts + 1, "cause": cause, "error": error}
    elif trigger is Trigger.FAIL:
        if record.phase is not Phase.ROLLING_BACK:
            update["failed_phase"] = record.phase
        update |= {"cause": cause or record.cause or Cause.INTERNAL,
                   "error": (error or record.error or "")[:2048]}  # fmt: skip
    update["timings_ms"] = timings
    update |= changes
    return record.model_copy(update=update)


def new_record(
    *,
    model: str,
    role: str,
    from_version: str | None,
    to_version: str,
    target_path: str,
    sha256: str,
    length: int,
    desired_seq: int,
    now: float,
    rollback: bool = False,
    canary: CanaryPolicy | None = None,
) -> UpdateRecord:
    """A record in ``downloading``: a deployment that has just started (``role``: stable,
    canary, shadow or prefetch; ``canary``: the policy of a canary deployment)."""
    from mcp_edge.agent.update.records import UpdateRecord  # pydantic: only once one is made

    idle = UpdateRecord(
        model=model, role=role, from_version=from_version, to_version=to_version,
        target_path=target_path, sha256=sha256, length=length, desired_seq=desired_seq,
        rollback=rollback, canary=canary,
    )  # fmt: skip
    return advance(idle, Trigger.START, now=now)
