"""Stage `train_draft`: an EAGLE-3 or DFlash draft for the target, trained and exported with NVIDIA ModelOpt.

- `algorithm`: `eagle3` or `dflash` (a discriminated union on `kind`, each with its own typed options; the
  shorthand `algorithm: dflash` takes that algorithm's defaults).
- `mode`: `online` keeps the target in memory beside the draft; `offline` first dumps the target's hidden
  states for the training set into the scratch directory (resumable, after a disk-space preflight), then
  trains from disk.
- `launcher`: `none` trains in this process; `torchrun` runs N processes per node (gloo on CPU, NCCL on
  GPUs), on one node or several (c10d rendezvous).
- Training checkpoints go to the stage's scratch directory (keyed by its fingerprint): a build that is
  interrupted resumes from the last checkpoint.
- Export: `draft/` exactly as ModelOpt's `export_speculative_decoding` writes it plus the target's tokenizer
  files, then named checks (`runtime.training.draft_checks`); any failing check fails the stage.

The loop itself lives in `runtime/training/draft_training.py` (it also runs under torchrun). Options and the GPU /
multi-node settings: docs/stages/train_draft.md. Artifact: see docs/architecture.md (train_draft).
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import Field, field_validator, model_validator

from pipeline.errors import StageError
from pipeline.stage import StageContext, StageSection, Strict

NAME = "train_draft"
CONSUMES = ("target", "data")
VERSION = "1"
PACKAGES = ("torch", "transformers", "nvidia-modelopt", "safetensors")
# Where training runs (rendezvous, this node's rank, the time limit) does not change the draft.
EXECUTION_ONLY = ("launcher.node_rank", "launcher.rdzv_endpoint", "launcher.rdzv_id", "launcher.timeout_s")


def _distinct_nonneg(v: list[int] | None) -> list[int] | None:
    if v is None:
        return v
    if not v:
        raise ValueError("must not be empty (omit it to take the default)")
    if min(v) < 0:
        raise ValueError(f"layer ids are 0-based and non-negative, found {min(v)}")
    if len(set(v)) != len(v):
        raise ValueError(f"{v} contains duplicates; each captured layer must appear once")
    return v


# EAGLE-3 drafts read exactly this many target layers. TensorRT-LLM sizes the draft's fc as hidden x (number of
# capture layers), 3 when eagle3_layers_to_capture is unset (tensorrt_llm/_torch/speculative/eagle3.py,
# Eagle3SpecMetadata / _get_eagle3_default_capture_layers); vLLM's llama_eagle3.py builds
# fc = Linear(3 x hidden, hidden) (vllm-project/vllm vllm/model_executor/models/llama_eagle3.py at 583507d1) and
# speculators' converter does the same: any other count does not load there.
EAGLE3_CAPTURE_LAYERS = 3


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """The EAGLE-3 capture layers when `aux_layer_ids` is not set (0-based, sorted).

    TensorRT-LLM's default tuple (1, L//2-1, L-4) when its three ids are distinct and inside the target;
    otherwise (L <= 6, where it collapses or leaves the stack) three distinct layers spread over the whole
    target: the first, the middle ((L-1)//2) and the last. ModelOpt 0.47's own default
    (`default_eagle_aux_layer_ids`: sorted({1, max(0, L//2-1), max(0, L-4)})) collapses to 2 layers on a 4-layer
    target, which gives fc [H, 2H]: a shape TensorRT-LLM and vLLM refuse, so it is never used."""
    if num_layers < EAGLE3_CAPTURE_LAYERS:
        raise ValueError(f"EAGLE-3 captures {EAGLE3_CAPTURE_LAYERS} distinct target layers; a {num_layers}-layer target "
                         "has too few")
    trt = (1, num_layers // 2 - 1, num_layers - 4)
    if len(set(trt)) == EAGLE3_CAPTURE_LAYERS and all(0 <= i < num_layers for i in trt):
        return sorted(trt)
    return [0, (num_layers - 1) // 2, num_layers - 1]


class Eagle3(Strict):
    """EAGLE-3: a small decoder that reads the target's hidden states from 3 of its layers (the aux layers)."""

    kind: Literal["eagle3"]
    draft_layers: int = Field(1, ge=1, le=8, description="decoder layers in the draft (1 is what TensorRT-LLM ships)")
    aux_layer_ids: list[int] | None = Field(None, description=(
        "the 3 target layers to capture, 0-based (stored sorted); default TensorRT-LLM's (1, L//2-1, L-4) when those "
        "are 3 distinct layers, else [0, (L-1)//2, L-1]"))
    ttt_steps: int = Field(3, ge=1, le=16, description="training-time-test steps: draft positions trained per sample")
    draft_vocab_size: int | None = Field(
        None, ge=2, description="reduced draft vocabulary (d2t map calibrated on the training data); default: full"
    )
    intermediate_size: int | None = Field(None, ge=1, description="draft MLP width; default: the target's")
    loss_decay_factor: float = Field(0.9, gt=0, le=1, description="weight of TTT step k is factor**k")

    @field_validator("aux_layer_ids")
    @classmethod
    def _ids(cls, v):
        v = _distinct_nonneg(v)
        if v is not None and len(v) != EAGLE3_CAPTURE_LAYERS:
            raise ValueError(f"{v} has {len(v)} layers; EAGLE-3 drafts capture exactly {EAGLE3_CAPTURE_LAYERS} (TensorRT-LLM, "
                             "vLLM and speculators build fc as 3 x hidden)")
        # sorted: ModelOpt's online hooks and TensorRT-LLM concatenate the captured layers in layer order
        return sorted(v) if v is not None else v


class DFlash(Strict):
    """DFlash: a block-diffusion draft that predicts `block_size - 1` tokens in one pass from masked slots."""

    kind: Literal["dflash"]
    draft_layers: int = Field(2, ge=1, description="draft layers; at most the target's layer count (one target layer feeds each)")
    target_layer_ids: list[int] | None = Field(
        None, description="one target layer per draft layer, 0-based; default: ModelOpt's uniform spread"
    )
    block_size: int = Field(8, ge=2, le=64, description="tokens per block: the anchor plus block_size-1 drafted tokens")
    mask_token: str | int | None = Field(
        None, description="token string or id for masked slots; default: the target tokenizer's mask token"
    )
    num_anchors: int = Field(32, ge=1, description="random block anchors per sequence and step")
    loss_objective: Literal["dpace", "decay"] = "dpace"
    loss_decay_factor: float = Field(4.0, ge=0, description="gamma of the 'decay' objective (4 for block 8)")
    intermediate_size: int | None = Field(None, ge=1, description="draft MLP width; default: the target's")

    @field_validator("target_layer_ids")
    @classmethod
    def _ids(cls, v):
        return _distinct_nonneg(v)

    @model_validator(mode="after")
    def _one_per_layer(self):
        if self.target_layer_ids is not None and len(self.target_layer_ids) != self.draft_layers:
            raise ValueError(f"target_layer_ids has {len(self.target_layer_ids)} entries but draft_layers is "
                             f"{self.draft_layers}; DFlash needs one target layer per draft layer")
        return self


Algorithm = Annotated[Union[Eagle3, DFlash], Field(discriminator="kind")]


class Launcher(Strict):
    """How training processes start. `torchrun`: nproc_per_node processes on each of nnodes nodes."""

    kind: Literal["none", "torchrun"] = "none"
    nproc_per_node: int = Field(1, ge=1, description="processes per node: the GPU count on GPU nodes")
    nnodes: int = Field(1, ge=1)
    node_rank: int = Field(
        0, ge=0, description="this node's rank; the stage runs on node 0, the others run the printed worker command"
    )
    rdzv_endpoint: str | None = Field(None, description="host:port of node 0 (required when nnodes > 1)")
    rdzv_id: str = "specpipe-train-draft"
    timeout_s: int = Field(24 * 3600, ge=10, description="the whole torchrun job is stopped after this long")
    fsdp: bool = Field(
        False,
        description="shard the frozen target's decoder layers over all processes (FSDP2, read from its safetensors, "
        "never loaded whole): each GPU holds 1/N of them, for a target larger than one GPU; the draft is replicated",
    )

    @model_validator(mode="after")
    def _multi_node(self):
        if self.kind == "torchrun" and self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError("nnodes > 1 needs rdzv_endpoint: host:port of node 0, reachable from every node")
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank {self.node_rank} must be < nnodes {self.nnodes}")
        return self


class Offline(Strict):
    max_dump_gb: float | None = Field(
        None, gt=0, description="refuse a hidden-state dump larger than this (the free-space check always runs)"
    )


class Eval(Strict):
    """The acceptance estimate at the end of training, on held-out prompts of each data.eval_domains entry."""

    estimator: Literal["runtime", "modelopt"] = Field("runtime", description=(
        "runtime: specpipe's speculative runtime on the BF16 target and the exported draft (KV cache, batched, the "
        "validate stage's definition); modelopt: ModelOpt's HFARValidation.validate_online (no KV cache, one prompt "
        "at a time; the only one that runs with launcher.fsdp or shard_target)"))
    prompts_per_domain: int = Field(8, ge=0, description="held-out prompts per data.eval_domains entry (0: skip)")
    osl: int = Field(64, ge=1, description="tokens generated per prompt")
    draft_len: int | None = Field(None, ge=1, description="draft tokens per step; default: the trained length")
    batch_size: int = Field(4, ge=1, description="runtime estimator: prompts decoded together (as validate.batch_size)")


class Config(StageSection):
    algorithm: Algorithm = Field(default_factory=lambda: Eagle3(kind="eagle3"))
    mode: Literal["online", "offline"] = "online"
    offline: Offline = Field(default_factory=Offline)
    launcher: Launcher = Field(default_factory=Launcher)
    optimizer: Literal["adamw", "sgd"] = "adamw"
    lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int = Field(30, ge=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    grad_clip: float | None = Field(1.0, gt=0)
    steps: int | None = Field(600, ge=1, description="optimizer steps (or set epochs)")
    epochs: float | None = Field(None, gt=0, description="passes over the training set; overrides steps")
    batch_size: int = Field(4, ge=1, description="global batch (split over all processes)")
    seq_len: int = Field(256, ge=8, description="tokens per sample (longer samples are truncated, shorter padded)")
    max_samples: int | None = Field(None, ge=1, description="use the first N training samples")
    seed: int = 0
    checkpoint_every: int = Field(100, ge=1)
    log_every: int = Field(10, ge=1, description="curve points every N steps")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="training dtype; auto: bfloat16 on GPU, float32 on CPU"
    )
    target_dtype: Literal["auto", "float32", "bfloat16"] = Field("auto", description=(
        "the frozen target's weights and forward; bfloat16 under a float32 dtype runs the forward (the target and the "
        "draft's matmuls) under bfloat16 autocast while the draft's master weights, optimizer state and loss stay "
        "float32 (about 2.6x faster steps on CPU for SmolLM2, docs/stages/train_draft.md); auto: the training dtype"))
    torch_compile: bool = False
    shard_target: bool = Field(
        False,
        description="launcher none on a multi-GPU node: spread the target over all visible GPUs (device_map=auto) "
        "for a target larger than one GPU",
    )
    serving_context: int | None = Field(
        None, ge=16, description="longest context the draft must serve; default: the target's max_position_embeddings"
    )
    rope_scaling: Literal["auto", "none"] | dict[str, Any] = Field(
        "auto", description="exported RoPE scaling: auto = YaRN only when serving_context exceeds the target's positions")
    eval: Eval = Field(default_factory=Eval)

    @field_validator("algorithm", mode="before")
    @classmethod
    def _shorthand(cls, v):
        return {"kind": v} if isinstance(v, str) else v

    @field_validator("launcher", mode="before")
    @classmethod
    def _launcher_shorthand(cls, v):
        return {"kind": v} if isinstance(v, str) else v


def check(cfg) -> list[tuple[str, str]]:
    """Impossible combinations, found before anything runs (target shape known only for target.bootstrap)."""
    sec: Config = cfg.train_draft
    a = sec.algorithm
    p = "train_draft"
    out: list[tuple[str, str]] = []
    if a.kind == "dflash":
        if sec.seq_len % a.block_size:
            out.append(
                (
                    f"{p}.seq_len",
                    f"{sec.seq_len} is not divisible by algorithm.block_size {a.block_size} (DFlash trains whole blocks)",
                )
            )
        from runtime.trtllm.draft_schedule import dflash_max_draft_len

        if sec.eval.draft_len and sec.eval.draft_len > dflash_max_draft_len(a.block_size):
            out.append(
                (
                    f"{p}.eval.draft_len",
                    f"{sec.eval.draft_len} exceeds block_size - 1 = {dflash_max_draft_len(a.block_size)}, "
                    "what one DFlash block drafts",
                )
            )
    elif sec.eval.draft_len and sec.eval.draft_len > 3 * a.ttt_steps:
        out.append(
            (
                f"{p}.eval.draft_len",
                f"{sec.eval.draft_len} is far beyond the {a.ttt_steps} trained positions (algorithm.ttt_steps)",
            )
        )
    procs = sec.launcher.nproc_per_node * sec.launcher.nnodes if sec.launcher.kind == "torchrun" else 1
    if sec.shard_target and sec.launcher.kind == "torchrun":
        out.append(
            (
                f"{p}.shard_target",
                "spreads one target copy over all GPUs of one process; it cannot combine with launcher torchrun",
            )
        )
    if sec.launcher.fsdp and (sec.launcher.kind != "torchrun" or procs < 2):
        out.append((f"{p}.launcher.fsdp", f"shards the target over several processes: it needs launcher.kind torchrun with "
                    f"nproc_per_node x nnodes >= 2 (now {sec.launcher.kind}, {procs} process{'es' if procs != 1 else ''})"))
    if sec.eval.estimator == "runtime" and sec.eval.prompts_per_domain:
        whole = ("launcher.fsdp" if sec.launcher.fsdp and sec.launcher.kind == "torchrun" else
                 "shard_target" if sec.shard_target else None)
        if whole:
            out.append((f"{p}.eval.estimator", f"runtime needs the whole target in one process, and {p}.{whole} spreads it; "
                        "use eval.estimator: modelopt (runs on the sharded target) or eval.prompts_per_domain: 0 "
                        "(validate measures the deployed pair)"))
    if (sec.dtype, sec.target_dtype) == ("bfloat16", "float32"):
        out.append((f"{p}.target_dtype", "float32 under dtype bfloat16 would run the target above the draft's own "
                    "precision; use target_dtype bfloat16 or auto (the training dtype)"))
    if sec.batch_size % procs:
        out.append(
            (
                f"{p}.batch_size",
                f"{sec.batch_size} is not divisible by the {procs} training processes (launcher.nproc_per_node x nnodes)",
            )
        )
    if cfg.target.bootstrap == "tiny":
        t = cfg.target.tiny
        out += _shape_problems(
            sec, t.num_layers, t.vocab_size, f"target.tiny.num_layers={t.num_layers}", f"target.tiny.vocab_size={t.vocab_size}"
        )
    return out


def _shape_problems(sec: Config, n_layers: int, vocab: int, layers_src: str, vocab_src: str) -> list[tuple[str, str]]:
    a = sec.algorithm
    p = "train_draft.algorithm"
    out = []
    if a.kind == "eagle3":
        bad = [i for i in (a.aux_layer_ids or []) if i >= n_layers]
        if n_layers < EAGLE3_CAPTURE_LAYERS:
            out.append((f"{p}.kind", f"EAGLE-3 captures {EAGLE3_CAPTURE_LAYERS} distinct target layers, but the target has "
                        f"{n_layers} ({layers_src}); TensorRT-LLM and vLLM load no other shape: use DFlash or a deeper target"))
        elif bad:
            out.append(
                (f"{p}.aux_layer_ids", f"{bad} out of range: the target has {n_layers} layers (0..{n_layers - 1}; {layers_src})")
            )
        if a.draft_vocab_size and a.draft_vocab_size > vocab:
            out.append((f"{p}.draft_vocab_size", f"{a.draft_vocab_size} exceeds the target vocabulary of {vocab} ({vocab_src})"))
    else:
        if a.draft_layers > n_layers:
            out.append(
                (
                    f"{p}.draft_layers",
                    f"{a.draft_layers} draft layers need as many target layers to read, but the target has "
                    f"{n_layers} ({layers_src})",
                )
            )
        bad = [i for i in (a.target_layer_ids or []) if i >= n_layers]
        if bad:
            out.append(
                (
                    f"{p}.target_layer_ids",
                    f"{bad} out of range: the target has {n_layers} layers (0..{n_layers - 1}; {layers_src})",
                )
            )
        if isinstance(a.mask_token, int) and not 0 <= a.mask_token < vocab:
            out.append((f"{p}.mask_token", f"id {a.mask_token} is not in the target vocabulary of {vocab} ({vocab_src})"))
    return out


# ---------------------------------------------------------------------------------------------- run


def _resolve(ctx: StageContext, summary: dict, tok) -> dict:
    """Algorithm options with the target's values filled in; raises StageError for impossible ones."""
    from runtime.trtllm.draft_schedule import dflash_max_draft_len

    sec: Config = ctx.section
    a = sec.algorithm
    n_layers, vocab = summary["num_layers"], summary["vocab_size"]
    probs = _shape_problems(sec, n_layers, vocab, f"target.json num_layers={n_layers}", f"target.json vocab_size={vocab}")
    if probs:
        raise StageError("; ".join(f"{k}: {m}" for k, m in probs))
    if a.kind == "eagle3":
        ids = a.aux_layer_ids or default_aux_layer_ids(n_layers)
        ctx.log.info("EAGLE-3 capture layers %s of %d (%s)", ids, n_layers, "configured" if a.aux_layer_ids else
                     "TensorRT-LLM's default" if ids == sorted((1, n_layers // 2 - 1, n_layers - 4)) else
                     "spread over the target: TensorRT-LLM's default (1, L//2-1, L-4) is not 3 distinct layers here")
        return {"name": "eagle3", "draft_layers": a.draft_layers, "aux_layer_ids": ids, "ttt_steps": a.ttt_steps,
                "draft_vocab_size": a.draft_vocab_size or vocab, "intermediate_size": a.intermediate_size,
                "loss_decay_factor": a.loss_decay_factor, "trained_draft_len": a.ttt_steps}
    from modelopt.torch.speculative.plugins.modeling_dflash import build_target_layer_ids

    ids = a.target_layer_ids or build_target_layer_ids(n_layers, a.draft_layers)
    if len(set(ids)) != len(ids):
        # ModelOpt's spread skips the first and last 3 layers and repeats layers on shallow targets
        # (4 layers, 2 draft layers -> [1, 1]); spread over the whole stack instead.
        spread = [round(i * (n_layers - 1) / (a.draft_layers - 1)) for i in range(a.draft_layers)]
        ctx.log.info("DFlash target layers: ModelOpt's default %s repeats a layer on a %d-layer target; using %s",
                     ids, n_layers, spread)
        ids = spread
    mask = a.mask_token
    if mask is None:
        if tok.mask_token_id is None:
            raise StageError("train_draft.algorithm.mask_token: the target tokenizer has no mask token; name one of its "
                             "tokens (an unused special token) as mask_token")
        mask_id = tok.mask_token_id
    elif isinstance(mask, str):
        mask_id = tok.get_vocab().get(mask)
        if mask_id is None:
            raise StageError(f"train_draft.algorithm.mask_token: '{mask}' is not a token of the target's vocabulary; "
                             f"the tokenizer's mask token is {tok.mask_token!r}")
    else:
        mask_id = mask
    return {"name": "dflash", "draft_layers": a.draft_layers, "target_layer_ids": ids, "block_size": a.block_size,
            "mask_token_id": mask_id, "num_anchors": a.num_anchors, "loss_objective": a.loss_objective,
            "loss_decay_factor": a.loss_decay_factor, "intermediate_size": a.intermediate_size,
            "trained_draft_len": dflash_max_draft_len(a.block_size)}


def _rope_scaling(sec: Config, target_positions: int, serving: int) -> dict:
    if isinstance(sec.rope_scaling, dict):
        return dict(sec.rope_scaling)
    if sec.rope_scaling == "none" or serving <= target_positions:
        return {}
    factor = 2.0
    while factor * target_positions < serving:
        factor *= 2
    return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": target_positions}


# the target's shape as the job carries it (target.json's fields)
_TARGET_SHAPE = ("num_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "vocab_size")


def make_job(ctx: StageContext) -> dict:
    """The JSON job the runtime executes (in-process or under torchrun)."""
    from transformers import AutoTokenizer

    sec: Config = ctx.section
    target, data = ctx.input("target"), ctx.input("data")
    summary = target.read_json("target.json")
    model_dir = target.path / "model"
    trust = bool(ctx.config.target.trust_remote_code)
    tok = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust)
    algo = _resolve(ctx, summary, tok)
    device = _device(ctx)
    train_dtype, target_dtype = _dtypes(sec, device)
    positions = summary.get("max_position_embeddings") or 2048
    serving = sec.serving_context or positions
    eval_files = {p.stem: str(p) for p in sorted((data.path / "eval").glob("*.jsonl"))}
    steps = _step_count(sec, data)
    d2t = algo["name"] == "eagle3" and algo["draft_vocab_size"] != summary["vocab_size"]
    return {
        "algorithm": algo,
        "target": {k: summary[k] for k in _TARGET_SHAPE},
        "target_dir": str(model_dir),
        "train_parquet": str(data.path / "train.parquet"),
        "eval_files": eval_files,
        "scratch_dir": str(ctx.scratch_dir),
        "export_dir": str(ctx.out_dir / "draft"),
        "d2t_path": str(ctx.scratch_dir / "d2t.pt") if d2t else None,
        "mode": sec.mode,
        "max_dump_gb": sec.offline.max_dump_gb,
        "max_samples": sec.max_samples,
        "device": device,
        "train_dtype": train_dtype,
        "target_dtype": target_dtype,
        "export_dtype": summary.get("dtype") or "bfloat16",
        "threads": ctx.config.run.threads,
        "trust_remote_code": trust,
        "torch_compile": sec.torch_compile,
        "shard_target": sec.shard_target and device == "cuda",
        "fsdp": sec.launcher.kind == "torchrun" and sec.launcher.fsdp,
        "export_rope_scaling": _rope_scaling(sec, positions, serving),
        "serving_context": serving,
        "train": _train_options(sec, steps),
        "eval": _eval_options(sec, algo, summary),
    }


def _device(ctx: StageContext) -> str:
    """run.device, with auto resolved: cuda when a GPU is visible, else cpu."""
    device = ctx.config.run.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    return device


def _dtypes(sec: Config, device: str) -> tuple[str, str]:
    """(training dtype, target dtype) with auto resolved; StageError for a target above the training precision."""
    train_dtype = sec.dtype if sec.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
    target_dtype = sec.target_dtype if sec.target_dtype != "auto" else train_dtype
    if (train_dtype, target_dtype) == ("bfloat16", "float32"):
        raise StageError(f"train_draft.target_dtype: float32 under a bfloat16 training dtype ({sec.dtype} on {device}) "
                         "would run the target above the draft's own precision; set target_dtype: bfloat16 or auto, "
                         "or dtype: float32")
    return train_dtype, target_dtype


def _step_count(sec: Config, data) -> int:
    """`steps`, or `epochs` passes over the (first max_samples) training rows in global batches."""
    if sec.epochs is None:
        return sec.steps
    n_train = data.metrics.get("train_samples")
    if not n_train:
        import pyarrow.parquet as pq

        n_train = pq.ParquetFile(str(data.path / "train.parquet")).metadata.num_rows
    n = min(n_train, sec.max_samples or n_train)
    return max(1, int(sec.epochs * n / sec.batch_size + 0.999))


def _train_options(sec: Config, steps: int) -> dict:
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
        "batch_size": sec.batch_size,
        "seq_len": sec.seq_len,
        "seed": sec.seed,
        "checkpoint_every": sec.checkpoint_every,
        "log_every": sec.log_every,
    }


def _eval_options(sec: Config, algo: dict, summary: dict) -> dict:
    return {
        "estimator": sec.eval.estimator,
        "prompts_per_domain": sec.eval.prompts_per_domain,
        "osl": sec.eval.osl,
        "draft_len": sec.eval.draft_len or algo["trained_draft_len"],
        "batch_size": sec.eval.batch_size,
        # every id that ends a generation (an instruct model's end-of-turn and its eos)
        "eos_token_ids": [e for e in (summary.get("eos_token_ids") or [summary.get("eos_token_id")]) if e is not None],
    }


class _Bars:
    """Turns runtime progress events into the stage's progress bars and log lines."""

    def __init__(self, ctx: StageContext):
        self.ctx = ctx
        self.bar = None

    def _open(self, total: int, done: int, desc: str) -> None:
        self.close()
        self.bar = self.ctx.progress(total=total, desc=desc).__enter__()
        if done:
            self.bar.update(done)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)
            self.bar = None

    def __call__(self, ev: dict) -> None:
        kind = ev.get("event")
        if kind == "dump_start":
            self.ctx.log.info("offline: dumping target hidden states, %d of %d samples already on disk", ev["done"], ev["total"])
            self._open(ev["total"], ev["done"], "dump hidden states")
        elif kind == "dump" and self.bar:
            self.bar.update(ev.get("n", 1))
        elif kind == "resume":
            self.ctx.log.info("resuming training from the checkpoint at step %d", ev["step"])
        elif kind == "train_start":
            self._open(ev["total"], ev["done"], f"train draft ({ev.get('world_size', 1)} proc)")
        elif kind == "step" and self.bar:
            acc = "/".join(f"{a:.2f}" for a in ev.get("accuracy", []))
            self.bar.update(1, loss=f"{ev['loss']:.3f}", acc=acc)
        elif kind == "checkpoint":
            self.ctx.log.debug("checkpoint at step %d", ev["step"])
        elif kind == "error":
            self.ctx.log.error("%s", ev["message"])


def _train_in_process(ctx: StageContext, job: dict, bars: _Bars) -> dict:
    from runtime.training import draft_training as dt

    try:
        return dt.train(job, emit=bars)
    except dt.JobError as e:
        raise StageError(f"train_draft: {e}") from None


def _torchrun_cmd(sec: Config, job_path: Path, node_rank: int) -> list[str]:
    L = sec.launcher
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(L.nproc_per_node)]
    if L.nnodes == 1:
        cmd += ["--standalone"]   # a free local port: no clash with other jobs on this host
    else:
        cmd += ["--nnodes", str(L.nnodes), "--node-rank", str(node_rank), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", L.rdzv_endpoint, "--rdzv-id", L.rdzv_id]
    return cmd + ["-m", "runtime.training.draft_training", "--job", str(job_path)]


def _train_torchrun(ctx: StageContext, job: dict, bars: _Bars) -> dict:
    sec: Config = ctx.section
    job_path = _write_job(ctx, job)
    cmd = _torchrun_cmd(sec, job_path, sec.launcher.node_rank)
    env = _worker_env(ctx)
    if sec.launcher.nnodes > 1:
        _write_worker_commands(ctx, sec, job_path, env)
    ctx.log.info("launching: %s", " ".join(cmd))
    err_log = ctx.scratch_dir / "torchrun.log"
    rc, errors, timed_out = _run_torchrun(ctx, cmd, env, err_log, bars)
    if timed_out:
        raise StageError(f"train_draft: torchrun ran past train_draft.launcher.timeout_s={sec.launcher.timeout_s} and was "
                         f"stopped (a node that never joined, or a hung collective); its log: {err_log}")
    if errors:
        raise StageError("train_draft: " + errors[0])
    if rc != 0:
        tail = err_log.read_text()[-3000:]
        raise StageError(f"train_draft: torchrun exited with status {rc}; last lines of {err_log}:\n{tail}")
    return json.loads((ctx.scratch_dir / "result.json").read_text())


def _write_job(ctx: StageContext, job: dict) -> Path:
    """`<scratch>/job.json` for the workers; a previous run's result.json is removed."""
    ctx.scratch_dir.mkdir(parents=True, exist_ok=True)
    job_path = ctx.scratch_dir / "job.json"
    job_path.write_text(json.dumps(job, indent=2))
    (ctx.scratch_dir / "result.json").unlink(missing_ok=True)
    return job_path


def _worker_env(ctx: StageContext) -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.setdefault("OMP_NUM_THREADS", str(ctx.config.run.threads or 1))
    # the repository root on the path, so `-m runtime.training.draft_training` resolves without an install
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parent.parent), env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep
    )
    return env


def _write_worker_commands(ctx: StageContext, sec: Config, job_path: Path, env: dict) -> None:
    """Multi-node: one self-contained shell line per other node (what the Slurm script runs there), written to
    `<scratch>/worker_commands.sh` and logged."""
    pre = ["env", f"PYTHONPATH={env['PYTHONPATH']}", "PYTHONUNBUFFERED=1", f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']}"]
    others = [shlex.join(pre + _torchrun_cmd(sec, job_path, r)) for r in range(1, sec.launcher.nnodes)]
    (ctx.scratch_dir / "worker_commands.sh").write_text("\n".join(others) + "\n")
    ctx.log.info("multi-node: run on node r (1..%d), with this workdir on a shared filesystem:\n  %s",
                 sec.launcher.nnodes - 1, "\n  ".join(others))


def _run_torchrun(ctx: StageContext, cmd: list[str], env: dict, err_log: Path, bars: _Bars) -> tuple[int, list[str], bool]:
    """torchrun with its stderr in `err_log`, stopped after launcher.timeout_s. Returns (exit status, the workers'
    error messages, whether the time limit stopped it)."""
    errors: list[str] = []
    timed_out = threading.Event()
    with open(err_log, "w") as err, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env) as proc:
        def _stop():   # a hung job (a lost node, a collective that never completes) still ends
            timed_out.set()
            proc.terminate()
            killer = threading.Timer(30, proc.kill)   # torchrun forwards SIGTERM to its workers; in case it hangs too
            killer.daemon = True
            killer.start()
        watchdog = threading.Timer(ctx.section.launcher.timeout_s, _stop)
        watchdog.daemon = True
        watchdog.start()
        try:
            _follow_output(ctx, proc.stdout, bars, errors)
            rc = proc.wait(timeout=60 if timed_out.is_set() else None)
        except BaseException:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise
        finally:
            watchdog.cancel()
    return rc, errors, timed_out.is_set()


def _follow_output(ctx: StageContext, lines, bars: _Bars, errors: list[str]) -> None:
    """Rank 0's stdout: progress events to the bars (error messages collected), other lines to the debug log."""
    from runtime.training.draft_training import PROGRESS_PREFIX

    for line in lines:
        if line.startswith(PROGRESS_PREFIX):
            ev = json.loads(line[len(PROGRESS_PREFIX):])
            if ev.get("event") == "error":
                errors.append(ev["message"])
            bars(ev)
        elif line.strip():
            ctx.log.debug("torchrun: %s", line.rstrip())


def run(ctx: StageContext) -> dict:
    job = make_job(ctx)
    _log_plan(ctx, job)
    result = _train(ctx, job)
    draft_dir = Path(job["export_dir"])
    cfg = _complete_export(draft_dir, Path(job["target_dir"]))
    checks = _check_export(ctx, job, draft_dir)
    acc = result.get("acceptance") or {}
    _write_draft_json(ctx, job, cfg, draft_dir, acc)
    _write_curve_json(ctx, job, result, acc)
    _log_outcome(ctx, result, acc)
    return _metrics(job, result, acc, len(checks))


def _log_plan(ctx: StageContext, job: dict) -> None:
    a = job["algorithm"]
    ctx.log.info(
        "%s draft, %d layer(s), %s mode, %d steps of batch %d x %d tokens on %s (%s), launcher %s%s",
        a["name"],
        a["draft_layers"],
        job["mode"],
        job["train"]["steps"],
        job["train"]["batch_size"],
        job["train"]["seq_len"],
        job["device"],
        job["train_dtype"]
        + (f", target {job['target_dtype']} under autocast" if job["target_dtype"] != job["train_dtype"] else ""),
        ctx.section.launcher.kind,
        " with the target's layers sharded (FSDP)" if job["fsdp"] else "",
    )


def _train(ctx: StageContext, job: dict) -> dict:
    """The job in this process or under torchrun, its progress in the stage's bars. Returns its result."""
    bars = _Bars(ctx)
    try:
        return _train_torchrun(ctx, job, bars) if ctx.section.launcher.kind == "torchrun" else _train_in_process(ctx, job, bars)
    finally:
        bars.close()


def _complete_export(draft_dir: Path, model_dir: Path) -> dict:
    """The target's tokenizer files (byte for byte) beside the export, its config.json's RoPE in the form TensorRT-LLM
    1.2 and 1.3 read. Returns that config."""
    from runtime.training.draft_checks import TOKENIZER_FILES
    from runtime.trtllm.hf_config import normalize_file

    for name in TOKENIZER_FILES:
        if (model_dir / name).exists():
            shutil.copy2(model_dir / name, draft_dir / name)
    normalize_file(draft_dir / "config.json")
    return json.loads((draft_dir / "config.json").read_text())


def _capture_layers(a: dict) -> list[int]:
    return a["aux_layer_ids"] if a["name"] == "eagle3" else a["target_layer_ids"]


def _check_export(ctx: StageContext, job: dict, draft_dir: Path) -> list:
    """The named export checks (`runtime.training.draft_checks`) into checks.json; StageError when any fails."""
    from runtime.training.draft_checks import Expect, as_dicts, check_draft, failures

    a = job["algorithm"]
    expect = Expect(algorithm=a["name"], num_layers=a["draft_layers"], hidden_size=job["target"]["hidden_size"],
                    vocab_size=job["target"]["vocab_size"], capture_layer_ids=_capture_layers(a),
                    serving_context=job["serving_context"], target_dir=Path(job["target_dir"]),
                    draft_vocab_size=a.get("draft_vocab_size"), block_size=a.get("block_size"),
                    mask_token_id=a.get("mask_token_id"))
    checks = check_draft(draft_dir, expect)
    (ctx.out_dir / "checks.json").write_text(json.dumps(as_dicts(checks), indent=2))
    bad = failures(checks)
    if bad:
        raise StageError(
            "train_draft: the exported draft failed its checks:\n" + "\n".join(f"  {c.name}: {c.message}" for c in bad)
        )
    return checks


def _write_draft_json(ctx: StageContext, job: dict, cfg: dict, draft_dir: Path, acc: dict) -> None:
    a = job["algorithm"]
    draft = {
        "algorithm": a["name"], "num_layers": a["draft_layers"],
        ("aux_layer_ids" if a["name"] == "eagle3" else "target_layer_ids"): _capture_layers(a),
        "vocab_size": job["target"]["vocab_size"], "draft_vocab_size": cfg.get("draft_vocab_size", job["target"]["vocab_size"]),
        "has_d2t": "d2t" in _tensor_names(draft_dir), "block_size": a.get("block_size"), "mask_token_id": a.get("mask_token_id"),
        "trained_draft_len": a["trained_draft_len"], "max_position_embeddings": cfg.get("max_position_embeddings"),
        "rope_scaling": cfg.get("rope_scaling"), "serving_context": job["serving_context"], "mode": job["mode"],
        "acceptance_length": acc.get("acceptance_length"), "eval_draft_len": acc.get("draft_len"),
        "acceptance_estimator": acc.get("estimator"),
    }
    (ctx.out_dir / "draft.json").write_text(json.dumps(draft, indent=2))


def _write_curve_json(ctx: StageContext, job: dict, result: dict, acc: dict) -> None:
    a = job["algorithm"]
    curve = {"algorithm": a["name"], "steps": job["train"]["steps"], "log_every": job["train"]["log_every"],
             "accuracy_positions": a["ttt_steps"] if a["name"] == "eagle3" else 1,
             "accuracy_note": "EAGLE-3: one accuracy per training-time-test step (draft position); DFlash: ModelOpt "
                              "reports the mean over the block's drafted positions",
             "points": result["curve"], "acceptance": acc}
    (ctx.out_dir / "curve.json").write_text(json.dumps(curve, indent=2))


def _log_outcome(ctx: StageContext, result: dict, acc: dict) -> None:
    if result.get("fsdp"):
        f = result["fsdp"]
        ctx.log.info("FSDP: each of %d processes held %.1f MB of the target's %.1f MB of decoder-layer weights",
                     f["processes"], f["target_layer_bytes_per_process"] / 1e6, f["target_layer_bytes"] / 1e6)
    if acc:
        ctx.log.info("acceptance length %.3f at %d draft tokens (%s, %.1f s: %s)", acc["acceptance_length"],
                     acc["draft_len"], ESTIMATORS[acc["estimator"]], result.get("eval_seconds") or 0.0,
                     ", ".join(f"{d} {v['acceptance_length']:.2f}" for d, v in acc["domains"].items()))


def _metrics(job: dict, result: dict, acc: dict, n_checks: int) -> dict:
    """The stage's metrics: the run's figures, the acceptance estimate, the dump's and FSDP's numbers when there."""
    return {
        "algorithm": job["algorithm"]["name"],
        "mode": job["mode"],
        "steps": job["train"]["steps"],
        "world_size": result["world_size"],
        "resumed_from_step": result["resumed_from_step"],
        "final_loss": result["final_loss"],
        "final_accuracy": result["final_accuracy"],
        "step_ms_mean": result["step_ms_mean"],
        "train_seconds": result["train_seconds"],
        "acceptance_length": acc.get("acceptance_length"),
        "acceptance_draft_len": acc.get("draft_len"),
        "acceptance_estimator": acc.get("estimator"),
        "eval_seconds": result.get("eval_seconds"),
        "acceptance_by_domain": {d: v["acceptance_length"] for d, v in acc.get("domains", {}).items()},
        "export_checks_passed": n_checks,
        **{k: result[k] for k in ("dump_bytes", "dump_estimate_bytes", "dump_seconds") if k in result},
        **(
            {
                "fsdp_processes": result["fsdp"]["processes"],
                "target_layer_bytes": result["fsdp"]["target_layer_bytes"],
                "target_layer_bytes_per_process": result["fsdp"]["target_layer_bytes_per_process"],
            }
            if result.get("fsdp")
            else {}
        ),
    }


ESTIMATORS = {"runtime": "specpipe runtime, BF16 target + exported draft (validate's definition)",
              "modelopt": "ModelOpt validate_online"}


def _tensor_names(d: Path) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(d / "model.safetensors"), "pt") as f:
        return set(f.keys())


def report(artifact) -> str:
    import matplotlib.pyplot as plt

    from pipeline.report import figure, table

    m = artifact.metrics
    curve = artifact.read_json("curve.json")
    pts = curve["points"]
    out = table(
        [
            ["algorithm", m.get("algorithm")],
            ["mode", m.get("mode")],
            ["steps", m.get("steps")],
            ["processes", m.get("world_size")],
            [
                "target layers per process (FSDP)",
                f"{m['target_layer_bytes_per_process'] / 1e6:.1f} of {m['target_layer_bytes'] / 1e6:.1f} MB"
                if m.get("fsdp_processes")
                else "whole target in every process",
            ],
            ["resumed from step", m.get("resumed_from_step")],
            ["final loss", m.get("final_loss")],
            ["final accuracy per position", m.get("final_accuracy")],
            ["ms per step", m.get("step_ms_mean")],
            ["acceptance estimator", ESTIMATORS.get(m.get("acceptance_estimator") or "", "none (eval.prompts_per_domain: 0)")],
            [
                "acceptance length",
                f"{m.get('acceptance_length')} at {m.get('acceptance_draft_len')} draft tokens ({m.get('eval_seconds')} s)",
            ],
        ],
        ["", ""],
    )
    if pts:
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.2))
        steps = [p["step"] for p in pts]
        ax1.plot(steps, [p["loss"] for p in pts])
        ax1.set_xlabel("step"), ax1.set_ylabel("loss"), ax1.set_title("draft training loss")
        for k in range(len(pts[-1]["accuracy"])):
            ax2.plot(steps, [p["accuracy"][k] if k < len(p["accuracy"]) else None for p in pts], label=f"position {k + 1}")
        ax2.set_xlabel("step"), ax2.set_ylabel("top-1 accuracy"), ax2.set_title("draft accuracy")
        ax2.legend(fontsize=7)
        out += figure(fig)
    acc = curve.get("acceptance") or {}
    if acc.get("domains"):
        out += table([[d, v["acceptance_length"], v["prompts"]] for d, v in acc["domains"].items()],
                     ["eval domain", f"acceptance length (k={acc['draft_len']})", "prompts"])
    checks = artifact.read_json("checks.json")
    out += table([[c["name"], "pass" if c["passed"] else "FAIL", c["message"]]
                  for c in checks], ["export check", "result", "message"])
    return out
