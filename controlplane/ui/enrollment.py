"""Console pages: enrollment (``/ui/enrollment``).

    GET  /ui/enrollment                                 tokens, devices waiting, the forms
    POST /ui/enrollment/tokens                          operator: create a token; the answer
                                                        shows its secret, once
    POST /ui/enrollment/tokens/{token_id}/revoke        operator
    POST /ui/enrollment/approvals/{device_id}/approve   operator: pending → accepted
    POST /ui/enrollment/approvals/{device_id}/reject    operator: pending → rejected
    POST /ui/enrollment/preauthorize                    operator: accept a public key in advance

Each change is the REST API's own: :func:`controlplane.api.tokens.create_enrollment_token`
and :func:`~controlplane.api.tokens.revoke_enrollment_token` for tokens, the
:class:`~controlplane.enrollment_service.EnrollmentService` (``app[ENROLLMENT]``) for
approvals and preauthorizations, with the same audit entries. Form fields are validated by the
API's request schemas (:class:`EnrollmentTokenCreate`, :class:`PreauthorizeRequest`).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from aiohttp import web

from mcp_edge.controlplane.api.approvals import pending_devices
from mcp_edge.controlplane.api.common import ApiError, validated
from mcp_edge.controlplane.api.enroll import enrollment
from mcp_edge.controlplane.api.schemas import EnrollmentTokenCreate, PreauthorizeRequest
from mcp_edge.controlplane.api.tokens import (
    create_enrollment_token,
    revoke_enrollment_token,
    token_out,
)
from mcp_edge.controlplane.auth import Role
from mcp_edge.controlplane.db import enrollment as token_q
from mcp_edge.controlplane.enrollment import Approval
from mcp_edge.controlplane.enrollment_service import (
    DeviceNotFoundError,
    EnrollmentConflictError,
    EnrollmentError,
)
from mcp_edge.controlplane.settings import EnrollmentApproval
from mcp_edge.controlplane.ui.core import Ctx, Page, UiError
from mcp_edge.shared.errors import ProtocolError

NAV = "enrollment"
HOME = "/ui/enrollment"
EXPIRY_CHOICES = (
    ("3600", "1 hour"),
    ("86400", "1 day"),
    ("604800", "7 days"),
    ("2592000", "30 days"),
    ("31536000", "1 year"),
    ("never", "Never"),
)
DEFAULT_EXPIRY = "604800"
APPROVAL_WAIT_S = 600
"""``--wait`` in the enroll line of a token whose devices wait for an operator (seconds)."""
MAX_PATH_ID = 64
_HOST = re.compile(r"^(?:[A-Za-z0-9.-]{1,253}|\[[0-9A-Fa-f:.]{2,45}\])(?::[0-9]{1,5})?$")
TOKEN_FIELDS = ("description", "group", "labels", "max_uses", "expires_in_s", "approval")
PREAUTH_FIELDS = ("public_key", "device_id", "group", "labels")
FORM_ERRORS = (ApiError, UiError, ProtocolError)
"""What a form the schemas refuse raises (an identifier's own check raises ProtocolError)."""


# ---------------------------------------------------------------------------- inputs
def parse_label_lines(text: str) -> dict[str, str]:
    """Labels typed one ``key=value`` per line (blank lines skipped); the schema checks keys
    and values. Raises :class:`UiError` for a line without ``=`` or a key given twice."""
    labels: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        key, sep, value = line.strip().partition("=")
        key = key.strip()
        if not line.strip():
            continue
        if not sep or not key:
            raise UiError(f"labels, line {number}: {line.strip()[:60]!r} is not key=value")
        if key in labels:
            raise UiError(f"labels, line {number}: {key[:63]!r} is given twice")
        labels[key] = value.strip()
    return labels


def _token_request(ctx: Ctx) -> EnrollmentTokenCreate:
    """The create-token form as the API's request body; raises ApiError/UiError (400)."""
    body: dict[str, Any] = {
        "description": ctx.field("description"),
        "labels": parse_label_lines(ctx.field("labels")),
        "approval": ctx.field("approval", Approval.AUTO.value),
    }
    if group := ctx.field("group"):
        body["group"] = group
    if max_uses := ctx.field("max_uses"):
        body["max_uses"] = max_uses
    expiry = ctx.field("expires_in_s", DEFAULT_EXPIRY)
    body["expires_in_s"] = None if expiry == "never" else expiry
    return validated(body, EnrollmentTokenCreate)


def _preauthorize_request(ctx: Ctx) -> PreauthorizeRequest:
    body: dict[str, Any] = {
        "public_key": ctx.field("public_key").lower(),
        "labels": parse_label_lines(ctx.field("labels")),
    }
    for name in ("device_id", "group"):
        if value := ctx.field(name):
            body[name] = value
    return validated(body, PreauthorizeRequest)


def _path_device(ctx: Ctx) -> str:
    device_id = ctx.request.match_info["device_id"]
    if not device_id or len(device_id) > MAX_PATH_ID:
        raise UiError("no such device", status=404)
    return device_id


@contextmanager
def _enrollment_refusals() -> Iterator[None]:
    """The enrollment service's refusals as error pages with the REST API's statuses."""
    try:
        yield
    except DeviceNotFoundError as e:
        raise UiError(str(e), status=404) from e
    except EnrollmentConflictError as e:
        raise UiError(str(e), status=409) from e
    except EnrollmentError as e:
        raise UiError(str(e), status=400) from e


# ---------------------------------------------------------------------------- the enroll line
def control_plane_url(request: web.Request) -> str:
    """This control plane's URL as the browser reached it (scheme and Host), or, when the Host
    header is not a plain host[:port], the address of the socket the request came in on."""
    host = request.host
    if not _HOST.fullmatch(host):
        sockname = request.transport.get_extra_info("sockname") if request.transport else None
        addr, port = (sockname[0], sockname[1]) if sockname else ("127.0.0.1", 8080)
        host = f"[{addr}]:{port}" if ":" in str(addr) else f"{addr}:{port}"
    return f"{request.scheme}://{host}"


def enroll_line(server: str, secret: str, *, wait: bool) -> str:
    """The ``mcp-agent enroll`` command that enrolls a device with ``secret`` (shell-quoted);
    ``wait`` adds ``--wait`` for a token whose devices wait for approval."""
    argv = ["mcp-agent", "enroll", "--server", server, "--token", secret]
    if wait:
        argv += ["--wait", str(APPROVAL_WAIT_S)]
    return shlex.join(argv)


# ---------------------------------------------------------------------------- pages
def _manual_policy(ctx: Ctx) -> bool:
    """Every new device waits for an operator, whatever its token says."""
    return ctx.svc.settings.enrollment_approval is EnrollmentApproval.MANUAL


async def _render_index(
    ctx: Ctx, *, status: int = 200, error: str = "", form: str = "", values: dict[str, str]
) -> web.Response:
    async with ctx.svc.db.read() as tx:
        tokens = await token_q.list_tokens(tx)
    pending = await pending_devices(ctx.svc)
    now = ctx.now
    return ctx.render(
        "enrollment/index.html",
        status=status,
        tokens=[token_out(t, now) for t in tokens],
        pending=pending,
        expiry_choices=EXPIRY_CHOICES,
        default_expiry=DEFAULT_EXPIRY,
        policy_manual=_manual_policy(ctx),
        error=error,
        error_form=form,
        values=values,
    )


async def index(ctx: Ctx) -> web.StreamResponse:
    return await _render_index(ctx, values={})


def _kept(ctx: Ctx, names: tuple[str, ...]) -> dict[str, str]:
    """What the user typed into a form, to show it again beside an error."""
    return {name: ctx.field(name) for name in names}


async def create_token(ctx: Ctx) -> web.StreamResponse:
    try:
        body = _token_request(ctx)
    except FORM_ERRORS as e:
        values = _kept(ctx, TOKEN_FIELDS)
        return await _render_index(ctx, status=400, error=str(e), form="new-token", values=values)
    token, secret = await create_enrollment_token(ctx.svc, ctx.principal, body)
    out = token_out(token, ctx.now)
    manual = out.approval is Approval.MANUAL or _manual_policy(ctx)
    return ctx.render(
        "enrollment/created.html",
        token=out,
        secret=secret,
        line=enroll_line(control_plane_url(ctx.request), secret, wait=manual),
        manual=manual,
        wait_s=APPROVAL_WAIT_S,
    )


async def revoke_token(ctx: Ctx) -> web.StreamResponse:
    raw = ctx.request.match_info["token_id"]
    if not raw.isdigit() or len(raw) > 18:
        raise UiError("no such enrollment token", status=404)
    token = await revoke_enrollment_token(ctx.svc, ctx.principal, int(raw))
    return ctx.redirect(HOME, f"Revoked enrollment token {token.prefix}…")


async def approve(ctx: Ctx) -> web.StreamResponse:
    device_id = _path_device(ctx)
    with _enrollment_refusals():
        await enrollment(ctx.request).approve(device_id, actor=ctx.principal.actor)
    return ctx.redirect(
        HOME, f"Approved {device_id}; it gets its credentials the next time it asks"
    )


async def reject(ctx: Ctx) -> web.StreamResponse:
    device_id = _path_device(ctx)
    with _enrollment_refusals():
        await enrollment(ctx.request).reject(device_id, actor=ctx.principal.actor)
    return ctx.redirect(HOME, f"Rejected {device_id}")


async def preauthorize(ctx: Ctx) -> web.StreamResponse:
    try:
        body = _preauthorize_request(ctx)
    except FORM_ERRORS as e:
        values = _kept(ctx, PREAUTH_FIELDS)
        return await _render_index(
            ctx, status=400, error=str(e), form="preauthorize", values=values
        )
    with _enrollment_refusals():
        view = await enrollment(ctx.request).preauthorize(
            body.public_key,
            actor=ctx.principal.actor,
            device_id=body.device_id,
            group=body.group,
            labels=body.labels,
        )
    return ctx.redirect(
        HOME, f"Preauthorized {view.id}: it is accepted when it enrolls, with or without a token"
    )


PAGES: list[Page] = [
    Page("GET", HOME, index, Role.VIEWER, nav=NAV),
    Page("POST", f"{HOME}/tokens", create_token, Role.OPERATOR, nav=NAV),
    Page("POST", f"{HOME}/tokens/{{token_id}}/revoke", revoke_token, Role.OPERATOR, nav=NAV),
    Page("POST", f"{HOME}/approvals/{{device_id}}/approve", approve, Role.OPERATOR, nav=NAV),
    Page("POST", f"{HOME}/approvals/{{device_id}}/reject", reject, Role.OPERATOR, nav=NAV),
    Page("POST", f"{HOME}/preauthorize", preauthorize, Role.OPERATOR, nav=NAV),
]
