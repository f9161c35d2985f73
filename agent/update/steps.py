"""One handler per phase of the update state machine, and the loop that drives a deployment.

:class:`DeploymentRunner` takes an :class:`~agent.update.machine.UpdateRecord` and moves it to
``active`` or ``failed``. Before each handler runs, the record is written to disk (and the
optional ``phase_hook`` is called: tests kill the process there). Each handler is idempotent,
so a record a crash left in a phase can run that phase again:

- ``downloading``: refresh TUF, check the target against the desired state (sha256, length:
  mix-and-match), the release counter (downgrade) and free disk, then download into
  ``staging/`` with resume. Transport errors retry here with exponential backoff.
- ``verifying``: the staged bytes against TUF's signed length and hashes; the bundle's
  publisher signature against the publisher keys the signed targets metadata lists; the
  manifest's name and version; a variant this profile runs. Unpacks into ``staging/``.
- ``installing``: one rename into ``models/{name}/{version}/``. A prefetch ends here: the
  index records the version as ``prefetch`` (so garbage collection keeps it) and the record
  rests in ``idle``; nothing is loaded, and a later deployment of the version in a role finds it
  installed and downloads nothing.
- ``loading``: the runtime loads the model, warms it and checks its outputs beside the running
  version, then swaps it in (:meth:`agent.runtime.manager.ModelManager.load`).
- ``warming``: a probe request through the serving path of the new version; then commit: the
  index records the new active/canary/shadow, the release counter and the previous version.
- ``rolling_back``: discard staged files, put the previous version back in service when the new
  one had been swapped in, remove an installed but uncommitted version (a prefetch that failed
  never loaded anything, so it only discards and removes what it brought).

The TUF stack (python-tuf, securesystemslib, cryptography, urllib3: about 10 MiB of RSS) is
imported by the ``downloading`` and ``verifying`` handlers, not with this module: an agent loads
it the first time a deployment needs repository metadata, never to serve installed models.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mcp_edge.agent.runtime.checks import check_outputs, synthetic_inputs
from mcp_edge.agent.runtime.manager import ModelManager, ModelNotFoundError, ModelSource
from mcp_edge.agent.runtime.runner import RunnerError
from mcp_edge.agent.serving.model_dir import bundle_source, pick_variant
from mcp_edge.agent.update.machine import Cause, Phase, Trigger, UpdateError, advance
from mcp_edge.agent.update.records import CanaryRef, InstallInfo, UpdateRecord
from mcp_edge.agent.update.store import ModelStore, is_disk_full
from mcp_edge.agent.update.transport import RepoTransport
from mcp_edge.shared.bundle import BundleManifest, open_bundle
from mcp_edge.shared.bundle.manifest import MANIFEST_NAME, SIGNATURE_NAME
from mcp_edge.shared.errors import BundleError, SigningError, VersionError
from mcp_edge.shared.profiles import HardwareProfile
from mcp_edge.shared.protocol.canary import DEFAULT_CANARY_POLICY
from mcp_edge.shared.protocol.reports import EventOutcome
from mcp_edge.shared.version import SemVer

if TYPE_CHECKING:
    from tuf.api.metadata import TargetFile

    from mcp_edge.agent.update.tuf_client import TufClient

log = logging.getLogger("mcp.agent.update")

PhaseHook = Callable[[Phase, UpdateRecord], None]
"""Called with each phase right after its record is on disk, before the phase's work."""
Emit = Callable[..., object]
"""Records one deployment event (keyword fields of :class:`shared.protocol.reports.EventReport`)."""


@dataclass(frozen=True)
class RetryPolicy:
    """Transient (transport) failures: attempts in all and the backoff between them (s)."""

    max_attempts: int = 5
    initial_s: float = 1.0
    max_s: float = 60.0

    def delay(self, attempt: int) -> float:
        return float(min(self.max_s, self.initial_s * 2 ** max(0, attempt - 1)))


def version_numeric(version: str) -> int:
    """The release-counter number of ``version`` (raises UpdateError for one that has none)."""
    try:
        return SemVer.parse(version).to_numeric()
    except VersionError as e:
        raise UpdateError(Cause.MANIFEST_MISMATCH, str(e)) from e


