"""``mcp-sim enroll``: enroll N simulated devices with a real control plane, as devices do.

Each device gets its own Ed25519 key and POSTs a signed, nonce-bearing
:class:`~shared.protocol.enrollment.EnrollmentRequest` to ``{server}/api/v1/enroll``, exactly
what ``mcp-agent enroll`` (:mod:`agent.enroll`) sends; the answer (broker credentials, trust
root) is checked by :class:`~shared.protocol.enrollment.EnrollmentAnswer` and kept in the state
directory (:mod:`.fleet`). Several requests run at once (``concurrency``).

The token decides how devices get in:

- an enrollment token (``mcpe_...``): used as is; its group and labels apply, the labels
  given here are added to the request;
- an operator API token (``mcpa_...``): an enrollment token is created first for the group and
  labels given (``POST /api/v1/enrollment-tokens``, as many uses as devices), or, with
  ``preauthorize``, each device's key is accepted in advance (``POST
  /api/v1/preauthorizations``) and the device then enrolls with no enrollment token.

A control plane that answers 503 (database or broker busy) or does not answer within
``timeout_s`` is asked again, with a fresh nonce, after a short backoff (a request that timed
out may still have been carried out: the control plane then answers the repeat for the same
key with the device it already has); any other refusal stops the enrollment with
:class:`SimEnrollError` (devices enrolled so far stay in the state directory).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import aiohttp

from mcp_edge.agent import __version__ as agent_version
from mcp_edge.shared.errors import McpError, MessageError
from mcp_edge.shared.protocol.codec import decode, loads
from mcp_edge.shared.protocol.enrollment import (
    EnrollmentAnswer,
    EnrollmentRequest,
    EnrollmentStatus,
    new_nonce,
    sign_enrollment,
)
from mcp_edge.shared.protocol.topics import validate_id
from mcp_edge.shared.signing import PrivateKey
from mcp_edge.tooling.sim.fleet import (
    DeviceRecord,
    Trust,
    append_devices,
    load_devices,
    load_trust,
    save_fleet_header,
)

log = logging.getLogger("mcp.sim.enroll")

API_TOKEN_PREFIX = "mcpa_"
ENROLLMENT_TOKEN_PREFIX = "mcpe_"
PREAUTHORIZED_TOKEN = "preauthorized-key"
"""What a preauthorized device sends as its token (the control plane matches its key)."""
FACTS: Mapping[str, Any] = {"os": "linux", "cpu_count": 4, "simulated": True}
BATCH = 200
"""Devices written to ``devices.jsonl`` at a time."""
RETRIES = 8
MAX_TAKEN = 1000
"""Taken device ids skipped before giving up."""
"""Attempts after a 503 or a timeout, per device."""


class SimEnrollError(McpError):
    """The control plane refused an enrollment or could not be reached."""


class _NoAnswer(SimEnrollError):
    """An enrollment request got no answer within the timeout (it is asked again)."""


class _IdTaken(SimEnrollError):
    """The control plane holds the device id for another key."""


@dataclass(frozen=True)
class EnrollPlan:
    """What ``mcp-sim enroll`` was asked for (built by the CLI)."""

    control_plane: str
    token: str
    devices: int
    state_dir: Path
    group: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    prefix: str = "sim"
    profile: str = "generic-x86_64"
    preauthorize: bool = False
    concurrency: int = 8
    timeout_s: float = 120.0
    """Per request; Mosquitto 2.0 makes enrollments slow on a large fleet (docs/simulator.md)."""

    def __post_init__(self) -> None:
        if self.token.startswith(ENROLLMENT_TOKEN_PREFIX):
            if self.group is not None or self.preauthorize:
                raise SimEnrollError(
                    "an enrollment token carries its own group; create it with --group, or "
                    "give an operator API token (mcpa_...) to set the group here"
                )
        elif not self.token.startswith(API_TOKEN_PREFIX):
            raise SimEnrollError("--token must be an enrollment token (mcpe_...) or an "
                                 "operator API token (mcpa_...)")  # fmt: skip
        validate_id(self.prefix + "-00000", "device id prefix")
        if self.group is not None:
            validate_id(self.group, "group")


@dataclass
class EnrollResult:
    enrolled: int
    pending: list[str]
    seconds: float
    total: int


async def enroll_fleet(
    plan: EnrollPlan, *, progress: Callable[[int, int, float], None] | None = None
) -> EnrollResult:
    """Enroll ``plan.devices`` new devices into ``plan.state_dir``; see the module docstring.

    ``progress(done, wanted, seconds)`` is called every few seconds. Raises
    :class:`SimEnrollError`.
    """
    state_dir = plan.state_dir
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    existing = {d.device_id for d in load_devices(state_dir)}
    ids = _new_ids(plan.prefix, existing)
    wanted = plan.devices
    skipped = 0
    base = plan.control_plane.rstrip("/")
    started = time.monotonic()
    records: list[DeviceRecord] = []
    pending: list[str] = []
    done = 0
    trust_seen: list[Trust | None] = [load_trust(state_dir)]
    timeout = aiohttp.ClientTimeout(total=plan.timeout_s)
    connector = aiohttp.TCPConnector(limit=plan.concurrency)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        token = plan.token
        if token.startswith(API_TOKEN_PREFIX) and not plan.preauthorize:
            token = await _create_token(http, base, plan)
        started_count = 0
        last_note = started

        async def worker() -> None:
            nonlocal done, last_note, started_count, skipped
            while started_count < wanted:
                started_count += 1
                device_id = next(ids)
                try:
                    record, answer = await _enroll_one(http, base, plan, token, device_id)
                except _IdTaken:
                    # The control plane has this id for another key (an earlier enrollment
                    # whose answer never came back): take the next free one.
                    skipped += 1
                    started_count -= 1
                    if skipped > MAX_TAKEN:
                        raise SimEnrollError(f"{skipped} device ids under {plan.prefix}- are "
                                             "taken at the control plane; use --prefix") from None  # fmt: skip
                    continue
                done += 1
                if record is None:
                    pending.append(device_id)
                else:
                    records.append(record)
                    _keep_trust(state_dir, base, answer, trust_seen)
                if len(records) >= BATCH:
                    append_devices(state_dir, records)
                    records.clear()
                now = time.monotonic()
                if progress is not None and now - last_note >= 5.0:
                    last_note = now
                    progress(done, wanted, now - started)

        workers = [asyncio.create_task(worker()) for _ in range(plan.concurrency)]
        try:
            await asyncio.gather(*workers)
        finally:
            for w in workers:
                w.cancel()
            append_devices(state_dir, records)
    enrolled = len(load_devices(state_dir)) - len(existing)
    return EnrollResult(enrolled, pending, time.monotonic() - started, len(existing) + enrolled)


def _new_ids(prefix: str, taken: set[str]) -> Iterator[str]:
    """``prefix-00000``, ``prefix-00001``, ... skipping the ids in ``taken``."""
    for i in itertools.count():
        candidate = f"{prefix}-{i:05d}"
        if candidate not in taken:
            yield candidate


def _keep_trust(
    state_dir: Path, base: str, answer: EnrollmentAnswer, seen: list[Trust | None]
) -> None:
    trust = answer.trust
    if trust is None or trust.tuf_root is None:
        raise SimEnrollError(f"{base} accepted {answer.device_id} without a TUF trust root")
    current = Trust(
        tuf_root=json.dumps(trust.tuf_root).encode(),
        director_keys=tuple(trust.director_keys),
        publisher_keys=tuple(trust.publisher_keys),
    )
    if seen[0] != current:
        save_fleet_header(state_dir, base, current)
        seen[0] = current


async def _create_token(http: aiohttp.ClientSession, base: str, plan: EnrollPlan) -> str:
    body = {
        "group": plan.group, "labels": dict(plan.labels), "max_uses": plan.devices + 100,
        "expires_in_s": 24 * 3600, "description": f"mcp-sim enroll of {plan.devices} devices",
    }  # fmt: skip
    status, doc = await _call(http, "POST", f"{base}/api/v1/enrollment-tokens", body, plan.token)
    if status != 201 or not isinstance(doc, dict) or not isinstance(doc.get("token"), str):
        raise SimEnrollError(f"{base} did not create an enrollment token ({status}): "
                             f"{_reason(doc)}")  # fmt: skip
    return str(doc["token"])


async def _enroll_one(
    http: aiohttp.ClientSession, base: str, plan: EnrollPlan, token: str, device_id: str
) -> tuple[DeviceRecord | None, EnrollmentAnswer]:
    key = PrivateKey.generate()
    public = key.public_key.raw.hex()
    if plan.preauthorize:
        body = {"public_key": public, "device_id": device_id, "group": plan.group,
                "labels": dict(plan.labels)}  # fmt: skip
        status, doc = await _call(http, "POST", f"{base}/api/v1/preauthorizations", body, token)
        if status != 201:
            raise SimEnrollError(f"{base} refused to preauthorize {device_id} ({status}): "
                                 f"{_reason(doc)}")  # fmt: skip
        token = PREAUTHORIZED_TOKEN
    request = EnrollmentRequest(
        device_id=device_id, public_key=public, token=token, nonce=new_nonce(),
        timestamp=datetime.now(timezone.utc), profile=plan.profile,
        labels={} if plan.preauthorize else dict(plan.labels), facts=dict(FACTS),
        agent_version=agent_version,
    )  # fmt: skip
    envelope = sign_enrollment(request, key)
    for attempt in range(RETRIES + 1):
        try:
            status, raw = await _post_raw(http, f"{base}/api/v1/enroll", envelope)
        except _NoAnswer:
            if attempt == RETRIES:
                raise
            status, raw = 503, b""
        if status != 503 or attempt == RETRIES:
            break
        await asyncio.sleep(min(5.0, 0.2 * 2**attempt))
        # A fresh nonce and time for the retry: the first nonce may have been remembered.
        request = request.model_copy(
            update={"nonce": new_nonce(), "timestamp": datetime.now(timezone.utc)}
        )
        envelope = sign_enrollment(request, key)
    if status != 200:
        reason = _reason(_json_or_none(raw))
        if status == 409 and ("belongs to another key" in reason or "not available" in reason):
            raise _IdTaken(reason)
        raise SimEnrollError(f"{base} refused the enrollment of {device_id} ({status}): "
                             f"{reason}")  # fmt: skip
    try:
        answer = decode(raw, EnrollmentAnswer)
    except MessageError as e:
        raise SimEnrollError(f"{base} sent an enrollment answer that does not parse: {e}") from e
    if answer.status is not EnrollmentStatus.ACCEPTED or answer.broker is None:
        return None, answer
    b = answer.broker
    record = DeviceRecord(
        device_id=answer.device_id, key_seed=key.seed.hex(), broker_urls=tuple(b.urls),
        username=b.username, password=b.password, client_id=b.client_id,
        group=plan.group, labels=dict(plan.labels),
    )  # fmt: skip
    return record, answer


async def _post_raw(
    http: aiohttp.ClientSession, url: str, body: Mapping[str, Any]
) -> tuple[int, bytes]:
    try:
        async with http.post(url, json=body) as resp:
            return resp.status, await resp.content.read(EnrollmentAnswer.MAX_BYTES + 1)
    except aiohttp.ClientError as e:
        raise SimEnrollError(f"cannot reach {url}: {e}") from e
    except asyncio.TimeoutError as e:
        raise _NoAnswer(f"{url} did not answer in time") from e


async def _call(
    http: aiohttp.ClientSession, method: str, url: str, body: Any, token: str
) -> tuple[int, Any]:
    try:
        async with http.request(
            method, url, json=body, headers={"Authorization": f"Bearer {token}"}
        ) as resp:
            return resp.status, _json_or_none(await resp.content.read(256 * 1024))
    except aiohttp.ClientError as e:
        raise SimEnrollError(f"cannot reach {url}: {e}") from e
    except asyncio.TimeoutError as e:
        raise SimEnrollError(f"{url} did not answer in time") from e


def _json_or_none(body: bytes) -> Any:
    try:
        return loads(body, max_bytes=256 * 1024)
    except MessageError:
        return body[:200].decode("utf-8", "replace")


def _reason(doc: Any) -> str:
    if isinstance(doc, dict) and isinstance(doc.get("error"), str):
        return str(doc["error"])[:300]
    return str(doc)[:300]


def parse_labels(items: Sequence[str]) -> dict[str, str]:
    """``k=v`` items → a dict; raises :class:`SimEnrollError` for an item without ``=``."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SimEnrollError(f"label {item!r} must look like key=value")
        out[key] = value
    return out
