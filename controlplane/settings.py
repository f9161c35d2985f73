"""The control plane's configuration: one frozen object, built once at the edge (the CLI).

Sources, later ones winning: defaults, ``<data dir>/controlplane.toml`` (written by
``mcp-controlplane init``), environment variables (``MCP_DATABASE_URL``, ``MCP_LISTEN``,
``MCP_BROKER_URLS``), command-line flags. :func:`load_settings` does the merging;
everything below the CLI receives a :class:`Settings` and never reads the environment.

``controlplane.toml`` keys::

    database_url = "postgresql://cp@db/mcp"     # absent: SQLite file in the data dir
    listen = "127.0.0.1:8080"
    broker_urls = ["mqtts://broker.example:8883"]
    enrollment_approval = "token"               # or "manual": every new device waits
    poll_after_s = 30.0
    broker_admin_url = "mqtt://127.0.0.1:1883"  # absent: no broker accounts, no ingestion
    broker_admin_user = "admin"                 # a dynamic-security admin account
    broker_admin_password_file = "/etc/mcp/broker-admin.pw"   # read at serve time
    broker_provisioner = "dynsec"               # or "http": brokers ask /broker/v1/... instead
    broker_auth_secret_file = "/etc/mcp/broker-auth.secret"   # "http": the brokers' secret
    broker_auth_listen = "0.0.0.0:8081"         # "http": a listener for the brokers alone
    telemetry_retention_days = 7
    timestamp_refresh_s = 3600                  # how often serve re-checks TUF timestamp expiry
    max_bundle_bytes = 2147483648               # cap on one uploaded .mcpb (POST /api/v1/bundles)
    desired_ttl_s = 604800                      # lifetime of a signed desired state (re-signed at half)
    repository_http = true                      # false: /repo/... answers 403 (MQTT only)
    replica_name = "cp-east-1"                  # absent: cp-{host}-{id kept in the data dir}
    shared_dir = "/srv/mcp-shared"              # absent: the data dir; repository/ and keys/
    inference_interval_s = 30.0                 # how often devices send inference statistics
    rollout_lease_s = 15.0                      # a dead replica's rollouts move on after this
    drift_max_reports_per_minute = 60           # per device; more are refused (docs/drift.md)
    drift_report_retention_hours = 48           # device drift reports; buckets: retention_days
    ui_session_hours = 12.0                     # web console sessions end after this (/ui/)
    otlp_endpoint = "http://otel-collector:4318" # absent: no tracing (shared/tracing.py)

    [drift_policy]                              # sent to every device; docs/drift.md
    enabled = true                              # false: devices measure no drift
    window_requests = 200                       # a window closes after this many samples ...
    window_s = 300.0                            # ... or this long after its first
    sample_every = 1                            # bin 1 in N answered requests
    hard_examples = false                       # keep low-confidence inputs for collection
    hard_example_max_confidence = 0.5           # "low": top score at most this
    hard_example_budget_bytes = 262144          # per device, at most 524288

    [[webhooks]]                                # any number; event delivery, docs/webhooks.md
    name = "ops"                                # identifier: letters, digits, ``_.-``, <= 64
    url = "https://hooks.example/mcp"           # http:// or https:// only
    secret_file = "/etc/mcp/webhook-ops.secret" # HMAC key, >= 32 bytes, read at serve time
    events = ["rollout.*"]                      # patterns; absent: every event ("*")
    timeout_s = 5.0                             # one POST, connect to last byte
    max_attempts = 12                           # then the delivery is given up

Webhooks are read from the file (or ``overrides``) only, never from the environment.

Environment: also ``MCP_TIMESTAMP_REFRESH_S``, ``MCP_MAX_BUNDLE_BYTES``, ``MCP_REPOSITORY_HTTP``,
``MCP_REPLICA_NAME``, ``MCP_SHARED_DIR``, ``MCP_INFERENCE_INTERVAL_S``, ``MCP_ROLLOUT_LEASE_S``,
``MCP_OTLP_ENDPOINT``, ``MCP_BROKER_PROVISIONER``, ``MCP_BROKER_AUTH_SECRET_FILE`` and
``MCP_BROKER_AUTH_LISTEN``.

``broker_provisioner = "http"`` keeps broker accounts in the database and serves them to
brokers that ask over HTTP (EMQX, VerneMQ, mosquitto-go-auth: docs/broker-http-auth.md); the
broker admin account is then not needed, and ``broker_admin_url`` only names the broker the
control plane's own sessions connect to.
"""

