"""The console's overview, enrollment and models pages over HTTP, on SQLite and PostgreSQL.

Devices enroll through the REST API with real signed envelopes; what they report (broker
presence, reported state, deployment events) is written with the ingestion's own queries, the
rows ingestion stores; bundles are built from the digits model, signed and published over REST.
Every assertion is on what a user sees: the page's text and status, and what the REST API says
afterwards.
"""

from __future__ import annotations

import html
import re
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import quote

import numpy as np
import pytest
from aiohttp import web

from mcp_edge.controlplane.api.common import SERVICES
from mcp_edge.controlplane.db import Database, registry
from mcp_edge.controlplane.db import drift as drift_q
from mcp_edge.controlplane.db import telemetry as telemetry_q
from mcp_edge.controlplane.settings import EnrollmentApproval
from mcp_edge.shared.bundle import build_bundle, sign_bundle
from mcp_edge.shared.signing import PrivateKey
from mcp_edge.shared.version import SemVer
from mcp_edge.tooling.models import DigitsModels
from tests.integration.test_deployments import publish_versions
from tests.support.console import Console, ConsolePlane, Page, console_plane, user_console
from tests.support.controlplane import ControlPlane

SCRIPT = "<script>alert(1)</script>"
ESCAPED = html.escape(SCRIPT, quote=False)


@pytest.fixture
async def plane(database_url: str, tmp_path: Path) -> AsyncIterator[ConsolePlane]:
    async with console_plane(database_url, tmp_path / "cp") as p:
        yield p


def db_of(cp: ControlPlane) -> Database:
    app: web.Application = cp.client.app
    return app[SERVICES].db


def card(page: Page, card_id: str) -> int:
    found = re.search(rf'id="{card_id}".*?class="big">(\d+)<', page.text, re.S)
    assert found is not None, f"no card {card_id}"
    return int(found.group(1))


def section(page: Page, section_id: str) -> str:
    found = re.search(rf'<section id="{section_id}".*?</section>', page.text, re.S)
    assert found is not None, f"no section {section_id}"
    return found.group(0)


async def api_total(cp: ControlPlane, status: str) -> int:
    code, answer = await cp.call("GET", "/api/v1/devices", params={"status": status})
    assert code == 200, answer
    return int(answer["total"])


async def enroll(cp: ControlPlane, token: str, device_id: str, **kwargs: Any) -> str:
    """Enroll a new key as ``device_id``; the answer's status (accepted or pending)."""
    code, answer = await cp.enroll(PrivateKey.generate(), token, device_id=device_id, **kwargs)
    assert code == 200, answer
    return str(answer["status"])


async def device(cp: ControlPlane, device_id: str) -> dict[str, Any]:
    code, answer = await cp.call("GET", f"/api/v1/devices/{device_id}")
    assert code == 200, answer
    return dict(answer)


def assert_escaped(page: Page) -> None:
    assert SCRIPT not in page.text
    assert ESCAPED in page.text


# ---------------------------------------------------------------------------- overview
async def report_running(
    db: Database, cp: ControlPlane, device_id: str, model: str = "digits", **status: Any
) -> None:
    """The device's retained reported state, as ingestion stores it."""
    now = cp.clock()
    document = {
        "device_id": device_id,
        "ts": now.timestamp(),
        "applied_seq": 1,
        "profile": "generic-x86_64",
        "models": [{"name": model, "phase": "active", **status}],
    }
    async with db.transaction() as tx:
        await telemetry_q.upsert_reported(
            tx,
            [{"device_id": device_id, "ts": now, "received_at": now, "applied_seq": 1,
              "document": document}],
        )  # fmt: skip


async def report_failure(
    db: Database, cp: ControlPlane, device_id: str, seq: int, **row: Any
) -> None:
    now = cp.clock()
    event = {
        "device_id": device_id, "event_seq": seq, "ts": now, "received_at": now,
        "model": "digits", "version": "1.1.0", "phase": "warming", "outcome": "error",
        "message": "warm-up failed: Gather index out of range", "cause": "warmup",
        "bytes_done": None, "bytes_total": None, "elapsed_ms": 3.0, **row,
    }  # fmt: skip
    async with db.transaction() as tx:
        await telemetry_q.insert_events(tx, [event])


