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

The job (`runtime/training/job.py`) runs in `runtime/training/draft_training.py`, in this process or as torchrun
workers (`runtime/training/launch.py`). Options, GPU/multi-node: docs/stages/train_draft.md; artifact: docs/architecture.md.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from pipeline.artifacts import target as target_artifact
from pipeline.artifacts import train_draft as train_draft_artifact
from pipeline.errors import StageError
from pipeline.stage import StageContext, StageSection, Strict
from runtime.algorithms import dflash, eagle3
from runtime.algorithms.registry import Named
from runtime.training.algorithm import shape_problems
from runtime.training.eval_config import every_problems

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


class Eagle3(Strict, Named):
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
    loss: Literal["kl", "lk_hybrid", "nla"] = Field("kl", description="kl: ModelOpt's soft CE; lk_hybrid, nla: LK losses")
    lk_eta: float = Field(3.0, gt=0, description="lk_hybrid's eta: KL weight exp(-eta * acceptance)")

    @field_validator("aux_layer_ids")
    @classmethod
    def _ids(cls, v):
        v = _distinct_nonneg(v)
        if v is not None and len(v) != eagle3.CAPTURE_LAYERS:
            raise ValueError(f"{v} has {len(v)} layers; EAGLE-3 drafts capture exactly {eagle3.CAPTURE_LAYERS} (TensorRT-LLM, "
                             "vLLM and speculators build fc as 3 x hidden)")
        # sorted: ModelOpt's online hooks and TensorRT-LLM concatenate the captured layers in layer order
        return sorted(v) if v is not None else v


class DFlash(Strict, Named):
    """DFlash: a block-diffusion draft that predicts `block_size - 1` tokens in one pass from masked slots."""

    kind: Literal["dflash"]
    draft_layers: int = Field(2, ge=1, description=(
        "draft layers; at most the target's layer count less one (each reads its own target layer, below the last)"))
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


Algorithm = Annotated[Eagle3 | DFlash, Field(discriminator="kind")]


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
    """The acceptance estimate during and at the end of training, on held-out prompts of each data.eval_domains entry."""

    estimator: Literal["runtime", "modelopt"] = Field("runtime", description=(
        "runtime: specpipe's speculative runtime on the BF16 target and the exported draft (KV cache, batched, the "
        "validate stage's definition); modelopt: ModelOpt's HFARValidation.validate_online (no KV cache, one prompt "
        "at a time; the only one that runs with launcher.fsdp or shard_target)"))
    prompts_per_domain: int = Field(8, ge=0, description="held-out prompts per data.eval_domains entry (0: skip)")
    osl: int = Field(64, ge=1, description="tokens generated per prompt")
    draft_len: int | None = Field(None, ge=1, description="draft tokens per step; default: the trained length")
    batch_size: int = Field(4, ge=1, description="runtime estimator: prompts decoded together (as validate.batch_size)")
    every: int | None = Field(None, ge=0, description=(
        "steps between held-out estimates during training (the best point is exported); default checkpoint_every where "
        "they run (not with launcher.fsdp, nor the modelopt estimator under torchrun or offline); 0: at the end only"))
    patience: int = Field(0, ge=0, description="eval points without improvement before training stops (0: never early)")
    min_delta: float = Field(0.0, ge=0, description="improvement of the mean held-out AL over the domains that counts")


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
    max_minutes: float | None = Field(None, gt=0, description="budget of training-step minutes (runtime/training/budget.py)")
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
        "float32 (about 2.6x faster steps for SmolLM2 on a CPU with native bf16, far slower on one without: "
        "docs/stages/train_draft.md); auto: bfloat16 under float32 training only on a CPU that runs bf16 GEMMs natively "
        "and measurably faster (runtime/engine/precision.py, cached per machine), else the training dtype"))
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
    p = "train_draft"
    out = _draft_len_problems(sec, p)
    procs = sec.launcher.nproc_per_node * sec.launcher.nnodes if sec.launcher.kind == "torchrun" else 1
    out += _placement_problems(sec, p, procs) + every_problems(sec, p)
    if (sec.dtype, sec.target_dtype) == ("bfloat16", "float32"):
        out.append((f"{p}.target_dtype", "float32 under dtype bfloat16 would run the target above the draft's own "
                    "precision; use target_dtype bfloat16 or auto (the training dtype)"))
    if sec.batch_size % procs:
        out.append((f"{p}.batch_size",
                    f"{sec.batch_size} is not divisible by the {procs} training processes (launcher.nproc_per_node x nnodes)"))
    if cfg.target.bootstrap == "tiny":
        t = cfg.target.tiny
        out += shape_problems(
            sec.algorithm, t.num_layers, t.vocab_size, f"target.tiny.num_layers={t.num_layers}",
            f"target.tiny.vocab_size={t.vocab_size}"
        )
    return out


