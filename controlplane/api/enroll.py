"""``POST /api/v1/enroll``: a device joins the fleet (DESIGN 4.1 steps 2-3).

The body is the signed envelope of :func:`shared.protocol.enrollment.sign_enrollment`; no API
token is needed (the enrollment token is inside, and the signature proves the device holds the
key it names). ``?force=true`` re-enrolls an accepted device (fresh facts and credentials).

This handler reads the query and the body (413, 415, 400 before anything else) and hands the
envelope to :class:`~controlplane.enrollment_service.EnrollmentService`, which lives in
``app[ENROLLMENT]`` and does the checks in order, cheapest refusal first: envelope and schema
(400), signature (401), clock skew (400), nonce (409, replay), token (403), device state (403),
device id clash (409), broker (503, nothing committed). Its errors become answers in
:mod:`controlplane.api.common`.
"""

from __future__ import annotations

from aiohttp import web
from pydantic import BaseModel, ConfigDict

from mcp_edge.controlplane.api.common import ApiError, Endpoint, read_json, read_query
from mcp_edge.controlplane.api.schemas import SignedEnrollment
from mcp_edge.controlplane.enrollment_service import EnrollmentService
from mcp_edge.shared.protocol.codec import encode
from mcp_edge.shared.protocol.enrollment import EnrollmentAnswer, EnrollmentRequest

ENROLLMENT = web.AppKey("enrollment", EnrollmentService)


class EnrollQuery(BaseModel):
    model_config = ConfigDict(extra="forbid")
    force: bool = False


def enrollment(request: web.Request) -> EnrollmentService:
    return request.app[ENROLLMENT]


async def enroll(request: web.Request) -> web.Response:
    service = enrollment(request)
    try:
        force = read_query(request, EnrollQuery).force
        envelope = await read_json(request, EnrollmentRequest.MAX_BYTES)
    except ApiError:
        service.count_unreadable()
        raise
    answer = await service.enroll(envelope, force=force)
    return web.Response(body=encode(answer), status=200, content_type="application/json")


ENDPOINTS = [
    Endpoint(
        "POST",
        "/api/v1/enroll",
        enroll,
        "Enroll a device with a signed request (no API token; ?force=true re-enrolls)",
        None,
        "enrollment",
        body=SignedEnrollment,
        query=EnrollQuery,
        response=EnrollmentAnswer,
        max_body=EnrollmentRequest.MAX_BYTES,
        answers={
            401: "the signature does not verify with the key the request names",
            403: "the enrollment token or the device's state refuses it",
            409: "the request was seen before (replay), or the device id is taken",
            503: "database or broker unavailable; nothing changed, retry later",
        },
    ),
]
