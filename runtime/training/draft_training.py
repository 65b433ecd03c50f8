"""The training worker: train an EAGLE-3 or DFlash draft for a target with NVIDIA ModelOpt, then export it.

Runs in-process (`train(job)`) or as N processes under torchrun (`runtime.training.launch`):

    torchrun --nproc-per-node 8 -m runtime.training.draft_training --job job.json

With `fsdp` in the job (several processes), the target is never loaded whole: its decoder layers are sharded
over all processes with FSDP2 (`runtime.training.fsdp`) and the draft's gradients are all-reduced. A *job* is a
JSON-able dict written by the `train_draft` stage (`runtime.training.job`); the worker never reads the pipeline
config. What it does, in order:

1. offline mode only: dump the target's hidden states for every training sample into `<scratch>/hidden/`
   (`runtime.training.offline`: one file per sample, written atomically, so an interrupted dump resumes);
2. convert the target with `modelopt.torch.speculative.convert` (`runtime.training.model`, the base stays frozen)
   and train the draft (`runtime.training.loop`) with AdamW/SGD, a warmup + cosine/linear schedule and periodic
   checkpoints in `<scratch>/ckpt/` (`runtime.training.checkpoint`: draft weights as safetensors +
   optimizer/step state); a restarted job resumes from the checkpoint;
3. rank 0: `export_speculative_decoding` into `<export_dir>` (`runtime.training.export`), the acceptance estimate
   on held-out prompts (`runtime.training.acceptance`, `eval.estimator`: `runtime_acceptance`, specpipe's runtime on
   the BF16 target and the exported draft with the validate stage's definition; or ModelOpt's
   `HFARValidation.validate_online` before the export, collective under FSDP), and `result.json` with the curve
   and metrics (`runtime.training.records`).

Data order and randomness are functions of (seed, step, rank) only (`runtime.training.samples`), so a resumed run
sees the same batches as an uninterrupted one. Progress goes to a callback in-process, or as `@@specpipe {json}`
lines on the stdout of rank 0 under torchrun (`runtime.training.progress`; the stage parses them into its bars).
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

from runtime.training.acceptance import modelopt_estimate, runtime_estimate
from runtime.training.dist import dist_group, start_process
from runtime.training.evals import conclude, end_only_summary
from runtime.training.export import export_draft
from runtime.training.job import JobError
from runtime.training.loop import setup_training, train_steps
from runtime.training.offline import dump_offline
from runtime.training.progress import PROGRESS_PREFIX, emit_stdout
from runtime.training.records import result_record
from runtime.training.samples import calibrate_d2t_once, read_prompts, read_training_data


def train(job: dict, emit: Callable[[dict], None] | None = None, should_stop: Callable[[int], bool] | None = None) -> dict:
    """Run the whole job in this process (one rank of a torchrun group, or alone). Returns the result
    (also written to `<scratch>/result.json` by rank 0). `should_stop(step)` lets a caller end training
    early after a checkpoint, as an interruption would (used by tests of resuming)."""
    proc = start_process(job, emit)
    scratch = Path(job["scratch_dir"])
    scratch.mkdir(parents=True, exist_ok=True)
    data = read_training_data(job, proc.world)
    calibrate_d2t_once(job, data.samples, proc)
    offline = job["mode"] == "offline"
    if offline:
        dump_offline(job, data, scratch, proc)
    run = setup_training(job, offline, scratch, proc)
    stopped_at = train_steps(job, run, data, scratch, proc, should_stop)
    if stopped_at is not None:
        return {"stopped_at": stopped_at}

    # Evaluation and export run on rank 0 alone: leave the process group first, since ModelOpt's
    # validate_online broadcasts across ranks whenever one is initialized. Under FSDP no process holds the whole
    # target: all of them evaluate together (validate_online's broadcasts keep them in step), rank 0 exports.
    fsdp, rank = run.fsdp, proc.rank
    d = dist_group()
    if d is not None and not fsdp:
        d.barrier()
        d.destroy_process_group()
    if rank != 0 and not fsdp:
        return {}
    held = [run.model]   # _finish takes the only reference: the runtime estimate frees the training model first
    curve, step_times, step0, evals = run.curve, run.step_times, run.step0, run.evals
    del run   # the DDP wrapper, optimizer, schedule and parameter list with it
    result = _finish(job, held, offline, proc, data.tok, (curve, step_times, step0, evals), data.dump_info)
    held.clear()   # whatever _finish left of the model goes now, before the last barrier
    if d is not None and fsdp:
        d.barrier()
        d.destroy_process_group()
    return result if rank == 0 else {}


def _finish(job, held: list, offline, proc, tok, progress: tuple, dump_info) -> dict:
    """After training: export, the acceptance estimate on held-out prompts, result.json. Rank 0 alone, or under
    FSDP every rank (ModelOpt's estimate is collective there; only rank 0 exports and writes). `progress`: (curve,
    step times, first step of this run, the eval points' `Evals`).

    `eval.estimator: runtime` (default): rank 0 exports, frees the training model, and measures the exported draft
    with the BF16 target through specpipe's runtime (`runtime_acceptance`, the validate stage's definition).
    `modelopt`: ModelOpt's `validate_online` on the in-memory model before the export (offline training first
    rebuilds the online model around the trained draft, since the offline model has no decoder layers).
    With eval points during training (`runtime.training.evals`), the last step is measured before the export
    and the best point's weights are exported. `held` holds the only reference to the model (so that it can be
    freed here)."""
    curve, step_times, step0, evals = progress
    device, rank = proc.device, proc.rank
    ev = job["eval"]
    estimator = ev.get("estimator", "runtime")
    prompts = read_prompts(job["eval_files"], ev["prompts_per_domain"])
    acc, eval_s = None, 0.0
    if prompts and estimator == "modelopt" and not evals.early_stop:
        acc, eval_s = modelopt_estimate(job, held, offline, device, tok, prompts)
    elif prompts and (job.get("_fsdp") or job.get("shard_target")):
        raise JobError("train_draft.eval.estimator: runtime needs the whole target in one process; with launcher.fsdp "
                       "or shard_target use eval.estimator: modelopt")
    if rank != 0:
        return {}
    if prompts and evals.points:   # eval points during training: the last step measured, the best exported
        acc, eval_s, summary = conclude(job, held[0], evals, prompts, tok, device, acc, proc.emit0)
        export_dir = export_draft(job, held[0])
    else:
        export_dir = export_draft(job, held[0])
        if prompts and estimator == "runtime":
            held.clear()
            _free_memory(device)
            acc, eval_s = runtime_estimate(job, export_dir, prompts, device)
        summary = end_only_summary(job, evals, acc, eval_s)
    result = result_record(job, curve, step_times, step0, proc.world, acc, eval_s, dump_info)
    result["evals"] = summary
    (Path(job["scratch_dir"]) / "result.json").write_text(json.dumps(result, indent=2))
    return result


def _free_memory(device) -> None:
    import gc

    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Train and export a speculative-decoding draft (one torchrun rank).")
    p.add_argument("--job", required=True, help="job JSON written by the train_draft stage")
    args = p.parse_args(argv)
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1)   # `kill -USR1 <pid>` prints every thread's stack to stderr
    job = json.loads(Path(args.job).read_text())
    try:
        train(job, emit=emit_stdout)
    except JobError as e:
        print(PROGRESS_PREFIX + json.dumps({"event": "error", "message": str(e)}), flush=True)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
