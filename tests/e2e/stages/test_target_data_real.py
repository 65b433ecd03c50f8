"""Stages `target` and `data` on the real model (tests/e2e: `real_model`, SmolLM2-135M-Instruct and its prompt sets,
prepared by `bash bench/real_model/prepare.sh`): its stop ids, its stock ChatML template's masks, regeneration equal to
Hugging Face generate, user chat templates. The stages on the tiny target: test_target_data.py."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import run_cli
from support import DATA
from support.stage_runs import config_file as _config
from support.stage_runs import jsonl as _jsonl
from support.stage_runs import only_upto as _only_upto
from support.stage_runs import parquet_rows as _rows

# ------------------------------------------------------------------------------------------ the real model


REAL_EOT = "<|im_end|>"
SMOL_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


def _link_tree(src: Path, dst: Path) -> Path:
    import os
    import shutil

    shutil.copytree(src, dst, copy_function=os.link)
    return dst


@pytest.fixture(scope="module")
def real_target(tmp_path_factory, real_model):
    """A workdir whose target stage is SmolLM2-135M-Instruct (stock tokenizer and ChatML template), committed."""
    tmp = tmp_path_factory.mktemp("real_target")
    cfg = _config(tmp, {"model": str(real_model["model_dir"])})
    r = run_cli("build", str(cfg), "--workdir", str(tmp / "w"), *_only_upto("target"))
    assert r.returncode == 0, r.stderr[-3000:]
    return tmp / "w", real_model


def _real_data_run(tmp_path: Path, real_target, data: dict, *extra: str, env: dict | None = None):
    wd_src, real = real_target
    wd = _link_tree(wd_src, tmp_path / "w")
    cfg = _config(tmp_path, {"model": str(real["model_dir"])}, data)
    return wd, run_cli("build", str(cfg), "--workdir", str(wd), *_only_upto("data"), *extra, env=env)


def _head(path: Path, n: int, name: str, tmp_path: Path, pick=lambda rec: True) -> Path:
    out = []
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if pick(rec):
            out.append(rec)
        if len(out) >= n:
            break
    return _jsonl(tmp_path, out, name)


def test_real_model_target_stop_ids(real_target):
    t = json.loads((real_target[0] / "artifacts" / "target" / "target.json").read_text())
    assert t["eos_token_ids"] == [2] and t["eos_token_id"] == 2 and t["end_of_turn"] == {"id": 2, "token": REAL_EOT}
    assert t["eos_sources"] == {"chat_template": [2], "config": [2], "generation_config": [2], "tokenizer": [2]}
    assert t["eos_rejected"] == []


def test_converted_tokenizer_eos_turn_start_is_rejected(tmp_path, real_model):
    """The raw GGUF->HF conversion says eos <|im_start|> (1): it opens every turn. The target stage must not make it
    a stop id: eos_token_ids is <|im_end|> (2, config.json's and the template's end of turn), with a warning."""
    d = tmp_path / "m"
    d.mkdir()
    for p in real_model["model_dir"].iterdir():
        if p.name != "tokenizer_config.json":
            (d / p.name).hardlink_to(p)
    tc = json.loads((real_model["model_dir"] / "tokenizer_config.json").read_text())
    tc["eos_token"] = "<|im_start|>"
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    wd = tmp_path / "w"
    r = run_cli("build", str(_config(tmp_path, {"model": str(d)})), "--workdir", str(wd), *_only_upto("target"))
    assert r.returncode == 0, r.stderr[-3000:]
    t = json.loads((wd / "artifacts" / "target" / "target.json").read_text())
    assert t["eos_sources"]["tokenizer"] == [1]
    assert t["eos_token_ids"] == [2] and t["eos_token_id"] == 2
    assert [(x["id"], x["token"], x["source"]) for x in t["eos_rejected"]] == [(1, "<|im_start|>", "tokenizer")]
    log = (wd / "logs" / "target.log").read_text()
    assert "tokenizer eos 1 (<|im_start|>) is not used as a stop id" in log and "assistant header" in log
    assert "stop ids (eos_token_ids): 2 (<|im_end|>)" in log


def test_real_model_stock_template_masks_every_assistant_turn(tmp_path, real_target):
    """SmolLM2's stock ChatML template (no generation tags): main refused it ('marks no assistant tokens'). GSM8K
    question/answer chats and multi-turn ShareGPT chats: the loss mask is exactly each answer + <|im_end|>."""
    from transformers import AutoTokenizer

    data_dir = real_target[1]["data_dir"]
    gsm = _head(data_dir / "gsm8k.jsonl", 12, "gsm.jsonl", tmp_path)
    multi = _head(data_dir / "sharegpt_chats.jsonl", 6, "multi.jsonl", tmp_path,
                  lambda r: sum(m["role"] == "assistant" for m in r["messages"]) >= 2
                  and sum(len(m["content"]) for m in r["messages"]) < 900)
    ev = _head(data_dir / "humaneval.jsonl", 3, "ev.jsonl", tmp_path)
    data = {"sources": [{"kind": "jsonl", "path": str(gsm), "domain": "math"}, {"kind": "jsonl", "path": str(multi),
                                                                                "domain": "chat"}],
            "eval_domains": {"code": {"kind": "jsonl", "path": str(ev)}}, "max_length": 512, "eval_fraction": 0.0,
            "min_length": 4}
    wd, r = _real_data_run(tmp_path, real_target, data)
    assert r.returncode == 0, r.stderr[-3000:]
    tok = AutoTokenizer.from_pretrained(real_target[1]["model_dir"])
    recs = {}
    for p in (gsm, multi):
        for line in p.read_text().splitlines():
            recs[json.loads(line)["messages"][0]["content"]] = json.loads(line)["messages"]
    rows = _rows(wd, "train")
    assert len(rows) == 18
    n_multi = 0
    for row in rows:
        ids, mask = row["input_ids"], row["loss_mask"]
        text = tok.decode(ids)
        assert text.startswith(SMOL_SYSTEM)
        msgs = recs[text[len(SMOL_SYSTEM):].split("<|im_start|>user\n", 1)[1].split(REAL_EOT)[0]]
        runs, cur = [], []
        for t, m in zip(ids + [None], mask + [0], strict=True):
            if m:
                cur.append(t)
            elif cur:
                runs.append(tok.decode(cur))
                cur = []
        assert runs == [m["content"] + REAL_EOT for m in msgs if m["role"] == "assistant"]
        untrained = tok.decode([t for t, m in zip(ids, mask, strict=True) if not m])
        assert all(m["content"] in untrained for m in msgs if m["role"] == "user") and "You are a helpful AI" in untrained
        n_multi += len(runs) >= 2
    assert n_multi == 6
    stats = json.loads((wd / "artifacts" / "data" / "stats.json").read_text())
    assert stats["chat_template"]["mask_method"] == "prefix_renderings" and stats["chat_template"]["end_of_turn"] == REAL_EOT
    shipped = (wd / "artifacts" / "data" / "chat_template.jinja").read_text()
    assert shipped == (real_target[1]["model_dir"] / "chat_template.jinja").read_text()


@pytest.mark.slow
def test_real_model_regeneration_equals_hf_generate_and_the_template(tmp_path, real_target):
    """Prompt-only chats regenerated through specpipe's runtime (greedy) give exactly HF `generate`'s greedy tokens
    (transformers 5.14.1, batch 1, fp32: the correctness anchor); every response that ended at <|im_end|> is exactly
    what the chat template renders for that assistant turn; the loss mask is the generated ids."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    asks = ["Say hello in three words.", "What is the capital of France? Answer in one word.",
            "Name one primary color.", "Write a Python function that adds two numbers."]
    src = _jsonl(tmp_path, [{"messages": [{"role": "user", "content": a}]} for a in asks])
    ev = _head(real_target[1]["data_dir"] / "gsm8k.jsonl", 2, "ev.jsonl", tmp_path)
    data = {"sources": [{"kind": "jsonl", "path": str(src)}], "eval_domains": {"m": {"kind": "jsonl", "path": str(ev)}},
            "eval_fraction": 0.0, "min_length": 4, "regenerate": {"enabled": True, "max_new_tokens": 40, "batch_size": 3}}
    wd, r = _real_data_run(tmp_path, real_target, data)
    assert r.returncode == 0, r.stderr[-3000:]
    model_dir = real_target[1]["model_dir"]
    tok = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = {tok.decode(x["input_ids"]).split("<|im_start|>user\n")[1].split(REAL_EOT)[0]: x for x in _rows(wd, "train")}
    assert sorted(rows) == sorted(asks)
    ended = 0
    for a in asks:
        msgs = [{"role": "user", "content": a}]
        prompt = list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=40, do_sample=False, eos_token_id=[2], pad_token_id=2)[0, len(prompt):].tolist()
        row = rows[a]
        assert row["input_ids"] == prompt + out, a
        assert row["loss_mask"] == [0] * len(prompt) + [1] * len(out)
        if out[-1] == 2:
            ended += 1
            content = tok.decode(out[:-1])
            full = tok.apply_chat_template(msgs + [{"role": "assistant", "content": content}], tokenize=True,
                                           return_dict=True)["input_ids"]
            assert list(full)[: len(row["input_ids"])] == row["input_ids"]
            assert tok.decode(out) == content + REAL_EOT
    assert ended >= 1
    st = json.loads((wd / "artifacts" / "data" / "stats.json").read_text())["regeneration"]
    assert st["ended_at_stop"] == ended and st["hit_max_new_tokens"] == len(asks) - ended
    assert st["template"]["checked"] == ended and st["template"]["consistent"] == ended
    assert st["prompts_per_s"] > 0 and st["new_tokens_per_s"] > 0 and st["stop_ids"] == [2]
    log = (wd / "logs" / "data.log").read_text()
    assert "prompts/s" in log and "new tokens/s" in log and "ended at a stop id" in log


