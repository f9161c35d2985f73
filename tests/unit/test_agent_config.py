"""The agent's TOML configuration file (agent/config.py): precedence, types, unknown keys.

The commands here carry the real serving options of ``mcp-agent serve``/``run`` and the real
``--config`` option, with the environment variables ``mcp-agent`` gives them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner, Result

from mcp_edge.agent.config import MAX_CONFIG_BYTES, config_option, settable_options
from mcp_edge.agent.run import run_command
from mcp_edge.agent.serving.serve import ServingOptions, serve_command, serving_options
from mcp_edge.shared.cli_style import env_options, log_options


def _command(default: Path) -> click.Command:
    @click.command()
    @config_option(default)
    @serving_options
    @log_options
    def show(serving: ServingOptions, log_level: str, log_format: str) -> None:
        values: dict[str, Any] = {
            "port": serving.port,
            "host": serving.host,
            "no_batching": serving.no_batching,
            "timeout_ms": serving.timeout_ms,
            "trust_keys": [str(p) for p in serving.trust_keys],
            "state_dir": None if serving.state_dir is None else str(serving.state_dir),
            "log_format": log_format,
        }
        click.echo(json.dumps(values))

    env_options(show)
    return show


def _run(tmp_path: Path, toml: str | None, *args: str, env: dict[str, str] | None = None) -> Result:
    default = tmp_path / "agent.toml"
    if toml is not None:
        default.write_text(toml)
    return CliRunner(env=env).invoke(_command(default), list(args))


def _values(result: Result) -> dict[str, Any]:
    assert result.exit_code == 0, result.output
    values: dict[str, Any] = json.loads(result.stdout)
    return values


def test_command_line_wins_over_the_environment_which_wins_over_the_file(tmp_path: Path) -> None:
    assert _values(_run(tmp_path, None))["port"] == 8000  # the built-in default
    assert _values(_run(tmp_path, "port = 9001\n"))["port"] == 9001
    env = {"MCP_PORT": "9002"}
    assert _values(_run(tmp_path, "port = 9001\n", env=env))["port"] == 9002
    assert _values(_run(tmp_path, "port = 9001\n", "--port", "9003", env=env))["port"] == 9003
    # Keys the command line does not give keep the file's values.
    mixed = _values(_run(tmp_path, 'port = 9001\nhost = "0.0.0.0"\n', "--port", "9003"))
    assert (mixed["port"], mixed["host"]) == (9003, "0.0.0.0")


def test_every_kind_of_value_is_read(tmp_path: Path) -> None:
    (tmp_path / "keys").mkdir()
    for name in ("a.pub", "b.pub"):
        (tmp_path / "keys" / name).write_text("unused\n")
    values = _values(
        _run(
            tmp_path,
            'no_batching = true\ntimeout_ms = 250\nlog_format = "json"\n'
            'trust_key = ["keys/a.pub", "keys/b.pub"]\nstate_dir = "state"\n',
        )
    )
    assert values["no_batching"] is True
    assert values["timeout_ms"] == 250.0  # an integer is a number too
    assert values["log_format"] == "json"
    # Relative paths are relative to the file's directory, not to the current directory.
    assert values["trust_keys"] == [str(tmp_path / "keys/a.pub"), str(tmp_path / "keys/b.pub")]
    assert values["state_dir"] == str(tmp_path / "state")


def test_the_default_file_is_optional_but_a_named_one_must_exist(tmp_path: Path) -> None:
    assert _values(_run(tmp_path, None))["port"] == 8000
    missing = _run(tmp_path, None, "--config", str(tmp_path / "nope.toml"))
    assert missing.exit_code == 2
    assert f"cannot read {tmp_path / 'nope.toml'}: No such file or directory" in missing.output
    named = tmp_path / "other.toml"
    named.write_text("port = 9100\n")
    assert _values(_run(tmp_path, "port = 9001\n", "--config", str(named)))["port"] == 9100
    env = {"MCP_CONFIG": str(named)}
    assert _values(_run(tmp_path, "port = 9001\n", env=env))["port"] == 9100


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ('port = "8000"\n', "port: expected an integer, got a string ('8000')"),
        ("port = true\n", "port: expected an integer, got a boolean (True)"),
        ("port = 80.5\n", "port: expected an integer, got a number (80.5)"),
        ("port = 70000\n", "port: 70000 is not in the range 0<=x<=65535."),
        ('no_batching = "yes"\n', "no_batching: expected true or false, got a string ('yes')"),
        ('timeout_ms = "fast"\n', "timeout_ms: expected a number, got a string ('fast')"),
        ('log_format = "xml"\n', "log_format: 'xml' is not one of 'text', 'json'."),
        ('trust_key = "a.pub"\n', "trust_key: expected an array (trust_key = [...]), got a string"),
        ("trust_key = [1]\n", "trust_key[0]: expected a string, got an integer (1)"),
        ("[host]\nname = 1\n", "host: expected a string, got a table"),
    ],
)
def test_a_value_of_the_wrong_type_is_refused_naming_the_key(
    tmp_path: Path, toml: str, message: str
) -> None:
    result = _run(tmp_path, toml)
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines() == [f"Error: {tmp_path / 'agent.toml'}: {message}"]


def test_an_unknown_key_is_refused_and_the_keys_listed(tmp_path: Path) -> None:
    result = _run(tmp_path, "port = 9001\nmax_batch = 4\n")
    assert result.exit_code == 2
    line = result.output.strip()
    assert line.startswith(f"Error: {tmp_path / 'agent.toml'}: unknown key 'max_batch'; ")
    assert "max_batch_size" in line and "log_level" in line and "trust_key" in line
    # The option's parameter name is not a key: the key is the option's name.
    assert _run(tmp_path, 'trust_keys = ["x"]\n').exit_code == 2


def test_a_file_that_is_not_toml_or_too_large_is_refused(tmp_path: Path) -> None:
    broken = _run(tmp_path, "port = \n")
    assert broken.exit_code == 2 and "not valid TOML" in broken.output
    big = _run(tmp_path, "# " + "x" * MAX_CONFIG_BYTES + "\n")
    assert big.exit_code == 2 and "larger than 256 KiB" in big.output
    binary = tmp_path / "agent.toml"
    binary.write_bytes(b"port = 1\n\xff\xfe\n")
    result = CliRunner().invoke(_command(binary), [])
    assert result.exit_code == 2 and "not UTF-8 text" in result.output


def test_run_takes_every_serving_option_of_serve_and_all_can_be_configured() -> None:
    serve_keys = set(settable_options(serve_command))
    run_keys = set(settable_options(run_command))
    shared = {"host", "port", "workers", "threads", "max_batch_size", "max_queue_delay_ms",
              "max_queue", "timeout_ms", "no_batching", "inline_below_us", "profile",
              "backend", "trust_key", "watch_interval", "state_dir", "max_body_mb",
              "access_log", "model_path", "log_level", "log_format"}  # fmt: skip
    assert shared <= serve_keys and shared <= run_keys
    assert {"repo", "health_interval", "stats_interval", "max_reply_mb"} <= run_keys
    assert serve_keys - run_keys == {
        "canary",
        "shadow",
        "canary_max_error_rate",
        "drift",
        "drift_sample_every",
    }
    # Each option of run is one the file may set, --config aside.
    names = {p.name for p in run_command.params if isinstance(p, click.Option)}
    assert names - {p.name for p in settable_options(run_command).values()} == {"config_path"}


def test_run_refuses_a_bad_file_before_starting(tmp_path: Path) -> None:
    config = tmp_path / "agent.toml"
    config.write_text("workers = 0\n")
    result = CliRunner().invoke(
        run_command, ["--config", str(config), "--state-dir", str(tmp_path / "state")]
    )
    assert result.exit_code == 2
    assert f"Error: {config}: workers: 0 is not in the range 1<=x<=64." in result.output
    assert not (tmp_path / "state").exists()
