"""``mcp-controlplane users|tokens|devices|audit|login``: the REST API from a shell.

Each command takes ``--server`` and ``--token`` (or ``MCP_SERVER`` / ``MCP_TOKEN``); list and
show commands take ``--json`` for scripts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import quote

import click

from mcp_edge.controlplane.cli.client import (
    ApiClient,
    api_options,
    fmt_labels,
    fmt_time,
    parse_duration,
    parse_labels,
    print_json,
    print_table,
)

ROLES = ["admin", "operator", "viewer"]
STATUSES = ["preauthorized", "pending", "accepted", "rejected", "revoked", "online", "offline"]


def _read_secret(path: Path | None, prompt: str) -> str:
    if path is not None:
        return path.read_text(encoding="utf-8").rstrip("\r\n")
    return str(click.prompt(prompt, hide_input=True, confirmation_prompt=True))


def _dev(device_id: str) -> str:
    return "/api/v1/devices/" + quote(device_id, safe="")


# ---------------------------------------------------------------------------- login
@click.command()
@api_options
@click.option("--username", "-u", required=True)
@click.option(
    "--password-file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Read the password from this file instead of prompting.",
)
@click.option("--name", default="cli", show_default=True, help="A name for the new token.")
@click.option("--expires", default="30d", show_default=True, help="Token lifetime (or never).")
def login(
    server: str,
    token: str | None,
    username: str,
    password_file: Path | None,
    name: str,
    expires: str,
) -> None:
    """Trade a username and password for an API token (printed once)."""
    password = (
        password_file.read_text(encoding="utf-8").rstrip("\r\n")
        if password_file
        else str(click.prompt("Password", hide_input=True))
    )
    answer = ApiClient(server, None).call(
        "POST",
        "/api/v1/auth/login",
        auth=False,
        body={
            "username": username,
            "password": password,
            "token_name": name,
            "expires_in_s": parse_duration(expires),
        },
    )
    click.echo(answer["token"])


# ---------------------------------------------------------------------------- users
@click.group()
def users() -> None:
    """Operator accounts (admin role)."""


@users.command("create")
@api_options
@click.argument("username")
@click.option("--role", type=click.Choice(ROLES), default="viewer", show_default=True)
@click.option("--password-file", type=click.Path(dir_okay=False, path_type=Path))
def users_create(
    server: str, token: str | None, username: str, role: str, password_file: Path | None
) -> None:
    """Create a user."""
    password = _read_secret(password_file, f"Password for {username}")
    user = ApiClient(server, token).call(
        "POST", "/api/v1/users", body={"username": username, "password": password, "role": role}
    )
    click.echo(f"created user {user['username']} ({user['role']})")


@users.command("list")
@api_options
@click.option("--json", "as_json", is_flag=True)
def users_list(server: str, token: str | None, as_json: bool) -> None:
    """List users."""
    items = ApiClient(server, token).call("GET", "/api/v1/users")["items"]
    if as_json:
        print_json(items)
        return
    print_table(
        ["username", "role", "disabled", "created"],
        [
            [u["username"], u["role"], "yes" if u["disabled"] else "no", fmt_time(u["created_at"])]
            for u in items
        ],
    )


@users.command("set")
@api_options
@click.argument("username")
@click.option("--role", type=click.Choice(ROLES))
@click.option("--disable/--enable", "disabled", default=None)
@click.option("--password-file", type=click.Path(dir_okay=False, path_type=Path))
def users_set(
    server: str,
    token: str | None,
    username: str,
    role: str | None,
    disabled: bool | None,
    password_file: Path | None,
) -> None:
    """Change a user's role, disabled flag or password."""
    body: dict[str, Any] = {"role": role, "disabled": disabled}
    if password_file is not None:
        body["password"] = _read_secret(password_file, "")
    body = {k: v for k, v in body.items() if v is not None}
    if not body:
        raise click.UsageError(
            "nothing to change: give --role, --disable/--enable or --password-file"
        )
    user = ApiClient(server, token).call("PATCH", "/api/v1/users/" + quote(username), body=body)
    click.echo(f"{user['username']}: {user['role']}{' (disabled)' if user['disabled'] else ''}")


# ---------------------------------------------------------------------------- tokens
@click.group()
def tokens() -> None:
    """Enrollment tokens for `mcp-agent enroll`."""


