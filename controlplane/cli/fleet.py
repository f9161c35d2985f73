"""``mcp-controlplane users|tokens|devices|audit|login``: the REST API from a shell.

Each command takes ``--server`` and ``--token`` (or ``MCP_SERVER`` / ``MCP_TOKEN``); list and
show commands take ``--json`` for scripts.
"""

from __future__ import annotations

import math
from collections import deque
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
from mcp_edge.shared.cli_style import CommandLineOnly

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
    """Devices: list, inspect, label, approve, revoke; their flight recorder and health."""


def fmt_models(models: list[dict[str, Any]]) -> str:
    """A device's models on one line: ``digits=1.1.0`` when in sync, else what it runs and
    what it should (``digits=1.0.0 (wants 1.1.0)``); the variant it runs, when reported, after
    the version (``digits=1.1.0 (int8)``, ``digits=1.0.0 (int8, wants 1.1.0)``)."""
    parts = []
    for m in models:
        runs = m["reported_version"] or "-"
        notes = [m["variant"]] if m.get("variant") else []
        if m["desired_version"] is None:
            notes.append("not desired")
        elif not m["in_sync"]:
            notes.append(f"wants {m['desired_version']}")
        parts.append(f"{m['model']}={runs}" + (f" ({', '.join(notes)})" if notes else ""))
    return ", ".join(parts) or "-"


def _sync_text(device: dict[str, Any]) -> str:
    if not device["models"]:
        return "-"
    return "yes" if device["in_sync"] else "no"


def _device_rows(items: list[dict[str, Any]]) -> list[list[object]]:
    return [
        [
            d["id"],
            d["status"],
            "online" if d["online"] else "offline",
            d["profile"],
            d["group"],
            fmt_labels(d["labels"]),
            fmt_models(d["models"]),
            _sync_text(d),
            fmt_time(d["last_seen_at"]),
        ]
        for d in items
    ]


DEVICE_HEADERS = [
    "id", "status", "connection", "profile", "group", "labels", "models", "in sync", "last seen",
]  # fmt: skip


@devices.command("list")
@api_options
@click.option("--label", "labels", multiple=True, help="k=v or k; repeatable (all must match).")
@click.option("--profile", cls=CommandLineOnly, help="Devices of this hardware profile.")
@click.option("--status", "statuses", multiple=True, type=click.Choice(STATUSES))
@click.option("--group")
@click.option("--model", help="Devices told to run this model, or reporting it.")
@click.option(
    "--in-sync/--not-in-sync",
    "in_sync",
    default=None,
    help="Devices whose every model runs its desired version / those with one that does not.",
)
@click.option("--search", "-q", help="Devices whose id contains this.")
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
    model: str | None,
    in_sync: bool | None,
    search: str | None,
    limit: int,
    offset: int,
    as_json: bool,
) -> None:
    """List devices matching all the filters given, with the version of each model they run
    and whether it is the one they were told to run."""
    params = [("label", label) for label in labels] + [("status", s) for s in statuses]
    params += [
        (k, v) for k, v in (("profile", profile), ("group", group), ("model", model),
                            ("q", search)) if v
    ]  # fmt: skip
    if in_sync is not None:
        params.append(("in_sync", "true" if in_sync else "false"))
    params += [("limit", str(limit)), ("offset", str(offset))]
    answer = ApiClient(server, token).call("GET", "/api/v1/devices", params=params)
    if as_json:
        print_json(answer)
        return
    print_table(DEVICE_HEADERS, _device_rows(answer["items"]))
    if answer["total"] > len(answer["items"]):
        click.echo(f"({len(answer['items'])} of {answer['total']}; use --offset)", err=True)


