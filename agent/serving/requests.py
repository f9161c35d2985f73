"""What every inference transport shares: request options, the error answer, failure → code.

The HTTP API (:mod:`.http_api`) and the MQTT inference topics
(:mod:`mcp_edge.agent.fleet.mqtt_inference`) read the same options and answer the same
failures with the same code and message. Each transport passes its own lookup (HTTP headers,
MQTT 5 user properties) and the names the options go by there::

    option        HTTP header       MQTT user property   meaning
    version       X-Model-Version   model-version        pin a version (canary included)
    request key   X-Request-Key     request-key          sticky canary routing
    priority      X-Priority        priority             high | normal | low (default normal)
    timeout       X-Timeout-Ms      timeout-ms           deadline in ms, in (0, 3600000]

An empty version or request key is the same as none. A bad priority or timeout is a
``bad_request`` naming the option as that transport spells it. Options are read before the
model is looked up, so a request with a bad option and an unknown model gets ``bad_request``
on every transport.

Every failure reaches the client as a :class:`RequestError` (:func:`classify`)::

    RequestError                                 as it is
    MessageError, InputError, PreprocessError    bad_request   (the message as it is)
    ModelNotFoundError                           not_found
    OverloadedError                              overloaded    "overloaded: …", retry_after_s
    DeadlineExceededError                        timeout       "timed out: …"
    BatcherClosedError                           unavailable   (the version was unloaded)
    InferenceError                               internal      "inference failed: …"
    anything else                                internal      "internal error: <type>", logged

The code gives the HTTP status (:attr:`ErrorCode.http_status`), which MQTT replies carry too.

Statistics: both transports ask the model manager to count each request's runs
(``ModelManager.infer(..., counted=True)``: the answer, a canary failure handed to stable, a
shadow's copy, each under its version's role) and count a request that failed after routing
but before it ran with :func:`count_unrun` (an error, or a rejection for ``overloaded`` and
``timeout``: :func:`outcome_for`). A request that never reached a version (bad options, unknown
model, body not JSON or over the cap) is in no version's statistics, only in the metrics by
code. This module imports no transport library.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from mcp_edge.agent.runtime.batcher import (
    BatcherClosedError,
    DeadlineExceededError,
    OverloadedError,
    Priority,
)
from mcp_edge.agent.runtime.manager import LoadedVersion, ModelManager, ModelNotFoundError, Outcome
from mcp_edge.agent.runtime.runner import InferenceError, InputError
from mcp_edge.agent.serving.preprocess import PreprocessError
from mcp_edge.shared.errors import MessageError
from mcp_edge.shared.protocol.wire import ErrorCode

log = logging.getLogger("mcp.agent.serving")

MAX_TIMEOUT_S = 3600.0
"""The longest deadline a request may ask for (seconds)."""


class RequestError(Exception):
    """A request answered with an error: ``code`` (which gives the status), the message, and
    for ``overloaded`` the seconds after which to retry."""

    def __init__(self, code: ErrorCode, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.retry_after_s = retry_after_s


def classify(e: Exception) -> RequestError:
    """The error answer for a failure while serving a request (see the module docstring).

    Never raises; an exception it does not know is logged with its traceback and answered
    ``internal`` without its message (which may hold internals).
    """
    if isinstance(e, RequestError):
        return e
    if isinstance(e, (MessageError, InputError, PreprocessError)):
        return RequestError(ErrorCode.BAD_REQUEST, str(e))
    if isinstance(e, ModelNotFoundError):
        return RequestError(ErrorCode.NOT_FOUND, str(e))
    if isinstance(e, OverloadedError):
        return RequestError(ErrorCode.OVERLOADED, f"overloaded: {e}", e.retry_after_s)
    if isinstance(e, DeadlineExceededError):
        return RequestError(ErrorCode.TIMEOUT, f"timed out: {e}")
    if isinstance(e, BatcherClosedError):
        return RequestError(ErrorCode.UNAVAILABLE, str(e))
    if isinstance(e, InferenceError):
        return RequestError(ErrorCode.INTERNAL, f"inference failed: {e}")
    log.exception("unexpected error while handling a request")
    return RequestError(ErrorCode.INTERNAL, f"internal error: {type(e).__name__}")


def outcome_for(err: RequestError) -> Outcome:
    """How a request answered with ``err`` counts: overload and deadline are rejections."""
    if err.code is ErrorCode.OVERLOADED or err.code is ErrorCode.TIMEOUT:
        return Outcome.REJECTED
    return Outcome.ERROR


class SuccessCounter:
    """Counts answered requests on every transport: the requests counter (code 200) and the
    latency histogram, their label children kept per (model, version, protocol) so that the
    hot path looks them up once."""

    def __init__(self, manager: ModelManager) -> None:
        self._metrics = manager.metrics
        self._children: dict[tuple[str, str, str], tuple[Any, Any]] = {}

    def count(self, lv: LoadedVersion, protocol: str, started: float) -> float:
        """Count one request ``lv`` answered over ``protocol``; its seconds since ``started``
        (a ``time.perf_counter()`` reading)."""
        key = (lv.name, lv.version, protocol)
        children = self._children.get(key)
        if children is None:
            m = self._metrics
            children = self._children[key] = (
                m.requests.labels(lv.name, protocol, "200"),
                m.latency.labels(lv.name, lv.version),
            )
        elapsed = time.perf_counter() - started
        children[0].inc()
        children[1].observe(elapsed)
        return elapsed


def count_failure(
    manager: ModelManager,
    model: str,
    protocol: str,
    err: RequestError,
    lv: LoadedVersion | None,
    ran: bool,
    elapsed_s: float,
) -> None:
    """Everything a failed request counts, on every transport: the Triton statistics of the
    version it was routed to (``lv``; None: never routed), its statistics as a request that
    never ran (``ran`` False), and the metrics by code (``protocol``: the label). Only a
    loaded model's name becomes a label value: a request must not mint metric series."""
    if lv is not None:
        lv.statistics.on_failure(elapsed_s)
        if not ran:
            count_unrun(manager, lv, err, elapsed_s)
    label = model if model in manager.loaded_names else "_unknown"
    m = manager.metrics
    if err.code is ErrorCode.OVERLOADED or err.code is ErrorCode.TIMEOUT:
        m.rejections.labels(label, err.code.value).inc()
    else:
        m.errors.labels(label, err.code.value).inc()
    m.requests.labels(label, protocol, str(err.code.http_status)).inc()


