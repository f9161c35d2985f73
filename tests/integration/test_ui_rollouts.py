"""The console's rollout pages over HTTP, as a browser without script meets them.

A real control plane (SQLite and PostgreSQL) with the fake broker provisioner and a clock that
moves only when told to; its rollout loop is stopped so each test steps it itself. Devices
enroll through the REST API; published versions are recorded as the registry records them, and
what devices report is written with the ingestion's own queries (the helpers of
test_rollouts_service). Every check is on what a user sees: the pages' text, their status
codes, and what the REST API says afterwards.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from mcp_edge.controlplane.api.common import SERVICES
from mcp_edge.controlplane.api.rollouts import ROLLOUTS
from mcp_edge.controlplane.db import telemetry as telemetry_q
from mcp_edge.controlplane.rollouts.service import COMMANDS
from mcp_edge.controlplane.ui.rollouts import format_target, parse_target, parse_target_spec
from mcp_edge.shared.signing import PrivateKey
from tests.integration.test_deployments import publish_versions
from tests.integration.test_rollouts_service import MODEL, NEW, OLD, Fleet
from tests.support.console import Console, ConsolePlane, Page, console_plane, user_console

STREAM_TIMEOUT_S = 20.0
SCRIPT = "<script>alert(1)</script>"


@dataclass
class Setup:
    plane: ConsolePlane
    fleet: Fleet
    group: str
    site: str

    @property
    def admin(self) -> Console:
        return self.plane.admin

    async def api(self, method: str, path: str, body: Any = None, status: int = 200) -> Any:
        code, answer = await self.plane.cp.call(method, path, body=body)
        assert code == status, answer
        return answer

    async def rollouts(self) -> list[dict[str, Any]]:
        return list((await self.api("GET", "/api/v1/rollouts"))["items"])

    def form(self, **changes: str) -> dict[str, str]:
        values = {
            "model": MODEL,
            "version": NEW,
            "target": f"group={self.group}",
            "stages": "2, rest",
            "gates": "error_rate<0.05,min_requests=20",
            "bake": "1m",
            "rate": "20/min",
            "rate_growth": "2",
            "device_timeout": "10m",
            "auto_rollback": "on",
        }
        values.update(changes)
        return {k: v for k, v in values.items() if v != "-"}

    async def start(self, **changes: str) -> int:
        page = await self.admin.post("/ui/rollouts/new", self.form(**changes), follow=False)
        assert page.status == 303, page.text
        found = re.fullmatch(r"/ui/rollouts/(\d+)", page.headers["Location"])
        assert found is not None, page.headers
        return int(found[1])


@pytest.fixture
async def setup(database_url: str, tmp_path: Path) -> AsyncIterator[Setup]:
    async with console_plane(database_url, tmp_path / "cp") as plane:
        cp = plane.cp
        app = cp.client.server.app
        service = app[ROLLOUTS]
        await service.stop()  # each test steps the loop itself
        db = app[SERVICES].db
        suffix = secrets.token_hex(3)
        group, site = f"line-{suffix}", f"site-{suffix}"
        token = (await cp.new_token(max_uses=50, group=group))["token"]
        devices = []
        for i in range(10):
            device_id = f"cam-{i}-{suffix}"
            labels = {"site": site, **({"line": "b"} if i < 4 else {})}
            status, answer = await cp.enroll(
                PrivateKey.generate(), token, device_id=device_id, labels=labels
            )
            assert status == 200 and answer["status"] == "accepted", answer
            devices.append(device_id)
        await publish_versions(db, cp.clock(), MODEL, "0.9.0", OLD, NEW, "1.2.0")
        code, answer = await cp.call(
            "POST",
            "/api/v1/deployments",
            body={"model": MODEL, "version": OLD, "selector": {"group": group}},
        )
        assert code == 201, answer
        fleet = Fleet(cp, db, service, devices)
        await fleet.running(devices, OLD)
        async with db.transaction() as tx:  # online, as their birth messages make them
            await telemetry_q.mark_seen(tx, devices, devices, [], cp.clock())
        yield Setup(plane, fleet, group, site)


async def first_event(console: Console, path: str) -> tuple[str, str]:
    """The first named event of the stream at ``path`` (its name and data); then it closes."""

    async def read() -> tuple[str, str]:
        async with console.session.get(console.url(path)) as r:
            assert r.status == 200, await r.text()
            assert r.headers["Content-Type"].startswith("text/event-stream")
            name, data = "", []
            while True:
                line = (await r.content.readline()).decode()
                assert line, "the stream ended before an event"
                line = line.rstrip("\n")
                if line.startswith("event: "):
                    name = line[len("event: ") :]
                elif line.startswith("data: ") and name:
                    data.append(line[len("data: ") :])
                elif not line and name:
                    return name, "\n".join(data)

    return await asyncio.wait_for(read(), STREAM_TIMEOUT_S)


def state_of(page: Page | str) -> str:
    text = page if isinstance(page, str) else page.text
    found = re.search(r'id="rollout-state"[^>]*>([^<]*)<', text)
    assert found is not None, text[:2000]
    return found[1]


# ---------------------------------------------------------------------------- the form
async def test_the_form_creates_what_the_api_creates(setup: Setup) -> None:
    form = await setup.admin.get("/ui/rollouts/new")
    assert form.status == 200
    assert "Start rollout" in form.text and f'<option value="{MODEL}"' in form.text
    assert 'data-count-url="/ui/rollouts/target-count"' in form.text
    assert 'data-count-out="target-count"' in form.text
    for field in ("model", "version", "target", "stages", "gates", "rate"):
        assert f'id="{field}"' in form.text and f'for="{field}"' in form.text

    rollout_id = await setup.start()
    page = await setup.admin.get(f"/ui/rollouts/{rollout_id}")
    assert page.status == 200
    assert f"Rollout {rollout_id} started: {MODEL} {NEW} to 10 devices in 2 stage(s)." in page.text
    [listed] = await setup.rollouts()
    assert listed["id"] == rollout_id and listed["status"] == "running"
    assert listed["created_by"] == "user:admin" and listed["target_devices"] == 10
    spec = listed["spec"]
    assert spec["target"] == {"group": setup.group}
    assert [s.get("count") for s in spec["stages"]] == [2, None]
    assert spec["stages"][1]["percent"] == 100
    gate = {"metric": "error_rate", "threshold": 0.05, "min_devices": 1, "min_requests": 20,
            "on_fail": "rollback", "dry_run": False}  # fmt: skip
    assert all(s["gates"] == [gate] and s["bake_s"] == 60 for s in spec["stages"])
    assert spec["rate"] == {"per_minute": 20, "growth": 2} and spec["device_timeout_s"] == 600

    # The same body through the REST API creates the same rollout.
    await setup.api("POST", f"/api/v1/rollouts/{rollout_id}/abort", {"reason": "again"})
    body = {
        "model": MODEL, "version": NEW, "target": {"group": setup.group},
        "stages": [{"count": 2, "bake_s": 60, "gates": [gate]},
                   {"percent": 100, "bake_s": 60, "gates": [gate]}],
        "rate": {"per_minute": 20, "growth": 2}, "device_timeout_s": 600,
    }  # fmt: skip
    again = (await setup.api("POST", "/api/v1/rollouts", body, status=201))["rollout"]
    assert again["spec"] == spec and again["devices"] == listed["devices"]
    first = await setup.api("GET", f"/api/v1/rollouts/{rollout_id}/devices")
    second = await setup.api("GET", f"/api/v1/rollouts/{again['id']}/devices")
    assert [(d["device_id"], d["stage"]) for d in first["items"]] == [
        (d["device_id"], d["stage"]) for d in second["items"]
    ]
    audit = await setup.api("GET", "/api/v1/audit", None)
    created = [e for e in audit["items"] if e["action"] == "rollout.created"]
    assert {e["target_id"] for e in created} == {str(rollout_id), str(again["id"])}
    assert {e["actor"] for e in created} == {"user:admin"}


async def test_the_form_without_auto_rollback_pauses_and_takes_defaults(setup: Setup) -> None:
    rollout_id = await setup.start(
        target=f"site={setup.site} line=b", stages="1:canary:weight=0.2, rest",
        gates="error_rate<0.1 latency_p95_ratio<1.5,on_fail=rollback", bake="", rate="",
        rate_growth="", device_timeout="", auto_rollback="-",
    )  # fmt: skip
    [listed] = await setup.rollouts()
    assert listed["id"] == rollout_id and listed["target_devices"] == 4
    spec = listed["spec"]
    assert spec["target"] == {"labels": {"line": "b", "site": setup.site}}
    assert spec["stages"][0]["mode"] == "canary" and spec["stages"][0]["weight"] == 0.2
    assert [g["on_fail"] for g in spec["stages"][0]["gates"]] == ["pause", "rollback"]
    assert all(s["bake_s"] == 300 for s in spec["stages"])  # the spec's default
    assert spec["rate"] == {"per_minute": None, "growth": 1} and spec["device_timeout_s"] == 600


async def test_the_target_count_counts_what_a_rollout_would_take(setup: Setup) -> None:
    async def count(target: str, console: Console | None = None) -> str:
        c = console or setup.admin
        async with c.session.get(
            c.url("/ui/rollouts/target-count"), params={"target": target}
        ) as r:
            assert r.status == 200 and r.content_type == "application/json"
            return str(json.loads(await r.text())["text"])

    assert await count(f"group={setup.group}") == "10 devices match"
    assert await count(f"site={setup.site}, line=b") == "4 devices match"
    assert await count(f"group={setup.group} profile=generic-x86_64") == "10 devices match"
    assert await count(f"group={setup.group} profile=jetson-orin") == "No accepted device matches"
    one = setup.fleet.devices[0]
    assert await count(f"device={one} device=nope-1") == (
        "1 device matches; there is no device nope-1"
    )
    assert (await count("group=two words")).startswith("Not a target: 'words'")
    assert "is not an identifier" in await count("group='two words'")
    assert (await count("")).startswith("Name the devices")
    # What it counts is what a create takes.
    rollout_id = await setup.start(target=f"site={setup.site} line=b", stages="1, rest")
    assert (await setup.api("GET", f"/api/v1/rollouts/{rollout_id}"))["rollout"][
        "target_devices"
    ] == 4
    viewer = await user_console(setup.plane.cp, "vera", "viewer")
    try:
        assert await count(f"site={setup.site}, line=b", viewer) == "4 devices match"
    finally:
        await viewer.close()


@pytest.mark.parametrize(
    ("changes", "field", "message"),
    [
        ({"stages": "10%:blue, rest"}, "stages", "stage '10%:blue': unknown option 'blue'"),
        ({"stages": "10%, 20%"}, "stages", "stages: the percents sum to 30, not 100"),
        ({"stages": "5, 5, rest"}, "stages", "the last stage would get nothing"),
        ({"gates": "error_rate<2"}, "gates", "stage 1, gate 1, threshold: 2.0 is out of range"),
        ({"gates": "latency<3"}, "gates", "unknown metric 'latency'"),
        ({"gates": "agreement>0.9"}, "gates", "an agreement gate needs a shadow stage"),
        ({"rate": "fast"}, "rate", "write N/min, N/s or N/h"),
        ({"bake": "soon"}, "bake", "'soon' is not a duration"),
        ({"target": "site"}, "target", "write group=G, profile=P, device=D or a label k=v"),
        ({"target": "group=nobody-here"}, "target", "matches no accepted device"),
        ({"version": "9.9.9"}, "version", "has no published version '9.9.9'"),
        ({"version": "0.9.0"}, "version", "0.9.0 is below the current version on 10"),
    ],
)
async def test_invalid_input_keeps_the_values_and_creates_nothing(
    setup: Setup, changes: dict[str, str], field: str, message: str
) -> None:
    page = await setup.admin.post("/ui/rollouts/new", setup.form(**changes))
    assert page.status == 400, page.text[:2000]
    error = re.search(rf'<p class="error" id="{field}-error" role="alert">([^<]*)</p>', page.text)
    assert error is not None, page.text
    assert message in error[1].replace("&#39;", "'"), error[1]
    assert f'aria-describedby="{field}-error' in page.text
    for name, value in setup.form(**changes).items():  # what was typed is still there
        if name not in ("model", "auto_rollback"):
            escaped = value.replace("<", "&lt;").replace(">", "&gt;")
            assert escaped in page.text, (name, value)
    assert await setup.rollouts() == []


# ---------------------------------------------------------------------------- the pages
async def test_the_detail_page_shows_stages_devices_and_gates(setup: Setup) -> None:
    fleet = setup.fleet
    rollout_id = await setup.start()
    await fleet.settle()
    moving = [d for d, v in (await fleet.told()).items() if v == NEW]
    assert len(moving) == 2
    page = await setup.admin.get(f"/ui/rollouts/{rollout_id}")
    assert f'<div id="rollout-live" data-live="/ui/rollouts/{rollout_id}/live">' in page.text
    assert state_of(page) == "running"
    assert 'id="rollout-progress">0 %<' in page.text and "0 of 10 devices done" in page.text
    for d in fleet.devices:
        assert f'<tr data-device="{d}">' in page.text
    row = re.search(rf'<tr data-device="{moving[0]}">(.*?)</tr>', page.text, re.S)
    assert row is not None and "moving" in row[1] and f"{OLD} → {NEW}" in row[1]
    stages = re.findall(r'<tr data-stage="(\d)">(.*?)</tr>', page.text, re.S)
    assert [n for n, _ in stages] == ["1", "2"]
    assert "2 devices" in stages[0][1] and "running" in stages[0][1]
    assert "100% (8 devices)" in stages[1][1] and "not started" in stages[1][1]
    assert "error_rate&lt;0.05,min_requests=20" in stages[0][1]
    gate = re.search(r'<tr data-gate="error_rate">(.*?)</tr>', page.text, re.S)
    assert gate is not None and "&lt; 0.05" in gate[1] and "not judged yet" in gate[1]
    assert "stage_started" in page.text  # the history

    await fleet.running(moving, NEW)
    await fleet.settle()
    for d in moving:
        await fleet.stats(d, NEW, count=40, errors=1)
    await fleet.settle()
    page = await setup.admin.get(f"/ui/rollouts/{rollout_id}")
    assert "2 of 10 devices done" in page.text and 'id="rollout-progress">20 %<' in page.text
    gate = re.search(r'<tr data-gate="error_rate">(.*?)</tr>', page.text, re.S)
    assert gate is not None, page.text
    cells = re.findall(r"<td[^>]*>(.*?)</td>", gate[1], re.S)
    assert cells[1:4] == ["0.025", "&lt; 0.05", '<span class="badge ok">pass</span>'], cells
    assert "bake_started" in page.text

    failed = await setup.admin.get(f"/ui/rollouts/{rollout_id}?phase=active")
    assert failed.text.count("<tr data-device=") == 2
    assert (await setup.admin.get(f"/ui/rollouts/{rollout_id}?phase=nope")).status == 400


async def test_the_list_shows_active_then_history(setup: Setup) -> None:
    empty = await setup.admin.get("/ui/rollouts")
    assert 'id="rollouts-empty"' in empty.text and "mcp-controlplane rollouts create" in empty.text
    assert 'href="/ui/rollouts/new"' in empty.text
    first = await setup.start(target=f"site={setup.site} line=b", stages="1, rest")
    await setup.api("POST", f"/api/v1/rollouts/{first}/abort", {})
    second = await setup.start()
    page = await setup.admin.get("/ui/rollouts")
    assert '<table id="rollouts">' in page.text
    active, history = page.text.split('id="rollouts-history"')
    assert f'<tr data-rollout="{second}" data-status="running">' in active
    assert f'<a href="/ui/rollouts/{second}">{second}</a>' in active
    assert "0 of 10 devices" in active and "<progress" in active
    assert f'<tr data-rollout="{first}" data-status="aborted">' in history
    assert "aborted by user:admin" in history


async def test_the_live_route_streams_the_state(setup: Setup) -> None:
    rollout_id = await setup.start()
    name, data = await first_event(setup.admin, f"/ui/rollouts/{rollout_id}/live")
    assert name == "update"
    assert state_of(data) == "running" and 'id="rollout-progress">0 %<' in data
    await setup.api("POST", f"/api/v1/rollouts/{rollout_id}/abort", {})
    async with setup.admin.session.get(setup.admin.url(f"/ui/rollouts/{rollout_id}/live")) as r:
        text = await asyncio.wait_for(r.text(), STREAM_TIMEOUT_S)  # it ends by itself
    assert "event: update" in text and "event: end" in text
    assert state_of(text) == "aborted"
    missing = await setup.admin.get("/ui/rollouts/999/live")
    assert missing.status == 404 and "no rollout 999" in missing.text


async def test_commands_do_what_the_api_does(setup: Setup) -> None:
    rollout_id = await setup.start()
    page = await setup.admin.get(f"/ui/rollouts/{rollout_id}")
    shown = set(re.findall(r'<button type="submit" id="action-(\w+)"', page.text))
    assert shown == {"pause", "promote", "abort", "rollback"}
    assert 'data-confirm="Pause rollout' in page.text and ">Roll back</button>" in page.text

    async def command(op: str, reason: str = "") -> Page:
        return await setup.admin.post(f"/ui/rollouts/{rollout_id}/{op}", {"reason": reason})

    page = await command("pause", "night")
    assert page.status == 200 and state_of(page) == "paused"
    assert f"Rollout {rollout_id} paused; it is paused." in page.text
    assert set(re.findall(r'<button type="submit" id="action-(\w+)"', page.text)) == {
        "resume", "promote", "abort", "rollback",
    }  # fmt: skip
    api = await setup.api("GET", f"/api/v1/rollouts/{rollout_id}")
    assert api["rollout"]["status"] == "paused"
    assert api["rollout"]["reason"] == "paused by user:admin: night"

    page = await command("resume")
    assert state_of(page) == "running"
    page = await command("promote")
    assert (await setup.api("GET", f"/api/v1/rollouts/{rollout_id}"))["rollout"]["stage"] == 1
    page = await command("abort", "wrong version")
    assert state_of(page) == "aborted" and 'id="action-' not in page.text
    events = await setup.api("GET", f"/api/v1/rollouts/{rollout_id}/events")
    kinds = [e["kind"] for e in events["items"]]
    order = [kinds.index(k) for k in ("paused", "resumed", "promoted", "aborted")]
    assert order == sorted(order) and "stage_passed" in kinds, kinds
    audit = await setup.api("GET", "/api/v1/audit")
    actions = [e["action"] for e in audit["items"] if e["target_id"] == str(rollout_id)]
    assert {"rollout.pause", "rollout.resume", "rollout.promote", "rollout.abort"} <= set(actions)

    refused = await command("pause")
    assert refused.status == 409
    assert "rollout is aborted; it has ended and takes no command" in refused.text
    assert 'id="action-error"' in refused.text and state_of(refused) == "aborted"
    long = await command("resume", "x" * 300)
    assert long.status == 400 and "reason" in long.text


async def test_roll_back_puts_devices_back(setup: Setup) -> None:
    fleet = setup.fleet
    rollout_id = await setup.start()
    await fleet.settle()
    page = await setup.admin.post(f"/ui/rollouts/{rollout_id}/rollback", {"reason": "bad"})
    assert state_of(page) == "rolling back"
    await fleet.settle()
    assert all(v == OLD for v in (await fleet.told()).values())


async def test_unknown_rollout_is_a_404_page(setup: Setup) -> None:
    for path in ("/ui/rollouts/4242", "/ui/rollouts/abc"):
        page = await setup.admin.get(path)
        assert page.status == 404 and "<html" in page.text
    page = await setup.admin.post("/ui/rollouts/4242/pause", {})
    assert page.status == 404 and "no rollout 4242" in page.text


# ---------------------------------------------------------------------------- who may
async def test_a_viewer_sees_and_changes_nothing(setup: Setup) -> None:
    rollout_id = await setup.start()
    viewer = await user_console(setup.plane.cp, "vera", "viewer")
    try:
        page = await viewer.get(f"/ui/rollouts/{rollout_id}")
        assert page.status == 200 and 'id="action-' not in page.text
        assert 'href="/ui/rollouts/new"' not in (await viewer.get("/ui/rollouts")).text
        assert (await viewer.get("/ui/rollouts/new")).status == 403
        posts = ["/ui/rollouts/new", *(f"/ui/rollouts/{rollout_id}/{op}" for op in COMMANDS)]
        for path in posts:
            refused = await viewer.post(path, setup.form())
            assert refused.status == 403, path
            assert "viewer may not do this" in refused.text
    finally:
        await viewer.close()
    [listed] = await setup.rollouts()
    assert listed["status"] == "running"
    events = await setup.api("GET", f"/api/v1/rollouts/{rollout_id}/events")
    assert [e["kind"] for e in events["items"]] == ["stage_started"]


async def test_a_post_without_the_csrf_token_is_refused(setup: Setup) -> None:
    refused = await setup.admin.post("/ui/rollouts/new", setup.form(), csrf="")
    assert refused.status == 403 and "CSRF" in refused.text
    assert await setup.rollouts() == []
    rollout_id = await setup.start()
    for op in ("pause", "abort"):
        refused = await setup.admin.post(f"/ui/rollouts/{rollout_id}/{op}", {}, csrf="")
        assert refused.status == 403 and "CSRF" in refused.text
    assert (await setup.rollouts())[0]["status"] == "running"


async def test_names_and_labels_are_escaped(setup: Setup) -> None:
    cp = setup.plane.cp
    token = (await cp.new_token(max_uses=1, labels={"note": SCRIPT}))["token"]
    status, answer = await cp.enroll(PrivateKey.generate(), token, device_id="odd-1")
    assert status == 200, answer
    page = await setup.admin.post("/ui/rollouts/new", setup.form(model=SCRIPT))
    assert page.status == 400 and SCRIPT not in page.text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page.text
    form = await setup.admin.get("/ui/rollouts/new?target=" + "note%3D%22%3Cscript%3E%22")
    assert "<script>" not in form.text.replace('<script src="/ui/static/', "")

    answer = await setup.api(
        "POST", "/api/v1/rollouts",
        {"model": MODEL, "version": NEW, "target": {"labels": {"note": SCRIPT}},
         "stages": [{"percent": 100}]},
        status=201,
    )  # fmt: skip
    rollout_id = answer["rollout"]["id"]
    for path in (f"/ui/rollouts/{rollout_id}", "/ui/rollouts"):
        page = await setup.admin.get(path)
        assert SCRIPT not in page.text
    detail = await setup.admin.get(f"/ui/rollouts/{rollout_id}")
    assert "note=&lt;script&gt;alert(1)&lt;/script&gt;" in detail.text
    name, data = await first_event(setup.admin, f"/ui/rollouts/{rollout_id}/live")
    assert name == "update" and SCRIPT not in data


# ---------------------------------------------------------------------------- the target line
def test_target_lines_read_back() -> None:
    assert parse_target("group=a, site=f1 profile=p profile=q device=d label:group=x") == {
        "group": "a",
        "profiles": ["p", "q"],
        "devices": ["d"],
        "labels": {"site": "f1", "group": "x"},
    }
    assert parse_target("room='hall 2, east'") == {"labels": {"room": "hall 2, east"}}
    for line in ("group=a site=f1", "label:device=x room='hall 2, east' profile=p"):
        target = parse_target_spec(parse_target(line))
        assert parse_target_spec(parse_target(format_target(target))) == target
    for bad, why in (
        ("site", "write group=G"),
        ("group=a group=b", "two groups"),
        ("room='open", "close every quote"),
        ("site=a site=b", "given twice"),
    ):
        with pytest.raises(ValueError, match=why):
            parse_target(bad)
