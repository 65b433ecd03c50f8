"""Held-out acceptance during training (`train_draft.eval.every`, `patience`, `min_delta`): at every eval point rank 0
measures the draft's acceptance length (AL) on the held-out eval prompts with the configured estimator (the one the
end of training uses, `runtime.training.acceptance`), the best point's draft weights are kept beside the checkpoint
(`<scratch>/ckpt/best.safetensors`), training stops early once `patience` eval points in a row did not raise the mean
AL over the domains by more than `min_delta`, and the best point (not the last) is exported.

Where eval points run: launcher none or torchrun without FSDP (rank 0 measures, the other ranks wait at a broadcast
of the stop decision); the `modelopt` estimator only in one process and online mode (it is collective under a
process group, and offline it rebuilds the online model). Elsewhere (launcher.fsdp, modelopt under torchrun or
offline) the estimate runs once, at the end: the default `every` resolves to 0 there and an explicit one is a
config error (`every_problems`). The config side (where eval points run, the job's `eval` options) is
`runtime.training.eval_config`; this module is the worker side."""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path


def domain_mean(acc: dict) -> float:
    """The mean over the domains of their AL (each domain counts once)."""
    als = [v["acceptance_length"] for v in acc["domains"].values()]
    return round(sum(als) / max(1, len(als)), 6)


@dataclasses.dataclass
class Evals:
    """The eval points so far, the best one (with its estimate) and the early-stop state; saved in the checkpoint."""

    every: int = 0
    patience: int = 0
    min_delta: float = 0.0
    points: list = dataclasses.field(default_factory=list)
    best: dict | None = None          # {"step", "mean", "acceptance": the estimator's record}
    bad: int = 0                      # eval points in a row without improvement
    early_stop: dict | None = None    # {"step", "reason"}
    train_cpu_s: float = 0.0          # CPU seconds this process spent outside eval points so far (resumes add on)
    cpu_mark: float = dataclasses.field(default_factory=time.process_time)   # not saved: this process's clock

    @classmethod
    def from_job(cls, job: dict, saved: dict | None) -> Evals:
        ev = job["eval"]
        e = cls(ev.get("every", 0), ev.get("patience", 0), ev.get("min_delta", 0.0))
        for k in ("points", "best", "bad", "early_stop", "train_cpu_s"):
            if saved and k in saved:
                setattr(e, k, saved[k])
        return e

    def state(self) -> dict:
        return {"points": self.points, "best": self.best, "bad": self.bad, "early_stop": self.early_stop,
                "train_cpu_s": self.train_cpu_s}

    def train_cpu(self) -> float:
        """train_cpu_s with this process's CPU since the last mark added (call it before an eval point measures)."""
        now = time.process_time()        # every thread of this process (torch's included)
        self.train_cpu_s, self.cpu_mark = self.train_cpu_s + now - self.cpu_mark, now
        return self.train_cpu_s

    def eval_done(self) -> float:
        """After an eval point's measurement: its CPU seconds (not counted as training)."""
        now = time.process_time()
        spent, self.cpu_mark = now - self.cpu_mark, now
        return spent

    def due(self, step: int, last: int) -> bool:
        return bool(self.every) and step % self.every == 0 and step != last

    def record(self, step: int, acc: dict, seconds: float, cpu: tuple[float, float] = (0.0, 0.0)) -> bool:
        """Adds the point (`cpu`: this process's CPU seconds of training up to it, and of its measurement); returns
        True when it is the new best (its mean AL above the best's by more than min_delta), and decides the early stop
        when patience is exhausted."""
        mean = domain_mean(acc)
        self.points.append({"step": step, "al": {d: v["acceptance_length"] for d, v in acc["domains"].items()},
                            "mean": mean, "acceptance_length": acc["acceptance_length"], "seconds": round(seconds, 2),
                            "train_cpu_s": round(cpu[0], 3), "eval_cpu_s": round(cpu[1], 3)})
        if self.best is None or mean > self.best["mean"] + self.min_delta:
            self.best, self.bad = {"step": step, "mean": mean, "acceptance": acc}, 0
            return True
        self.bad += 1
        if self.patience and self.bad >= self.patience:
            self.early_stop = {"step": step, "reason": (
                f"early stop at step {step}: the mean held-out AL did not rise above {self.best['mean']:.4f} (step "
                f"{self.best['step']}) by more than eval.min_delta {self.min_delta} for {self.bad} eval points "
                f"(eval.patience {self.patience})")}
        return False

    def summary(self, exported_step: int, reason: str) -> dict:
        return {"points": self.points, "exported_step": exported_step, "export_reason": reason,
                "early_stop": self.early_stop, "every": self.every, "patience": self.patience, "min_delta": self.min_delta}


