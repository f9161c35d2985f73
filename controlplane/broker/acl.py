"""The broker accounts MCP Edge creates, as pure data: who connects as what, allowed to do what.

Three kinds of account, each bound to one MQTT client id::

    kind     username          client id    role                ACLs (everything else denied)
    device   dev-{device}      {device}     device-{device}     its own topics, literal; fleet
                                                                inference (shared subscription);
                                                                replies to application clients
                                                                on token-suffixed topics only
    service  svc-{name}        {name}       controlplane        every device topic, shared
                                                                subscriptions in any group
    app      app-{client}      {client}     app-{client}        inference requests; its own
                                                                reply topics

Device roles are literal topic lists because Debian's Mosquitto 2.0.x does not expand
``%c``/``%u`` in dynamic-security ACLs. The broker's default ACL access is deny for all four
ACL kinds (``deploy/mosquitto/bootstrap.sh``), so a role lists everything its account may do,
including the ``unsubscribe`` twin of each subscription and the ``publishClientReceive`` that
lets a granted subscription deliver anything.

Shared subscriptions: Mosquitto 2.0.11 checks the subscribe and unsubscribe ACLs against the
whole ``$share/{group}/{filter}`` string, and ``publishClientReceive`` against each delivered
message's plain topic. Granting ``{filter}`` does not allow ``$share/{group}/{filter}`` and
vice versa, so a device may take fleet requests only through the one share group (it cannot
read every request by subscribing without ``$share``).

Replies to applications: a device may publish on ``mcp/v1/client/+/reply/+`` and never on a
bare ``.../reply``. The last level is the token an application client draws for its session
(:class:`shared.protocol.topics.ClientReplyTopic`) and the only topic it subscribes to, so a
device can reach an application only on a topic it was sent in a request. The broker cannot
tell a real token from a guess; the token's 128 random bits do.

Every topic and filter comes from :mod:`shared.protocol.topics`; where a level must be ``+``
it is built there with a placeholder identifier and widened at a fixed position.

The last section spells the dynamic-security commands that realise a spec. This module
performs no I/O; :mod:`controlplane.broker.dynsec` sends those commands and reads the answers.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from mcp_edge.shared.errors import TopicError
from mcp_edge.shared.protocol import topics
from mcp_edge.shared.protocol.topics import Channel, TelemetryKind

DEFAULT_FLEET_SHARE_GROUP = "agents"
SERVICE_ROLE = "controlplane"

# A valid identifier that ``_widen`` replaces by ``+`` at one known level.
_ANY = "any-level"


class AclType(str, enum.Enum):
    """Mosquitto dynamic-security ACL kinds (the JSON ``acltype`` values)."""

    PUBLISH_SEND = "publishClientSend"
    PUBLISH_RECEIVE = "publishClientReceive"
    SUBSCRIBE_LITERAL = "subscribeLiteral"
    SUBSCRIBE_PATTERN = "subscribePattern"
    UNSUBSCRIBE_LITERAL = "unsubscribeLiteral"
    UNSUBSCRIBE_PATTERN = "unsubscribePattern"


class AccountKind(str, enum.Enum):
    """Who an account belongs to; the value prefixes the username."""

    DEVICE = "dev"
    SERVICE = "svc"
    APP = "app"


@dataclass(frozen=True)
class Acl:
    """One ACL entry of a role. ``topic`` is a topic filter (``+``/``#`` allowed).

    Raises :class:`TopicError` when ``topic`` is not a valid filter.
    """

    acl_type: AclType
    topic: str
    allow: bool = True
    priority: int = 0

    def __post_init__(self) -> None:
        topics.validate_filter(self.topic)


@dataclass(frozen=True)
class AccountSpec:
    """Everything needed to create one account: its identity and its role's ACLs."""

    kind: AccountKind
    username: str
    client_id: str
    role: str
    acls: tuple[Acl, ...]


def username_for(kind: AccountKind, client_id: str) -> str:
    """The username of the ``kind`` account bound to ``client_id``.

    Raises :class:`TopicError` when ``client_id`` is not a valid identifier.
    """
    return f"{kind.value}-{topics.validate_id(client_id, 'client id')}"


def usernames_bound_to(client_id: str) -> tuple[str, ...]:
    """The usernames of every kind of account that would be bound to ``client_id``.

    Mosquitto lets any authenticated client take over the session of another client with the
    same client id, whatever its username, so one client id must belong to one account only.
    """
    return tuple(username_for(kind, client_id) for kind in AccountKind)


def device_account(device_id: str, *, share_group: str = DEFAULT_FLEET_SHARE_GROUP) -> AccountSpec:
    """The account of one device: ``dev-{device_id}``, client id ``{device_id}``.

    Raises :class:`TopicError` for an invalid device id or share group.
    """
    return AccountSpec(
        kind=AccountKind.DEVICE,
        username=username_for(AccountKind.DEVICE, device_id),
        client_id=device_id,
        role=f"device-{device_id}",
        acls=device_acls(device_id, share_group=share_group),
    )


def service_account(name: str) -> AccountSpec:
    """The account of one control-plane replica: ``svc-{name}``, client id ``{name}``.

    Every replica shares the role :data:`SERVICE_ROLE`. Raises :class:`TopicError` for an
    invalid name.
    """
    return AccountSpec(
        kind=AccountKind.SERVICE,
        username=username_for(AccountKind.SERVICE, name),
        client_id=name,
        role=SERVICE_ROLE,
        acls=service_acls(),
    )


def app_client_account(client_id: str) -> AccountSpec:
    """The account of an application client: ``app-{client_id}``, client id ``{client_id}``.

    Raises :class:`TopicError` for an invalid client id.
    """
    return AccountSpec(
        kind=AccountKind.APP,
        username=username_for(AccountKind.APP, client_id),
        client_id=client_id,
        role=f"app-{client_id}",
        acls=app_client_acls(client_id),
    )


def device_acls(device_id: str, *, share_group: str = DEFAULT_FLEET_SHARE_GROUP) -> tuple[Acl, ...]:
    """The ACLs of ``device_id``'s role: its own topics spelled out literally.

    Publishes its status, reported state, events, telemetry, command replies and repository
    requests, and replies on token-suffixed application reply topics
    (:func:`client_reply_filter`); reads its desired state, commands, its
    own inference requests, repository replies, and fleet inference requests through
    ``$share/{share_group}/mcp/v1/fleet/infer/+``.
    """
    sends = [
        topics.status(device_id),
        topics.reported(device_id),
        topics.events(device_id),
        *(topics.telemetry(device_id, kind) for kind in TelemetryKind),
        topics.command_reply(device_id),
        topics.repo_request(device_id),
        client_reply_filter(),
    ]
    fleet_requests = fleet_infer_filter()
    return (
        *(Acl(AclType.PUBLISH_SEND, topic) for topic in sends),
        *_reader(topics.desired(device_id)),
        *_reader(topics.command(device_id)),
        *_reader(device_infer_filter(device_id)),
        *_reader(topics.repo_reply(device_id)),
        *_reader(
            fleet_requests, subscription=topics.shared_subscription(share_group, fleet_requests)
        ),
    )


def service_acls() -> tuple[Acl, ...]:
    """The ACLs of the control-plane role: read every device topic (directly or through a
    shared subscription in any group) and publish what the control plane sends to devices.

    ``status`` and ``reported`` are publishable so a replica can clear a removed device's
    retained messages; ``desired`` is retained by the publisher.
    """
    every_device = every_device_filter()
    any_share = _widen(topics.shared_subscription(_ANY, every_device), 1)
    sends = (Channel.DESIRED, Channel.COMMAND, Channel.REPO_REPLY, Channel.STATUS, Channel.REPORTED)
    return (
        *_reader(every_device),
        Acl(AclType.SUBSCRIBE_PATTERN, any_share),
        Acl(AclType.UNSUBSCRIBE_PATTERN, any_share),
        *(Acl(AclType.PUBLISH_SEND, topics.all_devices(channel)) for channel in sends),
    )


def app_client_acls(client_id: str) -> tuple[Acl, ...]:
    """The ACLs of an application client: send inference requests to the fleet or to any
    device, and read replies on its own reply topics only (``mcp/v1/client/{client_id}/reply/+``,
    any session token)."""
    return (
        Acl(AclType.PUBLISH_SEND, fleet_infer_filter()),
        Acl(AclType.PUBLISH_SEND, topics.all_devices(Channel.INFER)),
        *_reader(topics.client_replies(client_id)),
    )


def _reader(topic_filter: str, *, subscription: str | None = None) -> tuple[Acl, ...]:
    """Subscribe, unsubscribe and receive on ``topic_filter``; the (un)subscribe ACLs name
    ``subscription`` instead when given (a ``$share`` form of the same filter)."""
    subscribe_to = topic_filter if subscription is None else subscription
    return (
        Acl(AclType.SUBSCRIBE_PATTERN, subscribe_to),
        Acl(AclType.UNSUBSCRIBE_PATTERN, subscribe_to),
        Acl(AclType.PUBLISH_RECEIVE, topic_filter),
    )


def every_device_filter() -> str:
    """``mcp/v1/dev/+/#``: every topic of every device."""
    return _widen(topics.device_subtree(_ANY), -2)


def device_infer_filter(device_id: str) -> str:
    """``mcp/v1/dev/{device_id}/infer/+``: the device's inference requests, any model."""
    return _widen(topics.device_infer(device_id, _ANY), -1)


def fleet_infer_filter() -> str:
    """``mcp/v1/fleet/infer/+``: fleet inference requests, any model."""
    return _widen(topics.fleet_infer(_ANY), -1)


def client_reply_filter() -> str:
    """``mcp/v1/client/+/reply/+``: every application client session's reply topic (never the
    bare ``.../reply``, which no client subscribes to)."""
    return _widen(topics.client_replies(_ANY), -3)


def _widen(topic: str, level: int) -> str:
    """Replace level ``level`` of ``topic`` (built with the placeholder there) by ``+``.

    The position is fixed, so an identifier that happens to equal the placeholder elsewhere in
    the topic (a device called ``any-level``) is never widened.
    """
    levels = topic.split("/")
    if levels[level] != _ANY:
        raise TopicError(f"level {level} of {topic!r} is not the wildcard placeholder")
    levels[level] = "+"
    return topics.validate_filter("/".join(levels))


# ---- the dynamic-security documents that realise an AccountSpec (still pure) ---------------

Document = dict[str, Any]
AclKey = tuple[str, str, int, bool]
"""An ACL as ``(acltype, topic, priority, allow)``, comparable with what ``getRole`` lists."""


def acl_document(acl: Acl) -> Document:
    """The dynsec JSON form of one ACL entry."""
    return {
        "acltype": acl.acl_type.value,
        "topic": acl.topic,
        "priority": acl.priority,
        "allow": acl.allow,
    }


def acl_key(document: Mapping[str, Any]) -> AclKey:
    """The comparable key of an ACL document (ours or one listed by ``getRole``).

    Raises ``KeyError``/``TypeError``/``ValueError`` on a document without that shape.
    """
    return (
        str(document["acltype"]),
        str(document["topic"]),
        int(document.get("priority", 0)),
        bool(document["allow"]),
    )


def role_commands(spec: AccountSpec, current: Collection[AclKey] | None) -> list[Document]:
    """Commands that make ``spec.role`` hold exactly ``spec.acls``.

    ``current`` is what the role holds now, or None when it does not exist. Editing in place
    (rather than deleting and recreating the role) keeps a role shared by several accounts,
    such as :data:`SERVICE_ROLE`, attached to all of them.
    """
    if current is None:
        documents = [acl_document(acl) for acl in spec.acls]
        return [{"command": "createRole", "rolename": spec.role, "acls": documents}]
    held = set(current)
    wanted = {acl_key(acl_document(acl)) for acl in spec.acls}
    removals = [
        {"command": "removeRoleACL", "rolename": spec.role, "acltype": kind, "topic": topic}
        for kind, topic, _priority, _allow in sorted(held - wanted)
    ]
    additions = [
        {"command": "addRoleACL", "rolename": spec.role, **acl_document(acl)}
        for acl in spec.acls
        if acl_key(acl_document(acl)) not in held
    ]
    return [*removals, *additions]


def reset_client_commands(spec: AccountSpec, password: str) -> list[Document]:
    """Delete and recreate ``spec``'s client with ``password``, bound to its client id and
    holding only its role. In one batch this resets the account atomically (password, client
    id, roles, groups, enabled again) and disconnects a live session."""
    return [
        {"command": "deleteClient", "username": spec.username},
        {
            "command": "createClient",
            "username": spec.username,
            "password": password,
            "clientid": spec.client_id,
            "textname": f"MCP Edge {spec.kind.name.lower()} {spec.client_id}",
            "roles": [{"rolename": spec.role}],
        },
    ]
