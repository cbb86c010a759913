"""Sums an Nsight Compute CSV (one row per kernel, metric gpu__time_duration.sum) by kernel
family and by kernel name: where one profiled training step spends its GPU time.

    python ops/bench/ncu_summary.py ncu.csv [top_n]
"""
import csv
import re
import sys
from collections import defaultdict

FAMILIES = [
    ("attention", r"sdpa|flash|fmha|attention|cudnn"),
    ("gemm", r"gemm|cutlass|xmma|nvjet|sm90_|cublas"),
    ("norm", r"rms|layer_norm|norm_kernel"),
    ("reduce", r"reduce|softmax|logsumexp|norm"),
    ("copy/cat/cast", r"copy|cat|CatArray|direct_copy|to_kind|convert"),
    ("index/scatter/gather", r"index|scatter|gather|embedding"),
    ("elementwise", r"elementwise|vectorized|unrolled|pointwise|roll"),
]


def family(name):
    for fam, pattern in FAMILIES:
        if re.search(pattern, name, re.IGNORECASE):
            return fam
    return "other"


def main():
    path = sys.argv[1]
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 25
    rows = []
    with open(path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]
    for row in csv.DictReader(lines):
        value = row.get("gpu__time_duration.sum") or row.get("Metric Value")
        name = row.get("Kernel Name") or row.get("Function Name") or "?"
        try:
            rows.append((name, float(str(value).replace(",", ""))))
        except ValueError:
            continue
    total = sum(ns for _, ns in rows)
    by_family = defaultdict(lambda: [0.0, 0])
    by_name = defaultdict(lambda: [0.0, 0])
    for name, ns in rows:
        by_family[family(name)][0] += ns
        by_family[family(name)][1] += 1
        short = re.sub(r"\(.*", "", name)[:110]
        by_name[short][0] += ns
        by_name[short][1] += 1
    print(f"kernels: {len(rows)}, GPU time: {total / 1e6:.1f} ms")
    print("\n| family | ms | % | kernels |\n|---|---:|---:|---:|")
    for fam, (ns, n) in sorted(by_family.items(), key=lambda kv: -kv[1][0]):
        print(f"| {fam} | {ns / 1e6:.1f} | {100 * ns / total:.1f} | {n} |")
    print("\n| kernel | ms | % | count |\n|---|---:|---:|---:|")
    for name, (ns, n) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"| `{name}` | {ns / 1e6:.1f} | {100 * ns / total:.1f} | {n} |")


if __name__ == "__main__":
    main()