def export_for_eval(job: dict, model, out: Path) -> Path:
    """The draft as `export_draft` writes it, without casting the model in training: ModelOpt's export in the
    training dtype, then the file's floating tensors cast to the export dtype (what `model.to(dtype)` before the
    export gives, and DFlash's exporter does)."""
    from modelopt.torch.export import export_speculative_decoding
    from safetensors.torch import load_file, save_file

    from runtime.training.job import torch_dtype

    out.mkdir(parents=True, exist_ok=True)
    export_speculative_decoding(model, export_dir=str(out))
    dtype = torch_dtype(job["export_dtype"])
    f = out / "model.safetensors"
    sd = load_file(str(f))
    save_file({k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in sd.items()}, str(f),
              metadata={"format": "pt"})
    return out


def measure(job: dict, model, tok, prompts: dict, device) -> tuple[dict, float]:
    """The held-out estimate of the draft in training (rank 0): the runtime estimator on an export of it in the
    scratch directory, or ModelOpt's on the in-memory model. The model is back in train mode after."""
    from runtime.training.acceptance import acceptance, runtime_estimate

    ev = job["eval"]
    t0 = time.monotonic()
    if ev.get("estimator", "runtime") == "runtime":
        acc, _ = runtime_estimate(job, export_for_eval(job, model, Path(job["scratch_dir"]) / "eval_draft"), prompts, device)
    else:
        model.eval()
        acc = acceptance(model, tok, prompts, ev["osl"], ev["draft_len"])
    model.train()
    return acc, time.monotonic() - t0


def eval_point(job: dict, run, tok, prompts: dict, step: int, proc) -> bool:
    """One eval point: rank 0 measures and records; the stop decision and whether the point is the new best are
    broadcast to every rank. Returns whether it is the new best."""
    from runtime.training.dist import dist_group

    ev = run.evals
    flags = [False, False]
    if proc.rank == 0:
        cpu = ev.train_cpu()
        acc, secs = measure(job, run.model, tok, prompts, proc.device)
        flags = [ev.record(step, acc, secs, (cpu, ev.eval_done())), ev.early_stop is not None]
        p = ev.points[-1]
        proc.emit0({"event": "eval_point", "step": step, "mean": p["mean"], "al": p["al"], "seconds": p["seconds"],
                    "best_step": ev.best["step"], "best_mean": ev.best["mean"]})
        if ev.early_stop:
            proc.emit0({"event": "early_stop", **ev.early_stop})
    if d := dist_group():
        import torch

        t = torch.tensor([float(x) for x in flags])
        d.broadcast(t, src=0)
        flags = [bool(x) for x in t.tolist()]
        if proc.rank != 0 and flags[1]:
            ev.early_stop = {"step": step, "reason": "decided on rank 0"}
    return flags[0]


def conclude(job: dict, model, evals: Evals, prompts: dict, tok, device, final_acc: dict | None,
             emit) -> tuple[dict | None, float, dict]:
    """Rank 0 after the last step (or the early stop), with eval points during training: the last step measured
    unless training stopped early (`final_acc` when the caller measured it), then the best point's weights loaded
    into `model` when it is not the last. Returns (the exported draft's estimate, seconds, evals summary)."""
    from runtime.training.checkpoint import load_best

    t0 = time.monotonic()
    last = evals.early_stop["step"] if evals.early_stop else job["train"]["steps"]
    if not evals.points or evals.points[-1]["step"] != last:
        cpu = evals.train_cpu()
        acc, secs = (final_acc, 0.0) if final_acc else measure(job, model, tok, prompts, device)
        evals.record(last, acc, secs, (cpu, evals.eval_done()))
        emit({"event": "eval_point", "step": last, "mean": evals.points[-1]["mean"], "al": evals.points[-1]["al"],
              "seconds": evals.points[-1]["seconds"], "best_step": evals.best["step"], "best_mean": evals.best["mean"]})
    best = evals.best
    if best["step"] != last:
        load_best(Path(job["scratch_dir"]), model, device)
        reason = (f"best held-out AL: step {best['step']} (mean {best['mean']:.4f}) of {len(evals.points)} eval points; "
                  f"the last, step {last}, measured {evals.points[-1]['mean']:.4f}")
    else:
        reason = f"the last step, {last}, has the best held-out AL (mean {best['mean']:.4f}) of {len(evals.points)} eval points"
    emit({"event": "export_choice", "step": best["step"], "reason": reason})
    return best["acceptance"], time.monotonic() - t0, evals.summary(best["step"], reason)


def end_only_summary(job: dict, evals: Evals, acc: dict | None, seconds: float) -> dict:
    """No eval point during training: the one at the end (when measured) is the exported last step."""
    steps = job["train"]["steps"]
    if acc:
        evals.record(steps, acc, seconds, (evals.train_cpu(), 0.0))   # measured before: its CPU counted as training
        why = "eval only at the end (eval.every: 0 or no eval points before the last step)"
    else:
        why = "no held-out estimate (eval.prompts_per_domain: 0)"
    return evals.summary(steps, f"the last step, {steps}: {why}")
