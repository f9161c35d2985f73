"""``mcp-agent serve --processes 2`` as an operator runs it: real processes on one real port.

The primary and its worker bind the same HTTP (and gRPC) port with SO_REUSEPORT; the kernel
spreads fresh connections between them. Which process answered a request is read where an
operator would read it: with ``--access-log`` every request is logged, and a worker's log
lines name it (``mcp.agent.workers[worker 1]``); each request here carries a User-Agent of its
own, so its access-log line says who answered it. Every test sends enough fresh connections
that both processes answer some (2^-23 odds of one process taking all 24) and checks that they
did, so what is asserted of every answer is asserted of both processes.
"""

from __future__ import annotations

import contextlib
import http.client
import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mcp_edge.tooling.models import DigitsModels, train_digits_mlp, write_digits_onnx
from mcp_edge.tooling.processes import AGENT, REPO, free_port, process_env, wait_until

ENV = process_env()
PRIMARY = "primary"
WORKER = "worker 1"
BOTH = {PRIMARY, WORKER}
MANY = 24
"""Fresh connections per check: both processes answer some of them but for 2^-23 odds."""

_ACCESS = re.compile(r" INFO (?P<logger>[^:]+): .*\"(?P<agent>probe-[0-9]+)\"$")
_tokens = itertools.count()


# ---------------------------------------------------------------------------- the server
@dataclass
class Answer:
    status: int
    body: Any
    token: str
    """The request's User-Agent, which names it in the access log."""


@dataclass
class Server:
    """One ``mcp-agent serve --processes 2`` and the file its stderr (the log) goes to."""

    proc: subprocess.Popen[bytes]
    log: Path
    port: int
    grpc_port: int | None = None

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def workers(self) -> list[psutil.Process]:
        """The worker processes the primary started (its children running the worker)."""
        found = []
        for child in psutil.Process(self.proc.pid).children():
            with contextlib.suppress(psutil.NoSuchProcess):
                if "mcp_edge.agent.serving.worker" in " ".join(child.cmdline()):
                    found.append(child)
        return found

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        headers: dict[str, str] | None = None,
    ) -> Answer:
        """One request on a connection of its own, named by a User-Agent of its own."""
        token = f"probe-{next(_tokens)}"
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            data = None if body is None else json.dumps(body).encode()
            conn.request(method, path, body=data, headers={
                "User-Agent": token, "Content-Type": "application/json", **(headers or {}),
            })  # fmt: skip
            answer = conn.getresponse()
            raw = answer.read()
        finally:
            conn.close()
        ctype = answer.getheader("Content-Type") or ""
        parsed = json.loads(raw) if raw and "json" in ctype else raw.decode(errors="replace")
        return Answer(answer.status, parsed, token)

    def infer(self, row: np.ndarray, headers: dict[str, str] | None = None) -> Answer:
        return self.request("POST", "/v2/models/digits/infer", _body(row), headers)

    def served_by(self, answers: list[Answer]) -> dict[str, str]:
        """Which process answered each request (token -> ``primary`` / ``worker 1``), from the
        access log; each request must be logged exactly once."""
        wanted = {a.token for a in answers}
        found: dict[str, list[str]] = {}

        def logged() -> bool:
            found.clear()
            for line in self.log_text().splitlines():
                m = _ACCESS.search(line)
                if m and m["agent"] in wanted:
                    w = re.search(r"\[(worker \d+)\]$", m["logger"])
                    found.setdefault(m["agent"], []).append(w[1] if w else PRIMARY)
            return set(found) == wanted

        wait_until(logged, "every request in the access log")
        assert all(len(v) == 1 for v in found.values()), found
        return {k: v[0] for k, v in found.items()}


def _body(row: np.ndarray) -> dict[str, Any]:
    x = np.asarray(row, np.float32).reshape(1, 64)
    return {"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32",
                        "data": x.ravel().tolist()}]}  # fmt: skip


def _probabilities(answer: Answer) -> np.ndarray:
    out = next(o for o in answer.body["outputs"] if o["name"] == "probabilities")
    return np.asarray(out["data"], np.float32).reshape(out["shape"])


