#!/usr/bin/env bash
# One command for a GPU machine: build with CUDA, run every GPU test, check kiln on the GPU against
# the CPU, measure the device's copy bandwidth, benchmark decode on both GPU paths at every batch
# bucket, time PyTorch on the same models, and print a short table. Fits a 10-minute call on an
# H100: stages that would start after KILN_GPU_CHECK_BUDGET seconds (default 540) are skipped and
# recorded as such, so the table always prints.
#
#   scripts/gpu-check.sh            # logs in $KILN_GPU_WORK (default /tmp/kiln-gpu-check);
#                                   # with $OUT set: $OUT/summary.md and $OUT/gpu-check-logs.tgz
#
# Stages (each one's output in WORK/<stage>.log; a failure is recorded and the next stage runs):
#  1. build: `cargo build --release --features cuda` (bins + the GPU tests). Without cargo on the
#     machine, binaries built elsewhere by scripts/gpu-pack.sh and carried in .gpu/bin are used.
#  2. test:<name>: every test file that uses the CUDA backend (tests/*.rs naming `backend::cuda`
#     or `feature = "cuda"`: the NVRTC gate, the megakernel gate, GPU vs CPU logits on every
#     fixture and 128 greedy SmolLM2 tokens), and the library's `cuda` unit tests.
#  3. bandwidth-kiln, bandwidth-torch: a device-to-device copy of 1 GiB, bytes read + written,
#     median of 20 event-timed copies (kiln-bench --measure-gpu-bandwidth, and torch's copy_ as a
#     cross-check). Every roofline % below divides by the kiln measurement (--bandwidth-gbs).
#  4. correct:<model>:<path>: `kiln --device cuda --decode per-op|megakernel` greedy ids against
#     `kiln --device cpu --weights bf16` on the same prompt (and 3 greedy samples at once, which
#     must each equal the batch-1 result): the demo model when present, and a fixture model.
#  5. bench:<model>:<path>: kiln-bench --device cuda --decode <path>, tg$N at batch 1,2,4,8, for
#     the synthetic Llama-3.2-1B shape, SmolLM2-135M (the demo GGUF when present, uploaded as
#     bf16; always also the synthetic shape with its exact config), plus a CPU baseline row.
#  6. torch:<shape>: scripts/torch_compare.py on the same shapes (transformers StaticCache +
#     torch.compile reduce-overhead CUDA graphs) at KILN_TORCH_BATCHES (default 1: each batch
#     size costs a compile of about a minute).
#  7. The stage table, the bandwidths, and per kiln row: t/s, ms/token, % of bandwidth, PyTorch's
#     t/s on the same model and batch, and the ratio (scripts/gpu_report.py).
#
# Method (docs/gpu-method.md): device time after a warm-up, the median of repeated runs, random
# non-zero weights, and a measured device-to-device copy (bytes read + bytes written) as the
# bandwidth ceiling. Bytes per token: bf16 weights read once + bf16 KV read to the mean context
# + new K/V written, `kiln-bench --bytes-per-token`.
#
# Status: written without access to a GPU; this script and everything it runs on the device are
# UNVERIFIED until run on one. The CPU-side pieces (kiln-bench flags, torch_compare.py's refusal
# and bytes, gpu_report.py) are tested by tests/bench.rs, tests/torch_compare.rs, tests/gpu_report.rs.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
WORK=${KILN_GPU_WORK:-/tmp/kiln-gpu-check}
BUDGET=${KILN_GPU_CHECK_BUDGET:-540}
N_GEN=${KILN_BENCH_N:-128}
BATCHES=${KILN_BATCHES:-1,2,4,8}
TORCH_BATCHES=${KILN_TORCH_BATCHES:-1}
DEMO=models/SmolLM2-135M-Instruct.Q4_1.gguf
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
rm -rf "$WORK"
mkdir -p "$WORK"
: > "$WORK/stages.tsv"

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
    else
        # The first error line says more than clap's or cargo's closing line.
        local why
        why=$(grep -m1 -E '^error|panicked|Error:' "$log" || grep -v '^[[:space:]]*$' "$log" | tail -1 || true)
        res="FAIL (exit $rc): $(echo "$why" | cut -c1-200)"
    fi
    printf '%s\t%s\t%s\n' "$name" "$res" "$dt" >>"$WORK/stages.tsv"
    echo "   $res ($dt s)"
    grep -E "SKIPPED|GPU:|rel err|test result|bandwidth" "$log" 2>/dev/null | head -20 | sed 's/^/   /' || true
    [[ $res == pass ]]
}

