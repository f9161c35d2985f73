"""Drift and retraining triggers (docs/drift.md): the fleet's figures, rules, triggers.

    GET    /api/v1/drift?model=&version=&device=&since=&until=   viewer: a model's buckets per
                                                  version over time (per-feature PSI); with
                                                  device=, that device's reports instead
    GET    /api/v1/drift/rules                    viewer: every stored rule
    GET    /api/v1/drift/default-rule             viewer: the default rule (model ``*``)
    PUT    /api/v1/drift/default-rule             operator: change it
    GET    /api/v1/drift/rules/{model}            viewer: the rule in force for a model
    PUT    /api/v1/drift/rules/{model}            operator: give a model its own rule
    DELETE /api/v1/drift/rules/{model}            operator: back to the default rule
    GET    /api/v1/drift/triggers                 viewer: newest first, ?model=&version=&status=
    GET    /api/v1/drift/triggers/{trigger_id}    viewer: one trigger with its figures
    POST   /api/v1/drift/triggers/{trigger_id}/acknowledge   operator: with a note

A PUT names only the settings it changes; the others keep the values of the rule in force.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from aiohttp import web
from pydantic import Field, StringConstraints

from mcp_edge.controlplane.api.common import (
    ApiError,
    Endpoint,
    json_response,
    path_int,
    read_body,
    read_query,
)
from mcp_edge.controlplane.api.schemas import Request, Response, RowId
from mcp_edge.controlplane.auth import Role, principal_of
from mcp_edge.controlplane.db.drift import AggregateView, ReportView, TriggerView
from mcp_edge.controlplane.drift import rules as bounds
from mcp_edge.controlplane.drift.admin import (
    DriftAdmin,
    DriftAdminError,
    InvalidRuleError,
    RuleInForce,
    RuleNotFoundError,
    TriggerNotFoundError,
)
from mcp_edge.controlplane.drift.rules import DEFAULT_MODEL
from mcp_edge.controlplane.drift.service import TRIGGER_PATH
from mcp_edge.shared.errors import TopicError
from mcp_edge.shared.protocol.base import Identifier
from mcp_edge.shared.protocol.command import ErrorCode
from mcp_edge.shared.protocol.topics import validate_id
from mcp_edge.shared.version import MAX_VERSION_LENGTH, SEMVER_PATTERN

DRIFT_ADMIN = web.AppKey("drift_admin", DriftAdmin)
Semver = Annotated[str, StringConstraints(pattern=SEMVER_PATTERN, max_length=MAX_VERSION_LENGTH)]
Metric = Literal["score", "input_psi", "max_feature_psi", "class_psi", "confidence_psi"]


# ---------------------------------------------------------------------------- schemas
class DriftQuery(Request):
    model: Identifier
    version: Semver | None = None
    device: Identifier | None = Field(
        default=None, description="this device's reports instead of the fleet's buckets"
    )
    since: datetime | None = Field(default=None, description="from this time (inclusive)")
    until: datetime | None = Field(default=None, description="to this time (exclusive)")
    limit: Annotated[int, Field(ge=1, le=10_000)] = 1000


class BucketOut(Response):
    """One version's summed reports over one bucket, scored as a whole (PSI of the sum)."""

    version: str
    bucket_start: datetime
    bucket_s: int
    samples: int
    reports: int
    devices: int
    score: float | None
    input_psi: float | None
    class_psi: float | None
    confidence_psi: float | None
    max_feature_psi: float | None
    features: dict[str, float | None] = Field(description="PSI per feature")
    top_features: list[tuple[str, float]] = Field(description="the most drifted, largest first")
    over: bool = Field(description="over the model's rule when last scored")


class ReportOut(Response):
    """One stored report of a device (scores recomputed by the control plane)."""

    id: int
    version: str
    role: str
    received_at: datetime
    window_start: float
    window_end: float
    samples: int
    sample_every: int
    score: float | None
    input_psi: float | None
    class_psi: float | None
    confidence_psi: float | None
    counts: dict[str, Any]
    hard_examples: int


class DriftOut(Response):
    model: str
    version: str | None
    device: str | None
    buckets: list[BucketOut]
    reports: list[ReportOut]


