#!/usr/bin/env bash
# The test command: installs what the tests need on a fresh Debian machine, then runs pytest.
#   bash tests/run.sh                 # whole suite
#   bash tests/run.sh -k bundle -x    # arguments go to pytest
# Installs Debian's mosquitto, chromium, systemd (systemd-analyze) and prometheus (promtool) when
# missing, axe-core (npm) into .cache/axe, then
# .venv (or $MCP_VENV) with the project and its extras at the versions pinned in
# deploy/constraints.txt (deploy/setup-venv.sh), and .venv-ovep with onnxruntime-openvino
# (deploy/setup-venv-ovep.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

# apt_install PACKAGE WHY: install a Debian package (through sudo unless root).
apt_install() {
  echo "tests/run.sh: installing Debian $1 ($2)" >&2
  local sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "$1" >/dev/null
}

if ! command -v mosquitto >/dev/null 2>&1 && [ ! -x /usr/sbin/mosquitto ]; then
  apt_install mosquitto "the broker the integration tests run"
fi
# systemd-analyze checks the systemd units under deploy/systemd (verify, security --offline).
if ! command -v systemd-analyze >/dev/null 2>&1; then
  apt_install systemd "tests/integration/test_deploy_files.py runs systemd-analyze"
fi
# promtool checks the Prometheus alert rules under deploy/observability.
if ! command -v promtool >/dev/null 2>&1; then
  apt_install prometheus "tests/integration/test_observability_files.py runs promtool"
fi
if [ ! -x /usr/bin/chromium ]; then
  apt_install chromium "the browser tests in tests/ui/ drive it"
fi
# axe-core, the accessibility checker tests/ui/test_console_a11y.py injects into each page.
if [ ! -f .cache/axe/node_modules/axe-core/axe.min.js ]; then
  command -v npm >/dev/null 2>&1 || apt_install npm "to fetch axe-core"
  echo "tests/run.sh: fetching axe-core into .cache/axe" >&2
  npm install --no-audit --no-fund --silent --prefix .cache/axe axe-core@4 >/dev/null
fi

bash deploy/setup-venv.sh
# .venv-ovep: onnxruntime-openvino (OpenVINOExecutionProvider) cannot share the main venv;
# tests/integration/test_ovep_env.py runs tests/ovep in it.
bash deploy/setup-venv-ovep.sh
# tflite-runtime 2.14 (its last release) is built against NumPy 1 and cannot run under the
# NumPy 2 of .venv: tests/integration/test_tflite_runtime_numpy1.py runs its tests with this
# NumPy 1 overlay on PYTHONPATH.
numpy1=.cache/numpy1
if [ "$(cat "$numpy1/.stamp" 2>/dev/null)" != "numpy==1.26.4" ]; then
  echo "tests/run.sh: installing numpy 1.26.4 into $numpy1 (for tflite-runtime)" >&2
  rm -rf "$numpy1"
  "${MCP_VENV:-.venv}/bin/python" -m pip install -q --disable-pip-version-check --no-deps \
    --target "$numpy1" numpy==1.26.4
  echo "numpy==1.26.4" > "$numpy1/.stamp"
fi
exec "${MCP_VENV:-.venv}/bin/python" -m pytest "$@"
