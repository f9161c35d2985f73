"""The OpenAPI 3.1 document of the REST API, built from the route table and pydantic's JSON
Schemas (served at ``GET /api/v1/openapi.json``).

Pure: takes :class:`controlplane.api.common.Endpoint` values and returns a JSON-ready dict.
Request bodies use each schema's validation form, answers its serialization form; every
operation lists its error answers with the shared ``ErrorBody`` schema, and the role it needs
as ``x-required-role``.
"""

from __future__ import annotations

import re
import typing
from collections.abc import Sequence
from typing import Any, Literal, cast

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from controlplane.api.common import Endpoint
from controlplane.api.schemas import ErrorBody

REF = "#/components/schemas/{model}"
_PATH_PARAM = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
_INTEGER_PARAMS = frozenset({"token_id"})
Mode = Literal["validation", "serialization"]


def _error(description: str) -> dict[str, Any]:
    return {
        "description": description,
        "content": {"application/json": {"schema": {"$ref": REF.format(model="ErrorBody")}}},
    }


def _query_parameters(model: type[BaseModel], schema: dict[str, Any]) -> list[dict[str, Any]]:
    props = schema.get("properties", {})
    params = []
    for name, field in model.model_fields.items():
        param: dict[str, Any] = {
            "name": name,
            "in": "query",
            "required": field.is_required(),
            "schema": {k: v for k, v in props.get(name, {}).items() if k != "title"},
        }
        if field.description:
            param["description"] = field.description
        if typing.get_origin(field.annotation) is list:
            param.update(style="form", explode=True)
        params.append(param)
    return params


def _path_parameters(path: str) -> list[dict[str, Any]]:
    return [
        {
            "name": name,
            "in": "path",
            "required": True,
            "schema": {"type": "integer" if name in _INTEGER_PARAMS else "string"},
        }
        for name in _PATH_PARAM.findall(path)
    ]


def _operation(
    ep: Endpoint, refs: dict[tuple[type[BaseModel], Mode], dict[str, Any]],
    query_schemas: dict[type[BaseModel], dict[str, Any]],
) -> dict[str, Any]:
    op: dict[str, Any] = {
        "summary": ep.summary,
        "operationId": f"{ep.method.lower()}_{ep.handler.__name__}",
        "tags": [ep.tag],
        "security": [{"bearer": []}] if ep.role is not None else [],
    }
    if ep.handler.__doc__:
        op["description"] = ep.handler.__doc__.strip()
    if ep.role is not None:
        op["x-required-role"] = ep.role.value
    params = _path_parameters(ep.path)
    if ep.query is not None:
        params += _query_parameters(ep.query, query_schemas[ep.query])
    if params:
        op["parameters"] = params
    if ep.body is not None:
        op["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": refs[(ep.body, "validation")]}},
        }
    ok: dict[str, Any] = {"description": "success"}
    if ep.response is not None:
        ok["content"] = {"application/json": {"schema": refs[(ep.response, "serialization")]}}
    responses: dict[str, Any] = {str(ep.status): ok, "400": _error("invalid request")}
    if ep.role is not None:
        responses["401"] = _error("no or bad API token")
        responses["403"] = _error(f"needs the {ep.role.value} role")
    if _PATH_PARAM.search(ep.path):
        responses["404"] = _error("no such object")
    if ep.method in ("POST", "PATCH", "PUT", "DELETE"):
        responses["409"] = _error("conflicts with the current state")
    if ep.body is not None:
        responses["413"] = _error("request body too large")
    responses["503"] = _error("database or broker unavailable; retry later")
    op["responses"] = responses
    return op


def build_openapi(
    endpoints: Sequence[Endpoint], *, version: str, title: str = "MCP Edge control plane"
) -> dict[str, Any]:
    """The OpenAPI 3.1 document for ``endpoints``."""
    wanted: list[tuple[type[BaseModel], Mode]] = [(ErrorBody, "serialization")]
    for ep in endpoints:
        if ep.body is not None:
            wanted.append((ep.body, "validation"))
        if ep.response is not None:
            wanted.append((ep.response, "serialization"))
    unique = list(dict.fromkeys(wanted))
    keyed, defs = models_json_schema(unique, ref_template=REF)
    refs = cast(dict[tuple[type[BaseModel], Mode], dict[str, Any]], dict(keyed))
    query_schemas = {
        ep.query: ep.query.model_json_schema(ref_template=REF)
        for ep in endpoints if ep.query is not None
    }
    paths: dict[str, dict[str, Any]] = {}
    for ep in endpoints:
        paths.setdefault(ep.path, {})[ep.method.lower()] = _operation(ep, refs, query_schemas)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": title,
            "version": version,
            "description": "Fleet management API. Authenticate with `Authorization: Bearer "
            "<API token>` (from `mcp-controlplane init` or `POST /api/v1/auth/login`).",
        },
        "paths": paths,
        "components": {
            "schemas": defs.get("$defs", {}),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
