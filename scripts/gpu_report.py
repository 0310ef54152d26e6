#!/usr/bin/env python3
"""The two jobs scripts/gpu-check.sh gives Python (standard library only):

    gpu_report.py compare REF.json GOT.json   # kiln --json outputs: are the greedy ids identical?
    gpu_report.py table WORKDIR               # the final tables from WORKDIR's stage results

`compare` prints one line, `identical N/N tokens` (exit 0) or where the first row diverges
(exit 1); every row of GOT (`--samples`) is compared with REF's first row, since greedy rows of
one prompt must all equal the batch-1 result.

`table` reads WORKDIR/stages.tsv (stage, result, seconds), WORKDIR/bandwidth-*.json,
WORKDIR/bench__<model>__<path>.json (kiln-bench -o json) and WORKDIR/torch-*.jsonl
(scripts/torch_compare.py), and prints the stage table, the bandwidths, and one row per kiln
decode measurement with PyTorch's number for the same model (matched by parameter count) and
batch, and the ratio kiln / PyTorch.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def ids(doc: dict) -> list[list[int]]:
    rows = doc.get("rows") or [{"generated_ids": doc.get("generated_ids", [])}]
    return [r.get("generated_ids", []) for r in rows]


def compare(ref_path: str, got_path: str) -> int:
    ref = ids(json.loads(Path(ref_path).read_text()))[0]
    for i, row in enumerate(ids(json.loads(Path(got_path).read_text()))):
        k = next((j for j, (a, b) in enumerate(zip(ref, row)) if a != b), None)
        if k is None and len(ref) != len(row):
            k = min(len(ref), len(row))
        if k is not None:
            got = row[k] if k < len(row) else "end"
            want = ref[k] if k < len(ref) else "end"
            print(f"row {i} diverges at token {k} of {len(ref)}: {got} instead of {want}")
            return 1
    print(f"identical {len(ref)}/{len(ref)} tokens" + (f" in {i + 1} rows" if i else ""))
    return 0


def md(head: list[str], body: list[list[str]]) -> str:
    w = [max([len(h)] + [len(r[c]) for r in body]) for c, h in enumerate(head)]
    line = lambda cells: "| " + " | ".join(v.ljust(w[c]) for c, v in enumerate(cells)) + " |"
    return "\n".join([line(head), "|" + "|".join("-" * (x + 2) for x in w) + "|"] + [line(r) for r in body])


def table(work: str) -> int:
    d = Path(work)
    out = []
    stages = []
    tsv = d / "stages.tsv"
    if tsv.exists():
        for ln in tsv.read_text().splitlines():
            parts = ln.split("\t")
            if len(parts) >= 3:
                stages.append([parts[0], parts[2] + " s", parts[1]])
    out.append(md(["stage", "time", "result"], stages))

    bws = []
    for f in sorted(d.glob("bandwidth-*.json")):
        if not f.read_text().strip():
            continue  # the stage failed; the stage table says why
        try:
            v = json.loads(f.read_text().strip().splitlines()[-1])
            bws.append(f"{f.stem}: {v['bytes_per_s'] / 1e9:.1f} GB/s (median {v['median_ms']:.3f} ms for "
                       f"{v['bytes_moved'] / 2**30:.2f} GiB read + written)")
        except (ValueError, KeyError, IndexError) as e:
            bws.append(f"{f.stem}: unreadable ({e})")
    if bws:
        out.append("\n".join(bws))

    torch = {}
    for f in sorted(d.glob("torch-*.jsonl")):
        for ln in f.read_text().splitlines():
            try:
                v = json.loads(ln)
            except ValueError:
                continue
            if "tokens_per_s" in v:
                torch[(v.get("num_params"), v["batch"])] = v
    rows = []
    for f in sorted(d.glob("bench__*.json")):
        parts = f.stem.split("__")
        path = parts[2] if len(parts) == 3 else "?"
        try:
            bench = json.loads(f.read_text())
        except ValueError:
            continue
        for r in bench:
            # A CPU row against PyTorch on the GPU would be no comparison.
            t = torch.get((r.get("n_params"), r.get("batch"))) if path != "cpu" else None
            rows.append([
                r["model"], path, r["backend"], str(r["batch"]), r["test"],
                f"{r['tokens_per_s']:.1f}", f"{r['ms_per_token']:.4f}", f"{r['roofline_pct']:.1f}",
                f"{t['tokens_per_s']:.1f}" if t else "-",
                f"{r['tokens_per_s'] / t['tokens_per_s']:.2f}" if t else "-",
            ])
    if rows:
        out.append(md(["model", "decode", "backend", "batch", "test", "kiln t/s", "ms/token",
                       "% of BW", "torch t/s", "kiln/torch"], rows))
    print("\n\n".join(out))
    return 0


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "compare":
        return compare(argv[1], argv[2])
    if len(argv) == 2 and argv[0] == "table":
        return table(argv[1])
    print(__doc__.strip().split("\n\n")[1], file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