def _facts(device: dict[str, Any]) -> list[tuple[str, str]]:
    status = device["status"]
    if status == "accepted":
        status += " (online)" if device["online"] else " (offline)"
    elif device["revoked_at"]:
        status += f" since {fmt_time(device['revoked_at'])}"
    enrolled = fmt_time(device["created_at"])
    if device["accepted_at"]:
        enrolled += f", accepted {fmt_time(device['accepted_at'])}"
    hardware = ", ".join(f"{k}={v}" for k, v in sorted(device["facts"].items())) or "-"
    return [
        ("status", status),
        ("profile", device["profile"] or "-"),
        ("group", device["group"] or "-"),
        ("labels", fmt_labels(device["labels"])),
        ("agent version", device["agent_version"] or "-"),
        ("hardware", hardware),
        ("enrolled", enrolled),
        ("last seen", fmt_time(device["last_seen_at"])),
        ("public key", device["public_key"]),
    ]


def _print_facts(facts: list[tuple[str, str]]) -> None:
    width = max(len(k) for k, _ in facts)
    for key, value in facts:
        click.echo(f"  {key.ljust(width)}  {value}")


@devices.command("show")
@api_options
@click.argument("device_id")
@click.option("--json", "as_json", is_flag=True, help="The whole document the API gives.")
def devices_show(server: str, token: str | None, device_id: str, as_json: bool) -> None:
    """Everything known about one device: its facts, labels and models."""
    device = ApiClient(server, token).call("GET", _dev(device_id))
    if as_json:
        print_json(device)
        return
    click.echo(device["id"])
    _print_facts(_facts(device))
    if not device["models"]:
        command = f"mcp-controlplane deploy MODEL VERSION --device {device['id']}"
        click.echo(f"no models; deploy one with `{command}`")
        return
    click.echo("all models in sync" if device["in_sync"] else "not in sync")
    print_table(
        ["model", "desired", "canary", "reported", "variant", "backend", "phase", "in sync"],
        [
            [m["model"], m["desired_version"] or "(not desired)", m["canary_version"],
             m["reported_version"], m.get("variant"), m.get("backend"), m["phase"],
             "yes" if m["in_sync"] else "no"]
            for m in device["models"]
        ],
    )  # fmt: skip


EVENTS_PAGE = 1000


def fmt_bytes(value: int | None) -> str:
    """``1.5 MiB`` (binary units up to GiB); ``-`` for None."""
    if value is None:
        return "-"
    if value < 1024:
        return f"{value} B"
    exponent = min(3, int(math.log(value, 1024)))
    return f"{value / 1024**exponent:.1f} {('KiB', 'MiB', 'GiB')[exponent - 1]}"


def _event_bytes(event: dict[str, Any]) -> str:
    done, total = event["bytes_done"], event["bytes_total"]
    if total:
        return f"{fmt_bytes(done or 0)}/{fmt_bytes(total)}"
    return fmt_bytes(done)


def _took(ms: float | None) -> str:
    if ms is None:
        return "-"
    return f"{ms:.0f} ms" if ms < 1000 else f"{ms / 1000:.1f} s"


@devices.command("events")
@api_options
@click.argument("device_id")
@click.option(
    "--limit", type=click.IntRange(1, 10_000), default=50, show_default=True,
    help="How many of the newest events.",
)  # fmt: skip
@click.option("--json", "as_json", is_flag=True)
def devices_events(
    server: str, token: str | None, device_id: str, limit: int, as_json: bool
) -> None:
    """The device's deployment flight recorder: each step of each deployment (phase, outcome,
    bytes, time taken, cause), oldest first, the newest LIMIT of them."""
    client = ApiClient(server, token)
    newest: deque[dict[str, Any]] = deque(maxlen=limit)
    after = -1
    while True:  # the API pages by event_seq from the oldest; keep the newest LIMIT
        params = [("after_seq", str(after)), ("limit", str(EVENTS_PAGE))]
        items = client.call("GET", _dev(device_id) + "/events", params=params)["items"]
        newest.extend(items)
        if len(items) < EVENTS_PAGE:
            break
        after = items[-1]["event_seq"]
    events = list(newest)
    if as_json:
        print_json(events)
        return
    if not events:
        click.echo(f"{device_id} recorded no deployment events yet", err=True)
        return
    print_table(
        ["seq", "time", "model", "version", "phase", "outcome", "bytes", "took", "cause",
         "message"],
        [
            [e["event_seq"], fmt_time(e["ts"]), e["model"], e["version"], e["phase"],
             e["outcome"], _event_bytes(e), _took(e["elapsed_ms"]), e["cause"],
             e["message"] or "-"]
            for e in events
        ],
    )  # fmt: skip


