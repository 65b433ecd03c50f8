"""train_draft.max_minutes (runtime/training/budget.py): the step count resolved from the measured step time, the
schedule ending at it, the hard stop when steps slow down, the resolved count carried across a resume; and a real
build under a budget (in this process and under torchrun: every rank stops at the same step) that commits a draft
passing its checks with the steps done recorded."""
from __future__ import annotations

import json
import shutil

import pytest

from runtime.training.budget import RESOLVE_AFTER, Budget, budget_metrics, steps_row
from runtime.training.loop import lr_factor

from conftest import TINY_CONFIG, run_cli, status_json, tiny_overrides


class _Proc:
    """Rank 0 of one process: what Budget reads of runtime.training.dist.Process, events kept."""

    rank, world = 0, 1

    def __init__(self):
        self.events: list[dict] = []

    def emit0(self, ev):
        self.events.append(ev)


def _job(steps=100, max_minutes=0.5, warmup=30):
    return {"train": {"steps": steps, "max_minutes": max_minutes, "warmup_steps": warmup, "min_lr_ratio": 0.1,
                      "schedule": "cosine"}}


def _run(job, times, saved=None):
    proc, budget = _Proc(), Budget.from_job(job, saved)
    done = []
    for i, s in enumerate(times):
        done.append(s)
        budget.after_step(job, i + 1, done, proc)
        if i + 1 >= job["train"]["steps"]:
            break
    return budget, proc, len(done)


def test_the_count_is_resolved_from_the_measured_steps_and_the_schedule_ends_there():
    """30 s of steps at a measured 1 s a step (the first, a warm-up, 3 s): 6 done in 8 s, 22 more fit: 28 steps, the
    warm-up cut to them, the cosine at its floor at the last step; the steps after run to 28 and no further."""
    job = _job()
    budget, proc, n = _run(job, [3.0] + [1.0] * 40)
    assert job["train"]["steps"] == 28 == n and job["train"]["warmup_steps"] == 28
    assert [e["event"] for e in proc.events] == ["budget"]
    assert proc.events[0] == {"event": "budget", "steps": 28, "configured_steps": 100, "rate_s": 1.0,
                              "max_minutes": 0.5, "spent_s": 8.0}
    assert lr_factor(27, job) == pytest.approx(1.0)   # the warm-up's last step: 28 / 28
    job["train"]["warmup_steps"] = 10                 # with a warm-up inside the count, the cosine ends at its floor
    assert lr_factor(28, job) == pytest.approx(0.1)
    rec = job["train"]["budget"]
    assert rec == {"max_minutes": 0.5, "configured_steps": 100, "resolved_steps": 28, "rate_s": 1.0, "steps": 28,
                   "stopped": "budget"}
    m = budget_metrics({"budget": rec})
    assert m == {"configured_steps": 100, "max_minutes": 0.5, "budget_stop": "budget", "budget_step_s": 1.0}
    assert steps_row({"steps": 28, **m}) == "28 of 100 (the 0.5-minute budget at 1.0 s a step)"
    assert budget.state() == {"budget": {"resolved_steps": 28, "rate_s": 1.0, "stopped": None}}


def test_a_budget_the_steps_fit_in_changes_nothing():
    job = _job(max_minutes=10)
    _, _, n = _run(job, [1.0] * 200)
    assert n == 100 and job["train"]["steps"] == 100 and job["train"]["warmup_steps"] == 30
    assert job["train"]["budget"]["stopped"] is None and job["train"]["budget"]["resolved_steps"] == 100
    assert steps_row({"steps": 100, **budget_metrics({"budget": job["train"]["budget"]})}) == \
        "100 of 100 (within the 10-minute budget)"
    assert steps_row({"steps": 100}) == "100"   # no budget: the count as before


def test_steps_that_slow_down_stop_at_the_budget():
    """Resolved at 1 s a step (28 steps), then 5 s a step: the sum reaches 30 s at step 11 (8 + 5 x 5 = 33), which is
    the last; the hard stop is recorded and logged once."""
    job = _job()
    budget, proc, n = _run(job, [3.0] + [1.0] * 5 + [5.0] * 40)
    assert n == 11 and job["train"]["steps"] == 11 and budget.stopped == "time"
    assert [e["event"] for e in proc.events] == ["budget", "budget_stop"]
    assert proc.events[1]["step"] == 11 and proc.events[1]["resolved_steps"] == 28
    assert job["train"]["budget"]["stopped"] == "time" and job["train"]["budget"]["steps"] == 11


