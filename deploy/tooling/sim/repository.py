"""TUF over MQTT for thousands of devices in one process: real requests, shared verdicts.

Every simulated device asks the control plane's repository for the very files a real agent's
ngclient asks for, over its own MQTT session and the agent's own transport
(:class:`agent.update.transport_mqtt.MqttRepoTransport`, chunk by chunk with retries)::

    metadata/{n+1}.root.json         probed until not_found (root rotation)
    metadata/timestamp.json
    metadata/{v}.snapshot.json       v from the timestamp (consistent snapshots)
    metadata/{v}.targets.json        v from the snapshot
    targets/{dir}/{sha256}.{name}    the bundle, every chunk

**The shortcut.** Running python-tuf's ngclient per device (a trusted-metadata set, signature
checks and a metadata cache on disk for each of 10,000 devices on 2 cores) is out of reach, so
verification is done once per distinct content, process-wide. :class:`SharedVerdicts` keys each
verdict by the sha256 of the bytes a device received (and of the files before them in the
chain): the first device holding bytes that hash to a new key runs the real checks —
python-tuf's ``TrustedMetadataSet`` (signatures by the root's keys, versions, the hashes and
lengths the timestamp and snapshot list, expiry) from the fleet's enrollment root, then the
bundle's publisher signature and manifest (:func:`shared.bundle.verify_bundle` against the
publisher keys the verified targets list) — and every device whose bytes hash the same reuses
the verdict. A device's own bytes are always hashed, so a device handed different bytes gets
its own verification, and target bytes that do not match the signed length and hashes are a
``hash_mismatch`` failure for that device. A verdict is reused only until the earliest
expiry in its chain. What a device does not keep: its own trusted metadata between
deployments, so the rollback check against the versions it trusted before (ngclient's) is not
made per device; a repository serving the same signed files to all devices makes that moot.

Failures come out as :class:`agent.update.machine.UpdateError` with the agent's causes
(``transport`` is transient: the caller retries).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import tempfile
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

from tuf.api import exceptions as tuf_errors
from tuf.api.metadata import Metadata, Root, Targets
from tuf.ngclient._internal.trusted_metadata_set import TrustedMetadataSet
from tuf.ngclient.config import EnvelopeType, UpdaterConfig

from mcp_edge.agent.update.machine import Cause, UpdateError
from mcp_edge.agent.update.transport_mqtt import MqttRepoTransport
from mcp_edge.agent.update.tuf_client import PUBLISHERS_FIELD
from mcp_edge.shared.bundle import verify_bundle
from mcp_edge.shared.errors import BundleError, SigningError
from mcp_edge.shared.protocol.repo import MAX_CHUNK_BYTES, RepoStatus
from mcp_edge.shared.signing import PublicKey

log = logging.getLogger("mcp.sim.repository")

_LIMITS = UpdaterConfig()
MAX_ROOT_ROTATIONS = _LIMITS.max_root_rotations
WINDOW = 8
"""Chunk requests in flight per target download (the agent's default window)."""
T = TypeVar("T")


@dataclass(frozen=True)
class TargetInfo:
    """One target as the verified targets metadata lists it."""

    path: str
    length: int
    hashes: Mapping[str, str]

    @property
    def url_path(self) -> str:
        """The consistent-snapshot repository path of its bytes."""
        dirname, sep, basename = self.path.rpartition("/")
        return f"targets/{dirname}{sep}{self.hashes['sha256']}.{basename}"


@dataclass(frozen=True)
class VerifiedTargets:
    """What a verified metadata chain says: the targets, the publisher keys, until when."""

    targets: Mapping[str, TargetInfo]
    publishers: tuple[PublicKey, ...]
    expires: float
    """Unix seconds: the earliest expiry in the chain."""


@dataclass(frozen=True)
class _Step:
    next_version: int
    expires: float


class SharedVerdicts:
    """Process-wide TUF and bundle verdicts keyed by content (see the module docstring).

    ``root`` is the fleet's TUF root from enrollment; ``scratch`` a directory for bundle
    checks. Concurrent requests for the same key wait on one verification.
    """

    def __init__(
        self, root: bytes, scratch: Path, *, clock: Callable[[], float] = time.time
    ) -> None:
        self._root = root
        self._root_version = Metadata[Root].from_bytes(root).signed.version
        self._scratch = scratch
        self._clock = clock
        self._verdicts: dict[tuple[str, ...], asyncio.Future[Any]] = {}
        self.verifications = 0
        """Verifications actually run (cache misses)."""
        self.reused = 0
        """Verdicts served from the cache."""

    # ------------------------------------------------------------------ per device
    async def refresh(self, transport: MqttRepoTransport) -> VerifiedTargets:
        """Fetch the metadata chain over ``transport`` and return its verdict.

        Raises :class:`UpdateError` (``transport``, ``tuf_expired``, ``tuf_metadata``).
        """
        roots = [self._root]
        version = self._root_version
        for _ in range(MAX_ROOT_ROTATIONS):
            newer = await fetch_file(
                transport, f"metadata/{version + 1}.root.json", _LIMITS.root_max_length
            )
            if newer is None:
                break
            roots.append(newer)
            version += 1
        chain = tuple(_sha(r) for r in roots[1:])
        ts = await _required(transport, "metadata/timestamp.json", _LIMITS.timestamp_max_length)
        key = (*chain, "ts", _sha(ts))
        step = await self._verdict(key, lambda: self._verify(roots, ts))
        snap = await _required(transport, f"metadata/{step.next_version}.snapshot.json",
                               _LIMITS.snapshot_max_length)  # fmt: skip
        key = (*key, _sha(snap))
        step = await self._verdict(key, lambda: self._verify(roots, ts, snap))
        targets = await _required(transport, f"metadata/{step.next_version}.targets.json",
                                  _LIMITS.targets_max_length)  # fmt: skip
        key = (*key, _sha(targets))
        verified: VerifiedTargets = await self._verdict(
            key, lambda: self._verify(roots, ts, snap, targets)
        )
        return verified

    async def check_bundle(
        self, data: bytes, info: TargetInfo, model: str, version: str, keys: tuple[PublicKey, ...]
    ) -> None:
        """Check a device's downloaded ``data`` against ``info`` (length and every hash: its
        own bytes, every time), then the bundle's publisher signature and manifest (once per
        distinct content). Raises :class:`UpdateError`."""
        if len(data) != info.length:
            raise UpdateError(Cause.HASH_MISMATCH,
                              f"{info.path}: {len(data)} bytes, TUF signed {info.length}")  # fmt: skip
        for algorithm, expected in info.hashes.items():
            try:
                got = hashlib.new(algorithm, data).hexdigest()
            except ValueError:
                raise UpdateError(Cause.TUF_METADATA,
                                  f"{info.path}: unknown hash algorithm {algorithm}") from None  # fmt: skip
            if got != expected:
                raise UpdateError(Cause.HASH_MISMATCH,
                                  f"{info.path}: {algorithm} {got[:16]}… is not the signed "
                                  f"{expected[:16]}…")  # fmt: skip
        key = ("bundle", info.hashes["sha256"], model, version, *(k.keyid for k in keys))
        await self._verdict(key, lambda: self._verify_bundle(data, model, version, keys))

    # ------------------------------------------------------------------ the cache
    async def _verdict(self, key: tuple[str, ...], verify: Callable[[], Awaitable[T]]) -> T:
        future = self._verdicts.get(key)
        if future is not None:
            if not future.done():
                self.reused += 1
                shared: T = await asyncio.shield(future)
                return shared
            error = future.exception()
            if error is None:
                result: T = future.result()
                if getattr(result, "expires", float("inf")) > self._clock():
                    self.reused += 1
                    return result
            if isinstance(error, UpdateError) and error.cause is not Cause.TUF_EXPIRED:
                self.reused += 1
                raise error
        future = asyncio.get_running_loop().create_future()
        self._verdicts[key] = future
        self.verifications += 1
        try:
            value = await verify()
        except UpdateError as e:
            future.set_exception(e)
            future.exception()  # retrieved here: waiters re-raise it
            raise
        except BaseException as e:
            del self._verdicts[key]
            future.set_exception(UpdateError(Cause.INTERNAL, f"verification failed: {e!r}"))
            future.exception()
            raise
        future.set_result(value)
        return value

    async def _verify(self, roots: list[bytes], *files: bytes) -> Any:
        return await asyncio.to_thread(self._verify_chain, roots, files)

    def _verify_chain(self, roots: list[bytes], files: tuple[bytes, ...]) -> Any:
        """python-tuf's checks over root chain, timestamp[, snapshot[, targets]]."""
        try:
            trusted = TrustedMetadataSet(roots[0], EnvelopeType.METADATA)
            for newer in roots[1:]:
                trusted.update_root(newer)
            expires = [trusted.root.expires]
            ts = trusted.update_timestamp(files[0])
            expires.append(ts.expires)
            if len(files) == 1:
                return _Step(ts.snapshot_meta.version, _earliest(expires))
            snapshot = trusted.update_snapshot(files[1])
            expires.append(snapshot.expires)
            if len(files) == 2:
                return _Step(snapshot.meta["targets.json"].version, _earliest(expires))
            targets = trusted.update_targets(files[2])
            expires.append(targets.expires)
            return VerifiedTargets(_targets_of(targets), _publishers_of(targets),
                                   _earliest(expires))  # fmt: skip
        except tuf_errors.ExpiredMetadataError as e:
            raise UpdateError(Cause.TUF_EXPIRED, f"repository metadata: {e}") from e
        except (tuf_errors.RepositoryError, ValueError, KeyError) as e:
            raise UpdateError(Cause.TUF_METADATA,
                              f"repository metadata: {type(e).__name__}: {e}") from e  # fmt: skip

    async def _verify_bundle(
        self, data: bytes, model: str, version: str, keys: tuple[PublicKey, ...]
    ) -> bool:
        if not keys:
            raise UpdateError(Cause.PUBLISHER, "the signed targets metadata lists no publishers")
        return await asyncio.to_thread(self._verify_bundle_file, data, model, version, keys)

    def _verify_bundle_file(
        self, data: bytes, model: str, version: str, keys: tuple[PublicKey, ...]
    ) -> bool:
        self._scratch.mkdir(parents=True, exist_ok=True, mode=0o700)
        with tempfile.NamedTemporaryFile(dir=self._scratch, suffix=".mcpb") as f:
            f.write(data)
            f.flush()
            try:
                verified = verify_bundle(f.name, keys, validate_models=False)
            except BundleError as e:
                signature = isinstance(e.__cause__, SigningError) or "signature" in str(e)
                raise UpdateError(Cause.PUBLISHER if signature else Cause.BUNDLE, str(e)) from e
        manifest = verified.manifest
        if (manifest.name, manifest.version) != (model, version):
            raise UpdateError(Cause.MANIFEST_MISMATCH,
                              f"the bundle is {manifest.name} {manifest.version}, not the "
                              f"{model} {version} asked for")  # fmt: skip
        return True


# ------------------------------------------------------------------------------- fetching
async def fetch_file(transport: MqttRepoTransport, path: str, max_length: int) -> bytes | None:
    """The whole repository file ``path`` (None when the repository answers not_found), with
    ``WINDOW`` chunk requests in flight. Raises :class:`UpdateError`: ``transport`` (no answer
    after the transport's retries, a server error), ``too_long`` (over ``max_length``)."""
    first, size = await _chunk(transport, path, 0, MAX_CHUNK_BYTES, max_length)
    if first is None:
        return None
    parts = [first]
    offset = len(first)
    window: deque[tuple[int, asyncio.Task[tuple[bytes | None, int]]]] = deque()
    try:
        while window or offset < size:
            while len(window) < WINDOW and offset < size:
                n = min(MAX_CHUNK_BYTES, size - offset)
                task = asyncio.ensure_future(_chunk(transport, path, offset, n, max_length))
                window.append((offset, task))
                offset += n
            _, task = window.popleft()
            data, total = await task
            if data is None or total != size:
                raise UpdateError(Cause.TRANSPORT, f"{path} changed while being read")
            parts.append(data)
    finally:
        for _, task in window:
            task.cancel()
    return b"".join(parts)


async def _required(transport: MqttRepoTransport, path: str, max_length: int) -> bytes:
    data = await fetch_file(transport, path, max_length)
    if data is None:
        raise UpdateError(Cause.TUF_METADATA, f"the repository has no {path}")
    return data


async def _chunk(
    transport: MqttRepoTransport, path: str, offset: int, length: int, max_length: int
) -> tuple[bytes | None, int]:
    try:
        reply, data = await transport.request(path, offset, length)
    except asyncio.CancelledError:
        raise
    except Exception as e:  # the transport's own "no answer after every retry" error
        raise UpdateError(Cause.TRANSPORT, f"{path}@{offset}: {e}") from e
    if reply.status is RepoStatus.NOT_FOUND:
        return None, 0
    if reply.status is not RepoStatus.OK or reply.size is None:
        raise UpdateError(Cause.TRANSPORT, f"{path}: the repository answered "
                          f"{reply.status.value}: {reply.error or 'no reason given'}")  # fmt: skip
    if reply.size > max_length:
        raise UpdateError(Cause.TOO_LONG,
                          f"{path} is {reply.size} bytes, more than {max_length}")  # fmt: skip
    expected = max(0, min(length, reply.size - offset))
    if reply.offset != offset or len(data) != expected:
        raise UpdateError(Cause.TRANSPORT, f"{path}: reply of {len(data)} bytes at "
                          f"{reply.offset}, asked {expected} at {offset}")  # fmt: skip
    return data, reply.size


# ------------------------------------------------------------------------------- helpers
def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _earliest(expiries: list[datetime]) -> float:
    return min(e.replace(tzinfo=e.tzinfo or timezone.utc).timestamp() for e in expiries)


def _targets_of(targets: Targets) -> dict[str, TargetInfo]:
    out: dict[str, TargetInfo] = {}
    for path, info in targets.targets.items():
        if "sha256" in info.hashes:
            out[path] = TargetInfo(path, info.length, dict(info.hashes))
    return out


def _publishers_of(targets: Targets) -> tuple[PublicKey, ...]:
    listed: Any = targets.unrecognized_fields.get(PUBLISHERS_FIELD) or {}
    keys: list[PublicKey] = []
    if isinstance(listed, dict):
        for keyid, hexkey in listed.items():
            try:
                key = PublicKey.from_hex(str(hexkey))
            except SigningError:
                continue
            if key.keyid == keyid:
                keys.append(key)
    return tuple(keys)
