"""A simulated device converging to an accepted desired state, phase by phase like the agent.

For every model of the document: the stable version, then the canary (or the canary policy
changed in place), then the shadow, then the prefetch, as :class:`agent.update.updater.
UpdateAgent` does; models the document no longer names are retired. After each deployment and
at the end the reported state is published. One deployment walks the phases of
:mod:`agent.update.machine` and emits the agent's events with its messages::

    idle progress "deployment as stable from 1.0.0 started"
    downloading ok "downloaded"            (the TUF chain and the bundle: :mod:`.repository`)
    verifying ok "verified: ..."           (signed length and hashes, publisher, manifest)
    installing ok "installed"              (a prefetch ends here: "prefetched: ...")
    loading progress "loaded on ..."       (after the version's load_ms)
    loading ok "loaded and swapped in"
    warming ok "probe request answered; committed"
    active ok "active as stable after N ms of work"

A transport failure in ``downloading`` is retried with the agent's backoff
(:class:`agent.update.steps.RetryPolicy`: 5 attempts, 1 s doubling), each retry an error event;
any other failure, or the last retry, gives an error event in its phase, then
``rolling_back ok "rolled back"``, and the model rests in ``failed`` with ``last_error`` while
the version before keeps serving. A version the behaviour marks ``fail_load`` fails in
``loading`` with cause ``load_failed``. Nothing is written to disk: the bundle's bytes live
only while they are checked.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from mcp_edge.agent.update.machine import Cause, UpdateError
from mcp_edge.agent.update.steps import RetryPolicy, version_numeric
from mcp_edge.shared.protocol.reports import DeploymentPhase, EventOutcome
from mcp_edge.shared.signing import PublicKey
from mcp_edge.tooling.sim.device import ModelState, SimDevice
from mcp_edge.tooling.sim.repository import TargetInfo, fetch_file

if TYPE_CHECKING:
    from mcp_edge.shared.protocol.state import DesiredModel, DesiredState, TargetRef

log = logging.getLogger("mcp.sim.deploy")

Phase = DeploymentPhase
RETRY = RetryPolicy()
_VERIFIED = "verified: TUF hashes, publisher signature, manifest, variant"
_PREFETCHED = "prefetched: verified and installed for a later switch; not loaded"


async def converge(dev: SimDevice, state: DesiredState) -> None:
    """Bring ``dev`` to ``state`` (already verified and accepted)."""
    for model in state.models:
        await _converge_model(dev, model)
    wanted = {m.name for m in state.models}
    for name, m in dev.models.items():
        if name not in wanted and (m.active or m.canary or m.shadow):
            m.previous = m.active or m.previous
            m.active = m.canary = m.shadow = m.prefetch = None
            m.phase = Phase.IDLE
            m.collect()
    dev.applied_seq = state.seq
    dev.report()


async def _converge_model(dev: SimDevice, model: DesiredModel) -> None:
    m = dev.models.get(model.name)
    if m is None:
        m = dev.models[model.name] = ModelState(model.name)
    await _deploy(dev, m, "stable", model.stable, rollback=model.rollback)
    if model.canary is not None:
        c = model.canary
        if m.canary == c.target.version:
            m.canary_weight = c.weight  # a changed policy, applied in place
        else:
            await _deploy(dev, m, "canary", c.target, rollback=model.rollback, weight=c.weight)
    elif m.canary is not None:
        m.canary, m.canary_weight = None, 0.0
        m.collect()
    if model.shadow is not None:
        await _deploy(dev, m, "shadow", model.shadow, rollback=model.rollback)
    elif m.shadow is not None:
        m.shadow = None
        m.collect()
    prefetch = getattr(model, "prefetch", None)
    if prefetch is not None:
        await _deploy(dev, m, "prefetch", prefetch, rollback=model.rollback)
    elif m.prefetch is not None:
        m.prefetch = None
        m.collect()


def _current(m: ModelState, role: str) -> str | None:
    return {"stable": m.active, "canary": m.canary, "shadow": m.shadow,
            "prefetch": m.prefetch}[role]  # fmt: skip


async def _deploy(
    dev: SimDevice, m: ModelState, role: str, target: TargetRef, *, rollback: bool,
    weight: float = 0.0,
) -> None:  # fmt: skip
    current = _current(m, role)
    if current == target.version and m.installed.get(target.version) == target.sha256:
        return
    version = target.version
    ctx = dev.ctx
    if role == "prefetch":
        started = f"prefetch started beside {m.active or 'nothing'}: download and verify, not run"
    else:
        started = f"deployment as {role} from {current or 'nothing'} started"
    dev.emit(m.name, version, Phase.IDLE, EventOutcome.PROGRESS, started,
             bytes_total=target.length)  # fmt: skip
    work_ms = 0.0

    def done(
        phase: DeploymentPhase, message: str, t0: float, bytes_done: int | None = None
    ) -> None:
        nonlocal work_ms
        elapsed = (time.monotonic() - t0) * 1000.0
        work_ms += elapsed
        dev.emit(m.name, version, phase, EventOutcome.OK, message, elapsed_ms=elapsed,
                 bytes_done=bytes_done, bytes_total=target.length)  # fmt: skip

    phase = Phase.DOWNLOADING
    try:
        m.phase = phase
        t0 = time.monotonic()
        data, info, publishers = await _download(dev, m, target, rollback)
        done(phase, "downloaded", t0, bytes_done=target.length)
        phase = m.phase = Phase.VERIFYING
        t0 = time.monotonic()
        if data is not None:
            await ctx.verdicts.check_bundle(data, info, m.name, version, publishers)
        done(phase, _VERIFIED, t0)
        phase = m.phase = Phase.INSTALLING
        t0 = time.monotonic()
        m.installed[version] = target.sha256
        if role == "prefetch":
            m.prefetch = version
            done(phase, _PREFETCHED, t0)
            m.phase = Phase.IDLE if m.active is None else Phase.ACTIVE
            m.collect()
            return
        done(phase, "installed", t0)
        phase = m.phase = Phase.LOADING
        t0 = time.monotonic()
        b = ctx.behaviour.of(m.name, version)
        if b.load_ms:
            await asyncio.sleep(b.load_ms / 1000.0)
        if b.fail_load:
            raise UpdateError(Cause.LOAD_FAILED, f"{m.name} {version} did not load "
                              "(the simulator's behaviour says fail_load)")  # fmt: skip
        dev.emit(m.name, version, Phase.LOADING, EventOutcome.PROGRESS,
                 f"loaded on onnxruntime/CPUExecutionProvider in {b.load_ms:.0f} ms, warmed "
                 "and checked in 0 ms", bytes_total=target.length)  # fmt: skip
        done(phase, "loaded and swapped in", t0)
        phase = m.phase = Phase.WARMING
        t0 = time.monotonic()
        _commit(m, role, version, weight)
        done(phase, "probe request answered; committed", t0)
    except UpdateError as e:
        _failed(dev, m, version, phase, e, target.length)
        return
    m.phase = Phase.ACTIVE
    m.last_error = m.failed_version = None
    dev.emit(m.name, version, Phase.ACTIVE, EventOutcome.OK,
             f"active as {role} after {work_ms:.0f} ms of work", elapsed_ms=work_ms,
             bytes_total=target.length)  # fmt: skip
    ctx.counters["deployments_ok"] += 1
    dev.report()


async def _download(
    dev: SimDevice, m: ModelState, target: TargetRef, rollback: bool
) -> tuple[bytes | None, TargetInfo, tuple[PublicKey, ...]]:
    """The TUF chain, the target checks and the bundle's bytes (None: installed already), with
    the agent's retries of transport failures."""
    attempt = 1
    while True:
        t0 = time.monotonic()
        try:
            return await _download_once(dev, m, target, rollback)
        except UpdateError as e:
            if not e.transient or attempt >= RETRY.max_attempts:
                raise
            delay = RETRY.delay(attempt)
            dev.emit(m.name, target.version, Phase.DOWNLOADING, EventOutcome.ERROR,
                     f"{e}; retrying in {delay:.1f} s", cause=e.cause.value,
                     elapsed_ms=(time.monotonic() - t0) * 1000.0,
                     bytes_total=target.length)  # fmt: skip
            dev.ctx.counters["download_retries"] += 1
            await asyncio.sleep(delay)
            attempt += 1


