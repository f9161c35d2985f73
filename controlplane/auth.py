"""Who may do what: password hashing, API and enrollment secrets, roles, the auth middleware.

- Passwords: argon2id through PyNaCl (``nacl.pwhash.argon2id``), hashed and verified in a
  worker thread (64 MiB and ~0.1 s each at the interactive cost) behind a small semaphore so a
  burst of logins cannot exhaust memory or stall the event loop.
- Secrets (API tokens, enrollment tokens): 32 random bytes, URL-safe, with a type prefix
  (``mcpa_`` / ``mcpe_``) so a leaked one is recognisable; only the SHA-256 is stored and the
  secret is shown once. The first characters (``prefix``) identify a token in listings.
- Roles are ordered: ``viewer`` reads, ``operator`` also changes the fleet (tokens, devices,
  approvals), ``admin`` also manages users.
- :func:`auth_middleware` reads ``Authorization: Bearer <token>`` and checks the route's
  required role; the principal is then ``request[PRINCIPAL]``.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import secrets
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta

import nacl.exceptions
import nacl.pwhash
from aiohttp import web
from aiohttp.typedefs import Middleware
from aiohttp.web_urldispatcher import AbstractRoute

from mcp_edge.controlplane.db import Database
from mcp_edge.controlplane.db import users as user_queries
from mcp_edge.controlplane.settings import PasswordCost
from mcp_edge.shared.errors import McpError

API_TOKEN_PREFIX = "mcpa_"
ENROLLMENT_TOKEN_PREFIX = "mcpe_"
DISPLAY_PREFIX_CHARS = 12
TOUCH_INTERVAL = timedelta(minutes=1)
MAX_PASSWORD_BYTES = 1024
SESSION_COOKIE = "mcp_session"

Clock = Callable[[], datetime]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Role(str, enum.Enum):
    """A user's role; each one can do everything the roles below it can."""

    VIEWER = "viewer"
    OPERATOR = "operator"
    ADMIN = "admin"

    @property
    def rank(self) -> int:
        return _RANK[self]

    def allows(self, required: Role) -> bool:
        """True when this role may do what ``required`` may."""
        return self.rank >= required.rank


_RANK = {Role.VIEWER: 0, Role.OPERATOR: 1, Role.ADMIN: 2}


class AuthError(McpError):
    """A request is not authenticated (``status`` 401) or not allowed (403)."""

    def __init__(self, message: str, *, status: int = 401) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Principal:
    """The authenticated user behind a request."""

    user_id: int
    username: str
    role: Role
    token_id: int

    @property
    def actor(self) -> str:
        """How the audit log names this principal."""
        return f"user:{self.username}"


PRINCIPAL = web.RequestKey("principal", Principal)


@dataclass(frozen=True)
class IssuedSecret:
    """A fresh secret: give ``token`` to its holder once, store ``digest`` and ``prefix``."""

    token: str
    digest: str
    prefix: str


