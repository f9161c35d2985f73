"""Choosing by measurement: of the variants and backends that fit this device, keep the fastest
one whose answers pass the checks.

A model version may offer several files (an FP32 ``default``, an ``int8`` copy...) and the
device may have several backends that run them (onnxruntime's CPU provider, the OpenVINO
runtime, TFLite...). When the hardware profile turns ``runtime.selection.measure`` on,
:func:`select` opens each :class:`Candidate`, checks its answers, times it, and returns a
:class:`Selection` naming the one to serve with and every :class:`Trial`.

The rules, in the order they apply:

1. **Order.** Candidates are tried in the order given, which is also the order of preference:
   callers put the non-quantized ``default`` variant on the profile's first backend first.
   Only the first ``max_candidates`` are tried; the rest are "not tried".
2. **Budget.** The whole selection aims to end within ``budget_s``. The first candidate is
   always opened; a later one is not started when the time the earlier ones took to open
   (their mean) no longer fits in the first half of the budget, so the second half stays for
   timing. Timing is split in rounds sized from the warm-up's run times, so even a slow model
   overshoots the budget by about one run, not by a fixed count of runs.
3. **Checks.** A quantized candidate whose manifest figure (``top1_agreement``, measured on
   real samples when the bundle was built) is under 90 % fails without being opened. Each
   candidate is loaded with :func:`~agent.runtime.loader.load_runner`
   (``backend=candidate.backend``); it must really run on that backend (a provider that fell
   back to the CPU is a failure, not a duplicate of the CPU candidate), pass
   :func:`~agent.runtime.checks.warm_up` (output names, shapes, dtypes, no NaN or infinity),
   and answer like the **reference**: the first passing candidate that is not quantized (the
   first passing one when all are). The comparison runs the same inputs through both: the
   caller's ``samples`` when given, else :func:`~agent.runtime.checks.synthetic_inputs`
   (deterministic uniform noise), 32 rows when the model is batchable:

   * a classifier output (float, ``[N, C]`` with C > 1) must give the same arg-max on at least
     97 % of the rows (a near tie counts as the same: the reference's class scoring within
     1 % of the output's scale of the candidate's top score, as bf16 or a fused kernel may
     break a tie either way), or, for a quantized candidate, on at least its manifest's
     ``top1_agreement`` minus 0.05 (these rows are not the build's samples), 90 % when no
     figure is known;
   * any other output must be close: ``|a - b| <= atol + rtol * |ref|`` with rtol 1e-2 and
     atol 1e-2 of the reference's largest magnitude (backends may compute in bf16 or fuse
     ops), or, quantized, an atol of 10 % of that magnitude.

   Noise is a weak test of a quantized model (its activation ranges were calibrated on real
   inputs: a broken INT8 convnet may agree with its reference on noise and not on digits, or
   the other way round), which is why the manifest's figure is checked too.
   A candidate that fails any step is a failed :class:`Trial` with the reason; its runner is
   closed before the timing starts.
4. **Timing.** The candidates that passed are timed in interleaved rounds, at most
   :data:`TIMING_CAP_S` each in all. A survey (a third of that time) gives every candidate a
   slice of batch-32 and of batch-1 calls in each round, the starting one rotating; then a
   race between the candidates within 25 % of the fastest alternates short slices of the
   batch the choice is made on, so close calls get most of the measurements; a racer the
   leader beats in 90 % of the race rounds by over 10 % drops out, and the race ends when
   one is left. ``p50_us`` is
   the median batch-1 run and ``rps`` the rows per second of the median batch-32 run (batch
   1 when not batchable): medians, so runs another process preempted do not count.
5. **Choice.** By throughput at batch 32 when every passing candidate is batchable, otherwise
   by batch-1 latency. Throughput decides because a lone request's difference between
   backends is microseconds against the HTTP request's hundreds, while under load the rows
   per second are the capacity, and what keeps queues (and the tail latency) short. Speeds
   are compared round by round (the median over rounds of each candidate's speed over one
   racing candidate's in the same round), so a machine whose speed drifts (a busy 2-core
   box) moves every candidate alike. Candidates within 2 % of the best
   count as equal and the earliest of them wins, so noise does not flip the choice between
   near-equal candidates away from the preferred one.

Every runner opened here is closed before :func:`select` returns or raises. One info line on
``mcp.agent.runtime`` gives :meth:`Selection.summary`.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, overload

import numpy as np

from mcp_edge.agent.runtime import loader
from mcp_edge.agent.runtime.checks import check_outputs, synthetic_inputs, warm_up
from mcp_edge.agent.runtime.loader import load_runner, provider_alias
from mcp_edge.agent.runtime.runner import Array, ModelRunner, RunnerError, RunnerInfo
from mcp_edge.shared.profiles import HardwareProfile

log = logging.getLogger("mcp.agent.runtime")

RunnerLoader = Callable[..., ModelRunner]
"""``load_runner``'s shape: ``(model_path, profile, *, backend, threads) -> ModelRunner``."""

