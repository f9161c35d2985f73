"""What the simulated fleet does, as one frozen value built once by the CLI.

A behaviour file (TOML) says how each model version behaves on a simulated device, and how the
fleet as a whole comes and goes; every key is optional::

    [defaults]                 # every version not listed below
    request_rate = 2.0         # requests per second the version answers on one device
    error_rate = 0.0           # share of those requests that fail, 0..1
    latency_ms = 4.0           # median latency, milliseconds
    latency_sigma = 0.35       # spread: sigma of the log-normal latency distribution
    latency_factor = 1.0       # multiplies the latency (a slow version)
    load_ms = 0.0              # time the version takes in ``loading``, milliseconds
    fail_load = false          # the version does not load: failed event, old version stays
    agreement = 0.99           # share of shadowed requests whose answer agrees with stable

    [[version]]                # one table per model version that behaves differently
    model = "digits"
    version = "1.1.0"
    fail_load = true

    [fleet]
    health_interval_s = 30     # health sample period per device, seconds
    stats_interval_s = 60      # inference statistics period per device, seconds
    churn_percent_per_minute = 0   # devices that go offline per minute, % of the fleet
    churn_offline_s = 30       # how long a churned device stays offline, seconds
    connect_rate = 500         # devices connecting per second at start

Flags of ``mcp-sim run`` override the ``[fleet]`` values. Unknown keys, wrong types and values
out of range raise :class:`BehaviourError` naming the key, so a typo never silently runs the
defaults.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from mcp_edge.shared.errors import McpError

MAX_BEHAVIOUR_BYTES = 1024 * 1024


class BehaviourError(McpError):
    """The behaviour file or a flag cannot be used as given."""


@dataclass(frozen=True)
class VersionBehaviour:
    """How one model version behaves on every simulated device (units in the field names)."""

    request_rate: float = 2.0
    error_rate: float = 0.0
    latency_ms: float = 4.0
    latency_sigma: float = 0.35
    latency_factor: float = 1.0
    load_ms: float = 0.0
    fail_load: bool = False
    agreement: float = 0.99

    def __post_init__(self) -> None:
        _check_range("request_rate", self.request_rate, 0.0, 1e6)
        _check_range("error_rate", self.error_rate, 0.0, 1.0)
        _check_range("latency_ms", self.latency_ms, 1e-3, 1e6)
        _check_range("latency_sigma", self.latency_sigma, 0.0, 5.0)
        _check_range("latency_factor", self.latency_factor, 1e-3, 1e4)
        _check_range("load_ms", self.load_ms, 0.0, 3.6e6)
        _check_range("agreement", self.agreement, 0.0, 1.0)
        if not isinstance(self.fail_load, bool):
            raise BehaviourError(f"fail_load must be true or false, not {self.fail_load!r:.40}")

    @property
    def median_ms(self) -> float:
        """The median latency with the slow-down factor applied."""
        return self.latency_ms * self.latency_factor


@dataclass(frozen=True)
class FleetBehaviour:
    """How the fleet comes and goes (seconds, devices per second, % per minute)."""

    health_interval_s: float = 30.0
    stats_interval_s: float = 60.0
    churn_percent_per_minute: float = 0.0
    churn_offline_s: float = 30.0
    connect_rate: float = 500.0

    def __post_init__(self) -> None:
        _check_range("health_interval_s", self.health_interval_s, 1.0, 86_400.0)
        _check_range("stats_interval_s", self.stats_interval_s, 1.0, 86_400.0)
        _check_range("churn_percent_per_minute", self.churn_percent_per_minute, 0.0, 100.0)
        _check_range("churn_offline_s", self.churn_offline_s, 0.0, 86_400.0)
        _check_range("connect_rate", self.connect_rate, 0.1, 1e6)


@dataclass(frozen=True)
class Behaviour:
    """Version behaviours (``defaults`` for any version not in ``versions``) and the fleet's."""

    defaults: VersionBehaviour = field(default_factory=VersionBehaviour)
    versions: Mapping[tuple[str, str], VersionBehaviour] = field(default_factory=dict)
    fleet: FleetBehaviour = field(default_factory=FleetBehaviour)

    def of(self, model: str, version: str) -> VersionBehaviour:
        """How ``model`` ``version`` behaves."""
        return self.versions.get((model, version), self.defaults)

    def with_fleet(self, **changes: float | None) -> Behaviour:
        """A copy whose fleet values are replaced by the ``changes`` that are not None (flags)."""
        given = {k: v for k, v in changes.items() if v is not None}
        if not given:
            return self
        try:
            fleet = dataclasses.replace(self.fleet, **given)
        except TypeError as e:
            raise BehaviourError(str(e)) from e
        return dataclasses.replace(self, fleet=fleet)


