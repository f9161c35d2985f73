"""The canary policy: how a device serves a candidate version beside stable, and when it stops.

One value, :class:`CanaryPolicy`, with its defaults written here and nowhere else. The control
plane stores it per deployment and per device model and puts it in each desired state's
``canary`` (:class:`~shared.protocol.state.CanarySpec`); the agent's update machine records it
and its model manager routes and judges the canary by it; ``mcp-agent serve`` and the REST API
take their defaults from :data:`DEFAULT_CANARY_POLICY`.

No pydantic here on purpose: the agent's serving path (model manager, ``mcp-agent serve``)
needs the policy and must not load pydantic (see :mod:`shared.protocol.wire`). Pydantic models
that hold a policy validate it through :meth:`CanaryPolicy.__post_init__`, which pydantic runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

MAX_CANARY_WINDOW = 10_000
"""The largest sliding window (canary results kept per model) a policy may ask for."""


@dataclass(frozen=True)
class CanaryPolicy:
    """How a device serves and judges a canary.

    The device sends ``weight`` of the requests that do not pin a version to the canary (split by
    a hash of the request key, or at random), and keeps the outcome (answered or failed) of the
    canary's last ``window`` requests. Once that window holds at least ``min_requests`` outcomes
    and the share of failures in it is above ``max_error_rate``, the device takes the canary out
    of rotation: stable answers everything until another canary version is deployed (or the
    agent restarts and judges it afresh).

    Raises ValueError when a field is out of range (shares outside 0..1, counts outside
    1..:data:`MAX_CANARY_WINDOW`, or ``min_requests`` above ``window``).
    """

    weight: float = 0.1
    """Share of routed requests the canary answers, 0..1."""
    max_error_rate: float = 0.05
    """Share of failed requests in the window above which the canary is taken out, 0..1."""
    min_requests: int = 20
    """Canary requests the window must hold before its error rate is judged (1..window)."""
    window: int = 100
    """How many of the canary's latest requests the error rate is computed over (requests)."""

    def __post_init__(self) -> None:
        for name in ("weight", "max_error_rate"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"canary {name} must be a number from 0 to 1, not {value!r:.40}")
            if math.isnan(value) or not 0.0 <= value <= 1.0:
                raise ValueError(f"canary {name} {value} is outside 0..1")
            object.__setattr__(self, name, float(value))
        for name in ("min_requests", "window"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"canary {name} must be a whole number, not {value!r:.40}")
            if not 1 <= value <= MAX_CANARY_WINDOW:
                raise ValueError(f"canary {name} {value} is outside 1..{MAX_CANARY_WINDOW}")
        if self.min_requests > self.window:
            raise ValueError(
                f"canary min_requests {self.min_requests} is above its window of {self.window} "
                "requests: the error rate would never be judged"
            )

    def as_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready ``{name: value}`` mapping."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


DEFAULT_CANARY_POLICY = CanaryPolicy()
"""The policy a canary gets for every field nobody set."""

CANARY_POLICY_FIELDS = tuple(f.name for f in fields(CanaryPolicy))
"""``weight``, ``max_error_rate``, ``min_requests``, ``window``."""
