"""``mcp-agent`` and ``mcp-bundle`` as a user meets them: real processes, their exit statuses,
``Error:`` lines, JSON errors, the port ``serve --port 0`` bound and the JSON errors of routes
the agent does not have."""

from __future__ import annotations

import gzip
import json
import re
import signal
import socket
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mcp_edge.tooling.models import DigitsModels
from mcp_edge.tooling.processes import AGENT, BUNDLE, REPO, process_env, wait_until

LISTENING = re.compile(r"listening on http://127\.0\.0\.1:(\d+) ")


def _cli(
    tool: list[str], *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*tool, *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**process_env(), **(env or {})},
        timeout=120,
        check=False,
    )


def _error_line(done: subprocess.CompletedProcess[str]) -> str:
    """The last stderr line, after checking there is no traceback."""
    assert "Traceback" not in done.stderr, done.stderr
    return done.stderr.strip().splitlines()[-1]


def _http(url: str, method: str = "GET") -> tuple[int, dict[str, str], Any]:
    request = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, dict(answer.headers), json.loads(answer.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Any]:
    """Start ``mcp-agent serve ARGS...`` with stderr in a file; stop it at the end."""
    procs: list[subprocess.Popen[str]] = []

    def start(*args: str) -> tuple[subprocess.Popen[str], Path]:
        log = tmp_path / f"serve-{len(procs)}.log"
        with log.open("w") as err:
            proc = subprocess.Popen(
                [*AGENT, "serve", "--state-dir", str(tmp_path / "state"), *args],
                stdout=subprocess.DEVNULL,
                stderr=err,
                text=True,
                cwd=REPO,
                env=process_env(),
            )
        procs.append(proc)
        return proc, log

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=10)


def _bound_port(proc: subprocess.Popen[str], log: Path) -> int:
    def listening() -> bool:
        assert proc.poll() is None, log.read_text()
        return LISTENING.search(log.read_text()) is not None

    wait_until(listening, "the agent's listening line", 60)
    found = LISTENING.search(log.read_text())
    assert found is not None
    return int(found[1])


def test_serve_on_port_0_prints_the_port_it_bound_and_answers_there(
    digits: DigitsModels, serve: Any
) -> None:
    proc, log = serve("--model-path", str(digits.onnx_path), "--port", "0")
    port = _bound_port(proc, log)
    assert port != 0
    base = f"http://127.0.0.1:{port}"
    assert _http(base + "/v2/health/ready")[0::2] == (200, {"ready": True})
    assert (
        f"mcp-agent: serving digits on {base}; try GET {base}/v2/models/digits" in log.read_text()
    )

    # Routes the agent does not have answer in the API's error shape.
    status, _, body = _http(base + "/v2/nothing/here")
    assert (status, body) == (
        404,
        {"error": "no such route: /v2/nothing/here", "code": "not_found"},
    )
    status, headers, body = _http(base + "/v2/health/ready", method="POST")
    assert status == 405 and headers["Allow"] == "GET,HEAD"
    assert body == {
        "error": "POST is not allowed on /v2/health/ready; use GET, HEAD",
        "code": "bad_request",
    }
    status, headers, body = _http(base + "/v2/models/digits/infer", method="GET")
    assert (status, headers["Allow"], body["code"]) == (405, "POST", "bad_request")

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0, log.read_text()


def test_serve_logs_json_lines_when_asked(digits: DigitsModels, serve: Any) -> None:
    proc, log = serve("--model-path", str(digits.onnx_path), "--port", "0", "--log-format", "json")

    def listening() -> bool:
        assert proc.poll() is None, log.read_text()
        return "listening on http://127.0.0.1:" in log.read_text()

    wait_until(listening, "the agent's listening record", 60)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0, log.read_text()
    records = [json.loads(line) for line in log.read_text().splitlines()]  # every line is JSON
    assert all({"ts", "level", "logger", "message"} <= set(r) for r in records)
    assert any(LISTENING.search(r["message"] + " ") for r in records), records