def test_a_resumed_job_keeps_the_resolved_count():
    """The checkpoint's count is taken, not resolved again from the new machine's (here far slower) steps; the steps
    of the earlier run count toward the budget."""
    job = _job()
    saved = {"resolved_steps": 28, "rate_s": 1.0, "stopped": None}
    budget = Budget.from_job(job, saved)
    assert job["train"]["steps"] == 28 and job["train"]["configured_steps"] == 100
    earlier = [3.0] + [1.0] * 11   # 12 steps, 14 s, before the interruption
    proc = _Proc()
    times = list(earlier)
    for i in range(12, 12 + RESOLVE_AFTER + 2):
        times.append(1.5)
        budget.after_step(job, i + 1, times, proc)
    assert job["train"]["steps"] == 28 and proc.events == []   # 14 + 8 x 1.5 = 26 s: within the budget


def test_the_config_takes_a_budget_in_minutes():
    from pydantic import ValidationError

    from stages.train_draft import Config

    assert Config.model_validate({"max_minutes": 36}).max_minutes == 36
    assert Config.model_validate({}).max_minutes is None
    with pytest.raises(ValidationError, match="max_minutes"):
        Config.model_validate({"max_minutes": 0})


SMALL = ["train_draft.batch_size=2", "train_draft.seq_len=64", "train_draft.warmup_steps=2", "train_draft.log_every=2",
         "train_draft.eval.prompts_per_domain=0", "train_draft.algorithm.draft_vocab_size=256",
         "train_draft.steps=40", "train_draft.checkpoint_every=100", "train_draft.max_minutes=0.00001"]


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["none", "{kind: torchrun, nproc_per_node: 2, timeout_s: 600}"])
def test_a_build_under_a_budget_commits_the_steps_it_did(run_dir, tmp_path, launcher):
    """A 0.6-ms budget: the first step takes longer on any CPU (one of 0.06 s did not on an idle one), so training
    stops there (the hard stop, before any count is resolved); the draft of step 1 is exported, passes its checks,
    and the steps done, the configured count and why are in the metrics, draft.json, curve.json, the log and the
    report. Under torchrun both ranks stop at step 1 (one that went on would hang its peer's all-reduce)."""
    wd = tmp_path / "run"
    (wd / "artifacts").mkdir(parents=True)
    for stage in ("target", "data"):
        shutil.copytree(run_dir / "artifacts" / stage, wd / "artifacts" / stage)
    o = [x for it in [*SMALL, f"train_draft.launcher={launcher}"] for x in ("-o", it)]
    r = run_cli("build", str(TINY_CONFIG), "--workdir", str(wd), "--only", "train_draft", *tiny_overrides("target", "data"), *o)
    assert r.returncode == 0, r.stderr[-4000:]
    art = wd / "artifacts" / "train_draft"
    m = {s["name"]: s for s in status_json(wd)["stages"]}["train_draft"]["metrics"]
    assert m["steps"] == 1 and m["configured_steps"] == 40 and m["budget_stop"] == "time"
    assert m["max_minutes"] == 0.00001 and m["export_checks_passed"] > 0
    assert all(c["passed"] for c in json.loads((art / "checks.json").read_text()))
    draft, curve = json.loads((art / "draft.json").read_text()), json.loads((art / "curve.json").read_text())
    assert draft["exported_step"] == 1 and draft["budget"]["configured_steps"] == 40
    assert curve["steps"] == 1 and max(p["step"] for p in curve["points"]) == 1
    log = (wd / "logs" / "train_draft.log").read_text()
    assert "the 1e-05-minute budget, by step 1" in log and "fewer where they take over max_minutes 1e-05" in log
    assert run_cli("report", "--workdir", str(wd)).returncode == 0
    assert "1 of 40 (stopped at the 1e-05-minute budget)" in (wd / "report.html").read_text()
