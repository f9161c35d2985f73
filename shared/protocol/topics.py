"""Every MQTT topic MCP Edge uses, built and parsed here and nowhere else.

Layout (``mcp/v1`` is :data:`PREFIX`; the version lets a fleet run two protocol versions side
by side during an upgrade)::

    mcp/v1/dev/{device}/status               retained "online"/"offline" (birth / last will)
    mcp/v1/dev/{device}/desired              retained, director-signed desired state (CP → dev)
    mcp/v1/dev/{device}/reported             retained reported state (dev → CP)
    mcp/v1/dev/{device}/events               deployment events, the flight recorder (dev → CP)
    mcp/v1/dev/{device}/telemetry/{kind}     kind ∈ health | inference | drift (dev → CP)
    mcp/v1/dev/{device}/cmd                  command requests (CP → dev)
    mcp/v1/dev/{device}/cmd/reply            command replies (dev → CP)
    mcp/v1/dev/{device}/infer/{model}        inference requests for one device
    mcp/v1/dev/{device}/repo                 repository requests: TUF metadata and chunks (dev → CP)
    mcp/v1/dev/{device}/repo/reply           repository replies (CP → dev)
    mcp/v1/fleet/infer/{model}               fleet-wide inference, load-balanced through
                                             $share/{group}/mcp/v1/fleet/infer/{model}
    mcp/v1/client/{client}/reply/{token}     where one application client session receives
                                             inference replies

Everything that carries a reply uses the MQTT 5 response topic and correlation data; the
``.../reply`` topics above are conventions for who may subscribe where, so per-device ACLs can
be literal topic lists (Mosquitto 2.0's dynsec does not expand ``%c``/``%u``).

Devices may publish on every ``mcp/v1/client/+/reply/+``, so what keeps one device from
answering requests it never received is the ``{token}``: an unguessable value the application
client draws for its session (:meth:`ClientReplyTopic.new`) and subscribes to alone. Only a
device that was sent a request knows it. Tokens are 22-64 characters of the URL-safe base64
alphabet ``[A-Za-z0-9_-]`` (at least 128 random bits); a reply topic without one does not parse.

Identifiers (device ids, model names, client ids, share groups) are 1-64 characters of
``[A-Za-z0-9._-]`` starting with a letter or digit: never ``/``, ``+``, ``#``, ``$``, spaces or
NUL, so an identifier can never widen a subscription or escape its subtree.
"""

from __future__ import annotations

import enum
import re
import secrets
from dataclasses import dataclass

from mcp_edge.shared.errors import TopicError

PREFIX = "mcp/v1"
SHARE_PREFIX = "$share"
MAX_TOPIC_LENGTH = 512
IDENTIFIER_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
"""What :func:`validate_id` accepts, as a regular expression (JSON Schema's ``pattern``)."""
_IDENT = re.compile(IDENTIFIER_PATTERN)
_REPLY_TOKEN = re.compile(r"[A-Za-z0-9_-]{22,64}")
REPLY_TOKEN_BYTES = 16
"""Random bytes in a new reply token: ``secrets.token_urlsafe(16)`` is 22 characters."""


def validate_id(value: str, what: str = "identifier") -> str:
    """Return ``value`` if it is a valid identifier for use inside a topic.

    Raises :class:`TopicError` naming ``what`` otherwise.
    """
    if not isinstance(value, str) or _IDENT.fullmatch(value) is None:
        raise TopicError(
            f"invalid {what} {value!r:.80}: use 1-64 characters of A-Z a-z 0-9 . _ -, "
            "starting with a letter or digit"
        )
    return value


class Channel(str, enum.Enum):
    """The kind of traffic a device topic carries."""

    STATUS = "status"
    DESIRED = "desired"
    REPORTED = "reported"
    EVENTS = "events"
    TELEMETRY = "telemetry"
    COMMAND = "cmd"
    COMMAND_REPLY = "cmd/reply"
    INFER = "infer"
    REPO = "repo"
    REPO_REPLY = "repo/reply"


class TelemetryKind(str, enum.Enum):
    HEALTH = "health"
    INFERENCE = "inference"
    DRIFT = "drift"