def load_behaviour(path: Path | None) -> Behaviour:
    """The behaviour in ``path`` (TOML; see the module docstring), or the defaults for None.

    Raises :class:`BehaviourError` for a file that is missing, too large, not TOML, or holds
    unknown keys or values out of range.
    """
    if path is None:
        return Behaviour()
    try:
        with path.open("rb") as f:
            data = f.read(MAX_BEHAVIOUR_BYTES + 1)
    except OSError as e:
        raise BehaviourError(f"cannot read the behaviour file {path}: {e}") from e
    if len(data) > MAX_BEHAVIOUR_BYTES:
        raise BehaviourError(f"{path} is larger than {MAX_BEHAVIOUR_BYTES} bytes")
    try:
        doc = tomllib.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise BehaviourError(f"{path} is not TOML: {e}") from e
    try:
        return behaviour_from(doc)
    except BehaviourError as e:
        raise BehaviourError(f"{path}: {e}") from e


def behaviour_from(doc: Mapping[str, Any]) -> Behaviour:
    """Build a :class:`Behaviour` from a parsed TOML document; raises :class:`BehaviourError`."""
    _only(doc, {"defaults", "version", "fleet"}, "the file")
    defaults = _version_fields(_table(doc, "defaults"), VersionBehaviour(), "[defaults]")
    versions: dict[tuple[str, str], VersionBehaviour] = {}
    entries = doc.get("version", [])
    if not isinstance(entries, list):
        raise BehaviourError("[[version]] must be an array of tables")
    for i, entry in enumerate(entries):
        where = f"[[version]] #{i + 1}"
        if not isinstance(entry, dict):
            raise BehaviourError(f"{where} is not a table")
        model, version = entry.get("model"), entry.get("version")
        if not isinstance(model, str) or not isinstance(version, str):
            raise BehaviourError(f"{where} needs model and version strings")
        rest = {k: v for k, v in entry.items() if k not in ("model", "version")}
        if (model, version) in versions:
            raise BehaviourError(f"{where}: {model} {version} is listed twice")
        versions[(model, version)] = _version_fields(rest, defaults, where)
    fleet_table = _table(doc, "fleet")
    _only(fleet_table, {f.name for f in dataclasses.fields(FleetBehaviour)}, "[fleet]")
    try:
        fleet = FleetBehaviour(**{k: _number(k, v) for k, v in fleet_table.items()})
    except BehaviourError as e:
        raise BehaviourError(f"[fleet]: {e}") from e
    return Behaviour(defaults=defaults, versions=versions, fleet=fleet)


def _version_fields(
    table: Mapping[str, Any], base: VersionBehaviour, where: str
) -> VersionBehaviour:
    names = {f.name for f in dataclasses.fields(VersionBehaviour)}
    _only(table, names, where)
    values: dict[str, Any] = {}
    for key, value in table.items():
        values[key] = value if key == "fail_load" else _number(key, value)
    try:
        return dataclasses.replace(base, **values)
    except BehaviourError as e:
        raise BehaviourError(f"{where}: {e}") from e


def _table(doc: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    table = doc.get(name, {})
    if not isinstance(table, dict):
        raise BehaviourError(f"[{name}] must be a table")
    return table


def _only(table: Mapping[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise BehaviourError(
            f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(allowed))}"
        )


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BehaviourError(f"{name} must be a number, not {value!r:.40}")
    return float(value)


def _check_range(name: str, value: float, lo: float, hi: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise BehaviourError(f"{name} must be a number, not {value!r:.40}")
    if not lo <= value <= hi:
        raise BehaviourError(f"{name} {value} is outside {lo:g}..{hi:g}")
