"""train_draft's held-out acceptance during training (runtime/training/evals.py): eval points at the configured steps,
the best point exported (not the last), early stop when patience runs out, resume keeping the best; eval points
under torchrun (rank 0 measures, the stop decision broadcast); the config errors where they cannot run; the reduced
draft vocabulary's statistics. On the session's tiny target and data (`run_dir`)."""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from conftest import TINY_CONFIG, run_cli, status_json, tiny_overrides

pytestmark = pytest.mark.slow

SMALL = ["train_draft.batch_size=2", "train_draft.seq_len=64", "train_draft.warmup_steps=2", "train_draft.log_every=2",
         "train_draft.eval.prompts_per_domain=2", "train_draft.eval.osl=12", "train_draft.algorithm.draft_vocab_size=256"]


def _workdir(run_dir: Path, tmp_path: Path) -> Path:
    wd = tmp_path / "run"
    (wd / "artifacts").mkdir(parents=True)
    for stage in ("target", "data"):
        shutil.copytree(run_dir / "artifacts" / stage, wd / "artifacts" / stage)
    return wd


def _build(wd: Path, *overrides: str):
    o = []
    for it in [*SMALL, *overrides]:
        o += ["-o", it]
    return run_cli("build", str(TINY_CONFIG), "--workdir", str(wd), "--only", "train_draft",
                   *tiny_overrides("target", "data"), *o)


def _first_argmax(points: list) -> int:
    best = max(p["mean"] for p in points)
    return next(p["step"] for p in points if p["mean"] == best)


def test_early_stop_exports_the_best_point_not_the_last(run_dir, tmp_path):
    """min_delta 3 (more than any AL rise of a k=3 draft from its floor 1): only the first eval point is ever the best,
    patience 2 stops training at the third; the first is exported, with the reasons in draft.json, curve.json, the
    log and the report, beside the draft vocabulary's statistics."""
    wd = _workdir(run_dir, tmp_path)
    r = _build(wd, "train_draft.steps=12", "train_draft.checkpoint_every=5", "train_draft.eval.every=2",
               "train_draft.eval.patience=2", "train_draft.eval.min_delta=3")
    assert r.returncode == 0, r.stderr[-4000:]
    art = wd / "artifacts" / "train_draft"
    curve, draft = json.loads((art / "curve.json").read_text()), json.loads((art / "draft.json").read_text())
    pts = curve["acceptance_points"]
    assert [p["step"] for p in pts] == [2, 4, 6]   # stopped at 6: two points without improvement
    assert set(pts[0]["al"]) == {"code", "prose"} and all(1.0 <= v <= 4.0 for p in pts for v in p["al"].values())
    assert all(p["mean"] == pytest.approx(sum(p["al"].values()) / 2, abs=1e-6) for p in pts)
    assert 0 < pts[0]["train_cpu_s"] < pts[1]["train_cpu_s"] < pts[2]["train_cpu_s"] and all(p["eval_cpu_s"] > 0 for p in pts)
    assert curve["early_stop"]["step"] == 6 and "eval.patience 2" in curve["early_stop"]["reason"]
    assert draft["exported_step"] == curve["exported_step"] == 2 != pts[-1]["step"]
    assert "best held-out AL: step 2" in draft["export_reason"]
    assert draft["acceptance_length"] == pts[0]["acceptance_length"]   # the estimate is the exported point's
    m = {s["name"]: s for s in status_json(wd)["stages"]}["train_draft"]["metrics"]
    assert m["exported_step"] == 2 and m["early_stop_step"] == 6 and m["eval_points"] == 3
    assert max(p["step"] for p in curve["points"]) == 6   # no step ran after the stop
    log = (wd / "logs" / "train_draft.log").read_text()
    assert "held-out AL at step 4: mean" in log and "early stop at step 6" in log and "exporting the draft of step 2" in log
    dv = draft["draft_vocab"]
    assert dv["draft_vocab_size"] == 256 and 0.5 < dv["token_coverage"] <= 1 and 0 <= dv["heldout_oov_rate"] < 1
    assert dv["heldout_tokens"] > 0 and "of the held-out split's assistant tokens fall outside it" in log
    assert m["draft_vocab_heldout_oov_rate"] == dv["heldout_oov_rate"]
    assert run_cli("report", "--workdir", str(wd)).returncode == 0
    html = (wd / "report.html").read_text()
    assert "mean AL" in html and "held-out assistant tokens outside it" in html and "early stop at step 6" in html


