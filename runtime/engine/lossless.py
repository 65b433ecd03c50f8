"""Is speculative decoding lossless? The three checks that can be made (docs/stages/validate.md):

1. exact, on the unquantized pair: greedy speculative output == autoregressive output, token for token
   (`lossless_diff`, with `tie_margins` for fp32 accumulation-order ties);
2. an invariant of the algorithm under any arithmetic, on every pair (`AcceptanceChecker`): every token the
   engine emits is the token the acceptance rule picks from the logits of the same verification forward, and
   the stream is continuous (each step verifies the previously emitted token, the target's cache advances by
   exactly accepted + 1). Recomputed from `generate(on_verify=...)`'s `VerifyStep`s, independently of the
   engine's own acceptance code;
3. statistical, on the deployed (FP8) pair (`divergence`, `rate_test`): speculative output diverges from the
   batch-1 autoregressive output no faster than the target's own noise floor, i.e. autoregressive decoding of
   the same prompts at other forward shapes (another batch size, the prompt prefilled in chunks).

Why 3 exists: an FP8 target rounds its activations (and KV cache) to E4M3 at every layer. Two forwards of
different shapes (1 vs k+1 tokens, batch 1 vs 4) accumulate their float32 sums in different orders; a
difference of 1e-6 moves a value across an E4M3 rounding boundary now and then, which is a whole quantization
step (1/8 to 1/16 of the value), and 30 layers carry it to the logits. An FP8 target is therefore not
token-for-token deterministic across shapes, and comparing it with itself token for token is not a test of
speculative decoding. (Measured on SmolLM2-135M: docs/stages/validate.md.)
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from runtime.engine.sampling import Sampling
from runtime.engine.target import TargetRunner

# ---------------------------------------------------------------------------------------------- exact


def lossless_diff(spec: list[list[int]], ref: list[list[int]]) -> list[dict]:
    """Requests whose greedy speculative output differs from target-only output, with the first divergence."""
    bad = []
    for i, (a, b) in enumerate(zip(spec, ref, strict=True)):
        if a != b:
            j = next((n for n, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            bad.append({"request": i, "position": j, "speculative": a[j:j + 4], "target": b[j:j + 4]})
    return bad


@torch.no_grad()
def tie_margins(model, prompts: list[list[int]], ref: list[list[int]], bad: list[dict]) -> list[dict]:
    """For each divergence, the target's top-2 logit margin at that position, from one fresh forward over
    prompt + the target-only output before it. Verifying k+1 tokens at once and decoding one at a time do the
    same math in a different order; float rounding (amplified by FP8's E4M3 activation rounding) can flip an
    argmax only where the two best logits are within that noise, so a tiny margin marks a numerical tie,
    a large one a real bug. `gap`: the reference token's logit minus the other output's token's logit there
    (None when one output ended at the divergence)."""
    out = []
    for b in bad:
        seq = prompts[b["request"]] + ref[b["request"]][: b["position"]]
        r = TargetRunner(model)
        r.reset(1, len(seq) + 1)
        logits, _ = r.forward(torch.tensor([seq], device=r.device), logits_at=torch.tensor([len(seq) - 1], device=r.device))
        top = logits[0].topk(2)
        gap = (float(logits[0, b["target"][0]] - logits[0, b["speculative"][0]])
               if b["target"] and b["speculative"] else None)
        out.append({**b, "margin": float(top.values[0] - top.values[1]), "top2": top.indices.tolist(), "gap": gap})
    return out


# ---------------------------------------------------------------------------------------------- invariant

VIOLATION_KINDS = {
    "prompt": "the prefill forward did not process the request's prompt",
    "shape": "logits/tokens/accepted do not fit together",
    "length": "the target's cache length is not prompt + emitted - 1 (a rollback off by some positions)",
    "continuity": "the verified block does not start with the token emitted last",
    "accepted": "an accepted draft token is not the target's choice at its position (greedy: not a maximum of "
                "the logits; sampling: zero probability)",
    "next": "the emitted bonus/correction token is not the target's choice at the first rejected position "
            "(greedy: not a maximum; sampling: zero probability)",
    "rejected": "the token emitted after a rejection equals the rejected draft (it was acceptable, or the "
                "accepted count is off by one)",
    "after_end": "a request was still decoded after its end token or max_new_tokens",
    "output": "the engine's output is not the stream its verification steps decided",
    "missing": "a request was never prefilled",
}


@dataclass
class _Req:
    prompt: list[int]
    emitted: list[int] = field(default_factory=list)
    steps: int = 0


class AcceptanceChecker:
    """`on_verify` callback for one `generate` call: recomputes the acceptance decision of every deciding
    target forward from its logits and checks the stream continuity; `finish(outputs)` then checks that the
    engine returned exactly the stream those steps decided (cut at the first end token / max_new_tokens).

    Greedy (temperature 0): accepted drafts d_1..d_a are maxima of the logits at positions 0..a-1, the emitted
    token is a maximum at position a, and after a rejection (a < k) it differs from d_{a+1}. Ties are
    allowed either way (any maximum is a greedy choice), so the rule does not depend on argmax's tie-breaking.
    Sampling (temperature > 0): the same positions, with "has nonzero probability under the target's
    (temperature, top_p) distribution" instead of "is a maximum", and the token after a rejection differs
    from the rejected draft (the residual max(0, p - q) is zero at a draft the rule rejected). Sampling can
    only be checked for consistency, not reproduced: q and the random numbers are not in the VerifyStep.
    """

    def __init__(self, prompts: list[list[int]], *, max_new_tokens: int, eos: Iterable[int] = (),
                 temperature: float = 0.0, top_p: float = 1.0, max_examples: int = 10):
        self.reqs = [_Req(list(p)) for p in prompts]
        self.max_new = max_new_tokens
        self.eos = frozenset(int(e) for e in eos)
        self.temperature = temperature
        self.top_p = top_p
        self.max_examples = max_examples
        self.forwards = 0          # VerifySteps seen
        self.rows = 0              # (step, request) pairs checked
        self.drafted = 0
        self.violations: dict[str, int] = {}
        self.examples: list[dict] = []

    # -- helpers
    def _bad(self, kind: str, req: int, step: int, **detail) -> None:
        self.violations[kind] = self.violations.get(kind, 0) + 1
        if len(self.examples) < self.max_examples:
            self.examples.append({"kind": kind, "request": req, "step": step, **detail})

    def _finished(self, r: _Req) -> bool:
        return len(r.emitted) >= self.max_new or any(t in self.eos for t in r.emitted)

    def _cut(self, toks: list[int]) -> list[int]:
        stop = next((i for i, t in enumerate(toks) if t in self.eos), None)
        if stop is not None:
            toks = toks[: stop + 1]
        return toks[: self.max_new]

    def _ok(self, logits: torch.Tensor, token: int) -> bool:
        """Whether the target's rule may choose `token` from these logits [V]."""
        logits = logits.float()
        if self.temperature <= 0:
            return bool(logits[token] == logits.max())
        p = torch.softmax(logits / self.temperature, -1)
        if not bool(p[token] > 0):
            return False
        if self.top_p < 1.0:
            # outside every nucleus: the tokens strictly more probable already reach top_p (lenient by 1e-6 at
            # the boundary and at ties, so only what no nucleus could contain is flagged)
            return bool(p[p > p[token]].sum() < self.top_p + 1e-6)
        return True

    # -- the callback
    def __call__(self, st) -> None:
        self.forwards += 1
        tokens, logits = st.tokens, st.logits
        B = tokens.shape[0]
        if logits.shape[0] != B or len(st.requests) != B:
            self._bad("shape", -1, self.forwards, detail=f"tokens {tuple(tokens.shape)} logits {tuple(logits.shape)} "
                                                         f"requests {len(st.requests)}")
            return
        toks_l = tokens.tolist()
        acc_l = st.accepted.tolist()
        nxt_l = st.next_tokens.tolist()
        len_l = st.lengths_before.tolist()
        for r, b in enumerate(st.requests):
            self.rows += 1
            if not 0 <= b < len(self.reqs):
                self._bad("shape", b, self.forwards, detail="request index out of range")
                continue
            q = self.reqs[b]
            step = q.steps
            q.steps += 1
            if step == 0:                                          # the prefill
                P = len(q.prompt)
                if toks_l[r][:P] != q.prompt:
                    self._bad("prompt", b, step, got=toks_l[r][:8], want=q.prompt[:8])
                if len_l[r] != P:
                    self._bad("length", b, step, got=len_l[r], want=P)
                if not self._ok(logits[r, -1], nxt_l[r]):
                    self._bad("next", b, step, position=0, token=nxt_l[r],
                              best=int(logits[r, -1].argmax()))
                q.emitted.append(nxt_l[r])
                continue
            if self._finished(q):
                self._bad("after_end", b, step, emitted=len(q.emitted))
            T = tokens.shape[1]
            k = T - 1
            a = acc_l[r]
            if logits.shape[1] != T or not 0 <= a <= k:
                self._bad("shape", b, step, detail=f"tokens {T} logits {logits.shape[1]} accepted {a}")
                continue
            self.drafted += k
            want_len = len(q.prompt) + len(q.emitted) - 1
            if len_l[r] != want_len:
                self._bad("length", b, step, got=len_l[r], want=want_len)
            x, drafts = toks_l[r][0], toks_l[r][1:]
            if x != q.emitted[-1]:
                self._bad("continuity", b, step, got=x, want=q.emitted[-1])
            for j in range(a):
                if not self._ok(logits[r, j], drafts[j]):
                    self._bad("accepted", b, step, position=j + 1, token=drafts[j], best=int(logits[r, j].argmax()))
                    break
            if not self._ok(logits[r, a], nxt_l[r]):
                self._bad("next", b, step, position=a, token=nxt_l[r], best=int(logits[r, a].argmax()))
            if a < k and nxt_l[r] == drafts[a]:
                self._bad("rejected", b, step, position=a + 1, token=nxt_l[r])
            q.emitted += drafts[:a] + [nxt_l[r]]

    def finish(self, outputs: list[list[int]]) -> AcceptanceChecker:
        for b, q in enumerate(self.reqs):
            if q.steps == 0:
                self._bad("missing", b, 0)
                continue
            want = self._cut(q.emitted)
            got = list(outputs[b]) if b < len(outputs) else None
            if got != want:
                j = next((n for n, (u, v) in enumerate(zip(got or [], want, strict=False)) if u != v),
                         min(len(got or []), len(want)))
                self._bad("output", b, q.steps, position=j, got=(got or [])[j:j + 4], want=want[j:j + 4])
        return self

    def as_dict(self) -> dict:
        return {"forwards": self.forwards, "rows": self.rows, "drafted": self.drafted,
                "tokens": sum(len(self._cut(q.emitted)) for q in self.reqs),
                "violations": sum(self.violations.values()), "by_kind": dict(self.violations),
                "examples": list(self.examples)}


class InvariantTally:
    """Sums `AcceptanceChecker` results over many generate calls (all runs of one pair)."""

    def __init__(self, max_examples: int = 10):
        self.generations = 0
        self.forwards = self.rows = self.drafted = self.tokens = 0
        self.by_kind: dict[str, int] = {}
        self.examples: list[dict] = []
        self.max_examples = max_examples

    def add(self, chk: AcceptanceChecker, run: str) -> None:
        d = chk.as_dict()
        self.generations += 1
        for f in ("forwards", "rows", "drafted", "tokens"):
            setattr(self, f, getattr(self, f) + d[f])
        for kk, v in d["by_kind"].items():
            self.by_kind[kk] = self.by_kind.get(kk, 0) + v
        for e in d["examples"]:
            if len(self.examples) < self.max_examples:
                self.examples.append({"run": run, **e})

    @property
    def violations(self) -> int:
        return sum(self.by_kind.values())

    def as_dict(self) -> dict:
        return {"passed": self.violations == 0, "generations": self.generations, "forwards": self.forwards,
                "rows_checked": self.rows, "drafted": self.drafted, "tokens": self.tokens,
                "violations": self.violations, "by_kind": dict(self.by_kind),
                "kinds": {k: VIOLATION_KINDS[k] for k in self.by_kind}, "examples": list(self.examples)}


def checked_generate(engine, prompts: list[list[int]], *, tally: InvariantTally | None = None, run: str = "",
                     **kw):
    """`engine.generate(prompts, **kw)` with an `AcceptanceChecker` on every verification forward; the result
    is added to `tally`. Returns (Generation, AcceptanceChecker)."""
    eos = kw.get("eos_token_id")
    eos = () if eos is None else ((eos,) if isinstance(eos, int) else tuple(eos))
    sampling = kw.get("sampling") or Sampling()
    chk = AcceptanceChecker(prompts, max_new_tokens=kw["max_new_tokens"], eos=eos,
                            temperature=sampling.temperature, top_p=sampling.top_p)
    g = engine.generate(prompts, on_verify=chk, **kw)
    chk.finish(g.tokens)
    if tally is not None:
        tally.add(chk, run)
    return g, chk


# ---------------------------------------------------------------------------------------------- noise floor


@torch.no_grad()
def decode_chunked_prefill(model, prompts: list[list[int]], *, max_new_tokens: int, eos: Iterable[int] = (),
                           chunk: int = 16) -> list[list[int]]:
    """Greedy autoregressive decoding, one request at a time, with the prompt prefilled in chunks of `chunk`
    tokens (what a serving engine with chunked prefill does). The same math as one prefill forward, in other
    shapes: on an exact target the output equals `generate`'s; on an FP8 target it shows the noise floor."""
    stop = frozenset(int(e) for e in eos)
    outs = []
    r = TargetRunner(model)
    for p in prompts:
        r.reset(1, len(p) + max_new_tokens + 2)
        dev = r.device
        logits = None
        for i in range(0, len(p), chunk):
            c = p[i:i + chunk]
            logits, _ = r.forward(torch.tensor([c], device=dev))
            r.commit(torch.tensor([len(c)], device=dev))
        out = [int(logits[0, -1].argmax())]
        while len(out) < max_new_tokens and out[-1] not in stop:
            lg, _ = r.forward(torch.tensor([[out[-1]]], device=dev))
            r.commit(torch.tensor([1], device=dev))
            out.append(int(lg[0, -1].argmax()))
        outs.append(out)
    return outs


def first_divergence(out: list[int], ref: list[int]) -> int | None:
    if out == ref:
        return None
    return next((n for n, (x, y) in enumerate(zip(out, ref, strict=False)) if x != y), min(len(out), len(ref)))


def divergence(outs: list[list[int]], refs: list[list[int]]) -> dict:
    """Per arm against the reference: prompts diverging, first-divergence positions, and the exposure = token
    positions compared up to and including the first divergence (all of the reference when none). The
    divergence rate per token = diverging / exposure is the maximum-likelihood hazard of a first divergence
    when each emitted token flips independently with the same small probability (a geometric model)."""
    first = [first_divergence(o, r) for o, r in zip(outs, refs, strict=True)]
    exposure = sum((f + 1) if f is not None else len(r) for f, r in zip(first, refs, strict=True))
    n_div = sum(f is not None for f in first)
    hit = [f for f in first if f is not None]
    return {"prompts": len(refs), "diverging": n_div, "share_diverging": round(n_div / len(refs), 4) if refs else 0.0,
            "exposure": exposure, "rate_per_token": round(n_div / exposure, 6) if exposure else 0.0,
            "mean_first_divergence": round(sum(hit) / len(hit), 2) if hit else None, "first_divergence": first}


def binom_sf(x: int, n: int, p: float) -> float:
    """P(X >= x) for X ~ Binomial(n, p)."""
    if x <= 0:
        return 1.0
    if x > n:
        return 0.0
    return min(1.0, sum(math.comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(x, n + 1)))


def rate_test(d_s: int, e_s: int, d_n: int, e_n: int, *, ratio: float, alpha: float) -> dict:
    """One-sided exact test of H0: rate_S <= ratio * rate_N for two Poisson counts d_s, d_n with exposures
    e_s, e_n (divergences per compared token). Conditional on n = d_s + d_n, d_s ~ Binomial(n, pi0) on the
    boundary of H0, pi0 = ratio e_s / (ratio e_s + e_n); p = P(X >= d_s). Fails when p < alpha."""
    n = d_s + d_n
    if e_s == 0 or n == 0:
        p = 1.0
    elif e_n == 0:
        p = 0.0 if d_s else 1.0
    else:
        pi0 = ratio * e_s / (ratio * e_s + e_n)
        p = binom_sf(d_s, n, pi0)
    return {"p_value": round(p, 6), "passed": p >= alpha}
