"""The training job: the JSON-able dict the `train_draft` stage writes and the worker (`draft_training`, in-process or
under torchrun) executes. `make_job` assembles it from the stage's section and the target's and data's records;
the readings of it that the worker's modules share (dtypes, capture layers) and `JobError` live here too. The job
is all the worker reads: it never sees the pipeline config."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from runtime.algorithms.registry import get as get_algorithm
from runtime.training.eval_config import job_options

if TYPE_CHECKING:
    from runtime.records import TargetInfo


class JobError(Exception):
    """An expected failure with a message for the user (the stage turns it into a StageError)."""


def torch_dtype(name: str):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def target_dtype(job: dict):
    """The frozen target's weight and compute dtype (`target_dtype`, default the training dtype). Lower than the
    training dtype, the forward runs under autocast: the target in it, the draft's matmuls too, its master weights,
    optimizer state and loss in the training dtype."""
    return torch_dtype(job.get("target_dtype") or job["train_dtype"])


def capture_layer_ids(job: dict) -> list[int]:
    """Target layers whose outputs the draft reads: EAGLE-3 aux layers or DFlash target layers."""
    a = job["algorithm"]
    return list(a[get_algorithm(a["name"]).capture_field])


# ------------------------------------------------------------------------------------------- assembly


# the target's shape as the job carries it (target.json's fields)
TARGET_SHAPE = ("num_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "vocab_size")


@dataclass(frozen=True)
class JobDirs:
    """The directories a training job reads and writes: the target checkpoint, the data artifact, the stage's
    scratch directory (checkpoints, d2t) and its output directory (the exported draft goes to `draft/`)."""

    model_dir: Path
    data_dir: Path
    scratch_dir: Path
    out_dir: Path


def make_job(sec, *, algo: dict, target: TargetInfo, dirs: JobDirs, train_samples: int | None, device: str,
             threads: int | None, trust_remote_code: bool) -> dict:
    """The JSON job the runtime executes (in-process or under torchrun), from the stage's section `sec`, the
    resolved algorithm options (`runtime.training.algorithm.resolve_algorithm`), target.json (`target`) and the
    directories (`dirs`). JobError for a target dtype above the training precision."""
    model_dir, data_dir, scratch_dir, out_dir = dirs.model_dir, dirs.data_dir, dirs.scratch_dir, dirs.out_dir
    train_dtype, tgt_dtype = resolve_dtypes(sec, device)
    positions = target.max_position_embeddings or 2048
    serving = sec.serving_context or positions
    eval_files = {p.stem: str(p) for p in sorted((data_dir / "eval").glob("*.jsonl"))}
    steps = step_count(sec, data_dir, train_samples)
    d2t = get_algorithm(algo["name"]).has_draft_vocab and algo["draft_vocab_size"] != target.vocab_size
    return {
        "algorithm": algo,
        "target": {k: getattr(target, k) for k in TARGET_SHAPE},
        "target_dir": str(model_dir),
        "train_parquet": str(data_dir / "train.parquet"),
        "heldout_parquet": str(data_dir / "heldout.parquet"),
        "eval_files": eval_files,
        "scratch_dir": str(scratch_dir),
        "export_dir": str(out_dir / "draft"),
        "d2t_path": str(scratch_dir / "d2t.pt") if d2t else None,
        "mode": sec.mode,
        "max_dump_gb": sec.offline.max_dump_gb,
        "max_samples": sec.max_samples,
        "device": device,
        "train_dtype": train_dtype,
        "target_dtype": tgt_dtype,
        "export_dtype": target.dtype,
        "threads": threads,
        "trust_remote_code": trust_remote_code,
        "torch_compile": sec.torch_compile,
        "shard_target": sec.shard_target and device == "cuda",
        "fsdp": sec.launcher.kind == "torchrun" and sec.launcher.fsdp,
        "export_rope_scaling": rope_scaling(sec, positions, serving),
        "serving_context": serving,
        "train": train_options(sec, steps),
        "eval": eval_options(sec, algo, target),
    }


def resolve_dtypes(sec, device: str, precision=None) -> tuple[str, str]:
    """(training dtype, target dtype) with auto resolved; JobError for a target above the training precision.
    dtype auto: bfloat16 on CUDA, float32 on CPU (the draft's master weights). target_dtype auto: the training dtype,
    except under float32 training on a CPU, where it is bfloat16 only where this CPU runs bf16 GEMMs natively and
    measurably faster (`runtime.engine.precision`; `precision`: a `CpuPrecision` already at hand), and only in the
    path that runs a bf16 target under a float32 draft (`_bf16_target_path`)."""
    from runtime.engine.precision import cpu_precision, resolve_precision

    train_dtype = sec.dtype if sec.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
    if sec.target_dtype != "auto":
        tgt_dtype = sec.target_dtype
    elif train_dtype == "float32" and device == "cpu" and _bf16_target_path(sec):
        tgt_dtype = resolve_precision("auto", "cpu", precision or cpu_precision())
    else:
        tgt_dtype = train_dtype
    if (train_dtype, tgt_dtype) == ("bfloat16", "float32"):
        raise JobError(f"train_draft.target_dtype: float32 under a bfloat16 training dtype ({sec.dtype} on {device}) "
                       "would run the target above the draft's own precision; set target_dtype: bfloat16 or auto, "
                       "or dtype: float32")
    return train_dtype, tgt_dtype


def _bf16_target_path(sec) -> bool:
    """Online training in one process with the runtime estimator: the path where a bf16 target under a float32 draft
    runs (the offline dump, torchrun's DDP/FSDP workers and ModelOpt's estimator meet float32 draft weights with the
    bf16 target's features in one matmul: "expected m1 and m2 to have the same dtype"), so auto stays float32 elsewhere."""
    return sec.mode == "online" and sec.launcher.kind == "none" and sec.eval.estimator == "runtime"


def needs_machine(sec) -> bool:
    """Whether the section's dtypes depend on the machine (an auto among them)."""
    return "auto" in (sec.dtype, sec.target_dtype)


def rope_scaling(sec, target_positions: int, serving: int) -> dict:
    """The exported RoPE scaling: the configured dict, none, or (auto) YaRN by the power of 2 that reaches
    serving_context when it exceeds the target's positions."""
    if isinstance(sec.rope_scaling, dict):
        return dict(sec.rope_scaling)
    if sec.rope_scaling == "none" or serving <= target_positions:
        return {}
    factor = 2.0
    while factor * target_positions < serving:
        factor *= 2
    return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": target_positions}


def step_count(sec, data_dir: Path, train_samples: int | None) -> int:
    """`steps`, or `epochs` passes over the (first max_samples) training rows in global batches."""
    if sec.epochs is None:
        return sec.steps
    n_train = train_samples
    if not n_train:
        import pyarrow.parquet as pq

        n_train = pq.ParquetFile(str(data_dir / "train.parquet")).metadata.num_rows
    n = min(n_train, sec.max_samples or n_train)
    return max(1, int(sec.epochs * n / sec.batch_size + 0.999))


def train_options(sec, steps: int) -> dict:
    return {
        "optimizer": sec.optimizer,
        "lr": sec.lr,
        "weight_decay": sec.weight_decay,
        "betas": list(sec.betas),
        "schedule": sec.schedule,
        "warmup_steps": min(sec.warmup_steps, steps),
        "min_lr_ratio": sec.min_lr_ratio,
        "grad_clip": sec.grad_clip,
        "steps": steps,
        "max_minutes": sec.max_minutes,   # a budget for the steps (runtime.training.budget)
        "batch_size": sec.batch_size,
        "seq_len": sec.seq_len,
        "seed": sec.seed,
        "checkpoint_every": sec.checkpoint_every,
        "log_every": sec.log_every,
    }


def eval_options(sec, algo: dict, target: TargetInfo) -> dict:
    return {
        **job_options(sec),
        "estimator": sec.eval.estimator,
        "prompts_per_domain": sec.eval.prompts_per_domain,
        "osl": sec.eval.osl,
        "draft_len": sec.eval.draft_len or algo["trained_draft_len"],
        "batch_size": sec.eval.batch_size,
        # every id that ends a generation (an instruct model's end-of-turn and its eos)
        "eos_token_ids": list(target.stop_ids),
    }