def _job(run_dir: Path, out: Path, **eval_opts) -> dict:
    """The job the stage would write (runtime.training.job.make_job) for a 9-step EAGLE-3 run."""
    from transformers import AutoTokenizer

    from runtime.records import TargetInfo
    from runtime.training.algorithm import resolve_algorithm
    from runtime.training.job import JobDirs, make_job
    from stages.train_draft import Config

    sec = Config.model_validate({"steps": 9, "batch_size": 2, "seq_len": 64, "warmup_steps": 2, "checkpoint_every": 100,
                                 "log_every": 1, "algorithm": {"kind": "eagle3", "draft_vocab_size": 256},
                                 "eval": {"prompts_per_domain": 2, "osl": 12, **eval_opts}})
    t, d = run_dir / "artifacts" / "target", run_dir / "artifacts" / "data"
    info = TargetInfo.from_json(json.loads((t / "target.json").read_text()))
    algo = resolve_algorithm(sec.algorithm, info, AutoTokenizer.from_pretrained(t / "model"), logging.getLogger("t"))
    return make_job(sec, algo=algo, target=info, dirs=JobDirs(t / "model", d, out / "scratch", out), train_samples=None,
                    device="cpu", threads=2, trust_remote_code=False)


def test_best_point_exported_and_kept_across_a_resume(run_dir, tmp_path):
    """Eval points every 3 steps (not the checkpoint steps: each point checkpoints): the exported draft is the first
    argmax of the mean AL, its weights the kept best.safetensors; a run interrupted after step 6 and resumed records
    the same points, keeps the same best and exports the same weights as an uninterrupted one."""
    import torch
    from safetensors.torch import load_file

    from runtime.training import draft_training as dt

    full = dt.train(_job(run_dir, tmp_path / "b", every=3))
    pts = full["evals"]["points"]
    assert [p["step"] for p in pts] == [3, 6, 9] and full["evals"]["exported_step"] == _first_argmax(pts)
    best = load_file(str(tmp_path / "b" / "scratch" / "ckpt" / "best.safetensors"))
    exported = load_file(str(tmp_path / "b" / "draft" / "model.safetensors"))
    if full["evals"]["exported_step"] != 9:   # the kept best is what was exported (in the export dtype)
        for k, v in best.items():
            torch.testing.assert_close(exported[k], v.to(exported[k].dtype), msg=k)
    assert dt.train(_job(run_dir, tmp_path / "a", every=3), should_stop=lambda s: s >= 6)["stopped_at"] == 6
    assert (tmp_path / "a" / "scratch" / "ckpt" / "best.safetensors").exists()
    resumed = dt.train(_job(run_dir, tmp_path / "a", every=3))
    assert resumed["resumed_from_step"] == 6
    timing = ("seconds", "train_cpu_s", "eval_cpu_s")
    strip = [{k: v for k, v in p.items() if k not in timing} for p in pts]
    assert [{k: v for k, v in p.items() if k not in timing} for p in resumed["evals"]["points"]] == strip
    cpu = [p["train_cpu_s"] for p in resumed["evals"]["points"]]   # the first run's training CPU carried over the resume
    assert 0 < cpu[0] < cpu[1] < cpu[2]
    assert resumed["evals"]["exported_step"] == full["evals"]["exported_step"]
    again = load_file(str(tmp_path / "a" / "draft" / "model.safetensors"))
    for k in exported:
        torch.testing.assert_close(again[k], exported[k], msg=k)


