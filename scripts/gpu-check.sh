#!/usr/bin/env bash
# One command for a GPU machine: run every GPU test, check kiln on the GPU against the CPU,
# measure the device's copy bandwidth, benchmark decode on both GPU paths at every batch bucket,
# run compute-sanitizer on a few steps, time PyTorch on the same models, and print a short table.
# Stages that would start after KILN_GPU_CHECK_BUDGET seconds (default 540) are skipped and
# recorded as such, so the table always prints.
#
#   scripts/gpu-check.sh                      # every stage; logs in $KILN_GPU_WORK (default
#                                             # /tmp/kiln-gpu-check); with KILN_GPU_OUT set
#                                             # (a directory to collect results in), also
#                                             # summary.md and gpu-check-logs.tgz there
#   KILN_GPU_STAGES=env,tests scripts/gpu-check.sh   # only some stages (names below)
#   scripts/gpu-check.sh --stash-only         # only keep what this transfer carried (below)
#
# Binaries. With cargo on the machine it builds (`--features cuda`). Without it (a GPU machine
# with no Rust toolchain) it uses what scripts/gpu-pack.sh built elsewhere: the archive
# .gpu/pack/kiln-gpu-bin.tar.xz (unpacked with xz, or python3's tarfile/lzma where xz is
# missing) or an unpacked .gpu/bin.
#
# The demo model, when one transfer cannot carry it: scripts/gpu-pack.sh --split-model cuts it
# into .gpu/model-1 … .gpu/model-N, one per transfer. Every run (and `--stash-only`, which does
# nothing else) copies the archive and any carried parts to $KILN_GPU_STASH (default
# /tmp/kiln-gpu-stash, outside the checkout, so a later transfer that replaces the checkout keeps
# them); once all N parts are there they are joined into models/ and checked against the sha256.
#
# Kernels: gpu-pack.sh also compiles the per-op sources and the megakernels of the fixtures and
# the synthetic shapes for sm_90 with NVRTC 13.0 (the GPU machine's toolkit version) into the
# archive's cache/kiln; unless XDG_CACHE_HOME is set, the binaries read that cache, and compile
# only what it misses (the closing line counts those).
#
# Stages (KILN_GPU_STAGES, comma-separated, run in the order given; default all, in the order
# below, cmds only when KILN_GPU_CMDS is set). Each stage's output is in WORK/<stage>.log; a
# failure is recorded and the next stage runs:
#  env        the device, driver, toolkit, NVRTC found, tools, and a 4-token smoke run per path
#             (KILN_GPU_NO_SMOKE=1 leaves the smoke runs out).
#  tests      every test function of every test file that uses the CUDA backend (tests/*.rs
#             naming `backend::cuda` or `feature = "cuda"`) and the library's `cuda` unit tests,
#             one process per test function under its own time limit (a hang costs one test).
#             KILN_GPU_TEST_FILTER (a grep -E pattern on "file::test") narrows them and
#             KILN_GPU_TEST_SKIP (default: the all-fixture megakernel NVRTC gate) leaves some out.
#             KILN_GPU_TEST_VARIANTS (default "default") runs them once per megakernel variant
#             (the names of KILN_GPU_MK_ROWS below; stage names then carry "[variant]"), each
#             after a stage kernels[variant] that compiles the variant's fixture megakernels on
#             all cores (those the pack did not carry).
#  demo       with the demo model present: the demo-model tests (filter `smollm2`) and its
#             `correct` rows (for a run that only then has the model).
#  bandwidth  a device-to-device copy of 1 GiB, bytes read + written, median of 20 event-timed
#             copies (kiln-bench --measure-gpu-bandwidth; torch's copy_ as a cross-check).
#  correct    `kiln --device cuda --decode per-op|megakernel` greedy ids against
#             `kiln --device cpu --weights bf16 --kv-type bf16` on the same prompt (and 3 greedy
#             samples at once, which must each equal the batch-1 result), on fixture models.
#  bench      kiln-bench --device cuda --decode megakernel|per-op, tg$KILN_BENCH_N (128) at batch
#             $KILN_BATCHES (1,2,4,8), -r $KILN_BENCH_REPS (5), for KILN_GPU_BENCH_MODELS (default:
#             the synthetic Llama-3.2-1B and SmolLM2-135M shapes, the demo GGUF when present, a
#             CPU row); the megakernel once per KILN_GPU_MK_ROWS value ("default", matvec rows
#             per tile, "nostage": no shared-memory weight staging, or "split": small tiles'
#             rows split across warps, or "preload": arguments loaded before the wait; e.g.
#             "default 16 nostage split preload"; see scripts/mk-variant.sh), each kiln-bench
#             under KILN_GPU_BENCH_LIMIT seconds (default 240).
#  ncu        Nsight Compute: one megakernel step (speed of light, occupancy, warp stalls) and
#             the per-op path's kernel times over about one step; with KILN_GPU_NCU_SYNTHETIC
#             (a shape) one batch-1 megakernel step of that shape instead, under the variant
#             KILN_GPU_NCU_VARIANT.
#  sanitize   compute-sanitizer memcheck on a few per-op and megakernel steps, racecheck and
#             synccheck on the megakernel (a fixture model, few tokens), and racecheck on each
#             other KILN_GPU_TEST_VARIANTS value.
#  torch      scripts/torch_compare.py on the same shapes (transformers StaticCache +
#             torch.compile reduce-overhead CUDA graphs) at KILN_TORCH_BATCHES (default 1).
#  cmds       each line of the file KILN_GPU_CMDS ("LABEL COMMAND"; blank lines and # comments
#             skipped) as a stage of its own named cmd:LABEL: COMMAND runs under bash in the
#             checkout, with $KILN and $BENCH set and the pack's kernel cache, under
#             KILN_GPU_CMD_LIMIT seconds (default 120). For the measurements the other stages do
#             not make (a KILN_TRACE_CUDA run, one variant's bench:
#             `fuse env $(scripts/mk-variant.sh fuse) "$BENCH" --synthetic … --device cuda …`).
# Then the stage table, the bandwidths, and per kiln row: t/s, ms/token, % of bandwidth,
# PyTorch's t/s on the same model and batch, and the ratio (scripts/gpu_report.py).
#
# Method (docs/gpu-method.md): device time after a warm-up, the median of repeated runs, random
# non-zero weights, and a measured device-to-device copy (bytes read + bytes written) as the
# bandwidth ceiling.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
WORK=${KILN_GPU_WORK:-/tmp/kiln-gpu-check}
STASH=${KILN_GPU_STASH:-/tmp/kiln-gpu-stash}
BUDGET=${KILN_GPU_CHECK_BUDGET:-540}
TEST_LIMIT=${KILN_GPU_TEST_LIMIT:-120}
BENCH_LIMIT=${KILN_GPU_BENCH_LIMIT:-240}
# Tests that need no GPU and take minutes of NVRTC (CI runs them): skipped unless asked for.
TEST_SKIP=${KILN_GPU_TEST_SKIP-generated_megakernel_compiles_for_sm90_and_sm80}
N_GEN=${KILN_BENCH_N:-128}
REPS=${KILN_BENCH_REPS:-5}
# Matvec rows per megakernel tile to bench (KILN_MK_MATVEC_ROWS); "default" is the built-in size,
# "nostage" the built-in size without the weight staging (KILN_MK_STAGE=0), "split" with small
# tiles' rows split across warps (KILN_MK_SPLIT=1), "preload" with tile arguments loaded before
# the wait (KILN_MK_PRELOAD=1); scripts/mk-variant.sh maps the names, and '+' combines them
# (split+4).
MK_ROWS=${KILN_GPU_MK_ROWS:-default}
# Synthetic shape names, smollm2-gguf (the demo model, when present) and cpu (a CPU row).
BENCH_MODELS=${KILN_GPU_BENCH_MODELS:-llama-3.2-1b smollm2-135m smollm2-gguf cpu}
BATCHES=${KILN_BATCHES:-1,2,4,8}
TORCH_BATCHES=${KILN_TORCH_BATCHES:-1}
# cmds joins the default list only when KILN_GPU_CMDS names its file (else it is a skipped row).
STAGES=${KILN_GPU_STAGES:-env,tests,demo,bandwidth,correct,ncu,bench,sanitize,torch${KILN_GPU_CMDS:+,cmds}}
DEMO=models/SmolLM2-135M-Instruct.Q4_1.gguf
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 RUST_BACKTRACE=1 PY
mkdir -p "$STASH"

