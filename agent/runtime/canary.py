"""One model's canary on the device: which requests it takes, and when it is taken out.

A :class:`CanaryState` applies a :class:`~shared.protocol.canary.CanaryPolicy` (from the
desired state, or ``mcp-agent serve``'s flags): it takes ``weight`` of the routed requests and
keeps whether each of its latest ``window`` requests failed; once at least ``min_requests`` are
kept and the failed share is above ``max_error_rate``, it leaves rotation (a new canary version,
or the canary loaded again after a restart, starts a new state). Pure: the model manager calls
it on every routed request.
"""

from __future__ import annotations

import collections
import hashlib
import random
from dataclasses import dataclass, field

from mcp_edge.shared.protocol.canary import CanaryPolicy


@dataclass
class CanaryState:
    """A canary version in rotation (``enabled``) or out of it, with its latest results."""

    version: str
    policy: CanaryPolicy
    enabled: bool = True
    results: collections.deque[bool] = field(default_factory=collections.deque)
    """Whether each of the canary's latest requests failed (at most ``policy.window``)."""

    @property
    def weight(self) -> float:
        return self.policy.weight

    @property
    def error_rate(self) -> float:
        """The failed share of the kept results, 0..1 (0 with none)."""
        return sum(self.results) / len(self.results) if self.results else 0.0

    def takes(self, request_key: str | None) -> bool:
        """Whether the canary answers a routed request: the same ``request_key`` always gets
        the same answer (sticky); without one the split is random."""
        if not self.enabled or self.policy.weight <= 0:
            return False
        if request_key:
            digest = hashlib.blake2b(request_key.encode(), digest_size=8).digest()
            share = int.from_bytes(digest, "big") / 2**64
        else:
            share = random.random()
        return share < self.policy.weight

    def record(self, failed: bool) -> bool:
        """Add one result; return True when this result takes the canary out of rotation."""
        self.results.append(failed)
        while len(self.results) > self.policy.window:
            self.results.popleft()
        tripped = (
            self.enabled
            and len(self.results) >= self.policy.min_requests
            and self.error_rate > self.policy.max_error_rate
        )
        if tripped:
            self.enabled = False
        return tripped
