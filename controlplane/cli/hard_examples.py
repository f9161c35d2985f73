"""``mcp-controlplane drift examples ...``: a retraining trigger's hard examples from a shell
(docs/hard-examples.md).

    mcp-controlplane drift examples TRIGGER_ID -o DIR [--limit N] [--progress/--no-progress]
    mcp-controlplane drift examples collect TRIGGER_ID [--device D ...] [--max-bytes N]
                                            [--timeout 10] [--json]

The first form (``download`` spelled out, or left out) writes the trigger's dataset into DIR:
``trigger-{id}-hard-examples.npz`` and ``.json`` (a trigger with more than ``--limit``
examples gives one pair per page, ``-p2``, ``-p3``...). Each archive is streamed to a
``.part`` file with a progress bar on a terminal, then checked against its metadata (every
input's sha256) before it takes its name, so a file in DIR is always whole and as stored.

:data:`examples` is a click group; the ``drift`` group adds it with
``drift.add_command(examples)``.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import click
import numpy as np
import orjson

from mcp_edge.controlplane.cli.client import ApiCallError, api_options, print_json, print_table
from mcp_edge.shared.bundle._progress import progress_bar

DOWNLOAD_CHUNK = 256 * 1024
CONNECT_TIMEOUT_S = 30.0
DEFAULT_LIMIT = 10_000


class _DownloadByDefault(click.Group):
    """``examples TRIGGER_ID ...`` means ``examples download TRIGGER_ID ...``."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and not args[0].startswith("-"):
            args = ["download", *args]
        return super().parse_args(ctx, args)


@click.group("examples", cls=_DownloadByDefault)
def examples() -> None:
    """A retraining trigger's hard examples: download them as a dataset (.npz and .json),
    or ask its devices for them now (collect)."""


# ---------------------------------------------------------------------------- HTTP
def _headers(token: str | None) -> dict[str, str]:
    if not token:
        raise click.ClickException(
            "no API token: pass --token or set MCP_TOKEN (from `mcp-controlplane init` "
            "or `mcp-controlplane login`)"
        )
    return {"Authorization": f"Bearer {token}", "Accept": "application/json"}


def _refusal(status: int, raw: bytes) -> click.ClickException:
    try:
        answer = orjson.loads(raw)
    except orjson.JSONDecodeError:
        answer = None
    message = answer.get("error") if isinstance(answer, dict) else None
    code = answer.get("code") if isinstance(answer, dict) else None
    return ApiCallError(
        f"{message or 'request failed'} (HTTP {status})",
        code=code if isinstance(code, str) else "failed",
        status=status,
    )


async def _json(
    server: str,
    token: str | None,
    method: str,
    path: str,
    *,
    body: Mapping[str, Any] | None = None,
    params: Sequence[tuple[str, str]] = (),
    timeout_s: float,
) -> Any:
    headers = _headers(token)
    data = orjson.dumps(body) if body is not None else None
    if data is not None:
        headers["Content-Type"] = "application/json"
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.request(
                method, server.rstrip("/") + path, data=data, params=list(params), headers=headers
            ) as response,
        ):
            raw, status = await response.read(), response.status
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
        raise click.ClickException(f"cannot reach {server}: {e or type(e).__name__}") from e
    if status >= 400:
        raise _refusal(status, raw)
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise click.ClickException(
            f"{method} {path}: HTTP {status}, and the answer is not JSON "
            f"(is {server} a control plane?)"
        ) from e


async def _download(
    server: str,
    token: str | None,
    path: str,
    params: Sequence[tuple[str, str]],
    out: Path,
    *,
    progress: bool,
) -> int:
    """Stream ``path`` into ``out``; return its size. Raises ClickException."""
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S, sock_read=60)
    try:
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.get(
                server.rstrip("/") + path, params=list(params), headers=_headers(token)
            ) as response,
        ):
            if response.status >= 400:
                raise _refusal(response.status, await response.read())
            total = response.content_length or 0
            bar = progress_bar(total, out.name, progress)
            size = 0
            try:
                with out.open("wb") as f:
                    async for chunk in response.content.iter_chunked(DOWNLOAD_CHUNK):
                        f.write(chunk)
                        size += len(chunk)
                        bar.update(len(chunk))
                    f.flush()
                    os.fsync(f.fileno())
            finally:
                bar.close()
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
        raise click.ClickException(f"cannot download from {server}: {e or type(e).__name__}") from e
    if total and size != total:
        raise click.ClickException(f"{out.name}: got {size} of {total} bytes; try again")
    return size


def check_archive(path: Path, meta: Mapping[str, Any]) -> None:
    """Check the archive at ``path`` against its metadata: the same examples, and every
    input's bytes hashing to the sha256 the control plane stored. Raises ClickException."""
    wanted = [str(e["sha256"]) for e in meta["examples"]]
    try:
        with np.load(path, allow_pickle=False) as npz:
            listed = [str(s) for s in npz["sha256"]] if wanted else []
            if "inputs" in npz.files:
                inputs = [row.tobytes() for row in npz["inputs"]]
            else:
                inputs = [npz[f"input_{i}"].tobytes() for i in range(len(wanted))]
    except (OSError, ValueError, KeyError) as e:
        raise click.ClickException(f"{path.name} is not the dataset it should be: {e}") from e
    got = [hashlib.sha256(data).hexdigest() for data in inputs]
    if listed != wanted or got != wanted:
        raise click.ClickException(
            f"{path.name} does not match its metadata (changed during the download?); try again"
        )


