"""The API reference (``/ui/api``): the control plane's own OpenAPI document, rendered.

Every operation of ``GET /api/v1/openapi.json``, grouped by tag, with its method, path,
summary, the role it needs, its parameters, request body and answers, and every schema they
name; readable without script. ``static/apiref.js`` adds a "Try it" form to each GET
operation: it fills the path and query parameters in and fetches the API with the console's
session cookie (which the API accepts for GET requests), showing the status and the answer.

The page is built from the very bytes the API serves (the app's ``OPENAPI`` key), parsed once
per document (:func:`reference`, pure).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web
from markupsafe import Markup

from mcp_edge.controlplane.auth import Role
from mcp_edge.controlplane.ui.core import Ctx, Page

OPENAPI_PATH = "/api/v1/openapi.json"
SCHEMA_REF = "#/components/schemas/"
METHODS = ("get", "put", "post", "patch", "delete", "head", "options")
MAX_DEPTH = 6
_CONSTRAINTS = (
    ("minimum", "at least {}"), ("exclusiveMinimum", "more than {}"),
    ("maximum", "at most {}"), ("exclusiveMaximum", "less than {}"),
    ("minLength", "at least {} characters"), ("maxLength", "at most {} characters"),
    ("minItems", "at least {} items"), ("maxItems", "at most {} items"),
)  # fmt: skip


@dataclass(frozen=True)
class Param:
    """One path or query parameter. ``choices``: its enumerated values (a select in Try it);
    ``array``: it may be repeated."""

    name: str
    location: str
    required: bool
    type: Markup
    notes: Markup
    description: str
    choices: tuple[str, ...]
    array: bool
    default: str


@dataclass(frozen=True)
class Body:
    media_type: str
    required: bool
    type: Markup


@dataclass(frozen=True)
class Answer:
    status: str
    description: str
    media_type: str
    type: Markup


@dataclass(frozen=True)
class Operation:
    id: str
    method: str
    path: str
    tag: str
    summary: str
    description: list[str]
    role: str
    params: list[Param]
    bodies: list[Body]
    answers: list[Answer]

    @property
    def try_it(self) -> bool:
        return self.method == "GET"


@dataclass(frozen=True)
class SchemaField:
    name: str
    type: Markup
    required: bool
    notes: Markup
    description: str


@dataclass(frozen=True)
class SchemaDoc:
    name: str
    description: str
    type: Markup
    fields: list[SchemaField]


@dataclass(frozen=True)
class Reference:
    title: str
    version: str
    description: str
    tags: list[tuple[str, list[Operation]]]
    schemas: list[SchemaDoc]

    @property
    def operations(self) -> int:
        return sum(len(ops) for _, ops in self.tags)


# ---------------------------------------------------------------------------- schemas as text
def _json(value: Any) -> str:
    return orjson.dumps(value).decode()


def _join(parts: Sequence[Markup], word: str) -> Markup:
    return Markup(f" {word} ").join(parts)


def type_of(schema: Any, depth: int = 0) -> Markup:
    """A JSON Schema as a short readable type, each named schema a link to its entry."""
    if not isinstance(schema, Mapping) or depth > MAX_DEPTH:
        return Markup("any")
    ref = schema.get("$ref")
    if isinstance(ref, str):
        name = ref.removeprefix(SCHEMA_REF)
        return Markup('<a href="#schema-{0}">{0}</a>').format(name)
    for key, word in (("anyOf", "or"), ("oneOf", "or"), ("allOf", "and")):
        if isinstance(schema.get(key), list):
            return _join([type_of(s, depth + 1) for s in schema[key]], word)
    if "const" in schema:
        return Markup("<code>{}</code>").format(_json(schema["const"]))
    if isinstance(schema.get("enum"), list):
        values = [Markup("<code>{}</code>").format(_json(v)) for v in schema["enum"]]
        return Markup("one of ") + Markup(", ").join(values)
    kind = schema.get("type")
    if isinstance(kind, list):
        return _join([type_of({**schema, "type": k}, depth + 1) for k in kind], "or")
    if kind == "array":
        if isinstance(schema.get("prefixItems"), list):
            items = [type_of(s, depth + 1) for s in schema["prefixItems"]]
            return Markup("[") + Markup(", ").join(items) + Markup("]")
        return Markup("array of ") + type_of(schema.get("items"), depth + 1)
    if kind == "object":
        extra = schema.get("additionalProperties")
        if isinstance(extra, Mapping) and extra and "properties" not in schema:
            return Markup("object of ") + type_of(extra, depth + 1)
        return Markup("object")
    if isinstance(kind, str):
        fmt = schema.get("format")
        return (
            Markup("{} ({})").format(kind, fmt)
            if isinstance(fmt, str)
            else Markup("{}").format(kind)
        )
    return Markup("any")


def _plain(schema: Mapping[str, Any]) -> Mapping[str, Any]:
    """The one non-null alternative of an optional value's ``anyOf``, else ``schema``."""
    options = schema.get("anyOf")
    if isinstance(options, list):
        real = [s for s in options if isinstance(s, Mapping) and s.get("type") != "null"]
        if len(real) == 1:
            return real[0]
    return schema


