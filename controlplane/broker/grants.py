"""What a broker account may do, decided without I/O: the rules the HTTP hooks apply.

An account's topics are its role's ACLs from :mod:`controlplane.broker.acl`, the very lists the
dynamic-security implementation hands to Mosquitto, read the way the plugin reads them: the
first ACL (highest priority first) of the asked kind that matches the topic decides, and no
match denies (default access deny). A requested subscription is covered by an ACL's filter when
every topic it can match is matched by that filter (``+`` covers one level, ``#`` the rest), so
``$share/cp/mcp/v1/dev/+/status`` is covered by the service role's ``$share/+/mcp/v1/dev/+/#``
and by nothing a device or an application holds.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass

from mcp_edge.controlplane.broker.acl import (
    AccountKind,
    AccountSpec,
    Acl,
    AclType,
    app_client_account,
    device_account,
    service_account,
)
from mcp_edge.shared.errors import TopicError
from mcp_edge.shared.protocol import topics


class Access(enum.Enum):
    """What a client asks to do with a topic."""

    PUBLISH = "publish"  # the client sends a message
    RECEIVE = "receive"  # the broker is about to deliver a message to the client
    SUBSCRIBE = "subscribe"  # the client subscribes to a filter ($share/... included)


class Verdict(enum.Enum):
    """The answer to a login or an ACL check; every value but ALLOW says why it was denied."""

    ALLOW = "allowed"
    UNKNOWN_ACCOUNT = "no such account"
    DISABLED = "account disabled"
    WRONG_CLIENT_ID = "client id not bound to this account"
    WRONG_PASSWORD = "wrong password"
    NOT_PERMITTED = "topic not permitted"

    @property
    def allowed(self) -> bool:
        return self is Verdict.ALLOW


def valid_topic(topic: str) -> bool:
    """A topic a message can be published on: not empty, no wildcard, no NUL, not too long."""
    return (
        0 < len(topic) <= topics.MAX_TOPIC_LENGTH
        and "\x00" not in topic
        and "+" not in topic
        and "#" not in topic
    )


def valid_subscription(topic_filter: str) -> bool:
    """A filter a client can subscribe to: MQTT filter syntax, and ``$share/{group}/{filter}``
    with a group free of wildcards and a filter after it."""
    try:
        topics.validate_filter(topic_filter)
    except TopicError:
        return False
    if topic_filter.startswith(topics.SHARE_PREFIX + "/"):
        parts = topic_filter.split("/", 2)
        return len(parts) == 3 and parts[1] not in ("", "+", "#") and parts[2] != ""
    return True


def filter_covers(pattern: str, requested: str) -> bool:
    """Whether every topic ``requested`` can match is matched by ``pattern`` (both filters)."""
    p_levels, r_levels = pattern.split("/"), requested.split("/")
    if requested.startswith("$") and p_levels[0] in ("+", "#"):
        return False  # MQTT 5 §4.7.2: a leading wildcard never matches a $ topic
    for i, level in enumerate(p_levels):
        if level == "#":
            return True
        if i >= len(r_levels):
            return False
        if r_levels[i] == "#":  # '#' matches its parent level too, which '+/#' covers at the top
            return i == 0 and p_levels == ["+", "#"]
        if level != "+" and (r_levels[i] == "+" or level != r_levels[i]):
            return False
    return len(p_levels) == len(r_levels)


_KINDS = {
    Access.PUBLISH: (AclType.PUBLISH_SEND,),
    Access.RECEIVE: (AclType.PUBLISH_RECEIVE,),
    Access.SUBSCRIBE: (AclType.SUBSCRIBE_PATTERN, AclType.SUBSCRIBE_LITERAL),
}


@dataclass(frozen=True)
class Grant:
    """What one enabled account, connected with its own client id, may do: its role's ACLs."""

    username: str
    acls: tuple[Acl, ...]

    def permits(self, access: Access, topic: str) -> bool:
        """Whether the first ACL (highest priority first) that matches ``topic`` for
        ``access`` allows it; no match, or a malformed topic, denies."""
        if access is Access.SUBSCRIBE:
            if not valid_subscription(topic):
                return False
        elif not valid_topic(topic):
            return False
        kinds = _KINDS[access]
        for acl in sorted(self.acls, key=lambda a: -a.priority):
            if acl.acl_type in kinds and _acl_matches(acl, topic):
                return acl.allow
        return False

    def permits_shared_real_topic(self, topic_filter: str) -> bool:
        """For brokers that check a shared subscription by its real filter only (EMQX strips
        ``$share/{group}/`` before it asks): whether ``topic_filter`` may be subscribed to
        directly, or through a shared subscription in some group this role may use."""
        if self.permits(Access.SUBSCRIBE, topic_filter):
            return True
        if not valid_subscription(topic_filter) or topic_filter.startswith("$"):
            return False
        prefix = topics.SHARE_PREFIX + "/"
        return any(
            acl.allow
            and acl.acl_type is AclType.SUBSCRIBE_PATTERN
            and acl.topic.startswith(prefix)
            and filter_covers(acl.topic.split("/", 2)[2], topic_filter)
            for acl in self.acls
        )


def _acl_matches(acl: Acl, topic: str) -> bool:
    if acl.acl_type is AclType.SUBSCRIBE_LITERAL:
        return acl.topic == topic
    if acl.acl_type is AclType.SUBSCRIBE_PATTERN:
        return filter_covers(acl.topic, topic)
    return topics.matches(acl.topic, topic)


@functools.lru_cache(maxsize=4096)
def _role_acls(kind: AccountKind, client_id: str, share_group: str) -> tuple[Acl, ...]:
    return _spec(kind, client_id, share_group).acls


def _spec(kind: AccountKind, client_id: str, share_group: str) -> AccountSpec:
    if kind is AccountKind.DEVICE:
        return device_account(client_id, share_group=share_group)
    if kind is AccountKind.SERVICE:
        return service_account(client_id)
    return app_client_account(client_id)


def kind_name(kind: AccountKind) -> str:
    """How ``broker_accounts.kind`` spells ``kind``: ``device``, ``service`` or ``app``."""
    return kind.name.lower()


def kind_of(name: str) -> AccountKind | None:
    """The kind ``broker_accounts.kind`` spells ``name``; None for an unknown spelling."""
    return AccountKind.__members__.get(name.upper())


def role_grant(kind: AccountKind, username: str, client_id: str, share_group: str) -> Grant:
    """What the ``kind`` account ``username`` bound to ``client_id`` may do.

    Raises :class:`TopicError` for a client id or share group no provisioner would accept.
    """
    return Grant(username, _role_acls(kind, client_id, share_group))