def _draft_len_problems(sec: Config, p: str) -> list[tuple[str, str]]:
    """The algorithm against what it trains: DFlash's whole blocks, eval.draft_len within what the draft drafts."""
    a = sec.algorithm
    out: list[tuple[str, str]] = []
    if a.traits.drafts_block:
        if sec.seq_len % a.block_size:
            out.append((f"{p}.seq_len",
                        f"{sec.seq_len} is not divisible by algorithm.block_size {a.block_size} (DFlash trains whole blocks)"))
        if sec.eval.draft_len and sec.eval.draft_len > dflash.max_draft_len(a.block_size):
            out.append((f"{p}.eval.draft_len", f"{sec.eval.draft_len} exceeds block_size - 1 = "
                        f"{dflash.max_draft_len(a.block_size)}, what one DFlash block drafts"))
    elif sec.eval.draft_len and sec.eval.draft_len > 3 * a.ttt_steps:
        out.append((f"{p}.eval.draft_len",
                    f"{sec.eval.draft_len} is far beyond the {a.ttt_steps} trained positions (algorithm.ttt_steps)"))
    return out


def _placement_problems(sec: Config, p: str, procs: int) -> list[tuple[str, str]]:
    """Where the target lives (shard_target, launcher.fsdp) against the launcher and the in-training estimator."""
    out: list[tuple[str, str]] = []
    if sec.shard_target and sec.launcher.kind == "torchrun":
        out.append((f"{p}.shard_target",
                    "spreads one target copy over all GPUs of one process; it cannot combine with launcher torchrun"))
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
    return out


# ---------------------------------------------------------------------------------------------- run


def resolved(section: Config, device_type) -> dict:
    """The dtypes training runs in, auto resolved on this machine: they change the draft, so they enter the
    fingerprint (a machine that resolves them otherwise retrains); runtime/training/precision.py."""
    from runtime.training.precision import resolved_dtypes

    return resolved_dtypes(section, device_type)


def make_job(ctx: StageContext) -> dict:
    """The JSON job the runtime executes (in-process or under torchrun): `runtime.training.job.make_job` on this
    section, target.json, the target's tokenizer and the data artifact."""
    from transformers import AutoTokenizer

    from runtime.training.algorithm import resolve_algorithm
    from runtime.training.job import JobDirs, JobError
    from runtime.training.job import make_job as assemble

    sec: Config = ctx.section
    target, data = ctx.input("target"), ctx.input("data")
    info = target_artifact.read_info(target.path)
    model_dir = target.path / "model"
    trust = bool(ctx.config.target.trust_remote_code)
    tok = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust)
    try:
        algo = resolve_algorithm(sec.algorithm, info, tok, ctx.log)
        return assemble(sec, algo=algo, target=info, dirs=JobDirs(model_dir, data.path, ctx.scratch_dir, ctx.out_dir),
                        train_samples=data.metrics.get("train_samples"),
                        device=ctx.device.type, threads=ctx.config.run.threads,
                        trust_remote_code=trust)
    except JobError as e:
        raise StageError(str(e)) from None