@dataclass(frozen=True)
class DeviceTopic:
    """A topic under ``mcp/v1/dev/{device}/``; ``detail`` is the telemetry kind or model name."""

    device_id: str
    channel: Channel
    detail: str | None = None

    def __post_init__(self) -> None:
        validate_id(self.device_id, "device id")
        needs_detail = self.channel in (Channel.TELEMETRY, Channel.INFER)
        if needs_detail and self.detail is None:
            raise TopicError(f"a {self.channel.value} topic needs a detail (kind or model)")
        if not needs_detail and self.detail is not None:
            raise TopicError(f"a {self.channel.value} topic takes no detail")
        if self.channel is Channel.TELEMETRY:
            try:
                TelemetryKind(self.detail)
            except ValueError as e:
                raise TopicError(f"unknown telemetry kind {self.detail!r}") from e
        elif self.channel is Channel.INFER:
            validate_id(str(self.detail), "model name")

    def __str__(self) -> str:
        base = f"{PREFIX}/dev/{self.device_id}/{self.channel.value}"
        return base if self.detail is None else f"{base}/{self.detail}"


@dataclass(frozen=True)
class FleetInferTopic:
    """``mcp/v1/fleet/infer/{model}``: a request any agent serving ``model`` may answer."""

    model: str

    def __post_init__(self) -> None:
        validate_id(self.model, "model name")

    def __str__(self) -> str:
        return f"{PREFIX}/fleet/infer/{self.model}"

    def shared(self, group: str = "agents") -> str:
        """The shared-subscription filter that load-balances requests across a group."""
        return shared_subscription(group, str(self))


def validate_reply_token(value: str) -> str:
    """Return ``value`` if it is a valid reply token (see the module docstring).

    Raises :class:`TopicError` otherwise, without echoing more than a few characters of it.
    """
    if not isinstance(value, str) or _REPLY_TOKEN.fullmatch(value) is None:
        raise TopicError(
            f"invalid reply token {value!r:.12}: use 22-64 characters of A-Z a-z 0-9 _ -"
        )
    return value


@dataclass(frozen=True)
class ClientReplyTopic:
    """``mcp/v1/client/{client}/reply/{token}``: where one session of an application client
    takes its replies. ``token`` is the session's unguessable suffix.

    Raises :class:`TopicError` for an invalid client id or token.
    """

    client_id: str
    token: str

    def __post_init__(self) -> None:
        validate_id(self.client_id, "client id")
        validate_reply_token(self.token)

    @classmethod
    def new(cls, client_id: str) -> ClientReplyTopic:
        """A reply topic for a new session of ``client_id`` with a fresh random token."""
        return cls(client_id, secrets.token_urlsafe(REPLY_TOKEN_BYTES))

    def __str__(self) -> str:
        return f"{PREFIX}/client/{self.client_id}/reply/{self.token}"


Topic = DeviceTopic | FleetInferTopic | ClientReplyTopic


# Builders: the only way the rest of the code spells a topic.
def status(device_id: str) -> str:
    return str(DeviceTopic(device_id, Channel.STATUS))


def desired(device_id: str) -> str:
    return str(DeviceTopic(device_id, Channel.DESIRED))


def reported(device_id: str) -> str:
    return str(DeviceTopic(device_id, Channel.REPORTED))


def events(device_id: str) -> str:
    return str(DeviceTopic(device_id, Channel.EVENTS))


def telemetry(device_id: str, kind: TelemetryKind | str) -> str:
    return str(DeviceTopic(device_id, Channel.TELEMETRY, TelemetryKind(kind).value))


def command(device_id: str) -> str:
    return str(DeviceTopic(device_id, Channel.COMMAND))


def command_reply(device_id: str) -> str:
    return str(DeviceTopic(device_id, Channel.COMMAND_REPLY))


def device_infer(device_id: str, model: str) -> str:
    return str(DeviceTopic(device_id, Channel.INFER, model))


def repo_request(device_id: str) -> str:
    return str(DeviceTopic(device_id, Channel.REPO))


def repo_reply(device_id: str) -> str:
    return str(DeviceTopic(device_id, Channel.REPO_REPLY))


def fleet_infer(model: str) -> str:
    return str(FleetInferTopic(model))


def client_reply(client_id: str, token: str) -> str:
    return str(ClientReplyTopic(client_id, token))


def client_replies(client_id: str) -> str:
    """``mcp/v1/client/{client}/reply/+``: the reply topics of every session of one client."""
    return f"{PREFIX}/client/{validate_id(client_id, 'client id')}/reply/+"


def shared_subscription(group: str, topic_filter: str) -> str:
    """``$share/{group}/{filter}``: MQTT 5 shared subscription, one member gets each message."""
    validate_id(group, "share group")
    validate_filter(topic_filter)
    if topic_filter.startswith(SHARE_PREFIX + "/"):
        raise TopicError("cannot nest shared subscriptions")
    return f"{SHARE_PREFIX}/{group}/{topic_filter}"


