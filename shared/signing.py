"""Ed25519 keys and signed JSON documents (PyNaCl).

Key ids are the lowercase hex SHA-256 of the raw 32-byte public key, so anyone holding a public
key can compute its id and nobody can choose one.

Key files are small JSON documents::

    {"keytype": "ed25519", "keyid": "<hex>", "public": "<hex>"}                 # public
    {"keytype": "ed25519", "keyid": "<hex>", "public": "<hex>", "private": "<hex seed>"}

A public key is accepted only when it is a usable Ed25519 key: 32 bytes, canonically encoded
(the y coordinate below 2^255 - 19), and a point of the curve's prime-order subgroup, so none
of the eight points of small order (all zeros, the identity ``01 00..00``, ...). A signature
by such a key proves nothing about who made it, and nobody holds its private key.

Private key files are written with mode 0600 (temp file, fsync, rename) and refused on read when
the group or others can read them, the way ssh treats identity files.

Signed documents use a TUF-like envelope::

    {"signed": {...}, "signatures": [{"keyid": "<hex>", "sig": "<hex>"}]}

The signature covers :func:`canonical_json` of ``signed``: keys sorted, no insignificant
whitespace, UTF-8, no NaN/Infinity. Python's float repr is the shortest round-trip form, so a
document re-encoded by any code here gives the same bytes.
"""

from __future__ import annotations

import functools
import hashlib
import json
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nacl.bindings
import nacl.exceptions
import nacl.signing

from mcp_edge.shared.errors import (
    BadSignatureError,
    KeyFileError,
    MalformedSignatureError,
    UnknownSignerError,
    WrongKeyError,
)
from mcp_edge.shared.fsutil import atomic_write_bytes

KEYTYPE = "ed25519"
MAX_KEY_FILE_BYTES = 4096
_HEX = frozenset("0123456789abcdef")
_FIELD_PRIME = 2**255 - 19
_Y_MASK = (1 << 255) - 1  # the top bit of an encoded point is the sign of x


def canonical_json(document: Any) -> bytes:
    """Return the canonical UTF-8 encoding of a JSON-compatible value (what gets signed).

    Raises :class:`MalformedSignatureError` when the value holds something JSON cannot carry
    (NaN, Infinity, non-string keys, arbitrary objects).
    """
    try:
        return json.dumps(
            document, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
        ).encode("utf-8")
    except (TypeError, ValueError) as e:
        raise MalformedSignatureError(f"document cannot be canonicalised: {e}") from e


def key_id(public_key: bytes) -> str:
    """Key id of a raw 32-byte Ed25519 public key: hex SHA-256."""
    if len(public_key) != 32:
        raise KeyFileError(f"an Ed25519 public key is 32 bytes, got {len(public_key)}")
    return hashlib.sha256(public_key).hexdigest()


def _is_hex(value: object, length: int) -> bool:
    return isinstance(value, str) and len(value) == length and set(value) <= _HEX


def check_public_key(raw: bytes) -> None:
    """Refuse what is not a usable Ed25519 public key (see the module docstring).

    Raises :class:`KeyFileError` for a wrong length, a non-canonical encoding, or a point of
    small order, off the curve or outside the prime-order subgroup.
    """
    if len(raw) != 32:
        raise KeyFileError(f"an Ed25519 public key is 32 bytes, got {len(raw)}")
    if int.from_bytes(raw, "little") & _Y_MASK >= _FIELD_PRIME:
        raise KeyFileError("public key is not canonically encoded (its y is not below 2^255-19)")
    # libsodium's check: canonical, not of small order, on the curve, in the prime-order group.
    if not nacl.bindings.crypto_core_ed25519_is_valid_point(raw):
        raise KeyFileError(
            "public key is not a usable Ed25519 key: a point of small order (such as all "
            "zeros), not on the curve, or outside its prime-order subgroup"
        )


