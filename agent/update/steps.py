"""One handler per phase of the update state machine, and the loop that drives a deployment.

:class:`DeploymentRunner` takes an :class:`~agent.update.machine.UpdateRecord` and moves it to
``active`` or ``failed``. Before each handler runs, the record is written to disk (and the
optional ``phase_hook`` is called: tests kill the process there). Each handler is idempotent,
so a record a crash left in a phase can run that phase again:

- ``downloading``: refresh TUF, check the target against the desired state (sha256, length:
  mix-and-match), the release counter (downgrade) and free disk, then download into
  ``staging/`` with resume. Transport errors retry here with exponential backoff. When the
  bundle target's signed custom fields name its ``parts``, only the manifest, its signature,
  the chosen variant's file (the candidates' files when choosing by measurement) and the
  bundle's other files (labels...) are fetched, each a TUF target of its own
  (docs/updates.md "Variants"); otherwise the whole bundle.
- ``verifying``: the staged bytes against TUF's signed length and hashes; the bundle's
  publisher signature against the publisher keys the signed targets metadata lists; the
  manifest's name and version; a variant this profile runs (:mod:`agent.update.variants`;
  measured with :func:`agent.runtime.selection.select` when the profile asks for it). Unpacks
  into ``staging/`` (parts: each file also checked against the manifest's sha256 and size).
- ``installing``: one rename into ``models/{name}/{version}/``. A prefetch ends here: the
  index records the version as ``prefetch`` (so garbage collection keeps it) and the record
  rests in ``idle``; nothing is loaded, and a later deployment of the version in a role finds it
  installed and downloads nothing.
- ``loading``: the runtime loads the model, warms it and checks its outputs beside the running
  version, then swaps it in (:meth:`agent.runtime.manager.ModelManager.load`). When a variant
  installed from parts fails here (or in ``warming``) and another candidate is left, the
  record notes the failure and goes back to ``downloading`` for the next one.
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
import os
import shutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mcp_edge.agent.runtime.checks import check_outputs, synthetic_inputs
from mcp_edge.agent.runtime.manager import ModelManager, ModelNotFoundError, ModelSource
from mcp_edge.agent.runtime.runner import RunnerError
from mcp_edge.agent.serving.model_dir import bundle_source
from mcp_edge.agent.update.machine import Cause, Phase, Trigger, UpdateError, advance
from mcp_edge.agent.update.records import CanaryRef, InstallInfo, UpdateRecord
from mcp_edge.agent.update.store import ModelStore, is_disk_full
from mcp_edge.agent.update.transport import RepoTransport
from mcp_edge.agent.update.variants import Ranking, backend_check, rank_variants
from mcp_edge.shared.bundle import BundleLimits, BundleManifest, open_bundle
from mcp_edge.shared.bundle.manifest import MANIFEST_NAME, SIGNATURE_NAME, Variant
from mcp_edge.shared.errors import BundleError, McpError, SigningError, VersionError
from mcp_edge.shared.fsutil import atomic_write_bytes, fsync_dir
from mcp_edge.shared.profiles import HardwareProfile
from mcp_edge.shared.protocol.canary import DEFAULT_CANARY_POLICY
from mcp_edge.shared.protocol.reports import EventOutcome
from mcp_edge.shared.version import SemVer

if TYPE_CHECKING:
    from tuf.api.metadata import TargetFile

    from mcp_edge.agent.runtime.selection import Selection
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
        self._changes: dict[str, Any] = {}
        self._done_note: tuple[str, int] | None = None
        self.backend_available = backend_check()
        self.limits = BundleLimits()
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
            self._changes, self._done_note = {}, None
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
            message = _DONE.get(done, done.value)
            if self._done_note is not None:  # parts: what was fetched, not the bundle
                message, bytes_done = self._done_note
                got = bytes_done
            record = advance(record, trigger, now=self.clock(), bytes_done=got, **self._changes)
            if trigger is Trigger.NEXT_VARIANT:
                continue  # the handler's event said which variant failed and what comes next
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

        def progress_of(total: int) -> Callable[[int, int], None]:
            step = max(1, total // 4)
            marks = {"next": step}

            def progress(done: int, _total: int) -> None:
                if done >= marks["next"] and done < total:
                    marks["next"] = done + step
                    loop_emit(record, Phase.DOWNLOADING, EventOutcome.PROGRESS, "downloading",
                              bytes_done=done)  # fmt: skip

            return progress

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
            parts = parts_of(info)
            if parts is not None:
                self._download_parts(record, tuf, parts, progress_of)
                return
            staged = self.store.staged_bundle(record.sha256)
            already = staged.stat().st_size if staged.exists() else 0
            self.store.check_free(record.length, already=min(already, record.length))
            url = tuf.target_url(info)
            try:
                self.transport.download(url, staged, length=record.length,
                                        progress=progress_of(record.length))  # fmt: skip
            except tuf_errors.DownloadLengthMismatchError as e:
                staged.unlink(missing_ok=True)
                raise UpdateError(Cause.TOO_LONG, f"{record.target_path}: {e}") from e
            except tuf_errors.DownloadError as e:
                raise UpdateError(Cause.TRANSPORT, f"{record.target_path}: {e}") from e

        await _in_thread(work)
        return Trigger.DOWNLOADED

    def _download_parts(
        self,
        record: UpdateRecord,
        tuf: TufClient,
        parts: BundleParts,
        progress_of: Callable[[int], Callable[[int, int], None]],
    ) -> None:
        """Fetch the manifest and signature, choose the variant(s), fetch their files and the
        bundle's other files into ``staging/{sha256}.parts/`` (worker thread)."""
        staging = self.store.staged_parts(record.sha256)
        staging.mkdir(parents=True, exist_ok=True)
        fetched = 0
        meta = [(parts.manifest, self.limits.max_manifest_bytes),
                (parts.signature, self.limits.max_signature_bytes)]  # fmt: skip
        for path, cap in meta:
            info = tuf.target(path)
            if info.length > cap:
                raise UpdateError(Cause.BUNDLE, f"{path}: TUF lists {info.length} bytes, over "
                                                f"the cap of {cap}")  # fmt: skip
            fetched += self._fetch_part(tuf, info, staging, None)
        manifest, _signer = self._staged_manifest(record, tuf, parts, staging)
        ranking = self._ranking(record, manifest)
        fetch = self._to_fetch(ranking)
        members = [v.file for v in fetch] + _other_files(manifest)
        infos = [(member, self._part_info(tuf, parts, manifest, member)) for member in members]
        total = sum(info.length for _, info in infos)
        already = sum(min(_size(staging / _staged_name(info)), info.length) for _, info in infos)
        self.store.check_free(total, already=already)
        progress = progress_of(total)
        base = {"done": 0}

        def cumulative(done: int, _total: int) -> None:
            progress(base["done"] + done, total)

        for member, info in infos:
            fetched += self._fetch_part(tuf, info, staging, cumulative)
            _check_member(manifest, member, staging / _staged_name(info))
            base["done"] += info.length
        tags = ", ".join(v.tag for v in fetch)
        label = f"variant {tags}" if len(fetch) == 1 else f"variants {tags} (to measure)"
        self._changes = {"variant": fetch[0].tag}
        self._done_note = (
            f"downloaded {label}: {_human(fetched)} of the bundle's {_human(record.length)}",
            fetched,
        )

    def _fetch_part(
        self, tuf: TufClient, info: TargetFile, staging: Path,
        progress: Callable[[int, int], None] | None,
    ) -> int:  # fmt: skip
        """Download one part (resuming), check it against TUF; the bytes this call fetched."""
        from tuf.api import exceptions as tuf_errors

        from mcp_edge.agent.update.tuf_client import TufClient

        dest = staging / _staged_name(info)
        if _size(dest) == info.length:
            try:
                TufClient.verify_file(info, dest)
                return 0  # fetched before a restart
            except UpdateError:
                dest.unlink(missing_ok=True)
        try:
            got = self.transport.download(tuf.target_url(info), dest, length=info.length,
                                          progress=progress)  # fmt: skip
        except tuf_errors.DownloadLengthMismatchError as e:
            dest.unlink(missing_ok=True)
            raise UpdateError(Cause.TOO_LONG, f"{info.path}: {e}") from e
        except tuf_errors.DownloadError as e:
            raise UpdateError(Cause.TRANSPORT, f"{info.path}: {e}") from e
        try:
            TufClient.verify_file(info, dest)
        except UpdateError:
            dest.unlink(missing_ok=True)
            raise
        return got

    def _staged_manifest(
        self, record: UpdateRecord, tuf: TufClient, parts: BundleParts, staging: Path
    ) -> tuple[BundleManifest, str]:
        """The staged manifest and signature, checked against the publisher keys TUF lists and
        against the record's name and version."""
        from mcp_edge.shared.bundle.parts import verify_manifest_parts

        manifest_bytes = self._staged_bytes(tuf, parts.manifest, staging)
        signature_bytes = self._staged_bytes(tuf, parts.signature, staging)
        publishers = tuf.publishers()
        if not publishers:
            raise UpdateError(
                Cause.PUBLISHER, "the signed targets metadata lists no publisher keys"
            )
        try:
            manifest, signer = verify_manifest_parts(
                manifest_bytes, signature_bytes, publishers.values(), self.limits
            )
        except BundleError as e:
            signature = isinstance(e.__cause__, SigningError) or e.member == SIGNATURE_NAME \
                or "signature" in str(e)  # fmt: skip
            raise UpdateError(Cause.PUBLISHER if signature else Cause.BUNDLE, str(e)) from e
        if (manifest.name, manifest.version) != (record.model, record.to_version):
            raise UpdateError(
                Cause.MANIFEST_MISMATCH,
                f"the manifest is {manifest.name} {manifest.version}, not the "
                f"{record.model} {record.to_version} asked for",
            )
        return manifest, signer

    def _staged_bytes(self, tuf: TufClient, path: str, staging: Path) -> bytes:
        from mcp_edge.agent.update.tuf_client import TufClient

        info = tuf.target(path)
        staged = staging / _staged_name(info)
        try:
            TufClient.verify_file(info, staged)
        except FileNotFoundError as e:
            raise UpdateError(Cause.INTERRUPTED, f"{staged}: the download is gone") from e
        return staged.read_bytes()

    @staticmethod
    def _part_info(
        tuf: TufClient, parts: BundleParts, manifest: BundleManifest, member: str
    ) -> TargetFile:
        """The TUF target of ``member``; refused unless TUF and the manifest agree on it."""
        path = parts.files.get(member)
        if path is None:
            raise UpdateError(Cause.BUNDLE, f"the repository does not list {member} of "
                                            f"{manifest.name} {manifest.version} as a part")  # fmt: skip
        info = tuf.target(path)
        entry = manifest.file_entry(member)
        if (info.length, info.hashes.get("sha256")) != (entry.size, entry.sha256):
            raise UpdateError(
                Cause.BUNDLE,
                f"{path}: TUF lists {info.length} bytes, sha256 "
                f"{str(info.hashes.get('sha256'))[:16]}…, the signed manifest {entry.size} "
                f"bytes, sha256 {entry.sha256[:16]}… (the repository and the publisher disagree)",
            )
        return info

    def _ranking(
        self, record: UpdateRecord, manifest: BundleManifest, *, announce: bool = True
    ) -> Ranking:
        """The variants this device may run, best first, less those that already failed in
        this deployment; ``no_variant`` when none is left. With ``announce``, the variants
        skipped (and why) make one event."""
        ranking = rank_variants(manifest, self.profile, self.backend_available)
        if ranking.skipped and announce:
            self.emit(record, record.phase, EventOutcome.PROGRESS, ranking.describe_skipped())
        left = tuple(v for v in ranking.candidates if v.tag not in record.failed_variants)
        if not left:
            failed = "; ".join(f"variant {t} failed: {why}"
                               for t, why in record.failed_variants.items())  # fmt: skip
            formats = ", ".join(sorted(self.profile.runtime.formats))
            detail = "; ".join(x for x in (ranking.describe_skipped(), failed) if x)
            raise UpdateError(
                Cause.NO_VARIANT if not record.failed_variants else Cause.LOAD_FAILED,
                f"no variant of {manifest.name} {manifest.version} is left to run on profile "
                f"{self.profile.name} (it runs {formats}; the bundle has "
                f"{', '.join(f'{v.tag}:{v.format}' for v in manifest.variants)})"
                + (f": {detail}" if detail else ""),
            )
        return Ranking(left, ranking.skipped)

    def _to_fetch(self, ranking: Ranking) -> list[Variant]:
        """The first candidate, or the candidates to measure (when measuring is on and there
        is more than one variant × backend to try)."""
        settings = self.profile.runtime.selection
        if settings.measure:
            chosen = list(ranking.candidates[: settings.max_candidates])
            if len(self._measured(chosen, {v.tag: Path(v.file) for v in chosen})) > 1:
                return chosen
        return [ranking.candidates[0]]

    def _measured(self, variants: list[Variant], paths: dict[str, Path]) -> list[Any]:
        """The selection candidates of ``variants`` (each on its backend, or on every backend
        the profile runs its format with), at most ``max_candidates``."""
        from mcp_edge.agent.runtime.selection import Candidate, candidate_backends

        found: list[Candidate] = []
        for v in variants:
            backends = [v.backend] if v.backend else candidate_backends(v.format, self.profile)
            for backend in backends or ["onnxruntime" if v.format == "onnx" else "tflite"]:
                q = v.quantization
                found.append(Candidate(v.tag, paths[v.tag], backend, quantized=q is not None,
                                       top1_agreement=q.top1_agreement if q else None))  # fmt: skip
        return found[: self.profile.runtime.selection.max_candidates]

    # ------------------------------------------------------------------ verifying
    async def _verify(self, record: UpdateRecord) -> Trigger:
        def work() -> None:
            from tuf.api.metadata import TargetFile

            from mcp_edge.agent.update.tuf_client import TufClient

            have = self.store.installed(record.model, record.to_version)
            if have is not None and have.sha256 == record.sha256:
                return
            if record.variant is not None:
                self._verify_parts(record)
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
            try:
                variants = self._to_fetch(self._ranking(record, manifest))
            except UpdateError:
                self.store.discard_unpacked(unpack)
                raise
            tag, backend, choice = self._choose(record, variants, unpack)
            self._write_info(record, manifest, unpack, tag, opened.signer_keyid, backend, choice)

        await _in_thread(work)
        return Trigger.VERIFIED

    def _verify_parts(self, record: UpdateRecord) -> None:
        """Check the staged parts again (TUF hashes, publisher signature, manifest hashes),
        lay them out as an unpacked bundle holding only the chosen files (worker thread)."""
        tuf = self._tuf_client()
        info = self._target or tuf.target(record.target_path)
        parts = parts_of(info)
        if parts is None:
            raise UpdateError(Cause.INTERRUPTED, f"{record.target_path} lists no parts any more")
        staging = self.store.staged_parts(record.sha256)
        manifest, signer = self._staged_manifest(record, tuf, parts, staging)
        ranking = self._ranking(record, manifest, announce=False)
        variants = self._to_fetch(ranking)
        if variants[0].tag != record.variant:
            variants = [manifest.variant(record.variant)] if record.variant else variants
        unpack = self.store.unpack_dir(record.model, record.to_version)
        self.store.discard_unpacked(unpack)
        unpack.mkdir(parents=True)
        from mcp_edge.agent.update.tuf_client import TufClient

        for member in [v.file for v in variants] + _other_files(manifest):
            part = self._part_info(tuf, parts, manifest, member)
            staged = staging / _staged_name(part)
            try:
                TufClient.verify_file(part, staged)
            except FileNotFoundError as e:
                raise UpdateError(Cause.INTERRUPTED, f"{staged}: the download is gone") from e
            _check_member(manifest, member, staged)
            _place(staged, unpack / member)
        atomic_write_bytes(unpack / MANIFEST_NAME, self._staged_bytes(tuf, parts.manifest, staging))
        atomic_write_bytes(unpack / SIGNATURE_NAME,
                           self._staged_bytes(tuf, parts.signature, staging))  # fmt: skip
        tag, backend, choice = self._choose(record, variants, unpack)
        for v in variants:
            if v.tag != tag:
                (unpack / v.file).unlink(missing_ok=True)
        for directory in {(unpack / m).parent for m in _member_dirs(manifest)} | {unpack}:
            if directory.is_dir():
                fsync_dir(directory)
        self._changes = {"variant": tag}
        self._write_info(record, manifest, unpack, tag, signer, backend, choice)

    def _choose(
        self, record: UpdateRecord, variants: list[Variant], root: Path
    ) -> tuple[str, str | None, dict[str, Any] | None]:
        """``(variant, backend, choice)``: by measurement when there are several candidates to
        measure (see :meth:`_to_fetch`), else the first variant on the profile's backends."""
        if len(variants) < 2 and not self.profile.runtime.selection.measure:
            return variants[0].tag, None, None
        candidates = self._measured(variants, {v.tag: root / v.file for v in variants})
        if len(candidates) < 2:
            return variants[0].tag, None, None
        from mcp_edge.agent.runtime.selection import select

        settings = self.profile.runtime.selection
        try:
            chosen: Selection = select(candidates, self.profile, budget_s=settings.budget_s,
                                       max_candidates=settings.max_candidates)  # fmt: skip
        except RunnerError as e:
            raise UpdateError(Cause.LOAD_FAILED, f"no candidate passed its checks: {e}") from e
        self.emit(record, Phase.VERIFYING, EventOutcome.PROGRESS, chosen.summary())
        return chosen.chosen.variant, chosen.chosen.backend, _member_paths(chosen.to_json(), root)

    def _write_info(
        self, record: UpdateRecord, manifest: BundleManifest, unpack: Path, tag: str,
        signer: str | None, backend: str | None, choice: dict[str, Any] | None,
    ) -> None:  # fmt: skip
        info_doc = InstallInfo(
            name=manifest.name, version=manifest.version,
            version_numeric=version_numeric(manifest.version), variant=tag,
            model_file=manifest.variant(tag).file, target_path=record.target_path,
            sha256=record.sha256, length=record.length, signer_keyid=signer,
            installed_at=self.clock(), backend=backend, choice=choice,
        )  # fmt: skip
        self.store.write_install_info(unpack, info_doc)

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
            shutil.rmtree(self.store.staged_parts(record.sha256), ignore_errors=True)
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
        try:
            await self._ensure_loaded(record)
        except UpdateError as e:
            return await self._next_variant_or_raise(record, e)
        return Trigger.LOADED

    async def _next_variant_or_raise(self, record: UpdateRecord, e: UpdateError) -> Trigger:
        """After a variant installed from parts failed to load or warm up: note it in the
        record, put back what served, remove the install and go fetch the next candidate;
        re-raise ``e`` when the deployment was no parts install or no candidate is left."""
        if e.cause is not Cause.LOAD_FAILED or record.variant is None:
            raise e
        info = self.store.installed(record.model, record.to_version)
        if info is None or info.variant != record.variant:
            raise e
        if record.to_version in self.store.index(record.model).referenced():
            raise e  # committed in another role: not this deployment's to replace
        failed = {**record.failed_variants, record.variant: str(e)[:300]}
        try:
            manifest = BundleManifest.model_validate_json(
                (
                    self.store.version_dir(record.model, record.to_version) / MANIFEST_NAME
                ).read_bytes()
            )
        except (OSError, ValueError):
            raise e from None
        ranking = rank_variants(manifest, self.profile, self.backend_available)
        left = [v.tag for v in ranking.candidates if v.tag not in failed]
        if not left:
            raise UpdateError(
                Cause.LOAD_FAILED,
                f"variant {record.variant} failed: {e}; no other variant is left to try",
            ) from e
        self.emit(record, record.phase, EventOutcome.PROGRESS,
                  f"variant {record.variant} failed its load and output checks: {e}; "
                  f"trying {left[0]}", cause=Cause.LOAD_FAILED.value)  # fmt: skip
        await self._put_back(record)
        await _in_thread(self.store.remove_version, record.model, record.to_version)
        self._changes = {"failed_variants": failed, "variant": None}
        return Trigger.NEXT_VARIANT

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
        try:
            await self._ensure_loaded(record)
            try:
                lv = self.manager.get(record.model, record.to_version)
                feeds = synthetic_inputs(lv.info, 1)
                _, out = await self.manager.infer(lv, feeds, pinned=True)
                check_outputs(lv.info, out, 1)
            except RunnerError as e:
                raise UpdateError(Cause.LOAD_FAILED, f"probe request failed: {e}") from e
        except UpdateError as e:
            return await self._next_variant_or_raise(record, e)
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
        elif not committed:
            await self._put_back(record)
        if not committed:
            await _in_thread(self.store.remove_version, name, version)
        return Trigger.ROLLED_BACK

    async def _put_back(self, record: UpdateRecord) -> None:
        """Unload the uncommitted new version; when it had been swapped in as stable, load the
        committed stable version again first."""
        index = self.store.index(record.model)
        name, version = record.model, record.to_version
        roles = loaded_roles(self.manager, name)
        if record.role != "prefetch" and version in roles:
            restore = index.active if record.role == "stable" else None
            if restore is not None and restore != version and roles[version] == "stable":
                info = self.store.installed(name, restore)
                if info is not None:
                    try:
                        await self.manager.load(installed_source(self.store, info), role="stable")
                        self.emit(record, record.phase, EventOutcome.PROGRESS,
                                  f"{restore} serves again")  # fmt: skip
                    except RunnerError as e:
                        log.error("%s: could not put %s back: %s", name, restore, e)
            if version in loaded_roles(self.manager, name):
                await self.manager.unload(name, version)


