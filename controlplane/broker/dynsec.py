"""Broker accounts through Mosquitto's dynamic-security plugin, spoken over MQTT 5.

:class:`DynsecProvisioner` implements :class:`~controlplane.broker.base.BrokerProvisioner` with
one admin session of the one MQTT adapter (:class:`mcp_edge.shared.mqtt.Session`: paho on the
event loop, no paho thread; reconnected with :data:`controlplane.mqtt.CP_RECONNECT`). Each call
hands its commands to a :class:`~controlplane.broker.batching.CommandBatcher`, which merges the
commands of concurrent calls into one message to ``$CONTROL/dynamic-security/v1`` per short
window (one message in flight at a time); Mosquitto runs a message in one go and answers on
``.../response`` with one result per command, matched, inside the read that brought the
answer, by each command's ``correlationData``, so every call gets its own answers and a command
that fails fails only its call. A device account costs two round trips (a probe, then the
change), shared with every account provisioned in the same windows. The commands themselves
are built by the pure :mod:`controlplane.broker.acl`.

Mosquitto 2.0.x writes its whole ``dynamic-security.json`` after every command that changes
something (2.1: once per message), so on 2.0 the broker's cost of one new account (a role and
a client: two rewrites) grows with the number of accounts; batching saves round trips there,
not rewrites.

Every refusal, timeout, lost connection or MQTT error reaches the caller as
:class:`~controlplane.broker.base.BrokerAdminError` (chained to the adapter's
:class:`~mcp_edge.shared.mqtt.MqttError`); an invalid id raises
:class:`~shared.errors.TopicError` before anything is sent. A call that timed out may still be
applied later; operations are idempotent, so a retry is safe. A dropped session is reconnected
in the background; calls waiting then fail at once, and calls made meanwhile too.
"""

from __future__ import annotations

import logging
import secrets
import ssl
from collections.abc import Collection, Sequence

from mcp_edge.controlplane.broker.acl import (
    DEFAULT_FLEET_SHARE_GROUP,
    AccountKind,
    AccountSpec,
    AclKey,
    acl_key,
    app_client_account,
    device_account,
    reset_client_commands,
    role_commands,
    service_account,
    username_for,
    usernames_bound_to,
)
from mcp_edge.controlplane.broker.base import AccountConflictError, BrokerAdminError, Credentials
from mcp_edge.controlplane.broker.batching import Command, CommandBatcher
from mcp_edge.controlplane.mqtt import CP_RECONNECT
from mcp_edge.shared.mqtt import (
    RETAIN_DO_NOT_SEND,
    InboundMessage,
    MqttClient,
    MqttConnectError,
    MqttError,
    MqttRefusedError,
    MqttSettings,
    ReconnectPolicy,
    Session,
    Subscription,
)

COMMAND_TOPIC = "$CONTROL/dynamic-security/v1"
RESPONSE_TOPIC = "$CONTROL/dynamic-security/v1/response"
# The plugin's error strings (Mosquitto 2.0.11) that idempotent operations accept.
CLIENT_NOT_FOUND = "Client not found"
ROLE_NOT_FOUND = "Role not found"
ROLE_EXISTS = "Role already exists"

BATCH_WINDOW_S = 0.005
"""How long the first command of a message waits for others to join it (seconds)."""
MAX_BATCH_COMMANDS = 256
"""The most commands one message carries."""

_log = logging.getLogger(__name__)


