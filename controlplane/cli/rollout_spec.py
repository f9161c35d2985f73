"""The spec of ``mcp-controlplane rollouts create``: the compact ``--stage`` form, ``--rate``,
durations, a ``--file`` (TOML or JSON), and the request body built from them (pure but for
reading the file).

One ``--stage`` is ``SIZE[:OPTION]...``::

    10%:canary:weight=0.1:bake=10m:gate=error_rate<0.02:gate=latency_p95_ratio<1.5
    1:switch:approval:prefetch:bake=5m:gate=install_failure_rate<0.1,min_devices=1
    rest

SIZE is ``N`` devices, ``P%`` of the target or ``rest`` (the last stage: what the others leave).
OPTIONs: a mode (``switch``, ``canary``, ``shadow``), ``weight=F`` (canary), ``bake=DURATION``,
``prefetch``, ``approval``, and ``gate=METRIC<T`` (``METRIC>T`` for ``agreement``, the one
floor) with ``,min_devices=N``, ``,min_requests=N``, ``,on_fail=pause|rollback``, ``,dry_run``.
:func:`stage_text` writes a stage back in this form. The body is then checked by the server's
own rules (:func:`controlplane.rollouts.spec.parse_spec`), so a mistake is a usage error naming
the ``--stage`` or the file at fault before anything is sent.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import click

from mcp_edge.controlplane.rollouts.model import FailAction, Gate, GateMetric, Stage, StageMode
from mcp_edge.controlplane.rollouts.spec import SpecError, parse_spec
from mcp_edge.shared.protocol.canary import DEFAULT_CANARY_POLICY

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

MAX_FILE_BYTES = 1 << 20
"""A ``--file`` spec larger than this is refused unread."""
REST = "rest"
DEFAULT_BAKE = "10m"
DEFAULT_GATES = (
    "gate=install_failure_rate<0.1",
    f"gate=error_rate<{DEFAULT_CANARY_POLICY.max_error_rate:g}",
)
DEFAULT_STAGES = tuple(
    ":".join((size, f"bake={DEFAULT_BAKE}", *DEFAULT_GATES)) for size in ("10%", "50%", REST)
)
"""The stages of a ``create`` given no ``--stage`` (docs/rollouts.md, "Defaults")."""
EXAMPLE = (
    "e.g. --stage '10%:canary:weight=0.1:bake=10m:gate=error_rate<0.02' "
    "--stage '1:switch:approval:prefetch:gate=install_failure_rate<0.1,min_devices=1' "
    "--stage rest"
)


class StageSyntaxError(click.UsageError):
    """A ``--stage`` the compact form cannot read; the message names it and shows an example."""

    def __init__(self, text: str, problem: str) -> None:
        super().__init__(f"--stage {text!r}: {problem}\n  {EXAMPLE}")


_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h|d)?$")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}
_SIZE = re.compile(r"^(?:(?P<count>\d+)|(?P<percent>\d+(?:\.\d+)?)%)$")
_GATE = re.compile(r"^(?P<metric>[a-z0-9_]+)(?P<op><=?|>=?)(?P<threshold>\S+)$")
_RATE = re.compile(r"^(\d+(?:\.\d+)?)\s*(?:/\s*(s|sec|min|m|h|hour))?$")
_PER_MINUTE = {"s": 60.0, "sec": 60.0, "min": 1.0, "m": 1.0, None: 1.0, "h": 1 / 60, "hour": 1 / 60}
_STAGE_DEFAULT = Stage()
_GATE_DEFAULT = Gate(GateMetric.ERROR_RATE, 0.0)


def parse_seconds(text: str) -> float:
    """``90s``, ``10m``, ``1.5h``, ``2d``, ``250ms`` or bare seconds → seconds; raises
    ValueError."""
    match = _DURATION.match(text.strip().lower())
    if match is None:
        raise ValueError(f"{text!r} is not a duration: use a number and s, m, h or d (10m)")
    return float(match.group(1)) * _UNIT_S[match.group(2)]


def fmt_seconds(seconds: float) -> str:
    """The shortest of ``90s``, ``10m``, ``2h``, ``1d`` that says ``seconds`` exactly."""
    for unit, size in (("d", 86400.0), ("h", 3600.0), ("m", 60.0)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"


def _number(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{what} {text!r} is not a number") from None
    if not math.isfinite(value):
        raise ValueError(f"{what} {text!r} is not a finite number")
    return value


def _whole(text: str, what: str) -> int:
    if not text.isdigit():
        raise ValueError(f"{what} {text!r} is not a whole number")
    return int(text)


def parse_gate(text: str) -> dict[str, Any]:
    """``METRIC<T[,min_devices=N][,min_requests=N][,on_fail=pause|rollback][,dry_run]`` → the
    JSON form of a gate (``>`` for agreement, the one floor). Raises ValueError."""
    head, *options = text.split(",")
    match = _GATE.match(head.strip())
    metrics = ", ".join(m.value for m in GateMetric)
    if match is None:
        raise ValueError(f"gate {text!r}: write METRIC<THRESHOLD (metrics: {metrics})")
    try:
        metric = GateMetric(match["metric"])
    except ValueError:
        raise ValueError(
            f"gate {text!r}: unknown metric {match['metric']!r}; one of {metrics}"
        ) from None
    want = ">" if metric.is_floor else "<"
    if match["op"][0] != want:
        kind = "a floor" if metric.is_floor else "a ceiling"
        raise ValueError(f"gate {text!r}: {metric.value} takes {kind}: {metric.value}{want}T")
    gate: dict[str, Any] = {
        "metric": metric.value,
        "threshold": _number(match["threshold"], f"gate {metric.value}: threshold"),
    }
    for option in (o.strip() for o in options):
        key, sep, value = option.partition("=")
        if key in ("min_devices", "min_requests") and sep:
            gate[key] = _whole(value, f"gate {metric.value}: {key}")
        elif key == "on_fail" and value in [a.value for a in FailAction]:
            gate["on_fail"] = value
        elif key == "dry_run" and (not sep or value in ("true", "false")):
            gate["dry_run"] = value != "false"
        else:
            raise ValueError(
                f"gate {metric.value}: unknown option {option!r}; use min_devices=N, "
                "min_requests=N, on_fail=pause|rollback or dry_run"
            )
    return gate


def parse_stage(text: str) -> dict[str, Any]:
    """One ``--stage``: ``SIZE[:OPTION]...`` → the JSON form of a stage.

    SIZE is ``N`` devices, ``P%`` of the target, or ``rest`` (the last stage only: see
    :func:`stages_from_flags`, which resolves it; here it is ``{"rest": True}``). OPTIONs:
    ``switch``/``canary``/``shadow``, ``weight=F``, ``bake=10m``, ``prefetch``, ``approval``,
    ``gate=...`` (:func:`parse_gate`), repeatable. Raises :class:`StageSyntaxError`.
    """
    size, *options = text.strip().split(":")
    stage: dict[str, Any] = {}
    match = _SIZE.match(size.strip())
    if size.strip().lower() == REST:
        stage["rest"] = True
    elif match is None:
        raise StageSyntaxError(text, f"{size!r} is not a size: use N devices, P% or rest")
    elif match["count"] is not None:
        stage["count"] = int(match["count"])
    else:
        stage["percent"] = float(match["percent"])
    gates: list[dict[str, Any]] = []
    try:
        for option in (o.strip() for o in options):
            key, sep, value = option.partition("=")
            if not sep and key in [m.value for m in StageMode]:
                stage["mode"] = key
            elif not sep and key in ("prefetch", "approval"):
                stage[key] = True
            elif sep and key == "weight":
                stage["weight"] = _number(value, "weight")
            elif sep and key == "bake":
                stage["bake_s"] = parse_seconds(value)
            elif sep and key == "gate":
                gates.append(parse_gate(value))
            else:
                raise ValueError(
                    f"unknown option {option!r}: use switch, canary, shadow, weight=F, "
                    "bake=10m, prefetch, approval or gate=METRIC<T"
                )
    except ValueError as e:
        raise StageSyntaxError(text, str(e)) from None
    if gates:
        stage["gates"] = gates
    return stage


def stages_from_flags(texts: Sequence[str]) -> list[dict[str, Any]]:
    """Every ``--stage`` parsed, with ``rest`` made what :mod:`controlplane.rollouts.spec`
    reads as the remainder: when every other stage is a percent, the percent that makes 100;
    when a count is among them, ``100`` (a last percent stage after counts takes the rest).
    Raises :class:`StageSyntaxError`."""
    stages = [parse_stage(t) for t in texts]
    for i, (stage, text) in enumerate(zip(stages, texts, strict=True)):
        if stage.pop("rest", False):
            if i != len(stages) - 1:
                raise StageSyntaxError(text, "rest takes what the other stages leave: last only")
            others = stages[:-1]
            left = 100.0
            if not any("count" in s for s in others):
                left = round(100.0 - math.fsum(s["percent"] for s in others), 9)
                if left <= 0:
                    raise StageSyntaxError(text, "the stages before it already take 100%")
            stages[i] = {"percent": left, **stage}
    return stages


def gate_text(gate: Mapping[str, Any]) -> str:
    """A gate's JSON form in the ``gate=`` form (only what differs from the defaults)."""
    metric = GateMetric(gate["metric"])
    parts = [f"{metric.value}{'>' if metric.is_floor else '<'}{gate['threshold']:g}"]
    for key in ("min_devices", "min_requests"):
        if gate.get(key, getattr(_GATE_DEFAULT, key)) != getattr(_GATE_DEFAULT, key):
            parts.append(f"{key}={gate[key]}")
    if gate.get("on_fail", FailAction.ROLLBACK.value) != FailAction.ROLLBACK.value:
        parts.append(f"on_fail={gate['on_fail']}")
    if gate.get("dry_run"):
        parts.append("dry_run")
    return ",".join(parts)


