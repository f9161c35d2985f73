"""Broker accounts through Mosquitto's dynamic-security plugin, spoken over MQTT 5.

:class:`DynsecProvisioner` implements :class:`~controlplane.broker.base.BrokerProvisioner` with
one admin connection; paho's network loop runs in its thread and hands events to asyncio with
``call_soon_threadsafe``. Each call publishes one batch of commands to ``$CONTROL/dynamic-
security/v1``; Mosquitto runs a batch in one go and answers on ``.../response`` with one result
per command, matched here by each command's ``correlationData``. The commands themselves are
built by the pure :mod:`controlplane.broker.acl`.

Every refusal, timeout, lost connection or paho error reaches the caller as
:class:`~controlplane.broker.base.BrokerAdminError` (chained to the library's exception); an
invalid id raises :class:`~shared.errors.TopicError` before anything is sent. A call that timed
out may still be applied later; operations are idempotent, so a retry is safe. paho reconnects
a dropped session in the background; calls made meanwhile fail at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import socket
import ssl
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from socket import IPPROTO_TCP, TCP_NODELAY
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.reasoncodes import ReasonCode

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
from mcp_edge.shared.netutil import close_with_reset, is_self_connected

COMMAND_TOPIC = "$CONTROL/dynamic-security/v1"
RESPONSE_TOPIC = "$CONTROL/dynamic-security/v1/response"
# The plugin's error strings (Mosquitto 2.0.11) that idempotent operations accept.
CLIENT_NOT_FOUND = "Client not found"
ROLE_NOT_FOUND = "Role not found"
ROLE_EXISTS = "Role already exists"

Command = dict[str, Any]
_log = logging.getLogger(__name__)


@dataclass
class _Batch:  # a published batch waiting for its answers, by command index
    future: asyncio.Future[list[Command]]
    size: int
    answers: dict[int, Command] = field(default_factory=dict)


class DynsecProvisioner:
    """Creates, disables and deletes broker accounts through the dynamic-security plugin.

    Use as ``async with DynsecProvisioner(host, port, user, password) as provisioner:``; the
    context owns the admin connection. ``timeout_s`` bounds the TCP connect, the login and each
    command batch (seconds). ``fleet_share_group`` is the share group devices may use for
    fleet inference requests; ``ssl_context`` turns on TLS.
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
    ) -> None:
        self._host = host
        self._port = port
        self._where = f"{host}:{port}"
        self._admin_username = admin_username
        self._timeout_s = timeout_s
        self._share_group = fleet_share_group
        # Admin accounts are not bound to a client id; a random suffix lets replicas share one.
        client_id = f"{client_id_prefix}-{secrets.token_hex(4)}"
        self._client = mqtt.Client(
            CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5
        )
        self._client.username_pw_set(admin_username, admin_password)
        if ssl_context is not None:  # commands carry new passwords: use TLS off the host
            self._client.tls_set_context(ssl_context)
        self._client.connect_timeout = timeout_s
        self._client.reconnect_delay_set(min_delay=1, max_delay=30)
        self._client.on_socket_open = self._on_socket_open
        self._client.on_connect = self._on_connect
        self._client.on_subscribe = self._on_subscribe
        self._client.on_disconnect = self._on_disconnect
        self._client.on_message = self._on_message
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started: asyncio.Future[None] | None = None
        self._batches: dict[str, _Batch] = {}
        self._subscribe_mid: int | None = None
        self._ready = asyncio.Event()  # admin session up and subscribed to the answers
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
        if self._loop is not None:
            raise BrokerAdminError("this provisioner was already started")
        self._loop = asyncio.get_running_loop()
        self._started = self._loop.create_future()
        try:
            await asyncio.to_thread(self._client.connect, self._host, self._port, 30)
            sock = self._client.socket()
            if sock is None or sock.fileno() < 0:  # reset by _on_socket_open: a self-connect
                if self._started.done():  # paho's report of the dead socket, said better here
                    self._started.exception()
                raise ConnectionRefusedError("the socket connected to itself: nothing listens")
            self._client.loop_start()
            await asyncio.wait_for(self._started, self._timeout_s)
        except asyncio.TimeoutError as e:  # before OSError: on 3.11+ it is one
            await self.close()
            raise BrokerAdminError(
                f"no connection and admin login to the broker at {self._where} within "
                f"{self._timeout_s} s"
            ) from e
        except (OSError, ValueError) as e:
            await self.close()
            raise BrokerAdminError(f"cannot connect to the broker at {self._where}: {e}") from e
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        """Disconnect and stop paho's thread; pending calls fail. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._ready.clear()
        if self._started is not None and not self._started.done():
            self._started.cancel()
        self._client.disconnect()
        await asyncio.to_thread(self._client.loop_stop)
        self._fail_all(BrokerAdminError("the broker provisioner was closed"))

    @property
    def connected(self) -> bool:
        """Whether the admin session is up and subscribed to the plugin's answers."""
        return self._ready.is_set()

    async def wait_connected(self, timeout_s: float) -> None:
        """Wait until the admin session is up again (paho reconnects by itself).

        Raises BrokerAdminError: not up within ``timeout_s`` seconds.
        """
        try:
            await asyncio.wait_for(self._ready.wait(), timeout_s)
        except asyncio.TimeoutError as e:
            raise BrokerAdminError(f"no admin session to {self._where} within {timeout_s} s") from e

    @property
    def tcp_nodelay(self) -> bool:
        """Whether the live socket has Nagle's algorithm off (False when not connected)."""
        sock = self._client.socket()
        nodelay = isinstance(sock, socket.socket) and sock.getsockopt(IPPROTO_TCP, TCP_NODELAY)
        return bool(nodelay)

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
        probes = [{"command": "getClient", "username": u} for u in others]
        answers = await self._execute(
            [*probes, {"command": "getRole", "rolename": spec.role}],
            tolerate={CLIENT_NOT_FOUND, ROLE_NOT_FOUND},
        )
        for username, answer in zip(others, answers[:-1], strict=True):
            if "error" not in answer:
                raise AccountConflictError(spec.client_id, username)
        try:
            current = None if "error" in answers[-1] else _role_acls(answers[-1])
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise BrokerAdminError(f"unexpected getRole answer from the broker: {e!r}") from e
        password = secrets.token_urlsafe(32)
        await self._execute(
            [*role_commands(spec, current), *reset_client_commands(spec, password)],
            tolerate={CLIENT_NOT_FOUND, ROLE_EXISTS},
        )
        _log.info("broker account %s provisioned (client id %s)", spec.username, spec.client_id)
        return Credentials(username=spec.username, password=password, client_id=spec.client_id)

    async def _execute(
        self, commands: Sequence[Command], *, tolerate: Collection[str] = ()
    ) -> list[Command]:
        """Send ``commands`` as one batch; return one answer per command, in order.

        Raises:
            BrokerAdminError: not connected, paho refused the publish, no complete answer
                within ``timeout_s``, or an answer carries an error not in ``tolerate``.
        """
        loop = self._loop
        if loop is None or self._closed:
            raise BrokerAdminError("the broker provisioner is not started")
        if not self._ready.is_set():
            raise BrokerAdminError(f"not connected to the broker at {self._where}")
        batch_id = secrets.token_hex(8)
        tagged = [{**c, "correlationData": f"{batch_id}:{i}"} for i, c in enumerate(commands)]
        batch = _Batch(loop.create_future(), len(tagged))
        self._batches[batch_id] = batch
        names = ", ".join(c["command"] for c in commands)
        try:
            # QoS 0: the answer is the acknowledgement, and no command lingers in paho's queue
            # to be replayed after a reconnect.
            rc = self._client.publish(COMMAND_TOPIC, json.dumps({"commands": tagged})).rc
            if rc != mqtt.MQTT_ERR_SUCCESS:
                raise BrokerAdminError(f"cannot send dynsec {names}: {mqtt.error_string(rc)}")
            answers = await asyncio.wait_for(batch.future, self._timeout_s)
        except asyncio.TimeoutError as e:
            raise BrokerAdminError(
                f"the broker at {self._where} did not answer dynsec {names} within "
                f"{self._timeout_s} s"
            ) from e
        except ValueError as e:  # paho: payload or topic unusable
            raise BrokerAdminError(f"cannot send dynsec {names}: {e}") from e
        finally:
            self._batches.pop(batch_id, None)
        for command, answer in zip(commands, answers, strict=True):
            error = answer.get("error")
            if error is not None and error not in tolerate:
                subject = command.get("username") or command.get("rolename") or ""
                raise BrokerAdminError(f"dynsec {command['command']} {subject} refused: {error}")
        return answers

    # ---- paho callbacks (paho's thread) ----------------------------------------------------

    def _on_socket_open(self, _client: mqtt.Client, _userdata: Any, sock: Any) -> None:
        if is_self_connected(sock):  # see shared.netutil; reset: no TIME_WAIT on the port
            _log.warning("broker admin: the connection to %s came back to its own socket "
                         "(nothing listens there); reset", self._where)
            close_with_reset(sock)
            return
        # Nagle's algorithm delays small request/response packets by tens of ms (DESIGN §8).
        if isinstance(sock, socket.socket) and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(IPPROTO_TCP, TCP_NODELAY, 1)

    def _on_connect(
        self, client: mqtt.Client, _u: Any, _flags: Any, reason: ReasonCode, _p: Any
    ) -> None:
        if reason.is_failure:
            self._post(
                self._login_failed,
                f"the broker at {self._where} refused the admin login as "
                f"{self._admin_username!r}: {reason}",
            )
            return
        rc, self._subscribe_mid = client.subscribe(RESPONSE_TOPIC, qos=1)
        if rc != mqtt.MQTT_ERR_SUCCESS:
            self._post(self._login_failed, f"cannot subscribe: {mqtt.error_string(rc)}")

    def _on_subscribe(
        self, _c: mqtt.Client, _u: Any, mid: int, reasons: list[ReasonCode], _p: Any
    ) -> None:
        if mid != self._subscribe_mid:
            return
        if reasons and not reasons[0].is_failure:
            self._post(self._session_ready)
        else:
            who = self._admin_username
            self._post(self._login_failed, f"{who!r} may not read {RESPONSE_TOPIC}: not an admin")

    def _on_disconnect(
        self, _c: mqtt.Client, _u: Any, _flags: Any, reason: ReasonCode, _p: Any
    ) -> None:
        self._post(self._connection_lost, str(reason))

    def _on_message(self, _c: mqtt.Client, _u: Any, message: mqtt.MQTTMessage) -> None:
        if message.topic == RESPONSE_TOPIC:
            self._post(self._take_answers, bytes(message.payload))

    def _post(self, callback: Any, *args: Any) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # the loop closed after the check
            loop.call_soon_threadsafe(callback, *args)

    # ---- state changes (asyncio's thread) --------------------------------------------------

    def _session_ready(self) -> None:
        if not self._closed:
            self._ready.set()
            self._settle_start(None, f"broker admin session to {self._where} restored")

    def _login_failed(self, message: str) -> None:
        if not self._closed:
            self._ready.clear()
            self._settle_start(BrokerAdminError(message), message)

    def _connection_lost(self, reason: str) -> None:
        if not self._closed:
            self._ready.clear()
            message = f"connection to the broker at {self._where} lost: {reason}"
            self._settle_start(BrokerAdminError(message), message + "; reconnecting")
            self._fail_all(BrokerAdminError(message))

    def _settle_start(self, error: BrokerAdminError | None, log_message: str) -> None:
        """Complete :meth:`start`'s wait, or log ``log_message`` after start-up."""
        started = self._started
        if started is not None and not started.done():
            if error is None:
                started.set_result(None)
            else:
                started.set_exception(error)
        else:
            _log.log(logging.INFO if error is None else logging.WARNING, "%s", log_message)

    def _fail_all(self, error: BrokerAdminError) -> None:
        for batch in self._batches.values():
            if not batch.future.done():
                batch.future.set_exception(error)

    def _take_answers(self, payload: bytes) -> None:
        try:
            for answer in json.loads(payload)["responses"]:
                batch_id, _, index = str(answer.get("correlationData", "")).partition(":")
                batch = self._batches.get(batch_id)
                # No batch: the answer to one that timed out.
                if batch is None or batch.future.done() or not index.isdigit():
                    continue
                if int(index) < batch.size:
                    batch.answers[int(index)] = answer
                if len(batch.answers) == batch.size:
                    batch.future.set_result([batch.answers[i] for i in range(batch.size)])
        except (ValueError, KeyError, TypeError, AttributeError):
            _log.warning("dropped a malformed dynsec answer (%d bytes)", len(payload))


def _role_acls(answer: Command) -> set[AclKey]:
    """The ACLs a ``getRole`` answer lists; raises KeyError/TypeError/ValueError when it does
    not have the documented shape."""
    return {acl_key(acl) for acl in answer["data"]["role"].get("acls", [])}
