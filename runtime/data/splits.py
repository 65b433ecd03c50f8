"""How the samples are partitioned: the seeded hash that orders them, the eval prompts chosen per domain (their
samples never train the draft), dedup and the train / held-out split, the data contract's row rule and the split
statistics."""
from __future__ import annotations

import hashlib

from runtime.data.render import render_prompt
from runtime.data.sources import Sample, source_of
from runtime.errors import RuntimeFailure


def bucket(key: str, seed: int) -> float:
    return int(hashlib.sha256(f"{seed}:{key}".encode()).hexdigest()[:12], 16) / float(1 << 48)


def eval_prompts(name: str, samples: list[Sample], renderer, tok, *, limit: int, max_prompt_tokens: int, seed: int,
                 chosen_keys: set[str]) -> list[dict]:
    """Up to `limit` eval prompts of domain `name` (fields of the data artifact's EvalPrompt), in seeded order:
    rendered, cut to the last `max_prompt_tokens` tokens, at least 4 tokens each. Every sample looked at is added to
    `chosen_keys` (those never train the draft)."""
    samples = sorted({s.key: s for s in samples}.values(), key=lambda s: bucket(s.key, seed))
    prompts: list[dict] = []
    for s in samples:
        chosen_keys.add(s.key)
        prompt = render_prompt(renderer, tok, s)
        ids = tok(prompt, add_special_tokens=False)["input_ids"][-max_prompt_tokens:]
        if len(ids) < 4:
            continue
        ref = s.content[-1]["content"] if s.fmt == "messages" and s.content[-1]["role"] == "assistant" else None
        prompts.append({"id": f"{name}-{len(prompts)}", "prompt": tok.decode(ids), "prompt_ids": ids, "reference": ref})
        if len(prompts) >= limit:
            break
    return prompts


def dedup_and_split(train: list[Sample], chosen_keys: set[str], *, dedup: bool, seed: int, eval_fraction: float):
    """Dedup, drop what the eval prompts came from, and split into train / held-out by a seeded hash."""
    n_raw, n_dup, raw = len(train), 0, list(train)
    if dedup:
        seen, uniq = set(), []
        for s in train:
            if s.key not in seen:
                seen.add(s.key)
                uniq.append(s)
        n_dup = len(train) - len(uniq)
        train = uniq
    overlap = [s for s in train if s.key in chosen_keys]
    train = [s for s in train if s.key not in chosen_keys]
    train.sort(key=lambda s: bucket(s.key, seed))
    heldout = [s for s in train if bucket("heldout:" + s.key, seed) < eval_fraction]
    train = [s for s in train if bucket("heldout:" + s.key, seed) >= eval_fraction]
    if not train:
        raise RuntimeFailure("no training samples left after dedup and split: "
                             + split_losses(raw, chosen_keys, heldout, eval_fraction)
                             + "; add sources or lower data.eval_fraction")
    return train, heldout, {"raw_samples": n_raw, "dedup_removed": n_dup, "eval_overlap_removed": len(overlap)}


def split_losses(raw: list[Sample], chosen_keys: set[str], heldout: list[Sample], eval_fraction: float) -> str:
    """Per source, where its samples went when none was left to train on: duplicates, eval prompts, held out."""
    held = {id(s) for s in heldout}
    seen: set[str] = set()
    dups = set()
    for s in raw:   # a duplicate of an earlier sample, of any source
        if s.key in seen:
            dups.add(id(s))
        seen.add(s.key)
    parts = []
    for src in dict.fromkeys(source_of(s.origin) for s in raw):
        mine = [s for s in raw if source_of(s.origin) == src]
        parts.append(f"{src}: {len(mine)} sample(s), {sum(id(s) in dups for s in mine)} duplicate(s), "
                     f"{sum(s.key in chosen_keys for s in mine)} also eval prompts, "
                     f"{sum(id(s) in held for s in mine)} held out by data.eval_fraction={eval_fraction}")
    return "; ".join(parts) or "the sources gave no sample"


def rows_problem(samples: list[Sample], enc: list, min_length: int) -> str:
    """Per source, why none of its samples became a training row (token_rows' rule)."""
    parts = []
    for src in dict.fromkeys(source_of(s.origin) for s in samples):
        mine = [e for s, e in zip(samples, enc, strict=True) if source_of(s.origin) == src]
        short = sum(1 for e in mine if not e or len(e[0]) < min_length)
        longest = max((len(e[0]) for e in mine if e), default=0)
        parts.append(f"{src}: {short} of {len(mine)} sample(s) shorter than data.min_length={min_length} tokens "
                     f"(longest {longest}), {len(mine) - short} without a token to train on")
    return "; ".join(parts)


def token_rows(samples: list[Sample], enc: list, min_length: int) -> dict:
    """Parquet columns of the encoded samples that meet the data contract's row rule (>= min_length tokens, at
    least one trained on)."""
    keep = [(s, e) for s, e in zip(samples, enc, strict=True) if e and len(e[0]) >= min_length and sum(e[1]) > 0]
    return {"input_ids": [e[0] for _, e in keep], "loss_mask": [e[1] for _, e in keep],
            "domain": [s.domain for s, _ in keep], "source": [s.origin for s, _ in keep]}


def split_stats(r: dict) -> dict:
    """Samples, tokens, tokens trained on and the length range of one split's rows."""
    lens = [len(x) for x in r["input_ids"]]
    return {"samples": len(lens), "tokens": sum(lens), "loss_tokens": sum(sum(m) for m in r["loss_mask"]),
            "min_len": min(lens, default=0), "mean_len": round(sum(lens) / max(1, len(lens)), 1), "max_len": max(lens, default=0)}
