"""tflite-runtime, for real: its tests under NumPy 1.

``tflite-runtime`` 2.14, the last release, is built against NumPy 1; under the NumPy 2 of
``.venv`` it imports but cannot run a model, so ``tests/unit/test_tflite_runtimes.py`` skips its
half there with that reason. ``tests/run.sh`` installs NumPy 1.26 into ``.cache/numpy1``; this
test runs the tflite-runtime cases with that overlay first on ``PYTHONPATH`` and requires every
one of them to run and pass. Outside CI a missing overlay skips; in CI (``CI`` set) it fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
OVERLAY = REPO / ".cache" / "numpy1"


@pytest.mark.timeout(300)
def test_tflite_runtime_cases_pass_under_numpy_1() -> None:
    if not (OVERLAY / "numpy").is_dir():
        if os.environ.get("CI"):
            pytest.fail(f"{OVERLAY} is missing: tests/run.sh should have made it")
        pytest.skip(f"{OVERLAY} is missing; `bash tests/run.sh` installs it")
    env = dict(os.environ, PYTHONPATH=str(OVERLAY))
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
         "tests/unit/test_tflite_runtimes.py", "-k", "tflite-runtime"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=280, check=False,
    )  # fmt: skip
    report = done.stdout[-4000:] + done.stderr[-2000:]
    assert done.returncode == 0, report
    assert " passed" in done.stdout and "skipped" not in done.stdout, report
    check = subprocess.run(
        [sys.executable, "-c", "import numpy; print(numpy.__version__)"],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert check.stdout.startswith("1."), check.stdout
