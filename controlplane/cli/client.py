"""The REST client behind the ``mcp-controlplane`` commands that talk to a control plane.

Every failure becomes an :class:`ApiCallError` (a :class:`click.ClickException`): an answer
with an error status carries the server's own message with the status, and its ``code``
(``not_found``, ``forbidden``, ...); a server that cannot be reached says which URL and what
to check. So the CLI never prints a traceback for a usage or network problem, and under
``--json`` the error object carries the API's code.
"""

from __future__ import annotations

import asyncio
import errno
import re
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from datetime import datetime
from typing import Any, TypeVar

import aiohttp
import click
import orjson

from mcp_edge.shared.cli_style import setup_logging

DEFAULT_SERVER = "http://127.0.0.1:8080"
TIMEOUT_S = 30.0
MAX_ANSWER_BYTES = 64 * 1024 * 1024
F = TypeVar("F", bound=Callable[..., Any])
_CHECK = "check that `mcp-controlplane serve` runs there and that --server (MCP_SERVER) names it"


class ApiCallError(click.ClickException):
    """A request that did not succeed. ``code`` is the API's error code (``not_found``, ...)
    or ``unreachable`` / ``bad_answer`` / ``no_token`` / ``usage``; ``status`` the HTTP
    status, if any."""

    def __init__(self, message: str, *, code: str, status: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.status = status


class ServerUrlError(ApiCallError):
    """``--server`` is not a URL: a usage error (exit 2)."""

    exit_code = 2


def _unreachable(server: str, e: BaseException) -> ApiCallError:
    """What to tell a user whose request never got an answer."""
    if isinstance(e, asyncio.TimeoutError):
        why = f"no answer within {TIMEOUT_S:.0f} s; {_CHECK}"
    elif isinstance(e, aiohttp.InvalidURL):
        return ServerUrlError(
            f"--server {server!r} is not a URL; give one like {DEFAULT_SERVER}", code="usage"
        )
    elif isinstance(e, aiohttp.ClientConnectorDNSError):
        why = f"its host name does not resolve ({e.os_error}); check --server (MCP_SERVER)"
    elif isinstance(e, (aiohttp.ClientConnectorCertificateError, aiohttp.ClientSSLError)):
        why = f"the TLS handshake failed ({e}); check the server's certificate and the URL's scheme"
    elif isinstance(e, aiohttp.ClientConnectorError):
        refused = e.os_error.errno == errno.ECONNREFUSED
        why = f"{'connection refused' if refused else e.os_error.strerror or e}; {_CHECK}"
    elif isinstance(e, aiohttp.ServerDisconnectedError):
        why = "it closed the connection without answering; is that a control plane?"
    else:
        why = f"{e or type(e).__name__}; {_CHECK}"
    return ApiCallError(f"cannot reach {server}: {why}", code="unreachable")


async def _read_capped(response: aiohttp.ClientResponse) -> bytes | None:
    """The body, or None once it passes :data:`MAX_ANSWER_BYTES`."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.content.iter_chunked(256 * 1024):
        size += len(chunk)
        if size > MAX_ANSWER_BYTES:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


class ApiSession:
    """Requests to one control plane over one HTTP connection pool (see
    :meth:`ApiClient.session`); :meth:`call` as :meth:`ApiClient.call`, awaited."""

    def __init__(self, client: ApiClient, http: aiohttp.ClientSession) -> None:
        self.client = client
        self.http = http

    async def call(
        self,
        method: str,
        path: str,
        *,
        body: Mapping[str, Any] | None = None,
        params: Sequence[tuple[str, str]] | None = None,
        auth: bool = True,
    ) -> Any:
        """Send one request and return the decoded JSON answer; raises :class:`ApiCallError`."""
        server, token = self.client.server, self.client.token
        if auth and not token:
            raise ApiCallError(
                "no API token: pass --token or set MCP_TOKEN (from `mcp-controlplane init` "
                "or `mcp-controlplane login`)",
                code="no_token",
            )
        headers = {"Accept": "application/json"}
        if auth and token:
            headers["Authorization"] = f"Bearer {token}"
        data = orjson.dumps(body) if body is not None else None
        if data is not None:
            headers["Content-Type"] = "application/json"
        try:
            async with self.http.request(
                method, server + path, data=data, params=list(params or []), headers=headers
            ) as response:
                status = response.status
                raw = await _read_capped(response)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            raise _unreachable(server, e) from e
        if raw is None:
            raise ApiCallError(
                f"{method} {path}: the answer is over {MAX_ANSWER_BYTES} bytes; refused",
                code="bad_answer",
                status=status,
            )
        try:
            answer = orjson.loads(raw) if raw else None
        except orjson.JSONDecodeError as e:
            raise ApiCallError(
                f"{method} {path}: HTTP {status}, and the answer is not JSON "
                f"(is {server} a control plane?)",
                code="bad_answer",
                status=status,
            ) from e
        if status >= 400:
            error = answer if isinstance(answer, dict) else {}
            message, code = error.get("error"), error.get("code")
            raise ApiCallError(
                f"{message if isinstance(message, str) and message else 'request failed'} "
                f"(HTTP {status})",
                code=code if isinstance(code, str) and code else f"http_{status}",
                status=status,
            )
        return answer


class ApiClient:
    """Calls ``{server}/api/v1/...`` with ``Authorization: Bearer {token}``."""

    def __init__(self, server: str, token: str | None) -> None:
        self.server = server.rstrip("/")
        self.token = token

    @asynccontextmanager
    async def session(self) -> AsyncIterator[ApiSession]:
        """One HTTP connection pool for many requests (each times out after ``TIMEOUT_S``)."""
        timeout = aiohttp.ClientTimeout(total=TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            yield ApiSession(self, http)

    def call(
        self,
        method: str,
        path: str,
        *,
        body: Mapping[str, Any] | None = None,
        params: Sequence[tuple[str, str]] | None = None,
        auth: bool = True,
    ) -> Any:
        """Send one request and return the decoded JSON answer; raises :class:`ApiCallError`."""

        async def once() -> Any:
            async with self.session() as session:
                return await session.call(method, path, body=body, params=params, auth=auth)

        return asyncio.run(once())


def configure_logging(log_level: str, log_format: str) -> None:
    """Apply ``--log-level`` / ``--log-format`` of a long-running command; the group's
    ``-v`` (debug) wins over the level."""
    root = click.get_current_context().find_root()
    verbose = bool(root.params.get("verbose"))
    setup_logging("debug" if verbose else log_level.lower(), log_format)


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