# Wildcard filters for the control plane (which serves every device).
def all_devices(channel: Channel, detail: str | None = None) -> str:
    """Filter matching ``channel`` (and ``detail``, or any when None) on every device."""
    if channel in (Channel.TELEMETRY, Channel.INFER):
        if detail is None:
            return f"{PREFIX}/dev/+/{channel.value}/+"
        DeviceTopic("x", channel, detail)  # validates detail
        return f"{PREFIX}/dev/+/{channel.value}/{detail}"
    if detail is not None:
        raise TopicError(f"a {channel.value} topic takes no detail")
    return f"{PREFIX}/dev/+/{channel.value}"


def device_subtree(device_id: str) -> str:
    """``mcp/v1/dev/{device}/#``: everything about one device."""
    return f"{PREFIX}/dev/{validate_id(device_id, 'device id')}/#"


def validate_filter(topic_filter: str) -> str:
    """Check MQTT topic-filter syntax: ``+`` and ``#`` only as whole levels, ``#`` last."""
    if not topic_filter or len(topic_filter) > MAX_TOPIC_LENGTH or "\x00" in topic_filter:
        raise TopicError(f"invalid topic filter {topic_filter!r:.80}")
    levels = topic_filter.split("/")
    for i, level in enumerate(levels):
        if "#" in level and (level != "#" or i != len(levels) - 1):
            raise TopicError(f"'#' must be a whole last level in {topic_filter!r:.80}")
        if "+" in level and level != "+":
            raise TopicError(f"'+' must be a whole level in {topic_filter!r:.80}")
    return topic_filter


def matches(topic_filter: str, topic: str) -> bool:
    """True when ``topic`` (no wildcards) matches ``topic_filter`` by MQTT rules.

    A ``$share/{group}/`` prefix is stripped first; topics starting with ``$`` are not matched
    by a filter starting with a wildcard (MQTT 5 §4.7.2).
    """
    validate_filter(topic_filter)
    if topic_filter.startswith(SHARE_PREFIX + "/"):
        parts = topic_filter.split("/", 2)
        if len(parts) < 3:
            raise TopicError(f"invalid shared subscription {topic_filter!r:.80}")
        topic_filter = parts[2]
    if "+" in topic or "#" in topic:
        raise TopicError("a published topic cannot contain wildcards")
    f_levels, t_levels = topic_filter.split("/"), topic.split("/")
    if topic.startswith("$") and f_levels[0] in ("+", "#"):
        return False
    for i, f in enumerate(f_levels):
        if f == "#":
            return True
        if i >= len(t_levels):
            return False
        if f != "+" and f != t_levels[i]:
            return False
    return len(f_levels) == len(t_levels)


def parse(topic: str) -> Topic:
    """Parse a concrete topic into its value object.

    Raises :class:`TopicError` for anything that is not one of the topics above (wrong prefix,
    unknown channel, invalid identifiers, wildcards, extra levels).
    """
    if not isinstance(topic, str) or not topic or len(topic) > MAX_TOPIC_LENGTH:
        raise TopicError(f"invalid topic {topic!r:.80}")
    if not topic.startswith(PREFIX + "/"):
        raise TopicError(f"topic {topic!r:.80} is not under {PREFIX}/")
    rest = topic[len(PREFIX) + 1 :].split("/")
    match rest:
        case ["dev", device_id, "telemetry", kind]:
            return DeviceTopic(device_id, Channel.TELEMETRY, kind)
        case ["dev", device_id, "infer", model]:
            return DeviceTopic(device_id, Channel.INFER, model)
        case ["dev", device_id, "cmd", "reply"]:
            return DeviceTopic(device_id, Channel.COMMAND_REPLY)
        case ["dev", device_id, "repo", "reply"]:
            return DeviceTopic(device_id, Channel.REPO_REPLY)
        case ["dev", device_id, channel]:
            try:
                ch = Channel(channel)
            except ValueError as e:
                raise TopicError(f"unknown device channel {channel!r:.40}") from e
            if ch in (Channel.TELEMETRY, Channel.INFER):
                raise TopicError(f"a {channel} topic needs a detail level")
            return DeviceTopic(device_id, ch)
        case ["fleet", "infer", model]:
            return FleetInferTopic(model)
        case ["client", client_id, "reply", token]:
            return ClientReplyTopic(client_id, token)
        case ["client", _client_id, "reply"]:
            raise TopicError(f"client reply topic {topic!r:.80} has no session token level")
    raise TopicError(f"unknown topic {topic!r:.80}")
