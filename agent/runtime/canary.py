"""One model's candidate version on the device: which requests a canary takes and when it is
taken out, and whether a shadow's answer agrees with stable's.

A :class:`CanaryState` applies a :class:`~shared.protocol.canary.CanaryPolicy` (from the
desired state, or ``mcp-agent serve``'s flags): it takes ``weight`` of the routed requests and
keeps whether each of its latest ``window`` requests failed; once at least ``min_requests`` are
kept and the failed share is above ``max_error_rate``, it leaves rotation (a new canary version,
or the canary loaded again after a restart, starts a new state).

:func:`answers_agree` is the test a shadow's answer passes to count as agreeing with the
answer stable gave to the same request (the ``shadow_agreed`` of its inference statistics).

Pure: the model manager calls both, on every routed request and on every shadow answer.
"""

from __future__ import annotations

import collections
import hashlib
import random
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from mcp_edge.agent.runtime.runner import Array
from mcp_edge.shared.protocol.canary import CanaryPolicy

SHADOW_RTOL = 1e-3
SHADOW_ATOL = 1e-5
"""How close float outputs that are not score vectors must be to agree (``np.allclose``)."""


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


def answers_agree(stable: Mapping[str, Array], shadow: Mapping[str, Array]) -> bool:
    """Whether a shadow's outputs agree with stable's for the same request.

    Every output both answers hold must agree (none in common: they disagree), and with the
    same shape: float outputs of rank 2 or more with more than one value on the last axis are
    score vectors (a classifier's), agreeing when the top class (argmax along the last axis) is
    the same everywhere; other float outputs agree when ``np.allclose`` with
    :data:`SHADOW_RTOL` and :data:`SHADOW_ATOL` holds (NaN agrees with nothing); integer,
    boolean and string (label) outputs agree when equal.
    """
    common = stable.keys() & shadow.keys()
    if not common:
        return False
    for name in common:
        a, b = np.asarray(stable[name]), np.asarray(shadow[name])
        if a.shape != b.shape:
            return False
        if a.dtype.kind == "f" and b.dtype.kind == "f":
            if a.ndim >= 2 and a.shape[-1] > 1:
                if not np.array_equal(a.argmax(axis=-1), b.argmax(axis=-1)):
                    return False
            elif not np.allclose(a, b, rtol=SHADOW_RTOL, atol=SHADOW_ATOL, equal_nan=False):
                return False
        elif not np.array_equal(a, b):
            return False
    return True
