"""Request options and error answers, as the HTTP API and MQTT inference both give them."""

from __future__ import annotations

import logging
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mcp_edge.agent.runtime.batcher import (
    BatcherClosedError,
    DeadlineExceededError,
    OverloadedError,
    Priority,
)
from mcp_edge.agent.runtime.manager import ModelNotFoundError
from mcp_edge.agent.runtime.runner import InferenceError, InputError
from mcp_edge.agent.serving.preprocess import PreprocessError
from mcp_edge.agent.serving.requests import (
    HTTP_HEADERS,
    MQTT_PROPERTIES,
    OptionNames,
    RequestError,
    RequestOptions,
    classify,
    parse_options,
)
from mcp_edge.shared.errors import MessageError
from mcp_edge.shared.protocol import ErrorCode

TRANSPORTS = pytest.mark.parametrize("names", [HTTP_HEADERS, MQTT_PROPERTIES], ids=["http", "mqtt"])


def parse(names: OptionNames, values: dict[str, str], version: str | None = None) -> RequestOptions:
    # Both transports look names up case-insensitively; a lower-cased dict stands in for them.
    lowered = {k.lower(): v for k, v in values.items()}
    return parse_options(lambda name: lowered.get(name.lower()), names, version)


@TRANSPORTS
def test_a_request_without_options_is_routed_at_normal_priority(names: OptionNames) -> None:
    assert parse(names, {}) == RequestOptions(None, None, Priority.NORMAL, None)


@TRANSPORTS
def test_every_option_is_read_under_its_transport_name(names: OptionNames) -> None:
    opts = parse(
        names,
        {
            names.version: "2",
            names.request_key: "user-7",
            names.priority: "High",
            names.timeout_ms: "250",
        },
    )
    assert opts == RequestOptions("2", "user-7", Priority.HIGH, 0.25)


@TRANSPORTS
def test_empty_version_and_key_are_none_and_the_path_version_wins(names: OptionNames) -> None:
    assert parse(names, {names.version: "", names.request_key: ""}) == RequestOptions()
    assert parse(names, {names.version: "2"}, version="3").version == "3"


@TRANSPORTS
def test_an_unknown_priority_is_a_bad_request(names: OptionNames) -> None:
    with pytest.raises(RequestError) as info:
        parse(names, {names.priority: "urgent"})
    assert info.value.code is ErrorCode.BAD_REQUEST
    assert str(info.value) == "priority must be high, normal or low, not 'urgent'"


@TRANSPORTS
@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ("soon", "{} must be a number"),
        ("", "{} must be a number"),
        ("0", "{} must be in (0, 3600000]"),
        ("-5", "{} must be in (0, 3600000]"),
        ("3600000.5", "{} must be in (0, 3600000]"),
        ("nan", "{} must be in (0, 3600000]"),
        ("inf", "{} must be in (0, 3600000]"),
    ],
)
def test_a_bad_timeout_is_refused_naming_the_option(
    names: OptionNames, raw: str, message: str
) -> None:
    with pytest.raises(RequestError) as info:
        parse(names, {names.timeout_ms: raw})
    assert info.value.code is ErrorCode.BAD_REQUEST
    assert str(info.value) == message.format(names.timeout_ms)


@given(st.text(max_size=30))
def test_any_timeout_text_is_a_deadline_in_range_or_a_bad_request(raw: str) -> None:
    try:
        opts = parse(MQTT_PROPERTIES, {"timeout-ms": raw})
    except RequestError as e:
        assert e.code is ErrorCode.BAD_REQUEST
    else:
        assert opts.timeout_s is not None and 0 < opts.timeout_s <= 3600
        assert math.isclose(opts.timeout_s, float(raw) / 1000)


@pytest.mark.parametrize(
    ("error", "code", "message", "retry_after_s"),
    [
        (
            MessageError("inputs: field required"),
            ErrorCode.BAD_REQUEST,
            "inputs: field required",
            None,
        ),
        (
            InputError("input 'x' expects FP32"),
            ErrorCode.BAD_REQUEST,
            "input 'x' expects FP32",
            None,
        ),
        (PreprocessError("needs 64 values"), ErrorCode.BAD_REQUEST, "needs 64 values", None),
        (
            ModelNotFoundError("model 'x' is not loaded"),
            ErrorCode.NOT_FOUND,
            "model 'x' is not loaded",
            None,
        ),
        (
            OverloadedError("1024 waiting", 0.5),
            ErrorCode.OVERLOADED,
            "overloaded: 1024 waiting",
            0.5,
        ),
        (DeadlineExceededError("30 ms"), ErrorCode.TIMEOUT, "timed out: 30 ms", None),
        (
            BatcherClosedError("digits 1 was unloaded"),
            ErrorCode.UNAVAILABLE,
            "digits 1 was unloaded",
            None,
        ),
        (
            InferenceError("backend fault"),
            ErrorCode.INTERNAL,
            "inference failed: backend fault",
            None,
        ),
        (
            RequestError(ErrorCode.TOO_LARGE, "reply too large"),
            ErrorCode.TOO_LARGE,
            "reply too large",
            None,
        ),
    ],
)
def test_each_failure_gets_its_code_and_message(
    error: Exception, code: ErrorCode, message: str, retry_after_s: float | None
) -> None:
    err = classify(error)
    assert (err.code, str(err), err.retry_after_s) == (code, message, retry_after_s)


def test_an_unknown_failure_is_internal_without_its_text_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.ERROR):
        err = classify(KeyError("/secret/path"))
    assert (err.code, str(err)) == (ErrorCode.INTERNAL, "internal error: KeyError")
    assert "unexpected error while handling a request" in caplog.text
