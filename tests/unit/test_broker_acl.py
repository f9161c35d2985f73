"""The broker accounts as data: every ACL a valid filter, wildcards only where intended, device
ids literal, and each account allowed exactly its own traffic (checked with MQTT matching)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mcp_edge.controlplane.broker import acl
from mcp_edge.controlplane.broker.acl import AccountKind, Acl, AclType
from mcp_edge.shared.errors import TopicError
from mcp_edge.shared.protocol import topics
from mcp_edge.shared.protocol.topics import Channel, FleetInferTopic, TelemetryKind

ident = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", fullmatch=True)
SUBSCRIBE = (AclType.SUBSCRIBE_PATTERN, AclType.SUBSCRIBE_LITERAL)
FLEET = "mcp/v1/fleet/infer/+"
TOKEN = "Zq3bV9xY-k_2mN8pL4rT0w"  # the shape of secrets.token_urlsafe(16)


def _device_topics(device_id: str) -> list[str]:
    """Every concrete topic of one device."""
    return [
        topics.status(device_id),
        topics.desired(device_id),
        topics.reported(device_id),
        topics.events(device_id),
        *(topics.telemetry(device_id, kind) for kind in TelemetryKind),
        topics.command(device_id),
        topics.command_reply(device_id),
        topics.device_infer(device_id, "digits"),
        topics.repo_request(device_id),
        topics.repo_reply(device_id),
    ]


def _allowed(acls: tuple[Acl, ...], kind: AclType, topic: str) -> bool:
    return any(a.acl_type is kind and a.allow and topics.matches(a.topic, topic) for a in acls)


def _has_wildcard(topic: str) -> bool:
    return any(level in ("+", "#") for level in topic.split("/"))


@given(ident, ident)
def test_a_device_may_touch_only_its_own_topics(device_id: str, other_id: str) -> None:
    acls = acl.device_acls(device_id)
    sends = {topics.status, topics.reported, topics.events, topics.command_reply}
    sends |= {topics.repo_request}

    for builder in sends:
        assert _allowed(acls, AclType.PUBLISH_SEND, builder(device_id))
    for kind in TelemetryKind:
        assert _allowed(acls, AclType.PUBLISH_SEND, topics.telemetry(device_id, kind))
    for builder in (topics.desired, topics.command, topics.repo_reply):
        assert _allowed(acls, AclType.PUBLISH_RECEIVE, builder(device_id))
        assert not _allowed(acls, AclType.PUBLISH_SEND, builder(device_id))
    assert _allowed(acls, AclType.PUBLISH_RECEIVE, topics.device_infer(device_id, "digits"))
    assert _allowed(acls, AclType.PUBLISH_SEND, topics.client_reply("some-app", TOKEN))
    if other_id != device_id:
        for topic in _device_topics(other_id):
            assert not any(topics.matches(a.topic, topic) for a in acls), topic


@given(ident)
def test_device_ids_are_embedded_literally_and_wildcards_appear_only_where_intended(
    device_id: str,
) -> None:
    acls = acl.device_acls(device_id)
    wildcards = {a.topic for a in acls if _has_wildcard(a.topic)}

    assert wildcards == {
        acl.client_reply_filter(),
        acl.device_infer_filter(device_id),
        FLEET,
        topics.shared_subscription("agents", FLEET),
    }
    assert acl.device_infer_filter(device_id).split("/")[3] == device_id
    for entry in acls:
        assert topics.validate_filter(entry.topic) == entry.topic
        if "/dev/" in entry.topic:
            assert entry.topic.split("/")[3] == device_id


@given(ident)
def test_a_device_answers_applications_only_on_token_suffixed_reply_topics(app: str) -> None:
    acls = acl.device_acls("d1")

    assert acl.client_reply_filter() == "mcp/v1/client/+/reply/+"
    assert _allowed(acls, AclType.PUBLISH_SEND, topics.client_reply(app, TOKEN))
    # The bare topic (what every device could publish on before) and anything that is not a
    # session reply topic are refused.
    for topic in (f"mcp/v1/client/{app}/reply", f"mcp/v1/client/{app}/reply/{TOKEN}/more"):
        assert not _allowed(acls, AclType.PUBLISH_SEND, topic), topic
    assert not any(
        a.acl_type in SUBSCRIBE and topics.matches(a.topic, topics.client_reply(app, TOKEN))
        for a in acls
    )


def test_the_placeholder_is_never_widened_when_it_is_a_real_device_id() -> None:
    acls = acl.device_acls("any-level")
    assert all(a.topic.split("/")[3] == "any-level" for a in acls if "/dev/" in a.topic)


def test_fleet_requests_are_granted_through_one_share_group_only() -> None:
    acls = acl.device_acls("d1", share_group="edge")
    subscribe = {a.topic for a in acls if a.acl_type in SUBSCRIBE}
    unsubscribe = {a.topic for a in acls if a.acl_type is AclType.UNSUBSCRIBE_PATTERN}

    # Mosquitto 2.0.11 checks (un)subscribe ACLs against the whole $share string and
    # delivery against the plain topic.
    assert acl.fleet_infer_filter() == FLEET
    assert subscribe >= {"$share/edge/mcp/v1/fleet/infer/+"}
    assert FLEET not in subscribe and FleetInferTopic("digits").shared("agents") not in subscribe
    assert subscribe == unsubscribe
    assert _allowed(acls, AclType.PUBLISH_RECEIVE, topics.fleet_infer("digits"))
    assert not _allowed(acls, AclType.PUBLISH_SEND, topics.fleet_infer("digits"))


@pytest.mark.parametrize(
    "acls",
    [acl.device_acls("d1"), acl.service_acls(), acl.app_client_acls("app1")],
    ids=["device", "service", "app"],
)
def test_every_subscription_can_be_undone_and_delivers(acls: tuple[Acl, ...]) -> None:
    for entry in acls:
        if entry.acl_type in SUBSCRIBE:
            twin = Acl(AclType.UNSUBSCRIBE_PATTERN, entry.topic)
            assert twin in acls, entry
            shared = entry.topic.startswith("$share/")
            plain = entry.topic.split("/", 2)[2] if shared else entry.topic
            assert Acl(AclType.PUBLISH_RECEIVE, plain) in acls, entry
        assert not entry.topic.startswith("$CONTROL") and entry.topic not in ("#", "mcp/#")


@given(ident)
def test_the_service_reads_every_device_and_writes_only_what_the_control_plane_sends(
    device_id: str,
) -> None:
    acls = acl.service_acls()

    for topic in _device_topics(device_id):
        assert _allowed(acls, AclType.PUBLISH_RECEIVE, topic)
    for builder in (topics.desired, topics.command, topics.repo_reply, topics.status):
        assert _allowed(acls, AclType.PUBLISH_SEND, builder(device_id))
    for topic in (topics.telemetry(device_id, "health"), topics.events(device_id)):
        assert not _allowed(acls, AclType.PUBLISH_SEND, topic)
    assert not _allowed(acls, AclType.PUBLISH_RECEIVE, topics.fleet_infer("digits"))
    assert not _allowed(acls, AclType.PUBLISH_RECEIVE, topics.client_reply("app", TOKEN))
    assert acl.every_device_filter() == "mcp/v1/dev/+/#"
    assert "$share/+/mcp/v1/dev/+/#" in {a.topic for a in acls if a.acl_type in SUBSCRIBE}


@given(ident, ident)
def test_an_app_client_sends_requests_and_reads_only_its_replies(app: str, other: str) -> None:
    acls = acl.app_client_acls(app)

    assert _allowed(acls, AclType.PUBLISH_SEND, topics.fleet_infer("digits"))
    assert _allowed(acls, AclType.PUBLISH_SEND, topics.device_infer("d1", "digits"))
    assert _allowed(acls, AclType.PUBLISH_RECEIVE, topics.client_reply(app, TOKEN))
    subscribe = {a.topic for a in acls if a.acl_type in SUBSCRIBE}
    assert subscribe == {f"mcp/v1/client/{app}/reply/+"}  # any of its own sessions, no other
    assert not _allowed(acls, AclType.PUBLISH_RECEIVE, f"mcp/v1/client/{app}/reply")
    assert not _allowed(acls, AclType.PUBLISH_SEND, topics.client_reply(app, TOKEN))
    if other != app:
        assert not _allowed(acls, AclType.PUBLISH_RECEIVE, topics.client_reply(other, TOKEN))
    for topic in _device_topics("d1"):
        assert not _allowed(acls, AclType.PUBLISH_RECEIVE, topic)
        if topic != topics.device_infer("d1", "digits"):
            assert not _allowed(acls, AclType.PUBLISH_SEND, topic)


def test_accounts_are_bound_to_their_client_ids() -> None:
    device = acl.device_account("d1")
    service = acl.service_account("cp-1")
    app = acl.app_client_account("app1")

    assert (device.username, device.client_id, device.role) == ("dev-d1", "d1", "device-d1")
    assert (service.username, service.client_id, service.role) == (
        "svc-cp-1",
        "cp-1",
        "controlplane",
    )
    assert (app.username, app.client_id, app.role) == ("app-app1", "app1", "app-app1")
    assert acl.usernames_bound_to("x") == ("dev-x", "svc-x", "app-x")
    assert acl.username_for(AccountKind.DEVICE, "x") == "dev-x"


@pytest.mark.parametrize("bad", ["", "a/b", "+", "#", "$SYS", "a b", "-lead", "x" * 65])
def test_identifiers_that_could_widen_a_topic_are_refused(bad: str) -> None:
    for build in (acl.device_account, acl.service_account, acl.app_client_account):
        with pytest.raises(TopicError):
            build(bad)


def test_an_acl_must_be_a_valid_filter() -> None:
    with pytest.raises(TopicError):
        Acl(AclType.PUBLISH_SEND, "mcp/v1/dev/a#")


def test_role_commands_create_a_missing_role_and_edit_an_existing_one_in_place() -> None:
    spec = acl.device_account("d1")
    wanted = {acl.acl_key(acl.acl_document(a)) for a in spec.acls}

    (create,) = acl.role_commands(spec, None)
    assert create["command"] == "createRole" and create["rolename"] == "device-d1"
    assert {acl.acl_key(d) for d in create["acls"]} == wanted
    assert acl.role_commands(spec, wanted) == []

    stale = ("subscribePattern", "#", 0, True)
    kept = sorted(wanted)[1:]
    changed = acl.role_commands(spec, {stale, *kept})
    assert changed[0] == {
        "command": "removeRoleACL",
        "rolename": "device-d1",
        "acltype": "subscribePattern",
        "topic": "#",
    }
    (added,) = changed[1:]
    assert added["command"] == "addRoleACL" and acl.acl_key(added) == sorted(wanted)[0]


def test_reset_client_commands_recreate_the_client_bound_to_its_id_and_role() -> None:
    spec = acl.app_client_account("app1")

    delete, create = acl.reset_client_commands(spec, "s3cret")

    assert delete == {"command": "deleteClient", "username": "app-app1"}
    assert create["command"] == "createClient"
    assert (create["username"], create["password"], create["clientid"]) == (
        "app-app1",
        "s3cret",
        "app1",
    )
    assert create["roles"] == [{"rolename": "app-app1"}]


def test_all_device_channels_are_covered() -> None:
    # A new channel in shared.protocol.topics must get a decision here (send, read or neither).
    assert {c.value for c in Channel} == {
        "status", "desired", "reported", "events", "telemetry",
        "cmd", "cmd/reply", "infer", "repo", "repo/reply",
    }  # fmt: skip
