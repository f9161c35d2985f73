"""The telemetry spool: order, bounds, priority classes, acks and restarts (real SQLite files)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mcp_edge.agent.fleet.spool import Spool, SpoolError, SpoolKind


def _payload(i: int, size: int = 10) -> bytes:
    return json.dumps({"i": i}).encode().ljust(size, b" ")


def test_rows_come_back_in_insertion_order_and_leave_only_when_acked(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool.db")
    ids = [
        spool.put(SpoolKind.HEALTH if i % 3 else SpoolKind.EVENT, "t/x", _payload(i))
        for i in range(10)
    ]
    assert ids == sorted(ids)
    seen = [json.loads(item.payload)["i"] for item in spool.drain(batch=3)]
    assert seen == list(range(10))
    # Draining deletes nothing; acking deletes exactly what was acked.
    assert spool.rows == 10
    first = spool.peek(4)
    assert spool.ack([i.id for i in first]) == 4
    assert [json.loads(i.payload)["i"] for i in spool.peek(100)] == list(range(4, 10))
    assert spool.ack([first[0].id]) == 0  # acking twice is harmless


def test_survives_a_restart_and_keeps_counting_ids_upward(tmp_path: Path) -> None:
    path = tmp_path / "spool.db"
    spool = Spool(path)
    for i in range(5):
        spool.put(SpoolKind.EVENT, "t/e", _payload(i), qos=1, retain=False)
    spool.put(SpoolKind.STATE, "t/reported", b"{}", retain=True)
    last = spool.peek(100)[-1].id
    spool.ack([spool.peek(1)[0].id])
    spool.close()

    again = Spool(path)
    items = again.peek(100)
    assert [json.loads(i.payload)["i"] for i in items[:-1]] == [1, 2, 3, 4]
    assert items[-1].retain and items[-1].kind is SpoolKind.STATE
    assert again.rows == 5 and again.size_bytes > 0
    assert again.put(SpoolKind.HEALTH, "t/h", b"{}") > last


def test_over_the_row_bound_the_oldest_health_samples_go_first_and_events_never(
    tmp_path: Path,
) -> None:
    spool = Spool(tmp_path / "spool.db", max_rows=10)
    for i in range(4):
        spool.put(SpoolKind.EVENT, "t/events", _payload(100 + i))
    spool.put(SpoolKind.INFERENCE, "t/inference", _payload(500))
    for i in range(20):
        spool.put(SpoolKind.HEALTH, "t/health", _payload(i))
    kinds = [(i.kind, json.loads(i.payload)["i"]) for i in spool.peek(100)]
    assert spool.rows == 10
    assert [v for k, v in kinds if k is SpoolKind.EVENT] == [100, 101, 102, 103]
    assert [v for k, v in kinds if k is SpoolKind.INFERENCE] == [500]  # health goes before it
    assert [v for k, v in kinds if k is SpoolKind.HEALTH] == [15, 16, 17, 18, 19]
    assert spool.dropped["health"] == 15 and spool.dropped["event"] == 0


def test_when_health_is_gone_inference_then_drift_are_dropped(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool.db", max_rows=3)
    spool.put(SpoolKind.DRIFT, "t/d", _payload(1))
    spool.put(SpoolKind.INFERENCE, "t/i", _payload(2))
    spool.put(SpoolKind.INFERENCE, "t/i", _payload(3))
    spool.put(SpoolKind.EVENT, "t/e", _payload(4))
    assert [json.loads(i.payload)["i"] for i in spool.peek(10)] == [1, 3, 4]
    spool.put(SpoolKind.EVENT, "t/e", _payload(5))
    assert [json.loads(i.payload)["i"] for i in spool.peek(10)] == [1, 4, 5]
    spool.put(SpoolKind.EVENT, "t/e", _payload(6))
    assert [json.loads(i.payload)["i"] for i in spool.peek(10)] == [4, 5, 6]


def test_events_alone_may_exceed_the_bound(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool.db", max_rows=2)
    for i in range(5):
        spool.put(SpoolKind.EVENT, "t/e", _payload(i))
    assert spool.rows == 5  # never dropped, even over the bound
    spool.put(SpoolKind.HEALTH, "t/h", _payload(9))
    assert spool.count(SpoolKind.HEALTH) == 0 and spool.count(SpoolKind.EVENT) == 5


def test_byte_bound_drops_oldest_health(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool.db", max_bytes=1000)
    for i in range(30):
        spool.put(SpoolKind.HEALTH, "t/h", _payload(i, size=97))  # 100 bytes with the topic
    assert spool.size_bytes <= 1000
    assert [json.loads(i.payload)["i"] for i in spool.peek(100)] == list(range(20, 30))


def test_reported_state_keeps_only_the_newest_unsent(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool.db")
    spool.put(SpoolKind.STATE, "t/reported", b'{"seq": 1}', retain=True)
    spool.put(SpoolKind.EVENT, "t/e", b"{}")
    spool.put(SpoolKind.STATE, "t/reported", b'{"seq": 2}', retain=True)
    spool.put(SpoolKind.STATE, "t/other", b'{"seq": 9}', retain=True)
    items = spool.peek(10)
    assert [(i.topic, i.payload) for i in items] == [
        ("t/e", b"{}"),
        ("t/reported", b'{"seq": 2}'),
        ("t/other", b'{"seq": 9}'),
    ]
    assert spool.rows == 3


def test_an_oversized_item_is_refused_and_nothing_written(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool.db", max_item_bytes=100)
    with pytest.raises(SpoolError, match="item limit"):
        spool.put(SpoolKind.EVENT, "t/e", b"x" * 200)
    assert spool.rows == 0


def test_a_corrupt_spool_file_is_moved_aside_and_a_new_one_started(tmp_path: Path) -> None:
    path = tmp_path / "spool.db"
    path.write_bytes(b"this is not an SQLite database" * 100)
    spool = Spool(path)
    spool.put(SpoolKind.EVENT, "t/e", b"{}")
    assert spool.rows == 1
    assert list(tmp_path.glob("spool.db.corrupt-*"))


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.sampled_from([SpoolKind.EVENT, SpoolKind.HEALTH, SpoolKind.INFERENCE]), max_size=60
    ),
    st.integers(min_value=1, max_value=12),
)
def test_property_events_are_never_lost_and_order_holds(
    tmp_path_factory: pytest.TempPathFactory, kinds: list[SpoolKind], bound: int
) -> None:
    spool = Spool(tmp_path_factory.mktemp("p") / "spool.db", max_rows=bound)
    for i, kind in enumerate(kinds):
        spool.put(kind, f"t/{kind.value}", _payload(i))
    items = spool.peek(1000)
    order = [json.loads(i.payload)["i"] for i in items]
    assert order == sorted(order)
    events = [i for i, k in enumerate(kinds) if k is SpoolKind.EVENT]
    assert [json.loads(i.payload)["i"] for i in items if i.kind is SpoolKind.EVENT] == events
    assert spool.rows == max(len(events), min(bound, len(kinds)))
    # Within each droppable kind, what is left is the newest ones.
    for kind in (SpoolKind.HEALTH, SpoolKind.INFERENCE):
        left = [json.loads(i.payload)["i"] for i in items if i.kind is kind]
        produced = [i for i, k in enumerate(kinds) if k is kind]
        assert left == produced[len(produced) - len(left) :]
    spool.close()
