"""``mcp-controlplane keys|publishers|models``: the repository's keys, publisher keys, models.

``keys`` works on the data dir itself (like ``init``), so the root key can be kept offline and
brought back only to sign a new root::

    mcp-controlplane keys show
    mcp-controlplane keys export-root /media/usb/root.key --remove
    mcp-controlplane keys import-root /media/usb/root.key
    mcp-controlplane keys rotate root|targets|snapshot|timestamp|director

Each change takes the repository's writer lock (``repository/.lock``), so it is safe beside a
running ``serve``, which reads keys and metadata from disk on every use.

``publishers`` and ``models`` call the REST API (``--server``/``--token`` or ``MCP_SERVER`` /
``MCP_TOKEN``), like the commands of :mod:`controlplane.cli.fleet`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar
from urllib.parse import quote

import click

from mcp_edge.controlplane.cli.client import (
    ApiClient,
    api_options,
    fmt_time,
    print_json,
    print_table,
)
from mcp_edge.controlplane.cli.datadir import cli_settings, data_dir_option
from mcp_edge.controlplane.repository.service import repository_for, repository_lock
from mcp_edge.controlplane.repository.tuf_repo import DIRECTOR, ROLES, TufRepository
from mcp_edge.shared.errors import McpError
from mcp_edge.shared.signing import read_public_key

T = TypeVar("T")
_data_dir_option = data_dir_option(
    "The control plane's data dir (keys live in keys/ of its shared_dir, else of the data dir)."
)


def _with_repository(data_dir: Path | None, func: Callable[[TufRepository], T]) -> T:
    """Run ``func`` on the data dir's repository under its writer lock; errors → ClickException."""
    repo = repository_for(cli_settings(data_dir))
    if not repo.initialized:
        raise click.ClickException(
            f"no repository in {repo.dir}; run `mcp-controlplane init` (or start serve) first"
        )
    try:
        with repository_lock(repo):
            return func(repo)
    except (McpError, OSError) as e:
        raise click.ClickException(str(e)) from e


# ---------------------------------------------------------------------------- keys
@click.group()
def keys() -> None:
    """The TUF repository's signing keys (local: works on the data dir)."""


@keys.command("show")
@_data_dir_option
def keys_show(data_dir: Path | None) -> None:
    """Show each role's key id, metadata version and expiry, and where the root key is."""

    def show(repo: TufRepository) -> None:
        root = repo.root().signed
        signed = {
            "root": root,
            "targets": repo.targets().signed,
            "snapshot": repo.snapshot().signed,
            "timestamp": repo.timestamp().signed,
        }
        print_table(
            ["role", "version", "expires", "key id"],
            [
                [
                    role,
                    signed[role].version,
                    signed[role].expires.strftime("%Y-%m-%d %H:%M"),
                    ",".join(k[:16] for k in root.roles[role].keyids),
                ]
                for role in ROLES
            ],
        )
        click.echo(f"director key  {repo.director_key().keyid[:16]}")
        where = (
            "online (in keys/)" if repo.keys.has("root") else "OFFLINE (import-root to change root)"
        )
        click.echo(f"root key      {where}")
        listed = sorted(repo.publishers())
        click.echo(f"publishers    {', '.join(k[:16] for k in listed) or '-'}")

    _with_repository(data_dir, show)


