"""Accessibility of every console page: axe-core (all its default rules) reports no violation
of impact serious or critical, in Chromium, with the page's Content-Security-Policy in force.

The pages are every GET route the console registers (``all_pages()``), their path parameters
filled with ids that exist in the fleet (a device, a model version, a rollout, a trigger), the
login form signed out, and the answers to forms: a new enrollment token's one-time page and
forms sent back with errors. A region kept live by server-sent events is checked after its
first update.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest

from tests.ui.axe import AXE_JS, blocking, describe, run_axe
from tests.ui.browser import DESKTOP, Tab
from tests.ui.fleet import AGENTS, ConsoleFleet
from tests.ui.pages import NOT_HTML, Ids, fill, registered

if TYPE_CHECKING:
    from playwright.sync_api import Browser

pytestmark = pytest.mark.timeout(300)

ROUTES = sorted(p.path for p in registered("GET") if not NOT_HTML.search(p.path))


@pytest.fixture(scope="module", autouse=True)
def _axe_present() -> None:
    if not AXE_JS.is_file():
        pytest.skip(f"axe-core is missing ({AXE_JS}): `bash tests/run.sh` fetches it from npm")


@pytest.fixture(scope="module")
def tab(browser: Browser, fleet: ConsoleFleet, admin_state: Any) -> Iterator[Tab]:
    """One admin tab for the module (every page is read, none changed)."""
    context = browser.new_context(viewport=DESKTOP, storage_state=admin_state)
    try:
        yield Tab(context.new_page(), fleet.url)
    finally:
        context.close()


def _check(tab: Tab, what: str) -> None:
    if tab.page.locator("[data-live]").count():
        tab.page.wait_for_selector("[data-live][data-updated]")
    found = blocking(run_axe(tab.page))
    assert not found, f"axe-core on {what} ({tab.page.url}):\n{describe(found)}"


@pytest.mark.parametrize("route", ROUTES)
def test_page_has_no_serious_accessibility_violation(tab: Tab, ids: Ids, route: str) -> None:
    tab.open(fill(route, ids))
    _check(tab, route)


def test_login_form_has_no_serious_accessibility_violation(
    browser: Browser, fleet: ConsoleFleet
) -> None:
    context = browser.new_context(viewport=DESKTOP)
    try:
        tab = Tab(context.new_page(), fleet.url)
        tab.open("/ui/login")
        _check(tab, "the login form")
        tab.page.fill("#username", "admin")
        tab.page.fill("#password", "not the password")
        tab.page.get_by_role("button", name="Sign in").click()
        tab.page.wait_for_selector("#login-error")
        _check(tab, "the login form after a wrong password")
    finally:
        context.close()


def test_the_checker_sees_a_field_without_a_label(browser: Browser, fleet: ConsoleFleet) -> None:
    """axe-core runs in these pages: the login form with its username label taken away fails."""
    context = browser.new_context(viewport=DESKTOP)
    try:
        tab = Tab(context.new_page(), fleet.url)
        tab.open("/ui/login")
        tab.page.evaluate("() => document.querySelector('label[for=username]').remove()")
        found = {v["id"] for v in blocking(run_axe(tab.page))}
        assert "label" in found, found
    finally:
        context.close()


def test_form_answers_have_no_serious_accessibility_violation(tab: Tab, ids: Ids) -> None:
    page = tab.page
    tab.open("/ui/enrollment")
    page.fill("#token-description", "accessibility check")
    page.locator("#new-token").get_by_role("button", name="Create token").click()
    page.wait_for_selector("#token-secret")
    _check(tab, "a new enrollment token's page")

    tab.open("/ui/rollouts/new")
    page.fill("#version", "1.0.0")
    page.fill("#target", "group=ui-lab")
    page.fill("#stages", "not-a-stage")
    page.get_by_role("button", name="Start rollout").click()
    page.wait_for_selector("#form-error")
    _check(tab, "the rollout form sent back with an error")

    tab.open(f"/ui/devices/{AGENTS[0]}")
    page.fill("#labels-text", "Not A Key=1")
    page.locator("#device-labels").get_by_role("button", name="Save labels").click()
    page.wait_for_selector("#labels-error")
    _check(tab, "a device's labels sent back with an error")
