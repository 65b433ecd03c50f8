"""Stages `target` (local model route, bootstrap determinism) and `data` (formats, masks, malformed lines,
regeneration, local HF datasets), through the real CLI."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from pipeline import registry

from conftest import TINY_CONFIG, run_cli, status_json, tiny_overrides
from support import DATA


def _only_upto(stage: str) -> list[str]:
    names = registry.names()
    return [x for n in names[names.index(stage) + 1:] for x in ("-o", f"{n}.enabled=false")]


@pytest.fixture(scope="module")
def local_model(tmp_path_factory) -> Path:
    """A tiny random Llama + the project's BPE tokenizer (with chat template and mask token), saved like a hub model."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from runtime.target.corpus import stdlib_corpus, train_tokenizer

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
    texts = [{"text": "def f(x):\n    return x + 1\n" * 8}] * 1 + [{"text": f"x = {i}\n" * 30} for i in range(20)]
    prompts = [{"prompt": f"import os\nprint({i}, os.getcwd())"} for i in range(5)]
    cfg = _config(tmp_path, {"model": str(local_model)},
                  {"sources": [{"kind": "jsonl", "path": str(_jsonl(tmp_path, texts))}],
                   "eval_domains": {"misc": {"kind": "jsonl", "path": str(_jsonl(tmp_path, prompts, "ev.jsonl"))}},
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


@pytest.mark.fast
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


def _data_run(tmp_path, target_workdir, data: dict, *extra: str, env: dict | None = None):
    import shutil

    wd_src, model = target_workdir
    wd = tmp_path / "w"
    shutil.copytree(wd_src, wd)
    cfg = _config(tmp_path, {"model": str(model)}, data)
    return wd, run_cli("build", str(cfg), "--workdir", str(wd), *_only_upto("data"), *extra, env=env)


def _rows(wd: Path, split: str):
    import pyarrow.parquet as pq

    return pq.read_table(wd / "artifacts" / "data" / f"{split}.parquet").to_pylist()


def test_conversations_train_on_assistant_tokens_only(tmp_path, target_workdir):
    from transformers import AutoTokenizer

    src = _jsonl(tmp_path, CONVS)
    wd, r = _data_run(tmp_path, target_workdir, {"sources": [{"kind": "jsonl", "path": str(src)}], "min_length": 4,
                                                 "eval_domains": {"chat": {"kind": "jsonl", "path": str(src)}},
                                                 "eval_fraction": 0.1})
    assert r.returncode == 0, r.stderr[-3000:]
    tok = AutoTokenizer.from_pretrained(target_workdir[1])
    rows = _rows(wd, "train")
    for row in rows[:5]:
        ids, mask = row["input_ids"], row["loss_mask"]
        assert 0 < sum(mask) < len(mask)
        trained = tok.decode([t for t, m in zip(ids, mask, strict=True) if m])
        untrained = tok.decode([t for t, m in zip(ids, mask, strict=True) if not m])
        assert "def f" in trained and "Write function" in untrained and "Write function" not in trained
    # an eval prompt never appears in training: the same file as source and eval leaves nothing to train on
    stats = json.loads((wd / "artifacts" / "data" / "stats.json").read_text())
    assert stats["eval_overlap_removed"] > 0


def _with_template(tmp_path: Path, model: Path, template: str) -> Path:
    import shutil

    d = tmp_path / "m"
    shutil.copytree(model, d)
    tc = json.loads((d / "tokenizer_config.json").read_text())
    tc["chat_template"] = template
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    (d / "chat_template.jinja").unlink(missing_ok=True)
    return d


def test_template_without_generation_tags_masks_assistant_turns(tmp_path, target_workdir):
    """No {% generation %} tags: the assistant spans come from the template's own renderings (on main this was
    refused: 'marks no assistant tokens')."""
    from transformers import AutoTokenizer

    plain = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
             "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    model = _with_template(tmp_path, target_workdir[1], plain)
    src = _jsonl(tmp_path, CONVS[:20])
    cfg = _config(tmp_path, {"model": str(model)}, {"sources": [{"kind": "jsonl", "path": str(src)}], "min_length": 4,
                                                     "eval_domains": {"x": {"kind": "jsonl",
                                                                            "path": str(_jsonl(tmp_path, CONVS[30:33],
                                                                                               "e.jsonl"))}}})
    wd = tmp_path / "w"
    r = run_cli("build", str(cfg), "--workdir", str(wd), *_only_upto("data"))
    assert r.returncode == 0, r.stderr[-3000:]
    tok = AutoTokenizer.from_pretrained(model)
    rows = _rows(wd, "train")
    assert rows
    by_text = {c["messages"][0]["content"]: c["messages"][1]["content"] for c in CONVS}
    for row in rows:
        ids, mask = row["input_ids"], row["loss_mask"]
        trained = tok.decode([t for t, m in zip(ids, mask, strict=True) if m])
        user = tok.decode(ids).split("<|user|>")[1].split("<|end|>")[0]
        assert trained == by_text[user] + "<|end|>"               # content + end of turn, not the <|assistant|> header
    stats = json.loads((wd / "artifacts" / "data" / "stats.json").read_text())
    assert stats["chat_template"]["mask_method"] == "prefix_renderings" and stats["chat_template"]["end_of_turn"] == "<|end|>"


def test_template_without_generation_prompt_is_refused(tmp_path, target_workdir):
    plain = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    model = _with_template(tmp_path, target_workdir[1], plain)
    cfg = _config(tmp_path, {"model": str(model)}, {"sources": [{"kind": "jsonl", "path": str(_jsonl(tmp_path, CONVS))}],
                                                     "eval_domains": {"x": {"kind": "jsonl",
                                                                            "path": str(_jsonl(tmp_path, CONVS[:3],
                                                                                               "e.jsonl"))}}})
    r = run_cli("build", str(cfg), "--workdir", str(tmp_path / "w"), *_only_upto("data"))
    assert r.returncode == 1
    assert "the loss mask cannot be derived from the chat template of the target's tokenizer" in r.stderr
    assert "adds nothing for add_generation_prompt=True" in r.stderr and "data.chat_template" in r.stderr


def test_malformed_lines_are_counted_and_limited(tmp_path, target_workdir):
    src = _jsonl(tmp_path, CONVS, raw_lines=["{not json", json.dumps({"messages": "nope"}), json.dumps({"other": 1})])
    ev = _jsonl(tmp_path, CONVS[:4], "ev.jsonl")
    data = {"sources": [{"kind": "jsonl", "path": str(src)}], "eval_domains": {"c": {"kind": "jsonl", "path": str(ev)}},
            "min_length": 4}
    _, r = _data_run(tmp_path, target_workdir, data)
    assert r.returncode == 1
    assert "3 malformed input lines (limit data.max_malformed=0)" in r.stderr
    assert f"{src}:41: invalid JSON" in r.stderr
    wd, r = _data_run(tmp_path / "b", target_workdir, {**data, "max_malformed": 5}) if (tmp_path / "b").mkdir() is None else None
    assert r.returncode == 0, r.stderr[-2000:]
    stats = json.loads((wd / "artifacts" / "data" / "stats.json").read_text())
    assert stats["malformed"] == 3
    assert any(f"{src}:42" in x and "'messages' must be" in x for x in stats["malformed_examples"])


def test_data_errors_name_the_source_and_what_was_wrong(tmp_path, target_workdir):
    """An empty file and a file of blank lines are config errors before anything runs (exit 2, the field and the
    file named); samples all shorter than data.min_length and a split that holds everything out fail the stage,
    naming each source file and what became of its samples."""
    ev = _jsonl(tmp_path, CONVS[:3], "ev.jsonl")
    good = _jsonl(tmp_path, CONVS[3:20], "good.jsonl")
    empty, blank = tmp_path / "empty.jsonl", tmp_path / "blank.jsonl"
    empty.write_text("")
    blank.write_text("\n  \n\t\n")

    def data(*paths, **kw):
        return {"sources": [{"kind": "jsonl", "path": str(p)} for p in paths], "min_length": 4,
                "eval_domains": {"c": {"kind": "jsonl", "path": str(ev)}}, **kw}

    r = run_cli("check", str(_config(tmp_path, {"model": str(target_workdir[1])}, data(good, empty, blank))))
    assert r.returncode == 2, r.stderr
    assert f"data.sources.1.path: {empty} is empty (0 bytes)" in r.stderr
    assert f"data.sources.2.path: {blank} has 3 line(s), all blank" in r.stderr
    short = _jsonl(tmp_path, [{"text": f"x{i}"} for i in range(6)], "short.jsonl")
    (tmp_path / "a").mkdir()
    _, r = _data_run(tmp_path / "a", target_workdir, data(short, min_length=40, eval_fraction=0.0))
    assert r.returncode == 1, r.stderr[-2000:]
    assert f"{short}: 6 of 6 sample(s) shorter than data.min_length=40 tokens (longest " in r.stderr
    assert "no training samples left after dedup and split" not in r.stderr
    from runtime.data.sources import Sample
    from runtime.data.splits import bucket

    out = next(c for c in CONVS[20:] if bucket("heldout:" + Sample("messages", c["messages"], "d", "o").key, 0) < 0.49)
    tiny = _jsonl(tmp_path, CONVS[:3] + [out], "tiny.jsonl")   # 3 are the eval prompts, the 4th is held out
    dup = _jsonl(tmp_path, CONVS[:1], "dup.jsonl")
    (tmp_path / "c").mkdir()
    _, r = _data_run(tmp_path / "c", target_workdir, data(tiny, dup, eval_fraction=0.49, seed=0))
    assert r.returncode == 1, r.stderr[-2000:]
    assert "no training samples left after dedup and split:" in r.stderr
    assert f"{tiny}: 4 sample(s), 0 duplicate(s), 3 also eval prompts, 1 held out by data.eval_fraction=0.49" in r.stderr
    assert f"{dup}: 1 sample(s), 1 duplicate(s), 1 also eval prompts" in r.stderr


def test_prompt_only_needs_regeneration_and_regeneration_masks_the_prompt(tmp_path, target_workdir):
    prompts = _jsonl(tmp_path, [{"prompt": f"def g{i}(a, b):"} for i in range(12)])
    ev = _jsonl(tmp_path, [{"prompt": "class A:"}, {"prompt": "import sys"}], "ev.jsonl")
    data = {"sources": [{"kind": "jsonl", "path": str(prompts)}], "eval_domains": {"c": {"kind": "jsonl", "path": str(ev)}},
            "min_length": 4, "eval_fraction": 0.0}
    _, r = _data_run(tmp_path, target_workdir, data)
    assert r.returncode == 1 and "enable data.regenerate" in r.stderr
    (tmp_path / "b").mkdir()
    wd, r = _data_run(tmp_path / "b", target_workdir, {**data, "regenerate": {"enabled": True, "max_new_tokens": 8,
                                                                              "batch_size": 4}})
    assert r.returncode == 0, r.stderr[-3000:]
    rows = _rows(wd, "train")
    assert len(rows) == 12
    for row in rows:
        mask = row["loss_mask"]
        assert mask[0] == 0 and mask[-1] == 1 and 1 <= sum(mask) <= 8   # prompt masked, the target's tokens trained


def test_local_hf_dataset_with_column_mapping_and_determinism(tmp_path, target_workdir):
    from datasets import Dataset

    ds_dir = tmp_path / "ds"
    Dataset.from_dict({"body": [f"def h{i}():\n    return "
                                f"{i}\n" * 6 for i in range(30)], "id": list(range(30))}).save_to_disk(str(ds_dir))
    bench = tmp_path / "bench"   # shaped like SPEED-Bench / MT-Bench: multi-turn `turns`, a `category` column
    Dataset.from_dict({"turns": [[f"Write code number {i} please", "and again"] for i in range(6)],
                       "category": ["coding", "math"] * 3}).save_to_disk(str(bench))
    data = {"sources": [{"kind": "hf", "name": str(ds_dir), "columns": {"text": "body"}, "domain": "code"}],
            "eval_domains": {"coding": {"kind": "hf", "name": str(bench), "columns": {"prompt": "turns"},
                                        "where": {"category": "coding"}, "chat": True}},
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
    _, r = _data_run(tmp_path / "c", target_workdir, {**data, "sources": [{"kind": "hf", "name": str(ds_dir),
                                                                           "columns": {"text": "content"}}]})
    assert r.returncode == 1 and "no column(s) ['content']" in r.stderr


# ------------------------------------------------------------------------------------------ regeneration (tiny model)


def test_regeneration_resumes_after_an_interruption(tmp_path, target_workdir):
    """Killed (SIGKILL, the runner's fault injection) after 2 finished batches, the rerun reuses their answers from the
    journal, regenerates only the rest, and ends with exactly the artifact of an uninterrupted run (sampling, so the
    seeds per batch matter)."""
    prompts = _jsonl(tmp_path, [{"messages": [{"role": "user", "content": f"Write function number {i}."}]} for i in range(12)])
    ev = _jsonl(tmp_path, [{"prompt": "class A:"}, {"prompt": "import sys"}], "ev.jsonl")
    data = {"sources": [{"kind": "jsonl", "path": str(prompts)}], "eval_domains": {"c": {"kind": "jsonl", "path": str(ev)}},
            "min_length": 4, "eval_fraction": 0.0,
            "regenerate": {"enabled": True, "mode": "sample", "temperature": 1.0, "max_new_tokens": 6, "batch_size": 2}}
    wd, r = _data_run(tmp_path, target_workdir, data, env={"SPECPIPE_FAULT": "data:regenerate-batch-2"})
    assert r.returncode != 0 and not (wd / "artifacts" / "data" / "manifest.json").exists()
    journal = list((wd / "scratch" / "data").glob("*/regenerate/answers.jsonl"))
    assert len(journal) == 1 and len(journal[0].read_text().splitlines()) == 4      # 2 batches of 2, appended as decoded
    cfg = _config(tmp_path, {"model": str(target_workdir[1])}, data)
    r = run_cli("build", str(cfg), "--workdir", str(wd), *_only_upto("data"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "regeneration: resumed 4 answers from" in r.stderr and "8 prompts left" in r.stderr
    stats = json.loads((wd / "artifacts" / "data" / "stats.json").read_text())["regeneration"]
    assert (stats["prompts"], stats["resumed_prompts"], stats["generated_prompts"]) == (12, 4, 8)
    (tmp_path / "fresh").mkdir()
    wd2, r = _data_run(tmp_path / "fresh", target_workdir, data)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((wd2 / "artifacts" / "data" / "stats.json").read_text())["regeneration"]["resumed_prompts"] == 0
    assert _rows(wd2, "train") == _rows(wd, "train") and len(_rows(wd, "train")) == 12


def test_regeneration_through_failing_endpoints_survives_sigterm_and_equals_an_undisturbed_run(tmp_path, target_workdir):
    """`specpipe build --only data` through two endpoints (a fake completions server in this process, API key required)
    answering 503, 429 with Retry-After, resets mid-body and hangs past the timeout, SIGTERM'd after 4 complete batches:
    the rerun asks only for what the journal lacks and the artifact equals that of an undisturbed run (sampled, seeded
    per request); the key is in no log."""
    from support.fake_completions import FakeCompletions, State

    prompts = _jsonl(tmp_path, [{"messages": [{"role": "user", "content": f"Write function number {i}."}]} for i in range(30)])
    ev = _jsonl(tmp_path, [{"prompt": "class A:"}, {"prompt": "import sys"}], "ev.jsonl")
    state = State({"503": 0.05, "429": 0.05, "reset": 0.05, "hang": 0.03}, vocab=500, hang_s=1.0)
    env = {"SPECPIPE_TEST_REGEN_KEY": "s3cr3t-k3y"}
    with FakeCompletions(state, api_key="s3cr3t-k3y") as a, FakeCompletions(state, api_key="s3cr3t-k3y") as b:
        data = {"sources": [{"kind": "jsonl", "path": str(prompts)}], "eval_domains": {"c": {"kind": "jsonl", "path": str(ev)}},
                "min_length": 4, "eval_fraction": 0.0,
                "regenerate": {"enabled": True, "engine": "endpoint", "endpoint": [a.url, b.url], "mode": "sample",
                               "temperature": 1.0, "max_new_tokens": 6, "batch_size": 2, "concurrency": 3, "timeout_s": 0.5,
                               "backoff_s": 0.01, "api_key_env": "SPECPIPE_TEST_REGEN_KEY"}}
        wd, r = _data_run(tmp_path, target_workdir, data, env={**env, "SPECPIPE_FAULT": "data:regenerate-batch-4:TERM"})
        assert r.returncode != 0 and not (wd / "artifacts" / "data" / "manifest.json").exists()
        journal = next((wd / "scratch" / "data").glob("*/regenerate/answers.jsonl"))
        kept = len(journal.read_text().splitlines())
        assert 8 <= kept < 30
        cfg = _config(tmp_path, {"model": str(target_workdir[1])}, data)
        r = run_cli("build", str(cfg), "--workdir", str(wd), *_only_upto("data"), env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        stats = json.loads((wd / "artifacts" / "data" / "stats.json").read_text())["regeneration"]
        assert (stats["resumed_prompts"], stats["generated_prompts"], stats["failed_prompts"]) == (kept, 30 - kept, 0)
        assert set(stats["endpoints"]) == {a.url, b.url} and stats["concurrency"] == 3
        assert run_cli("report", "--workdir", str(wd)).returncode == 0
        html = (wd / "report.html").read_text()
        assert "retried requests" in html and "failed prompts (left out)" in html and a.url in html
        (tmp_path / "fresh").mkdir()
        wd2, r2 = _data_run(tmp_path / "fresh", target_workdir, data, env=env)
        assert r2.returncode == 0, r2.stderr[-3000:]
    assert state.faulted and json.loads((wd2 / "artifacts" / "data" / "stats.json").read_text())["regeneration"][
        "retried_requests"] + stats["retried_requests"] > 0
    assert _rows(wd2, "train") == _rows(wd, "train") and len(_rows(wd, "train")) == 30
    for text in (r.stderr, r2.stderr, *(p.read_text() for p in wd.glob("logs/*.log"))):
        assert "s3cr3t" not in text


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


@pytest.mark.fast
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