@dataclass(frozen=True)
class PublicKey:
    """An Ed25519 verify key with its key id; only a usable key can be built
    (:func:`check_public_key`, raising :class:`KeyFileError`)."""

    raw: bytes

    def __post_init__(self) -> None:
        check_public_key(self.raw)

    @property
    def keyid(self) -> str:
        return key_id(self.raw)

    @classmethod
    def from_hex(cls, value: str) -> PublicKey:
        if not _is_hex(value, 64):
            raise KeyFileError("public key must be 64 lowercase hex characters")
        return cls(bytes.fromhex(value))

    def to_dict(self) -> dict[str, str]:
        return {"keytype": KEYTYPE, "keyid": self.keyid, "public": self.raw.hex()}

    def verify(self, data: bytes, signature: bytes) -> None:
        """Check ``signature`` over ``data``; raise :class:`BadSignatureError` if it fails."""
        try:
            nacl.signing.VerifyKey(self.raw).verify(data, signature)
        except (nacl.exceptions.BadSignatureError, ValueError, TypeError) as e:
            raise BadSignatureError(f"signature by key {self.keyid[:16]} does not verify") from e


@dataclass(frozen=True)
class PrivateKey:
    """An Ed25519 signing key (32-byte seed)."""

    seed: bytes

    def __post_init__(self) -> None:
        if len(self.seed) != 32:
            raise KeyFileError(f"an Ed25519 private key seed is 32 bytes, got {len(self.seed)}")

    def __repr__(self) -> str:  # never print the seed
        return f"PrivateKey(keyid={self.keyid[:16]}...)"

    @classmethod
    def generate(cls) -> PrivateKey:
        return cls(bytes(nacl.signing.SigningKey.generate()))

    # Derived once per key object: the control plane signs thousands of documents with one.
    @functools.cached_property
    def _signing_key(self) -> nacl.signing.SigningKey:
        return nacl.signing.SigningKey(self.seed)

    @functools.cached_property
    def public_key(self) -> PublicKey:
        return PublicKey(bytes(self._signing_key.verify_key))

    @functools.cached_property
    def keyid(self) -> str:
        return self.public_key.keyid

    def sign(self, data: bytes) -> bytes:
        """Detached 64-byte Ed25519 signature over ``data``."""
        return bytes(self._signing_key.sign(data).signature)

    def to_dict(self) -> dict[str, str]:
        return {**self.public_key.to_dict(), "private": self.seed.hex()}


def write_private_key(path: Path | str, key: PrivateKey, *, overwrite: bool = False) -> None:
    """Write ``key`` to ``path`` with mode 0600, atomically.

    Raises :class:`KeyFileError` if the file exists and ``overwrite`` is false.
    """
    path = Path(path)
    if path.exists() and not overwrite:
        raise KeyFileError(f"{path}: already exists; refusing to overwrite a key")
    atomic_write_bytes(path, canonical_json(key.to_dict()) + b"\n", mode=0o600)


def write_public_key(path: Path | str, key: PublicKey) -> None:
    """Write the public half to ``path`` (mode 0644), atomically."""
    atomic_write_bytes(Path(path), canonical_json(key.to_dict()) + b"\n", mode=0o644)


def _read_key_document(path: Path) -> dict[str, Any]:
    try:
        st = path.stat()
    except FileNotFoundError as e:
        raise KeyFileError(f"{path}: no such key file") from e
    if not stat.S_ISREG(st.st_mode):
        raise KeyFileError(f"{path}: not a regular file")
    if st.st_size > MAX_KEY_FILE_BYTES:
        raise KeyFileError(f"{path}: {st.st_size} bytes is too large for a key file")
    try:
        doc = json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError) as e:
        raise KeyFileError(f"{path}: not a key file (invalid JSON)") from e
    if not isinstance(doc, dict) or doc.get("keytype") != KEYTYPE:
        raise KeyFileError(f"{path}: not an {KEYTYPE} key file")
    return doc


def read_private_key(path: Path | str) -> PrivateKey:
    """Load a private key file, refusing one that group or others may read.

    Raises :class:`KeyFileError` for a missing, malformed or unsafe file.
    """
    path = Path(path)
    doc = _read_key_document(path)
    seed = doc.get("private")
    if not _is_hex(seed, 64):
        raise KeyFileError(f"{path}: no private key in this file (is it a public key?)")
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        raise KeyFileError(
            f"{path}: permissions {mode:04o} are too open; a private key must be readable by "
            f"its owner only (chmod 600 {path})"
        )
    assert isinstance(seed, str)
    key = PrivateKey(bytes.fromhex(seed))
    if doc.get("keyid") not in (None, key.keyid):
        raise KeyFileError(f"{path}: key id does not match the key")
    return key