def test_eval_points_under_torchrun_stop_every_rank(run_dir, tmp_path):
    """Two DDP processes: rank 0 measures, the stop decision reaches rank 1 (both leave the loop at step 4; a rank
    that went on would hang its peer's all-reduce), and the first point is exported."""
    wd = _workdir(run_dir, tmp_path)
    r = _build(wd, "train_draft.steps=8", "train_draft.checkpoint_every=100", "train_draft.eval.every=2",
               "train_draft.eval.patience=1", "train_draft.eval.min_delta=3",
               "train_draft.launcher={kind: torchrun, nproc_per_node: 2, timeout_s: 600}")
    assert r.returncode == 0, r.stderr[-4000:]
    curve = json.loads((wd / "artifacts" / "train_draft" / "curve.json").read_text())
    assert [p["step"] for p in curve["acceptance_points"]] == [2, 4] and curve["early_stop"]["step"] == 4
    assert curve["exported_step"] == 2 and max(p["step"] for p in curve["points"]) == 4


@pytest.mark.parametrize("overrides,path", [
    (["train_draft.launcher={kind: torchrun, nproc_per_node: 2, fsdp: true}", "train_draft.eval.estimator=modelopt",
      "train_draft.eval.every=5"], "train_draft.eval.every"),
    (["train_draft.mode=offline", "train_draft.eval.estimator=modelopt", "train_draft.eval.every=5"],
     "train_draft.eval.every"),
    (["train_draft.eval.every=0", "train_draft.eval.patience=2"], "train_draft.eval.patience"),
])
def test_eval_points_where_they_cannot_run_are_config_errors(overrides, path):
    o = []
    for it in overrides:
        o += ["-o", it]
    r = run_cli("check", str(TINY_CONFIG), *o)
    assert r.returncode == 2 and path in r.stderr, r.stderr


def test_default_every_is_checkpoint_every_or_the_end_only():
    from runtime.training.eval_config import resolve_every
    from stages.train_draft import Config

    def every(**kw):
        return resolve_every(Config.model_validate({"checkpoint_every": 7, **kw}))

    assert every() == 7 and every(eval={"every": 3}) == 3 and every(eval={"prompts_per_domain": 0}) == 0
    assert every(launcher={"kind": "torchrun", "nproc_per_node": 2, "fsdp": True}, eval={"estimator": "modelopt"}) == 0
    assert every(launcher={"kind": "torchrun", "nproc_per_node": 2}) == 7   # DDP: rank 0 measures


def test_d2t_stats_count_the_trained_on_tokens_outside_the_draft_vocabulary(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    from runtime.training.samples import d2t_stats

    vocab = [2, 5, 9]
    torch.save(torch.tensor([t - i for i, t in enumerate(vocab)]), tmp_path / "d2t.pt")
    train = [([1, 2, 5, 7], [0, 1, 1, 1]), ([9, 9, 3], [0, 1, 1])]   # trained on 2 5 7 | 9 3: 3 of 5 inside
    pq.write_table(pa.table({"input_ids": [[1, 2, 3, 4], [5, 6]], "loss_mask": [[0, 0, 1, 1], [1, 1]]}),
                   tmp_path / "heldout.parquet")   # trained on 3 4 5 6: 1 of 4 inside
    s = d2t_stats(tmp_path / "d2t.pt", train, str(tmp_path / "heldout.parquet"))
    assert s == {"draft_vocab_size": 3, "token_coverage": 0.6, "train_tokens": 5, "heldout_oov_rate": 0.75,
                 "heldout_tokens": 4}


def test_validate_counts_the_generated_tokens_outside_the_draft_vocabulary():
    """validate's `outside_draft_vocab` (runtime/validate/reference.py): target ids d2t reaches, the share of the
    generated tokens outside them; 0.0 for a draft without d2t (the whole vocabulary)."""
    import types

    import torch

    from runtime.validate.reference import draft_vocab_ids, outside_share

    vocab = draft_vocab_ids(types.SimpleNamespace(d2t=torch.tensor([2, 4, 7])))   # draft ids 0 1 2 -> 2 5 9
    assert vocab == {2, 5, 9}
    assert outside_share(vocab, [[2, 3, 5], [9, 9, 1, 4, 2]]) == 0.375 and outside_share(vocab, [[]]) is None
    assert draft_vocab_ids(types.SimpleNamespace(d2t=None)) is None and outside_share(None, [[1, 2]]) == 0.0