@pytest.mark.slow
def test_regeneration_sampling_honours_temperature_top_p_and_seed(real_model):
    import logging

    from transformers import AutoTokenizer

    from runtime.data.regenerate import Decoding, RegenRun, regenerate

    tok = AutoTokenizer.from_pretrained(real_model["model_dir"])
    prompts = [list(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                            return_dict=True)["input_ids"]) for q in ("Tell me a story.", "Describe the sea.")]
    log = logging.getLogger("test.regenerate")

    def gen(temperature, top_p, seed):
        return regenerate(real_model["model_dir"], prompts, ["a", "b"], batch_size=2,
                          decoding=Decoding(12, temperature, top_p, [2], seed), run=RegenRun(None, log))[0]

    greedy = gen(0.0, 1.0, 0)
    assert gen(1.0, 1e-6, 5) == greedy                  # a nucleus of one token is greedy
    assert gen(1e-4, 1.0, 5) == greedy                  # so is a temperature near 0
    s0 = gen(1.5, 1.0, 0)
    assert gen(1.5, 1.0, 0) == s0 and s0 != greedy      # sampling: reproducible per seed, not greedy
    assert gen(1.5, 1.0, 1) != s0                       # another seed, another sample


@pytest.mark.slow
def test_user_chat_template_renders_samples_and_eval_prompts(tmp_path, real_target):
    """data.chat_template (vLLM's ChatML example: no default system prompt) replaces SmolLM2's own for the eval prompts
    and the regenerated samples, and is stored in the artifact; it leaves the last message open, so conversations
    with answers cannot be masked with it: refused, naming the sample."""
    tmpl = DATA / "chat_templates" / "vllm-chatml.jinja"
    src = _jsonl(tmp_path, [{"messages": [{"role": "user", "content": a}]} for a in ("Hi there.", "Count to three.",
                                                                                     "Name a fruit.")])
    ev = _head(real_target[1]["data_dir"] / "gsm8k.jsonl", 2, "ev.jsonl", tmp_path)
    data = {"sources": [{"kind": "jsonl", "path": str(src)}], "eval_domains": {"m": {"kind": "jsonl", "path": str(ev)}},
            "eval_fraction": 0.0, "min_length": 4, "chat_template": str(tmpl), "max_prompt_tokens": 512,
            "regenerate": {"enabled": True, "max_new_tokens": 6, "batch_size": 4}}
    wd, r = _real_data_run(tmp_path, real_target, data)
    assert r.returncode == 0, r.stderr[-3000:]
    art = wd / "artifacts" / "data"
    ev_rows = [json.loads(x) for x in (art / "eval" / "m.jsonl").read_text().splitlines()]
    assert all(e["prompt"].startswith("<|im_start|>user\n") and e["prompt"].endswith("<|im_end|>\n<|im_start|>assistant\n")
               for e in ev_rows)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(real_target[1]["model_dir"])
    for row in _rows(wd, "train"):
        prompt = tok.decode([t for t, m in zip(row["input_ids"], row["loss_mask"], strict=True) if not m])
        assert prompt.startswith("<|im_start|>user\n") and "SmolLM" not in prompt and prompt.endswith("<|im_start|>assistant\n")
    assert (art / "chat_template.jinja").read_text() == tmpl.read_text()
    stats = json.loads((art / "stats.json").read_text())
    assert stats["chat_template"]["source"] == f"data.chat_template ({tmpl})"
    # with answers to mask, the open last message is refused
    gsm = _head(real_target[1]["data_dir"] / "gsm8k.jsonl", 4, "gsm.jsonl", tmp_path)
    (tmp_path / "b").mkdir()
    _, r = _real_data_run(tmp_path / "b", real_target, {**data, "sources": [{"kind": "jsonl", "path": str(gsm)}],
                                                        "regenerate": {"enabled": False}})
    assert r.returncode == 1
    assert f"{gsm}:" in r.stderr and "is not closed by the end-of-turn token '<|im_end|>'" in r.stderr


