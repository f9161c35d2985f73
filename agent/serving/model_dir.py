"""The model directory behind ``mcp-agent serve``: model files on disk → loaded models.

``--model-path`` is one model file or a directory of them (``.onnx``, ``.tflite``, ``.mcpb``;
other files are ignored). A model's name is its file's stem (``digits.onnx`` → ``digits``)
unless its bundle names it. Plain files get versions ``1``, ``2``, … in the order they are
loaded, and each version is a copy of the file as it was then (under the state directory), so
a file replaced or rewritten later never changes a version already loaded, and every serving
process (``--processes``) loads the same bytes for it; a bundle brings its own version. A bundle is verified and unpacked into the state
directory (its publisher signature is required when trusted keys are configured), and the
variant that fits this device's profile is loaded.

:class:`ModelDirectoryWatcher` polls the files: when one changes (new mtime, size or inode) and
has stayed the same for one more poll (so a half-copied file is never loaded), the new content
goes through the same hot-swap path as any other load; a removed file unloads its model.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mcp_edge.agent.runtime.manager import ModelManager, ModelSource
from mcp_edge.agent.runtime.runner import RunnerError
from mcp_edge.shared.errors import McpError
from mcp_edge.shared.profiles import HardwareProfile

if TYPE_CHECKING:
    from mcp_edge.shared.bundle import BundleManifest
    from mcp_edge.shared.signing import PublicKey

log = logging.getLogger("mcp.agent.model_dir")

MODEL_SUFFIXES = (".onnx", ".tflite", ".mcpb")
Fingerprint = tuple[int, int, int]


class ModelDirectoryError(McpError):
    """The model path cannot be served (missing, empty, or two files claim one name)."""


@dataclass(frozen=True)
class ModelFile:
    path: Path
    fingerprint: Fingerprint


def fingerprint(path: Path) -> Fingerprint:
    st = path.stat()
    return (st.st_mtime_ns, st.st_size, st.st_ino)


def scan(model_path: Path) -> dict[Path, ModelFile]:
    """The model files under ``model_path`` (a file or a directory, not recursive)."""
    if model_path.is_file():
        candidates = [model_path]
    elif model_path.is_dir():
        candidates = sorted(p for p in model_path.iterdir() if p.is_file())
    else:
        raise ModelDirectoryError(f"{model_path}: no such file or directory")
    found: dict[Path, ModelFile] = {}
    for p in candidates:
        if p.suffix.lower() in MODEL_SUFFIXES and not p.name.startswith("."):
            with contextlib.suppress(FileNotFoundError):
                found[p] = ModelFile(p, fingerprint(p))
    return found


def pick_variant(manifest: BundleManifest, profile: HardwareProfile) -> str:
    """The variant tag for ``profile``: one listing the profile by name, else the first of the
    profile's preferred tags the bundle has, else ``default``."""
    for v in manifest.variants:
        if profile.name in v.profiles:
            return v.tag
    tags = {v.tag for v in manifest.variants}
    for tag in profile.variants.tags:
        if tag in tags:
            return tag
    return "default"


def bundle_source(
    manifest: BundleManifest,
    root: Path,
    tag: str,
    *,
    origin: Path | None = None,
    signer_keyid: str | None = None,
    backend: str | None = None,
) -> ModelSource:
    """The :class:`ModelSource` of variant ``tag`` of a bundle unpacked (and verified) under
    ``root``: its model file, labels, preprocessing and drift baseline. Raises KeyError for an
    unknown tag."""
    labels: tuple[str, ...] = ()
    if manifest.labels is not None:
        text = (root / manifest.labels.file).read_text(encoding="utf-8")
        labels = tuple(line.strip() for line in text.splitlines() if line.strip())
    pre = manifest.preprocessing.model_dump(mode="json") if manifest.preprocessing else None
    return ModelSource(
        name=manifest.name,
        version=manifest.version,
        model_path=root / manifest.variant(tag).file,
        labels=labels,
        preprocessing=pre,
        origin=origin,
        signer_keyid=signer_keyid,
        drift_baseline=manifest.drift_baseline,
        variant=tag,
        backend=backend,
    )


