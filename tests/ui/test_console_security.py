"""The console's defences as a browser meets them, against the real fleet.

- Every mutating route (each POST of ``all_pages()``, so a new page is covered without a change
  here; path parameters are ids that exist) refuses a missing or wrong CSRF token, and every
  operator route refuses a viewer holding a valid one: 403, and nothing changed (the audit log
  has no new entry and what the API shows is the same). A form posted from another site
  reaches the console without the session cookie (SameSite=Strict).
- Text users supply (device labels, token descriptions, a trigger's note), names written to the
  database by any path (model and publisher names the API refuses) and names in a URL render as
  text in Chromium with the page's CSP switched off, so that an unescaped tag would run: no
  dialog opens, the text is on the page, no element was injected.
- Every console response carries the Content-Security-Policy, with no 'unsafe-inline' or
  'unsafe-eval' for scripts, and no page loads anything from another host or breaks its CSP.
"""

from __future__ import annotations

import asyncio
import http.server
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlsplit

import pytest

from mcp_edge.controlplane.auth import Role
from mcp_edge.controlplane.db import Database, registry
from mcp_edge.shared.signing import PrivateKey
from mcp_edge.shared.version import SemVer
from mcp_edge.tooling.processes import free_port
from tests.ui.browser import DESKTOP, Tab
from tests.ui.fleet import AGENTS, GROUP, ConsoleFleet
from tests.ui.pages import Ids, html_pages, post_routes

if TYPE_CHECKING:
    from playwright.sync_api import APIRequestContext, Browser, Response

pytestmark = pytest.mark.timeout(300)

PROBE = '<img src="/x" class="xss-probe" onerror="alert(1)"><script>alert(2)</script>'
"""Markup that opens a dialog or leaves an ``.xss-probe`` element wherever it is not escaped."""
WRONG_CSRF = "0" * 64
FORM = {
    "labels": "probe=1", "description": "probe", "reason": "probe", "note": "probe",
    "model": "vision", "version": "1.0.0", "target": f"group={GROUP}", "stages": "rest",
    "bake": "0s", "group": GROUP, "max_uses": "1", "expires_in_s": "3600", "approval": "auto",
    "public_key": "ab" * 32, "device_id": "probe-device",
}  # fmt: skip
"""Fields that would make each route act, if it let the request through."""


# ---------------------------------------------------------------------------- CSRF and roles
def _post(
    request: APIRequestContext, url: str, csrf: str | None, *, header: bool = False
) -> tuple[int, str]:
    form: dict[str, str | float | bool] = dict(FORM)
    headers = {}
    if csrf is not None and header:
        headers["X-CSRF-Token"] = csrf
    elif csrf is not None:
        form["csrf"] = csrf
    answer = request.post(url, form=form, headers=headers, max_redirects=0)
    return answer.status, answer.text()


def test_every_post_route_refuses_a_missing_or_wrong_csrf_token_and_a_viewer(
    admin_tab: Tab, viewer_tab: Tab, fleet: ConsoleFleet, ids: Ids
) -> None:
    routes = post_routes(ids)
    assert len(routes) >= 10, [p.path for p, _ in routes]
    admin_tab.open("/ui/account")
    viewer_tab.open("/ui/account")
    viewer_csrf = viewer_tab.csrf()
    audit, before = fleet.last_audit_id(), fleet.state()

    wrong: list[str] = []
    for page, path in routes:
        url = fleet.url + path
        tries = [("no token", admin_tab, None, False), ("a wrong token", admin_tab, WRONG_CSRF,
                 False), ("a wrong header", admin_tab, WRONG_CSRF, True)]  # fmt: skip
        if page.role is not Role.VIEWER:
            tries.append(("a viewer", viewer_tab, viewer_csrf, False))
        for what, tab, csrf, header in tries:
            status, text = _post(tab.page.request, url, csrf, header=header)
            expected = "CSRF" if what != "a viewer" else "it needs the"
            if status != 403 or expected not in text:
                wrong.append(f"POST {path} with {what}: {status} {text[:200]!r}")
    assert not wrong, "\n".join(wrong)
    assert fleet.last_audit_id() == audit, "a refused POST left an audit entry"
    assert fleet.state() == before

    # The same channel with the session's own token gets through: the refusals were the token's.
    trigger = ids.by_name["trigger_id"]
    status, _ = _post(
        admin_tab.page.request,
        f"{fleet.url}/ui/drift/triggers/{trigger}/acknowledge",
        admin_tab.csrf(),
    )
    assert status == 303 and fleet.last_audit_id() > audit


def test_the_login_form_refuses_a_forged_token(admin_tab: Tab, fleet: ConsoleFleet) -> None:
    answer = admin_tab.page.request.post(
        fleet.url + "/ui/login",
        form={"username": "admin", "password": fleet.admin_password, "csrf": "forged"},
        max_redirects=0,
    )
    assert answer.status == 403 and "expired" in answer.text()


