"""``mcp-agent``: the device-side command line.

Errors follow the house style (:mod:`mcp_edge.shared.cli_style`): one ``Error: ...`` line on
stderr, exit 2 for a usage error, 1 for a failure (an :class:`McpError` or an OSError, shown
without a traceback), 130 when interrupted; with ``--json`` one ``{"error", "code"}`` object.
Every option can also be set with its ``MCP_<OPTION>`` environment variable.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from mcp_edge.agent import __version__
from mcp_edge.agent.enroll_cli import enroll_command
from mcp_edge.agent.fleet.cli import infer_command
from mcp_edge.agent.run import run_command
from mcp_edge.agent.serving.serve import serve_command
from mcp_edge.agent.update.cli import updates_command
from mcp_edge.shared import cli_style
from mcp_edge.shared.errors import McpError
from mcp_edge.shared.profiles import HardwareProfile, load_profiles

if TYPE_CHECKING:
    from mcp_edge.agent.runtime.loader import BackendChoice

FAILURES = (McpError, OSError)
"""What a command may fail with as a matter of course: shown in one line, exit status 1."""


class Failure(click.ClickException):
    """An expected failure as one line, with the code ``--json`` reports."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(" ".join(message.split()))
        self.code = code


def failure(e: BaseException) -> Failure:
    """``e`` as one line: an OSError as ``FILE: reason``; the code is the exception's ``code``
    attribute, else its class name in snake case (``IdentityError`` → ``identity``)."""
    if isinstance(e, OSError) and e.strerror:
        message = f"{e.filename}: {e.strerror}" if e.filename else e.strerror
    else:
        message = str(e) or type(e).__name__
    code = getattr(e, "code", None)
    if not isinstance(code, str):
        name = re.sub(r"(?<!^)(?=[A-Z])", "_", type(e).__name__).lower()
        code = name.removesuffix("_error") or "failed"
    return Failure(message, code)


class AgentGroup(cli_style.StyledGroup):
    """Run in the house style; expected failures become one-line errors with a code."""

    prog = "mcp-agent"
    failures = FAILURES

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except FAILURES as e:
            raise failure(e) from e


@click.group(cls=AgentGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="mcp-agent")
def main() -> None:
    """MCP Edge device agent.

    Every option can also be set by the environment variable shown beside it in a command's
    --help (MCP_ and the option's name: --state-dir is MCP_STATE_DIR); `mcp-agent run` also
    reads /etc/mcp-agent/agent.toml (or --config FILE).
    """


@main.command("profiles")
@click.option("--json", "as_json", is_flag=True, help="Print the profiles as JSON.")
def profiles_cmd(as_json: bool) -> None:
    """List the hardware profiles this agent ships with and their backend order."""
    profiles = load_profiles()
    if as_json:
        click.echo(json.dumps({n: p.to_dict() for n, p in profiles.items()}, indent=2))
        return
    width = max(len(n) for n in profiles)
    for name, p in profiles.items():
        order = " -> ".join(
            f"{b.provider if b.name == 'onnxruntime' else f'{b.name}/{b.provider}'}"
            f"{' (opt-in)' if b.opt_in else ''}"
            for b in p.runtime.backends
        )
        click.echo(f"{name:<{width}}  {order}")
        click.echo(f"{'':<{width}}  {p.description}")