BATCH = 32
"""Rows per batch for the throughput figure and the answer comparison (batchable models)."""
SETUP_SHARE = 0.5
"""Share of the budget that opening and checking candidates may use before timing."""
TIMING_CAP_S = 2.0
"""Most seconds of timing per candidate, however large the budget."""
SURVEY_SHARE = 1 / 3
"""Share of the timing spent on the survey of every candidate; the race gets the rest."""
SURVEY_ROUNDS = 6
"""Survey rounds at most."""
MIN_ROUND_S = 0.05
"""Shortest time one candidate runs in one survey round (batch-1 and batch-32 together)."""
RACE_MARGIN = 0.25
"""Candidates the survey finds this much slower than the fastest are out of the race."""
RACE_SLICE_S = 0.01
"""One candidate's slice of a race round (at least one run)."""
RACE_CHECK_ROUNDS = 10
"""Race rounds between two looks for clearly beaten racers (and the fewest to judge on)."""
RACE_WIN_SHARE = 0.9
RACE_DROP_MARGIN = 0.1
"""A racer is out once the leader beat it in 90 % of the race rounds, by over 10 % (median):
the race ends when one is left, so clear choices take a fraction of the budget."""
TIE = 0.02
"""Candidates within this fraction of the best figure count as equally fast."""
TOP1_SAME_BACKEND = 0.97
TOP1_QUANTIZED_DEFAULT = 0.90
TOP1_QUANTIZED_MARGIN = 0.05
RTOL = 1e-2
ATOL_SHARE = 1e-2
ATOL_SHARE_QUANTIZED = 0.1
_REASON_IN_SUMMARY = 90


@dataclass(frozen=True)
class Candidate:
    """One model file on one backend."""

    variant: str
    """The bundle variant's tag (``default``, ``int8``...)."""
    model_path: Path
    backend: str
    """What :func:`~agent.runtime.loader.load_runner` takes: ``onnxruntime``, ``openvino``,
    ``tflite``, or an execution provider's short name (``cuda``, ``coreml``...)."""
    quantized: bool = False
    top1_agreement: float | None = None
    """For a quantized variant, its manifest's ``quantization.top1_agreement``, if known."""

    def label(self) -> str:
        return f"{self.variant} on {self.backend}"

    def to_json(self) -> dict[str, Any]:
        return {
            "variant": self.variant,
            "model_path": str(self.model_path),
            "backend": self.backend,
            "quantized": self.quantized,
        }


@dataclass(frozen=True)
class Trial:
    """What became of one candidate."""

    candidate: Candidate
    ok: bool
    """It loaded, passed the checks and was timed."""
    p50_us: float | None
    """Median batch-1 run, microseconds."""
    rps: float | None
    """Rows per second at batch 32 when the model is batchable, else at batch 1."""
    reason: str | None
    """Why it failed, or ``not tried: ...`` (budget, max_candidates); None when ok."""
    runtime: str | None = None
    """What it really ran on, ``backend/provider`` (``onnxruntime/CPU``, ``openvino/CPU``)."""

    def to_json(self) -> dict[str, Any]:
        return {
            **self.candidate.to_json(),
            "ok": self.ok,
            "p50_us": None if self.p50_us is None else round(self.p50_us, 2),
            "rps": None if self.rps is None else round(self.rps, 1),
            "reason": self.reason,
            "runtime": self.runtime,
        }