@dataclass
class OtherSite:
    """A page on another site (``localhost`` is not ``127.0.0.1``) with a form aimed at the
    console."""

    html: bytes
    url: str = ""
    seen: list[str] = field(default_factory=list)


@pytest.fixture
def other_site(fleet: ConsoleFleet) -> Iterator[OtherSite]:
    target = f"{fleet.url}/ui/devices/{AGENTS[0]}/labels"
    site = OtherSite(
        f'<!doctype html><title>Prize</title><form method="post" action="{target}">'
        '<input name="labels" value="owned=1"><input name="csrf" value="guess">'
        "<button>Claim the prize</button></form>".encode()
    )

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.end_headers()
            self.wfile.write(site.html)

        def log_message(self, format: str, *args: Any) -> None:
            site.seen.append(format % args)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
    site.url = f"http://localhost:{server.server_address[1]}/"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield site
    finally:
        server.shutdown()
        thread.join(timeout=10)
        server.server_close()


def test_a_form_posted_from_another_site_carries_no_session(
    admin_tab: Tab, fleet: ConsoleFleet, other_site: OtherSite
) -> None:
    admin_tab.open("/ui/devices")  # signed in at 127.0.0.1
    labels = fleet.devices()[AGENTS[0]]["labels"]
    page = admin_tab.page
    page.goto(other_site.url)
    with page.expect_response(lambda r: r.url.endswith("/labels")) as answer:
        page.get_by_role("button", name="Claim the prize").click()
    assert answer.value.status == 401, answer.value.status  # no cookie: SameSite=Strict
    assert "sign in again" in answer.value.text()
    assert fleet.devices()[AGENTS[0]]["labels"] == labels


# ---------------------------------------------------------------------------- text, not markup
@pytest.fixture
def csp_off_tab(browser: Browser, fleet: ConsoleFleet, admin_state: Any) -> Iterator[Tab]:
    """An admin tab that ignores the console's CSP, so that markup the console failed to
    escape would run."""
    context = browser.new_context(viewport=DESKTOP, storage_state=admin_state, bypass_csp=True)
    try:
        yield Tab(context.new_page(), fleet.url)
    finally:
        context.close()


def _shown_as_text(tab: Tab, where: str, text: str = PROBE) -> None:
    page = tab.page
    if page.locator("[data-live]").count():
        page.wait_for_selector("[data-live][data-updated]")
    assert page.locator(".xss-probe").count() == 0, f"markup injected on {where}"
    assert page.get_by_text(text).count() > 0, f"{text!r} not shown on {where}"
    assert tab.alerts() == [], f"{where}: {tab.alerts()}"


async def _store_names(url: str, name: str) -> None:
    """A model version and a publisher named ``name``, written straight to the database as an
    older release or another tool could have (the API refuses such names)."""
    db = Database(url)
    key = PrivateKey.generate().public_key
    variant = {"name": "default", "file": "m.onnx", "sha256": "0" * 64, "size": 1, "profiles": []}
    now = datetime.now(timezone.utc)
    try:
        async with db.transaction() as tx:
            await registry.add_publisher(
                tx, keyid=key.keyid, public_key=key.raw.hex(), name=name, now=now
            )
            await registry.insert_version(
                tx, model=name, version="1.0.0", version_numeric=SemVer.parse("1.0.0").to_numeric(),
                target_path=f"{name}/1.0.0/bundle.mcpb", sha256="0" * 64, length=10,
                format="onnx", profiles=[], variants=[variant], publisher_keyid=key.keyid,
                uploaded_by="user:admin", now=now,
            )  # fmt: skip
    finally:
        await db.dispose()


