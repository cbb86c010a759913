"""Reference outputs for trainq's model tests, made with torch + transformers + peft.

    model_ref.py models OUT_DIR
        Writes tiny random HF model directories (qwen3, qwen3_sharded, qwen2, llama3,
        unsupported_*) and, for each model NAME, NAME_reference.safetensors holding the inputs
        (unpacked and packed batches) and transformers' logits and per-token log-probs. Also a
        peft adapter with non-zero B (qwen3_peft_adapter/) and peft's logits for it
        (qwen3_peft_reference.safetensors).
    model_ref.py logits INPUTS.safetensors OUT.safetensors MODEL_DIR [ADAPTER_DIR]
        Loads MODEL_DIR with transformers (and the adapter through
        peft.PeftModel.from_pretrained) and writes the logits for INPUTS' input_ids (one row at
        a time, each row one document) as OUT's "logits".

Log-prob convention (same as trainq's `Policy::token_logprobs`): targets[b, t] = ids[b, t + 1];
the last position of each document has target -100 and log-prob 0.
"""

import json
import os
import sys

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

VOCAB = 96
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
             max_position_embeddings=128, initializer_range=0.2)  # large enough for non-trivial logits
UNPACKED_LEN = 12
PACKED_DOCS = [[5, 4, 3], [7, 5]]  # document lengths per row; each row sums to UNPACKED_LEN


def configs():
    return {
        "qwen3": Qwen3Config(**SMALL, head_dim=16, tie_word_embeddings=False),
        "qwen2": Qwen2Config(**SMALL, tie_word_embeddings=True),
        "llama3": LlamaConfig(**SMALL, tie_word_embeddings=False, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    }


def randomize(model):
    """HF init leaves norms at 1 and biases at 0; perturb them so that parity covers them."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.1)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.1)


def targets_for(ids, doc_lengths):
    """targets[t] = ids[t+1] within a document, -100 at each document's last token."""
    out, start = [], 0
    for n in doc_lengths:
        doc = ids[start:start + n]
        out += doc[1:].tolist() + [-100]
        start += n
    return torch.tensor(out)


def logprobs_for(logits, targets):
    lp = torch.log_softmax(logits.float(), dim=-1)
    safe = targets.clamp(min=0)
    out = lp.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    return torch.where(targets >= 0, out, torch.zeros_like(out))


@torch.no_grad()
def per_document_logits(model, ids, doc_lengths):
    """Runs every document alone (positions from 0) and concatenates the logits."""
    parts, start = [], 0
    for n in doc_lengths:
        doc = ids[start:start + n].unsqueeze(0)
        parts.append(model(input_ids=doc).logits[0])
        start += n
    return torch.cat(parts, 0)


def reference_batches(model, gen):
    ids = torch.randint(0, VOCAB, (2, UNPACKED_LEN), generator=gen)
    rows = [per_document_logits(model, ids[b], [UNPACKED_LEN]) for b in range(2)]
    logits = torch.stack(rows)
    targets = torch.stack([targets_for(ids[b], [UNPACKED_LEN]) for b in range(2)])
    pids = torch.randint(0, VOCAB, (2, UNPACKED_LEN), generator=gen)
    prows = [per_document_logits(model, pids[b], PACKED_DOCS[b]) for b in range(2)]
    ptargets = torch.stack([targets_for(pids[b], PACKED_DOCS[b]) for b in range(2)])
    ppos = torch.stack([torch.cat([torch.arange(n) for n in docs]) for docs in PACKED_DOCS])
    plogits = torch.stack(prows)
    return {
        "input_ids": ids, "position_ids": torch.arange(UNPACKED_LEN).repeat(2, 1),
        "targets": targets, "logits": logits.contiguous(),
        "logprobs": logprobs_for(logits, targets),
        "packed_input_ids": pids, "packed_position_ids": ppos, "packed_targets": ptargets,
        "packed_logits": plogits.contiguous(), "packed_logprobs": logprobs_for(plogits, ptargets),
    }


def write_unsupported(out, base_config_path):
    base = json.load(open(base_config_path))
    variants = {
        "unsupported_activation": {"hidden_act": "gelu"},
        "unsupported_rope": {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0,
                                                 "factor": 4.0}},
        "unsupported_architecture": {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"]},
    }
    for name, patch in variants.items():
        os.makedirs(os.path.join(out, name), exist_ok=True)
        with open(os.path.join(out, name, "config.json"), "w") as f:
            json.dump({**base, **patch}, f, indent=2)


def write_peft(out, base_dir, batches):
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                     "up_proj", "down_proj"], task_type="CAUSAL_LM")
    model = get_peft_model(model, cfg).eval()
    model.save_pretrained(os.path.join(out, "qwen3_peft_adapter"))
    ids = batches["input_ids"]
    logits = torch.stack([per_document_logits(model, ids[b], [UNPACKED_LEN]) for b in range(2)])
    grads = lora_gradients(model, batches)
    save_file({"input_ids": ids, "position_ids": batches["position_ids"],
               "logits": logits.contiguous(), **grads},
              os.path.join(out, "qwen3_peft_reference.safetensors"))


def lora_gradients(model, batches):
    """Gradients of sum(coef * logprobs) over the packed batch (each document run alone) with
    respect to every LoRA weight, keyed "grad.<PEFT key without .default>", plus "coef"."""
    coef = torch.randn(batches["packed_targets"].shape, generator=torch.Generator().manual_seed(9))
    with torch.enable_grad():
        total = 0.0
        for b, docs in enumerate(PACKED_DOCS):
            start = 0
            for n in docs:
                doc = batches["packed_input_ids"][b, start:start + n].unsqueeze(0)
                lp = logprobs_for(model(input_ids=doc).logits[0], batches["packed_targets"][b, start:start + n])
                total = total + (coef[b, start:start + n] * lp).sum()
                start += n
        total.backward()
    out = {"coef": coef}
    for name, p in model.named_parameters():
        if "lora_" in name:
            out["grad." + name.replace(".default", "")] = p.grad.detach().clone()
    return out


def models(out):
    os.makedirs(out, exist_ok=True)
    for i, (name, cfg) in enumerate(configs().items()):
        torch.manual_seed(100 + i)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
        randomize(model)
        model.save_pretrained(os.path.join(out, name))
        batches = reference_batches(model, torch.Generator().manual_seed(200 + i))
        save_file(batches, os.path.join(out, f"{name}_reference.safetensors"))
        if name == "qwen3":
            model.save_pretrained(os.path.join(out, "qwen3_sharded"), max_shard_size="20KB")
            write_unsupported(out, os.path.join(out, name, "config.json"))
            write_peft(out, os.path.join(out, name), batches)


@torch.no_grad()
def logits(inputs_path, out_path, model_dir, adapter_dir=None):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel
        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    ids = load_file(inputs_path)["input_ids"]
    out = torch.stack([model(input_ids=ids[b:b + 1]).logits[0] for b in range(ids.shape[0])])
    save_file({"logits": out.contiguous()}, out_path)


if __name__ == "__main__":
    if sys.argv[1:2] == ["models"] and len(sys.argv) == 3:
        models(sys.argv[2])
    elif sys.argv[1:2] == ["logits"] and len(sys.argv) in (5, 6):
        logits(*sys.argv[2:])
    else:
        sys.exit(__doc__)