@main.command("doctor")
@click.option(
    "--profile",
    "profile_name",
    metavar="NAME",
    help="Use this profile instead of the detected one (see `mcp-agent profiles`).",
)
@click.option(
    "--backend",
    metavar="NAME",
    help="Show the order with this backend tried first: a runtime (onnxruntime, openvino, "
    "tflite) or an onnxruntime provider (cpu, cuda, tensorrt, coreml, openvino-ep, xnnpack, "
    "...); opt-in ones are only used when named here.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
@click.option(
    "--root",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("/"),
    hidden=True,
    help="Read /proc, /etc and /dev under this directory (tests).",
)
@click.option("--system", hidden=True, help="Pretend platform.system() is this (tests).")
@click.option("--machine", hidden=True, help="Pretend platform.machine() is this (tests).")
def doctor_cmd(
    profile_name: str | None,
    backend: str | None,
    as_json: bool,
    root: Path,
    system: str | None,
    machine: str | None,
) -> None:
    """Show what this box is, which hardware profile fits it and why, and which backends load.

    Exits 0 after a full report, 1 when no profile fits this box (pass --profile), and 2 for an
    unknown --profile or --backend name.
    """
    from mcp_edge.agent.hardware import (
        NoProfileError,
        UnknownProfileError,
        collect_facts,
        select_profile,
    )
    from mcp_edge.agent.runtime.loader import available_backends  # imports onnxruntime: only here

    profiles = load_profiles()
    facts = collect_facts(root, system=system, machine=machine)
    report: dict[str, Any] = {"facts": facts.to_dict(), "backend_requested": backend}
    try:
        choice = select_profile(facts, profiles, override=profile_name)
    except UnknownProfileError as e:
        raise click.BadParameter(str(e), param_hint="'--profile'") from e
    except NoProfileError as e:
        report.update(profile=None, error=str(e), reasons=[], rejected=e.rejected)
    else:
        report.update(choice.to_dict())
        report.update(_backend_plan(choice.profile, backend))
    report["available"] = available_backends()
    noted = sorted({f for p in profiles.values() for f in p.detect.cpu_flags_noted})
    click.echo(json.dumps(report, indent=2) if as_json else _render_doctor(report, noted))
    if report["profile"] is None:
        raise SystemExit(1)


def _backend_plan(profile: HardwareProfile, backend: str | None) -> dict[str, Any]:
    """The profile's backends and the order the runtime loader tries them in for each format.

    Raises :class:`click.BadParameter` for a ``--backend`` name the loader does not know.
    """
    from mcp_edge.agent.runtime.loader import (
        PROVIDER_ALIASES,
        BackendChoice,
        backend_available,
        backend_order,
        check_backend_name,
    )
    from mcp_edge.agent.runtime.runner import BackendUnavailableError

    flag_of: dict[str, str] = {}
    for alias, provider in PROVIDER_ALIASES.items():
        flag_of.setdefault(provider, alias)
    usable: dict[str, bool] = {}

    def offered(choice: BackendChoice) -> bool | None:
        if choice.backend == "tflite":
            return None
        key = "openvino" if choice.backend == "openvino" else choice.provider
        if key not in usable:
            usable[key] = backend_available(key) is None
        return usable[key]

    try:
        if backend is not None:
            check_backend_name(backend)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="'--backend'") from e
    onnx: list[BackendChoice] | None = None
    if "onnx" in profile.runtime.formats:
        try:
            onnx = backend_order(profile, "onnx", backend)
        except BackendUnavailableError:
            onnx = None
    listed = [
        {
            "name": b.name,
            "provider": b.provider,
            "opt_in": b.opt_in,
            "flag": b.name if b.name != "onnxruntime" else flag_of.get(b.provider, b.provider),
            "offered_here": offered(BackendChoice(b.name, b.provider)),
        }
        for b in profile.runtime.backends
    ]
    return {
        "backends": listed,
        "onnx_order": [_step(c) for c in onnx] if onnx is not None else None,
        "onnx_would_use": next((_step(c) for c in onnx or [] if offered(c)), None),
        "tflite": _tflite_plan(profile, backend),
    }


def _step(choice: BackendChoice) -> str:
    """A step of the ``.onnx`` order: the provider for onnxruntime, ``openvino/DEVICE`` else."""
    return choice.provider if choice.backend == "onnxruntime" else choice.label


