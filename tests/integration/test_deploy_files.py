"""The packaging under deploy/ (docker, compose, k8s, systemd) checked against the code.

Nothing here builds an image or starts a container (this machine has no Docker engine, and no
systemd as PID 1): every file is parsed (Dockerfiles instruction by instruction, YAML with
PyYAML, shell with shlex, systemd units with systemd-analyze) and what it names is compared
with what the code defines:

- ports: the agent's ``DEFAULT_PORT`` (``mcp_edge.agent.serving.serve``), the control plane's
  ``DEFAULT_LISTEN`` (``mcp_edge.controlplane.settings``), the broker's ``listener`` in
  ``deploy/mosquitto/mosquitto.conf``; every EXPOSE, published port, probe, Service and URL
  must use them (or, for the agent's gRPC port, the ``--grpc-port`` the image passes);
- probe paths: resolved against the agent's router (``build_router``) and the control plane's
  aiohttp app (``create_app``), and they must reach the liveness and readiness handlers;
- commands: every ``mcp-agent``/``mcp-controlplane`` invocation in any file (exec form, compose
  commands, shell scripts) names real subcommands, and every ``--flag`` and ``MCP_*`` variable
  it uses appears in that subcommand's ``--help``;
- users and volumes: images run as a fixed non-root uid that the manifests repeat, and the
  state and data dirs mounted are those the commands use (the code's defaults);
- systemd: ``systemd-analyze verify`` passes and ``systemd-analyze security --offline=yes``
  rates each unit 2.5 or lower; ``MemoryDenyWriteExecute=yes`` is checked by running onnxruntime,
  LiteRT and ``mcp-controlplane init`` under the seccomp rule systemd installs for it.

The ``test_*_drift_*`` tests run the same checks against a changed copy of the code's facts
(another port, a renamed probe route) and expect them to fail: a drift in the code fails here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import importlib
import inspect
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import click
import pytest
import yaml
from click.testing import CliRunner

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
DOCKER = DEPLOY / "docker"
COMPOSE = DEPLOY / "compose"
K8S = DEPLOY / "k8s"
SYSTEMD = DEPLOY / "systemd"
VENV_BIN = Path(sys.executable).parent
PROGRAMS = ("mcp-agent", "mcp-controlplane")
SHELLS = ("sh", "bash", "/bin/sh", "/bin/bash")
MAX_EXPOSURE = 2.5


# ---------------------------------------------------------------------------- the code's facts
@dataclasses.dataclass(frozen=True)
class Code:
    """What the deploy files must agree with, read from the code (``code()``); the drift tests
    build changed copies."""

    agent_port: int
    cp_port: int
    mqtt_port: int
    agent_state_dir: str
    cp_data_dir: str
    agent_route: Callable[[str], str | None]
    """A GET path → the name of the agent's handler for it (None: no route)."""
    cp_route: Callable[[str], str | None]
    """A GET path → the name of the control plane's handler for it (None: no route)."""


AGENT_LIVE, AGENT_READY = "live", "ready"
CP_LIVE, CP_READY = "healthz", "readyz"


class _NamedHandlers:
    """Stands in for the agent's Handlers: each attribute is a handler named after it."""

    def __getattr__(self, name: str) -> Any:
        async def handler(request: Any) -> Any:  # pragma: no cover - never called
            raise AssertionError(name)

        handler.__name__ = name
        return handler


def _agent_router_names() -> Callable[[str], str | None]:
    from mcp_edge.agent.serving.http_api import build_router

    router = build_router(_NamedHandlers())  # type: ignore[arg-type]

    def route(path: str) -> str | None:
        handler, _, _ = router.resolve("GET", path)
        return None if handler is None else handler.__name__

    return route


def _cp_route_names(tmp: Path) -> Callable[[str], str | None]:
    from aiohttp.test_utils import make_mocked_request

    from mcp_edge.controlplane.app import UnconfiguredProvisioner, create_app
    from mcp_edge.controlplane.settings import Settings

    app = create_app(Settings(data_dir=tmp), UnconfiguredProvisioner())

    async def resolve(path: str) -> str | None:
        match = await app.router.resolve(make_mocked_request("GET", path, app=app))
        if match.http_exception is not None:
            return None
        return str(match.handler.__name__)

    return lambda path: asyncio.run(resolve(path))


def _root_default(module: str, function: str) -> str:
    """The default dir ``function`` gives root (what the images and units must mount)."""
    mod = importlib.import_module(module)
    real = os.geteuid
    os.geteuid = lambda: 0  # type: ignore[assignment]
    try:
        return str(getattr(mod, function)())
    finally:
        os.geteuid = real  # type: ignore[assignment]


def _conf_listener_port() -> int:
    ports = re.findall(r"^listener\s+(\d+)\s*$", _mosquitto_conf(), re.M)
    assert len(ports) == 1, f"expected one plain listener in mosquitto.conf, found {ports}"
    return int(ports[0])


def _mosquitto_conf() -> str:
    return (DEPLOY / "mosquitto" / "mosquitto.conf").read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def code(tmp_path_factory: pytest.TempPathFactory) -> Code:
    from mcp_edge.agent.serving.serve import DEFAULT_PORT
    from mcp_edge.controlplane.settings import DEFAULT_LISTEN, Settings, parse_listen

    cp_port = parse_listen(DEFAULT_LISTEN)[1]
    assert Settings(data_dir=Path("/x")).port == cp_port
    run_port = next(p for p in _command("mcp-agent", "run").params if p.name == "port")
    assert run_port.default == DEFAULT_PORT, "mcp-agent run --port defaults to DEFAULT_PORT"
    return Code(
        agent_port=DEFAULT_PORT,
        cp_port=cp_port,
        mqtt_port=_conf_listener_port(),
        agent_state_dir=_root_default("mcp_edge.agent.serving.serve", "default_state_dir"),
        cp_data_dir=_root_default("mcp_edge.controlplane.cli.datadir", "default_data_dir"),
        agent_route=_agent_router_names(),
        cp_route=_cp_route_names(tmp_path_factory.mktemp("cp-routes")),
    )


# ---------------------------------------------------------------------------- the CLIs
@functools.cache
def _pyproject() -> dict[str, Any]:
    return tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))


@functools.cache
def _main(program: str) -> click.Command:
    target = _pyproject()["project"]["scripts"][program]
    module, _, attr = target.partition(":")
    command = getattr(importlib.import_module(module), attr)
    assert isinstance(command, click.Command)
    return command


def _command(program: str, *path: str) -> click.Command:
    cmd = _main(program)
    for name in path:
        assert isinstance(cmd, click.Group), f"{program} {' '.join(path)}: not a group"
        cmd = cmd.commands[name]
    return cmd


@dataclasses.dataclass(frozen=True)
class Help:
    flags: frozenset[str]
    env: frozenset[str]


@functools.cache
def _help(program: str, path: tuple[str, ...]) -> Help:
    """The options of ``program PATH`` and the variables its ``--help`` lists (run in-process,
    through the click command the console script calls)."""
    result = CliRunner().invoke(
        _main(program), [*path, "--help"], prog_name=program, terminal_width=200
    )
    assert result.exit_code == 0, result.output
    env = frozenset(re.findall(r"env var:\s*(MCP_[A-Z0-9_]+)", " ".join(result.output.split())))
    command = _command(program, *path)
    shown = [p for p in command.params if not getattr(p, "hidden", False)]
    flags = {o for p in shown for o in (*p.opts, *p.secondary_opts) if o[:2] == "--"}
    for flag in flags:  # what --help shows is what the command takes
        assert flag in result.output, f"{program} {' '.join(path)} --help does not show {flag}"
    return Help(frozenset(flags | {"--help"}), env)


