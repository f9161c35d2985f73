#!/usr/bin/env bash
# The closed-loop fleet demo: Mosquitto, the control plane, three agents, 20 simulated devices
# and the retraining receiver on this machine, driven by the real CLIs: 1.0.0 in stages, 2.0.0
# as a canary, drift, a retraining trigger, 3.0.0 trained and rolled out (deploy/demo.py;
# docs/demo.md says what each step shows).
#   bash deploy/demo.sh                       # runs until Ctrl-C
#   bash deploy/demo.sh --smoke               # every step checked, then everything stopped
#   bash deploy/demo.sh --work-dir /tmp/demo  # default .cache/demo, wiped at start; --keep
#                                             # reuses the trained models and bundles
# Installs Debian's mosquitto (and mosquitto-clients, for the broker bootstrap) when missing,
# then .venv (or $MCP_VENV) with deploy/setup-venv.sh.
set -euo pipefail
cd "$(dirname "$0")/.."

have() { command -v "$1" >/dev/null 2>&1 || [ -x "/usr/sbin/$1" ]; }
if ! have mosquitto || ! have mosquitto_rr; then
  echo "demo.sh: installing Debian mosquitto and mosquitto-clients" >&2
  SUDO=""
  [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
    mosquitto mosquitto-clients >/dev/null
fi

bash deploy/setup-venv.sh
exec "${MCP_VENV:-.venv}/bin/python" deploy/demo.py "$@"
