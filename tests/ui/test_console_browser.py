"""The console in Chromium against a real fleet (:mod:`tests.ui.fleet`): what an operator does
and sees, end to end.

- Sign in through the form and see the two agents online (overview figures, devices table).
- A device enrolling with a token that needs approval waits on the enrollment page; the
  operator approves it there and its ``mcp-agent enroll`` completes.
- A rollout started from the form reaches 100 % while its page stays open (server-sent
  events, no reload: a marker set on ``window`` survives); another is aborted from its page,
  the confirmation dialog accepted.
- A device sent drifting inputs raises a retraining trigger, which appears in the triggers
  table without a reload and is acknowledged from its page.
- A full-page screenshot of every main page (desktop, and tablet width for some) goes to the
  artefacts folder.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.ui.browser import DESKTOP, TABLET, Tab, sign_in
from tests.ui.fleet import AGENTS, GROUP, SENSOR, VERSION, ConsoleFleet
from tests.ui.pages import TABLET_PAGES, Ids, main_paths

if TYPE_CHECKING:
    from playwright.sync_api import Browser

pytestmark = pytest.mark.timeout(300)

LIVE_TIMEOUT_MS = 120_000
"""How long a live region may take to show what the fleet did (a rollout's devices download,
verify and load a bundle; an agent's drift report goes through the broker)."""
SETTLED = ["succeeded", "paused", "rolled_back", "aborted", "rolling_back"]
"""A rollout's states once it succeeded or will not (without a human's command)."""
MARK = "() => { window.__consoleNotReloaded = true; }"
MARKED = "() => window.__consoleNotReloaded === true"


def _big(tab: Tab, card: str) -> str:
    return tab.page.inner_text(f"#{card} .big").strip()


def test_sign_in_through_the_form_and_see_the_agents_online(
    browser: Browser, fleet: ConsoleFleet
) -> None:
    context = browser.new_context(viewport=DESKTOP)
    try:
        tab = Tab(context.new_page(), fleet.url)
        tab.page.goto(fleet.url + "/ui/devices")
        assert "/ui/login" in tab.page.url  # not signed in: the login form, then back here
        sign_in(tab.page, fleet.url, "admin", fleet.admin_password)
        assert tab.page.url.endswith("/ui/devices"), tab.page.url
        for device in AGENTS:
            row = tab.page.locator(f'table#devices tr[data-device="{device}"]')
            assert row.is_visible() and "online" in row.inner_text(), row.inner_text()
        tab.page.locator(f'tr[data-device="{AGENTS[0]}"] a').first.click()
        tab.page.wait_for_url(re.compile(rf"/ui/devices/{AGENTS[0]}$"))
        assert tab.page.inner_text("h1").strip() == AGENTS[0]

        tab.open("/ui/")
        online = fleet.online()
        assert set(AGENTS) <= set(online)
        assert _big(tab, "fleet-online") == str(len(online))
        accepted = [d for d, v in fleet.devices().items() if v["status"] == "accepted"]
        assert _big(tab, "fleet-offline") == str(len(accepted) - len(online))
        assert _big(tab, "fleet-pending") == str(len(fleet.pending()))
        assert tab.alerts() == [] and tab.csp_violations() == [], tab.errors
    finally:
        context.close()


def test_approve_a_pending_device_from_the_enrollment_page(
    admin_tab: Tab, fleet: ConsoleFleet
) -> None:
    device = "edge-waiting"
    token = fleet.post(
        "/api/v1/enrollment-tokens",
        {"approval": "manual", "max_uses": 1, "description": "needs approval"},
        201,
    )["token"]  # no group: the rollouts of the group's devices do not wait for this one
    enrolling = fleet.enroll(device, token, wait_s=120)
    fleet.wait(lambda: device in fleet.pending(), f"{device} pending approval", 60)

    admin_tab.open("/ui/")
    assert int(_big(admin_tab, "fleet-pending")) >= 1
    admin_tab.page.click("#fleet-pending a")  # the card's link to the devices waiting
    row = admin_tab.page.locator(f'table#pending tr[data-device="{device}"]')
    row.get_by_role("button", name=re.compile(r"^Approve")).click()
    admin_tab.page.wait_for_load_state()
    assert admin_tab.page.locator(f'table#pending tr[data-device="{device}"]').count() == 0

    out, err = enrolling.communicate(timeout=90)
    assert enrolling.returncode == 0 and f"enrolled as {device}" in out, err
    assert fleet.devices()[device]["status"] == "accepted"
    admin_tab.open("/ui/devices")
    listed = admin_tab.page.locator(f'table#devices tr[data-device="{device}"]')
    assert "accepted" in listed.inner_text()


def test_a_rollout_started_from_the_form_reaches_100_percent_live(
    admin_tab: Tab, fleet: ConsoleFleet, artifacts: Path
) -> None:
    page = admin_tab.page
    admin_tab.open("/ui/rollouts/new")
    page.select_option("#model", "vision")
    page.fill("#version", VERSION)
    page.fill("#target", f"group={GROUP}")
    admin_tab.wait_for(
        "() => document.getElementById('target-count').textContent.includes('2')",
        "the target count",
        15_000,
    )
    page.fill("#stages", "1, rest")
    page.fill("#gates", "install_failure_rate<0.1")  # judged on installs alone: no traffic
    page.fill("#bake", "5s")  # each stage bakes 5 s: the page opens on a running rollout
    page.get_by_role("button", name="Start rollout").click()
    page.wait_for_url(re.compile(r"/ui/rollouts/\d+$"))
    rollout_id = int(page.url.rsplit("/", 1)[1])
    assert fleet.rollout(rollout_id)["model"] == "vision"

    page.evaluate(MARK)
    assert page.get_attribute("#rollout-state", "data-status") == "running"
    try:
        admin_tab.wait_for(
            "(settled) => settled.includes(document.getElementById('rollout-state')"
            ".dataset.status)",
            "the rollout to succeed (or stop)",
            LIVE_TIMEOUT_MS,
            SETTLED,
        )
        state = page.inner_text("#rollout-state").strip()
        assert state == "succeeded", f"the rollout is {state}:\n{admin_tab.text()[:3000]}"
    except AssertionError as e:
        raise AssertionError(f"{e}\nAPI: {fleet.rollout(rollout_id)}\n{fleet.log_tail()}") from None
    assert page.inner_text("#rollout-progress").strip() == "100 %"
    assert page.evaluate(MARKED), "the rollout page was reloaded"
    assert page.get_attribute("#rollout-live", "data-updated")
    assert fleet.rollout(rollout_id)["status"] == "succeeded"
    for device in AGENTS:
        assert fleet.active(device, "vision") == VERSION
    admin_tab.screenshot(artifacts, "rollout-succeeded")


def test_abort_a_rollout_from_its_page(admin_tab: Tab, fleet: ConsoleFleet) -> None:
    stages = [{"count": 1, "bake_s": 3600}, {"percent": 100, "bake_s": 0}]
    rollout_id = fleet.create_rollout("vision-b", stages)
    page = admin_tab.page
    admin_tab.open(f"/ui/rollouts/{rollout_id}")
    page.evaluate(MARK)
    page.fill("#action-reason", "stopped from the console")
    page.get_by_role("button", name="Abort").click()
    admin_tab.wait_for(
        "() => document.getElementById('rollout-state').dataset.status === 'aborted'",
        "the rollout aborted",
        30_000,
    )
    assert [d for d in admin_tab.dialogs if d.startswith("confirm:")], admin_tab.dialogs
    assert page.inner_text("#rollout-state").strip() == "aborted"
    rollout = fleet.rollout(rollout_id)
    assert rollout["status"] == "aborted"
    assert "stopped from the console" in rollout["reason"], rollout["reason"]


def test_a_drift_trigger_appears_live_and_is_acknowledged(
    admin_tab: Tab, fleet: ConsoleFleet
) -> None:
    page = admin_tab.page
    admin_tab.open(f"/ui/drift?model={SENSOR}")
    page.wait_for_selector("#triggers-live[data-updated]")  # the event stream is open
    before = page.eval_on_selector_all(
        "tr[data-trigger]", "rows => rows.map(r => r.dataset.trigger)"
    )
    page.evaluate(MARK)
    fleet.drift(AGENTS[1])
    selector = "#triggers-live table#triggers tr[data-trigger]"
    admin_tab.wait_for(
        "([selector, before]) => Array.from(document.querySelectorAll(selector))"
        ".some(r => !before.includes(r.dataset.trigger))",
        "a new trigger row",
        LIVE_TIMEOUT_MS,
        [selector, before],
    )
    assert page.evaluate(MARKED), "the drift page was reloaded"
    shown = page.eval_on_selector_all(selector, "rows => rows.map(r => r.dataset.trigger)")
    new = max((t for t in shown if t not in before), key=int)
    trigger = next(t for t in fleet.triggers() if str(t["id"]) == new)
    assert trigger["model"] == SENSOR and AGENTS[1] in trigger["device_ids"], trigger

    page.locator(f'tr[data-trigger="{new}"] a').first.click()
    page.wait_for_url(re.compile(rf"/ui/drift/triggers/{new}$"))
    page.fill("#ack-note", "retraining on the inverted digits")
    page.get_by_role("button", name="Acknowledge").click()
    page.wait_for_load_state()
    status = next(t for t in fleet.triggers() if str(t["id"]) == new)["status"]
    assert status == "acknowledged", status
    assert "retraining on the inverted digits" in admin_tab.text()


def test_screenshots_of_every_main_page(
    browser: Browser, admin_tab: Tab, fleet: ConsoleFleet, ids: Ids, artifacts: Path
) -> None:
    sideways: dict[str, int] = {}
    for name, path in main_paths(ids).items():
        admin_tab.open(path)
        if admin_tab.page.locator("[data-live]").count():
            admin_tab.page.wait_for_selector("[data-live][data-updated]")
        admin_tab.screenshot(artifacts, name)
        assert admin_tab.page.locator("h1").count() == 1, name
        with admin_tab.viewport(TABLET):
            if name in TABLET_PAGES:
                admin_tab.screenshot(artifacts, f"{name}-tablet")
            sideways[name] = admin_tab.overflow_px()
    assert admin_tab.csp_violations() == [] and admin_tab.foreign == []
    # Wide tables scroll inside their .table-wrap: no page is wider than a tablet's window.
    assert {n: px for n, px in sideways.items() if px > 0} == {}, sideways

    context = browser.new_context(viewport=TABLET)
    try:
        tab = Tab(context.new_page(), fleet.url)
        tab.open("/ui/login")
        tab.screenshot(artifacts, "login-tablet")
        with tab.viewport(DESKTOP):
            tab.screenshot(artifacts, "login")
    finally:
        context.close()
    shots = sorted(p.name for p in artifacts.glob("*.png"))
    assert {f"{n}.png" for n in [*main_paths(ids), "login"]} <= set(shots), shots