from __future__ import annotations

import enum
import json
import os
import re
import stat
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pydantic import ValidationError

from mcp_edge.controlplane.replica import valid_replica_name
from mcp_edge.shared.errors import McpError
from mcp_edge.shared.fsutil import atomic_write_bytes
from mcp_edge.shared.protocol.state import DriftPolicy

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

CONFIG_FILE = "controlplane.toml"
SQLITE_FILE = "controlplane.db"
DEFAULT_LISTEN = "127.0.0.1:8080"
DEFAULT_BROKER_URLS = ("mqtt://127.0.0.1:1883",)


class SettingsError(McpError):
    """The configuration is inconsistent or a value does not parse."""


class EnrollmentApproval(str, enum.Enum):
    """Server-wide enrollment policy.

    ``TOKEN``: each enrollment token says whether its devices are accepted at once
    (``approval=auto``) or wait for an operator (``approval=manual``).
    ``MANUAL``: every new device waits for an operator, whatever its token says.
    Preauthorized public keys are accepted under both.
    """

    TOKEN = "token"
    MANUAL = "manual"


WEBHOOK_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
EVENT_TYPE = re.compile(r"^[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)+$")
"""An event type: dot-separated lower-case words, such as ``rollout.stage_started``."""
EVENT_PATTERN = re.compile(r"^(\*|[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)*(\.\*)?)$")
MAX_EVENT_TYPE = 64
MAX_WEBHOOK_URL = 2048
MIN_WEBHOOK_SECRET_BYTES = 32
MAX_WEBHOOK_SECRET_BYTES = 4096
_WEBHOOK_KEYS = frozenset({"name", "url", "secret_file", "events", "timeout_s", "max_attempts"})


@dataclass(frozen=True)
class WebhookConfig:
    """One ``[[webhooks]]`` entry: where events go and which ones.

    ``events`` holds patterns: ``*`` (every event), an exact type (``rollout.succeeded``) or a
    prefix ending in ``.*`` (``rollout.*``: every type starting with ``rollout.``).
    ``timeout_s`` bounds one POST (seconds); after ``max_attempts`` failed POSTs a delivery is
    given up. The secret is not held here: :meth:`read_secret` reads it at serve time.
    """

    name: str
    url: str
    secret_file: Path
    events: tuple[str, ...] = ("*",)
    timeout_s: float = 5.0
    max_attempts: int = 12

    def accepts(self, event: str) -> bool:
        """Whether ``event`` (an event type) matches one of :attr:`events`."""
        return any(event_matches(pattern, event) for pattern in self.events)

    def read_secret(self) -> bytes:
        """The HMAC key: the bytes of ``secret_file`` less a trailing newline.

        Raises :class:`SettingsError` when the file is missing, not a regular file, readable or
        writable by others (group access is allowed, for a secret shared through a group), or
        holds fewer than 32 or more than 4096 bytes. ``others`` means any bit of ``0o007``.
        """
        path = self.secret_file
        where = f"webhook {self.name!r}: secret_file {path}"
        try:
            st = path.stat()
            if not stat.S_ISREG(st.st_mode):
                raise SettingsError(f"{where} is not a regular file")
            if st.st_mode & 0o007:
                raise SettingsError(
                    f"{where} has permissions {stat.S_IMODE(st.st_mode):04o}; others must have "
                    f"no access to a webhook secret (chmod 600 {path}, or 640 for a group)"
                )
            with path.open("rb") as f:
                raw = f.read(MAX_WEBHOOK_SECRET_BYTES + 3)
        except OSError as e:
            raise SettingsError(f"{where} cannot be read: {e.strerror or e}") from e
        secret = raw.rstrip(b"\r\n")
        if len(secret) > MAX_WEBHOOK_SECRET_BYTES:
            raise SettingsError(f"{where} is larger than {MAX_WEBHOOK_SECRET_BYTES} bytes")
        if len(secret) < MIN_WEBHOOK_SECRET_BYTES:
            raise SettingsError(
                f"{where} holds {len(secret)} bytes; a webhook secret needs at least "
                f"{MIN_WEBHOOK_SECRET_BYTES} (openssl rand -hex 32 > {path})"
            )
        return secret


