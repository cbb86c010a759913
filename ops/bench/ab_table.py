#!/usr/bin/env python3
"""The same-call A/B table of `ops/gpu.sh ab`: per row, each binary's tok/s (peak GiB) and the
new binary's gain over the base, from ab.jsonl (`bench train` lines tagged "binary")."""
import json
import sys
from collections import defaultdict


def main(path):
    rows = defaultdict(lambda: defaultdict(list))
    for line in open(path):
        r = json.loads(line)
        if "binary" not in r:
            continue
        key = f"{r['shape']} {r['mode']} {r['micro']}x{r['seq']}"
        if r.get("accumulate", 1) > 1:
            key += f" acc{r['accumulate']}"
        if r.get("packed"):
            key += " packed"
        rows[key][r["binary"]].append((r["tokens_per_s"], r["peak_mem_gib"]))

    def cell(runs):
        return " / ".join(f"{t:,.0f} ({m})" for t, m in runs)

    def mean(runs):
        return sum(t for t, _ in runs) / len(runs)

    print("| row | base tok/s (GiB) | new tok/s (GiB) | gain |")
    print("|---|---|---|---|")
    for key, by_binary in rows.items():
        base, new = by_binary.get("trainq-base", []), by_binary.get("trainq", [])
        gain = f"{100 * (mean(new) / mean(base) - 1):+.1f} %" if base and new else "—"
        print(f"| {key} | {cell(base)} | {cell(new)} | {gain} |")


if __name__ == "__main__":
    main(sys.argv[1])
