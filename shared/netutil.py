"""TCP helpers both sides and the tooling share: the self-connect check and the choice of ports.

A TCP self-connect: a client connects to a loopback port nobody listens on, and the kernel
happens to pick that very port as the client's source port. The SYN then meets itself
(a simultaneous open) and the socket is connected to itself: what it sends, it reads back (an
MQTT client reads its own CONNECT). When that socket is closed the usual way, its TIME_WAIT
holds the port for a minute, so a server that then starts on the port fails with "Address
already in use". Only a port inside the kernel's ephemeral range can be picked as a source
port, so a server port below that range (1883 and 8883 are) cannot be hit. Clients check
:func:`is_self_connected` right after connecting and drop such a socket with
:func:`close_with_reset`; tests and the demo put servers on :func:`free_port_below_ephemeral`.

Standard library only (``socket``); no I/O framework.
"""

from __future__ import annotations

import contextlib
import random
import socket
import struct
from collections.abc import Iterable
from pathlib import Path

EPHEMERAL_RANGE_PATH = Path("/proc/sys/net/ipv4/ip_local_port_range")
DEFAULT_EPHEMERAL_RANGE = (32768, 60999)
"""Linux's default ephemeral range, used where the kernel's setting cannot be read."""
LOWEST_PORT = 20000
"""Ports are chosen from ``[LOWEST_PORT, start of the ephemeral range)`` (below 20000 live
well-known services a test must not disturb)."""
_MIN_WINDOW = 1000  # fewer free candidates than this and parallel runs would collide often
_RANGE_FILE_MAX_BYTES = 64
_ATTEMPTS = 200


class NoFreePortError(OSError):
    """No candidate port could be bound."""


def is_self_connected(sock: socket.socket) -> bool:
    """Whether a connected TCP socket is connected to itself (local address == peer address).

    False for a socket that is not TCP over IPv4/IPv6 or not connected.
    """
    try:
        if sock.family not in (socket.AF_INET, socket.AF_INET6):
            return False
        local, peer = sock.getsockname(), sock.getpeername()
    except (OSError, AttributeError):
        return False
    # IPv6 names carry flow info and scope id too: host and port are what identify the end.
    return bool(local[:2] == peer[:2])


def close_with_reset(sock: socket.socket) -> None:
    """Close a connected socket with a reset (``SO_LINGER`` 0) instead of the FIN handshake.

    Why: a socket closed the usual way stays in TIME_WAIT for a minute, holding its local port;
    for a self-connected socket that port is the server's. Never raises.
    """
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()


def ephemeral_port_range(path: Path = EPHEMERAL_RANGE_PATH) -> tuple[int, int]:
    """The kernel's ephemeral port range ``(low, high)``, both included.

    Read from ``path`` (Linux's ``ip_local_port_range``: two numbers); a missing, unreadable
    or malformed file gives :data:`DEFAULT_EPHEMERAL_RANGE`.
    """
    try:
        with path.open("rb") as f:
            text = f.read(_RANGE_FILE_MAX_BYTES + 1)
        if len(text) > _RANGE_FILE_MAX_BYTES:
            return DEFAULT_EPHEMERAL_RANGE
        low, high = (int(p) for p in text.split())
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL_RANGE
    if not 1 <= low <= high <= 65535:
        return DEFAULT_EPHEMERAL_RANGE
    return low, high


def port_window(ephemeral: tuple[int, int]) -> range:
    """The ports servers may be put on: below the ephemeral range (or above it when there is
    too little room below). Empty when the range covers nearly all ports."""
    low, high = ephemeral
    if low - LOWEST_PORT >= _MIN_WINDOW:
        return range(LOWEST_PORT, low)
    if 65535 - high >= _MIN_WINDOW:
        return range(high + 1, 65536)
    return range(0)


def bind_first_free(host: str, candidates: Iterable[int]) -> int:
    """The first of ``candidates`` that a listening socket could bind on ``host`` just now.

    The probe does not set ``SO_REUSEADDR``, so a port still held by a connection in
    TIME_WAIT counts as taken. Raises :class:`NoFreePortError` when none could be bound.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    tried = 0
    for port in candidates:
        tried += 1
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
            return port
    raise NoFreePortError(f"no free port on {host} among {tried} candidates")


def free_port_below_ephemeral(
    host: str = "127.0.0.1",
    *,
    rng: random.Random | None = None,
    range_path: Path = EPHEMERAL_RANGE_PATH,
) -> int:
    """A TCP port on ``host`` that was free a moment ago and lies outside the kernel's
    ephemeral range, so no client's source port can be it (see the module docstring).

    Picked at random (``rng``) from :func:`port_window`, so parallel runs rarely meet; a
    caller that still finds it taken picks again. Where the ephemeral range leaves no room,
    the kernel's own choice (an ephemeral port) is returned. Raises :class:`NoFreePortError`.
    """
    window = port_window(ephemeral_port_range(range_path))
    if not window:
        return _kernel_port(host)
    r = rng or random.Random()
    return bind_first_free(host, (r.choice(window) for _ in range(_ATTEMPTS)))


def _kernel_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])