@tokens.command("create")
@api_options
@click.option("--group", help="Group the enrolled devices join.")
@click.option("--labels", "labels", multiple=True, help="k=v[,k=v]; repeatable.")
@click.option("--uses", type=click.IntRange(min=1), help="How many devices may use it.")
@click.option("--expires", default="7d", show_default=True, help="Lifetime: 30m, 12h, 7d, never.")
@click.option(
    "--approval",
    type=click.Choice(["auto", "manual"]),
    default="auto",
    show_default=True,
    help="manual: devices wait in `devices pending`.",
)
@click.option("--description", default="")
def tokens_create(
    server: str,
    token: str | None,
    group: str | None,
    labels: tuple[str, ...],
    uses: int | None,
    expires: str,
    approval: str,
    description: str,
) -> None:
    """Create an enrollment token; the token is printed once, on the last line."""
    answer = ApiClient(server, token).call(
        "POST",
        "/api/v1/enrollment-tokens",
        body={
            "group": group,
            "labels": parse_labels(labels),
            "max_uses": uses,
            "expires_in_s": parse_duration(expires),
            "approval": approval,
            "description": description,
        },
    )
    uses_text = f"{answer['max_uses']} uses" if answer["max_uses"] else "unlimited uses"
    click.echo(
        f"enrollment token {answer['id']} ({uses_text}, expires "
        f"{fmt_time(answer['expires_at'])}, approval {answer['approval']}):",
        err=True,
    )
    click.echo(answer["token"])


@tokens.command("list")
@api_options
@click.option("--json", "as_json", is_flag=True)
def tokens_list(server: str, token: str | None, as_json: bool) -> None:
    """List enrollment tokens (the secrets themselves are never shown again)."""
    items = ApiClient(server, token).call("GET", "/api/v1/enrollment-tokens")["items"]
    if as_json:
        print_json(items)
        return
    print_table(
        ["id", "prefix", "state", "group", "labels", "uses", "approval", "expires"],
        [
            [
                t["id"],
                t["prefix"],
                t["state"],
                t["group"],
                fmt_labels(t["labels"]),
                f"{t['uses']}/{t['max_uses'] or '∞'}",
                t["approval"],
                fmt_time(t["expires_at"]),
            ]
            for t in items
        ],
    )


@tokens.command("revoke")
@api_options
@click.argument("token_id", type=int)
def tokens_revoke(server: str, token: str | None, token_id: int) -> None:
    """Revoke an enrollment token by id."""
    answer = ApiClient(server, token).call("DELETE", f"/api/v1/enrollment-tokens/{token_id}")
    click.echo(f"enrollment token {answer['id']} ({answer['prefix']}...) is {answer['state']}")


# ---------------------------------------------------------------------------- devices
@click.group()
def devices() -> None:
    """Devices: list, inspect, label, approve, revoke."""


def _device_rows(items: list[dict[str, Any]]) -> list[list[object]]:
    return [
        [
            d["id"],
            d["status"],
            "online" if d["online"] else "offline",
            d["profile"],
            d["group"],
            fmt_labels(d["labels"]),
            fmt_time(d["last_seen_at"]),
        ]
        for d in items
    ]


DEVICE_HEADERS = ["id", "status", "connection", "profile", "group", "labels", "last seen"]


@devices.command("list")
@api_options
@click.option("--label", "labels", multiple=True, help="k=v or k; repeatable (all must match).")
@click.option("--profile")
@click.option("--status", "statuses", multiple=True, type=click.Choice(STATUSES))
@click.option("--group")
@click.option("--limit", type=click.IntRange(1, 1000), default=100, show_default=True)
@click.option("--offset", type=click.IntRange(min=0), default=0)
@click.option("--json", "as_json", is_flag=True)
def devices_list(
    server: str,
    token: str | None,
    labels: tuple[str, ...],
    profile: str | None,
    statuses: tuple[str, ...],
    group: str | None,
    limit: int,
    offset: int,
    as_json: bool,
) -> None:
    """List devices matching all the filters given."""
    params = [("label", label) for label in labels] + [("status", s) for s in statuses]
    params += [(k, v) for k, v in (("profile", profile), ("group", group)) if v]
    params += [("limit", str(limit)), ("offset", str(offset))]
    answer = ApiClient(server, token).call("GET", "/api/v1/devices", params=params)
    if as_json:
        print_json(answer)
        return
    print_table(DEVICE_HEADERS, _device_rows(answer["items"]))
    if answer["total"] > len(answer["items"]):
        click.echo(f"({len(answer['items'])} of {answer['total']}; use --offset)", err=True)


@devices.command("show")
@api_options
@click.argument("device_id")
def devices_show(server: str, token: str | None, device_id: str) -> None:
    """Everything known about one device (JSON)."""
    print_json(ApiClient(server, token).call("GET", _dev(device_id)))