@dataclass(frozen=True)
class Selection:
    """The candidate chosen, every trial in the candidates' order, and the time it all took."""

    chosen: Candidate
    trials: tuple[Trial, ...]
    seconds: float
    criterion: str = "rps"
    """``rps`` (throughput at batch 32) or ``p50`` (batch-1 latency)."""

    def summary(self) -> str:
        """One line for a deployment event: the choice first, then every other candidate."""
        chosen = next((t for t in self.trials if t.ok and t.candidate is self.chosen), None)
        if chosen is None:
            chosen = next((t for t in self.trials if t.ok and t.candidate == self.chosen), None)
        parts = [f"chose {_describe(chosen) if chosen else self.chosen.label()}"]
        parts += [_describe(t) for t in self.trials if t is not chosen]
        criterion = f"rows/s at batch {BATCH}" if self.criterion == "rps" else "batch-1 p50"
        parts.append(f"{len(self.trials)} candidates in {self.seconds:.1f} s (by {criterion})")
        return "; ".join(parts)

    def to_json(self) -> dict[str, Any]:
        return {
            "chosen": self.chosen.to_json(),
            "criterion": self.criterion,
            "seconds": round(self.seconds, 3),
            "trials": [t.to_json() for t in self.trials],
        }


class SelectionError(RunnerError):
    """No candidate passed; the message gives each one's reason, ``trials`` the details."""

    def __init__(self, message: str, trials: tuple[Trial, ...]) -> None:
        super().__init__(message)
        self.trials = trials


def _describe(trial: Trial) -> str:
    where = trial.runtime or trial.candidate.backend
    head = f"{trial.candidate.variant} on {where}"
    if trial.ok:
        return f"{head}: p50 {_duration(trial.p50_us)}, {_rate(trial.rps)} rows/s"
    reason = " ".join((trial.reason or "failed").split())
    if len(reason) > _REASON_IN_SUMMARY:
        reason = reason[: _REASON_IN_SUMMARY - 1] + "…"
    return f"{head}: {reason}"


def _duration(us: float | None) -> str:
    if us is None:
        return "?"
    if us < 1_000:
        return f"{us:.0f} µs"
    if us < 1_000_000:
        return f"{us / 1_000:.1f} ms"
    return f"{us / 1_000_000:.2f} s"


def _rate(rps: float | None) -> str:
    if rps is None:
        return "?"
    return f"{float(f'{rps:.3g}'):,.0f}" if rps >= 100 else f"{rps:.3g}"


# --- which backends to try ---------------------------------------------------------------------

_SHORT_NAMES = {
    provider: short for short, provider in reversed(list(loader.PROVIDER_ALIASES.items()))
}
"""Provider → its first short name (``TensorrtExecutionProvider`` → ``tensorrt``, not ``trt``)."""
_FORMAT_BACKENDS = {"onnx": ("onnxruntime", "openvino"), "tflite": ("tflite",)}


def candidate_backends(fmt: str, profile: HardwareProfile) -> list[str]:
    """The backends to measure for a ``fmt`` (``onnx``/``tflite``) model under ``profile``.

    The profile's ``runtime.backends`` entries that run the format (``onnx``: onnxruntime and
    openvino; ``tflite``: tflite), ``opt_in`` ones left out, each name once, in the profile's
    order, and only those usable on this box. onnxruntime entries are named so that
    :func:`~agent.runtime.loader.load_runner` opens exactly that provider: the profile's first
    onnxruntime entry is ``onnxruntime`` (the profile's own order starts with it), later ones
    their provider's short name (``cpu``, ``cuda``...; the full provider name where the short
    one would read as another backend). Empty when the profile does not run the format.
    """
    if fmt not in profile.runtime.formats:
        return []
    wanted = _FORMAT_BACKENDS.get(fmt, ())
    entries = [e for e in profile.runtime.backends if e.name in wanted and not e.opt_in]
    first_ort = next((e for e in entries if e.name == "onnxruntime"), None)
    found: list[str] = []
    for entry in entries:
        if entry.name != "onnxruntime":
            name = entry.name
        elif entry is first_ort:
            name = "onnxruntime"
            if backend_unavailable(entry.provider) is not None:
                continue
        else:
            name = _SHORT_NAMES.get(entry.provider, entry.provider)
            if name in _FORMAT_BACKENDS["onnx"] or name in _FORMAT_BACKENDS["tflite"]:
                name = entry.provider
        if name not in found and backend_unavailable(name) is None:
            found.append(name)
    return found


