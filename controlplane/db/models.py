"""The tables of the control plane's core (migration ``0001_core``).

Adding tables later (telemetry, deployments, rollouts): declare them on :class:`Base` in a new
module imported by :mod:`controlplane.db.migrations.env` (or here), and write the matching
``versions/000N_*.py`` migration by hand or with ``alembic revision --autogenerate``; the test
``test_migrations_match_models`` fails until the two agree.

Conventions: ids of things operators type (devices, users) are strings; surrogate keys are
integers. Every time is a timezone-aware UTC datetime (:class:`UtcDateTime` stores UTC on
SQLite, which has no time zones). Enumerated values (roles, statuses) are short strings checked
in Python (``controlplane.auth.Role``, ``controlplane.enrollment.DeviceStatus``) so adding one
needs no table rebuild on SQLite. Secrets are never stored: tokens as SHA-256, passwords as
argon2id.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, ClassVar

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

BigId = BigInteger().with_variant(Integer(), "sqlite")
"""A 64-bit surrogate key that is still SQLite's ``INTEGER PRIMARY KEY`` (rowid alias)."""


class UtcDateTime(TypeDecorator[datetime]):
    """A timezone-aware datetime, stored as UTC; naive values are refused."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to a UTC column")
        value = value.astimezone(timezone.utc)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=timezone.utc)
        return value.astimezone(timezone.utc)


class Base(DeclarativeBase):
    """Declarative base; its ``metadata`` is what Alembic compares migrations against."""

    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map: ClassVar[dict[Any, Any]] = {
        datetime: UtcDateTime(),
        dict[str, Any]: JSON(),
    }


class User(Base):
    """An operator account. ``role`` is admin, operator or viewer."""

    __tablename__ = "users"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    username: Mapped[str] = mapped_column(String(64), unique=True)
    password_hash: Mapped[str] = mapped_column(String(255))
    role: Mapped[str] = mapped_column(String(16))
    disabled: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]


class ApiToken(Base):
    """A bearer token for the REST API (the CLI's credential), stored as its SHA-256."""

    __tablename__ = "api_tokens"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(64))
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime]
    expires_at: Mapped[datetime | None]
    last_used_at: Mapped[datetime | None]
    revoked_at: Mapped[datetime | None]


class EnrollmentToken(Base):
    """What ``mcp-agent enroll --token`` presents: scoped, counted, expiring, revocable."""

    __tablename__ = "enrollment_tokens"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(16))
    description: Mapped[str] = mapped_column(String(256), default="")
    group_name: Mapped[str | None] = mapped_column(String(64))
    labels: Mapped[dict[str, Any]] = mapped_column(default=dict)
    approval: Mapped[str] = mapped_column(String(16))
    max_uses: Mapped[int | None] = mapped_column(Integer)
    uses: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime]
    created_by: Mapped[str] = mapped_column(String(64))
    expires_at: Mapped[datetime | None]
    revoked_at: Mapped[datetime | None]


class Device(Base):
    """A device known to the control plane, in any status (preauthorized to revoked).

    ``online`` and ``last_seen_at`` belong to telemetry ingestion; enrollment only sets them
    at creation.
    """

    __tablename__ = "devices"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    public_key: Mapped[str] = mapped_column(String(64), unique=True)
    status: Mapped[str] = mapped_column(String(16), index=True)
    profile: Mapped[str | None] = mapped_column(String(64), index=True)
    group_name: Mapped[str | None] = mapped_column(String(64), index=True)
    facts: Mapped[dict[str, Any]] = mapped_column(default=dict)
    agent_version: Mapped[str] = mapped_column(String(64), default="")
    enrollment_token_id: Mapped[int | None] = mapped_column(
        ForeignKey("enrollment_tokens.id", ondelete="SET NULL")
    )
    online: Mapped[bool] = mapped_column(Boolean, default=False)
    last_seen_at: Mapped[datetime | None]
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]
    accepted_at: Mapped[datetime | None]
    revoked_at: Mapped[datetime | None]


