"""Histograms and counters for the request hot path, cheaper than prometheus_client's own.

prometheus_client's ``Histogram.observe`` takes a lock and costs ~2 µs; four of them per
request were a measurable share of the agent's latency (bench/local_inference.py). These are
updated only from the event loop thread, so they need no lock: an observation is a bisect and
two additions. They are exported through a custom collector in the same registry, in the same
text format as any other family.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector


class _HistogramChild:
    __slots__ = ("_bounds", "counts", "total")

    def __init__(self, bounds: Sequence[float]) -> None:
        self._bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self._bounds, value)] += 1
        self.total += value


class _CounterChild:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


class _GaugeChild(_CounterChild):
    __slots__ = ()

    def dec(self, amount: float = 1.0) -> None:
        self.value -= amount

    def set(self, value: float) -> None:
        self.value = value


class LoopHistogram(Collector):
    """A labelled histogram family mutated only on the event loop thread."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        buckets: Sequence[float],
        registry: CollectorRegistry,
    ) -> None:
        self.name, self.documentation = name, documentation
        self.labelnames = tuple(labelnames)
        self.buckets = tuple(float(b) for b in buckets)
        self._children: dict[tuple[str, ...], _HistogramChild] = {}
        registry.register(self)

    def labels(self, *values: str) -> _HistogramChild:
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name} takes labels {self.labelnames}")
            child = self._children[values] = _HistogramChild(self.buckets)
        return child

    def remove(self, *values: str) -> None:
        self._children.pop(values, None)

    def collect(self) -> Iterator[Any]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in list(self._children.items()):
            cumulative, running = [], 0
            for bound, count in zip((*self.buckets, float("inf")), child.counts, strict=True):
                running += count
                cumulative.append((_le(bound), running))
            family.add_metric(list(values), cumulative, child.total)
        yield family

    def describe(self) -> Iterator[Any]:
        yield HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)


class LoopCounter(Collector):
    """A labelled counter family mutated only on the event loop thread."""

    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str], registry: CollectorRegistry
    ) -> None:
        self.name = name.removesuffix("_total")
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], _CounterChild] = {}
        registry.register(self)

    def labels(self, *values: str) -> _CounterChild:
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name} takes labels {self.labelnames}")
            child = self._children[values] = _CounterChild()
        return child

    def collect(self) -> Iterator[Any]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in list(self._children.items()):
            family.add_metric(list(values), child.value)
        yield family

    def describe(self) -> Iterator[Any]:
        yield CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)


class LoopGauge(Collector):
    """A gauge family mutated only on the event loop thread; unlabelled ones take inc/dec/set."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        *,
        registry: CollectorRegistry,
    ) -> None:
        self.name, self.documentation = name, documentation
        self.labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], _GaugeChild] = {}
        self._own = _GaugeChild()
        if not self.labelnames:
            self._children[()] = self._own
        registry.register(self)

    def labels(self, *values: str) -> _GaugeChild:
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name} takes labels {self.labelnames}")
            child = self._children[values] = _GaugeChild()
        return child

    def remove(self, *values: str) -> None:
        if values:
            self._children.pop(values, None)

    def inc(self, amount: float = 1.0) -> None:
        self._own.value += amount

    def dec(self, amount: float = 1.0) -> None:
        self._own.value -= amount

    def set(self, value: float) -> None:
        self._own.value = value

    def collect(self) -> Iterator[Any]:
        family = GaugeMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in list(self._children.items()):
            family.add_metric(list(values), child.value)
        yield family

    def describe(self) -> Iterator[Any]:
        yield GaugeMetricFamily(self.name, self.documentation, labels=self.labelnames)


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)