def backend_unavailable(name: str) -> str | None:
    """Why ``name`` (a backend or a provider, as ``load_runner`` takes it) cannot run here;
    None when it can (:func:`agent.runtime.loader.backend_available`)."""
    return loader.backend_available(name)


# --- one candidate -----------------------------------------------------------------------------


class _Failed(Exception):
    """A candidate failed a step; the message is the trial's reason."""


@dataclass
class _Open:
    """A candidate that loaded and passed its own checks, and its timings."""

    index: int
    candidate: Candidate
    runner: ModelRunner
    batch: int
    outputs: dict[str, Array]
    feeds1: dict[str, Array]
    feeds_batch: dict[str, Array]
    warm_b1: float
    """Median batch-1 run of the warm-up, seconds (the figure when no round was timed)."""
    warm_bn: float
    """One batch-``batch`` run of the comparison, seconds."""
    runtime: str
    closed: bool = False
    b1: dict[int, list[float]] = field(default_factory=dict)
    """Batch-1 run times (seconds) by timing round."""
    bn: dict[int, list[float]] = field(default_factory=dict)
    """Batch-``batch`` run times (seconds) by timing round."""

    @property
    def info(self) -> RunnerInfo:
        return self.runner.info

    def p50_s(self) -> float:
        runs = [t for times in self.b1.values() for t in times]
        return statistics.median(runs) if runs else self.warm_b1

    def rps(self) -> float:
        """Rows per second: at ``batch`` when batchable, else at batch 1."""
        if not self.info.batchable:
            return _per_second(1, self.p50_s())
        runs = [t for times in self.bn.values() for t in times]
        return _per_second(self.batch, statistics.median(runs) if runs else self.warm_bn)

    def rounds(self, criterion: str) -> list[int]:
        """The timing rounds with a run of the batch ``criterion`` is decided on."""
        return list(self.bn if criterion == "rps" else self.b1)

    def run_estimate(self, criterion: str) -> float:
        """Seconds one run of the batch ``criterion`` is decided on takes, about."""
        runs = [t for times in (self.bn if criterion == "rps" else self.b1).values() for t in times]
        if runs:
            return statistics.median(runs)
        return self.warm_bn if criterion == "rps" else self.warm_b1

    @overload
    def speed(self, criterion: str) -> float: ...
    @overload
    def speed(self, criterion: str, round_: int) -> float | None: ...

    def speed(self, criterion: str, round_: int | None = None) -> float | None:
        """Higher is faster: rows per second (``rps``) or runs per second at batch 1 (``p50``),
        over every round or in one; None when that round has no run."""
        if round_ is None:
            return self.rps() if criterion == "rps" else _per_second(1, self.p50_s())
        times = (self.bn if criterion == "rps" else self.b1).get(round_)
        if not times:
            return None
        return _per_second(self.batch if criterion == "rps" else 1, statistics.median(times))


def _release(o: _Open) -> None:
    if not o.closed:
        o.closed = True
        _close(o.runner)


def _per_second(rows: int, seconds: float) -> float:
    return rows / seconds if seconds > 0 else float("inf")


def _runtime(info: RunnerInfo) -> str:
    return f"{info.backend}/{info.provider.removesuffix('ExecutionProvider')}"