def test_text_from_users_and_stored_names_render_as_text(
    csp_off_tab: Tab, fleet: ConsoleFleet, ids: Ids
) -> None:
    tab, page = csp_off_tab, csp_off_tab.page
    device = AGENTS[1]
    tab.open(f"/ui/devices/{device}")
    labels_before = page.input_value("#labels-text")
    page.fill("#labels-text", f"{labels_before}\nnote={PROBE}".strip())
    page.locator("#device-labels").get_by_role("button", name="Save labels").click()
    page.wait_for_load_state()
    try:
        assert fleet.devices()[device]["labels"].get("note") == PROBE
        _shown_as_text(tab, "a device's page")
        for path in ("/ui/devices", "/ui/"):
            tab.open(path)
            _shown_as_text(tab, path)
    finally:
        tab.open(f"/ui/devices/{device}")
        page.fill("#labels-text", labels_before)
        page.locator("#device-labels").get_by_role("button", name="Save labels").click()
        page.wait_for_load_state()

    tab.open("/ui/enrollment")
    page.fill("#token-description", PROBE)
    page.locator("#new-token").get_by_role("button", name="Create token").click()
    page.wait_for_selector("#token-secret")
    _shown_as_text(tab, "a new token's page")
    tab.open("/ui/enrollment")
    _shown_as_text(tab, "the enrollment page")

    tab.open(f"/ui/drift/triggers/{ids.by_name['trigger_id']}")
    page.fill("#ack-note", PROBE)
    page.get_by_role("button", name="Acknowledge").click()
    page.wait_for_load_state()
    _shown_as_text(tab, "a trigger's page")

    name = '<img src="/x" class="xss-probe" onerror="alert(3)">'
    with ThreadPoolExecutor(1) as thread:  # Playwright's loop runs in this one
        thread.submit(asyncio.run, _store_names(fleet.database_url, name)).result()
    for path in ("/ui/models", f"/ui/models/{quote(name, safe='')}",
                 f"/ui/models/{quote(name, safe='')}/1.0.0"):  # fmt: skip
        tab.open(path)
        _shown_as_text(tab, path, name)

    for path in (f"/ui/devices/{quote(PROBE, safe='')}", f"/ui/models/{quote(PROBE, safe='')}",
                 f"/ui/{quote(PROBE, safe='')}"):  # fmt: skip
        answer = page.goto(fleet.url + path)
        assert answer is not None and answer.status == 404, path
        _shown_as_text(tab, f"the not-found page of {path}", 'class="xss-probe"')


# ---------------------------------------------------------------------------- CSP, other hosts
def _directives(policy: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for part in policy.split(";"):
        words = part.split()
        if words:
            found[words[0].lower()] = words[1:]
    return found


def _policy_problems(response: Response) -> str | None:
    policy = response.headers.get("content-security-policy")
    if policy is None:
        return "no Content-Security-Policy"
    d = _directives(policy)
    scripts = d.get("script-src", d.get("default-src"))
    if scripts is None:
        return f"no script-src or default-src: {policy}"
    unsafe = [s for s in scripts if s.strip("'").startswith("unsafe-")]
    if unsafe or "*" in scripts or "data:" in scripts:
        return f"script-src allows {unsafe or scripts}: {policy}"
    if d.get("default-src") != ["'none'"] or d.get("frame-ancestors") != ["'none'"]:
        return f"default-src or frame-ancestors is not 'none': {policy}"
    return None


@dataclass
class Walk:
    responses: list[Response]
    foreign: list[str]
    csp_violations: list[str]
    pages: list[str]


@pytest.fixture(scope="module")
def walk(browser: Browser, fleet: ConsoleFleet, admin_state: Any, ids: Ids) -> Walk:
    """Every console page visited as the admin (live regions updated once), the login form
    signed out, a page that does not exist, and a refused POST; what the browser recorded."""
    tabs: list[Tab] = []
    paths = list(html_pages(ids).values())
    for state in (admin_state, None):
        context = browser.new_context(viewport=DESKTOP, storage_state=state)
        tab = Tab(context.new_page(), fleet.url)
        tabs.append(tab)
        for path in paths if state is not None else ["/ui/login"]:
            tab.open(path)
            if tab.page.locator("[data-live]").count():
                tab.page.wait_for_selector("[data-live][data-updated]")
        if state is not None:
            tab.page.goto(fleet.url + "/ui/no-such-page")
            refused = tab.page.evaluate(
                "async () => (await fetch('/ui/logout', {method: 'POST', body: "
                "new URLSearchParams({csrf: 'wrong'})})).status"
            )
            assert refused == 403
        context.close()
    return Walk(
        [r for t in tabs for r in t.responses],
        [u for t in tabs for u in t.foreign],
        [e for t in tabs for e in t.csp_violations()],
        paths,
    )


def test_every_console_response_carries_a_strict_csp(walk: Walk, fleet: ConsoleFleet) -> None:
    host = urlsplit(fleet.url).netloc
    mine = [r for r in walk.responses if urlsplit(r.url).netloc == host]
    statuses = {r.status for r in mine}
    assert {200, 403, 404} <= statuses, statuses
    kinds = {r.request.resource_type for r in mine}
    assert {"document", "stylesheet", "script", "eventsource"} <= kinds, kinds
    problems = [
        f"{r.request.method} {r.url} ({r.status}): {why}"
        for r in mine
        if (why := _policy_problems(r)) is not None
    ]
    assert not problems, "\n".join(problems)


def test_no_page_loads_from_another_host_or_breaks_its_csp(walk: Walk) -> None:
    assert len(walk.pages) >= 14, walk.pages
    assert walk.foreign == [], walk.foreign
    assert walk.csp_violations == [], walk.csp_violations