def installed_source(store: ModelStore, info: InstallInfo) -> ModelSource:
    """The :class:`ModelSource` of an installed version (its files were verified at install)."""
    root = store.version_dir(info.name, info.version)
    try:
        manifest = BundleManifest.model_validate_json((root / MANIFEST_NAME).read_bytes())
        return bundle_source(manifest, root, info.variant, origin=root,
                             signer_keyid=info.signer_keyid, backend=info.backend)  # fmt: skip
    except (OSError, ValueError, KeyError) as e:
        raise UpdateError(Cause.LOAD_FAILED, f"{root}: installed files unusable: {e}") from e


class DeploymentRunner:
    """Drives deployment records through the machine (see the module docstring)."""

    def __init__(
        self,
        store: ModelStore,
        manager: ModelManager,
        profile: HardwareProfile,
        tuf: Callable[[], TufClient],
        transport: RepoTransport,
        *,
        emit: Emit,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        retry: RetryPolicy | None = None,
        phase_hook: PhaseHook | None = None,
    ) -> None:
        self.store, self.manager, self.profile = store, manager, profile
        self._tuf_factory = tuf
        self.transport = transport
        self.emit = emit
        self.clock = clock
        self.sleep = sleep
        self.retry = retry or RetryPolicy()
        self.phase_hook = phase_hook
        self._tuf: TufClient | None = None
        self._target: TargetFile | None = None
        self._handlers = {
            Phase.DOWNLOADING: self._download,
            Phase.VERIFYING: self._verify,
            Phase.INSTALLING: self._install,
            Phase.LOADING: self._load,
            Phase.WARMING: self._warm,
            Phase.ROLLING_BACK: self._roll_back,
        }

    # ------------------------------------------------------------------ the loop
    async def run(self, record: UpdateRecord) -> UpdateRecord:
        """Move ``record`` to ``active`` or ``failed``; never raises for a failed deployment."""
        self._tuf, self._target = None, None
        while True:
            await asyncio.to_thread(self.store.save_record, record)
            if self.phase_hook is not None:
                self.phase_hook(record.phase, record)
            if record.terminal:
                return record
            handler = self._handlers[record.phase]
            t0 = time.monotonic()
            try:
                trigger = await handler(record)
            except UpdateError as e:
                record = await self._failed(record, e, time.monotonic() - t0)
                continue
            except Exception as e:  # a bug must roll back, not leave a half-done deployment
                log.exception(
                    "%s %s: %s failed", record.model, record.to_version, record.phase.value
                )
                err = UpdateError(Cause.INTERNAL, f"{type(e).__name__}: {e}")
                record = await self._failed(record, err, time.monotonic() - t0)
                continue
            elapsed = (time.monotonic() - t0) * 1000.0
            done = record.phase
            bytes_done = record.length if done is Phase.DOWNLOADING else None
            got = record.length if done is Phase.DOWNLOADING else record.bytes_done
            record = advance(record, trigger, now=self.clock(), bytes_done=got)
            message = _DONE.get(done, done.value)
            if record.role == "prefetch" and done is Phase.INSTALLING:
                message = _PREFETCHED
            self.emit(record, done, EventOutcome.OK, message, elapsed_ms=elapsed,
                      bytes_done=bytes_done)  # fmt: skip
            if record.phase is Phase.ACTIVE:
                total_ms = sum(record.timings_ms.values())
                self.emit(record, Phase.ACTIVE, EventOutcome.OK,
                          f"active as {record.role} after {total_ms:.0f} ms of work",
                          elapsed_ms=total_ms)  # fmt: skip

    async def _failed(self, record: UpdateRecord, e: UpdateError, spent_s: float) -> UpdateRecord:
        phase = record.phase
        elapsed = spent_s * 1000.0
        if e.transient and phase is Phase.DOWNLOADING and record.attempts < self.retry.max_attempts:
            delay = self.retry.delay(record.attempts)
            log.warning("%s %s: %s; attempt %d of %d again in %.1f s", record.model,
                        record.to_version, e, record.attempts + 1, self.retry.max_attempts, delay)  # fmt: skip
            self.emit(record, phase, EventOutcome.ERROR, f"{e}; retrying in {delay:.1f} s",
                      cause=e.cause.value, elapsed_ms=elapsed)  # fmt: skip
            await self.sleep(delay)
            return advance(record, Trigger.RETRY, now=self.clock(), cause=e.cause, error=str(e))
        log.error("%s %s refused in %s (%s): %s", record.model, record.to_version, phase.value,
                  e.cause.value, e)  # fmt: skip
        self.emit(
            record, phase, EventOutcome.ERROR, str(e), cause=e.cause.value, elapsed_ms=elapsed
        )
        return advance(record, Trigger.FAIL, now=self.clock(), cause=e.cause, error=str(e))

    def _tuf_client(self) -> TufClient:
        if self._tuf is None:
            self._tuf = self._tuf_factory()
        return self._tuf

    # ------------------------------------------------------------------ downloading
    async def _download(self, record: UpdateRecord) -> Trigger:
        loop_emit = self.emit
        step = max(1, record.length // 4)
        marks = {"next": step}

        def progress(done: int, total: int) -> None:
            if done >= marks["next"] and done < total:
                marks["next"] = done + step
                loop_emit(record, Phase.DOWNLOADING, EventOutcome.PROGRESS, "downloading",
                          bytes_done=done)  # fmt: skip

        def work() -> None:
            from tuf.api import exceptions as tuf_errors  # see the module docstring: TUF loads here

            tuf = self._tuf_client()
            tuf.refresh()
            info = tuf.target(record.target_path)
            if info.hashes.get("sha256") != record.sha256 or info.length != record.length:
                raise UpdateError(
                    Cause.TARGET_MISMATCH,
                    f"TUF lists {record.target_path} as {info.length} bytes, sha256 "
                    f"{str(info.hashes.get('sha256'))[:16]}…; the desired state says "
                    f"{record.length} bytes, sha256 {record.sha256[:16]}…",
                )
            self._target = info
            numeric = version_numeric(record.to_version)
            counter = self.store.index(record.model).release_counter
            if numeric < counter and not record.rollback:
                raise UpdateError(
                    Cause.DOWNGRADE,
                    f"{record.model} {record.to_version} is below the release counter "
                    f"{SemVer.from_numeric(counter)}; only an explicit rollback may go back",
                )
            have = self.store.installed(record.model, record.to_version)
            if have is not None and have.sha256 == record.sha256:
                return  # kept on disk (the previous version): an instant rollback
            staged = self.store.staged_bundle(record.sha256)
            already = staged.stat().st_size if staged.exists() else 0
            self.store.check_free(record.length, already=min(already, record.length))
            url = tuf.target_url(info)
            try:
                self.transport.download(url, staged, length=record.length, progress=progress)
            except tuf_errors.DownloadLengthMismatchError as e:
                staged.unlink(missing_ok=True)
                raise UpdateError(Cause.TOO_LONG, f"{record.target_path}: {e}") from e
            except tuf_errors.DownloadError as e:
                raise UpdateError(Cause.TRANSPORT, f"{record.target_path}: {e}") from e

        await _in_thread(work)
        return Trigger.DOWNLOADED

    # ------------------------------------------------------------------ verifying
    async def _verify(self, record: UpdateRecord) -> Trigger:
        def work() -> None:
            from tuf.api.metadata import TargetFile

            from mcp_edge.agent.update.tuf_client import TufClient

            have = self.store.installed(record.model, record.to_version)
            if have is not None and have.sha256 == record.sha256:
                return
            staged = self.store.staged_bundle(record.sha256)
            info = self._target or TargetFile(record.length, {"sha256": record.sha256},
                                              record.target_path)  # fmt: skip
            try:
                TufClient.verify_file(info, staged)
            except UpdateError:
                staged.unlink(missing_ok=True)
                raise
            except FileNotFoundError as e:
                raise UpdateError(Cause.INTERRUPTED, f"{staged}: the download is gone") from e
            publishers = self._tuf_client().publishers()
            if not publishers:
                raise UpdateError(
                    Cause.PUBLISHER, "the signed targets metadata lists no publisher keys"
                )
            unpack = self.store.unpack_dir(record.model, record.to_version)
            self.store.discard_unpacked(unpack)
            try:
                opened = open_bundle(staged, unpack, publishers.values(), validate_models=False)
            except BundleError as e:
                signature = isinstance(e.__cause__, SigningError) or e.member == SIGNATURE_NAME \
                    or "signature" in str(e)  # fmt: skip
                raise UpdateError(Cause.PUBLISHER if signature else Cause.BUNDLE, str(e)) from e
            manifest = opened.manifest
            if (manifest.name, manifest.version) != (record.model, record.to_version):
                self.store.discard_unpacked(unpack)
                raise UpdateError(
                    Cause.MANIFEST_MISMATCH,
                    f"the bundle is {manifest.name} {manifest.version}, not the "
                    f"{record.model} {record.to_version} asked for",
                )
            tag = self._variant_for(manifest)
            info_doc = InstallInfo(
                name=manifest.name, version=manifest.version,
                version_numeric=version_numeric(manifest.version), variant=tag,
                model_file=manifest.variant(tag).file, target_path=record.target_path,
                sha256=record.sha256, length=record.length, signer_keyid=opened.signer_keyid,
                installed_at=self.clock(),
            )  # fmt: skip
            self.store.write_install_info(unpack, info_doc)

        await _in_thread(work)
        return Trigger.VERIFIED

    def _variant_for(self, manifest: BundleManifest) -> str:
        formats = set(self.profile.runtime.formats)
        tag = pick_variant(manifest, self.profile)
        if manifest.variant(tag).format in formats:
            return tag
        for v in manifest.variants:
            fits = self.profile.name in v.profiles or v.tag in self.profile.variants.tags
            if fits and v.format in formats:
                return v.tag
        raise UpdateError(
            Cause.NO_VARIANT,
            f"no variant of {manifest.name} {manifest.version} runs on profile "
            f"{self.profile.name} (it runs {', '.join(sorted(formats))}; the bundle has "
            f"{', '.join(f'{v.tag}:{v.format}' for v in manifest.variants)})",
        )

    # ------------------------------------------------------------------ installing
    async def _install(self, record: UpdateRecord) -> Trigger:
        def work() -> None:
            have = self.store.installed(record.model, record.to_version)
            if have is None:
                unpack = self.store.unpack_dir(record.model, record.to_version)
                if not (unpack / "install.json").is_file():
                    raise UpdateError(Cause.INTERRUPTED, "the verified files are gone")
                self.store.install(unpack, record.model, record.to_version)
            self.store.staged_bundle(record.sha256).unlink(missing_ok=True)
            if record.role == "prefetch":
                self._keep_prefetched(record)

        await _in_thread(work)
        return Trigger.STORED if record.role == "prefetch" else Trigger.INSTALLED

    def _keep_prefetched(self, record: UpdateRecord) -> None:
        """Commit a prefetch: the index names it, so garbage collection keeps it; the version
        it replaces as the prefetch is collected unless a role still holds it."""
        index = self.store.index(record.model)
        index = index.model_copy(update={"prefetch": record.to_version})
        self.store.save_index(index)
        self.store.gc(record.model, index.referenced())

    # ------------------------------------------------------------------ loading / warming
    async def _load(self, record: UpdateRecord) -> Trigger:
        await self._ensure_loaded(record)
        return Trigger.LOADED

    async def _ensure_loaded(self, record: UpdateRecord) -> None:
        name, version = record.model, record.to_version
        roles = loaded_roles(self.manager, name)
        if version in roles:
            if roles[version] == record.role:
                return
            await self.manager.unload(name, version)  # e.g. a canary promoted to stable
        info = self.store.installed(name, version)
        if info is None:
            raise UpdateError(Cause.INTERRUPTED, f"{name} {version} is not installed")
        source = installed_source(self.store, info)
        try:
            lv = await self.manager.load(source, role=record.role,
                                         canary=record.canary or DEFAULT_CANARY_POLICY)  # fmt: skip
        except RunnerError as e:
            raise UpdateError(Cause.LOAD_FAILED, str(e)) from e
        self.emit(record, Phase.LOADING, EventOutcome.PROGRESS,
                  f"loaded on {lv.info.backend}/{lv.info.provider} in {lv.load_s * 1000:.0f} ms, "
                  f"warmed and checked in {lv.warmup_s * 1000:.0f} ms")  # fmt: skip

    async def _warm(self, record: UpdateRecord) -> Trigger:
        await self._ensure_loaded(record)
        try:
            lv = self.manager.get(record.model, record.to_version)
            feeds = synthetic_inputs(lv.info, 1)
            _, out = await self.manager.infer(lv, feeds, pinned=True)
            check_outputs(lv.info, out, 1)
        except RunnerError as e:
            raise UpdateError(Cause.LOAD_FAILED, f"probe request failed: {e}") from e
        await _in_thread(self._commit, record)
        return Trigger.WARMED

    def _commit(self, record: UpdateRecord) -> None:
        index = self.store.index(record.model)
        version = record.to_version
        if record.role == "stable":
            previous = index.active if index.active != version else index.previous
            counter = max(index.release_counter, version_numeric(version))
            index = index.model_copy(update={"active": version, "previous": previous,
                                             "release_counter": counter})  # fmt: skip
            if index.canary is not None and index.canary.version == version:
                index = index.model_copy(update={"canary": None})
            if index.shadow == version:
                index = index.model_copy(update={"shadow": None})
        elif record.role == "canary":
            ref = CanaryRef(version=version, policy=record.canary or DEFAULT_CANARY_POLICY)
            index = index.model_copy(update={"canary": ref})
        else:
            index = index.model_copy(update={"shadow": version})
        if index.prefetch == version:  # the switch a prefetch was for: it has a role now
            index = index.model_copy(update={"prefetch": None})
        self.store.save_index(index)
        self.store.gc(record.model, index.referenced())

    # ------------------------------------------------------------------ rolling back
    async def _roll_back(self, record: UpdateRecord) -> Trigger:
        await _in_thread(self.store.discard_staged, record)
        index = self.store.index(record.model)
        name, version = record.model, record.to_version
        roles = loaded_roles(self.manager, name)
        committed = version in index.referenced()
        if record.role == "prefetch":
            committed = committed or version in roles  # a prefetch never touches what serves
        elif version in roles and not committed:
            restore = index.active if record.role == "stable" else None
            if restore is not None and restore != version and roles[version] == "stable":
                info = self.store.installed(name, restore)
                if info is not None:
                    try:
                        await self.manager.load(installed_source(self.store, info), role="stable")
                        self.emit(record, Phase.ROLLING_BACK, EventOutcome.PROGRESS,
                                  f"{restore} serves again")  # fmt: skip
                    except RunnerError as e:
                        log.error("%s: could not put %s back: %s", name, restore, e)
            if version in loaded_roles(self.manager, name):
                await self.manager.unload(name, version)
        if not committed:
            await _in_thread(self.store.remove_version, name, version)
        return Trigger.ROLLED_BACK


_DONE = {
    Phase.DOWNLOADING: "downloaded",
    Phase.VERIFYING: "verified: TUF hashes, publisher signature, manifest, variant",
    Phase.INSTALLING: "installed",
    Phase.LOADING: "loaded and swapped in",
    Phase.WARMING: "probe request answered; committed",
    Phase.ROLLING_BACK: "rolled back",
}
_PREFETCHED = "prefetched: verified and installed for a later switch; not loaded"


async def _in_thread(fn: Callable[..., None], *args: object) -> None:
    """Run blocking file/network work off the event loop; OSErrors become UpdateErrors."""
    try:
        await asyncio.to_thread(fn, *args)
    except OSError as e:
        if is_disk_full(e):
            raise UpdateError(Cause.DISK_FULL, f"write failed: {e}") from e
        raise UpdateError(Cause.INTERNAL, f"file system error: {e}") from e


def loaded_roles(manager: ModelManager, name: str) -> dict[str, str]:
    """Versions of ``name`` the manager holds and their roles (empty when none serves)."""
    try:
        slot = manager.slot(name)
    except ModelNotFoundError:
        return {}
    return {v: slot.role_of(v) for v in slot.versions}
