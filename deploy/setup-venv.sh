#!/usr/bin/env bash
# Create .venv (or $MCP_VENV) and install mcp-edge with every extra at the pinned versions.
# Sourced or run by tests/run.sh and deploy/quickstart.sh; re-installs only when
# pyproject.toml or deploy/constraints.txt changed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON=${PYTHON:-python3}
VENV=${MCP_VENV:-.venv}

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup-venv: creating $VENV" >&2
  "$PYTHON" -m venv "$VENV"
fi

stamp="$VENV/.mcp-edge-installed"
want=$(cat pyproject.toml deploy/constraints.txt | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup-venv: installing mcp-edge[test,dev,tflite,postgres,grpc,otel] into $VENV" >&2
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check \
    -c deploy/constraints.txt -e ".[test,dev,tflite,postgres,grpc,otel]"
  echo "$want" > "$stamp"
fi
