"""Runs under ANY transformers (the project's transformers 5, or the 4.57.1 venv TensorRT-LLM 1.2.1 pins; needs only
transformers, tokenizers and jinja2, no torch):

    python tests/support/tokenizer_probe.py DIR [DIR ...]

For each directory it loads the tokenizer the way TensorRT-LLM's `load_hf_tokenizer` does
(`AutoTokenizer.from_pretrained(dir)`, fast tokenizer, no remote code) and prints one JSON object {dir: result}:
result = {"error": "..."} when loading fails, else the class, the special ids, the ids of a set of texts (with and
without special tokens), their decodings (with and without skip_special_tokens) and tokens, and, when the tokenizer
has a chat template, its renderings (with and without the generation prompt) and the rendered ids.
"""
from __future__ import annotations

import json
import sys

TEXTS = ["Hello, world!", "a , b . c ! d ? e n't it 's", "  def add(a, b):\n\treturn a+b  \n",
         "Ünïcödé ✓ 漢字 🙂", "<|im_start|>user\nhi<|im_end|>", "<|endoftext|> <|end|> <|pad|>", ""]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4"}, {"role": "user", "content": "And  3 + 3 ?"}]


def probe(d: str) -> dict:
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(d)
    except Exception as e:  # noqa: BLE001 - the message is the result
        return {"error": f"{type(e).__name__}: {e}"}
    out: dict = {"class": type(tok).__name__, "len": len(tok), "all_special_ids": sorted(tok.all_special_ids),
                 "special": {k: getattr(tok, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")}}
    for i, t in enumerate(TEXTS):
        with_special = tok(t)["input_ids"]
        plain = tok(t, add_special_tokens=False)["input_ids"]
        out[f"text{i}"] = {"ids": with_special, "ids_plain": plain, "decode": tok.decode(with_special),
                           "decode_skip": tok.decode(with_special, skip_special_tokens=True),
                           "tokens": tok.convert_ids_to_tokens(plain)}
    out["has_chat_template"] = bool(tok.chat_template)
    if tok.chat_template:
        rendered = tok.apply_chat_template(MESSAGES, tokenize=False)
        prompt = tok.apply_chat_template(MESSAGES[:2], tokenize=False, add_generation_prompt=True)
        ids = tok.apply_chat_template(MESSAGES[:2], tokenize=True, add_generation_prompt=True)
        out["chat"] = {"rendered": rendered, "prompt": prompt, "ids": ids if isinstance(ids, list) else ids["input_ids"]}
    return out


if __name__ == "__main__":
    print(json.dumps({d: probe(d) for d in sys.argv[1:]}))
