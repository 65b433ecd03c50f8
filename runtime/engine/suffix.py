"""TensorRT-LLM's suffix-automaton (SA) draft enhancer, ported: the trained draft proposes, and where the request's own
text holds a long enough repeat of its ending, the continuation of that repeat replaces the trained draft.

Upstream (NVIDIA/TensorRT-LLM; files at the commits the search index holds):
- `SAEnhancerConfig` (tensorrt_llm/llmapi/llm_args.py): `threshold` (PositiveInt, default 4; "minimum suffix match
  length required for the SA output to override neural draft tokens") and `enable_global_pool` (default False: a
  request searches only its own automaton). It is the `sa_config` field of Eagle3/MTP/PARD decoding configs
  (status "beta"); documented from 1.3.0rc27 (nvidia.github.io/TensorRT-LLM/1.3.0rc27/llm-api/reference/
  SAEnhancerConfig.html); absent from 1.2.1.
- which match: cpp/tensorrt_llm/kernels/speculativeDecoding/suffixAutomaton/suffixAutomaton.h @ b120c7c9436f2f3e20
  da1fa64df67da73fce51b8 (`SuffixAutomaton::extend`, `lookup`, `getDraftTokens`; adapted there from Baseten's
  sa_spec). Each state keeps `pos`, the end of the earliest occurrence of its strings (a clone copies it). `lookup`
  walks the suffix links from the whole text's state to the first state whose `pos` is not the last token: the
  LONGEST suffix of the text that also occurs ending earlier (overlapping occurrences count), its length `len`
  (uncapped), and `pos + 1`, where the continuation of its EARLIEST occurrence starts. `getDraftTokens` copies up to
  `draftLength` tokens from there, fewer when the text ends first.
- the rule: tensorrt_llm/_torch/speculative/sa_enhancer.py @ 1a487b3f2593ca6fc7b86c542ba0be9442ca94e8
  (`SADraftEnhancer.maybe_override_all_draft_tokens`): after the neural draft loop, for every generation request
  with match_len >= threshold ALL K draft positions are replaced by the SA draft (torch.where on the row).
- which text: tensorrt_llm/_torch/speculative/suffix_automaton.py (`SAResourceManager.prepare_resources`: the
  automaton is built from `req.get_tokens(0)` when the request's first context chunk is scheduled, i.e. the
  prompt) and eagle3.py (`extend_and_prepare` is called with the accepted tokens of the generation requests only,
  `request_ids[num_contexts:]`; the override touches `next_draft_tokens[num_contexts:]`). As read: the draft made
  in the context step is the neural one, and the token sampled in the context step is never appended to the
  automaton (the generation steps append the tokens accepted after it). The port does the same.

Differences, on purpose: where the continuation is shorter than K, upstream's buffer keeps stale tokens in the
remaining positions (verified as ordinary guesses); the port proposes nothing there (`draft_lens`). TensorRT-LLM
turns rejection sampling off with sa_config (its 1.3 llm_args rule); the port's sampled mode verifies the one-hot
SA proposal by rejection sampling, which is lossless too (greedy, validate's default, is identical).

Cost: upstream runs the neural draft loop for every request and overrides afterwards (the SA kernels overlap it
on a side stream), so a matched step costs TensorRT-LLM the same draft forwards. The port skips the trained
drafter's pass on a step where every row matched (its pending positions are drafted over in the next pass, which
gives the same draft KV and the same later proposals), which is what the runtime's batch-1 speed measures.

Lossless by construction, like every drafter: the target verifies (greedy: a draft is kept iff it is the target's
argmax); the acceptance-rule invariant checks it on every validate run.
"""
from __future__ import annotations

import torch

from runtime.engine.drafters import Drafter

UPSTREAM_RULE = ("tensorrt-llm cpp/.../suffixAutomaton/suffixAutomaton.h@b120c7c9 SuffixAutomaton::lookup + "
                 "tensorrt_llm/_torch/speculative/sa_enhancer.py@1a487b3f SADraftEnhancer.maybe_override_all_draft_tokens")
DEFAULT_THRESHOLD = 4          # SAEnhancerConfig.threshold's default
PAD = 0                        # a padded (not proposed) position's token; never accepted