def stage_text(stage: Mapping[str, Any]) -> str:
    """A stage's JSON form in the ``--stage`` form; :func:`parse_stage` reads it back."""
    parts = [f"{stage['count']}" if stage.get("count") is not None else f"{stage['percent']:g}%"]
    mode = stage.get("mode", StageMode.SWITCH.value)
    parts.append(mode)
    if mode == StageMode.CANARY.value:
        parts.append(f"weight={stage.get('weight', _STAGE_DEFAULT.weight):g}")
    parts.append(f"bake={fmt_seconds(float(stage.get('bake_s', _STAGE_DEFAULT.bake_s)))}")
    parts += [flag for flag in ("prefetch", "approval") if stage.get(flag)]
    parts += [f"gate={gate_text(g)}" for g in stage.get("gates", [])]
    return ":".join(parts)


def parse_rate(text: str) -> float | None:
    """``10/min``, ``1/s``, ``120/h`` or a bare number per minute → devices per minute;
    ``none`` → None (no limit). Raises click.BadParameter."""
    if text.strip().lower() in ("none", "off", "unlimited"):
        return None
    match = _RATE.match(text.strip().lower())
    if match is None:
        raise click.BadParameter(f"{text!r}: write N/min, N/s or N/h (e.g. 10/min) or none")
    return float(match.group(1)) * _PER_MINUTE[match.group(2)]


