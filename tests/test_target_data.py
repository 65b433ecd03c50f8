"""Stages `target` (local model route, bootstrap determinism) and `data` (formats, masks, malformed lines,
regeneration, local HF datasets), through the real CLI."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from conftest import TINY_CONFIG, run_cli, status_json, tiny_overrides
from pipeline import registry


def _only_upto(stage: str) -> list[str]:
    names = registry.names()
    return [x for n in names[names.index(stage) + 1:] for x in ("-o", f"{n}.enabled=false")]


@pytest.fixture(scope="module")
def local_model(tmp_path_factory) -> Path:
    """A tiny random Llama + the project's BPE tokenizer (with chat template and mask token), saved like a hub model."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from stages.target import stdlib_corpus, train_tokenizer

    d = tmp_path_factory.mktemp("local_model")
    tok = train_tokenizer([t for _, t in stdlib_corpus(300_000)], 512, d)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    LlamaForCausalLM(cfg).save_pretrained(d)
    return d


def _config(tmp_path: Path, target: dict, data: dict | None = None) -> Path:
    p = tmp_path / "cfg.yaml"
    doc = {"target": target}
    if data is not None:
        doc["data"] = data
    p.write_text("# test config\n" + yaml.safe_dump(doc))
    return p


# ------------------------------------------------------------------------------------------ target


def test_local_model_is_checked_and_placed(tmp_path, local_model):
    cfg = _config(tmp_path, {"model": str(local_model)},
                  {"sources": [{"kind": "jsonl", "path": str(_jsonl(tmp_path, [{"text": "def f(x):\n    return x + 1\n" * 8}] * 1 + [{"text": f"x = {i}\n" * 30} for i in range(20)]))}],
                   "eval_domains": {"misc": {"kind": "jsonl", "path": str(_jsonl(tmp_path, [{"prompt": f"import os\nprint({i}, os.getcwd())"} for i in range(5)], "ev.jsonl"))}},
                   "min_length": 4})
    wd = tmp_path / "w"
    r = run_cli("build", str(cfg), "--workdir", str(wd), *_only_upto("data"))
    assert r.returncode == 0, r.stderr[-3000:]
    art = wd / "artifacts" / "target"
    summary = json.loads((art / "target.json").read_text())
    assert summary["num_layers"] == 2 and summary["mask_token"] == "<|mask|>" and summary["has_chat_template"]
    assert (art / "model" / "model.safetensors").exists()
    # the eval prompt of a prompt-only source is rendered as a chat turn (chat template present)
    ev = [json.loads(x) for x in (wd / "artifacts" / "data" / "eval" / "misc.jsonl").read_text().splitlines()]
    assert ev and ev[0]["prompt"].startswith("<|user|>") and ev[0]["prompt"].endswith("<|assistant|>")
    # a changed file in the local model dir is an external input change
    (local_model / "generation_config.json").write_text(json.dumps({"max_new_tokens": 7}))
    r = run_cli("plan", str(cfg), "--workdir", str(wd), *_only_upto("data"))
    assert "target       run       external input changed" in r.stdout, r.stdout


@pytest.mark.parametrize("case", ["missing", "no_tokenizer", "bin_only", "not_causal"])
def test_bad_local_models_fail_clearly(tmp_path, local_model, case):
    import shutil

    d = tmp_path / "m"
    if case != "missing":
        shutil.copytree(local_model, d)
    if case == "no_tokenizer":
        for p in d.glob("tokenizer*"):
            p.unlink()
        (d / "special_tokens_map.json").unlink(missing_ok=True)
    elif case == "bin_only":
        (d / "model.safetensors").rename(d / "pytorch_model.bin")
    elif case == "not_causal":
        c = json.loads((d / "config.json").read_text())
        c.update(model_type="bert", architectures=["BertModel"])
        (d / "config.json").write_text(json.dumps(c))
    cfg = _config(tmp_path, {"model": str(d)})
    r = run_cli("build", str(cfg), "--workdir", str(tmp_path / "w"), *_only_upto("target"))
    assert r.returncode == 1, r.stderr
    expect = {"missing": "is not a directory", "no_tokenizer": "no usable tokenizer", "bin_only": "pytorch_model.bin: convert",
              "not_causal": "not a causal language model"}[case]
    assert expect in r.stderr, r.stderr[-2000:]
    assert "stage 'target' failed" in r.stderr and "log:" in r.stderr
    assert not (tmp_path / "w" / "artifacts" / "target").exists()


