#!/usr/bin/env bash
# kiln serve against llama.cpp's llama-server on the same model, threads, CPUs and workload, in
# one run: closed-loop streaming clients at each concurrency (kiln-bench serve-load), aggregate
# tokens/s, requests/s, TTFT and inter-token latency p50/p99, and kiln's ratios. Each server in
# turn is started pinned to the same CPUs, warmed up, loaded at every level, and stopped.
#
#   scripts/serve_compare.sh [--quick] [-t THREADS] [--concurrency LIST] [--max-tokens N]
#                            [--requests-per-client N] [--min-requests N] [--model FILE]
#                            [--build auto|native|noamx] [--slots N] [--ctx-per-slot N]
#                            [--kiln-kv-budget SIZE] [--server-cpus LIST] [--client-cpus LIST]
#                            [--port N] [--servers kiln,llama-server]
#
#   -t THREADS             server threads (default 2)
#   --concurrency LIST     client levels (default 1,4,16,64)
#   --max-tokens N         tokens per request, exactly (ignore_eos; default 64)
#   --requests-per-client  requests each client sends per level (default 4; at least
#   --min-requests           --min-requests per level, default 16)
#   --build B              llama.cpp build (default auto: noamx on CPUs with AMX, where the
#                          native build crashes in prefill, else native)
#   --slots N              llama-server parallel slots -np and kiln --max-running (default: the
#                          largest concurrency)
#   --ctx-per-slot N       context per request: llama-server -c N*slots, kiln -c N (default 1024)
#   --kiln-kv-budget SIZE  kiln's KV pool (default 4G: every slot's full context in f32)
#   --server-cpus LIST     taskset CPUs of both servers (default: the first THREADS CPUs when the
#                          machine has more, else all of them)
#   --client-cpus LIST     taskset CPUs of the load generator (default: the others, else all)
#   --port N               port both servers listen on in turn, on 127.0.0.1 (default 18080)
#   --quick                a check that everything runs, not a measurement: concurrency 1,4,
#                          16 tokens, 1 request per client, at least 4 per level
#
# The workload (kiln::bench::load::workload): /v1/completions, streamed, temperature 0,
# ignore_eos, a seeded set of prompts of 8 to 320 words, the same requests for both servers.
# Run on a quiet machine. Server logs: .bench/logs/.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

THREADS=2
CONCURRENCY="1,4,16,64"
MAX_TOKENS=64
PER_CLIENT=4
MIN_REQUESTS=16
WARMUP=2
MODEL="models/SmolLM2-135M-Instruct.Q4_1.gguf"
BUILD="auto"
SLOTS=""
CTX=1024
KILN_KV="4G"
SERVER_CPUS=""
CLIENT_CPUS=""
PORT=18080
SERVERS="llama-server,kiln"

usage() {
    sed -n '2,33p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
}
need_arg() { [[ $# -ge 2 && -n "$2" ]] || { echo "serve_compare: $1 needs a value" >&2; usage; }; }
while [[ $# -gt 0 ]]; do
    case "$1" in
        -t|--threads) need_arg "$@"; THREADS="$2"; shift 2 ;;
        --concurrency) need_arg "$@"; CONCURRENCY="$2"; shift 2 ;;
        --max-tokens) need_arg "$@"; MAX_TOKENS="$2"; shift 2 ;;
        --requests-per-client) need_arg "$@"; PER_CLIENT="$2"; shift 2 ;;
        --min-requests) need_arg "$@"; MIN_REQUESTS="$2"; shift 2 ;;
        --model) need_arg "$@"; MODEL="$2"; shift 2 ;;
        --build) need_arg "$@"; BUILD="$2"; shift 2 ;;
        --slots) need_arg "$@"; SLOTS="$2"; shift 2 ;;
        --ctx-per-slot) need_arg "$@"; CTX="$2"; shift 2 ;;
        --kiln-kv-budget) need_arg "$@"; KILN_KV="$2"; shift 2 ;;
        --server-cpus) need_arg "$@"; SERVER_CPUS="$2"; shift 2 ;;
        --client-cpus) need_arg "$@"; CLIENT_CPUS="$2"; shift 2 ;;
        --port) need_arg "$@"; PORT="$2"; shift 2 ;;
        --servers) need_arg "$@"; SERVERS="$2"; shift 2 ;;
        --quick) CONCURRENCY="1,4"; MAX_TOKENS=16; PER_CLIENT=1; MIN_REQUESTS=4; WARMUP=1; shift ;;
        -h|--help) usage ;;
        *) echo "serve_compare: unknown argument '$1'" >&2; usage ;;
    esac
