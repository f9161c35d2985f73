"""``mcp-controlplane whoami|api-tokens``: the caller's identity and API tokens.

    mcp-controlplane whoami [--json]
    mcp-controlplane api-tokens list [--all] [--active] [--json]
    mcp-controlplane api-tokens revoke ID

API tokens are what ``init``, ``login`` and the web console's sign-in (tokens named
``web session``) hand out; revoking one ends that CLI login or console session. Enrollment
tokens, for devices, are ``mcp-controlplane tokens``.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

import click

from mcp_edge.controlplane.cli.client import (
    ApiCallError,
    ApiClient,
    api_options,
    fmt_time,
    print_json,
    print_table,
)


def _whoami(client: ApiClient) -> dict[str, Any]:
    answer: dict[str, Any] = client.call("GET", "/api/v1/auth/whoami")
    return answer


def _state(token: dict[str, Any], now: datetime) -> str:
    if token["revoked_at"]:
        return "revoked"
    expires = token["expires_at"]
    if expires and datetime.fromisoformat(expires.replace("Z", "+00:00")) <= now:
        return "expired"
    return "active"


@click.command()
@api_options
@click.option("--json", "as_json", is_flag=True, help="Print the answer as JSON.")
def whoami(server: str, token: str | None, as_json: bool) -> None:
    """The user and role the API token belongs to, and the token's id."""
    me = _whoami(ApiClient(server, token))
    if as_json:
        print_json(me)
        return
    click.echo(f"{me['username']} ({me['role']}), API token {me['token_id']}, on {server}")


@click.group("api-tokens")
def api_tokens() -> None:
    """Your API tokens: CLI logins and web console sessions (`tokens` are enrollment tokens)."""


@api_tokens.command("list")
@api_options
@click.option("--all", "everyone", is_flag=True, help="Every user's tokens (admins only).")
@click.option("--active", is_flag=True, help="Only tokens that still work.")
@click.option("--json", "as_json", is_flag=True, help="Print the tokens as JSON.")
def api_tokens_list(
    server: str, token: str | None, everyone: bool, active: bool, as_json: bool
) -> None:
    """List your API tokens, newest first; the one this command used is marked `(this one)`.

    Secrets are never shown again; a token is named by its id and prefix.
    """
    client = ApiClient(server, token)
    me = _whoami(client)
    if everyone and me["role"] != "admin":
        raise ApiCallError(
            f"--all needs the admin role; {me['username']} is {me['role']}", code="forbidden"
        )
    items: list[dict[str, Any]] = client.call("GET", "/api/v1/api-tokens")["items"]
    now = datetime.now(timezone.utc)
    rows: list[dict[str, Any]] = []
    for t in items:
        if not everyone and t["username"] != me["username"]:
            continue
        state = _state(t, now)
        if active and state != "active":
            continue
        rows.append({**t, "state": state, "current": t["id"] == me["token_id"]})
    rows.sort(key=lambda t: int(t["id"]), reverse=True)
    if as_json:
        print_json(rows)
        return
    headers = ["id", "name", *(["user"] if everyone else []), "prefix", "state", "created",
               "expires", "last used"]  # fmt: skip
    print_table(
        headers,
        [
            [
                t["id"],
                t["name"],
                *([t["username"]] if everyone else []),
                t["prefix"],
                t["state"] + (" (this one)" if t["current"] else ""),
                fmt_time(t["created_at"]),
                fmt_time(t["expires_at"]) if t["expires_at"] else "never",
                fmt_time(t["last_used_at"]),
            ]
            for t in rows
        ],
    )


@api_tokens.command("revoke")
@api_options
@click.argument("token_id", type=click.IntRange(1))
def api_tokens_revoke(server: str, token: str | None, token_id: int) -> None:
    """Revoke one of your API tokens by id (admins: anyone's). Revoking a web session signs
    that browser out; revoking the token in use ends this login."""
    client = ApiClient(server, token)
    me = _whoami(client)
    answer = client.call("DELETE", f"/api/v1/api-tokens/{token_id}")
    owner = "" if answer["username"] == me["username"] else f" of {answer['username']}"
    click.echo(
        f"API token {answer['id']} {answer['name']!r}{owner} ({answer['prefix']}...) revoked"
    )
    if answer["id"] == me["token_id"]:
        click.echo(
            "that was the token this command used; get a new one with `mcp-controlplane login`",
            err=True,
        )


COMMANDS = [whoami, api_tokens]