def test_hub_id_offline_fails_with_advice(tmp_path):
    cfg = _config(tmp_path, {"model": "some-org/some-model"})
    r = run_cli("build", str(cfg), "--workdir", str(tmp_path / "w"), *_only_upto("target"))
    assert r.returncode == 1
    assert "could not download 'some-org/some-model'" in r.stderr and "local directory" in r.stderr


def test_bootstrap_is_deterministic(tmp_path):
    ov = tiny_overrides("target") + ["-o", "target.tiny.steps=5"] + _only_upto("target")
    digests = []
    for i in range(2):
        r = run_cli("build", str(TINY_CONFIG), "--workdir", str(tmp_path / f"w{i}"), *ov)
        assert r.returncode == 0, r.stderr[-2000:]
        m = json.loads((tmp_path / f"w{i}" / "artifacts" / "target" / "manifest.json").read_text())
        digests.append(m["digest"])
    assert digests[0] == digests[1]


# ------------------------------------------------------------------------------------------ data


def _jsonl(tmp_path: Path, rows: list, name: str = "train.jsonl", raw_lines: list[str] = ()) -> Path:
    p = tmp_path / name
    p.write_text("".join(json.dumps(r) + "\n" for r in rows) + "".join(x + "\n" for x in raw_lines))
    return p


CONVS = [{"messages": [{"role": "user", "content": f"Write function number {i}."},
                       {"role": "assistant", "content": f"def f{i}(x):\n    return x * {i} + {i % 7}\n" * 3}]} for i in range(40)]


@pytest.fixture(scope="module")
def target_workdir(tmp_path_factory, local_model):
    """A workdir whose target stage is committed (the local model), for data-stage tests to copy."""
    tmp = tmp_path_factory.mktemp("tw")
    cfg = _config(tmp, {"model": str(local_model)})
    r = run_cli("build", str(cfg), "--workdir", str(tmp / "w"), *_only_upto("target"))
    assert r.returncode == 0, r.stderr[-2000:]
    return tmp / "w", local_model


def _data_run(tmp_path, target_workdir, data: dict, *extra: str):
    import shutil

    wd_src, model = target_workdir
    wd = tmp_path / "w"
    shutil.copytree(wd_src, wd)
    cfg = _config(tmp_path, {"model": str(model)}, data)
    return wd, run_cli("build", str(cfg), "--workdir", str(wd), *_only_upto("data"), *extra)


def _rows(wd: Path, split: str):
    import pyarrow.parquet as pq

    return pq.read_table(wd / "artifacts" / "data" / f"{split}.parquet").to_pylist()


def test_conversations_train_on_assistant_tokens_only(tmp_path, target_workdir):
    from transformers import AutoTokenizer

    src = _jsonl(tmp_path, CONVS)
    wd, r = _data_run(tmp_path, target_workdir, {"sources": [{"kind": "jsonl", "path": str(src)}], "min_length": 4,
                                                 "eval_domains": {"chat": {"kind": "jsonl", "path": str(src)}}, "eval_fraction": 0.1})
    assert r.returncode == 0, r.stderr[-3000:]
    tok = AutoTokenizer.from_pretrained(target_workdir[1])
    rows = _rows(wd, "train")
    for row in rows[:5]:
        ids, mask = row["input_ids"], row["loss_mask"]
        assert 0 < sum(mask) < len(mask)
        trained = tok.decode([t for t, m in zip(ids, mask) if m])
        untrained = tok.decode([t for t, m in zip(ids, mask) if not m])
        assert "def f" in trained and "Write function" in untrained and "Write function" not in trained
    # an eval prompt never appears in training: the same file as source and eval leaves nothing to train on
    stats = json.loads((wd / "artifacts" / "data" / "stats.json").read_text())
    assert stats["eval_overlap_removed"] > 0


def test_template_without_generation_tags_is_refused(tmp_path, target_workdir):
    import shutil

    model = tmp_path / "m"
    shutil.copytree(target_workdir[1], model)
    tc = json.loads((model / "tokenizer_config.json").read_text())
    plain = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    tc["chat_template"] = plain
    (model / "tokenizer_config.json").write_text(json.dumps(tc))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    cfg = _config(tmp_path, {"model": str(model)}, {"sources": [{"kind": "jsonl", "path": str(_jsonl(tmp_path, CONVS))}],
                                                     "eval_domains": {"x": {"kind": "jsonl", "path": str(_jsonl(tmp_path, CONVS[:3], "e.jsonl"))}}})
    r = run_cli("build", str(cfg), "--workdir", str(tmp_path / "w"), *_only_upto("data"))
    assert r.returncode == 1
    assert "marks no assistant tokens" in r.stderr and "generation" in r.stderr


