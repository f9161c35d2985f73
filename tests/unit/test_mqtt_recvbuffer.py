"""``shared.mqtt.recvbuffer.RecvBuffer``: small reads served from large ones, nothing lost or reordered."""

from __future__ import annotations

import random

import pytest

from mcp_edge.shared.mqtt.recvbuffer import CHUNK, RecvBuffer


class Stream:
    """A socket stand-in: ``recv(n)`` hands out at most ``n`` bytes of ``data``, in pieces of
    at most ``piece`` bytes (as a socket returns what has arrived); then BlockingIOError."""

    def __init__(self, data: bytes, piece: int) -> None:
        self.data, self.pos, self.piece = data, 0, piece
        self.calls: list[int] = []

    def recv(self, n: int) -> bytes:
        self.calls.append(n)
        if self.pos >= len(self.data):
            raise BlockingIOError
        out = self.data[self.pos : self.pos + min(n, self.piece)]
        self.pos += len(out)
        return out


@pytest.mark.parametrize("piece", [1, 7, 300, CHUNK, 10 * CHUNK])
def test_any_sequence_of_reads_yields_the_stream_in_order(piece: int) -> None:
    rng = random.Random(piece)
    data = rng.randbytes(300_000)
    stream, buf, out = Stream(data, piece), RecvBuffer(), bytearray()
    while True:
        try:
            got = buf.take(rng.choice([1, 1, 2, 100, 5000, 200_000]), stream.recv)
        except BlockingIOError:
            break
        assert got
        out += got
    assert bytes(out) == data
    assert not buf.pending


def test_one_large_read_serves_many_small_ones() -> None:
    stream, buf = Stream(bytes(range(200)) * 50, piece=CHUNK), RecvBuffer()
    assert buf.take(1, stream.recv) == b"\x00"
    assert buf.pending
    assert [buf.take(1, stream.recv) for _ in range(3)] == [b"\x01", b"\x02", b"\x03"]
    assert buf.take(196, stream.recv) == bytes(range(4, 200))
    assert stream.calls == [CHUNK]  # one real read so far


def test_a_read_larger_than_what_is_buffered_returns_the_rest_first() -> None:
    stream, buf = Stream(b"abcdef", piece=4), RecvBuffer()
    assert buf.take(1, stream.recv) == b"a"
    assert buf.take(10, stream.recv) == b"bcd"  # what was buffered, not a second recv
    assert buf.take(10, stream.recv) == b"ef"
    with pytest.raises(BlockingIOError):
        buf.take(1, stream.recv)


def test_end_of_stream_and_clear() -> None:
    buf = RecvBuffer()
    assert buf.take(5, lambda n: b"") == b""  # the peer closed: paho sees the empty read
    assert buf.take(1, lambda n: b"xyz") == b"x"
    buf.clear()
    assert not buf.pending
    assert buf.take(1, lambda n: b"new") == b"n"
