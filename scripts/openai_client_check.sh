#!/usr/bin/env bash
# Starts `kiln serve` on the demo model on a loopback port and drives it with the official
# `openai` Python client (scripts/openai_client_check.py). Needs target/release/kiln and
# `pip install -r scripts/requirements-server.txt`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
MODEL_FILE=${1:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
PORT=${KILN_TEST_PORT:-$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')}
KEY=check-key
target/release/kiln serve -m "$MODEL_FILE" --port "$PORT" --api-key "$KEY" --max-running 1 \
    --max-queue 0 --model-name demo -t 2 &
PID=$!
trap 'kill $PID 2>/dev/null || true' EXIT
for _ in $(seq 1 120); do
    if python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$PORT/health', timeout=1)" 2>/dev/null; then
        break
    fi
    sleep 0.5
done
python3 scripts/openai_client_check.py "http://127.0.0.1:$PORT/v1" demo "$KEY"
kill -TERM $PID
wait $PID
trap - EXIT
