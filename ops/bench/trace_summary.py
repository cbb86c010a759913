"""Summarizes a Kineto trace of one training step (`trainq bench train --trace DIR`): GPU time by
kernel family and by kernel name, how long the GPU sat idle inside the step, and the
matmul-only limit (the step's GEMM and attention time alone, at the speed they ran). A trace
recorded with `--trace-ops` also holds the CPU operators: kernels are then summed by the
operator that launched them (the autograd node in the backward pass, and the innermost aten op).

    python ops/bench/trace_summary.py TRACE.json[.gz] [top_n]
"""
import bisect
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


def launching_ops(events):
    """Kernel correlation id -> "outer / inner" name of the CPU operators that launched it, from
    the runtime call's thread and time (operators nest by time on their thread)."""
    ops_by_tid = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation"):
            ops_by_tid[e["tid"]].append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), e["name"]))
    parents = {}
    for tid, ops in ops_by_tid.items():
        ops.sort(key=lambda o: (o[0], -o[1]))
        stack, parent = [], []
        for i, (start, end, _) in enumerate(ops):
            while stack and ops[stack[-1]][1] < start:
                stack.pop()
            parent.append(stack[-1] if stack else -1)
            stack.append(i)
        parents[tid] = parent
    starts = {tid: [o[0] for o in ops] for tid, ops in ops_by_tid.items()}
    names = {}
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in ("cuda_runtime", "cuda_driver"):
            continue
        corr = e.get("args", {}).get("correlation")
        tid, t = e["tid"], float(e["ts"])
        if corr is None or tid not in ops_by_tid:
            continue
        ops, parent = ops_by_tid[tid], parents[tid]
        i = bisect.bisect_right(starts[tid], t) - 1
        while i >= 0 and ops[i][1] < t:
            i = parent[i]
        chain = []
        while i >= 0:
            chain.append(ops[i][2])
            i = parent[i]
        if not chain:
            continue
        node = next((n.split(": ", 1)[1] for n in chain if n.startswith("autograd::engine::evaluate_function")), None)
        outer = node or chain[-1]
        names[corr] = outer if outer == chain[0] else f"{outer} / {chain[0]}"
    return names


def by_operator(events, top):
    """GPU time per launching operator, or None when the trace holds no CPU operators."""
    names = launching_ops(events)
    if not names:
        return None
    sums = defaultdict(lambda: [0.0, 0])
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "kernel":
            name = names.get(e.get("args", {}).get("correlation"), "(no operator)")
            sums[name][0] += float(e.get("dur", 0))
            sums[name][1] += 1
    lines = ["", "| launching operator | ms | kernels |", "|---|---:|---:|"]
    for name, (us, n) in sorted(sums.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"| `{name[:120]}` | {us / 1e3:.2f} | {n} |")
    return "\n".join(lines)


def main():
    path = sys.argv[1]
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 25
    print(f"## {path.rsplit('/', 1)[-1]}\n")
    events = load(path)
    print(summarize(events, top))
    ops = by_operator(events, top)
    if ops:
        print(ops)


if __name__ == "__main__":
    main()
