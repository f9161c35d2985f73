"""Serve the TUF repository directory to devices over MQTT request/response (DESIGN 4.4).

The protocol is :mod:`shared.protocol.repo`. This module is the control plane's end of it:

- one MQTT 5 session (:class:`controlplane.mqtt.MqttSubscriber`) subscribed to
  ``$share/{group}/mcp/v1/dev/+/repo``, so with several replicas each request reaches one;
  the session ends with its connection (no session expiry): the broker stops giving a killed
  replica its share at once, and a device's retry reaches a live one;
- every request is untrusted. Its response topic must be exactly ``repo/reply`` of the device
  named in the request topic (the broker's ACLs bound who may publish there); anything else is
  dropped and counted (``mcp_cp_repo_dropped_total{reason}``), with at most one log line per
  reason every :data:`LOG_INTERVAL_S`. A payload over :attr:`RepoRequest.MAX_BYTES`, JSON that
  does not parse or a path outside ``metadata/``/``targets/`` is answered ``bad_request`` with
  a reason; a file that is not there, not a regular file or reached through a symlink is
  answered ``not_found``; an I/O failure is answered ``error``;
- a chunk is read with ``os.pread`` from a small LRU of open file descriptors. An entry is
  reused only while ``stat`` of the path still names the same inode, size and mtime, so a file
  the repository replaces atomically (``timestamp.json``, ``root.json``) is never served stale;
- the reply goes to the response topic at the request's QoS with the request's correlation
  data; its payload is the bytes themselves, its user properties :class:`RepoReply`'s.

Nothing a device sends stops the service: every failure costs one request.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from mcp_edge.controlplane.broker.base import Credentials
from mcp_edge.controlplane.metrics import ControlPlaneMetrics
from mcp_edge.controlplane.mqtt import BrokerAddress, MqttSubscriber
from mcp_edge.shared.errors import TopicError
from mcp_edge.shared.mqtt import InboundMessage, MqttError
from mcp_edge.shared.protocol import topics
from mcp_edge.shared.protocol.repo import RepoReply, RepoStatus
from mcp_edge.shared.protocol.repo_request import RepoRequest
from mcp_edge.shared.protocol.topics import Channel

log = logging.getLogger("mcp.controlplane.repository.mqtt")

SHARE_GROUP = "cp"
LOG_INTERVAL_S = 10.0
_ROOT_PROBE = re.compile(r"metadata/[0-9]+\.root\.json")
"""The next root version a device probes for on every update (TUF's root rotation check)."""


@dataclass(frozen=True)
class RepoConnection:
    """How the repository service reaches the broker: its address and service account."""

    address: BrokerAddress
    credentials: Credentials


def repo_account_name(service_client_id: str) -> str:
    """The service account name (and client id) of the repository session of a replica whose
    ingestion session uses ``service_client_id``: ``{id}-repo``, within the 64-character limit."""
    return f"{service_client_id[:59]}-repo"


def subscription(share_group: str = SHARE_GROUP) -> str:
    """``$share/{group}/mcp/v1/dev/+/repo``: every device's repository requests, shared."""
    return topics.shared_subscription(share_group, topics.all_devices(Channel.REPO))


class _Refused(Exception):
    """A request answered with ``status`` and a reason instead of bytes."""

    def __init__(self, status: RepoStatus, reason: str) -> None:
        super().__init__(reason)
        self.status = status


@dataclass
class _OpenFile:
    fd: int
    key: tuple[int, int, int, int]  # st_dev, st_ino, st_size, st_mtime_ns
    size: int


class RepositoryFiles:
    """Read-only chunk access to a repository directory, confined to it.

    ``max_open`` file descriptors stay open (least recently used closed first).
    """

    def __init__(self, root: Path, *, max_open: int = 32) -> None:
        self.root = os.path.realpath(root)
        self._max_open = max_open
        self._open: OrderedDict[str, _OpenFile] = OrderedDict()

    def read(self, path: str, offset: int, length: int) -> tuple[int, bytes]:
        """Return ``(file size, up to length bytes from offset)`` of a validated repository path.

        Raises :class:`_Refused` (``not_found``: missing, not a regular file, a symlink on the
        way; ``error``: an I/O failure).
        """
        full = os.path.join(self.root, path)
        try:
            if os.path.realpath(full) != full:
                raise _Refused(RepoStatus.NOT_FOUND, f"{path} is not a file of the repository")
            st = os.stat(full, follow_symlinks=False)
        except FileNotFoundError:
            self._forget(path)
            raise _Refused(RepoStatus.NOT_FOUND, f"{path} does not exist") from None
        except OSError as e:
            raise _Refused(RepoStatus.ERROR, f"cannot read {path}: {e.strerror}") from e
        if not stat.S_ISREG(st.st_mode):
            raise _Refused(RepoStatus.NOT_FOUND, f"{path} is not a regular file")
        entry = self._entry(path, full, (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))
        if offset >= entry.size:
            return entry.size, b""
        try:
            data = os.pread(entry.fd, min(length, entry.size - offset), offset)
        except OSError as e:
            self._forget(path)
            raise _Refused(RepoStatus.ERROR, f"cannot read {path}: {e.strerror}") from e
        return entry.size, data

    def _entry(self, path: str, full: str, key: tuple[int, int, int, int]) -> _OpenFile:
        entry = self._open.get(path)
        if entry is not None and entry.key == key:
            self._open.move_to_end(path)
            return entry
        self._forget(path)
        try:
            fd = os.open(full, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            if e.errno in (errno.ENOENT, errno.ELOOP):
                raise _Refused(RepoStatus.NOT_FOUND, f"{path} does not exist") from None
            raise _Refused(RepoStatus.ERROR, f"cannot open {path}: {e.strerror}") from e
        st = os.fstat(fd)
        entry = _OpenFile(fd, (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns), st.st_size)
        self._open[path] = entry
        while len(self._open) > self._max_open:
            _, old = self._open.popitem(last=False)
            os.close(old.fd)
        return entry

    def _forget(self, path: str) -> None:
        entry = self._open.pop(path, None)
        if entry is not None:
            os.close(entry.fd)

    def close(self) -> None:
        """Close every open file descriptor."""
        while self._open:
            _, entry = self._open.popitem()
            os.close(entry.fd)


class RepoMqttService:
    """Answers repository requests from devices (see the module docstring).

    ``repo_dir`` is the :class:`controlplane.repository.tuf_repo.TufRepository` directory. Call
    :meth:`start` with a :class:`RepoConnection`, or feed :meth:`handle` from a session of your
    own; :meth:`stop` ends the session.
    """

    def __init__(
        self,
        repo_dir: Path,
        metrics: ControlPlaneMetrics,
        *,
        share_group: str = SHARE_GROUP,
        max_open_files: int = 32,
    ) -> None:
        self.files = RepositoryFiles(repo_dir, max_open=max_open_files)
        self._metrics = metrics
        self._share_group = share_group
        self._subscriber: MqttSubscriber | None = None
        self._last_log: dict[str, float] = {}

    async def start(self, connection: RepoConnection) -> None:
        """Subscribe at the broker and serve until :meth:`stop`.

        Raises :class:`mcp_edge.shared.mqtt.MqttError` when the broker cannot be used.
        """
        subscriber = MqttSubscriber(
            connection.address,
            connection.credentials,
            [subscription(self._share_group)],
            on_message=self.handle,
            name="repository",
            max_inflight=256,
            # No session after the connection: a request queued for a replica that died is
            # answered by nobody, while the share group's live members could answer it.
            session_expiry_s=0,
        )
        self._subscriber = subscriber  # before start: requests may arrive as soon as it is granted
        try:
            await subscriber.start()
        except BaseException:
            self._subscriber = None
            raise
        log.info(
            "serving the repository %s over MQTT at %s as %s",
            self.files.root,
            subscriber.where,
            connection.credentials.username,
        )

    @property
    def session(self) -> MqttSubscriber | None:
        """The broker session while started (for readiness and metrics)."""
        return self._subscriber

    async def stop(self) -> None:
        """End the broker session and close open files. Safe to call twice."""
        if self._subscriber is not None:
            await self._subscriber.close()
            self._subscriber = None
        self.files.close()

    # ---- event-loop thread -------------------------------------------------------------------

    def handle(self, message: InboundMessage) -> None:
        """Answer one request (or drop it, counted); never raises."""
        try:
            self._handle(message)
        except Exception:  # a bug must cost one request, not the service
            log.exception("repository: unexpected failure on %.120s", message.topic)
            self._drop("internal", message.topic, "unexpected failure")

    def _handle(self, message: InboundMessage) -> None:
        try:
            parsed = topics.parse(message.topic)
        except TopicError as e:
            self._drop("bad_topic", message.topic, str(e))
            return
        if not isinstance(parsed, topics.DeviceTopic) or parsed.channel is not Channel.REPO:
            self._drop("bad_topic", message.topic, "not a device's repo topic")
            return
        reply_to = topics.repo_reply(parsed.device_id)
        if message.response_topic != reply_to:
            self._drop(
                "bad_response_topic",
                message.topic,
                f"response topic {str(message.response_topic)[:120]!r} is not {reply_to}",
            )
            return
        if not message.correlation_data:
            self._drop("no_correlation", message.topic, "request without correlation data")
            return
        request = None
        try:
            request = self._parse(message.payload)
            size, data = self.files.read(request.path, request.offset, request.length)
        except _Refused as e:
            # Every update asks for the next root version until it is not found: no news.
            probe = (
                e.status is RepoStatus.NOT_FOUND
                and request is not None
                and _ROOT_PROBE.fullmatch(request.path) is not None
            )
            self._reply(message, reply_to, RepoReply(e.status, error=str(e)), b"", quiet=probe)
            return
        self._reply(
            message, reply_to, RepoReply(RepoStatus.OK, size=size, offset=request.offset), data
        )

    @staticmethod
    def _parse(payload: bytes) -> RepoRequest:
        if len(payload) > RepoRequest.MAX_BYTES:
            raise _Refused(
                RepoStatus.BAD_REQUEST,
                f"request of {len(payload)} bytes exceeds {RepoRequest.MAX_BYTES}",
            )
        try:
            return RepoRequest.model_validate_json(payload)
        except ValidationError as e:
            first = e.errors()[0] if e.errors() else {"msg": str(e), "loc": ()}
            where = ".".join(str(x) for x in first.get("loc", ())) or "request"
            raise _Refused(RepoStatus.BAD_REQUEST, f"{where}: {first['msg']}"[:300]) from None

    def _reply(
        self,
        message: InboundMessage,
        reply_to: str,
        reply: RepoReply,
        data: bytes,
        *,
        quiet: bool = False,
    ) -> None:
        subscriber = self._subscriber
        if subscriber is None:
            self._drop("not_connected", message.topic, "no broker session")
            return
        try:
            subscriber.publish_nowait(
                reply_to,
                data,
                qos=min(message.qos, 1),
                user_properties=reply.user_properties(),
                correlation_data=message.correlation_data,
            )
        except MqttError as e:
            self._drop("not_connected", message.topic, str(e))
            return
        self._metrics.repo_requests.labels(reply.status.value).inc()
        if data:
            self._metrics.repo_bytes.inc(len(data))
        if reply.status is not RepoStatus.OK and not quiet:
            self._note(
                f"reply:{reply.status.value}",
                "repository: answered %s to %s: %s",
                reply.status.value,
                message.topic,
                reply.error,
            )

    def _drop(self, reason: str, topic: str, detail: str) -> None:
        self._metrics.repo_dropped.labels(reason).inc()
        self._note(
            reason, "repository: dropped a request on %.120s (%s): %s", topic, reason, detail
        )

    def _note(self, key: str, fmt: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last_log.get(key, -LOG_INTERVAL_S) >= LOG_INTERVAL_S:
            self._last_log[key] = now
            log.warning(fmt, *args)
