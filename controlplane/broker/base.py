"""The interface the control plane uses to manage broker accounts, whatever the broker.

Mosquitto's dynamic-security plugin is the implementation shipped today
(:mod:`controlplane.broker.dynsec`); an EMQX or HiveMQ implementation would provide the same
methods. Every account is bound to one client id, and every ACL is a literal topic list built
with :mod:`shared.protocol.topics` (Mosquitto 2.0's dynsec does not expand ``%c``/``%u``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from mcp_edge.shared.errors import McpError


class BrokerAdminError(McpError):
    """The broker refused or did not answer an administration request."""


class AccountConflictError(BrokerAdminError):
    """The client id is already bound to another kind of account (a device id that a service
    or an application uses, or the other way round). Retrying will not help; the message names
    that account, so it is for the operator's log, never for the client that asked."""

    def __init__(self, client_id: str, holder: str) -> None:
        super().__init__(f"client id {client_id!r} already belongs to account {holder!r}")
        self.client_id = client_id
        self.holder = holder


@dataclass(frozen=True)
class Credentials:
    """An MQTT account: the client must connect with exactly this client id."""

    username: str
    password: str
    client_id: str

    def __repr__(self) -> str:  # never log the password
        return f"Credentials(username={self.username!r}, client_id={self.client_id!r})"


class BrokerProvisioner(Protocol):
    """Creates, disables and removes broker accounts. All methods are idempotent."""

    async def provision_device(self, device_id: str) -> Credentials:
        """Create (or reset the password of) the device's account with its per-device role:
        publish/subscribe only on its own topics, the fleet inference topics and client reply
        topics; everything else denied. Raises :class:`AccountConflictError` when another kind
        of account holds the client id."""
        ...

    async def provision_service(self, name: str) -> Credentials:
        """An account for a control-plane replica: every device topic, shared subscriptions."""
        ...

    async def provision_app_client(self, client_id: str) -> Credentials:
        """An account for an application that sends inference requests and reads its replies.
        Raises :class:`AccountConflictError` when another kind of account holds the client
        id."""
        ...

    async def disable_device(self, device_id: str) -> None:
        """Disable the account and disconnect a live session (revocation)."""
        ...

    async def enable_device(self, device_id: str) -> None: ...

    async def delete_device(self, device_id: str) -> None: ...

    async def disable_app_client(self, client_id: str) -> None:
        """Disable the application's account and disconnect a live session (revocation); no
        error when it has no account."""
        ...

    async def delete_app_client(self, client_id: str) -> None:
        """Delete the application's account (disconnecting a live session) and its role."""
        ...
