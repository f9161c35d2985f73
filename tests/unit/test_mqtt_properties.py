"""``shared.mqtt.properties``: PUBLISH properties encoded by hand are byte for byte paho's."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from mcp_edge.shared.mqtt.properties import encode_publish_properties


@settings(max_examples=200, deadline=None)
@given(
    st.one_of(st.none(), st.text(min_size=1, max_size=300)),
    st.one_of(st.none(), st.binary(max_size=300)),
    st.lists(st.tuples(st.text(max_size=40), st.text(max_size=200)), max_size=4),
    st.one_of(st.none(), st.text(min_size=1, max_size=40)),
    st.one_of(st.none(), st.integers(min_value=1, max_value=2**32 - 1)),
)
def test_our_publish_properties_are_byte_for_byte_what_paho_would_send(
    response_topic: str | None,
    correlation: bytes | None,
    user: list[tuple[str, str]],
    content_type: str | None,
    expiry: int | None,
) -> None:
    props = Properties(PacketTypes.PUBLISH)
    if expiry:
        props.MessageExpiryInterval = expiry
    if content_type:
        props.ContentType = content_type
    if response_topic:
        props.ResponseTopic = response_topic
    if correlation is not None:
        props.CorrelationData = correlation
    if user:
        props.UserProperty = user
    ours = encode_publish_properties(
        response_topic=response_topic, correlation_data=correlation, user_properties=user,
        content_type=content_type, message_expiry_s=expiry,
    )  # fmt: skip
    assert ours == bytes(props.pack())


def test_a_value_over_65535_bytes_is_refused() -> None:
    with pytest.raises(ValueError, match="exceeds 65535"):
        encode_publish_properties(correlation_data=b"x" * 65536)