def event_matches(pattern: str, event: str) -> bool:
    """Whether the event type ``event`` matches ``pattern`` (see :class:`WebhookConfig`)."""
    if pattern == "*":
        return True
    if pattern.endswith(".*"):
        return event.startswith(pattern[:-1])
    return event == pattern


def _webhook(index: int, entry: object) -> WebhookConfig:
    if not isinstance(entry, Mapping):
        raise ValueError(f"webhooks[{index}] must be a table ([[webhooks]])")
    unknown = sorted(str(k) for k in entry if k not in _WEBHOOK_KEYS)
    if unknown:
        raise ValueError(
            f"webhooks[{index}]: unknown key(s) {', '.join(unknown)}; "
            f"known: {', '.join(sorted(_WEBHOOK_KEYS))}"
        )
    name = entry.get("name")
    if not isinstance(name, str) or not WEBHOOK_NAME.match(name):
        raise ValueError(
            f"webhooks[{index}]: name {name!r} must be 1-64 letters, digits, '_', '.' or '-', "
            "starting with a letter or digit"
        )
    where = f"webhook {name!r}"
    url = entry.get("url")
    if not isinstance(url, str):
        raise ValueError(f"{where}: url is missing")
    _check_webhook_url(where, url)
    secret_file = entry.get("secret_file")
    if not isinstance(secret_file, str) or not secret_file:
        raise ValueError(f"{where}: secret_file (a path to the HMAC secret) is missing")
    events = entry.get("events", ["*"])
    if not isinstance(events, list) or not all(isinstance(e, str) for e in events):
        raise ValueError(f"{where}: events must be a list of event-type patterns")
    if not events:
        raise ValueError(f"{where}: events is empty; leave it out to receive every event")
    for pattern in events:
        if len(pattern) > MAX_EVENT_TYPE or not EVENT_PATTERN.match(pattern):
            raise ValueError(
                f"{where}: event pattern {pattern!r} must be '*', a type such as "
                "'rollout.succeeded', or a prefix such as 'rollout.*'"
            )
    timeout = entry.get("timeout_s", 5.0)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise ValueError(f"{where}: timeout_s must be a number of seconds")
    if not 0.1 <= timeout <= 60.0:
        raise ValueError(f"{where}: timeout_s must be between 0.1 and 60 seconds")
    attempts = entry.get("max_attempts", 12)
    if isinstance(attempts, bool) or not isinstance(attempts, int):
        raise ValueError(f"{where}: max_attempts must be an integer")
    if not 1 <= attempts <= 100:
        raise ValueError(f"{where}: max_attempts must be between 1 and 100")
    return WebhookConfig(
        name=name,
        url=url,
        secret_file=Path(secret_file).expanduser().absolute(),
        events=tuple(dict.fromkeys(events)),
        timeout_s=float(timeout),
        max_attempts=attempts,
    )


def _check_webhook_url(where: str, url: str) -> None:
    if len(url) > MAX_WEBHOOK_URL:
        raise ValueError(f"{where}: url is longer than {MAX_WEBHOOK_URL} characters")
    if any(c.isspace() or not c.isprintable() for c in url):
        raise ValueError(f"{where}: url {url!r} contains spaces or control characters")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - parses the port, raising ValueError when it is not a number
    except ValueError as e:
        raise ValueError(f"{where}: url {url!r} does not parse: {e}") from None
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"{where}: url {url!r} must start with http:// or https://")
    if not parts.hostname:
        raise ValueError(f"{where}: url {url!r} names no host")
    if parts.username is not None or parts.password is not None:
        raise ValueError(
            f"{where}: url must not carry credentials (user:password@); receivers verify the "
            "X-MCP-Signature header instead"
        )
    if parts.fragment:
        raise ValueError(f"{where}: url must not have a #fragment")


def _parse_webhooks(value: object) -> tuple[WebhookConfig, ...]:
    if not isinstance(value, (list, tuple)):
        raise ValueError("webhooks must be a list of tables ([[webhooks]] entries)")
    hooks = tuple(_webhook(i, entry) for i, entry in enumerate(value))
    names = [h.name for h in hooks]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"webhook name(s) used twice: {', '.join(duplicates)}")
    return hooks