def run(ctx: StageContext) -> dict:
    from runtime.training.export import complete_export
    from runtime.training.precision import log_precision, plan_line
    from runtime.training.records import curve_record, draft_record, stage_metrics

    job = make_job(ctx)
    precision = log_precision(ctx.log, job, ctx.section.dtype, ctx.section.target_dtype)
    ctx.log.info("%s", plan_line(job, ctx.section.launcher.kind))
    result = _train(ctx, job)
    draft_dir = Path(job["export_dir"])
    cfg = complete_export(draft_dir, Path(job["target_dir"]))
    checks = _check_export(ctx, job, draft_dir)
    acc = result.get("acceptance") or {}
    info = draft_record(job, cfg, draft_dir, acc, result)
    (ctx.out_dir / train_draft_artifact.INFO).write_text(json.dumps(info.to_json(), indent=2))
    (ctx.out_dir / "curve.json").write_text(json.dumps(curve_record(job, result, acc), indent=2))
    _log_outcome(ctx, result, acc)
    return {**stage_metrics(job, result, acc, len(checks)), "train_dtype": job["train_dtype"],
            "target_dtype": job["target_dtype"], **precision}


def _train(ctx: StageContext, job: dict) -> dict:
    """The job in this process or under torchrun, its progress in the stage's bars. Returns its result."""
    from runtime.training.job import JobError
    from runtime.training.progress import Bars

    sec: Config = ctx.section
    bars = Bars(ctx.progress, ctx.log)
    try:
        if sec.launcher.kind == "torchrun":
            from runtime.training.launch import train_torchrun

            return train_torchrun(job, sec.launcher, ctx.scratch_dir, ctx.config.run.threads, bars, ctx.log)
        from runtime.training.draft_training import train

        return train(job, emit=bars)
    except JobError as e:
        raise StageError(f"train_draft: {e}") from None
    finally:
        bars.close()


def _check_export(ctx: StageContext, job: dict, draft_dir: Path) -> list:
    """The named export checks (`runtime.training.draft_checks`) into checks.json; StageError when any fails."""
    from runtime.training.draft_checks import Expect, as_dicts, check_draft, failures
    from runtime.training.job import capture_layer_ids

    a = job["algorithm"]
    expect = Expect(algorithm=a["name"], num_layers=a["draft_layers"], hidden_size=job["target"]["hidden_size"],
                    vocab_size=job["target"]["vocab_size"], capture_layer_ids=capture_layer_ids(job),
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


def _log_outcome(ctx: StageContext, result: dict, acc: dict) -> None:
    from runtime.training.acceptance import ESTIMATORS

    if result.get("fsdp"):
        f = result["fsdp"]
        ctx.log.info("FSDP: each of %d processes held %.1f MB of the target's %.1f MB of decoder-layer weights",
                     f["processes"], f["target_layer_bytes_per_process"] / 1e6, f["target_layer_bytes"] / 1e6)
    if acc:
        ctx.log.info("acceptance length %.3f at %d draft tokens (%s, %.1f s: %s)", acc["acceptance_length"],
                     acc["draft_len"], ESTIMATORS[acc["estimator"]], result.get("eval_seconds") or 0.0,
                     ", ".join(f"{d} {v['acceptance_length']:.2f}" for d, v in acc["domains"].items()))


def report(artifact) -> str:
    import matplotlib.pyplot as plt

    from pipeline.report import figure, table
    from runtime.training.acceptance import ESTIMATORS
    from runtime.training.budget import steps_row
    from runtime.training.precision import precision_row
    from runtime.training.records import eval_report

    m = artifact.metrics
    curve = artifact.read_json("curve.json")
    pts = curve["points"]
    out = table(
        [
            ["algorithm", m.get("algorithm")],
            ["mode", m.get("mode")],
            ["steps", steps_row(m)],
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
            ["precision", precision_row(m)],
            ["acceptance estimator", ESTIMATORS.get(m.get("acceptance_estimator") or "", "none (eval.prompts_per_domain: 0)")],
            [
                "acceptance length",
                f"{m.get('acceptance_length')} at {m.get('eval_draft_len', m.get('acceptance_draft_len'))} draft tokens "
                f"({m.get('eval_seconds')} s)",     # acceptance_draft_len: a workdir from before the glossary's renames
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
    pt_rows, pt_head, summary = eval_report(curve, train_draft_artifact.read_info(artifact.path).raw)
    out += (table(pt_rows, pt_head) if pt_rows else "") + table(summary, ["", ""])
    checks = artifact.read_json("checks.json")
    out += table([[c["name"], "pass" if c["passed"] else "FAIL", c["message"]]
                  for c in checks], ["export check", "result", "message"])
    return out
