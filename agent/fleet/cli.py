"""``mcp-agent infer --mqtt HOST:PORT --model M [--device ID] --data JSON|@file``.

Sends one Open Inference Protocol request over MQTT (to one device, or to the fleet) and prints
the reply JSON. ``--data`` is either a full request body (``{"inputs": [...]}``) or bare numbers
(a nested JSON array), sent as one FP32 input named ``--input-name``; a flat array becomes one
row. Exit status: 0 answered; 1 the agent answered with an error (its error reply's JSON on
stderr) or no reply came (``{"error": ..., "code": ...}`` on stderr, the code naming why:
``no_responder``, ``inference_timeout``, ``inference_transport``); 2 bad usage.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import sys
from pathlib import Path
from typing import Any

import click
import numpy as np

from mcp_edge.shared.errors import MessageError
from mcp_edge.shared.protocol.wire import Datatype


def _load_data(text: str) -> Any:
    if text.startswith("@"):
        path = Path(text[1:])
        try:
            text = path.read_text()
        except OSError as e:
            raise click.BadParameter(f"cannot read {path}: {e}", param_hint="'--data'") from e
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise click.BadParameter(f"not JSON: {e}", param_hint="'--data'") from e


def request_body(data: Any, input_name: str, datatype: str) -> bytes:
    """Raises click.BadParameter for data that is neither a request body nor numbers."""
    # Imported here: `mcp-agent serve` registers this command and must not load paho.
    from mcp_edge.client import build_request

    if isinstance(data, dict):
        if "inputs" not in data:
            raise click.BadParameter(
                'a JSON object must be a request body with "inputs"', param_hint="'--data'"
            )
        try:
            return build_request(data)
        except MessageError as e:
            raise click.BadParameter(str(e), param_hint="'--data'") from e
    try:
        arr = np.asarray(data, dtype=Datatype(datatype).numpy_dtype)
    except (ValueError, TypeError) as e:
        raise click.BadParameter(
            f"not a regular array of numbers: {e}", param_hint="'--data'"
        ) from e
    if arr.ndim <= 1:
        arr = arr.reshape(1, -1)
    return build_request({input_name: arr})


@click.command("infer")
@click.option(
    "--mqtt",
    "broker",
    required=True,
    metavar="HOST[:PORT]",
    help="The MQTT broker (port 1883 unless given; 8883 with --tls).",
)
@click.option("--model", required=True, help="Model name.")
@click.option(
    "--device",
    default=None,
    metavar="ID",
    help="Ask this device; without it, whichever agent of the fleet serves the model.",
)
@click.option(
    "--data",
    required=True,
    metavar="JSON|@FILE",
    help='A request body {"inputs": [...]} or a nested array of numbers.',
)
@click.option(
    "--input-name", default="input", show_default=True, help="Input name for bare-number --data."
)
@click.option(
    "--datatype",
    default="FP32",
    show_default=True,
    type=click.Choice([d.value for d in Datatype if d is not Datatype.BYTES]),
    help="Datatype for bare-number --data.",
)
@click.option("--version", "model_version", default=None, help="Pin a model version.")
@click.option("--priority", type=click.Choice(["high", "normal", "low"]), default=None)
@click.option("--request-key", default=None, help="Sticky canary routing key.")
@click.option(
    "--timeout",
    "timeout_s",
    type=float,
    default=5.0,
    show_default=True,
    help="Seconds to wait for the reply.",
)
@click.option("--qos", type=click.IntRange(0, 1), default=1, show_default=True)
@click.option("--client-id", default=None, help="MQTT client id (random by default).")
@click.option("--username", envvar="MCP_MQTT_USERNAME", default=None)
@click.option(
    "--password", envvar="MCP_MQTT_PASSWORD", default=None, help="Or set MCP_MQTT_PASSWORD."
)
@click.option("--tls", is_flag=True, help="Connect with TLS.")
@click.option(
    "--cafile",
    type=click.Path(dir_okay=False, exists=True),
    default=None,
    help="CA bundle for --tls (system CAs otherwise).",
)
def infer_command(
    broker: str,
    model: str,
    device: str | None,
    data: str,
    input_name: str,
    datatype: str,
    model_version: str | None,
    priority: str | None,
    request_key: str | None,
    timeout_s: float,
    qos: int,
    client_id: str | None,
    username: str | None,
    password: str | None,
    tls: bool,
    cafile: str | None,
) -> None:
    """Send one inference request over MQTT and print the reply."""
    from mcp_edge.client import (
        InferenceClient,
        InferenceClientError,
        InferenceReplyError,
        parse_reply,
    )
    from mcp_edge.shared.mqtt import parse_host_port

    try:
        host, port = parse_host_port(broker, 8883 if tls else 1883)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="'--mqtt'") from e
    body = request_body(_load_data(data), input_name, datatype)
    context = ssl.create_default_context(cafile=cafile) if tls else None

    async def run() -> bytes:
        async with InferenceClient(
            host,
            port,
            client_id=client_id,
            username=username,
            password=password,
            tls=context,
            qos=qos,
        ) as client:
            reply = await client.infer_raw(
                model,
                body,
                device=device,
                timeout_s=timeout_s,
                version=model_version,
                priority=priority,
                request_key=request_key,
            )
            parse_reply(reply)  # raises InferenceReplyError for an error reply
            return reply.payload

    try:
        payload = asyncio.run(run())
    except InferenceReplyError as e:
        click.echo(e.reply.model_dump_json(exclude_none=True), err=True)
        sys.exit(1)
    except InferenceClientError as e:
        from mcp_edge.agent.cli import failure

        err = failure(e)
        click.echo(json.dumps({"error": err.message, "code": err.code}), err=True)
        sys.exit(1)
    click.echo(payload.decode("utf-8", "replace"))