async def test_overview_empty_fleet_says_how_to_start(plane: ConsolePlane) -> None:
    page = await plane.admin.get("/ui/")
    assert page.status == 200 and 'aria-current="page">Overview' in page.text
    assert [card(page, c) for c in ("fleet-online", "fleet-offline", "fleet-pending")] == [0, 0, 0]
    assert "No devices yet" in page.text and 'href="/ui/enrollment"' in page.text
    assert "mcp-controlplane tokens create" in page.text
    assert "No rollout is in progress" in section(page, "active-rollouts")
    assert "No deployment failures" in section(page, "recent-failures")
    assert "No drift triggers" in section(page, "recent-triggers")


async def test_overview_counts_breakdowns_versions_rollouts_failures_triggers(
    plane: ConsolePlane,
) -> None:
    cp, db = plane.cp, db_of(plane.cp)
    auto = (await cp.new_token(max_uses=10))["token"]
    manual = (await cp.new_token(approval="manual"))["token"]
    for i in range(4):
        labels = {"site": "f1" if i < 3 else "f2", "note": SCRIPT}
        profile = "raspberry-pi" if i == 3 else "generic-x86_64"
        assert await enroll(cp, auto, f"cam-{i}", labels=labels, profile=profile) == "accepted"
    assert await enroll(cp, manual, "gate-1") == "pending"
    async with db.transaction() as tx:  # online, as their birth messages make them
        await telemetry_q.mark_seen(tx, ["cam-0", "cam-1"], ["cam-0", "cam-1"], [], cp.clock())

    await publish_versions(db, cp.clock(), "digits", "1.0.0", "1.1.0")
    for d in ("cam-0", "cam-1", "cam-2"):
        await report_running(db, cp, d, active_version="1.0.0", installed_versions=["1.0.0"])
    await report_running(db, cp, "cam-3", active_version="1.0.0", canary_version="1.1.0")
    await report_failure(db, cp, "cam-2", 1)
    await report_failure(db, cp, "cam-1", 2, message="download failed: reset; retrying in 5 s",
                         cause="download", phase="downloading")  # fmt: skip
    async with db.transaction() as tx:
        trigger = await drift_q.insert_trigger(
            tx, model="digits", version="1.0.0", raised_at=cp.clock(), status="open",
            score=0.41, figures={}, rule={}, device_count=3, device_ids=["cam-0"], note="",
        )  # fmt: skip
    code, answer = await cp.call(
        "POST", "/api/v1/deployments",
        body={"model": "digits", "version": "1.0.0", "selector": {"labels": {"site": "f1"}}},
    )  # fmt: skip
    assert code == 201, answer
    code, answer = await cp.call(
        "POST", "/api/v1/rollouts",
        body={"model": "digits", "version": "1.1.0",
              "target": {"devices": ["cam-0", "cam-1", "cam-2"]},
              "stages": [{"count": 1, "bake_s": 600}, {"count": 2}]},
    )  # fmt: skip
    assert code == 201, answer
    rollout_id = answer["rollout"]["id"]

    page = await plane.admin.get("/ui/")
    assert page.status == 200
    assert card(page, "fleet-online") == await api_total(cp, "online") == 2
    assert card(page, "fleet-offline") == await api_total(cp, "offline") == 2
    assert card(page, "fleet-pending") == await api_total(cp, "pending") == 1
    assert "No devices yet" not in page.text

    profiles = re.search(r'<table id="by-profile">.*?</table>', page.text, re.S)
    assert profiles is not None
    rows = re.findall(r"<tr><td>.*?>([\w.-]+)</a></td>\s*<td class=\"num\">(\d+)</td>"
                      r"<td class=\"num\">(\d+)</td><td class=\"num\">(\d+)</td>",
                      profiles.group(0))  # fmt: skip
    assert rows == [("generic-x86_64", "3", "2", "1"), ("raspberry-pi", "1", "0", "1")]
    by_label = re.search(r'<table id="by-label">.*?</table>', page.text, re.S)
    assert by_label is not None
    assert "<code>site=f1</code>" in by_label.group(0)
    assert "<code>site=f2</code>" in by_label.group(0)
    assert f"<code>note={ESCAPED}</code>" in by_label.group(0)
    assert_escaped(page)

    running = re.findall(
        r'<tr data-model="digits" data-version="([\d.]+)">.*?<td class="num">(\d+)</td>'
        r'<td class="num">(\d+)</td><td class="num">(\d+)</td>',
        page.text,
        re.S,
    )
    assert running == [("1.0.0", "4", "0", "0"), ("1.1.0", "0", "1", "0")]

    rollouts = section(page, "active-rollouts")
    assert f'href="/ui/rollouts/{rollout_id}"' in rollouts and "<progress" in rollouts
    assert "digits 1.1.0" in rollouts and "of 3 devices done" in rollouts

    failures = section(page, "recent-failures")
    assert "cam-2" in failures and "warmup" in failures and "Gather index out of range" in failures
    assert "retrying" not in failures  # the agent retries those downloads by itself
    triggers = section(page, "recent-triggers")
    assert f'href="/ui/drift/triggers/{trigger.id}"' in triggers and "0.410" in triggers