done
int() { [[ "$2" =~ ^[1-9][0-9]*$ ]] || { echo "serve_compare: $1 '$2' is not a positive integer" >&2; exit 2; }; }
int -t "${THREADS}"; int --max-tokens "${MAX_TOKENS}"; int --requests-per-client "${PER_CLIENT}"
int --min-requests "${MIN_REQUESTS}"; int --ctx-per-slot "${CTX}"; int --port "${PORT}"
[[ "${CONCURRENCY}" =~ ^[1-9][0-9]*(,[1-9][0-9]*)*$ ]] || { echo "serve_compare: --concurrency '${CONCURRENCY}' is not a comma list" >&2; exit 2; }
MAX_C="$(tr , '\n' <<< "${CONCURRENCY}" | sort -n | tail -n1)"
SLOTS="${SLOTS:-${MAX_C}}"
int --slots "${SLOTS}"
[[ -f "${MODEL}" ]] || { echo "serve_compare: --model ${MODEL} does not exist (scripts/fetch_demo_model.sh fetches the demo model)" >&2; exit 1; }
if [[ "${BUILD}" == auto ]]; then
    if grep -qw amx_tile /proc/cpuinfo; then BUILD=noamx; else BUILD=native; fi
fi
case "${BUILD}" in native|noamx) ;; *) echo "serve_compare: --build '${BUILD}' (auto, native or noamx)" >&2; exit 2 ;; esac

NCPU="$(nproc)"
if [[ -z "${SERVER_CPUS}" ]]; then
    if (( NCPU > THREADS )); then
        SERVER_CPUS="0-$((THREADS - 1))"
        CLIENT_CPUS="${CLIENT_CPUS:-${THREADS}-$((NCPU - 1))}"
    else
        SERVER_CPUS="0-$((NCPU - 1))"
        echo "serve_compare: only ${NCPU} CPUs: the load generator shares the servers' CPUs" >&2
    fi
fi
CLIENT_CPUS="${CLIENT_CPUS:-0-$((NCPU - 1))}"
command -v taskset >/dev/null || { echo "serve_compare: needs taskset (util-linux) to pin the servers" >&2; exit 1; }
command -v curl >/dev/null || { echo "serve_compare: needs curl to wait for the servers" >&2; exit 1; }
PY="${PYTHON:-python3}"
LOGS=".bench/logs"
mkdir -p "${LOGS}"

echo "serve_compare: building kiln and kiln-bench" >&2
nice -n 5 cargo build --release --quiet --bin kiln --bin kiln-bench
LLAMA_BIN=""
if [[ ",${SERVERS}," == *",llama-server,"* ]]; then
    LLAMA_BIN="$(scripts/build_llama_cpp.sh --builds "${BUILD}")"
fi

# --- servers: one at a time on PORT, killed on any exit
SERVER_PID=""
LOAD_PID=""
stop_load() {
    if [[ -n "${LOAD_PID}" ]]; then
        kill "${LOAD_PID}" 2>/dev/null || true
        wait "${LOAD_PID}" 2>/dev/null || true
        LOAD_PID=""
    fi
}
stop_server() {
    if [[ -n "${SERVER_PID}" ]] && kill -0 "${SERVER_PID}" 2>/dev/null; then
        kill "${SERVER_PID}" 2>/dev/null || true
        for _ in $(seq 1 50); do kill -0 "${SERVER_PID}" 2>/dev/null || break; sleep 0.1; done
        kill -9 "${SERVER_PID}" 2>/dev/null || true
        wait "${SERVER_PID}" 2>/dev/null || true
    fi
    SERVER_PID=""
}
trap 'stop_load; stop_server' EXIT
trap 'stop_load; stop_server; exit 130' INT TERM

port_busy() { (exec 3<>"/dev/tcp/127.0.0.1/${PORT}") 2>/dev/null; }

start_server() { # name log command...
    local name="$1" log="$2"; shift 2
    if port_busy; then
        echo "serve_compare: 127.0.0.1:${PORT} is already in use; pass --port" >&2
        exit 1
    fi
    echo "serve_compare: starting ${name}: $*" >&2
    echo "taskset -c ${SERVER_CPUS} $*" >> "${LOGS}/serve-commands.txt"
    taskset -c "${SERVER_CPUS}" "$@" >"${log}" 2>&1 &
    SERVER_PID=$!
    local t0=${SECONDS}
    until curl -sf "http://127.0.0.1:${PORT}/health" >/dev/null 2>&1; do
        if ! kill -0 "${SERVER_PID}" 2>/dev/null; then
            echo "serve_compare: ${name} exited before it was ready; the end of ${log}:" >&2
            tail -n 20 "${log}" >&2
            exit 1
        fi
        if (( SECONDS - t0 > 300 )); then
            echo "serve_compare: ${name} not ready after 300 s; see ${log}" >&2
            exit 1
        fi
        sleep 0.2
    done
}

