from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mcp_edge.shared.errors import VersionError
from mcp_edge.shared.version import SemVer


@pytest.mark.parametrize(
    ("text", "numeric"),
    [
        ("v2.1.0-rc1", 20010001),
        ("2.1.0-rc.2", 20010002),
        ("2.1.0", 20010009),
        ("1.3.0", 10030009),
        ("0.0.1", 19),
        ("213.999.999", 2139999999),
    ],
)
def test_numeric_mapping(text: str, numeric: int) -> None:
    v = SemVer.parse(text)
    assert v.to_numeric() == numeric
    assert SemVer.from_numeric(numeric).to_numeric() == numeric
    assert str(SemVer.from_numeric(20010001)) == "2.1.0-rc1"


@pytest.mark.parametrize(
    "text", ["1.0.0-alpha", "1.0.0-beta.2", "1.0.0-rc9", "214.0.0", "1.1000.0"]
)
def test_unmappable_versions_are_refused(text: str) -> None:
    with pytest.raises(VersionError, match="cannot be mapped"):
        SemVer.parse(text).to_numeric()


@pytest.mark.parametrize("text", ["1.0", "01.0.0", "1.0.0-", "a.b.c", "1.0.0+", "", "1.0.0-01"])
def test_invalid_versions(text: str) -> None:
    with pytest.raises(VersionError):
        SemVer.parse(text)


def test_semver_precedence_from_the_spec() -> None:
    chain = [
        "1.0.0-alpha",
        "1.0.0-alpha.1",
        "1.0.0-alpha.beta",
        "1.0.0-beta",
        "1.0.0-beta.2",
        "1.0.0-beta.11",
        "1.0.0-rc.1",
        "1.0.0",
        "1.0.1",
        "1.1.0",
        "2.0.0",
    ]
    parsed = [SemVer.parse(v) for v in chain]
    assert parsed == sorted(reversed(parsed))
    assert SemVer.parse("1.0.0+build.5") == SemVer.parse("1.0.0")


mappable = st.builds(
    SemVer,
    st.integers(0, 213),
    st.integers(0, 999),
    st.integers(0, 999),
    st.sampled_from([(), ("rc0",), ("rc1",), ("rc3",), ("rc8",)]),
)


@given(mappable, mappable)
def test_numeric_order_matches_semver_order(a: SemVer, b: SemVer) -> None:
    assert (a < b) == (a.to_numeric() < b.to_numeric())
    assert SemVer.from_numeric(a.to_numeric()).to_numeric() == a.to_numeric()


@given(st.text(max_size=40))
def test_parse_round_trips_or_refuses(text: str) -> None:
    try:
        v = SemVer.parse(text)
    except VersionError:
        return
    assert str(v) == text.removeprefix("v")
