"""Summarizes a Kineto trace of one training step (`trainq bench train --trace DIR`): GPU time by
kernel family and by kernel name, how long the GPU sat idle inside the step, and the
matmul-only limit (the step's GEMM and attention time alone, at the speed they ran).

    python ops/bench/trace_summary.py TRACE.json[.gz] [top_n]
"""
import gzip
import json
import re
import sys
from collections import defaultdict

from ncu_summary import family

GPU_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}


def load(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def busy_and_gaps(intervals):
    """Union length of [start, end) intervals and the gaps between them, longest first."""
    intervals.sort()
    busy, gaps = 0.0, []
    cur_start, cur_end = intervals[0]
    for start, end in intervals[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            gaps.append((start - cur_end, cur_end))
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    busy += cur_end - cur_start
    return busy, sorted(gaps, reverse=True)


def summarize(events, top):
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES]
    if not gpu:
        return "no GPU events in the trace"
    intervals = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in gpu]
    window = max(end for _, end in intervals) - min(start for start, _ in intervals)
    busy, gaps = busy_and_gaps(intervals)
    by_family = defaultdict(lambda: [0.0, 0])
    by_name = defaultdict(lambda: [0.0, 0])
    for e in gpu:
        name = e.get("name", "?") if e["cat"] == "kernel" else e["cat"]
        fam = family(name) if e["cat"] == "kernel" else "copy/cat/cast"
        by_family[fam][0] += float(e.get("dur", 0))
        by_family[fam][1] += 1
        short = re.sub(r"\(.*", "", name)[:110]
        by_name[short][0] += float(e.get("dur", 0))
        by_name[short][1] += 1
    total = sum(us for us, _ in by_family.values())
    matmul = by_family["gemm"][0] + by_family["attention"][0]
    lines = [
        f"step window (first to last GPU event): {window / 1e3:.1f} ms; GPU busy {busy / 1e3:.1f} ms "
        f"({100 * busy / window:.1f}%), idle {(window - busy) / 1e3:.1f} ms in {len(gaps)} gaps "
        f"(longest {gaps[0][0] / 1e3 if gaps else 0:.2f} ms)",
        f"kernels: {len(gpu)}, GPU time {total / 1e3:.1f} ms; matmul-only limit (GEMM + attention) "
        f"{matmul / 1e3:.1f} ms = {100 * matmul / window:.1f}% of the window; the rest "
        f"{(window - matmul) / 1e3:.1f} ms",
        "",
        "| family | ms | % of GPU time | kernels |",
        "|---|---:|---:|---:|",
    ]
    for fam, (us, n) in sorted(by_family.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"| {fam} | {us / 1e3:.1f} | {100 * us / total:.1f} | {n} |")
    lines += ["", "| kernel | ms | % | count |", "|---|---:|---:|---:|"]
    for name, (us, n) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"| `{name}` | {us / 1e3:.2f} | {100 * us / total:.1f} | {n} |")
    return "\n".join(lines)


def main():
    path = sys.argv[1]
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 25
    print(f"## {path.rsplit('/', 1)[-1]}\n")
    print(summarize(load(path), top))


if __name__ == "__main__":
    main()
