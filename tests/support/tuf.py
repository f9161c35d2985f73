"""Real signed TUF repositories, bundles and desired states for update tests.

`SignedRepo` wraps the control plane's `TufRepository` with a publisher key listed in the
signed targets metadata; `publish` adds a signed `.mcpb` as one target the way the control
plane does (`{name}/{version}/{name}-{version}.mcpb` with the custom fields). `desired`
signs a desired state with the director key. `make_bundle` builds and signs a bundle from the
digits model.

Run as ``python -m tests.support.tuf ARGS_JSON`` it is the child process of the fault tests:
it builds a real `UpdateAgent` (file transport, onnxruntime manager), resumes, optionally
handles one desired state with a phase hook that SIGKILLs itself at a phase, and prints what
it serves as JSON.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import sys
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from mcp_edge.controlplane.repository.tuf_repo import Expiry, KeyStore, TufRepository
from mcp_edge.shared.bundle import build_bundle, sign_bundle
from mcp_edge.shared.profiles import HardwareProfile, load_profiles
from mcp_edge.shared.protocol.state import DesiredModel, DesiredState, TargetRef, sign_desired_state
from mcp_edge.shared.signing import PrivateKey
from mcp_edge.shared.version import SemVer

DEVICE = "dev-update-1"


def update_profile(**runtime: Any) -> HardwareProfile:
    """The generic x86_64 profile (CPU onnxruntime), runtime settings overridable."""
    base = load_profiles()["generic-x86_64"]
    if not runtime:
        return base
    return dataclasses.replace(base, runtime=dataclasses.replace(base.runtime, **runtime))


def make_bundle(
    model_path: Path, out_dir: Path, name: str, version: str, key: PrivateKey | None
) -> Path:
    """Build (and sign with ``key`` unless None) ``{out_dir}/{name}-{version}.mcpb``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"{name}-{version}.mcpb"
    build_bundle(model_path, out, name=name, version=version)
    if key is not None:
        sign_bundle(out, key)
    return out


@dataclass
class SignedRepo:
    """A TUF repository on disk with a director key and one listed publisher."""

    root: Path
    repo: TufRepository
    publisher: PrivateKey

    @classmethod
    def create(cls, root: Path, *, clock: Any = None, expiry: Expiry | None = None) -> SignedRepo:
        repo = TufRepository(root / "repo", KeyStore(root / "keys"), clock=clock, expiry=expiry)
        repo.init()
        publisher = PrivateKey.generate()
        repo.set_publishers([publisher.public_key])
        return cls(root, repo, publisher)

    @property
    def directory(self) -> Path:
        return self.repo.dir

    @property
    def director(self) -> PrivateKey:
        return self.repo.keys.load("director")

    def root_bytes(self) -> bytes:
        return self.repo.root_bytes()

    def publish(self, bundle: Path, name: str, version: str) -> TargetRef:
        """Add ``bundle`` as the target of ``name`` ``version``; the desired-state reference."""
        path = f"{name}/{version}/{name}-{version}.mcpb"
        info = self.repo.add_target(path, bundle, custom={
            "model": name, "version": version,
            "version_numeric": SemVer.parse(version).to_numeric(), "format": "onnx",
            "profiles": ["*"], "variants": ["default"], "publisher": self.publisher.keyid,
        })  # fmt: skip
        return TargetRef(
            version=version, target_path=path, sha256=info.hashes["sha256"], length=info.length
        )

    def desired(
        self,
        seq: int,
        models: list[DesiredModel],
        *,
        device_id: str = DEVICE,
        key: PrivateKey | None = None,
        issued: datetime | None = None,
        ttl: timedelta = timedelta(hours=1),
    ) -> dict[str, Any]:
        """A desired state for ``device_id`` signed by the director (or ``key``)."""
        issued = issued or datetime.now(timezone.utc)
        state = DesiredState(
            device_id=device_id, seq=seq, issued_at=issued, expires=issued + ttl, models=models
        )
        return sign_desired_state(state, key or self.director)


# ---------------------------------------------------------------------- child process


def _kill_hook(kill_at: str | None, version: str | None) -> Any:
    def hook(phase: Any, record: Any) -> None:
        if kill_at is not None and phase.value == kill_at and record.to_version == version:
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


async def _child(args: dict[str, Any]) -> dict[str, Any]:
    from mcp_edge.agent.runtime.manager import ModelManager
    from mcp_edge.agent.serving.serve import runner_factory
    from mcp_edge.agent.update.transport_file import FileRepoTransport
    from mcp_edge.agent.update.updater import UpdateAgent, updates_status
    from mcp_edge.shared.signing import PublicKey

    profile = update_profile()
    manager = ModelManager(runner_factory(profile, workers=1, threads=1, backend=None))
    agent = UpdateAgent(
        Path(args["state_dir"]), args.get("device_id", DEVICE), profile, manager,
        FileRepoTransport(args["repo_dir"]), [PublicKey.from_hex(args["director"])],
        tuf_root=bytes.fromhex(args["tuf_root"]),
        phase_hook=_kill_hook(args.get("kill_at"), args.get("kill_version")),
    )  # fmt: skip
    await agent.resume()
    if args.get("envelope") is not None:
        await agent.handle_desired(args["envelope"])
    serving: dict[str, Any] = {}
    for name in manager.names():
        lv = manager.get(name)
        import numpy as np

        _, out = await manager.infer(lv, {"input": np.zeros((1, 64), dtype=np.float32)})
        serving[name] = {"version": lv.version, "outputs": list(out)}
    await manager.close()
    return {"serving": serving, "status": updates_status(agent.store)}


def main() -> None:
    args = json.loads(Path(sys.argv[1]).read_text())
    result = asyncio.run(_child(args))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