class BrokerProvisionerKind(str, enum.Enum):
    """Where broker accounts live. ``DYNSEC``: in Mosquitto's dynamic-security plugin, through
    the broker admin account. ``HTTP``: in the control plane's database, asked for by the
    broker over HTTP (:mod:`controlplane.broker.http_hooks`)."""

    DYNSEC = "dynsec"
    HTTP = "http"


BROKER_AUTH_SECRET = re.compile(r"^[A-Za-z0-9._~-]{32,4096}$")
"""A broker endpoint secret: URL-safe characters only, so it can sit in a header and, as is,
in a URL's ``user:secret@`` part (VerneMQ's and go-auth's way to send it)."""


class PasswordCost(str, enum.Enum):
    """argon2id cost (PyNaCl's named limits). ``MIN`` exists for tests only."""

    MIN = "min"
    INTERACTIVE = "interactive"
    MODERATE = "moderate"


@dataclass(frozen=True)
class Settings:
    """Everything the control plane needs to know at start.

    ``max_body_bytes`` caps every REST request body; ``poll_after_s`` is what a pending device
    is told to wait before asking again (seconds). ``timestamp_refresh_s`` is how often serve
    re-signs TUF timestamp metadata that nears expiry (seconds); ``max_bundle_bytes`` caps one
    uploaded bundle (bytes), separately from ``max_body_bytes``. ``desired_ttl_s`` is how long
    a signed desired state stays valid (seconds); it is re-signed at half that.
    """

    data_dir: Path
    database_url: str | None = None
    host: str = "127.0.0.1"
    port: int = 8080
    broker_urls: tuple[str, ...] = DEFAULT_BROKER_URLS
    enrollment_approval: EnrollmentApproval = EnrollmentApproval.TOKEN
    poll_after_s: float = 30.0
    max_body_bytes: int = 64 * 1024
    password_cost: PasswordCost = PasswordCost.INTERACTIVE
    migrate_on_start: bool = True
    broker_admin_url: str | None = None
    broker_admin_user: str | None = None
    broker_admin_password_file: Path | None = None
    broker_provisioner: BrokerProvisionerKind = BrokerProvisionerKind.DYNSEC
    """Where broker accounts live (:class:`BrokerProvisionerKind`)."""
    broker_auth_secret_file: Path | None = None
    """The secret brokers present to ``/broker/v1/...`` (``broker_provisioner = "http"``),
    read at serve time by :meth:`broker_auth_secret`."""
    broker_auth_listen: str | None = None
    """``host:port`` where serve also answers the brokers alone (``broker_provisioner =
    "http"``), opened before the control plane logs its own sessions in: they are checked
    through it. None: the brokers ask the main listener only."""
    telemetry_retention_days: int = 7
    timestamp_refresh_s: float = 3600.0
    repository_http: bool = True
    """Serve the TUF repository at ``/repo/...`` without authentication (its content is signed
    and hashed, not secret-keeping); False keeps model bytes to the devices' MQTT accounts."""
    max_bundle_bytes: int = 2 << 30
    desired_ttl_s: float = 7 * 86400.0
    replica_name: str | None = None
    """This replica's broker identity; None: ``cp-{host}-{id}``, the id kept in the data dir
    (:mod:`controlplane.replica`)."""
    shared_dir: Path | None = None
    """Where the TUF repository (``repository/``) and its online keys (``keys/``) live; None:
    the data dir. Replicas on one database point theirs at one directory (a volume every
    replica mounts, with working ``flock``) and so serve one repository: writers take the
    repository's file lock, so one replica at a time signs (docs/operations.md)."""
    inference_interval_s: float = 30.0
    """How often devices send inference statistics (their desired state's telemetry policy):
    the rollout gates judge on them, so a shorter interval decides stages sooner."""
    rollout_lease_s: float = 15.0
    """How long a replica's claim on a rollout lasts without renewal (it renews every step):
    when a replica dies, another carries its rollouts on after at most this long."""
    webhooks: tuple[WebhookConfig, ...] = ()
    """Where events (rollout transitions, ...) are delivered (:mod:`controlplane.webhooks`)."""
    drift_max_reports_per_minute: int = 60
    """Drift reports one device may send a minute (bursts up to as many); more are refused as
    ``flood`` and never reach an aggregate (:mod:`controlplane.drift.service`)."""
    drift_report_retention_hours: int = 48
    """How long each device's drift reports are kept (the fleet's buckets are kept
    ``telemetry_retention_days``)."""
    ui_session_hours: float = 12.0
    """How long a web console session lasts after sign-in (``/ui/login``); it can be ended
    sooner by signing out or revoking it (``mcp-controlplane api-tokens revoke``)."""
    otlp_endpoint: str | None = None
    """Where traces go (OTLP over HTTP); None: no tracing (:mod:`shared.tracing`)."""
    drift_policy: DriftPolicy = field(default_factory=DriftPolicy)
    """How devices measure drift (window, sampling, hard examples): sent in every desired
    state's telemetry policy (``[drift_policy]`` in the config file)."""

    @property
    def broker_configured(self) -> bool:
        """Whether serve should provision broker accounts and ingest telemetry."""
        return bool(self.broker_admin_url)

    def broker_admin_password(self) -> str:
        """The admin password from ``broker_admin_password_file`` (trailing newline removed).

        Raises :class:`SettingsError` when no file is configured or it cannot be read.
        """
        if self.broker_admin_password_file is None:
            raise SettingsError("broker_admin_url is set but broker_admin_password_file is not")
        try:
            text = self.broker_admin_password_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise SettingsError(f"cannot read the broker admin password: {e}") from e
        return text.rstrip("\r\n")

    def broker_auth_secret(self) -> str:
        """The broker endpoint secret from ``broker_auth_secret_file`` (trailing newline
        removed).

        Raises :class:`SettingsError` when no file is configured, it is not a regular file,
        others may read it (``0o007``; a group may), it cannot be read, or it is not 32 to 4096
        characters of ``[A-Za-z0-9._~-]`` (``openssl rand -hex 32`` makes one).
        """
        path = self.broker_auth_secret_file
        if path is None:
            raise SettingsError(
                'broker_provisioner = "http" needs broker_auth_secret_file (the secret the '
                "brokers present to /broker/v1/...)"
            )
        where = f"broker_auth_secret_file {path}"
        try:
            st = path.stat()
            if not stat.S_ISREG(st.st_mode):
                raise SettingsError(f"{where} is not a regular file")
            if st.st_mode & 0o007:
                raise SettingsError(
                    f"{where} has permissions {stat.S_IMODE(st.st_mode):04o}; others must have "
                    f"no access to it (chmod 600 {path}, or 640 for a group)"
                )
            with path.open("rb") as f:
                raw = f.read(4096 + 3)
        except OSError as e:
            raise SettingsError(f"{where} cannot be read: {e.strerror or e}") from e
        secret = raw.rstrip(b"\r\n").decode("ascii", errors="replace")
        if not BROKER_AUTH_SECRET.match(secret):
            raise SettingsError(
                f"{where} must hold 32 to 4096 characters of A-Z a-z 0-9 . _ ~ - "
                f"(openssl rand -hex 32 > {path})"
            )
        return secret

    @property
    def effective_database_url(self) -> str:
        """The configured URL, or the SQLite file inside the data dir."""
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.data_dir / SQLITE_FILE).resolve()}"

    @property
    def config_path(self) -> Path:
        return self.data_dir / CONFIG_FILE

    @property
    def repository_root(self) -> Path:
        """The directory holding ``repository/`` and ``keys/``: ``shared_dir`` or the data dir."""
        return self.shared_dir if self.shared_dir is not None else self.data_dir


