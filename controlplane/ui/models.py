"""Console pages: the model registry.

    GET /ui/models                       every model with its newest versions; publisher keys
    GET /ui/models/{name}                one model: every version
    GET /ui/models/{name}/{version}      one version: variants, manifest, drift baseline

The rows are what ``GET /api/v1/models...`` answers (the registry's own queries through
:class:`~controlplane.repository.service.RepositoryService`, shaped by
:func:`controlplane.api.models.version_out`). The manifest is read from the signed bundle the
repository serves (only its head: manifest and signature); the drift baseline is the one the
registry stored when the bundle was published (``model_versions.drift_baseline``). How many
devices run a version is what they last reported (:func:`controlplane.ui.overview.running_versions`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from markupsafe import Markup
from pydantic import ValidationError

from mcp_edge.controlplane.api.models import ModelVersionOut, version_out
from mcp_edge.controlplane.auth import Role
from mcp_edge.controlplane.db.models import ModelVersion, PublisherKey
from mcp_edge.controlplane.repository.http import REPOSITORY, resolve_repo_file
from mcp_edge.controlplane.repository.service import RepositoryService
from mcp_edge.controlplane.ui.charts import PALETTE
from mcp_edge.controlplane.ui.core import Ctx, Page, UiError
from mcp_edge.controlplane.ui.overview import RunningVersion, running_versions
from mcp_edge.shared.bundle import BundleLimits, inspect_bundle
from mcp_edge.shared.bundle.manifest import DriftBaseline
from mcp_edge.shared.errors import BundleError, MessageError
from mcp_edge.shared.protocol.repo import validate_repo_path

NAV = "models"
VERSIONS_LISTED = 5
"""Versions of each model the registry page lists (the model's page lists them all)."""
MAX_PATH_PART = 128
HIST_WIDTH, HIST_HEIGHT = 120, 28


@dataclass(frozen=True)
class ModelRow:
    name: str
    version_count: int
    versions: list[ModelVersionOut]


@dataclass(frozen=True)
class Manifest:
    """A stored bundle's manifest as pretty-printed JSON, or why it could not be read."""

    text: str | None
    problem: str | None


# ---------------------------------------------------------------------------- reading
def _repository(ctx: Ctx) -> RepositoryService:
    return ctx.request.app[REPOSITORY]


async def _publishers(repo: RepositoryService) -> dict[str, PublisherKey]:
    return {p.keyid: p for p in await repo.list_publishers()}


async def _running(ctx: Ctx) -> dict[tuple[str, str], RunningVersion]:
    async with ctx.svc.db.read() as tx:
        return {(r.model, r.version): r for r in await running_versions(tx)}


def _path_part(ctx: Ctx, name: str) -> str:
    value = ctx.request.match_info[name]
    if not value or len(value) > MAX_PATH_PART:
        raise UiError(f"no such {name}", status=404)
    return value


def bundle_file_of(row: ModelVersion) -> str:
    """The repository path of a version's bundle (``targets/{dir}/{sha256}.{name}``, as
    :meth:`TufRepository.add_target` stores it)."""
    directory, _, basename = row.target_path.rpartition("/")
    return f"targets/{directory}/{row.sha256}.{basename}"


async def stored_manifest(repo: RepositoryService, row: ModelVersion) -> Manifest:
    """The manifest of the bundle the repository holds for ``row``, pretty-printed."""
    relative = bundle_file_of(row)
    try:
        validate_repo_path(relative)
    except MessageError as e:
        return Manifest(None, f"the bundle's path is not a repository path: {e}")
    path = resolve_repo_file(repo.repo.dir, relative)
    if path is None:
        return Manifest(None, f"the repository holds no file {relative}")
    limits = BundleLimits(max_bundle_bytes=repo.settings.max_bundle_bytes)
    try:
        info = await asyncio.to_thread(inspect_bundle, path, limits=limits)
    except (BundleError, OSError) as e:
        return Manifest(None, f"the stored bundle could not be read: {e}")
    return Manifest(json.dumps(info["manifest"], indent=2, sort_keys=True), None)


def parse_baseline(stored: dict[str, Any] | None) -> tuple[DriftBaseline | None, str | None]:
    """The stored drift baseline as its schema, or None and why it does not read as one (as the
    drift service reads it: from JSON, whose lists are the schema's tuples)."""
    if stored is None:
        return None, None
    try:
        return DriftBaseline.model_validate_json(json.dumps(stored)), None
    except ValidationError as e:
        return None, f"the stored baseline does not match the schema: {e.errors()[0]['msg']}"


def histogram_svg(counts: Sequence[int], title: str) -> Markup:
    """A small bar chart of a histogram's counts (inline SVG, presentation attributes)."""
    top = max(counts, default=0) or 1
    width = HIST_WIDTH / max(len(counts), 1)
    bars = Markup("").join(
        Markup(
            '<rect x="{:.2f}" y="{:.2f}" width="{:.2f}" height="{:.2f}" fill="{}"></rect>'
        ).format(
            i * width,
            HIST_HEIGHT - HIST_HEIGHT * c / top,
            max(width - 1, 0.5),
            HIST_HEIGHT * c / top,
            PALETTE[0],
        )
        for i, c in enumerate(counts)
    )
    return Markup(
        '<svg class="hist" role="img" viewBox="0 0 {w} {h}" width="{w}" height="{h}">'
        "<title>{t}</title>{b}</svg>"
    ).format(w=HIST_WIDTH, h=HIST_HEIGHT, t=title, b=bars)


# ---------------------------------------------------------------------------- pages
async def models_index(ctx: Ctx) -> web.StreamResponse:
    repo = _repository(ctx)
    rows: list[ModelRow] = []
    for summary in await repo.list_models():
        found = await repo.model_detail(summary.name)
        if found is None:  # removed since the list was read
            continue
        versions = [version_out(v) for v in found[1]]
        rows.append(ModelRow(summary.name, len(versions), versions[:VERSIONS_LISTED]))
    publishers = await _publishers(repo)
    return ctx.render(
        "models/index.html",
        models=rows,
        publishers=publishers,
        listed=VERSIONS_LISTED,
        running=await _running(ctx),
    )


async def model_page(ctx: Ctx) -> web.StreamResponse:
    name = _path_part(ctx, "name")
    repo = _repository(ctx)
    found = await repo.model_detail(name)
    if found is None:
        raise UiError(f"no model {name!r}; the registry lists the published ones", status=404)
    model, versions = found
    return ctx.render(
        "models/model.html",
        model=model,
        versions=[version_out(v) for v in versions],
        publishers=await _publishers(repo),
        running=await _running(ctx),
    )


async def version_page(ctx: Ctx) -> web.StreamResponse:
    name, version = _path_part(ctx, "name"), _path_part(ctx, "version")
    repo = _repository(ctx)
    row = await repo.model_version(name, version)
    if row is None:
        raise UiError(f"no version {version!r} of model {name!r}", status=404)
    baseline, baseline_problem = parse_baseline(row.drift_baseline)
    running = (await _running(ctx)).get((name, version))
    return ctx.render(
        "models/version.html",
        v=version_out(row),
        publisher=(await _publishers(repo)).get(row.publisher_keyid),
        manifest=await stored_manifest(repo, row),
        baseline=baseline,
        baseline_problem=baseline_problem,
        running=running,
        histogram=histogram_svg,
    )


PAGES: list[Page] = [
    Page("GET", "/ui/models", models_index, Role.VIEWER, nav=NAV),
    Page("GET", "/ui/models/{name}", model_page, Role.VIEWER, nav=NAV),
    Page("GET", "/ui/models/{name}/{version}", version_page, Role.VIEWER, nav=NAV),
]
