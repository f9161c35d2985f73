"""The pure core of deployments: desired-state documents, profile fit, downgrade checks.

No I/O here: :mod:`controlplane.deployments` reads the rows, calls these functions, and signs,
stores and publishes what they return.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta

from mcp_edge.controlplane.db.deployments import DeviceModelView, VersionView
from mcp_edge.controlplane.db.devices import DeviceView
from mcp_edge.shared.errors import VersionError
from mcp_edge.shared.protocol.canary import DEFAULT_CANARY_POLICY
from mcp_edge.shared.protocol.state import (
    CanarySpec,
    DesiredModel,
    DesiredState,
    TargetRef,
    TelemetryPolicy,
)
from mcp_edge.shared.version import parse_version

log = logging.getLogger("mcp.controlplane.deployments")


def _ref(version: VersionView) -> TargetRef:
    return TargetRef(
        version=version.version,
        target_path=version.target_path,
        sha256=version.sha256,
        length=version.length,
    )


def build_desired_state(
    device_id: str,
    seq: int,
    now: datetime,
    ttl: timedelta,
    models: Sequence[DeviceModelView],
    versions: Mapping[tuple[str, str], VersionView],
    telemetry: TelemetryPolicy | None = None,
    traceparent: str | None = None,
) -> DesiredState:
    """The whole desired state of one device from its desired models; a model whose version
    is no longer published is left out (logged). A ``prefetch_version`` that is no longer
    published, or that the model already runs as stable, canary or shadow, is left out of its
    model alone (logged): the model keeps serving. ``traceparent``: the trace of the deploy
    call that issues it (tracing on). Raises pydantic's ValidationError when the document
    would break its schema (more than 64 models)."""
    entries: list[DesiredModel] = []
    for m in models:
        stable = versions.get((m.model, m.stable_version))
        canary = versions.get((m.model, m.canary_version)) if m.canary_version else None
        shadow = versions.get((m.model, m.shadow_version)) if m.shadow_version else None
        if (
            stable is None
            or (m.canary_version and canary is None)
            or (m.shadow_version and shadow is None)
        ):
            log.warning(
                "device %s: %s %s is no longer published; left out of its desired state",
                device_id,
                m.model,
                m.stable_version,
            )
            continue
        entries.append(
            DesiredModel(
                name=m.model,
                stable=_ref(stable),
                canary=CanarySpec.of(_ref(canary), m.canary_policy or DEFAULT_CANARY_POLICY)
                if canary
                else None,
                shadow=_ref(shadow) if shadow else None,
                rollback=m.rollback,
                prefetch=_prefetch(device_id, m, versions),
            )
        )
    return DesiredState(
        device_id=device_id,
        seq=seq,
        issued_at=now,
        expires=now + ttl,
        models=entries,
        telemetry=telemetry or TelemetryPolicy(),
        traceparent=traceparent,
    )


def _prefetch(
    device_id: str, m: DeviceModelView, versions: Mapping[tuple[str, str], VersionView]
) -> TargetRef | None:
    """The target ``m`` asks the device to prefetch, or None (none asked, or left out)."""
    if not m.prefetch_version:
        return None
    if m.prefetch_version in (m.stable_version, m.canary_version, m.shadow_version):
        log.info(
            "device %s: %s %s already runs; no prefetch of it",
            device_id,
            m.model,
            m.prefetch_version,
        )
        return None
    found = versions.get((m.model, m.prefetch_version))
    if found is None:
        log.warning(
            "device %s: %s %s is no longer published; not prefetched",
            device_id,
            m.model,
            m.prefetch_version,
        )
        return None
    return _ref(found)


def misfits(
    devices: Sequence[DeviceView], versions: Sequence[VersionView]
) -> tuple[list[DeviceView], dict[str, str]]:
    """Split devices into those whose profile every version fits (a version with no profiles
    fits all) and ``{device_id: why not}`` for the rest."""
    fits: list[DeviceView] = []
    skipped: dict[str, str] = {}
    for device in devices:
        for v in versions:
            if v.profiles and device.profile not in v.profiles:
                skipped[device.id] = (
                    f"device {device.id!r} has profile {device.profile or 'unknown'}, which no "
                    f"variant of {v.model} {v.version} fits ({', '.join(v.profiles)})"
                )
                break
        else:
            fits.append(device)
    return fits, skipped


def _numeric(version: str, known: Mapping[str, int]) -> int | None:
    if version in known:
        return known[version]
    try:
        return parse_version(version).to_numeric()
    except VersionError:
        return None


def downgrades(
    target: int,
    desired: Mapping[str, str],
    reported: Mapping[str, str],
    known: Mapping[str, int],
) -> dict[str, str]:
    """``{device_id: version}`` for devices whose desired stable or reported active version
    is above the release counter ``target`` (``known`` maps version text to its counter)."""
    below: dict[str, str] = {}
    for device_id in sorted(set(desired) | set(reported)):
        for version in (desired.get(device_id), reported.get(device_id)):
            n = _numeric(version, known) if version else None
            if n is not None and n > target:
                below[device_id] = str(version)
                break
    return below
