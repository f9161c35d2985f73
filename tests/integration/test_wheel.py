"""The distribution works as a user installs it: a wheel in a clean virtual environment."""

from __future__ import annotations

import subprocess
import sys
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def installed_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Build the wheel and install it (with its pinned dependencies) into a fresh venv."""
    work = tmp_path_factory.mktemp("wheel")
    dist = work / "dist"
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--outdir", str(dist), str(REPO)],
        check=True, capture_output=True, text=True,
    )
    wheels = list(dist.glob("mcp_edge-*.whl"))
    assert len(wheels) == 1, wheels
    env_dir = work / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    subprocess.run(
        [str(env_dir / "bin" / "python"), "-m", "pip", "install", "-q",
         "--disable-pip-version-check", "-c", str(REPO / "deploy" / "constraints.txt"),
         str(wheels[0])],
        check=True, capture_output=True, text=True,
    )
    return env_dir


@pytest.mark.timeout(900)
def test_packages_import_and_profiles_load_from_the_wheel(installed_wheel: Path, tmp_path: Path) -> None:
    code = (
        "import shared, agent, controlplane, firmware_profiles, shared.bundle, shared.protocol\n"
        "from shared.profiles import load_profiles\n"
        "print(shared.__file__)\n"
        "print(','.join(load_profiles()))\n"
    )
    # Run from an empty directory so the checkout cannot shadow the installed packages.
    out = subprocess.run(
        [str(installed_wheel / "bin" / "python"), "-c", code],
        cwd=tmp_path, check=True, capture_output=True, text=True,
    ).stdout.splitlines()
    assert "site-packages" in out[0]
    assert {"jetson-orin", "apple-silicon", "intel-xeon", "generic-x86_64", "generic-arm64",
            "raspberry-pi"} <= set(out[1].split(","))


@pytest.mark.timeout(900)
@pytest.mark.parametrize("script", ["mcp-bundle", "mcp-agent", "mcp-controlplane"])
def test_console_scripts_answer_help(installed_wheel: Path, tmp_path: Path, script: str) -> None:
    result = subprocess.run(
        [str(installed_wheel / "bin" / script), "--help"],
        cwd=tmp_path, capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stderr
    assert "Usage:" in result.stdout
