"""The enrollment an agent stores and reads back at every start, checked without pydantic."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mcp_edge.agent.identity import (
    BrokerAccess,
    IdentityError,
    StoredTrust,
    enrollment_path,
    load_enrollment,
    save_enrollment,
)
from mcp_edge.shared.protocol import (
    BrokerCredentials,
    EnrollmentAnswer,
    EnrollmentStatus,
    TrustRoot,
)

KEY = "ab" * 32
ANSWER = EnrollmentAnswer(
    status=EnrollmentStatus.ACCEPTED, device_id="cam-1",
    broker=BrokerCredentials(urls=["mqtt://broker:1883"], username="dev-cam-1",
                             password="s3cret-s3cret", client_id="cam-1"),
    trust=TrustRoot(tuf_root={"signed": {"_type": "root"}}, director_keys=[KEY],
                    publisher_keys=["cd" * 32]),
    message="welcome",
)  # fmt: skip


def test_what_enroll_stores_run_reads_back(tmp_path: Path) -> None:
    assert load_enrollment(tmp_path) is None
    save_enrollment(tmp_path, "http://cp:8080", ANSWER)
    stored = load_enrollment(tmp_path)
    assert stored is not None and stored.server == "http://cp:8080"
    answer = stored.answer
    assert answer.status is EnrollmentStatus.ACCEPTED and answer.device_id == "cam-1"
    assert answer.broker == BrokerAccess(("mqtt://broker:1883",), "dev-cam-1", "s3cret-s3cret",
                                         "cam-1")  # fmt: skip
    assert answer.trust == StoredTrust({"signed": {"_type": "root"}}, (KEY,), ("cd" * 32,))
    pending = EnrollmentAnswer(status=EnrollmentStatus.PENDING, device_id="cam-2")
    save_enrollment(tmp_path, "http://cp:8080", pending)
    again = load_enrollment(tmp_path)
    assert again is not None and again.answer.status is EnrollmentStatus.PENDING
    assert again.answer.broker is None and again.answer.trust is None


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"device_id": "../etc"}, "invalid device id"),
        ({"status": "approved"}, "not accepted or pending"),
        (
            {"broker": {"urls": [], "username": "u", "password": "p", "client_id": "c"}},
            "broker.urls",
        ),
        (
            {"broker": {"urls": ["mqtt://b"], "username": "u", "password": "", "client_id": "c"}},
            "password",
        ),
        (
            {
                "broker": {
                    "urls": ["mqtt://b"],
                    "username": "u",
                    "password": "p",
                    "client_id": "a b",
                }
            },
            "client id",
        ),
        ({"trust": {"director_keys": ["AB" * 32]}}, "director_keys"),
        ({"trust": {"director_keys": [KEY] * 17}}, "at most 16"),
        ({"trust": {"tuf_root": "root.json"}}, "tuf_root"),
    ],
)
def test_a_malformed_record_is_refused_with_the_field_named(
    tmp_path: Path, change: dict[str, Any], reason: str
) -> None:
    save_enrollment(tmp_path, "http://cp:8080", ANSWER)
    path = enrollment_path(tmp_path)
    doc = json.loads(path.read_text())
    doc["answer"].update(change)
    path.write_text(json.dumps(doc))
    with pytest.raises(IdentityError, match=reason):
        load_enrollment(tmp_path)


def test_a_record_others_can_read_or_that_is_not_json_is_refused(tmp_path: Path) -> None:
    save_enrollment(tmp_path, "http://cp:8080", ANSWER)
    path = enrollment_path(tmp_path)
    os.chmod(path, 0o644)
    with pytest.raises(IdentityError, match="readable by others"):
        load_enrollment(tmp_path)
    os.chmod(path, 0o600)
    path.write_text("[1, 2]")
    with pytest.raises(IdentityError, match="not a valid enrollment record"):
        load_enrollment(tmp_path)


def test_reading_the_enrollment_loads_no_pydantic(tmp_path: Path) -> None:
    save_enrollment(tmp_path, "http://cp:8080", ANSWER)
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from mcp_edge.agent.identity import load_enrollment\n"
        f"assert load_enrollment(Path({str(tmp_path)!r})).answer.device_id == 'cam-1'\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('pydantic', 'pydantic_core')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