def notes_of(schema: Any) -> Markup:
    """The limits a value must keep to (range, length, pattern) and its default."""
    if not isinstance(schema, Mapping):
        return Markup("")
    plain = _plain(schema)
    notes = [Markup(text).format(plain[key]) for key, text in _CONSTRAINTS if key in plain]
    if isinstance(plain.get("pattern"), str):
        notes.append(Markup("matches <code>{}</code>").format(plain["pattern"]))
    if "default" in schema and schema["default"] is not None:
        notes.append(Markup("default <code>{}</code>").format(_json(schema["default"])))
    return Markup("; ").join(notes)


# ---------------------------------------------------------------------------- the document
def _mapping(value: Any) -> Mapping[str, Any]:
    """``value`` when it is a JSON object, else an empty one (a document that leaves a part
    out, or has the wrong type there, renders without it)."""
    return value if isinstance(value, Mapping) else {}


def _param(raw: Mapping[str, Any]) -> Param:
    schema = _mapping(raw.get("schema"))
    plain = _plain(schema)
    choices: tuple[str, ...] = ()
    if isinstance(plain.get("enum"), list):
        choices = tuple(str(v) for v in plain["enum"])
    elif plain.get("type") == "boolean":
        choices = ("true", "false")
    default = schema.get("default")
    return Param(
        name=str(raw.get("name", "")), location=str(raw.get("in", "")),
        required=bool(raw.get("required")), type=type_of(schema), notes=notes_of(schema),
        description=str(raw.get("description", "")), choices=choices,
        array=plain.get("type") == "array",
        default="" if default is None else str(default).lower() if isinstance(default, bool)
        else str(default),
    )  # fmt: skip


def _media(content: Any) -> list[tuple[str, Markup]]:
    if not isinstance(content, Mapping):
        return []
    return [(str(media), type_of(body.get("schema"))) for media, body in content.items()
            if isinstance(body, Mapping)]  # fmt: skip


def _operation(method: str, path: str, raw: Mapping[str, Any]) -> Operation:
    tags = raw.get("tags")
    body = _mapping(raw.get("requestBody"))
    answers = []
    for status, value in _mapping(raw.get("responses")).items():
        answer = _mapping(value)
        description = str(answer.get("description", ""))
        media = _media(answer.get("content"))
        for media_type, kind in media or [("", Markup(""))]:
            answers.append(Answer(str(status), description, media_type, kind))
    text = str(raw.get("description", ""))
    return Operation(
        id=str(raw.get("operationId") or f"{method}_{path}"), method=method.upper(), path=path,
        tag=str(tags[0]) if isinstance(tags, list) and tags else "other",
        summary=str(raw.get("summary", "")),
        description=[p.strip() for p in text.split("\n\n") if p.strip()],
        role=str(raw.get("x-required-role", "")),
        params=[_param(p) for p in raw.get("parameters") or [] if isinstance(p, Mapping)],
        bodies=[Body(m, bool(body.get("required")), t) for m, t in _media(body.get("content"))],
        answers=answers,
    )  # fmt: skip


def _schema(name: str, raw: Mapping[str, Any]) -> SchemaDoc:
    required = set(raw.get("required") or [])
    props = _mapping(raw.get("properties"))
    fields = [
        SchemaField(str(field), type_of(prop), field in required, notes_of(prop),
                    str(_mapping(prop).get("description", "")))
        for field, prop in props.items()
    ]  # fmt: skip
    return SchemaDoc(name, str(raw.get("description", "")), type_of(raw), fields)


def reference(document: Mapping[str, Any]) -> Reference:
    """The page's content from an OpenAPI 3 document: operations grouped by tag (tags in the
    order they first appear, operations in the document's order) and every component schema
    by name."""
    groups: dict[str, list[Operation]] = {}
    for path, item in _mapping(document.get("paths")).items():
        for method in METHODS:
            raw = _mapping(item).get(method)
            if isinstance(raw, Mapping):
                op = _operation(method, str(path), raw)
                groups.setdefault(op.tag, []).append(op)
    info = _mapping(document.get("info"))
    schemas = _mapping(_mapping(document.get("components")).get("schemas"))
    return Reference(
        title=str(info.get("title", "API")), version=str(info.get("version", "")),
        description=str(info.get("description", "")), tags=list(groups.items()),
        schemas=[_schema(str(n), s) for n, s in sorted(schemas.items()) if isinstance(s, Mapping)],
    )  # fmt: skip


@functools.lru_cache(maxsize=4)
def _parsed(document: bytes) -> Reference:
    return reference(orjson.loads(document))


# ---------------------------------------------------------------------------- the page
async def api_reference(ctx: Ctx) -> web.StreamResponse:
    # Imported here: the app module imports the console (ui) to attach its pages.
    from mcp_edge.controlplane.app import OPENAPI

    ref = _parsed(ctx.request.app[OPENAPI])
    return ctx.render("apiref.html", ref=ref, openapi_path=OPENAPI_PATH)


PAGES = [Page("GET", "/ui/api", api_reference, Role.VIEWER, nav="api")]
