#!/usr/bin/env bash
# The test command: installs what the tests need on a fresh Debian machine, then runs pytest.
#   bash tests/run.sh                 # whole suite
#   bash tests/run.sh -k bundle -x    # arguments go to pytest
# Installs Debian's mosquitto when missing, makes .venv (or $MCP_VENV) and installs the project
# with its test extras from the pinned versions in deploy/constraints.txt.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${MCP_VENV:-.venv}

if ! command -v mosquitto >/dev/null 2>&1 && [ ! -x /usr/sbin/mosquitto ]; then
  echo "tests/run.sh: installing Debian mosquitto" >&2
  SUDO=""
  [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends mosquitto >/dev/null
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "tests/run.sh: creating $VENV" >&2
  "$PYTHON" -m venv "$VENV"
fi

# Reinstall only when the pinned set or the project metadata changed.
stamp="$VENV/.mcp-edge-installed"
want=$(cat pyproject.toml deploy/constraints.txt | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "tests/run.sh: installing mcp-edge[test,dev] into $VENV" >&2
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check \
    -c deploy/constraints.txt -e ".[test,dev,tflite,postgres]"
  echo "$want" > "$stamp"
fi

exec "$VENV/bin/python" -m pytest "$@"