def secret_digest(token: str) -> str:
    """The stored form of a token: hex SHA-256 of its UTF-8 bytes."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def issue_secret(kind_prefix: str) -> IssuedSecret:
    """A new random token starting with ``kind_prefix``."""
    token = kind_prefix + secrets.token_urlsafe(32)
    return IssuedSecret(
        token=token, digest=secret_digest(token), prefix=token[:DISPLAY_PREFIX_CHARS]
    )


_LIMITS = {
    PasswordCost.MIN: (nacl.pwhash.argon2id.OPSLIMIT_MIN, nacl.pwhash.argon2id.MEMLIMIT_MIN),
    PasswordCost.INTERACTIVE: (
        nacl.pwhash.argon2id.OPSLIMIT_INTERACTIVE,
        nacl.pwhash.argon2id.MEMLIMIT_INTERACTIVE,
    ),
    PasswordCost.MODERATE: (
        nacl.pwhash.argon2id.OPSLIMIT_MODERATE,
        nacl.pwhash.argon2id.MEMLIMIT_MODERATE,
    ),
}


class PasswordHasher:
    """argon2id hashing at one cost; at most ``concurrency`` hashes run at once."""

    def __init__(self, cost: PasswordCost = PasswordCost.INTERACTIVE, concurrency: int = 2) -> None:
        self.opslimit, self.memlimit = _LIMITS[cost]
        self._slots = asyncio.Semaphore(concurrency)
        # Verified against when the user does not exist, so both paths take the same time.
        self._decoy = self.hash_sync(secrets.token_hex(16))

    def hash_sync(self, password: str) -> str:
        """The argon2id hash string of ``password`` (``$argon2id$v=19$...``)."""
        data = password.encode("utf-8")
        if len(data) > MAX_PASSWORD_BYTES:
            raise ValueError(f"password longer than {MAX_PASSWORD_BYTES} bytes")
        raw = nacl.pwhash.argon2id.str(data, opslimit=self.opslimit, memlimit=self.memlimit)
        return raw.decode("ascii")

    @staticmethod
    def verify_sync(password_hash: str, password: str) -> bool:
        """True when ``password`` matches; False for a wrong password or a malformed hash."""
        try:
            return bool(nacl.pwhash.verify(password_hash.encode("ascii"), password.encode("utf-8")))
        except (nacl.exceptions.InvalidkeyError, nacl.exceptions.CryptoError, ValueError):
            return False

    async def hash(self, password: str) -> str:
        async with self._slots:
            return await asyncio.to_thread(self.hash_sync, password)

    async def verify(self, password_hash: str | None, password: str) -> bool:
        """Check a password off the event loop; ``password_hash`` None checks a decoy."""
        async with self._slots:
            ok = await asyncio.to_thread(self.verify_sync, password_hash or self._decoy, password)
        return ok and password_hash is not None


def bearer_token(request: web.Request) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, or None."""
    header = request.headers.get("Authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        return None
    return value.strip()


async def authenticate(db: Database, token: str, now: datetime) -> Principal:
    """The principal an API token stands for; raises :class:`AuthError` (401)."""
    async with db.read() as tx:
        found = await user_queries.find_api_token(tx, secret_digest(token))
    if found is None:
        raise AuthError("unknown API token")
    api_token, user = found
    if api_token.revoked_at is not None:
        raise AuthError("this API token was revoked")
    if api_token.expires_at is not None and api_token.expires_at <= now:
        raise AuthError("this API token has expired; log in again")
    if user.disabled:
        raise AuthError(f"user {user.username!r} is disabled")
    try:
        role = Role(user.role)
    except ValueError as e:
        raise AuthError(f"user {user.username!r} has an unknown role", status=403) from e
    if api_token.last_used_at is None or now - api_token.last_used_at > TOUCH_INTERVAL:
        async with db.transaction() as tx:
            await user_queries.touch_api_token(tx, api_token.id, now)
    return Principal(user_id=user.id, username=user.username, role=role, token_id=api_token.id)


def auth_middleware(
    db: Database, clock: Clock, route_roles: Mapping[AbstractRoute, Role | None]
) -> Middleware:
    """Middleware that authenticates requests to routes listed in ``route_roles`` with a role.

    Routes mapped to None, and routes not listed (health, metrics), are public.
    """

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        route = request.match_info.route
        required = route_roles.get(route) if isinstance(route, AbstractRoute) else None
        if required is None:
            return await handler(request)
        token = bearer_token(request)
        if token is None and request.method in ("GET", "HEAD"):
            # The console's session reads the API too (its API reference page); only for
            # reads, so a cross-site form can never change anything with it.
            token = request.cookies.get(SESSION_COOKIE) or None
        if token is None:
            raise AuthError("authentication required: send 'Authorization: Bearer <API token>'")
        principal = await authenticate(db, token, clock())
        if not principal.role.allows(required):
            raise AuthError(
                f"{principal.role.value} may not do this; it needs the {required.value} role",
                status=403,
            )
        request[PRINCIPAL] = principal
        return await handler(request)

    return middleware


def principal_of(request: web.Request) -> Principal:
    """The principal the middleware stored; raises :class:`AuthError` on a public route."""
    if PRINCIPAL not in request:
        raise AuthError("authentication required")
    return request[PRINCIPAL]