def _check_backend(candidate: Candidate, info: RunnerInfo) -> None:
    """Raise :class:`_Failed` when the runner does not run on the backend the candidate names."""
    name = candidate.backend
    if name in ("onnxruntime", "tflite"):
        ok = info.backend == name
    elif name == "openvino":
        ok = info.backend == "openvino" or info.provider == "OpenVINOExecutionProvider"
    elif info.backend == "tflite":
        ok = info.provider.upper() == name.upper()
    else:
        ok = info.provider == provider_alias(name)
    if not ok:
        detail = f": {info.fallback_reason}" if info.fallback_reason else ""
        raise _Failed(f"{name} is not usable here, it ran on {_runtime(info)}{detail}")


def _timed_run(runner: ModelRunner, feeds: dict[str, Array]) -> tuple[dict[str, Array], float]:
    t = time.perf_counter()
    out = runner.run(feeds)
    return out, time.perf_counter() - t


def _open(index: int, candidate: Candidate, profile: HardwareProfile, threads: int | None,
          load: RunnerLoader, samples: Mapping[str, Array] | None) -> _Open:  # fmt: skip
    """Load ``candidate``, check its backend, warm it up and keep its answers on the
    comparison inputs. Raises :class:`_Failed`; the runner is closed on any failure."""
    figure = candidate.top1_agreement
    if candidate.quantized and figure is not None and figure < TOP1_QUANTIZED_DEFAULT:
        raise _Failed(
            f"its manifest says its top-1 agrees with the reference on {figure:.0%} of the "
            f"build's samples, needs {TOP1_QUANTIZED_DEFAULT:.0%}"
        )
    try:
        runner = load(candidate.model_path, profile, backend=candidate.backend, threads=threads)
    except (RunnerError, ValueError, OSError) as e:
        raise _Failed(f"does not load: {e}") from e
    try:
        return _checked(index, candidate, runner, samples)
    except BaseException:
        _close(runner)
        raise


def _checked(
    index: int, candidate: Candidate, runner: ModelRunner, samples: Mapping[str, Array] | None
) -> _Open:
    info = runner.info
    _check_backend(candidate, info)
    try:
        warm = warm_up([runner], repeats=3)
    except RunnerError as e:
        raise _Failed(str(e)) from e
    if samples is None:
        batch = BATCH if info.batchable else 1
        feeds_batch = synthetic_inputs(info, batch)
        feeds1 = synthetic_inputs(info, 1)
    else:
        rows = min(len(a) for a in samples.values())
        batch = min(BATCH, rows) if info.batchable else 1
        feeds_batch = {k: np.ascontiguousarray(a[:batch]) for k, a in samples.items()}
        feeds1 = {k: np.ascontiguousarray(a[:1]) for k, a in samples.items()}
    try:
        outputs, warm_bn = _timed_run(runner, feeds_batch)
        check_outputs(info, outputs, batch)
    except RunnerError as e:
        raise _Failed(f"at batch {batch}: {e}") from e
    return _Open(
        index=index,
        candidate=candidate,
        runner=runner,
        batch=batch,
        outputs=outputs,
        feeds1=feeds1,
        feeds_batch=feeds_batch,
        warm_b1=warm.run_s,
        warm_bn=warm_bn,
        runtime=_runtime(info),
    )


def _disagreement(reference: _Open, other: _Open) -> str | None:
    """Why ``other``'s answers do not match ``reference``'s on the same inputs; None if they do."""
    if other.info.inputs != reference.info.inputs:
        return "its inputs differ from the reference's " + reference.candidate.label()
    quantized = other.candidate.quantized and not reference.candidate.quantized
    for name, ref in reference.outputs.items():
        got = other.outputs.get(name)
        if got is None:
            return f"output {name!r} missing (the reference has it)"
        if got.shape != ref.shape:
            return f"output {name!r} has shape {list(got.shape)}, the reference {list(ref.shape)}"
        if ref.dtype.kind != "f":
            if not np.array_equal(got, ref):
                return f"output {name!r} differs from the reference's"
            continue
        a, b = ref.astype(np.float64), got.astype(np.float64)
        scale = float(np.max(np.abs(a))) if a.size else 0.0
        if a.ndim == 2 and a.shape[1] > 1:
            # A near tie may break either way: the row agrees when the reference's class
            # scores within ATOL_SHARE of the scale of the candidate's own top score.
            top = b[np.arange(a.shape[0]), a.argmax(axis=1)]
            agree = float(np.mean(top >= b.max(axis=1) - ATOL_SHARE * scale))
            need = _top1_needed(other.candidate) if quantized else TOP1_SAME_BACKEND
            if agree < need:
                return (
                    f"output {name!r}: top-1 agrees with the reference on {agree:.1%} of "
                    f"{a.shape[0]} rows, needs {need:.0%}"
                )
            continue
        atol = (ATOL_SHARE_QUANTIZED if quantized else ATOL_SHARE) * scale + 1e-6
        if not np.allclose(b, a, rtol=RTOL, atol=atol):
            worst = float(np.max(np.abs(b - a)))
            return f"output {name!r} differs from the reference by up to {worst:.3g}"
    return None