class DeviceLabel(Base):
    """One ``key=value`` label of a device (a row each, so label filters use an index)."""

    __tablename__ = "device_labels"
    __table_args__ = (Index("ix_device_labels_key_value", "key", "value"),)

    device_id: Mapped[str] = mapped_column(
        ForeignKey("devices.id", ondelete="CASCADE"), primary_key=True
    )
    key: Mapped[str] = mapped_column(String(63), primary_key=True)
    value: Mapped[str] = mapped_column(String(128))


class EnrollmentNonce(Base):
    """A nonce seen in an enrollment request, kept until ``expires_at`` to refuse replays."""

    __tablename__ = "enrollment_nonces"

    nonce: Mapped[str] = mapped_column(String(128), primary_key=True)
    expires_at: Mapped[datetime] = mapped_column(index=True)


class AuditEntry(Base):
    """One change made through the API: who, what, to which object, when."""

    __tablename__ = "audit_log"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(index=True)
    actor: Mapped[str] = mapped_column(String(128))
    action: Mapped[str] = mapped_column(String(64), index=True)
    target_type: Mapped[str] = mapped_column(String(32))
    target_id: Mapped[str] = mapped_column(String(128))
    detail: Mapped[dict[str, Any]] = mapped_column(default=dict)


# ---------------------------------------------------------------------------- telemetry (0002)
# Written by ingestion (controlplane.ingest) in batches through Core inserts, never ORM adds.
# ``ts`` is the device's own clock; ``received_at`` is when the control plane took it.


def _device_fk() -> ForeignKey:
    return ForeignKey("devices.id", ondelete="CASCADE")


