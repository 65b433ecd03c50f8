"""A training budget in minutes (`train_draft.max_minutes`): the step count resolved from this machine's measured step
time, and a hard stop at the budget.

What counts is the time of the training steps (`run.step_times`, summed over every run of the job: a resumed job
brings the earlier runs' times in its checkpoint); held-out eval points, the export and the final estimate come on
top. Two rules, in this order:

1. After `RESOLVE_AFTER` steps of this run, the median of their times after the first (a warm-up) gives the rate, and
   the job's step count becomes min(configured steps, the steps done + what fits in the budget left at that rate).
   This happens inside the warm-up of the shipped configs (30 steps), so the learning-rate schedule, which reads the
   job's step count, decays to its end at the resolved count as it would at a configured one. The resolved count is
   saved in every checkpoint: a resumed job (on this machine or another) keeps it and does not resolve again.
2. Should the steps slow down after that (a busy machine), training stops after the step whose time brings the sum
   to the budget; that step is the exported one (its learning rate not fully decayed).

The job's `train.steps` is changed in place, so everything after (the schedule, eval points, the export, result.json)
sees the steps actually done. Under torchrun rank 0 decides and the count is broadcast after every step, so every
rank stops at the same step. The fingerprint holds `max_minutes` (the configuration), not the resolved count, which
only the run knows: a committed draft trained under a budget stays up to date on a faster machine; the steps done are
in the stage's metrics (`steps`, `configured_steps`, `budget_stop`), draft.json and the report.
"""
from __future__ import annotations

import dataclasses

RESOLVE_AFTER = 6   # steps of this run timed before the count is resolved (the first is a warm-up)


@dataclasses.dataclass
class Budget:
    """The budget's state in one run of the job; `state()` goes into the checkpoint."""

    max_s: float
    configured_steps: int
    resolved_steps: int | None = None   # set once, by rule 1 (or carried from the checkpoint)
    rate_s: float | None = None         # the measured step time it was resolved with
    stopped: str | None = None          # "time" when rule 2 ended training
    this_run: int = 0                   # steps timed in this run

    @classmethod
    def from_job(cls, job: dict, saved: dict | None) -> Budget | None:
        t = job["train"]
        if not t.get("max_minutes"):
            return None
        b = cls(max_s=60.0 * t["max_minutes"], configured_steps=int(t.get("configured_steps") or t["steps"]))
        t["configured_steps"] = b.configured_steps
        if saved:
            b.resolved_steps, b.rate_s, b.stopped = saved.get("resolved_steps"), saved.get("rate_s"), saved.get("stopped")
            if b.resolved_steps:
                _set_steps(job, b.resolved_steps)
        t["budget"] = b.record(job)
        return b

    def state(self) -> dict:
        return {"budget": {"resolved_steps": self.resolved_steps, "rate_s": self.rate_s, "stopped": self.stopped}}

    def after_step(self, job: dict, done: int, step_times: list, proc) -> None:
        """After step `done` (1-based) on every rank: rank 0 applies the two rules to `step_times` (every step of the
        job so far), the count is shared with the other ranks; `job["train"]["steps"]` is the count to train to."""
        self.this_run += 1
        steps = job["train"]["steps"]
        if proc.rank == 0:
            steps = self._decide(job, done, step_times, proc)
        if proc.world > 1:
            from runtime.training.dist import dist_group

            if d := dist_group():
                import torch

                t = torch.tensor([float(steps)], dtype=torch.float64)
                d.broadcast(t, src=0)
                steps = int(t.item())
        if steps != job["train"]["steps"]:
            _set_steps(job, steps)
        job["train"]["budget"] = self.record(job)

    def _decide(self, job: dict, done: int, step_times: list, proc) -> int:
        steps = job["train"]["steps"]
        spent = float(sum(step_times))
        if self.resolved_steps is None and self.this_run >= RESOLVE_AFTER:
            timed = sorted(step_times[len(step_times) - self.this_run + 1:])
            self.rate_s = round(timed[len(timed) // 2], 4)
            fit = done + int(max(0.0, self.max_s - spent) // self.rate_s) if self.rate_s > 0 else self.configured_steps
            self.resolved_steps = steps = max(done, min(self.configured_steps, fit))
            proc.emit0({"event": "budget", "steps": steps, "configured_steps": self.configured_steps,
                        "rate_s": self.rate_s, "max_minutes": round(self.max_s / 60, 6), "spent_s": round(spent, 1)})
        if spent >= self.max_s and done < steps:
            self.stopped, steps = "time", done
            proc.emit0({"event": "budget_stop", "step": done, "spent_s": round(spent, 1),
                        "max_minutes": round(self.max_s / 60, 6), "resolved_steps": self.resolved_steps})
        return steps

    def record(self, job: dict) -> dict:
        """result.json's `budget`: the configured budget and count, the resolved count, the steps done and why."""
        return {"max_minutes": round(self.max_s / 60, 6), "configured_steps": self.configured_steps,
                "resolved_steps": self.resolved_steps, "rate_s": self.rate_s, "steps": job["train"]["steps"],
                "stopped": self.stopped or ("budget" if job["train"]["steps"] < self.configured_steps else None)}


def _set_steps(job: dict, steps: int) -> None:
    t = job["train"]
    t["steps"] = int(steps)
    t["warmup_steps"] = min(t["warmup_steps"], t["steps"])


def budget_metrics(result: dict) -> dict:
    """The stage's metrics on the budget (empty without one): the configured count, the budget, what ended training
    (`budget_stop`: "budget" when the resolved count was below the configured one, "time" at the hard stop)."""
    b = result.get("budget")
    if not b:
        return {}
    return {"configured_steps": b["configured_steps"], "max_minutes": b["max_minutes"], "budget_stop": b["stopped"],
            "budget_step_s": b["rate_s"]}


def steps_row(m: dict) -> str:
    """The report's "steps" row: the steps done, and under a budget of how many configured and why."""
    if not m.get("max_minutes"):
        return str(m.get("steps"))
    why = {"budget": f"the {m['max_minutes']:g}-minute budget at {m.get('budget_step_s')} s a step",
           "time": f"stopped at the {m['max_minutes']:g}-minute budget"}.get(m.get("budget_stop") or "",
                                                                            f"within the {m['max_minutes']:g}-minute budget")
    return f"{m.get('steps')} of {m.get('configured_steps')} ({why})"
