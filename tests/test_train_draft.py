"""Stage `train_draft`: EAGLE-3 and DFlash drafts trained with ModelOpt on a tiny target, for real.

One module fixture builds the tiny target + data once; each build below copies those committed artifacts
into its own workdir and runs only `train_draft` (tens of steps on a hidden-64 target).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import REPO, SPECPIPE, TINY_CONFIG, run_cli, status_json, tiny_overrides

pytestmark = pytest.mark.slow
DFLASH_CONFIG = REPO / "configs" / "tiny_fp8_dflash.yaml"   # same target/data sections as TINY_CONFIG

# Test-size training: a few tens of steps of batch 2 x 64 tokens.
SMALL = ["train_draft.steps=12", "train_draft.batch_size=2", "train_draft.seq_len=64", "train_draft.warmup_steps=2",
         "train_draft.checkpoint_every=5", "train_draft.log_every=2", "train_draft.eval.prompts_per_domain=2",
         "train_draft.eval.osl=12"]


def _o(*items: str) -> list[str]:
    out = []
    for it in items:
        out += ["-o", it]
    return out


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """A workdir with committed tiny `target` and `data` artifacts."""
    wd = tmp_path_factory.mktemp("td_inputs") / "run"
    for stage in ("target", "data"):
        r = run_cli("build", str(TINY_CONFIG), "--workdir", str(wd), "--only", stage, *tiny_overrides("target", "data"))
        assert r.returncode == 0, r.stderr[-3000:]
    return wd


def _workdir(inputs: Path, tmp_path: Path) -> Path:
    wd = tmp_path / "run"
    (wd / "artifacts").mkdir(parents=True)
    for stage in ("target", "data"):
        shutil.copytree(inputs / "artifacts" / stage, wd / "artifacts" / stage)
    return wd


def _build(wd: Path, *overrides: str, config: Path = TINY_CONFIG) -> subprocess.CompletedProcess:
    return run_cli("build", str(config), "--workdir", str(wd), "--only", "train_draft",
                   *tiny_overrides("target", "data"), *_o(*SMALL, *overrides))


@pytest.fixture(scope="module")
def eagle(inputs, tmp_path_factory) -> Path:
    """EAGLE-3, online, reduced draft vocabulary (so d2t is exercised), in-process."""
    wd = _workdir(inputs, tmp_path_factory.mktemp("td_eagle"))
    r = _build(wd, "train_draft.algorithm.draft_vocab_size=256")
    assert r.returncode == 0, r.stderr[-4000:]
    return wd


@pytest.fixture(scope="module")
def dflash(inputs, tmp_path_factory) -> Path:
    """DFlash, online, under torchrun with 2 processes (gloo on CPU)."""
    wd = _workdir(inputs, tmp_path_factory.mktemp("td_dflash"))
    r = _build(wd, "train_draft.algorithm={kind: dflash, block_size: 4, draft_layers: 2, num_anchors: 8}",
               "train_draft.launcher={kind: torchrun, nproc_per_node: 2}", config=DFLASH_CONFIG)
    assert r.returncode == 0, r.stderr[-4000:]
    return wd


def _art(wd: Path) -> Path:
    return wd / "artifacts" / "train_draft"


# ------------------------------------------------------------------------------------------- EAGLE-3


def test_eagle3_exports_a_checked_deployable_draft(eagle):
    art = _art(eagle)
    cfg = json.loads((art / "draft" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["draft_vocab_size"] == 256 and cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1]
    assert (art / "draft" / "model.safetensors").exists() and (art / "draft" / "tokenizer.json").exists()
    checks = json.loads((art / "checks.json").read_text())
    assert {c["name"] for c in checks} >= {"config", "required_tensors", "draft_vocab_size", "d2t", "aux_layer_ids",
                                           "serving_context", "tokenizer"}
    assert all(c["passed"] for c in checks), checks
    d = json.loads((art / "draft.json").read_text())
    assert d["algorithm"] == "eagle3" and d["aux_layer_ids"] == [0, 1] and d["has_d2t"] is True
    assert d["vocab_size"] == 512 and d["draft_vocab_size"] == 256 and d["trained_draft_len"] == 3
    assert 1.0 <= d["acceptance_length"] <= 4.0


def test_eagle3_curve_metrics_and_report(eagle):
    curve = json.loads((_art(eagle) / "curve.json").read_text())
    pts = curve["points"]
    assert pts[0]["step"] == 1 and pts[-1]["step"] == 12
    assert all(len(p["accuracy"]) == 3 and p["loss"] > 0 for p in pts)   # one accuracy per TTT position
    assert pts[-1]["loss"] < pts[0]["loss"]
    st = {s["name"]: s for s in status_json(eagle)["stages"]}["train_draft"]
    m = st["metrics"]
    assert m["acceptance_draft_len"] == 3 and 1.0 <= m["acceptance_length"] <= 4.0
    assert set(m["acceptance_by_domain"]) == {"code", "prose"}
    assert m["step_ms_mean"] > 0 and m["world_size"] == 1 and m["resumed_from_step"] == 0
    r = run_cli("report", "--workdir", str(eagle))
    assert r.returncode == 0, r.stderr
    html = (eagle / "report.html").read_text()
    assert "draft training loss" in html or "data:image/png" in html
    assert "validate_online" in html


def test_eagle3_export_reloads_into_modelopt(eagle):
    """The exported tensors load strictly into a freshly converted ModelOpt EAGLE model, which then drafts."""
    import torch
    from safetensors.torch import load_file

    from runtime import draft_training as dt

    model = dt.build_model(json.loads(_job(eagle).read_text()), False, torch.device("cpu"))
    sd = load_file(str(_art(eagle) / "draft" / "model.safetensors"))
    model.eagle_module.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in sd.items()}, strict=True)
    assert int(model.eagle_module.d2t.abs().sum()) > 0   # the calibrated reduced-vocabulary map came back
    model.eval()
    _, draft = model.pseudo_speculative_generate(torch.tensor([[5, 6, 7, 8]]), steps=3)
    assert draft.shape == (1, 3) and int(draft.max()) < 512


def _job(wd: Path) -> Path:
    """A job file equivalent to the build's (for reloading): rebuilt from the draft.json of the artifact."""
    art = _art(wd)
    d = json.loads((art / "draft.json").read_text())
    tj = json.loads((wd / "artifacts" / "target" / "target.json").read_text())
    job = {"algorithm": {"name": "eagle3", "draft_layers": d["num_layers"], "aux_layer_ids": d["aux_layer_ids"],
                         "ttt_steps": 3, "draft_vocab_size": d["draft_vocab_size"], "intermediate_size": None,
                         "loss_decay_factor": 0.9},
           "target": {k: tj[k] for k in ("num_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                                         "num_key_value_heads", "head_dim", "vocab_size")},
           "target_dir": str(wd / "artifacts" / "target" / "model"), "train_dtype": "float32", "trust_remote_code": False,
           "torch_compile": False, "export_rope_scaling": {}, "train": {"seed": 0}}
    p = wd / "reload_job.json"
    p.write_text(json.dumps(job))
    return p


# ------------------------------------------------------------------------------------------- export checks


def _checks(draft: Path, wd: Path, **kw):
    from runtime.draft_checks import Expect, check_draft

    d = json.loads((_art(wd) / "draft.json").read_text())
    e = dict(algorithm="eagle3", num_layers=1, hidden_size=64, vocab_size=512, capture_layer_ids=d["aux_layer_ids"],
             serving_context=2048, target_dir=wd / "artifacts" / "target" / "model", draft_vocab_size=256)
    e.update(kw)
    return {c.name: c for c in check_draft(draft, Expect(**e))}


def _rewrite_tensors(draft: Path, fn) -> None:
    from safetensors.torch import load_file, save_file

    sd = load_file(str(draft / "model.safetensors"))
    save_file(fn(sd), str(draft / "model.safetensors"))


def _edit_config(draft: Path, fn) -> None:
    cfg = json.loads((draft / "config.json").read_text())
    fn(cfg)
    (draft / "config.json").write_text(json.dumps(cfg))


BROKEN = {
    "required_tensors": (lambda d: _rewrite_tensors(d, lambda sd: {k: v for k, v in sd.items() if k != "fc.weight"}),
                         "missing 1 tensor(s)"),
    "d2t": (lambda d: _rewrite_tensors(d, lambda sd: {k: v for k, v in sd.items() if k != "d2t"}), "no d2t tensor"),
    "draft_vocab_size": (lambda d: _edit_config(d, lambda c: c.pop("draft_vocab_size")), "has no draft_vocab_size"),
    "aux_layer_ids": (lambda d: _edit_config(d, lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[0, 2])),
                      "training captured [0, 1]"),
    "serving_context": (lambda d: _edit_config(d, lambda c: c.update(max_position_embeddings=1024, rope_scaling=None)),
                        "covers 1024 positions"),
    "tokenizer": (lambda d: (d / "tokenizer.json").write_text((d / "tokenizer.json").read_text().replace("<|mask|>", "<|MASK|>")),
                  "different from the target's: tokenizer.json"),
    "config": (lambda d: _edit_config(d, lambda c: c.update(architectures=["LlamaForCausalLM"])), "expected ['LlamaForCausalLMEagle3']"),
}


def test_export_checks_pass_on_the_real_export(eagle):
    assert all(c.passed for c in _checks(_art(eagle) / "draft", eagle).values())


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_each_export_check_fails_on_a_broken_export(eagle, tmp_path, name):
    draft = tmp_path / "draft"
    shutil.copytree(_art(eagle) / "draft", draft)
    breaker, fragment = BROKEN[name]
    breaker(draft)
    got = _checks(draft, eagle)
    assert not got[name].passed and fragment in got[name].message, got[name]
    others = [c for n, c in got.items() if n != name and not c.passed]
    assert not others, others   # each break trips exactly its own check


def test_d2t_map_out_of_vocab_is_caught(eagle, tmp_path):
    import torch

    draft = tmp_path / "draft"
    shutil.copytree(_art(eagle) / "draft", draft)
    _rewrite_tensors(draft, lambda sd: {**sd, "d2t": torch.full_like(sd["d2t"], 10_000)})
    c = _checks(draft, eagle)["d2t"]
    assert not c.passed and "outside the vocabulary" in c.message


# ------------------------------------------------------------------------------------------- DFlash, 2 processes


def test_dflash_two_process_training_exports_a_checked_draft(dflash):
    art = _art(dflash)
    m = {s["name"]: s for s in status_json(dflash)["stages"]}["train_draft"]["metrics"]
    assert m["world_size"] == 2 and m["algorithm"] == "dflash"
    cfg = json.loads((art / "draft" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["block_size"] == 4
    assert cfg["dflash_config"]["mask_token_id"] == json.loads((dflash / "artifacts" / "target" / "target.json").read_text())["mask_token_id"]
    assert cfg["dflash_config"]["target_layer_ids"] == [0, 3]   # ModelOpt's default repeats layer 1 on 4 layers
    assert cfg["num_attention_heads"] == 4 and cfg["hidden_size"] == 64   # the target's shape, not Qwen3 defaults
    assert all(c["passed"] for c in json.loads((art / "checks.json").read_text()))
    d = json.loads((art / "draft.json").read_text())
    assert d["trained_draft_len"] == 3 and d["block_size"] == 4 and m["acceptance_draft_len"] == 3
    assert 1.0 <= m["acceptance_length"] <= 4.0


def test_dflash_export_reloads_with_modelopt_warm_start(dflash):
    """ModelOpt's own loader (`dflash_init_checkpoint`) accepts the export and raises on any mismatch."""
    art = _art(dflash)
    d = json.loads((art / "draft.json").read_text())
    tj = json.loads((dflash / "artifacts" / "target" / "target.json").read_text())
    import copy

    import modelopt.torch.speculative as mtsp
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(dflash / "artifacts" / "target" / "model", dtype=torch.float32)
    cfg = copy.deepcopy(mtsp.DFLASH_DEFAULT_CFG["config"])
    cfg.update(dflash_block_size=4, dflash_mask_token_id=d["mask_token_id"], dflash_use_torch_compile=False,
               dflash_init_checkpoint=str(art / "draft"),
               dflash_architecture_config=dict(num_hidden_layers=2, target_layer_ids=d["target_layer_ids"],
                                               intermediate_size=tj["intermediate_size"], num_attention_heads=tj["num_attention_heads"],
                                               num_key_value_heads=tj["num_key_value_heads"], head_dim=tj["head_dim"]))
    mtsp.convert(m, [("dflash", cfg)])
    m.eval()
    _, draft = m.pseudo_speculative_generate(torch.tensor([[5, 6, 7, 8]]), steps=3)
    assert draft.shape == (1, 3)


# ------------------------------------------------------------------------------------------- offline, disk


def test_offline_trains_from_dumped_hidden_states(inputs, tmp_path):
    wd = _workdir(inputs, tmp_path)
    r = _build(wd, "train_draft.mode=offline", "train_draft.steps=6")
    assert r.returncode == 0, r.stderr[-4000:]
    m = {s["name"]: s for s in status_json(wd)["stages"]}["train_draft"]["metrics"]
    assert m["mode"] == "offline" and m["dump_bytes"] > 0
    # the estimate (samples x tokens x (1 + aux layers) x hidden x bytes) is within 25 % of what was written
    assert abs(m["dump_estimate_bytes"] - m["dump_bytes"]) / m["dump_bytes"] < 0.25
    assert "dumping target hidden states" in (wd / "logs" / "train_draft.log").read_text()
    assert all(c["passed"] for c in json.loads((_art(wd) / "checks.json").read_text()))


def _stage_ctx(wd: Path, *overrides: str, config: Path = TINY_CONFIG):
    """The stage's context as the runner builds it, for calling `run` in this process."""
    import logging

    from pipeline.config import load_config
    from pipeline.stage import StageContext
    from pipeline.store import Store

    cfg = load_config(config, [*tiny_overrides_items(), *SMALL, *overrides])
    st = Store(wd)
    out = wd / "out"
    out.mkdir()
    return StageContext(name="train_draft", config=cfg, section=cfg.train_draft, out_dir=out,
                        scratch_dir=st.scratch_dir("train_draft", "0" * 16), inputs={k: st.artifact(k) for k in ("target", "data")},
                        workdir=wd, fingerprint="0" * 16, log=logging.getLogger("test_train_draft"))


def tiny_overrides_items() -> list[str]:
    return [x for x in tiny_overrides("target", "data") if x != "-o"]


def test_offline_dump_refused_over_budget(inputs, tmp_path):
    from pipeline.errors import StageError
    import stages.train_draft as td

    wd = _workdir(inputs, tmp_path)
    ctx = _stage_ctx(wd, "train_draft.mode=offline", "train_draft.offline.max_dump_gb=0.0001")
    with pytest.raises(StageError, match="offline hidden-state dump needs about .*max_dump_gb"):
        td.run(ctx)
    assert not list(ctx.scratch_dir.glob("hidden/*.pt"))   # refused before dumping anything


def test_disk_preflight_refuses_when_free_space_is_short(tmp_path):
    from runtime.draft_training import JobError, dump_preflight, estimate_dump_bytes

    free = shutil.disk_usage(tmp_path).free
    # a 70B-class dump: 1M samples x 4096 tokens x (1 + 3) x 8192 x bf16 is ~268 TB
    need = estimate_dump_bytes(1_000_000, 4096, 3, 8192, 2)
    assert need > free
    with pytest.raises(JobError, match="free; free space there"):
        dump_preflight(need, tmp_path)
    assert dump_preflight(1024, tmp_path)["disk_free_bytes"] > 0


# ------------------------------------------------------------------------------------------- resume


def test_resume_reproduces_an_uninterrupted_run(inputs, tmp_path):
    """Stopped after the step-5 checkpoint and restarted, training continues at step 5 and ends with the
    same draft weights as a run that never stopped (data order and randomness depend on the step only)."""
    import torch
    from safetensors.torch import load_file

    from runtime import draft_training as dt

    art_t, art_d = inputs / "artifacts" / "target", inputs / "artifacts" / "data"
    tj = json.loads((art_t / "target.json").read_text())

    def job(name):
        return {"algorithm": {"name": "dflash", "draft_layers": 1, "target_layer_ids": [2], "block_size": 4,
                              "mask_token_id": tj["mask_token_id"], "num_anchors": 8, "loss_objective": "dpace",
                              "loss_decay_factor": 4.0, "intermediate_size": None, "trained_draft_len": 3},
                "target": {k: tj[k] for k in ("num_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                                              "num_key_value_heads", "head_dim", "vocab_size")},
                "target_dir": str(art_t / "model"), "train_parquet": str(art_d / "train.parquet"), "eval_files": {},
                "scratch_dir": str(tmp_path / name / "scratch"), "export_dir": str(tmp_path / name / "draft"),
                "d2t_path": None, "mode": "online", "max_dump_gb": None, "max_samples": None, "device": "cpu",
                "train_dtype": "float32", "export_dtype": "float32", "threads": 1, "trust_remote_code": False,
                "torch_compile": False, "export_rope_scaling": {}, "serving_context": 2048,
                "train": {"optimizer": "adamw", "lr": 1e-3, "weight_decay": 0.0, "betas": [0.9, 0.95], "schedule": "cosine",
                          "warmup_steps": 2, "min_lr_ratio": 0.1, "grad_clip": 1.0, "steps": 9, "batch_size": 2,
                          "seq_len": 64, "seed": 0, "checkpoint_every": 5, "log_every": 1},
                "eval": {"prompts_per_domain": 0, "osl": 8, "draft_len": 3}}

    def run(name, stop):
        res = dt.train(job(name), should_stop=(lambda s: s >= stop) if stop else None)
        return {k: res.get(k) for k in ("stopped_at", "resumed_from_step")}

    assert run("a", 5) == {"stopped_at": 5, "resumed_from_step": None}
    assert (tmp_path / "a" / "scratch" / "ckpt" / "state.pt").exists() and not (tmp_path / "a" / "draft").exists()
    assert run("a", 0)["resumed_from_step"] == 5
    assert run("b", 0)["resumed_from_step"] == 0
    wa, wb = load_file(str(tmp_path / "a" / "draft" / "model.safetensors")), load_file(str(tmp_path / "b" / "draft" / "model.safetensors"))
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.allclose(wa[k], wb[k], atol=1e-5), k
    curve_a = json.loads((tmp_path / "a" / "scratch" / "result.json").read_text())["curve"]
    assert [p["step"] for p in curve_a] == list(range(1, 10))   # the curve survives the interruption


def test_killed_build_resumes_from_checkpoint(inputs, tmp_path):
    """`specpipe build` killed mid-training: the next build keeps the fingerprint and resumes, not step 0."""
    wd = _workdir(inputs, tmp_path)
    args = [SPECPIPE, "build", str(TINY_CONFIG), "--workdir", str(wd), "--only", "train_draft",
            *tiny_overrides("target", "data"),
            *_o(*SMALL, "train_draft.steps=150", "train_draft.eval.prompts_per_domain=1")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 600
        while not list((wd / "scratch" / "train_draft").glob("*/ckpt/state.pt")):
            assert proc.poll() is None, "build ended before its first checkpoint"
            assert time.monotonic() < deadline, "no checkpoint appeared"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert not (_art(wd) / "manifest.json").exists()
    r = run_cli("build", str(TINY_CONFIG), "--workdir", str(wd), "--only", "train_draft", *tiny_overrides("target", "data"),
                *_o(*SMALL, "train_draft.steps=150", "train_draft.eval.prompts_per_domain=1"))
    assert r.returncode == 0, r.stderr[-3000:]
    m = {s["name"]: s for s in status_json(wd)["stages"]}["train_draft"]["metrics"]
    assert m["resumed_from_step"] >= 5 and m["resumed_from_step"] % 5 == 0
    assert "resuming training from the checkpoint at step" in (wd / "logs" / "train_draft.log").read_text()


# ------------------------------------------------------------------------------------------- config errors


def _check(*overrides: str, config: Path = TINY_CONFIG) -> subprocess.CompletedProcess:
    return run_cli("check", str(config), *_o(*overrides))


@pytest.mark.parametrize("overrides,path,fragment", [
    (["train_draft.algorithm={kind: dflash, draft_layers: 5}"], "train_draft.algorithm.draft_layers", "target has 4"),
    (["train_draft.algorithm={kind: dflash, mask_token: 99999}"], "train_draft.algorithm.mask_token", "not in the target vocabulary"),
    (["train_draft.algorithm.aux_layer_ids=[0, 7]"], "train_draft.algorithm.aux_layer_ids", "[7] out of range"),
    (["train_draft.algorithm={kind: dflash, target_layer_ids: [0, 9]}"], "train_draft.algorithm.target_layer_ids", "out of range"),
    (["train_draft.algorithm={kind: dflash}", "train_draft.seq_len=60"], "train_draft.seq_len", "not divisible by algorithm.block_size 8"),
    (["train_draft.algorithm.aux_layer_ids=[1, 1]"], "train_draft.algorithm.aux_layer_ids", "duplicates"),
    (["train_draft.algorithm={kind: medusa}"], "train_draft.algorithm.kind", "eagle3, dflash"),
    (["train_draft.algorithm.draft_vocab_size=5000"], "train_draft.algorithm.draft_vocab_size", "exceeds the target vocabulary"),
    (["train_draft.launcher={kind: torchrun, nnodes: 2}"], "train_draft.launcher", "rdzv_endpoint"),
    (["train_draft.launcher={kind: torchrun, nproc_per_node: 3}"], "train_draft.batch_size", "not divisible by the 3"),
    (["train_draft.launcher={kind: none, fsdp: true}"], "train_draft.launcher.fsdp", "needs launcher.kind torchrun"),
    (["train_draft.launcher={kind: torchrun, fsdp: true}"], "train_draft.launcher.fsdp", "(now torchrun, 1 process)"),
])
def test_bad_algorithm_options_are_config_errors(overrides, path, fragment):
    r = _check(*overrides)
    assert r.returncode == 2, r.stdout + r.stderr
    line = next((ln.strip() for ln in r.stderr.splitlines() if ln.strip().startswith(path + ":")), None)
    assert line is not None and fragment in line, r.stderr


def test_algorithm_shorthand_and_tiny_configs_validate():
    r = _check("train_draft.algorithm=dflash", config=DFLASH_CONFIG)   # the shorthand takes DFlash's defaults
    assert r.returncode == 0, r.stderr
    for cfg in (TINY_CONFIG, DFLASH_CONFIG):
        r = run_cli("check", str(cfg))
        assert r.returncode == 0, r.stderr


def test_mask_token_not_in_vocab_is_a_stage_error(inputs, tmp_path):
    from pipeline.errors import StageError
    import stages.train_draft as td

    wd = _workdir(inputs, tmp_path)
    ctx = _stage_ctx(wd, "train_draft.algorithm={kind: dflash, block_size: 4, mask_token: '<|nope|>'}", config=DFLASH_CONFIG)
    with pytest.raises(StageError, match=r"'<\|nope\|>' is not a token of the target's vocabulary"):
        td.run(ctx)


# ------------------------------------------------------------------------------------------- FSDP, several nodes


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _draft_weights(wd: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(_art(wd) / "draft" / "model.safetensors"))


def _metrics(wd: Path) -> dict:
    return {s["name"]: s for s in status_json(wd)["stages"]}["train_draft"]["metrics"]


def test_fsdp_over_two_nodes_trains_the_draft_ddp_trains(inputs, tmp_path):
    """Two torchrun nodes of one process each on this host (c10d rendezvous on 127.0.0.1), the target's layers
    sharded between them, node 1 started from the stage's worker_commands.sh as the Slurm script does: the
    exported draft equals the one DDP trains with two processes on one node, each node held half the
    target's layers."""
    import torch

    ref = _workdir(inputs, tmp_path / "ddp")
    r = _build(ref, "train_draft.steps=6", "train_draft.launcher={kind: torchrun, nproc_per_node: 2}")
    assert r.returncode == 0, r.stderr[-4000:]

    wd = _workdir(inputs, tmp_path / "fsdp")
    launcher = (f"train_draft.launcher={{kind: torchrun, nproc_per_node: 1, nnodes: 2, fsdp: true, "
                f"rdzv_endpoint: '127.0.0.1:{_free_port()}', timeout_s: 600}}")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    node0 = subprocess.Popen([SPECPIPE, "build", str(TINY_CONFIG), "--workdir", str(wd), "--only", "train_draft",
                              *tiny_overrides("target", "data"), *_o(*SMALL, "train_draft.steps=6", launcher)],
                             cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        cmds = []
        while not cmds and time.monotonic() < deadline and node0.poll() is None:
            cmds = list((wd / "scratch" / "train_draft").glob("*/worker_commands.sh"))
            time.sleep(0.5)
        assert cmds, "node 0 never wrote worker_commands.sh" + (node0.stderr.read()[-3000:] if node0.poll() is not None else "")
        lines = cmds[0].read_text().splitlines()
        assert len(lines) == 1 and "--nnodes 2" in lines[0] and "runtime.draft_training" in lines[0]
        node1 = subprocess.run(["bash", "-c", lines[0]], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        _, err = node0.communicate(timeout=600)
    finally:
        if node0.poll() is None:
            node0.kill()
    assert node1.returncode == 0, node1.stderr[-3000:]
    assert node0.returncode == 0, err[-4000:]

    m = _metrics(wd)
    assert m["world_size"] == 2 and m["fsdp_processes"] == 2
    assert m["target_layer_bytes_per_process"] * 2 == m["target_layer_bytes"] > 0
    assert "each of 2 processes held" in (wd / "logs" / "train_draft.log").read_text()
    assert m["final_loss"] == pytest.approx(_metrics(ref)["final_loss"], rel=1e-5)
    a, b = _draft_weights(wd), _draft_weights(ref)
    assert sorted(a) == sorted(b)
    for k in a:
        torch.testing.assert_close(a[k].float(), b[k].float(), rtol=1e-4, atol=1e-5, msg=k)
    assert all(c["passed"] for c in json.loads((_art(wd) / "checks.json").read_text()))


def test_dflash_under_fsdp_trains_the_draft_ddp_trains(dflash, inputs, tmp_path):
    """DFlash (whose forward leaves some draft parameters unused) with the target sharded: the same draft as
    the `dflash` fixture's DDP run with the same options."""
    import torch

    wd = _workdir(inputs, tmp_path)
    r = _build(wd, "train_draft.algorithm={kind: dflash, block_size: 4, draft_layers: 2, num_anchors: 8}",
               "train_draft.launcher={kind: torchrun, nproc_per_node: 2, fsdp: true, timeout_s: 600}", config=DFLASH_CONFIG)
    assert r.returncode == 0, r.stderr[-4000:]
    assert _metrics(wd)["fsdp_processes"] == 2 and "fsdp_processes" not in _metrics(dflash)
    a, b = _draft_weights(wd), _draft_weights(dflash)
    assert sorted(a) == sorted(b)
    for k in a:
        torch.testing.assert_close(a[k].float(), b[k].float(), rtol=1e-4, atol=1e-5, msg=k)


def test_fsdp_target_skeleton_reads_only_what_every_process_keeps(inputs, tmp_path):
    """Before sharding, a process holds the target's embeddings, final norm, lm_head and RoPE tables (equal to
    the checkpoint's) and no decoder layer but the last one's empty storage; a target directory without
    safetensors is refused by name."""
    import torch
    from transformers import AutoModelForCausalLM

    from runtime.draft_training import JobError, load_target_skeleton

    model_dir = inputs / "artifacts" / "target" / "model"
    job = {"target_dir": str(model_dir), "trust_remote_code": False}
    sk = load_target_skeleton(job, torch.device("cpu"), torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    layers = sk.get_decoder().layers
    assert all(p.is_meta for layer in layers[:-1] for p in layer.parameters())
    assert not any(p.is_meta for p in layers[-1].parameters())
    outside = {n: p for n, p in sk.named_parameters() if ".layers." not in n}
    assert outside and all(torch.equal(p, ref.get_parameter(n)) for n, p in outside.items())
    for n, b in sk.named_buffers():
        assert torch.equal(b, ref.get_buffer(n)), n
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(model_dir / "config.json", bare / "config.json")
    with pytest.raises(JobError, match="neither model.safetensors nor model.safetensors.index.json"):
        load_target_skeleton({"target_dir": str(bare), "trust_remote_code": False}, torch.device("cpu"), torch.float32)


def test_fsdp_offline_dump_matches_the_targets_hidden_states(inputs, tmp_path):
    """Offline mode with the target sharded over two processes: every sample is dumped once, and a dumped
    record holds exactly what the whole target computes for that sample. Resuming a dump where only one
    process has samples left (the other runs discarded forwards to keep the collectives in step) rewrites
    the missing records identically."""
    import torch
    from transformers import AutoModelForCausalLM

    import stages.train_draft as td
    from runtime.draft_training import read_samples

    wd = _workdir(inputs, tmp_path)
    opts = ("train_draft.mode=offline", "train_draft.steps=2", "train_draft.max_samples=7",
            "train_draft.launcher={kind: torchrun, nproc_per_node: 2, fsdp: true, timeout_s: 240}")
    ctx = _stage_ctx(wd, *opts)
    m = td.run(ctx)
    assert m["mode"] == "offline" and m["fsdp_processes"] == 2 and m["world_size"] == 2
    files = sorted(ctx.scratch_dir.glob("hidden/*.pt"))
    assert len(files) == 7
    target = AutoModelForCausalLM.from_pretrained(wd / "artifacts" / "target" / "model", dtype=torch.float32).eval()
    samples = read_samples(wd / "artifacts" / "data" / "train.parquet", 7)
    aux = json.loads((ctx.out_dir / "draft.json").read_text())["aux_layer_ids"]
    for i in (0, 5):   # one sample from each process
        rec = torch.load(files[i], weights_only=True)
        ids = torch.tensor([samples[i][0][:64]])
        assert torch.equal(rec["input_ids"], ids[0])
        with torch.no_grad():
            hs = target(input_ids=ids, output_hidden_states=True).hidden_states
        torch.testing.assert_close(rec["hidden_states"], hs[-1][0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(rec["aux_hidden_states"], torch.cat([hs[j + 1][0] for j in aux], -1), rtol=1e-4, atol=1e-5)

    # samples 0, 2, 4 are process 0's: it alone has work when they are gone
    before = {i: torch.load(files[i], weights_only=True) for i in (0, 2, 4)}
    for i in before:
        files[i].unlink()
    ctx.out_dir.rename(wd / "out.first")
    m2 = td.run(_stage_ctx(wd, *opts))
    assert m2["dump_bytes"] == m["dump_bytes"]
    for i, rec in before.items():
        again = torch.load(files[i], weights_only=True)
        for k in rec:
            assert torch.equal(again[k], rec[k]), (i, k)


def test_a_node_that_never_joins_ends_at_the_launcher_timeout(inputs, tmp_path):
    wd = _workdir(inputs, tmp_path)
    t0 = time.monotonic()
    r = _build(wd, f"train_draft.launcher={{kind: torchrun, nnodes: 2, rdzv_endpoint: '127.0.0.1:{_free_port()}', timeout_s: 10}}")
    assert r.returncode != 0 and time.monotonic() - t0 < 180
    assert "ran past train_draft.launcher.timeout_s=10" in r.stderr, r.stderr[-3000:]
    assert not (_art(wd) / "manifest.json").exists()