class RuleIn(Request):
    """Settings to change; those left out keep the values of the rule in force."""

    threshold: float | None = Field(
        default=None, gt=0, le=bounds.MAX_THRESHOLD, description="a bucket is over above this"
    )
    metric: Metric | None = None
    min_devices: int | None = Field(default=None, ge=1, le=bounds.MAX_DEVICES)
    min_samples: int | None = Field(default=None, ge=1, le=bounds.MAX_SAMPLES)
    sustained: int | None = Field(
        default=None, ge=1, le=bounds.MAX_SUSTAINED, description="buckets over in a row"
    )
    cooldown_s: int | None = Field(default=None, ge=0, le=bounds.MAX_COOLDOWN_S)
    window_s: int | None = Field(
        default=None, ge=bounds.MIN_WINDOW_S, le=bounds.MAX_WINDOW_S, description="bucket length"
    )
    enabled: bool | None = None
    collect_hard_examples: bool | None = None


class RuleOut(Response):
    model: str = Field(description="the model, or * for the default rule")
    source: str = Field(description="model (its own rule), default (the * rule) or builtin")
    threshold: float
    metric: str
    min_devices: int
    min_samples: int
    sustained: int
    cooldown_s: int
    window_s: int
    enabled: bool
    collect_hard_examples: bool
    updated_at: datetime | None
    updated_by: str | None


class RuleList(Response):
    items: list[RuleOut]


class TriggerQuery(Request):
    model: Identifier | None = None
    version: Semver | None = None
    status: Literal["open", "acknowledged"] | None = None
    before_id: RowId | None = None
    limit: Annotated[int, Field(ge=1, le=1000)] = 100


class TriggerOut(Response):
    id: int
    model: str
    version: str
    raised_at: datetime
    status: str = Field(description="open or acknowledged")
    score: float | None
    figures: dict[str, Any]
    rule: dict[str, Any]
    device_count: int
    device_ids: list[str] = Field(description="at most 1,000")
    acknowledged_at: datetime | None
    acknowledged_by: str | None
    note: str
    url: str


class TriggerResult(Response):
    trigger: TriggerOut


class TriggerList(Response):
    items: list[TriggerOut]


class AcknowledgeBody(Request):
    note: Annotated[str, StringConstraints(max_length=2048)] = ""


# ---------------------------------------------------------------------------- conversions
def bucket_out(b: AggregateView) -> BucketOut:
    f = b.figures
    return BucketOut(
        version=b.version, bucket_start=b.bucket_start, bucket_s=b.bucket_s, samples=b.samples,
        reports=b.reports, devices=b.devices, score=b.score, input_psi=b.input_psi,
        class_psi=b.class_psi, confidence_psi=b.confidence_psi,
        max_feature_psi=f.get("max_feature_psi"), features=dict(f.get("features") or {}),
        top_features=[(str(n), float(v)) for n, v in f.get("top_features") or []], over=b.over,
    )  # fmt: skip


def report_out(r: ReportView) -> ReportOut:
    return ReportOut.model_validate(r)


def rule_out(r: RuleInForce) -> RuleOut:
    return RuleOut(source=r.source, updated_at=r.updated_at, updated_by=r.updated_by,
                   **r.rule.as_dict())  # fmt: skip


def trigger_out(t: TriggerView) -> TriggerOut:
    return TriggerOut(url=TRIGGER_PATH.format(id=t.id), **t.__dict__)


# ---------------------------------------------------------------------------- handlers
def admin_of(app: web.Application) -> DriftAdmin:
    """The app's :class:`DriftAdmin` (the API and the console share it); raises
    :class:`ApiError` when there is none."""
    admin = app.get(DRIFT_ADMIN)
    if admin is None:
        raise ApiError(ErrorCode.UNAVAILABLE, "drift is not set up on this control plane")
    return admin


def _admin(request: web.Request) -> DriftAdmin:
    return admin_of(request.app)


def admin_error(e: DriftAdminError) -> ApiError:
    """What a :class:`DriftAdminError` is answered with: 404 for what does not exist, else
    400."""
    if isinstance(e, (TriggerNotFoundError, RuleNotFoundError)):
        return ApiError(ErrorCode.NOT_FOUND, str(e))
    return ApiError(ErrorCode.BAD_REQUEST, str(e))


async def drift_figures(request: web.Request) -> web.Response:
    query = read_query(request, DriftQuery)
    admin = _admin(request)
    window: dict[str, Any] = {"version": query.version, "since": query.since, "until": query.until,
              "limit": query.limit}  # fmt: skip
    buckets: list[BucketOut] = []
    reports: list[ReportOut] = []
    if query.device is not None:
        rows = await admin.reports(query.device, model=query.model, **window)
        reports = [report_out(r) for r in rows]
    else:
        buckets = [bucket_out(b) for b in await admin.buckets(query.model, **window)]
    return json_response(DriftOut(model=query.model, version=query.version,
                                  device=query.device, buckets=buckets, reports=reports))  # fmt: skip