want() { [[ ",$STAGES," == *",$1,"* ]]; }
# Stages that run the decode megakernel (directly, through a CUDA graph, or through the engine);
# after one of them times out, the rest of the same megakernel variant (CUR_VARIANT) are skipped
# and say why.
MK_PATTERN=${KILN_GPU_MK_PATTERN:-megakernel|graph|gpu_engine}
declare -A MK_HUNG=()
CUR_VARIANT=default

# --- what this transfer carried: the binary archive and model parts go to the stash ---------
if [[ -f .gpu/pack/kiln-gpu-bin.tar.xz ]]; then
    cmp -s .gpu/pack/kiln-gpu-bin.tar.xz "$STASH/kiln-gpu-bin.tar.xz" ||
        { cp .gpu/pack/kiln-gpu-bin.tar.xz "$STASH/" && rm -rf "$STASH/bin" "$STASH/cache"; }
fi
for d in .gpu/model-*; do
    [[ -f $d/part ]] || continue
    cp "$d/part" "$STASH/${d#.gpu/}.part"
    [[ -f $d/sha256 ]] && cp "$d/sha256" "$STASH/model.sha256"
    [[ -f $d/count ]] && cp "$d/count" "$STASH/model.count"
    echo "stash: ${d#.gpu/} ($(stat -c %s "$d/part") bytes)"
