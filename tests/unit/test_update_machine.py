"""The update state machine's table and its persisted record and index (pure; no I/O)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mcp_edge.agent.update.machine import (
    TERMINAL,
    TRANSITIONS,
    WORKING,
    Cause,
    Phase,
    TransitionError,
    Trigger,
    advance,
    new_record,
    next_phase,
)
from mcp_edge.agent.update.records import ModelIndex, UpdateRecord

SHA = "ab" * 32


def record(now: float = 100.0) -> UpdateRecord:
    return new_record(model="digits", role="stable", from_version="1.0.0", to_version="1.1.0",
                      target_path="digits/1.1.0/digits-1.1.0.mcpb", sha256=SHA, length=2048,
                      desired_seq=3, now=now)  # fmt: skip


def test_every_state_has_an_exit_and_every_working_state_can_fail() -> None:
    sources = {phase for phase, _ in TRANSITIONS}
    assert sources == set(Phase)
    for phase in WORKING:
        assert next_phase(phase, Trigger.FAIL) is Phase.ROLLING_BACK
    assert next_phase(Phase.ROLLING_BACK, Trigger.ROLLED_BACK) is Phase.FAILED
    for phase in TERMINAL:
        assert next_phase(phase, Trigger.START) is Phase.DOWNLOADING


def test_the_happy_path_goes_through_every_phase_in_order() -> None:
    rec = record()
    seen = [rec.phase]
    for i, trig in enumerate([Trigger.DOWNLOADED, Trigger.VERIFIED, Trigger.INSTALLED,
                              Trigger.LOADED, Trigger.WARMED]):  # fmt: skip
        rec = advance(rec, trig, now=101.0 + i)
        seen.append(rec.phase)
    assert seen == [Phase.DOWNLOADING, Phase.VERIFYING, Phase.INSTALLING, Phase.LOADING,
                    Phase.WARMING, Phase.ACTIVE]  # fmt: skip
    assert rec.timings_ms["downloading"] == pytest.approx(1000.0)
    assert set(rec.timings_ms) == {p.value for p in WORKING}


def test_transient_errors_retry_in_downloading_and_fatal_ones_roll_back() -> None:
    rec = advance(record(), Trigger.RETRY, now=101.0, cause=Cause.TRANSPORT, error="lost")
    assert (rec.phase, rec.attempts, rec.cause) == (Phase.DOWNLOADING, 2, Cause.TRANSPORT)
    assert Cause.TRANSPORT.transient and not Cause.HASH_MISMATCH.transient
    rec = advance(rec, Trigger.DOWNLOADED, now=102.0)
    with pytest.raises(TransitionError):
        advance(rec, Trigger.RETRY, now=103.0)  # only downloading retries
    failed = advance(rec, Trigger.FAIL, now=103.0, cause=Cause.PUBLISHER, error="unknown key")
    assert (failed.phase, failed.failed_phase, failed.cause) == (
        Phase.ROLLING_BACK, Phase.VERIFYING, Cause.PUBLISHER)  # fmt: skip
    done = advance(failed, Trigger.ROLLED_BACK, now=104.0)
    assert (done.phase, done.cause, done.error) == (Phase.FAILED, Cause.PUBLISHER, "unknown key")
    again = advance(done, Trigger.START, now=105.0)
    assert (again.phase, again.cause, again.attempts, again.timings_ms) == (
        Phase.DOWNLOADING, None, 1, {})  # fmt: skip


@given(st.lists(st.sampled_from(list(Trigger)), max_size=40))
def test_any_trigger_sequence_follows_the_table_or_is_refused(triggers: list[Trigger]) -> None:
    rec = record()
    for i, trig in enumerate(triggers):
        expected = TRANSITIONS.get((rec.phase, trig))
        if expected is None:
            with pytest.raises(TransitionError):
                advance(rec, trig, now=200.0 + i)
            continue
        after = advance(rec, trig, now=200.0 + i, cause=Cause.INTERNAL, error="x")
        assert after.phase is expected
        assert after.updated_at == 200.0 + i
        if expected is Phase.ROLLING_BACK:
            assert after.failed_phase in WORKING and after.cause is not None
        rec = after
    assert UpdateRecord.from_bytes(rec.to_bytes()) == rec


def test_a_damaged_record_is_refused() -> None:
    with pytest.raises(ValueError):
        UpdateRecord.from_bytes(b'{"model": "digits"}')
    with pytest.raises(ValueError):
        UpdateRecord.from_bytes(b" " * (UpdateRecord.MAX_BYTES + 1))


def prefetch_record(now: float = 100.0) -> UpdateRecord:
    return new_record(model="digits", role="prefetch", from_version="1.0.0",
                      to_version="1.1.0", target_path="digits/1.1.0/digits-1.1.0.mcpb",
                      sha256=SHA, length=2048, desired_seq=4, now=now)  # fmt: skip


def test_a_prefetch_is_verified_and_installed_then_rests_without_loading() -> None:
    rec = prefetch_record()
    seen = [rec.phase]
    for i, trig in enumerate([Trigger.DOWNLOADED, Trigger.VERIFIED, Trigger.STORED]):
        rec = advance(rec, trig, now=101.0 + i)
        seen.append(rec.phase)
    assert seen == [Phase.DOWNLOADING, Phase.VERIFYING, Phase.INSTALLING, Phase.IDLE]
    assert rec.terminal and not rec.interrupted
    assert set(rec.timings_ms) == {"downloading", "verifying", "installing"}
    assert UpdateRecord.from_bytes(rec.to_bytes()) == rec
    # Only installing stores: a prefetch cannot skip verification, nor be stored once loading.
    for phase in set(Phase) - {Phase.INSTALLING}:
        with pytest.raises(TransitionError):
            next_phase(phase, Trigger.STORED)
    # A failed prefetch rolls back like any deployment, and the next one starts afresh.
    failed = advance(advance(prefetch_record(), Trigger.FAIL, now=101.0, cause=Cause.TRANSPORT,
                             error="gone"), Trigger.ROLLED_BACK, now=102.0)  # fmt: skip
    assert (failed.phase, failed.failed_phase, failed.cause) == (
        Phase.FAILED, Phase.DOWNLOADING, Cause.TRANSPORT)  # fmt: skip
    assert advance(rec, Trigger.START, now=103.0).phase is Phase.DOWNLOADING


def test_roles_are_stable_canary_shadow_or_prefetch() -> None:
    doc = json.loads(prefetch_record().to_bytes())
    assert UpdateRecord.from_bytes(json.dumps(doc).encode()).role == "prefetch"
    with pytest.raises(ValueError):
        UpdateRecord.from_bytes(json.dumps({**doc, "role": "preload"}).encode())


def test_the_index_keeps_its_prefetch_on_disk_and_in_a_file_older_agents_read() -> None:
    index = ModelIndex(name="digits", active="1.0.0", previous="0.9.0", prefetch="1.1.0")
    assert index.referenced() == {"1.0.0", "0.9.0", "1.1.0"}
    assert ModelIndex.model_validate_json(index.to_bytes()) == index
    # Without a prefetch the file holds exactly the fields of an agent that predates it (its
    # index refuses unknown fields).
    plain = json.loads(ModelIndex(name="digits", active="1.0.0").to_bytes())
    assert set(plain) == {"name", "active", "previous", "canary", "shadow", "release_counter"}
