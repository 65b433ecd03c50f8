"""Prompt-lookup (n-gram) drafting for the speculative engine: no draft model, the context proposes its own
continuation. For each row: the longest n-gram (n from `max_n` down to `min_n`) that ends the context and also
occurs earlier in it; the k tokens that followed that earlier occurrence are the draft.

The rule is vLLM 0.32.0's (`vllm/v1/spec_decode/ngram_proposer.py`, `_find_longest_matched_ngram_and_propose_tokens`:
a KMP pass over the reversed context, matches capped at max_n; among matches of the longest length the earliest
occurrence wins; fewer than k tokens when the match ends near the end of the context; nothing when no n-gram of
at least min_n matches). `longest_match_proposal` ports it line for line (tests compare it with vLLM's own function).

TensorRT-LLM's NGram drafter (NVIDIA/TensorRT-LLM `tensorrt_llm/_torch/speculative/ngram.py`, commit
0249976575050d2c624a5f285683c66de311a3b7, `NGramPoolManager.get_draft_tokens`) keeps a pool pattern -> matches,
searches pattern sizes max_matching_ngram_size down to 1 (its min n is 1) and with `is_use_oldest` proposes the
oldest match; with `is_keep_all` a longer continuation of the same pattern replaces shorter ones. The two agree
whenever the longest matching n-gram's earliest occurrence has k tokens after it (the common case); they differ
at the context's tail (vLLM returns the shorter continuation, TensorRT-LLM's pool keeps the longest one seen) and
TensorRT-LLM's pool only looks back max_total_draft_tokens + max_matching_ngram_size - 1 tokens per update.

Lossless by construction: the drafts are only proposals, the target verifies them with the engine's acceptance
rule (greedy: a draft is kept iff it is the target's argmax). A row with a proposal shorter than the step's longest
(or none) is padded; `draft_lens` tells `DecodeBatch` how many are real, the padding is never accepted, and a
step in which no row has a proposal verifies the pending token alone (a plain decoding step).
"""
from __future__ import annotations

import torch

from runtime.engine.drafters import Drafter

VLLM_RULE = "vllm 0.32.0 vllm/v1/spec_decode/ngram_proposer.py::_find_longest_matched_ngram_and_propose_tokens"
PAD = 0          # the token fed to the target in a padded (not proposed) position; never accepted


def longest_match_proposal(tokens: list[int], min_n: int, max_n: int, k: int, max_model_len: int | None = None) -> list[int]:
    """vLLM's rule (see the module doc): the tokens following the earliest occurrence of the longest suffix n-gram
    (min_n <= n <= max_n) found earlier in `tokens`; [] when none. A KMP pass over the reversed tokens, O(len)."""
    total = len(tokens)
    if total < min_n:
        return []
    if max_model_len is not None:
        k = min(k, max_model_len - total)
    if k <= 0:
        return []
    rev = tokens[::-1]
    lps = [0] * max_n              # lps[i] = longest proper prefix of rev[:i+1] that is also its suffix (i < max_n)
    longest = position = prev = 0
    i = 1
    while i < total:
        if rev[prev] == rev[i]:
            prev += 1
            if prev >= longest:    # >=: the later position in rev, i.e. the earliest occurrence in `tokens`
                longest, position = prev, i
            if i < max_n:
                lps[i] = prev
            if prev == max_n:      # cap matches at max_n
                prev = lps[max_n - 1]
            i += 1
        elif prev != 0:
            prev = lps[prev - 1]
        else:
            i += 1
    if longest < min_n:
        return []
    start = total - 1 - position + longest
    return tokens[start:start + min(k, total - start)]


class NgramDrafter(Drafter):
    """Prompt-lookup drafting (`longest_match_proposal`) over each row's whole context: prompt and generated
    tokens. Needs no hidden states (`capture_layers` is empty). `draft_lens` after each `propose`: the real
    proposal length per row (the rest of the [B, k'] block is padding)."""

    def __init__(self, min_n: int, max_n: int, vocab_size: int):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n, self.max_n, self.vocab_size = min_n, max_n, vocab_size
        self.capture_layers = []
        self.max_draft_len = None
        self.row_state = ("history",)
        self.history: list[list[int]] = []
        self.draft_lens: torch.Tensor | None = None
        self.proposals = 0           # steps x rows that had a proposal (vLLM counts only these as drafts)
        self.lookups = 0             # steps x rows asked

    def reset(self, batch, capacity):
        self.history = [[] for _ in range(batch)]

    def begin(self, prompts):
        # observe() receives each position's following token: the prompt's first token comes from here
        for h, p in zip(self.history, prompts, strict=True):
            h[:] = [int(p[0])]

    def select_rows(self, idx):
        self.history = [self.history[i] for i in idx.tolist()]

    def observe(self, hidden, next_tokens, counts):
        rows = next_tokens.tolist()
        for h, row, c in zip(self.history, rows, counts.tolist(), strict=True):
            h.extend(row[:c])

    def propose(self, last, k, temperature, gen):
        props = [longest_match_proposal(h, self.min_n, self.max_n, k) for h in self.history]
        B, width = len(props), max((len(p) for p in props), default=0)
        self.lookups += B
        self.proposals += sum(1 for p in props if p)
        tokens = torch.full((B, width), PAD, dtype=torch.long, device=last.device)
        for b, p in enumerate(props):
            tokens[b, :len(p)] = torch.tensor(p, dtype=torch.long)
        self.draft_lens = torch.tensor([len(p) for p in props], device=last.device)
        if temperature <= 0:
            return tokens, None
        # a deterministic proposal: q is one-hot at each real draft, zero in padded positions
        q = torch.zeros(B, width, self.vocab_size, device=last.device)
        real = torch.arange(width, device=last.device)[None] < self.draft_lens[:, None]
        q.scatter_(-1, tokens[..., None], real[..., None].float())
        return tokens, q
