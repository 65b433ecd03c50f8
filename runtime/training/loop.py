"""The training loop: the converted model with its optimizer (AdamW/SGD) and warmup + cosine/linear schedule, restored
from the checkpoint when there is one, DDP over several processes without FSDP; then each step (the batch a function
of (seed, step, rank) only, forward under autocast when the target runs below the training dtype, gradients
all-reduced under FSDP, clipping), the curve, the held-out eval points (`runtime.training.evals`: a checkpoint at each,
an early stop when patience runs out) and the periodic checkpoints."""
from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from runtime.algorithms.registry import get as get_algorithm
from runtime.training.budget import Budget
from runtime.training.checkpoint import load_checkpoint, save_checkpoint
from runtime.training.dist import Process, barrier, dist_group
from runtime.training.evals import Evals, eval_point
from runtime.training.fsdp import allreduce_grads, fsdp_active
from runtime.training.job import target_dtype, torch_dtype
from runtime.training.model import build_model
from runtime.training.samples import Data, batch_indices, read_prompts


def lr_factor(step: int, job: dict) -> float:
    t = job["train"]
    if step < t["warmup_steps"]:
        return (step + 1) / t["warmup_steps"]
    prog = min(1.0, (step - t["warmup_steps"]) / max(1, t["steps"] - t["warmup_steps"]))
    lo = t["min_lr_ratio"]
    if t["schedule"] == "cosine":
        return lo + (1 - lo) * 0.5 * (1 + math.cos(math.pi * prog))
    if t["schedule"] == "linear":
        return lo + (1 - lo) * (1 - prog)
    return 1.0


def autocast(job: dict, device):
    import contextlib

    import torch

    low = target_dtype(job)
    if low == torch_dtype(job["train_dtype"]):
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=low)


@dataclasses.dataclass
class Run:
    """The model in training and everything a step and a checkpoint need; the curve so far (resumed or empty)."""

    model: Any
    ddp: Any   # the model, or its DistributedDataParallel wrapper
    params: list
    opt: Any
    sched: Any
    fsdp: bool
    step0: int
    curve: list
    step_times: list
    evals: Evals
    budget: Budget | None = None   # train_draft.max_minutes (runtime.training.budget)


def _optimizer(params: list, t: dict):
    import torch

    if t["optimizer"] == "adamw":
        return torch.optim.AdamW(params, lr=t["lr"], weight_decay=t["weight_decay"], betas=tuple(t["betas"]))
    return torch.optim.SGD(params, lr=t["lr"], momentum=0.9, weight_decay=t["weight_decay"])


def setup_training(job: dict, offline: bool, scratch: Path, proc: Process) -> Run:
    """The converted model, its optimizer and schedule, restored from the checkpoint when there is one (a
    `resume` event), and the DDP wrapper over several processes without FSDP."""
    import torch

    model = build_model(job, offline, proc.device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = _optimizer(params, job["train"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, job))
    state = load_checkpoint(scratch, model, opt, sched, proc.device)
    step0 = int(state["step"]) if state else 0
    curve: list = list(state["curve"]) if state else []
    step_times: list = list(state.get("step_times", [])) if state else []
    if state:
        proc.emit0({"event": "resume", "step": step0})
    fsdp = fsdp_active(job)
    ddp = model
    if proc.world > 1 and not fsdp:
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model, device_ids=[proc.local_rank] if job["device"] == "cuda" else None,
                                      find_unused_parameters=get_algorithm(job["algorithm"]["name"]).drafts_block)
    evals = Evals.from_job(job, state.get("evals") if state else None)
    budget = Budget.from_job(job, state.get("budget") if state else None)
    return Run(model, ddp, params, opt, sched, fsdp, step0, curve, step_times, evals, budget)