done
if [[ -f $STASH/kiln-gpu-bin.tar.xz && ! -d $STASH/bin ]]; then
    if command -v xz >/dev/null; then
        xz -dc "$STASH/kiln-gpu-bin.tar.xz" | tar -x -C "$STASH"
    else
        "$PY" -c 'import sys, tarfile; tarfile.open(sys.argv[1], "r:xz").extractall(sys.argv[2])' \
            "$STASH/kiln-gpu-bin.tar.xz" "$STASH"
    fi && echo "stash: unpacked $(ls "$STASH/bin" | wc -l) files into $STASH/bin"
fi
if [[ ! -f $DEMO && -f $STASH/model.count && -f $STASH/model.sha256 ]]; then
    n=$(cat "$STASH/model.count")
    parts=()
    for ((i = 1; i <= n; i++)); do parts+=("$STASH/model-$i.part"); done
    if ls "${parts[@]}" >/dev/null 2>&1; then
        mkdir -p models
        cat "${parts[@]}" >"$DEMO"
        (cd "$(dirname "$DEMO")" && sha256sum -c --quiet "$STASH/model.sha256") || {
            echo "stash: the joined demo model fails its sha256; removed"
            rm -f "$DEMO"
        }
    else
        echo "stash: demo model parts so far: $(ls "$STASH"/model-*.part 2>/dev/null | wc -l) of $n"
    fi
fi
# Kernels gpu-pack.sh compiled ahead (the archive's cache/kiln): the binaries look them up there
# (the cache key is the source's hash, the architecture and NVRTC's version; a miss compiles).
if [[ -d $STASH/cache/kiln && -z ${XDG_CACHE_HOME:-} ]]; then
    export XDG_CACHE_HOME=$STASH/cache
    echo "kernel cache: $(find "$STASH/cache/kiln" -name '*.cubin' | wc -l) cubins from the pack"
fi
[[ ${1:-} == --stash-only ]] && exit 0

rm -rf "$WORK"
mkdir -p "$WORK"
: >"$WORK/stages.tsv"
touch "$WORK/started"

# stage NAME LIMIT [--stdout FILE] CMD...: runs CMD (an executable; use `bash -c` for more) with
# stdout+stderr in WORK/NAME.log (stdout in FILE when given), under `timeout` (LIMIT seconds,
# less if the budget is nearly spent); records pass / FAIL and the time; returns CMD's success.
stage() {
    local name=$1 limit=$2
    shift 2
    local stdout=""
    if [[ ${1:-} == --stdout ]]; then
        stdout=$2
        shift 2
    fi
    local hung=${MK_HUNG[$CUR_VARIANT]:-}
    if [[ -n $hung && $name =~ $MK_PATTERN ]]; then
        printf '%s\tskipped: %s timed out earlier\t0\n' "$name" "$hung" >>"$WORK/stages.tsv"
        echo "== $name: skipped ($hung timed out earlier)"
        return 1
    fi
    local left=$((BUDGET - SECONDS))
    if ((left < 15)); then
        printf '%s\tskipped: time budget spent\t0\n' "$name" >>"$WORK/stages.tsv"
        echo "== $name: skipped (time budget spent)"
        return 1
    fi
    ((limit > left)) && limit=$left
    echo "== $name"
    local log="$WORK/${name//[:\/]/_}.log" t0=$SECONDS rc=0
    if [[ -n $stdout ]]; then
        timeout --kill-after=10 "$limit" "$@" >"$stdout" 2>"$log" || rc=$?
    else
        timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1 || rc=$?
    fi
    local dt=$((SECONDS - t0)) res
    if ((rc == 0)); then
        res=pass
    elif ((rc == 124 || rc == 137)); then
        res="FAIL: timed out after $limit s"
        # A decode megakernel that never finishes would hang every later stage that runs one.
        [[ $name =~ $MK_PATTERN ]] && MK_HUNG[$CUR_VARIANT]=$name
    else
        # The first error line says more than clap's or cargo's closing line.
        local why
        why=$(grep -m1 -E '^error|panicked|Error:|ERROR' "$log" || grep -v '^[[:space:]]*$' "$log" | tail -1 || true)
        res="FAIL (exit $rc): $(echo "$why" | cut -c1-300)"
    fi
    printf '%s\t%s\t%s\n' "$name" "$res" "$dt" >>"$WORK/stages.tsv"
    echo "   $res ($dt s)"
    grep -E "SKIPPED|GPU:|rel err|bandwidth|identical|diverges|ERROR SUMMARY|tokens/s" "$log" 2>/dev/null | head -8 | sed 's/^/   /' || true
    [[ $res == pass ]]
}

