"""What the three command lines (``mcp-agent``, ``mcp-controlplane``, ``mcp-bundle``) share:
one error style, one way to configure logging, options readable from the environment.

- Errors: ``Error: …`` on stderr; exit 2 for a usage error (click's), 1 for a failure, 130
  when interrupted. With ``--json`` anywhere on the command line a failure is one JSON object
  on stderr instead: ``{"error": "...", "code": "..."}`` (``code`` from the exception's
  ``code`` attribute, else ``usage`` / ``failed`` / ``interrupted``).
- Logging: :func:`log_options` adds ``--log-level`` and ``--log-format text|json`` to a
  long-running command; :func:`setup_logging` applies them (JSON: one object per line with
  ``ts``, ``level``, ``logger``, ``message``).
- Environment: :func:`env_options` gives every option that has no variable of its own the
  variable ``MCP_<OPTION>`` (``--data-dir`` → ``MCP_DATA_DIR``, from the option's longest
  flag) and shows it in ``--help``; ``MCP_JSON=1`` turns on ``--json`` and with it the JSON
  error.
- :class:`StyledGroup`: a click group whose standalone ``main()`` (the console script's call,
  and click's test runner's) goes through :func:`run`, so both see the same errors.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, NoReturn, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])

LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts (UTC ISO 8601), level, logger, message, exc."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def setup_logging(level: str = "info", fmt: str = "text") -> None:
    """Configure the root logger on stderr (replacing earlier handlers)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    if level != "debug":  # Alembic narrates every plugin and context at INFO
        logging.getLogger("alembic").setLevel(logging.WARNING)


def log_options(f: F) -> F:
    """``--log-level`` and ``--log-format`` (``MCP_LOG_LEVEL``, ``MCP_LOG_FORMAT``)."""
    f = click.option(
        "--log-format",
        type=click.Choice(LOG_FORMATS),
        default="text",
        show_default=True,
        envvar="MCP_LOG_FORMAT",
        show_envvar=True,
        help="Log lines as text or as one JSON object per line.",
    )(f)
    f = click.option(
        "--log-level",
        type=click.Choice(LOG_LEVELS, case_sensitive=False),
        default="info",
        show_default=True,
        envvar="MCP_LOG_LEVEL",
        show_envvar=True,
        help="Least severe log level written to stderr.",
    )(f)
    return f


def env_name(option: click.Option, prefix: str = "MCP") -> str | None:
    """``MCP_`` and the option's longest flag (``--json`` → ``MCP_JSON``, whatever the
    parameter is called); None for options that pass no value (``--help``, ``--version``) and
    those without a long flag."""
    if not option.name or not option.expose_value:
        return None
    flags = [f for f in option.opts if f.startswith("--")]
    if not flags:
        return None
    flag = max(flags, key=len)[2:]
    return f"{prefix}_{flag.replace('-', '_').upper()}"


class _Json:
    """Whether this run asked for JSON: ``--json`` on the command line or from ``MCP_JSON``
    (set by the option's callback once click parsed it)."""

    wanted = False


def _note_json(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    if value:
        _Json.wanted = True
    return value


def _noting_json(
    callback: Callable[[click.Context, click.Parameter, Any], Any] | None,
) -> Callable[[click.Context, click.Parameter, Any], Any]:
    """``callback`` (if any) after :func:`_note_json`."""
    if callback is None or callback is _note_json or getattr(callback, "notes_json", False):
        return callback or _note_json

    def both(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
        return callback(ctx, param, _note_json(ctx, param, value))

    both.notes_json = True  # type: ignore[attr-defined]
    return both


class CommandLineOnly(click.Option):
    """An option :func:`env_options` gives no environment variable: a filter or selector that a
    variable meant for another program must not narrow silently (the control plane's
    ``--profile`` would otherwise read ``MCP_PROFILE``, the agent's hardware profile, and a
    rollout or a device list on a host that runs an agent would cover one profile only)."""


def env_options(command: click.Command, prefix: str = "MCP") -> None:
    """Give every option under ``command`` an environment variable, shown in its help (not
    :class:`CommandLineOnly` ones)."""
    for param in command.params:
        if isinstance(param, click.Option) and not param.hidden:
            if param.envvar is None and not isinstance(param, CommandLineOnly):
                param.envvar = env_name(param, prefix)
            if param.envvar is not None:
                param.show_envvar = True
            if "--json" in param.opts:
                param.callback = _noting_json(param.callback)
    if isinstance(command, click.Group):
        for sub in command.commands.values():
            env_options(sub, prefix)


def _fail(message: str, code: str, status: int, as_json: bool) -> NoReturn:
    if as_json:
        click.echo(json.dumps({"error": message, "code": code}), err=True)
    else:
        click.echo(f"Error: {message}", err=True)
    sys.exit(status)


def run(
    command: click.Command,
    prog_name: str,
    *,
    failures: tuple[type[BaseException], ...] = (),
    argv: Sequence[str] | None = None,
) -> NoReturn:
    """Run ``command`` as ``prog_name`` in the house error style; ``failures`` are exception
    types printed as one line (exit 1) rather than with a traceback."""
    args = list(sys.argv[1:] if argv is None else argv)
    _Json.wanted = "--json" in args

    def as_json() -> bool:
        return _Json.wanted

    try:
        # Outside standalone mode click answers ``ctx.exit(n)`` (and --help, --version) by
        # returning n; a command that returns an int means the same.
        result = command.main(args=args, prog_name=prog_name, standalone_mode=False)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.exceptions.Abort:
        _fail("interrupted", "interrupted", 130, as_json())
    except KeyboardInterrupt:
        _fail("interrupted", "interrupted", 130, as_json())
    except click.exceptions.NoArgsIsHelpError as e:  # a group run without a command
        click.echo(e.format_message(), err=True)
        sys.exit(e.exit_code)
    except click.UsageError as e:
        if not as_json() and e.ctx is not None:
            click.echo(e.ctx.get_usage(), err=True)
            click.echo(f"Try '{e.ctx.command_path} --help' for help.\n", err=True)
        _fail(e.format_message(), "usage", 2, as_json())
    except click.ClickException as e:
        code = getattr(e, "code", None) or "failed"
        _fail(e.format_message(), str(code), e.exit_code, as_json())
    except failures as e:
        _fail(str(e) or type(e).__name__, str(getattr(e, "code", None) or "failed"), 1, as_json())
    sys.exit(result if isinstance(result, int) and not isinstance(result, bool) else 0)


class StyledGroup(click.Group):
    """A click group run in the house style: its standalone ``main()`` goes through
    :func:`run` with the class's ``prog`` and ``failures``. A subclass sets them::

        class Cli(StyledGroup):
            prog = "mcp-controlplane"
            failures = (McpError,)

        @click.group(cls=Cli)
        def main() -> None: ...
    """

    prog: ClassVar[str] = ""
    failures: ClassVar[tuple[type[BaseException], ...]] = ()

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        run(self, prog_name or self.prog or self.name or "", failures=self.failures, argv=args)