def train_steps(job: dict, run: Run, data: Data, scratch: Path, proc: Process,
                 should_stop: Callable[[int], bool] | None) -> int | None:
    """The steps from `run.step0` on, with the curve, progress, eval points and periodic checkpoints (one at each eval
    point too). Returns the step after which `should_stop` ended training early (an interruption, not an early
    stop: `run.evals.early_stop` says that), None when training ended. Under a budget (`run.budget`) the job's step
    count may be lowered as training goes (runtime.training.budget)."""
    import torch

    t = job["train"]
    rank, world = proc.rank, proc.world
    per_rank = t["batch_size"] // world
    prompts = read_prompts(job["eval_files"], job["eval"]["prompts_per_domain"]) if run.evals.every else {}
    run.model.train()
    proc.emit0({"event": "train_start", "total": t["steps"], "done": run.step0, "world_size": world})
    for step in range(run.step0, t["steps"]):
        if run.evals.early_stop:   # decided before the checkpoint this run resumed from
            return None
        t_step = time.monotonic()
        torch.manual_seed(t["seed"] * 7919 + step * world + rank)   # DFlash anchors: a function of (seed, step, rank)
        idx = batch_indices(step, len(data.samples), t["batch_size"], t["seed"])[rank * per_rank:(rank + 1) * per_rank]
        stats = _optimizer_step(job, run, data.batch(idx, t["seq_len"], proc.device), proc)
        _record_step(job, run, step, stats, time.monotonic() - t_step, proc)
        at_eval = bool(prompts) and run.evals.due(step + 1, t["steps"])
        new_best = at_eval and eval_point(job, run, data.tok, prompts, step + 1, proc)
        if step + 1 != t["steps"] and (at_eval or (step + 1) % t["checkpoint_every"] == 0):
            if rank == 0:
                save_checkpoint(scratch, run.model, run.opt, run.sched, step + 1, run.curve,
                                {"step_times": run.step_times, "evals": run.evals.state(),
                                 **(run.budget.state() if run.budget else {})}, new_best=new_best)
                proc.emit0({"event": "checkpoint", "step": step + 1})
            barrier()
            if should_stop and should_stop(step + 1):
                return step + 1
        if step + 1 >= t["steps"]:   # the last step, or a budget's count reached (runtime.training.budget)
            break
    return None


def _optimizer_step(job: dict, run: Run, batch: dict, proc: Process):
    """Forward, backward (gradients all-reduced under FSDP), clip, optimizer and schedule step. Returns
    [loss, accuracy per position] averaged over the processes (float64)."""
    import torch

    t = job["train"]
    with autocast(job, proc.device):
        out = run.ddp(**batch)
    run.opt.zero_grad(set_to_none=True)
    out.loss.backward()
    if run.fsdp:
        allreduce_grads(run.params, proc.world)
    if t["grad_clip"]:
        torch.nn.utils.clip_grad_norm_(run.params, t["grad_clip"])
    run.opt.step()
    run.sched.step()
    acc = [float(a) for a in (out.train_acc[0] if out.train_acc else [])]
    stats = torch.tensor([float(out.loss.detach())] + acc, dtype=torch.float64)
    if d := dist_group():
        d.all_reduce(stats)
        stats /= proc.world
    return stats


def _record_step(job: dict, run: Run, step: int, stats, dt: float, proc: Process) -> None:
    """The step's time, the budget's decision (which may make this step the last), a curve point (every log_every
    steps, the first and the last), the `step` event."""
    t = job["train"]
    run.step_times.append(round(dt, 4))
    if run.budget:
        run.budget.after_step(job, step + 1, run.step_times, proc)
    loss_v, acc_v = float(stats[0]), [round(float(a), 4) for a in stats[1:]]
    if (step + 1) % t["log_every"] == 0 or step + 1 == t["steps"] or step == run.step0:
        run.curve.append({"step": step + 1, "loss": round(loss_v, 4), "accuracy": acc_v,
                          "lr": round(run.sched.get_last_lr()[0], 8), "step_s": round(dt, 4)})
    proc.emit0({"event": "step", "step": step + 1, "loss": round(loss_v, 4), "accuracy": acc_v, "step_s": round(dt, 4)})