def test_a_port_in_use_is_one_error_line(digits: DigitsModels, tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = _cli(
            AGENT, "serve", "--model-path", str(digits.onnx_path), "--port", str(port),
            "--state-dir", str(tmp_path / "state"),
        )  # fmt: skip
    assert done.returncode == 1
    assert _error_line(done) == f"Error: cannot listen on 127.0.0.1:{port}: Address already in use"


def test_usage_errors_exit_2_and_failures_exit_1(tmp_path: Path) -> None:
    bad_port = _cli(AGENT, "serve", "--model-path", str(tmp_path), "--port", "70000")
    assert bad_port.returncode == 2
    assert _error_line(bad_port) == (
        "Error: Invalid value for '--port' (env var: 'MCP_PORT'): 70000 is not in the range "
        "0<=x<=65535."
    )
    assert "Usage: mcp-agent serve [OPTIONS]" in bad_port.stderr

    not_enrolled = _cli(AGENT, "run", "--state-dir", str(tmp_path / "fresh"))
    assert not_enrolled.returncode == 1
    assert not_enrolled.stderr.strip().splitlines() == [
        f"Error: {tmp_path / 'fresh'}: not enrolled; run `mcp-agent enroll` first"
    ]


def test_json_commands_fail_with_a_json_error_and_a_code(tmp_path: Path) -> None:
    state = tmp_path / "state"
    (state / "updates" / "digits.json").mkdir(parents=True)  # a record that cannot be read
    done = _cli(AGENT, "updates", "--state-dir", str(state), "--json")
    assert done.returncode == 1
    assert json.loads(done.stderr) == {
        "error": f"{state / 'updates' / 'digits.json'}: Is a directory",
        "code": "is_a_directory",
    }
    usage = _cli(AGENT, "doctor", "--json", "--profile", "no-such-profile")
    assert usage.returncode == 2
    assert json.loads(usage.stderr)["code"] == "usage"


def test_enroll_without_a_scheme_says_to_add_one_before_going_anywhere(tmp_path: Path) -> None:
    state = tmp_path / "state"
    for args, env in (
        (["--server", "cp.example:8080"], None),
        ([], {"MCP_SERVER": "cp.example:8080"}),
    ):
        done = _cli(AGENT, "enroll", *args, "--token", "t" * 16, "--state-dir", str(state), env=env)
        assert done.returncode == 2
        assert _error_line(done) == (
            "Error: Invalid value for '--server' (env var: 'MCP_SERVER'): 'cp.example:8080' has "
            "no scheme; add one: "
            "http://cp.example:8080 or https://cp.example:8080"
        )
    assert not state.exists()  # no device key made: nothing ran


def test_run_refuses_a_config_file_with_an_unknown_key(tmp_path: Path) -> None:
    config = tmp_path / "agent.toml"
    config.write_text('port = 8001\nmodel_dir = "/srv/models"\n')
    for args, env in ((["--config", str(config)], None), ([], {"MCP_CONFIG": str(config)})):
        done = _cli(AGENT, "run", *args, "--state-dir", str(tmp_path / "state"), env=env)
        assert done.returncode == 2
        line = _error_line(done)
        assert line.startswith(f"Error: {config}: unknown key 'model_dir'; the keys are ")
        assert "model_path" in line


def test_bundle_verify_of_a_file_that_is_not_a_bundle(tmp_path: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("not a bundle\n" * 100)
    compressed = tmp_path / "digits.mcpb.gz"
    compressed.write_bytes(gzip.compress(b"x" * 2048))
    cases = {
        text: "it does not start with a POSIX ustar header",
        compressed: "it is gzip-compressed; a bundle is an uncompressed tar archive",
    }
    for path, why in cases.items():
        done = _cli(BUNDLE, "verify", str(path), "--allow-unsigned")
        assert done.returncode == 1
        assert done.stderr.strip().splitlines() == [f"Error: {path} is not an MCP bundle ({why})"]
        as_json = _cli(BUNDLE, "verify", str(path), "--allow-unsigned", "--json")
        assert as_json.returncode == 1
        assert json.loads(as_json.stderr) == {
            "error": f"{path} is not an MCP bundle ({why})",
            "code": "not_a_bundle",
        }


def test_bundle_usage_errors_and_failures(digits: DigitsModels, tmp_path: Path) -> None:
    no_keys = _cli(BUNDLE, "verify", str(digits.onnx_path))
    assert no_keys.returncode == 2
    assert (
        _error_line(no_keys)
        == "Error: no trusted keys: pass --trusted-key PUB (or --allow-unsigned)"
    )
    key = tmp_path / "publisher.key"
    assert _cli(BUNDLE, "keygen", "--out", str(key)).returncode == 0
    again = _cli(BUNDLE, "keygen", "--out", str(key))
    assert again.returncode == 1
    assert _error_line(again) == (
        f"Error: {key.with_suffix('.pub')}: already exists; refusing to overwrite a key "
        "(use --force)"
    )
