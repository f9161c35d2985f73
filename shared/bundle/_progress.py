"""A byte-count progress bar on stderr that stays silent when stderr is not a terminal."""

from __future__ import annotations

import sys
from typing import Any, Protocol


class Progress(Protocol):
    def update(self, n: int) -> Any: ...

    def close(self) -> Any: ...


class _Silent:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total: int, desc: str, enabled: bool) -> Progress:
    """A tqdm bar of ``total`` bytes when ``enabled`` and stderr is a TTY, else a no-op."""
    if not enabled or not sys.stderr.isatty():
        return _Silent()
    from tqdm import tqdm

    bar: Progress = tqdm(
        total=total,
        desc=desc,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        file=sys.stderr,
        leave=False,
    )
    return bar