_DONE = {
    Phase.DOWNLOADING: "downloaded",
    Phase.VERIFYING: "verified: TUF hashes, publisher signature, manifest, variant",
    Phase.INSTALLING: "installed",
    Phase.LOADING: "loaded and swapped in",
    Phase.WARMING: "probe request answered; committed",
    Phase.ROLLING_BACK: "rolled back",
}
_PREFETCHED = "prefetched: verified and installed for a later switch; not loaded"


@dataclass(frozen=True)
class BundleParts:
    """The parts a bundle target's signed ``custom.parts`` names (docs/repository.md)."""

    manifest: str
    signature: str
    files: dict[str, str]


MAX_PARTS = 64


def parts_of(info: TargetFile) -> BundleParts | None:
    """The parts of a bundle target, or None for one published without them. The field is
    signed by TUF, but still checked: paths must be safe repository paths."""
    from mcp_edge.shared.protocol.repo import validate_repo_path

    custom = info.unrecognized_fields.get("custom")
    raw = custom.get("parts") if isinstance(custom, dict) else None
    if raw is None:
        return None
    problem = UpdateError(Cause.TUF_METADATA, f"{info.path}: custom.parts is malformed")
    if not isinstance(raw, dict):
        raise problem
    manifest, signature, files = raw.get("manifest"), raw.get("signature"), raw.get("files")
    if not isinstance(manifest, str) or not isinstance(signature, str):
        raise problem
    if not isinstance(files, dict) or len(files) > MAX_PARTS:
        raise problem
    paths = [manifest, signature, *files.values()]
    if not all(isinstance(k, str) for k in files) or not all(isinstance(p, str) for p in paths):
        raise problem
    try:
        for path in paths:
            validate_repo_path(f"targets/{path}")
    except McpError as e:
        raise UpdateError(Cause.TUF_METADATA, f"{info.path}: custom.parts: {e}") from e
    return BundleParts(manifest, signature, {str(k): str(v) for k, v in files.items()})


