#!/usr/bin/env python3
"""Summarises a decode-megakernel timeline (KILN_MK_TIMELINE=DIR writes DIR/mk-timeline-bB.csv:
one line per tile of a graph's last step, with when its block reached it, when its dependency
wait ended and when its work ended, in ns).

    python3 scripts/mk_timeline.py mk-timeline/mk-timeline-b1.csv [--top 15]

Prints the step's span, how the blocks spent it (waiting, working, idle after their last tile),
each tile kind's work times, and the critical path walked back from the last tile: at each tile,
either its wait ended after its last producer finished (a hand-off: the gap is the signal's
latency) or its block reached it late because the block's previous tile was still running (a
queue: the round-robin schedule put two dependent-in-time tiles on one block). The sums along
that path say whether a step is work, hand-offs or queueing.
"""
import argparse
import csv
import statistics
import sys
from collections import defaultdict


def load(path):
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    tiles = []
    for r in rows:
        waits = [w for w in r["waits"].split(";") if w]
        tiles.append(
            dict(
                t=int(r["tile"]),
                instr=int(r["instr"]),
                name=r["name"],
                lo=int(r["lo"]),
                hi=int(r["hi"]),
                waits=waits,
                block=int(r["block"]),
                sm=int(r["sm"]),
                reached=int(r["reached_ns"]),
                waited=int(r["waited_ns"]),
                done=int(r["done_ns"]),
            )
        )
    return tiles


def us(ns):
    return f"{ns / 1000:.2f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=15, help="critical-path tiles to list")
    a = ap.parse_args()
    tiles = load(a.csv)
    if not tiles:
        sys.exit(f"{a.csv}: no tiles")
    span = max(t["done"] for t in tiles) - min(t["reached"] for t in tiles)
    blocks = defaultdict(list)
    for t in tiles:
        blocks[t["block"]].append(t)
    instr_tiles = defaultdict(list)
    for t in tiles:
        instr_tiles[t["instr"]].append(t)
    # Each instruction's last tile to finish: the one its counter waited for.
    instr_last = {i: max(v, key=lambda x: x["done"]) for i, v in instr_tiles.items()}
    by_t = {t["t"]: t for t in tiles}

    print(f"{a.csv}: {len(tiles)} tiles on {len(blocks)} blocks, {len(instr_tiles)} instructions; step {us(span)} us")
    wait = sum(t["waited"] - t["reached"] for t in tiles)
    work = sum(t["done"] - t["waited"] for t in tiles)
    end = max(t["done"] for t in tiles)
    tail = sum(end - max(x["done"] for x in b) for b in blocks.values())
    total = span * len(blocks)
    print(
        f"block time: waiting {100 * wait / total:.1f}%, working {100 * work / total:.1f}%, "
        f"idle after the last tile {100 * tail / total:.1f}%, between tiles {100 * (total - wait - work - tail) / total:.1f}%"
    )

    print("\nwork per tile by kind (us): tiles, median, p90, max, sum over tiles")
    kinds = defaultdict(list)
    for t in tiles:
        kinds[t["name"]].append(t["done"] - t["waited"])
    for name, v in sorted(kinds.items(), key=lambda kv: -sum(kv[1])):
        v.sort()
        print(
            f"  {name:12s} {len(v):6d} {us(statistics.median(v)):>8s} {us(v[int(0.9 * (len(v) - 1))]):>8s} "
            f"{us(v[-1]):>8s} {us(sum(v)):>10s}"
        )

    def producer(t):
        """The wait of tile t that was satisfied last: (done time, tile) of its last producer."""
        best = None
        for w in t["waits"]:
            if w[0] == "i":
                cand = instr_last.get(int(w[1:]))
            else:
                cand = by_t.get(int(w[1:]))
            if cand and (best is None or cand["done"] > best["done"]):
                best = cand
        return best

    prev_on_block = {}
    for b in blocks.values():
        b.sort(key=lambda x: x["t"])
        for p, n in zip(b, b[1:]):
            prev_on_block[n["t"]] = p

    # Walk back from the last tile to finish.
    t = max(tiles, key=lambda x: x["done"])
    path = []
    acc = defaultdict(int)
    while t is not None:
        p = producer(t)
        q = prev_on_block.get(t["t"])
        work_ns = t["done"] - t["waited"]
        acc["work"] += work_ns
        if p is not None and p["done"] >= (q["done"] if q else -1):
            # Waited on a producer: the hand-off is from its end to this wait's end.
            acc["hand-off"] += t["waited"] - p["done"]
            path.append((t, "hand-off", t["waited"] - p["done"], p))
            t = p
        elif q is not None:
            # The block was busy with its previous tile: queueing.
            acc["queue (block busy)"] += t["waited"] - q["done"]
            path.append((t, "queue", t["waited"] - q["done"], q))
            t = q
        else:
            acc["start"] += t["waited"]
            path.append((t, "start", t["waited"], None))
            t = None
    print(f"\ncritical path: {len(path)} tiles; " + ", ".join(f"{k} {us(v)} us" for k, v in acc.items()))
    gaps = [g for (_, kind, g, _) in path if kind == "hand-off"]
    if gaps:
        gaps.sort()
        print(f"  hand-offs: {len(gaps)}, median {us(statistics.median(gaps))} us, p90 {us(gaps[int(0.9 * (len(gaps) - 1))])} us")
    print(f"\nthe {a.top} longest steps on the path (tile, kind, rows, work us, gap us, gap kind):")
    for t, kind, gap, _ in sorted(path, key=lambda x: -(x[0]["done"] - x[0]["waited"] + x[2]))[: a.top]:
        print(f"  t{t['t']:<7d} {t['name']:12s} [{t['lo']},{t['hi']}) work {us(t['done'] - t['waited'])} gap {us(gap)} {kind}")

    print("\nper instruction: tiles, first reached, last wait end, last done (us from the step's start)")
    for i in sorted(instr_tiles)[: 40]:
        v = instr_tiles[i]
        print(
            f"  i{i:<5d} {v[0]['name']:12s} {len(v):5d} {us(min(x['reached'] for x in v)):>9s} "
            f"{us(max(x['waited'] for x in v)):>9s} {us(max(x['done'] for x in v)):>9s}"
        )
    if len(instr_tiles) > 40:
        print(f"  … {len(instr_tiles) - 40} more")


if __name__ == "__main__":
    main()
