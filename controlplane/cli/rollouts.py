"""``mcp-controlplane rollouts ...``: staged rollouts from a shell (docs/rollouts.md).

    mcp-controlplane rollouts create [MODEL VERSION] (--device D ... | --group G | --label k=v ...
                                     | --profile P ...) [--stage SPEC ...] [--rate N/min]
                                     [--rate-growth F] [--device-timeout 10m]
                                     [--file rollout.toml|rollout.json] [--print-spec]
    mcp-controlplane rollouts list [--model M] [--status S|active] [--limit N]
    mcp-controlplane rollouts show ID
    mcp-controlplane rollouts devices ID [--phase P]
    mcp-controlplane rollouts history ID
    mcp-controlplane rollouts pause|resume|abort|promote|approve|rollback ID [--reason TEXT]
    mcp-controlplane rollouts watch ID [--interval 1s]

Everything goes through the REST API (``--server``/``--token`` or ``MCP_SERVER``/``MCP_TOKEN``);
the reading commands take ``--json`` for scripts. ``create`` builds its body in
:mod:`controlplane.cli.rollout_spec` (the compact ``--stage`` form, ``--file``), checked there by
the server's own rules before anything is sent. The screen ``show`` and ``watch`` draw is
:func:`render`, a pure function of the API's answers.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import click

from mcp_edge.controlplane.cli.client import (
    ApiClient,
    api_options,
    parse_labels,
    print_json,
    print_table,
)
from mcp_edge.controlplane.cli.rollout_spec import (
    DEFAULT_STAGES,
    build_spec,
    fmt_seconds,
    gate_text,
    parse_rate,
    parse_seconds,
)
from mcp_edge.controlplane.rollouts.model import DevicePhase, RolloutStatus, Stage
from mcp_edge.controlplane.rollouts.spec import SpecError, parse_spec, plan_stage_sizes
from mcp_edge.shared.cli_style import CommandLineOnly

ENDED = tuple(s.value for s in RolloutStatus if s.ended)
STATUSES = [s.value for s in RolloutStatus]
PHASES = [p.value for p in DevicePhase]
COMMAND_HELP = {
    "pause": "Pause a rollout: no device is told anything until it resumes.",
    "resume": "Resume a paused rollout (the current stage's bake starts again).",
    "abort": "Stop a rollout for good; devices stay where they are.",
    "promote": "Count the current stage as passed now (skips its bake and gates).",
    "approve": "Approve the stage that waits for a human.",
    "rollback": "Put every device the rollout touched back on its previous version.",
}
WATCH_DEVICES = 5
"""Devices named per phase on the watch screen."""
WATCH_HISTORY = 8
"""History lines on the watch screen."""
WATCH_FAILURES = 5
"""Polls in a row that may fail before ``watch`` gives up."""
CLEAR = "\x1b[H\x1b[2J"
_STAGE_DEFAULT = Stage()


# ---------------------------------------------------------------------------- output
def fmt_at(value: str | None) -> str:
    """An RFC 3339 answer field as ``YYYY-MM-DD HH:MM:SS`` (UTC), or ``-``."""
    if not value:
        return "-"
    try:
        at = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return value
    return at.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def fmt_value(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def stage_no(index: int | None) -> str:
    """Stages are numbered from 1 on screen (the API's ``stage`` is the 0-based index)."""
    return "-" if index is None else str(index + 1)


def stage_sizes(rollout: Mapping[str, Any]) -> list[int] | None:
    """The devices each stage took, by the engine's rule (None: the spec cannot say)."""
    try:
        return plan_stage_sizes(parse_spec(rollout["spec"]), int(rollout["target_devices"]))
    except (SpecError, KeyError, TypeError, ValueError):
        return None


def _stage_state(rollout: Mapping[str, Any], index: int) -> str:
    status, current = str(rollout["status"]), int(rollout["stage"])
    if status == RolloutStatus.SUCCEEDED.value or index < current:
        return "passed"
    if index == current:
        return status
    return "-"


def _table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    cells = [[str(c) if c is not None else "-" for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    lines = ["  ".join(h.upper().ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines += [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells
    ]
    return lines


def render(
    rollout: Mapping[str, Any],
    *,
    devices: Mapping[str, Sequence[str]] | None = None,
    history: Sequence[Mapping[str, Any]] = (),
    now: datetime | None = None,
) -> list[str]:
    """The lines ``show`` and ``watch`` print: the header and reason, the stages (size, mode,
    bake, flags, gates, state), devices per phase (and the first few of each from ``devices``),
    the current stage's gate values, and ``history``. ``now`` adds the bake's time left."""
    r = rollout
    spec_stages = r["spec"].get("stages", [])
    lines = [
        f"rollout {r['id']}  {r['model']} {r['version']}  {r['status']}  stage "
        f"{stage_no(min(int(r['stage']), max(len(spec_stages) - 1, 0)))}/{r['stages']}  "
        f"{r['target_devices']} device(s)  by {r['created_by']} at {fmt_at(r['created_at'])}",
    ]
    if r.get("reason"):
        lines.append(f"reason: {r['reason']}")
    if r.get("bake_started_at") and r["status"] not in ENDED:
        lines.append(_bake_line(r, spec_stages, now))
    sizes: Sequence[int | None] = stage_sizes(r) or [None] * len(spec_stages)
    rows = []
    for i, (s, n) in enumerate(zip(spec_stages, sizes, strict=False)):
        size = str(s["count"]) if s.get("count") is not None else f"{s['percent']:g}%"
        rows.append([
            stage_no(i),
            size if n is None or s.get("count") is not None else f"{size} ({n})",
            s.get("mode", "switch") + (f" {s['weight']:g}" if s.get("mode") == "canary" else ""),
            fmt_seconds(float(s.get("bake_s", _STAGE_DEFAULT.bake_s))),
            ",".join(f for f in ("prefetch", "approval") if s.get(f)) or "-",
            " ".join(gate_text(g) for g in s.get("gates", [])) or "-",
            _stage_state(r, i),
        ])  # fmt: skip
    lines += ["", *_table(["stage", "size", "mode", "bake", "flags", "gates", "state"], rows)]
    counts = {p: n for p, n in r.get("devices", {}).items() if n}
    phases = sorted(counts, key=lambda p: PHASES.index(p) if p in PHASES else len(PHASES))
    lines += ["", "devices: " + (", ".join(f"{counts[p]} {p}" for p in phases) or "none")]
    for phase in phases:
        named = list((devices or {}).get(phase, ()))
        if named:
            more = f" (+{counts[phase] - len(named)} more)" if counts[phase] > len(named) else ""
            lines.append(f"  {phase}: {' '.join(named)}{more}")
    if r.get("gates"):
        lines += ["", f"gates of stage {stage_no(int(r['stage']))}:"]
        lines += _table(
            ["metric", "verdict", "value", "threshold", "devices", "requests", "reason"],
            [_gate_row(g) for g in r["gates"]],
        )
    if history:
        lines += ["", "history:", *(history_line(e) for e in history)]
    return lines


def _gate_row(g: Mapping[str, Any]) -> list[object]:
    verdict = g["verdict"] + (" (dry run)" if g["dry_run"] else "")
    value, threshold = fmt_value(g["value"]), f"{g['threshold']:g}"
    return [g["metric"], verdict, value, threshold, g["devices"], g["requests"], g["reason"]]


def _bake_line(
    r: Mapping[str, Any], stages: Sequence[Mapping[str, Any]], now: datetime | None
) -> str:
    line = f"baking since {fmt_at(r['bake_started_at'])}"
    stage = int(r["stage"])
    if stage >= len(stages):
        return line
    bake_s = float(stages[stage].get("bake_s", _STAGE_DEFAULT.bake_s))
    line += f" for {fmt_seconds(bake_s)}"
    if now is not None:
        started = datetime.fromisoformat(str(r["bake_started_at"]).replace("Z", "+00:00"))
        left = bake_s - (now - started).total_seconds()
        minutes, seconds = divmod(math.ceil(left), 60)
        more = f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"
        line += f" ({more} left)" if left > 0 else " (over)"
    return line


def history_line(event: Mapping[str, Any]) -> str:
    return (
        f"{fmt_at(event['at'])}  {event['kind']:<18}  stage {stage_no(event['stage']):<3} "
        f"{event['actor']}: {event['reason']}"
    )


def _rollout_path(rollout_id: int, tail: str = "") -> str:
    return f"/api/v1/rollouts/{rollout_id}" + (f"/{tail}" if tail else "")


def all_events(client: ApiClient, rollout_id: int, after_id: int = 0) -> list[dict[str, Any]]:
    """Every history entry after ``after_id``, oldest first (page by page)."""
    events: list[dict[str, Any]] = []
    while True:
        page = client.call(
            "GET",
            _rollout_path(rollout_id, "events"),
            params=[("after_id", str(after_id)), ("limit", "1000")],
        )["items"]
        events += page
        if len(page) < 1000:
            return events
        after_id = int(page[-1]["id"])


def first_devices(
    client: ApiClient, rollout_id: int, counts: Mapping[str, int], per_phase: int
) -> dict[str, list[str]]:
    """The first ``per_phase`` devices (by stage, then id) of each phase that has any."""
    return {
        phase: [
            d["device_id"]
            for d in client.call(
                "GET",
                _rollout_path(rollout_id, "devices"),
                params=[("phase", phase), ("limit", str(per_phase))],
            )["items"]
        ]
        for phase, n in counts.items()
        if n and phase in PHASES
    }


def _echo(lines: Sequence[str]) -> None:
    click.echo("\n".join(lines))


# ---------------------------------------------------------------------------- commands
@click.group()
def rollouts() -> None:
    """Staged rollouts of a model version, gated on what the devices measure."""


CREATE_HELP = (
    "Start a staged rollout of VERSION of MODEL over the selected devices.\n\n"
    "Stage sizes are counts or percents of the target; `rest` (last) takes what remains. "
    "Quote a --stage that holds < or >. Without --stage (and --file) the stages are:\n\n\b\n"
    + "\n".join(f"  --stage '{s}'" for s in DEFAULT_STAGES)
)


@rollouts.command("create", help=CREATE_HELP)
@api_options
@click.argument("model", required=False)
@click.argument("version", required=False)
@click.option("--device", "devices", multiple=True, help="A device by id; repeatable.")
@click.option("--group", help="Accepted devices of this group.")
@click.option("--label", "labels", multiple=True, metavar="K=V", help="Repeatable; all must hold.")
@click.option(
    "--profile",
    "profiles",
    multiple=True,
    cls=CommandLineOnly,
    help="Devices of this profile; repeatable.",
)
@click.option(
    "--stage",
    "stage_flags",
    multiple=True,
    metavar="SPEC",
    help="One stage, in order: SIZE[:OPTION]..., SIZE N, P% or rest; OPTIONs switch|canary|"
    "shadow, weight=F, bake=10m, prefetch, approval, gate=METRIC<T[,min_devices=N]"
    "[,min_requests=N][,on_fail=pause][,dry_run] (agreement takes >); repeatable.",
)
@click.option(
    "--rate", metavar="N/min", help="Devices told to move per minute (default: no limit)."
)
@click.option(
    "--rate-growth",
    type=float,
    metavar="F",
    help="The rate limit's factor per stage (stage i allows rate * F**i; default 1).",
)
@click.option(
    "--device-timeout",
    metavar="DURATION",
    help="A device not settled (or still offline) this long is skipped (default 10m).",
)
@click.option(
    "--file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="The whole spec (.toml or .json, the REST body's shape); flags given override it.",
)
@click.option("--print-spec", is_flag=True, help="Print the request body and send nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print the created rollout as JSON.")
def create(
    server: str,
    token: str | None,
    model: str | None,
    version: str | None,
    devices: tuple[str, ...],
    group: str | None,
    labels: tuple[str, ...],
    profiles: tuple[str, ...],
    stage_flags: tuple[str, ...],
    rate: str | None,
    rate_growth: float | None,
    device_timeout: str | None,
    file: Path | None,
    print_spec: bool,
    as_json: bool,
) -> None:
    """Start a staged rollout (the help is :data:`CREATE_HELP`)."""
    if version is None and model is not None and file is None:
        raise click.UsageError("give MODEL and VERSION")
    target: dict[str, Any] = {}
    if devices:
        target["devices"] = list(devices)
    if group:
        target["group"] = group
    if labels:
        target["labels"] = parse_labels(labels)
    if profiles:
        target["profiles"] = list(profiles)
    try:
        timeout_s = parse_seconds(device_timeout) if device_timeout is not None else None
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--device-timeout") from None
    body = build_spec(
        model=model,
        version=version,
        target=target,
        stage_flags=stage_flags,
        rate=parse_rate(rate) if rate is not None else None,
        rate_growth=rate_growth,
        device_timeout_s=timeout_s,
        file=file,
    )
    if print_spec:
        print_json(body)
        return
    answer = ApiClient(server, token).call("POST", "/api/v1/rollouts", body=body)["rollout"]
    if as_json:
        print_json(answer)
        return
    _echo(render(answer))
    click.echo(f"watch it: mcp-controlplane rollouts watch {answer['id']}", err=True)


@rollouts.command("list")
@api_options
@click.option("--model", help="Only this model.")
@click.option(
    "--status",
    type=click.Choice([*STATUSES, "active"]),
    help="Only this status, or active: not ended.",
)
@click.option("--limit", type=click.IntRange(1, 1000), default=50, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def list_rollouts(
    server: str, token: str | None, model: str | None, status: str | None, limit: int,
    as_json: bool,
) -> None:  # fmt: skip
    """Rollouts, newest first."""
    params = [("limit", str(limit))]
    params += [("model", model)] if model else []
    params += [("status", status)] if status else []
    items = ApiClient(server, token).call("GET", "/api/v1/rollouts", params=params)["items"]
    if as_json:
        print_json(items)
        return
    print_table(
        ["id", "model", "version", "status", "stage", "active", "devices", "by", "created",
         "reason"],
        [
            [r["id"], r["model"], r["version"], r["status"],
             f"{stage_no(min(int(r['stage']), int(r['stages']) - 1))}/{r['stages']}",
             r["devices"].get("active", 0), r["target_devices"], r["created_by"],
             fmt_at(r["created_at"]), r["reason"][:60]]
            for r in items
        ],
    )  # fmt: skip


@rollouts.command("show")
@api_options
@click.argument("rollout_id", type=click.IntRange(1))
@click.option("--json", "as_json", is_flag=True)
def show(server: str, token: str | None, rollout_id: int, as_json: bool) -> None:
    """A rollout: stages and their sizes, devices per phase, the gates' values, its reason."""
    client = ApiClient(server, token)
    rollout = client.call("GET", _rollout_path(rollout_id))["rollout"]
    if as_json:
        print_json(rollout)
        return
    named = first_devices(client, rollout_id, rollout["devices"], WATCH_DEVICES)
    _echo(render(rollout, devices=named))


@rollouts.command("devices")
@api_options
@click.argument("rollout_id", type=click.IntRange(1))
@click.option("--phase", type=click.Choice(PHASES), help="Only devices in this phase.")
@click.option("--limit", type=click.IntRange(1, 10_000), default=1000, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def devices_cmd(
    server: str, token: str | None, rollout_id: int, phase: str | None, limit: int,
    as_json: bool,
) -> None:  # fmt: skip
    """Where each device of a rollout stands, by stage then id."""
    params = [("limit", str(limit))] + ([("phase", phase)] if phase else [])
    answer = ApiClient(server, token).call(
        "GET", _rollout_path(rollout_id, "devices"), params=params
    )
    if as_json:
        print_json(answer)
        return
    print_table(
        ["device", "stage", "phase", "since", "told", "from", "mode", "moves"],
        [
            [d["device_id"], stage_no(d["stage"]), d["phase"], fmt_at(d["since"]),
             fmt_at(d["told_at"]), d["from_version"] or "-", d["mode"] or "-", d["moves"]]
            for d in answer["items"]
        ],
    )  # fmt: skip
    if answer["total"] > len(answer["items"]):
        click.echo(f"{len(answer['items'])} of {answer['total']} device(s) shown", err=True)


@rollouts.command("history")
@api_options
@click.argument("rollout_id", type=click.IntRange(1))
@click.option("--json", "as_json", is_flag=True)
def history(server: str, token: str | None, rollout_id: int, as_json: bool) -> None:
    """A rollout's history, oldest first: every decision and operator action."""
    events = all_events(ApiClient(server, token), rollout_id)
    if as_json:
        print_json(events)
        return
    print_table(
        ["at", "kind", "stage", "actor", "reason"],
        [[fmt_at(e["at"]), e["kind"], stage_no(e["stage"]), e["actor"], e["reason"]]
         for e in events],
    )  # fmt: skip


def _commander(op: str) -> click.Command:
    @api_options
    @click.argument("rollout_id", type=click.IntRange(1))
    @click.option("--reason", default="", help="Why, for the history and the audit log.")
    @click.option("--json", "as_json", is_flag=True)
    def command(
        server: str, token: str | None, rollout_id: int, reason: str, as_json: bool
    ) -> None:
        answer = ApiClient(server, token).call(
            "POST", _rollout_path(rollout_id, op), body={"reason": reason}
        )["rollout"]
        if as_json:
            print_json(answer)
            return
        click.echo(f"rollout {answer['id']}: {answer['status']}: {answer['reason'] or op}")

    return click.command(op, help=COMMAND_HELP[op])(command)


for _op in COMMAND_HELP:
    rollouts.add_command(_commander(_op))


# ---------------------------------------------------------------------------- watch
class Watcher:
    """Polls one rollout and prints its screen until it ends (see :func:`watch`)."""

    def __init__(self, client: ApiClient, rollout_id: int, *, live: bool) -> None:
        self.client = client
        self.rollout_id = rollout_id
        self.live = live
        self.history: list[dict[str, Any]] = []
        self.printed: list[str] | None = None

    def poll(self) -> dict[str, Any]:
        """Read the rollout, then what is new in its history, and print the screen: redrawn
        each time when ``live``, else a new block when anything changed. Returns the rollout."""
        rollout: dict[str, Any] = self.client.call("GET", _rollout_path(self.rollout_id))["rollout"]
        after = int(self.history[-1]["id"]) if self.history else 0
        new = all_events(self.client, self.rollout_id, after)
        self.history += new
        named = first_devices(self.client, self.rollout_id, rollout["devices"], WATCH_DEVICES)
        if self.live:
            now = datetime.now(timezone.utc)
            lines = render(rollout, devices=named, history=self.history[-WATCH_HISTORY:], now=now)
            click.echo(CLEAR + "\n".join(lines))
            return rollout
        core = render(rollout, devices=named)
        if self.printed is None or core != self.printed or new:
            shown = self.history[-WATCH_HISTORY:] if self.printed is None else new
            lines = render(rollout, devices=named, history=shown)
            click.echo(("\n" if self.printed is not None else "") + "\n".join(lines))
            self.printed = core
        return rollout


@rollouts.command("watch")
@api_options
@click.argument("rollout_id", type=click.IntRange(1))
@click.option("--interval", default="1s", show_default=True, help="Time between polls.")
def watch(server: str, token: str | None, rollout_id: int, interval: str) -> None:
    """Follow a rollout until it ends: stages, devices per phase, gates, new history.

    On a terminal the screen is redrawn each poll; otherwise a new block is printed whenever
    something changed. Exits 0 when the rollout succeeded, 1 when it was rolled back or
    aborted (or the server stayed unreachable), 130 on Ctrl-C.
    """
    try:
        interval_s = parse_seconds(interval)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--interval") from None
    if not 0.1 <= interval_s <= 3600:
        raise click.BadParameter("use 0.1s to 1h", param_hint="--interval")
    watcher = Watcher(ApiClient(server, token), rollout_id, live=sys.stdout.isatty())
    failures = 0
    try:
        rollout = watcher.poll()  # a first failure (no such rollout, bad token) ends the watch
        while rollout["status"] not in ENDED:
            time.sleep(interval_s)
            try:
                rollout = watcher.poll()
                failures = 0
            except click.ClickException as e:
                failures += 1
                if failures >= WATCH_FAILURES:
                    raise
                click.echo(f"watch: {e.format_message()}; trying again", err=True)
    except KeyboardInterrupt:
        click.echo("", err=True)
        raise SystemExit(130) from None
    click.echo(f"rollout {rollout['id']} {rollout['status']}: {rollout['reason']}")
    raise SystemExit(0 if rollout["status"] == RolloutStatus.SUCCEEDED.value else 1)


COMMANDS = [rollouts]