def _top1_needed(candidate: Candidate) -> float:
    if candidate.top1_agreement is None:
        return TOP1_QUANTIZED_DEFAULT
    return max(0.0, min(TOP1_SAME_BACKEND, candidate.top1_agreement - TOP1_QUANTIZED_MARGIN))


# --- timing ------------------------------------------------------------------------------------


def _time_rounds(
    passed: list[_Open], deadline: float, reasons: dict[int, str], criterion: str
) -> list[_Open]:
    """Time ``passed`` in interleaved rounds (run times go to each ``_Open``'s ``b1``/``bn``
    by round) for at most :data:`TIMING_CAP_S` per candidate and no later than ``deadline``.

    A third of that time is a survey: every candidate, batch 1 and batch n, in up to
    :data:`SURVEY_ROUNDS` rounds. The rest is a race between the candidates the survey found
    within :data:`RACE_MARGIN` of the fastest: short slices of the batch the choice is made
    on, alternating, so that the close calls get most of the measurements.

    Returns the candidates that ran every timed call; one that raised gets its reason in
    ``reasons`` (its runner stays open for the caller to close).
    """
    now = time.perf_counter()
    total = min(TIMING_CAP_S * len(passed), deadline - now)
    if not passed or total <= 0:
        return passed
    end = now + total
    per_candidate = total * SURVEY_SHARE / len(passed)
    # A survey round holds at least one run of each kind for every candidate.
    slowest = max(o.warm_b1 + (o.warm_bn if o.info.batchable else 0.0) for o in passed)
    rounds = min(SURVEY_ROUNDS, int(per_candidate / max(MIN_ROUND_S, slowest)))
    if rounds < 1:
        return passed
    slice_s = per_candidate / rounds
    for r in range(rounds):
        for k in range(len(passed)):
            o = passed[(r + k) % len(passed)]
            if o.index not in reasons:
                _time_slice(o, r, slice_s, reasons, both=True, criterion=criterion)
    alive = [o for o in passed if o.index not in reasons]
    if len(alive) < 2:
        return alive
    speeds = _relative_speeds(alive, criterion)
    best = max(speeds)
    racing = [o for o, v in zip(alive, speeds, strict=True) if v >= best * (1 - RACE_MARGIN)]
    if len(racing) < 2:
        return alive
    r = rounds
    while len(racing) > 1:
        one_round = sum(o.run_estimate(criterion) for o in racing)
        if time.perf_counter() + one_round >= end:
            break
        for k in range(len(racing)):
            o = racing[(r + k) % len(racing)]
            _time_slice(o, r, RACE_SLICE_S, reasons, both=False, criterion=criterion)
        racing = [o for o in racing if o.index not in reasons]
        r += 1
        if (r - rounds) % RACE_CHECK_ROUNDS == 0:
            racing = _still_racing(racing, criterion, range(rounds, r))
    return [o for o in passed if o.index not in reasons]


