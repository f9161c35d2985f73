#!/usr/bin/env bash
# The standalone quick start: install, make a real model, serve it with mcp-agent.
#   bash deploy/quickstart.sh            # serves on http://127.0.0.1:8000 until Ctrl-C
#   PORT=9000 bash deploy/quickstart.sh
#   bash deploy/quickstart.sh --smoke    # start, answer one request, stop (used by the tests)
set -euo pipefail
cd "$(dirname "$0")/.."

bash deploy/setup-venv.sh
VENV=${MCP_VENV:-.venv}
PORT=${PORT:-8000}
WORK=${MCP_QUICKSTART_DIR:-.cache/quickstart}

echo "quickstart: training the digits model and packing a signed bundle in $WORK" >&2
"$VENV/bin/python" deploy/demo_model.py "$WORK"

serve=("$VENV/bin/mcp-agent" serve --model-path "$WORK/digits-1.0.0.mcpb"
       --trust-key "$WORK/publisher.pub" --port "$PORT" --state-dir "$WORK/state")

cat >&2 <<TXT

Try, in another terminal:
  curl -s localhost:$PORT/v2/models/digits
  curl -s -H 'Content-Type: application/json' -d @$WORK/sample.json localhost:$PORT/v2/models/digits/infer
  curl -s localhost:$PORT/metrics | grep mcp_agent_requests_total

TXT

if [ "${1:-}" != "--smoke" ]; then
  exec "${serve[@]}"
fi

"${serve[@]}" &
pid=$!
trap 'kill $pid 2>/dev/null || true' EXIT
"$VENV/bin/python" - "$PORT" "$WORK/sample.json" <<'PY'
import json, sys, time, urllib.request
port, sample = sys.argv[1], sys.argv[2]
base = f"http://127.0.0.1:{port}"
deadline = time.monotonic() + 60
while True:
    try:
        urllib.request.urlopen(base + "/v2/health/ready", timeout=2)
        break
    except OSError:
        if time.monotonic() > deadline:
            sys.exit("quickstart: the agent did not become ready")
        time.sleep(0.1)
req = urllib.request.Request(base + "/v2/models/digits/infer", data=open(sample, "rb").read(),
                             headers={"Content-Type": "application/json"})
out = json.loads(urllib.request.urlopen(req, timeout=10).read())["outputs"][0]
rows = [out["data"][i * 10:(i + 1) * 10] for i in range(out["shape"][0])]
print("quickstart: digits answered", [r.index(max(r)) for r in rows])
PY
kill -TERM $pid
wait $pid
trap - EXIT
