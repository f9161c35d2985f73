"""The web console's plumbing: sessions, CSRF, rendering, security headers, page routes.

Every console page is a :class:`Page`: a path, a method, the role it needs and a handler that
takes a :class:`Ctx`. :func:`attach_pages` wraps each handler so that

- a request without a valid session is sent to ``/ui/login`` (GET) or refused (POST, 401);
- a role below the page's is refused (403), so a viewer sees everything and changes nothing;
- a POST must carry the session's CSRF token (form field ``csrf`` or header
  ``X-CSRF-Token``), or it is refused (403) before the handler runs;
- a form body is capped (:data:`MAX_FORM_BYTES`) and must be ``application/x-www-form-urlencoded``;
- an error becomes an HTML error page with the matching status (never a traceback);
- every answer carries the console's Content-Security-Policy and the other security headers.

A session is an API token named :data:`SESSION_TOKEN_NAME` (``mcp-controlplane api-tokens
list`` shows it, ``api-tokens revoke`` ends it) held in an HttpOnly, SameSite=Strict cookie,
Secure when the console is served over TLS. The CSRF token is an HMAC of the session secret, so it is bound
to the session and needs no storage.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import jinja2
from aiohttp import web
from markupsafe import Markup

from mcp_edge.controlplane.api.common import ApiError, Services, enrollment_code, services
from mcp_edge.controlplane.auth import SESSION_COOKIE, AuthError, Principal, Role, authenticate
from mcp_edge.controlplane.broker.base import BrokerAdminError
from mcp_edge.controlplane.db import ConflictError, NotFoundError, UnavailableError
from mcp_edge.controlplane.enrollment_service import EnrollmentError
from mcp_edge.shared.errors import MessageError, ProtocolError

log = logging.getLogger("mcp.controlplane.ui")

HERE = Path(__file__).parent
TEMPLATES = HERE / "templates"
STATIC = HERE / "static"

LOGIN_CSRF_COOKIE = "mcp_login_csrf"
FLASH_COOKIE = "mcp_flash"
SESSION_TOKEN_NAME = "web session"
MAX_FORM_BYTES = 64 * 1024
MAX_FORM_FIELDS = 200

CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}

PageHandler = Callable[["Ctx"], Awaitable[web.StreamResponse]]


class UiError(Exception):
    """An error page chosen by a handler: ``status`` and a message shown to the user."""

    def __init__(self, message: str, *, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Page:
    """One console route. ``role`` is the least role that may use it (POSTs: operator or above
    unless said otherwise); ``name`` is the nav section it belongs to."""

    method: str
    path: str
    handler: PageHandler
    role: Role = Role.VIEWER
    nav: str = ""


@dataclass
class Ctx:
    """What a page handler gets: the request, the services, who is asking, and the form."""

    request: web.Request
    svc: Services
    principal: Principal
    csrf: str
    nav: str
    form: Mapping[str, list[str]] = field(default_factory=dict)

    # ------------------------------------------------------------------ inputs
    def field(self, name: str, default: str = "") -> str:
        """One form field (the first value), stripped; ``default`` when absent."""
        values = self.form.get(name)
        return values[0].strip() if values else default

    def fields(self, name: str) -> list[str]:
        return list(self.form.get(name, []))

    def query(self, name: str, default: str = "") -> str:
        return self.request.query.get(name, default)

    @property
    def now(self) -> datetime:
        return self.svc.clock()

    def can(self, role: Role) -> bool:
        return self.principal.role.allows(role)

    # ------------------------------------------------------------------ answers
    def render(self, template: str, *, status: int = 200, **values: Any) -> web.Response:
        """The page ``template`` rendered inside the console layout."""
        return html_response(
            render(self.request.app, template, **self.context(), **values), status=status
        )

    def fragment(self, template: str, **values: Any) -> str:
        """``template`` rendered alone (a live-update fragment), as text."""
        return render(self.request.app, template, **self.context(), **values)

    def context(self) -> dict[str, Any]:
        flash = self.request.cookies.get(FLASH_COOKIE, "")
        return {
            "principal": self.principal,
            "csrf": self.csrf,
            "nav": self.nav,
            "can_operate": self.can(Role.OPERATOR),
            "can_admin": self.can(Role.ADMIN),
            "flash": urllib.parse.unquote(flash)[:300] if flash else "",
            "now": self.now,
            "request_path": self.request.path_qs,
        }

    def redirect(self, location: str, flash: str | None = None) -> web.Response:
        """A 303 to ``location`` (a path on this site), with an optional one-time message."""
        if not location.startswith("/") or location.startswith("//"):
            location = "/ui/"
        response = web.Response(status=303, headers={"Location": location, **SECURITY_HEADERS})
        if flash:
            response.set_cookie(
                FLASH_COOKIE, urllib.parse.quote(flash[:300]), max_age=60, httponly=True,
                samesite="Strict", path="/ui/", secure=self.request.secure,
            )  # fmt: skip
        return response


UI_ENV = web.AppKey("ui_env", jinja2.Environment)


# ---------------------------------------------------------------------------- rendering
def _fmt_time(value: datetime | None) -> Markup:
    """A ``<time>`` element: UTC text, turned into the viewer's local time by app.js."""
    if value is None:
        return Markup('<span class="muted">never</span>')
    iso = value.strftime("%Y-%m-%dT%H:%M:%SZ")
    text = value.strftime("%Y-%m-%d %H:%M:%S UTC")
    return Markup('<time datetime="{}">{}</time>').format(iso, text)


