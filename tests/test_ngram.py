"""Prompt-lookup (n-gram) drafting (runtime/engine/ngram.py): the proposal rule against vLLM's own function, and
speculative decoding with it against plain greedy decoding on a tiny target.

Upstream: vLLM 0.32.0 `vllm/v1/spec_decode/ngram_proposer.py::_find_longest_matched_ngram_and_propose_tokens`
(imported from the vLLM environment in a subprocess; under CI=true a missing environment fails, elsewhere that
comparison skips). The fixed cases: the docstring example of `NgramProposer.propose` in that file and cases worked
by hand with its rule; the random-case test runs them through vLLM's function too.
"""
from __future__ import annotations

import json
import os
import random
import subprocess

import pytest
import torch

from runtime.engine.lossless import checked_generate
from runtime.engine.ngram import NgramDrafter, longest_match_proposal
from runtime.engine.speculative import SpeculativeEngine

# (tokens, min_n, max_n, k, max_model_len, vLLM's answer)
FIXED = [
    ([1, 2, 3, 4, 2, 3], 2, 3, 4, 100, [4, 2, 3]),              # NgramProposer.propose's docstring
    ([1, 2, 3, 4, 1, 2, 3, 5, 6], 2, 2, 2, 100, []),            # no suffix match
    ([1, 2, 3, 4, 1, 2, 3], 2, 2, 3, 100, [4, 1, 2]),
    ([1, 2, 3, 4, 1, 2, 3], 2, 2, 2, 100, [4, 1]),
    ([1, 2, 3, 4, 1, 2, 3], 1, 1, 3, 100, [4, 1, 2]),
    ([1, 2, 3, 4, 1, 2, 3], 1, 1, 1, 100, [4]),
    ([1, 3, 6, 2, 3, 4, 1, 2, 3], 1, 3, 3, 100, [4, 1, 2]),    # the longest n-gram wins over a later shorter one
    ([1, 2, 3, 4, 1, 2, 3], 1, 3, 3, 9, [4, 1]),               # capped by the model length
    ([1, 2, 3, 2, 3, 2, 3], 2, 2, 3, 100, [2, 3, 2]),          # earliest occurrence wins
    ([5, 5, 5, 5], 1, 3, 4, 100, [5]),                         # overlapping self-match, continuation cut at the end
]


@pytest.mark.parametrize("tokens,min_n,max_n,k,max_len,want", FIXED)
def test_rule_on_fixed_cases(tokens, min_n, max_n, k, max_len, want):
    assert longest_match_proposal(tokens, min_n, max_n, k, max_len) == want


def _random_cases(n: int, seed: int = 0) -> list[tuple]:
    rnd = random.Random(seed)
    cases = []
    for _ in range(n):
        vocab = rnd.choice([2, 3, 5, 20])               # small vocabularies: many repeats and ties
        toks = [rnd.randrange(vocab) for _ in range(rnd.randrange(0, 60))]
        lo = rnd.randrange(1, 5)
        cases.append((toks, lo, lo + rnd.randrange(0, 4), rnd.randrange(1, 8), rnd.choice([1000, len(toks) + 2])))
    return cases


_VLLM_SCRIPT = """
import json, sys
import numpy as np
from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens as f
out = []
for toks, lo, hi, k, ml in json.load(sys.stdin):
    r = f(origin_tokens=np.array(toks, dtype=np.int32), min_ngram=lo, max_ngram=hi, max_model_len=ml, k=k)
    out.append([] if r is None else [int(t) for t in r])
print(json.dumps(out))
"""


