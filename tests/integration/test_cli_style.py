"""``mcp-controlplane`` as a new user meets it, against a real served control plane: one-line
errors with the API's message (exit 1) and, under ``--json``, a JSON object with the API's
code; usage errors exit 2; an unreachable server is named with what to check; every option
readable from an ``MCP_...`` variable shown in ``--help``; ``init`` refusing, before it writes
anything, to create an admin without a password; ``whoami`` and ``api-tokens`` (console
sessions among them); ``serve`` logging JSON lines."""

from __future__ import annotations

import http.cookiejar
import json
import re
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from mcp_edge.controlplane.cli import main
from mcp_edge.controlplane.settings import load_settings
from mcp_edge.tooling.processes import CONTROLPLANE, REPO, free_port, process_env
from tests.integration.test_controlplane_cli import PASSWORD, Fleet, _init
from tests.support.controlplane import FakeClock, FakeProvisioner, served


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    """``init`` and a served control plane on the system clock (token expiry is judged by the
    CLI's clock and the server's alike)."""
    data_dir = tmp_path / "cp"
    result = _init(data_dir, tmp_path, "--listen", "127.0.0.1:0")
    assert result.exit_code == 0, result.output
    token = result.stdout.strip().splitlines()[-1]
    provisioner = FakeProvisioner()
    with served(load_settings(data_dir, environ={}), provisioner) as url:
        # The clock is only what enrollment envelopes are dated with.
        yield Fleet(url, token, data_dir, provisioner, FakeClock(datetime.now(timezone.utc)))


def lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


# ---------------------------------------------------------------------------- errors
def test_an_api_error_is_the_servers_message_on_one_line_and_exit_1(fleet: Fleet) -> None:
    missing = fleet.run("desired", "show", "ghost", ok=False)
    assert (missing.exit_code, missing.stdout) == (1, "")
    assert missing.stderr == "Error: no device 'ghost' (HTTP 404)\n"
    as_json = fleet.run("desired", "show", "ghost", "--json", ok=False)
    assert as_json.exit_code == 1
    assert json.loads(as_json.stderr) == {
        "error": "no device 'ghost' (HTTP 404)",
        "code": "not_found",
    }
    refused = fleet.run("whoami", "--json", token="mcpa_wrong", ok=False)
    assert refused.exit_code == 1 and json.loads(refused.stderr)["code"] == "unauthorized"
    # MCP_JSON=1 is --json, and with it the JSON error.
    env = {"MCP_SERVER": fleet.url, "MCP_TOKEN": fleet.token, "MCP_JSON": "1"}
    from_env = CliRunner(env=env).invoke(main, ["desired", "show", "ghost"])
    assert from_env.exit_code == 1 and json.loads(from_env.stderr)["code"] == "not_found"


def test_usage_errors_exit_2_with_the_usage_line(fleet: Fleet) -> None:
    no_selector = fleet.run("deploy", "digits", "1.0.0", ok=False)
    assert no_selector.exit_code == 2
    assert no_selector.stderr.startswith("Usage: mcp-controlplane deploy")
    assert lines(no_selector.stderr)[-1] == (
        "Error: select devices with exactly one of --device, --group or --label k=v (got none)"
    )
    as_json = fleet.run("deploy", "digits", "1.0.0", "--json", ok=False)
    assert as_json.exit_code == 2 and json.loads(as_json.stderr)["code"] == "usage"
    timeout_alone = fleet.run("deploy", "digits", "1.0.0", "--device", "x", "--timeout", "1m", ok=False)  # fmt: skip
    assert timeout_alone.exit_code == 2 and "Error: --timeout is for --wait" in timeout_alone.stderr
    unknown = fleet.run("api-tokens", "revoke", "zero", ok=False)
    assert unknown.exit_code == 2 and "'zero' is not a valid integer" in unknown.stderr


