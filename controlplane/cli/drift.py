"""``mcp-controlplane drift ...``: data drift and retraining triggers from a shell
(docs/drift.md).

    mcp-controlplane drift show MODEL [--version V] [--device D] [--since 6h] [--limit N]
    mcp-controlplane drift rules get MODEL|*
    mcp-controlplane drift rules set MODEL|* [--threshold T] [--metric M] [--min-devices N]
                                     [--min-samples N] [--sustained N] [--cooldown 1h]
                                     [--window 5m] [--enable/--disable]
                                     [--hard-examples/--no-hard-examples]
    mcp-controlplane drift rules reset MODEL
    mcp-controlplane drift rules list
    mcp-controlplane drift triggers list [--model M] [--version V] [--status open|acknowledged]
    mcp-controlplane drift triggers show ID
    mcp-controlplane drift triggers ack ID [--note TEXT]

Everything goes through the REST API (``--server``/``--token`` or ``MCP_SERVER``/``MCP_TOKEN``);
every command takes ``--json`` for scripts. ``*`` names the default rule (quote it in a shell).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta, timezone
from typing import Any

import click

from mcp_edge.controlplane.cli.client import (
    ApiClient,
    api_options,
    fmt_time,
    print_json,
    print_table,
)
from mcp_edge.controlplane.cli.hard_examples import COMMANDS as EXAMPLES
from mcp_edge.controlplane.cli.rollout_spec import fmt_seconds, parse_seconds
from mcp_edge.controlplane.drift.rules import DEFAULT_MODEL, METRICS

RULE_SETTINGS = ("threshold", "metric", "min_devices", "min_samples", "sustained",
                 "cooldown_s", "window_s", "enabled", "collect_hard_examples")  # fmt: skip


def fmt_psi(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _rule_path(model: str) -> str:
    return (
        "/api/v1/drift/default-rule" if model == DEFAULT_MODEL else f"/api/v1/drift/rules/{model}"
    )


def rule_lines(rule: Mapping[str, Any]) -> list[str]:
    """What ``rules get`` and ``rules set`` print."""
    where = {"model": "its own rule", "default": "the default rule (*)",
             "builtin": "the built-in default (no rule stored)"}  # fmt: skip
    lines = [f"{rule['model']}: {where.get(rule['source'], rule['source'])}"]
    state = "enabled" if rule["enabled"] else "disabled"
    lines.append(
        f"  {state}: a trigger when {rule['metric']} > {rule['threshold']:g} in "
        f"{rule['sustained']} bucket(s) of {fmt_seconds(rule['window_s'])} in a row, each with "
        f">= {rule['min_samples']} samples from >= {rule['min_devices']} device(s); "
        f"at most one per {fmt_seconds(rule['cooldown_s'])}"
    )
    lines.append(f"  hard examples collected: {'yes' if rule['collect_hard_examples'] else 'no'}")
    if rule.get("updated_by"):
        lines.append(f"  set by {rule['updated_by']} at {fmt_time(rule['updated_at'])}")
    return lines


def trigger_lines(t: Mapping[str, Any]) -> list[str]:
    """What ``triggers show`` prints."""
    f, rule = t["figures"], t["rule"]
    lines = [
        f"trigger {t['id']}  {t['model']} {t['version']}  {t['status']}  raised "
        f"{fmt_time(t['raised_at'])}",
        f"  {rule.get('metric')} {fmt_psi(f.get('value'))} > {rule.get('threshold')} over "
        f"{rule.get('sustained')} bucket(s) of {fmt_seconds(rule.get('window_s') or 0)}; score "
        f"{fmt_psi(t['score'])} (input {fmt_psi(f.get('input_psi'))}, class "
        f"{fmt_psi(f.get('class_psi'))}, confidence {fmt_psi(f.get('confidence_psi'))}), "
        f"{f.get('samples', 0)} samples in the last bucket",
    ]
    top = f.get("top_features") or []
    if top:
        lines.append("  most drifted: " + ", ".join(f"{n} {v:.3f}" for n, v in top))
    more = t["device_count"] - len(t["device_ids"])
    lines.append(f"  {t['device_count']} device(s): {', '.join(t['device_ids'][:20])}"
                 + (f" (+{t['device_count'] - min(20, len(t['device_ids']))} more)"
                    if more > 0 or len(t["device_ids"]) > 20 else ""))  # fmt: skip
    if t["acknowledged_at"]:
        lines.append(f"  acknowledged by {t['acknowledged_by']} at "
                     f"{fmt_time(t['acknowledged_at'])}: {t['note'] or '-'}")  # fmt: skip
    return lines


@click.group()
def drift() -> None:
    """Data drift per model version and retraining triggers (docs/drift.md)."""


@drift.command("show")
@api_options
@click.argument("model")
@click.option("--version", help="Only this version.")
@click.option("--device", help="This device's reports instead of the fleet's buckets.")
@click.option("--since", default="6h", show_default=True,
              help="How far back (90s, 30m, 6h, 7d).")  # fmt: skip
@click.option("--limit", type=click.IntRange(1, 10_000), default=100, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def show(
    server: str, token: str | None, model: str, version: str | None, device: str | None,
    since: str, limit: int, as_json: bool,
) -> None:  # fmt: skip
    """A model's drift over time: per version and bucket, the PSI of the fleet's summed counts
    (or, with --device, that device's reports)."""
    start = datetime.now(timezone.utc) - timedelta(seconds=_duration(since, "--since") or 0)
    params = [("model", model), ("since", start.isoformat()), ("limit", str(limit))]
    params += [("version", version)] if version else []
    params += [("device", device)] if device else []
    answer = ApiClient(server, token).call("GET", "/api/v1/drift", params=params)
    if as_json:
        print_json(answer)
        return
    if device:
        print_table(
            ["received", "version", "role", "samples", "score", "input", "class", "confidence"],
            [[fmt_time(r["received_at"]), r["version"], r["role"], r["samples"],
              fmt_psi(r["score"]), fmt_psi(r["input_psi"]), fmt_psi(r["class_psi"]),
              fmt_psi(r["confidence_psi"])] for r in answer["reports"]],
        )  # fmt: skip
        return
    print_table(
        ["bucket", "version", "devices", "samples", "score", "input", "class", "confidence",
         "over", "most drifted"],
        [[fmt_time(b["bucket_start"]), b["version"], b["devices"], b["samples"],
          fmt_psi(b["score"]), fmt_psi(b["input_psi"]), fmt_psi(b["class_psi"]),
          fmt_psi(b["confidence_psi"]), "yes" if b["over"] else "",
          ", ".join(f"{n} {v:.2f}" for n, v in b["top_features"][:3])]
         for b in answer["buckets"]],
    )  # fmt: skip


# ---------------------------------------------------------------------------- rules
@drift.group("rules")
def rules() -> None:
    """When drift raises a retraining trigger: per model, or * for the default."""


@rules.command("list")
@api_options
@click.option("--json", "as_json", is_flag=True)
def list_rules(server: str, token: str | None, as_json: bool) -> None:
    """Every stored rule (models without one follow *, or the built-in default)."""
    items = ApiClient(server, token).call("GET", "/api/v1/drift/rules")["items"]
    if as_json:
        print_json(items)
        return
    print_table(
        ["model", "metric", "threshold", "min devices", "min samples", "sustained", "window",
         "cooldown", "enabled", "hard examples", "by"],
        [[r["model"], r["metric"], r["threshold"], r["min_devices"], r["min_samples"],
          r["sustained"], fmt_seconds(r["window_s"]), fmt_seconds(r["cooldown_s"]),
          "yes" if r["enabled"] else "no", "yes" if r["collect_hard_examples"] else "no",
          r["updated_by"]] for r in items],
    )  # fmt: skip


@rules.command("get")
@api_options
@click.argument("model")
@click.option("--json", "as_json", is_flag=True)
def get_rule(server: str, token: str | None, model: str, as_json: bool) -> None:
    """The rule in force for MODEL (* for the default rule)."""
    rule = ApiClient(server, token).call("GET", _rule_path(model))
    if as_json:
        print_json(rule)
        return
    for line in rule_lines(rule):
        click.echo(line)


def _duration(value: str | None, option: str) -> int | None:
    """Whole seconds of a duration option (None: not given); raises click.BadParameter."""
    if value is None:
        return None
    try:
        return round(parse_seconds(value))
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint=option) from e