# ---------------------------------------------------------------------------- enrollment
TOKEN_FORM = {
    "description": f"line 3 {SCRIPT}",
    "group": "line-3",
    "labels": f"site=f1\r\nrole={SCRIPT}\r\n",
    "max_uses": "2",
    "expires_in_s": "86400",
    "approval": "auto",
}


def secret_of(page: Page) -> str:
    found = re.search(r'<code id="token-secret">([^<]+)</code>', page.text)
    assert found is not None, page.text[:2000]
    return found.group(1)


async def test_a_new_token_is_shown_once_and_enrolls_a_device(plane: ConsolePlane) -> None:
    cp, admin = plane.cp, plane.admin
    form = await admin.get("/ui/enrollment")
    assert form.status == 200 and 'id="new-token"' in form.text and 'id="preauthorize"' in form.text
    assert "No enrollment tokens yet" in form.text and "No device is waiting" in form.text

    created = await admin.post("/ui/enrollment/tokens", TOKEN_FORM)
    assert created.status == 200, created.text[:2000]
    secret = secret_of(created)
    line = re.search(r'<pre id="enroll-line">([^<]+)</pre>', created.text)
    assert line is not None
    server = str(cp.client.make_url("")).rstrip("/")
    assert html.unescape(line.group(1)) == f"mcp-agent enroll --server {server} --token {secret}"
    assert '<button type="button" data-copy="enroll-line" hidden>Copy</button>' in created.text
    assert created.headers["Cache-Control"] == "no-store"
    assert_escaped(created)

    listing = await admin.get("/ui/enrollment")
    assert secret not in listing.text  # shown once
    assert_escaped(listing)
    code, tokens = await cp.call("GET", "/api/v1/enrollment-tokens")
    assert code == 200 and len(tokens["items"]) == 1
    token = tokens["items"][0]
    assert secret.startswith(token["prefix"]) and f"{token['prefix']}…" in listing.text
    assert token["description"] == f"line 3 {SCRIPT}" and token["group"] == "line-3"
    assert token["labels"] == {"site": "f1", "role": SCRIPT} and token["max_uses"] == 2
    assert token["approval"] == "auto" and token["created_by"] == "admin"
    assert token["expires_at"].startswith(
        (cp.clock() + timedelta(days=1)).strftime("%Y-%m-%dT%H:%M")
    )

    assert await enroll(cp, secret, "cam-1") == "accepted"
    joined = await device(cp, "cam-1")
    assert joined["labels"] == {"site": "f1", "role": SCRIPT} and joined["group"] == "line-3"
    listing = await admin.get("/ui/enrollment")
    assert re.search(
        rf'data-token="{token["id"]}">.*?1 of 2.*?badge ok">active', listing.text, re.S
    )

    revoked = await admin.post(f"/ui/enrollment/tokens/{token['id']}/revoke")
    assert revoked.status == 200 and "Revoked enrollment token" in revoked.text
    assert re.search(rf'data-token="{token["id"]}">.*?badge bad">revoked', revoked.text, re.S)
    code, answer = await cp.call("GET", f"/api/v1/enrollment-tokens/{token['id']}")
    assert answer["state"] == "revoked"
    code, answer = await cp.enroll(PrivateKey.generate(), secret, device_id="cam-2")
    assert code == 403 and "revoked" in answer["error"]