def _fmt_bytes(value: int | float | None) -> str:
    if value is None:
        return "–"
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def _fmt_duration(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _fmt_ago(value: datetime | None, now: datetime | None = None) -> str:
    if value is None:
        return "never"
    from mcp_edge.controlplane.app import system_clock

    delta = ((now or system_clock()) - value).total_seconds()
    if delta < 0:
        return "just now"
    return _fmt_duration(delta) + " ago"


def _query(base: Mapping[str, str], **changes: Any) -> str:
    """``?…`` of ``base`` with ``changes`` applied (None removes a key): links that keep the
    current filters while changing one (a page, a sort)."""
    merged = {k: v for k, v in base.items()}
    for k, v in changes.items():
        if v is None or v == "":
            merged.pop(k, None)
        else:
            merged[k] = str(v)
    return "?" + urllib.parse.urlencode(merged) if merged else "?"


def make_env() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES)),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["time"] = _fmt_time
    env.filters["bytes"] = _fmt_bytes
    env.filters["duration"] = _fmt_duration
    env.filters["ago"] = _fmt_ago
    env.globals["query"] = _query
    return env


def render(app: web.Application, template: str, **values: Any) -> str:
    return app[UI_ENV].get_template(template).render(**values)


def html_response(text: str, *, status: int = 200) -> web.Response:
    return web.Response(
        text=text, status=status, content_type="text/html", charset="utf-8",
        headers=SECURITY_HEADERS,
    )  # fmt: skip


# ---------------------------------------------------------------------------- sessions
def csrf_for(session_token: str) -> str:
    """The CSRF token of a session: HMAC-SHA256 of a fixed label keyed by the session secret."""
    return hmac.new(session_token.encode(), b"mcp-console-csrf", hashlib.sha256).hexdigest()


def session_lifetime(svc: Services) -> timedelta:
    return timedelta(hours=svc.settings.ui_session_hours)


async def session_principal(request: web.Request) -> tuple[Principal, str] | None:
    """The principal and secret of the request's session cookie, or None when it has none or
    the session is unknown, expired or revoked."""
    token = request.cookies.get(SESSION_COOKIE)
    if not token or len(token) > 200:
        return None
    svc = services(request)
    try:
        principal = await authenticate(svc.db, token, svc.clock())
    except AuthError:
        return None
    return principal, token