def test_rule_equals_vllms_function_on_random_cases():
    """2000 random contexts (small vocabularies, so repeats and equal-length matches at several positions are
    common): the port and vLLM's numba function propose the same tokens."""
    from runtime.vllm import engine as E

    try:
        py = E.find_vllm().python
    except E.VllmUnavailable as e:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(str(e))
        pytest.skip(str(e))
    cases = _random_cases(2000) + [c[:5] for c in FIXED]
    r = subprocess.run([str(py), "-c", _VLLM_SCRIPT], input=json.dumps(cases), capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    theirs = json.loads(r.stdout.strip().splitlines()[-1])
    ours = [longest_match_proposal(*c) for c in cases]
    bad = [(c, a, b) for c, a, b in zip(cases, ours, theirs) if a != b]
    assert not bad, bad[:5]
    assert sum(1 for t in theirs if t) > 500          # the cases do exercise matches


@pytest.fixture(scope="module")
def tiny_target():
    """A random tiny Llama with a peaky head: its greedy output loops, so prompt lookup finds matches."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=256, tie_word_embeddings=False)
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(4)
    return m


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = random.Random(seed)
    out = []
    for i in range(n):
        motif = [g.randrange(64) for _ in range(g.randrange(2, 6))]
        out.append((motif * 4 + [g.randrange(64) for _ in range(g.randrange(1, 9))])[: 6 + 3 * i])
    return out


def test_speculative_with_ngram_equals_greedy_and_accepts(tiny_target):
    """Greedy speculative decoding with n-gram drafts gives the plain greedy output token for token, batched
    (rows with proposals of different lengths, rows with none) and at batch 1; the acceptance-rule invariant
    holds on every verification; the drafts are accepted often on looping output; only real proposals count."""
    prompts = _prompts(6, 1)
    ref = SpeculativeEngine(tiny_target, drafter=None).generate(prompts, max_new_tokens=40).tokens
    eng = SpeculativeEngine(tiny_target, drafter=NgramDrafter(1, 3, 64))
    g, chk = checked_generate(eng, prompts, max_new_tokens=40, draft_len=4)
    assert g.tokens == ref
    assert chk.as_dict()["violations"] == 0, chk.as_dict()
    s = g.stats
    assert s.acceptance_length > 1.5, s.as_dict()
    assert 0 < s.drafted < 4 * s.steps                  # some steps proposed fewer than k (or nothing)
    assert s.accepted <= s.drafted
    for p, want in zip(prompts[:2], ref[:2]):
        assert eng.generate([p], max_new_tokens=40, draft_len=4).tokens[0] == want
    # a target whose greedy output never repeats a 5-gram of the prompt: no drafts at all, still exact
    eng5 = SpeculativeEngine(tiny_target, drafter=NgramDrafter(5, 5, 64))
    g5 = eng5.generate([[1, 2, 3]], max_new_tokens=3, draft_len=4)
    assert g5.tokens == SpeculativeEngine(tiny_target).generate([[1, 2, 3]], max_new_tokens=3).tokens
    assert g5.stats.drafted == 0 and g5.stats.acceptance_length == 1.0


def test_sampling_with_ngram_keeps_the_target_distribution(tiny_target):
    """Rejection sampling with the deterministic (one-hot) n-gram proposal: the second generated token's law,
    estimated from 16000 samples of a looping prompt, matches the target's exact conditional law."""
    prompt = [5, 9, 5, 9, 5]
    T, N = 0.7, 16000
    eng = SpeculativeEngine(tiny_target, drafter=NgramDrafter(1, 2, 64))
    with torch.no_grad():
        g = eng.generate([prompt] * N, max_new_tokens=2, draft_len=2, temperature=T, seed=5)
        assert 0 < g.stats.accepted < g.stats.drafted
        p1 = torch.softmax(tiny_target(torch.tensor([prompt])).logits[0, -1] / T, -1)
        p2 = torch.softmax(tiny_target(torch.tensor([prompt + [a] for a in range(64)])).logits[:, -1] / T, -1)
    joint = torch.zeros(64, 64)
    for a, b in g.tokens:
        joint[a, b] += 1 / N
    exact = p1[:, None] * p2
    tv = 0.5 * (joint.sum(0) - exact.sum(0)).abs().sum().item()
    assert tv < 0.04, tv
