"""An enrolled ``mcp-agent run`` against a test broker and a signed TUF repository on disk,
for tests that drive the agent through its desired-state topic (no control plane)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from mcp_edge.agent.identity import save_enrollment
from mcp_edge.shared.protocol.enrollment import BrokerCredentials, EnrollmentAnswer, TrustRoot
from mcp_edge.shared.protocol.wire import EnrollmentStatus
from mcp_edge.tooling.mosquitto import MosquittoBroker
from mcp_edge.tooling.processes import AGENT, REPO, free_port, process_env
from tests.support.tuf import SignedRepo


def launch_repo_agent(
    mosquitto: MosquittoBroker,
    tmp_path: Path,
    processes: list[subprocess.Popen[str]],
    device_id: str,
    extra_args: tuple[str, ...] = (),
) -> tuple[SignedRepo, str]:
    """Enroll ``device_id`` on disk (broker account = its id, the repository's root and
    director key as trust), start ``mcp-agent run`` with health and statistics intervals of an
    hour (its log in ``tmp_path/agent.log``), and return the repository and its base URL. The
    process goes into ``processes`` (the caller stops it); ``extra_args`` go on its command
    line."""
    repo = SignedRepo.create(tmp_path / "tuf")
    state = tmp_path / "agent"
    save_enrollment(state, "http://127.0.0.1:9", EnrollmentAnswer(
        status=EnrollmentStatus.ACCEPTED, device_id=device_id,
        broker=BrokerCredentials(urls=[f"mqtt://{mosquitto.host}:{mosquitto.port}"],
                                 username=device_id, password="unused", client_id=device_id),
        trust=TrustRoot(tuf_root=json.loads(repo.root_bytes()),
                        director_keys=[repo.director.public_key.raw.hex()]),
    ))  # fmt: skip
    port = free_port()
    with (tmp_path / "agent.log").open("w") as log:  # the agent's log, for when a test fails
        processes.append(subprocess.Popen(
            [*AGENT, "run", "--repo", repo.directory.as_uri(), "--port", str(port),
             "--state-dir", str(state), "--health-interval", "3600", "--stats-interval", "3600",
             *extra_args],
            stdout=subprocess.DEVNULL, stderr=log, text=True, cwd=REPO, env=process_env(),
        ))  # fmt: skip
    return repo, f"http://127.0.0.1:{port}"