def _reference(model: Path) -> Callable[[np.ndarray], np.ndarray]:
    """onnxruntime on ``model``, in this process: what every answer must equal."""
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])

    def run(row: np.ndarray) -> np.ndarray:
        x = np.asarray(row, np.float32).reshape(1, 64)
        out: np.ndarray = session.run(["probabilities"], {"input": x})[0]
        return out

    return run


def _start(tmp: Path, *args: str) -> Server:
    """Start ``mcp-agent serve --processes 2`` and wait until both processes serve."""
    port = free_port()
    log = tmp / "serve.log"
    with log.open("ab") as err:
        proc = subprocess.Popen(
            [*AGENT, "serve", "--port", str(port), "--state-dir", str(tmp / "state"),
             "--log-level", "info", "--access-log", "--processes", "2", *args],
            stdout=subprocess.DEVNULL, stderr=err, cwd=REPO, env=ENV,
            start_new_session=True,  # its own process group: Ctrl-C is sent to it alone
        )  # fmt: skip
    server = Server(proc, log, port)

    def up() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"mcp-agent serve exited {proc.returncode}:\n{server.log_text()}")
        return "2 serving processes share these ports" in server.log_text()

    wait_until(up, "both serving processes", timeout_s=90)
    m = re.search(r"gRPC \(inference\.GRPCInferenceService\) on 127\.0\.0\.1:(\d+)",
                  server.log_text())  # fmt: skip
    server.grpc_port = int(m[1]) if m else None
    return server


@contextlib.contextmanager
def _serving(tmp: Path, *args: str) -> Iterator[Server]:
    server = _start(tmp, *args)
    try:
        yield server
    finally:
        if server.proc.poll() is None:
            server.proc.terminate()
            try:
                server.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.proc.kill()
                server.proc.wait(timeout=10)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(server.proc.pid, signal.SIGKILL)  # any worker left behind


class _Tail:
    """The lines a log file gained since the last read (whole lines only)."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset = path, 0

    def read(self) -> str:
        with self.path.open("rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        whole = chunk[: chunk.rfind(b"\n") + 1]
        self.offset += len(whole)
        return whole.decode(errors="replace")


def _assert_both(served: dict[str, str]) -> None:
    assert set(served.values()) == BOTH, f"answered only by {set(served.values())}"


# ---------------------------------------------------------------------------- models
@pytest.fixture(scope="module")
def next_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second digits MLP (another seed: other answers) as ``next/digits.onnx``."""
    out = tmp_path_factory.mktemp("next") / "digits.onnx"
    return write_digits_onnx(train_digits_mlp(seed=1).model, out)