@rules.command("set")
@api_options
@click.argument("model")
@click.option(
    "--threshold",
    type=click.FloatRange(0, 1000, min_open=True),
    help="A bucket is over when its metric is above this (PSI; 0.2 by default).",
)
@click.option(
    "--metric",
    type=click.Choice(METRICS),
    help="What is compared: input_psi (default: the mean of the input features' PSIs), "
    "score (the largest of input, class and confidence PSI), max_feature_psi, class_psi, "
    "confidence_psi.",
)
@click.option("--min-devices", type=click.IntRange(1), help="Devices a bucket needs.")
@click.option("--min-samples", type=click.IntRange(1), help="Samples a bucket needs.")
@click.option("--sustained", type=click.IntRange(1, 100), help="Buckets over in a row.")
@click.option("--cooldown", help="At most one trigger per this long (30m, 1h, 1d).")
@click.option("--window", help="Bucket length (60s, 5m).")
@click.option("--enable/--disable", "enabled", default=None, help="Raise triggers or not.")
@click.option(
    "--hard-examples/--no-hard-examples",
    "collect",
    default=None,
    help="Collect hard examples from a trigger's devices.",
)
@click.option("--json", "as_json", is_flag=True)
def set_rule(
    server: str, token: str | None, model: str, threshold: float | None, metric: str | None,
    min_devices: int | None, min_samples: int | None, sustained: int | None,
    cooldown: str | None, window: str | None, enabled: bool | None, collect: bool | None,
    as_json: bool,
) -> None:  # fmt: skip
    """Change MODEL's rule (* for the default); settings not given keep their values."""
    changes = {
        "threshold": threshold, "metric": metric, "min_devices": min_devices,
        "min_samples": min_samples, "sustained": sustained,
        "cooldown_s": _duration(cooldown, "--cooldown"), "window_s": _duration(window, "--window"),
        "enabled": enabled, "collect_hard_examples": collect,
    }  # fmt: skip
    body = {k: v for k, v in changes.items() if v is not None}
    if not body:
        raise click.UsageError("nothing to change: give at least one setting")
    rule = ApiClient(server, token).call("PUT", _rule_path(model), body=body)
    if as_json:
        print_json(rule)
        return
    for line in rule_lines(rule):
        click.echo(line)


