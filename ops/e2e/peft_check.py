#!/usr/bin/env python3
"""Every committed checkpoint of an end-to-end run, loaded by peft, scores what trainq scores.

    peft_check.py --model NAME --base DIR --work DIR [--trainq BIN] [--device cuda]
                  [--sequences 4] [--min-len 512] [--max-len 2048] [--seed 0]
                  [--dtype bf16|f32] [--tolerance-mean 0.02 (bf16) / 1e-4 (f32)]

For each step of NAME in trainq.steps that has a checkpoint (psql from $TRAINQ_SERVICES_BIN,
$DATABASE_URL), `trainq checkpoint fetch` downloads it (manifest-verified) under WORK; then
  - trainq: `trainq score --model BASE --adapter step1 --adapter step2 … --device DEVICE`
    (base loaded once, each adapter swapped in), per-token log-probs in DTYPE on CUDA;
  - peft:   `PeftModel.from_pretrained(base, step1)` then `load_adapter` for each step,
    the same sequences, DTYPE on CUDA, log_softmax in f32.
In bf16 both stacks round differently by about as much as a few steps of a small-learning-rate
LoRA move the log-probs, so the bf16 check shows the checkpoints load and agree to bf16's
precision; the f32 check (`--dtype f32`) is the one that tells each adapter apart.
Sequences are random token ids (seeded, lengths uniform in [min-len, max-len]). Prints one JSON
line per checkpoint ({"step", "mean_abs", "max_abs", "shift_from_base"}: mean |Δ| between the
two stacks, max |Δ|, and how far the adapter moved log-probs from the base, so a match is not a
vacuous one), then a summary line; exits 1 if a checkpoint fails to load or the mean |Δ| of one
exceeds --tolerance-mean. bf16 on both sides with different kernels: the per-token differences
are bf16 rounding of the logits (the engine's bench check measures 0.007 mean |Δ| of bf16 CUDA
against f32 CPU).
"""
import argparse
import json
import os
import random
import subprocess
import sys

# Mean |Δ log-prob| allowed between the two stacks. bf16: rounding of bf16 logits through
# different kernels (bench check: 0.007 against f32). f32: summation order only.
TOLERANCE_MEAN = {"bf16": 0.02, "f32": 1e-4}


def psql_rows(sql):
    psql = os.path.join(os.environ.get("TRAINQ_SERVICES_BIN", ""), "psql") if os.environ.get("TRAINQ_SERVICES_BIN") else "psql"
    out = subprocess.run([psql, os.environ["DATABASE_URL"], "-AtF", "\t", "-c", sql], check=True, capture_output=True, text=True)
    return [line.split("\t") for line in out.stdout.splitlines() if line]


def fetch(trainq, model, step, to):
    if os.path.isfile(os.path.join(to, "adapter_config.json")):
        return
    subprocess.run([trainq, "checkpoint", "fetch", "--model", model, "--step", str(step), "--to", to],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def trainq_scores(trainq, base, adapters, seq_file, device, dtype):
    cmd = [trainq, "score", "--model", base, "--input", seq_file, "--device", device, "--dtype", dtype]
    for a in adapters:
        cmd += ["--adapter", a]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    lines = [json.loads(line) for line in out.splitlines() if line.strip()]
    return [line["logprobs"][1:] for line in lines]


def peft_scores(base, adapters, sequences, device, dtype):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    torch_dtype = {"bf16": torch.bfloat16, "f32": torch.float32}[dtype]
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch_dtype).to(device)
    model.eval()

    def score(m):
        rows = []
        with torch.no_grad():
            for ids in sequences:
                x = torch.tensor([ids], device=device)
                logits = m(input_ids=x).logits[0, :-1].float()
                lp = torch.log_softmax(logits, dim=-1).gather(1, x[0, 1:, None])[:, 0]
                rows.append(lp.cpu().tolist())
        return rows

    base_rows = score(model)
    peft_model = PeftModel.from_pretrained(model, adapters[0], adapter_name="a0")
    peft_model.eval()
    per_adapter = []
    for i, a in enumerate(adapters):
        name = f"a{i}"
        if i > 0:
            peft_model.load_adapter(a, adapter_name=name)
        peft_model.set_adapter(name)
        per_adapter.append(score(peft_model))
        if i > 0:
            peft_model.delete_adapter(f"a{i - 1}")
    return base_rows, per_adapter


def flat_abs_diff(a_rows, b_rows):
    diffs = []
    for a, b in zip(a_rows, b_rows):
        assert len(a) == len(b), (len(a), len(b))
        diffs.extend(abs(x - y) for x, y in zip(a, b))
    return diffs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--base", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--trainq", default=".carry/trainq")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--sequences", type=int, default=4)
    ap.add_argument("--min-len", type=int, default=512)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=["bf16", "f32"], default="bf16")
    ap.add_argument("--tolerance-mean", type=float, default=None)
    args = ap.parse_args()
    if args.tolerance_mean is None:
        args.tolerance_mean = TOLERANCE_MEAN[args.dtype]

    steps = [int(r[0]) for r in psql_rows(
        f"SELECT step FROM trainq.steps WHERE model = '{args.model}' AND checkpoint_uri IS NOT NULL ORDER BY step")]
    if not steps:
        sys.exit(f"no committed checkpoint for {args.model}")
    os.makedirs(args.work, exist_ok=True)
    adapters = []
    for step in steps:
        to = os.path.join(args.work, f"step-{step:06d}")
        fetch(args.trainq, args.model, step, to)
        adapters.append(to)

    rng = random.Random(args.seed)
    with open(os.path.join(args.base, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    sequences = [[rng.randrange(vocab) for _ in range(rng.randint(args.min_len, args.max_len))]
                 for _ in range(args.sequences)]
    seq_file = os.path.join(args.work, "sequences.jsonl")
    with open(seq_file, "w") as f:
        for ids in sequences:
            f.write(json.dumps({"ids": ids}) + "\n")

    ours = trainq_scores(args.trainq, args.base, adapters, seq_file, args.device, args.dtype)
    n = len(sequences)
    base_rows, theirs = peft_scores(args.base, adapters, sequences, args.device, args.dtype)
    worst, failed = 0.0, []
    for i, step in enumerate(steps):
        d = flat_abs_diff(ours[i * n:(i + 1) * n], theirs[i])
        shift = flat_abs_diff(theirs[i], base_rows)
        row = {"step": step, "mean_abs": sum(d) / len(d), "max_abs": max(d), "shift_from_base": sum(shift) / len(shift)}
        print(json.dumps(row), flush=True)
        worst = max(worst, row["mean_abs"])
        if row["mean_abs"] > args.tolerance_mean:
            failed.append(step)
    tokens = sum(len(s) - 1 for s in sequences)
    print(json.dumps({"checkpoints": len(steps), "dtype": args.dtype, "tokens_per_checkpoint": tokens, "worst_mean_abs": worst,
                      "tolerance_mean": args.tolerance_mean, "failed": failed}))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
