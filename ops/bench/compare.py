"""Side-by-side table of trainq's and the HF+PEFT peer's training benchmarks (JSON lines in).

    python3 compare.py trainq.jsonl peer.jsonl
"""
import json, sys


def load(path):
    rows = {}
    for line in open(path):
        line = line.strip()
        if not line.startswith("{"):
            continue
        r = json.loads(line)
        if "shape" in r:
            key = (r["shape"], r["mode"], r.get("micro"), bool(r.get("ckpt")), bool(r.get("packed")), r.get("seq"))
            # Offloaded rows have no peer counterpart; they stay in the raw JSON.
            if not r.get("offload"):
                rows[key] = r
    return rows


ours, peer = load(sys.argv[1]), load(sys.argv[2])
print("| shape | mode | micro×seq | ckpt | packed | peer tok/s (GiB) | trainq tok/s (GiB) | ratio | trainq MFU |")
print("|---|---|---|---|---|---|---|---|---|")
for key, p in peer.items():
    o = ours.get(key, {})
    ratio = (o["tokens_per_s"] / p["tokens_per_s"]) if "tokens_per_s" in o and "tokens_per_s" in p else None
    print(f"| {key[0]} | {key[1]} | {key[2]}×{p.get('seq', '')} | {key[3]} | {'docs, peer padded' if key[4] else 'no'} "
          f"| {p.get('tokens_per_s', p.get('error'))} ({p.get('peak_mem_gib', '')}) "
          f"| {o.get('tokens_per_s', o.get('error', 'missing'))} ({o.get('peak_mem_gib', '')}) "
          f"| {f'{ratio:.2f}×' if ratio else '—'} | {o.get('mfu', '—')} |")