def count_unrun(
    manager: ModelManager, lv: LoadedVersion | None, err: RequestError, latency_s: float
) -> None:
    """Count a request routed to ``lv`` that failed with ``err`` before it ran (None: it was
    never routed, and nothing is counted)."""
    if lv is not None:
        manager.count_refused(lv, latency_s, outcome_for(err))


class RequestOptions(NamedTuple):
    """What a request asks for besides its inputs (a tuple: cheap to build and unpack on the
    hot path)."""

    version: str | None = None
    """The version it pins (it may be a canary out of rotation); None: routed."""
    request_key: str | None = None
    """Requests with the same key go to the same version while a canary runs."""
    priority: Priority = Priority.NORMAL
    timeout_s: float | None = None
    """Its deadline in seconds; None: the batcher's default."""


DEFAULT_OPTIONS = RequestOptions()
_NORMAL = Priority.NORMAL
# RequestOptions(...) goes through a Python-level __new__; this is the same tuple at half the
# cost, which shows on a request path that otherwise costs a few microseconds.
_options = tuple.__new__


class OptionNames(NamedTuple):
    """What each option is called on one transport (looked up, and named in errors)."""

    version: str
    request_key: str
    priority: str
    timeout_ms: str


HTTP_HEADERS = OptionNames("X-Model-Version", "X-Request-Key", "X-Priority", "X-Timeout-Ms")
MQTT_PROPERTIES = OptionNames("model-version", "request-key", "priority", "timeout-ms")


def parse_options(
    lookup: Callable[[str], str | None], names: OptionNames, version: str | None = None
) -> RequestOptions:
    """The options of one request; ``lookup(name)`` gives an option's value or None.

    ``version``, when given, is a version the request names elsewhere (the HTTP path) and wins
    over the version option. Raises :class:`RequestError` (bad_request) for an unknown
    priority or a timeout that is not a number of milliseconds in (0, 3600000].
    """
    version_name, key_name, priority_name, timeout_name = names
    if version is None:
        version = lookup(version_name) or None
    request_key = lookup(key_name) or None
    raw_priority = lookup(priority_name)
    raw_timeout = lookup(timeout_name)
    if raw_priority is None and raw_timeout is None:
        # Most requests set no option: no parsing, and no new object when none is set at all.
        if version is None and request_key is None:
            return DEFAULT_OPTIONS
        return _options(RequestOptions, (version, request_key, _NORMAL, None))
    try:
        priority = Priority.parse(raw_priority)
    except ValueError as e:
        raise RequestError(ErrorCode.BAD_REQUEST, str(e)) from None
    timeout_s = None
    if raw_timeout is not None:
        try:
            timeout_s = float(raw_timeout) / 1000.0
        except ValueError:
            raise RequestError(ErrorCode.BAD_REQUEST, f"{timeout_name} must be a number") from None
        # Written so that NaN fails too.
        if not 0 < timeout_s <= MAX_TIMEOUT_S:
            raise RequestError(ErrorCode.BAD_REQUEST, f"{timeout_name} must be in (0, 3600000]")
    return _options(RequestOptions, (version, request_key, priority, timeout_s))