# ---------------------------------------------------------------------------- the spec
def read_spec_file(path: Path) -> dict[str, Any]:
    """A whole spec from ``path`` (``.toml`` or ``.json``, the REST body's shape); raises
    click.UsageError naming the file."""
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise click.UsageError(f"--file {path}: {e.strerror or e}") from e
    if len(raw) > MAX_FILE_BYTES:
        raise click.UsageError(f"--file {path}: larger than {MAX_FILE_BYTES} bytes")
    suffix = path.suffix.lower()
    try:
        text = raw.decode("utf-8")
        if suffix == ".toml":
            data: Any = tomllib.loads(text)
        elif suffix == ".json":
            data = json.loads(text)
        else:
            raise click.UsageError(f"--file {path}: name a .toml or a .json file")
    except (UnicodeDecodeError, tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise click.UsageError(f"--file {path}: {e}") from e
    if not isinstance(data, dict):
        raise click.UsageError(f"--file {path}: expected an object (the rollout spec)")
    return data


def _check(body: dict[str, Any], stage_flags: Sequence[str], source: str | None) -> None:
    """``body`` checked by :func:`parse_spec`; a problem becomes a usage error naming the
    ``--stage`` it came from, or the file."""
    try:
        parse_spec(body)
    except SpecError as e:
        message = str(e)
        match = re.match(r"^stages\[(\d+)\][.:]?\s*(.*)$", message, re.S)
        if stage_flags and match is not None and int(match[1]) < len(stage_flags):
            raise StageSyntaxError(stage_flags[int(match[1])], match[2]) from e
        if stage_flags and message.startswith("stages:"):
            problem = message[len("stages:") :].strip()
            raise click.UsageError(f"--stage: {problem}\n  {EXAMPLE}") from e
        raise click.UsageError(f"{source}: {message}" if source else message) from e


def build_spec(
    *,
    model: str | None,
    version: str | None,
    target: Mapping[str, Any],
    stage_flags: Sequence[str],
    rate: float | None,
    rate_growth: float | None,
    device_timeout_s: float | None,
    file: Path | None,
) -> dict[str, Any]:
    """The request body of a create: the file's spec (if any) with every flag given laid over
    it; without a file and ``--stage``, :data:`DEFAULT_STAGES`. Raises click.UsageError."""
    body: dict[str, Any] = read_spec_file(file) if file is not None else {}
    if model is not None:
        body["model"] = model
    if version is not None:
        body["version"] = version
    if "model" not in body or "version" not in body:
        raise click.UsageError("give MODEL and VERSION (or a --file that names them)")
    if target:
        body["target"] = dict(target)
    elif "target" not in body:
        raise click.UsageError(
            "select the devices: --device D (repeatable), --group G, --label k=v or --profile P"
        )
    if stage_flags:
        body["stages"] = stages_from_flags(stage_flags)
    elif file is None:
        body["stages"] = stages_from_flags(DEFAULT_STAGES)
    if rate is not None or rate_growth is not None:
        given = body.get("rate")
        merged = dict(given) if isinstance(given, dict) else {}
        if rate is not None:
            merged["per_minute"] = rate
        if rate_growth is not None:
            merged["growth"] = rate_growth
        body["rate"] = merged
    if device_timeout_s is not None:
        body["device_timeout_s"] = device_timeout_s
    _check(body, stage_flags, f"--file {file}" if file is not None else None)
    return body