def test_an_unreachable_server_is_named_with_what_to_check() -> None:
    server = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    result = CliRunner().invoke(main, ["whoami", "--server", server, "--token", "mcpa_x"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.stderr == (
        f"Error: cannot reach {server}: connection refused; check that `mcp-controlplane "
        "serve` runs there and that --server (MCP_SERVER) names it\n"
    )
    as_json = CliRunner().invoke(main, ["whoami", "--server", server, "--token", "x", "--json"])
    assert json.loads(as_json.stderr)["code"] == "unreachable"
    not_a_url = CliRunner().invoke(main, ["whoami", "--server", "cp-1", "--token", "mcpa_x"])
    assert not_a_url.exit_code == 2
    assert not_a_url.stderr == (
        "Error: --server 'cp-1' is not a URL; give one like http://127.0.0.1:8080\n"
    )


# ---------------------------------------------------------------------------- environment
def _options(command: click.Command, path: tuple[str, ...] = ()) -> list[tuple[str, click.Option]]:
    found = [
        (" ".join(path), p)
        for p in command.params
        if isinstance(p, click.Option) and p.expose_value
    ]
    if isinstance(command, click.Group):
        for name, sub in command.commands.items():
            found += _options(sub, (*path, name))
    return found


def test_every_option_has_an_environment_variable_shown_in_its_help() -> None:
    options = _options(main)
    assert len(options) > 100
    without = [f"{where} {max(o.opts, key=len)}" for where, o in options if not o.envvar]
    # Profile filters and selectors are the exception: MCP_PROFILE is the agent's hardware
    # profile, set on hosts that run one, and must not narrow a device list or a rollout.
    assert without == ["devices list --profile", "rollouts create --profile"]
    names = {(where, max(o.opts, key=len)): o.envvar for where, o in options}
    # The variables that predate the rule keep their names.
    assert names["init", "--data-dir"] == names["serve", "--data-dir"] == "MCP_DATA_DIR"
    assert names["serve", "--database-url"] == "MCP_DATABASE_URL"
    assert names["serve", "--listen"] == "MCP_LISTEN"
    assert names["init", "--broker-url"] == "MCP_BROKER_URLS"
    assert names["devices list", "--server"] == "MCP_SERVER"
    assert names["devices list", "--token"] == "MCP_TOKEN"
    assert names["deploy", "--json"] == "MCP_JSON"
    for args, shown in (
        (["deploy", "--help"], ["MCP_WAIT", "MCP_TIMEOUT", "MCP_LOG_LEVEL", "MCP_LOG_FORMAT"]),
        (["serve", "--help"], ["MCP_DATA_DIR", "MCP_LISTEN", "MCP_LOG_FORMAT"]),
        (["api-tokens", "list", "--help"], ["MCP_SERVER", "MCP_TOKEN", "MCP_ALL"]),
    ):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0, result.output
        text = " ".join(result.stdout.split())  # help wraps lines
        for name in shown:
            assert f"env var: {name}" in text, (args, name)


def test_options_are_read_from_their_variables(fleet: Fleet) -> None:
    for n in range(3):
        fleet.run("tokens", "create", "--description", f"t{n}")
    env = {"MCP_SERVER": fleet.url, "MCP_TOKEN": fleet.token}
    one = CliRunner(env={**env, "MCP_LIMIT": "1", "MCP_JSON": "true"}).invoke(main, ["audit"])
    assert one.exit_code == 0, one.output
    assert len(json.loads(one.stdout)) == 1
    described = CliRunner(env={**env, "MCP_DESCRIPTION": "from-env"}).invoke(
        main, ["tokens", "create"]
    )
    assert described.exit_code == 0, described.output
    listed = json.loads(fleet.run("tokens", "list", "--json").stdout)
    assert "from-env" in [t["description"] for t in listed]


# ---------------------------------------------------------------------------- init
def test_init_without_a_password_source_writes_nothing(tmp_path: Path) -> None:
    fresh, empty = tmp_path / "fresh", tmp_path / "empty"
    empty.mkdir()
    for data_dir in (fresh, empty):
        # CliRunner's stdin is no terminal, so there is nobody to ask either.
        result = CliRunner().invoke(main, ["init", "--data-dir", str(data_dir)])
        assert result.exit_code == 1, result.output
        error = lines(result.stderr)[-1]
        assert error.startswith("Error: init creates the first admin and needs its password")
        for way in ("--admin-password-file", "MCP_ADMIN_PASSWORD_FILE", "MCP_ADMIN_PASSWORD"):
            assert way in error
        assert "terminal" in error and f"nothing was written to {data_dir}" in error
    assert not fresh.exists() and list(empty.iterdir()) == []
    unreadable = CliRunner().invoke(
        main, ["init", "--data-dir", str(fresh), "--admin-password-file", str(tmp_path / "no")]
    )
    assert unreadable.exit_code == 1 and "cannot read --admin-password-file" in unreadable.stderr
    assert not fresh.exists()

    made = CliRunner(env={"MCP_DATA_DIR": str(fresh), "MCP_ADMIN_PASSWORD": PASSWORD}).invoke(
        main, ["init"]
    )
    assert made.exit_code == 0, made.output
    assert made.stdout.strip().startswith("mcpa_")
    # Users exist now: no password is needed, and none is asked for.
    again = CliRunner().invoke(main, ["init", "--data-dir", str(fresh)])
    assert again.exit_code == 0 and "no admin created" in again.stderr
    named = CliRunner().invoke(main, ["init", "--data-dir", str(fresh), "--admin-user", "bob"])
    assert named.exit_code == 1 and "needs its password" in named.stderr


# ---------------------------------------------------------------------------- account
def _console_sign_in(url: str, username: str, password: str) -> urllib.request.OpenerDirector:
    """Sign in to the web console as a browser does; the opener keeps the session cookie."""
    jar = http.cookiejar.CookieJar()
    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
    with opener.open(url + "/ui/login", timeout=10) as page:
        found = re.search(r'name="csrf" value="([^"]+)"', page.read().decode())
    assert found is not None
    form = {"username": username, "password": password, "next": "/ui/account"}
    body = urllib.parse.urlencode({**form, "csrf": found.group(1)}).encode()
    with opener.open(url + "/ui/login", data=body, timeout=10) as signed_in:
        assert signed_in.url.endswith("/ui/account")
    return opener


def test_whoami_and_the_callers_api_tokens_with_console_sessions(
    fleet: Fleet, tmp_path: Path
) -> None:
    me = json.loads(fleet.run("whoami", "--json").stdout)
    assert (me["username"], me["role"]) == ("admin", "admin")
    assert fleet.run("whoami").stdout.startswith(f"admin (admin), API token {me['token_id']}")

    pw = tmp_path / "vera.pw"
    pw.write_text("vera-password\n")
    fleet.run("users", "create", "vera", "--role", "viewer", "--password-file", str(pw))
    vera_cli = fleet.run("login", "-u", "vera", "--password-file", str(pw)).stdout.strip()
    browser = _console_sign_in(fleet.url, "vera", "vera-password")

    vera = json.loads(fleet.run("api-tokens", "list", "--json", token=vera_cli).stdout)
    assert sorted(t["name"] for t in vera) == ["cli", "web session"]
    assert {t["username"] for t in vera} == {"vera"}
    assert [t["current"] for t in vera if t["name"] == "cli"] == [True]
    table = fleet.run("api-tokens", "list", token=vera_cli).stdout
    assert "web session" in table and "active (this one)" in table and "admin" not in table
    # An admin sees only their own by default, everyone's with --all; a viewer may not ask.
    own = json.loads(fleet.run("api-tokens", "list", "--json").stdout)
    assert {t["username"] for t in own} == {"admin"}
    everyone = json.loads(fleet.run("api-tokens", "list", "--all", "--json").stdout)
    assert {t["username"] for t in everyone} == {"admin", "vera"}
    refused = fleet.run("api-tokens", "list", "--all", token=vera_cli, ok=False)
    assert refused.exit_code == 1 and "--all needs the admin role" in refused.stderr

    session = next(t for t in vera if t["name"] == "web session")
    revoked = fleet.run("api-tokens", "revoke", str(session["id"]), token=vera_cli)
    assert revoked.stdout.strip() == (
        f"API token {session['id']} 'web session' ({session['prefix']}...) revoked"
    )
    with browser.open(fleet.url + "/ui/account", timeout=10) as page:
        assert "/ui/login" in page.url  # the console session ended
    active = json.loads(
        fleet.run("api-tokens", "list", "--active", "--json", token=vera_cli).stdout
    )
    assert [t["name"] for t in active] == ["cli"]
    # Someone else's token is not the caller's to revoke; the token in use ends this login.
    admin_token = own[0]["id"]
    other = fleet.run("api-tokens", "revoke", str(admin_token), token=vera_cli, ok=False)
    assert other.exit_code == 1 and f"no API token {admin_token} (HTTP 404)" in other.stderr
    cli_id = next(t["id"] for t in vera if t["name"] == "cli")
    last = fleet.run("api-tokens", "revoke", str(cli_id), token=vera_cli)
    assert "that was the token this command used" in last.stderr
    gone = fleet.run("whoami", token=vera_cli, ok=False)
    assert gone.exit_code == 1 and gone.stderr.startswith("Error: ")


# ---------------------------------------------------------------------------- serve logging
def test_serve_logs_json_lines_with_log_format_json(tmp_path: Path) -> None:
    data_dir = tmp_path / "cp"
    env = {**process_env(), "MCP_DATA_DIR": str(data_dir), "MCP_ADMIN_PASSWORD": PASSWORD}
    init = subprocess.run(
        [*CONTROLPLANE, "init", "--listen", "127.0.0.1:0"],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert init.returncode == 0, init.stderr
    server = subprocess.Popen(
        [*CONTROLPLANE, "serve", "--log-level", "debug"],
        env={**env, "MCP_LOG_FORMAT": "json"}, cwd=REPO, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert server.stdout is not None
        url = server.stdout.readline().strip()  # printed once the socket listens
        assert url.startswith("http://127.0.0.1:")
    finally:
        server.terminate()
        _, err = server.communicate(timeout=60)
    assert server.returncode == 0, err
    records = [json.loads(line) for line in lines(err) if line.startswith("{")]
    others = [line for line in lines(err) if not line.startswith("{")]
    assert len(others) == 1 and others[0].endswith(f"serving on {url}"), err
    assert {"ts", "level", "logger", "message"} <= set(records[0])
    assert "debug" in {r["level"] for r in records}
    assert any(r["logger"].startswith("mcp.controlplane") for r in records)
