"""transformers reference for trainq's chat tokenization (tests/tokenize_chat_template.rs).

Usage: chat_template_ref.py TOKENIZER_DIR CONVERSATION.json OUT.json

Renders and tokenizes the conversation ({"messages": [...], "tools": [...]}) with
AutoTokenizer.apply_chat_template(tokenize=True), exactly as a Hugging Face user would. Qwen3's
template has no {% generation %} blocks, so return_assistant_tokens_mask is unavailable; the
reference mask is found independently of trainq's prefix-render method, by locating assistant
spans in the token ids: every token after an assistant header (the text add_generation_prompt
appends, "<|im_start|>assistant\\n" for Qwen) up to and including the next eos token
("<|im_end|>") is an assistant token. The conversation's optional "chat_template_kwargs" object
is passed to every apply_chat_template call (e.g. {"enable_thinking": false}).
"""
import json
import sys

from transformers import AutoTokenizer


def assistant_mask(ids, header, end_id):
    mask = [False] * len(ids)
    i = 0
    while i < len(ids):
        if ids[i:i + len(header)] == header:
            j = i + len(header)
            while j < len(ids) and ids[j] != end_id:
                mask[j] = True
                j += 1
            if j < len(ids):
                mask[j] = True
            i = j + 1
        else:
            i += 1
    return mask


def main():
    tok_dir, conversation, out = sys.argv[1:4]
    tok = AutoTokenizer.from_pretrained(tok_dir)
    conv = json.load(open(conversation))
    kwargs = conv.get("chat_template_kwargs", {})
    text = tok.apply_chat_template(conv["messages"], tools=conv.get("tools"), tokenize=False, **kwargs)
    ids = tok.apply_chat_template(conv["messages"], tools=conv.get("tools"), tokenize=True, **kwargs)
    if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    ids = list(ids)
    first = conv["messages"][:1]
    with_prompt = tok.apply_chat_template(first, tokenize=False, add_generation_prompt=True, **kwargs)
    without = tok.apply_chat_template(first, tokenize=False, add_generation_prompt=False, **kwargs)
    assert with_prompt.startswith(without), "generation prompt is not a suffix"
    header = tok.encode(with_prompt[len(without):], add_special_tokens=False)
    end_id = tok.convert_tokens_to_ids(tok.eos_token)
    json.dump({"text": text, "ids": ids, "mask": assistant_mask(ids, header, end_id)}, open(out, "w"))


if __name__ == "__main__":
    main()
