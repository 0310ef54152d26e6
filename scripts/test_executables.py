#!/usr/bin/env python3
"""Reads cargo's `--message-format=json` output (`cargo test --no-run`) from the file named by the
first argument and prints one line per test executable: `test-<name> <path>`, where <name> is
the test target's name, or `lib` for the library's unit tests. scripts/gpu-pack.sh copies them
and scripts/gpu-check.sh links them under those names. Standard library only."""

import json
import sys


def main(path: str) -> int:
    for line in open(path):
        try:
            m = json.loads(line)
        except ValueError:
            continue
        if m.get("reason") != "compiler-artifact" or not m.get("executable") or not m["profile"]["test"]:
            continue
        name = "lib" if "lib" in m["target"]["kind"] else m["target"]["name"]
        print(f"test-{name} {m['executable']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
