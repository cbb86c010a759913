"""Summary of an end-to-end run (ops/e2e/run.sh) from its steps.csv and groups.csv.

    python3 report.py OUT_DIR      # prints one JSON object

Step period = finished_at(n) - finished_at(n-1) (the first step's period is left out: it holds
the model load). Tokens/s = real (non-pad) tokens of the step's micro-batches / period, the same
count `trainq bench train --packed` reports; trained (assistant) tokens/s is given too. Time
outside training = 1 - train / period,
where train is the step row's timings.train; the rest is claim, prepare, save, upload, commit and
waiting for groups. GPU memory comes from nvidia-smi samples (mem.csv) when present.
"""
import csv, json, os, statistics, sys

out = sys.argv[1]
rows = list(csv.DictReader(open(os.path.join(out, "steps.csv"))))
steps = []
for r in rows:
    t = json.loads(r["timings"] or "{}")
    steps.append(dict(step=int(r["step"]), start=float(r["started"]), end=float(r["finished"]),
                      tokens=int(r["real_tokens"] or 0), trained_tokens=int(r["tokens"]), timings=t,
                      claimed=int(r["groups_claimed"]), trained=int(r["groups_trained"])))
periods = []
for prev, cur in zip(steps, steps[1:]):
    period = cur["end"] - prev["end"]
    train = cur["timings"].get("train", 0.0)
    periods.append(dict(step=cur["step"], period=period, tokens=cur["tokens"], trained_tokens=cur["trained_tokens"], train=train,
                        outside=1 - train / period if period > 0 else None,
                        phases={k: v for k, v in cur["timings"].items() if k != "train"}))
res = dict(run=os.path.basename(out.rstrip("/")), steps=len(steps))
if periods:
    tot_tokens = sum(p["tokens"] for p in periods)
    tot_period = sum(p["period"] for p in periods)
    tot_train = sum(p["train"] for p in periods)
    res.update(
        tokens_per_s=round(tot_tokens / tot_period),
        trained_tokens_per_s=round(sum(p["trained_tokens"] for p in periods) / tot_period),
        tokens_per_s_while_training=round(tot_tokens / tot_train) if tot_train else None,
        time_outside_training=round(1 - tot_train / tot_period, 4),
        median_period_s=round(statistics.median(p["period"] for p in periods), 3),
        mean_tokens_per_step=round(tot_tokens / len(periods)),
        mean_phase_s={k: round(statistics.mean(p["phases"].get(k, 0.0) for p in periods), 3)
                      for k in ["batch_wait", "claim", "prepare", "save", "upload", "commit"]},
        groups_claimed=sum(s["claimed"] for s in steps), groups_trained=sum(s["trained"] for s in steps),
    )
groups_csv = os.path.join(out, "groups.csv")
if os.path.exists(groups_csv):
    res["groups_by_state"] = {f"{r['state']}{'/' + r['reason'] if r.get('reason') else ''}": int(r["count"])
                              for r in csv.DictReader(open(groups_csv))}
mem = os.path.join(out, "mem.csv")
if os.path.exists(mem):
    used = [int(l.split(",")[0].strip().split()[0]) for l in open(mem) if l.strip() and l[0].isdigit()]
    if used:
        k = max(1, len(used) // 10)
        res["gpu_mem_mib"] = dict(first_tenth_max=max(used[:k]), last_tenth_max=max(used[-k:]), max=max(used))
print(json.dumps(res))
