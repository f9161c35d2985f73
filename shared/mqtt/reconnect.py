"""When to try again after a connection failed or dropped: one policy for every MQTT session.

:class:`ReconnectPolicy` is the configuration (frozen, built once by whoever wires the
session); :class:`Backoff` is one session's running count of attempts under it. The delay
before attempt ``n`` (0 after a reset) is drawn from ``[c·(1 - jitter), c]`` with the ceiling
``c = min(max_delay_s, first_delay_s · multiplierⁿ)``: ``jitter`` 1 is "full jitter" (AWS's
name: uniform in ``[0, c]``, spreads a fleet reconnecting after a broker restart), 0.5 keeps
at least half the ceiling, 0 is a fixed schedule.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class ReconnectPolicy:
    """Exponential backoff with jitter (seconds). Raises ValueError for unusable values."""

    first_delay_s: float = 0.5
    """Ceiling of the first wait."""
    max_delay_s: float = 60.0
    """Largest ceiling."""
    multiplier: float = 2.0
    jitter: float = 1.0
    """Fraction of the ceiling drawn at random (0 to 1; see the module docstring)."""
    stable_after_s: float = 30.0
    """A connection that stayed up this long resets the count (0: any successful connect)."""

    def __post_init__(self) -> None:
        if not 0 < self.first_delay_s <= self.max_delay_s:
            raise ValueError("need 0 < first_delay_s <= max_delay_s")
        if self.multiplier < 1 or not 0 <= self.jitter <= 1 or self.stable_after_s < 0:
            raise ValueError("need multiplier >= 1, jitter in [0, 1] and stable_after_s >= 0")


class Backoff:
    """The attempts of one session under a :class:`ReconnectPolicy`.

    ``rng`` is injectable so tests see the delays; :meth:`reset` after a stable connection.
    """

    def __init__(self, policy: ReconnectPolicy | None = None, rng: random.Random | None = None):
        self.policy = policy or ReconnectPolicy()
        self.rng = rng or random.Random()
        self.attempt = 0
        """Attempts since the last reset."""

    def ceiling(self, attempt: int | None = None) -> float:
        """The largest delay before attempt ``attempt`` (default: the next one), seconds."""
        p = self.policy
        n = self.attempt if attempt is None else attempt
        return float(min(p.max_delay_s, p.first_delay_s * p.multiplier ** min(n, 64)))

    def next_delay(self) -> float:
        """The delay before the next attempt (seconds); advances the attempt counter."""
        top = self.ceiling()
        delay = self.rng.uniform(top * (1.0 - self.policy.jitter), top)
        self.attempt += 1
        return delay

    def reset(self) -> None:
        self.attempt = 0
