"""The distribution works as a user installs it: a wheel in a clean virtual environment."""

from __future__ import annotations

import subprocess
import sys
import venv
import zipfile
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
        check=True,
        capture_output=True,
        text=True,
    )
    wheels = list(dist.glob("mcp_edge-*.whl"))
    assert len(wheels) == 1, wheels
    with zipfile.ZipFile(wheels[0]) as wheel:
        tops = {name.split("/")[0] for name in wheel.namelist()}
    # One top-level import name; generic ones (agent, shared, ...) never land in site-packages.
    assert {t for t in tops if not t.endswith(".dist-info")} == {"mcp_edge"}, tops
    env_dir = work / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    subprocess.run(
        [
            str(env_dir / "bin" / "python"),
            "-m",
            "pip",
            "install",
            "-q",
            "--disable-pip-version-check",
            "-c",
            str(REPO / "deploy" / "constraints.txt"),
            str(wheels[0]),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    return env_dir


@pytest.fixture
def clashing_dir(tmp_path: Path) -> Path:
    """A working directory holding unrelated ``agent/`` and ``shared/`` packages, as a user's
    project might: imports of the generic names would pick these up."""
    for name in ("agent", "shared", "controlplane"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(
            f"raise ImportError('the unrelated {name} package was imported')\n"
        )
    return tmp_path


@pytest.mark.timeout(900)
def test_packages_import_and_profiles_load_from_the_wheel(
    installed_wheel: Path, clashing_dir: Path
) -> None:
    code = (
        "import mcp_edge.agent, mcp_edge.controlplane, mcp_edge.shared.bundle\n"
        "import mcp_edge.shared.protocol, mcp_edge.firmware_profiles\n"
        "from mcp_edge.shared.profiles import load_profiles\n"
        "print(mcp_edge.shared.__file__)\n"
        "print(','.join(load_profiles()))\n"
        # The application client's public path, and only that one.
        "from mcp_edge.client import InferenceClient, InferenceClientError\n"
        "import mcp_edge.client, importlib.util\n"
        "print(mcp_edge.client.__file__)\n"
        "print(importlib.util.find_spec('mcp_edge.shared.client'))\n"
        "from mcp_edge.shared.mqtt import MqttClient, Session\n"
        # The console's templates and static files are package data.
        "from mcp_edge.controlplane.ui import all_pages, core\n"
        "assert (core.TEMPLATES / 'base.html').is_file(), core.TEMPLATES\n"
        "assert (core.STATIC / 'app.js').is_file() and (core.STATIC / 'app.css').is_file()\n"
        "core.make_env().get_template('login.html')\n"
    )
    # Run from a directory whose own agent/ and shared/ would shadow generic names.
    out = subprocess.run(
        [str(installed_wheel / "bin" / "python"), "-c", code],
        cwd=clashing_dir,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.splitlines()
    assert "site-packages" in out[0]
    assert out[2].endswith("site-packages/mcp_edge/client/__init__.py"), out[2]
    assert out[3] == "None"  # shared/client is not also installed as mcp_edge.shared.client
    assert {
        "jetson-orin",
        "apple-silicon",
        "intel-xeon",
        "generic-x86_64",
        "generic-arm64",
        "raspberry-pi",
    } <= set(out[1].split(","))


@pytest.mark.timeout(900)
@pytest.mark.parametrize("script", ["mcp-bundle", "mcp-agent", "mcp-controlplane"])
def test_console_scripts_answer_help(
    installed_wheel: Path, clashing_dir: Path, script: str
) -> None:
    result = subprocess.run(
        [str(installed_wheel / "bin" / script), "--help"],
        cwd=clashing_dir,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert "Usage:" in result.stdout
