"""The agent's configuration file: a TOML file of option values for ``mcp-agent run``.

Every option of the command can be set there, the key being the option's name with
underscores (``--max-batch-size 8`` is ``max_batch_size = 8``, ``--trust-key`` is
``trust_key = ["a.pub", "b.pub"]``, a flag is ``true``/``false``). A value given on the command
line wins over the option's ``MCP_*`` environment variable, which wins over the file, which wins
over the built-in default: the file's values become the command's ``default_map``, which click
consults after the command line and the environment.

The file is ``/etc/mcp-agent/agent.toml`` when it exists, or the one ``--config PATH`` (or
``MCP_CONFIG``) names, which must exist. It is checked before the command runs: a key that is
not an option, a value of the wrong TOML type or out of the option's range, a file over
:data:`MAX_CONFIG_BYTES` or not valid TOML is an error naming the file and the key. Relative
paths in it are relative to the file's directory.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from datetime import date, datetime, time
from pathlib import Path
from typing import Any, TypeVar

import click

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

F = TypeVar("F", bound=Callable[..., Any])

DEFAULT_CONFIG_PATH = Path("/etc/mcp-agent/agent.toml")
MAX_CONFIG_BYTES = 256 * 1024
CONFIG_ENV = "MCP_CONFIG"


class ConfigError(click.ClickException):
    """The configuration file cannot be used (exit status 2, as for a usage error)."""

    exit_code = 2
    code = "config"


def option_key(param: click.Option) -> str:
    """The configuration key of an option: its longest flag with underscores (the flag its
    ``MCP_*`` variable is named after)."""
    flags = [o for o in param.opts if o.startswith("--")] or list(param.opts)
    return max(flags, key=len).lstrip("-").replace("-", "_")


def settable_options(command: click.Command) -> dict[str, click.Option]:
    """The options of ``command`` a configuration file may set, by key."""
    return {
        option_key(p): p
        for p in command.params
        if isinstance(p, click.Option) and p.expose_value and not p.hidden and p.name
    }


def _toml_type(value: object) -> str:
    kinds: list[tuple[type | tuple[type, ...], str]] = [
        (bool, "a boolean"),
        (int, "an integer"),
        (float, "a number"),
        (str, "a string"),
        (list, "an array"),
        (dict, "a table"),
        ((datetime, date, time), "a date or time"),
    ]
    return next((name for kind, name in kinds if isinstance(value, kind)), type(value).__name__)


def _expected(param: click.Option) -> tuple[Callable[[object], bool], str]:
    """What TOML value an option takes: a test and its description."""
    if param.is_flag and param.is_bool_flag:
        return (lambda v: isinstance(v, bool)), "true or false"
    if isinstance(param.type, click.types.IntParamType):
        return (lambda v: isinstance(v, int) and not isinstance(v, bool)), "an integer"
    if isinstance(param.type, click.types.FloatParamType):
        return (lambda v: isinstance(v, int | float) and not isinstance(v, bool)), "a number"
    return (lambda v: isinstance(v, str)), "a string"


def _value(
    param: click.Option, key: str, raw: object, base: Path, ctx: click.Context, where: str
) -> object:
    """One value of the file, checked as the option checks its own; paths made absolute."""
    fits, wanted = _expected(param)
    if not fits(raw):
        shown = "" if isinstance(raw, list | dict) else f" ({repr(raw)[:60]})"
        raise ConfigError(f"{where}: {key}: expected {wanted}, got {_toml_type(raw)}{shown}")
    if isinstance(param.type, click.Path) and isinstance(raw, str):
        raw = str(base / Path(raw).expanduser())
    try:
        param.type.convert(raw, param, ctx)
    except click.BadParameter as e:
        raise ConfigError(f"{where}: {key}: {e.message}") from None
    return raw


def config_defaults(
    command: click.Command, doc: Mapping[str, object], path: Path, ctx: click.Context
) -> dict[str, object]:
    """The parsed file ``doc`` checked against ``command``'s options, as a ``default_map``
    (keyed by parameter name). Raises :class:`ConfigError`."""
    options = settable_options(command)
    where = str(path)
    base = path.parent
    defaults: dict[str, object] = {}
    for key, raw in doc.items():
        param = options.get(key)
        if param is None or param.name is None:
            raise ConfigError(
                f"{where}: unknown key {key!r}; the keys are the options of "
                f"`{ctx.command_path}` with underscores: {', '.join(sorted(options))}"
            )
        if param.multiple:
            if not isinstance(raw, list):
                raise ConfigError(
                    f"{where}: {key}: expected an array ({key} = [...]), got {_toml_type(raw)}"
                )
            defaults[param.name] = [
                _value(param, f"{key}[{i}]", item, base, ctx, where) for i, item in enumerate(raw)
            ]
        else:
            defaults[param.name] = _value(param, key, raw, base, ctx, where)
    return defaults


def read_config(path: Path) -> dict[str, Any]:
    """The TOML document at ``path``. Raises :class:`ConfigError`."""
    try:
        with path.open("rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror or e}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: larger than {MAX_CONFIG_BYTES // 1024} KiB")
    try:
        return dict(tomllib.loads(data.decode("utf-8")))
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None


def config_option(default: Path = DEFAULT_CONFIG_PATH) -> Callable[[F], F]:
    """``--config PATH`` (``MCP_CONFIG``): read before the other options, the file's values
    become the defaults of the command's options. Without it, ``default`` is read when it
    exists."""

    def load(ctx: click.Context, param: click.Parameter, value: Path | None) -> None:
        if value is None:
            if not default.exists():
                return
            value = default
        doc = read_config(value)
        defaults = config_defaults(ctx.command, doc, value, ctx)
        ctx.default_map = {**(ctx.default_map or {}), **defaults}

    return click.option(
        "--config",
        "config_path",
        type=click.Path(dir_okay=False, path_type=Path),
        default=None,
        is_eager=True,
        expose_value=False,
        callback=load,
        envvar=CONFIG_ENV,
        show_envvar=True,
        metavar="PATH",
        help=f"TOML file of option values, keys named as the options with underscores "
        f"(default: {default} when it exists). The command line and the MCP_* variables "
        "override it.",
    )
