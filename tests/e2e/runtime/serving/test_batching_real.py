"""Continuous batching on the real model (tests/e2e: `real_model`, prepared by `bash bench/real_model/prepare.sh`):
SmolLM2 requests joining a running batch decode what they decode alone. The rest: test_batching.py."""
from __future__ import annotations

import json

import pytest


@pytest.mark.slow
def test_real_model_requests_joining_decode_what_they_decode_alone(real_model):
    """SmolLM2-135M-Instruct (30 layers, GQA, RoPE theta 1e5), target alone: chat prompts joining a running batch
    after two steps decode exactly what they decode alone, up to the end-of-turn id."""
    from transformers import AutoTokenizer

    from runtime.engine.speculative import SpeculativeEngine
    from runtime.engine.target import load_target
    from runtime.serving.adapter import eos_ids

    md = real_model["model_dir"]
    tok = AutoTokenizer.from_pretrained(md)
    rows = [json.loads(x) for x in (real_model["data_dir"] / "gsm8k.jsonl").read_text().splitlines()[:3]]
    text = [tok.apply_chat_template(r["messages"][:1], tokenize=False, add_generation_prompt=True) for r in rows]
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in text]
    eos = eos_ids(md, tok)
    eng = SpeculativeEngine(load_target(md))
    solo = [eng.generate([p], max_new_tokens=12, eos_token_id=eos).tokens[0] for p in ids]
    b = eng.batch()
    keys = b.add([ids[0]], max_new_tokens=12, eos_token_id=eos)
    b.step()
    b.step()
    keys += b.add(ids[1:], max_new_tokens=12, eos_token_id=eos)
    while b.live:
        b.step()
    assert [b.finished[k].tokens for k in keys] == solo
    assert max(b.stats.rows_per_step) == 3
