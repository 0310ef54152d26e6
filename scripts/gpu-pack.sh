#!/usr/bin/env bash
# Builds what scripts/gpu-check.sh runs, here, for a GPU machine that has no Rust toolchain and no
# network: kiln, kiln-bench and the GPU test executables with `--features cuda`, stripped, in
# .gpu/bin (about 60 MB), and the same packed as one archive, .gpu/pack/kiln-gpu-bin.tar.xz
# (about 10 MB), which is what to send. gpu-check.sh unpacks it there (xz, or python3's
# tarfile/lzma) when `cargo` is missing. .gpu is added to .git/info/exclude. The binaries need a
# glibc no newer than the GPU machine's (this project builds on Debian 12, glibc 2.36).
#
#   scripts/gpu-pack.sh                 # .gpu/bin and .gpu/pack
#   scripts/gpu-pack.sh --split-model   # also the demo GGUF (98 MB) cut into .gpu/model-1 …
#                                       # .gpu/model-N, for when one transfer cannot carry it
#                                       # with the checkout and the archive; send .gpu/pack with
#                                       # .gpu/model-1 and one part with each later transfer
#                                       # while the machine stays up: gpu-check.sh keeps the
#                                       # parts outside the checkout, joins them once all N are
#                                       # there, and checks the sha256
#
# Kernels, compiled here ahead: the per-op sources and the decode megakernels (buckets 1, 2, 4,
# 8) of every fixture model and of the synthetic shapes (KILN_GPU_PACK_SHAPES, default
# llama-3.2-1b,smollm2-135m), once per megakernel variant in KILN_GPU_PACK_VARIANTS (default
# "default"; the names gpu-check.sh's KILN_GPU_MK_ROWS takes), for sm_$KILN_GPU_ARCH (default 90)
# with NVRTC 13.0 (the CUDA 13.0 toolkit's version, which the GPU machine loads; installed from
# PyPI into .ci/nvrtc-13.0 when missing), by `kiln-bench --precompile-cuda`, into the archive's
# cache/kiln. KILN_GPU_PACK_VARIANTS=none packs no kernels.
#
# KILN_GPU_CARRY_MIB (default 64) is the most one transfer may carry: the checkout's tracked
# files, plus the archive in the first, plus one part. KILN_GPU_TESTS names the test files to
# pack (default: those the GPU machine runs: gpu, gpu_engine, megakernel, bench).
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

tests=${KILN_GPU_TESTS:-gpu gpu_engine megakernel bench}
test_args=()
for t in $tests; do test_args+=(--test "$t"); done

cargo build -p kiln --release --features cuda --bins
cargo test -p kiln --release --features cuda --no-run --lib "${test_args[@]}" --message-format=json-render-diagnostics >/tmp/kiln-gpu-pack.json

rm -rf "$OUTDIR" .gpu/pack
mkdir -p "$OUTDIR" .gpu/pack
for b in kiln kiln-bench; do
    cp "$TARGET/release/$b" "$OUTDIR/$b"
done
# Test executables from cargo's JSON: test-<name>, and test-lib for the library's unit tests.
python3 scripts/test_executables.py /tmp/kiln-gpu-pack.json | while read -r name exe; do
    cp "$exe" "$OUTDIR/$name"
    echo "gpu-pack: $name <- $exe" >&2
