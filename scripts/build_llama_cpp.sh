#!/usr/bin/env bash
# Build llama.cpp's llama-bench, llama-server and llama-quantize from the llama-cpp-python sdist
# (which vendors llama.cpp; its version is pinned in scripts/requirements-llama-cpp.txt), for the
# comparisons in scripts/bench_compare.sh and scripts/serve_compare.sh.
#
#   scripts/build_llama_cpp.sh [--builds native,noamx]
#
# Two builds, because llama.cpp's native build (GGML_NATIVE=ON) segfaults in the prefill of
# Q4_1/Q4_K files on CPUs with AMX, while a build that names the CPU's AVX/AVX-512 features one by
# one and leaves AMX out works there; decode is fastest with the native build. The comparison
# reports the best of the two per test, and which one gave it.
#   native  GGML_NATIVE=ON                        -> .bench/llama.cpp/build-native/bin
#   noamx   GGML_NATIVE=OFF + this CPU's features  -> .bench/llama.cpp/build-noamx/bin
#           except AMX (read from /proc/cpuinfo)
#
# Idempotent: the sdist is downloaded and unpacked once, each build is configured once, and a
# finished build (its binaries present and its stamp matching the pinned version) is left alone.
# cmake and ninja come from PyPI (pinned in the same file) into .bench/tools when not on PATH.
# Runs under `nice`; about 7 minutes of 2 cores per build.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

REQ="scripts/requirements-llama-cpp.txt"
ROOT=".bench/llama.cpp"
PY="${PYTHON:-python3}"
BUILDS="native,noamx"

usage() {
    sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
}