class SuffixAutomaton:
    """The suffix automaton of one request's text, extended token by token (amortised O(1) per token).
    `lookup()`: (start of the continuation, match length) of the longest suffix that also occurs ending earlier,
    taking its earliest occurrence; None when no suffix repeats."""

    __slots__ = ("tokens", "length", "link", "pos", "next", "last")

    def __init__(self, tokens=()):
        self.tokens: list[int] = []
        self.length = [0]                  # per state: the longest string's length
        self.link = [-1]                   # suffix link (-1: none, the root's)
        self.pos = [-1]                    # end of the earliest occurrence (-1: the root, no position)
        self.next: list[dict] = [{}]
        self.last = 0
        for t in tokens:
            self.extend(t)

    def extend(self, token: int) -> None:
        token = int(token)
        self.tokens.append(token)
        length, link, pos, nxt = self.length, self.link, self.pos, self.next
        cur = len(length)
        length.append(length[self.last] + 1)
        link.append(-1)
        pos.append(len(self.tokens) - 1)
        nxt.append({})
        p = self.last
        while p != -1 and token not in nxt[p]:
            nxt[p][token] = cur
            p = link[p]
        if p == -1:
            link[cur] = 0
        else:
            q = nxt[p][token]
            if length[p] + 1 == length[q]:
                link[cur] = q
            else:                          # clone q: same transitions, link and earliest end
                clone = len(length)
                length.append(length[p] + 1)
                link.append(link[q])
                pos.append(pos[q])
                nxt.append(dict(nxt[q]))
                while p != -1 and nxt[p].get(token) == q:
                    nxt[p][token] = clone
                    p = link[p]
                link[q] = clone
                link[cur] = clone
        self.last = cur

    def lookup(self) -> tuple[int, int] | None:
        n = len(self.tokens)
        state = self.last
        while state > 0:                   # upstream: walk the suffix links to the first earlier occurrence
            if self.pos[state] + 1 < n:
                return self.pos[state] + 1, self.length[state]
            state = self.link[state]
        return None

    def draft(self, start: int, k: int) -> list[int]:
        return self.tokens[start:start + k]


def sa_proposal(sam: SuffixAutomaton, k: int, threshold: int) -> tuple[list[int], int]:
    """(the SA draft, the match length): the draft is [] unless the longest repeated suffix is >= threshold long."""
    hit = sam.lookup()
    if hit is None:
        return [], 0
    start, n = hit
    return (sam.draft(start, k) if n >= threshold else []), n


