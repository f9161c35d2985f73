"""The console's drift pages over HTTP (SQLite and PostgreSQL): a model version's fleet drift
and its devices from reports fed through the drift store the ingestion uses, a device's drift
over time, retraining triggers appearing in a live table, a trigger's webhook deliveries to a
real HTTP receiver, and acknowledging one as the API does (roles and CSRF enforced)."""

from __future__ import annotations

import asyncio
import hashlib
import html
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

from mcp_edge.controlplane.app import DRIFT
from mcp_edge.controlplane.db import drift as drift_q
from mcp_edge.controlplane.db import hard_examples as examples_q
from mcp_edge.controlplane.drift.sample import decode_drift
from mcp_edge.controlplane.settings import WebhookConfig
from mcp_edge.shared.bundle.baseline import compute_baseline
from mcp_edge.shared.bundle.manifest import DriftBaseline
from mcp_edge.shared.drift import Binner
from tests.support.console import Console, ConsolePlane, console_plane, user_console
from tests.support.controlplane import ControlPlane, FakeClock
from tests.support.drift import Receiver, running_receiver, secret_file, window

DEVICES = ["cam-1", "cam-2", "cam-3"]
WAIT_S = 20.0
RULE = {"threshold": 0.2, "min_devices": 1, "min_samples": 100, "sustained": 1,
        "cooldown_s": 3600, "window_s": 60}  # fmt: skip


@pytest.fixture(scope="module")
def baseline() -> DriftBaseline:
    rng = np.random.default_rng(21)
    data = rng.normal(size=(4000, 6))
    return compute_baseline("x", data, output_name="p", scores=_scores(data), bins=8)


def _scores(data: Any) -> Any:
    logits = np.stack([data[:, 0], -data[:, 0], data[:, 1]], axis=1) * 2.0
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


@dataclass
class Fleet:
    """Devices of one published version in the console's control plane, and a way to feed
    their drift reports to the app's drift store (what ingestion hands it)."""

    cp: ControlPlane
    binner: Binner
    rng: np.random.Generator

    async def report(self, shifts: dict[str, float], n: int = 200) -> list[Any]:
        """One window from each device (its inputs shifted by ``shifts[device]``); the
        triggers raised."""
        samples = []
        for device, shift in shifts.items():
            data = self.rng.normal(size=(n, 6)) + shift
            self.binner.add(data, _scores(data))
            count, features, classes, confidence = self.binner.take()
            body = window(device, self.cp.clock(), count, features, classes, confidence)
            samples.append(decode_drift(orjson.dumps(body), device, self.cp.clock().timestamp()))
        result = await self.cp.client.app[DRIFT].store(samples)
        assert result.stored == len(shifts)
        return list(result.triggers)


async def seed(cp: ControlPlane, baseline: DriftBaseline, *, model: str = "digits") -> Fleet:
    drift = cp.client.app[DRIFT]
    async with drift.db.transaction() as tx:
        await drift_q.seed_fleet(tx, device_ids=DEVICES, model=model, version="1.0.0",
                                 version_numeric=1_000_000,
                                 baseline=baseline.model_dump(mode="json"), now=cp.clock())  # fmt: skip
    return Fleet(cp, Binner(baseline), np.random.default_rng(5))


@pytest.fixture
async def plane(database_url: str, tmp_path: Path) -> AsyncIterator[ConsolePlane]:
    async with console_plane(database_url, tmp_path / "cp") as p:
        yield p


