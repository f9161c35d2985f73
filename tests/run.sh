#!/usr/bin/env bash
# The test command: installs what the tests need on a fresh Debian machine, then runs pytest.
#   bash tests/run.sh                 # whole suite
#   bash tests/run.sh -k bundle -x    # arguments go to pytest
# Installs Debian's mosquitto when missing, then .venv (or $MCP_VENV) with the project and its
# extras at the versions pinned in deploy/constraints.txt (deploy/setup-venv.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v mosquitto >/dev/null 2>&1 && [ ! -x /usr/sbin/mosquitto ]; then
  echo "tests/run.sh: installing Debian mosquitto" >&2
  SUDO=""
  [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends mosquitto >/dev/null
fi

bash deploy/setup-venv.sh
exec "${MCP_VENV:-.venv}/bin/python" -m pytest "$@"
