#!/usr/bin/env bash
# Create .venv-ovep (or $MCP_OVEP_VENV): an environment where the `onnxruntime` module is
# onnxruntime-openvino, the build with OpenVINOExecutionProvider (OpenVINO's libraries inside
# the wheel). That distribution provides the same `onnxruntime` module as the `onnxruntime`
# distribution of the main .venv, so the two cannot share an environment.
#
# Installs onnxruntime-openvino, the project's other runtime dependencies (pyproject.toml,
# less onnxruntime) and what tests/ovep needs, at the versions in deploy/constraints.txt, then
# the project itself with --no-deps, so pip never pulls the plain onnxruntime back in.
# Re-installs only when pyproject.toml, deploy/constraints.txt or this script changed.
#   bash deploy/setup-venv-ovep.sh && .venv-ovep/bin/python -m pytest -q tests/ovep
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON=${PYTHON:-python3}
VENV=${MCP_OVEP_VENV:-.venv-ovep}
# Pinned here rather than in deploy/constraints.txt: that file is the main environment's
# `pip freeze` (onnxruntime included), and this distribution replaces onnxruntime. sympy and
# mpmath are onnxruntime-openvino's own dependencies, which the main environment lacks.
ORT_OPENVINO="onnxruntime-openvino==1.24.1"
OVEP_PINS=("$ORT_OPENVINO" sympy==1.14.0 mpmath==1.3.0)
# What tests/ovep runs with besides the runtime dependencies (the digits model is trained
# with scikit-learn and converted with skl2onnx).
TEST_REQUIREMENTS=(pytest pytest-timeout pytest-asyncio scikit-learn skl2onnx)

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup-venv-ovep: creating $VENV" >&2
  "$PYTHON" -m venv "$VENV"
fi

stamp="$VENV/.mcp-edge-ovep-installed"
want=$(cat pyproject.toml deploy/constraints.txt "${BASH_SOURCE[0]}" | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup-venv-ovep: installing $ORT_OPENVINO and mcp-edge's dependencies into $VENV" >&2
  # The runtime dependencies from pyproject.toml, less the onnxruntime distribution.
  mapfile -t runtime < <("$VENV/bin/python" - <<'EOF'
import re
import sys

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

with open("pyproject.toml", "rb") as f:
    dependencies = tomllib.load(f)["project"]["dependencies"]
for requirement in dependencies:
    name = re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0]
    if name.lower().replace("_", "-") != "onnxruntime":
        print(requirement)
EOF
  )
  if [ "${#runtime[@]}" -eq 0 ]; then
    echo "setup-venv-ovep: no runtime dependencies read from pyproject.toml" >&2
    exit 1
  fi
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
  # A plain onnxruntime left over in the environment would shadow or break the OpenVINO build.
  if "$VENV/bin/python" -m pip show -q onnxruntime >/dev/null 2>&1; then
    "$VENV/bin/python" -m pip uninstall -q -y onnxruntime
  fi
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -c deploy/constraints.txt \
    "${OVEP_PINS[@]}" "${runtime[@]}" "${TEST_REQUIREMENTS[@]}"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps -e .
  if ! "$VENV/bin/python" -c 'import onnxruntime as o, sys; sys.exit("OpenVINOExecutionProvider" not in o.get_available_providers())'; then
    echo "setup-venv-ovep: onnxruntime in $VENV does not offer OpenVINOExecutionProvider" >&2
    exit 1
  fi
  echo "$want" > "$stamp"
fi
