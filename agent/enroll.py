"""``mcp-agent enroll``: join a fleet (DESIGN 4.1, the device's side).

The agent detects its hardware, creates its Ed25519 key once, and POSTs a signed, nonce-bearing
request to ``{server}/api/v1/enroll``. The answer (device id, broker URLs and credentials,
trust root) is stored atomically with mode 0600. Re-running on an enrolled device changes
nothing unless ``force`` is set; a pending answer can be waited on (each poll is a fresh,
freshly signed request, so no request is ever replayed). A ``503`` answer (the control plane's
database or broker is unavailable; nothing changed there) is asked again, with a fresh request,
after a growing, jittered pause (``retries`` times at most), so a fleet that enrolls at once
spreads out instead of failing.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable, Mapping
from datetime import datetime, timezone
from pathlib import Path

import aiohttp

from mcp_edge.agent import __version__
from mcp_edge.agent.identity import load_enrollment, load_or_create_device_key, save_enrollment
from mcp_edge.shared.errors import McpError, MessageError
from mcp_edge.shared.protocol.codec import decode, loads
from mcp_edge.shared.protocol.enrollment import (
    EnrollmentAnswer,
    EnrollmentRequest,
    EnrollmentStatus,
    new_nonce,
    sign_enrollment,
)

log = logging.getLogger("mcp.agent.enroll")


class EnrollError(McpError):
    """The control plane refused the enrollment or could not be reached."""


class ServerUnavailableError(EnrollError):
    """The control plane answered 503: its database or broker is unavailable and nothing
    changed; the same enrollment may be asked again later."""


class AlreadyEnrolled(McpError):
    """This device is enrolled already (use force to enroll again)."""


RETRIES = 6
RETRY_S = 0.5
RETRY_MAX_S = 15.0


def retry_delay_s(attempt: int, *, base_s: float = RETRY_S, cap_s: float = RETRY_MAX_S) -> float:
    """The pause before retry number ``attempt`` (1, 2, ...) after a 503: ``base_s`` doubled per
    attempt up to ``cap_s``, times a random factor in [0.5, 1) so devices refused together do
    not come back together (seconds)."""
    return float(min(cap_s, base_s * 2.0 ** (attempt - 1)) * (0.5 + random.random() / 2))


def _utcnow() -> datetime:
    return datetime.now(timezone.utc)


async def enroll(
    server: str,
    token: str,
    *,
    state_dir: Path,
    profile: str,
    facts: Mapping[str, object],
    labels: Mapping[str, str] | None = None,
    device_id: str | None = None,
    force: bool = False,
    wait_s: float = 0.0,
    poll_s: float = 5.0,
    clock: Callable[[], datetime] = _utcnow,
    timeout_s: float = 30.0,
    retries: int = RETRIES,
    retry_s: float = RETRY_S,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> EnrollmentAnswer:
    """Enroll with ``server``; return the stored answer.

    ``timeout_s`` bounds each request (seconds); a 503 answer is retried ``retries`` times at
    most, after :func:`retry_delay_s` of ``retry_s`` (``sleep`` waits).

    Raises :class:`AlreadyEnrolled` (enrolled and not ``force``), :class:`EnrollError`
    (refused, unreachable, or still pending after ``wait_s``), :class:`ServerUnavailableError`
    (503 after every retry).
    """
    existing = load_enrollment(state_dir)
    if existing is not None and existing.answer.status is EnrollmentStatus.ACCEPTED and not force:
        raise AlreadyEnrolled(
            f"already enrolled as {existing.answer.device_id} with {existing.server}; "
            "nothing changed (use --force to enroll again)"
        )
    key = load_or_create_device_key(state_dir)
    base = server.rstrip("/")
    deadline = asyncio.get_running_loop().time() + wait_s
    refused = 0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as http:
        while True:
            request = EnrollmentRequest(
                device_id=device_id,
                public_key=key.public_key.raw.hex(),
                token=token,
                nonce=new_nonce(),
                timestamp=clock(),
                profile=profile,
                labels=dict(labels or {}),
                facts=dict(facts),
                agent_version=__version__,
            )
            try:
                answer = await _post(http, base, sign_enrollment(request, key), force)
            except ServerUnavailableError as e:
                refused += 1
                if refused > retries:
                    raise
                delay = retry_delay_s(refused, base_s=retry_s)
                log.warning("%s; asking again in %.1f s", e, delay)
                await sleep(delay)
                continue
            save_enrollment(state_dir, server, answer)
            if answer.trust is not None and answer.trust.tuf_root is not None:
                _store_tuf_root(state_dir, answer.trust.tuf_root)
            if answer.status is EnrollmentStatus.ACCEPTED:
                return answer
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                return answer
            log.info("enrollment pending approval; asking again in %.0f s", poll_s)
            await asyncio.sleep(min(poll_s, remaining))


async def _post(
    http: aiohttp.ClientSession, base: str, envelope: dict[str, object], force: bool
) -> EnrollmentAnswer:
    url = f"{base}/api/v1/enroll" + ("?force=true" if force else "")
    try:
        async with http.post(url, json=envelope) as resp:
            body = await resp.content.read(EnrollmentAnswer.MAX_BYTES + 1)
            if resp.status == 503:
                raise ServerUnavailableError(f"{base} is unavailable (503): {_reason(body)}")
            if resp.status != 200:
                raise EnrollError(f"{base} refused the enrollment ({resp.status}): {_reason(body)}")
    except aiohttp.ClientError as e:
        raise EnrollError(f"cannot reach {base}: {e}") from e
    except asyncio.TimeoutError as e:
        raise EnrollError(f"{base} did not answer in time") from e
    try:
        return decode(body, EnrollmentAnswer)
    except MessageError as e:
        raise EnrollError(f"{base} sent an answer this agent cannot read: {e}") from e


def _store_tuf_root(state_dir: Path, root: dict[str, object]) -> None:
    """Keep the TUF root from the answer as the update agent's trust anchor."""
    import json

    from mcp_edge.agent.update.trust_root import store_bootstrap_root

    try:
        store_bootstrap_root(state_dir, json.dumps(root).encode())
    except ValueError as e:
        raise EnrollError(f"the control plane sent an unusable TUF root: {e}") from e


def _reason(body: bytes) -> str:
    try:
        doc = loads(body, max_bytes=64 * 1024)
    except MessageError:
        return body[:200].decode("utf-8", "replace")
    if isinstance(doc, dict) and isinstance(doc.get("error"), str):
        return str(doc["error"])
    return str(doc)[:200]