finish() {
    echo
    if [[ -n ${XDG_CACHE_HOME:-} && -d $XDG_CACHE_HOME/kiln ]]; then
        echo "kernel cache: $(find "$XDG_CACHE_HOME/kiln" -name '*.cubin' | wc -l) cubins in $XDG_CACHE_HOME/kiln at the end" \
            "($(find "$XDG_CACHE_HOME/kiln" -name '*.cubin' -newer "$WORK/started" | wc -l) compiled by this run)"
    fi
    "$PY" scripts/gpu_report.py table "$WORK" | tee "$WORK/summary.md" || cat "$WORK/stages.tsv"
    if [[ -n ${KILN_GPU_OUT:-} ]]; then
        mkdir -p "$KILN_GPU_OUT"
        cp "$WORK/summary.md" "$KILN_GPU_OUT/summary.md" 2>/dev/null || true
        tar czf "$KILN_GPU_OUT/gpu-check-logs.tgz" -C "$WORK" . || true
        echo "(logs: $KILN_GPU_OUT/gpu-check-logs.tgz, table: $KILN_GPU_OUT/summary.md)"
    else
        echo "(logs: $WORK)"
    fi
    ! grep -qv $'\tpass\t' "$WORK/stages.tsv"
}

# --- NVRTC and the CUDA headers: a toolkit's, the Python environment's NVIDIA wheels, or PyPI's
if [[ -z ${KILN_NVRTC_DIR:-} ]]; then
    toolkit=""
    for t in "${CUDA_HOME:-}" /usr/local/cuda /usr/local/cuda-13* /usr/local/cuda-12*; do
        [[ -n $t && -f $t/include/cuda_bf16.h ]] && ls "$t"/lib64/libnvrtc.so* >/dev/null 2>&1 && { toolkit=$t; break; }
    done
    if [[ -n $toolkit ]]; then
        export CUDA_HOME=$toolkit
        export LD_LIBRARY_PATH="$toolkit/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    else
        site=$("$PY" -c 'import nvidia, os; print(os.path.dirname(list(nvidia.__path__)[0]))' 2>/dev/null || true)
        if [[ -n $site && -f $site/nvidia/cu13/include/cuda_bf16.h ]]; then
            export KILN_NVRTC_DIR=$site
        else
            [[ -f .ci/nvrtc/nvidia/cu13/include/cuda_bf16.h ]] ||
                "$PY" -m pip install --quiet --no-deps --target .ci/nvrtc nvidia-cuda-nvrtc nvidia-cuda-runtime || true
            export KILN_NVRTC_DIR="$PWD/.ci/nvrtc"
        fi
        export LD_LIBRARY_PATH="$KILN_NVRTC_DIR/nvidia/cu13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    fi
fi
for d in /usr/local/cuda/bin /usr/local/cuda/compute-sanitizer; do
    [[ -d $d ]] && PATH=$PATH:$d
done
export PATH

