"""The step-wise core of the speculative engine (`DecodeBatch`): a batch of live requests of different lengths
that requests join (`add`: one prefill forward) and leave (eos, token budget, `cancel`) between steps. Each
`step` for every live row (target has processed n tokens; x is the next token, not yet processed):
  1. the drafter proposes k tokens d1..dk (`runtime.engine.drafters`);
  2. the target verifies [x, d1..dk] in ONE forward (positions n..n+k) with its KV cache;
  3. acceptance (the rule the batch was given, `runtime.engine.sampling.accept` by default);
  4. rollback: the target keeps n + a + 1 cache positions (x and the a accepted tokens), the rest are
     overwritten later; the drafter receives the target hidden states of the kept positions.
Every deciding target forward is reported as a `VerifyStep` (`on_verify`).

A batch is given what it runs on (the target runner, the drafter, the acceptance rule and the `Seat` its engine's
batches share); it knows nothing of the engine that made it (`runtime.engine.speculative.SpeculativeEngine.batch`)."""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from runtime.engine.drafters import Drafter
from runtime.engine.layers import KVCache
from runtime.engine.sampling import GREEDY, Sampling, accept, pick
from runtime.engine.stats import RequestStats, RunStats
from runtime.engine.target import TargetRunner


@dataclass
class VerifyStep:
    """One target forward that decided tokens, as `generate(on_verify=...)` reports it. Row r of every tensor
    belongs to request `requests[r]`. The prefill is reported as a step with `tokens` = the padded prompts,
    `logits` [B, 1, V] at each prompt's last position, `accepted` 0 and `next_tokens` the first new tokens."""

    requests: list[int]              # request index of each row
    tokens: torch.Tensor             # [B, k+1] the verified tokens [x, d1..dk] (prefill: the prompts)
    logits: torch.Tensor             # [B, k+1, V] the target's logits at those positions
    lengths_before: torch.Tensor     # [B] cache length of each row when this forward ran (prefill: prompt lengths)
    accepted: torch.Tensor           # [B] draft tokens accepted
    next_tokens: torch.Tensor        # [B] the token emitted after the accepted ones (bonus / correction)


def _eos_set(eos) -> frozenset[int]:
    if eos is None:
        return frozenset()
    if isinstance(eos, int):
        return frozenset((eos,))
    return frozenset(int(e) for e in eos)


@dataclass
class BatchRequest:
    """One request of a `DecodeBatch`: its generated tokens so far and its statistics."""

    key: int
    max_new_tokens: int
    eos: frozenset[int]
    prompt_len: int
    tokens: list[int] = field(default_factory=list)
    stats: RequestStats = field(default_factory=RequestStats)
    finish: str | None = None          # "stop" (an eos id) | "length" | "cancelled" once it left the batch


@dataclass(frozen=True)
class StepHooks:
    """What a batch reports as it decodes: `on_tokens(request key, tokens)` each time tokens are appended to a
    request's output, `on_verify(VerifyStep)` after every deciding target forward (None: not reported)."""

    on_tokens: Callable[[int, list[int]], None] | None = None
    on_verify: Callable[[VerifyStep], None] | None = None


class Seat:
    """Which batch holds the target's cache and the drafter's per-row state now. Several batches may share one
    target and drafter (one per sampling rule, `runtime.serving.batching`): they share one seat, and a batch that
    runs parks the state of the one that held it (`DecodeBatch._enter`)."""

    def __init__(self):
        self.batch: DecodeBatch | None = None


