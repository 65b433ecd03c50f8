"""The suffix-automaton draft enhancer (runtime/engine/suffix.py) against TensorRT-LLM's own rules, and speculative
decoding with it against plain greedy decoding on the tiny ModelOpt pair.

Upstream references transcribed here (NVIDIA/TensorRT-LLM, files at the commits the search index holds):
- `_upstream_lookup`: tensorrt_llm/_torch/speculative/suffix_automaton.py @ aba252566a7bd1a8abb8815cf46d3b7d6e2aa360,
  `SuffixAutomatonState.lookup` + `get_draft_tokens`, the Python fallback upstream shipped beside its CUDA kernel
  (a brute-force search: for every suffix length, its first occurrence ending before the last token; the longest
  wins). The port is a transcription of the other implementation, the C++ automaton (suffixAutomaton.h @
  b120c7c9436f2f3e20da1fa64df67da73fce51b8), so the random-context test compares upstream's two implementations'
  rule through the port (the fallback's 1024-token window never binds on these contexts).
- `_upstream_override`: tensorrt_llm/_torch/speculative/sa_enhancer.py @ 1a487b3f2593ca6fc7b86c542ba0be9442ca94e8,
  `SADraftEnhancer.maybe_override_all_draft_tokens` (mask = match_len >= threshold over all K positions, torch.where).
"""
from __future__ import annotations

import random

import pytest
import torch

from runtime.engine.drafters import Drafter
from runtime.engine.lossless import checked_generate
from runtime.engine.speculative import SpeculativeEngine, load_pair
from runtime.engine.suffix import SuffixAutomaton, SuffixEnhancedDrafter, sa_proposal


def _upstream_lookup(text: list[int]):
    """suffix_automaton.py @ aba25256 SuffixAutomatonState.lookup, transcribed: (position after the match, length)."""
    if len(text) < 2:
        return None
    n = len(text)
    best_pos, best_len = None, 0
    for suffix_len in range(1, n):
        suffix_start = n - suffix_len
        suffix = text[suffix_start:]
        search_start = max(0, n - suffix_len - 1024)
        for pos in range(search_start, n - suffix_len):
            if text[pos:pos + suffix_len] == suffix:
                if suffix_len > best_len:
                    best_len = suffix_len
                    best_pos = pos + suffix_len
                break
    return (best_pos, best_len) if best_pos is not None else None


def _upstream_override(draft_tokens: torch.Tensor, match_len: torch.Tensor, sa_tokens: torch.Tensor, threshold: int):
    """sa_enhancer.py @ 1a487b3f SADraftEnhancer.maybe_override_all_draft_tokens, transcribed."""
    K = draft_tokens.shape[1]
    mask = (match_len >= threshold).unsqueeze(1).expand_as(draft_tokens)
    return torch.where(mask, sa_tokens[:, :K], draft_tokens)


# (text, k, threshold, SA draft, match length), worked by hand with the rule
FIXED = [
    ([1, 2, 3, 4, 1, 2, 3], 3, 1, [4, 1, 2], 3),            # "1 2 3" repeats: continue after its first occurrence
    ([1, 2, 3, 4, 1, 2, 3], 3, 4, [], 3),                   # ... but 3 < threshold 4: no SA draft
    ([5, 5, 5, 5], 4, 1, [5], 3),                           # overlapping self-match; the text ends after 1 token
    ([1, 2, 3, 1, 2, 3, 1, 2, 3], 4, 2, [1, 2, 3], 6),      # period 3: longest repeat 6, continuation only 3
    ([7, 8, 9], 2, 1, [], 0),                               # nothing repeats
    ([1, 9, 2, 9, 3, 9], 2, 1, [2, 9], 1),                  # several 1-token repeats: the earliest one
    ([4, 1, 2, 5, 1, 2, 6, 1, 2], 2, 2, [5, 1], 2),         # "1 2" three times: the earliest continuation
]


@pytest.mark.parametrize("text,k,threshold,want,n", FIXED)
def test_lookup_on_fixed_cases(text, k, threshold, want, n):
    assert sa_proposal(SuffixAutomaton(text), k, threshold) == (want, n)
    hit = _upstream_lookup(text)
    assert (hit[1] if hit else 0) == n