def _tflite_plan(profile: HardwareProfile, backend: str | None) -> str:
    """How a ``.tflite`` model would run, following the loader's order."""
    from mcp_edge.agent.runtime.loader import backend_order
    from mcp_edge.agent.runtime.runner import BackendUnavailableError

    if "tflite" not in profile.runtime.formats:
        return "profile does not run .tflite models"
    try:
        order = backend_order(profile, "tflite", backend)
    except BackendUnavailableError:
        return f"refused with --backend {backend} (use xnnpack or cpu)"
    xnnpack = order[0].provider.upper() == "XNNPACK"
    return "TFLite interpreter, XNNPACK delegate " + ("on" if xnnpack else "off")


def _section(title: str, rows: list[tuple[str, str]]) -> list[str]:
    width = max((len(k) for k, _ in rows), default=0)
    return [title, *(f"  {k:<{width}}  {v}".rstrip() for k, v in rows), ""]


def _render_doctor(report: dict[str, Any], noted_flags: list[str]) -> str:
    """The human form of a ``doctor`` report: aligned sections, ``-`` for unknown values."""
    f = report["facts"]
    flags = set(f["cpu_flags"])
    l4t = f"R{f['l4t_release']}.{f['l4t_revision'] or '?'}" if f["l4t_release"] else None
    host = [
        ("os", f["os"]),
        ("arch", f["arch"]),
        ("cpu model", f["cpu_model"]),
        ("cpu count", f["cpu_count"]),
        (
            "cpu flags",
            f"{len(flags)} flags; "
            + ", ".join(f"{n} {'yes' if n in flags else 'no'}" for n in noted_flags),
        ),
        ("memory", f"{f['mem_total_mb']} MiB" if f["mem_total_mb"] else None),
        ("device-tree model", f["device_tree_model"]),
        ("L4T", f"{l4t} (JetPack {f['jetpack'] or 'unknown'})" if l4t else None),
        ("gpu hints", "; ".join(f["gpu_hints"])),
        ("packages", ", ".join(f"{k} {v}" for k, v in f["packages"].items())),
    ]
    lines = _section("Host", [(k, str(v) if v not in (None, "") else "-") for k, v in host])
    if report["profile"] is None:
        lines += [f"Profile: none ({report['error']})", ""]
    else:
        how = "chosen by --profile" if report["overridden"] else "detected"
        lines += [
            f"Profile: {report['profile']} ({how})",
            *(f"  - {r}" for r in report["reasons"]),
            "",
        ]
    lines += _section("Not chosen", list(report["rejected"].items()))
    if report["profile"] is not None:
        lines += _render_backends(report)
    lines += _section("Loadable here", list(report["available"].items()))
    return "\n".join(lines).rstrip()


def _render_backends(report: dict[str, Any]) -> list[str]:
    requested = (report["backend_requested"] or "").lower()
    rows = []
    for i, b in enumerate(report["backends"], 1):
        marks = []
        if b["opt_in"]:
            marks.append(f"opt-in: --backend {b['flag']}")
        if b["offered_here"] is False:
            marks.append(
                "OpenVINO not usable here"
                if b["name"] == "openvino"
                else "not offered by this onnxruntime"
            )
        if requested and requested == b["flag"]:
            marks.append("asked for with --backend")
        note = f"  ({'; '.join(marks)})" if marks else ""
        rows.append(("profile lists" if i == 1 else "", f"{i}. {b['name']}/{b['provider']}{note}"))
    order = report["onnx_order"]
    if order is not None:
        rows.append((".onnx models", " -> ".join(order)))
        rows.append(("  would use", report["onnx_would_use"] or "none of them is offered here"))
    elif requested == "tflite":
        rows.append((".onnx models", "refused with --backend tflite"))
    else:
        rows.append((".onnx models", "profile does not run .onnx models"))
    rows.append((".tflite models", report["tflite"]))
    title = f"Backends of {report['profile']}" + (
        f" with --backend {report['backend_requested']}" if requested else ""
    )
    return _section(title, rows)


main.add_command(serve_command)
main.add_command(enroll_command)
main.add_command(run_command)
main.add_command(infer_command)
main.add_command(updates_command)
cli_style.env_options(main)


if __name__ == "__main__":
    main()
