"""Tokenizer files every targeted reader loads the same way: transformers 5 (specpipe, vLLM, TensorRT-LLM 1.3) and
transformers 4.57.1, which TensorRT-LLM 1.2.1 pins.

transformers 5 saves `"tokenizer_class": "TokenizersBackend"`. transformers 4.57.1 has no such class:
`AutoTokenizer.from_pretrained` (models/auto/tokenization_auto.py, tag v4.57.1) looks `tokenizer_class` up by name and
raises "Tokenizer class TokenizersBackend does not exist or is not currently imported"; TensorRT-LLM 1.2's
`load_hf_tokenizer` catches it and serves without a tokenizer, so every text request fails. In transformers 5,
`PreTrainedTokenizerFast` is the same class (tokenization_utils_tokenizers.py: `PreTrainedTokenizerFast =
TokenizersBackend`), and in 4.57.1 it is the class that loads `tokenizer.json` as it is. So the config names
`PreTrainedTokenizerFast`.

Decoding: transformers 5 ignores `clean_up_tokenization_spaces: true` for a BPE model (tokenization_utils_tokenizers.py
`_decode`: the cleanup strips spaces before punctuation, which corrupts BPE text), 4.57.1 applies it ("a , b" decodes
to "a, b"). The file says `false` for a BPE tokenizer, which is what transformers 5 does with `true`.

Extra special tokens: transformers 5 saves the tokens a tokenizer was given beyond bos/eos/pad/... (Llama-3.x's
`<|start_header_id|>`, Qwen3's `<|im_start|>`, re-saved by transformers 5) as a LIST, `"extra_special_tokens": [...]`.
transformers 4.57.1 reads `extra_special_tokens` as a dict of named tokens (tokenization_utils_base.py
`PreTrainedTokenizerBase.__init__` -> `_set_model_specific_special_tokens`: `special_tokens.keys()`), so a list raises
AttributeError inside the tokenizer's constructor, and `from_pretrained` reports it as a protobuf ImportError where
protobuf is absent. Both versions read the same list under `additional_special_tokens` (measured: ids, decodings,
special ids and chat renderings equal under 4.57.1 and 5.14.1, tests/e2e/runtime/text/test_tokenizer_compat.py), so a list
is moved there; a dict (named tokens, which 4.57.1 understands) stays.

The chat template stays where transformers 5 writes it, `chat_template.jinja`: 4.57.1 reads that file too
(tokenization_utils_base.py, CHAT_TEMPLATE_FILE) and it wins over a `chat_template` key.
tests/e2e/runtime/text/test_tokenizer_compat.py loads every shipped tokenizer under both versions and compares ids,
decoding and chat rendering.

`portable_tokenizer(dir)` is the one place this is done; every writer of a shipped model directory calls it (quantize's
target and draft, train_draft's draft, build's renamed draft, export's repositories).
"""
from __future__ import annotations

import json
from pathlib import Path

from runtime.files import atomic_write_text

# Files that make up a Hugging Face tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json")

# transformers 5 class names 4.57.1 does not have, and the 4.57.1 class that loads the same tokenizer.json.
RENAMED_CLASSES = {"TokenizersBackend": "PreTrainedTokenizerFast"}


def portable_config(cfg: dict, tokenizer_json: dict | None) -> dict:
    """`tokenizer_config.json`'s content as both transformers lines read it identically (see the module docstring)."""
    out = dict(cfg)
    cls = out.get("tokenizer_class")
    if cls in RENAMED_CLASSES and tokenizer_json is not None:
        out["tokenizer_class"] = RENAMED_CLASSES[cls]
    extra = out.get("extra_special_tokens")
    if isinstance(extra, list):
        have = list(out.get("additional_special_tokens") or [])
        out["additional_special_tokens"] = have + [t for t in extra if t not in have]
        del out["extra_special_tokens"]
    bpe = ((tokenizer_json or {}).get("model") or {}).get("type") == "BPE"
    if bpe and out.get("clean_up_tokenization_spaces") and not out.get(
            "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"):
        out["clean_up_tokenization_spaces"] = False
    return out


def portable_tokenizer(model_dir: Path) -> bool:
    """Rewrite `model_dir/tokenizer_config.json` in its portable form. The file is replaced (a new inode), so a
    hard-linked source elsewhere is never modified. Returns whether it changed."""
    cfg_path = Path(model_dir) / "tokenizer_config.json"
    if not cfg_path.is_file():
        return False
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    tj = Path(model_dir) / "tokenizer.json"
    new = portable_config(cfg, json.loads(tj.read_text(encoding="utf-8")) if tj.is_file() else None)
    if new == cfg:
        return False
    atomic_write_text(cfg_path, json.dumps(new, indent=2, ensure_ascii=False) + "\n")
    return True


def same_tokenizer_config(a: Path, b: Path) -> bool:
    """Whether two tokenizer_config.json files say the same once both are in the portable form (a draft's copy is
    portable, the target's source may not be)."""
    def load(p: Path) -> dict:
        tj = p.parent / "tokenizer.json"
        return portable_config(json.loads(p.read_text(encoding="utf-8")),
                               json.loads(tj.read_text(encoding="utf-8")) if tj.is_file() else None)
    return load(a) == load(b)