load() { # label out.json
    local cmd=(taskset -c "${CLIENT_CPUS}" target/release/kiln-bench serve-load
        --url "http://127.0.0.1:${PORT}" --label "$1" --concurrency "${CONCURRENCY}"
        --max-tokens "${MAX_TOKENS}" --requests-per-client "${PER_CLIENT}"
        --min-requests "${MIN_REQUESTS}" --warmup "${WARMUP}" -o json)
    echo "${cmd[*]}" >> "${LOGS}/serve-commands.txt"
    # In the background and waited for: bash runs a trap only once the foreground command ends,
    # and `wait` lets Ctrl-C or SIGTERM stop the run (and the server) at once.
    "${cmd[@]}" > "$2" &
    LOAD_PID=$!
    wait "${LOAD_PID}"
    LOAD_PID=""
}

: > "${LOGS}/serve-commands.txt"
OUTS=()
IFS=, read -r -a WANT <<< "${SERVERS}"
for s in "${WANT[@]}"; do
    out="${LOGS}/serve-${s}.json"
    case "${s}" in
        llama-server)
            start_server llama-server "${LOGS}/llama-server.log" \
                "${LLAMA_BIN}/llama-server" -m "${MODEL}" -t "${THREADS}" -tb "${THREADS}" \
                -np "${SLOTS}" -c "$((SLOTS * CTX))" --host 127.0.0.1 --port "${PORT}" ;;
        kiln)
            start_server kiln "${LOGS}/kiln-serve.log" \
                target/release/kiln serve -m "${MODEL}" -t "${THREADS}" -c "${CTX}" \
                --max-running "${SLOTS}" --kv-budget "${KILN_KV}" --host 127.0.0.1 --port "${PORT}" ;;
        *) echo "serve_compare: unknown server '${s}' (kiln, llama-server)" >&2; exit 2 ;;
    esac
    load "${s}" "${out}"
    stop_server
    OUTS+=("${out}")
done

# --- report
CPU_MODEL="$(grep -m1 '^model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')"
KILN_REV="$(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD 2>/dev/null || echo '+dirty')"
LCP="$(grep -E '^llama-cpp-python==' scripts/requirements-llama-cpp.txt | cut -d= -f3)"
echo
echo "## kiln serve vs llama-server ($(date -u +%Y-%m-%d), kiln ${KILN_REV}, llama.cpp ${BUILD} build from llama-cpp-python ${LCP})"
echo
echo "CPU: ${CPU_MODEL}, ${NCPU} logical CPUs; servers on CPUs ${SERVER_CPUS} with ${THREADS} threads, load generator on CPUs ${CLIENT_CPUS}."
echo "Model $(basename "${MODEL}"); ${MAX_TOKENS} tokens per request (ignore_eos), streaming /v1/completions, greedy; ${SLOTS} slots, ${CTX} context each."
echo
"${PY}" - "${OUTS[@]}" <<'PYEOF'
import json, sys
runs = {}
order = []
for path in sys.argv[1:]:
    for row in json.load(open(path)):
        runs.setdefault(row["server"], {})[row["concurrency"]] = row
        if row["server"] not in order:
            order.append(row["server"])
def f(v, fmt="%.1f"):
    return "-" if v is None else fmt % v
levels = sorted({c for r in runs.values() for c in r})
print("| clients | server | tok/s | req/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | errors | short |")
print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
for c in levels:
    for s in order:
        r = runs[s].get(c)
        if r:
            print("| %d | %s | %.1f | %.2f | %s | %s | %s | %s | %d | %d |" % (
                c, s, r["tokens_per_s"], r["requests_per_s"], f(r["ttft_p50_ms"]),
                f(r["ttft_p99_ms"]), f(r["itl_p50_ms"]), f(r["itl_p99_ms"]), r["errors"], r["short"]))
if "kiln" in runs and "llama-server" in runs:
    print()
    print("kiln / llama-server (tok/s: higher is better for kiln; latencies: lower is better):")
    print()
    print("| clients | tok/s | TTFT p99 | ITL p99 |")
    print("|---:|---:|---:|---:|")
    for c in levels:
        k, l = runs["kiln"].get(c), runs["llama-server"].get(c)
        if not (k and l):
            continue
        def ratio(key):
            a, b = k[key], l[key]
            return "%.2f" % (a / b) if a is not None and b else "-"
        print("| %d | %s | %s | %s |" % (c, ratio("tokens_per_s"), ratio("ttft_p99_ms"), ratio("itl_p99_ms")))
bad = [(s, c) for s in runs for c, r in runs[s].items() if r["errors"] or r["short"]]
if bad:
    print()
    print("WARNING: errors or completions of another length than asked at: %s" % ", ".join("%s/%d" % b for b in bad))
PYEOF
echo
echo "Commands (logs in ${LOGS}/):"
echo
echo '```sh'
cat "${LOGS}/serve-commands.txt"
echo '```'
