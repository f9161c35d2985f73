"""``mcp-controlplane apps``: application MQTT accounts, through the REST API.

    mcp-controlplane apps create CLIENT_ID [--description D] [--json]
    mcp-controlplane apps list [--json]
    mcp-controlplane apps revoke CLIENT_ID

``create`` prints the credentials once (the password is never shown again) and a ready-to-run
``mcp-agent infer --mqtt ...`` line that passes the password through ``MCP_MQTT_PASSWORD``.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

import click

from mcp_edge.controlplane.cli.client import (
    ApiClient,
    api_options,
    fmt_time,
    print_json,
    print_table,
)

_DEFAULT_PORTS = {"mqtt": 1883, "mqtts": 8883}


def infer_target(broker_url: str) -> tuple[str, bool]:
    """``mqtt[s]://HOST[:PORT][/...]`` → (``HOST:PORT`` for ``mcp-agent infer --mqtt``, TLS?).

    A URL in another form is returned unchanged, without TLS.
    """
    scheme, sep, rest = broker_url.partition("://")
    if not sep or scheme not in _DEFAULT_PORTS:
        return broker_url, False
    hostport = rest.split("/", 1)[0]
    _host, colon, port = hostport.rpartition(":")
    if not colon or not port.isdigit():
        hostport = f"{hostport}:{_DEFAULT_PORTS[scheme]}"
    return hostport, scheme == "mqtts"


def infer_command_line(answer: Mapping[str, Any]) -> str:
    """A shell line that asks the fleet with the new account (model and data to fill in)."""
    urls = answer.get("broker_urls") or []
    target, tls = infer_target(urls[0]) if urls else ("HOST:PORT", False)
    args = [
        "mcp-agent",
        "infer",
        "--mqtt",
        target,
        *(["--tls"] if tls else []),
        "--client-id",
        answer["client_id"],
        "--username",
        answer["username"],
    ]
    password = shlex.quote(answer["password"])
    return f"MCP_MQTT_PASSWORD={password} {shlex.join(args)} --model MODEL --data '[[...]]'"


@click.group()
def apps() -> None:
    """Application MQTT accounts: for programs that send inference requests over MQTT."""


@apps.command("create")
@api_options
@click.argument("client_id")
@click.option("--description", default="", help="What the application is (shown in `list`).")
@click.option(
    "--json", "as_json", is_flag=True, help="Print the whole answer, password included, as JSON."
)
def apps_create(
    server: str, token: str | None, client_id: str, description: str, as_json: bool
) -> None:
    """Create the account CLIENT_ID and print its credentials, once.

    The application must connect with exactly CLIENT_ID as its MQTT client id; it may publish
    inference requests (to the fleet or one device) and read only its own reply topic.
    """
    answer = ApiClient(server, token).call(
        "POST", "/api/v1/apps", body={"client_id": client_id, "description": description}
    )
    if as_json:
        print_json(answer)
        return
    click.echo(f"app client {answer['client_id']} created; its password is shown only now:")
    rows = [
        ("client id", answer["client_id"]),
        ("username", answer["username"]),
        ("password", answer["password"]),
        ("broker", ", ".join(answer["broker_urls"]) or "-"),
        ("reply topic", answer["reply_topic"]),
    ]
    for name, value in rows:
        click.echo(f"  {name:<12} {value}")
    click.echo("Ask the fleet with:")
    click.echo("  " + infer_command_line(answer))


@apps.command("list")
@api_options
@click.option("--json", "as_json", is_flag=True)
def apps_list(server: str, token: str | None, as_json: bool) -> None:
    """List application accounts (passwords are never shown again)."""
    items = ApiClient(server, token).call("GET", "/api/v1/apps")["items"]
    if as_json:
        print_json(items)
        return
    print_table(
        ["client id", "state", "created", "by", "revoked", "description"],
        [
            [
                a["client_id"],
                a["state"],
                fmt_time(a["created_at"]),
                a["created_by"],
                fmt_time(a["revoked_at"]),
                a["description"] or "-",
            ]
            for a in items
        ],
    )


@apps.command("revoke")
@api_options
@click.argument("client_id")
def apps_revoke(server: str, token: str | None, client_id: str) -> None:
    """Revoke CLIENT_ID: the broker refuses its logins and closes a live session."""
    answer = ApiClient(server, token).call("DELETE", "/api/v1/apps/" + quote(client_id, safe=""))
    click.echo(
        f"app client {answer['client_id']} is {answer['state']} "
        f"(since {fmt_time(answer['revoked_at'])})"
    )


COMMANDS = [apps]