def _staged_name(info: TargetFile) -> str:
    """A staged part's file name: its sha256 (a resume continues the right bytes)."""
    sha = info.hashes.get("sha256")
    if not isinstance(sha, str) or len(sha) != 64 or not all(c in "0123456789abcdef" for c in sha):
        raise UpdateError(Cause.TUF_METADATA, f"{info.path}: no usable sha256 in its metadata")
    return sha


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _other_files(manifest: BundleManifest) -> list[str]:
    """The bundle's files that belong to no variant (labels...): every device fetches them."""
    variant_files = {v.file for v in manifest.variants}
    return [f.path for f in manifest.files if f.path not in variant_files]


def _member_dirs(manifest: BundleManifest) -> list[str]:
    return [f.path for f in manifest.files]


def _check_member(manifest: BundleManifest, member: str, path: Path) -> None:
    from mcp_edge.shared.bundle.parts import check_member_file

    try:
        check_member_file(manifest, member, path)
    except BundleError as e:
        path.unlink(missing_ok=True)
        raise UpdateError(Cause.HASH_MISMATCH, str(e)) from e


def _place(staged: Path, dest: Path) -> None:
    """Put a checked staged file at ``dest`` in the unpack directory: a hard link (no second
    copy on disk), or a copy, fsynced, where the file system has no links."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(staged, dest)
    except OSError:
        tmp = dest.with_name(f".{dest.name}.tmp")
        shutil.copyfile(staged, tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, dest)
    os.chmod(dest, 0o644)


def _member_paths(doc: Any, root: Path) -> Any:
    """``doc`` with each ``model_path`` under ``root`` (the unpack directory, gone once the
    version is installed) written as the member path inside the version directory."""
    if isinstance(doc, dict):
        out = {k: _member_paths(v, root) for k, v in doc.items()}
        path = out.get("model_path")
        if isinstance(path, str) and Path(path).is_relative_to(root):
            out["model_path"] = Path(path).relative_to(root).as_posix()
        return out
    if isinstance(doc, list):
        return [_member_paths(v, root) for v in doc]
    return doc


def _human(n: int) -> str:
    """Bytes for an event message: ``812 B``, ``10.2 KiB``, ``3.4 MiB``, ``1.2 GiB``."""
    if n < 1024:
        return f"{n} B"
    for unit in ("KiB", "MiB", "GiB"):
        n_f = n / 1024.0
        if n_f < 1024 or unit == "GiB":
            return f"{n_f:.1f} {unit}"
        n = int(n_f)
    return f"{n} B"


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
