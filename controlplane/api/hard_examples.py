"""Hard examples of a retraining trigger (docs/hard-examples.md): read them as a dataset, or
ask the trigger's devices for them now.

    GET  /api/v1/drift/triggers/{trigger_id}/hard-examples            viewer: the metadata JSON
    GET  /api/v1/drift/triggers/{trigger_id}/hard-examples.npz        viewer: the .npz
    POST /api/v1/drift/triggers/{trigger_id}/hard-examples/collect    operator: ask the devices

Both reads take ``?after_id=&limit=`` and describe the same examples in the same order (ids
above ``after_id``, oldest first), so a page's metadata and its archive line up; the metadata's
``next_after_id`` is the next page's ``after_id`` (null on the last page).

:func:`attach_hard_examples` puts the :class:`~controlplane.hard_examples.HardExampleService`
in ``app[HARD_EXAMPLES]`` and, when a broker is configured, opens its command session at
startup (service account ``{replica}-cmd``, provisioned then). Without a broker ``collect``
answers 503.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
from datetime import datetime
from typing import Annotated, Literal

from aiohttp import web
from prometheus_client import CollectorRegistry
from pydantic import Field

from mcp_edge.controlplane.api.common import (
    ApiError,
    Clock,
    Endpoint,
    json_response,
    path_int,
    read_body,
    read_query,
)
from mcp_edge.controlplane.api.schemas import Request, Response
from mcp_edge.controlplane.auth import Role, principal_of
from mcp_edge.controlplane.broker.base import BrokerProvisioner
from mcp_edge.controlplane.commands import MAX_TIMEOUT_S, DeviceCommands, commands_account_name
from mcp_edge.controlplane.db import Database
from mcp_edge.controlplane.db import hard_examples as q
from mcp_edge.controlplane.hard_example_checks import HardExampleError
from mcp_edge.controlplane.hard_example_dataset import ExportChangedError, metadata, write_npz
from mcp_edge.controlplane.hard_examples import (
    CollectResult,
    HardExampleService,
    Outcome,
    TriggerNotFoundError,
)
from mcp_edge.controlplane.ingest import IngestConnection
from mcp_edge.controlplane.mqtt import MqttSubscriber
from mcp_edge.shared.protocol.base import Identifier
from mcp_edge.shared.protocol.command import ErrorCode
from mcp_edge.shared.protocol.state import MAX_HARD_EXAMPLE_BUDGET

log = logging.getLogger("mcp.controlplane.api")

HARD_EXAMPLES = web.AppKey("hard_examples", HardExampleService)
MAX_PAGE = 100_000
MAX_COLLECT_DEVICES = 1000
STREAM_CHUNK = 256 * 1024
SPOOL_BYTES = 16 * 1024 * 1024
"""An archive up to this size is built in memory, a larger one in a temporary file."""


# ---------------------------------------------------------------------------- schemas
class ExamplesQuery(Request):
    after_id: Annotated[int, Field(ge=0, le=2**63 - 1, description="examples above this id")] = 0
    limit: Annotated[int, Field(ge=1, le=MAX_PAGE, description="examples in this page")] = 10_000


class TensorMeta(Response):
    name: str
    datatype: str
    shape: list[int]
    bytes: int


class HardExampleOut(Response):
    """One example; ``index`` is its place in the page's archive (``input_{index}``...)."""

    index: int
    id: int
    device_id: str
    version: str
    device_ts: float = Field(description="the device's clock when it kept the input (Unix s)")
    time: datetime | None
    received_at: datetime
    confidence: float
    predicted: int | None
    sha256: str = Field(description="of the input's raw bytes")
    input: TensorMeta
    output: TensorMeta | None


class Layout(Response):
    inputs: Literal["stacked", "per_example", "none"]
    outputs: Literal["stacked", "per_example", "none"]


class HardExampleDataset(Response):
    """The metadata of one page of a trigger's hard examples (the JSON beside the .npz)."""

    format: int
    trigger_id: int
    model: str
    version: str
    count: int
    total: int = Field(description="examples the trigger holds, every page")
    next_after_id: int | None
    bytes: int = Field(description="raw tensor bytes of this page")
    layout: Layout
    examples: list[HardExampleOut]


class CollectBody(Request):
    devices: (
        Annotated[list[Identifier], Field(min_length=1, max_length=MAX_COLLECT_DEVICES)] | None
    ) = Field(default=None, description="some of the trigger's devices (default: all)")
    max_bytes: Annotated[int, Field(ge=0, le=MAX_HARD_EXAMPLE_BUDGET)] | None = Field(
        default=None, description="raw bytes per device (default: each device's policy budget)"
    )
    timeout_s: Annotated[float, Field(ge=1, le=MAX_TIMEOUT_S)] = Field(
        default=10.0, description="how long to wait for each device"
    )


class DeviceOutcomeOut(Response):
    device_id: str
    status: Outcome
    stored: int
    duplicates: int
    bytes: int
    held: int = Field(description="examples the device still keeps (they did not fit)")
    detail: str


class CollectOut(Response):
    trigger_id: int
    model: str
    version: str | None
    max_bytes: int
    stored: int
    duplicates: int
    devices: list[DeviceOutcomeOut]


# ---------------------------------------------------------------------------- handlers
def _service(request: web.Request) -> HardExampleService:
    service = request.app.get(HARD_EXAMPLES)
    if service is None:
        raise ApiError(ErrorCode.UNAVAILABLE, "hard examples are not set up on this control plane")
    return service


