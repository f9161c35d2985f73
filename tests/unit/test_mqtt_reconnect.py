"""``shared.mqtt.reconnect``: the one reconnect policy every MQTT session uses."""

from __future__ import annotations

import random

import pytest

from mcp_edge.shared.mqtt import Backoff, ReconnectPolicy


def test_backoff_is_exponential_with_full_jitter_and_resets() -> None:
    b = Backoff(ReconnectPolicy(first_delay_s=0.5, max_delay_s=8.0), rng=random.Random(7))
    delays = [b.next_delay() for _ in range(8)]
    ceilings = [0.5, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0, 8.0]
    assert all(0 <= d <= c for d, c in zip(delays, ceilings, strict=True))
    assert len(set(delays)) == len(delays)  # jittered, not a fixed schedule
    assert min(delays[4:]) < 4.0  # full jitter: well below the ceiling happens
    b.reset()
    assert b.next_delay() <= 0.5


def test_partial_jitter_keeps_at_least_that_share_of_the_ceiling() -> None:
    # The control plane's sessions: 1 s doubling to 30 s, at least half of each ceiling.
    b = Backoff(
        ReconnectPolicy(first_delay_s=1.0, max_delay_s=30.0, jitter=0.5), rng=random.Random(1)
    )
    delays = [b.next_delay() for _ in range(200)]
    ceilings = [min(30.0, 2.0**n) for n in range(200)]
    assert all(c / 2 <= d <= c for d, c in zip(delays, ceilings, strict=True))
    assert b.attempt == 200


def test_no_jitter_is_a_fixed_schedule() -> None:
    b = Backoff(ReconnectPolicy(first_delay_s=0.25, max_delay_s=1.0, multiplier=3, jitter=0))
    assert [b.next_delay() for _ in range(4)] == [0.25, 0.75, 1.0, 1.0]


@pytest.mark.parametrize("kwargs", [
    {"first_delay_s": 0}, {"first_delay_s": 5, "max_delay_s": 1}, {"jitter": 1.5},
    {"multiplier": 0.5}, {"stable_after_s": -1},
])  # fmt: skip
def test_an_unusable_policy_is_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        ReconnectPolicy(**kwargs)