def parse_listen(value: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` for IPv6) → ``(host, port)``; raises :class:`SettingsError`."""
    host, sep, port_text = value.rpartition(":")
    if not sep or not port_text.isdigit():
        raise SettingsError(f"listen address {value!r} must be host:port")
    port = int(port_text)
    if not 0 <= port <= 65535:
        raise SettingsError(f"port {port} is out of range")
    host = host.strip("[]") or "0.0.0.0"
    return host, port


def _parse_broker_urls(value: object) -> tuple[str, ...]:
    if isinstance(value, str):
        urls = [u.strip() for u in value.split(",") if u.strip()]
    elif isinstance(value, list) and all(isinstance(u, str) for u in value):
        urls = list(value)
    else:
        raise SettingsError("broker_urls must be a list of URLs or a comma-separated string")
    for url in urls:
        if "://" not in url:
            raise SettingsError(f"broker URL {url!r} needs a scheme such as mqtt:// or mqtts://")
    if not urls:
        raise SettingsError("at least one broker URL is needed")
    return tuple(urls)


def read_config_file(path: Path) -> dict[str, Any]:
    """The keys of a ``controlplane.toml``; an empty dict when the file does not exist."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return {}
    try:
        return dict(tomllib.loads(raw.decode("utf-8")))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise SettingsError(f"{path}: {e}") from e


def _number(key: str, value: Any, kind: type[int] | type[float]) -> float:
    try:
        return kind(value)
    except (ValueError, TypeError):
        raise ValueError(f"{key} must be a number, got {value!r}") from None


def _apply(settings: Settings, values: Mapping[str, Any], origin: str) -> Settings:
    changes: dict[str, Any] = {}
    try:
        if values.get("database_url"):
            changes["database_url"] = str(values["database_url"])
        if values.get("listen"):
            changes["host"], changes["port"] = parse_listen(str(values["listen"]))
        if values.get("broker_urls"):
            changes["broker_urls"] = _parse_broker_urls(values["broker_urls"])
        if values.get("enrollment_approval"):
            changes["enrollment_approval"] = EnrollmentApproval(values["enrollment_approval"])
        if values.get("poll_after_s") is not None:
            changes["poll_after_s"] = float(values["poll_after_s"])
        if values.get("password_cost"):
            changes["password_cost"] = PasswordCost(values["password_cost"])
        if values.get("broker_admin_url"):
            url = str(values["broker_admin_url"])
            if not url.startswith(("mqtt://", "mqtts://")):
                raise ValueError(f"broker_admin_url {url!r} must start with mqtt:// or mqtts://")
            changes["broker_admin_url"] = url
        if values.get("broker_admin_user"):
            changes["broker_admin_user"] = str(values["broker_admin_user"])
        if values.get("broker_admin_password_file"):
            path = Path(str(values["broker_admin_password_file"])).expanduser()
            changes["broker_admin_password_file"] = path.absolute()
        if values.get("broker_provisioner"):
            kind = values["broker_provisioner"]
            kind = kind.value if isinstance(kind, BrokerProvisionerKind) else str(kind)
            try:
                changes["broker_provisioner"] = BrokerProvisionerKind(kind)
            except ValueError:
                raise ValueError(f"broker_provisioner {kind!r} is not 'dynsec' or 'http'") from None
        if values.get("broker_auth_secret_file"):
            path = Path(str(values["broker_auth_secret_file"])).expanduser()
            changes["broker_auth_secret_file"] = path.absolute()
        if values.get("broker_auth_listen"):
            parse_listen(str(values["broker_auth_listen"]))  # SettingsError when malformed
            changes["broker_auth_listen"] = str(values["broker_auth_listen"])
        if values.get("telemetry_retention_days") is not None:
            days = int(values["telemetry_retention_days"])
            if days < 1:
                raise ValueError("telemetry_retention_days must be at least 1")
            changes["telemetry_retention_days"] = days
        if values.get("timestamp_refresh_s") is not None:
            interval = _number("timestamp_refresh_s", values["timestamp_refresh_s"], float)
            if not 1.0 <= interval <= 86400.0:
                raise ValueError("timestamp_refresh_s must be between 1 and 86400 seconds")
            changes["timestamp_refresh_s"] = interval
        if values.get("max_bundle_bytes") is not None:
            cap = int(_number("max_bundle_bytes", values["max_bundle_bytes"], int))
            if cap < 1024:
                raise ValueError("max_bundle_bytes must be at least 1024")
            changes["max_bundle_bytes"] = cap
        if values.get("repository_http") is not None:
            flag = values["repository_http"]
            if isinstance(flag, str) and flag.lower() in ("true", "false", "1", "0"):
                flag = flag.lower() in ("true", "1")
            if not isinstance(flag, bool):
                raise ValueError("repository_http must be true or false")
            changes["repository_http"] = flag
        if values.get("desired_ttl_s") is not None:
            ttl = float(values["desired_ttl_s"])
            if not 600.0 <= ttl <= 365 * 86400.0:
                raise ValueError("desired_ttl_s must be between 600 seconds and 365 days")
            changes["desired_ttl_s"] = ttl
        if values.get("inference_interval_s") is not None:
            interval = _number("inference_interval_s", values["inference_interval_s"], float)
            if not 1.0 <= interval <= 86400.0:
                raise ValueError("inference_interval_s must be between 1 and 86400 seconds")
            changes["inference_interval_s"] = interval
        if values.get("rollout_lease_s") is not None:
            lease = _number("rollout_lease_s", values["rollout_lease_s"], float)
            if not 2.0 <= lease <= 3600.0:
                raise ValueError("rollout_lease_s must be between 2 and 3600 seconds")
            changes["rollout_lease_s"] = lease
        if values.get("ui_session_hours") is not None:
            session_hours = _number("ui_session_hours", values["ui_session_hours"], float)
            if not 0.05 <= session_hours <= 24.0 * 90:
                raise ValueError("ui_session_hours must be between 0.05 and 2160 hours")
            changes["ui_session_hours"] = session_hours
        if values.get("drift_max_reports_per_minute") is not None:
            rate = int(_number("drift_max_reports_per_minute",
                               values["drift_max_reports_per_minute"], int))  # fmt: skip
            if not 1 <= rate <= 100_000:
                raise ValueError("drift_max_reports_per_minute must be between 1 and 100000")
            changes["drift_max_reports_per_minute"] = rate
        if values.get("drift_report_retention_hours") is not None:
            hours = int(_number("drift_report_retention_hours",
                                values["drift_report_retention_hours"], int))  # fmt: skip
            if not 1 <= hours <= 365 * 24:
                raise ValueError("drift_report_retention_hours must be between 1 and 8760")
            changes["drift_report_retention_hours"] = hours
        if values.get("replica_name"):
            changes["replica_name"] = valid_replica_name(str(values["replica_name"]))
        if values.get("shared_dir"):
            changes["shared_dir"] = Path(str(values["shared_dir"])).expanduser().absolute()
        if values.get("otlp_endpoint"):
            endpoint = str(values["otlp_endpoint"])
            if not endpoint.startswith(("http://", "https://")) or len(endpoint) > 2048:
                raise ValueError("otlp_endpoint must be an http:// or https:// URL")
            changes["otlp_endpoint"] = endpoint
        if values.get("webhooks") is not None:
            changes["webhooks"] = _parse_webhooks(values["webhooks"])
        if values.get("drift_policy") is not None:
            changes["drift_policy"] = _parse_drift_policy(values["drift_policy"])
    except (ValueError, TypeError) as e:
        raise SettingsError(f"{origin}: {e}") from e
    return replace(settings, **changes)


def _parse_drift_policy(table: object) -> DriftPolicy:
    """The ``[drift_policy]`` table as a :class:`DriftPolicy` (its own bounds), or ValueError
    naming the first bad key."""
    if isinstance(table, DriftPolicy):
        return table
    if not isinstance(table, Mapping):
        raise ValueError("drift_policy must be a table ([drift_policy] with keys below it)")
    try:
        return DriftPolicy.model_validate(dict(table))
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "drift_policy"
        raise ValueError(f"drift_policy.{where}: {first['msg']}") from None


def load_settings(
    data_dir: Path,
    *,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Settings:
    """Merge defaults, ``<data_dir>/controlplane.toml``, ``environ`` and ``overrides``.

    ``overrides`` uses the config file's keys (``database_url``, ``listen``, ...); None values
    are ignored. Raises :class:`SettingsError`.
    """
    settings = Settings(data_dir=Path(data_dir))
    settings = _apply(settings, read_config_file(settings.config_path), str(settings.config_path))
    env = environ if environ is not None else {}
    from_env = {
        "database_url": env.get("MCP_DATABASE_URL"),
        "listen": env.get("MCP_LISTEN"),
        "broker_urls": env.get("MCP_BROKER_URLS"),
        "timestamp_refresh_s": env.get("MCP_TIMESTAMP_REFRESH_S") or None,
        "max_bundle_bytes": env.get("MCP_MAX_BUNDLE_BYTES") or None,
        "repository_http": env.get("MCP_REPOSITORY_HTTP") or None,
        "replica_name": env.get("MCP_REPLICA_NAME") or None,
        "broker_provisioner": env.get("MCP_BROKER_PROVISIONER") or None,
        "broker_auth_secret_file": env.get("MCP_BROKER_AUTH_SECRET_FILE") or None,
        "broker_auth_listen": env.get("MCP_BROKER_AUTH_LISTEN") or None,
        "shared_dir": env.get("MCP_SHARED_DIR") or None,
        "inference_interval_s": env.get("MCP_INFERENCE_INTERVAL_S") or None,
        "rollout_lease_s": env.get("MCP_ROLLOUT_LEASE_S") or None,
        "otlp_endpoint": env.get("MCP_OTLP_ENDPOINT") or None,
    }
    settings = _apply(settings, from_env, "environment")
    return _apply(settings, overrides or {}, "command line")


def _toml_value(value: object) -> str:
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    raise SettingsError(f"cannot write {type(value).__name__} to TOML")


def write_config_file(settings: Settings) -> Path:
    """Write the settings ``serve`` must find again into the data dir (mode 0600: the database
    URL may hold a password)."""
    values: dict[str, object] = {
        "listen": f"{settings.host}:{settings.port}",
        "broker_urls": list(settings.broker_urls),
        "enrollment_approval": settings.enrollment_approval.value,
        "poll_after_s": settings.poll_after_s,
        "password_cost": settings.password_cost.value,
    }
    if settings.database_url:
        values["database_url"] = settings.database_url
    if settings.broker_admin_url:
        values["broker_admin_url"] = settings.broker_admin_url
    if settings.broker_admin_user:
        values["broker_admin_user"] = settings.broker_admin_user
    if settings.broker_admin_password_file is not None:
        values["broker_admin_password_file"] = str(settings.broker_admin_password_file)
    values["broker_provisioner"] = settings.broker_provisioner.value
    if settings.broker_auth_secret_file is not None:
        values["broker_auth_secret_file"] = str(settings.broker_auth_secret_file)
    if settings.broker_auth_listen:
        values["broker_auth_listen"] = settings.broker_auth_listen
    values["telemetry_retention_days"] = settings.telemetry_retention_days
    values["timestamp_refresh_s"] = settings.timestamp_refresh_s
    values["max_bundle_bytes"] = settings.max_bundle_bytes
    values["repository_http"] = settings.repository_http
    values["inference_interval_s"] = settings.inference_interval_s
    values["rollout_lease_s"] = settings.rollout_lease_s
    values["ui_session_hours"] = settings.ui_session_hours
    if settings.replica_name:
        values["replica_name"] = settings.replica_name
    if settings.shared_dir is not None:
        values["shared_dir"] = str(settings.shared_dir)
    if settings.otlp_endpoint:
        values["otlp_endpoint"] = settings.otlp_endpoint
    text = "# Written by mcp-controlplane init; edit freely.\n" + "".join(
        f"{k} = {_toml_value(v)}\n" for k, v in values.items()
    )
    if settings.drift_policy != DriftPolicy():  # tables come after every top-level key
        text += "\n[drift_policy]\n" + "".join(
            f"{k} = {_toml_value(v)}\n" for k, v in settings.drift_policy.model_dump().items()
        )
    for hook in settings.webhooks:  # tables come after every top-level key in TOML
        entry: dict[str, object] = {
            "name": hook.name,
            "url": hook.url,
            "secret_file": str(hook.secret_file),
            "events": list(hook.events),
            "timeout_s": hook.timeout_s,
            "max_attempts": hook.max_attempts,
        }
        text += "\n[[webhooks]]\n" + "".join(f"{k} = {_toml_value(v)}\n" for k, v in entry.items())
    atomic_write_bytes(settings.config_path, text.encode("utf-8"), mode=0o600)
    return settings.config_path


def environment() -> dict[str, str]:
    """A snapshot of the process environment (the CLI passes it to :func:`load_settings`)."""
    return dict(os.environ)
