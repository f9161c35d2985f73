from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mcp_edge.shared.errors import (
    BadSignatureError,
    KeyFileError,
    MalformedSignatureError,
    UnknownSignerError,
    WrongKeyError,
)
from mcp_edge.shared.signing import (
    PrivateKey,
    PublicKey,
    canonical_json,
    key_id,
    read_private_key,
    read_public_key,
    sign_document,
    verify_document,
    verify_signature,
    write_private_key,
    write_public_key,
)

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**53), 2**53)
    | st.text(max_size=20)
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)


def test_key_file_round_trip_with_private_mode(tmp_path: Path) -> None:
    key = PrivateKey.generate()
    path = tmp_path / "publisher.key"
    write_private_key(path, key)
    assert (path.stat().st_mode & 0o777) == 0o600
    assert read_private_key(path) == key
    assert read_public_key(path) == key.public_key
    write_public_key(tmp_path / "publisher.pub", key.public_key)
    assert read_public_key(tmp_path / "publisher.pub").keyid == key.keyid
    with pytest.raises(KeyFileError, match="no private key"):
        read_private_key(tmp_path / "publisher.pub")
    with pytest.raises(KeyFileError, match="already exists"):
        write_private_key(path, PrivateKey.generate())
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o660])
def test_group_or_world_readable_private_key_refused(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "k.key"
    write_private_key(path, PrivateKey.generate())
    os.chmod(path, mode)
    with pytest.raises(KeyFileError, match="too open"):
        read_private_key(path)


def test_malformed_key_files_refused(tmp_path: Path) -> None:
    cases = {
        "missing": None,
        "notjson": b"\x00garbage",
        "wrongtype": b'{"keytype": "rsa"}',
        "short": b'{"keytype": "ed25519", "public": "abcd"}',
        "huge": b" " * 10_000,
    }
    for name, content in cases.items():
        p = tmp_path / name
        if content is not None:
            p.write_bytes(content)
            os.chmod(p, 0o600)
        with pytest.raises(KeyFileError):
            read_public_key(p)
    good = PrivateKey.generate().to_dict()
    lying = {**good, "keyid": "0" * 64}
    p = tmp_path / "lying"
    p.write_bytes(canonical_json(lying))
    os.chmod(p, 0o600)
    with pytest.raises(KeyFileError, match="does not match"):
        read_private_key(p)


@given(json_values)
def test_canonical_json_is_stable(value: object) -> None:
    doc = {"v": value}
    import json

    assert canonical_json(json.loads(canonical_json(doc))) == canonical_json(doc)


def test_canonical_json_refuses_nan() -> None:
    with pytest.raises(MalformedSignatureError):
        canonical_json({"x": float("nan")})


@given(st.dictionaries(st.text(max_size=8), json_values, max_size=5))
def test_sign_verify_round_trip(doc: dict[str, object]) -> None:
    key = PrivateKey.generate()
    env = sign_document(doc, key)
    assert verify_document(env, [key.public_key]) == doc


def test_document_verification_errors() -> None:
    a, b, c = PrivateKey.generate(), PrivateKey.generate(), PrivateKey.generate()
    env = sign_document({"seq": 1, "models": ["digits"]}, a)
    with pytest.raises(UnknownSignerError, match="unknown key"):
        verify_document(env, [b.public_key])
    with pytest.raises(BadSignatureError):
        verify_document({**env, "signed": {"seq": 2, "models": ["digits"]}}, [a.public_key])
    sig = env["signatures"][0]
    flipped = sig["sig"][:-1] + ("0" if sig["sig"][-1] != "0" else "1")
    with pytest.raises(BadSignatureError):
        verify_document({**env, "signatures": [{**sig, "sig": flipped}]}, [a.public_key])
    for bad in [
        None,
        [],
        {"signed": {}},
        {"signed": [], "signatures": [sig]},
        {"signed": {}, "signatures": []},
        {"signed": {}, "signatures": [{"keyid": "x"}]},
        {"signed": {}, "signatures": [{"keyid": "0" * 64, "sig": "zz"}]},
    ]:
        with pytest.raises(MalformedSignatureError):
            verify_document(bad, [a.public_key])
    # threshold: two distinct trusted signers needed
    env2 = sign_document({"x": 1}, a, c)
    assert verify_document(env2, [a.public_key, c.public_key], threshold=2) == {"x": 1}
    with pytest.raises(UnknownSignerError, match="needs 2"):
        verify_document(env, [a.public_key, c.public_key], threshold=2)
    # a trusted map whose entry does not hash to its id is a configuration error
    data = canonical_json({"seq": 1, "models": ["digits"]})
    with pytest.raises(WrongKeyError):
        verify_signature(data, sig, {a.keyid: b.public_key})


def test_key_ids_are_sha256_of_the_public_key() -> None:
    key = PrivateKey.generate()
    assert key.keyid == key_id(key.public_key.raw)
    assert len(key.keyid) == 64
    assert PublicKey.from_hex(key.public_key.raw.hex()) == key.public_key
    assert key.keyid[:16] in repr(key) and key.seed.hex() not in repr(key)


# ---------------------------------------------------------------------------- unusable keys
_P = 2**255 - 19
_D = -121665 * pow(121666, -1, _P) % _P
_SQRT_M1 = pow(2, (_P - 1) // 4, _P)

# The eight points of the curve's torsion subgroup (canonical encodings): the identity, the
# point of order 2, two of order 4 (y = 0, the all-zero key and its sign twin) and four of
# order 8. Their orders are checked below with plain Edwards arithmetic.
SMALL_ORDER_KEYS = [
    "01" + "00" * 31,
    "ec" + "ff" * 30 + "7f",
    "00" * 32,
    "00" * 31 + "80",
    "26e8958fc2b227b045c3f489f2ef98f0d5dfac05d3c63339b13802886d53fc05",
    "26e8958fc2b227b045c3f489f2ef98f0d5dfac05d3c63339b13802886d53fc85",
    "c7176a703d4dd84fba3c0b760d10670f2a2053fa2c39ccc64ec7fd7792ac037a",
    "c7176a703d4dd84fba3c0b760d10670f2a2053fa2c39ccc64ec7fd7792ac03fa",
]


def _decode(encoded: bytes) -> tuple[int, int]:
    """RFC 8032 §5.1.3 point decoding (canonical encodings only)."""
    n = int.from_bytes(encoded, "little")
    y, sign = n & ((1 << 255) - 1), n >> 255
    u, v = (y * y - 1) % _P, (_D * y * y + 1) % _P
    x = u * pow(v, 3, _P) * pow(u * pow(v, 7, _P), (_P - 5) // 8, _P) % _P
    if v * x * x % _P != u:
        x = x * _SQRT_M1 % _P
    assert v * x * x % _P == u, "not on the curve"
    return (_P - x if x and (x & 1) != sign else x), y


def _add(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    (x1, y1), (x2, y2) = a, b
    t = _D * x1 * x2 * y1 * y2 % _P
    return (
        (x1 * y2 + y1 * x2) * pow(1 + t, -1, _P) % _P,
        (y1 * y2 + x1 * x2) * pow(1 - t, -1, _P) % _P,
    )


@pytest.mark.parametrize("hexkey", SMALL_ORDER_KEYS)
def test_small_order_public_keys_are_refused(hexkey: str, tmp_path: Path) -> None:
    assert len({_decode(bytes.fromhex(h)) for h in SMALL_ORDER_KEYS}) == 8
    multiple = _decode(bytes.fromhex(hexkey))
    for _ in range(3):
        multiple = _add(multiple, multiple)
    assert multiple == (0, 1)  # 8 · P is the identity: the key is of small order

    with pytest.raises(KeyFileError, match="small order"):
        PublicKey.from_hex(hexkey)
    with pytest.raises(KeyFileError, match="small order"):
        PublicKey(bytes.fromhex(hexkey))
    path = tmp_path / "bad.pub"
    path.write_bytes(canonical_json({"keytype": "ed25519", "public": hexkey}))
    with pytest.raises(KeyFileError, match="small order"):
        read_public_key(path)


@pytest.mark.parametrize("y", range(19))
@pytest.mark.parametrize("x_sign", [0, 1])
def test_non_canonical_encodings_are_refused(y: int, x_sign: int) -> None:
    # y + p still fits in 255 bits for y < 19: the same y written a second way.
    encoded = ((y + _P) | (x_sign << 255)).to_bytes(32, "little")
    with pytest.raises(KeyFileError, match="not canonically encoded"):
        PublicKey(encoded)


def test_a_key_with_a_torsion_component_is_refused() -> None:
    # A real key plus a point of order 8: on the curve, not of small order, but outside the
    # prime-order subgroup every honest key lies in.
    real = _decode(PrivateKey.generate().public_key.raw)
    x, y = _add(real, _decode(bytes.fromhex(SMALL_ORDER_KEYS[4])))
    mixed = (y | ((x & 1) << 255)).to_bytes(32, "little")
    with pytest.raises(KeyFileError, match="prime-order subgroup"):
        PublicKey(mixed)
