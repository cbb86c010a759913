"""PyTorch reference for trainq's policy loss and optimizer step (tests/loss_reference.rs).

Usage: loss_ref.py IN.json OUT.json

IN holds "loss_cases" (a linear log-softmax policy, per-token data and a loss config) and
"trainers" (each a linear policy, packed micro-batches and a train config). The formulas are written
independently of the Rust code, with explicit loops over sequences, straight from their
definitions: PPO clip, CISPO, GSPO (geometric-mean sequence ratio), k3 KL, token- or
sequence-mean, torch.nn.utils.clip_grad_norm_ and torch.optim.AdamW. OUT holds the loss parts,
the gradient of the loss with respect to W (loss cases) and W after every step (trainers).
"""
import json
import math
import sys

import torch



def policy_loss(new, sampler, adv, mask, seq, cfg, normalizer, ref=None):
    """Sum over trained tokens of weight * (policy term + kl_coef * k3), over normalizer."""
    eps = cfg["epsilon"]
    eps_high = cfg.get("epsilon_high") if cfg.get("epsilon_high") is not None else eps
    lo, hi = 1.0 - eps, 1.0 + eps_high
    sequences = sorted({int(s) for s, m in zip(seq, mask) if m})
    policy = new.new_zeros(())
    kl = new.new_zeros(())
    clipped = 0
    ratio_sum = 0.0
    for s in sequences:
        idx = [t for t in range(len(seq)) if mask[t] and int(seq[t]) == s]
        logp = new[idx]
        old = torch.stack([new[t].detach() if math.isnan(sampler[t]) else torch.tensor(sampler[t]) for t in idx])
        if cfg["ratio_level"] == "sequence":
            ratios = torch.exp((logp - old).mean()).expand(len(idx))
        else:
            ratios = torch.exp(logp - old)
        weight = 1.0 if cfg["normalization"] == "token_mean" else 1.0 / len(idx)
        for k, t in enumerate(idx):
            r, a = ratios[k], adv[t]
            rc = r.clamp(lo, hi)
            if cfg["kind"] == "ppo_clip":
                term = -torch.minimum(r * a, rc * a)
                clipped += int((r.item() < lo and a < 0) or (r.item() > hi and a > 0))
            else:
                term = -(rc.detach() * a * logp[k])
                clipped += int(r.item() < lo or r.item() > hi)
            policy = policy + weight * term
            ratio_sum += r.item()
            if ref is not None:
                d = ref[t] - logp[k]
                kl = kl + weight * (torch.exp(d) - d - 1.0)
    loss = (policy + cfg["kl_coef"] * kl) / normalizer
    parts = {"policy_loss": policy.item() / normalizer, "kl": kl.item() / normalizer,
             "clipped_tokens": clipped, "ratio_sum": ratio_sum,
             "tokens": int(sum(1 for m in mask if m))}
    return loss, parts


def run_loss_case(case):
    X = torch.tensor(case["x"])
    W = torch.tensor(case["w"], requires_grad=True)
    targets = torch.tensor(case["targets"])
    new = torch.log_softmax(X @ W, dim=-1).gather(1, targets[:, None])[:, 0]
    ref = None
    if case.get("reference_w") is not None:
        with torch.no_grad():
            ref = torch.log_softmax(X @ torch.tensor(case["reference_w"]), dim=-1).gather(1, targets[:, None])[:, 0]
    sampler = [float("nan") if v is None else v for v in case["sampler_logprobs"]]
    loss, parts = policy_loss(new, sampler, case["advantages"], case["mask"], case["sequence_index"],
                              case["config"], case["normalizer"], ref)
    loss.backward()
    return {"loss": loss.item(), **parts, "grad_w": W.grad.flatten().tolist()}


def token_logprobs(embed, w, input_ids, targets):
    return torch.log_softmax(embed[input_ids] @ w, dim=-1).gather(1, targets[:, None])[:, 0]


def run_trainer(spec):
    embed = torch.tensor(spec["embed"])
    w = torch.tensor(spec["w"], requires_grad=True)
    w0 = w.detach().clone()
    cfg = spec["config"]
    opt = cfg["optimizer"]
    adamw = torch.optim.AdamW([w], lr=opt["learning_rate"], betas=tuple(opt["betas"]),
                              eps=opt["eps"], weight_decay=opt["weight_decay"])
    batches = spec["batches"]
    key = "loss_mask"
    if cfg["loss"]["normalization"] == "token_mean":
        normalizer = sum(sum(b[key]) for b in batches)
    else:
        normalizer = sum(len({s for s, m in zip(b["sequence_index"], b[key]) if m}) for b in batches)
    steps = []
    for _ in range(spec["steps"]):
        adamw.zero_grad()
        total = 0.0
        for b in batches:
            ids, targets = torch.tensor(b["input_ids"]), torch.tensor(b["targets"])
            new = token_logprobs(embed, w, ids, targets)
            ref = token_logprobs(embed, w0, ids, targets).detach() if cfg["loss"]["kl_coef"] > 0 else None
            sampler = [float("nan") if v is None else v for v in b["sampler_logprobs"]]
            loss, _ = policy_loss(new, sampler, b["advantages"], b[key], b["sequence_index"],
                                  cfg["loss"], normalizer, ref)
            loss.backward()
            total += loss.item()
        norm = torch.nn.utils.clip_grad_norm_([w], opt["max_grad_norm"]).item()
        adamw.step()
        steps.append({"loss": total, "grad_norm": norm, "w": w.detach().flatten().tolist()})
    return steps


def main():
    spec = json.load(open(sys.argv[1]))
    out = {"loss_cases": [run_loss_case(c) for c in spec["loss_cases"]],
           "trainers": [run_trainer(t) for t in spec["trainers"]]}
    json.dump(out, open(sys.argv[2], "w"))


if __name__ == "__main__":
    main()