async def test_a_token_form_with_mistakes_says_what_is_wrong(plane: ConsolePlane) -> None:
    admin = plane.admin
    await admin.get("/ui/enrollment")
    for changes, message in (
        ({"labels": "site"}, "is not key=value"),
        ({"labels": "site=a\nsite=b"}, "'site' is given twice"),
        ({"labels": "Bad Key=1"}, "label key"),
        ({"max_uses": "0"}, "max_uses"),
        ({"expires_in_s": "5"}, "expires_in_s"),
        ({"approval": "sometimes"}, "approval"),
        ({"group": "no spaces here"}, "group"),
    ):
        page = await admin.post("/ui/enrollment/tokens", {**TOKEN_FORM, **changes})
        assert page.status == 400, changes
        assert 'role="alert"' in page.text and message in html.unescape(page.text), changes
        assert html.escape(f"line 3 {SCRIPT}") in page.text  # what was typed stays
    code, tokens = await plane.cp.call("GET", "/api/v1/enrollment-tokens")
    assert code == 200 and tokens["items"] == []


async def test_approve_and_reject_do_what_the_api_does(plane: ConsolePlane) -> None:
    cp, admin = plane.cp, plane.admin
    manual = (await cp.new_token(approval="manual", description=SCRIPT))["token"]
    assert await enroll(cp, manual, "gate-1", labels={"note": SCRIPT}) == "pending"
    assert await enroll(cp, manual, "gate-2") == "pending"
    page = await admin.get("/ui/enrollment")
    assert '<table id="pending"' in page.text
    assert '<tr data-device="gate-1">' in page.text and '<tr data-device="gate-2">' in page.text
    assert_escaped(page)
    assert card(await admin.get("/ui/"), "fleet-pending") == 2

    approved = await admin.post("/ui/enrollment/approvals/gate-1/approve")
    assert approved.status == 200 and "Approved gate-1" in approved.text
    assert '<tr data-device="gate-1">' not in approved.text
    assert (await device(cp, "gate-1"))["status"] == "accepted"
    code, answer = await cp.enroll(PrivateKey.generate(), manual, device_id="gate-3")
    assert answer["status"] == "pending"

    rejected = await admin.post("/ui/enrollment/approvals/gate-2/reject")
    assert rejected.status == 200 and "Rejected gate-2" in rejected.text
    assert (await device(cp, "gate-2"))["status"] == "rejected"
    code, pending = await cp.call("GET", "/api/v1/approvals")
    assert [d["id"] for d in pending["items"]] == ["gate-3"]
    code, audit = await cp.call("GET", "/api/v1/audit")
    assert code == 200, audit
    actions = {(e["action"], e["target_id"], e["actor"]) for e in audit["items"]}
    assert {
        ("device.approved", "gate-1", "user:admin"),
        ("device.rejected", "gate-2", "user:admin"),
    } <= actions

    again = await admin.post("/ui/enrollment/approvals/gate-1/approve")
    assert again.status == 409 and "not pending" in again.text
    missing = await admin.post("/ui/enrollment/approvals/nobody/reject")
    assert missing.status == 404 and "no device" in missing.text


async def test_server_policy_manual_makes_the_enroll_line_wait(
    database_url: str, tmp_path: Path
) -> None:
    async with console_plane(
        database_url, tmp_path / "cp", enrollment_approval=EnrollmentApproval.MANUAL
    ) as plane:
        page = await plane.admin.get("/ui/enrollment")
        assert 'enrollment_approval = "manual"' in html.unescape(page.text)
        created = await plane.admin.post("/ui/enrollment/tokens", TOKEN_FORM)
        secret = secret_of(created)
        assert f"--token {secret} --wait 600</pre>" in created.text
        assert await enroll(plane.cp, secret, "cam-9") == "pending"
        page = await plane.admin.get("/ui/enrollment")
        assert '<tr data-device="cam-9">' in page.text
        assert "operator approves (server policy)" in page.text


async def test_preauthorize_accepts_a_key_before_it_enrolls(plane: ConsolePlane) -> None:
    cp, admin = plane.cp, plane.admin
    key = PrivateKey.generate()
    form = {
        "public_key": key.public_key.raw.hex().upper(),
        "device_id": "kiosk-7",
        "group": "kiosks",
        "labels": f"site=hq\nnote={SCRIPT}",
    }
    await admin.get("/ui/enrollment")
    page = await admin.post("/ui/enrollment/preauthorize", form)
    assert page.status == 200 and "Preauthorized kiosk-7" in page.text
    pre = await device(cp, "kiosk-7")
    assert pre["status"] == "preauthorized" and pre["public_key"] == key.public_key.raw.hex()
    assert pre["group"] == "kiosks" and pre["labels"] == {"site": "hq", "note": SCRIPT}

    again = await admin.post("/ui/enrollment/preauthorize", form)
    assert again.status == 409 and "already belongs to device" in html.unescape(again.text)
    bad = await admin.post("/ui/enrollment/preauthorize", {**form, "public_key": "00" * 32})
    assert bad.status == 400 and 'role="alert"' in bad.text

    code, answer = await cp.enroll(key, "not-a-real-token")
    assert code == 200 and answer["status"] == "accepted" and answer["device_id"] == "kiosk-7"