finish() {
    echo
    "$PY" scripts/gpu_report.py table "$WORK" | tee "$WORK/summary.md" || cat "$WORK/stages.tsv"
    if [[ -n ${OUT:-} ]]; then
        cp "$WORK/summary.md" "$OUT/summary.md" 2>/dev/null || true
        tar czf "$OUT/gpu-check-logs.tgz" -C "$WORK" . || true
        echo "(logs: \$OUT/gpu-check-logs.tgz, table: \$OUT/summary.md)"
    else
        echo "(logs: $WORK)"
    fi
    ! grep -qv $'\tpass\t' "$WORK/stages.tsv"
}

# NVRTC and the CUDA headers: the toolkit's, or PyPI's (CI's recipe).
if [ -z "${KILN_NVRTC_DIR:-}" ] && ! ls /usr/local/cuda/include/cuda_bf16.h >/dev/null 2>&1; then
    if [ ! -f .ci/nvrtc/nvidia/cu13/include/cuda_bf16.h ]; then
        "$PY" -m pip install --quiet --no-deps --target .ci/nvrtc nvidia-cuda-nvrtc nvidia-cuda-runtime || true
    fi
    export KILN_NVRTC_DIR="$PWD/.ci/nvrtc"
    export LD_LIBRARY_PATH="$KILN_NVRTC_DIR/nvidia/cu13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader || true

# The demo model: present, or reassembled from parts scripts/gpu-pack.sh --split-model made
# (98 MB is over one call's 64 MiB of carried files), or absent (then only synthetic shapes).
if [[ ! -f $DEMO && -f .gpu/model-1/part && -f .gpu/model-2/part && -f .gpu/model-2/sha256 ]]; then
    mkdir -p models
    cat .gpu/model-1/part .gpu/model-2/part >"$DEMO"
    sha256sum -c .gpu/model-2/sha256 || rm -f "$DEMO"
fi
[[ -f $DEMO ]] || echo "(no $DEMO: SmolLM2 runs as the synthetic smollm2-135m shape only)"

