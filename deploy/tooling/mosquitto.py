"""A real Mosquitto broker on a free loopback port, owned by a test.

`MosquittoBroker` writes its own config into a working directory, starts
`mosquitto -c <conf>`, waits until the port accepts TCP connections and stops the process by
its pid. It can be killed and started again on the same port, for fault tests that lose the
broker mid-transfer.

Ports are chosen below the kernel's ephemeral range (`shared.netutil`): a client reconnecting
to a stopped broker on an ephemeral port can be handed that very port as its source port and
connect to itself, and the restarted broker then fails with "Address already in use". A port
chosen here that another run takes before the broker binds it is replaced by a fresh one. `DynsecMosquittoBroker` adds the dynamic-security plugin and refuses
anonymous clients; its admin client is bootstrapped with `mosquitto_ctrl dynsec init`.

Everything that goes wrong raises `MosquittoError` with the broker's log in the message.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType

from mcp_edge.shared.netutil import free_port_below_ephemeral

LOOPBACK = "127.0.0.1"
_SBIN_DIRS = ("/usr/sbin", "/usr/local/sbin", "/sbin")
_PLUGIN_NAME = "mosquitto_dynamic_security.so"
_LIB_DIRS = (
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib",
    "/usr/lib64",
    "/usr/local/lib",
    "/usr/local/lib64",
    "/opt/homebrew/lib",
)
_INSTALL_HINT = "run `bash tests/run.sh`, which installs Debian's mosquitto package"
_PORT_TAKEN = "Address already in use"
_PORT_ATTEMPTS = 5
# An MQTT 3.1.1 CONNECT (clean session, no client id): a broker answers CONNACK (0x20), even
# when it refuses anonymous clients; whatever else holds the port does not.
_PROBE_CONNECT = bytes.fromhex("100c00044d5154540402003c0000")
_CONNACK = 0x20


class MosquittoError(RuntimeError):
    """The broker could not be found, started or stopped."""


def find_executable(name: str) -> Path:
    """Return the path of a Mosquitto executable, searching PATH and then the sbin dirs.

    Raises:
        MosquittoError: it is not installed.
    """
    search_path = os.pathsep.join([os.environ.get("PATH", ""), *_SBIN_DIRS])
    found = shutil.which(name, path=search_path)
    if found is None:
        raise MosquittoError(f"{name} is not installed: {_INSTALL_HINT}")
    return Path(found)


def find_dynsec_plugin() -> Path:
    """Return the path of Mosquitto's dynamic-security plugin, searching the usual lib dirs.

    Raises:
        MosquittoError: the plugin is not installed.
    """
    for lib_dir in _LIB_DIRS:
        for candidate in (Path(lib_dir) / _PLUGIN_NAME, Path(lib_dir) / "mosquitto" / _PLUGIN_NAME):
            if candidate.is_file():
                return candidate
    raise MosquittoError(f"{_PLUGIN_NAME} not found in {', '.join(_LIB_DIRS)}: {_INSTALL_HINT}")


def free_loopback_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago, below the ephemeral range."""
    return free_port_below_ephemeral(LOOPBACK)


