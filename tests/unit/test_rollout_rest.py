"""The rollout loop's rest between rounds (:func:`controlplane.rollouts.service.round_rest`):
twice the round, at least the interval, and never so long that this replica's leases run out
while it is alive (another replica would take its rollouts over) or a finished rollout waits
long to be marked so."""

from __future__ import annotations

import pytest

from mcp_edge.controlplane.rollouts.service import round_rest


@pytest.mark.parametrize(
    ("took_s", "expected"),
    [(0.01, 1.0), (0.4, 1.0), (2.0, 4.0), (8.0, 5.0), (60.0, 5.0)],
)
def test_the_rest_is_twice_the_round_within_the_interval_and_a_third_of_the_lease(
    took_s: float, expected: float
) -> None:
    assert round_rest(took_s, interval_s=1.0, lease_s=15.0) == pytest.approx(expected)


def test_a_long_round_never_rests_past_the_lease() -> None:
    for lease_s in (2.0, 3.0, 15.0, 3600.0):
        for took_s in (0.0, 1.0, lease_s, 10 * lease_s):
            assert round_rest(took_s, interval_s=0.5, lease_s=lease_s) < lease_s