class DecodeBatch:
    """The step-wise core of the speculative engine: a batch of live requests that requests join and leave between
    steps. `add(prompts)` prefills the new prompts (one target forward over them) and appends their rows to
    the running batch, so they take part in the next `step()`; `step()` drafts for every live row and verifies
    all of them in ONE target forward; a row leaves the batch when it reaches an eos id or its token budget,
    or when `cancel(key)` removes it. Rows have their own lengths (the KV caches hold per-row lengths).

    One temperature / top_p / random generator per batch (rows share the generator, so a sampled request's
    draws depend on what else is in the batch; greedy rows do not). Statistics accumulate in `stats` as in
    `generate`; finished requests wait in `finished` (key -> BatchRequest) until the caller pops them."""

    def __init__(self, target: TargetRunner, drafter: Drafter | None, *, draft_len: int, sampling: Sampling = GREEDY,
                 hooks: StepHooks = StepHooks(), accept_rule: Callable = accept, seat: Seat | None = None):
        """`accept_rule(logits, d, q, temperature, gen, top_p, lens=...)` -> (accepted [B], next tokens [B]): the
        acceptance rule (`runtime.engine.sampling.accept`; an engine may pass its own). `seat`: the one every batch
        on this target and drafter shares (a batch of its own when None)."""
        self.target = target
        self.accept_rule = accept_rule
        self.seat = seat if seat is not None else Seat()
        self.drafter = drafter if draft_len > 0 else None
        self.k = draft_len if self.drafter is not None else 0
        d = self.drafter
        if d is not None and d.max_draft_len is not None and self.k > d.max_draft_len:
            raise ValueError(f"draft_len {self.k} exceeds what the drafter can propose ({d.max_draft_len})")
        self.temperature, self.top_p = sampling.temperature, sampling.top_p
        self.on_tokens, self.on_verify = hooks.on_tokens, hooks.on_verify
        self.device = target.device
        self.gen = torch.Generator(device=self.device).manual_seed(sampling.seed)  # on the device: multinomial needs it there
        self.stats = RunStats(self.k)
        self.rows: list[BatchRequest] = []       # live requests, in batch-row order
        self.x: torch.Tensor | None = None       # [B] the next token of each row (decided, not yet processed)
        self.finished: dict[int, BatchRequest] = {}
        self._next_key = 0
        self._parked = None

    @property
    def live(self) -> int:
        return len(self.rows)

    def keys(self) -> list[int]:
        return [r.key for r in self.rows]

    # -- joining
    @torch.no_grad()
    def add(self, prompts: list[list[int]], *, max_new_tokens: int | list[int],
            eos_token_id: int | Iterable[int] | None = None, keys: list[int] | None = None) -> list[int]:
        """Prefill `prompts` and append them to the batch; returns their keys (`keys` if given, else the next
        integers). `max_new_tokens`: one budget for all or one per prompt. Their first token (from the prefill)
        is emitted here."""
        if any(len(p) == 0 for p in prompts):
            raise ValueError("empty prompt")
        if not prompts:
            return []
        budgets = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
        if len(budgets) != len(prompts) or min(budgets) < 0:
            raise ValueError(f"max_new_tokens must be >= 0 for each prompt, got {max_new_tokens}")
        if keys is None:
            keys = list(range(self._next_key, self._next_key + len(prompts)))
        taken = set(self.keys()) | set(self.finished)
        if len(keys) != len(prompts) or len(set(keys)) != len(keys) or taken & set(keys):
            raise ValueError(f"keys must be unique and new, one per prompt, got {keys}")
        self._next_key = max(self._next_key, max(keys) + 1)
        eos = _eos_set(eos_token_id)
        self._enter()
        tgt, drafter = self.target, self.drafter
        joining = bool(self.rows)
        if joining and drafter is not None and drafter.row_state is None:
            raise ValueError(f"{type(drafter).__name__} declares no row_state: it cannot take rows into a running batch")
        t0 = time.perf_counter()
        B = len(prompts)
        cap = max(len(p) + n for p, n in zip(prompts, budgets, strict=True)) + self.k + 2
        T = max(len(p) for p in prompts)
        if joining:                                         # set the running batch's state aside
            saved = self._state()
        try:
            x, toks, logits, lens = self._prefill(prompts, cap)
        except BaseException:
            if joining:                                     # the running rows carry on untouched
                self._restore(saved)
            raise
        if joining:                                         # running rows first, then the new ones
            tgt.cache = _cat_caches(saved[0], tgt.cache)
            # A drafter's next pass may cover every row's pending positions padded to the longest (EAGLE-3: the new
            # rows' whole prompt), written from each row's own length: the running rows need that much room.
            room = int(saved[0].lengths.max()) + T + self.k + 2
            for a, old in saved[1].items():
                new = getattr(drafter, a)
                setattr(drafter, a, _cat_caches(old, new, room) if isinstance(old, KVCache) else list(old) + list(new))
            self.x = torch.cat((self.x, x))
        else:
            self.x = x
        new_rows = [BatchRequest(key, n, eos, len(p)) for key, p, n in zip(keys, prompts, budgets, strict=True)]
        self.rows += new_rows
        self.stats.prefill_s += time.perf_counter() - t0
        if self.on_verify is not None:
            self.on_verify(VerifyStep([r.key for r in new_rows], toks, logits[:, None], lens, torch.zeros_like(lens), x))
        first = len(self.rows) - B
        done = [False] * first + self._append(new_rows, [[t] for t in x.tolist()])
        self._compact(done)
        return [r.key for r in new_rows]

    def _prefill(self, prompts: list[list[int]], cap: int):
        """The target processes every prompt token (fresh caches for these rows); its last logits give the
        first new token, and the drafter observes the prompt."""
        tgt, drafter, dev = self.target, self.drafter, self.device
        B = len(prompts)
        tgt.reset(B, cap)
        if drafter is not None:
            drafter.reset(B, cap)
            drafter.begin(prompts)
        lens = torch.tensor([len(p) for p in prompts], device=dev)
        T = int(lens.max())
        toks = torch.zeros(B, T, dtype=torch.long, device=dev)
        for b, p in enumerate(prompts):
            toks[b, :len(p)] = torch.tensor(p, device=dev)
        logits, hid = tgt.forward(toks, logits_at=lens - 1)
        tgt.commit(lens)
        x, _ = pick(logits, self.temperature, self.gen, self.top_p)
        if drafter is not None:
            nxt = torch.cat((toks[:, 1:], toks.new_zeros(B, 1)), 1)
            nxt[torch.arange(B, device=dev), lens - 1] = x
            drafter.observe(hid, nxt, lens)
        return x, toks, logits, lens

    # -- one step of every live row
    @torch.no_grad()
    def step(self) -> list[int]:
        """Draft for every live row, verify all of them in one target forward, accept, roll back, emit.
        Returns the keys of the requests that finished in this step (now in `finished`)."""
        if not self.rows:
            return []
        self._enter()
        tgt, drafter, dev, k, stats = self.target, self.drafter, self.device, self.k, self.stats
        n_live = len(self.rows)
        x = self.x
        t0 = time.perf_counter()
        d, q, lens = self._propose(x)
        verify = x[:, None] if d is None else torch.cat((x[:, None], d), 1)
        t1 = time.perf_counter()
        before = tgt.lengths.clone()
        logits, hid = tgt.forward(verify)
        t2 = time.perf_counter()
        ragged = {} if lens is None else {"lens": lens}
        acc, bonus = self.accept_rule(logits, d, q, self.temperature, self.gen, self.top_p, **ragged)
        tgt.commit(acc + 1)
        if self.on_verify is not None:
            self.on_verify(VerifyStep(self.keys(), _mark_padding(verify, lens), logits, before, acc, bonus))
        t3 = time.perf_counter()
        if drafter is not None:       # draft-side work: counted as draft time
            nxt = bonus[:, None].clone() if d is None else torch.cat((d, d.new_zeros(n_live, 1)), 1)
            nxt[torch.arange(n_live, device=dev), acc] = bonus
            drafter.observe(hid, nxt, acc + 1)
        t4 = time.perf_counter()
        new = []
        acc_l, bonus_l = acc.tolist(), bonus.tolist()
        d_l = d.tolist() if d is not None else None
        n_l = [k] * n_live if lens is None else lens.tolist()
        for r, req in enumerate(self.rows):
            a = acc_l[r]
            new.append((d_l[r][:a] if d_l else []) + [bonus_l[r]])
            if k:
                rs = req.stats
                rs.steps += 1
                rs.drafted += n_l[r]
                rs.accepted += a
                stats.record_step(a, n_l[r])
        stats.steps += n_live if k else 0
        stats.drafted += sum(n_l) if k else 0
        stats.accepted += int(acc.sum()) if k else 0
        stats.rows_per_step.append(n_live)
        self.x = bonus
        done = self._append(self.rows, new)
        finished = self._compact(done)
        t5 = time.perf_counter()
        stats.draft_s += (t1 - t0) + (t4 - t3)
        stats.target_s += t2 - t1
        stats.other_s += (t3 - t2) + (t5 - t4)
        return finished

    def _propose(self, x: torch.Tensor):
        """(drafts [B, k'] or None, q or None, real lengths [B] or None) for this step. A drafter whose proposals
        vary in length (`draft_lens`) may return fewer than k columns, none when no row has a proposal."""
        drafter = self.drafter
        if drafter is None:
            return None, None, None
        d, q = drafter.propose(x, self.k, self.temperature, self.gen)
        lens = drafter.draft_lens
        if d.shape[1] == 0:
            return None, None, torch.zeros(len(x), dtype=torch.long, device=x.device)
        return d, q, lens

    # -- leaving
    def cancel(self, keys: Iterable[int]) -> list[int]:
        """Remove live requests (a cancelled or disconnected client): their rows are freed before the next step.
        Returns the keys that were live; each is in `finished` with finish 'cancelled'."""
        ks = set(keys)
        done = [r.key in ks for r in self.rows]
        if any(done):
            self._enter()
        for r, dn in zip(self.rows, done, strict=True):
            if dn:
                r.finish = "cancelled"
        return self._compact(done)

    def _enter(self) -> None:
        """Several batches may share one target and drafter (one `Seat`): the target's cache and the drafter's
        per-row state belong to whichever batch runs; the others' are parked until they run again."""
        cur = self.seat.batch
        if cur is self:
            return
        if cur is not None and cur.rows:
            cur._parked = cur._state()
        if self.rows:
            self._restore(self._parked)
            self._parked = None
        self.seat.batch = self

    def _state(self):
        d = self.drafter
        if d is not None and d.row_state is None:
            raise ValueError(f"{type(d).__name__} declares no row_state: two batches cannot share it")
        return self.target.cache, ({a: getattr(d, a) for a in d.row_state} if d is not None else {})

    def _restore(self, state) -> None:
        self.target.cache = state[0]
        for a, v in state[1].items():
            setattr(self.drafter, a, v)

    def _append(self, rows: list[BatchRequest], new: list[list[int]]) -> list[bool]:
        done = []
        for req, toks in zip(rows, new, strict=True):
            stop = next((i for i, t in enumerate(toks) if t in req.eos), None)
            if stop is not None:
                toks = toks[: stop + 1]
            room = req.max_new_tokens - len(req.tokens)
            req.tokens.extend(toks[:room])
            if self.on_tokens is not None and toks[:room]:
                self.on_tokens(req.key, toks[:room])
            if stop is not None and stop < room:
                req.finish = "stop"
            elif len(req.tokens) >= req.max_new_tokens:
                req.finish = "length"
            done.append(req.finish is not None)
        return done

    def _compact(self, done: list[bool]) -> list[int]:
        if not any(done):
            return []
        gone = [r for r, dn in zip(self.rows, done, strict=True) if dn]
        keep = [i for i, dn in enumerate(done) if not dn]
        idx = torch.tensor(keep, dtype=torch.long, device=self.device)
        if keep:
            self.target.select_rows(idx)
            if self.drafter is not None:
                self.drafter.select_rows(idx)
        self.x = self.x.index_select(0, idx)
        self.rows = [self.rows[i] for i in keep]
        for r in gone:
            self.finished[r.key] = r
        return [r.key for r in gone]


