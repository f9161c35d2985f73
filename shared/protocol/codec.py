"""The one encode/decode pair for protocol messages, with size caps.

:func:`decode` checks, in this order, so the cheapest refusal comes first: the payload size
against the cap (the type's ``MAX_BYTES`` unless a lower one is given), that it is JSON
(orjson: rejects NaN, Infinity and invalid UTF-8), and the schema. Every failure is a
:class:`MessageError` with a one-line reason fit for a log line or an error reply.

:func:`decode_for_topic` picks the schema from the topic, for a subscriber that listens on
several (the control plane's ingest).
"""

from __future__ import annotations

import functools
from typing import Any, TypeVar

from pydantic import ValidationError

from mcp_edge.shared.errors import MessageError
from mcp_edge.shared.protocol import topics
from mcp_edge.shared.protocol.base import Message
from mcp_edge.shared.protocol.inference import (
    InferRequest,
)
from mcp_edge.shared.protocol.reports import Report, encode_report
from mcp_edge.shared.protocol.wire import loads

__all__ = [
    "decode", "decode_for_parsed", "decode_for_topic", "describe_validation_error", "encode",
    "loads", "schema_for_topic", "validate",
]  # fmt: skip

M = TypeVar("M", bound=Message)


def encode(message: Message | Report) -> bytes:
    """Serialize a message to compact JSON bytes (``None`` fields left out). A plain report
    (:mod:`shared.protocol.reports`) gives the bytes its model would."""
    if not isinstance(message, Message):
        return encode_report(message)
    return message.model_dump_json(exclude_none=True).encode("utf-8")


def decode(
    payload: bytes | bytearray | memoryview | str, cls: type[M], *, max_bytes: int | None = None
) -> M:
    """Parse and validate ``payload`` as ``cls``.

    Raises :class:`MessageError` naming the size, the JSON error, or the first schema error
    (``field.path: reason``).
    """
    cap = cls.MAX_BYTES if max_bytes is None else min(max_bytes, cls.MAX_BYTES)
    obj = loads(payload, max_bytes=cap)
    return validate(obj, cls)


def validate(obj: Any, cls: type[M]) -> M:
    """Validate an already-parsed JSON value as ``cls`` (see :func:`decode`)."""
    try:
        return cls.model_validate(obj)
    except ValidationError as e:
        raise MessageError(f"{cls.__name__}: {describe_validation_error(e)}") from e


def describe_validation_error(e: ValidationError) -> str:
    """One line for the first error (and a count of the rest)."""
    errors = e.errors(include_url=False)
    first = errors[0]
    loc = ".".join(str(p) for p in first.get("loc", ())) or "body"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{loc}: {first.get('msg', 'invalid')}{more}"


def schema_for_topic(topic: topics.Topic) -> type[Message] | None:
    """The message class a topic carries, or None for topics whose payload is not a Message
    (status strings, signed envelopes, repository traffic)."""
    if isinstance(topic, topics.FleetInferTopic):
        return InferRequest
    if not isinstance(topic, topics.DeviceTopic):
        return None
    by_kind, by_channel = _schemas()
    if topic.channel is topics.Channel.TELEMETRY:
        return by_kind.get(str(topic.detail))
    return by_channel.get(topic.channel)


@functools.cache
def _schemas() -> tuple[dict[str, type[Message]], dict[topics.Channel, type[Message]]]:
    # Imported on first use so a process that only decodes inference requests (the agent's
    # HTTP path) does not load every message family.
    from mcp_edge.shared.protocol.command import CommandReply, CommandRequest
    from mcp_edge.shared.protocol.state import DeploymentEvent, ReportedState
    from mcp_edge.shared.protocol.telemetry import DriftReport, HealthSample, InferenceStats

    by_kind: dict[str, type[Message]] = {
        topics.TelemetryKind.HEALTH.value: HealthSample,
        topics.TelemetryKind.INFERENCE.value: InferenceStats,
        topics.TelemetryKind.DRIFT.value: DriftReport,
    }
    by_channel: dict[topics.Channel, type[Message]] = {
        topics.Channel.REPORTED: ReportedState,
        topics.Channel.EVENTS: DeploymentEvent,
        topics.Channel.COMMAND: CommandRequest,
        topics.Channel.COMMAND_REPLY: CommandReply,
        topics.Channel.INFER: InferRequest,
    }
    return by_kind, by_channel


def decode_for_topic(
    topic: str, payload: bytes | bytearray | memoryview | str
) -> tuple[topics.Topic, Message]:
    """Parse the topic, decode the payload with its schema, and check the device id inside the
    payload matches the topic (a device may only speak for itself).

    Raises :class:`shared.errors.TopicError` or :class:`MessageError`.
    """
    parsed = topics.parse(topic)
    return parsed, decode_for_parsed(parsed, payload)


def decode_for_parsed(
    parsed: topics.Topic, payload: bytes | bytearray | memoryview | str
) -> Message:
    """:func:`decode_for_topic` for a topic already parsed (saves parsing it twice)."""
    cls = schema_for_topic(parsed)
    if cls is None:
        raise MessageError(f"topic {str(parsed)!r:.80} carries no typed message")
    message = decode(payload, cls)
    claimed = getattr(message, "device_id", None)
    if (
        isinstance(parsed, topics.DeviceTopic)
        and claimed is not None
        and claimed != parsed.device_id
    ):
        raise MessageError(
            f"payload claims device {claimed!r} on device {parsed.device_id!r}'s topic"
        )
    return message