def _still_racing(racing: list[_Open], criterion: str, race_rounds: range) -> list[_Open]:
    """The racers not clearly beaten: one is out when, over the race rounds so far, the
    leader was faster in at least :data:`RACE_WIN_SHARE` of them and by more than
    :data:`RACE_DROP_MARGIN` in the median."""
    if len(racing) < 2:
        return racing
    speeds = _relative_speeds(racing, criterion)
    leader = racing[max(range(len(racing)), key=lambda i: speeds[i])]
    kept = []
    for o in racing:
        pairs = [(leader.speed(criterion, r), o.speed(criterion, r)) for r in race_rounds]
        both = [(a, b) for a, b in pairs if a and b is not None]
        beaten = (
            o is not leader
            and len(both) >= RACE_CHECK_ROUNDS
            and sum(a > b for a, b in both) >= RACE_WIN_SHARE * len(both)
            and statistics.median(b / a for a, b in both) < 1 - RACE_DROP_MARGIN
        )
        if not beaten:
            kept.append(o)
    return kept


def _time_slice(
    o: _Open, r: int, seconds: float, reasons: dict[int, str], *, both: bool, criterion: str
) -> None:
    """One candidate's slice of round ``r``: batch n then batch 1 (``both``), or only the
    batch the choice is made on."""
    try:
        if not both:
            if criterion == "rps":
                o.bn[r] = _run_for(o.runner, o.feeds_batch, seconds)
            else:
                o.b1[r] = _run_for(o.runner, o.feeds1, seconds)
        elif o.info.batchable:
            # Batch n for half the slice (or one run), batch 1 for the rest.
            t0 = time.perf_counter()
            o.bn[r] = _run_for(o.runner, o.feeds_batch, seconds / 2)
            o.b1[r] = _run_for(o.runner, o.feeds1, seconds - (time.perf_counter() - t0))
        else:
            o.b1[r] = _run_for(o.runner, o.feeds1, seconds)
    except Exception as e:  # a run that fails now fails the candidate, not the others
        reasons[o.index] = f"failed while timed: {e}"


def _run_for(runner: ModelRunner, feeds: dict[str, Array], seconds: float) -> list[float]:
    """Run ``feeds`` back to back for about ``seconds`` (at least once); each run's seconds."""
    times = []
    end = time.perf_counter() + seconds
    while True:
        t = time.perf_counter()
        runner.run(feeds)
        now = time.perf_counter()
        times.append(now - t)
        if now >= end:
            return times


def _relative_speeds(timed: Sequence[_Open], criterion: str) -> list[float]:
    """Each candidate's speed against a base one's: the median over the timing rounds of the
    ratio of their speeds in the same round, so a drift of the machine's speed between rounds
    cancels out (the base is the earliest candidate timed in the most rounds; the ratio of
    the overall figures stands in when two candidates share no round)."""
    base = max(timed, key=lambda o: len(o.rounds(criterion)))
    found = []
    for o in timed:
        ratios = []
        for r in o.rounds(criterion):
            a, b = o.speed(criterion, r), base.speed(criterion, r)
            if a is not None and b is not None and b > 0:
                ratios.append(a / b)
        if ratios:
            found.append(statistics.median(ratios))
        else:
            found.append(o.speed(criterion) / max(base.speed(criterion), 1e-300))
    return found


# --- the selection -----------------------------------------------------------------------------


