"""``mcp-controlplane deploy|undeploy|deployments|desired``: deployments from a shell.

    mcp-controlplane deploy MODEL VERSION (--device D | --group G | --label k=v ...)
                            [--canary V [--weight W] [--max-error-rate R] [--min-requests N]
                             | --shadow V] [--rollback]
                            [--wait [--timeout 10m] [--log-level L] [--log-format text|json]]
    mcp-controlplane undeploy MODEL (--device D | --group G | --label k=v ...)
    mcp-controlplane deployments list [--model M] [--limit N]
    mcp-controlplane desired show DEVICE [--envelope]
    mcp-controlplane desired models DEVICE

Everything goes through the REST API (``--server``/``--token`` or ``MCP_SERVER``/``MCP_TOKEN``);
list and show commands take ``--json`` for scripts.

``deploy --wait`` follows the deployment until each device it reached has reported the
outcome (:class:`Follower`): its reported state (``GET /devices/{id}/models``) shows the
desired state applied and the versions active, or its deployment events
(``GET /devices/{id}/events``, those received since the deploy) show the versions failed,
rolled back or refused, with the cause. It exits 0 when every device succeeded, 1 when one
failed or the timeout passed first.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any
from urllib.parse import quote

import click

from mcp_edge.controlplane.cli.client import (
    ApiCallError,
    ApiClient,
    ApiSession,
    api_options,
    configure_logging,
    fmt_labels,
    fmt_time,
    parse_duration,
    parse_labels,
    print_json,
    print_table,
)
from mcp_edge.shared.cli_style import log_options
from mcp_edge.shared.protocol.canary import DEFAULT_CANARY_POLICY as CANARY

log = logging.getLogger("mcp.controlplane.deploy")


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
@click.option(
    "--wait",
    is_flag=True,
    help="Follow the deployment until every device reports the outcome: exit 0 when all run "
    "it, 1 when one failed or --timeout passed.",
)
@click.option(
    "--timeout",
    default="10m",
    show_default=True,
    help="With --wait: how long to wait (90s, 30m, 2h, or never).",
)
@log_options
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
    wait: bool,
    timeout: str,
    log_level: str,
    log_format: str,
    as_json: bool,
) -> None:
    """Make VERSION of MODEL the stable version on the selected devices.

    Each device gets a new director-signed desired state, published retained on its desired
    topic. Going below a device's current version needs --rollback.

    With --wait the command follows each device until it reports the outcome, logging
    progress on stderr, and prints one line per device at the end.
    """
    ctx = click.get_current_context()
    if not wait and ctx.get_parameter_source("timeout") is click.core.ParameterSource.COMMANDLINE:
        raise click.UsageError("--timeout is for --wait")
    try:
        timeout_s = parse_duration(timeout) if wait else None
    except click.BadParameter as e:
        raise click.BadParameter(e.message, param_hint="--timeout") from None
    if wait:
        configure_logging(log_level, log_format)
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
    client = ApiClient(server, token)
    answer = client.call("POST", "/api/v1/deployments", body=body)
    if not wait:
        if as_json:
            print_json(answer)
        else:
            _print_result(answer)
        return
    if not as_json:
        _print_result(answer)
    follower = Follower(answer, canary=canary, shadow=shadow)
    asyncio.run(follower.follow(client, timeout_s))
    follower.finish(as_json, timeout)


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


# ---------------------------------------------------------------------------- deploy --wait
POLL_S = 1.0
HEARTBEAT_S = 30.0
CONCURRENCY = 8
EVENT_PAGE = 1000
MAX_POLL_FAILURES = 5
PENDING, ACTIVE, FAILED = "pending", "active", "failed"


class WaitError(click.ClickException):
    """``deploy --wait`` ended without every device running the deployment."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


