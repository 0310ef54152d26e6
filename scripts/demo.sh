#!/usr/bin/env bash
# The main job: fetch the demo model if missing, build kiln, and answer a chat prompt with it.
# Prints the answer as it streams, then prefill and decode tokens/s.
#   scripts/demo.sh ["your question" [extra kiln flags...]]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

model="$(scripts/fetch_demo_model.sh)"
echo "demo: building kiln (release) ..." >&2
cargo build --release --quiet --bin kiln
prompt="${1:-What is the capital of France?}"
shift || true
exec target/release/kiln -m "${model}" --chat -p "${prompt}" -n 128 "$@"