@devices.command("label")
@api_options
@click.argument("device_id")
@click.argument("changes", nargs=-1, required=True)
def devices_label(server: str, token: str | None, device_id: str, changes: tuple[str, ...]) -> None:
    """Set labels (k=v) and remove them (k-), e.g. `devices label dev-1 site=f2 rack-`."""
    set_: dict[str, str] = {}
    remove: list[str] = []
    for change in changes:
        if "=" in change:
            set_.update(parse_labels([change]))
        elif change.endswith("-") and len(change) > 1:
            remove.append(change[:-1])
        else:
            raise click.BadParameter(f"{change!r}: use key=value to set or key- to remove")
    answer = ApiClient(server, token).call(
        "PATCH", _dev(device_id) + "/labels", body={"set": set_, "remove": remove}
    )
    click.echo(f"{answer['id']}: {fmt_labels(answer['labels'])}")


@devices.command("revoke")
@api_options
@click.argument("device_id")
@click.option("--reason", default="")
def devices_revoke(server: str, token: str | None, device_id: str, reason: str) -> None:
    """Revoke a device: its broker account is disabled and it is refused from now on."""
    answer = ApiClient(server, token).call(
        "POST", _dev(device_id) + "/revoke", body={"reason": reason}
    )
    click.echo(f"{answer['id']}: {answer['status']}")


@devices.command("pending")
@api_options
@click.option("--json", "as_json", is_flag=True)
def devices_pending(server: str, token: str | None, as_json: bool) -> None:
    """Devices waiting for approval."""
    items = ApiClient(server, token).call("GET", "/api/v1/approvals")["items"]
    if as_json:
        print_json(items)
        return
    print_table(
        ["id", "profile", "group", "labels", "public key", "asked"],
        [
            [
                d["id"],
                d["profile"],
                d["group"],
                fmt_labels(d["labels"]),
                d["public_key"][:16],
                fmt_time(d["created_at"]),
            ]
            for d in items
        ],
    )


def _decide(verb: str) -> click.Command:
    @api_options
    @click.argument("device_id")
    @click.option("--reason", default="")
    def command(server: str, token: str | None, device_id: str, reason: str) -> None:
        answer = ApiClient(server, token).call(
            "POST",
            f"/api/v1/approvals/{quote(device_id, safe='')}/{verb}",
            body={"reason": reason},
        )
        click.echo(f"{answer['id']}: {answer['status']}")

    command.__doc__ = f"{verb.capitalize()} a pending device."
    return click.command(verb)(command)


devices.add_command(_decide("approve"))
devices.add_command(_decide("reject"))


@devices.command("preauthorize")
@api_options
@click.option("--public-key", required=True, help="The device's Ed25519 public key (64 hex).")
@click.option("--device-id", help="Id to give the device (default: derived from the key).")
@click.option("--group")
@click.option("--labels", "labels", multiple=True, help="k=v[,k=v]; repeatable.")
def devices_preauthorize(
    server: str,
    token: str | None,
    public_key: str,
    device_id: str | None,
    group: str | None,
    labels: tuple[str, ...],
) -> None:
    """Accept a device by public key before it enrolls (it then needs no valid token)."""
    answer = ApiClient(server, token).call(
        "POST",
        "/api/v1/preauthorizations",
        body={
            "public_key": public_key.strip().lower(),
            "device_id": device_id,
            "group": group,
            "labels": parse_labels(labels),
        },
    )
    click.echo(f"{answer['id']}: {answer['status']}")


# ---------------------------------------------------------------------------- audit
@click.command()
@api_options
@click.option("--limit", type=click.IntRange(1, 1000), default=50, show_default=True)
@click.option("--action", help="e.g. device.revoked")
@click.option("--json", "as_json", is_flag=True)
def audit(server: str, token: str | None, limit: int, action: str | None, as_json: bool) -> None:
    """The audit log, newest first."""
    params = [("limit", str(limit))] + ([("action", action)] if action else [])
    items = ApiClient(server, token).call("GET", "/api/v1/audit", params=params)["items"]
    if as_json:
        print_json(items)
        return
    print_table(
        ["id", "at", "actor", "action", "target"],
        [
            [
                e["id"],
                fmt_time(e["at"]),
                e["actor"],
                e["action"],
                f"{e['target_type']}:{e['target_id']}",
            ]
            for e in items
        ],
    )


COMMANDS = [login, users, tokens, devices, audit]