def _when(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def _percent(event: dict[str, Any]) -> str:
    done, total = event.get("bytes_done"), event.get("bytes_total")
    if event["phase"] == "downloading" and isinstance(done, int) and isinstance(total, int):
        return f" {100 * done // max(total, 1)}%"
    return ""


@dataclass
class Watched:
    """One device the deployment reached: the seq of its new desired state and what it
    reported so far."""

    device_id: str
    seq: int
    outcome: str = PENDING
    detail: str = "no report yet"
    after_seq: int = 0
    last_error: str = ""


@dataclass
class Follower:
    """Follows a deploy's devices to their outcomes (see the module's docstring)."""

    answer: dict[str, Any]
    canary: str | None = None
    shadow: str | None = None
    devices: dict[str, Watched] = field(default_factory=dict)

    def __post_init__(self) -> None:
        d = self.answer["deployment"]
        self.id = int(d["id"])
        self.model, self.version = str(d["model"]), str(d["version"])
        self.since = _when(d["created_at"])
        self.versions = {v for v in (self.version, self.canary, self.shadow) if v}
        for item in self.answer["devices"]:
            self.devices[item["device_id"]] = Watched(item["device_id"], int(item["seq"]))

    # ------------------------------------------------------------------ judging
    def judge_models(self, w: Watched, answer: dict[str, Any]) -> None:
        """The device's reported state (``GET .../models``): done once it applied ``w.seq``."""
        ours = next((m for m in answer["items"] if m["model"] == self.model), None)
        desired_seq = answer.get("desired_seq")
        if isinstance(desired_seq, int) and desired_seq > w.seq:
            stable = ((ours or {}).get("desired") or {}).get("stable_version")
            if stable != self.version:
                w.outcome = FAILED
                w.detail = f"superseded: its desired state seq {desired_seq} runs " + (
                    f"{self.model} {stable}" if stable else f"no {self.model}"
                )
                return
        applied = answer.get("applied_seq")
        if not isinstance(applied, int) or applied < w.seq:
            return
        reported = (ours or {}).get("reported") or {}
        if reported.get("phase") == "failed":
            w.outcome = FAILED
            w.detail = str(reported.get("last_error") or w.last_error or "failed")
            return
        wanted = {
            "active_version": self.version,
            "canary_version": self.canary,
            "shadow_version": self.shadow,
        }
        if all(reported.get(k) == v for k, v in wanted.items()):
            w.outcome = ACTIVE
            w.detail = f"{self.model} {self.version} active"
            if self.canary:
                w.detail += f", canary {self.canary}"
            if self.shadow:
                w.detail += f", shadow {self.shadow}"

    def judge_events(self, w: Watched, events: list[dict[str, Any]]) -> None:
        """Deployment events of the device, oldest first: progress, and a failure of one of
        the deployment's versions (rolled back, or the desired state refused)."""
        for e in events:
            w.after_seq = max(w.after_seq, int(e["event_seq"]))
            if e["model"] != self.model or e["version"] not in self.versions:
                continue
            if _when(e["received_at"]) < self.since:
                continue
            phase, outcome, version = e["phase"], e["outcome"], e["version"]
            cause = f"{e['cause']}: {e['message']}" if e.get("cause") else str(e["message"])
            if phase == "idle" and outcome == "error":
                w.outcome, w.detail = FAILED, f"desired state refused: {cause}"
            elif phase == "rolling_back" and outcome == "ok":
                w.outcome, w.detail = FAILED, f"{w.last_error or version}; rolled back"
            elif phase == "rolling_back" and outcome == "error":
                w.outcome = FAILED
                w.detail = f"{w.last_error or version}; the rollback failed too: {cause}"
            elif phase == "failed":
                w.outcome, w.detail = FAILED, w.last_error or f"{version} {cause}"
            elif outcome == "error":
                w.last_error = f"{version} {cause}"
                w.detail = f"{version} {phase}: {cause}"
            else:
                w.detail = f"{version} {phase}{_percent(e)}"

    # ------------------------------------------------------------------ polling
    async def poll(self, session: ApiSession, w: Watched) -> None:
        path = f"/api/v1/devices/{quote(w.device_id, safe='')}"
        try:
            while True:
                params = [("after_seq", str(w.after_seq)), ("limit", str(EVENT_PAGE))]
                page = (await session.call("GET", path + "/events", params=params))["items"]
                self.judge_events(w, page)
                if len(page) < EVENT_PAGE or w.outcome != PENDING:
                    break
            if w.outcome == PENDING:
                self.judge_models(w, await session.call("GET", path + "/models"))
        except ApiCallError as e:
            if e.status != 404:
                raise
            w.outcome, w.detail = FAILED, str(e)

    async def follow(self, client: ApiClient, timeout_s: int | None) -> None:
        """Poll the pending devices every :data:`POLL_S` until none is left or ``timeout_s``
        passed, logging a progress line whenever it changes (and every 30 s)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        limit = asyncio.Semaphore(CONCURRENCY)
        failures, said, said_at = 0, "", 0.0

        async def one(session: ApiSession, w: Watched) -> None:
            async with limit:
                await self.poll(session, w)

        async with client.session() as session:
            while True:
                pending = [w for w in self.devices.values() if w.outcome == PENDING]
                results = await asyncio.gather(
                    *(one(session, w) for w in pending), return_exceptions=True
                )
                errors = [r for r in results if isinstance(r, BaseException)]
                if not errors:
                    failures = 0
                else:
                    e = errors[0]
                    failures += 1
                    if not isinstance(e, ApiCallError):
                        raise e
                    if e.status in (401, 403) or failures >= MAX_POLL_FAILURES:
                        raise e
                    log.warning("deployment %d: %s; trying again", self.id, e.format_message())
                line = self.progress()
                if line != said or time.monotonic() - said_at >= HEARTBEAT_S:
                    log.info("%s", line)
                    said, said_at = line, time.monotonic()
                if not any(w.outcome == PENDING for w in self.devices.values()):
                    return
                if deadline is not None and time.monotonic() >= deadline:
                    return
                await asyncio.sleep(POLL_S)

    # ------------------------------------------------------------------ reporting
    def counts(self) -> dict[str, list[Watched]]:
        out: dict[str, list[Watched]] = {ACTIVE: [], FAILED: [], PENDING: []}
        for w in sorted(self.devices.values(), key=lambda w: w.device_id):
            out[w.outcome].append(w)
        return out

    def progress(self) -> str:
        c = self.counts()
        done = len(c[ACTIVE]) + len(c[FAILED])
        line = (
            f"deployment {self.id} ({self.model} {self.version}): {done} of "
            f"{len(self.devices)} device(s) done, {len(c[ACTIVE])} active, "
            f"{len(c[FAILED])} failed"
        )
        if c[PENDING]:
            shown = ", ".join(f"{w.device_id} ({w.detail})" for w in c[PENDING][:5])
            more = f" and {len(c[PENDING]) - 5} more" if len(c[PENDING]) > 5 else ""
            line += f"; waiting for {shown}{more}"
        return line

    def finish(self, as_json: bool, timeout: str) -> None:
        """Print each device's outcome (stdout); raise :class:`WaitError` unless all are
        active."""
        c = self.counts()
        rows = [w for outcome in (FAILED, PENDING, ACTIVE) for w in c[outcome]]
        if as_json:
            print_json(
                {
                    **self.answer,
                    "outcomes": [
                        {"device_id": w.device_id, "outcome": w.outcome, "detail": w.detail}
                        for w in rows
                    ],
                }
            )
        elif rows:
            print_table(
                ["device", "outcome", "detail"], [[w.device_id, w.outcome, w.detail] for w in rows]
            )
        what = f"deployment {self.id} ({self.model} {self.version})"
        if not c[FAILED] and not c[PENDING]:
            if not self.devices:
                click.echo(f"{what}: no device to wait for", err=True)
            else:
                click.echo(f"{what}: active on all {len(self.devices)} device(s)", err=True)
            return
        problems = []
        if c[FAILED]:
            named = ", ".join(f"{w.device_id} ({w.detail})" for w in c[FAILED][:10])
            problems.append(f"{len(c[FAILED])} device(s) failed: {named}")
        if c[PENDING]:
            named = ", ".join(w.device_id for w in c[PENDING][:20])
            more = f" and {len(c[PENDING]) - 20} more" if len(c[PENDING]) > 20 else ""
            problems.append(f"{len(c[PENDING])} still pending after {timeout}: {named}{more}")
        raise WaitError(
            f"{what}: " + "; ".join(problems),
            "deployment_failed" if c[FAILED] else "timeout",
        )


COMMANDS = [deploy, undeploy, deployments, desired]
