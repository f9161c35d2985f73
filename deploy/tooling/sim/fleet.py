"""The simulator's state directory: the enrolled fleet, kept so a later run reuses it.

Layout (every file written atomically; the two holding secrets with mode 0600)::

    {state_dir}/fleet.json      control plane URL and the trust every device was given at
                                enrollment (TUF root, director and publisher keys)
    {state_dir}/devices.jsonl   one enrolled device per line: id, Ed25519 key seed, broker URLs
                                and credentials, group, labels (0600)
    {state_dir}/runtime.json    what each device runs, saved by ``mcp-sim run`` at exit and
                                every ``save_interval_s``: accepted and applied desired-state
                                seq, the next event seq, and per model the active, previous,
                                canary and shadow versions (0600: no secret, but the same
                                owner as the rest)

``mcp-sim enroll`` appends devices to ``devices.jsonl`` (enrolling more into an existing fleet
keeps the old ones); ``mcp-sim run`` reads all three. Every file is read back with size caps
and each field checked, and a malformed one raises :class:`FleetError` naming it: these files
are the simulator's own, but a truncated or hand-edited one must fail clearly, not half-run.

The trust is stored once for the fleet, not per device: every device enrolled against one
control plane gets the same TUF root and director keys. A later enrollment that hands out a
different trust (a rotated director key) replaces it for the whole fleet.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from mcp_edge.shared.errors import McpError, TopicError
from mcp_edge.shared.fsutil import atomic_write_bytes
from mcp_edge.shared.protocol.topics import validate_id

FLEET_FILE = "fleet.json"
DEVICES_FILE = "devices.jsonl"
RUNTIME_FILE = "runtime.json"
FORMAT = 1
MAX_FLEET_BYTES = 1024 * 1024
MAX_DEVICE_LINE = 8 * 1024
MAX_DEVICES = 200_000
MAX_RUNTIME_BYTES = 256 * 1024 * 1024
_HEX = frozenset("0123456789abcdef")


class FleetError(McpError):
    """The state directory holds no usable fleet, or a file in it is malformed."""


@dataclass(frozen=True)
class Trust:
    """What the devices trust (the enrollment answer's ``trust``): keys as hex."""

    tuf_root: bytes
    """The TUF root metadata handed out at enrollment, as JSON bytes."""
    director_keys: tuple[str, ...]
    publisher_keys: tuple[str, ...] = ()

    def as_json(self) -> dict[str, Any]:
        return {
            "tuf_root": json.loads(self.tuf_root),
            "director_keys": list(self.director_keys),
            "publisher_keys": list(self.publisher_keys),
        }


@dataclass(frozen=True, slots=True)
class DeviceRecord:
    """One enrolled device as stored in ``devices.jsonl``."""

    device_id: str
    key_seed: str
    """The device's Ed25519 private key seed, 64 hex characters (it signed the enrollment)."""
    broker_urls: tuple[str, ...]
    username: str
    password: str
    client_id: str
    group: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return {
            "id": self.device_id, "key": self.key_seed, "broker_urls": list(self.broker_urls),
            "username": self.username, "password": self.password, "client_id": self.client_id,
            "group": self.group, "labels": dict(self.labels),
        }  # fmt: skip


@dataclass(frozen=True)
class Fleet:
    """The enrolled fleet: where it enrolled, what it trusts, and its devices in order."""

    control_plane: str
    trust: Trust
    devices: tuple[DeviceRecord, ...]


# ------------------------------------------------------------------------------- writing
def save_fleet_header(state_dir: Path, control_plane: str, trust: Trust) -> None:
    """Write ``fleet.json`` (creating the directory with mode 0700)."""
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    doc = {"format": FORMAT, "control_plane": control_plane, "trust": trust.as_json()}
    atomic_write_bytes(state_dir / FLEET_FILE, orjson.dumps(doc) + b"\n", mode=0o600)


def append_devices(state_dir: Path, records: Iterable[DeviceRecord]) -> int:
    """Append enrolled devices to ``devices.jsonl`` (0600) and fsync; return how many.

    A line is written whole with one ``write`` of an ``O_APPEND`` descriptor, so an enrollment
    interrupted mid-batch leaves every device it finished.
    """
    lines = b"".join(orjson.dumps(r.as_json()) + b"\n" for r in records)
    if not lines:
        return 0
    path = state_dir / DEVICES_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, lines)
        os.fsync(fd)
    finally:
        os.close(fd)
    return lines.count(b"\n")


def save_runtime(state_dir: Path, devices: Mapping[str, Any], *, clean: bool) -> None:
    """Write ``runtime.json`` atomically: ``devices`` (device id → saved state) and whether
    this is the save of a clean exit (see the module docstring)."""
    doc = {"format": FORMAT, "clean": clean, "devices": devices}
    atomic_write_bytes(state_dir / RUNTIME_FILE, orjson.dumps(doc), mode=0o600)


# ------------------------------------------------------------------------------- reading
def load_fleet(state_dir: Path) -> Fleet:
    """Read the fleet of ``state_dir``. Raises :class:`FleetError` when there is none (run
    ``mcp-sim enroll``) or a file is malformed."""
    header = _read_private(state_dir / FLEET_FILE, MAX_FLEET_BYTES, missing_ok=False)
    assert header is not None
    try:
        doc = orjson.loads(header)
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ValueError(f"not a format {FORMAT} fleet header")
        control_plane = _string(doc.get("control_plane"), "control_plane", 1, 2048)
        trust = _trust(doc.get("trust"))
    except (ValueError, orjson.JSONDecodeError) as e:
        raise FleetError(f"{state_dir / FLEET_FILE}: {e}") from e
    devices = load_devices(state_dir)
    if not devices:
        raise FleetError(f"{state_dir}: no device enrolled yet; run `mcp-sim enroll` first")
    return Fleet(control_plane, trust, devices)


