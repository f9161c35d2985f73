"""What the HTTP server logs about requests it cannot parse: one short line, rate-limited.

aiohttp answers a request it cannot parse (a request line or header over its 8190-byte limit,
too many headers, a malformed line) with 400 itself, before any handler runs, and logs it at
ERROR with the parser's whole traceback. Anyone who can reach the port could fill the log with
those, one per request. :class:`MalformedRequestLog` stands in for the server's logger (aiohttp's
``RequestHandler`` takes one through ``web.AppRunner(app, logger=...)``): such a record becomes
one WARNING line without traceback, at most one every ``interval_s`` seconds, the next line
saying how many were left out meanwhile. Everything else passes through unchanged.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from aiohttp.http_exceptions import HttpProcessingError

REPORT_INTERVAL_S = 60.0
MAX_REASON_CHARS = 80
LOGGER_NAME = "mcp.controlplane.http"


def _exception_of(exc_info: object) -> BaseException | None:
    """The exception a logging call's ``exc_info`` argument names, if any."""
    if isinstance(exc_info, BaseException):
        return exc_info
    if isinstance(exc_info, tuple) and len(exc_info) == 3:
        return exc_info[1] if isinstance(exc_info[1], BaseException) else None
    if exc_info is True:
        return sys.exc_info()[1]
    return None


def _reason(error: HttpProcessingError) -> str:
    """The parser's message up to the first colon (what follows echoes the client's bytes),
    printable and capped: the client chose those bytes."""
    head = (error.message or type(error).__name__).split("\n", 1)[0].split(":", 1)[0].strip()
    printable = "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in head)
    return printable[:MAX_REASON_CHARS] or type(error).__name__


if TYPE_CHECKING:
    _Adapter = logging.LoggerAdapter[logging.Logger]
else:  # subscriptable at run time only from Python 3.11
    _Adapter = logging.LoggerAdapter


class MalformedRequestLog(_Adapter):
    """A logger for aiohttp's ``RequestHandler`` that reports unparsable requests briefly.

    ``interval_s`` (seconds) is the shortest time between two such lines; ``clock`` gives
    monotonic seconds. Thread-safe; one instance per server keeps its own count.
    """

    def __init__(
        self,
        logger: logging.Logger | None = None,
        *,
        interval_s: float = REPORT_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(logger or logging.getLogger(LOGGER_NAME), {})
        self._interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last_report: float | None = None
        self._left_out = 0

    def log(self, level: int, msg: object, *args: Any, **kwargs: Any) -> None:
        error = _exception_of(kwargs.get("exc_info"))
        # Below WARNING (aiohttp logs TLS or other non-HTTP bytes on a fresh connection at
        # DEBUG) the operator asked for detail: leave those as they are.
        if level < logging.WARNING or not isinstance(error, HttpProcessingError):
            super().log(level, msg, *args, **kwargs)
            return
        with self._lock:
            now = self._clock()
            if self._last_report is not None and now - self._last_report < self._interval_s:
                self._left_out += 1
                return
            left_out, self._left_out, self._last_report = self._left_out, 0, now
        # aiohttp calls ``exception("Error handling request from %s", request.remote)``.
        peer = args[0] if len(args) == 1 else "a client"
        tail = f"; {left_out} more since the last report" if left_out else ""
        self.logger.warning(
            "refused an unparsable HTTP request from %s with %d: %s%s",
            peer,
            error.code or 400,
            _reason(error),
            tail,
        )


def server_logging() -> Mapping[str, Any]:
    """Keyword arguments for ``web.AppRunner`` that install a fresh :class:`MalformedRequestLog`
    as the server's logger."""
    return {"logger": MalformedRequestLog()}
