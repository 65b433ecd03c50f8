"""Prompt-lookup (n-gram) drafting (runtime/engine/ngram_drafter.py): the proposal rule against vLLM's own function, and
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
from runtime.engine.ngram_drafter import NgramDrafter, longest_match_proposal
from runtime.engine.sampling import Sampling
from runtime.engine.speculative import SpeculativeEngine

from support.vllm_env import vllm_install

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
    py = vllm_install().python
    cases = _random_cases(2000) + [c[:5] for c in FIXED]
    r = subprocess.run([str(py), "-c", _VLLM_SCRIPT], input=json.dumps(cases), capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    theirs = json.loads(r.stdout.strip().splitlines()[-1])
    ours = [longest_match_proposal(*c) for c in cases]
    bad = [(c, a, b) for c, a, b in zip(cases, ours, theirs, strict=True) if a != b]
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
    for p, want in zip(prompts[:2], ref[:2], strict=True):
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
        g = eng.generate([prompt] * N, max_new_tokens=2, draft_len=2, sampling=Sampling(T, seed=5))
        assert 0 < g.stats.accepted < g.stats.drafted
        p1 = torch.softmax(tiny_target(torch.tensor([prompt])).logits[0, -1] / T, -1)
        p2 = torch.softmax(tiny_target(torch.tensor([prompt + [a] for a in range(64)])).logits[:, -1] / T, -1)
    joint = torch.zeros(64, 64)
    for a, b in g.tokens:
        joint[a, b] += 1 / N
    exact = p1[:, None] * p2
    tv = 0.5 * (joint.sum(0) - exact.sum(0)).abs().sum().item()
    assert tv < 0.04, tv


# ---------------------------------------------------------------------------------------------- validate and build


def test_validate_measures_ngram_per_domain_beside_the_trained_draft(run_dir):
    """The tiny run's validate: n-gram drafting on every domain (same prompts), which pays more judged on AL, in
    acceptance.json, the stage metrics (`status --json`) and the report's table."""
    from conftest import artifact_dir, run_cli, status_json

    acc = json.loads((artifact_dir(run_dir, "validate") / "acceptance.json").read_text())
    ng = acc["ngram"]
    assert (ng["min_n"], ng["max_n"], ng["k"]) == (1, 4, acc["measured_draft_len"])
    assert set(ng["comparison"]) == set(acc["domains"]) | {"overall"}
    for d, v in acc["domains"].items():
        n, t = v["ngram"], v["fp8"]
        assert n["prompts"] == t["prompts"] and n["steps"] > 0 and 0 <= n["accepted"] <= n["drafted"]
        c = ng["comparison"][d]
        assert c["ngram"]["acceptance_length"] == n["acceptance_length"]
        assert c["pays_more"] == ("ngram" if n["acceptance_length"] > t["acceptance_length"] else "trained")
        assert c["al_difference"] == pytest.approx(n["acceptance_length"] - t["acceptance_length"], abs=1e-3)
    assert acc["lossless"]["invariant"]["pairs"]["fp8"]["passed"]      # the n-gram runs are checked there too
    m = next(s for s in status_json(run_dir)["stages"] if s["name"] == "validate")["metrics"]["ngram"]
    assert set(m) == set(ng["comparison"]) and all(x["pays_more"] in ("ngram", "trained") for x in m.values())
    r = run_cli("report", "--workdir", str(run_dir))
    assert r.returncode == 0, r.stderr
    assert "free n-gram (prompt-lookup) drafting" in (run_dir / "report.html").read_text()