class ModelDirectory:
    """Turns model files into :class:`ModelSource` objects the manager can load."""

    def __init__(
        self,
        model_path: Path,
        *,
        state_dir: Path,
        profile: HardwareProfile,
        trusted_keys: Sequence[PublicKey] = (),
    ) -> None:
        self.model_path = model_path
        self.profile = profile
        self.trusted_keys = list(trusted_keys)
        self.bundle_dir = state_dir / "bundles"
        self.copies_dir = self.bundle_dir / "files"
        self._copies: dict[tuple[str, str], Path] = {}
        self._counters: dict[str, int] = {}
        self._names: dict[Path, str] = {}

    def owned_names(self) -> set[str]:
        """Names of the models this directory's files serve (loaded from here)."""
        return set(self._names.values())

    def name_of(self, path: Path) -> str:
        """The model name ``path`` serves: known once loaded, else its stem (a bundle's own
        name is known only once it has been opened)."""
        return self._names.get(path) or path.stem

    def claim(self, path: Path, name: str) -> None:
        """Record that ``path`` serves ``name`` (loaded by explicit model control)."""
        self._names[path] = name

    def reset_bundle_dir(self) -> None:
        """Remove bundles unpacked by an earlier run."""
        shutil.rmtree(self.bundle_dir, ignore_errors=True)
        self.bundle_dir.mkdir(parents=True, exist_ok=True)

    def source_for(self, path: Path) -> ModelSource:
        """Prepare ``path`` for loading (verify and unpack a bundle). Raises McpError."""
        if path.suffix.lower() == ".mcpb":
            return self._bundle_source(path)
        name = path.stem
        version = self._counters.get(name, 0) + 1
        self._counters[name] = version
        copy = self._copy(path, name, str(version))
        return ModelSource(name=name, version=str(version), model_path=copy, origin=path)

    def _copy(self, path: Path, name: str, version: str) -> Path:
        """Version ``version`` of ``name``: a copy of ``path`` as it is now."""
        self.copies_dir.mkdir(parents=True, exist_ok=True)
        dest = self.copies_dir / f"{name}-{version}{path.suffix.lower()}"
        tmp = dest.with_name(dest.name + ".tmp")
        shutil.copyfile(path, tmp)
        os.replace(tmp, dest)
        self._copies[name, version] = dest
        return dest

    def prune(self, manager: ModelManager) -> None:
        """Delete the copies of versions that are no longer loaded (nor draining)."""
        for (n, version), copy in list(self._copies.items()):
            if manager.find(n, version) is None:
                with contextlib.suppress(OSError):
                    copy.unlink()
                del self._copies[n, version]

    def _bundle_source(self, path: Path) -> ModelSource:
        from mcp_edge.shared.bundle import open_bundle  # only when a bundle is served

        self.bundle_dir.mkdir(parents=True, exist_ok=True)
        dest = self.bundle_dir / f"{path.stem}-{fingerprint(path)[0]}"
        if dest.exists():
            shutil.rmtree(dest)
        signed = bool(self.trusted_keys)
        opened = open_bundle(
            path, dest, self.trusted_keys, require_signature=signed, validate_models=False
        )
        if not signed:
            log.warning("%s: publisher signature not checked (no --trust-key given)", path.name)
        tag = pick_variant(opened.manifest, self.profile)
        return bundle_source(
            opened.manifest, opened.root, tag, origin=path, signer_keyid=opened.signer_keyid
        )

    async def load_all(self, manager: ModelManager) -> dict[Path, ModelFile]:
        """Load every model file now; raise :class:`ModelDirectoryError` if none loads."""
        files = scan(self.model_path)
        if not files:
            raise ModelDirectoryError(
                f"{self.model_path}: no model files ({', '.join(MODEL_SUFFIXES)}) found"
            )
        loaded: dict[Path, ModelFile] = {}
        for path, mf in files.items():
            try:
                source = self.source_for(path)
                if source.name in self._names.values():
                    raise ModelDirectoryError(
                        f"{path.name}: another file already serves {source.name!r}"
                    )
                await manager.load(source)
            except (McpError, OSError) as e:
                log.error("%s: not loaded: %s", path.name, e)
                continue
            self._names[path] = source.name
            loaded[path] = mf
        self.prune(manager)
        if not loaded:
            raise ModelDirectoryError(
                f"{self.model_path}: no model could be loaded (see errors above)"
            )
        return loaded

    async def reload(self, manager: ModelManager, path: Path) -> bool:
        """Hot-swap the model of ``path`` to the file's current content; False if it failed
        (the running version keeps serving)."""
        try:
            source = self.source_for(path)
            owner = self._names.get(path)
            if owner is not None and owner != source.name:
                await manager.unload(owner)
            await manager.load(source)
        except (McpError, OSError) as e:
            log.error("%s: reload failed, previous version keeps serving: %s", path.name, e)
            return False
        finally:
            self.prune(manager)
        self._names[path] = source.name
        return True

    async def remove(self, manager: ModelManager, path: Path) -> None:
        name = self._names.pop(path, None)
        if name is not None:
            log.info("%s removed: unloading %s", path.name, name)
            with contextlib.suppress(RunnerError):
                await manager.unload(name)
            self.prune(manager)


class ModelDirectoryWatcher:
    """Polls the model path every ``interval_s`` seconds and reloads what changed."""

    def __init__(
        self,
        directory: ModelDirectory,
        manager: ModelManager,
        known: dict[Path, ModelFile],
        *,
        interval_s: float = 1.0,
    ) -> None:
        self.directory, self.manager = directory, manager
        self.interval_s = interval_s
        self._known = {p: mf.fingerprint for p, mf in known.items()}
        self._seen: dict[Path, Fingerprint] = dict(self._known)
        self._task: asyncio.Task[None] | None = None
        self.reloads = 0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.poll()
            except Exception:  # the watcher must outlive any one bad file
                log.exception("model watcher poll failed")

    async def poll(self) -> None:
        """One pass: reload files that changed and then held still for a poll."""
        try:
            current = {p: mf.fingerprint for p, mf in scan(self.directory.model_path).items()}
        except ModelDirectoryError as e:
            log.warning("%s", e)
            return
        for path in list(self._known):
            if path not in current:
                del self._known[path]
                await self.directory.remove(self.manager, path)
        for path, fp in current.items():
            stable = self._seen.get(path) == fp
            self._seen[path] = fp
            if self._known.get(path) != fp and stable:
                self._known[path] = fp
                if await self.directory.reload(self.manager, path):
                    self.reloads += 1
        for path in list(self._seen):
            if path not in current:
                del self._seen[path]
