#!/usr/bin/env bash
# Prints the environment (one VAR=value per line) of a decode-megakernel variant, the names that
# scripts/gpu-check.sh (KILN_GPU_MK_ROWS, KILN_GPU_TEST_VARIANTS) and scripts/gpu-pack.sh
# (KILN_GPU_PACK_VARIANTS) take:
#   default   nothing (the built-in kernel)
#   nostage   KILN_MK_STAGE=0     no shared-memory weight staging
#   split     KILN_MK_SPLIT=1     rows of small matvec tiles split across warps (default: where tiles are small)
#   preload   KILN_MK_PRELOAD=1   tile arguments loaded before the dependency wait (the default)
#   xstage    KILN_MK_XSTAGE=1    matvec input rows copied into shared memory once per tile
#   fuse      KILN_MK_FUSE_ATTN=1 query RoPE and KV append folded into the attention tiles (the default)
#   scfence   KILN_MK_SC_FENCE=1  tiles publish with __threadfence + release reds (the old way)
#   noattstage KILN_MK_ATT_STAGE=0 attention tiles read every key from the cache
#   nopreload KILN_MK_PRELOAD=0   tile arguments loaded after the dependency wait
#   unfused   KILN_MK_FUSE_ATTN=0 query RoPE and KV append as tiles of their own
#   nosplit   KILN_MK_SPLIT=0     no split rows even where tiles are small
#   timeline  KILN_MK_TIMELINE=mk-timeline  per-tile wait/work times of each graph's last step,
#             written to ./mk-timeline/mk-timeline-bB.csv at each stop (a diagnostic)
#   N         KILN_MK_MATVEC_ROWS=N   matvec output rows per tile
#   bytesN    KILN_MK_STAGE_BYTES=N   one staging buffer's bytes (bytes2048: partial attention
#             staging and split rows on the fixtures)
# and combinations joined by '+' (split+4). An unknown name is an error (exit 1).
set -euo pipefail
[[ $# -eq 1 ]] || { echo "usage: $0 VARIANT" >&2; exit 2; }
IFS=+ read -r -a parts <<<"$1"
[[ ${#parts[@]} -gt 0 ]] || { echo "mk-variant: empty variant" >&2; exit 1; }
for p in "${parts[@]}"; do
    case $p in
    default) ;;
    nostage) echo KILN_MK_STAGE=0 ;;
    split) echo KILN_MK_SPLIT=1 ;;
    preload) echo KILN_MK_PRELOAD=1 ;;
    xstage) echo KILN_MK_XSTAGE=1 ;;
    fuse) echo KILN_MK_FUSE_ATTN=1 ;;
    scfence) echo KILN_MK_SC_FENCE=1 ;;
    noattstage) echo KILN_MK_ATT_STAGE=0 ;;
    nopreload) echo KILN_MK_PRELOAD=0 ;;
    unfused) echo KILN_MK_FUSE_ATTN=0 ;;
    nosplit) echo KILN_MK_SPLIT=0 ;;
    timeline) echo KILN_MK_TIMELINE=mk-timeline ;;
    bytes[0-9]*) echo "KILN_MK_STAGE_BYTES=${p#bytes}" ;;
    *[!0-9]* | "") echo "mk-variant: unknown megakernel variant '$p' in '$1'" >&2 && exit 1 ;;
    *) echo "KILN_MK_MATVEC_ROWS=$p" ;;
    esac
done