async def _download_once(
    dev: SimDevice, m: ModelState, target: TargetRef, rollback: bool
) -> tuple[bytes | None, TargetInfo, tuple[PublicKey, ...]]:
    transport = dev.transport()
    verified = await dev.ctx.verdicts.refresh(transport)
    info = verified.targets.get(target.target_path)
    if info is None:
        raise UpdateError(Cause.TARGET_MISSING,
                          f"the signed targets metadata does not list {target.target_path}")  # fmt: skip
    if info.hashes.get("sha256") != target.sha256 or info.length != target.length:
        raise UpdateError(Cause.TARGET_MISMATCH,
                          f"TUF lists {target.target_path} as {info.length} bytes, sha256 "
                          f"{info.hashes.get('sha256', '')[:16]}…; the desired state says "
                          f"{target.length} bytes, sha256 {target.sha256[:16]}…")  # fmt: skip
    if version_numeric(target.version) < m.release_counter and not rollback:
        raise UpdateError(Cause.DOWNGRADE, f"{m.name} {target.version} is below the release "
                          "counter; only an explicit rollback may go back")  # fmt: skip
    if m.installed.get(target.version) == target.sha256:
        return None, info, verified.publishers  # kept installed: nothing to fetch
    data = await fetch_file(transport, info.url_path, target.length)
    if data is None:
        raise UpdateError(Cause.TRANSPORT, f"{info.url_path}: not found in the repository")
    return data, info, verified.publishers


def _commit(m: ModelState, role: str, version: str, weight: float) -> None:
    if role == "stable":
        if m.active != version:
            m.previous = m.active
        m.active = version
        m.release_counter = max(m.release_counter, version_numeric(version))
        if m.canary == version:
            m.canary, m.canary_weight = None, 0.0
        if m.shadow == version:
            m.shadow = None
    elif role == "canary":
        m.canary, m.canary_weight = version, weight
    else:
        m.shadow = version
    if m.prefetch == version:
        m.prefetch = None
    m.collect()


def _failed(
    dev: SimDevice, m: ModelState, version: str, phase: DeploymentPhase, e: UpdateError,
    length: int,
) -> None:  # fmt: skip
    dev.emit(m.name, version, phase, EventOutcome.ERROR, str(e), cause=e.cause.value,
             bytes_total=length)  # fmt: skip
    m.phase = Phase.ROLLING_BACK
    if version not in m.referenced():
        m.installed.pop(version, None)
    dev.emit(m.name, version, Phase.ROLLING_BACK, EventOutcome.OK, "rolled back",
             bytes_total=length)  # fmt: skip
    m.phase = Phase.FAILED
    m.last_error = f"{e.cause.value}: {e}"[:2048]
    m.failed_version = version
    dev.ctx.counters["deployments_failed"] += 1
    log.debug("%s: %s %s failed in %s: %s", dev.device_id, m.name, version, phase.value, e)
    dev.report()