async def until(check: Callable[[], Awaitable[bool]], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def rows_of(text: str, table: str, attribute: str) -> list[str]:
    """The ``attribute`` values of the rows of table ``table``, in page order."""
    start = text.index(f'<table id="{table}"')
    body = text[start : text.index("</table>", start)]
    return re.findall(rf'<tr {attribute}="([^"]+)"', body)


# ---------------------------------------------------------------------------- fleet drift
async def test_empty_states_say_what_to_do(plane: ConsolePlane, baseline: DriftBaseline) -> None:
    page = await plane.admin.get("/ui/drift")
    assert page.status == 200 and "No model is published yet" in page.text
    assert "mcp-bundle push" in page.text and 'aria-current="page">Drift' in page.text
    assert "No retraining trigger has been raised" in page.text
    assert "mcp-controlplane drift rules set &#39;*&#39; --metric input_psi --threshold 0.2" in (
        page.text
    )
    await seed(plane.cp, baseline)
    page = await plane.admin.get("/ui/drift")
    assert page.status == 200 and "Fleet drift of digits 1.0.0" in page.text
    assert 'id="drift-empty"' in page.text and "<svg" not in page.text
    assert "No device reported drift for digits 1.0.0" in page.text
    assert "built-in default" in page.text
    assert "mcp-controlplane drift rules set digits --metric input_psi" in page.text
    device = await plane.admin.get("/ui/drift/devices/cam-1")
    assert device.status == 200 and "cam-1 has sent no drift report" in device.text


async def test_fleet_chart_and_devices_sorted_by_score(
    plane: ConsolePlane, baseline: DriftBaseline
) -> None:
    fleet = await seed(plane.cp, baseline)
    status, _ = await plane.cp.call("PUT", "/api/v1/drift/rules/digits",
                                    body={**RULE, "threshold": 5.0})  # fmt: skip
    assert status == 200
    for _ in range(3):  # three buckets of 60 s; cam-3 drifts most, cam-1 not at all
        await fleet.report({"cam-1": 0.0, "cam-2": 0.5, "cam-3": 2.0})
        plane.cp.clock.advance(seconds=60)

    page = await plane.admin.get("/ui/drift?model=digits&version=1.0.0")
    assert page.status == 200
    chart = page.text[page.text.index('<figure id="drift-chart">') :]
    chart = chart[: chart.index("</figure>")]
    assert "<svg" in chart and "Fleet drift of digits 1.0.0" in chart
    for series in ("input PSI", "class PSI", "confidence PSI", "score"):
        assert f">{series}</text>" in chart
    assert "threshold (input PSI) 5" in chart
    assert chart.count("<polyline") == 4  # three points per series: lines, not dots
    assert "its own rule" in page.text  # the rules in force, read-only
    assert "mcp-controlplane drift rules set digits --metric input_psi --threshold 5" in page.text
    assert "mcp-controlplane drift rules reset digits" in page.text

    assert rows_of(page.text, "drift-devices", "data-device") == ["cam-3", "cam-2", "cam-1"]
    assert '<a href="/ui/devices/cam-3">cam-3</a>' in page.text
    assert "The newest report of each of the 3 devices" in page.text
    smallest = await plane.admin.get("/ui/drift?model=digits&version=1.0.0&sort=score")
    assert rows_of(smallest.text, "drift-devices", "data-device") == ["cam-1", "cam-2", "cam-3"]

    device = await plane.admin.get("/ui/drift/devices/cam-3?model=digits")
    assert device.status == 200 and "Drift of digits 1.0.0 on cam-3" in device.text
    assert "<svg" in device.text and "threshold (input PSI) 5" in device.text
    assert device.text.count("<tr>") == 3 + 1  # three reports and the header
    assert (await plane.admin.get("/ui/drift/devices/cam-9")).status == 404

    older = await plane.admin.get("/ui/drift?model=digits&version=1.0.0&span=1h")
    assert "3 buckets in the last 1h" in older.text
    plane.cp.clock.advance(hours=2)  # out of the last hour: the empty state again
    later = await plane.admin.get("/ui/drift?model=digits&version=1.0.0&span=1h")
    assert 'id="drift-empty"' in later.text and "<svg" not in later.text


async def test_a_model_name_with_markup_is_shown_escaped(plane: ConsolePlane) -> None:
    name = "<script>alert(1)</script>"
    for path in (f"/ui/drift?model={name}", f"/ui/drift/triggers?model={name}",
                 f"/ui/drift/devices/{name}"):  # fmt: skip
        page = await plane.admin.get(path)
        assert page.status in (400, 404), path
        assert "<script>alert" not in page.text
        assert html.escape(name)[:20] in page.text or "&lt;script&gt;" in page.text


# ---------------------------------------------------------------------------- triggers
@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    async with running_receiver(FakeClock()) as r:
        yield r


@pytest.fixture
async def hooked(
    database_url: str, tmp_path: Path, receiver: Receiver
) -> AsyncIterator[ConsolePlane]:
    hook = WebhookConfig(name="training", url=receiver.url, secret_file=secret_file(tmp_path),
                         events=("retraining.*",))  # fmt: skip
    async with console_plane(database_url, tmp_path / "cp", webhooks=(hook,)) as p:
        receiver.clock = p.cp.clock  # the receiver checks signatures on the same clock
        yield p


class Stream:
    """An open event stream of a console page (what app.js's EventSource reads)."""

    def __init__(self, console: Console, path: str) -> None:
        self.console, self.path = console, path

    async def __aenter__(self) -> Stream:
        self.response = await self.console.session.get(self.console.url(self.path))
        assert self.response.status == 200
        assert self.response.headers["Content-Type"].startswith("text/event-stream")
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.response.close()

    async def update(self) -> str:
        """The data of the next ``update`` event."""

        async def read() -> str:
            name, data = "", []
            while True:
                line = (await self.response.content.readline()).decode().rstrip("\n")
                if line.startswith("event: "):
                    name = line[7:]
                elif line.startswith("data: "):
                    data.append(line[6:])
                elif line == "" and name:
                    if name == "update":
                        return "\n".join(data)
                    name, data = "", []

        return await asyncio.wait_for(read(), WAIT_S)


async def test_a_trigger_appears_live_shows_its_deliveries_and_is_acknowledged(
    hooked: ConsolePlane, baseline: DriftBaseline, receiver: Receiver
) -> None:
    cp, admin = hooked.cp, hooked.admin
    fleet = await seed(cp, baseline)
    status, _ = await cp.call("PUT", "/api/v1/drift/rules/digits", body=RULE)
    assert status == 200
    async with Stream(admin, "/ui/drift/triggers/live") as stream:
        first = await stream.update()
        assert "No retraining trigger has been raised" in first
        (raised,) = await fleet.report({d: 2.0 for d in DEVICES})
        nxt = await stream.update()  # the open page learns of it without a reload
        assert f'<tr data-trigger="{raised.id}">' in nxt
    async with Stream(admin, "/ui/drift/triggers/live") as stream:
        assert f'<tr data-trigger="{raised.id}">' in await stream.update()

    listing = await admin.get("/ui/drift/triggers")
    assert rows_of(listing.text, "triggers", "data-trigger") == [str(raised.id)]
    assert 'id="triggers-live" data-live="/ui/drift/triggers/live"' in listing.text
    assert 'data-trigger="' in (await admin.get("/ui/drift")).text
    opened = await admin.get("/ui/drift/triggers?status=open")
    assert rows_of(opened.text, "triggers", "data-trigger") == [str(raised.id)]
    assert 'data-live="/ui/drift/triggers/live?status=open"' in opened.text

    await asyncio.wait_for(receiver.arrived.wait(), WAIT_S)  # the app's dispatcher sent it
    path = f"/ui/drift/triggers/{raised.id}"

    async def delivered() -> bool:
        return 'class="badge ok">delivered' in (await admin.get(path)).text

    await until(delivered, "the delivery recorded as delivered")
    page = await admin.get(path)
    assert page.status == 200 and f"Retraining trigger {raised.id}" in page.text
    deliveries = page.text[page.text.index('<table id="deliveries"') :]
    assert "<td>training</td>" in deliveries and "2xx" in deliveries
    assert receiver.accepted()[0].headers["X-MCP-Delivery"] in page.text
    assert "input_psi" in page.text and "none collected" in page.text
    for device in DEVICES:
        assert f'<a href="/ui/devices/{device}">{device}</a>' in page.text
    assert ">Acknowledge</button>" in page.text

    ack = f"{path}/acknowledge"
    viewer = await user_console(cp, "vera", "viewer")
    try:
        seen = await viewer.get(path)
        assert seen.status == 200 and ">Acknowledge</button>" not in seen.text
        refused = await viewer.post(ack, {"note": "x"})
        assert refused.status == 403
    finally:
        await viewer.close()
    assert (await admin.post(ack, {"note": "x"}, csrf="")).status == 403
    assert (await admin.post(ack, {"note": "x"}, csrf="0" * 64)).status == 403
    status, shown = await cp.call("GET", f"/api/v1/drift/triggers/{raised.id}")
    assert shown["trigger"]["status"] == "open"  # nothing refused changed it
    assert (await admin.post("/ui/drift/triggers/999/acknowledge", {"note": ""})).status == 404
    assert (await admin.post(ack, {"note": "n" * 2049})).status == 400

    note = "<script>alert(1)</script> retraining on line-a data"
    done = await admin.post(ack, {"note": note})
    assert done.status == 200 and done.url.endswith(path)
    assert f"Trigger {raised.id} acknowledged." in done.text
    assert "<script>alert" not in done.text and html.escape(note) in done.text
    status, shown = await cp.call("GET", f"/api/v1/drift/triggers/{raised.id}")
    trigger = shown["trigger"]
    assert (trigger["status"], trigger["acknowledged_by"], trigger["note"]) == (
        "acknowledged", "user:admin", note)  # fmt: skip
    status, audit = await cp.call(
        "GET", "/api/v1/audit", params={"action": "drift.trigger_acknowledged"}
    )
    assert status == 200 and len(audit["items"]) == 1
    acked = await admin.get("/ui/drift/triggers?status=acknowledged")
    assert rows_of(acked.text, "triggers", "data-trigger") == [str(raised.id)]
    still_open = await admin.get("/ui/drift/triggers?status=open")
    assert "No retraining trigger matches" in still_open.text


async def test_a_trigger_without_webhooks_says_so_and_pages_go_back_in_time(
    plane: ConsolePlane, baseline: DriftBaseline
) -> None:
    cp = plane.cp
    fleet = await seed(cp, baseline)
    status, _ = await cp.call("PUT", "/api/v1/drift/rules/digits",
                              body={**RULE, "cooldown_s": 0})  # fmt: skip
    assert status == 200
    raised = []
    for _ in range(27):  # a trigger per bucket: more than one page of the table
        raised += await fleet.report({"cam-1": 2.0})
        cp.clock.advance(seconds=60)
    ids = [str(t.id) for t in reversed(raised)]
    assert len(ids) == 27
    first = await plane.admin.get("/ui/drift/triggers")
    assert rows_of(first.text, "triggers", "data-trigger") == ids[:25]
    older = re.search(r'href="(/ui/drift/triggers\?before=\d+)">Older triggers', first.text)
    assert older is not None
    second = await plane.admin.get(html.unescape(older.group(1)))
    assert rows_of(second.text, "triggers", "data-trigger") == ids[25:]
    assert "Older triggers" not in second.text and "Newest triggers" in second.text
    page = await plane.admin.get(f"/ui/drift/triggers/{ids[0]}")
    assert 'id="deliveries-empty"' in page.text and "retraining.*" in page.text
    assert "none collected" in page.text

    data = np.zeros(6, dtype="<f4").tobytes()
    async with cp.client.app[DRIFT].db.transaction() as tx:  # what a collection stores
        await examples_q.insert_examples(tx, [{
            "trigger_id": int(ids[0]), "device_id": "cam-1", "model": "digits",
            "version": "1.0.0", "device_ts": cp.clock().timestamp(), "received_at": cp.clock(),
            "confidence": 0.3, "predicted": 1, "input_name": "x", "input_datatype": "FP32",
            "input_shape": [1, 6], "input_data": data, "output_name": None,
            "output_datatype": None, "output_shape": None, "output_data": None,
            "sha256": hashlib.sha256(data).hexdigest(),
        }])  # fmt: skip
    page = await plane.admin.get(f"/ui/drift/triggers/{ids[0]}")
    assert "1 collected" in page.text
    npz = f"/api/v1/drift/triggers/{ids[0]}/hard-examples.npz"
    assert f'href="{npz}"' in page.text
    async with plane.admin.session.get(plane.admin.url(npz)) as r:
        assert r.status == 200 and len(await r.read()) > 0
    assert (await plane.admin.get("/ui/drift/triggers/123456")).status == 404
    assert (await plane.admin.get("/ui/drift/triggers/abc")).status == 404
