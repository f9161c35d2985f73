"""The console's API reference (/ui/api) against the OpenAPI document the API serves: every
operation listed with its method, path, summary and role, every schema it names present, a Try
it form on each GET operation (its script served, none inline), and the raw document's link."""

from __future__ import annotations

import html
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from mcp_edge.controlplane.app import OPENAPI
from mcp_edge.controlplane.ui.apiref import reference
from tests.support.console import ConsolePlane, console_plane, user_console

_OPERATION = re.compile(r'<section class="op" id="op-([^"]+)" data-method="([A-Z]+)" '
                        r'data-path="([^"]+)"')  # fmt: skip


@pytest.fixture
async def plane(database_url: str, tmp_path: Path) -> AsyncIterator[ConsolePlane]:
    async with console_plane(database_url, tmp_path / "cp") as p:
        yield p


def document(plane: ConsolePlane) -> dict[str, Any]:
    doc: dict[str, Any] = orjson.loads(plane.cp.client.app[OPENAPI])
    return doc


def sections(text: str) -> dict[str, str]:
    """Each operation's section of the page, by operation id."""
    starts = [(m.start(), m.group(1)) for m in _OPERATION.finditer(text)]
    ends = [s for s, _ in starts[1:]] + [text.index('<h2 id="schemas">')]
    return {op: text[s:e] for (s, op), e in zip(starts, ends, strict=True)}


async def test_every_operation_of_the_document_is_listed(plane: ConsolePlane) -> None:
    doc = document(plane)
    page = await plane.admin.get("/ui/api")
    assert page.status == 200 and 'aria-current="page">API' in page.text
    listed = {(m, html.unescape(p)) for _, m, p in _OPERATION.findall(page.text)}
    expected = {(m.upper(), p) for p, item in doc["paths"].items() for m in item}
    assert listed == expected and len(expected) > 50
    found = sections(page.text)
    for path, item in doc["paths"].items():
        for method, op in item.items():
            section = found[op["operationId"]]
            assert f"<code>{html.escape(path)}</code>" in section
            assert op["summary"] in html.unescape(section)
            role = op.get("x-required-role")
            assert (f"Needs the <strong>{role}</strong> role" if role else "Public") in section
            for param in op.get("parameters", []):
                assert f"<code>{param['name']}</code>" in section
            for status in op["responses"]:
                assert f"<tr><td>{status}</td>" in section
            assert ('class="try"' in section) == (method == "get")
            for name in re.findall(r"#/components/schemas/(\w+)", orjson.dumps(op).decode()):
                assert f'href="#schema-{name}"' in section
    ack = found["post_acknowledge"]
    assert "Needs the <strong>operator</strong> role" in ack
    assert 'href="#schema-AcknowledgeBody"' in ack
    body = page.text[page.text.index('id="schema-AcknowledgeBody"') :]
    body = body[: body.index("</section>")]
    assert "<code>note</code>" in body and "at most 2048 characters" in body
    listing = found["get_list_triggers"]
    assert 'data-path="/api/v1/drift/triggers"' in listing
    assert '<select id="try-get_list_triggers-status" name="status" data-in="query">' in listing
    assert 'placeholder="100"' in listing  # the limit's default

    anchors = set(re.findall(r'id="schema-(\w+)"', page.text))
    assert anchors == set(doc["components"]["schemas"])
    assert set(re.findall(r'href="#schema-(\w+)"', page.text)) <= anchors
    tags = {op["tags"][0] for item in doc["paths"].values() for op in item.values()}
    assert set(re.findall(r'<h2 id="tag-([^"]+)">', page.text)) == tags


async def test_the_page_runs_only_its_own_script_and_readers_may_use_it(
    plane: ConsolePlane,
) -> None:
    page = await plane.admin.get("/ui/api")
    scripts = re.findall(r"<script([^>]*)>", page.text)
    assert scripts and all('src="/ui/static/' in s for s in scripts)
    assert '<script src="/ui/static/apiref.js" defer>' in page.text
    async with plane.admin.session.get(plane.admin.url("/ui/static/apiref.js")) as r:
        assert r.status == 200 and r.content_type == "text/javascript"
        script = await r.text()
    assert "form.try-form" in script and "textContent" in script and "innerHTML" not in script
    viewer = await user_console(plane.cp, "vera", "viewer")
    try:
        seen = await viewer.get("/ui/api")
        assert seen.status == 200 and "as vera (viewer)" in seen.text
        async with viewer.session.get(viewer.url("/api/v1/drift/triggers")) as r:
            assert r.status == 200  # what Try it does: a GET with the session cookie
    finally:
        await viewer.close()
    async with plane.cp.client.get("/ui/api", allow_redirects=False) as r:
        assert r.status == 303 and r.headers["Location"].startswith("/ui/login")


async def test_the_raw_document_link_downloads_the_served_document(plane: ConsolePlane) -> None:
    page = await plane.admin.get("/ui/api")
    link = re.search(r'<a id="openapi-download" href="([^"]+)" download="openapi.json">',
                     page.text)  # fmt: skip
    assert link is not None
    async with plane.admin.session.get(plane.admin.url(link.group(1))) as r:
        assert r.status == 200 and r.content_type == "application/json"
        body = await r.read()
    assert body == plane.cp.client.app[OPENAPI]
    assert orjson.loads(body)["openapi"].startswith("3.")


def test_a_sparse_or_odd_document_renders_what_it_has_escaped() -> None:
    ref = reference({
        "paths": {"/x/{id}": {
            "get": {"summary": "<b>s</b>", "responses": {"200": {"description": "ok"}},
                    "parameters": [{"name": "id", "in": "path", "required": True,
                                    "schema": {"type": "<i>"}}, "not a parameter"]},
            "post": "not an operation",
        }},
        "components": {"schemas": {"A": {"type": "object",
                                         "properties": {"n": {"$ref": "#/components/schemas/<x>"}}},
                                   "B": "not a schema"}},
    })  # fmt: skip
    ((tag, (op,)),) = ref.tags
    assert (tag, op.method, op.id, op.role, op.bodies) == ("other", "GET", "get_/x/{id}", "", [])
    assert str(op.params[0].type) == "&lt;i&gt;" and op.summary == "<b>s</b>"
    (schema,) = ref.schemas
    assert str(schema.fields[0].type) == '<a href="#schema-&lt;x&gt;">&lt;x&gt;</a>'
    assert (ref.title, ref.operations) == ("API", 1)