def read_public_key(path: Path | str) -> PublicKey:
    """Load a public key file (a private key file also yields its public half)."""
    path = Path(path)
    doc = _read_key_document(path)
    pub = doc.get("public")
    if not isinstance(pub, str):
        raise KeyFileError(f"{path}: no public key in this file")
    key = PublicKey.from_hex(pub)
    if doc.get("keyid") not in (None, key.keyid):
        raise KeyFileError(f"{path}: key id does not match the key")
    return key


def make_signature(data: bytes, key: PrivateKey) -> dict[str, str]:
    """Signature object ``{"keyid", "sig"}`` over raw bytes."""
    return {"keyid": key.keyid, "sig": key.sign(data).hex()}


def parse_signature(obj: object) -> tuple[str, bytes]:
    """Validate a signature object and return ``(keyid, signature bytes)``."""
    if not isinstance(obj, dict) or set(obj) != {"keyid", "sig"}:
        raise MalformedSignatureError('a signature must be {"keyid": ..., "sig": ...}')
    keyid, sig = obj["keyid"], obj["sig"]
    if not _is_hex(keyid, 64):
        raise MalformedSignatureError("signature keyid must be 64 lowercase hex characters")
    if not _is_hex(sig, 128):
        raise MalformedSignatureError("signature must be 128 lowercase hex characters")
    return keyid, bytes.fromhex(sig)


def verify_signature(
    data: bytes, signature: object, trusted: Mapping[str, PublicKey] | Iterable[PublicKey]
) -> str:
    """Verify one signature object over ``data`` against trusted keys; return the signer's id.

    Raises :class:`MalformedSignatureError`, :class:`UnknownSignerError`,
    :class:`WrongKeyError` (a trusted entry whose key does not hash to its id) or
    :class:`BadSignatureError`.
    """
    keys = _key_map(trusted)
    keyid, sig = parse_signature(signature)
    key = keys.get(keyid)
    if key is None:
        raise UnknownSignerError(f"signed by unknown key {keyid[:16]}; not among trusted keys")
    if key.keyid != keyid:
        raise WrongKeyError(f"trusted key listed as {keyid[:16]} is really {key.keyid[:16]}")
    key.verify(data, sig)
    return keyid


def _key_map(trusted: Mapping[str, PublicKey] | Iterable[PublicKey]) -> dict[str, PublicKey]:
    if isinstance(trusted, Mapping):
        return dict(trusted)
    return {k.keyid: k for k in trusted}


def sign_document(signed: Mapping[str, Any], *keys: PrivateKey) -> dict[str, Any]:
    """Wrap ``signed`` in an envelope carrying one signature per key."""
    if not keys:
        raise WrongKeyError("sign_document needs at least one key")
    data = canonical_json(signed)
    return {"signed": dict(signed), "signatures": [make_signature(data, k) for k in keys]}


def verify_document(
    envelope: object,
    trusted: Mapping[str, PublicKey] | Iterable[PublicKey],
    *,
    threshold: int = 1,
) -> dict[str, Any]:
    """Check an envelope and return its ``signed`` part.

    At least ``threshold`` distinct trusted keys must have signed. Signatures by unknown keys
    are ignored when enough trusted ones verify; a signature by a trusted key that fails to
    verify is always an error (the document was tampered with).

    Raises :class:`MalformedSignatureError`, :class:`UnknownSignerError` (no trusted signer),
    :class:`BadSignatureError`.
    """
    if not isinstance(envelope, dict) or set(envelope) != {"signed", "signatures"}:
        raise MalformedSignatureError(
            'a signed document must be {"signed": ..., "signatures": [...]}'
        )
    signed, signatures = envelope["signed"], envelope["signatures"]
    if not isinstance(signed, dict):
        raise MalformedSignatureError('"signed" must be a JSON object')
    if not isinstance(signatures, list) or not signatures:
        raise MalformedSignatureError('"signatures" must be a non-empty list')
    if threshold < 1:
        raise ValueError("threshold must be at least 1")
    keys = _key_map(trusted)
    data = canonical_json(signed)
    good: set[str] = set()
    unknown: list[str] = []
    for sig_obj in signatures:
        keyid, _ = parse_signature(sig_obj)
        if keyid not in keys:
            unknown.append(keyid)
            continue
        good.add(verify_signature(data, sig_obj, keys))
    if len(good) < threshold:
        if not good and unknown:
            raise UnknownSignerError(
                f"signed only by unknown key(s) {', '.join(k[:16] for k in unknown)}"
            )
        raise UnknownSignerError(f"needs {threshold} trusted signature(s), found {len(good)}")
    return signed
