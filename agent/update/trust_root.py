"""The device's TUF trust anchor on disk: stored at enrollment, read at every start.

``{state_dir}/tuf/bootstrap-root.json`` is the root metadata the control plane handed out at
enrollment; :class:`agent.update.tuf_client.TufClient` walks the root chain from it. Reading it
needs no TUF code, so this module imports none: ``mcp-agent run`` reads the anchor at start and
loads python-tuf only when a deployment needs repository metadata (docs/agent.md "Memory").
"""

from __future__ import annotations

from pathlib import Path

from mcp_edge.shared.fsutil import atomic_write_bytes

BOOTSTRAP_NAME = "bootstrap-root.json"
MAX_ROOT_BYTES = 512 * 1024
"""The largest root metadata stored or read (bytes)."""


def tuf_dir(state_dir: Path) -> Path:
    """Where the device keeps its TUF files (the anchor, ngclient's ``metadata/`` cache)."""
    return Path(state_dir) / "tuf"


def bootstrap_root_path(state_dir: Path) -> Path:
    return tuf_dir(state_dir) / BOOTSTRAP_NAME


def store_bootstrap_root(state_dir: Path, root: bytes) -> Path:
    """Keep the enrollment's TUF root as this device's trust anchor (checked to parse as root
    metadata first). Raises ValueError when it is not TUF root metadata."""
    from tuf.api.metadata import Metadata  # enrollment only: the check needs TUF's parser

    if len(root) > MAX_ROOT_BYTES:
        raise ValueError(f"TUF root of {len(root)} bytes is too large")
    try:
        md = Metadata.from_bytes(root)
    except Exception as e:
        raise ValueError(f"the trust root is not TUF metadata: {e}") from e
    if md.signed.type != "root":
        raise ValueError(f"the trust root is {md.signed.type} metadata, not root")
    path = bootstrap_root_path(state_dir)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    atomic_write_bytes(path, root)
    return path


def load_bootstrap_root(state_dir: Path) -> bytes | None:
    """The stored anchor's bytes, or None when there is none. Raises ValueError when the file
    is larger than :data:`MAX_ROOT_BYTES` (it is checked as TUF metadata where it is used)."""
    path = bootstrap_root_path(state_dir)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    if len(data) > MAX_ROOT_BYTES:
        raise ValueError(f"{path}: {len(data)} bytes is too large for a TUF root")
    return data
