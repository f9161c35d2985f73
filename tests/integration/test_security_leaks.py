"""What a stranger on the network can make the control plane say or store.

- Requests too large for the HTTP parser are answered 400 and logged as one short line per
  burst, never a traceback per request (the real ``serve``, raw sockets).
"""

from __future__ import annotations

import logging
import socket
from pathlib import Path

import pytest

from controlplane.settings import PasswordCost, Settings
from tests.support.controlplane import FakeProvisioner, served

SOCKET_TIMEOUT_S = 10.0


# ---------------------------------------------------------------------------- HTTP parser
def _raw_exchange(url: str, request: bytes) -> bytes:
    """Send ``request`` on a fresh connection and read the answer until the server closes."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=SOCKET_TIMEOUT_S) as conn:
        conn.sendall(request)
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
    return answer


OVERSIZED = [
    b"GET /" + b"a" * 10240 + b" HTTP/1.1\r\nHost: cp\r\n\r\n",
    b"GET /healthz HTTP/1.1\r\nHost: cp\r\nX-Filler: " + b"b" * 10240 + b"\r\n\r\n",
    b"GET /healthz HTTP/1.1\r\nHost: cp\r\n" + b"X-Many: y\r\n" * 200 + b"\r\n",
]


def test_oversized_requests_get_400_and_one_log_line_per_burst_without_traceback(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = Settings(
        data_dir=tmp_path / "cp", database_url=f"sqlite:///{tmp_path / 'cp.db'}",
        password_cost=PasswordCost.MIN, port=0,
    )
    caplog.set_level(logging.INFO)
    with served(settings, FakeProvisioner()) as url:
        caplog.clear()
        answers = [_raw_exchange(url, request) for request in OVERSIZED * 3]
        healthy = _raw_exchange(
            url, b"GET /healthz HTTP/1.1\r\nHost: cp\r\nConnection: close\r\n\r\n"
        )

    assert all(a.startswith(b"HTTP/1.") and a.split(b" ", 2)[1] == b"400" for a in answers), [
        a[:60] for a in answers
    ]
    assert healthy.split(b" ", 2)[1] == b"200"  # the server is still serving
    assert "Traceback" not in caplog.text
    assert not [r for r in caplog.records if r.exc_info]
    about_requests = [r for r in caplog.records if "HTTP request" in r.getMessage()]
    assert len(about_requests) == 1, [r.getMessage() for r in about_requests]
    line = about_requests[0].getMessage()
    assert "\n" not in line and "127.0.0.1" in line and "400" in line
    assert "aaaa" not in line  # the client's bytes are not echoed into the log