done
strip "$OUTDIR"/*
cat >"$OUTDIR/manifest.env" <<MANIFEST
KILN_BUILD_ROOT=$ROOT
KILN_TARGET_DIR=$TARGET
KILN_PACKED_TESTS="$tests"
KILN_PACKED_FROM="$(git rev-parse --short HEAD)$(git diff --quiet || echo -dirty) on $(hostname), $(date -u +%FT%TZ)"
MANIFEST
# Cached kernels stay between packs (an entry of an older source is never looked up, and
# skipping what is there makes a re-pack cheap); KILN_GPU_PACK_FRESH=1 starts the cache over.
[[ -n ${KILN_GPU_PACK_FRESH:-} ]] && rm -rf .gpu/cache
variants=${KILN_GPU_PACK_VARIANTS:-default}
if [[ $variants != none ]]; then
    nv=.ci/nvrtc-13.0
    [[ -f $nv/nvidia/cu13/include/cuda_bf16.h ]] ||
        python3 -m pip install --quiet --no-deps --target "$nv" -r scripts/requirements-nvrtc-13.0.txt
    : >/tmp/kiln-gpu-pack-kernels.log
    models=()
    for m in tests/fixtures/*; do
        [[ -f $m/config.json || $m == *.gguf ]] && models+=(-m "$m")
    done
    for v in $variants; do
        mapfile -t envs < <(scripts/mk-variant.sh "$v")
        # One model per process, two at a time (a model the megakernel does not lower, or one
        # that does not load, is reported and skipped).
        printf '%s\0' "${models[@]}" "--synthetic" "${KILN_GPU_PACK_SHAPES:-llama-3.2-1b,smollm2-135m}" |
            xargs -0 -n 2 -P "$(nproc)" env "${envs[@]}" XDG_CACHE_HOME="$ROOT/.gpu/cache" \
                KILN_NVRTC_DIR="$ROOT/$nv" LD_LIBRARY_PATH="$ROOT/$nv/nvidia/cu13/lib" \
                "$TARGET/release/kiln-bench" --precompile-cuda "${KILN_GPU_ARCH:-90}" --batch 1,2,4,8 \
                >>/tmp/kiln-gpu-pack-kernels.log 2>&1 || true
        echo "gpu-pack: kernels for variant $v: $(find .gpu/cache -name '*.cubin' | wc -l) cubins so far" >&2
    done
    grep -i error /tmp/kiln-gpu-pack-kernels.log >&2 || true
fi
tar -C .gpu -cf - bin $([[ -d .gpu/cache ]] && echo cache) | xz -T0 -6 >.gpu/pack/kiln-gpu-bin.tar.xz

if [[ ${1:-} == --split-model ]]; then
    demo=models/SmolLM2-135M-Instruct.Q4_1.gguf
    [[ -f $demo ]] || scripts/fetch_demo_model.sh >/dev/null
    limit=$((${KILN_GPU_CARRY_MIB:-64} * 1024 * 1024))
    tracked=$(git ls-files -z | xargs -0 stat -c %s | awk '{s += $1} END {print s}')
    margin=$((2 * 1024 * 1024))
    first=$((limit - tracked - $(stat -c %s .gpu/pack/kiln-gpu-bin.tar.xz) - margin))
    rest=$((limit - tracked - margin))
    ((first > 0 && rest > 0)) || { echo "gpu-pack: the checkout ($tracked bytes) leaves no room for a model part" >&2; exit 1; }
    rm -rf .gpu/model-*
    size=$(stat -c %s "$demo") off=0 i=0
    while ((off < size)); do
        i=$((i + 1))
        len=$rest
        ((i == 1)) && len=$first
        mkdir -p ".gpu/model-$i"
        dd if="$demo" of=".gpu/model-$i/part" bs=1M iflag=skip_bytes,count_bytes skip="$off" count="$len" status=none
        off=$((off + len))
    done
    (cd "$(dirname "$demo")" && sha256sum "$(basename "$demo")") >.gpu/model-1/sha256
    echo "$i" >.gpu/model-1/count
    for ((j = 2; j <= i; j++)); do cp .gpu/model-1/sha256 .gpu/model-1/count ".gpu/model-$j/"; done
    echo "gpu-pack: the demo model in $i parts: send [\".gpu/pack\", \".gpu/model-1\"] first, then .gpu/model-2 … in later transfers" >&2
fi
du -sh .gpu/* >&2
echo "gpu-pack: send .gpu/pack with the run; scripts/gpu-check.sh unpacks it where cargo is missing" >&2
