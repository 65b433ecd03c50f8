"""The built-in tiny target: a small Llama of the configured shape for the corpus tokenizer (corpus.py), pretrained on
random windows of the corpus (linear warmup, cosine decay; checkpointed so that an interrupted run resumes where it
stopped), its held-out loss measured on the files it never saw. A random target would make acceptance meaningless:
the pretraining gives it a real next-token distribution."""
from __future__ import annotations

import math
import os
import time
from pathlib import Path

from runtime.target.corpus import token_stream, train_tokenizer, write_corpus


def bootstrap_tiny(t, model_dir: Path, *, corpus_dir: Path, scratch_dir: Path, dtype: str, log, progress,
                   on_checkpoint=None) -> dict:
    """Build the tiny target: a corpus of standard-library sources (written to `corpus_dir`), a BPE tokenizer trained
    on it, a small Llama pretrained on it (resumable from `scratch_dir`), saved to `model_dir` in `dtype`. `t`: the
    target stage's `tiny` section; `progress(total=, desc=)`: a progress context; `on_checkpoint(step)`: called after
    each pretraining checkpoint is on disk (the stage's fault point). Returns the pretraining metrics."""
    import torch

    torch.manual_seed(t.seed)
    files, train_files, held_files = write_corpus(corpus_dir, t, log)
    tok = train_tokenizer([x for _, x in train_files], t.vocab_size, model_dir)
    data = token_stream(tok, train_files)
    held_t = token_stream(tok, held_files)
    log.info("tokenizer: vocab %d; %d training tokens, %d held-out tokens", len(tok), len(data), len(held_t))

    model = _tiny_llama(tok, t)
    loss_v, first_loss, train_s = _pretrain(t, model, data, ckpt=scratch_dir / "pretrain.pt", log=log, progress=progress,
                                           on_checkpoint=on_checkpoint)
    held_loss = _eval_loss(model, held_t, t.seq_len)
    model.to(getattr(torch, dtype)).save_pretrained(model_dir, safe_serialization=True)
    log.info("pretrained %d steps in %.0fs: loss %.3f, held-out perplexity "
             "%.1f", t.steps, train_s, loss_v, math.exp(held_loss))
    return {
        "pretrain_steps": t.steps,
        "pretrain_first_loss": round(first_loss, 4) if first_loss is not None else None,
        "pretrain_final_loss": round(loss_v, 4),
        "heldout_loss": round(held_loss, 4),
        "heldout_perplexity": round(math.exp(held_loss), 3),
        "pretrain_seconds": round(train_s, 2),
        "train_tokens": len(data),
        "heldout_tokens": len(held_t),
        "corpus_files": len(files),
    }


def _tiny_llama(tok, t):
    """A freshly initialised Llama of the configured tiny shape for tokenizer `tok` (the global torch seed decides
    its weights)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
        num_hidden_layers=t.num_layers, num_attention_heads=t.num_heads, num_key_value_heads=t.num_kv_heads,
        max_position_embeddings=t.max_position_embeddings, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, tie_word_embeddings=False, rope_theta=10000.0,
    )
    cfg.architectures = ["LlamaForCausalLM"]
    return LlamaForCausalLM(cfg)


def _lr_at(t, step: int) -> float:
    """Linear warmup, then cosine decay to a tenth of `lr`."""
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    prog = (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps)
    return t.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * prog)))


def _pretrain(t, model, data, *, ckpt: Path, log, progress, on_checkpoint=None) -> tuple[float, float | None, float]:
    """Pretrain `model` on random windows of `data` for `t.steps` steps, resuming from (and checkpointing to) `ckpt`.
    Returns (last loss, first loss of this run, seconds)."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, weight_decay=0.01, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(t.seed)
    step0 = _resume_pretraining(ckpt, model, opt, gen, log)
    n = len(data) - t.seq_len - 1
    model.train()
    t0 = time.monotonic()
    loss_v = float("nan")
    first_loss = None
    with progress(total=t.steps, desc="pretrain tiny target") as bar:
        bar.update(step0)
        for step in range(step0, t.steps):
            starts = torch.randint(0, n, (t.batch_size,), generator=gen)
            x = torch.stack([data[s: s + t.seq_len] for s in starts])
            for g in opt.param_groups:
                g["lr"] = _lr_at(t, step)
            loss = model(input_ids=x, labels=x).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            loss_v = loss.item()
            first_loss = loss_v if first_loss is None else first_loss
            bar.update(1, loss=f"{loss_v:.3f}")
            if (step + 1) % t.checkpoint_every == 0 and step + 1 < t.steps:
                tmp = ckpt.with_suffix(".tmp")
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "gen": gen.get_state(), "step": step + 1}, tmp)
                os.replace(tmp, ckpt)
                if on_checkpoint is not None:
                    on_checkpoint(step + 1)
    return loss_v, first_loss, time.monotonic() - t0


def _resume_pretraining(ckpt: Path, model, opt, gen, log) -> int:
    """Load model, optimizer and sampler state from `ckpt` when it exists; the step to continue from (0 if not)."""
    import torch

    if not ckpt.exists():
        return 0
    state = torch.load(ckpt, weights_only=True)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    gen.set_state(state["gen"])
    step0 = int(state["step"])
    log.info("resuming pretraining from step %d (checkpoint %s)", step0, ckpt)
    return step0


def _eval_loss(model, ids, seq_len: int, max_windows: int = 32) -> float:
    import torch

    model.eval()
    losses = []
    with torch.no_grad():
        for i in range(0, min(len(ids) - seq_len - 1, max_windows * seq_len), seq_len):
            x = ids[i: i + seq_len].unsqueeze(0)
            losses.append(model(input_ids=x, labels=x).loss.item())
    return sum(losses) / max(1, len(losses))