def load_trust(state_dir: Path) -> Trust | None:
    """The fleet's stored trust, or None when ``fleet.json`` is not there yet."""
    data = _read_private(state_dir / FLEET_FILE, MAX_FLEET_BYTES, missing_ok=True)
    if data is None:
        return None
    try:
        doc = orjson.loads(data)
        return _trust(doc.get("trust") if isinstance(doc, dict) else None)
    except (ValueError, orjson.JSONDecodeError) as e:
        raise FleetError(f"{state_dir / FLEET_FILE}: {e}") from e


def load_devices(state_dir: Path) -> tuple[DeviceRecord, ...]:
    """The enrolled devices in enrollment order (empty when none). Raises :class:`FleetError`
    for a malformed line or a device id that appears twice."""
    path = state_dir / DEVICES_FILE
    if _read_private(path, 0, missing_ok=True, size_only=True) is None:
        return ()
    out: list[DeviceRecord] = []
    seen: set[str] = set()
    with path.open("rb") as f:
        for number, line in enumerate(f, 1):
            if len(line) > MAX_DEVICE_LINE:
                raise FleetError(f"{path}:{number}: line longer than {MAX_DEVICE_LINE} bytes")
            if not line.strip():
                continue
            try:
                record = _device(orjson.loads(line))
            except (ValueError, TopicError, orjson.JSONDecodeError) as e:
                raise FleetError(f"{path}:{number}: {e}") from e
            if record.device_id in seen:
                raise FleetError(f"{path}:{number}: device {record.device_id} appears twice")
            seen.add(record.device_id)
            out.append(record)
            if len(out) > MAX_DEVICES:
                raise FleetError(f"{path}: more than {MAX_DEVICES} devices")
    return tuple(out)


def load_runtime(state_dir: Path) -> tuple[dict[str, Any], bool]:
    """``runtime.json``'s per-device entries (device id → its saved state), or {} when there
    is none, and whether the run that saved it ended cleanly. The entries are checked by
    whoever restores them."""
    data = _read_private(state_dir / RUNTIME_FILE, MAX_RUNTIME_BYTES, missing_ok=True)
    if data is None:
        return {}, True
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise FleetError(f"{state_dir / RUNTIME_FILE}: not JSON: {e}") from e
    devices = doc.get("devices") if isinstance(doc, dict) else None
    if not isinstance(devices, dict):
        raise FleetError(f"{state_dir / RUNTIME_FILE}: no devices object")
    return devices, doc.get("clean") is True


def _read_private(
    path: Path, cap: int, *, missing_ok: bool, size_only: bool = False
) -> bytes | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        if missing_ok:
            return None
        raise FleetError(
            f"{path.parent}: no simulated fleet here; run `mcp-sim enroll --state-dir "
            f"{path.parent}` first"
        ) from None
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise FleetError(f"{path}: readable by others; it holds credentials (chmod 600)")
    if size_only:
        return b""
    if st.st_size > cap:
        raise FleetError(f"{path}: {st.st_size} bytes is more than {cap}")
    return path.read_bytes()


def _trust(doc: Any) -> Trust:
    if not isinstance(doc, dict):
        raise ValueError("trust must be an object")
    root = doc.get("tuf_root")
    if not isinstance(root, dict):
        raise ValueError("trust.tuf_root must be an object (the TUF root metadata)")
    return Trust(
        tuf_root=json.dumps(root).encode(),
        director_keys=_keys(doc.get("director_keys"), "director_keys", 16),
        publisher_keys=_keys(doc.get("publisher_keys", []), "publisher_keys", 64),
    )


def _device(doc: Any) -> DeviceRecord:
    if not isinstance(doc, dict):
        raise ValueError("not a JSON object")
    urls = doc.get("broker_urls")
    if not isinstance(urls, list) or not 1 <= len(urls) <= 8:
        raise ValueError("broker_urls must hold 1 to 8 URLs")
    labels = doc.get("labels") or {}
    if not isinstance(labels, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in labels.items()
    ):
        raise ValueError("labels must map strings to strings")
    group = doc.get("group")
    return DeviceRecord(
        device_id=validate_id(doc.get("id"), "device id"),  # type: ignore[arg-type]
        key_seed=_hex64(doc.get("key"), "key"),
        broker_urls=tuple(_string(u, "broker_urls item", 1, 2048) for u in urls),
        username=_string(doc.get("username"), "username", 1, 128),
        password=_string(doc.get("password"), "password", 1, 256),
        client_id=validate_id(doc.get("client_id"), "client id"),  # type: ignore[arg-type]
        group=None if group is None else validate_id(group, "group"),
        labels=labels,
    )


def _keys(value: Any, name: str, most: int) -> tuple[str, ...]:
    if not isinstance(value, list) or len(value) > most:
        raise ValueError(f"trust.{name} must be a list of at most {most} keys")
    return tuple(_hex64(k, f"trust.{name} item") for k in value)


def _hex64(value: Any, name: str) -> str:
    if not isinstance(value, str) or len(value) != 64 or not set(value) <= _HEX:
        raise ValueError(f"{name} must be 64 lowercase hex characters")
    return value


def _string(value: Any, name: str, lo: int, hi: int) -> str:
    if not isinstance(value, str) or not lo <= len(value) <= hi:
        raise ValueError(f"{name} must be a string of {lo} to {hi} characters")
    return value
