from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mcp_edge.shared.errors import TopicError
from mcp_edge.shared.protocol import topics
from mcp_edge.shared.protocol.topics import Channel, DeviceTopic, TelemetryKind

ident = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", fullmatch=True)
bad_ident = st.one_of(
    st.just(""),
    st.text(min_size=65, max_size=80, alphabet="abc"),
    st.builds(
        lambda a, c: a + c, ident.filter(lambda s: len(s) < 60), st.sampled_from("/+#$ \x00")
    ),
    st.sampled_from(["-lead", ".hidden", "_x", "a/b", "+", "#", "$SYS"]),
)


@given(ident)
def test_every_device_topic_round_trips(device_id: str) -> None:
    built = [
        topics.status(device_id),
        topics.desired(device_id),
        topics.reported(device_id),
        topics.events(device_id),
        topics.command(device_id),
        topics.command_reply(device_id),
        topics.repo_request(device_id),
        topics.repo_reply(device_id),
        *(topics.telemetry(device_id, k) for k in TelemetryKind),
    ]
    for t in built:
        parsed = topics.parse(t)
        assert isinstance(parsed, DeviceTopic)
        assert parsed.device_id == device_id
        assert str(parsed) == t
        assert topics.matches(topics.device_subtree(device_id), t)


@given(ident, ident)
def test_infer_topics_round_trip(device_id: str, model: str) -> None:
    t = topics.device_infer(device_id, model)
    assert topics.parse(t) == DeviceTopic(device_id, Channel.INFER, model)
    f = topics.fleet_infer(model)
    assert topics.parse(f) == topics.FleetInferTopic(model)
    assert topics.matches(topics.FleetInferTopic(model).shared("agents"), f)


token = st.from_regex(r"[A-Za-z0-9_-]{22,64}", fullmatch=True)
bad_token = st.one_of(
    st.text(alphabet="abcXYZ019_-", max_size=21),  # too short to be unguessable
    st.text(alphabet="abc", min_size=65, max_size=80),
    st.builds(lambda t, c: t[:30] + c, token, st.sampled_from(list("/+#$ .=~\x00é"))),
)


@given(ident, token)
def test_client_reply_topics_round_trip_with_their_token(client_id: str, tok: str) -> None:
    built = topics.client_reply(client_id, tok)
    assert built == f"mcp/v1/client/{client_id}/reply/{tok}"
    assert topics.parse(built) == topics.ClientReplyTopic(client_id, tok)
    assert str(topics.ClientReplyTopic(client_id, tok)) == built
    assert topics.matches(topics.client_replies(client_id), built)
    assert topics.client_replies(client_id) == f"mcp/v1/client/{client_id}/reply/+"


@given(ident, bad_token)
def test_a_reply_topic_with_a_bad_token_never_builds_nor_parses(client_id: str, bad: str) -> None:
    with pytest.raises(TopicError, match="reply token"):
        topics.ClientReplyTopic(client_id, bad)
    if "/" not in bad and bad:
        with pytest.raises(TopicError):
            topics.parse(f"mcp/v1/client/{client_id}/reply/{bad}")


def test_a_bare_reply_topic_is_not_a_reply_topic() -> None:
    for bare in ("mcp/v1/client/app-1/reply", "mcp/v1/client/app-1/reply/", "mcp/v1/client/app-1"):
        with pytest.raises(TopicError):
            topics.parse(bare)
    with pytest.raises(TopicError, match="no session token"):
        topics.parse("mcp/v1/client/app-1/reply")
    with pytest.raises(TypeError):
        topics.ClientReplyTopic("app-1")  # type: ignore[call-arg]


def test_new_reply_topics_draw_fresh_unguessable_tokens() -> None:
    drawn = [topics.ClientReplyTopic.new("app-1") for _ in range(50)]
    assert len({t.token for t in drawn}) == 50
    for t in drawn:
        assert t.client_id == "app-1" and len(t.token) >= 22
        assert topics.parse(str(t)) == t


@given(bad_ident)
def test_invalid_ids_never_make_a_topic(bad: str) -> None:
    with pytest.raises(TopicError):
        topics.status(bad)
    with pytest.raises(TopicError):
        topics.fleet_infer(bad)


@given(st.text(max_size=200))
def test_parse_never_crashes_on_arbitrary_text(text: str) -> None:
    try:
        parsed = topics.parse(text)
    except TopicError:
        return
    assert str(parsed) == text


def test_device_cannot_be_widened_by_wildcards() -> None:
    for t in [
        "mcp/v1/dev/+/status",
        "mcp/v1/dev/#",
        "mcp/v1/dev/a/status/extra",
        "mcp/v2/dev/a/status",
    ]:
        with pytest.raises(TopicError):
            topics.parse(t)


def test_wildcard_filters_match_by_mqtt_rules() -> None:
    health = topics.all_devices(Channel.TELEMETRY, "health")
    assert health == "mcp/v1/dev/+/telemetry/health"
    assert topics.matches(health, topics.telemetry("d1", "health"))
    assert not topics.matches(health, topics.telemetry("d1", "drift"))
    assert topics.matches(topics.all_devices(Channel.TELEMETRY), topics.telemetry("d1", "drift"))
    assert not topics.matches(topics.all_devices(Channel.STATUS), topics.desired("d1"))
    assert topics.matches("mcp/#", "mcp/v1/dev/a/status")
    assert not topics.matches("#", "$CONTROL/dynamic-security/v1")
    shared_filter = topics.shared_subscription("cp", topics.all_devices(Channel.EVENTS))
    assert shared_filter == "$share/cp/mcp/v1/dev/+/events"
    assert topics.matches(shared_filter, topics.events("x"))


@pytest.mark.parametrize("bad", ["a/#/b", "a/b#", "a+/b", "", "x\x00"])
def test_bad_filters_refused(bad: str) -> None:
    with pytest.raises(TopicError):
        topics.validate_filter(bad)


def test_unknown_telemetry_kind_refused() -> None:
    with pytest.raises(TopicError, match="telemetry kind"):
        topics.parse("mcp/v1/dev/a/telemetry/secrets")