def select(
    candidates: Sequence[Candidate],
    profile: HardwareProfile,
    *,
    threads: int | None = None,
    budget_s: float | None = None,
    max_candidates: int | None = None,
    samples: Mapping[str, Array] | None = None,
    load: RunnerLoader = load_runner,
) -> Selection:
    """Measure ``candidates`` and choose the fastest that passes the checks (module docstring).

    Args:
        candidates: in order of preference; the first non-quantized one that passes is the
            reference the others' answers are compared with.
        profile: the hardware profile in force (thread and provider settings for loading,
            and ``runtime.selection`` defaults).
        threads: passed to ``load``; None takes the profile's.
        budget_s: seconds the whole selection aims to take; None: the profile's.
        max_candidates: how many candidates are tried at most; None: the profile's.
        samples: real inputs (one array per model input, rows first), used instead of
            synthetic ones to compare answers and time runs (the first 32 rows); the
            comparison is only as good as its inputs, and noise is a poor stand-in for a
            quantized model's real inputs.
        load: opens a runner, :func:`~agent.runtime.loader.load_runner` by default.

    Returns:
        The choice, and one :class:`Trial` per candidate, in the given order.

    Raises:
        SelectionError: no candidate passed (its message lists each one's reason).
        ValueError: no candidates, a budget or count that is not positive, or ``samples``
            that are empty or not numpy arrays.
    """
    settings = profile.runtime.selection
    budget = settings.budget_s if budget_s is None else budget_s
    limit = settings.max_candidates if max_candidates is None else max_candidates
    if not candidates:
        raise ValueError("select() needs at least one candidate")
    if not budget > 0 or limit < 1:
        raise ValueError(f"budget_s must be > 0 and max_candidates >= 1 (got {budget}, {limit})")
    if samples is not None and (
        not samples
        or any(not isinstance(a, np.ndarray) or not a.ndim or not len(a) for a in samples.values())
    ):
        raise ValueError("samples must map each input name to a numpy array with rows")
    start = time.perf_counter()
    reasons: dict[int, str] = {}
    passed: list[_Open] = []
    try:
        setups: list[float] = []
        for i, candidate in enumerate(candidates):
            if i >= limit:
                reasons[i] = f"not tried: max_candidates is {limit}"
                continue
            t0 = time.perf_counter()
            if setups and t0 + statistics.fmean(setups) > start + SETUP_SHARE * budget:
                reasons[i] = f"not tried: budget ({budget:g} s) spent"
                continue
            try:
                passed.append(_open(i, candidate, profile, threads, load, samples))
            except _Failed as e:
                reasons[i] = str(e)
            except Exception as e:  # a runtime's own bug must not stop the other candidates
                log.warning(
                    "%s: unexpected error while measuring", candidate.label(), exc_info=True
                )
                reasons[i] = f"unexpected error: {type(e).__name__}: {e}"
            setups.append(time.perf_counter() - t0)
        _compare(passed, reasons)
        checked = [o for o in passed if o.index not in reasons]
        criterion = "rps" if all(o.info.batchable for o in checked) else "p50"
        timed = _time_rounds(checked, start + budget, reasons, criterion)
    finally:
        for o in passed:
            _release(o)
    seconds = time.perf_counter() - start
    trials = _trials(candidates, passed, reasons)
    if not timed:
        listing = "; ".join(f"{t.candidate.label()}: {t.reason}" for t in trials)
        raise SelectionError(f"no candidate passed the checks: {listing}", trials)
    selection = Selection(_choose(timed, criterion).candidate, trials, seconds, criterion)
    log.info("model selection: %s", selection.summary())
    return selection


def _compare(passed: list[_Open], reasons: dict[int, str]) -> None:
    """Fail (in ``reasons``) the candidates whose answers differ from the reference's."""
    if not passed:
        return
    reference = next((o for o in passed if not o.candidate.quantized), passed[0])
    for o in passed:
        why = None if o is reference else _disagreement(reference, o)
        if why is not None:
            reasons[o.index] = why
            _release(o)


def _choose(timed: list[_Open], criterion: str) -> _Open:
    """The earliest candidate within :data:`TIE` of the fastest (by :func:`_relative_speeds`)."""
    speeds = _relative_speeds(timed, criterion)
    best = max(speeds)
    return next(o for o, v in zip(timed, speeds, strict=True) if v >= best * (1 - TIE))


def _trials(
    candidates: Sequence[Candidate], passed: list[_Open], reasons: dict[int, str]
) -> tuple[Trial, ...]:
    by_index = {o.index: o for o in passed}
    trials = []
    for i, candidate in enumerate(candidates):
        o = by_index.get(i)
        runtime = o.runtime if o is not None else None
        if o is not None and i not in reasons:
            trials.append(Trial(candidate, True, o.p50_s() * 1e6, o.rps(), None, runtime))
        else:
            trials.append(Trial(candidate, False, None, None, reasons[i], runtime))
    return tuple(trials)


def _close(runner: ModelRunner) -> None:
    try:
        runner.close()
    except Exception:
        log.warning("closing a runner after model selection failed", exc_info=True)