class MosquittoBroker:
    """A `mosquitto` process on 127.0.0.1 that accepts anonymous clients.

    Args:
        workdir: an existing directory for the config, log and plugin files.
        port: the TCP port to listen on; a free one below the ephemeral range is picked when
            None (and picked again if taken at the first start). It stays the same across
            `stop()`/`kill()` and `start()`.
        start_timeout: seconds `start()` waits for the port to accept connections.
    """

    host: str = LOOPBACK

    def __init__(self, workdir: Path, *, port: int | None = None, start_timeout: float = 10.0):
        self.workdir = Path(workdir)
        self.port = port if port is not None else free_loopback_port()
        self._port_chosen = port is None  # ours to replace until the broker first listens
        self.start_timeout = start_timeout
        self.conf_path = self.workdir / "mosquitto.conf"
        self.log_path = self.workdir / "mosquitto.log"
        self.output_path = self.workdir / "mosquitto.out"
        self._binary = find_executable("mosquitto")
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        """The broker's process id.

        Raises:
            MosquittoError: the broker is not running.
        """
        if self._process is None or self._process.poll() is not None:
            raise MosquittoError("the broker is not running")
        return self._process.pid

    @property
    def running(self) -> bool:
        """Whether the broker process is alive."""
        return self._process is not None and self._process.poll() is None

    def log_text(self) -> str:
        """Return everything the broker logged: its log file, then its stdout and stderr."""
        parts = [
            p.read_text(errors="replace") for p in (self.log_path, self.output_path) if p.exists()
        ]
        return "".join(parts)

    def start(self) -> None:
        """Write the config, start the broker and wait until its port accepts a connection.

        The broker counts as up once it answers an MQTT CONNECT with a CONNACK (a bare TCP
        accept could come from another program holding the port).

        Raises:
            MosquittoError: it is already running, exited during start-up, or did not accept
                a connection within `start_timeout` seconds (the process is then killed).
        """
        if self.running:
            raise MosquittoError(f"the broker is already running as pid {self.pid}")
        self._prepare()
        for attempt in range(1, _PORT_ATTEMPTS + 1):
            logged = len(self.log_text())
            try:
                self._start_once()
                break
            except MosquittoError:
                # Another run took the chosen port between the check and the bind: pick again.
                taken = _PORT_TAKEN in self.log_text()[logged:]
                if not (self._port_chosen and taken and attempt < _PORT_ATTEMPTS):
                    raise
                self.port = free_loopback_port()
        self._port_chosen = False

    def _start_once(self) -> None:
        self.conf_path.write_text("\n".join(self._config_lines()) + "\n")
        with self.output_path.open("ab") as output:
            self._process = subprocess.Popen(
                [str(self._binary), "-c", str(self.conf_path)],
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
            )
        self._wait_until_accepting(self._process)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the broker with SIGTERM, then SIGKILL if it has not exited within `timeout` s.

        Does nothing if it is not running.
        """
        process = self._process
        if process is None or process.poll() is not None:
            return
        os.kill(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.kill(process.pid, signal.SIGKILL)
            process.wait()

    def kill(self, timeout: float = 10.0) -> None:
        """Kill the broker with SIGKILL and wait until it is gone (a crash, for fault tests).

        Raises:
            MosquittoError: the broker is not running, or still there after `timeout` s.
        """
        process = self._process
        if process is None or process.poll() is not None:
            raise MosquittoError("the broker is not running")
        os.kill(process.pid, signal.SIGKILL)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired as e:
            raise MosquittoError(f"mosquitto pid {process.pid} survived SIGKILL") from e

    def __enter__(self) -> MosquittoBroker:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = f"pid {self._process.pid}" if self.running and self._process else "stopped"
        return f"<{type(self).__name__} {self.host}:{self.port} {state}>"

    def _prepare(self) -> None:
        """Create whatever files the config refers to; called before every start."""

    def _config_lines(self) -> list[str]:
        # As root, mosquitto would otherwise drop to the `mosquitto` user, which cannot write
        # into the test's working directory.
        user = pwd.getpwuid(os.getuid()).pw_name
        return [
            "per_listener_settings false",
            f"listener {self.port} {self.host}",
            "allow_anonymous true",
            f"user {user}",
            "set_tcp_nodelay true",
            "persistence false",
            f"log_dest file {self.log_path}",
            "log_type error",
            "log_type warning",
            "log_type notice",
            "log_type information",
            "connection_messages true",
            "log_timestamp_format %Y-%m-%dT%H:%M:%S",
        ]

    def _wait_until_accepting(self, process: subprocess.Popen[bytes]) -> None:
        deadline = time.monotonic() + self.start_timeout
        while True:
            if process.poll() is not None:
                raise MosquittoError(
                    f"mosquitto exited with status {process.returncode} during start-up; "
                    f"log:\n{self.log_text()}"
                )
            try:
                with socket.create_connection((self.host, self.port), timeout=0.5) as probe:
                    probe.sendall(_PROBE_CONNECT)
                    if probe.recv(1)[:1] == bytes([_CONNACK]):
                        return
            except OSError:
                pass
            if time.monotonic() >= deadline:
                process.kill()
                process.wait()
                raise MosquittoError(
                    f"mosquitto did not accept connections on {self.host}:{self.port} within "
                    f"{self.start_timeout} s; log:\n{self.log_text()}"
                )
            # Waiting on the process, not sleeping, so an early exit is seen at once.
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=0.02)


class DynsecMosquittoBroker(MosquittoBroker):
    """A `MosquittoBroker` with the dynamic-security plugin and no anonymous access.

    The plugin's JSON lives in `workdir/dynamic-security.json` and survives restarts. It starts
    with one admin client (`admin_username`, `admin_password`) whose role may publish and
    subscribe to `$CONTROL/dynamic-security/#`, which is how tests create further clients.
    """

    admin_username: str = "admin"

    def __init__(self, workdir: Path, *, port: int | None = None, start_timeout: float = 10.0):
        super().__init__(workdir, port=port, start_timeout=start_timeout)
        self.admin_password = secrets.token_urlsafe(16)
        self.dynsec_path = self.workdir / "dynamic-security.json"
        self._plugin = find_dynsec_plugin()
        self._ctrl = find_executable("mosquitto_ctrl")

    def _prepare(self) -> None:
        if self.dynsec_path.exists():
            return
        command = [
            str(self._ctrl),
            "dynsec",
            "init",
            str(self.dynsec_path),
            self.admin_username,
            self.admin_password,
        ]
        result = subprocess.run(
            command, stdin=subprocess.DEVNULL, capture_output=True, timeout=30, check=False
        )
        if result.returncode != 0 or not self.dynsec_path.exists():
            raise MosquittoError(
                f"`mosquitto_ctrl dynsec init` failed with status {result.returncode}: "
                f"{(result.stdout + result.stderr).decode(errors='replace')}"
            )

    def _config_lines(self) -> list[str]:
        lines = [line for line in super()._config_lines() if not line.startswith("allow_anon")]
        return [
            *lines,
            "allow_anonymous false",
            f"plugin {self._plugin}",
            f"plugin_opt_config_file {self.dynsec_path}",
        ]