class DynsecProvisioner:
    """Creates, disables and deletes broker accounts through the dynamic-security plugin.

    Use as ``async with DynsecProvisioner(host, port, user, password) as provisioner:``; the
    context owns the admin connection. ``timeout_s`` bounds the TCP connect, the login, and the
    answer to each call's commands (seconds; a message carrying the commands of n calls gets
    n times that). ``batch_window_s`` and ``max_batch_commands`` shape the messages (see
    :mod:`controlplane.broker.batching`). ``fleet_share_group`` is the share group devices may
    use for fleet inference requests; ``ssl_context`` turns on TLS; ``reconnect`` paces the
    admin session's reconnects after a loss.
    """

    def __init__(
        self,
        host: str,
        port: int,
        admin_username: str,
        admin_password: str,
        *,
        timeout_s: float = 5.0,
        client_id_prefix: str = "mcp-cp-admin",
        fleet_share_group: str = DEFAULT_FLEET_SHARE_GROUP,
        ssl_context: ssl.SSLContext | None = None,
        reconnect: ReconnectPolicy = CP_RECONNECT,
        batch_window_s: float = BATCH_WINDOW_S,
        max_batch_commands: int = MAX_BATCH_COMMANDS,
    ) -> None:
        self._where = f"{host}:{port}"
        self._admin_username = admin_username
        self._share_group = fleet_share_group
        # Admin accounts are not bound to a client id; a random suffix lets replicas share one.
        # Commands carry new passwords: give ``ssl_context`` when the broker is off the host.
        self._client = MqttClient(MqttSettings(
            host=host, port=port, client_id=f"{client_id_prefix}-{secrets.token_hex(4)}",
            username=admin_username, password=admin_password, keepalive_s=30,
            clean_start=True, session_expiry_s=0, tls=ssl_context,
            connect_timeout_s=timeout_s, ack_timeout_s=timeout_s,
        ))  # fmt: skip
        self._client.set_handler(self._on_message)
        self._session = Session(
            self._client, name="broker-admin", policy=reconnect, on_down=self._connection_lost
        )
        self._batcher = CommandBatcher(
            lambda payload: self._client.send(COMMAND_TOPIC, payload),
            timeout_s=timeout_s,
            window_s=batch_window_s,
            max_commands=max_batch_commands,
            where=self._where,
        )
        self._started = False
        self._closed = False

    async def __aenter__(self) -> DynsecProvisioner:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Connect, log in and subscribe to the plugin's answers.

        Raises BrokerAdminError: unreachable broker, refused login, not an admin account, no
        answer within ``timeout_s``, or started twice.
        """
        if self._started:
            raise BrokerAdminError("this provisioner was already started")
        self._started = True
        await self._client.subscribe(
            Subscription(RESPONSE_TOPIC, qos=1, retain_handling=RETAIN_DO_NOT_SEND)
        )
        try:
            await self._session.start(wait=True)
        except MqttConnectError as e:
            await self.close()
            if e.reason_code is not None:
                raise BrokerAdminError(
                    f"the broker at {self._where} refused the admin login as "
                    f"{self._admin_username!r}: {e.reason}"
                ) from e
            raise BrokerAdminError(str(e)) from e
        except MqttRefusedError as e:
            await self.close()
            raise BrokerAdminError(
                f"{self._admin_username!r} may not read {RESPONSE_TOPIC}: not an admin"
            ) from e
        except MqttError as e:
            await self.close()
            raise BrokerAdminError(f"no admin session to the broker at {self._where}: {e}") from e
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        """Disconnect and stop reconnecting; pending calls fail. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        await self._session.close()
        self._fail_all(BrokerAdminError("the broker provisioner was closed"))

    @property
    def connected(self) -> bool:
        """Whether the admin session is up and subscribed to the plugin's answers."""
        return self._session.up

    async def wait_connected(self, timeout_s: float) -> None:
        """Wait until the admin session is up again (it reconnects by itself).

        Raises BrokerAdminError: not up within ``timeout_s`` seconds.
        """
        try:
            await self._session.wait_up(timeout_s)
        except MqttError as e:
            raise BrokerAdminError(f"no admin session to {self._where} within {timeout_s} s") from e

    @property
    def messages_sent(self) -> int:
        """Command messages published to the plugin so far (each carries many calls'
        commands when calls overlap)."""
        return self._batcher.messages_sent

    @property
    def commands_sent(self) -> int:
        """Commands those messages carried."""
        return self._batcher.commands_sent

    @property
    def tcp_nodelay(self) -> bool:
        """Whether the live socket has Nagle's algorithm off (False when not connected)."""
        return self._client.tcp_nodelay

    # ---- BrokerProvisioner: TopicError for an invalid id, BrokerAdminError otherwise ------

    async def provision_device(self, device_id: str) -> Credentials:
        """Create or reset ``dev-{device_id}`` (client id ``device_id``) with its own role.

        A new password every call; a disabled account comes back enabled, so the caller
        decides whether a revoked device may be provisioned again. Raises
        AccountConflictError when the client id is bound to another kind of account.
        """
        return await self._provision(device_account(device_id, share_group=self._share_group))

    async def provision_service(self, name: str) -> Credentials:
        """Create or reset ``svc-{name}`` (client id ``name``) with the shared service role."""
        return await self._provision(service_account(name))

    async def provision_app_client(self, client_id: str) -> Credentials:
        """Create or reset ``app-{client_id}`` (client id ``client_id``) with its own role."""
        return await self._provision(app_client_account(client_id))

    async def disable_device(self, device_id: str) -> None:
        """Disable the device's account: Mosquitto disconnects a live session at once and
        refuses new ones. A device without an account cannot connect anyway: no error."""
        username = username_for(AccountKind.DEVICE, device_id)
        await self._execute(
            [{"command": "disableClient", "username": username}], tolerate={CLIENT_NOT_FOUND}
        )

    async def enable_device(self, device_id: str) -> None:
        """Let a disabled device log in again; BrokerAdminError when it has no account."""
        username = username_for(AccountKind.DEVICE, device_id)
        await self._execute([{"command": "enableClient", "username": username}])

    async def delete_device(self, device_id: str) -> None:
        """Delete the device's account (disconnecting a live session) and its role."""
        spec = device_account(device_id, share_group=self._share_group)
        await self._execute(
            [
                {"command": "deleteClient", "username": spec.username},
                {"command": "deleteRole", "rolename": spec.role},
            ],
            tolerate={CLIENT_NOT_FOUND, ROLE_NOT_FOUND},
        )

    async def disable_app_client(self, client_id: str) -> None:
        """Disable ``app-{client_id}``: Mosquitto disconnects a live session at once and
        refuses new ones. No account: no error (nothing can log in as it anyway)."""
        username = username_for(AccountKind.APP, client_id)
        await self._execute(
            [{"command": "disableClient", "username": username}], tolerate={CLIENT_NOT_FOUND}
        )
        _log.info("broker account %s disabled", username)

    async def delete_app_client(self, client_id: str) -> None:
        """Delete ``app-{client_id}`` (disconnecting a live session) and its role."""
        spec = app_client_account(client_id)
        await self._execute(
            [
                {"command": "deleteClient", "username": spec.username},
                {"command": "deleteRole", "rolename": spec.role},
            ],
            tolerate={CLIENT_NOT_FOUND, ROLE_NOT_FOUND},
        )

    async def _provision(self, spec: AccountSpec) -> Credentials:
        # Any account may take over the session of another that uses the same client id, so
        # refuse a client id that another kind of account is already bound to.
        others = [u for u in usernames_bound_to(spec.client_id) if u != spec.username]
        probes = [{"command": "getClient", "username": u} for u in [*others, spec.username]]
        answers = await self._execute(
            [*probes, {"command": "getRole", "rolename": spec.role}],
            tolerate={CLIENT_NOT_FOUND, ROLE_NOT_FOUND},
        )
        for username, answer in zip(others, answers, strict=False):
            if "error" not in answer:
                raise AccountConflictError(spec.client_id, username)
        exists = "error" not in answers[len(others)]
        try:
            current = None if "error" in answers[-1] else _role_acls(answers[-1])
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise BrokerAdminError(f"unexpected getRole answer from the broker: {e!r}") from e
        password = secrets.token_urlsafe(32)
        # A new account needs no delete: Mosquitto 2.0 rewrites its file for every change.
        reset = reset_client_commands(spec, password)[0 if exists else 1 :]
        await self._execute(
            [*role_commands(spec, current), *reset],
            tolerate={CLIENT_NOT_FOUND, ROLE_EXISTS},
        )
        _log.info("broker account %s provisioned (client id %s)", spec.username, spec.client_id)
        return Credentials(username=spec.username, password=password, client_id=spec.client_id)

    async def _execute(
        self, commands: Sequence[Command], *, tolerate: Collection[str] = ()
    ) -> list[Command]:
        """Send ``commands`` (merged with other calls' into the next message); return one
        answer per command, in order.

        Raises:
            BrokerAdminError: not connected, paho refused the publish, no complete answer
                in time, or an answer carries an error not in ``tolerate``.
        """
        if not self._started or self._closed:
            raise BrokerAdminError("the broker provisioner is not started")
        if not self._session.up:
            raise BrokerAdminError(f"not connected to the broker at {self._where}")
        answers = await self._batcher.run(commands)
        for command, answer in zip(commands, answers, strict=True):
            error = answer.get("error")
            if error is not None and error not in tolerate:
                subject = command.get("username") or command.get("rolename") or ""
                raise BrokerAdminError(f"dynsec {command['command']} {subject} refused: {error}")
        return answers

    # ---- the admin session (on the loop) -----------------------------------------------------

    def _on_message(self, message: InboundMessage) -> None:
        if message.topic == RESPONSE_TOPIC:
            self._batcher.take_answers(message.payload)

    def _connection_lost(self, reason: str) -> None:
        self._fail_all(
            BrokerAdminError(f"connection to the broker at {self._where} lost: {reason}")
        )

    def _fail_all(self, error: BrokerAdminError) -> None:
        self._batcher.fail_all(error)


def _role_acls(answer: Command) -> set[AclKey]:
    """The ACLs a ``getRole`` answer lists; raises KeyError/TypeError/ValueError when it does
    not have the documented shape."""
    return {acl_key(acl) for acl in answer["data"]["role"].get("acls", [])}
