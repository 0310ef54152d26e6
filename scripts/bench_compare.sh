#!/usr/bin/env bash
# kiln against llama.cpp on the same files, threads and tests, in one run: prefill (ppN) and
# decode (tgN) tokens/s from kiln-bench and llama-bench, alternating between them, and the ratio
# of kiln to the best llama.cpp build (native, or the no-AMX build where the native one crashes or
# is slower). Prints a Markdown table, the CPU model and flags, with more than one round each
# round's figures and the ratio within each round, kiln's decode as a share of its memory
# roofline (kiln-bench's roofline %), and every command it ran.
#
#   scripts/bench_compare.sh [--quick] [-t THREADS] [-r REPS] [--rounds N] [-p N] [-n N]
#                            [--models LIST] [--builds native,noamx] [--cpus LIST]
#                            [--numerics exact,int24,int16,bf16,int8]
#
#   -t THREADS    thread counts, comma list (default 2; -t 1 or -t 1,2 for one thread)
#   -r REPS       repetitions per tool run (default 5)
#   --rounds N    each tool runs N times per test, alternating, and the median is kept (default 3)
#   -p N / -n N   prompt length of the pp test / tokens of the tg test (default 512 / 128)
#   --models LIST comma list of q4_1, bf16, q8_0, q4_k_m (default all)
#   --builds LIST llama.cpp builds to run (default native,noamx; see scripts/build_llama_cpp.sh)
#   --cpus LIST   run every tool under `taskset -c LIST` (default: no pinning)
#   --numerics L  kiln's numerics modes to run, each a column (default int24, kiln's; see kiln-bench
#                 --numerics: int24 rounds activations to 24-bit integers, int16 to
#                 16-bit integers, bf16
#                 rounds prefill activations, and quantized weights, to bf16, int8 rounds
#                 every step's activations to 8-bit integers against Q4_0/Q4_1/Q5_0/Q5_1/Q8_0
#                 weights)
#   --quick       a check that everything runs, not a measurement: pp64, tg16, -r 1, 1 round
#
# Models: the demo model SmolLM2-135M-Instruct Q4_1 (scripts/fetch_demo_model.sh), its BF16 and
# Q8_0 conversions made once with llama.cpp's llama-quantize from the same file and kept in
# models/, and Qwen2.5-Coder-0.5B-Instruct Q4_K_M (scripts/fetch_models.sh). Run it on a quiet
# machine: llama.cpp's spinning threads collapse under contention, and any other load makes
# both numbers meaningless. Logs of every run: .bench/logs/.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

THREADS="2"
REPS=5
ROUNDS=3
PP=512
TG=128
MODELS="q4_1,bf16,q8_0,q4_k_m"
BUILDS="native,noamx"
CPUS=""
NUMERICS="int24"
QUICK=0

usage() {
    sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
}
need_arg() { [[ $# -ge 2 && -n "$2" ]] || { echo "bench_compare: $1 needs a value" >&2; usage; }; }
while [[ $# -gt 0 ]]; do
    case "$1" in
        -t|--threads) need_arg "$@"; THREADS="$2"; shift 2 ;;
        -r|--repetitions) need_arg "$@"; REPS="$2"; shift 2 ;;
        --rounds) need_arg "$@"; ROUNDS="$2"; shift 2 ;;
        -p) need_arg "$@"; PP="$2"; shift 2 ;;
        -n) need_arg "$@"; TG="$2"; shift 2 ;;
        --models) need_arg "$@"; MODELS="$2"; shift 2 ;;
        --builds) need_arg "$@"; BUILDS="$2"; shift 2 ;;
        --cpus) need_arg "$@"; CPUS="$2"; shift 2 ;;
        --numerics) need_arg "$@"; NUMERICS="$2"; shift 2 ;;
        --quick) QUICK=1; shift ;;
        -h|--help) usage ;;
        *) echo "bench_compare: unknown argument '$1'" >&2; usage ;;
    esac
done
if [[ "${QUICK}" == 1 ]]; then
    PP=64; TG=16; REPS=1; ROUNDS=1
fi
for v in "${REPS}" "${ROUNDS}" "${PP}" "${TG}"; do
    [[ "${v}" =~ ^[1-9][0-9]*$ ]] || { echo "bench_compare: '${v}' is not a positive integer" >&2; exit 2; }
done
[[ "${THREADS}" =~ ^[1-9][0-9]*(,[1-9][0-9]*)*$ ]] || { echo "bench_compare: -t '${THREADS}' is not a comma list of thread counts" >&2; exit 2; }
[[ "${NUMERICS}" =~ ^(exact|int24|int16|bf16|int8)(,(exact|int24|int16|bf16|int8))*$ ]] || { echo "bench_compare: --numerics '${NUMERICS}' is not a comma list of exact, int24, int16, bf16, int8" >&2; exit 2; }
IFS=, read -r -a NUMERICS_LIST <<< "${NUMERICS}"
PIN=()
if [[ -n "${CPUS}" ]]; then
    command -v taskset >/dev/null || { echo "bench_compare: --cpus needs taskset (util-linux)" >&2; exit 1; }
    PIN=(taskset -c "${CPUS}")
