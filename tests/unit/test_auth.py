"""Password hashing, secrets, roles and bearer parsing of ``controlplane.auth``."""

from __future__ import annotations

import hashlib

import pytest
from aiohttp.test_utils import make_mocked_request

from mcp_edge.controlplane.auth import (
    API_TOKEN_PREFIX,
    ENROLLMENT_TOKEN_PREFIX,
    PasswordHasher,
    Role,
    bearer_token,
    issue_secret,
    secret_digest,
)
from mcp_edge.controlplane.settings import PasswordCost


def test_passwords_are_argon2id_at_the_interactive_cost() -> None:
    hasher = PasswordHasher(PasswordCost.INTERACTIVE)
    stored = hasher.hash_sync("correct horse battery")
    assert stored.startswith("$argon2id$v=19$m=65536,t=2,")
    assert "correct horse" not in stored
    assert hasher.verify_sync(stored, "correct horse battery")
    assert not hasher.verify_sync(stored, "correct horse batterz")
    assert stored != hasher.hash_sync("correct horse battery")  # salted


def test_verify_refuses_malformed_hashes_instead_of_raising() -> None:
    assert not PasswordHasher.verify_sync("not a hash", "x")
    assert not PasswordHasher.verify_sync("", "x")


async def test_async_verify_of_a_missing_user_checks_a_decoy_and_fails() -> None:
    hasher = PasswordHasher(PasswordCost.MIN)
    assert not await hasher.verify(None, "anything")
    stored = await hasher.hash("pässwörd-ünicode")
    assert await hasher.verify(stored, "pässwörd-ünicode")


def test_overlong_passwords_are_refused() -> None:
    with pytest.raises(ValueError, match="longer than"):
        PasswordHasher(PasswordCost.MIN).hash_sync("x" * 2000)


def test_issued_secrets_are_prefixed_random_and_stored_as_sha256() -> None:
    a, b = issue_secret(API_TOKEN_PREFIX), issue_secret(API_TOKEN_PREFIX)
    assert a.token.startswith("mcpa_") and a.token != b.token
    assert len(a.token) >= 5 + 43  # 32 random bytes in URL-safe base64
    assert a.digest == hashlib.sha256(a.token.encode()).hexdigest() == secret_digest(a.token)
    assert a.prefix == a.token[:12] and a.token not in a.digest
    assert issue_secret(ENROLLMENT_TOKEN_PREFIX).token.startswith("mcpe_")


@pytest.mark.parametrize(
    ("role", "required", "allowed"),
    [
        (Role.ADMIN, Role.OPERATOR, True),
        (Role.ADMIN, Role.ADMIN, True),
        (Role.OPERATOR, Role.VIEWER, True),
        (Role.OPERATOR, Role.ADMIN, False),
        (Role.VIEWER, Role.OPERATOR, False),
        (Role.VIEWER, Role.VIEWER, True),
    ],
)
def test_roles_are_ordered(role: Role, required: Role, allowed: bool) -> None:
    assert role.allows(required) is allowed


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        ("Bearer mcpa_abc", "mcpa_abc"),
        ("bearer   mcpa_abc  ", "mcpa_abc"),
        ("Basic dXNlcjpwdw==", None),
        ("Bearer", None),
        ("", None),
    ],
)
def test_bearer_token_parsing(header: str, expected: str | None) -> None:
    headers = {"Authorization": header} if header else {}
    assert bearer_token(make_mocked_request("GET", "/", headers=headers)) == expected
