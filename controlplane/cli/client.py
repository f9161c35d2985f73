"""The REST client behind ``mcp-controlplane users|tokens|devices|audit|login``.

Every failure becomes a :class:`click.ClickException` whose message is the server's own error
text (``{"error": ...}``) with the status, or says plainly that the server cannot be reached,
so the CLI never prints a traceback for a usage or network problem.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any, TypeVar

import aiohttp
import click
import orjson

DEFAULT_SERVER = "http://127.0.0.1:8080"
TIMEOUT_S = 30.0
F = TypeVar("F", bound=Callable[..., Any])


class ApiClient:
    """Calls ``{server}/api/v1/...`` with ``Authorization: Bearer {token}``."""

    def __init__(self, server: str, token: str | None) -> None:
        self.server = server.rstrip("/")
        self.token = token

    def call(
        self,
        method: str,
        path: str,
        *,
        body: Mapping[str, Any] | None = None,
        params: Sequence[tuple[str, str]] | None = None,
        auth: bool = True,
    ) -> Any:
        """Send one request and return the decoded JSON answer; raises ClickException."""
        if auth and not self.token:
            raise click.ClickException(
                "no API token: pass --token or set MCP_TOKEN (from `mcp-controlplane init` "
                "or `mcp-controlplane login`)"
            )
        return asyncio.run(self._call(method, path, body, params, auth))

    async def _call(
        self,
        method: str,
        path: str,
        body: Mapping[str, Any] | None,
        params: Sequence[tuple[str, str]] | None,
        auth: bool,
    ) -> Any:
        headers = {"Accept": "application/json"}
        if auth and self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        url = self.server + path
        data = orjson.dumps(body) if body is not None else None
        if data is not None:
            headers["Content-Type"] = "application/json"
        timeout = aiohttp.ClientTimeout(total=TIMEOUT_S)
        try:
            async with (
                aiohttp.ClientSession(timeout=timeout) as session,
                session.request(
                    method, url, data=data, params=list(params or []), headers=headers
                ) as response,
            ):
                raw = await response.read()
                status = response.status
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            raise click.ClickException(
                f"cannot reach {self.server}: {e or type(e).__name__}"
            ) from e
        try:
            answer = orjson.loads(raw) if raw else None
        except orjson.JSONDecodeError as e:
            raise click.ClickException(
                f"{method} {path}: HTTP {status}, and the answer is not JSON "
                f"(is {self.server} a control plane?)"
            ) from e
        if status >= 400:
            message = answer.get("error") if isinstance(answer, dict) else None
            raise click.ClickException(f"{message or 'request failed'} (HTTP {status})")
        return answer


def api_options(func: F) -> F:
    """Add ``--server`` / ``--token`` (env ``MCP_SERVER`` / ``MCP_TOKEN``) as ``client``."""
    func = click.option(
        "--token",
        envvar="MCP_TOKEN",
        show_envvar=True,
        help="API token (from `init` or `login`).",
    )(func)
    func = click.option(
        "--server",
        envvar="MCP_SERVER",
        show_envvar=True,
        default=DEFAULT_SERVER,
        show_default=True,
        help="Control plane base URL.",
    )(func)
    return func


_DURATION = re.compile(r"^(\d+)\s*([smhdw])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str) -> int | None:
    """``90s``, ``30m``, ``12h``, ``7d``, ``2w`` → seconds; ``never`` → None.

    Raises :class:`click.BadParameter`.
    """
    text = text.strip().lower()
    if text in ("never", "none", "0"):
        return None
    match = _DURATION.match(text)
    if match is None:
        raise click.BadParameter(f"{text!r}: use a number and a unit (s, m, h, d, w) or 'never'")
    return int(match.group(1)) * _UNIT_S[match.group(2)]


def parse_labels(items: Sequence[str]) -> dict[str, str]:
    """``["site=f1", "line=a,rack=3"]`` → a dict; raises :class:`click.BadParameter`."""
    labels: dict[str, str] = {}
    for item in items:
        for part in item.split(","):
            if not part.strip():
                continue
            key, sep, value = part.partition("=")
            if not sep or not key.strip():
                raise click.BadParameter(f"label {part!r} must be key=value")
            labels[key.strip()] = value.strip()
    return labels


def fmt_time(value: str | None) -> str:
    """An RFC 3339 answer field as ``YYYY-MM-DD HH:MM`` (UTC), or ``-``."""
    if not value:
        return "-"
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).strftime("%Y-%m-%d %H:%M")
    except ValueError:
        return value


def fmt_labels(labels: Mapping[str, str] | None) -> str:
    return ",".join(f"{k}={v}" for k, v in (labels or {}).items()) or "-"


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """Aligned columns on stdout (nothing but the header when there are no rows)."""
    cells = [[str(c) if c is not None else "-" for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    click.echo("  ".join(h.upper().ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip())
    for row in cells:
        click.echo("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


def print_json(value: Any) -> None:
    click.echo(orjson.dumps(value, option=orjson.OPT_INDENT_2).decode())