def test_automaton_equals_upstream_lookup_on_random_contexts():
    """1500 random texts over small vocabularies (repeats and equal-length matches at several places are common),
    extended token by token as the engine does: after every token the port's lookup (position, length) and its
    k-token draft equal upstream's Python transcription on the same prefix."""
    rnd = random.Random(0)
    checked = hits = 0
    for _ in range(1500):
        vocab = rnd.choice([2, 3, 5, 20])
        text = [rnd.randrange(vocab) for _ in range(rnd.randrange(1, 70))]
        k = rnd.randrange(1, 8)
        sam = SuffixAutomaton()
        for i, t in enumerate(text):
            sam.extend(t)
            ours, theirs = sam.lookup(), _upstream_lookup(text[:i + 1])
            assert ours == theirs, (text[:i + 1], ours, theirs)
            if theirs:
                assert sam.draft(ours[0], k) == text[:i + 1][theirs[0]:theirs[0] + k]
                hits += 1
            checked += 1
    assert checked > 40000 and hits > checked // 2


class _Fixed(Drafter):
    """A drafter proposing given tokens (the enhancer's rule is what is under test; its inner drafter is data)."""

    row_state = ("rows",)

    def __init__(self, tokens: torch.Tensor):
        self.tokens, self.rows = tokens, []

    def reset(self, batch, capacity):
        self.rows = list(range(batch))

    def propose(self, last, k, temperature, gen):
        return self.tokens[:, :k], None


def test_override_rule_equals_upstream_enhancer():
    """Random texts per row, random trained drafts, thresholds 1-6: the enhanced drafter's block equals upstream's
    torch.where override wherever the SA continuation fills all K positions; where it is shorter, the port proposes
    only the continuation (draft_lens) where upstream verifies stale buffer tokens."""
    rnd = random.Random(1)
    for trial in range(300):
        B, K, thr = rnd.randrange(1, 5), rnd.randrange(1, 6), rnd.randrange(1, 7)
        texts = [[rnd.randrange(rnd.choice([2, 3, 6])) for _ in range(rnd.randrange(2, 40))] for _ in range(B)]
        trained = torch.randint(100, 200, (B, K))
        dr = SuffixEnhancedDrafter(_Fixed(trained), threshold=thr, vocab_size=300)
        dr.reset(B, 64)
        dr.begin(texts)
        dr.phase = [2] * B                         # generating (the context step's rule is tested below)
        got, _ = dr.propose(torch.zeros(B, dtype=torch.long), K, 0.0, None)
        match_len = torch.tensor([(SuffixAutomaton(t).lookup() or (0, 0))[1] for t in texts])
        sa = torch.zeros(B, K, dtype=torch.long)
        for b, t in enumerate(texts):
            hit = _upstream_lookup(t)
            if hit:
                cont = t[hit[0]:hit[0] + K]
                sa[b, :len(cont)] = torch.tensor(cont)
        want = _upstream_override(trained, match_len, sa, thr)
        lens = dr.draft_lens.tolist()
        for b in range(B):
            assert got[b, :lens[b]].tolist() == want[b, :lens[b]].tolist(), (trial, texts[b], thr)
            assert lens[b] == (K if match_len[b] < thr else min(K, len(texts[b]) - _upstream_lookup(texts[b])[0]))


def test_context_step_draft_is_the_trained_one_and_its_token_stays_out():
    """As upstream: the draft made right after prefill is the wrapped drafter's even on a repeating prompt, and the
    token sampled then is not appended to the automaton (generation steps append what they accept)."""
    trained = torch.full((1, 3), 42)
    dr = SuffixEnhancedDrafter(_Fixed(trained), threshold=1, vocab_size=64)
    dr.reset(1, 64)
    dr.begin([[1, 2, 3, 1, 2, 3]])
    dr.observe(None, torch.tensor([[2, 3, 1, 2, 3, 9]]), torch.tensor([6]))      # prefill; 9 = the context token
    assert dr.propose(torch.tensor([9]), 3, 0.0, None)[0].tolist() == [[42, 42, 42]]
    dr.observe(None, torch.tensor([[1, 2, 0, 0]]), torch.tensor([2]))            # generation step: 1, 2 accepted
    assert dr.sams[0].tokens == [1, 2, 3, 1, 2, 3, 1, 2]
    tok, _ = dr.propose(torch.tensor([2]), 3, 0.0, None)
    assert tok.tolist() == [[3, 1, 2]] and dr.sa_steps == 1 and dr.skipped_passes == 1