# ---------------------------------------------------------------------------- commands
@examples.command("download")
@api_options
@click.argument("trigger_id", type=click.IntRange(min=1))
@click.option(
    "-o",
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    required=True,
    help="Directory for the .npz and .json files (made if missing).",
)
@click.option(
    "--limit",
    type=click.IntRange(1, 100_000),
    default=DEFAULT_LIMIT,
    show_default=True,
    help="Examples per file.",
)
@click.option(
    "--progress/--no-progress", default=None,
    help="Show a download progress bar [default: when stderr is a terminal].",
)  # fmt: skip
def download(
    server: str,
    token: str | None,
    trigger_id: int,
    out_dir: Path,
    limit: int,
    progress: bool | None,
) -> None:
    """Download the hard examples of TRIGGER_ID as a dataset: a .npz archive (inputs, outputs,
    device ids, times, confidences, predictions) and its JSON metadata."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = asyncio.run(
        _download_all(server, token, trigger_id, out_dir, limit, progress is not False)
    )
    if not written:
        click.echo(f"trigger {trigger_id} holds no hard examples yet")
        return
    count = sum(int(meta["count"]) for meta, _ in written)
    size = sum(int(meta["bytes"]) for meta, _ in written)
    devices = {e["device_id"] for meta, _ in written for e in meta["examples"]}
    first = written[0][0]
    click.echo(
        f"{count} hard examples of {first['model']} {first['version']} ({size} tensor bytes) "
        f"from {len(devices)} device(s):"
    )
    for _, npz_path in written:
        click.echo(f"  {npz_path}  {npz_path.with_suffix('.json')}")


async def _download_all(
    server: str, token: str | None, trigger_id: int, out_dir: Path, limit: int, progress: bool
) -> list[tuple[dict[str, Any], Path]]:
    base = f"/api/v1/drift/triggers/{trigger_id}/hard-examples"
    written: list[tuple[dict[str, Any], Path]] = []
    after = 0
    while True:
        params = [("after_id", str(after)), ("limit", str(limit))]
        meta = await _json(server, token, "GET", base, params=params, timeout_s=60)
        if not meta["examples"]:
            return written
        stem = f"trigger-{trigger_id}-hard-examples" + (f"-p{len(written) + 1}" if written else "")
        npz_path = out_dir / f"{stem}.npz"
        part = out_dir / f"{stem}.npz.part"
        try:
            await _download(server, token, f"{base}.npz", params, part, progress=progress)
            check_archive(part, meta)
        except BaseException:
            part.unlink(missing_ok=True)
            raise
        os.replace(part, npz_path)
        json_path = npz_path.with_suffix(".json")
        json_part = json_path.with_suffix(".json.part")
        json_part.write_bytes(orjson.dumps(meta, option=orjson.OPT_INDENT_2))
        os.replace(json_part, json_path)
        written.append((meta, npz_path))
        if meta["next_after_id"] is None:
            return written
        after = int(meta["next_after_id"])


@examples.command("collect")
@api_options
@click.argument("trigger_id", type=click.IntRange(min=1))
@click.option(
    "--device",
    "devices",
    multiple=True,
    metavar="DEVICE",
    help="Ask only this device of the trigger (repeatable; default: all of them).",
)
@click.option(
    "--max-bytes",
    type=click.IntRange(min=0),
    default=None,
    help="Raw tensor bytes per device [default: each device's policy budget].",
)
@click.option(
    "--timeout",
    "timeout_s",
    type=click.FloatRange(1, 300),
    default=10.0,
    show_default=True,
    help="Seconds to wait for each device.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the answer as JSON.")  # fmt: skip
def collect(
    server: str,
    token: str | None,
    trigger_id: int,
    devices: tuple[str, ...],
    max_bytes: int | None,
    timeout_s: float,
    as_json: bool,
) -> None:
    """Ask the devices of TRIGGER_ID for their hard examples now, and store what they send."""
    body: dict[str, Any] = {"timeout_s": timeout_s}
    if devices:
        body["devices"] = list(devices)
    if max_bytes is not None:
        body["max_bytes"] = max_bytes
    path = f"/api/v1/drift/triggers/{trigger_id}/hard-examples/collect"
    # The answer comes once every device answered or timed out: asked 16 at a time.
    wait = timeout_s * (len(devices) // 16 + 1 if devices else 64) + 30
    answer = asyncio.run(_json(server, token, "POST", path, body=body, timeout_s=wait))
    if as_json:
        print_json(answer)
        return
    rows = [
        [d["device_id"], d["status"], d["stored"], d["duplicates"], d["bytes"], d["held"],
         d["detail"][:80] or "-"]
        for d in answer["devices"]
    ]  # fmt: skip
    print_table(["device", "status", "stored", "duplicates", "bytes", "held", "detail"], rows)
    click.echo(
        f"{answer['stored']} stored, {answer['duplicates']} duplicates from "
        f"{len(answer['devices'])} device(s) for trigger {trigger_id} "
        f"({answer['model']} {answer['version']}, at most {answer['max_bytes']} bytes each)"
    )


COMMANDS = [examples]