def _health_facts(h: dict[str, Any]) -> list[tuple[str, str]]:
    def mb(value: float | None) -> str:
        return "-" if value is None else f"{value:.0f}"

    facts = [
        ("cpu", f"{h['cpu_percent']:.0f} %"
         + (f", load {h['load_1m']:.2f}" if h["load_1m"] is not None else "")),
        ("memory", f"{mb(h['mem_used_mb'])} of {mb(h['mem_total_mb'])} MB used"),
        ("disk", f"{mb(h['disk_free_mb'])} of {mb(h['disk_total_mb'])} MB free"),
        ("agent memory", f"{mb(h['process_rss_mb'])} MB"),
        ("uptime", "-" if h["uptime_s"] is None else f"{h['uptime_s'] / 3600:.1f} h"),
    ]  # fmt: skip
    temperatures = ", ".join(f"{k} {v:.1f} °C" for k, v in sorted(h["temperatures_c"].items()))
    facts.append(("temperature", temperatures or "-"))
    gpu = h.get("gpu") or {}
    if gpu:
        parts = []
        if gpu.get("util_percent") is not None:
            parts.append(f"{gpu['util_percent']:.0f} %")
        if gpu.get("mem_used_mb") is not None:
            parts.append(f"memory {mb(gpu['mem_used_mb'])} of {mb(gpu.get('mem_total_mb'))} MB")
        if gpu.get("power_mw") is not None:
            parts.append(f"power {gpu['power_mw'] / 1000:.1f} W")
        facts.append(("gpu", ", ".join(parts) or "-"))
    return facts


@devices.command("health")
@api_options
@click.argument("device_id")
@click.option(
    "--window", default="1h", show_default=True,
    help="Inference figures over this much time back (1m to 7d).",
)  # fmt: skip
@click.option("--json", "as_json", is_flag=True)
def devices_health(
    server: str, token: str | None, device_id: str, window: str, as_json: bool
) -> None:
    """The device's latest health reading, and the requests, errors and p95 latency of each
    model version it ran over the window."""
    window_s = parse_duration(window)
    if window_s is None:
        raise click.BadParameter("give a length of time such as 1h", param_hint="--window")
    client = ApiClient(server, token)
    samples = client.call("GET", _dev(device_id) + "/health", params=[("limit", "1")])["items"]
    inference = client.call(
        "GET", _dev(device_id) + "/inference", params=[("window_s", str(window_s))]
    )
    latest = samples[-1] if samples else None
    if as_json:
        print_json({"device_id": device_id, "health": latest, "inference": inference})
        return
    if latest is None:
        click.echo(f"{device_id}: no health reading stored")
    else:
        click.echo(f"{device_id}: health at {fmt_time(latest['ts'])} (the device's clock)")
        _print_facts(_health_facts(latest))
    if not inference["items"]:
        click.echo(f"no inference statistics since {fmt_time(inference['since'])}")
        return
    click.echo(f"inference since {fmt_time(inference['since'])}:")
    print_table(
        ["model", "version", "role", "requests", "errors", "error rate", "p95"],
        [
            [i["model"], i["version"], i["role"], i["requests"], i["errors"],
             "-" if i["error_rate"] is None else f"{100 * i['error_rate']:.2f} %",
             "-" if i["p95_ms"] is None else f"{i['p95_ms']:.1f} ms"]
            for i in inference["items"]
        ],
    )  # fmt: skip


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
