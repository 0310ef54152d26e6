#!/usr/bin/env bash
# Builds what scripts/gpu-check.sh runs, here, for a GPU machine that has no Rust toolchain:
# kiln, kiln-bench, kiln-dump and the GPU test executables with `--features cuda`, stripped, in
# .gpu/bin (about 5 MB each; .gpu is added to .git/info/exclude). Carry `.gpu/bin` with the call;
# gpu-check.sh uses it when `cargo` is missing there. The binaries need glibc no newer than the
# GPU machine's (this project builds on Debian 12, glibc 2.36; the GPU image has Python 3.12 from
# a newer distribution).
#
#   scripts/gpu-pack.sh                 # .gpu/bin
#   scripts/gpu-pack.sh --split-model   # also the demo GGUF (98 MB, over one call's 64 MiB) in
#                                       # two halves, .gpu/model-1/part and .gpu/model-2/part, to
#                                       # carry in two calls while the machine stays warm (30 s);
#                                       # gpu-check.sh joins them and checks .gpu/model-2/sha256
#
# Test executables embed this checkout's paths (CARGO_MANIFEST_DIR, the target directory);
# manifest.env records them so gpu-check.sh can link them to the checkout on the GPU machine.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
OUTDIR=.gpu/bin
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qx '/.gpu/' "$exclude" 2>/dev/null || echo '/.gpu/' >>"$exclude"

tests=${KILN_GPU_TESTS:-$( (grep -l -E 'feature = "cuda"|backend::cuda' tests/*.rs || true) | xargs -r -n1 basename | sed 's/\.rs$//' | tr '\n' ' ')}
test_args=()
for t in $tests; do test_args+=(--test "$t"); done

cargo build -p kiln --release --features cuda --bins
cargo test -p kiln --release --features cuda --no-run --lib "${test_args[@]}" --message-format=json-render-diagnostics >/tmp/kiln-gpu-pack.json

rm -rf "$OUTDIR"
mkdir -p "$OUTDIR"
for b in kiln kiln-bench kiln-dump; do
    cp "$TARGET/release/$b" "$OUTDIR/$b"
done
# Test executables from cargo's JSON: test-<name>, and test-lib for the library's unit tests.
python3 - "$OUTDIR" /tmp/kiln-gpu-pack.json <<'EOF'
import json, shutil, sys
out = sys.argv[1]
for line in open(sys.argv[2]):
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") != "compiler-artifact" or not m.get("executable") or not m["profile"]["test"]:
        continue
    kind = m["target"]["kind"]
    name = "lib" if "lib" in kind else m["target"]["name"]
    shutil.copy(m["executable"], f"{out}/test-{name}")
    print(f"gpu-pack: test-{name} <- {m['executable']}", file=sys.stderr)
EOF
strip "$OUTDIR"/*
cat >"$OUTDIR/manifest.env" <<EOF
KILN_BUILD_ROOT=$ROOT
KILN_TARGET_DIR=$TARGET
KILN_PACKED_TESTS="$tests"
KILN_PACKED_FROM="$(git rev-parse --short HEAD)$(git diff --quiet || echo -dirty) on $(hostname), $(date -u +%FT%TZ)"
EOF

if [[ ${1:-} == --split-model ]]; then
    demo=models/SmolLM2-135M-Instruct.Q4_1.gguf
    [[ -f $demo ]] || scripts/fetch_demo_model.sh >/dev/null
    rm -rf .gpu/model-1 .gpu/model-2
    mkdir -p .gpu/model-1 .gpu/model-2
    half=$((($(stat -c %s "$demo") + 1) / 2))
    head -c "$half" "$demo" >.gpu/model-1/part
    tail -c +"$((half + 1))" "$demo" >.gpu/model-2/part
    sha256sum "$demo" >.gpu/model-2/sha256
    echo "gpu-pack: carry [\".gpu/bin\", \".gpu/model-1\"] in one call and [\".gpu/model-2\"] in the next" >&2
fi
du -sh .gpu/* >&2
echo "gpu-pack: carry [\".gpu/bin\"] with the run call; then scripts/gpu-check.sh uses it where cargo is missing" >&2