fi
PY="${PYTHON:-python3}"
LOGS=".bench/logs"
mkdir -p "${LOGS}"

# --- binaries
echo "bench_compare: building kiln-bench" >&2
nice -n 5 cargo build --release --quiet --bin kiln-bench
KILN_BENCH="target/release/kiln-bench"
# (Not `mapfile < <(...)`: a failed build must stop the script, and set -e does not see it there.)
BINDIR_TEXT="$(scripts/build_llama_cpp.sh --builds "${BUILDS}")"
mapfile -t BINDIRS <<< "${BINDIR_TEXT}"
IFS=, read -r -a BUILD_NAMES <<< "${BUILDS}"
if [[ "${#BINDIRS[@]}" -ne "${#BUILD_NAMES[@]}" ]]; then
    echo "bench_compare: scripts/build_llama_cpp.sh gave ${#BINDIRS[@]} build directories for ${#BUILD_NAMES[@]} builds" >&2
    exit 1
fi
QUANTIZE="${BINDIRS[0]}/llama-quantize"

# --- models
DEMO="models/SmolLM2-135M-Instruct.Q4_1.gguf"
[[ -f "${DEMO}" ]] || scripts/fetch_demo_model.sh >&2
[[ -f "${DEMO}" ]] || { echo "bench_compare: ${DEMO} missing after scripts/fetch_demo_model.sh" >&2; exit 1; }
# A conversion of the demo file made once by llama-quantize (written aside, then renamed, so an
# interrupted conversion never leaves a partial file behind).
derived() {
    local type="$1" out="models/SmolLM2-135M-Instruct.$1.gguf"
    if [[ ! -f "${out}" ]]; then
        echo "bench_compare: making ${out} with llama-quantize" >&2
        "${QUANTIZE}" --allow-requantize "${DEMO}" "${out}.part" "${type}" >"${LOGS}/quantize-${type}.log" 2>&1 ||
            { echo "bench_compare: llama-quantize ${type} failed; see ${LOGS}/quantize-${type}.log" >&2; exit 1; }
        mv "${out}.part" "${out}"
    fi
    echo "${out}"
}
MODEL_FILES=()
IFS=, read -r -a WANT_MODELS <<< "${MODELS}"
for m in "${WANT_MODELS[@]}"; do
    case "${m}" in
        q4_1) MODEL_FILES+=("${DEMO}") ;;
        bf16) MODEL_FILES+=("$(derived BF16)") ;;
        q8_0) MODEL_FILES+=("$(derived Q8_0)") ;;
        q4_k_m)
            Q="models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
            [[ -f "${Q}" ]] || scripts/fetch_models.sh qwen2.5-coder-0.5b >&2
            MODEL_FILES+=("${Q}") ;;
        *) echo "bench_compare: unknown model '${m}' (known: q4_1, bf16, q8_0, q4_k_m)" >&2; exit 2 ;;
    esac
done

# --- one run of each tool: prints tokens/s (kiln: tokens/s:roofline %:GB/s of the bandwidth it
# was scored against), or a word saying why there is none
# (Each run is in a command substitution, a subshell: the commands are collected in a file.)
CMDLOG="${LOGS}/commands.txt"
: > "${CMDLOG}"
run_kiln() { # model threads pp tg numerics
    local log="${LOGS}/kiln-$(basename "$1")-t$2-p$3-n$4-$5.json" cmd
    cmd=("${PIN[@]}" "${KILN_BENCH}" -m "$1" -t "$2" -p "$3" -n "$4" -r "${REPS}" --numerics "$5" -o json)
    echo "${cmd[*]}" >> "${CMDLOG}"
    if ! "${cmd[@]}" >"${log}" 2>"${log}.stderr"; then
        echo "bench_compare: kiln-bench failed: ${cmd[*]}" >&2
        tail -n 5 "${log}.stderr" >&2
        echo failed
        return
    fi
    "${PY}" -c 'import json,sys; r = json.load(open(sys.argv[1]))[0]; print("%.2f:%.1f:%.1f" % (r["tokens_per_s"], r["roofline_pct"], r["bandwidth_bytes_per_s"] / 1e9))' "${log}"
}
run_llama() { # bindir build model threads pp tg
    local log="${LOGS}/llama-$2-$(basename "$3")-t$4-p$5-n$6.json" cmd rc=0
    cmd=("${PIN[@]}" "$1/llama-bench" -m "$3" -t "$4" -p "$5" -n "$6" -r "${REPS}" -o json)
    echo "${cmd[*]}" >> "${CMDLOG}"
    "${cmd[@]}" >"${log}" 2>"${log}.stderr" || rc=$?
    if [[ "${rc}" -ne 0 ]]; then
        if [[ "${rc}" -gt 128 ]]; then
            echo "crash(sig$((rc - 128)))"
        else
            echo "bench_compare: llama-bench ($2) failed with ${rc}: ${cmd[*]}" >&2
            tail -n 5 "${log}.stderr" >&2
            echo failed
        fi
        return
    fi
    "${PY}" -c 'import json,sys; print("%.2f" % json.load(open(sys.argv[1]))[0]["avg_ts"])' "${log}"
}
median() { # values... (non-numbers ignored); prints the median or the first non-number
    "${PY}" - "$@" <<'PYEOF'
import statistics, sys
vals = sys.argv[1:]
nums = []
for v in vals:
    try:
        nums.append(float(v))
    except ValueError:
        pass
print("%.2f" % statistics.median(nums) if nums else (vals[0] if vals else "none"))
PYEOF
}