# ---------------------------------------------------------------------------- models
@pytest.fixture(scope="module")
def bundles(tmp_path_factory: pytest.TempPathFactory, digits: DigitsModels) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("ui-bundles")
    publisher = PrivateKey.generate()
    samples = out / "samples.npy"
    np.save(samples, digits.X_test[:200].astype(np.float32))
    paths = {}
    for version, baseline in (("1.0.0", samples), ("1.1.0", None)):
        path = out / f"digits-{version}.mcpb"
        build_bundle(
            digits.onnx_path, path, name="digits", version=version, baseline_npy=baseline,
            metadata={"note": SCRIPT},
        )  # fmt: skip
        sign_bundle(path, publisher, validate_models=False)
        paths[version] = path
    return {"publisher": publisher, "paths": paths}


async def test_models_pages_show_versions_manifest_and_baseline(
    plane: ConsolePlane, bundles: dict[str, Any]
) -> None:
    cp, admin = plane.cp, plane.admin
    empty = await admin.get("/ui/models")
    assert empty.status == 200 and "No models are published yet" in empty.text
    assert "No publisher keys" in empty.text
    key: PrivateKey = bundles["publisher"]
    code, answer = await cp.call(
        "POST", "/api/v1/publishers",
        body={"name": "vision team", "public_key": key.public_key.raw.hex()},
    )  # fmt: skip
    assert code == 201, answer
    for version in ("1.0.0", "1.1.0"):
        code, answer = await cp.call(
            "POST", "/api/v1/bundles", raw=bundles["paths"][version].read_bytes(),
            headers={"Content-Type": "application/octet-stream"},
        )  # fmt: skip
        assert code == 201, answer
    code, detail = await cp.call("GET", "/api/v1/models/digits")
    newest = detail["versions"][0]

    registry = await admin.get("/ui/models")
    assert registry.status == 200 and 'aria-current="page">Models' in registry.text
    assert re.findall(r'<tr data-version="([\d.]+)">', registry.text) == ["1.1.0", "1.0.0"]
    assert "vision team" in registry.text and key.public_key.keyid[:16] in registry.text
    assert 'href="/ui/models/digits/1.0.0"' in registry.text and "2 versions" in registry.text

    model = await admin.get("/ui/models/digits")
    assert model.status == 200
    assert re.findall(r'<tr data-version="([\d.]+)">', model.text) == ["1.1.0", "1.0.0"]
    size = re.search(r'<tr data-version="1.1.0">.*?<td class="num">([^<]+)</td>', model.text, re.S)
    assert size is not None and size.group(1) == f"{newest['length'] / 1024:.1f} KiB"

    page = await admin.get("/ui/models/digits/1.0.0")
    assert page.status == 200
    manifest = re.search(r'<pre id="manifest"[^>]*>(.*?)</pre>', page.text, re.S)
    assert manifest is not None
    text = html.unescape(manifest.group(1))
    assert '"name": "digits"' in text and '"version": "1.0.0"' in text
    assert f'"note": "{SCRIPT}"' in text and '"drift_baseline": {' in text
    assert_escaped(page)
    features = re.search(r'<table id="baseline-features">.*?</table>', page.text, re.S)
    assert features is not None, page.text[page.text.find("Drift baseline") :][:1500]
    names = re.findall(r"<tr><td><code>(\w+)</code>", features.group(0))
    assert names == [f"f{i}" for i in range(64)]
    assert "<svg" in features.group(0) and "Histogram of f0" in features.group(0)
    assert "200" in page.text and 'id="baseline-classes"' in page.text
    assert "vision team" in page.text

    plain = await admin.get("/ui/models/digits/1.1.0")
    assert plain.status == 200 and "has no drift baseline" in plain.text
    assert '<pre id="manifest"' in plain.text
    for path, message in (
        ("/ui/models/nothing", "no model"),
        ("/ui/models/digits/9.9.9", "no version"),
    ):
        missing = await admin.get(path)
        assert missing.status == 404 and message in html.unescape(missing.text)


