"""onnxruntime's OpenVINO execution provider, for real: tests/ovep run in .venv-ovep.

The ``onnxruntime-openvino`` distribution replaces ``onnxruntime`` (both are the ``onnxruntime``
module), so its tests run in their own environment, which ``tests/run.sh`` makes with
``deploy/setup-venv-ovep.sh``. Outside CI, a missing environment skips with that command; in CI
(``CI`` set) it fails instead, so the provider cannot silently go untested.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PYTHON = REPO / os.environ.get("MCP_OVEP_VENV", ".venv-ovep") / "bin" / "python"


@pytest.mark.timeout(300)
def test_openvino_execution_provider_suite_passes_in_its_environment() -> None:
    if not PYTHON.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{PYTHON} is missing: tests/run.sh should have made it")
        pytest.skip(f"{PYTHON} is missing; make it with `bash deploy/setup-venv-ovep.sh`")
    done = subprocess.run(
        [str(PYTHON), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", "tests/ovep"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    report = done.stdout[-4000:] + done.stderr[-2000:]
    assert done.returncode == 0, report
    # Every test ran: the provider was there, none skipped for want of it.
    assert " passed" in done.stdout and "skipped" not in done.stdout, report