# --- the runs, alternating tools within each round
RESULTS=()   # "model|threads|test|kiln|build1|build2..."
RAW=()       # the same with each tool's value in every round, space-separated
ROOF=()      # "model|threads|test|numerics|roofline %s|GB/s" of kiln's tg runs, one per round
IFS=, read -r -a THREAD_LIST <<< "${THREADS}"
for file in "${MODEL_FILES[@]}"; do
    for t in "${THREAD_LIST[@]}"; do
        for test in "pp${PP}" "tg${TG}"; do
            if [[ "${test}" == pp* ]]; then p="${PP}"; n=0; else p=0; n="${TG}"; fi
            declare -A K=() ; declare -A L=() ; declare -A KR=() ; declare -A KB=()
            for b in "${BUILD_NAMES[@]}"; do L[$b]=""; done
            for nm in "${NUMERICS_LIST[@]}"; do K[$nm]=""; KR[$nm]=""; KB[$nm]=""; done
            for round in $(seq 1 "${ROUNDS}"); do
                echo "bench_compare: $(basename "${file}") t=${t} ${test} round ${round}/${ROUNDS}" >&2
                for nm in "${NUMERICS_LIST[@]}"; do
                    v="$(run_kiln "${file}" "${t}" "${p}" "${n}" "${nm}")"
                    IFS=: read -r tps roof gbs <<< "${v}"
                    K[$nm]+=" ${tps}"; KR[$nm]+=" ${roof:-${tps}}"; KB[$nm]+=" ${gbs:-${tps}}"
                done
                for i in "${!BUILD_NAMES[@]}"; do
                    b="${BUILD_NAMES[$i]}"
                    L[$b]+=" $(run_llama "${BINDIRS[$i]}" "${b}" "${file}" "${t}" "${p}" "${n}")"
                done
            done
            row="$(basename "${file}")|${t}|${test}"
            for nm in "${NUMERICS_LIST[@]}"; do
                # shellcheck disable=SC2086  # the list of this mode's results
                row+="|$(median ${K[$nm]})"
            done
            for b in "${BUILD_NAMES[@]}"; do
                # shellcheck disable=SC2086  # the list of this build's results
                row+="|$(median ${L[$b]})"
            done
            RESULTS+=("${row}")
            raw="$(basename "${file}")|${t}|${test}"
            for nm in "${NUMERICS_LIST[@]}"; do raw+="|${K[$nm]}"; done
            for b in "${BUILD_NAMES[@]}"; do raw+="|${L[$b]}"; done
            RAW+=("${raw}")
            if [[ "${test}" == tg* ]]; then
                for nm in "${NUMERICS_LIST[@]}"; do
                    ROOF+=("$(basename "${file}")|${t}|${test}|${nm}|${KR[$nm]}|${KB[$nm]}")
                done
            fi
            unset K L KR KB
        done
    done
done

