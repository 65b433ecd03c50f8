"""The tiny target's corpus and tokenizer: standard-library Python sources (the same on every machine with the same
Python version), split by a hash of their path into pretraining and held-out files (the held-out ones feed only the
data stage's eval domains), and a byte-level BPE tokenizer trained on them, with a mask token and a chat template
whose `{% generation %}` tags mark the assistant tokens."""
from __future__ import annotations

import hashlib
import json
import sysconfig
from pathlib import Path

from runtime.errors import RuntimeFailure

SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>", "<|mask|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
# `{% generation %}` marks the assistant tokens, so the data stage can train on them alone.
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}<|system|>{{ m['content'] }}<|end|>"
    "{% elif m['role'] == 'user' %}<|user|>{{ m['content'] }}<|end|>"
    "{% elif m['role'] == 'assistant' %}<|assistant|>{% generation %}{{ m['content'] }}<|end|>{% endgeneration %}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def stdlib_corpus(max_bytes: int) -> list[tuple[str, str]]:
    """(relative path, text) of standard-library .py files, sorted, up to max_bytes. Same on every machine
    with the same Python version: deterministic for a given seed and corpus."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out, total = [], 0
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).as_posix()
        if rel.startswith(("site-packages", "test/", "idlelib/idle_test", "lib2to3/tests")) or "/tests/" in rel:
            continue
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not text.strip():
            continue
        out.append((rel, text))
        total += len(text.encode())
        if total >= max_bytes:
            break
    return out


def is_heldout(rel: str, frac: float) -> bool:
    return int(hashlib.sha256(rel.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF < frac


def train_tokenizer(texts: list[str], vocab_size: int, out_dir: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|end|>",
                                   pad_token="<|pad|>", mask_token="<|mask|>", unk_token=None)
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 1 << 30
    fast.save_pretrained(out_dir)
    return fast


def write_corpus(corpus_dir: Path, t, log) -> tuple[list, list, list]:
    """Standard-library sources split into pretraining and held-out files, written to `corpus_dir/{train,heldout}.jsonl`
    (`t`: the target stage's `tiny` section: `corpus_mb`, `heldout_fraction`). Returns (all files, training files,
    held-out files), each a list of (relative path, text). RuntimeFailure when there are fewer than 10 sources."""
    files = stdlib_corpus(int(t.corpus_mb * 2**20))
    if len(files) < 10:
        raise RuntimeFailure("found fewer than 10 standard-library sources to build the tiny corpus")
    train_files = [(r, x) for r, x in files if not is_heldout(r, t.heldout_fraction)]
    held_files = [(r, x) for r, x in files if is_heldout(r, t.heldout_fraction)]
    corpus_dir.mkdir(parents=True)
    for name, items in (("train", train_files), ("heldout", held_files)):
        with open(corpus_dir / f"{name}.jsonl", "w") as f:
            for rel, text in items:
                f.write(json.dumps({"path": rel, "text": text}) + "\n")
    log.info("corpus: %d files for pretraining, %d held out (%.1f MB)", len(train_files), len(held_files),
             sum(len(x) for _, x in files) / 2**20)
    return files, train_files, held_files


def token_stream(tok, items: list):
    """The files' token ids, each followed by eos, as one LongTensor."""
    import torch

    ids = []
    for _, text in items:
        ids.extend(tok(text)["input_ids"] + [tok.eos_token_id])
    return torch.tensor(ids, dtype=torch.long)