async def _page(
    request: web.Request,
) -> tuple[HardExampleService, q.TriggerInfo, list[q.ExampleMeta], ExamplesQuery]:
    query = read_query(request, ExamplesQuery)
    service, trigger_id = _service(request), path_int(request, "trigger_id")
    async with service.db.read() as tx:
        trigger = await q.get_trigger(tx, trigger_id)
        if trigger is None:
            raise ApiError(ErrorCode.NOT_FOUND, f"no retraining trigger {trigger_id}")
        examples = await q.list_examples(tx, trigger_id, after_id=query.after_id, limit=query.limit)
    return service, trigger, examples, query


async def get_dataset(request: web.Request) -> web.Response:
    service, trigger, examples, query = await _page(request)
    async with service.db.read() as tx:
        total = await q.count_examples(tx, trigger.id)
    more = len(examples) == query.limit
    body = metadata(trigger, examples, total=total, next_after_id=examples[-1].id if more else None)
    return json_response(HardExampleDataset.model_validate(body))


async def get_npz(request: web.Request) -> web.StreamResponse:
    service, trigger, examples, _ = await _page(request)
    with tempfile.SpooledTemporaryFile(max_size=SPOOL_BYTES) as archive:
        try:
            await write_npz(service.db, examples, archive)
        except ExportChangedError as e:
            raise ApiError(ErrorCode.CONFLICT, str(e)) from e
        size = archive.tell()
        archive.seek(0)
        name = f"trigger-{trigger.id}-hard-examples.npz"
        response = web.StreamResponse(
            headers={
                "Content-Type": "application/octet-stream",
                "Content-Disposition": f'attachment; filename="{name}"',
            }
        )
        response.content_length = size
        await response.prepare(request)
        while chunk := await asyncio.to_thread(archive.read, STREAM_CHUNK):
            await response.write(chunk)
        await response.write_eof()
    return response


def collect_out(result: CollectResult) -> CollectOut:
    return CollectOut(
        trigger_id=result.trigger_id or 0,
        model=result.model,
        version=result.version,
        max_bytes=result.max_bytes,
        stored=result.stored,
        duplicates=result.duplicates,
        devices=[DeviceOutcomeOut.model_validate(d) for d in result.devices],
    )


async def collect(request: web.Request) -> web.Response:
    service, who = _service(request), principal_of(request)
    trigger_id = path_int(request, "trigger_id")
    body = await read_body(request, CollectBody)
    async with service.db.read() as tx:
        if await q.get_trigger(tx, trigger_id) is None:
            raise ApiError(ErrorCode.NOT_FOUND, f"no retraining trigger {trigger_id}")
    if service.commands is None:
        raise ApiError(
            ErrorCode.UNAVAILABLE, "no broker is configured: devices cannot be asked for anything"
        )
    try:
        result = await service.collect_trigger(
            trigger_id,
            device_ids=body.devices,
            max_bytes=body.max_bytes,
            timeout_s=body.timeout_s,
            actor=who.actor,
        )
    except TriggerNotFoundError as e:
        raise ApiError(ErrorCode.NOT_FOUND, str(e)) from e
    except HardExampleError as e:
        raise ApiError(ErrorCode.CONFLICT, str(e)) from e
    return json_response(collect_out(result))


# ---------------------------------------------------------------------------- wiring
def attach_hard_examples(
    app: web.Application,
    db: Database,
    clock: Clock,
    *,
    broker: IngestConnection | None,
    provisioner: BrokerProvisioner,
    sessions: list[MqttSubscriber] | None = None,
    registry: CollectorRegistry | None = None,
) -> HardExampleService:
    """Create the service in ``app[HARD_EXAMPLES]``; with ``broker``, open its command session
    at startup and close it (and stop background collections) at cleanup. Append it after the
    migration and before the database's disposal. Raises
    :class:`controlplane.mqtt.MqttError` at startup when the broker is unusable."""
    commands = DeviceCommands(registry=registry) if broker is not None else None
    service = app[HARD_EXAMPLES] = HardExampleService(db, commands, clock, registry=registry)

    async def start(app: web.Application) -> None:
        if broker is None or commands is None:
            return
        name = commands_account_name(broker.credentials.client_id)
        credentials = await provisioner.provision_service(name)
        await commands.start(broker.address, credentials)
        if sessions is not None and commands.session is not None:
            sessions.append(commands.session)

    async def stop(app: web.Application) -> None:
        await service.stop()
        if commands is not None:
            await commands.stop()

    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    return service


_TRIGGER_404 = {404: "no such retraining trigger"}
ENDPOINTS = [
    Endpoint(
        "GET",
        "/api/v1/drift/triggers/{trigger_id}/hard-examples",
        get_dataset,
        "A page of a trigger's hard examples: the dataset's JSON metadata",
        Role.VIEWER,
        "drift",
        query=ExamplesQuery,
        response=HardExampleDataset,
        answers=_TRIGGER_404,
    ),
    Endpoint(
        "GET",
        "/api/v1/drift/triggers/{trigger_id}/hard-examples.npz",
        get_npz,
        "A page of a trigger's hard examples as a NumPy .npz archive (inputs, outputs, "
        "devices, times)",
        Role.VIEWER,
        "drift",
        query=ExamplesQuery,
        media_type="application/octet-stream",
        answers={**_TRIGGER_404, 409: "examples were removed while the archive was written"},
    ),
    Endpoint(
        "POST",
        "/api/v1/drift/triggers/{trigger_id}/hard-examples/collect",
        collect,
        "Ask a trigger's devices for their hard examples now, and store what they send",
        Role.OPERATOR,
        "drift",
        body=CollectBody,
        response=CollectOut,
        answers={
            **_TRIGGER_404,
            409: "a listed device is not one of the trigger's",
            503: "no broker is configured, or the database is unavailable",
        },
    ),
]
