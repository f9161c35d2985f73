"""``mcp-controlplane deploy|undeploy|deployments|desired``: deployments from a shell.

    mcp-controlplane deploy MODEL VERSION (--device D | --group G | --label k=v ...)
                            [--canary V [--weight W] [--max-error-rate R] [--min-requests N]
                             | --shadow V] [--rollback]
    mcp-controlplane undeploy MODEL (--device D | --group G | --label k=v ...)
    mcp-controlplane deployments list [--model M] [--limit N]
    mcp-controlplane desired show DEVICE [--envelope]
    mcp-controlplane desired models DEVICE

Everything goes through the REST API (``--server``/``--token`` or ``MCP_SERVER``/``MCP_TOKEN``);
list and show commands take ``--json`` for scripts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from urllib.parse import quote

import click

from mcp_edge.controlplane.cli.client import (
    ApiClient,
    api_options,
    fmt_labels,
    fmt_time,
    parse_labels,
    print_json,
    print_table,
)
from mcp_edge.shared.protocol.canary import DEFAULT_CANARY_POLICY as CANARY


def _selector(device: str | None, group: str | None, labels: Sequence[str]) -> dict[str, Any]:
    given = [
        name
        for name, value in (("--device", device), ("--group", group), ("--label", labels))
        if value
    ]
    if len(given) != 1:
        raise click.UsageError(
            "select devices with exactly one of --device, --group or --label k=v "
            f"(got {', '.join(given) or 'none'})"
        )
    if device:
        return {"device_id": device}
    if group:
        return {"group": group}
    return {"labels": parse_labels(labels)}


def _selector_options(func: Any) -> Any:
    func = click.option(
        "--label",
        "labels",
        multiple=True,
        metavar="K=V",
        help="Devices with this label; repeatable, all must match.",
    )(func)
    func = click.option("--group", help="Every accepted device of this group.")(func)
    func = click.option("--device", help="One device, by id.")(func)
    return func


def _describe(d: dict[str, Any]) -> str:
    if d.get("device_id"):
        return f"device {d['device_id']}"
    if d.get("group"):
        return f"group {d['group']}"
    return f"labels {fmt_labels(d.get('labels'))}"


def _print_result(answer: dict[str, Any]) -> None:
    d = answer["deployment"]
    what = f"{d['model']} {d['version']}" if d["action"] == "deploy" else f"{d['model']} removed"
    click.echo(f"deployment {d['id']}: {what} → {_describe(d)}: {len(answer['devices'])} device(s)")
    for item in answer["devices"]:
        state = "published" if item["published"] else "not published yet"
        click.echo(f"  {item['device_id']}  seq {item['seq']}  {state}")
    for device_id, reason in sorted(answer["skipped"].items()):
        click.echo(f"  {device_id}  skipped: {reason}")
    click.echo(answer["message"], err=True)


@click.command()
@api_options
@click.argument("model")
@click.argument("version")
@_selector_options
@click.option(
    "--canary", metavar="VERSION", help="Serve this version beside stable to a share of requests."
)
@click.option(
    "--weight",
    type=click.FloatRange(0.0, 1.0),
    help=f"The canary's share of requests (0..1; default {CANARY.weight}).",
)
@click.option(
    "--max-error-rate",
    type=click.FloatRange(0.0, 1.0),
    help="Share of failed canary "
    "requests that makes a device take the canary out of rotation (0..1; default "
    f"{CANARY.max_error_rate}).",
)
@click.option(
    "--min-requests",
    type=click.IntRange(1, CANARY.window),
    help="Canary requests a "
    f"device judges before it may take the canary out (default {CANARY.min_requests}).",
)
@click.option("--shadow", metavar="VERSION", help="Run this version on copies of requests.")
@click.option("--rollback", is_flag=True, help="Allow going below a device's current version.")
@click.option("--json", "as_json", is_flag=True, help="Print the whole answer as JSON.")
def deploy(
    server: str,
    token: str | None,
    model: str,
    version: str,
    device: str | None,
    group: str | None,
    labels: tuple[str, ...],
    canary: str | None,
    weight: float | None,
    max_error_rate: float | None,
    min_requests: int | None,
    shadow: str | None,
    rollback: bool,
    as_json: bool,
) -> None:
    """Make VERSION of MODEL the stable version on the selected devices.

    Each device gets a new director-signed desired state, published retained on its desired
    topic. Going below a device's current version needs --rollback.
    """
    selector = _selector(device, group, labels)
    policy = {
        name: value
        for name, value in (
            ("weight", weight),
            ("max_error_rate", max_error_rate),
            ("min_requests", min_requests),
        )
        if value is not None
    }
    if policy and canary is None:
        raise click.UsageError(
            "--weight, --max-error-rate and --min-requests set the canary's "
            "policy; give --canary VERSION too"
        )
    if canary and shadow:
        raise click.UsageError("a model takes a canary or a shadow, not both")
    body: dict[str, Any] = {
        "model": model,
        "version": version,
        "selector": selector,
        "rollback": rollback,
    }
    if canary:
        body["canary"] = {"version": canary, **policy}
    if shadow:
        body["shadow"] = shadow
    answer = ApiClient(server, token).call("POST", "/api/v1/deployments", body=body)
    if as_json:
        print_json(answer)
    else:
        _print_result(answer)


@click.command()
@api_options
@click.argument("model")
@_selector_options
@click.option("--json", "as_json", is_flag=True, help="Print the whole answer as JSON.")
def undeploy(
    server: str,
    token: str | None,
    model: str,
    device: str | None,
    group: str | None,
    labels: tuple[str, ...],
    as_json: bool,
) -> None:
    """Remove MODEL from the selected devices (a group or label undeploy also stops devices
    accepted later from getting it)."""
    body = {"model": model, "selector": _selector(device, group, labels)}
    answer = ApiClient(server, token).call("POST", "/api/v1/deployments/undeploy", body=body)
    if as_json:
        print_json(answer)
    else:
        _print_result(answer)


@click.group()
def deployments() -> None:
    """The history of deploys and undeploys."""


@deployments.command("list")
@api_options
@click.option("--model", help="Only this model.")
@click.option("--limit", type=click.IntRange(1, 1000), default=50, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def deployments_list(
    server: str, token: str | None, model: str | None, limit: int, as_json: bool
) -> None:
    """List deployments, newest first."""
    params = [("limit", str(limit))] + ([("model", model)] if model else [])
    items = ApiClient(server, token).call("GET", "/api/v1/deployments", params=params)["items"]
    if as_json:
        print_json(items)
        return
    print_table(
        ["id", "action", "model", "version", "selector", "extra", "devices", "by", "at"],
        [
            [
                d["id"],
                d["action"],
                d["model"],
                d["version"] or "-",
                _describe(d),
                _extra(d),
                d["devices_matched"],
                d["created_by"],
                fmt_time(d["created_at"]),
            ]
            for d in items
        ],
    )


def _extra(d: dict[str, Any]) -> str:
    parts = []
    if d.get("canary_version"):
        parts.append(f"canary {d['canary_version']}@{d['canary_weight']}")
    if d.get("shadow_version"):
        parts.append(f"shadow {d['shadow_version']}")
    if d.get("rollback"):
        parts.append("rollback")
    return ", ".join(parts) or "-"


@click.group()
def desired() -> None:
    """Signed desired states of devices."""


def _device_path(device_id: str, tail: str) -> str:
    return f"/api/v1/devices/{quote(device_id, safe='')}/{tail}"


@desired.command("show")
@api_options
@click.argument("device_id")
@click.option("--envelope", is_flag=True, help="Print the signed envelope as published.")
@click.option("--json", "as_json", is_flag=True, help="Print the whole answer as JSON.")
def desired_show(
    server: str, token: str | None, device_id: str, envelope: bool, as_json: bool
) -> None:
    """The device's current desired state: seq, lifetime, publication, and its models."""
    answer = ApiClient(server, token).call("GET", _device_path(device_id, "desired"))
    if as_json or envelope:
        print_json(answer if as_json else answer["envelope"])
        return
    published = fmt_time(answer["published_at"]) if answer["published"] else "not yet"
    click.echo(
        f"device {answer['device_id']}  seq {answer['seq']}  issued "
        f"{fmt_time(answer['issued_at'])}  expires {fmt_time(answer['expires_at'])}  "
        f"published {published}"
    )
    models = answer["envelope"]["signed"].get("models", [])
    print_table(
        ["model", "stable", "canary", "shadow", "rollback", "sha256"],
        [
            [
                m["name"],
                m["stable"]["version"],
                f"{m['canary']['target']['version']}@{m['canary']['weight']}"
                if m.get("canary")
                else "-",
                m["shadow"]["version"] if m.get("shadow") else "-",
                "yes" if m.get("rollback") else "no",
                m["stable"]["sha256"][:12],
            ]
            for m in models
        ],
    )


@desired.command("models")
@api_options
@click.argument("device_id")
@click.option("--json", "as_json", is_flag=True)
def desired_models(server: str, token: str | None, device_id: str, as_json: bool) -> None:
    """Desired versus reported version of each model of the device."""
    answer = ApiClient(server, token).call("GET", _device_path(device_id, "models"))
    if as_json:
        print_json(answer)
        return
    click.echo(
        f"device {answer['device_id']}  desired seq {answer['desired_seq'] or '-'}  "
        f"applied seq {answer['applied_seq'] if answer['applied_seq'] is not None else '-'}"
    )
    print_table(
        ["model", "desired", "active", "phase", "in sync"],
        [
            [
                m["model"],
                (m["desired"] or {}).get("stable_version", "-"),
                (m["reported"] or {}).get("active_version") or "-",
                (m["reported"] or {}).get("phase", "-"),
                "yes" if m["in_sync"] else "no",
            ]
            for m in answer["items"]
        ],
    )


COMMANDS = [deploy, undeploy, deployments, desired]
