"""What the draft trains and is measured on: the training samples (token ids and loss mask) and the held-out eval
prompts, the batches of a step (online: padded ids and masks; offline: ModelOpt's records of the dumped hidden
states), the data order as a function of (seed, step) only, and EAGLE-3's reduced draft vocabulary (`d2t`)
calibrated on the trained-on tokens."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from runtime.training.dist import barrier
from runtime.training.job import JobError

IGNORE_INDEX = -100


def read_samples(parquet: str | Path, max_samples: int | None = None) -> list[tuple[list[int], list[int]]]:
    """(input_ids, loss_mask) of the first `max_samples` training samples of a token-row parquet, the row rule checked
    (`runtime.data.rows`). Rows without a token to train on are skipped rather than refused: the data stage never
    writes one, but the training worker also reads hand-made datasets whose truncated rows can lose their response."""
    from runtime.data.rows import read_token_rows
    from runtime.errors import RuntimeFailure

    try:
        return read_token_rows(parquet, limit=max_samples or None, skip_untrained=True)
    except RuntimeFailure as e:
        raise JobError(str(e)) from None


def read_prompts(eval_files: dict[str, str], per_domain: int) -> dict[str, list[list[int]]]:
    """The first `per_domain` eval prompts' ids of each domain file (`runtime.data.rows`)."""
    from runtime.data.rows import read_eval_lines

    return {domain: [r["prompt_ids"] for r in read_eval_lines(path)[:per_domain]]
            for domain, path in sorted(eval_files.items())}


def batch_indices(step: int, n: int, batch: int, seed: int) -> list[int]:
    """The global batch of `step`: consecutive slices of a per-epoch permutation seeded by (seed, epoch)."""
    import torch

    out = []
    pos = step * batch
    while len(out) < batch:
        epoch, off = divmod(pos, n)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch)).tolist()
        take = min(batch - len(out), n - off)
        out += perm[off: off + take]
        pos += take
    return out


def online_batch(samples, idx: list[int], seq_len: int, pad_id: int, device) -> dict:
    import torch

    n = len(idx)
    ids = torch.full((n, seq_len), pad_id, dtype=torch.long)
    att = torch.zeros((n, seq_len), dtype=torch.long)
    lm = torch.zeros((n, seq_len), dtype=torch.long)
    for r, i in enumerate(idx):
        a, m = samples[i]
        a, m = a[:seq_len], m[:seq_len]
        ids[r, : len(a)] = torch.tensor(a)
        att[r, : len(a)] = 1
        lm[r, : len(m)] = torch.tensor(m)
    labels = ids.masked_fill(att == 0, IGNORE_INDEX)
    return {k: v.to(device) for k, v in
            {"input_ids": ids, "attention_mask": att, "loss_mask": lm, "labels": labels}.items()}


def offline_batch(dataset, collator, idx: list[int], device) -> dict:
    b = collator([dataset[i] for i in idx])
    b["base_model_outputs"] = {k: (v.to(device) if hasattr(v, "to") else v) for k, v in b["base_model_outputs"].items()}
    return {k: (v.to(device) if hasattr(v, "to") else v) for k, v in b.items()}


@dataclasses.dataclass
class Data:
    """The training samples, the tokenizer's padding id and, offline, ModelOpt's dataset over the dumped records."""

    samples: list
    tok: Any
    pad_id: int
    dataset: Any = None
    collator: Any = None
    dump_info: dict = dataclasses.field(default_factory=dict)

    def batch(self, idx: list[int], seq_len: int, device) -> dict:
        if self.dataset is not None:
            return offline_batch(self.dataset, self.collator, idx, device)
        return online_batch(self.samples, idx, seq_len, self.pad_id, device)


def read_training_data(job: dict, world: int) -> Data:
    """The samples (refused when the global batch does not split over the processes, or none has a token to train
    on) and the target's tokenizer for padding."""
    from transformers import AutoTokenizer

    t = job["train"]
    if t["batch_size"] % world:
        raise JobError(f"train_draft.batch_size {t['batch_size']} is not divisible by the {world} training processes")
    samples = read_samples(job["train_parquet"], job.get("max_samples"))
    if not samples:
        raise JobError(f"no training samples with a non-zero loss mask in {job['train_parquet']}")
    tok = AutoTokenizer.from_pretrained(job["target_dir"], trust_remote_code=job["trust_remote_code"])
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    return Data(samples, tok, pad_id)