class HealthSampleRow(Base):
    """One health reading (``telemetry/health``); downsampled and expired by retention."""

    __tablename__ = "health_samples"
    __table_args__ = (
        Index("ix_health_samples_device_id_ts", "device_id", "ts"),
        Index("ix_health_samples_ts", "ts"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    device_id: Mapped[str] = mapped_column(String(64), _device_fk())
    ts: Mapped[datetime]
    cpu_percent: Mapped[float] = mapped_column(Float)
    load_1m: Mapped[float | None] = mapped_column(Float)
    mem_used_mb: Mapped[float] = mapped_column(Float)
    mem_total_mb: Mapped[float] = mapped_column(Float)
    disk_free_mb: Mapped[float | None] = mapped_column(Float)
    disk_total_mb: Mapped[float | None] = mapped_column(Float)
    process_rss_mb: Mapped[float | None] = mapped_column(Float)
    uptime_s: Mapped[float | None] = mapped_column(Float)
    temperatures_c: Mapped[dict[str, Any]] = mapped_column(default=dict)
    gpu: Mapped[dict[str, Any] | None] = mapped_column(JSON)


class InferenceStatsRow(Base):
    """Counters of one model version on one device over one reporting window."""

    __tablename__ = "inference_stats"
    __table_args__ = (
        Index("ix_inference_stats_device_id_ts", "device_id", "ts"),
        Index("ix_inference_stats_model_version_ts", "model", "version", "ts"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    device_id: Mapped[str] = mapped_column(String(64), _device_fk())
    ts: Mapped[datetime]
    window_s: Mapped[float] = mapped_column(Float)
    model: Mapped[str] = mapped_column(String(64))
    version: Mapped[str] = mapped_column(String(128))
    count: Mapped[int] = mapped_column(BigInteger)
    errors: Mapped[int] = mapped_column(BigInteger)
    rejections: Mapped[int] = mapped_column(BigInteger)
    p50_ms: Mapped[float | None] = mapped_column(Float)
    p95_ms: Mapped[float | None] = mapped_column(Float)
    p99_ms: Mapped[float | None] = mapped_column(Float)
    queue_depth: Mapped[int] = mapped_column(Integer)
    batch_size_avg: Mapped[float | None] = mapped_column(Float)
    batch_fill_ratio: Mapped[float | None] = mapped_column(Float)
    # 0007: which role the version had on the device (stable, canary, shadow; NULL: stable, as
    # reported before roles), its latency histogram ({"edges_ms": [...], "counts": [...]}) and,
    # for a shadow, how many of its answers were compared with the stable one and agreed.
    role: Mapped[str | None] = mapped_column(String(16))
    latency_hist: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    shadow_compared: Mapped[int | None] = mapped_column(BigInteger)
    shadow_agreed: Mapped[int | None] = mapped_column(BigInteger)


class DeploymentEventRow(Base):
    """One step of a deployment, stored once per ``(device_id, event_seq)`` (resends are no-ops)."""

    __tablename__ = "deployment_events"
    __table_args__ = (
        UniqueConstraint("device_id", "event_seq", name="uq_deployment_events_device_id_event_seq"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    device_id: Mapped[str] = mapped_column(String(64), _device_fk())
    event_seq: Mapped[int] = mapped_column(BigInteger)
    ts: Mapped[datetime]
    received_at: Mapped[datetime]
    model: Mapped[str] = mapped_column(String(64))
    version: Mapped[str] = mapped_column(String(128))
    phase: Mapped[str] = mapped_column(String(32))
    outcome: Mapped[str] = mapped_column(String(16))
    message: Mapped[str] = mapped_column(String(2048), default="")
    cause: Mapped[str | None] = mapped_column(String(64))
    bytes_done: Mapped[int | None] = mapped_column(BigInteger)
    bytes_total: Mapped[int | None] = mapped_column(BigInteger)
    elapsed_ms: Mapped[float | None] = mapped_column(Float)


class ReportedStateRow(Base):
    """The latest reported state of a device (its retained ``reported`` document)."""

    __tablename__ = "device_reported"

    device_id: Mapped[str] = mapped_column(String(64), _device_fk(), primary_key=True)
    ts: Mapped[datetime]
    received_at: Mapped[datetime]
    applied_seq: Mapped[int] = mapped_column(BigInteger)
    document: Mapped[dict[str, Any]] = mapped_column(default=dict)


class ReportedModelRow(Base):
    """One model in a device's latest reported state (migration ``0009``): its name, the
    version it reports active (None: none) and the variant and ``backend/provider`` that
    version runs as (migration ``0010``; None: not reported), kept with the document by
    ``controlplane.db.telemetry.upsert_reported`` so that filters on models and sync state are
    index lookups instead of reading every document."""

    __tablename__ = "device_reported_models"
    __table_args__ = (
        Index("ix_device_reported_models_model_active_version", "model", "active_version"),
    )

    device_id: Mapped[str] = mapped_column(String(64), _device_fk(), primary_key=True)
    model: Mapped[str] = mapped_column(String(64), primary_key=True)
    active_version: Mapped[str | None] = mapped_column(String(128))
    variant: Mapped[str | None] = mapped_column(String(64))
    backend: Mapped[str | None] = mapped_column(String(128))


# ---------------------------------------------------------------------------- registry (0003)
# The model registry behind the TUF repository (controlplane.repository): publisher keys,
# models and their versions. A version is one signed bundle, published as one TUF target.


class PublisherKey(Base):
    """A publisher (ML team) key allowed to sign bundles; listed in signed TUF targets."""

    __tablename__ = "publisher_keys"

    keyid: Mapped[str] = mapped_column(String(64), primary_key=True)
    public_key: Mapped[str] = mapped_column(String(64), unique=True)
    name: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime]
    revoked_at: Mapped[datetime | None]


class Model(Base):
    """A model name; its versions are :class:`ModelVersion` rows."""

    __tablename__ = "models"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    created_at: Mapped[datetime]


class ModelVersion(Base):
    """One published version of a model: a signed bundle stored as a TUF target.

    ``version_numeric`` is :func:`shared.version.parse`'s release counter (orders versions in
    SQL). ``profiles`` lists the hardware profiles some variant of the bundle fits (empty: any);
    ``variants`` is ``[{"name", "file", "sha256", "size", "profiles"}]`` from the manifest.
    """

    __tablename__ = "model_versions"
    __table_args__ = (UniqueConstraint("model", "version", name="uq_model_versions_model_version"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    model: Mapped[str] = mapped_column(String(64), ForeignKey("models.name", ondelete="CASCADE"))
    version: Mapped[str] = mapped_column(String(128))
    version_numeric: Mapped[int] = mapped_column(BigInteger)
    target_path: Mapped[str] = mapped_column(String(512), unique=True)
    sha256: Mapped[str] = mapped_column(String(64))
    length: Mapped[int] = mapped_column(BigInteger)
    format: Mapped[str] = mapped_column(String(16))
    profiles: Mapped[list[str]] = mapped_column(JSON, default=list)
    variants: Mapped[list[dict[str, Any]]] = mapped_column(JSON, default=list)
    publisher_keyid: Mapped[str] = mapped_column(String(64))
    uploaded_by: Mapped[str] = mapped_column(String(128), default="")
    created_at: Mapped[datetime]
    # 0008: the manifest's ``drift_baseline`` (JSON), NULL for a bundle without one.
    drift_baseline: Mapped[dict[str, Any] | None] = mapped_column(JSON)


# ---------------------------------------------------------------------------- deployments (0004)
# What operators asked for (deployments), what each device should run now (device_models), and
# the signed desired-state document each device was last given (desired_states).


class DeploymentRow(Base):
    """One operator action: deploy (``version`` set) or undeploy a model to a selector.

    Exactly one of ``device_id``, ``group_name``, ``labels`` names the selector. Group and label
    deployments stand: a device accepted later into the group (or with the labels) gets the
    newest one of each model.
    """

    __tablename__ = "deployments"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    action: Mapped[str] = mapped_column(String(16))
    model: Mapped[str] = mapped_column(String(64), index=True)
    version: Mapped[str | None] = mapped_column(String(128))
    device_id: Mapped[str | None] = mapped_column(String(64))
    group_name: Mapped[str | None] = mapped_column(String(64), index=True)
    labels: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    canary_version: Mapped[str | None] = mapped_column(String(128))
    canary_weight: Mapped[float | None] = mapped_column(Float)
    canary_max_error_rate: Mapped[float | None] = mapped_column(Float)  # 0006; NULL: default
    canary_min_requests: Mapped[int | None] = mapped_column(Integer)  # 0006; NULL: default
    shadow_version: Mapped[str | None] = mapped_column(String(128))
    rollback: Mapped[bool] = mapped_column(Boolean, default=False)
    created_by: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[datetime]
    devices_matched: Mapped[int] = mapped_column(Integer, default=0)
    prefetch_version: Mapped[str | None] = mapped_column(String(128))  # 0007
    rollout_id: Mapped[int | None] = mapped_column(BigId, index=True)  # 0007: made by a rollout


class DeviceModelRow(Base):
    """What one device should run of one model now (the source of its desired state)."""

    __tablename__ = "device_models"

    device_id: Mapped[str] = mapped_column(String(64), _device_fk(), primary_key=True)
    model: Mapped[str] = mapped_column(String(64), primary_key=True)
    stable_version: Mapped[str] = mapped_column(String(128))
    canary_version: Mapped[str | None] = mapped_column(String(128))
    canary_weight: Mapped[float | None] = mapped_column(Float)
    canary_max_error_rate: Mapped[float | None] = mapped_column(Float)  # 0006; NULL: default
    canary_min_requests: Mapped[int | None] = mapped_column(Integer)  # 0006; NULL: default
    shadow_version: Mapped[str | None] = mapped_column(String(128))
    rollback: Mapped[bool] = mapped_column(Boolean, default=False)
    prefetch_version: Mapped[str | None] = mapped_column(String(128))  # 0007
    deployment_id: Mapped[int | None] = mapped_column(
        BigId, ForeignKey("deployments.id", ondelete="SET NULL")
    )
    updated_at: Mapped[datetime]


class DesiredStateRow(Base):
    """The last signed desired state of a device. ``published_at`` None: not yet on the broker.

    ``refresh_at`` (half the document's lifetime) is when it is re-signed with the next seq.
    """

    __tablename__ = "desired_states"

    device_id: Mapped[str] = mapped_column(String(64), _device_fk(), primary_key=True)
    seq: Mapped[int] = mapped_column(BigInteger)
    envelope: Mapped[dict[str, Any]] = mapped_column(default=dict)
    issued_at: Mapped[datetime]
    expires_at: Mapped[datetime]
    refresh_at: Mapped[datetime] = mapped_column(index=True)
    published_at: Mapped[datetime | None]


# ---------------------------------------------------------------------------- applications (0005)


class AppClient(Base):
    """An application's MQTT account (``app-{client_id}`` at the broker): it may send inference
    requests and read its own reply topic. The password is never stored; a revoked row is kept
    for the audit trail and its client id is not given out again."""

    __tablename__ = "app_clients"

    client_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    description: Mapped[str] = mapped_column(String(256), default="")
    created_by: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[datetime]
    revoked_at: Mapped[datetime | None]


# ---------------------------------------------------------------------------- rollouts (0007)
# A staged rollout (controlplane.rollouts): its spec and engine state, where each target device
# stands, every decision taken (the history), and webhook deliveries waiting to go out.


class RolloutRow(Base):
    """One rollout. ``spec`` is what the operator asked (validated), ``state`` the engine's
    state without the devices (those are :class:`RolloutDeviceRow`). ``step_seq`` grows on
    every step written: a replica writes a step only over the ``step_seq`` it read, so a step
    is never applied twice. ``lease_owner``/``lease_until``: the replica driving it."""

    __tablename__ = "rollouts"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    model: Mapped[str] = mapped_column(String(64), index=True)
    version: Mapped[str] = mapped_column(String(128))
    status: Mapped[str] = mapped_column(String(24), index=True)
    stage: Mapped[int] = mapped_column(Integer, default=0)
    spec: Mapped[dict[str, Any]] = mapped_column(default=dict)
    state: Mapped[dict[str, Any]] = mapped_column(default=dict)
    target_devices: Mapped[int] = mapped_column(Integer, default=0)
    created_by: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]
    ended_at: Mapped[datetime | None]
    step_seq: Mapped[int] = mapped_column(BigInteger, default=0)
    lease_owner: Mapped[str | None] = mapped_column(String(128))
    lease_until: Mapped[datetime | None]


class RolloutDeviceRow(Base):
    """Where one target device stands in a rollout. ``moves``: how many times it was told to
    run the new version (a device is moved once per rollout unless it was reverted)."""

    __tablename__ = "rollout_devices"
    __table_args__ = (Index("ix_rollout_devices_device_id", "device_id"),)

    rollout_id: Mapped[int] = mapped_column(
        BigId, ForeignKey("rollouts.id", ondelete="CASCADE"), primary_key=True
    )
    device_id: Mapped[str] = mapped_column(String(64), _device_fk(), primary_key=True)
    stage: Mapped[int] = mapped_column(Integer)
    phase: Mapped[str] = mapped_column(String(16))
    since: Mapped[datetime]
    told_at: Mapped[datetime | None]
    from_version: Mapped[str | None] = mapped_column(String(128))
    mode: Mapped[str | None] = mapped_column(String(16))
    moves: Mapped[int] = mapped_column(Integer, default=0)


class RolloutEventRow(Base):
    """One decision or operator action on a rollout: its history, with who and why."""

    __tablename__ = "rollout_events"
    __table_args__ = (Index("ix_rollout_events_rollout_id_id", "rollout_id", "id"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    rollout_id: Mapped[int] = mapped_column(BigId, ForeignKey("rollouts.id", ondelete="CASCADE"))
    at: Mapped[datetime]
    kind: Mapped[str] = mapped_column(String(32))
    stage: Mapped[int | None] = mapped_column(Integer)
    actor: Mapped[str] = mapped_column(String(128))
    reason: Mapped[str] = mapped_column(String(2048), default="")
    detail: Mapped[dict[str, Any]] = mapped_column(default=dict)


class WebhookDeliveryRow(Base):
    """One event for one configured webhook, kept until delivered (or given up on)."""

    __tablename__ = "webhook_deliveries"
    __table_args__ = (Index("ix_webhook_deliveries_pending", "delivered_at", "next_attempt_at"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    event_id: Mapped[str] = mapped_column(String(64))
    webhook: Mapped[str] = mapped_column(String(64))
    event: Mapped[str] = mapped_column(String(64))
    body: Mapped[dict[str, Any]] = mapped_column(default=dict)
    created_at: Mapped[datetime]
    next_attempt_at: Mapped[datetime]
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    delivered_at: Mapped[datetime | None]
    failed_at: Mapped[datetime | None]
    last_error: Mapped[str] = mapped_column(String(512), default="")


# ---------------------------------------------------------------------------- drift (0008)
# Drift reports as devices sent them (counts on the version baseline's bins), fleet aggregates
# per (model, version, time bucket) with the PSI of the summed counts, the rules that raise
# retraining triggers, the triggers, and the hard examples devices upload for a trigger.


class DriftReportRow(Base):
    """One accepted drift report of a device. The scores are the control plane's own, computed
    from ``counts`` (``{"features": {name: [...]}, "classes": [...], "confidence": [...]}``)
    against the version's baseline; window times are the device's clock (Unix seconds)."""

    __tablename__ = "drift_reports"
    __table_args__ = (
        Index("ix_drift_reports_model_version_received_at", "model", "version", "received_at"),
        Index("ix_drift_reports_device_id_received_at", "device_id", "received_at"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    device_id: Mapped[str] = mapped_column(String(64), _device_fk())
    model: Mapped[str] = mapped_column(String(64))
    version: Mapped[str] = mapped_column(String(128))
    role: Mapped[str] = mapped_column(String(16))
    received_at: Mapped[datetime]
    window_start: Mapped[float] = mapped_column(Float)
    window_end: Mapped[float] = mapped_column(Float)
    samples: Mapped[int] = mapped_column(BigInteger)
    sample_every: Mapped[int] = mapped_column(Integer)
    score: Mapped[float | None] = mapped_column(Float)
    input_psi: Mapped[float | None] = mapped_column(Float)
    class_psi: Mapped[float | None] = mapped_column(Float)
    confidence_psi: Mapped[float | None] = mapped_column(Float)
    counts: Mapped[dict[str, Any]] = mapped_column(default=dict)
    hard_examples: Mapped[int] = mapped_column(Integer, default=0)


class DriftAggregateRow(Base):
    """The fleet's summed counts of one model version over one time bucket (``bucket_s`` long,
    by receive time), with the PSI of the sum; ``figures`` is the full score (per-feature PSI).
    A bucket is its start and its length: after a rule's window changes, the new buckets never
    add to an old one that starts at the same instant.
    ``over``: the bucket met its rule when last scored."""

    __tablename__ = "drift_aggregates"

    model: Mapped[str] = mapped_column(String(64), primary_key=True)
    version: Mapped[str] = mapped_column(String(128), primary_key=True)
    bucket_start: Mapped[datetime] = mapped_column(primary_key=True)
    bucket_s: Mapped[int] = mapped_column(Integer, primary_key=True)
    samples: Mapped[int] = mapped_column(BigInteger)
    reports: Mapped[int] = mapped_column(BigInteger)
    devices: Mapped[int] = mapped_column(Integer)
    counts: Mapped[dict[str, Any]] = mapped_column(default=dict)
    score: Mapped[float | None] = mapped_column(Float)
    input_psi: Mapped[float | None] = mapped_column(Float)
    class_psi: Mapped[float | None] = mapped_column(Float)
    confidence_psi: Mapped[float | None] = mapped_column(Float)
    figures: Mapped[dict[str, Any]] = mapped_column(default=dict)
    over: Mapped[bool] = mapped_column(Boolean, default=False)
    updated_at: Mapped[datetime]


class DriftRuleRow(Base):
    """When a model's drift raises a retraining trigger; ``model`` ``*`` is the default rule."""

    __tablename__ = "drift_rules"

    model: Mapped[str] = mapped_column(String(64), primary_key=True)
    threshold: Mapped[float] = mapped_column(Float, default=0.2)
    metric: Mapped[str] = mapped_column(String(32), default="input_psi")
    min_devices: Mapped[int] = mapped_column(Integer)
    min_samples: Mapped[int] = mapped_column(BigInteger)
    sustained: Mapped[int] = mapped_column(Integer)
    cooldown_s: Mapped[int] = mapped_column(Integer)
    window_s: Mapped[int] = mapped_column(Integer)
    enabled: Mapped[bool] = mapped_column(Boolean, default=True)
    collect_hard_examples: Mapped[bool] = mapped_column(Boolean, default=False)
    updated_at: Mapped[datetime]
    updated_by: Mapped[str] = mapped_column(String(128))


class RetrainingTriggerRow(Base):
    """A retraining trigger: a model version's fleet drift stayed over its rule. ``figures``:
    the aggregate's scores when raised; ``rule``: the rule as applied; ``device_ids``: the
    devices that reported in the buckets over the rule (at most 1,000 listed)."""

    __tablename__ = "retraining_triggers"
    __table_args__ = (
        Index("ix_retraining_triggers_model_version_raised_at", "model", "version", "raised_at"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    model: Mapped[str] = mapped_column(String(64))
    version: Mapped[str] = mapped_column(String(128))
    raised_at: Mapped[datetime]
    status: Mapped[str] = mapped_column(String(16), index=True)
    score: Mapped[float | None] = mapped_column(Float)
    figures: Mapped[dict[str, Any]] = mapped_column(default=dict)
    rule: Mapped[dict[str, Any]] = mapped_column(default=dict)
    device_count: Mapped[int] = mapped_column(Integer)
    device_ids: Mapped[list[str]] = mapped_column(JSON, default=list)
    acknowledged_at: Mapped[datetime | None]
    acknowledged_by: Mapped[str | None] = mapped_column(String(128))
    note: Mapped[str] = mapped_column(Text, default="")


class HardExampleRow(Base):
    """One low-confidence input a device uploaded (raw little-endian tensor bytes) and the
    model's output for it; ``sha256`` is of ``input_data``. ``device_ts``: the device's clock."""

    __tablename__ = "hard_examples"
    __table_args__ = (
        Index("ix_hard_examples_model_version_received_at", "model", "version", "received_at"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    trigger_id: Mapped[int | None] = mapped_column(
        BigId, ForeignKey("retraining_triggers.id", ondelete="CASCADE"), index=True
    )
    device_id: Mapped[str] = mapped_column(String(64))
    model: Mapped[str] = mapped_column(String(64))
    version: Mapped[str] = mapped_column(String(128))
    device_ts: Mapped[float] = mapped_column(Float)
    received_at: Mapped[datetime]
    confidence: Mapped[float] = mapped_column(Float)
    predicted: Mapped[int | None] = mapped_column(Integer)
    input_name: Mapped[str] = mapped_column(String(256))
    input_datatype: Mapped[str] = mapped_column(String(8))
    input_shape: Mapped[list[int]] = mapped_column(JSON, default=list)
    input_data: Mapped[bytes] = mapped_column(LargeBinary)
    output_name: Mapped[str | None] = mapped_column(String(256))
    output_datatype: Mapped[str | None] = mapped_column(String(8))
    output_shape: Mapped[list[int] | None] = mapped_column(JSON)
    output_data: Mapped[bytes | None] = mapped_column(LargeBinary)
    sha256: Mapped[str] = mapped_column(String(64))


# ---------------------------------------------------------------------------- broker accounts (0011)


class BrokerAccountRow(Base):
    """An MQTT account kept for brokers that ask the control plane who may connect and what
    it may do (:mod:`controlplane.broker.http_auth`): ``kind`` is device, service or app, the
    account may connect with ``client_id`` only, and its password is kept as a salted scrypt
    hash. The topics it may use are not stored: they follow from ``kind`` and ``client_id``
    (:mod:`controlplane.broker.acl`)."""

    __tablename__ = "broker_accounts"

    username: Mapped[str] = mapped_column(String(80), primary_key=True)
    client_id: Mapped[str] = mapped_column(String(64), unique=True)
    kind: Mapped[str] = mapped_column(String(16))
    password_hash: Mapped[str] = mapped_column(String(255))
    enabled: Mapped[bool] = mapped_column(Boolean, default=True)
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]