# ---------------------------------------------------------------------------------------------- on the tiny pair


@pytest.fixture(scope="module")
def tiny():
    from support.tiny_models import tiny_assets

    return tiny_assets()


def _repeating_prompts(tiny, n: int) -> list[list[int]]:
    """Prompts that repeat a span of code: the continuation is often in the prompt, so the automaton matches."""
    data = tiny["data"]
    out = []
    for i in range(n):
        span = data[2000 + 700 * i: 2000 + 700 * i + 24].tolist()
        out.append(span + span[:12 + i])
    return out


@pytest.mark.parametrize("which", ["eagle_dir", "dflash_dir"])
def test_enhanced_speculative_equals_greedy_and_the_invariant_holds(tiny, which):
    """Greedy speculative decoding with the enhanced drafter (threshold 2) gives the plain greedy output token for
    token, batched and at batch 1; the acceptance-rule invariant holds on every verification; SA drafts are used,
    and some steps skip the trained drafter's pass."""
    model, draft = load_pair(tiny["target_dir"], tiny[which])
    prompts = _repeating_prompts(tiny, 4)
    ref = SpeculativeEngine(model).generate(prompts, max_new_tokens=32).tokens
    eng = SpeculativeEngine(model, draft)
    eng.drafter = dr = SuffixEnhancedDrafter(eng.drafter, threshold=2)
    g, chk = checked_generate(eng, prompts, max_new_tokens=32, draft_len=3)
    assert g.tokens == ref
    assert chk.as_dict()["violations"] == 0, chk.as_dict()
    assert dr.sa_steps > 0 and dr.sa_accepted > 0 and dr.trained_drafted > 0
    for p, want in zip(prompts[:2], ref[:2], strict=True):
        assert eng.generate([p], max_new_tokens=32, draft_len=3).tokens[0] == want
    assert dr.skipped_passes > 0


def test_sampled_proposals_are_one_hot_where_the_sa_draft_replaced_the_trained_one():
    """Rejection sampling needs q per drafted position: a row the SA draft took gets q one-hot at each SA token and
    zero in its padded positions (a deterministic proposal: accepted with probability p(x), the residual keeps the
    target's law, as for n-gram drafts); a row the trained draft kept gets the trained q unchanged."""

    class _FixedQ(_Fixed):
        def propose(self, last, k, temperature, gen):
            q = torch.softmax(torch.randn(2, k, 16, generator=torch.Generator().manual_seed(0)), -1)
            return self.tokens[:, :k], q

    dr = SuffixEnhancedDrafter(_FixedQ(torch.tensor([[9, 9, 9], [8, 8, 8]])), threshold=2, vocab_size=16)
    dr.reset(2, 64)
    dr.begin([[1, 2, 3, 1, 2], [5, 6, 7]])      # row 0: "1 2" repeats (match 2) and continues 3 1 2
    dr.phase = [2, 2]
    tok, q = dr.propose(torch.zeros(2, dtype=torch.long), 3, 0.8, None)
    n0 = int(dr.draft_lens[0])
    assert n0 == 3 and tok[0].tolist() == [3, 1, 2] and dr.draft_lens[1] == 3
    for j in range(n0):
        assert q[0, j].sum() == 1 and q[0, j, tok[0, j]] == 1
    ref = torch.softmax(torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(0)), -1)
    assert torch.equal(q[1], ref[1]) and tok[1].tolist() == [8, 8, 8]


def test_padded_positions_of_a_short_sa_draft_have_zero_q():
    dr = SuffixEnhancedDrafter(_Fixed(torch.tensor([[9, 9, 9, 9]])), threshold=1, vocab_size=16)
    dr.reset(1, 64)
    dr.begin([[4, 4, 4]])                         # period 1: the SA continuation is one token
    dr.phase = [2]
    tok, q = dr.propose(torch.zeros(1, dtype=torch.long), 4, 0.8, None)
    assert dr.draft_lens.tolist() == [1] and tok[0, 0] == 4
    assert q[0, 0, 4] == 1 and (q[0, 1:] == 0).all()
