"""Each constrained string type publishes a JSON Schema (in the OpenAPI document and every
message schema) that accepts exactly what its own check accepts, judged by a real JSON Schema
validator (jsonschema-rs, the one schemathesis uses)."""

from __future__ import annotations

from typing import Any

import jsonschema_rs
import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import TypeAdapter, ValidationError

from mcp_edge.controlplane.api.schemas import LABEL_FILTER_PATTERN, LabelFilter
from mcp_edge.shared.errors import ProtocolError
from mcp_edge.shared.protocol.base import (
    IDENTIFIER_PATTERN,
    LABEL_KEY_PATTERN,
    LABEL_VALUE_PATTERN,
    Identifier,
    Labels,
)

# JSON text cannot carry lone surrogates, so neither can a request.
TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=140)


def _verdicts(tp: Any, value: object) -> tuple[bool, bool]:
    """(what the published schema says, what the check says) about ``value``."""
    adapter = TypeAdapter(tp)
    published = jsonschema_rs.validator_for(adapter.json_schema()).is_valid(value)
    try:
        adapter.validate_python(value)
        checked = True
    except (ValidationError, ProtocolError):  # validate_id raises TopicError, answered 400
        checked = False
    return published, checked


@given(st.one_of(TEXT, st.from_regex(IDENTIFIER_PATTERN[1:-1], fullmatch=True), st.just("a\n")))
def test_an_identifiers_schema_is_its_check(value: str) -> None:
    published, checked = _verdicts(Identifier, value)
    assert published == checked


KEYS = st.one_of(TEXT, st.from_regex(LABEL_KEY_PATTERN[1:-1], fullmatch=True))
VALUES = st.one_of(TEXT, st.from_regex(LABEL_VALUE_PATTERN[1:-1], fullmatch=True))


@given(st.dictionaries(KEYS, VALUES, max_size=34))
def test_the_labels_schema_is_their_check(labels: dict[str, str]) -> None:
    published, checked = _verdicts(Labels, labels)
    assert published == checked


@given(st.one_of(TEXT, st.from_regex(LABEL_FILTER_PATTERN[1:-1], fullmatch=True)))
def test_a_label_filters_schema_is_its_check(value: str) -> None:
    published, checked = _verdicts(LabelFilter, value)
    assert published == checked


@pytest.mark.parametrize(
    ("value", "ok"),
    [
        ("Zürich, hall 2", True),
        ("", True),
        ("x" * 128, True),
        ("x" * 129, False),
        ("line\nbreak", False),
        ("right-to-left \u202e override", False),
        ("no\u00a0break space", False),
        ("zero\u200bwidth", False),
        ("tag \U000e0041 character", False),
        ("private \ue000 use", False),
    ],
)
def test_a_label_value_is_printable_text(value: str, ok: bool) -> None:
    assert _verdicts(Labels, {"site": value}) == (ok, ok)
