"""A strict, streaming reader for the POSIX ustar archives bundles are.

``tarfile`` is generous: it follows pax and GNU extensions, reads extended headers of any
size into memory and silently accepts links and devices. Bundles need the opposite, so this
reader accepts exactly one shape and checks each 512-byte header before touching the data
behind it:

* POSIX ustar headers (magic ``ustar\\0`` + version ``00``) with a valid checksum;
* regular files only (type ``0`` or NUL); links, devices, FIFOs, directories, pax/GNU
  extension headers and unknown types are refused;
* octal sizes only; data read exactly as long as the header says, padding included;
* the end-of-archive marker (two zero blocks) must be present and anything after it must be
  zeros (``tar`` pads to a record size), so truncation and appended data are both caught.

Errors are :class:`~shared.errors.BundleError` with ``member`` set when a member is at fault.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import BinaryIO

from mcp_edge.shared.bundle._progress import Progress
from mcp_edge.shared.errors import BundleError

BLOCK = 512
CHUNK = 1 << 20
_ZERO_BLOCK = bytes(BLOCK)
_MAGIC = b"ustar\x0000"
_GNU_MAGIC = b"ustar  \x00"
_TYPES = {
    b"1": "hard link",
    b"2": "symbolic link",
    b"3": "character device",
    b"4": "block device",
    b"5": "directory",
    b"6": "FIFO",
    b"7": "contiguous file",
    b"x": "pax extended header",
    b"g": "pax global header",
    b"L": "GNU long name",
    b"K": "GNU long link name",
    b"S": "GNU sparse file",
    b"V": "GNU volume header",
}


def bundle_error(reason: str, member: str | None = None) -> BundleError:
    """A BundleError whose message starts with the member at fault, when there is one."""
    return BundleError(f"{member}: {reason}" if member else reason, member=member)


@dataclass(frozen=True)
class MemberHeader:
    """A validated header: a regular file ``name`` of ``size`` bytes at byte ``offset``."""

    name: str
    size: int
    offset: int


def _octal(field: bytes, what: str, member: str | None) -> int:
    if field and field[0] & 0x80:
        raise bundle_error(f"{what} field uses base-256, which bundles do not allow", member)
    text = field.split(b"\x00", 1)[0].strip(b" ")
    if not text:
        return 0
    if any(c not in b"01234567" for c in text):
        raise bundle_error(f"{what} field {text[:20]!r} is not octal", member)
    return int(text, 8)


def _shown(raw: bytes) -> str:
    """A header name made printable for messages (never trusted as a path)."""
    text = raw.decode("utf-8", "replace")
    return "".join(c if c.isprintable() else "?" for c in text)[:200] or "<empty name>"


class TarStream:
    """Reads members from an open binary file, one validated header at a time.

    ``on_bytes`` receives every byte read (e.g. to hash the whole bundle); ``progress``
    is advanced by the number of bytes read.
    """

    def __init__(
        self, f: BinaryIO, on_bytes: Callable[[bytes], object], progress: Progress
    ) -> None:
        self._f = f
        self._on_bytes = on_bytes
        self._progress = progress
        self._offset = 0
        self._ended = False

    def _read(self, n: int, member: str | None) -> bytes:
        data = self._f.read(n)
        if len(data) != n:
            raise bundle_error(
                f"truncated bundle: needed {n} bytes at offset {self._offset}, got {len(data)}",
                member,
            )
        self._offset += n
        self._on_bytes(data)
        self._progress.update(n)
        return data

    def next_header(self) -> MemberHeader | None:
        """The next member's header, or None at the end-of-archive marker."""
        if self._ended:
            return None
        offset = self._offset
        block = self._read(BLOCK, None)
        if block == _ZERO_BLOCK:
            second = self._read(BLOCK, None)
            if second != _ZERO_BLOCK:
                raise bundle_error(f"corrupt tar: lone zero block at offset {offset}")
            self._ended = True
            return None
        raw_name = block[0:100].split(b"\x00", 1)[0]
        prefix = block[345:500].split(b"\x00", 1)[0]
        if block[257:265] == _MAGIC and prefix:
            raw_name = prefix + b"/" + raw_name
        shown = _shown(raw_name)
        self._check_checksum(block, offset, shown)
        if block[257:265] != _MAGIC:
            hint = " (GNU tar format; use --format=ustar)" if block[257:265] == _GNU_MAGIC else ""
            raise bundle_error(f"not a POSIX ustar header{hint}", shown)
        kind = block[156:157]
        if kind not in (b"0", b"\x00"):
            what = _TYPES.get(kind, f"unknown member type {kind!r}")
            raise bundle_error(f"{what} members are not allowed; only regular files", shown)
        try:
            name = raw_name.decode("ascii")
        except UnicodeDecodeError:
            raise bundle_error("member name is not ASCII", shown) from None
        size = _octal(block[124:136], "size", name)
        return MemberHeader(name=name, size=size, offset=offset)

    def _check_checksum(self, block: bytes, offset: int, shown: str) -> None:
        stored = _octal(block[148:156], "checksum", shown)
        unsigned = sum(block[:148]) + 8 * 0x20 + sum(block[156:])
        signed = unsigned - 2 * sum(b for b in block[:148] + block[156:] if b > 127)
        if stored not in (unsigned, signed):
            raise bundle_error(f"corrupt tar header at offset {offset} (bad checksum)", shown)

    def _padding(self, header: MemberHeader) -> None:
        pad = -header.size % BLOCK
        if pad:
            self._read(pad, header.name)

    def read_small(self, header: MemberHeader) -> bytes:
        """The whole data of a member the caller has already size-capped."""
        data = self._read(header.size, header.name)
        self._padding(header)
        return data

    def copy_data(self, header: MemberHeader, sink: Callable[[bytes], object] | None) -> str:
        """Stream the member's data to ``sink`` in chunks; return its sha256 hex digest."""
        digest = hashlib.sha256()
        left = header.size
        while left:
            chunk = self._read(min(CHUNK, left), header.name)
            left -= len(chunk)
            digest.update(chunk)
            if sink is not None:
                sink(chunk)
        self._padding(header)
        return digest.hexdigest()

    def finish(self) -> None:
        """Check that only zero padding follows the end-of-archive marker."""
        if not self._ended:
            raise bundle_error("bundle is not at its end-of-archive marker")
        while True:
            chunk = self._f.read(CHUNK)
            if not chunk:
                return
            self._on_bytes(chunk)
            self._progress.update(len(chunk))
            if chunk.count(0) != len(chunk):
                raise bundle_error(f"data after the end-of-archive marker (offset {self._offset})")
            self._offset += len(chunk)