@rules.command("reset")
@api_options
@click.argument("model")
@click.option("--json", "as_json", is_flag=True)
def reset_rule(server: str, token: str | None, model: str, as_json: bool) -> None:
    """Remove MODEL's own rule: the default applies again."""
    if model == DEFAULT_MODEL:
        raise click.UsageError("the default rule cannot be removed; change it with `rules set`")
    rule = ApiClient(server, token).call("DELETE", _rule_path(model))
    if as_json:
        print_json(rule)
        return
    for line in rule_lines(rule):
        click.echo(line)


# ---------------------------------------------------------------------------- triggers
@drift.group("triggers")
def triggers() -> None:
    """Retraining triggers: a model version's fleet drift stayed over its rule."""


@triggers.command("list")
@api_options
@click.option("--model", help="Only this model.")
@click.option("--version", help="Only this version.")
@click.option("--status", type=click.Choice(["open", "acknowledged"]))
@click.option("--limit", type=click.IntRange(1, 1000), default=50, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def list_triggers(
    server: str, token: str | None, model: str | None, version: str | None,
    status: str | None, limit: int, as_json: bool,
) -> None:  # fmt: skip
    """Retraining triggers, newest first."""
    params: list[tuple[str, str]] = [("limit", str(limit))]
    for key, value in (("model", model), ("version", version), ("status", status)):
        params += [(key, value)] if value else []
    items = ApiClient(server, token).call("GET", "/api/v1/drift/triggers", params=params)["items"]
    if as_json:
        print_json(items)
        return
    print_table(
        ["id", "model", "version", "raised", "status", "metric", "value", "devices"],
        [[t["id"], t["model"], t["version"], fmt_time(t["raised_at"]), t["status"],
          t["rule"].get("metric"), fmt_psi(t["figures"].get("value")), t["device_count"]]
         for t in items],
    )  # fmt: skip


def _echo(lines: Sequence[str]) -> None:
    for line in lines:
        click.echo(line)


@triggers.command("show")
@api_options
@click.argument("trigger_id", type=click.IntRange(1))
@click.option("--json", "as_json", is_flag=True)
def show_trigger(server: str, token: str | None, trigger_id: int, as_json: bool) -> None:
    """A trigger: the figures that raised it, the rule as applied, its devices."""
    trigger = ApiClient(server, token).call("GET", f"/api/v1/drift/triggers/{trigger_id}")
    if as_json:
        print_json(trigger["trigger"])
        return
    _echo(trigger_lines(trigger["trigger"]))


@triggers.command("ack")
@api_options
@click.argument("trigger_id", type=click.IntRange(1))
@click.option("--note", default="", help="What is being done about it.")
@click.option("--json", "as_json", is_flag=True)
def ack(server: str, token: str | None, trigger_id: int, note: str, as_json: bool) -> None:
    """Acknowledge a trigger (again: the note is replaced)."""
    answer = ApiClient(server, token).call(
        "POST", f"/api/v1/drift/triggers/{trigger_id}/acknowledge", body={"note": note}
    )
    if as_json:
        print_json(answer["trigger"])
        return
    _echo(trigger_lines(answer["trigger"]))


for _command in EXAMPLES:  # ``drift examples ...`` (docs/hard-examples.md)
    drift.add_command(_command)
COMMANDS = [drift]
