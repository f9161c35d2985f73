"""Broker accounts kept in the control plane's database, for brokers that ask over HTTP.

EMQX, VerneMQ and Mosquitto with mosquitto-go-auth can delegate every login and every
publish/subscribe decision to an HTTP service. :class:`HttpAuthProvisioner` is the second
:class:`~controlplane.broker.base.BrokerProvisioner` (after
:class:`~controlplane.broker.dynsec.DynsecProvisioner`): it keeps the accounts in the
``broker_accounts`` table and answers the questions :mod:`controlplane.broker.http_hooks` puts
to it in each broker's dialect. The topics an account may use are not stored: they are the
literal lists of :mod:`controlplane.broker.acl`, so both implementations grant exactly the same.

Decisions: a login needs an enabled account, the client id bound to it and its password; a
publish, a delivery or a subscription needs an enabled account, the bound client id and an ACL
of its role covering the topic (:mod:`controlplane.broker.grants`, pure).

Revocation: an authentication hook cannot end a session the broker already admitted.
:meth:`HttpAuthProvisioner.disable_device` (and ``delete_device``, ``disable_app_client``,
``delete_app_client``) make the very next login, publish and subscription check of that
account deny; Mosquitto (go-auth) also checks every delivery, EMQX and VerneMQ do not, so a
session admitted before the revocation keeps receiving on its existing subscriptions until the
operator disconnects it (``emqx ctl clients kick``, ``vmq-admin session disconnect``) or its
broker-side decision cache expires (docs/broker-http-auth.md).

Writes and SQLite: callers provision inside their own write transaction (an enrollment commits
the device and its account together), and SQLite has one writer. On SQLite the provisioner
therefore keeps each change in memory, where its own checks see it at once, and a background
task writes it as soon as the caller's transaction ends (:meth:`HttpAuthProvisioner.flush`
waits for that). A SQLite database is served by one process (``ServeLock``), so nothing else
needs to see the change earlier. On PostgreSQL each change commits in a transaction of its own
before the call returns, so every replica's endpoint sees it.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime, timezone

from mcp_edge.controlplane.broker.acl import (
    DEFAULT_FLEET_SHARE_GROUP,
    AccountKind,
    AccountSpec,
    app_client_account,
    device_account,
    service_account,
    username_for,
)
from mcp_edge.controlplane.broker.base import AccountConflictError, BrokerAdminError, Credentials
from mcp_edge.controlplane.broker.grants import Grant, Verdict, kind_name, kind_of, role_grant
from mcp_edge.controlplane.db import ConflictError, Database, DatabaseError
from mcp_edge.controlplane.db import broker_accounts as q
from mcp_edge.controlplane.db.broker_accounts import BrokerAccount
from mcp_edge.controlplane.db.engine import savepoint
from mcp_edge.shared.errors import TopicError
from mcp_edge.shared.protocol import topics

log = logging.getLogger(__name__)

# Passwords are 256-bit random tokens the control plane draws, so no offline guessing can
# recover one from its hash, however fast the hash. A salted, memory-hard scrypt is used anyway
# so that a copied table is worthless as it stands, at a cost chosen for the login path:
# N=2^12, r=8 (4 MiB, about 10 ms on one core). A broker that reconnects every client at once
# pays it once per account and process: verified results are kept VERIFIED_CACHE_S seconds.
SCRYPT_LOG2_N, SCRYPT_R, SCRYPT_P = 12, 8, 1
SALT_BYTES, HASH_BYTES = 16, 32
VERIFIED_CACHE_S = 600.0
"""How long a verified (account, password) pair skips scrypt (seconds). A new password or a
disabled account takes effect at once all the same: the key holds the stored hash, and the
enabled flag is read on every check."""
VERIFIED_CACHE_MAX = 65536
HASH_THREADS = 2
"""Concurrent scrypt runs (each in a worker thread), so a login storm cannot take every core."""
FLUSH_RETRY_MAX_S = 30.0

_Clock = Callable[[], datetime]


# ---- passwords (pure) ---------------------------------------------------------------------


def hash_password(password: str, *, salt: bytes | None = None) -> str:
    """``scrypt$<log2 N>$<r>$<p>$<salt>$<hash>`` (base64) of ``password``, with a fresh salt."""
    salt = salt if salt is not None else secrets.token_bytes(SALT_BYTES)
    digest = hashlib.scrypt(
        password.encode(), salt=salt, n=1 << SCRYPT_LOG2_N, r=SCRYPT_R, p=SCRYPT_P,
        dklen=HASH_BYTES, maxmem=64 << 20,
    )  # fmt: skip
    fields = (SCRYPT_LOG2_N, SCRYPT_R, SCRYPT_P, _b64(salt), _b64(digest))
    return "scrypt$" + "$".join(str(f) for f in fields)


def verify_password(password: str, encoded: str) -> bool:
    """Whether ``password`` hashes to ``encoded``; False for an encoding this module cannot read
    (never an exception: a damaged row denies its account)."""
    try:
        scheme, log2_n, r, p, salt, expected = encoded.split("$")
        if scheme != "scrypt" or not 1 <= int(log2_n) <= 20:
            return False
        digest = hashlib.scrypt(
            password.encode(), salt=base64.b64decode(salt), n=1 << int(log2_n), r=int(r),
            p=int(p), dklen=HASH_BYTES, maxmem=256 << 20,
        )  # fmt: skip
        return hmac.compare_digest(digest, base64.b64decode(expected))
    except (ValueError, TypeError, MemoryError):
        return False


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


# ---- the provisioner and the decisions (I/O) ----------------------------------------------


@dataclass(eq=False)
class _Pending:
    """A change not yet in the database (SQLite): the account as it now is, None if deleted."""

    account: BrokerAccount | None


Mutation = Callable[[BrokerAccount | None, str | None], BrokerAccount | None]
"""``(current account, username holding the client id) -> new account`` (None deletes;
returning ``current`` itself changes nothing). Raises to refuse."""


class HttpAuthProvisioner:
    """Broker accounts in the control plane's database, answering the brokers' HTTP hooks.

    ``db`` is the app's :class:`~controlplane.db.Database` (migrated to 0011 or later);
    ``fleet_share_group`` is the share group devices may take fleet inference requests in;
    ``clock`` stamps rows; ``monotonic`` times the verified-password cache. Use as
    ``async with`` or call :meth:`close`, which writes what is still held in memory.

    Every method raises :class:`~shared.errors.TopicError` for an invalid id, and
    :class:`~controlplane.broker.base.BrokerAdminError` when the database fails (on SQLite
    that comes later, in the background, and is retried).
    """

    def __init__(
        self,
        db: Database,
        *,
        fleet_share_group: str = DEFAULT_FLEET_SHARE_GROUP,
        clock: _Clock = lambda: datetime.now(timezone.utc),
        monotonic: Callable[[], float] = time.monotonic,
        verified_cache_s: float = VERIFIED_CACHE_S,
    ) -> None:
        self.db = db
        self._share_group = topics.validate_id(fleet_share_group, "share group")
        self._clock = clock
        self._monotonic = monotonic
        self._verified_cache_s = verified_cache_s
        self._verified: OrderedDict[tuple[str, str], tuple[bytes, float]] = OrderedDict()
        self._hashing = asyncio.Semaphore(HASH_THREADS)
        self._write_behind = db.is_sqlite
        self._pending: dict[str, _Pending] = {}
        self._wake = asyncio.Event()
        self._flush_lock = asyncio.Lock()
        self._flusher: asyncio.Task[None] | None = None
        self._flushes = 0
        """Batches committed and taken out of ``_pending`` so far: a read that saw this number
        change while it ran may have missed a change, and is done again."""
        self.password_checks = 0
        """scrypt verifications run so far (the cache answers the others)."""

    async def __aenter__(self) -> HttpAuthProvisioner:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop the background writer and write what it still holds."""
        if self._flusher is not None:
            self._flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._flusher
            self._flusher = None
        await self.flush()

    # ---- BrokerProvisioner ------------------------------------------------------------------

    async def provision_device(self, device_id: str) -> Credentials:
        """Create ``dev-{device_id}`` (client id ``device_id``) or give it a new password; a
        disabled account comes back enabled. Raises AccountConflictError when another kind
        of account holds the client id."""
        return await self._provision(device_account(device_id, share_group=self._share_group))

    async def provision_service(self, name: str) -> Credentials:
        """Create or reset ``svc-{name}`` (client id ``name``): a control-plane replica."""
        return await self._provision(service_account(name))

    async def provision_app_client(self, client_id: str) -> Credentials:
        """Create or reset ``app-{client_id}`` (client id ``client_id``)."""
        return await self._provision(app_client_account(client_id))

    async def disable_device(self, device_id: str) -> None:
        """Disable the device's account: its next login, publish and subscription are denied
        (a session the broker admitted earlier is not ended here: see the module docstring).
        No account: no error."""
        await self._set_enabled(username_for(AccountKind.DEVICE, device_id), False)

    async def enable_device(self, device_id: str) -> None:
        """Let a disabled device log in again; BrokerAdminError when it has no account."""
        await self._set_enabled(username_for(AccountKind.DEVICE, device_id), True)

    async def delete_device(self, device_id: str) -> None:
        """Delete the device's account (its next check is denied); no account: no error."""
        await self._apply(username_for(AccountKind.DEVICE, device_id), lambda current, _: None)

    async def disable_app_client(self, client_id: str) -> None:
        """Disable ``app-{client_id}`` (next check denied); no account: no error."""
        await self._set_enabled(username_for(AccountKind.APP, client_id), False)
        log.info("broker account app-%s disabled", client_id)

    async def delete_app_client(self, client_id: str) -> None:
        """Delete ``app-{client_id}`` (next check denied); no account: no error."""
        await self._apply(username_for(AccountKind.APP, client_id), lambda current, _: None)

    async def _provision(self, spec: AccountSpec) -> Credentials:
        password = secrets.token_urlsafe(32)
        async with self._hashing:
            encoded = await asyncio.to_thread(hash_password, password)

        def put(current: BrokerAccount | None, holder: str | None) -> BrokerAccount:
            if holder is not None and holder != spec.username:
                raise AccountConflictError(spec.client_id, holder)
            now = self._clock()
            return BrokerAccount(
                username=spec.username, client_id=spec.client_id, kind=kind_name(spec.kind),
                password_hash=encoded, enabled=True, updated_at=now,
                created_at=current.created_at if current is not None else now,
            )  # fmt: skip

        await self._apply(spec.username, put, client_id=spec.client_id)
        log.info("broker account %s provisioned (client id %s)", spec.username, spec.client_id)
        return Credentials(username=spec.username, password=password, client_id=spec.client_id)

    async def _set_enabled(self, username: str, enabled: bool) -> None:
        def toggle(current: BrokerAccount | None, _holder: str | None) -> BrokerAccount | None:
            if current is None:
                if enabled:
                    raise BrokerAdminError(f"broker account {username} does not exist")
                return None
            if current.enabled == enabled:
                return current
            return replace(current, enabled=enabled, updated_at=self._clock())

        await self._apply(username, toggle)

    # ---- the decisions ------------------------------------------------------------------------

    async def authenticate(
        self, username: str | None, password: str | None, client_id: str
    ) -> Verdict:
        """May ``client_id`` log in as ``username`` with ``password``?

        Raises BrokerAdminError when the database cannot be read.
        """
        if not username or not password:
            return Verdict.UNKNOWN_ACCOUNT if not username else Verdict.WRONG_PASSWORD
        account = await self._lookup(username)
        verdict = _standing(account, client_id)
        if verdict is not Verdict.ALLOW or account is None:
            return verdict
        digest = hashlib.sha256(password.encode()).digest()
        key = (username, account.password_hash)
        now = self._monotonic()
        cached = self._verified.get(key)
        if cached is not None and cached[1] > now and hmac.compare_digest(cached[0], digest):
            return Verdict.ALLOW
        self.password_checks += 1
        async with self._hashing:
            ok = await asyncio.to_thread(verify_password, password, account.password_hash)
        if not ok:
            return Verdict.WRONG_PASSWORD
        self._verified[key] = (digest, now + self._verified_cache_s)
        self._verified.move_to_end(key)
        while len(self._verified) > VERIFIED_CACHE_MAX:
            self._verified.popitem(last=False)
        return Verdict.ALLOW

    async def grant(self, username: str | None, client_id: str) -> Grant | Verdict:
        """What ``username``, connected as ``client_id``, may do now; a denying Verdict when
        the account is unknown, disabled or bound to another client id.

        Raises BrokerAdminError when the database cannot be read.
        """
        account = await self._lookup(username) if username else None
        verdict = _standing(account, client_id)
        kind = kind_of(account.kind) if account is not None else None
        if verdict is not Verdict.ALLOW or account is None or kind is None:
            return verdict if verdict is not Verdict.ALLOW else Verdict.UNKNOWN_ACCOUNT
        try:
            return role_grant(kind, account.username, account.client_id, self._share_group)
        except TopicError:  # a row no provisioner wrote
            return Verdict.UNKNOWN_ACCOUNT

    async def accounts(self) -> list[BrokerAccount]:
        """Every account as the endpoint sees it now (database and changes not yet written)."""
        while True:
            flushes = self._flushes
            try:
                async with self.db.read() as tx:
                    stored = {a.username: a for a in await q.list_accounts(tx)}
            except DatabaseError as e:
                raise BrokerAdminError(f"broker accounts cannot be read: {e}") from e
            if flushes == self._flushes:
                break
        for username, pending in self._pending.items():
            if pending.account is None:
                stored.pop(username, None)
            else:
                stored[username] = pending.account
        return [stored[u] for u in sorted(stored)]

    async def _lookup(self, username: str) -> BrokerAccount | None:
        # Changes in memory first: one that is not there any more was committed before the
        # read below starts, so the read sees it.
        pending = self._pending.get(username)
        if pending is not None:
            return pending.account
        try:
            async with self.db.read() as tx:
                return await q.get_account(tx, username)
        except DatabaseError as e:
            raise BrokerAdminError(f"broker accounts cannot be read: {e}") from e

    # ---- writes -------------------------------------------------------------------------------

    async def _apply(
        self, username: str, mutate: Mutation, *, client_id: str | None = None
    ) -> None:
        """Run ``mutate`` on the account's current state and keep its answer: in memory for the
        background writer on SQLite, committed in a transaction of its own on PostgreSQL."""
        if not self._write_behind:
            await self._apply_now(username, mutate, client_id)
            return
        while True:
            flushes = self._flushes
            try:
                async with self.db.read() as tx:
                    stored = await q.get_account(tx, username)
                    stored_holder = await q.holder_of(tx, client_id) if client_id else None
            except DatabaseError as e:
                raise BrokerAdminError(f"broker accounts cannot be read: {e}") from e
            if flushes == self._flushes:
                break  # what left _pending before the read had been committed: it is in there
        # No await from here on: the checks and the change see one state of ``_pending``.
        pending = self._pending.get(username)
        current = pending.account if pending is not None else stored
        holder = self._holder(client_id, stored_holder) if client_id else None
        new = mutate(current, holder)
        if new is current:
            return
        self._pending[username] = _Pending(new)
        self._wake.set()
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(self._flush_loop())

    def _holder(self, client_id: str, stored_holder: str | None) -> str | None:
        """Who holds ``client_id`` once the changes in memory are counted."""
        for username, pending in self._pending.items():
            if pending.account is not None and pending.account.client_id == client_id:
                return username
        if stored_holder is not None and stored_holder in self._pending:
            return None  # deleted or bound elsewhere since (it was not found above)
        return stored_holder

    async def _apply_now(self, username: str, mutate: Mutation, client_id: str | None) -> None:
        try:
            async with self.db.transaction() as tx:
                current = await q.get_account(tx, username, lock=True)
                holder = await q.holder_of(tx, client_id) if client_id else None
                new = mutate(current, holder)
                if new is None and current is not None:
                    await q.delete_account(tx, username)
                elif new is not None and new is not current:
                    await q.put_account(tx, new)
        except ConflictError as e:  # another replica bound the client id meanwhile
            raise AccountConflictError(client_id or "", "another account") from e
        except DatabaseError as e:
            raise BrokerAdminError(f"broker account {username} not written: {e}") from e

    async def flush(self) -> None:
        """Return once every change made so far is committed (at once on PostgreSQL).

        Raises BrokerAdminError when the database refuses the write (the changes stay in
        memory and are tried again).
        """
        while self._pending:
            try:
                await self._flush_once()
            except DatabaseError as e:
                raise BrokerAdminError(f"broker accounts not written: {e}") from e

    async def _flush_once(self) -> None:
        async with self._flush_lock:
            batch = dict(self._pending)
            if not batch:
                return
            conflicts: set[str] = set()
            async with self.db.transaction() as tx:
                for username, pending in batch.items():
                    try:
                        async with savepoint(tx):
                            if pending.account is None:
                                await q.delete_account(tx, username)
                            else:
                                await q.put_account(tx, pending.account)
                    except ConflictError:
                        conflicts.add(username)
            for username, pending in batch.items():
                if self._pending.get(username) is pending:
                    del self._pending[username]
            self._flushes += 1
            for username in sorted(conflicts):
                log.error("broker account %s dropped: its client id was taken meanwhile", username)

    async def _flush_loop(self) -> None:
        delay = 0.0
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                await self._flush_once()
                delay = 0.0
            except DatabaseError as e:
                delay = min(max(2 * delay, 0.5), FLUSH_RETRY_MAX_S)
                log.warning("broker accounts not written yet, retrying in %.1f s: %s", delay, e)
                await asyncio.sleep(delay)  # back off before the retry
                self._wake.set()


def _standing(account: BrokerAccount | None, client_id: str) -> Verdict:
    """Whether ``account`` may act at all as ``client_id`` (before its password or topics)."""
    if account is None:
        return Verdict.UNKNOWN_ACCOUNT
    if not account.enabled:
        return Verdict.DISABLED
    if not hmac.compare_digest(account.client_id.encode(), client_id.encode()):
        return Verdict.WRONG_CLIENT_ID
    return Verdict.ALLOW