@pytest.mark.slow
def test_regenerating_first_turns_fits_long_chats_the_last_turn_cannot(tmp_path, real_target):
    """data.regenerate.turns: multi-turn chats whose context before the last assistant turn is longer than
    max_length - max_new_tokens are all skipped with `last` (refused: no prompt fits) and all used with `first`: the
    first user turn alone, answered by the target, nothing of the later turns in the sample."""
    long_turn = "Please explain this in great detail. " * 40
    chats = [{"messages": [{"role": "user", "content": f"Name fruit number {i}."}, {"role": "assistant", "content": "Apple."},
                           {"role": "user", "content": long_turn}, {"role": "assistant", "content": "Sure."}]}
             for i in range(6)]
    src = _jsonl(tmp_path, chats)
    ev = _head(real_target[1]["data_dir"] / "gsm8k.jsonl", 2, "ev.jsonl", tmp_path)
    data = {"sources": [{"kind": "jsonl", "path": str(src)}], "eval_domains": {"m": {"kind": "jsonl", "path": str(ev)}},
            "eval_fraction": 0.0, "min_length": 4, "max_length": 160,
            "regenerate": {"enabled": True, "max_new_tokens": 8, "batch_size": 6, "turns": "last"}}
    _, r = _real_data_run(tmp_path, real_target, data)
    assert r.returncode == 1 and "no training prompt fits" in r.stderr and "(6 were longer)" in r.stderr, r.stderr[-2000:]
    (tmp_path / "b").mkdir()
    wd, r = _real_data_run(tmp_path / "b", real_target, {**data, "regenerate": {**data["regenerate"], "turns": "first"}})
    assert r.returncode == 0, r.stderr[-3000:]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(real_target[1]["model_dir"])
    rows = _rows(wd, "train")
    assert len(rows) == 6
    for row in rows:
        prompt = tok.decode([t for t, m in zip(row["input_ids"], row["loss_mask"], strict=True) if not m])
        assert "Name fruit number" in prompt and "Apple." not in prompt and "great detail" not in prompt
        assert prompt.endswith("<|im_start|>assistant\n") and 1 <= sum(row["loss_mask"]) <= 8
    st = json.loads((wd / "artifacts" / "data" / "stats.json").read_text())["regeneration"]
    assert st["turns"] == "first" and st["skipped_long_prompts"] == 0
    assert st["cut_loops"] is False and 0 <= st["looping"] <= 6 and st["loop_tokens_cut"] == 0
    assert f"regeneration: {st['looping']} of 6 responses fall into a loop" in r.stderr


