"""Semantic versions (semver 2.0.0) and their numeric form for Triton-style model repositories.

Triton, TF Serving and KServe lay models out as ``<model>/<integer version>/``. Bundles carry a
semver string; :meth:`SemVer.to_numeric` maps it to one integer that sorts the same way::

    numeric = major * 10_000_000 + minor * 10_000 + patch * 10 + stage
    stage   = 9 for a release; N for the release candidate rcN / rc.N (N in 0..8)

    2.1.0-rc1 -> 20010001      2.1.0-rc2 -> 20010002      2.1.0 -> 20010009
    1.3.0     -> 10030009      0.0.1     -> 19

Ranges: major 0..213 (the result fits a signed 32-bit integer), minor and patch 0..999. Only
release candidates map among pre-releases, since a model repository holds releases and their
candidates; ``alpha``/``beta``/``dev`` and anything out of range raise :class:`VersionError`
rather than collide with another version. :meth:`SemVer.from_numeric` is the inverse and
spells candidates ``rcN``. Keep one spelling per model: semver orders ``rc.3`` below ``rc1``
(the identifier ``rc`` sorts before ``rc1``), while both map by their number.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import total_ordering

from mcp_edge.shared.errors import VersionError

SEMVER_PATTERN = (
    r"^v?(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-((?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(?:\.(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*))?"
    r"(?:\+([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?$"
)
"""What :meth:`SemVer.parse` accepts, as a regular expression (JSON Schema's ``pattern``)."""
_SEMVER = re.compile(SEMVER_PATTERN)
MAX_VERSION_LENGTH = 128


@total_ordering
@dataclass(frozen=True)
class SemVer:
    """A parsed semantic version; ordering follows semver 2.0.0 precedence (build ignored)."""

    major: int
    minor: int
    patch: int
    prerelease: tuple[str, ...] = ()
    build: tuple[str, ...] = ()

    @classmethod
    def parse(cls, text: str) -> SemVer:
        """Parse ``MAJOR.MINOR.PATCH[-PRE][+BUILD]`` (a leading ``v`` is accepted).

        Raises :class:`VersionError` with the offending text.
        """
        if not isinstance(text, str) or len(text) > MAX_VERSION_LENGTH:
            raise VersionError(f"not a version string: {text!r:.80}")
        m = _SEMVER.match(text)
        if m is None:
            raise VersionError(
                f"{text!r} is not a semantic version (expected e.g. 1.3.0 or 2.1.0-rc1)"
            )
        pre = tuple(m.group(4).split(".")) if m.group(4) else ()
        build = tuple(m.group(5).split(".")) if m.group(5) else ()
        return cls(int(m.group(1)), int(m.group(2)), int(m.group(3)), pre, build)

    def __str__(self) -> str:
        s = f"{self.major}.{self.minor}.{self.patch}"
        if self.prerelease:
            s += "-" + ".".join(self.prerelease)
        if self.build:
            s += "+" + ".".join(self.build)
        return s

    def _key(self) -> tuple[object, ...]:
        # A release sorts after all of its pre-releases; identifiers compare numerically when
        # both are numeric, numeric before alphanumeric, and a longer list wins a tie.
        pre: tuple[tuple[int, int, str], ...] = tuple(
            (0, int(p), "") if p.isdigit() else (1, 0, p) for p in self.prerelease
        )
        return (self.major, self.minor, self.patch, 0 if self.prerelease else 1, pre)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SemVer):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __lt__(self, other: SemVer) -> bool:
        if not isinstance(other, SemVer):
            return NotImplemented
        return self._key() < other._key()

    @property
    def is_prerelease(self) -> bool:
        return bool(self.prerelease)

    def to_numeric(self) -> int:
        """Map to the integer used as a Triton-style version directory (see module docstring).

        Raises :class:`VersionError` when the version is outside the mapped ranges.
        """
        if self.major > 213 or self.minor > 999 or self.patch > 999:
            raise VersionError(
                f"{self} cannot be mapped to a number: needs major <= 213, minor <= 999 and "
                "patch <= 999"
            )
        return self.major * 10_000_000 + self.minor * 10_000 + self.patch * 10 + self._stage()

    def _stage(self) -> int:
        if not self.prerelease:
            return 9
        m = re.fullmatch(r"rc\.?(\d)", ".".join(self.prerelease).lower())
        if m is None or int(m.group(1)) > 8:
            raise VersionError(
                f"{self} cannot be mapped to a number: among pre-releases only rc0..rc8 "
                "(or rc.0..rc.8) map"
            )
        return int(m.group(1))

    @classmethod
    def from_numeric(cls, value: int) -> SemVer:
        """Inverse of :meth:`to_numeric` (build metadata is not carried; rcN comes back as rcN)."""
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 2_139_999_999:
            raise VersionError(f"{value!r} is not a numeric model version")
        major, rest = divmod(value, 10_000_000)
        minor, rest = divmod(rest, 10_000)
        patch, stage = divmod(rest, 10)
        return cls(major, minor, patch) if stage == 9 else cls(major, minor, patch, (f"rc{stage}",))


def parse_version(text: str) -> SemVer:
    """Shorthand for :meth:`SemVer.parse`."""
    return SemVer.parse(text)
