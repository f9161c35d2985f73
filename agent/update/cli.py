"""``mcp-agent updates``: what the update agent has installed and where each deployment stands."""

from __future__ import annotations

import json
from pathlib import Path

import click


@click.command("updates")
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="The agent's state directory (default: /var/lib/mcp-agent).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the full state as JSON.")
def updates_command(state_dir: Path | None, as_json: bool) -> None:
    """Show installed model versions and the last deployment of each model.

    \b
    Example:
      mcp-agent updates --state-dir /var/lib/mcp-agent
    """
    from mcp_edge.agent.serving.serve import default_state_dir
    from mcp_edge.agent.update.store import ModelStore
    from mcp_edge.agent.update.updater import updates_status

    status = updates_status(ModelStore(state_dir or default_state_dir()))
    if as_json:
        click.echo(json.dumps(status, indent=2))
        return
    if not status["models"]:
        click.echo("no models installed by the update agent")
        return
    for name, m in status["models"].items():
        index, record = m["index"], m["record"]
        canary = index["canary"]["version"] if index["canary"] else "-"
        click.echo(f"{name}: active {index['active'] or '-'}  previous {index['previous'] or '-'}"
                   f"  canary {canary}  shadow {index['shadow'] or '-'}"
                   f"  prefetched {index.get('prefetch') or '-'}"
                   f"  installed {', '.join(m['installed']) or '-'}")  # fmt: skip
        for what, rec in (("deployment", record), ("prefetch", m["prefetch_record"])):
            if rec is None:
                continue
            phase = "stored" if rec["role"] == "prefetch" and rec["phase"] == "idle" \
                else rec["phase"]  # fmt: skip
            line = (f"  last {what}: {rec['to_version']} as {rec['role']} "
                    f"(seq {rec['desired_seq']}): {phase}")  # fmt: skip
            if rec["cause"]:
                line += f" [{rec['cause']}] {rec['error'] or ''}"
            click.echo(line)