@pytest.mark.parametrize("case", ["missing", "syntax"])
def test_user_chat_template_is_validated(tmp_path, case):
    p = tmp_path / "t.jinja"
    if case == "syntax":
        p.write_text("{% for m in messages %}{{ m['content'] }}")
    cfg = _config(tmp_path, {"bootstrap": "tiny"}, {"chat_template": str(p)})
    r = run_cli("plan", str(cfg), "--workdir", str(tmp_path / "w"))
    assert r.returncode == 2, r.stderr
    assert "data.chat_template" in r.stderr
    assert ("file not found" if case == "missing" else "is not a valid Jinja chat template: line 1") in r.stderr


def test_every_conversation_is_checked_not_only_the_first(tmp_path, real_target):
    """Qwen3's template (data.chat_template) masks single-turn chats but rewrites earlier turns of a multi-turn one.
    Five single-turn chats and one multi-turn chat, wherever it sorts: the stage refuses, naming that sample."""
    tmpl = DATA / "chat_templates" / "qwen3-0.6b.jinja"
    gsm = [json.loads(x) for x in (real_target[1]["data_dir"] / "gsm8k.jsonl").read_text().splitlines()[:5]]
    multi = {"messages": [{"role": "user", "content": "Hi."}, {"role": "assistant",
                                                               "content": "<think>\ngreet\n</think>\n\nHello!"},
                          {"role": "user", "content": "Bye."}, {"role": "assistant", "content": "Goodbye!"}]}
    src = _jsonl(tmp_path, gsm + [multi])
    ev = _head(real_target[1]["data_dir"] / "humaneval.jsonl", 2, "ev.jsonl", tmp_path)
    data = {"sources": [{"kind": "jsonl", "path": str(src)}], "eval_domains": {"c": {"kind": "jsonl", "path": str(ev)}},
            "eval_fraction": 0.0, "min_length": 4, "max_length": 512, "chat_template": str(tmpl)}
    _, r = _real_data_run(tmp_path, real_target, data)
    assert r.returncode == 1, r.stderr[-2000:]
    assert f"{src}:6: the loss mask cannot be derived from the chat template of data.chat_template ({tmpl})" in r.stderr
    assert "message 1 (assistant): later messages change how this turn renders" in r.stderr and "<think>" in r.stderr
    # the five single-turn chats alone pass, each masked as reasoning block + answer + <|im_end|>
    (tmp_path / "b").mkdir()
    wd, r = _real_data_run(tmp_path / "b", real_target, {**data, "sources": [{"kind": "jsonl", "path": str(_jsonl(tmp_path, gsm,
                                                                                                                  "one.jsonl"))}]})
    assert r.returncode == 0, r.stderr[-2000:]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(real_target[1]["model_dir"])
    answers = {g["messages"][1]["content"] for g in gsm}
    for row in _rows(wd, "train"):
        trained = tok.decode([t for t, m in zip(row["input_ids"], row["loss_mask"], strict=True) if m])
        assert trained.startswith("<think>\n\n</think>\n\n") and trained.endswith(REAL_EOT)
        assert trained[len("<think>\n\n</think>\n\n"): -len(REAL_EOT)] in answers
