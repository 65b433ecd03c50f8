"""A drafter that proposes from a known continuation (the target's own greedy output), shared by the runtime
tests: with `wrong=None` every proposal is the target's next token (always accepted), with `wrong="all"` every
token is replaced by another one (always rejected), with `wrong=i` only the i-th of each run of proposals is (so a
verification sees some rows accepted, some rejected, and rolls the cache back). Tracks each row's position through
`observe` the way a real drafter does."""
from __future__ import annotations

import torch

from runtime.engine.drafters import Drafter


class ScriptDrafter(Drafter):
    def __init__(self, refs: list[list[int]], prompts: list[list[int]], vocab: int, wrong: int | str | None = None):
        self.refs, self.plen, self.vocab, self.wrong = refs, [len(p) for p in prompts], vocab, wrong

    def reset(self, batch, capacity):
        self.rows, self.done = list(range(batch)), [0] * batch     # done: target-processed tokens per row

    def select_rows(self, idx):
        self.rows = [self.rows[i] for i in idx.tolist()]
        self.done = [self.done[i] for i in idx.tolist()]

    def observe(self, hidden, next_tokens, counts):
        self.done = [d + int(c) for d, c in zip(self.done, counts, strict=True)]

    def propose(self, last, k, temperature, gen):
        out = []
        for r, n in zip(self.rows, self.done, strict=True):
            g = n - self.plen[r] + 1          # generated tokens so far (x included)
            cont = (self.refs[r][g:g + k] + [0] * k)[:k]
            wrong = range(k) if self.wrong == "all" else [] if self.wrong is None else [self.wrong]
            out.append([(t + 1) % self.vocab if i in wrong else t for i, t in enumerate(cont)])
        return torch.tensor(out), None