async def list_rules(request: web.Request) -> web.Response:
    return json_response(RuleList(items=[rule_out(r) for r in await _admin(request).rules()]))


def _model(request: web.Request) -> str:
    """The path's model (``*`` on the default rule's path); one that is not an identifier
    names nothing (404, like any other unknown id)."""
    model = request.match_info.get("model", DEFAULT_MODEL)
    if model != DEFAULT_MODEL or "model" in request.match_info:
        try:
            validate_id(model, "model")
        except TopicError as e:
            raise ApiError(ErrorCode.NOT_FOUND, str(e)) from e
    return model


async def get_rule(request: web.Request) -> web.Response:
    return json_response(rule_out(await _admin(request).rule(_model(request))))


async def put_rule(request: web.Request) -> web.Response:
    body = await read_body(request, RuleIn)
    changes = body.model_dump(exclude_none=True)
    try:
        rule = await _admin(request).set_rule(
            _model(request), changes, actor=principal_of(request).actor
        )
    except InvalidRuleError as e:
        raise admin_error(e) from e
    return json_response(rule_out(rule))


async def get_default_rule(request: web.Request) -> web.Response:
    return await get_rule(request)


async def put_default_rule(request: web.Request) -> web.Response:
    return await put_rule(request)


async def delete_rule(request: web.Request) -> web.Response:
    try:
        rule = await _admin(request).delete_rule(_model(request), actor=principal_of(request).actor)
    except DriftAdminError as e:
        raise admin_error(e) from e
    return json_response(rule_out(rule))


async def list_triggers(request: web.Request) -> web.Response:
    query = read_query(request, TriggerQuery)
    found = await _admin(request).triggers(
        model=query.model, version=query.version, status=query.status,
        before_id=query.before_id, limit=query.limit,
    )  # fmt: skip
    return json_response(TriggerList(items=[trigger_out(t) for t in found]))


async def get_trigger(request: web.Request) -> web.Response:
    try:
        found = await _admin(request).trigger(path_int(request, "trigger_id"))
    except DriftAdminError as e:
        raise admin_error(e) from e
    return json_response(TriggerResult(trigger=trigger_out(found)))


async def acknowledge(request: web.Request) -> web.Response:
    trigger_id = path_int(request, "trigger_id")
    body = await read_body(request, AcknowledgeBody)
    try:
        found = await _admin(request).acknowledge(
            trigger_id, actor=principal_of(request).actor, note=body.note
        )
    except DriftAdminError as e:
        raise admin_error(e) from e
    return json_response(TriggerResult(trigger=trigger_out(found)))


_RULE = "/api/v1/drift/rules/{model}"
_DEFAULT = "/api/v1/drift/default-rule"
_TRIGGER = "/api/v1/drift/triggers/{trigger_id}"

ENDPOINTS = [
    Endpoint("GET", "/api/v1/drift", drift_figures,
             "A model's drift per version over time (or one device's reports)", Role.VIEWER,
             "drift", query=DriftQuery, response=DriftOut),
    Endpoint("GET", "/api/v1/drift/rules", list_rules, "Every stored drift rule", Role.VIEWER,
             "drift", response=RuleList),
    Endpoint("GET", _DEFAULT, get_default_rule, "The default drift rule (models without their own)",
             Role.VIEWER, "drift", response=RuleOut),
    Endpoint("PUT", _DEFAULT, put_default_rule, "Change the default drift rule", Role.OPERATOR,
             "drift", body=RuleIn, response=RuleOut),
    Endpoint("GET", _RULE, get_rule, "The drift rule in force for a model", Role.VIEWER,
             "drift", response=RuleOut),
    Endpoint("PUT", _RULE, put_rule, "Give a model its own drift rule", Role.OPERATOR,
             "drift", body=RuleIn, response=RuleOut),
    Endpoint("DELETE", _RULE, delete_rule, "Remove a model's own drift rule (the default "
             "applies again)", Role.OPERATOR, "drift", response=RuleOut,
             answers={404: "the model has no drift rule of its own"}),
    Endpoint("GET", "/api/v1/drift/triggers", list_triggers,
             "Retraining triggers, newest first", Role.VIEWER, "drift", query=TriggerQuery,
             response=TriggerList),
    Endpoint("GET", _TRIGGER, get_trigger, "A retraining trigger with its figures",
             Role.VIEWER, "drift", response=TriggerResult),
    Endpoint("POST", f"{_TRIGGER}/acknowledge", acknowledge,
             "Acknowledge a retraining trigger, with a note", Role.OPERATOR, "drift",
             body=AcknowledgeBody, response=TriggerResult),
]  # fmt: skip
