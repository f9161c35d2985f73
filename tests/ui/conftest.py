"""Fixtures of the browser tests: Debian's Chromium driven by Playwright, one real fleet
(:mod:`tests.ui.fleet`) for the whole folder, signed-in browser contexts and the folder the
screenshots go to.

- `browser`: headless Chromium (``/usr/bin/chromium``, or ``$MCP_TEST_CHROMIUM``) launched
  with flags that need no network; the tests are skipped, saying why, when Playwright or
  Chromium is missing (``bash tests/run.sh`` installs Chromium; Playwright is in the venv).
- `fleet`: the broker, control plane and agents, shared by every module here.
- `admin_tab` / `viewer_tab`: a fresh context signed in as the admin / a viewer, with a
  :class:`~tests.ui.browser.Tab` that records dialogs, requests to other hosts and errors.
- `ids`: existing ids for the console's path parameters (:class:`~tests.ui.pages.Ids`): a
  device, a model version, a rollout, a trigger, an enrollment token, an API token.
- `artifacts`: ``$MCP_TEST_ARTIFACTS/ui`` when set, else ``test-artifacts/ui`` in the checkout.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from mcp_edge.tooling.models import DigitsModels
from mcp_edge.tooling.processes import REPO
from tests.ui.browser import DESKTOP, Tab, launch_args, sign_in
from tests.ui.fleet import AGENTS, SENSOR, VERSION, ConsoleFleet, console_fleet
from tests.ui.pages import Ids

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Playwright

CHROMIUM = Path(os.environ.get("MCP_TEST_CHROMIUM", "/usr/bin/chromium"))
VIEWER = ("vera", "vera-password")


@pytest.fixture(scope="package")
def playwright_api() -> Iterator[Playwright]:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("the Python package playwright is not installed (the venv's test extra has it)")
    if not CHROMIUM.is_file():
        pytest.skip(f"{CHROMIUM} is missing: `bash tests/run.sh` installs Debian's chromium")
    with sync_playwright() as api:
        yield api


@pytest.fixture(scope="package")
def browser(playwright_api: Playwright) -> Iterator[Browser]:
    chromium = playwright_api.chromium.launch(
        executable_path=str(CHROMIUM), headless=True, args=launch_args()
    )
    try:
        yield chromium
    finally:
        chromium.close()


@pytest.fixture(scope="package")
def fleet(
    browser: Browser, tmp_path_factory: pytest.TempPathFactory, digits: DigitsModels
) -> Iterator[ConsoleFleet]:
    # Depends on `browser` so that a machine without Chromium skips before starting processes.
    with console_fleet(tmp_path_factory.mktemp("console"), digits) as started:
        yield started


@pytest.fixture(scope="package")
def artifacts() -> Path:
    root = os.environ.get("MCP_TEST_ARTIFACTS")
    folder = Path(root) / "ui" if root else REPO / "test-artifacts" / "ui"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture(scope="package")
def ids(fleet: ConsoleFleet) -> Ids:
    token = fleet.get("/api/v1/enrollment-tokens")["items"][0]["id"]
    spare = fleet.post(
        "/api/v1/auth/login", {"username": "admin", "password": fleet.admin_password}, 201
    )  # an API token of the admin's own that a route may revoke
    by_name = {
        "device_id": AGENTS[0], "name": SENSOR, "model": SENSOR, "version": VERSION,
        "rollout_id": str(fleet.any_rollout()), "trigger_id": str(fleet.any_trigger()),
        "token_id": str(token),
    }  # fmt: skip
    return Ids(by_name, {("/ui/account/", "token_id"): str(spare["id"])})


def _signed_in_state(browser: Browser, fleet: ConsoleFleet, user: str, password: str) -> Any:
    context = browser.new_context(viewport=DESKTOP)
    try:
        page = context.new_page()
        sign_in(page, fleet.url, user, password)
        return context.storage_state()
    finally:
        context.close()


@pytest.fixture(scope="package")
def admin_state(browser: Browser, fleet: ConsoleFleet) -> Any:
    """The cookies of one admin session, signed in through the form."""
    return _signed_in_state(browser, fleet, "admin", fleet.admin_password)


@pytest.fixture(scope="package")
def viewer_state(browser: Browser, fleet: ConsoleFleet) -> Any:
    """The cookies of a session of the viewer :data:`VIEWER` (created here)."""
    username, password = VIEWER
    fleet.post("/api/v1/users", {"username": username, "password": password,
                                 "role": "viewer"}, 201)  # fmt: skip
    return _signed_in_state(browser, fleet, username, password)


def _tab(browser: Browser, fleet: ConsoleFleet, state: Any) -> Iterator[Tab]:
    context = browser.new_context(viewport=DESKTOP, storage_state=state)
    try:
        yield Tab(context.new_page(), fleet.url)
    finally:
        context.close()


@pytest.fixture
def admin_tab(browser: Browser, fleet: ConsoleFleet, admin_state: Any) -> Iterator[Tab]:
    yield from _tab(browser, fleet, admin_state)


@pytest.fixture
def viewer_tab(browser: Browser, fleet: ConsoleFleet, viewer_state: Any) -> Iterator[Tab]:
    yield from _tab(browser, fleet, viewer_state)