@dataclasses.dataclass(frozen=True)
class Invocation:
    program: str
    path: tuple[str, ...]
    args: tuple[str, ...]
    where: str

    def flags(self) -> list[str]:
        return [a.split("=", 1)[0] for a in self.args if a.startswith("--")]

    def value(self, flag: str) -> str | None:
        for i, a in enumerate(self.args):
            if a == flag and i + 1 < len(self.args):
                return self.args[i + 1]
            if a.startswith(flag + "="):
                return a.split("=", 1)[1]
        return None


def _invocation(tokens: list[str], where: str) -> Invocation | None:
    """The first mcp-agent/mcp-controlplane command in ``tokens`` (stopping at shell operators)."""
    for i, tok in enumerate(tokens):
        if Path(tok).name in PROGRAMS:
            program, rest = Path(tok).name, tokens[i + 1 :]
            break
    else:
        return None
    end = next((j for j, t in enumerate(rest) if t and set(t) <= set("();<>|&")), len(rest))
    rest = rest[:end]
    cmd, path = _main(program), []
    while isinstance(cmd, click.Group) and rest and rest[0] in cmd.commands:
        path.append(rest[0])
        cmd = cmd.commands[rest.pop(0)]
    assert not isinstance(cmd, click.Group), f"{where}: `{program} {' '.join(path)}` is a group"
    return Invocation(program, tuple(path), tuple(rest), where)


def _shell_invocations(script: str, where: str) -> list[Invocation]:
    """Invocations in a shell script, one line at a time, with the script's own plain
    ``name=value`` assignments substituted (``--server "$server"``)."""
    script = script.replace("$$", "$").replace("\\\n", " ")
    found: list[Invocation] = []
    variables: dict[str, str] = {}
    for line in script.splitlines():
        lex = shlex.shlex(line, posix=True, punctuation_chars=True)
        lex.whitespace_split = True
        lex.commenters = "#"
        tokens = list(lex)
        if len(tokens) == 1 and re.fullmatch(r"[A-Za-z_]\w*=[^$`]*", tokens[0]):
            name, _, value = tokens[0].partition("=")
            variables[name] = value
            continue
        for name, value in variables.items():
            tokens = [
                t.replace("${" + name + "}", value).replace(f"${name}", value) for t in tokens
            ]
        while tokens:
            inv = _invocation(tokens, where)
            if inv is None:
                break
            found.append(inv)
            index = next(i for i, t in enumerate(tokens) if Path(t).name == inv.program)
            tokens = tokens[index + 1 :]
    return found


def invocations(argv: list[str], where: str) -> list[Invocation]:
    """The program invocations an exec-form command line makes (through ``sh -c`` too)."""
    if argv and argv[0] in SHELLS:
        script_at = next(i for i, a in enumerate(argv) if a.startswith("-") and "c" in a) + 1
        return _shell_invocations(argv[script_at], where)
    inv = _invocation(list(argv), where)
    return [] if inv is None else [inv]


def check_invocations(invs: Iterable[Invocation]) -> list[str]:
    problems = []
    for inv in invs:
        known = _help(inv.program, inv.path).flags
        problems += [
            f"{inv.where}: `{inv.program} {' '.join(inv.path)}` has no {flag}"
            for flag in inv.flags()
            if flag not in known
        ]
    return problems


@functools.cache
def _settings_env() -> frozenset[str]:
    """The MCP_* variables the control plane's settings read besides the options'."""
    from mcp_edge.controlplane.settings import load_settings

    return frozenset(re.findall(r'"(MCP_[A-Z0-9_]+)"', inspect.getsource(load_settings)))


@functools.cache
def _entrypoint_env() -> dict[str, str]:
    """``X_FILE`` → ``X``: the variables deploy/docker/entrypoint.sh reads from files."""
    text = (DOCKER / "entrypoint.sh").read_text(encoding="utf-8")
    return {file: var for var, file in re.findall(r'read_secret (\w+) "\$(\w+_FILE)"', text)}


def check_env(
    env: dict[str, Any], invs: list[Invocation], where: str, argv: Iterable[str] = ()
) -> list[str]:
    """Every MCP_* variable set for a container is read by a command it runs, the control
    plane's settings, the image's entry point, or the container's own shell script."""
    known = set(_entrypoint_env())
    for arg in argv:
        known |= set(re.findall(r"\$\{?(MCP_[A-Z0-9_]+)", arg))
    for inv in invs:
        known |= _help(inv.program, inv.path).env
        if inv.program == "mcp-controlplane":
            known |= _settings_env()
    return [
        f"{where}: {name} is read by none of {[' '.join(i.path) for i in invs]}"
        for name in env
        if name.startswith("MCP_") and name not in known
    ]