def test_malformed_lines_are_counted_and_limited(tmp_path, target_workdir):
    src = _jsonl(tmp_path, CONVS, raw_lines=["{not json", json.dumps({"messages": "nope"}), json.dumps({"other": 1})])
    ev = _jsonl(tmp_path, CONVS[:4], "ev.jsonl")
    data = {"sources": [{"kind": "jsonl", "path": str(src)}], "eval_domains": {"c": {"kind": "jsonl", "path": str(ev)}}, "min_length": 4}
    _, r = _data_run(tmp_path, target_workdir, data)
    assert r.returncode == 1
    assert "3 malformed input lines (limit data.max_malformed=0)" in r.stderr
    assert f"{src}:41: invalid JSON" in r.stderr
    wd, r = _data_run(tmp_path / "b", target_workdir, {**data, "max_malformed": 5}) if (tmp_path / "b").mkdir() is None else None
    assert r.returncode == 0, r.stderr[-2000:]
    stats = json.loads((wd / "artifacts" / "data" / "stats.json").read_text())
    assert stats["malformed"] == 3
    assert any(f"{src}:42" in x and "'messages' must be" in x for x in stats["malformed_examples"])


def test_prompt_only_needs_regeneration_and_regeneration_masks_the_prompt(tmp_path, target_workdir):
    prompts = _jsonl(tmp_path, [{"prompt": f"def g{i}(a, b):"} for i in range(12)])
    ev = _jsonl(tmp_path, [{"prompt": "class A:"}, {"prompt": "import sys"}], "ev.jsonl")
    data = {"sources": [{"kind": "jsonl", "path": str(prompts)}], "eval_domains": {"c": {"kind": "jsonl", "path": str(ev)}},
            "min_length": 4, "eval_fraction": 0.0}
    _, r = _data_run(tmp_path, target_workdir, data)
    assert r.returncode == 1 and "enable data.regenerate" in r.stderr
    (tmp_path / "b").mkdir()
    wd, r = _data_run(tmp_path / "b", target_workdir, {**data, "regenerate": {"enabled": True, "max_new_tokens": 8, "batch_size": 4}})
    assert r.returncode == 0, r.stderr[-3000:]
    rows = _rows(wd, "train")
    assert len(rows) == 12
    for row in rows:
        mask = row["loss_mask"]
        assert mask[0] == 0 and mask[-1] == 1 and 1 <= sum(mask) <= 8   # prompt masked, the target's tokens trained


def test_local_hf_dataset_with_column_mapping_and_determinism(tmp_path, target_workdir):
    from datasets import Dataset

    ds_dir = tmp_path / "ds"
    Dataset.from_dict({"body": [f"def h{i}():\n    return {i}\n" * 6 for i in range(30)], "id": list(range(30))}).save_to_disk(str(ds_dir))
    bench = tmp_path / "bench"   # shaped like SPEED-Bench / MT-Bench: multi-turn `turns`, a `category` column
    Dataset.from_dict({"turns": [[f"Write code number {i} please", "and again"] for i in range(6)],
                       "category": ["coding", "math"] * 3}).save_to_disk(str(bench))
    data = {"sources": [{"kind": "hf", "name": str(ds_dir), "columns": {"text": "body"}, "domain": "code"}],
            "eval_domains": {"coding": {"kind": "hf", "name": str(bench), "columns": {"prompt": "turns"}, "where": {"category": "coding"}, "chat": True}},
            "min_length": 4, "max_samples": 20}
    wd, r = _data_run(tmp_path, target_workdir, data)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = _rows(wd, "train")
    assert 0 < len(rows) <= 20 and all(sum(x["loss_mask"]) == len(x["loss_mask"]) for x in rows)
    ev = [json.loads(x) for x in (wd / "artifacts" / "data" / "eval" / "coding.jsonl").read_text().splitlines()]
    assert len(ev) == 3 and all("Write code number" in e["prompt"] and "and again" not in e["prompt"] for e in ev)
    assert {int(e["prompt"].split("number ")[1].split()[0]) % 2 for e in ev} == {0}   # only category == coding
    (tmp_path / "b").mkdir()
    wd2, r = _data_run(tmp_path / "b", target_workdir, data)
    assert _rows(wd2, "train") == rows   # same split and order every time
    st = {s["name"]: s for s in status_json(wd)["stages"]}
    assert st["data"]["metrics"]["train_samples"] == len(rows)
    # a missing column is named
    (tmp_path / "c").mkdir()
    _, r = _data_run(tmp_path / "c", target_workdir, {**data, "sources": [{"kind": "hf", "name": str(ds_dir), "columns": {"text": "content"}}]})
    assert r.returncode == 1 and "no column(s) ['content']" in r.stderr