# --- report
CPU_MODEL="$(grep -m1 '^model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')"
CPU_FLAGS="$(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -E '^(avx2|avx512(f|bw|vl|_vnni|_bf16|_fp16)|avx_vnni|amx_(tile|bf16|int8))$' | tr '\n' ' ')"
KILN_REV="$(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD 2>/dev/null || echo '+dirty')"
LCP="$(grep -E '^llama-cpp-python==' scripts/requirements-llama-cpp.txt | cut -d= -f3)"
echo
echo "## kiln vs llama.cpp ($(date -u +%Y-%m-%d), kiln ${KILN_REV}, llama.cpp from llama-cpp-python ${LCP})"
echo
echo "CPU: ${CPU_MODEL}, $(nproc) logical CPUs; flags: ${CPU_FLAGS}"
[[ "${QUICK}" == 1 ]] && echo "(--quick: a check that the tools run, not a measurement)"
echo "Each figure: the median over ${ROUNDS} alternating round(s) of each tool's mean over ${REPS} repetition(s), tokens/s."
echo
header="| model | threads | test"
sep="|---|---:|---"
ratios=""
for nm in "${NUMERICS_LIST[@]}"; do header+=" | kiln ${nm} t/s"; sep+="|---:"; ratios+=" | kiln ${nm} / best"; done
for b in "${BUILD_NAMES[@]}"; do header+=" | llama.cpp ${b} t/s"; sep+="|---:"; done
echo "${header} | best llama.cpp${ratios} |"
echo -n "${sep}|---"
for nm in "${NUMERICS_LIST[@]}"; do echo -n "|---:"; done
echo "|"
for r in "${RESULTS[@]}"; do
    "${PY}" - "${r}" "${BUILDS}" "${NUMERICS}" <<'PYEOF'
import sys
cells = sys.argv[1].split("|")
builds = sys.argv[2].split(",")
modes = sys.argv[3].split(",")
model, threads, test = cells[:3]
kiln = cells[3:3 + len(modes)]
llama = cells[3 + len(modes):]
def num(v):
    try:
        return float(v)
    except ValueError:
        return None
best = max(((num(v), b) for v, b in zip(llama, builds) if num(v) is not None), default=None)
best_txt = "%.2f (%s)" % best if best else "none"
ratios = ["%.2f" % (num(k) / best[0]) if best and num(k) is not None and best[0] > 0 else "-" for k in kiln]
print("| %s | %s | %s | %s | %s | %s | %s |" % (model, threads, test, " | ".join(kiln), " | ".join(llama), best_txt, " | ".join(ratios)))
PYEOF
done
echo
if [[ "${ROUNDS}" -gt 1 ]]; then
    # The host's speed drifts between rounds; a round's two tools ran minutes apart, so the
    # spread of the per-round ratios says how far one run's ratio can be trusted.
    echo "Per round (tokens/s of each round in order; kiln / llama.cpp within each round, against the build with the best median):"
    echo
    echo "| model | threads | test | kiln | llama.cpp | per-round ratios | lowest–highest |"
    echo "|---|---:|---|---|---|---|---|"
    for r in "${RAW[@]}"; do
        "${PY}" - "${r}" "${BUILDS}" "${NUMERICS}" <<'PYEOF'
import statistics, sys
cells = sys.argv[1].split("|")
builds = sys.argv[2].split(",")
modes = sys.argv[3].split(",")
model, threads, test = cells[:3]
def nums(v):
    out = []
    for x in v.split():
        try:
            out.append(float(x))
        except ValueError:
            out.append(None)
    return out
kiln = [nums(v) for v in cells[3:3 + len(modes)]]
llama = [nums(v) for v in cells[3 + len(modes):]]
medians = [statistics.median([x for x in l if x is not None]) if any(x is not None for x in l) else None for l in llama]
if not any(m is not None for m in medians):
    sys.exit(0)
best = max((m, i) for i, m in enumerate(medians) if m is not None)[1]
ref = llama[best]
fmt = lambda l: " ".join("%.1f" % x if x is not None else "-" for x in l)
for mode, k in zip(modes, kiln):
    ratios = [a / b for a, b in zip(k, ref) if a is not None and b]
    span = "%.2f–%.2f" % (min(ratios), max(ratios)) if ratios else "-"
    label = test if len(modes) == 1 else "%s (%s)" % (test, mode)
    print("| %s | %s | %s | %s | %s (%s) | %s | %s |" % (model, threads, label, fmt(k), fmt(ref), builds[best], " ".join("%.2f" % x for x in ratios), span))
PYEOF
    done
    echo
fi
if [[ "${#ROOF[@]}" -gt 0 ]]; then
    # kiln-bench scores a decode step against a streaming read of as many bytes as the step
    # reads (README, "Benchmarking"): the share of that read's speed the decode reached.
    echo "kiln's decode against the memory roofline (kiln-bench's roofline %: the step's bytes at the speed of a streaming read of as many bytes, over the measured time; per round, and the read's GB/s):"
    echo
    echo "| model | threads | test | numerics | roofline % (median) | per round | read GB/s per round |"
    echo "|---|---:|---|---|---:|---|---|"
    for r in "${ROOF[@]}"; do
        IFS='|' read -r m t test nm roofs gbs <<< "${r}"
        # shellcheck disable=SC2086  # the list of rounds' values
        echo "| ${m} | ${t} | ${test} | ${nm} | $(median ${roofs}) |${roofs} |${gbs} |"
    done
    echo
fi
echo "Commands (in the order run; logs in ${LOGS}/):"
echo
echo '```sh'
awk '!seen[$0]++' "${CMDLOG}"
echo '```'