async def read_form(request: web.Request) -> dict[str, list[str]]:
    """An urlencoded form body, at most :data:`MAX_FORM_BYTES`; raises :class:`UiError`."""
    if request.content_length is not None and request.content_length > MAX_FORM_BYTES:
        raise UiError(f"the form is larger than {MAX_FORM_BYTES} bytes", status=413)
    if request.body_exists and request.content_type != "application/x-www-form-urlencoded":
        raise UiError("send the form as application/x-www-form-urlencoded", status=415)
    chunks: list[bytes] = []
    size = 0
    while chunk := await request.content.read(16 * 1024):
        size += len(chunk)
        if size > MAX_FORM_BYTES:
            raise UiError(f"the form is larger than {MAX_FORM_BYTES} bytes", status=413)
        chunks.append(chunk)
    try:
        text = b"".join(chunks).decode("utf-8")
        form = urllib.parse.parse_qs(
            text, keep_blank_values=True, strict_parsing=False,
            max_num_fields=MAX_FORM_FIELDS,
        )  # fmt: skip
    except (UnicodeDecodeError, ValueError) as e:
        raise UiError(f"the form does not parse: {e}") from e
    for name, values in form.items():
        if "\x00" in name or any("\x00" in v for v in values):
            raise UiError(f"form field {name[:40]!r} contains a NUL character")
    return form


def _error_status(e: Exception) -> tuple[int, str]:
    if isinstance(e, UiError):
        return e.status, str(e)
    if isinstance(e, ApiError):
        return e.code.http_status, str(e)
    if isinstance(e, AuthError):
        return e.status, str(e)
    if isinstance(e, EnrollmentError):
        return enrollment_code(e).http_status, str(e)
    if isinstance(e, NotFoundError):
        return 404, str(e)
    if isinstance(e, ConflictError):
        return 409, str(e)
    if isinstance(e, (MessageError, ProtocolError, ValueError)):
        return 400, str(e)
    if isinstance(e, UnavailableError):
        return 503, "the database is unavailable; retry later"
    if isinstance(e, BrokerAdminError):
        log.warning("broker provisioning failed: %s", e)
        return 503, f"the broker did not take the change: {e}"
    log.exception("console page failed", exc_info=e)
    return 500, f"internal error ({type(e).__name__}); the control plane's log has the details"


def error_page(
    request: web.Request, status: int, message: str, principal: Principal | None = None
) -> web.Response:
    titles = {400: "Bad request", 401: "Not signed in", 403: "Not allowed", 404: "Not found",
              409: "Conflict", 413: "Too large", 415: "Unsupported form", 503: "Unavailable"}  # fmt: skip
    text = render(
        request.app, "error.html", principal=principal, csrf="", nav="", can_operate=False,
        can_admin=False, flash="", status=status, title=titles.get(status, "Error"),
        message=message, now=services(request).clock(), request_path=request.path_qs,
    )  # fmt: skip
    return html_response(text, status=status)


def wrap(page: Page) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def handler(request: web.Request) -> web.StreamResponse:
        found = await session_principal(request)
        if found is None:
            if request.method in ("GET", "HEAD"):
                nxt = urllib.parse.quote(request.path_qs, safe="")
                raise web.HTTPSeeOther(f"/ui/login?next={nxt}", headers=SECURITY_HEADERS)
            return error_page(request, 401, "your session has ended; sign in again")
        principal, token = found
        csrf = csrf_for(token)
        try:
            if not principal.role.allows(page.role):
                raise UiError(
                    f"{principal.role.value} may not do this; it needs the {page.role.value} role",
                    status=403,
                )
            form: dict[str, list[str]] = {}
            if request.method == "POST":
                form = await read_form(request)
                sent = (form.get("csrf") or [request.headers.get("X-CSRF-Token", "")])[0]
                if not hmac.compare_digest(sent.encode(), csrf.encode()):
                    raise UiError(
                        "the form's CSRF token is missing or wrong; reload the page", status=403
                    )
            ctx = Ctx(request, services(request), principal, csrf, page.nav, form)
            response = await page.handler(ctx)
        except web.HTTPException:
            raise
        except Exception as e:
            status, message = _error_status(e)
            return error_page(request, status, message, principal)
        if (
            FLASH_COOKIE in request.cookies
            and request.method == "GET"
            and isinstance(response, web.Response)
        ):
            response.del_cookie(FLASH_COOKIE, path="/ui/")
        for k, v in SECURITY_HEADERS.items():
            response.headers.setdefault(k, v)
        return response

    return handler


def attach_pages(app: web.Application, pages: list[Page]) -> None:
    for page in pages:
        app.router.add_route(page.method, page.path, wrap(page), name=None)