class SuffixEnhancedDrafter(Drafter):
    """A drafter wrapped with the SA enhancer (`SAEnhancerConfig(threshold, enable_global_pool=False)`): per row and
    step, the SA draft when the row's match is >= threshold long, the wrapped drafter's otherwise. The wrapped
    drafter's per-row state is this drafter's too (the engine parks, joins and compacts rows through `row_state`).
    Counters after a run: `lookups`, `sa_steps` (rows x steps the SA draft was used), `sa_drafted`/`sa_accepted`
    and `trained_drafted`/`trained_accepted` (tokens proposed / kept per source), `skipped_passes` (steps in which
    every row matched, so the wrapped drafter did not run)."""

    _OWN = ("sams", "phase", "source")

    def __init__(self, inner: Drafter, threshold: int = DEFAULT_THRESHOLD, vocab_size: int | None = None):
        if threshold < 1:
            raise ValueError(f"threshold must be >= 1 (SAEnhancerConfig.threshold is a PositiveInt), got {threshold}")
        object.__setattr__(self, "inner", inner)
        self.threshold = threshold
        self.vocab_size = vocab_size or getattr(inner, "vocab_size", None)
        self.capture_layers = list(inner.capture_layers)
        self.max_draft_len = inner.max_draft_len
        self.row_state = None if inner.row_state is None else tuple(inner.row_state) + self._OWN
        self.sams: list[SuffixAutomaton] = []
        self.phase: list[int] = []     # 0 prompt only (prefill not observed), 1 context step done, 2 generating
        self.source: list[int] = []    # the last proposal's source per row: 1 SA, 0 wrapped drafter
        self.draft_lens = None
        self.lookups = self.sa_steps = self.skipped_passes = 0
        self.sa_drafted = self.sa_accepted = self.trained_drafted = self.trained_accepted = 0

    # the wrapped drafter's row attributes read and written through this object (DecodeBatch parks/restores them)
    def __getattr__(self, name):
        inner = self.__dict__.get("inner")
        if inner is not None and name in (inner.row_state or ()):
            return getattr(inner, name)
        raise AttributeError(name)

    def __setattr__(self, name, value):
        inner = self.__dict__.get("inner")
        if inner is not None and name in (inner.row_state or ()):
            setattr(inner, name, value)
        else:
            object.__setattr__(self, name, value)

    def reset(self, batch, capacity):
        self.inner.reset(batch, capacity)
        self.sams = [SuffixAutomaton() for _ in range(batch)]
        self.phase = [0] * batch
        self.source = [0] * batch

    def begin(self, prompts):
        self.inner.begin(prompts)
        for sam, p in zip(self.sams, prompts, strict=True):
            for t in p:
                sam.extend(int(t))

    def select_rows(self, idx):
        self.inner.select_rows(idx)
        keep = idx.tolist()
        self.sams = [self.sams[i] for i in keep]
        self.phase = [self.phase[i] for i in keep]
        self.source = [self.source[i] for i in keep]

    def observe(self, hidden, next_tokens, counts):
        self.inner.observe(hidden, next_tokens, counts)
        rows, cs = next_tokens.tolist(), counts.tolist()
        for b, (row, c) in enumerate(zip(rows, cs, strict=True)):
            if self.phase[b] == 0:         # the prefill: the context step's token stays out (upstream, see above)
                self.phase[b] = 1
                continue
            if self.phase[b] == 1:
                self.phase[b] = 2
            if self.source[b]:
                self.sa_accepted += c - 1
            else:
                self.trained_accepted += c - 1
            for t in row[:c]:
                self.sams[b].extend(t)

    def propose(self, last, k, temperature, gen):
        B = len(self.sams)
        sa = [sa_proposal(s, k, self.threshold)[0] if ph == 2 else [] for s, ph in zip(self.sams, self.phase, strict=True)]
        self.lookups += sum(1 for ph in self.phase if ph == 2)
        matched = [bool(p) for p in sa]
        self.source = [int(m) for m in matched]
        self.sa_steps += sum(matched)
        if all(matched):
            self.skipped_passes += 1
            d, q, inner_lens = last.new_zeros(B, 0), None, None
        else:
            d, q = self.inner.propose(last, k, temperature, gen)
            inner_lens = self.inner.draft_lens
        width = max([d.shape[1]] + [len(p) for p in sa])
        tokens = torch.full((B, width), PAD, dtype=torch.long, device=last.device)
        tokens[:, :d.shape[1]] = d
        lens = inner_lens.clone() if inner_lens is not None else torch.full((B,), d.shape[1], device=last.device)
        for b, p in enumerate(sa):
            if p:
                tokens[b, :len(p)] = torch.tensor(p, dtype=torch.long)
                tokens[b, len(p):] = PAD
                lens[b] = len(p)
        self.draft_lens = lens.to(last.device)
        for b in range(B):
            if matched[b]:
                self.sa_drafted += len(sa[b])
            else:
                self.trained_drafted += int(lens[b])
        if temperature <= 0:
            return tokens, None
        return tokens, self._q(tokens, q, matched)

    def _q(self, tokens, q, matched):
        """The proposal distributions: the wrapped drafter's rows as it gave them, one-hot at each SA draft."""
        B, width = tokens.shape
        out = torch.zeros(B, width, self.vocab_size, device=tokens.device)
        if q is not None:
            out[:, :q.shape[1]] = q
        real = torch.arange(width, device=tokens.device)[None] < self.draft_lens[:, None]
        for b in range(B):
            if matched[b]:
                out[b] = 0
                out[b].scatter_(-1, tokens[b, :, None], real[b, :, None].float())
        return out

    def counters(self) -> dict:
        """What the last runs did, for validate's report."""
        return {"lookups": self.lookups, "sa_steps": self.sa_steps, "skipped_passes": self.skipped_passes,
                "sa_drafted": self.sa_drafted, "sa_accepted": self.sa_accepted,
                "trained_drafted": self.trained_drafted, "trained_accepted": self.trained_accepted}