while [[ $# -gt 0 ]]; do
    case "$1" in
        --builds) [[ $# -ge 2 ]] || usage; BUILDS="$2"; shift 2 ;;
        -h|--help) usage ;;
        *) echo "build_llama_cpp: unknown argument '$1'" >&2; usage ;;
    esac
done

pin_of() {
    local v
    v="$(grep -E "^$1==" "${REQ}" | head -n1 | cut -d= -f3)"
    [[ -n "${v}" ]] || { echo "build_llama_cpp: no '$1==' pin in ${REQ}" >&2; exit 1; }
    echo "${v}"
}
LCP_VERSION="$(pin_of llama-cpp-python)"
TARGETS=(llama-bench llama-server llama-quantize)

mkdir -p "${ROOT}"
# One build at a time: a second caller waits for the first and then finds its builds done.
exec 9>"${ROOT}/.lock"
if ! flock -n 9; then
    echo "build_llama_cpp: waiting for another build in ${ROOT} to finish" >&2
    flock 9
fi

# --- build tools
TOOLS=".bench/tools"
if ! command -v cmake >/dev/null || ! command -v ninja >/dev/null; then
    if [[ ! -x "${TOOLS}/bin/cmake" || ! -x "${TOOLS}/bin/ninja" ]]; then
        echo "build_llama_cpp: installing cmake and ninja from PyPI into ${TOOLS}" >&2
        "${PY}" -m pip install --quiet --prefix "${PWD}/${TOOLS}" \
            "cmake==$(pin_of cmake)" "ninja==$(pin_of ninja)" >&2
    fi
    export PATH="${PWD}/${TOOLS}/bin:${PATH}"
    # pip --prefix puts the modules under lib/pythonX.Y/site-packages; the console scripts need them.
    PYTHONPATH="$(ls -d "${PWD}/${TOOLS}"/lib/python*/site-packages | head -n1)${PYTHONPATH:+:${PYTHONPATH}}"
    export PYTHONPATH
fi
command -v cmake >/dev/null || { echo "build_llama_cpp: cmake not found after installing it" >&2; exit 1; }
command -v ninja >/dev/null || { echo "build_llama_cpp: ninja not found after installing it" >&2; exit 1; }

# --- sources
SRC="${ROOT}/src"
if [[ ! -f "${SRC}/.version" || "$(cat "${SRC}/.version")" != "${LCP_VERSION}" ]]; then
    rm -rf "${SRC}" "${ROOT}/sdist"
    mkdir -p "${ROOT}/sdist" "${SRC}"
    echo "build_llama_cpp: downloading the llama-cpp-python==${LCP_VERSION} sdist" >&2
    # --no-binary for this package only: with ':all:' pip would also build the sdist's build
    # dependencies (cmake among them) from source just to read its metadata.
    "${PY}" -m pip download --quiet --no-deps --no-binary llama-cpp-python \
        -d "${ROOT}/sdist" "llama-cpp-python==${LCP_VERSION}" >&2
    TARBALL="$(ls "${ROOT}"/sdist/llama_cpp_python-"${LCP_VERSION}".tar.gz 2>/dev/null | head -n1)"
    [[ -n "${TARBALL}" ]] || { echo "build_llama_cpp: the sdist did not arrive in ${ROOT}/sdist" >&2; exit 1; }
    # sdist root / vendor / llama.cpp: three components.
    tar xzf "${TARBALL}" -C "${SRC}" --strip-components=3 \
        "llama_cpp_python-${LCP_VERSION}/vendor/llama.cpp"
    [[ -f "${SRC}/CMakeLists.txt" ]] || { echo "build_llama_cpp: ${TARBALL} has no vendor/llama.cpp" >&2; exit 1; }
    echo "${LCP_VERSION}" > "${SRC}/.version"
fi

# --- the no-AMX variant names each x86 feature this CPU has (a feature it lacks would SIGILL).
noamx_flags() {
    local flags
    flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
    local out=(-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
    has() { [[ "${flags}" == *" $1 "* ]]; }
    has avx && out+=(-DGGML_AVX=ON)
    has avx2 && out+=(-DGGML_AVX2=ON)
    has fma && out+=(-DGGML_FMA=ON)
    has f16c && out+=(-DGGML_F16C=ON)
    has bmi2 && out+=(-DGGML_BMI2=ON)
    has avx_vnni && out+=(-DGGML_AVX_VNNI=ON)
    if has avx512f && has avx512bw && has avx512vl && has avx512dq && has avx512cd; then
        out+=(-DGGML_AVX512=ON)
        has avx512vbmi && out+=(-DGGML_AVX512_VBMI=ON)
        has avx512_vnni && out+=(-DGGML_AVX512_VNNI=ON)
        has avx512_bf16 && out+=(-DGGML_AVX512_BF16=ON)
    fi
    echo "${out[@]}"
}

build_one() {
    local name="$1" dir="${ROOT}/build-$1" flags
    case "${name}" in
        native) flags="-DGGML_NATIVE=ON" ;;
        noamx) flags="$(noamx_flags)" ;;
        *) echo "build_llama_cpp: unknown build '${name}' (known: native, noamx)" >&2; exit 2 ;;
    esac
    local stamp="${LCP_VERSION} ${flags}"
    local done=1 t
    for t in "${TARGETS[@]}"; do [[ -x "${dir}/bin/${t}" ]] || done=0; done
    if [[ "${done}" == 1 && -f "${dir}/.stamp" && "$(cat "${dir}/.stamp")" == "${stamp}" ]]; then
        echo "build_llama_cpp: ${name} already built in ${dir}" >&2
        return
    fi
    echo "build_llama_cpp: building ${name} (${flags}) in ${dir}" >&2
    rm -f "${dir}/.stamp"
    # shellcheck disable=SC2086  # flags is a list of -D options
    nice -n 5 cmake -S "${SRC}" -B "${dir}" -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DBUILD_SHARED_LIBS=OFF \
        ${flags} >"${dir}.configure.log" 2>&1 ||
        { echo "build_llama_cpp: configuring ${name} failed; see ${dir}.configure.log" >&2; exit 1; }
    nice -n 5 cmake --build "${dir}" --target "${TARGETS[@]}" -j "$(nproc)" >"${dir}.build.log" 2>&1 ||
        { echo "build_llama_cpp: building ${name} failed; see ${dir}.build.log" >&2; tail -n 20 "${dir}.build.log" >&2; exit 1; }
    for t in "${TARGETS[@]}"; do
        [[ -x "${dir}/bin/${t}" ]] || { echo "build_llama_cpp: ${dir}/bin/${t} missing after the build" >&2; exit 1; }
    done
    echo "${stamp}" > "${dir}/.stamp"
    echo "build_llama_cpp: ${name} done" >&2
}

IFS=, read -r -a WANT <<< "${BUILDS}"
for b in "${WANT[@]}"; do build_one "${b}"; done
for b in "${WANT[@]}"; do echo "${ROOT}/build-${b}/bin"; done
