"""Stages `target` (local model route, bootstrap determinism) and `data` (formats, masks, malformed lines,
regeneration, local HF datasets), through the real CLI: `specpipe build` processes on a tiny target (~2 minutes of CPU in
all), so integration, not unit (pytest.mark.slow; tests/unit/test_tiers.py).
In process: tests/unit/stages/test_target_data_config.py."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import TINY_CONFIG, run_cli, status_json, tiny_overrides
from support.stage_runs import config_file as _config
from support.stage_runs import jsonl as _jsonl
from support.stage_runs import only_upto as _only_upto
from support.stage_runs import parquet_rows as _rows

pytestmark = pytest.mark.slow


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