def test_ngram_deployment_files_and_key_checks(run_dir, tmp_path):
    """build.ngram's writer on the tiny run's deployment options: TensorRT-LLM options with NGramDecodingConfig
    (every key in 1.2.1's field list), vLLM's speculative_config, serve scripts, the README naming the winners; a
    key TensorRT-LLM does not know fails with its name."""
    import yaml

    from runtime.trtllm import ngram_deployment as N
    from runtime.trtllm.schema import unknown_keys

    from conftest import artifact_dir

    base = yaml.safe_load((artifact_dir(run_dir, "build") / "deployment" / "llm_api_options.yaml").read_text())
    acc = json.loads((artifact_dir(run_dir, "validate") / "acceptance.json").read_text())
    settings, src = N.resolve({"k": None, "min_n": None, "max_n": None}, acc["ngram"], 4)
    assert settings == {"k": acc["ngram"]["k"], "min_n": 1, "max_n": 4} and src == "validate's measurement"
    doc = N.write_ngram(tmp_path / "ngram", base, "1.2.1", "/m/target", settings, acc["ngram"]["comparison"], None)
    opts = yaml.safe_load((tmp_path / "ngram" / "llm_api_options.yaml").read_text())
    assert opts["speculative_config"] == {"decoding_type": "NGram", "max_draft_len": settings["k"],
                                          "max_matching_ngram_size": 4, "is_keep_all": True, "is_use_oldest": True,
                                          "is_public_pool": False}
    assert unknown_keys(opts, "1.2.1") == [] and opts["max_batch_size"] == base["max_batch_size"]
    sc = json.loads((tmp_path / "ngram" / "vllm_speculative_config.json").read_text())
    assert sc == {"method": "ngram", "num_speculative_tokens": settings["k"], "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    assert "--speculative-config" in (tmp_path / "ngram" / "serve_vllm.sh").read_text()
    assert os.access(tmp_path / "ngram" / "serve_trtllm.sh", os.X_OK)
    assert doc["ngram_pays_more_on"] == N.winners(acc["ngram"]["comparison"])
    good = N.ngram_speculative_config
    bad = lambda k, n: {**good(k, n), "is_use_newest": True}  # noqa: E731
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(N, "ngram_speculative_config", bad)
        with pytest.raises(ValueError, match="speculative_config.is_use_newest"):
            N.ngram_options(base, 3, 2, "1.2.1")


def test_real_vllm_serves_the_written_ngram_config(run_dir, tmp_path):
    """vLLM 0.32 CPU serves the target with the speculative_config build writes (runtime/vllm/ngram_config.py): greedy
    output identical to plain greedy decoding of the same target (specpipe's runtime, fp32), and vLLM's spec-decode
    counters move. The target: a random tiny Llama with head_dim 32 (vLLM's CPU attention has no kernel for 16,
    vllm/v1/attention/backends/cpu_attn.py at v0.32.0) and a peaky head, so its output loops and lookup hits;
    the tokenizer is the tiny run's."""
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM

    from runtime.vllm import engine as E
    from runtime.vllm import ngram_config as VN

    from conftest import artifact_dir

    inst = vllm_install()
    src = artifact_dir(run_dir, "target") / "model"
    tcfg = json.loads((src / "config.json").read_text())
    torch.manual_seed(1)
    cfg = LlamaConfig(vocab_size=tcfg["vocab_size"], hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                      tie_word_embeddings=False, bos_token_id=tcfg.get("bos_token_id"), eos_token_id=tcfg.get("eos_token_id"))
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(6)
    model.save_pretrained(tmp_path / "target")
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, tmp_path / "target" / f.name)
    prompts = [[1, 17, 42, 99, 7, 17, 42], [1, 300, 301, 12, 300, 301]]
    ref = SpeculativeEngine(model).generate(prompts, max_new_tokens=24).tokens
    sc = VN.speculative_config(3, 1, 4)
    srv = E.VllmServer(inst, E.ServeArgs(str(tmp_path / "target"), max_model_len=256, dtype="float32",
                                         extra_args=("--speculative-config", json.dumps(sc))),
                       kv_cache_gib=1, log_path=tmp_path / "vllm.log")
    with srv:
        before = srv.spec_decode()
        out = srv.generate(prompts, max_tokens=24, ignore_eos=True)
        d = srv.spec_decode() - before
    assert out == ref
    assert d.drafts > 0 and 0 < d.accepted <= d.draft_tokens