@pytest.fixture(scope="module")
def canary_server(
    digits: DigitsModels, next_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """digits (version 1) with ``next_model`` as its canary (version 2) for all traffic, and
    gRPC on a port of its own choosing: shared by the tests that do not change it."""
    with _serving(
        tmp_path_factory.mktemp("canary-server"),
        "--model-path", str(digits.onnx_path), "--canary", f"{next_model}:1.0",
        "--grpc-port", "0",
    ) as server:  # fmt: skip
        yield server


def _metrics(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def _digits_requests(metrics: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> float:
    key = ("mcp_agent_requests_total", (("code", "200"), ("model", "digits"), ("protocol", "v2")))
    return metrics.get(key, 0.0)


def _inference_count(stats: dict[str, Any]) -> int:
    return sum(int(e["inference_count"]) for e in stats["model_stats"] if e["name"] == "digits")


def _from_both(server: Server, path: str) -> list[tuple[str, Answer]]:
    """GET ``path`` on fresh connections until both processes have answered it."""
    answers: list[Answer] = []
    for _ in range(10):
        answers.extend(server.request("GET", path) for _ in range(6))
        if set(server.served_by(answers).values()) == BOTH:
            break
    served = server.served_by(answers)
    _assert_both(served)
    return [(served[a.token], a) for a in answers]


# ---------------------------------------------------------------------------- one port, sums
def test_both_processes_answer_on_one_port_and_every_one_reports_the_sums(
    canary_server: Server, digits: DigitsModels
) -> None:
    server = canary_server
    before = server.request("GET", "/metrics").body
    stats_before = server.request("GET", "/v2/models/digits/stats").body
    answers = [server.infer(digits.X_test[i]) for i in range(MANY)]
    assert [a.status for a in answers] == [200] * MANY
    served = server.served_by(answers)
    _assert_both(served)

    # /metrics and the statistics are the whole server's, whichever process is asked.
    sent = _digits_requests(_metrics(before)) + MANY
    for who, answer in _from_both(server, "/metrics"):
        metrics = _metrics(answer.body)
        assert metrics[("mcp_agent_serving_processes", ())] == 2.0, who
        assert _digits_requests(metrics) == sent, who
    rows = _inference_count(stats_before) + MANY
    for who, answer in _from_both(server, "/v2/models/digits/stats"):
        assert answer.status == 200, who
        assert _inference_count(answer.body) == rows, who


# ---------------------------------------------------------------------------- canary
def test_a_canary_answers_from_every_process_and_pinning_works_on_each(
    canary_server: Server, digits: DigitsModels, next_model: Path
) -> None:
    server = canary_server
    stable, canary = _reference(digits.onnx_path), _reference(next_model)
    rows = [digits.X_test[i] for i in range(MANY)]

    routed = [server.infer(r) for r in rows]
    assert [(a.status, a.body["model_version"]) for a in routed] == [(200, "2")] * MANY
    for a, r in zip(routed, rows, strict=True):
        np.testing.assert_allclose(_probabilities(a), canary(r), atol=1e-5)
    _assert_both(server.served_by(routed))

    pinned = [server.infer(r, {"X-Model-Version": "1"}) for r in rows]
    assert [(a.status, a.body["model_version"]) for a in pinned] == [(200, "1")] * MANY
    for a, r in zip(pinned, rows, strict=True):
        np.testing.assert_allclose(_probabilities(a), stable(r), atol=1e-5)
    _assert_both(server.served_by(pinned))

    for who, meta in _from_both(server, "/v2/models/digits"):
        assert meta.body["parameters"]["canary"]["version"] == "2", who
        assert meta.body["parameters"]["canary"]["weight"] == 1.0, who


# ---------------------------------------------------------------------------- gRPC
def test_grpc_clients_are_answered_through_the_shared_port_and_statistics_sum(
    canary_server: Server, digits: DigitsModels, next_model: Path
) -> None:
    grpcclient = pytest.importorskip("tritonclient.grpc")
    server = canary_server
    assert server.grpc_port is not None
    canary = _reference(next_model)
    url = f"127.0.0.1:{server.grpc_port}"
    # A subchannel pool of its own per client: each client opens its own connection (gRPC
    # would otherwise share one between channels to the same address).
    clients = [
        grpcclient.InferenceServerClient(url, channel_args=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(MANY)
    ]
    try:

        def counted() -> int:
            stats = clients[0].get_inference_statistics("digits")
            return sum(s.inference_count for s in stats.model_stats)

        before = counted()
        for i, client in enumerate(clients):
            x = np.asarray(digits.X_test[i], np.float32).reshape(1, 64)
            inp = grpcclient.InferInput("input", [1, 64], "FP32")
            inp.set_data_from_numpy(x)
            result = client.infer("digits", [inp])
            assert result.get_response().model_version == "2"
            np.testing.assert_allclose(result.as_numpy("probabilities"), canary(x), atol=1e-5)

        # Both processes hold some of the clients' connections on the gRPC port (and each
        # client was answered on its own connection).
        holders = {}
        for who, proc in ((PRIMARY, psutil.Process(server.proc.pid)), (WORKER, *server.workers())):
            holders[who] = [
                c for c in proc.net_connections(kind="tcp")
                if c.laddr and c.laddr.port == server.grpc_port
                and c.status == psutil.CONN_ESTABLISHED
            ]  # fmt: skip
        assert all(holders.values()), {k: len(v) for k, v in holders.items()}
        # ModelStatistics, whichever process a client reaches, sums both.
        for client in clients:
            stats = client.get_inference_statistics("digits")
            assert sum(s.inference_count for s in stats.model_stats) == before + MANY
    finally:
        for client in clients:
            client.close()


# ---------------------------------------------------------------------------- hot swap
def test_a_replaced_model_file_is_swapped_in_every_process(
    digits: DigitsModels, next_model: Path, tmp_path: Path
) -> None:
    models = tmp_path / "models"
    models.mkdir()
    (models / "digits.onnx").write_bytes(digits.onnx_path.read_bytes())
    old, new = _reference(digits.onnx_path), _reference(next_model)
    rows = [digits.X_test[i] for i in range(MANY)]
    with _serving(tmp_path, "--model-path", str(models), "--watch-interval", "0.2") as server:
        first = [server.infer(r) for r in rows[:6]]
        assert [(a.status, a.body["model_version"]) for a in first] == [(200, "1")] * 6
        np.testing.assert_allclose(_probabilities(first[0]), old(rows[0]), atol=1e-5)

        # Written aside and renamed over, as deploy tools do; the watcher notices.
        (models / ".digits.onnx.new").write_bytes(next_model.read_bytes())
        os.replace(models / ".digits.onnx.new", models / "digits.onnx")
        # The primary logs a load once every process has committed it.
        wait_until(
            lambda: "mcp.agent.runtime: loaded digits 2 as stable" in server.log_text(),
            "the swap to version 2",
        )
        answers = [server.infer(r) for r in rows]
        assert [(a.status, a.body["model_version"]) for a in answers] == [(200, "2")] * MANY
        for a, r in zip(answers, rows, strict=True):
            np.testing.assert_allclose(_probabilities(a), new(r), atol=1e-5)
        _assert_both(server.served_by(answers))
        log = server.log_text()
        assert "mcp.agent.runtime: hot swap: digits 1 -> 2" in log
        assert "mcp.agent.runtime[worker 1]: hot swap: digits 1 -> 2" in log


# ---------------------------------------------------------------------------- explicit control
def test_explicit_unload_and_load_apply_to_every_process(
    digits: DigitsModels, tmp_path: Path
) -> None:
    models = tmp_path / "models"
    models.mkdir()
    (models / "digits.onnx").write_bytes(digits.onnx_path.read_bytes())
    expected = _reference(digits.onnx_path)
    rows = [digits.X_test[i] for i in range(MANY)]
    with _serving(tmp_path, "--model-path", str(models), "--model-control", "explicit") as server:
        control: list[Answer] = []
        # Until each process has taken one of the load/unload calls (a worker hands them to
        # the primary): what the call changed shows on every connection once it answered.
        for _ in range(8):
            unload = server.request("POST", "/v2/repository/models/digits/unload", {})
            assert unload.status == 200, unload.body
            gone = [server.infer(r) for r in rows]
            assert [a.status for a in gone] == [404] * MANY
            _assert_both(server.served_by(gone))

            load = server.request("POST", "/v2/repository/models/digits/load", {})
            assert load.status == 200, load.body
            back = [server.infer(r) for r in rows]
            assert [a.status for a in back] == [200] * MANY
            for a, r in zip(back, rows, strict=True):
                np.testing.assert_allclose(_probabilities(a), expected(r), atol=1e-5)
            _assert_both(server.served_by(back))
            control += [unload, load]
            if set(server.served_by(control).values()) == BOTH:
                break
        _assert_both(server.served_by(control))


# ---------------------------------------------------------------------------- a worker dies
def test_a_killed_worker_is_started_again_in_step_and_no_request_sees_it_loading(
    digits: DigitsModels, next_model: Path, tmp_path: Path
) -> None:
    canary = _reference(next_model)
    with _serving(
        tmp_path, "--model-path", str(digits.onnx_path), "--canary", f"{next_model}:1.0"
    ) as server:
        [worker] = server.workers()
        old_pid = worker.pid
        os.kill(old_pid, signal.SIGKILL)
        wait_until(
            lambda: (
                f"serving process 1 (pid {old_pid}) exited with code -9; starting another"
                in server.log_text()
            ),
            "the primary to see its worker die",
        )
        # From here on the old worker's socket is closed: every connection reaches a process
        # that serves, the primary alone until the new worker has the models (the canary
        # too) and binds the port beside it.
        restarted = re.compile(r"serving process 1 \(pid (\d+)\) is serving")
        new_lines = _Tail(server.log)
        deadline = time.monotonic() + 90
        back = False
        after: list[Answer] = []
        for i in itertools.count():
            assert time.monotonic() < deadline, "the worker was not started again"
            row = digits.X_test[i % len(digits.X_test)]
            answer = server.infer(row)
            assert (answer.status, answer.body.get("model_version")) == (200, "2"), answer.body
            np.testing.assert_allclose(_probabilities(answer), canary(row), atol=1e-5)
            if back:
                after.append(answer)
                if len(after) >= MANY:
                    break
            elif any(int(p) != old_pid for p in restarted.findall(new_lines.read())):
                back = True
        [new_worker] = server.workers()
        assert new_worker.pid != old_pid
        assert f"serving process 1 (pid {new_worker.pid}) is serving" in server.log_text()
        assert WORKER in server.served_by(after).values()
        metrics = _metrics(server.request("GET", "/metrics").body)
        assert metrics[("mcp_agent_serving_processes", ())] == 2.0


def test_a_version_is_the_file_as_it_was_loaded_even_in_a_worker_started_later(
    digits: DigitsModels, next_model: Path, tmp_path: Path
) -> None:
    """With explicit model control nothing reloads a rewritten file: a worker started again
    after the file changed must still serve version 1 as it was loaded, like the primary."""
    models = tmp_path / "models"
    models.mkdir()
    target = models / "digits.onnx"
    shutil.copyfile(digits.onnx_path, target)
    first = _reference(digits.onnx_path)
    with _serving(tmp_path, "--model-path", str(models), "--model-control", "explicit") as server:
        target.write_bytes(next_model.read_bytes())  # rewritten in place, not reloaded
        [worker] = server.workers()
        old_pid = worker.pid
        os.kill(old_pid, signal.SIGKILL)
        restarted = re.compile(r"serving process 1 \(pid (\d+)\) is serving")
        wait_until(
            lambda: any(int(p) != old_pid for p in restarted.findall(server.log_text())),
            "the worker started again",
            timeout_s=90,
        )
        answers = [server.infer(row) for row in digits.X_test[: MANY * 2]]
        for row, answer in zip(digits.X_test, answers, strict=False):
            assert (answer.status, answer.body["model_version"]) == (200, "1")
            np.testing.assert_allclose(_probabilities(answer), first(row), atol=1e-5)
        assert WORKER in server.served_by(answers).values()


# ---------------------------------------------------------------------------- stopping
@pytest.mark.parametrize("how", ["SIGTERM to the primary", "Ctrl-C to the process group"])
def test_stopping_the_primary_stops_every_worker(
    how: str, digits: DigitsModels, tmp_path: Path
) -> None:
    with _serving(tmp_path, "--model-path", str(digits.onnx_path)) as server:
        workers = server.workers()
        assert len(workers) == 1
        assert server.infer(digits.X_test[0]).status == 200
        if how.startswith("SIGTERM"):
            server.proc.send_signal(signal.SIGTERM)
        else:
            os.killpg(server.proc.pid, signal.SIGINT)
        assert server.proc.wait(timeout=60) == 0, server.log_text()
        # The primary waited for its workers: none is left, and the port is free.
        assert [w.pid for w in workers if psutil.pid_exists(w.pid)] == []
        with (
            pytest.raises(ConnectionRefusedError),
            socket.create_connection(("127.0.0.1", server.port), timeout=5),
        ):
            pass
        assert "shutting down: draining requests" in server.log_text()
