#!/usr/bin/env bash
# One command for a GPU machine: build with CUDA, check the GPU against the CPU, benchmark, and
# print a short table.
#
# Method (what the numbers mean):
#  * Correctness first: tests/gpu.rs compares GPU logits with the CPU reference on every fixture
#    (relative L2 error under bf16 tolerance) and requires 128 identical greedy tokens on the demo
#    model (SmolLM2-135M-Instruct). tests/nvrtc_compile.rs shows registers/spills per kernel.
#  * Speed: decode is memory-bound, so count the bytes a token must move (all weights once, bf16,
#    plus the KV cache read up to the position) and the flops (2 per weight per token); the
#    roofline time is bytes / measured bandwidth (a device-to-device copy measures it), and the
#    score is roofline time / measured time. Prefill is compute-bound: flops / peak.
#  * Timing: CUDA events around the work on the stream, a warm-up first, then the median of
#    many repetitions (never the mean, never one run); report ms/token, tokens/s and the fraction
#    of the roofline. kiln-bench implements this when present.
#
# Status: written without access to a GPU; this script and everything it runs on the device are
# UNVERIFIED until run on one.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if [ -z "${KILN_NVRTC_DIR:-}" ] && ! ls /usr/local/cuda/include/cuda_bf16.h >/dev/null 2>&1; then
    if [ ! -f .ci/nvrtc/nvidia/cu13/include/cuda_bf16.h ]; then
        python3 -m pip install --quiet --no-deps --target .ci/nvrtc nvidia-cuda-nvrtc nvidia-cuda-runtime
    fi
    export KILN_NVRTC_DIR="$PWD/.ci/nvrtc"
    export LD_LIBRARY_PATH="$KILN_NVRTC_DIR/nvidia/cu13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
[ -f models/SmolLM2-135M-Instruct.Q4_1.gguf ] || scripts/fetch_demo_model.sh || true

echo "== build (--features cuda)"
cargo build --release --features cuda --bins --tests

declare -A result
run() {  # name, command...
    local name=$1; shift
    if "$@" > "/tmp/kiln-gpu-$name.log" 2>&1; then result[$name]=pass; else result[$name]=FAIL; fi
    grep -E "SKIPPED|GPU:|rel err|test result" "/tmp/kiln-gpu-$name.log" || true
}
echo "== NVRTC compile gate"
run nvrtc cargo test --release --features cuda --test nvrtc_compile -- --nocapture
echo "== GPU vs CPU"
run gpu cargo test --release --features cuda --test gpu -- --nocapture --test-threads=1
# kiln-bench refuses --device cuda until the engine drives the CUDA backend; the CPU row is the
# baseline the GPU numbers will be compared with.
echo "== kiln-bench (CPU baseline; --device cuda)"
run bench target/release/kiln-bench -m models/SmolLM2-135M-Instruct.Q4_1.gguf -p 512 -n 128 -r 5 --device cpu
tail -6 /tmp/kiln-gpu-bench.log
if target/release/kiln-bench -m models/SmolLM2-135M-Instruct.Q4_1.gguf --device cuda >/tmp/kiln-gpu-bench-cuda.log 2>&1; then
    result[bench-cuda]=pass
else
    result[bench-cuda]="not available: $(tail -1 /tmp/kiln-gpu-bench-cuda.log)"
fi

printf '\n%-10s %s\n' check result
for k in nvrtc gpu bench bench-cuda; do printf '%-10s %s\n' "$k" "${result[$k]:-skipped}"; done
printf '(logs: /tmp/kiln-gpu-*.log)\n'
[[ "${result[nvrtc]}" == pass && "${result[gpu]}" == pass ]]