def _mark_padding(verify: torch.Tensor, lens: torch.Tensor | None) -> torch.Tensor:
    """The verified block as `on_verify` reports it: a padded (not proposed) draft position reads -1."""
    if lens is None or verify.shape[1] == 1:
        return verify
    pos = torch.arange(1, verify.shape[1], device=verify.device)[None]
    out = verify.clone()
    out[:, 1:] = verify[:, 1:].masked_fill(pos > lens[:, None], -1)
    return out


def _cat_caches(a: KVCache, b: KVCache, min_capacity: int = 0) -> KVCache:
    """The rows of `a` followed by the rows of `b` in one cache (capacities padded to the largest)."""
    cap = max(a.capacity, b.capacity, min_capacity)

    def grow(t: torch.Tensor, c: int) -> torch.Tensor:
        return t if c == cap else torch.cat((t, t.new_zeros(*t.shape[:2], cap - c, t.shape[3])), 2)

    out = object.__new__(KVCache)
    out.k = [torch.cat((grow(x, a.capacity), grow(y, b.capacity))) for x, y in zip(a.k, b.k, strict=True)]
    out.v = [torch.cat((grow(x, a.capacity), grow(y, b.capacity))) for x, y in zip(a.v, b.v, strict=True)]
    out.lengths = torch.cat((a.lengths, b.lengths))
    out.capacity = cap
    out.fp8_scale = a.fp8_scale      # the same drafter's caches: the same KV precision
    return out

