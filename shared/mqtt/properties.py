"""MQTT 5 PUBLISH properties encoded by hand: paho sends the bytes without re-validating them.

paho's own ``Properties`` validates and packs each attribute by scanning every property name,
which cost more than the whole broker round trip on the inference path (tens of µs per
message). :func:`encode_publish_properties` writes the same bytes (the test compares them with
paho's for arbitrary values) and :class:`EncodedProperties` hands them to paho, which calls only
``pack()`` (and ``str()`` for debug logs) on the properties of a message it sends.
"""

from __future__ import annotations

from collections.abc import Sequence


class EncodedProperties:
    """A PUBLISH property block (length prefix included) in the shape paho sends."""

    __slots__ = ("_data",)

    def __init__(self, data: bytes) -> None:
        self._data = data

    def pack(self) -> bytes:
        return self._data

    def __str__(self) -> str:
        return f"<{len(self._data) - 1} bytes of properties>"


def encode_publish_properties(
    *,
    response_topic: str | None = None,
    correlation_data: bytes | None = None,
    user_properties: Sequence[tuple[str, str]] = (),
    content_type: str | None = None,
    message_expiry_s: int | None = None,
) -> bytes:
    """The MQTT 5 property block of a PUBLISH (length prefix included), in identifier order as
    paho writes it. Raises ValueError for a string or binary value over 65535 bytes."""
    out = bytearray()
    if message_expiry_s:
        out += b"\x02" + int(message_expiry_s).to_bytes(4, "big")
    if content_type:
        out += b"\x03" + _field(content_type.encode())
    if response_topic:
        out += b"\x08" + _field(response_topic.encode())
    if correlation_data is not None:
        out += b"\x09" + _field(bytes(correlation_data))
    for key, value in user_properties:
        out += b"\x26" + _field(key.encode()) + _field(value.encode())
    return _varint(len(out)) + bytes(out)


def _field(data: bytes) -> bytes:
    if len(data) > 0xFFFF:
        raise ValueError(f"property value of {len(data)} bytes exceeds 65535")
    return len(data).to_bytes(2, "big") + data


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        n, digit = divmod(n, 128)
        out.append(digit | (0x80 if n else 0))
        if not n:
            return bytes(out)
