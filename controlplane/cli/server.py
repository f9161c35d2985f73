"""``mcp-controlplane init|serve``: the control plane's data dir, database and server process.

    mcp-controlplane init  --data-dir D [--database-url URL] [--admin-user U --admin-password-file F]
                           [--broker-url URL] [--broker-admin-url mqtt://H:P
                            --broker-admin-user U --broker-admin-password-file F]
    mcp-controlplane serve --data-dir D [--listen HOST:PORT] [--log-level L] [--log-format text|json]

``init`` needs the first admin's password when it creates one: from ``--admin-password-file``
(``MCP_ADMIN_PASSWORD_FILE``), ``MCP_ADMIN_PASSWORD``, or a prompt on a terminal; without any
of them it stops before it writes anything.

With a broker admin configured, ``serve`` logs in to Mosquitto's dynamic-security plugin,
gives enrolled devices real per-device credentials, provisions its own service accounts
``svc-cp-{host}-{id}`` (:mod:`controlplane.replica`) and ingests device telemetry with them;
without one, enrollment can accept devices but not give them MQTT credentials, and there is no
ingestion.

Flags, environment (``MCP_DATA_DIR``, ``MCP_DATABASE_URL``, ``MCP_LISTEN``,
``MCP_BROKER_URLS``, and ``MCP_<OPTION>`` for every other flag) and
``<data dir>/controlplane.toml`` become one
:class:`~controlplane.settings.Settings` here (:func:`controlplane.cli.datadir.cli_settings`),
and nothing below reads them again.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource

from mcp_edge.controlplane import __version__
from mcp_edge.controlplane.cli.client import configure_logging
from mcp_edge.controlplane.cli.datadir import cli_settings, data_dir_option
from mcp_edge.controlplane.settings import (
    SQLITE_FILE,
    BrokerProvisionerKind,
    EnrollmentApproval,
    Settings,
    SettingsError,
)
from mcp_edge.shared.cli_style import log_options
from mcp_edge.shared.errors import McpError

_DATA_DIR_HELP = "Where the database, config and keys live."
PASSWORD_ENV = "MCP_ADMIN_PASSWORD"


def install_event_loop() -> str:
    """Run ``serve`` on uvloop where it is installed (cheaper socket I/O and wake-ups, from the
    executor's connects among others, than the stock loop; bench/fleet_path.py measures ingest with it)."""
    try:
        import uvloop
    except ImportError:
        return "asyncio"
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return "uvloop"


@click.command()
@data_dir_option(_DATA_DIR_HELP)
@click.option("--database-url", help="postgresql://USER@HOST/DB (default: SQLite in the data dir).")
@click.option("--listen", help="HOST:PORT for serve (default 127.0.0.1:8080).")
@click.option(
    "--broker-url",
    "broker_urls",
    multiple=True,
    envvar="MCP_BROKER_URLS",
    help="MQTT URL given to devices; repeatable (the variable: comma-separated).",
)
@click.option(
    "--approval",
    type=click.Choice([a.value for a in EnrollmentApproval]),
    help="token: each token decides; manual: every new device waits for approval.",
)
@click.option("--admin-user", help="Create this admin (default 'admin' when there is no user).")
@click.option(
    "--admin-password-file",
    type=click.Path(dir_okay=False, path_type=Path),
    help=f"Read the first admin's password from this file (else ${PASSWORD_ENV}, else a "
    "prompt on a terminal).",
)
@click.option(
    "--broker-admin-url",
    help="mqtt://HOST:PORT where serve reaches the broker's dynamic-security plugin.",
)
@click.option("--broker-admin-user", help="The dynamic-security admin account.")
@click.option(
    "--broker-admin-password-file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="File holding that account's password (read at serve time).",
)
@click.option(
    "--broker-provisioner",
    type=click.Choice([k.value for k in BrokerProvisionerKind]),
    help="Where broker accounts live: dynsec (Mosquitto's dynamic security, the default) or "
    "http (the database, for brokers that ask /broker/v1/...: EMQX, VerneMQ, go-auth).",
)
@click.option(
    "--broker-auth-secret-file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="With http: file holding the secret the brokers present (read at serve time).",
)
@click.option(
    "--broker-auth-listen",
    help="With http: HOST:PORT where serve also answers the brokers (a listener of theirs).",
)
@click.option(
    "--telemetry-retention-days",
    type=click.IntRange(min=1),
    help="Keep health samples this many days (default 7).",
)
@click.option(
    "--shared-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Directory every replica mounts, holding the one TUF repository and its keys "
    "(default: the data dir).",
)
def init(
    data_dir: Path | None,
    database_url: str | None,
    listen: str | None,
    broker_urls: tuple[str, ...],
    approval: str | None,
    admin_user: str | None,
    admin_password_file: Path | None,
    broker_admin_url: str | None,
    broker_admin_user: str | None,
    broker_admin_password_file: Path | None,
    broker_provisioner: str | None,
    broker_auth_secret_file: Path | None,
    broker_auth_listen: str | None,
    telemetry_retention_days: int | None,
    shared_dir: Path | None,
) -> None:
    """Create the data dir and database (or migrate them), and a first admin with an API token.

    The API token is printed once, on stdout; everything else goes to stderr.
    """
    from mcp_edge.controlplane.app import system_clock
    from mcp_edge.controlplane.bootstrap import initialize

    settings = cli_settings(
        data_dir,
        database_url=database_url,
        listen=listen,
        broker_urls=",".join(broker_urls) or None,
        enrollment_approval=approval,
        broker_admin_url=broker_admin_url,
        broker_admin_user=broker_admin_user,
        broker_admin_password_file=broker_admin_password_file,
        broker_provisioner=broker_provisioner,
        broker_auth_secret_file=broker_auth_secret_file,
        broker_auth_listen=broker_auth_listen,
        telemetry_retention_days=telemetry_retention_days,
        shared_dir=shared_dir,
    )
    try:  # fail now, not at the first serve
        if settings.broker_provisioner is BrokerProvisionerKind.HTTP:
            settings.broker_auth_secret()
        elif settings.broker_configured:
            settings.broker_admin_password()
    except SettingsError as e:
        raise click.ClickException(str(e)) from e
    password = _admin_password(admin_password_file)
    if password is None:
        if asyncio.run(_admin_needed(settings, admin_user)):
            raise click.ClickException(_no_password(settings))
        password = _refuse_password(settings)
    # Flags given on this command line rewrite controlplane.toml; values from the environment
    # alone are written only into a new one (settings read the environment on every start).
    ctx = click.get_current_context()
    explicit = any(
        ctx.get_parameter_source(name) is ParameterSource.COMMANDLINE
        for name in (
            "database_url",
            "listen",
            "broker_urls",
            "approval",
            "broker_admin_url",
            "broker_admin_user",
            "broker_admin_password_file",
            "broker_provisioner",
            "broker_auth_secret_file",
            "broker_auth_listen",
            "telemetry_retention_days",
            "shared_dir",
        )
    )
    try:
        result = asyncio.run(
            initialize(
                settings,
                clock=system_clock,
                admin_user=admin_user,
                admin_password=password,
                write_config=explicit,
            )
        )
    except McpError as e:
        raise click.ClickException(str(e)) from e
    click.echo(
        f"data dir {settings.data_dir} ready; database at revision {result.revision}", err=True
    )
    _init_repository(settings)
    if result.api_token is None:
        click.echo("users exist already; no admin created (use `mcp-controlplane login`)", err=True)
        return
    click.echo(f"admin user {result.admin!r} created; its API token (shown once):", err=True)
    click.echo(result.api_token)


def _admin_password(path: Path | None) -> Callable[[], str] | None:
    """Where the first admin's password comes from: the file (read now, so a missing one
    fails before anything is written), ``MCP_ADMIN_PASSWORD``, or a prompt on a terminal
    (asked only when an admin is created); None when there is no source."""
    if path is not None:
        try:
            text = path.read_text(encoding="utf-8").rstrip("\r\n")
        except (OSError, UnicodeDecodeError) as e:
            raise click.ClickException(f"cannot read --admin-password-file {path}: {e}") from e
        return lambda: text
    from_env = os.environ.get(PASSWORD_ENV)
    if from_env:
        return lambda: from_env
    if sys.stdin.isatty():
        return lambda: str(
            click.prompt("Admin password", hide_input=True, confirmation_prompt=True)
        )
    return None


def _no_password(settings: Settings) -> str:
    return (
        "init creates the first admin and needs its password: give --admin-password-file "
        f"FILE (or MCP_ADMIN_PASSWORD_FILE=FILE), set {PASSWORD_ENV}, or run init on a "
        f"terminal to be asked; nothing was written to {settings.data_dir}"
    )


def _refuse_password(settings: Settings) -> Callable[[], str]:
    """The password source when there is none and no admin should be needed: asked anyway
    (the last user was removed meanwhile), it fails as a missing source does."""

    def refuse() -> str:
        raise click.ClickException(_no_password(settings))

    return refuse


async def _admin_needed(settings: Settings, admin_user: str | None) -> bool:
    """Whether ``init`` would create an admin: one is named, or the database has no user
    (an absent SQLite file or an empty database has none). Reads only; raises the database's
    errors (an unreachable PostgreSQL)."""
    if admin_user is not None:
        return True
    if not settings.database_url and not (settings.data_dir / SQLITE_FILE).is_file():
        return True
    from mcp_edge.controlplane.db import Database
    from mcp_edge.controlplane.db import users as user_q
    from mcp_edge.controlplane.db.migrate import current_revision

    db = Database(settings.effective_database_url)
    try:
        if await current_revision(db) is None:
            return True
        async with db.read() as tx:
            return await user_q.count_users(tx) == 0
    finally:
        await db.dispose()


def _init_repository(settings: Settings) -> None:
    """Create the TUF repository and its keys (in the shared dir, else the data dir) when they
    are missing; a replica joining a shared dir finds them present."""
    from mcp_edge.controlplane.repository.service import repository_for, repository_lock

    repo = repository_for(settings)
    try:
        with repository_lock(repo):
            created = not repo.initialized
            repo.init()
    except (McpError, OSError) as e:
        raise click.ClickException(f"cannot create the repository in {repo.dir}: {e}") from e
    state = "created" if created else "present"
    click.echo(f"TUF repository {state} in {repo.dir} (keys in {repo.keys.dir})", err=True)


@click.command()
@data_dir_option(_DATA_DIR_HELP)
@click.option("--database-url", help="Overrides the data dir's config.")
@click.option("--listen", help="HOST:PORT (default 127.0.0.1:8080; port 0 picks a free one).")
@click.option(
    "--otlp-endpoint",
    envvar="MCP_OTLP_ENDPOINT",
    metavar="URL",
    help="Send OpenTelemetry traces (deploy calls, carried to the devices) over OTLP/HTTP "
    "to URL (an OpenTelemetry Collector: http://collector:4318). Default: no tracing.",
)
@log_options
def serve(
    data_dir: Path | None,
    database_url: str | None,
    listen: str | None,
    otlp_endpoint: str | None,
    log_level: str,
    log_format: str,
) -> None:
    """Run the control plane: migrate the database, then serve REST, /metrics, /healthz, and
    (with a broker admin configured) per-device broker accounts and telemetry ingestion."""
    configure_logging(log_level, log_format)
    settings = cli_settings(
        data_dir, database_url=database_url, listen=listen, otlp_endpoint=otlp_endpoint
    )
    if not settings.data_dir.is_dir():
        raise click.ClickException(
            f"{settings.data_dir} does not exist; run `mcp-controlplane init` first"
        )

    def ready(url: str) -> None:
        click.echo(f"mcp-controlplane {__version__} serving on {url}", err=True)
        click.echo(url)
        sys.stdout.flush()

    install_event_loop()
    try:
        asyncio.run(_serve(settings, ready))
    except McpError as e:
        raise click.ClickException(str(e)) from e
    except OSError as e:
        raise click.ClickException(f"cannot listen on {settings.host}:{settings.port}: {e}") from e


async def _serve(settings: Settings, ready: Any) -> None:
    from mcp_edge.controlplane.replica import ServeLock, replica_name

    # Before anything else: a second serve on this data dir must not reset the broker
    # passwords the running one logs in with.
    with ServeLock(settings.data_dir):
        await _serve_locked(
            settings, ready, replica_name(settings.data_dir, configured=settings.replica_name)
        )


async def _serve_locked(settings: Settings, ready: Any, name: str) -> None:
    from mcp_edge.controlplane.app import UnconfiguredProvisioner
    from mcp_edge.controlplane.app import serve as run_server
    from mcp_edge.controlplane.broker.dynsec import DynsecProvisioner
    from mcp_edge.controlplane.ingest import IngestConnection
    from mcp_edge.controlplane.mqtt import BrokerAddress

    log = logging.getLogger("mcp.controlplane")
    if settings.broker_provisioner is BrokerProvisionerKind.HTTP:
        await _serve_http_auth(settings, ready, name)
        return
    if not settings.broker_configured:
        log.warning(
            "no broker admin configured (mcp-controlplane init --broker-admin-url ...): "
            "devices get no MQTT credentials and telemetry is not ingested"
        )
        await run_server(settings, UnconfiguredProvisioner(), on_ready=ready)
        return
    address = BrokerAddress.parse(str(settings.broker_admin_url))
    if settings.broker_admin_user is None:
        raise SettingsError("broker_admin_url is set but broker_admin_user is not")
    ssl_context = None
    if address.tls:
        import ssl

        ssl_context = ssl.create_default_context()
    async with DynsecProvisioner(
        address.host,
        address.port,
        settings.broker_admin_user,
        settings.broker_admin_password(),
        ssl_context=ssl_context,
    ) as provisioner:
        credentials = await provisioner.provision_service(name)
        log.info(
            "broker %s:%d: provisioning devices, replica %s ingesting as %s",
            address.host,
            address.port,
            name,
            credentials.username,
        )
        await run_server(
            settings,
            provisioner,
            on_ready=ready,
            ingest=IngestConnection(address, credentials),
        )


async def _serve_http_auth(settings: Settings, ready: Any, name: str) -> None:
    """Serve with broker accounts in the database (:class:`HttpAuthProvisioner`): the brokers
    ask the app's ``/broker/v1/...`` (and ``broker_auth_listen``, opened first); with a broker
    configured, this replica's own accounts are provisioned there and its sessions log in
    through those endpoints."""
    from contextlib import AsyncExitStack

    from mcp_edge.controlplane.app import serve as run_server
    from mcp_edge.controlplane.broker.http_auth import HttpAuthProvisioner
    from mcp_edge.controlplane.broker.http_hooks import serve_broker_hooks
    from mcp_edge.controlplane.db import Database, upgrade_head
    from mcp_edge.controlplane.ingest import IngestConnection
    from mcp_edge.controlplane.mqtt import BrokerAddress
    from mcp_edge.controlplane.settings import parse_listen

    log = logging.getLogger("mcp.controlplane")
    secret = settings.broker_auth_secret()
    db = Database(settings.effective_database_url)
    try:
        if settings.migrate_on_start:  # the accounts table, before this replica's accounts
            await upgrade_head(db)
        async with HttpAuthProvisioner(db) as provisioner, AsyncExitStack() as stack:
            if settings.broker_auth_listen:
                host, port = parse_listen(settings.broker_auth_listen)
                url = await stack.enter_async_context(
                    serve_broker_hooks(provisioner, secret, host, port)
                )
                log.info("answering the brokers on %s/broker/v1/", url)
            ingest = None
            if settings.broker_configured:
                address = BrokerAddress.parse(str(settings.broker_admin_url))
                credentials = await provisioner.provision_service(name)
                ingest = IngestConnection(address, credentials)
                log.info(
                    "broker %s:%d asks this control plane about accounts; replica %s "
                    "ingesting as %s", address.host, address.port, name, credentials.username,
                )  # fmt: skip
            else:
                log.warning(
                    "broker_provisioner is http but no broker_admin_url names the broker: "
                    "devices get MQTT credentials, telemetry is not ingested"
                )
            await run_server(settings, provisioner, on_ready=ready, ingest=ingest, database=db)
    finally:
        await db.dispose()


COMMANDS = [init, serve]
