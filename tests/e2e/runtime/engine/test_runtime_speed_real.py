"""The runtime's compute modes on the real model (tests/e2e: `real_model`, prepared by `bash bench/real_model/prepare.sh`):
fp32 is Hugging Face greedy and speculation exact on SmolLM2; the bf16 mode's contract. The rest: test_runtime_speed.py."""
from __future__ import annotations

import json

import pytest
import torch

from runtime.engine.lossless import lossless_diff
from runtime.engine.speculative import SpeculativeEngine
from runtime.engine.target import TargetRunner, load_target

from support.script_drafter import ScriptDrafter

# ---------------------------------------------------------------------------------------------- real model


def _real_prompts(real_model, tok, per_domain=1, max_tokens=160):
    out = []
    for name in ("humaneval", "gsm8k", "sharegpt_heldout"):
        lines = (real_model["data_dir"] / f"{name}.jsonl").read_text().splitlines()
        for line in lines[:per_domain]:
            user = next(m for m in json.loads(line)["messages"] if m["role"] == "user")
            ids = tok.apply_chat_template([user], add_generation_prompt=True, tokenize=True)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
            out.append(ids[-max_tokens:])
    return out


@pytest.fixture(scope="module")
def smol(real_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(real_model["model_dir"])
    model = load_target(real_model["model_dir"])
    return {"model": model, "tok": tok, "prompts": _real_prompts(real_model, tok)}


@pytest.mark.slow
def test_real_model_fp32_mode_is_hf_greedy_and_speculation_is_exact(smol):
    """SmolLM2 in the default fp32 mode: prefill logits are the Hugging Face forward's, batched autoregressive
    tokens are HF `generate`'s (greedy; attention_mask given, since the ChatML prompt holds <|im_end|>, which is
    also the pad id), and speculative decoding (k = 4, verification of 5 rows, partly rejected drafts, batch 3)
    gives exactly the autoregressive tokens."""
    model, prompts = smol["model"], smol["prompts"]
    N = 24
    with torch.no_grad():
        p = prompts[0]
        ref = model(torch.tensor([p])).logits[0].float()
        r = TargetRunner(model)
        r.reset(1, len(p) + 4)
        got, _ = r.forward(torch.tensor([p]))
        torch.testing.assert_close(got[0], ref, atol=1e-4, rtol=1e-5)
        ar = SpeculativeEngine(model, drafter=None).generate(prompts, max_new_tokens=N).tokens
        for p, a in zip(prompts, ar, strict=True):
            hf = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                max_new_tokens=N, do_sample=False, eos_token_id=None)[0, len(p):].tolist()
            assert a == hf
        refs = SpeculativeEngine(model, drafter=None).generate(prompts, max_new_tokens=N + 6).tokens
        eng = SpeculativeEngine(model, drafter=ScriptDrafter(refs, prompts, model.config.vocab_size, wrong=2))
        sp = eng.generate(prompts, max_new_tokens=N, draft_len=4)
    assert lossless_diff(sp.tokens, ar) == []
    assert 2.5 < sp.stats.acceptance_length < 4.5          # drafts were partly accepted: the 5-row path ran


@pytest.mark.slow
def test_real_model_bf16_mode_contract(smol):
    """SmolLM2, bf16 mode against the exact mode, teacher-forced on the exact mode's greedy continuations:
    every logit within 1.0 (logits reach ~45 here; bf16 weights and activations carry 8 significant bits) and
    >= 97 % of greedy choices the same (docs/serving.md states this contract)."""
    model, prompts = smol["model"], smol["prompts"]
    with torch.no_grad():
        ar = SpeculativeEngine(model, drafter=None).generate(prompts, max_new_tokens=32).tokens
        diffs, agree, n = [], 0, 0
        for p, a in zip(prompts, ar, strict=True):
            seq = torch.tensor([p + a])
            out = {}
            for mode in ("fp32", "bf16"):
                r = TargetRunner(model, compute=mode)
                r.reset(1, seq.shape[1] + 1)
                out[mode] = r.forward(seq)[0][0, len(p) - 1:]
            diffs.append((out["bf16"] - out["fp32"]).abs().max().item())
            agree += int((out["bf16"].argmax(-1) == out["fp32"].argmax(-1)).sum())
            n += out["fp32"].shape[0]
    assert max(diffs) < 1.0, diffs
    assert agree / n >= 0.97, (agree, n)
    assert max(diffs) > 0                                  # the bf16 mode did run in bf16