# --- binaries: build with cargo, or the packed ones --------------------------------------------
GPU_TESTS=${KILN_GPU_TESTS:-$( (grep -l -E 'feature = "cuda"|backend::cuda' tests/*.rs || true) | xargs -r -n1 basename | sed 's/\.rs$//' | tr '\n' ' ')}
if command -v cargo >/dev/null && [[ -z ${KILN_GPU_PREBUILT:-} ]]; then
    BIN=$WORK/bin
    mkdir -p "$BIN"
    test_args=()
    for t in $GPU_TESTS; do test_args+=(--test "$t"); done
    stage build 420 cargo build -p kiln --release --features cuda --bins || true
    stage build-tests 300 --stdout "$WORK/build-tests.json" cargo test -p kiln --release --features cuda --no-run --lib "${test_args[@]}" --message-format=json-render-diagnostics || true
    for b in kiln kiln-bench; do ln -sf "$ROOT/${CARGO_TARGET_DIR:-target}/release/$b" "$BIN/$b"; done
    "$PY" scripts/test_executables.py "$WORK/build-tests.json" | while read -r name exe; do
        ln -sf "$exe" "$BIN/$name"
    done
else
    BIN=""
    for b in "$STASH/bin" .gpu/bin; do
        [[ -f $b/manifest.env ]] && { BIN=$b; break; }
    done
    if [[ -z $BIN ]]; then
        printf 'build\tFAIL: no cargo here and no packed binaries (run scripts/gpu-pack.sh where Rust is, carry .gpu/pack)\t0\n' >>"$WORK/stages.tsv"
        finish
        exit 1
    fi
    # Built on another machine: its tests find fixtures through the build's paths, so make them
    # point here.
    # shellcheck disable=SC1091
    source "$BIN/manifest.env"
    GPU_TESTS=${KILN_GPU_TESTS:-$KILN_PACKED_TESTS}
    if [[ $KILN_BUILD_ROOT != "$ROOT" && ! -e $KILN_BUILD_ROOT ]]; then
        mkdir -p "$(dirname "$KILN_BUILD_ROOT")" && ln -s "$ROOT" "$KILN_BUILD_ROOT"
    fi
    # The tests start the binaries from the build's target directory.
    if [[ ! -e $KILN_TARGET_DIR/release/kiln || -L $KILN_TARGET_DIR/release/kiln ]]; then
        mkdir -p "$KILN_TARGET_DIR/release"
        for b in kiln kiln-bench kiln-dump; do [[ -f $BIN/$b ]] && ln -sf "$(realpath "$BIN/$b")" "$KILN_TARGET_DIR/release/$b"; done
    fi
    echo "== build: prebuilt binaries from $KILN_PACKED_FROM"
    printf 'build\tpass\t0\n' >>"$WORK/stages.tsv"
fi
KILN=$BIN/kiln
BENCH=$BIN/kiln-bench
export KILN BENCH

# --- the stages -------------------------------------------------------------------------------
FIXTURE=(-m tests/fixtures/llama_tied --prompt-ids 1,2,3,4,5)

# set_venv NAME: VENV=(env VAR=value ...), the prefix that runs a command under the variant
# (stage() runs executables under `timeout`, so not a shell function).
set_venv() {
    local envs
    envs=$(scripts/mk-variant.sh "$1") || return 1
    # shellcheck disable=SC2206
    VENV=(env $envs)
}

do_env() {
    stage env 60 bash -c '
        nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv || true
        nvidia-smi | head -5 || true
        echo "nvcc: $(nvcc --version 2>/dev/null | tail -2 | tr "\n" " ")"
        echo "CUDA_HOME=${CUDA_HOME:-} KILN_NVRTC_DIR=${KILN_NVRTC_DIR:-} XDG_CACHE_HOME=${XDG_CACHE_HOME:-}"
        ls -l ${CUDA_HOME:-/usr/local/cuda}/lib64/libnvrtc.so* 2>/dev/null | head -3
        echo "compute-sanitizer: $(command -v compute-sanitizer || echo missing)  ncu: $(command -v ncu || echo missing)"
        "$PY" -c "import torch, transformers; print(\"torch\", torch.__version__, \"transformers\", transformers.__version__, torch.cuda.get_device_name(0))" 2>&1 | tail -1
        ldd --version | head -1; uname -r; nproc
        "$KILN" --version' || true
    if [[ -z ${KILN_GPU_NO_SMOKE:-} ]]; then
        for path in per-op megakernel; do
            stage "smoke:$path" 120 "$KILN" --device cuda --decode "$path" "${FIXTURE[@]}" -n 4 --ignore-eos --json || true
        done
    fi
}

# The decode megakernels of every fixture model under the current VENV, compiled on all cores at
# once into the kernel cache, before tests that would otherwise each compile them inside their
# time limit (3-5 s a kernel: in run 11 a variant the pack lacked ran its first test out of 60 s).
# Kernels already cached are read, not compiled. The architecture is the device's
# (nvidia-smi's compute capability), 90 when that cannot be read.
precompile_variant() { # TAG
    local models=() m arch
    for m in tests/fixtures/*; do
        [[ -f $m/config.json || $m == *.gguf ]] && models+=(-m "$m")
    done
    ((${#models[@]})) || return 0
    arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .')
    [[ $arch =~ ^[0-9]+$ ]] || arch=90
    stage "kernels$1" 300 "${VENV[@]}" bash -c 'bench=$1 arch=$2; shift 2
        printf "%s\0" "$@" | xargs -0 -n 2 -P "$(nproc)" "$bench" --precompile-cuda "$arch" --batch 1,2,4,8 |
            awk -F"\t" "\$4 == \"compiled\" {n++} END {print n + 0, \"kernels compiled\"}"' \
        _ "$BENCH" "$arch" "${models[@]}" || true
}

run_tests() { # FILTER VARIANT: one process per test function, under the megakernel variant
    local filter=$1 variant=${2:-default} t bin name tag=""
    [[ $variant != default ]] && tag="[$variant]"
    set_venv "$variant" || return 0
    CUR_VARIANT=$variant
    precompile_variant "$tag"
    for t in $GPU_TESTS lib; do
        bin=$BIN/test-$t
        [[ -x $bin ]] || { echo "(no $bin)"; continue; }
        local list
        if [[ $t == lib ]]; then
            list=$("$bin" --list --format terse cuda 2>/dev/null | sed -n 's/: test$//p')
        else
            list=$("$bin" --list --format terse 2>/dev/null | sed -n 's/: test$//p')
        fi
        for name in $list; do
            [[ -n $filter ]] && ! grep -qE "$filter" <<<"$t::$name" && continue
            [[ -n $TEST_SKIP ]] && grep -qE "$TEST_SKIP" <<<"$t::$name" && continue
            stage "test$tag:$t::$name" "$TEST_LIMIT" "${VENV[@]}" "$bin" --exact "$name" --nocapture --test-threads=1 || true
        done
    done
    CUR_VARIANT=default
}
# The tests once per KILN_GPU_TEST_VARIANTS value (default: only "default").
do_tests() {
    local v
    for v in ${KILN_GPU_TEST_VARIANTS:-default}; do
        run_tests "${KILN_GPU_TEST_FILTER:-}" "$v"
    done
}

BW_GBS=""
bw_args=()
# bw_args from this run's measurement, an earlier run's on this machine, or KILN_BANDWIDTH_GBS.
set_bw_args() {
    [[ -z $BW_GBS && -s $STASH/bandwidth_gbs ]] && BW_GBS=$(cat "$STASH/bandwidth_gbs")
    [[ -n ${KILN_BANDWIDTH_GBS:-} ]] && BW_GBS=$KILN_BANDWIDTH_GBS
    bw_args=()
    [[ -n $BW_GBS ]] && bw_args=(--bandwidth-gbs "$BW_GBS")
    return 0
}
do_bandwidth() {
    if stage bandwidth-kiln 90 --stdout "$WORK/bandwidth-kiln.json" "$BENCH" --measure-gpu-bandwidth -o json; then
        BW_GBS=$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["bytes_per_s"] / 1e9)' "$WORK/bandwidth-kiln.json") || BW_GBS=""
    fi
    stage bandwidth-torch 90 --stdout "$WORK/bandwidth-torch.json" "$PY" scripts/torch_compare.py --measure-bandwidth --bandwidth-only || true
    if [[ -z $BW_GBS && -s $WORK/bandwidth-torch.json ]]; then
        BW_GBS=$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["bytes_per_s"] / 1e9)' "$WORK/bandwidth-torch.json") || BW_GBS=""
    fi
    # A later run on the same machine reuses the measurement.
    [[ -n $BW_GBS ]] && echo "$BW_GBS" >"$STASH/bandwidth_gbs"
    return 0
}

correct() { # label, then kiln's model/prompt arguments
    local label=$1
    shift
    local ref="$WORK/correct-$label-cpu.json"
    # The GPU's numbers on the CPU: bf16 weights and a bf16 KV cache.
    stage "correct:$label:cpu" 120 --stdout "$ref" "$KILN" --device cpu --weights bf16 --kv-type bf16 --json --ignore-eos "$@" || return 0
    for path in per-op megakernel; do
        local got="$WORK/correct-$label-$path.json" got3="$WORK/correct-$label-$path-x3.json"
        stage "correct:$label:$path" 120 bash -c '"$0" --device cuda --decode "$1" --json --ignore-eos "${@:4}" >"$2" && "$PY" scripts/gpu_report.py compare "$3" "$2"' \
            "$KILN" "$path" "$got" "$ref" "$@" || true
        stage "correct:$label:$path:x3" 120 bash -c '"$0" --device cuda --decode "$1" --json --ignore-eos --samples 3 "${@:4}" >"$2" && "$PY" scripts/gpu_report.py compare "$3" "$2"' \
            "$KILN" "$path" "$got3" "$ref" "$@" || true
    done
}
do_correct() {
    correct llama_tied "${FIXTURE[@]}" -n 64
    correct nanochat -m tests/fixtures/nanochat --prompt-ids 1,2,3,4,5 -n 64
}
do_demo() {
    [[ -f $DEMO ]] || { printf 'demo\tskipped: %s absent\t0\n' "$DEMO" >>"$WORK/stages.tsv"; return 0; }
    run_tests smollm2
    correct smollm2 -m "$DEMO" --chat -p "What is the capital of France?" -n 256
}

bench() { # name, then kiln-bench's model arguments
    local name=$1 rows
    shift
    set_bw_args
    # The megakernel at each KILN_GPU_MK_ROWS value (scripts/mk-variant.sh), then the per-op path.
    for rows in $MK_ROWS; do
        local label=megakernel
        if [[ $rows =~ ^[0-9]+$ ]]; then
            label=megakernel-r$rows
        elif [[ $rows != default ]]; then
            label=megakernel-${rows//+/-}
        fi
        set_venv "$rows" || continue
        # A bench that runs past its limit skips nothing else: it may only be slow (the
        # Llama-3.2-1B shape's 4 buckets took longer than 150 s on an H100, run 9).
        CUR_VARIANT="$rows:$name"
        stage "bench:$name:$label" "$BENCH_LIMIT" --stdout "$WORK/bench__${name}__${label}.json" \
            "${VENV[@]}" "$BENCH" "$@" --device cuda --decode megakernel -p 0 -n "$N_GEN" --batch "$BATCHES" -r "$REPS" -o json "${bw_args[@]}" || true
        CUR_VARIANT=default
    done
    stage "bench:$name:per-op" "$BENCH_LIMIT" --stdout "$WORK/bench__${name}__per-op.json" \
        "$BENCH" "$@" --device cuda --decode per-op -p 0 -n "$N_GEN" --batch "$BATCHES" -r "$REPS" -o json "${bw_args[@]}" || true
}
do_bench() {
    local m
    for m in $BENCH_MODELS; do
        case $m in
        smollm2-gguf) [[ -f $DEMO ]] && bench smollm2-gguf -m "$DEMO" ;;
        cpu)
            cpu_model=(--synthetic smollm2-135m)
            [[ -f $DEMO ]] && cpu_model=(-m "$DEMO")
            stage bench:smollm2:cpu 120 --stdout "$WORK/bench__smollm2__cpu.json" \
                "$BENCH" "${cpu_model[@]}" --weights bf16 -p 128 -n 64 -r 3 -o json || true
            ;;
        *) bench "$m" --synthetic "$m" ;;
        esac
    done
}

# Nsight Compute on a few decode steps: the megakernel (speed of light, occupancy, warp stalls)
# and the per-op path's kernel times for about one step (what the device does, against the
# step's wall time in the bench rows). With KILN_GPU_NCU_SYNTHETIC (a shape name) the megakernel
# step is kiln-bench's on that shape at batch 1, under the variant KILN_GPU_NCU_VARIANT.
do_ncu() {
    command -v ncu >/dev/null || { printf 'ncu\tskipped: no ncu\t0\n' >>"$WORK/stages.tsv"; return 0; }
    local sections=(--section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats
        --section MemoryWorkloadAnalysis --section SchedulerStats)
    if [[ -n ${KILN_GPU_NCU_SYNTHETIC:-} ]]; then
        local v=${KILN_GPU_NCU_VARIANT:-default}
        set_venv "$v" || return 0
        CUR_VARIANT=$v
        stage "ncu:megakernel:$KILN_GPU_NCU_SYNTHETIC:$v" 150 "${VENV[@]}" ncu --clock-control none \
            --kernel-name regex:kiln_decode_step --launch-skip 4 --launch-count 1 "${sections[@]}" \
            "$BENCH" --synthetic "$KILN_GPU_NCU_SYNTHETIC" --device cuda --decode megakernel -p 0 -n 8 --batch 1 -r 1 || true
        CUR_VARIANT=default
        return 0
    fi
    local ncu_model=(-m tests/fixtures/llama_tied --prompt-ids 1,2,3,4,5)
    [[ -f $DEMO ]] && ncu_model=(-m "$DEMO" -p "The capital of France is")
    stage ncu:megakernel 120 ncu --clock-control none --kernel-name regex:kiln_decode_step \
        --launch-skip 3 --launch-count 1 "${sections[@]}" "$KILN" --device cuda --decode megakernel "${ncu_model[@]}" -n 8 --ignore-eos || true
    stage ncu:per-op 120 ncu --clock-control none --metrics gpu__time_duration.sum \
        --launch-skip 600 --launch-count 600 --csv "$KILN" --device cuda --decode per-op "${ncu_model[@]}" -n 16 --ignore-eos || true
}

# compute-sanitizer on a few steps: memcheck on the per-op path, memcheck, racecheck and
# synccheck on the default megakernel, and racecheck on each other KILN_GPU_TEST_VARIANTS value.
do_sanitize() {
    command -v compute-sanitizer >/dev/null || { printf 'sanitize\tskipped: no compute-sanitizer\t0\n' >>"$WORK/stages.tsv"; return 0; }
    local tool v
    stage sanitize:memcheck:per-op 90 compute-sanitizer --tool memcheck --error-exitcode 9 "$KILN" --device cuda --decode per-op "${FIXTURE[@]}" -n 4 --ignore-eos || true
    for tool in memcheck racecheck synccheck; do
        stage "sanitize:$tool:megakernel" 90 compute-sanitizer --tool "$tool" --error-exitcode 9 "$KILN" --device cuda --decode megakernel "${FIXTURE[@]}" -n 3 --ignore-eos || true
    done
    for v in ${KILN_GPU_TEST_VARIANTS:-default}; do
        [[ $v == default ]] && continue
        set_venv "$v" || continue
        CUR_VARIANT=$v
        stage "sanitize:racecheck:megakernel-$v" 90 "${VENV[@]}" compute-sanitizer --tool racecheck --error-exitcode 9 "$KILN" --device cuda --decode megakernel "${FIXTURE[@]}" -n 3 --ignore-eos || true
        CUR_VARIANT=default
    done
}

do_torch() {
    local shape
    set_bw_args
    for shape in llama-3.2-1b smollm2-135m; do
        stage "torch:$shape" 240 --stdout "$WORK/torch-$shape.jsonl" \
            "$PY" scripts/torch_compare.py --model "$shape" --batch "$TORCH_BATCHES" -n "$N_GEN" -r 10 --warmup 3 "${bw_args[@]}" || true
    done
}

do_cmds() {
    if [[ -z ${KILN_GPU_CMDS:-} || ! -f ${KILN_GPU_CMDS:-} ]]; then
        printf 'cmds\tskipped: KILN_GPU_CMDS names no file\t0\n' >>"$WORK/stages.tsv"
        return 0
    fi
    local line label cmd
    # The commands' stdin is not the list (fd 3 is), so none of them can swallow the rest.
    while IFS= read -r line <&3; do
        [[ -z ${line//[[:space:]]/} || $line =~ ^[[:space:]]*# ]] && continue
        label=${line%%[[:space:]]*}
        cmd=${line#"$label"}
        stage "cmd:$label" "${KILN_GPU_CMD_LIMIT:-120}" bash -c "$cmd" </dev/null || true
    done 3<"$KILN_GPU_CMDS"
}

# The stages, in the order KILN_GPU_STAGES names them.
CUR_VARIANT=default
for s in ${STAGES//,/ }; do
    case $s in
    env | tests | demo | bandwidth | correct | ncu | bench | sanitize | torch | cmds) "do_$s" ;;
    *) printf '%s\tFAIL: unknown stage (known: env tests demo bandwidth correct ncu bench sanitize torch cmds)\t0\n' "$s" >>"$WORK/stages.tsv" ;;
    esac
done

finish
