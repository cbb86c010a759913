"""Peer baseline: Hugging Face transformers (+ PEFT LoRA) training throughput on Qwen3 shapes.

Run it on the GPU machine in the same call as trainq's own benchmark and report the ratio.
Random weights and random token ids (no model hub there); causal-LM loss over every token.

    python3 hf_peft_train.py --shape qwen3-0.6b --mode lora --seq 4096 --micro 4
    python3 hf_peft_train.py --all          # the standard table
    python3 hf_peft_train.py --docs docs.json   # trainq's --packed documents, padded per trajectory

This copy (ops/bench) adds `--docs FILE` to the shared script (../shared/bench, kept as it is):
the same documents `trainq bench train --packed --docs-out FILE` trained on, run the way a
transformers user runs variable-length trajectories — each trajectory its own row, padded to the
longest in its micro-batch (attention_mask 0 and label -100 on padding), micro-batches of at most
seq × micro padded tokens taken in order, one optimizer step over all of them. tokens/s counts
real (non-pad) tokens. It also adds the `qwen3-32b` shape (the seed's model), built directly in
bf16 (an f32 32B model would not fit before the cast); other shapes are built as in the shared
script.

Prints one JSON line per configuration: tokens/s, step time, peak memory, model TFLOP/s and the
fraction of a measured bf16 matmul peak (MFU). FLOPs per token: forward 2N + causal attention;
backward 2N for activations, +2N for weight gradients when full; +1 forward with checkpointing.
"""
import argparse, gc, json, os, time
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

SHAPES = {
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
    "qwen3-32b": dict(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8, tie_word_embeddings=False),
}
STANDARD = [  # shape, mode, seq, micro, checkpointing
    ("qwen3-0.6b", "lora", 4096, 4, False),
    ("qwen3-0.6b", "full", 4096, 4, False),
    ("qwen3-1.7b", "lora", 4096, 4, False),
    ("qwen3-8b", "lora", 4096, 2, True),
]


def matmul_peak_tflops():
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(5):
        a @ b
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(); s.record()
    for _ in range(50):
        a @ b
    e.record(); torch.cuda.synchronize()
    return 2 * 8192**3 * 50 / (s.elapsed_time(e) / 1e3) / 1e12


def batches_of(docs, budget, vocab):
    """Micro-batches of trajectories in order, each padded to its longest, at most `budget` padded tokens."""
    g = torch.Generator().manual_seed(0)
    out, cur = [], []
    for n in docs:
        if cur and (len(cur) + 1) * max(max(cur), n) > budget:
            out.append(cur); cur = []
        cur.append(n)
    if cur:
        out.append(cur)
    made = []
    for lens in out:
        width = max(lens)
        ids = torch.zeros(len(lens), width, dtype=torch.long)
        mask = torch.zeros(len(lens), width, dtype=torch.long)
        for r, n in enumerate(lens):
            ids[r, :n] = torch.randint(0, vocab, (n,), generator=g)
            mask[r, :n] = 1
        labels = ids.masked_fill(mask == 0, -100)
        made.append((ids.cuda(), mask.cuda(), labels.cuda()))
    return made


def run(shape, mode, seq, micro, ckpt, steps=5, peak=None, docs=None):
    cfg = Qwen3Config(vocab_size=151936, head_dim=128, max_position_embeddings=40960, rope_theta=1e6, **SHAPES[shape])
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    if shape == "qwen3-32b":
        torch.set_default_dtype(torch.bfloat16)
        with torch.device("cuda"):
            model = Qwen3ForCausalLM(cfg)
        torch.set_default_dtype(torch.float32)
    else:
        with torch.device("cuda"):
            model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    n_params = sum(p.numel() for p in model.parameters())
    if mode == "lora":
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=[
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if mode == "lora":
            model.enable_input_require_grads()
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, fused=True)
    if docs:
        batches = batches_of(docs, seq * micro, cfg.vocab_size)
        real_tokens = sum(docs)
    else:
        ids = torch.randint(0, cfg.vocab_size, (micro, seq), device="cuda")
        batches = [(ids, None, ids)]
        real_tokens = micro * seq
    torch.cuda.reset_peak_memory_stats()

    def step():
        for ids, mask, labels in batches:
            model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        opt.step(); opt.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize(); dt = (time.perf_counter() - t) / steps
    toks = real_tokens / dt
    context = sum(n * n for n in docs) / real_tokens if docs else seq
    fwd = 2 * n_params + 2 * cfg.num_hidden_layers * context * cfg.num_attention_heads * 128
    flops = fwd * ((3 if mode == "full" else 2) + (1 if ckpt else 0)) * toks
    res = dict(impl="hf+peft" if mode == "lora" else "hf", shape=shape, mode=mode, seq=seq, micro=micro,
               ckpt=ckpt, params_b=round(n_params / 1e9, 3), tokens_per_s=round(toks), step_s=round(dt, 4),
               model_tflops=round(flops / 1e12, 1), peak_mem_gib=round(torch.cuda.max_memory_allocated() / 2**30, 1))
    if peak:
        res["mfu"] = round(flops / 1e12 / peak, 3)
    if docs:
        res["packed"] = dict(docs=len(docs), real_tokens=real_tokens, padded_tokens=sum(b[0].numel() for b in batches),
                             micro_batches=len(batches), layout="padded per trajectory")
    del model, opt, batches
    gc.collect(); torch.cuda.empty_cache()
    return res


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=SHAPES, default="qwen3-0.6b")
    ap.add_argument("--mode", choices=["lora", "full"], default="lora")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--ckpt", action="store_true", help="gradient checkpointing")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--all", action="store_true", help="run the standard table")
    ap.add_argument("--docs", help="JSON from `trainq bench train --packed --docs-out`: run those documents padded per trajectory")
    a = ap.parse_args()
    peak = matmul_peak_tflops()
    print(json.dumps(dict(bf16_matmul_tflops=round(peak, 1))), flush=True)
    plan = STANDARD if a.all else [(a.shape, a.mode, a.seq, a.micro, a.ckpt)]
    doc_lists = [None] * len(plan)
    if a.docs:
        entries = json.load(open(a.docs))
        plan = [(a.shape, a.mode, e["seq"], e["micro"], a.ckpt) for e in entries]
        doc_lists = [e["docs"] for e in entries]
    for p, docs in zip(plan, doc_lists):
        try:
            r = run(*p, steps=a.steps, peak=peak, docs=docs)
        except torch.OutOfMemoryError:
            r = dict(shape=p[0], mode=p[1], seq=p[2], micro=p[3], ckpt=p[4], error="out of memory")
            gc.collect(); torch.cuda.empty_cache()
        print(json.dumps(r), flush=True)