def calibrate_d2t(samples, vocab_size: int, draft_vocab_size: int, path: Path) -> dict:
    """The reduced draft vocabulary: the most frequent trained-on tokens of the training set, stored as
    ModelOpt's `d2t` offsets (target_id = draft_id + d2t[draft_id]). ModelOpt's `calibrate_frequent_vocab`
    counts chat-template renderings of conversations; the data artifact already holds token ids with a loss
    mask, so the same count runs on exactly the tokens the draft learns to predict."""
    import collections

    import torch

    counts = collections.Counter()
    for ids, mask in samples:
        counts.update(t for t, m in zip(ids, mask, strict=True) if m)
    top = [t for t, _ in counts.most_common(draft_vocab_size)]
    if len(top) < draft_vocab_size:   # fill with unseen ids so the map is complete and injective
        seen = set(top)
        top += [t for t in range(vocab_size) if t not in seen][: draft_vocab_size - len(top)]
    top.sort()   # keep draft ids in target-id order: d2t is then non-decreasing
    d2t = torch.tensor([t - i for i, t in enumerate(top)], dtype=torch.int64)
    torch.save(d2t, path)
    covered = sum(counts[t] for t in top) / max(1, sum(counts.values()))
    return {"draft_vocab_size": draft_vocab_size, "token_coverage": round(covered, 4)}


def calibrate_d2t_once(job: dict, samples, proc) -> None:
    """EAGLE-3 with a reduced vocabulary: rank 0 writes the d2t map unless a previous run did, and (every run) its
    statistics into job["d2t_stats"] (`d2t_stats`, a `d2t` event); all wait for it."""
    if job.get("d2t_path") and proc.rank == 0:    # set only for a reduced vocabulary (job.py make_job)
        if not Path(job["d2t_path"]).exists():
            calibrate_d2t(samples, job["target"]["vocab_size"], job["algorithm"]["draft_vocab_size"], Path(job["d2t_path"]))
        job["d2t_stats"] = d2t_stats(Path(job["d2t_path"]), samples, job.get("heldout_parquet"))
        proc.emit0({"event": "d2t", **job["d2t_stats"]})
    barrier()


def draft_vocab(d2t_path: Path) -> set[int]:
    """The target ids of the reduced draft vocabulary (target_id = draft_id + d2t[draft_id])."""
    import torch

    d2t = torch.load(d2t_path, weights_only=True)
    return {i + int(o) for i, o in enumerate(d2t.tolist())}


def outside_share(vocab: set[int], rows) -> tuple[float | None, int]:
    """(share of the trained-on tokens of `rows` ((ids, loss mask) pairs) outside `vocab`, their count)."""
    n = out = 0
    for ids, mask in rows:
        for t, m in zip(ids, mask, strict=True):
            if m:
                n += 1
                out += t not in vocab
    return (round(out / n, 4) if n else None), n


def d2t_stats(d2t_path: Path, samples, heldout_parquet: str | None) -> dict:
    """The draft vocabulary's size, the share of the training set's trained-on tokens it covers, and
    `heldout_oov_rate`: the share of the held-out split's assistant (trained-on) tokens outside it."""
    vocab = draft_vocab(d2t_path)
    miss, n = outside_share(vocab, samples)
    out = {"draft_vocab_size": len(vocab), "token_coverage": round(1 - miss, 4) if miss is not None else None,
           "train_tokens": n, "heldout_oov_rate": None, "heldout_tokens": 0}
    if heldout_parquet and Path(heldout_parquet).exists():
        from runtime.data.rows import read_token_rows

        held = read_token_rows(heldout_parquet, skip_untrained=True)
        out["heldout_oov_rate"], out["heldout_tokens"] = outside_share(vocab, held)
    return out
