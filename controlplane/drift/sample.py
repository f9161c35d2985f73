"""A device's drift report as the control plane keeps it in memory, and its decoder.

:func:`decode_drift` turns the payload of a ``telemetry/drift`` message into a
:class:`DriftSample`: the report's fields with the feature counts as one numpy matrix instead
of hundreds of small objects. What it accepts is exactly what
:class:`~shared.protocol.telemetry.DriftReport` accepts, with the same values: the envelope
(every field but ``features``) goes through the schema itself, and the features are checked
on a fast path that only ever takes the canonical form (a list of objects with a 1-128
character ``name``, ``counts`` as JSON integers, and ``psi``/``ks`` as JSON numbers within
their bounds, all features with the same number of bins). Anything else, and every refusal,
goes through the full schema, which gives the error message. The fast path costs about a
third of the schema's: 10,000 reports of 64 features decode in well under a second.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson
from pydantic import ValidationError

from mcp_edge.shared.errors import MessageError
from mcp_edge.shared.protocol.codec import loads, validate
from mcp_edge.shared.protocol.telemetry import DriftReport

IntMatrix = npt.NDArray[np.int64]

_FEATURE_KEYS = frozenset({"name", "counts", "psi", "ks"})
_MAX_FEATURES = 512
_MAX_BINS = 256
_MAX_NAME = 128


@dataclass(frozen=True, eq=False)
class DriftSample:
    """One valid drift report (see :class:`~shared.protocol.telemetry.DriftReport`).

    ``names[i]`` is the feature whose counts are ``matrix[i]`` when all features have the same
    number of bins (the form every baseline uses; None otherwise). ``features_json`` is the
    features as the database stores them, ``{name: counts}`` as JSON (kept as bytes: a batch of
    10,000 reports holds no million small Python objects for the garbage collector to walk).
    ``received_at`` is when the control plane took it (Unix seconds).
    """

    device_id: str
    model: str
    version: str
    role: str
    window_start: float
    window_end: float
    samples: int
    sample_every: int
    names: tuple[str, ...]
    features_json: bytes
    matrix: IntMatrix | None
    class_counts: IntMatrix
    confidence_counts: IntMatrix
    hard_examples: int
    received_at: float

    def feature_counts(self) -> dict[str, list[int]]:
        """``{name: counts}`` as plain lists."""
        counts: dict[str, list[int]] = orjson.loads(self.features_json)
        return counts

    def counts_document(self) -> dict[str, Any]:
        """The ``counts`` column of a stored report (its features already serialized)."""
        return {
            "features": orjson.Fragment(self.features_json),
            "classes": self.class_counts.tolist(),
            "confidence": self.confidence_counts.tolist(),
        }

    def feature(self, i: int) -> IntMatrix:
        if self.matrix is not None:
            row: IntMatrix = self.matrix[i]
            return row
        return _ints(self.feature_counts()[self.names[i]])


def _ints(values: Sequence[int]) -> IntMatrix:
    return np.asarray(values, dtype=np.int64).reshape(-1)


def from_report(report: DriftReport, received_at: float) -> DriftSample:
    """A sample of a report the schema validated.

    Raises :class:`MessageError` for counts beyond 64 bits (the schema sets no upper bound).
    """
    rows = [list(f.counts) for f in report.features]
    try:
        uniform = len({len(r) for r in rows}) == 1
        matrix = np.asarray(rows, dtype=np.int64) if uniform else None
        if not uniform:
            for r in rows:
                _ints(r)
        classes, confidence = _ints(report.class_counts), _ints(report.confidence_counts)
    except OverflowError as e:
        raise MessageError("DriftReport: a count does not fit in 64 bits") from e
    return DriftSample(
        device_id=report.device_id,
        model=report.model,
        version=report.version,
        role=report.role.value,
        window_start=report.window_start,
        window_end=report.window_end,
        samples=report.samples,
        sample_every=report.sample_every,
        names=tuple(f.name for f in report.features),
        features_json=orjson.dumps({f.name: list(f.counts) for f in report.features}),
        matrix=matrix,
        class_counts=classes,
        confidence_counts=confidence,
        hard_examples=report.hard_examples,
        received_at=received_at,
    )


def _scores_ok(values: list[Any], upper: float) -> bool:
    """Whether every value is None or a float in ``[0, upper]`` (below inf: finite), checked
    in C-level passes."""
    kinds = set(map(type, values))
    if not kinds <= {float, type(None)}:
        return False
    present = [v for v in values if v is not None] if type(None) in kinds else values
    return not present or (
        min(present) >= 0.0 and max(present) <= upper and max(present) < math.inf
    )


_BOOLEANS = (b"[true", b",true", b"[false", b",false")
_KNOWN_NAMES: dict[tuple[Any, ...], tuple[str, ...]] = {}
_NAME = operator.itemgetter("name")
_PSI = operator.methodcaller("get", "psi")
_KS = operator.methodcaller("get", "ks")
_COUNTS = operator.itemgetter("counts")


def _checked_names(names: tuple[Any, ...]) -> tuple[str, ...] | None:
    """``names`` if they are distinct 1-128 character strings (the last few name lists seen
    are remembered: a fleet sends the same ones in every report)."""
    known = _KNOWN_NAMES.get(names)
    if known is not None:
        return known
    if set(map(type, names)) != {str} or len(set(names)) != len(names):
        return None
    lengths = set(map(len, names))
    if min(lengths) < 1 or max(lengths) > _MAX_NAME:
        return None
    if len(_KNOWN_NAMES) >= 64:
        _KNOWN_NAMES.clear()
    _KNOWN_NAMES[names] = names
    return names


def _fast_features(
    features: object, samples: int
) -> tuple[tuple[str, ...], bytes, IntMatrix] | None:
    """The names and counts matrix of canonical, valid features; None to ask the schema.

    Every check runs as one C-level pass over the features (``map``), not a Python loop.
    """
    if type(features) is not list or len(features) > _MAX_FEATURES:
        return None
    if not features:
        return (), b"{}", np.zeros((0, 0), dtype=np.int64)
    if set(map(type, features)) != {dict} or not set().union(*features) <= _FEATURE_KEYS:
        return None
    try:
        names = _checked_names(tuple(map(_NAME, features)))
        rows = list(map(_COUNTS, features))
    except (KeyError, TypeError):  # a missing key; an unhashable name
        return None
    if names is None:
        return None
    if set(map(type, rows)) != {list}:
        return None
    widths = set(map(len, rows))
    if len(widths) != 1 or not 1 <= widths.pop() <= _MAX_BINS:
        return None
    try:
        matrix = np.array(rows)
    except (ValueError, TypeError, OverflowError):
        return None
    if matrix.dtype != np.int64 or matrix.ndim != 2:
        return None  # floats, strings, booleans only, integers beyond 64 bits, nested lists
    text = orjson.dumps(dict(zip(names, rows, strict=True)))
    if any(marker in text for marker in _BOOLEANS):
        return None  # a boolean among the integers (the schema reads it as 0 or 1)
    if int(matrix.min()) < 0 or not bool((matrix.sum(axis=1) == samples).all()):
        return None
    if max(map(len, features)) > 2 and not (
        _scores_ok(list(map(_PSI, features)), math.inf)
        and _scores_ok(list(map(_KS, features)), 1.0)
    ):
        return None
    return names, text, matrix


def _fast(obj: Any, device_id: str, received_at: float) -> DriftSample | None:
    if type(obj) is not dict:
        return None
    envelope: Mapping[str, Any] = {k: v for k, v in obj.items() if k != "features"}
    try:
        head = DriftReport.model_validate(envelope)
    except ValidationError:
        return None
    if head.device_id != device_id:
        return None
    features = _fast_features(obj.get("features", []), head.samples)
    if features is None:
        return None
    names, text, matrix = features
    return DriftSample(
        device_id=head.device_id,
        model=head.model,
        version=head.version,
        role=head.role.value,
        window_start=head.window_start,
        window_end=head.window_end,
        samples=head.samples,
        sample_every=head.sample_every,
        names=names,
        features_json=text,
        matrix=matrix if names else None,
        class_counts=_ints(head.class_counts),
        confidence_counts=_ints(head.confidence_counts),
        hard_examples=head.hard_examples,
        received_at=received_at,
    )


def decode_drift(payload: bytes, device_id: str, received_at: float) -> DriftSample:
    """The sample in ``payload``, sent on ``device_id``'s drift topic.

    Raises :class:`MessageError` like :func:`shared.protocol.codec.decode_for_parsed` would:
    too large or not JSON (caused by ``orjson.JSONDecodeError``), a schema error (caused by
    ``ValidationError``), or a payload that claims another device.
    """
    obj = loads(payload, max_bytes=DriftReport.MAX_BYTES)
    sample = _fast(obj, device_id, received_at)
    if sample is not None:
        return sample
    report = validate(obj, DriftReport)
    if report.device_id != device_id:
        raise MessageError(
            f"payload claims device {report.device_id!r} on device {device_id!r}'s topic"
        )
    return from_report(report, received_at)
