"""One TUF repository written by several replicas (``shared_dir``): each replica has its own
:class:`TufRepository` on the same directory and takes the ``repository/.lock`` flock for
every write, as :class:`RepositoryService` does. Separate open files of one lock conflict
like separate processes do, so two threads stand in for two replicas here.

- publishes from both replicas at once form one version chain that lists every target;
- the timestamp nearing expiry is re-signed by exactly one of them.
"""

from __future__ import annotations

import threading
from datetime import datetime, timedelta, timezone
from pathlib import Path

from mcp_edge.controlplane.repository.service import repository_for, repository_lock
from mcp_edge.controlplane.repository.tuf_repo import Clock, Expiry, TufRepository
from mcp_edge.controlplane.settings import Settings

PER_REPLICA = 12


def _replicas(tmp_path: Path, clock: Clock | None = None) -> tuple[TufRepository, TufRepository]:
    shared = tmp_path / "shared"
    a = repository_for(Settings(data_dir=tmp_path / "a", shared_dir=shared), clock)
    b = repository_for(Settings(data_dir=tmp_path / "b", shared_dir=shared), clock)
    return a, b


def test_both_replicas_use_the_shared_dir_and_neither_data_dir(tmp_path: Path) -> None:
    a, b = _replicas(tmp_path)
    assert a.dir == b.dir == tmp_path / "shared" / "repository"
    assert a.keys.dir == b.keys.dir == tmp_path / "shared" / "keys"
    alone = repository_for(Settings(data_dir=tmp_path / "c"))
    assert alone.dir == tmp_path / "c" / "repository"


def test_publishes_from_two_replicas_at_once_form_one_chain_listing_every_target(
    tmp_path: Path,
) -> None:
    a, b = _replicas(tmp_path)
    with repository_lock(a):
        a.init()
    with repository_lock(b):
        b.init()  # finds it initialized: no second set of keys, no second version 1
    start = threading.Barrier(2)
    failures: list[BaseException] = []

    def publish(repo: TufRepository, name: str) -> None:
        try:
            start.wait()
            for i in range(PER_REPLICA):
                source = tmp_path / f"{name}-{i}.bin"
                source.write_bytes(f"{name} {i}".encode())
                with repository_lock(repo):
                    repo.add_target(f"m/{name}-{i}.bin", source)
        except BaseException as e:
            failures.append(e)

    threads = [threading.Thread(target=publish, args=(r, n)) for r, n in ((a, "a"), (b, "b"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not failures, failures

    listed = set(a.targets().signed.targets)
    assert listed == {f"m/{n}-{i}.bin" for n in "ab" for i in range(PER_REPLICA)}
    final = a.targets().signed.version
    assert final == 1 + 2 * PER_REPLICA  # every write built on the one before it
    metadata = tmp_path / "shared" / "repository" / "metadata"
    assert {int(p.name.split(".")[0]) for p in metadata.glob("*.targets.json")} == set(
        range(1, final + 1)
    )
    assert b.timestamp().signed.version == a.timestamp().signed.version
    assert b.snapshot().signed.meta["targets.json"].version == final


def test_the_timestamp_nearing_expiry_is_re_signed_by_one_replica_only(tmp_path: Path) -> None:
    now = [datetime(2026, 12, 1, tzinfo=timezone.utc)]

    def clock() -> datetime:
        return now[0]

    a, b = _replicas(tmp_path, clock)
    a.expiry = b.expiry = Expiry(timestamp=timedelta(hours=1))
    with repository_lock(a):
        a.init()
    before = a.timestamp().signed.version
    now[0] += timedelta(minutes=45)  # within the last half of the timestamp's life
    start = threading.Barrier(2)
    wrote: list[bool] = []

    def refresh(repo: TufRepository) -> None:
        start.wait()
        with repository_lock(repo):
            wrote.append(repo.refresh_timestamp())

    threads = [threading.Thread(target=refresh, args=(r,)) for r in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert sorted(wrote) == [False, True]
    assert a.timestamp().signed.version == before + 1
    assert a.timestamp().signed.expires == (now[0] + timedelta(hours=1)).replace(microsecond=0)