@keys.command("export-root")
@_data_dir_option
@click.argument("path", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--remove", is_flag=True, help="Delete the root key from the data dir afterwards.")
def keys_export_root(data_dir: Path | None, path: Path, remove: bool) -> None:
    """Copy the root private key to PATH (0600) to keep it offline; --remove deletes it here.

    Without the root key online, publishing and timestamp refresh go on, but rotating any key
    needs it back (`keys import-root`).
    """

    def export(repo: TufRepository) -> None:
        repo.keys.export_root(path)
        if remove:
            repo.keys.remove_root()

    _with_repository(data_dir, export)
    click.echo(f"root key written to {path}" + ("; removed from the data dir" if remove else ""))


@keys.command("import-root")
@_data_dir_option
@click.argument("path", type=click.Path(exists=True, dir_okay=False, path_type=Path))
def keys_import_root(data_dir: Path | None, path: Path) -> None:
    """Put the root private key from PATH back into the data dir.

    The key must be the one the current root metadata trusts.
    """

    def import_root(repo: TufRepository) -> str:
        from mcp_edge.shared.signing import read_private_key

        key = read_private_key(path)
        trusted = repo.root().signed.roles["root"].keyids
        if key.keyid not in trusted:
            raise click.ClickException(
                f"{path}: key {key.keyid[:16]} is not the root key the repository trusts "
                f"({', '.join(k[:16] for k in trusted)})"
            )
        repo.keys.import_root(path)
        return key.keyid

    keyid = _with_repository(data_dir, import_root)
    click.echo(f"root key {keyid[:16]} is back in the data dir")


@keys.command("rotate")
@_data_dir_option
@click.argument("role", type=click.Choice([*ROLES, DIRECTOR]))
def keys_rotate(data_dir: Path | None, role: str) -> None:
    """Give ROLE a new key, signed into a new root version (needs the root key).

    Devices follow the chain of root versions on their next refresh. Rotating `root` signs the
    new root with both the old and the new root key. The director key is not in TUF: devices
    learn a new one only when they enroll again.
    """

    def rotate(repo: TufRepository) -> tuple[str, int]:
        new = repo.rotate(role)
        return new.keyid, repo.root().signed.version

    keyid, version = _with_repository(data_dir, rotate)
    click.echo(f"{role} key rotated to {keyid[:16]}; root metadata is now version {version}")


# ---------------------------------------------------------------------------- publishers
@click.group()
def publishers() -> None:
    """Publisher keys allowed to sign bundles (listed in signed TUF targets metadata)."""


@publishers.command("add")
@api_options
@click.argument("keyfile", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--name", required=True, help="Who holds the key, e.g. vision-team.")
def publishers_add(server: str, token: str | None, keyfile: Path, name: str) -> None:
    """Register the public key in KEYFILE (from `mcp-bundle keygen`; only the public half of
    a private key file is sent)."""
    try:
        key = read_public_key(keyfile)
    except McpError as e:
        raise click.ClickException(str(e)) from e
    row = ApiClient(server, token).call(
        "POST", "/api/v1/publishers", body={"name": name, "public_key": key.raw.hex()}
    )
    click.echo(f"publisher key {row['keyid']} ({row['name']}) is registered")


@publishers.command("list")
@api_options
@click.option("--json", "as_json", is_flag=True)
def publishers_list(server: str, token: str | None, as_json: bool) -> None:
    """List publisher keys, revoked ones included."""
    items = ApiClient(server, token).call("GET", "/api/v1/publishers")["items"]
    if as_json:
        print_json(items)
        return
    print_table(
        ["key id", "name", "added", "revoked"],
        [
            [p["keyid"], p["name"], fmt_time(p["created_at"]), fmt_time(p["revoked_at"])]
            for p in items
        ],
    )


@publishers.command("revoke")
@api_options
@click.argument("keyid")
def publishers_revoke(server: str, token: str | None, keyid: str) -> None:
    """Revoke a publisher key: its bundles are refused and devices stop trusting it. Final."""
    row = ApiClient(server, token).call("DELETE", "/api/v1/publishers/" + quote(keyid, safe=""))
    click.echo(f"publisher key {row['keyid']} ({row['name']}) is revoked")


# ---------------------------------------------------------------------------- models
@click.group()
def models() -> None:
    """Published models and their versions (publish with `mcp-bundle push`)."""


@models.command("list")
@api_options
@click.option("--json", "as_json", is_flag=True)
def models_list(server: str, token: str | None, as_json: bool) -> None:
    """List models with their newest version."""
    items = ApiClient(server, token).call("GET", "/api/v1/models")["items"]
    if as_json:
        print_json(items)
        return
    print_table(
        ["name", "versions", "latest", "published"],
        [
            [m["name"], m["version_count"], m["latest_version"], fmt_time(m["latest_published_at"])]
            for m in items
        ],
    )


@models.command("show")
@api_options
@click.argument("name")
@click.option("--json", "as_json", is_flag=True)
def models_show(server: str, token: str | None, name: str, as_json: bool) -> None:
    """Show the versions of model NAME, newest first."""
    model = ApiClient(server, token).call("GET", "/api/v1/models/" + quote(name, safe=""))
    if as_json:
        print_json(model)
        return
    click.echo(f"{model['name']} (since {fmt_time(model['created_at'])})")
    print_table(
        [
            "version",
            "sha256",
            "bytes",
            "format",
            "profiles",
            "variants",
            "signer",
            "published",
            "by",
        ],
        [
            [
                v["version"],
                v["sha256"][:16],
                v["length"],
                v["format"],
                ",".join(v["profiles"]) or "any",
                ",".join(x["name"] for x in v["variants"]),
                v["signer"][:16],
                fmt_time(v["created_at"]),
                v["uploaded_by"],
            ]
            for v in model["versions"]
        ],
    )


COMMANDS = [keys, publishers, models]