# ---------------------------------------------------------------------------- Dockerfiles
@dataclasses.dataclass
class Dockerfile:
    path: Path
    preamble: list[tuple[str, str]]
    """The global ARGs before the first FROM."""
    stages: list[list[tuple[str, str]]]

    @classmethod
    def read(cls, path: Path) -> Dockerfile:
        logical, current = [], ""
        for raw in path.read_text(encoding="utf-8").splitlines():
            if raw.strip().startswith("#"):
                continue  # comments, also inside continued instructions, as Docker reads them
            if raw.rstrip().endswith("\\"):
                current += raw.rstrip()[:-1] + " "
                continue
            current += raw
            if current.strip():
                logical.append(current.strip())
            current = ""
        assert not current.strip(), f"{path}: ends inside a continued instruction"
        preamble: list[tuple[str, str]] = []
        stages: list[list[tuple[str, str]]] = []
        for line in logical:
            word, _, rest = line.partition(" ")
            instruction = word.upper()
            assert instruction in {
                "FROM",
                "ARG",
                "ENV",
                "WORKDIR",
                "COPY",
                "RUN",
                "LABEL",
                "VOLUME",
                "USER",
                "EXPOSE",
                "HEALTHCHECK",
                "ENTRYPOINT",
                "CMD",
                "STOPSIGNAL",
            }, f"{path}: unexpected instruction {word}"
            if instruction == "FROM":
                stages.append([])
            (stages[-1] if stages else preamble).append((instruction, rest.strip()))
        assert all(ins == "ARG" for ins, _ in preamble), f"{path}: only ARG before FROM"
        return cls(path, preamble, stages)

    def base_image(self, stage: list[tuple[str, str]]) -> str:
        """The image a stage starts from, global ARGs substituted."""
        image = stage[0][1].split()[0]
        for rest in (r for _, r in self.preamble):
            name, _, default = rest.partition("=")
            image = image.replace("${" + name + "}", default)
        return image

    @property
    def final(self) -> list[tuple[str, str]]:
        return self.stages[-1]

    def all(self, instruction: str, stage: list[tuple[str, str]] | None = None) -> list[str]:
        return [rest for ins, rest in (stage or self.final) if ins == instruction]

    def one(self, instruction: str) -> str:
        found = self.all(instruction)
        assert len(found) == 1, f"{self.path.name}: {len(found)} {instruction} in the final stage"
        return found[0]

    def exec_form(self, instruction: str) -> list[str]:
        value = json.loads(self.one(instruction))
        assert isinstance(value, list), f"{self.path.name}: {instruction} is not in exec form"
        return [str(v) for v in value]

    def env(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for rest in self.all("ENV"):
            for item in shlex.split(rest):
                key, _, value = item.partition("=")
                out[key] = value
        return out

    def arg_default(self, name: str) -> str:
        defaults = {
            rest.partition("=")[2] for rest in self.all("ARG") if rest.partition("=")[0] == name
        }
        assert len(defaults) == 1, f"{self.path.name}: ARG {name} defaults {defaults}"
        return defaults.pop()

    def exposed(self) -> set[int]:
        return {int(p.split("/")[0]) for rest in self.all("EXPOSE") for p in rest.split()}

    def volumes(self) -> list[str]:
        return [v for rest in self.all("VOLUME") for v in json.loads(rest)]

    def uid(self) -> int:
        """The uid the image runs as: its last USER, which must be numeric."""
        users = self.all("USER")
        assert users, f"{self.path.name}: no USER"
        user = users[-1].split(":")[0]
        assert user.isdigit(), f"{self.path.name}: USER {user} is not numeric (runAsNonRoot)"
        return int(user)

    def healthcheck_argv(self) -> list[str]:
        options, _, argv = self.one("HEALTHCHECK").partition("CMD ")
        assert options.strip().startswith("--"), "HEALTHCHECK options first, then CMD"
        return [str(v) for v in json.loads(argv)]

    def argv(self) -> list[str]:
        # A derived image's ENTRYPOINT resets the base image's CMD.
        return self.exec_form("ENTRYPOINT") + (self.exec_form("CMD") if self.all("CMD") else [])


@functools.cache
def dockerfile(name: str) -> Dockerfile:
    return Dockerfile.read(DOCKER / name)


IMAGES = {
    # Dockerfile: (program, the variable naming its state/data dir, the Code field of its default)
    "agent.Dockerfile": ("mcp-agent", "MCP_STATE_DIR", "agent_state_dir"),
    "controlplane.Dockerfile": ("mcp-controlplane", "MCP_DATA_DIR", "cp_data_dir"),
}


def _url_in(argv: list[str]) -> str:
    urls = [u for a in argv for u in re.findall(r"https?://[^'\" )]+", a)]
    assert len(urls) == 1, f"expected one URL in {argv}"
    return urls[0]


def image_http_port(df: Dockerfile, code: Code) -> int:
    """The HTTP port the image's command listens on (its flag, else the code's default)."""
    inv = invocations(df.argv(), df.path.name)[0]
    if inv.program == "mcp-agent":
        port = inv.value("--port")
        return int(port) if port else code.agent_port
    listen = inv.value("--listen")
    return int(listen.rpartition(":")[2]) if listen else code.cp_port


def image_ports(df: Dockerfile, code: Code) -> set[int]:
    inv = invocations(df.argv(), df.path.name)[0]
    ports = {image_http_port(df, code)}
    if inv.value("--grpc-port"):
        ports.add(int(str(inv.value("--grpc-port"))))
    return ports


def check_image(name: str, code: Code) -> list[str]:
    df = dockerfile(name)
    program, dir_var, default_attr = IMAGES[name]
    problems: list[str] = []
    where = name

    def need(ok: bool, text: str) -> None:
        if not ok:
            problems.append(f"{where}: {text}")

    # Multi-stage: a builder that makes wheels with the constraints, a slim runtime from them.
    need(len(df.stages) >= 2, "needs a builder stage and a runtime stage")
    need(df.stages[0][0][1].endswith(" AS builder"), "the first stage is `AS builder`")
    need(df.base_image(df.final) == "python:3.11-slim", "the runtime is python:3.11-slim")
    builder_runs = " ".join(df.all("RUN", df.stages[0]))
    need(
        "pip wheel" in builder_runs and "-c deploy/constraints.txt" in builder_runs,
        "the builder runs `pip wheel -c deploy/constraints.txt`",
    )
    runtime_runs = " ".join(df.all("RUN"))
    need(
        "--no-index" in runtime_runs and "mcp-edge[${EXTRAS}]" in runtime_runs,
        "the runtime installs mcp-edge[${EXTRAS}] from the builder's wheels only",
    )
    extras = set(df.arg_default("EXTRAS").split(","))
    need(
        extras <= set(_pyproject()["project"]["optional-dependencies"]),
        f"EXTRAS {sorted(extras)} are not all extras of pyproject.toml",
    )
    # The wheel is built from every folder pyproject maps to a package.
    copied = {src for rest in df.all("COPY", df.stages[0]) for src in shlex.split(rest)[:-1]}
    wanted = {
        *_pyproject()["tool"]["setuptools"]["package-dir"].values(),
        "pyproject.toml",
        _pyproject()["project"]["readme"],
    }
    for folder in wanted:
        need(
            any(folder == c or folder.startswith(c + "/") for c in copied),
            f"the builder does not copy {folder} (pyproject.toml builds the wheel from it)",
        )

    # Command: the entry point runs the program; every flag exists.
    argv = df.argv()
    need(argv[:2] == ["mcp-entrypoint", program], f"ENTRYPOINT runs mcp-entrypoint {program}")
    need(
        any("entrypoint.sh /usr/local/bin/mcp-entrypoint" in c for c in df.all("COPY")),
        "deploy/docker/entrypoint.sh is installed as mcp-entrypoint",
    )
    invs = invocations(argv, where)
    problems += check_invocations(invs)
    inv = invs[0]
    if program == "mcp-agent":
        need(inv.path == ("run",), "CMD is `run`")
        need(inv.value("--host") == "0.0.0.0", "run --host 0.0.0.0 (reachable from outside)")
        need(
            bool(inv.value("--grpc-port")) == ("grpc" in extras),
            "serves gRPC (--grpc-port) exactly when the grpc extra is installed",
        )
    else:
        need(inv.path == ("serve",), "CMD is `serve`")
        need(str(inv.value("--listen")).startswith("0.0.0.0:"), "serve --listen 0.0.0.0:PORT")
        need("postgres" in extras, "the postgres extra is installed (replicas need PostgreSQL)")
    problems += check_env(df.env(), invs + _subcommands_reading(program, dir_var), where)

    # Ports: EXPOSE = what the command listens on = the code's default HTTP port.
    http = image_http_port(df, code)
    default = code.agent_port if program == "mcp-agent" else code.cp_port
    need(http == default, f"HTTP port {http} is not the code's default {default}")
    need(
        df.exposed() == image_ports(df, code),
        f"EXPOSE {sorted(df.exposed())} != ports served {sorted(image_ports(df, code))}",
    )

    # HEALTHCHECK: python (no curl in slim) on the served port and the right route.
    check = df.healthcheck_argv()
    need(check[0] == "python", "HEALTHCHECK runs python")
    url = urlsplit(_url_in(check))
    need(url.port == http, f"HEALTHCHECK port {url.port} != HTTP port {http}")
    route = code.agent_route if program == "mcp-agent" else code.cp_route
    want = AGENT_LIVE if program == "mcp-agent" else CP_READY
    need(
        route(url.path) == want,
        f"HEALTHCHECK {url.path} resolves to {route(url.path)!r}, not {want!r}",
    )

    # User and volume: a fixed non-root uid owning the state/data dir, which is the volume.
    uid = df.uid()
    need(uid != 0, "USER is root")
    runs = " ".join(df.all("RUN"))
    need(f"--uid {uid}" in runs, f"the account is created with uid {uid}")
    state_dir = df.env().get(dir_var)
    need(
        state_dir == getattr(code, default_attr),
        f"{dir_var}={state_dir} is not the code's default {getattr(code, default_attr)}",
    )
    need(df.volumes() == [state_dir], f"VOLUME {df.volumes()} != [{state_dir}]")
    need(
        re.search(rf"install -d -o {uid} -g \d+ -m 07\d\d {state_dir}\b", runs) is not None,
        f"{state_dir} is created owned by {uid}",
    )
    return problems


def _subcommands_reading(program: str, variable: str) -> list[Invocation]:
    """The subcommands an image's directory variable is for (enroll and run; init and serve)."""
    paths = [("run",), ("enroll",)] if program == "mcp-agent" else [("serve",), ("init",)]
    invs = [Invocation(program, p, (), "image") for p in paths]
    for inv in invs:
        assert variable in _help(program, inv.path).env, f"{program} {inv.path} reads {variable}"
    return invs


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_image_matches_the_code(name: str, code: Code) -> None:
    assert check_image(name, code) == []


def test_image_drift_in_ports_or_probe_paths_fails(code: Code) -> None:
    moved = dataclasses.replace(code, agent_port=code.agent_port + 1, cp_port=code.cp_port + 1)
    for name in IMAGES:
        assert any("port" in p for p in check_image(name, moved)), name
    renamed = dataclasses.replace(
        code,
        agent_route=lambda p: None if p == "/healthz" else code.agent_route(p),
        cp_route=lambda p: None if p == "/readyz" else code.cp_route(p),
    )
    for name in IMAGES:
        assert any("HEALTHCHECK /" in p for p in check_image(name, renamed)), name


def test_entrypoint_reads_the_secret_files_and_nothing_else(tmp_path: Path) -> None:
    token, password = tmp_path / "token", tmp_path / "pw"
    token.write_text("tok-123\n")
    password.write_text("pg secret\n")
    env = {
        "PATH": os.environ["PATH"],
        "MCP_ENROLL_TOKEN_FILE": str(token),
        "PGPASSWORD_FILE": str(password),
        "MCP_ADMIN_PASSWORD_FILE": str(password),
    }
    out = subprocess.run(
        ["sh", str(DOCKER / "entrypoint.sh"), "env"], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    seen = dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)
    assert seen["MCP_ENROLL_TOKEN"] == "tok-123"
    assert seen["PGPASSWORD"] == "pg secret"
    assert "MCP_ADMIN_PASSWORD" not in seen  # a real option taking a file: left alone
    assert _entrypoint_env() == {
        "MCP_ENROLL_TOKEN_FILE": "MCP_ENROLL_TOKEN",
        "PGPASSWORD_FILE": "PGPASSWORD",
    }
    assert "MCP_ENROLL_TOKEN" in _help("mcp-agent", ("enroll",)).env
    missing = subprocess.run(
        ["sh", str(DOCKER / "entrypoint.sh"), "true"],
        env={**env, "MCP_ENROLL_TOKEN_FILE": str(tmp_path / "absent")},
        capture_output=True,
        text=True,
    )
    assert missing.returncode == 64 and "not a readable file" in missing.stderr
    for script in ("entrypoint.sh", "mosquitto-entrypoint.sh"):
        subprocess.run(["sh", "-n", str(DOCKER / script)], check=True)
    subprocess.run(["sh", "-n", str(COMPOSE / "make-secrets.sh")], check=True)


# ---------------------------------------------------------------------------- the broker image
def _sed_expressions(df: Dockerfile) -> list[tuple[str, str, bool]]:
    runs = " ".join(df.all("RUN"))
    return [(a, b, g == "g") for a, b, g in re.findall(r"-e 's\|([^|]+)\|([^|]*)\|(g?)'", runs)]


def mosquitto_image_conf(df: Dockerfile) -> str:
    """deploy/mosquitto/mosquitto.conf as the Dockerfile's sed leaves it in the image."""
    text = _mosquitto_conf()
    for old, new, every in _sed_expressions(df):
        assert old in text, f"mosquitto.Dockerfile replaces {old!r}, which mosquitto.conf lacks"
        text = text.replace(old, new) if every else text.replace(old, new, 1)
    return text


def _conf_value(conf: str, key: str) -> str:
    values = re.findall(rf"^{key}\s+(\S+)\s*$", conf, re.M)
    assert len(values) == 1, f"{key}: {values}"
    return values[0]


def test_mosquitto_image_runs_our_conf_and_bootstrap(code: Code) -> None:
    df = dockerfile("mosquitto.Dockerfile")
    assert df.one("FROM").startswith("eclipse-mosquitto:2.0")
    conf = mosquitto_image_conf(df)
    plugin = _conf_value(conf, "plugin")
    assert plugin == "/usr/lib/mosquitto_dynamic_security.so"  # the official image's path
    (data,) = df.volumes()
    assert data == "/mosquitto/data"
    assert _conf_value(conf, "plugin_opt_config_file") == f"{data}/dynamic-security.json"
    assert _conf_value(conf, "persistence_location").rstrip("/") == data
    assert "/var/lib/mosquitto" not in conf and "x86_64-linux-gnu" not in conf
    assert df.exposed() == {code.mqtt_port}
    uid = df.uid()
    assert uid not in (0,)
    check = df.healthcheck_argv()
    assert f"/dev/tcp/127.0.0.1/{code.mqtt_port}" in check[-1]
    # The entry point bootstraps into the same dir, with the same plugin, through flags that
    # bootstrap.sh parses; and the copies land where it calls them.
    entry = (DOCKER / "mosquitto-entrypoint.sh").read_text(encoding="utf-8")
    call = " ".join(
        line.rstrip("\\").strip()
        for line in entry.split("/usr/local/bin/mcp-dynsec-bootstrap")[1]
        .split("\n\n")[0]
        .splitlines()
    )
    assert f"--data-dir {data}" in call and f"--plugin {plugin}" in call
    bootstrap = (DEPLOY / "mosquitto" / "bootstrap.sh").read_text(encoding="utf-8")
    for flag in re.findall(r"(--[a-z-]+)", call):
        assert f"    {flag})" in bootstrap, f"bootstrap.sh has no {flag}"
    assert any("bootstrap.sh /usr/local/bin/mcp-dynsec-bootstrap" in c for c in df.all("COPY"))
    assert df.exec_form("ENTRYPOINT") == ["mcp-mosquitto-entrypoint"]
    assert "exec /usr/sbin/mosquitto -c /mosquitto/config/mosquitto.conf" in entry
    assert any("mosquitto.conf /mosquitto/config/mosquitto.conf" in c for c in df.all("COPY"))
    assert "bash" in " ".join(df.all("RUN"))  # bootstrap.sh is bash; the image is Alpine
    subprocess.run(["bash", "-n", str(DEPLOY / "mosquitto" / "bootstrap.sh")], check=True)


@pytest.mark.mosquitto
def test_mosquitto_image_conf_runs_with_the_bootstrap(tmp_path: Path) -> None:
    """The image's mosquitto.conf (after its sed), with its paths mapped onto this machine, and
    bootstrap.sh called with the entry point's flags: the admin logs in and access is deny."""
    import getpass
    import socket
    import time

    from mcp_edge.tooling.mosquitto import MosquittoError, find_executable
    from mcp_edge.tooling.processes import free_port

    try:
        mosquitto = find_executable("mosquitto")
        find_executable("mosquitto_rr")
    except MosquittoError as e:
        pytest.skip(str(e))
    plugins = sorted(Path("/usr/lib").glob("*/mosquitto_dynamic_security.so"))
    if not plugins:
        pytest.skip("no mosquitto_dynamic_security.so under /usr/lib")
    df = dockerfile("mosquitto.Dockerfile")
    (image_data,) = df.volumes()
    image_plugin = _conf_value(mosquitto_image_conf(df), "plugin")
    data, password = tmp_path / "data", tmp_path / "admin.password"
    data.mkdir()
    password.write_text("an-admin-password-for-the-test\n")
    port = free_port()
    conf = (
        mosquitto_image_conf(df)
        .replace(f"{image_data}/", f"{data}/")
        .replace(image_plugin, str(plugins[0]))
        .replace(f"listener {_conf_listener_port()}\n", f"listener {port} 127.0.0.1\n")
    )
    conf += f"user {getpass.getuser()}\n"  # as root, mosquitto would switch to `mosquitto`
    (tmp_path / "mosquitto.conf").write_text(conf)
    bootstrap = [
        "bash", str(DEPLOY / "mosquitto" / "bootstrap.sh"), "--data-dir", str(data),
        "--admin-user", "admin", "--password-file", str(password), "--plugin", str(plugins[0]),
    ]  # fmt: skip
    subprocess.run(bootstrap, check=True, capture_output=True, timeout=60)
    broker = subprocess.Popen(
        [str(mosquitto), "-c", str(tmp_path / "mosquitto.conf")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert broker.poll() is None and time.monotonic() < deadline, "broker down"
                time.sleep(0.05)
        # The conf refuses empty client ids (allow_zero_length_clientid false): name one.
        options = tmp_path / "rr" / "mosquitto_rr"
        options.parent.mkdir(mode=0o700)
        options.write_text("-u admin\n-P an-admin-password-for-the-test\n-i deploy-check\n")
        rr = subprocess.run(
            [
                str(find_executable("mosquitto_rr")),
                *("-h", "127.0.0.1", "-p", str(port), "-W", "10"),
                *("-t", "$CONTROL/dynamic-security/v1"),
                *("-e", "$CONTROL/dynamic-security/v1/response"),
                *("-m", json.dumps({"commands": [{"command": "getDefaultACLAccess"}]})),
            ],
            env={**os.environ, "XDG_CONFIG_HOME": str(options.parent)},
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert rr.returncode == 0, rr.stdout + rr.stderr
        (answer,) = json.loads(rr.stdout)["responses"]
        assert {a["allow"] for a in answer["data"]["acls"]} == {False}
    finally:
        broker.terminate()
        broker.wait(timeout=10)
    assert (data / "dynamic-security.json").is_file() and (data / "mosquitto.db").is_file()


# ---------------------------------------------------------------------------- compose
@functools.cache
def _compose() -> dict[str, Any]:
    doc = yaml.safe_load((COMPOSE / "compose.yaml").read_text(encoding="utf-8"))
    assert isinstance(doc, dict)
    return doc


def _service_image(svc: dict[str, Any]) -> Dockerfile | None:
    build = svc.get("build")
    if not build:
        return None
    assert build["context"] == "../..", "images build from the repository root"
    return Dockerfile.read(COMPOSE / build["context"] / build["dockerfile"])


def _service_argv(svc: dict[str, Any]) -> list[str]:
    df = _service_image(svc)
    entry = svc.get("entrypoint", df.exec_form("ENTRYPOINT") if df else [])
    image_cmd = df.argv()[len(df.exec_form("ENTRYPOINT")) :] if df else []
    command = svc.get("command", [] if "entrypoint" in svc else image_cmd)
    return [*entry, *command]


def _mounts(svc: dict[str, Any]) -> dict[str, str]:
    """Container path → source (volume name or ./path) of a service's volumes."""
    out = {}
    for item in svc.get("volumes", []):
        source, target = item.split(":")[:2]
        out[target] = source
    return out


def _published(svc: dict[str, Any]) -> set[int]:
    return {int(str(p).rsplit(":", 1)[1]) for p in svc.get("ports", [])}


def check_compose(code: Code) -> list[str]:
    doc = _compose()
    services: dict[str, dict[str, Any]] = doc["services"]
    problems: list[str] = []

    def need(ok: bool, text: str) -> None:
        if not ok:
            problems.append(f"compose.yaml: {text}")

    from mcp_edge.controlplane.settings import load_settings

    cp_toml = COMPOSE / "controlplane.toml"
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(cp_toml, Path(tmp) / "controlplane.toml")
        settings = load_settings(Path(tmp), environ={})
    problems += [
        f"controlplane.toml: {p}"
        for p in check_cp_settings(settings, code, "postgres", "mosquitto")
    ]
    problems += check_postgres_env(services["postgres"]["environment"], settings, "compose")
    need(services["postgres"]["healthcheck"]["test"][1] == "pg_isready", "pg_isready")

    all_invs: dict[str, list[Invocation]] = {}
    for name, svc in services.items():
        need(str(svc.get("user", "")).split(":")[0] not in ("0", "root"), f"{name} runs as root")
        df = _service_image(svc)
        if df is None:
            continue
        invs = all_invs[name] = invocations(_service_argv(svc), f"compose {name}")
        problems += check_invocations(invs)
        problems += check_env(svc.get("environment", {}), invs, f"compose {name}")
        need(df.uid() != 0, f"{name}'s image runs as root")
        if invs and invs[0].program == "mcp-agent":
            served = image_ports(df, code)
            need(_published(svc) <= served, f"{name} publishes {_published(svc)} not {served}")
            state = svc.get("environment", {}).get("MCP_STATE_DIR", df.env()["MCP_STATE_DIR"])
            need(state == code.agent_state_dir, f"{name}: state dir {state}")
            need(state in _mounts(svc), f"{name} has no volume on its state dir {state}")
        if invs and invs[0].program == "mcp-controlplane":
            data = df.env()["MCP_DATA_DIR"]
            need(data == code.cp_data_dir, f"{name}: data dir {data}")
            if _published(svc):
                need(_published(svc) == {code.cp_port}, f"{name} publishes {_published(svc)}")

    # The broker: our image, its data volume, the listener port published.
    broker = services["mosquitto"]
    need(_published(broker) == {code.mqtt_port}, "mosquitto publishes the listener port")
    broker_df = _service_image(broker)
    need(
        broker_df is not None and broker_df.volumes()[0] in _mounts(broker),
        "mosquitto keeps /mosquitto/data on a volume",
    )
    need("broker_admin_password" in broker.get("secrets", []), "mosquitto gets the admin password")

    # Control plane: init once, then two replicas of serve sharing the repository and keys.
    serving = [n for n, invs in all_invs.items() if [i.path for i in invs] == [("serve",)]]
    need(len(serving) == 2, f"two control-plane replicas, found {serving}")
    inits = [n for n, invs in all_invs.items() if [i.path for i in invs] == [("init",)]]
    need(len(inits) == 1, f"one init service, found {inits}")
    data = code.cp_data_dir
    names = set()
    for name in serving + inits:
        svc, mounts = services[name], _mounts(services[name])
        need(
            mounts.get(f"{data}/controlplane.toml") == "./controlplane.toml",
            f"{name} reads ./controlplane.toml as its config",
        )
        need(
            mounts.get(f"{data}/repository") == "controlplane-repository"
            and mounts.get(f"{data}/keys") == "controlplane-keys",
            f"{name} mounts the shared repository and keys",
        )
        need(data in mounts, f"{name} has a data volume")
        secret = Path(str(settings.broker_admin_password_file)).name
        need(secret in svc.get("secrets", []), f"{name} lacks the {secret} secret")
        pg_file = svc.get("environment", {}).get("PGPASSWORD_FILE", "")
        need(Path(pg_file).name in svc.get("secrets", []), f"{name}: PGPASSWORD_FILE secret")
        if name in serving:
            names.add(svc["environment"].get("MCP_REPLICA_NAME"))
            deps = svc.get("depends_on", {})
            need(
                deps.get(inits[0], {}).get("condition") == "service_completed_successfully",
                f"{name} starts after {inits[0]} completed",
            )
            need(
                deps.get("postgres", {}).get("condition") == "service_healthy",
                f"{name} waits for a healthy postgres",
            )
    need(len(names) == 2 and None not in names, "each replica has its own MCP_REPLICA_NAME")
    need(len({_mounts(services[n])[data] for n in serving}) == 2, "replicas share a data dir")
    init_inv = all_invs[inits[0]][0] if inits else None
    need(
        init_inv is not None
        and init_inv.value("--admin-password-file") is not None
        and Path(str(init_inv.value("--admin-password-file"))).name
        in services[inits[0]].get("secrets", []),
        "init reads the admin password from a secret",
    )

    # Enrollment: a token written to a shared volume, three agents with three profiles.
    token_writers = [
        n for n, invs in all_invs.items() if ("tokens", "create") in [i.path for i in invs]
    ]
    need(len(token_writers) == 1, f"one service creates the enrollment token: {token_writers}")
    script = " ".join(_service_argv(services[token_writers[0]])) if token_writers else ""
    for inv in all_invs.get(token_writers[0] if token_writers else "", []):
        server = urlsplit(str(inv.value("--server")))
        need(
            server.hostname in serving and server.port == code.cp_port,
            f"{inv.where}: --server {inv.value('--server')}",
        )
    enrolls = {n: i[0] for n, i in all_invs.items() if i and i[0].path == ("enroll",)}
    runs = {n: i[0] for n, i in all_invs.items() if i and i[0].path == ("run",)}
    need(len(enrolls) == 3 and len(runs) == 3, "three agents, each enrolled by a one-shot")
    profiles = set()
    known_profiles = {p.stem for p in (REPO / "firmware_profiles").glob("*.toml")}
    for name, inv in enrolls.items():
        svc = services[name]
        server = urlsplit(str(inv.value("--server")))
        need(
            server.hostname in serving and server.port == code.cp_port,
            f"{name}: --server {inv.value('--server')} is not a replica on {code.cp_port}",
        )
        token_file = svc["environment"].get("MCP_ENROLL_TOKEN_FILE", "")
        token_dir = str(Path(token_file).parent)
        need(token_file in script, f"{name}: {token_file} is not what the token job writes")
        need(
            _mounts(svc).get(token_dir) == _mounts(services[token_writers[0]]).get(token_dir),
            f"{name} does not mount the token job's volume at {token_dir}",
        )
        runner = name.removesuffix("-enroll")
        need(runner in runs, f"no agent service {runner} after {name}")
        if runner not in runs:
            continue
        run_svc = services[runner]
        need(
            run_svc["depends_on"][name]["condition"] == "service_completed_successfully",
            f"{runner} starts after {name}",
        )
        profile = svc["environment"].get("MCP_PROFILE")
        need(profile == run_svc["environment"].get("MCP_PROFILE"), f"{runner}: profile differs")
        need(profile in known_profiles, f"{name}: profile {profile} is not in firmware_profiles")
        profiles.add(profile)
        state = code.agent_state_dir
        need(_mounts(svc)[state] == _mounts(run_svc)[state], f"{name} and {runner} share state")
        extras = (run_svc.get("build", {}).get("args", {}) or {}).get("EXTRAS")
        if profile == "intel-xeon":
            need(
                extras is not None and "openvino" in extras.split(","),
                f"{runner} (intel-xeon) needs the openvino extra",
            )
    need(len(profiles) == 3, f"three different profiles: {profiles}")

    # Secrets come from files make-secrets.sh creates.
    maker = (COMPOSE / "make-secrets.sh").read_text(encoding="utf-8")
    made = set(re.search(r"for name in ([\w ]+); do", maker).group(1).split())  # type: ignore[union-attr]
    declared = doc["secrets"]
    need(set(declared) == made, f"make-secrets.sh makes {made}, compose declares {set(declared)}")
    for name, spec in declared.items():
        need(spec["file"] == f"./secrets/{name}", f"secret {name} file {spec['file']}")
    return problems


def check_cp_settings(settings: Any, code: Code, db_host: str, broker_host: str) -> list[str]:
    problems = []
    if settings.port != code.cp_port or settings.host != "0.0.0.0":
        problems.append(f"listen {settings.host}:{settings.port} is not 0.0.0.0:{code.cp_port}")
    db = urlsplit(str(settings.database_url))
    if db.hostname != db_host or (db.port or 5432) != 5432 or db.password:
        problems.append(f"database_url {settings.database_url}: host {db_host}, no password")
    admin = urlsplit(str(settings.broker_admin_url))
    if admin.hostname != broker_host or admin.port != code.mqtt_port:
        problems.append(f"broker_admin_url {settings.broker_admin_url}")
    for url in settings.broker_urls:
        if urlsplit(url).port != code.mqtt_port:
            problems.append(f"broker_urls {url}: not the listener port {code.mqtt_port}")
    entry = (DOCKER / "mosquitto-entrypoint.sh").read_text(encoding="utf-8")
    secret = re.search(r"DYNSEC_ADMIN_PASSWORD_FILE:-([^}]+)\}", entry).group(1)  # type: ignore[union-attr]
    user = re.search(r"DYNSEC_ADMIN_USER:-([^}]+)\}", entry).group(1)  # type: ignore[union-attr]
    if str(settings.broker_admin_password_file) != secret:
        problems.append(f"broker_admin_password_file is not the broker's {secret}")
    if settings.broker_admin_user != user:
        problems.append(f"broker_admin_user is not the broker's {user}")
    return problems


def check_postgres_env(env: Any, settings: Any, where: str) -> list[str]:
    if isinstance(env, list):  # Kubernetes: [{name, value}]
        env = {e["name"]: e.get("value") for e in env}
    db = urlsplit(str(settings.database_url))
    problems = []
    if env.get("POSTGRES_USER") != db.username or env.get("POSTGRES_DB") != db.path.lstrip("/"):
        problems.append(f"{where}: postgres user/db differ from database_url")
    if not str(env.get("POSTGRES_PASSWORD_FILE", "")).startswith("/run/secrets/"):
        problems.append(f"{where}: the postgres password is not a secret file")
    return problems


def test_compose_matches_the_code(code: Code) -> None:
    assert check_compose(code) == []


def test_compose_drift_in_ports_fails(code: Code) -> None:
    problems = check_compose(dataclasses.replace(code, cp_port=code.cp_port + 1))
    assert any("--server" in p for p in problems) and any("listen" in p for p in problems)
    problems = check_compose(dataclasses.replace(code, agent_port=code.agent_port + 1))
    assert any("publishes" in p for p in problems)
    problems = check_compose(dataclasses.replace(code, mqtt_port=code.mqtt_port + 1))
    assert any("broker_admin_url" in p for p in problems)


# ---------------------------------------------------------------------------- Kubernetes
@functools.cache
def _k8s() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")) + sorted((K8S / "examples").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")):
            if doc:
                docs.append((path.name, doc))
    return docs


def _k8s_get(kind: str, name: str) -> dict[str, Any]:
    found = [d for _, d in _k8s() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def _pod_containers(pod: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield from pod.get("initContainers", [])
    yield from pod["containers"]


def _container_argv(container: dict[str, Any], image: Dockerfile | None) -> list[str]:
    entry = container.get("command") or (image.exec_form("ENTRYPOINT") if image else [])
    args = container.get("args")
    if args is None:
        image_cmd = image.argv()[len(image.exec_form("ENTRYPOINT")) :] if image else []
        args = [] if container.get("command") else image_cmd
    return [*entry, *args]


def _port_number(container: dict[str, Any], port: Any) -> int:
    for p in container.get("ports", []):
        if port in (p.get("name"), p["containerPort"]):
            return int(p["containerPort"])
    raise AssertionError(f"port {port} is not a port of {container['name']}")


def check_k8s(code: Code) -> list[str]:
    problems: list[str] = []

    def need(ok: bool, text: str) -> None:
        if not ok:
            problems.append(f"k8s: {text}")

    docs = _k8s()
    for file, doc in docs:
        need(
            doc["metadata"].get("namespace", "mcp-edge") == "mcp-edge"
            or doc["kind"] == "Namespace",
            f"{file}: {doc['kind']} outside mcp-edge",
        )
    secret = _k8s_get("Secret", "mcp-edge-secrets")
    secret_keys = set(secret["stringData"])

    cp_df = dockerfile("controlplane.Dockerfile")
    broker_df = dockerfile("mosquitto.Dockerfile")
    images = {"controlplane": cp_df, "mosquitto": broker_df}

    # Every pod: non-root, no privilege escalation, read-only root, no capabilities, limits.
    for _, doc in docs:
        if doc["kind"] not in ("Deployment", "StatefulSet", "Job"):
            continue
        pod = doc["spec"]["template"]["spec"]
        name = f"{doc['kind']}/{doc['metadata']['name']}"
        sc = pod.get("securityContext", {})
        need(
            sc.get("runAsNonRoot") is True and int(sc.get("runAsUser", 0)) != 0,
            f"{name}: runAsNonRoot with a non-zero runAsUser",
        )
        need(sc.get("seccompProfile", {}).get("type") == "RuntimeDefault", f"{name}: seccomp")
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        claims = {c["metadata"]["name"] for c in doc["spec"].get("volumeClaimTemplates", [])}
        for c in _pod_containers(pod):
            csc = c.get("securityContext", {})
            need(csc.get("allowPrivilegeEscalation") is False, f"{name}/{c['name']}: escalation")
            need(csc.get("readOnlyRootFilesystem") is True, f"{name}/{c['name']}: read-only root")
            need(csc.get("capabilities", {}).get("drop") == ["ALL"], f"{name}/{c['name']}: caps")
            res = c.get("resources", {})
            need(
                {"cpu", "memory"} <= set(res.get("requests", {}))
                and {"cpu", "memory"} <= set(res.get("limits", {})),
                f"{name}/{c['name']}: requests and limits",
            )
            for m in c.get("volumeMounts", []):
                need(
                    m["name"] in volumes or m["name"] in claims,
                    f"{name}/{c['name']}: mount {m['name']} has no volume",
                )
            image = next(
                (df for key, df in images.items() if f"/mcp-edge/{key}:" in c["image"]), None
            )
            if image is not None:
                need(
                    int(sc["runAsUser"]) == image.uid(),
                    f"{name}: runAsUser {sc['runAsUser']} is not the image's {image.uid()}",
                )
                argv = _container_argv(c, image)
                invs = invocations(argv, f"{name}/{c['name']}")
                problems += check_invocations(invs)
                env = {e["name"]: e.get("value") for e in c.get("env", [])}
                problems += check_env(env, invs, f"{name}/{c['name']}", argv)
        for v in volumes.values():
            for item in v.get("secret", {}).get("items", []):
                need(item["key"] in secret_keys, f"{name}: secret key {item['key']} is unknown")

    # The control plane: 2 replicas, probes on the real routes and port, data dir on a volume.
    deploy = _k8s_get("Deployment", "mcp-controlplane")
    need(deploy["spec"]["replicas"] == 2, "the control plane runs 2 replicas")
    pod = deploy["spec"]["template"]["spec"]
    (cp,) = pod["containers"]
    invs = invocations(_container_argv(cp, cp_df), "Deployment/mcp-controlplane")
    need([i.path for i in invs] == [("serve",)], "the Deployment runs serve")
    listen = invs[0].value("--listen") if invs else None
    need(listen == f"0.0.0.0:{code.cp_port}", f"serve --listen {listen}")
    need({p["containerPort"] for p in cp["ports"]} == {code.cp_port}, "containerPort")
    for probe, want in (
        ("readinessProbe", CP_READY),
        ("livenessProbe", CP_LIVE),
        ("startupProbe", CP_LIVE),
    ):
        get = cp[probe]["httpGet"]
        need(
            code.cp_route(get["path"]) == want,
            f"{probe} {get['path']} resolves to {code.cp_route(get['path'])!r}, not {want!r}",
        )
        need(_port_number(cp, get["port"]) == code.cp_port, f"{probe} port")
    env = {e["name"]: e.get("value") for e in cp["env"]}
    data = env.get("MCP_DATA_DIR")
    need(data == code.cp_data_dir, f"MCP_DATA_DIR {data}")
    need(any(m["mountPath"] == data for m in cp["volumeMounts"]), "the data dir is a volume")
    need(Path(str(env.get("PGPASSWORD_FILE"))).name in secret_keys, "PGPASSWORD_FILE secret")
    service = _k8s_get("Service", "mcp-controlplane")
    (sport,) = service["spec"]["ports"]
    need(
        sport["port"] == code.cp_port and _port_number(cp, sport["targetPort"]) == code.cp_port,
        "the Service forwards the control plane's port",
    )
    config = _k8s_get("ConfigMap", "mcp-controlplane")["data"]["controlplane.toml"]
    from mcp_edge.controlplane.settings import load_settings

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "controlplane.toml").write_text(config, encoding="utf-8")
        settings = load_settings(Path(tmp), environ={})
    problems += [
        f"k8s ConfigMap: {p}" for p in check_cp_settings(settings, code, "postgres", "mosquitto")
    ]
    need(Path(str(settings.broker_admin_password_file)).name in secret_keys, "broker secret key")
    job = _k8s_get("Job", "mcp-controlplane-init")
    (init,) = job["spec"]["template"]["spec"]["containers"]
    init_invs = invocations(_container_argv(init, cp_df), "Job/mcp-controlplane-init")
    need([i.path for i in init_invs] == [("init",)], "the Job runs init")
    if init_invs:
        pw = Path(str(init_invs[0].value("--admin-password-file"))).name
        need(pw in secret_keys, f"init's --admin-password-file {pw} is not a Secret key")

    # The broker and PostgreSQL.
    broker = _k8s_get("StatefulSet", "mosquitto")
    (mq,) = broker["spec"]["template"]["spec"]["containers"]
    need({p["containerPort"] for p in mq["ports"]} == {code.mqtt_port}, "mosquitto port")
    need(
        any(m["mountPath"] == broker_df.volumes()[0] for m in mq["volumeMounts"]),
        "mosquitto's data dir is a persistent volume",
    )
    need(_port_number(mq, mq["readinessProbe"]["tcpSocket"]["port"]) == code.mqtt_port, "probe")
    mq_service = _k8s_get("Service", "mosquitto")["spec"]["ports"][0]
    need(mq_service["port"] == code.mqtt_port, "the mosquitto Service port")
    pg = _k8s_get("StatefulSet", "postgres")["spec"]["template"]["spec"]["containers"][0]
    problems += check_postgres_env(pg["env"], settings, "k8s postgres")
    need(_k8s_get("Service", "postgres")["spec"]["ports"][0]["port"] == 5432, "postgres Service")
    header = (K8S / "20-postgres.yaml").read_text(encoding="utf-8").split("apiVersion")[0]
    need("REFERENCE" in header and "managed database" in header, "postgres: lab reference note")
    return problems


def test_k8s_matches_the_code(code: Code) -> None:
    assert check_k8s(code) == []


def test_k8s_drift_in_probe_paths_or_ports_fails(code: Code) -> None:
    renamed = dataclasses.replace(
        code, cp_route=lambda p: None if p in ("/readyz", "/healthz") else code.cp_route(p)
    )
    problems = check_k8s(renamed)
    assert any("readinessProbe /readyz" in p for p in problems)
    assert any("livenessProbe /healthz" in p for p in problems)
    problems = check_k8s(dataclasses.replace(code, cp_port=code.cp_port + 1))
    assert any("containerPort" in p for p in problems)
    problems = check_k8s(dataclasses.replace(code, mqtt_port=code.mqtt_port + 1))
    assert any("mosquitto port" in p for p in problems)


# ---------------------------------------------------------------------------- systemd
UNITS = {
    "mcp-agent.service": ("mcp-agent", ("run",), "--state-dir", "agent_state_dir"),
    "mcp-controlplane.service": ("mcp-controlplane", ("serve",), "--data-dir", "cp_data_dir"),
}
DROP_INS = {"mcp-agent.service": ["mcp-agent-jetson.conf", "mcp-agent-openvino.conf"]}


def _unit_values(text: str, key: str) -> list[str]:
    return re.findall(rf"^{key}=(.*)$", text, re.M)


def _analyze() -> str:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed (tests/run.sh installs Debian's systemd)")
    return tool


def _runnable_copy(unit: str, tmp: Path, drop_ins: Iterable[str] = ()) -> Path:
    """The unit with ExecStart's /opt/mcp-edge/bin pointed at this venv's bin (verify checks
    that the program exists), plus drop-ins in ``unit.d/``."""
    text = (SYSTEMD / unit).read_text(encoding="utf-8")
    copy = tmp / unit
    copy.write_text(text.replace("ExecStart=/opt/mcp-edge/bin/", f"ExecStart={VENV_BIN}/"))
    for conf in drop_ins:
        (tmp / f"{unit}.d").mkdir(exist_ok=True)
        shutil.copy(SYSTEMD / conf, tmp / f"{unit}.d" / conf)
    return copy


@pytest.mark.parametrize("unit", sorted(UNITS))
def test_systemd_unit_matches_the_code(unit: str, code: Code) -> None:
    program, path, dir_flag, default_attr = UNITS[unit]
    text = (SYSTEMD / unit).read_text(encoding="utf-8")
    (exec_start,) = _unit_values(text, "ExecStart")
    argv = shlex.split(exec_start)
    assert argv[0] == f"/opt/mcp-edge/bin/{program}"
    assert (VENV_BIN / program).is_file(), f"{program} is a console script of the package"
    invs = invocations(argv, unit)
    assert [i.path for i in invs] == [path]
    assert check_invocations(invs) == []
    state = invs[0].value(dir_flag)
    assert state == getattr(code, default_attr)
    (state_directory,) = _unit_values(text, "StateDirectory")
    assert f"/var/lib/{state_directory}" == state
    assert _unit_values(text, "WorkingDirectory") == [state]
    (user,) = _unit_values(text, "User")
    assert user not in ("root", "0") and _unit_values(text, "DynamicUser") in ([], ["no"])
    sysusers = (SYSTEMD / "mcp-edge.sysusers.conf").read_text(encoding="utf-8")
    assert re.search(rf"^u\s+{user}\s+-\s+\"[^\"]+\"\s+{state}$", sysusers, re.M), user
    assert _unit_values(text, "EnvironmentFile") == [f"-/etc/{program}/env"]
    for key, value in {
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "PrivateDevices": "yes",
        "ProtectKernelTunables": "yes",
        "ProtectKernelModules": "yes",
        "ProtectKernelLogs": "yes",
        "ProtectControlGroups": "yes",
        "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6",
        "RestrictNamespaces": "yes",
        "LockPersonality": "yes",
        "SystemCallArchitectures": "native",
        "CapabilityBoundingSet": "",
        "AmbientCapabilities": "",
        "UMask": "0077",
        "Restart": "on-failure",
        "KillSignal": "SIGTERM",
        "MemoryDenyWriteExecute": "yes",
    }.items():
        assert _unit_values(text, key) == [value], key
    assert "@system-service" in _unit_values(text, "SystemCallFilter")
    assert _unit_values(text, "TimeoutStopSec")


@pytest.mark.parametrize("unit", sorted(UNITS))
def test_systemd_unit_verifies_and_rates_ok(unit: str, tmp_path: Path) -> None:
    tool = _analyze()
    copy = _runnable_copy(unit, tmp_path)
    verify = subprocess.run([tool, "verify", str(copy)], capture_output=True, text=True)
    assert verify.returncode == 0 and not verify.stderr.strip(), verify.stderr
    assert exposure(tool, copy) <= MAX_EXPOSURE


def exposure(tool: str, unit: Path) -> float:
    out = subprocess.run(
        [tool, "security", "--offline=yes", str(unit)], capture_output=True, text=True
    )
    match = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", out.stdout)
    assert match, out.stdout + out.stderr
    return float(match.group(1))


@pytest.mark.parametrize("conf", DROP_INS["mcp-agent.service"])
def test_systemd_agent_drop_ins_verify(conf: str, tmp_path: Path) -> None:
    tool = _analyze()
    copy = _runnable_copy("mcp-agent.service", tmp_path, [conf])
    verify = subprocess.run([tool, "verify", str(copy)], capture_output=True, text=True)
    assert verify.returncode == 0 and not verify.stderr.strip(), verify.stderr
    # Looser on purpose (device nodes, JIT memory), still "OK".
    assert exposure(tool, copy) <= MAX_EXPOSURE
    text = (SYSTEMD / conf).read_text(encoding="utf-8")
    assert _unit_values(text, "MemoryDenyWriteExecute") == ["no"]


# MemoryDenyWriteExecute=yes, as systemd 252 implements it on x86_64 (seccomp_memory_deny_
# write_execute in src/shared/seccomp-util.c): EPERM for mmap(PROT_WRITE|PROT_EXEC),
# mprotect/pkey_mprotect(PROT_EXEC) and shmat(SHM_EXEC); then exec the command.
MDWE_C = r"""
#include <errno.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stddef.h>
#include <stdio.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/shm.h>
#include <sys/syscall.h>
#include <unistd.h>
#define ARG(n) (offsetof(struct seccomp_data, args[n]))
#define DENY BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EPERM)
#define ALLOW BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW)
int main(int argc, char **argv) {
    struct sock_filter f[] = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, AUDIT_ARCH_X86_64, 1, 0),
        ALLOW,
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_mmap, 0, 4),
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, ARG(2)),
        BPF_STMT(BPF_ALU | BPF_AND | BPF_K, PROT_WRITE | PROT_EXEC),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, PROT_WRITE | PROT_EXEC, 0, 9),
        DENY,
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_mprotect, 1, 0),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_pkey_mprotect, 0, 3),
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, ARG(2)),
        BPF_JUMP(BPF_JMP | BPF_JSET | BPF_K, PROT_EXEC, 0, 4),
        DENY,
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_shmat, 0, 2),
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, ARG(2)),
        BPF_JUMP(BPF_JMP | BPF_JSET | BPF_K, SHM_EXEC, 1, 0),
        ALLOW,
        DENY,
    };
    struct sock_fprog prog = {sizeof(f) / sizeof(f[0]), f};
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) || prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog)) {
        perror("seccomp");
        return 2;
    }
    execvp(argv[1], argv + 1);
    perror("execvp");
    return 127;
}
"""

MDWE_WORKLOAD = r"""
import mmap, sys
from pathlib import Path
import numpy as np
import onnx
from onnx import TensorProto, helper

# The rule is in force: a writable and executable mapping is refused.
try:
    mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    sys.exit("W+X mapping allowed: the filter is not in force")
except PermissionError:
    pass

out = Path(sys.argv[1])
w = np.arange(12, dtype=np.float32).reshape(4, 3) / 10
graph = helper.make_graph(
    [helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
    [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 4])],
    [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 3])],
    [helper.make_tensor("w", TensorProto.FLOAT, [4, 3], w.ravel())],
)
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
model.ir_version = 8
x = np.ones((2, 4), np.float32)

import onnxruntime as ort
session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
np.testing.assert_allclose(session.run(None, {"x": x})[0], x @ w, rtol=1e-5)

from ai_edge_litert.interpreter import Interpreter
from mcp_edge.tooling.tflite_graph import TFLiteGraph
g = TFLiteGraph()
xi, yi = g.activation("x", [1, 4]), g.activation("y", [1, 3])
g.fully_connected(xi, w.T.copy(), np.zeros(3, np.float32), yi, relu=False)
g.write(out / "m.tflite", {"x": xi}, {"y": yi}, "mdwe check")
interp = Interpreter(model_path=str(out / "m.tflite"))  # XNNPACK by default
interp.allocate_tensors()
interp.set_tensor(interp.get_input_details()[0]["index"], x[:1])
interp.invoke()
np.testing.assert_allclose(interp.get_tensor(interp.get_output_details()[0]["index"]), x[:1] @ w,
                           rtol=1e-5)
print("ok")
"""


def test_memory_deny_write_execute_keeps_onnxruntime_litert_and_the_control_plane(
    tmp_path: Path,
) -> None:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None or platform.machine() != "x86_64" or sys.platform != "linux":
        pytest.skip("needs a C compiler on x86_64 Linux to emulate MemoryDenyWriteExecute")
    (tmp_path / "mdwe.c").write_text(MDWE_C)
    subprocess.run([cc, "-O2", "-o", str(tmp_path / "mdwe"), str(tmp_path / "mdwe.c")], check=True)
    mdwe = str(tmp_path / "mdwe")
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    agent = subprocess.run(
        [mdwe, sys.executable, "-c", MDWE_WORKLOAD, str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert agent.returncode == 0 and agent.stdout.strip() == "ok", agent.stdout + agent.stderr
    # The control plane's init: SQLAlchemy and Alembic, argon2 (PyNaCl), TUF keys and signing.
    (tmp_path / "pw").write_text("a-long-password\n")
    init = subprocess.run(
        [
            mdwe,
            str(VENV_BIN / "mcp-controlplane"),
            "init",
            "--data-dir",
            str(tmp_path / "cp"),
            "--admin-password-file",
            str(tmp_path / "pw"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert init.returncode == 0, init.stderr
    assert init.stdout.strip().startswith("mcpa_"), init.stdout  # the admin's API token