async def test_names_stored_by_any_path_render_as_text(plane: ConsolePlane) -> None:
    """Model, version, variant and publisher names the REST API refuses, written straight to
    the database (by an older release, by another tool), still render as text."""
    cp, db = plane.cp, db_of(plane.cp)
    name = "<img src=x onerror=alert(1)>"
    key = PrivateKey.generate().public_key
    variant = {"name": SCRIPT, "file": "m.onnx", "sha256": "0" * 64, "size": 1, "profiles": []}
    async with db.transaction() as tx:
        await registry.add_publisher(
            tx, keyid=key.keyid, public_key=key.raw.hex(), name=SCRIPT, now=cp.clock()
        )
        await registry.insert_version(
            tx, model=name, version="1.0.0", version_numeric=SemVer.parse("1.0.0").to_numeric(),
            target_path=f"{name}/1.0.0/{name}-1.0.0.mcpb", sha256="0" * 64, length=10,
            format="onnx", profiles=[SCRIPT], variants=[variant], publisher_keyid=key.keyid,
            uploaded_by=SCRIPT, now=cp.clock(),
        )  # fmt: skip
    token = (await cp.new_token())["token"]
    assert await enroll(cp, token, "cam-1") == "accepted"
    await report_running(db, cp, "cam-1", model=name, active_version=SCRIPT)

    shown = html.escape(name, quote=False)
    for path in ("/ui/models", f"/ui/models/{quote(name)}", f"/ui/models/{quote(name)}/1.0.0"):
        page = await plane.admin.get(path)
        assert page.status == 200, path
        assert name not in page.text and shown in page.text, path
        assert_escaped(page)
    overview = await plane.admin.get("/ui/")
    assert name not in overview.text and shown in overview.text
    assert_escaped(overview)


# ---------------------------------------------------------------------------- roles and CSRF
POSTS = (
    "/ui/enrollment/tokens",
    "/ui/enrollment/tokens/{token}/revoke",
    "/ui/enrollment/approvals/gate-1/approve",
    "/ui/enrollment/approvals/gate-1/reject",
    "/ui/enrollment/preauthorize",
)


async def nothing_changed(cp: ControlPlane, token_id: int) -> None:
    code, tokens = await cp.call("GET", "/api/v1/enrollment-tokens")
    assert code == 200, tokens
    assert [(t["id"], t["state"]) for t in tokens["items"]] == [(token_id, "active")]
    assert (await device(cp, "gate-1"))["status"] == "pending"
    assert (await cp.call("GET", "/api/v1/devices/kiosk-1"))[0] == 404


async def prepared(cp: ControlPlane) -> tuple[int, dict[str, str]]:
    token = await cp.new_token(approval="manual")
    assert await enroll(cp, token["token"], "gate-1") == "pending"
    form = {
        **TOKEN_FORM,
        "public_key": PrivateKey.generate().public_key.raw.hex(),
        "device_id": "kiosk-1",
    }
    return int(token["id"]), form


async def test_a_viewer_sees_the_pages_and_changes_nothing(plane: ConsolePlane) -> None:
    cp = plane.cp
    token_id, form = await prepared(cp)
    viewer: Console = await user_console(cp, "vera", "viewer")
    try:
        for path in ("/ui/", "/ui/enrollment", "/ui/models"):
            page = await viewer.get(path)
            assert page.status == 200, path
        page = await viewer.get("/ui/enrollment")
        assert '<tr data-device="gate-1">' in page.text
        assert 'id="new-token"' not in page.text and 'id="preauthorize"' not in page.text
        assert "/approve" not in page.text and "/revoke" not in page.text
        for path in POSTS:
            answer = await viewer.post(path.format(token=token_id), form)
            assert answer.status == 403 and "needs the operator role" in answer.text, path
        await nothing_changed(cp, token_id)
    finally:
        await viewer.close()


async def test_a_post_without_the_csrf_token_is_refused(plane: ConsolePlane) -> None:
    cp, admin = plane.cp, plane.admin
    token_id, form = await prepared(cp)
    await admin.get("/ui/enrollment")
    for path in POSTS:
        for csrf in ("", "0" * 64):
            answer = await admin.post(path.format(token=token_id), form, csrf=csrf)
            assert answer.status == 403 and "CSRF" in answer.text, path
    await nothing_changed(cp, token_id)
