"""The data dir the local commands (``init``, ``serve``, ``keys``) work on, and the one place
they turn flags, environment and ``<data dir>/controlplane.toml`` into
:class:`~controlplane.settings.Settings`."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from mcp_edge.controlplane.settings import Settings, SettingsError, environment, load_settings

F = TypeVar("F", bound=Callable[..., Any])


def default_data_dir() -> Path:
    """``/var/lib/mcp-controlplane`` for root, else ``$XDG_DATA_HOME/mcp-controlplane``."""
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        return Path("/var/lib/mcp-controlplane")
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "mcp-controlplane"


def cli_settings(data_dir: Path | None, **overrides: object) -> Settings:
    """The settings of ``data_dir`` (None: :func:`default_data_dir`) with the process
    environment and ``overrides`` (None values ignored) on top; raises
    :class:`click.ClickException` naming what is wrong."""
    try:
        return load_settings(
            data_dir or default_data_dir(), environ=environment(), overrides=overrides
        )
    except SettingsError as e:
        raise click.ClickException(str(e)) from e


def data_dir_option(help_text: str) -> Callable[[F], F]:
    """``--data-dir`` (env ``MCP_DATA_DIR``), passed as ``data_dir``: a Path or None."""

    def decorate(func: F) -> F:
        return click.option(
            "--data-dir",
            type=click.Path(file_okay=False, path_type=Path),
            envvar="MCP_DATA_DIR",
            show_envvar=True,
            help=help_text,
        )(func)

    return decorate