# GPU test files: those that use the CUDA backend (override: KILN_GPU_TESTS="gpu megakernel").
GPU_TESTS=${KILN_GPU_TESTS:-$( (grep -l -E 'feature = "cuda"|backend::cuda' tests/*.rs || true) | xargs -r -n1 basename | sed 's/\.rs$//' | tr '\n' ' ')}

# 1. Build, or use carried binaries.
if command -v cargo >/dev/null; then
    BIN=${CARGO_TARGET_DIR:-target}/release
    test_args=()
    for t in $GPU_TESTS; do test_args+=(--test "$t"); done
    stage build 420 cargo build -p kiln --release --features cuda --bins --lib "${test_args[@]}" || true
    stage build-tests 300 cargo test -p kiln --release --features cuda --no-run --lib "${test_args[@]}" || true
    run_test() { # name
        if [[ $1 == lib ]]; then
            cargo test -p kiln --release --features cuda --lib -- cuda --nocapture --test-threads=1
        else
            cargo test -p kiln --release --features cuda --test "$1" -- --nocapture --test-threads=1
        fi
    }
elif [[ -f .gpu/bin/manifest.env ]]; then
    # Built on another machine: its tests find fixtures through the build's paths, so make them
    # point here.
    # shellcheck disable=SC1091
    source .gpu/bin/manifest.env
    BIN=.gpu/bin
    GPU_TESTS=${KILN_GPU_TESTS:-$KILN_PACKED_TESTS}
    if [[ $KILN_BUILD_ROOT != "$ROOT" && ! -e $KILN_BUILD_ROOT ]]; then
        mkdir -p "$(dirname "$KILN_BUILD_ROOT")" && ln -s "$ROOT" "$KILN_BUILD_ROOT"
    fi
    mkdir -p "$KILN_TARGET_DIR/release"
    for b in kiln kiln-bench kiln-dump; do ln -sf "$ROOT/.gpu/bin/$b" "$KILN_TARGET_DIR/release/$b"; done
    echo "== build: prebuilt binaries from $KILN_PACKED_FROM"
    printf 'build\tpass\t0\n' >>"$WORK/stages.tsv"
    run_test() { # name
        if [[ $1 == lib ]]; then
            .gpu/bin/test-lib cuda --nocapture --test-threads=1
        else
            ".gpu/bin/test-$1" --nocapture --test-threads=1
        fi
    }
else
    printf 'build\tFAIL: no cargo here and no .gpu/bin (run scripts/gpu-pack.sh where Rust is, carry .gpu)\t0\n' >>"$WORK/stages.tsv"
    finish
    exit 1
fi
export -f run_test
KILN=$BIN/kiln
BENCH=$BIN/kiln-bench

# 2. Every GPU test, then the library's cuda unit tests.
for t in $GPU_TESTS lib; do
    stage "test:$t" 240 bash -c "run_test $t" || true
done

# 3. Bandwidth.
BW_GBS=""
if stage bandwidth-kiln 90 --stdout "$WORK/bandwidth-kiln.json" "$BENCH" --measure-gpu-bandwidth -o json; then
    BW_GBS=$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["bytes_per_s"] / 1e9)' "$WORK/bandwidth-kiln.json") || BW_GBS=""
fi
stage bandwidth-torch 90 --stdout "$WORK/bandwidth-torch.json" "$PY" scripts/torch_compare.py --measure-bandwidth --bandwidth-only || true
if [[ -z $BW_GBS && -s $WORK/bandwidth-torch.json ]]; then
    BW_GBS=$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["bytes_per_s"] / 1e9)' "$WORK/bandwidth-torch.json") || BW_GBS=""
fi
bw_args=()
[[ -n $BW_GBS ]] && bw_args=(--bandwidth-gbs "$BW_GBS")

# 4. Correctness through the CLI: GPU greedy ids equal the CPU's (bf16 weights on both).
correct() { # label, then kiln's model/prompt arguments
    local label=$1
    shift
    local ref="$WORK/correct-$label-cpu.json"
    stage "correct:$label:cpu" 120 --stdout "$ref" "$KILN" --device cpu --weights bf16 --json --ignore-eos "$@" || return 0
    for path in per-op megakernel; do
        local got="$WORK/correct-$label-$path.json" got3="$WORK/correct-$label-$path-x3.json"
        stage "correct:$label:$path" 120 bash -c '"$0" --device cuda --decode "$1" --json --ignore-eos "${@:4}" >"$2" && "$PY" scripts/gpu_report.py compare "$3" "$2"' \
            "$KILN" "$path" "$got" "$ref" "$@" || true
        stage "correct:$label:$path:x3" 120 bash -c '"$0" --device cuda --decode "$1" --json --ignore-eos --samples 3 "${@:4}" >"$2" && "$PY" scripts/gpu_report.py compare "$3" "$2"' \
            "$KILN" "$path" "$got3" "$ref" "$@" || true
    done
}
export PY
[[ -f $DEMO ]] && correct smollm2 -m "$DEMO" --chat -p "What is the capital of France?" -n 64
correct llama_tied -m tests/fixtures/llama_tied --prompt-ids 1,2,3,4,5 -n 32

# 5. kiln-bench on the GPU (the 1B shape first: it is the bandwidth target), and a CPU baseline.
bench_models=("llama-3.2-1b:--synthetic llama-3.2-1b")
[[ -f $DEMO ]] && bench_models+=("smollm2-gguf:-m $DEMO")
bench_models+=("smollm2-135m:--synthetic smollm2-135m")
for entry in "${bench_models[@]}"; do
    name=${entry%%:*}
    read -r -a margs <<<"${entry#*:}"
    for path in megakernel per-op; do
        stage "bench:$name:$path" 180 --stdout "$WORK/bench__${name}__${path}.json" \
            "$BENCH" "${margs[@]}" --device cuda --decode "$path" -p 0 -n "$N_GEN" --batch "$BATCHES" -r 5 -o json "${bw_args[@]}" || true
    done
done
cpu_model=(--synthetic smollm2-135m)
[[ -f $DEMO ]] && cpu_model=(-m "$DEMO")
stage bench:smollm2:cpu 120 --stdout "$WORK/bench__smollm2__cpu.json" \
    "$BENCH" "${cpu_model[@]}" --weights bf16 -p 128 -n 64 -r 3 -o json || true

# 6. PyTorch on the same shapes and GPU.
for shape in llama-3.2-1b smollm2-135m; do
    stage "torch:$shape" 300 --stdout "$WORK/torch-$shape.jsonl" \
        "$PY" scripts/torch_compare.py --model "$shape" --batch "$TORCH_BATCHES" -n "$N_GEN" -r 10 --warmup 3 "${bw_args[@]}" || true
done

# 7. The table.
finish
