"""Drift rules and their evaluation, with no I/O (docs/drift.md#rules).

A rule belongs to a model (``*``: the default for models without their own). The fleet's
reports of a version are summed per time bucket of ``window_s`` seconds (by receive time); a
bucket is **over** its rule when it holds at least ``min_samples`` samples from at least
``min_devices`` devices and its ``metric`` (the PSI of the summed counts) is above
``threshold``. A **retraining trigger** is raised when the newest ``sustained`` buckets, one
after the other with no gap, are all over, and no trigger of that model version was raised in
the last ``cooldown_s`` seconds: one trigger per cooldown, however long the drift lasts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

DEFAULT_MODEL = "*"
METRICS = ("score", "input_psi", "max_feature_psi", "class_psi", "confidence_psi")
"""What a rule may compare (the figures of :class:`shared.drift.DriftScores`)."""
MAX_THRESHOLD = 1000.0
MAX_DEVICES = 1_000_000
MAX_SAMPLES = 10**12
MAX_SUSTAINED = 100
MAX_COOLDOWN_S = 365 * 86_400
MIN_WINDOW_S, MAX_WINDOW_S = 10, 86_400


class RuleError(ValueError):
    """A rule setting out of its bounds."""


@dataclass(frozen=True)
class DriftRule:
    """When a model's drift raises a retraining trigger (see the module docstring)."""

    model: str = DEFAULT_MODEL
    threshold: float = 0.2
    metric: str = "input_psi"
    min_devices: int = 1
    min_samples: int = 100
    sustained: int = 2
    cooldown_s: int = 3600
    window_s: int = 300
    enabled: bool = True
    collect_hard_examples: bool = False

    def __post_init__(self) -> None:
        problem = self.problem()
        if problem is not None:
            raise RuleError(problem)

    def problem(self) -> str | None:
        """Why the settings cannot work (None: they can)."""
        if self.metric not in METRICS:
            return f"metric {self.metric!r} is not one of {', '.join(METRICS)}"
        checks: tuple[tuple[str, float, float, float], ...] = (
            ("min_devices", self.min_devices, 1, MAX_DEVICES),
            ("min_samples", self.min_samples, 1, MAX_SAMPLES),
            ("sustained", self.sustained, 1, MAX_SUSTAINED),
            ("cooldown_s", self.cooldown_s, 0, MAX_COOLDOWN_S),
            ("window_s", self.window_s, MIN_WINDOW_S, MAX_WINDOW_S),
        )
        for name, value, lo, hi in checks:
            if not lo <= value <= hi:
                return f"{name} must be between {lo:g} and {hi:g}, not {value:g}"
        if not (math.isfinite(self.threshold) and 0 < self.threshold <= MAX_THRESHOLD):
            return f"threshold must be above 0 and at most {MAX_THRESHOLD:g}"
        return None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def bucket_over(self, figures: Mapping[str, Any], samples: int, devices: int) -> bool:
        """Whether one bucket with these figures, samples and devices is over the rule."""
        value = figures.get(self.metric)
        return (
            samples >= self.min_samples
            and devices >= self.min_devices
            and isinstance(value, (int, float))
            and value > self.threshold
        )


@dataclass(frozen=True)
class Bucket:
    """What rule evaluation reads of one aggregate bucket."""

    start: float
    """Unix seconds of the bucket's start."""
    over: bool


def sustained_over(rule: DriftRule, newest_first: Sequence[Bucket], current: float) -> bool:
    """Whether the ``rule.sustained`` buckets ending with the one starting at ``current`` exist,
    follow each other with no gap, and are all over (``newest_first``: the newest buckets of
    the version at this bucket size, newest first)."""
    wanted = [current - i * rule.window_s for i in range(rule.sustained)]
    have = {round(b.start): b.over for b in newest_first}
    return all(have.get(round(start)) for start in wanted)


def cooled_down(rule: DriftRule, last_raised: float | None, now: float) -> bool:
    """Whether a new trigger may be raised: none yet, or the last is ``cooldown_s`` old."""
    return last_raised is None or now - last_raised >= rule.cooldown_s


def bucket_start(received_at: float, window_s: int) -> float:
    """The start of the bucket ``received_at`` (Unix seconds) falls in."""
    return math.floor(received_at / window_s) * float(window_s)
