"""shared.netutil: spotting a TCP self-connect, dropping it without TIME_WAIT, and choosing
server ports outside the kernel's ephemeral range (loopback sockets only)."""

from __future__ import annotations

import random
import socket
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path

import pytest

from mcp_edge.shared.netutil import (
    DEFAULT_EPHEMERAL_RANGE,
    LOWEST_PORT,
    NoFreePortError,
    bind_first_free,
    close_with_reset,
    ephemeral_port_range,
    free_port_below_ephemeral,
    is_self_connected,
    port_window,
)

HOST = "127.0.0.1"


@contextmanager
def listening(port: int = 0) -> Iterator[socket.socket]:
    with closing(socket.create_server((HOST, port))) as server:
        yield server


def self_connected() -> tuple[socket.socket, int]:
    """A socket connected to itself: from port P to port P, where nothing listens."""
    port = free_port_below_ephemeral(HOST)
    return socket.create_connection((HOST, port), timeout=5, source_address=(HOST, port)), port


def test_a_socket_connected_to_itself_is_spotted_and_a_real_connection_is_not() -> None:
    sock, _ = self_connected()
    with closing(sock):
        assert is_self_connected(sock)
    with listening() as server, socket.create_connection(server.getsockname()) as client:
        accepted, _ = server.accept()
        with accepted:
            assert not is_self_connected(client) and not is_self_connected(accepted)
    with socket.socket() as unconnected:
        assert not is_self_connected(unconnected)
    a, b = socket.socketpair(socket.AF_UNIX)
    with a, b:
        assert not is_self_connected(a)


def test_a_reset_self_connected_socket_leaves_its_port_free_at_once() -> None:
    sock, port = self_connected()
    close_with_reset(sock)
    assert bind_first_free(HOST, [port]) == port  # no TIME_WAIT holds it
    with listening(port):  # a server can start there
        pass
    close_with_reset(sock)  # twice: never raises


def test_a_self_connected_socket_closed_the_usual_way_holds_its_port() -> None:
    # What close_with_reset avoids: the reason a restarted broker failed to bind.
    sock, port = self_connected()
    sock.close()
    with pytest.raises(NoFreePortError):
        bind_first_free(HOST, [port])


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (b"32768\t60999\n", (32768, 60999)),
        (b"1024 4999", (1024, 4999)),
        (b"40000\t30000\n", DEFAULT_EPHEMERAL_RANGE),  # reversed
        (b"0 60999", DEFAULT_EPHEMERAL_RANGE),
        (b"32768 70000", DEFAULT_EPHEMERAL_RANGE),
        (b"32768", DEFAULT_EPHEMERAL_RANGE),
        (b"a b", DEFAULT_EPHEMERAL_RANGE),
        (b"\xff\xfe", DEFAULT_EPHEMERAL_RANGE),
        (b"1" * 100 + b" 2", DEFAULT_EPHEMERAL_RANGE),  # over the size cap
    ],
)
def test_the_ephemeral_range_is_read_from_the_kernel_file_or_defaults(
    tmp_path: Path, text: bytes, expected: tuple[int, int]
) -> None:
    path = tmp_path / "ip_local_port_range"
    path.write_bytes(text)
    assert ephemeral_port_range(path) == expected
    assert ephemeral_port_range(tmp_path / "missing") == DEFAULT_EPHEMERAL_RANGE


def test_the_port_window_lies_outside_the_ephemeral_range() -> None:
    assert port_window((32768, 60999)) == range(LOWEST_PORT, 32768)
    assert port_window((20500, 60000)) == range(60001, 65536)  # too little room below
    assert port_window((1024, 65000)) == range(0)


def test_a_chosen_port_is_below_the_kernels_range_and_free(tmp_path: Path) -> None:
    low, _ = ephemeral_port_range()
    ports = {free_port_below_ephemeral(HOST) for _ in range(20)}
    assert all(LOWEST_PORT <= p < low for p in ports) or low - LOWEST_PORT < 1000
    port = ports.pop()
    with listening(port):
        pass
    narrow = tmp_path / "range"
    narrow.write_text("20500 60000\n")
    assert 60001 <= free_port_below_ephemeral(HOST, range_path=narrow) <= 65535


def test_a_taken_port_is_skipped_and_none_free_is_an_error() -> None:
    seeded = free_port_below_ephemeral(HOST, rng=random.Random(7))
    assert seeded == free_port_below_ephemeral(HOST, rng=random.Random(7))  # reproducible
    with listening(seeded):
        other = free_port_below_ephemeral(HOST, rng=random.Random(7))
        assert other != seeded
        assert bind_first_free(HOST, [seeded, other]) == other
        with pytest.raises(NoFreePortError, match="among 1 candidates"):
            bind_first_free(HOST, [seeded])
