"""The control plane's server logger: unparsable requests make one short line per interval,
the next line counts those left out, and every other record passes unchanged.

The adapter is driven the way aiohttp's ``RequestHandler.handle_error`` calls its logger, with
the parser's real exception types.
"""

from __future__ import annotations

import logging

import pytest
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong

from mcp_edge.controlplane.httplog import MalformedRequestLog


class ManualClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def logger() -> logging.Logger:
    return logging.getLogger("tests.httplog")


def _too_long() -> LineTooLong:
    return LineTooLong("b'\\x1b[31m" + "a" * 200 + "'", "8190")


def test_one_line_per_interval_then_a_count_of_those_left_out(
    logger: logging.Logger, caplog: pytest.LogCaptureFixture
) -> None:
    clock = ManualClock()
    log = MalformedRequestLog(logger, interval_s=60.0, clock=clock)
    with caplog.at_level(logging.DEBUG, logger.name):
        for _ in range(5):
            log.exception("Error handling request from %s", "192.0.2.7", exc_info=_too_long())
        clock.now += 59.0
        log.exception("Error handling request from %s", "192.0.2.7", exc_info=_too_long())
        clock.now += 1.0
        log.exception(
            "Error handling request from %s",
            "192.0.2.8",
            exc_info=BadHttpMessage("Too many headers received"),
        )

    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "refused an unparsable HTTP request from 192.0.2.7 with 400: Got more than 8190 bytes "
        "when reading",
        "refused an unparsable HTTP request from 192.0.2.8 with 400: Too many headers received; "
        "5 more since the last report",
    ]
    assert all(r.levelno == logging.WARNING and r.exc_info is None for r in caplog.records)


def test_other_records_pass_unchanged(
    logger: logging.Logger, caplog: pytest.LogCaptureFixture
) -> None:
    log = MalformedRequestLog(logger, clock=ManualClock())
    with caplog.at_level(logging.DEBUG, logger.name):
        try:
            raise RuntimeError("handler bug")
        except RuntimeError:
            log.exception("Unhandled exception")
        # aiohttp logs non-HTTP bytes on a fresh connection at DEBUG: left as it is.
        log.debug(
            "Error handling request from %s",
            "192.0.2.9",
            exc_info=BadHttpMessage("Invalid method encountered"),
        )

    bug, probe = caplog.records
    assert bug.levelno == logging.ERROR and bug.exc_info is not None
    assert bug.getMessage() == "Unhandled exception"
    assert probe.levelno == logging.DEBUG and probe.exc_info is not None
