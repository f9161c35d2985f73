"""What ``shared/mqtt/_paho.py`` relies on in paho-mqtt's private API is still there.

The adapter reads the socket in 64 KiB chunks by overriding two private methods of
``paho.mqtt.client.Client``. A paho release that renames them, changes their parameters, or
stops reading through them would silently fall back to paho's own small reads (or break); this
test fails first, naming what changed, and pyproject.toml bounds paho to the release checked.
"""

from __future__ import annotations

import inspect
import sys
from importlib import metadata
from pathlib import Path

import paho.mqtt.client as paho

from mcp_edge.shared.mqtt._paho import PAHO_TESTED, PRIVATE_METHODS, ChunkedClient

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]


def test_the_installed_paho_is_the_release_the_overrides_were_checked_against() -> None:
    installed = tuple(int(p) for p in metadata.version("paho-mqtt").split(".")[:2])
    assert installed == PAHO_TESTED, (
        f"paho-mqtt {installed} installed, _paho.py checked against {PAHO_TESTED}: "
        "re-check the private methods it overrides, then update PAHO_TESTED and pyproject.toml"
    )


def test_pyproject_bounds_paho_to_that_release() -> None:
    major, minor = PAHO_TESTED
    want = f"paho-mqtt>={major}.{minor},<{major}.{minor + 1}"
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    project = config["project"]
    specs = [
        d
        for d in project["dependencies"] + project["optional-dependencies"]["test"]
        if d.startswith("paho-mqtt")
    ]
    assert specs and set(specs) == {want}, specs


def test_the_private_methods_exist_with_the_parameters_overridden() -> None:
    for name, params in PRIVATE_METHODS.items():
        original = getattr(paho.Client, name, None)
        assert callable(original), f"paho.Client.{name} is gone"
        assert tuple(inspect.signature(original).parameters) == params, (
            f"paho.Client.{name}{inspect.signature(original)} changed; _paho.py overrides it "
            f"as {name}{params}"
        )
        assert getattr(ChunkedClient, name) is not original  # our override is in place


def test_paho_reads_and_closes_its_socket_through_them() -> None:
    # The overrides only take effect if paho's packet reader and its socket teardown call them.
    reader = inspect.getsource(paho.Client._packet_read)
    assert "self._sock_recv(" in reader, "paho's _packet_read no longer reads via _sock_recv"
    assert "self._sock.recv(" not in reader, "paho's _packet_read reads the socket directly"
    for caller in (paho.Client._reset_sockets, paho.Client._loop_rc_handle):
        assert "self._sock_close()" in inspect.getsource(caller), caller.__name__


def test_a_chunked_client_starts_with_nothing_buffered() -> None:
    client = ChunkedClient(paho.CallbackAPIVersion.VERSION2, protocol=paho.MQTTv5)
    assert not client.buffered
    client._sock_close()  # no socket yet: paho's close is a no-op, the buffer is cleared
    assert not client.buffered
