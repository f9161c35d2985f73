"""A bounded, on-disk outbox for everything the agent sends upstream (DESIGN 4.7).

Every outbound telemetry message, deployment event and reported state is written here first
and published from here, so what the agent says arrives in the order it said it, whether the
broker was reachable at the time or not. SQLite in WAL mode with ``synchronous=FULL``: a row
that :meth:`Spool.put` returned for survives a crash or power cut, and a row leaves only
through :meth:`Spool.ack`, which the publisher calls after the broker acknowledged it.

Priority classes (``SpoolKind``):

- ``event``: deployment events. Never dropped to make room; they count towards the bound but
  when only events are left the spool grows past it (and says so).
- ``state``: the retained reported state. Only the newest per topic matters, so putting one
  replaces any unsent older one; never dropped otherwise.
- ``health``, ``inference``, ``drift``: telemetry. When the spool is over its bound (rows or
  bytes), the oldest rows are dropped, health samples first, then inference statistics, then
  drift reports.

:meth:`Spool.drain` yields rows in insertion order (the ``AUTOINCREMENT`` id never goes back,
even across restarts). The class is synchronous and thread-safe; the session calls it from one
worker thread so the event loop never waits on an fsync.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import sqlite3
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from mcp_edge.shared.errors import McpError

log = logging.getLogger("mcp.agent.spool")

DEFAULT_MAX_ROWS = 20_000
DEFAULT_MAX_BYTES = 32 * 1024 * 1024
DEFAULT_MAX_ITEM_BYTES = 1024 * 1024


class SpoolError(McpError):
    """The spool cannot take or give a row (disk full, I/O error, item too large)."""


class SpoolKind(str, enum.Enum):
    EVENT = "event"
    STATE = "state"
    HEALTH = "health"
    INFERENCE = "inference"
    DRIFT = "drift"

    @property
    def drop_rank(self) -> int:
        """0: never dropped; otherwise lower ranks are dropped first."""
        return _DROP_RANK[self]


_DROP_RANK = {
    SpoolKind.EVENT: 0,
    SpoolKind.STATE: 0,
    SpoolKind.HEALTH: 1,
    SpoolKind.INFERENCE: 2,
    SpoolKind.DRIFT: 3,
}

_SCHEMA = """
CREATE TABLE IF NOT EXISTS outbox (
    id      INTEGER PRIMARY KEY AUTOINCREMENT,
    kind    TEXT    NOT NULL,
    rank    INTEGER NOT NULL,
    topic   TEXT    NOT NULL,
    payload BLOB    NOT NULL,
    size    INTEGER NOT NULL,
    qos     INTEGER NOT NULL,
    retain  INTEGER NOT NULL,
    created REAL    NOT NULL
);
CREATE INDEX IF NOT EXISTS outbox_drop ON outbox (rank, id) WHERE rank > 0;
CREATE INDEX IF NOT EXISTS outbox_state ON outbox (kind, topic) WHERE rank = 0;
"""


@dataclass(frozen=True)
class SpoolItem:
    id: int
    kind: SpoolKind
    topic: str
    payload: bytes
    qos: int
    retain: bool
    created: float


class Spool:
    """The outbox (see the module docstring).

    ``max_rows``/``max_bytes`` bound all rows (size = payload + topic bytes); only telemetry
    is dropped to stay within them;
    ``max_item_bytes`` refuses a single oversized row (it could never be delivered anyway).
    """

    def __init__(
        self,
        path: Path | str,
        *,
        max_rows: int = DEFAULT_MAX_ROWS,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_item_bytes: int = DEFAULT_MAX_ITEM_BYTES,
    ) -> None:
        if max_rows < 1 or max_bytes < 1:
            raise ValueError("spool bounds must be positive")
        self.path = Path(path)
        self.max_rows = max_rows
        self.max_bytes = max_bytes
        self.max_item_bytes = max_item_bytes
        self._lock = threading.Lock()
        self.dropped: Counter[str] = Counter()
        """Rows dropped to keep the bound, by kind (and ``refused`` for acked-as-undeliverable)."""
        self._db = self._open()
        rows, size = self._db.execute(
            "SELECT count(*), coalesce(sum(size), 0) FROM outbox"
        ).fetchone()
        self._rows, self._bytes = int(rows), int(size)

    # ----------------------------------------------------------------- open
    def _open(self) -> sqlite3.Connection:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            return self._connect()
        except sqlite3.DatabaseError as e:
            # A corrupt spool must not stop the agent: keep the file for a post-mortem, start anew.
            aside = self.path.with_name(f"{self.path.name}.corrupt-{int(time.time())}")
            log.error("telemetry spool %s is unreadable (%s); moved to %s", self.path, e, aside)
            for suffix in ("", "-wal", "-shm"):
                p = Path(str(self.path) + suffix)
                if p.exists():
                    os.replace(p, Path(str(aside) + suffix))
            return self._connect()

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")
            db.executescript(_SCHEMA)
            db.execute("SELECT count(*) FROM outbox").fetchone()
        except sqlite3.DatabaseError:
            db.close()
            raise
        return db

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # ----------------------------------------------------------------- write
    def put(
        self,
        kind: SpoolKind | str,
        topic: str,
        payload: bytes,
        qos: int = 1,
        retain: bool = False,
        *,
        now: float | None = None,
    ) -> int:
        """Append one row and enforce the bound; return the row id.

        Raises :class:`SpoolError` for an item over ``max_item_bytes`` or a database failure
        (e.g. the disk is full); nothing is written then.
        """
        kind = SpoolKind(kind)
        size = len(payload) + len(topic.encode())
        if size > self.max_item_bytes:
            raise SpoolError(
                f"{kind.value} message of {size} bytes exceeds the spool's "
                f"{self.max_item_bytes}-byte item limit"
            )
        created = time.time() if now is None else now
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    if kind is SpoolKind.STATE:
                        self._delete_where("kind = 'state' AND topic = ? AND rank = 0", (topic,))
                    cur = self._db.execute(
                        "INSERT INTO outbox (kind, rank, topic, payload, size, qos, retain, created)"
                        " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                        (
                            kind.value,
                            kind.drop_rank,
                            topic,
                            payload,
                            size,
                            qos,
                            int(retain),
                            created,
                        ),
                    )
                    self._rows += 1
                    self._bytes += size
                    self._enforce_bound()
                    self._db.execute("COMMIT")
                except BaseException:
                    self._db.execute("ROLLBACK")
                    self._recount()
                    raise
            except sqlite3.Error as e:
                raise SpoolError(f"cannot write to the spool {self.path}: {e}") from e
            rowid = cur.lastrowid
            assert rowid is not None
            return rowid

    def _delete_where(self, where: str, args: tuple[object, ...]) -> None:
        row = self._db.execute(
            f"SELECT count(*), coalesce(sum(size), 0) FROM outbox WHERE {where}", args
        ).fetchone()
        if row[0]:
            self._db.execute(f"DELETE FROM outbox WHERE {where}", args)
            self._rows -= row[0]
            self._bytes -= row[1]

    def _enforce_bound(self) -> None:
        excess_rows = self._rows - self.max_rows
        excess_bytes = self._bytes - self.max_bytes
        if excess_rows <= 0 and excess_bytes <= 0:
            return
        victims: list[int] = []
        cur = self._db.execute("SELECT id, kind, size FROM outbox WHERE rank > 0 ORDER BY rank, id")
        for rowid, kind, size in cur:
            if excess_rows <= 0 and excess_bytes <= 0:
                break
            victims.append(rowid)
            self.dropped[kind] += 1
            excess_rows -= 1
            excess_bytes -= size
            self._rows -= 1
            self._bytes -= size
        cur.close()
        for i in range(0, len(victims), 500):
            chunk = victims[i : i + 500]
            self._db.execute(
                f"DELETE FROM outbox WHERE id IN ({','.join('?' * len(chunk))})", chunk
            )
        if victims:
            log.debug("spool over its bound: dropped %d oldest telemetry rows", len(victims))
        if excess_rows > 0 or excess_bytes > 0:
            log.warning(
                "spool holds %d rows / %d bytes of undroppable events and state, above its "
                "bound of %d rows / %d bytes",
                self._rows,
                self._bytes,
                self.max_rows,
                self.max_bytes,
            )

    def _recount(self) -> None:
        with contextlib.suppress(sqlite3.Error):
            self._rows, self._bytes = self._db.execute(
                "SELECT count(*), coalesce(sum(size), 0) FROM outbox"
            ).fetchone()

    # ----------------------------------------------------------------- read
    def peek(self, limit: int = 64, after_id: int = 0) -> list[SpoolItem]:
        """Up to ``limit`` oldest rows with id > ``after_id``, in insertion order."""
        with self._lock:
            try:
                rows = self._db.execute(
                    "SELECT id, kind, topic, payload, qos, retain, created FROM outbox"
                    " WHERE id > ? ORDER BY id LIMIT ?",
                    (after_id, limit),
                ).fetchall()
            except sqlite3.Error as e:
                raise SpoolError(f"cannot read the spool {self.path}: {e}") from e
        return [
            SpoolItem(r[0], SpoolKind(r[1]), r[2], bytes(r[3]), r[4], bool(r[5]), r[6])
            for r in rows
        ]

    def drain(self, batch: int = 64) -> Iterator[SpoolItem]:
        """Yield every row in insertion order, reading ``batch`` rows at a time.

        Nothing is deleted here: call :meth:`ack` with a row's id once the broker acknowledged
        it. Rows put while draining are yielded too.
        """
        last = 0
        while True:
            items = self.peek(batch, after_id=last)
            if not items:
                return
            yield from items
            last = items[-1].id

    def ack(self, ids: Iterable[int]) -> int:
        """Delete delivered rows; return how many were deleted (unknown ids are ignored)."""
        id_list = list(ids)
        deleted = 0
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    for i in range(0, len(id_list), 500):
                        chunk = id_list[i : i + 500]
                        marks = ",".join("?" * len(chunk))
                        n, size = self._db.execute(
                            f"SELECT count(*), coalesce(sum(size), 0) FROM outbox"
                            f" WHERE id IN ({marks})",
                            chunk,
                        ).fetchone()
                        self._db.execute(f"DELETE FROM outbox WHERE id IN ({marks})", chunk)
                        deleted += n
                        self._rows -= n
                        self._bytes -= size
                    self._db.execute("COMMIT")
                except BaseException:
                    self._db.execute("ROLLBACK")
                    self._recount()
                    raise
            except sqlite3.Error as e:
                raise SpoolError(f"cannot delete from the spool {self.path}: {e}") from e
        return deleted

    # ----------------------------------------------------------------- figures
    @property
    def rows(self) -> int:
        return self._rows

    @property
    def size_bytes(self) -> int:
        return self._bytes

    def count(self, kind: SpoolKind | str | None = None) -> int:
        """Rows waiting, of one kind or all."""
        if kind is None:
            return self._rows
        with self._lock:
            (n,) = self._db.execute(
                "SELECT count(*) FROM outbox WHERE kind = ?", (SpoolKind(kind).value,)
            ).fetchone()
        return int(n)
