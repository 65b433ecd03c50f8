"""Train an EAGLE-3 or DFlash draft for a target with NVIDIA ModelOpt, then export it.

Runs in-process (`train(job)`) or as N processes under torchrun:

    torchrun --nproc-per-node 8 -m runtime.training.draft_training --job job.json

With `fsdp` in the job (several processes), the target is never loaded whole: its decoder layers are sharded
over all processes with FSDP2 (`load_target_skeleton`, `shard_target_layers`) and the draft's gradients are
all-reduced. A *job* is a JSON-able dict written by the `train_draft` stage (see `stages/train_draft.py`); this module
never reads the pipeline config. What it does, in order:

1. offline mode only: dump the target's hidden states for every training sample into `<scratch>/hidden/`
   (one file per sample, written atomically, so an interrupted dump resumes where it stopped);
2. convert the target with `modelopt.torch.speculative.convert` (the base stays frozen) and train the
   draft with AdamW/SGD, a warmup + cosine/linear schedule and periodic checkpoints in `<scratch>/ckpt/`
   (draft weights as safetensors + optimizer/step state); a restarted job resumes from the checkpoint;
3. rank 0: `export_speculative_decoding` into `<export_dir>`, the acceptance estimate on held-out prompts
   (`eval.estimator`: `runtime_acceptance`, specpipe's runtime on the BF16 target and the exported draft with the
   validate stage's definition; or ModelOpt's `HFARValidation.validate_online` before the export, collective
   under FSDP), and `result.json` with the curve and metrics.

Data order and randomness are functions of (seed, step, rank) only, so a resumed run sees the same batches
as an uninterrupted one. Progress goes to a callback in-process, or as `@@specpipe {json}` lines on the
stdout of rank 0 under torchrun (the stage parses them into its progress bar).
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable

PROGRESS_PREFIX = "@@specpipe "
CKPT = "ckpt"
HIDDEN = "hidden"
IGNORE_INDEX = -100


class JobError(Exception):
    """An expected failure with a message for the user (the stage turns it into a StageError)."""


# ------------------------------------------------------------------------------------------- helpers


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _rank_world() -> tuple[int, int]:
    d = _dist()
    return (d.get_rank(), d.get_world_size()) if d else (0, 1)


def _barrier() -> None:
    if d := _dist():
        d.barrier()


def target_dtype(job: dict):
    """The frozen target's weight and compute dtype (`target_dtype`, default the training dtype). Lower than the
    training dtype, the forward runs under autocast: the target in it, the draft's matmuls too, its master weights,
    optimizer state and loss in the training dtype."""
    return _torch_dtype(job.get("target_dtype") or job["train_dtype"])


def autocast(job: dict, device):
    import contextlib

    import torch

    low = target_dtype(job)
    if low == _torch_dtype(job["train_dtype"]):
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=low)


def _torch_dtype(name: str):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def read_samples(parquet: str | Path, max_samples: int | None = None) -> list[tuple[list[int], list[int]]]:
    """(input_ids, loss_mask) of the first `max_samples` training samples of a token-row parquet, the row rule checked
    (`runtime.data_rows`). Rows without a token to train on are skipped rather than refused: the data stage never
    writes one, but the training worker also reads hand-made datasets whose truncated rows can lose their response."""
    from runtime.data_rows import read_token_rows
    from runtime.errors import RuntimeFailure

    try:
        return read_token_rows(parquet, limit=max_samples or None, skip_untrained=True)
    except RuntimeFailure as e:
        raise JobError(str(e)) from None


def read_prompts(eval_files: dict[str, str], per_domain: int) -> dict[str, list[list[int]]]:
    """The first `per_domain` eval prompts' ids of each domain file (`runtime.data_rows`)."""
    from runtime.data_rows import read_eval_lines

    return {domain: [r["prompt_ids"] for r in read_eval_lines(path)[:per_domain]]
            for domain, path in sorted(eval_files.items())}


def batch_indices(step: int, n: int, batch: int, seed: int) -> list[int]:
    """The global batch of `step`: consecutive slices of a per-epoch permutation seeded by (seed, epoch)."""
    import torch

    out = []
    pos = step * batch
    while len(out) < batch:
        epoch, off = divmod(pos, n)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch)).tolist()
        take = min(batch - len(out), n - off)
        out += perm[off: off + take]
        pos += take
    return out


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


def capture_layer_ids(job: dict) -> list[int]:
    """Target layers whose outputs the draft reads: EAGLE-3 aux layers or DFlash target layers."""
    a = job["algorithm"]
    return list(a["aux_layer_ids"] if a["name"] == "eagle3" else a["target_layer_ids"])


# ------------------------------------------------------------------------------------------- model


def convert_config(job: dict, offline: bool) -> tuple[str, dict]:
    """The ModelOpt mode name and config for `mtsp.convert`, from the job's algorithm options."""
    import modelopt.torch.speculative as mtsp

    a, tgt = job["algorithm"], job["target"]
    if a["name"] == "eagle3":
        cfg = copy.deepcopy(mtsp.EAGLE3_DEFAULT_CFG["config"])
        arch = cfg["eagle_architecture_config"]
        arch.update({
            "num_hidden_layers": a["draft_layers"],
            "intermediate_size": a["intermediate_size"] or tgt["intermediate_size"],
            "num_attention_heads": tgt["num_attention_heads"],
            "num_key_value_heads": tgt["num_key_value_heads"],
            "head_dim": tgt["head_dim"],
            "eagle_aux_hidden_state_layer_ids": list(a["aux_layer_ids"]),
        })
        if a["draft_vocab_size"] and a["draft_vocab_size"] != tgt["vocab_size"]:
            arch["draft_vocab_size"] = a["draft_vocab_size"]
        cfg.update({"eagle_ttt_steps": a["ttt_steps"], "eagle_loss_decay_factor": a["loss_decay_factor"],
                    "eagle_use_torch_compile": job["torch_compile"], "eagle_offline": offline,
                    "eagle_export_rope_scaling": job["export_rope_scaling"] or {}})
        return "eagle", cfg
    cfg = copy.deepcopy(mtsp.DFLASH_DEFAULT_CFG["config"])
    cfg.update({
        "dflash_block_size": a["block_size"], "dflash_mask_token_id": a["mask_token_id"],
        "dflash_num_anchors": a["num_anchors"], "dflash_use_torch_compile": job["torch_compile"],
        "dflash_loss_objective": a["loss_objective"], "dflash_loss_decay_factor": a["loss_decay_factor"],
        "dflash_offline": offline, "dflash_export_rope_scaling": job["export_rope_scaling"] or {},
        # Qwen3Config defaults (32 heads, 22016 MLP) would win over the target's shape otherwise.
        "dflash_architecture_config": {
            "num_hidden_layers": a["draft_layers"], "target_layer_ids": list(a["target_layer_ids"]),
            "intermediate_size": a["intermediate_size"] or tgt["intermediate_size"],
            "num_attention_heads": tgt["num_attention_heads"], "num_key_value_heads": tgt["num_key_value_heads"],
            "head_dim": tgt["head_dim"],
        },
    })
    return "dflash", cfg


def build_model(job: dict, offline: bool, device):
    """The target converted for draft training. Offline: the target without its decoder layers. With
    `fsdp` (several processes) the target's decoder layers end up sharded over all of them."""
    import modelopt.torch.speculative as mtsp
    import torch

    dtype = _torch_dtype(job["train_dtype"])
    tdtype = target_dtype(job)
    fsdp = fsdp_active(job) and not offline   # the offline model has no decoder layers to shard
    if offline:
        from modelopt.torch.speculative.utils import load_vlm_or_llm

        model = load_vlm_or_llm(job["target_dir"], use_offline_training=True, dtype=tdtype,
                                trust_remote_code=job["trust_remote_code"])
    elif fsdp:
        model = load_target_skeleton(job, device, tdtype)
    else:
        model = _load_target(job, device, tdtype)
    if offline or not (job.get("shard_target") or fsdp):
        model.to(device)
    mode, cfg = convert_config(job, offline)
    torch.manual_seed(job["train"]["seed"])  # the draft's initial weights
    mtsp.convert(model, [(mode, cfg)])
    if tdtype != dtype:   # ModelOpt builds the draft in the base model's dtype: its master weights stay in `dtype`
        draft_module(model).to(dtype)
    if job["algorithm"]["name"] == "eagle3" and job.get("d2t_path"):
        from modelopt.torch.speculative.plugins.hf_eagle import HFEagleModel

        HFEagleModel.load_draft_vocab_cache(model, job["d2t_path"])
    if fsdp:
        job.setdefault("_fsdp", shard_target_layers(model, device, job["target_dir"]))
    return model


def _load_target(job: dict, device, dtype):
    """The full target on `device`; with `shard_target` its layers spread over all visible GPUs
    (transformers' device_map="auto"; one process) for a target larger than one GPU."""
    from transformers import AutoModelForCausalLM

    kw = {"device_map": "auto"} if job.get("shard_target") else {}
    model = AutoModelForCausalLM.from_pretrained(job["target_dir"], dtype=dtype, trust_remote_code=job["trust_remote_code"], **kw)
    return model if kw else model.to(device)


class _Checkpoint:
    """Tensors of a Hugging Face safetensors checkpoint (one file or an index of shards), read one at a time
    (memory-mapped), so that a process takes from the target only what it keeps."""

    def __init__(self, model_dir: str | Path):
        d = Path(model_dir)
        index = d / "model.safetensors.index.json"
        if index.is_file():
            self.files = {k: d / f for k, f in json.loads(index.read_text())["weight_map"].items()}
        elif (d / "model.safetensors").is_file():
            from safetensors import safe_open

            with safe_open(str(d / "model.safetensors"), "pt") as f:
                self.files = {k: d / "model.safetensors" for k in f.keys()}
        else:
            raise JobError(f"launcher.fsdp reads the target's safetensors directly, and {d} has neither "
                           "model.safetensors nor model.safetensors.index.json")

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def get(self, name: str):
        from safetensors import safe_open

        with safe_open(str(self.files[name]), "pt") as f:
            return f.get_tensor(name)


def load_target_skeleton(job: dict, device, dtype):
    """The target for FSDP: built on the meta device from its config, with everything outside the decoder
    layers (embeddings, final norm, lm_head, rotary tables) read from the checkpoint onto `device`; the
    layers stay empty (meta) until `shard_target_layers` gives each process its shard. No process ever holds
    the whole target, in host or device memory."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(job["target_dir"], trust_remote_code=job["trust_remote_code"])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, trust_remote_code=job["trust_remote_code"])
    ckpt = _Checkpoint(job["target_dir"])
    layers = model.get_decoder().layers
    in_layers = {id(m) for m in layers.modules()}
    missing = []
    for mname, mod in model.named_modules():
        if id(mod) in in_layers:
            continue
        for pname, p in list(mod.named_parameters(recurse=False)):
            key = f"{mname}.{pname}" if mname else pname
            if key in ckpt:
                mod._parameters[pname] = torch.nn.Parameter(ckpt.get(key).to(device, dtype), requires_grad=p.requires_grad)
            else:
                missing.append(key)
    if getattr(cfg, "tie_word_embeddings", False):
        model.tie_weights()
    missing = [k for k in missing if model.get_parameter(k).is_meta]
    if missing:
        raise JobError(f"launcher.fsdp: {', '.join(missing)} not in the checkpoint {job['target_dir']}")
    # non-persistent buffers (RoPE inverse frequencies) are computed, not stored: build those modules again
    for mname, mod in list(model.named_modules()):
        if id(mod) in in_layers or not any(b.is_meta for b in mod.buffers(recurse=False)):
            continue
        if "rotary" not in type(mod).__name__.lower():
            raise JobError(f"launcher.fsdp: cannot materialize the buffers of {mname} ({type(mod).__name__}) outside "
                           "the checkpoint; train without fsdp")
        parent, _, child = mname.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, type(mod)(config=mod.config, device=device))
    # ModelOpt puts the draft on the device of the last layer's first weight: give that layer (one of L, its
    # values filled in by shard_target_layers) real storage, or the draft would be created on the meta device.
    layers[-1].to_empty(device=device)
    return model


def fsdp_active(job: dict) -> bool:
    """`launcher.fsdp` under torchrun with more than one process."""
    return bool(job.get("fsdp")) and _dist() is not None and _rank_world()[1] > 1


def shard_target_layers(model, device, target_dir: str | Path) -> dict:
    """FSDP2 over all processes: each decoder layer of the (frozen) target is sharded along dim 0, so every
    process holds 1/N of the layers' weights and all-gathers one layer at a time while it runs, resharding it
    right after its forward. The layers come from `load_target_skeleton` empty (meta): they are sharded
    there, and each process then reads its own rows of each weight from the checkpoint. Everything outside
    the layers (and the draft) is whole on every process; the draft's gradients are all-reduced."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    _, world = _rank_world()
    base = model.get_decoder()
    layers = list(base.layers)
    prefix = next(n for n, m in model.named_modules() if m is base.layers)
    mesh = init_device_mesh(device.type, (world,))
    ckpt = _Checkpoint(target_dir)
    full = local = 0
    for i, layer in enumerate(layers):
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
        layer.to_empty(device=device)
        with torch.no_grad():
            for name, p in layer.named_parameters():
                w = ckpt.get(f"{prefix}.{i}.{name}").to(p.dtype)
                p.to_local().copy_(distribute_tensor(w, mesh, [Shard(0)], src_data_rank=None).to_local())
                full += w.numel() * w.element_size()
                local += p.to_local().numel() * p.element_size()
                del w
        # Each layer is its own FSDP root (wrapping the decoder stack would change its class, which
        # transformers' output capture looks up by name), and FSDP keeps a root's weights gathered after
        # forward for the backward that follows; the target is frozen and runs without grad, so drop them.
        layer.register_forward_hook(lambda mod, args, out: mod.reshard())
    return {"target_layer_bytes": full, "target_layer_bytes_per_process": local, "processes": world}


def draft_module(model):
    return model.eagle_module if hasattr(model, "eagle_module") else model.dflash_module


def calibrate_d2t(samples, vocab_size: int, draft_vocab_size: int, path: Path) -> dict:
    """The reduced draft vocabulary: the most frequent trained-on tokens of the training set, stored as
    ModelOpt's `d2t` offsets (target_id = draft_id + d2t[draft_id]). ModelOpt's `calibrate_frequent_vocab`
    counts chat-template renderings of conversations; the data artifact already holds token ids with a loss
    mask, so the same count runs on exactly the tokens the draft learns to predict."""
    import collections

    import torch

    counts = collections.Counter()
    for ids, mask in samples:
        counts.update(t for t, m in zip(ids, mask) if m)
    top = [t for t, _ in counts.most_common(draft_vocab_size)]
    if len(top) < draft_vocab_size:   # fill with unseen ids so the map is complete and injective
        seen = set(top)
        top += [t for t in range(vocab_size) if t not in seen][: draft_vocab_size - len(top)]
    top.sort()   # keep draft ids in target-id order: d2t is then non-decreasing
    d2t = torch.tensor([t - i for i, t in enumerate(top)], dtype=torch.int64)
    torch.save(d2t, path)
    covered = sum(counts[t] for t in top) / max(1, sum(counts.values()))
    return {"draft_vocab_size": draft_vocab_size, "token_coverage": round(covered, 4)}


# ------------------------------------------------------------------------------------------- offline dump


def estimate_dump_bytes(n_samples: int, tokens_per_sample: float, n_capture_layers: int, hidden: int, dtype_bytes: int) -> int:
    """Hidden states of the final layer plus each captured layer, per token, plus ids and mask (int64)."""
    return int(n_samples * tokens_per_sample * ((1 + n_capture_layers) * hidden * dtype_bytes + 16))


def dump_preflight(need_bytes: int, where: Path, max_bytes: int | None = None) -> dict:
    """Refuse an offline dump that the disk (or the configured budget) cannot hold. Returns the numbers."""
    where.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(where).free
    gib = 2**30
    if max_bytes is not None and need_bytes > max_bytes:
        raise JobError(f"offline hidden-state dump needs about {need_bytes / gib:.2f} GiB, over the budget "
                       f"train_draft.offline.max_dump_gb={max_bytes / gib:.4g}; raise the budget, train fewer samples "
                       "or a shorter seq_len, or use train_draft.mode: online")
    if need_bytes * 1.05 > free:
        raise JobError(f"offline hidden-state dump needs about {need_bytes / gib:.2f} GiB but {where} has only "
                       f"{free / gib:.2f} GiB free; free space there, point the workdir at a larger disk, "
                       "or use train_draft.mode: online (no dump)")
    return {"dump_estimate_bytes": need_bytes, "disk_free_bytes": free}


def dump_hidden_states(job: dict, samples, device, emit: Callable[[dict], None]) -> list[Path]:
    """Write `<scratch>/hidden/<i>.pt` for each sample (this rank's share), skipping files that exist.
    Keys follow ModelOpt's offline format: input_ids, hidden_states (last layer), aux_hidden_states
    (captured layers concatenated), loss_mask."""
    import torch

    rank, world = _rank_world()
    out = Path(job["scratch_dir"]) / HIDDEN
    out.mkdir(parents=True, exist_ok=True)
    files = [out / f"{i:07d}.pt" for i in range(len(samples))]
    todo = [i for i in range(rank, len(samples), world) if not files[i].exists()]
    done_before = len(samples) - sum(1 for f in files if not f.exists())
    fsdp = fsdp_active(job)
    rounds = len(todo)
    if fsdp:   # every process runs the same number of forwards: each one all-gathers every layer
        import torch.distributed as dist

        n = torch.tensor([rounds])
        dist.all_reduce(n, op=dist.ReduceOp.MAX)
        rounds = int(n)
    if rounds:
        dtype = _torch_dtype(job["train_dtype"])
        if fsdp:
            model = load_target_skeleton(job, device, dtype)
            job.setdefault("_fsdp", shard_target_layers(model, device, job["target_dir"]))
        else:
            model = _load_target(job, device, dtype)
        model.eval()
        layers = capture_layer_ids(job)
        seq = job["train"]["seq_len"]
        emit({"event": "dump_start", "total": len(samples), "done": done_before})
        with torch.no_grad():
            for j in range(rounds):
                if j >= len(todo):   # this process is done: keep the others' collectives company
                    model(input_ids=torch.tensor([samples[0][0][:8]], device=device))
                    continue
                i = todo[j]
                ids, mask = samples[i]
                x = torch.tensor([ids[:seq]], device=device)
                hs = model(input_ids=x, output_hidden_states=True).hidden_states
                rec = {"input_ids": x[0].cpu(), "hidden_states": hs[-1][0].cpu(),
                       "aux_hidden_states": torch.cat([hs[lid + 1][0].cpu() for lid in layers], dim=-1),
                       "loss_mask": torch.tensor(mask[:seq], dtype=torch.long)}
                tmp = files[i].with_suffix(f".tmp{rank}")
                torch.save(rec, tmp)
                os.replace(tmp, files[i])
                emit({"event": "dump", "n": 1})
        del model
    _barrier()
    return files


# ------------------------------------------------------------------------------------------- batches


def online_batch(samples, idx: list[int], seq_len: int, pad_id: int, device) -> dict:
    import torch

    n = len(idx)
    ids = torch.full((n, seq_len), pad_id, dtype=torch.long)
    att = torch.zeros((n, seq_len), dtype=torch.long)
    lm = torch.zeros((n, seq_len), dtype=torch.long)
    for r, i in enumerate(idx):
        a, m = samples[i]
        a, m = a[:seq_len], m[:seq_len]
        ids[r, : len(a)] = torch.tensor(a)
        att[r, : len(a)] = 1
        lm[r, : len(m)] = torch.tensor(m)
    labels = ids.masked_fill(att == 0, IGNORE_INDEX)
    return {k: v.to(device) for k, v in
            {"input_ids": ids, "attention_mask": att, "loss_mask": lm, "labels": labels}.items()}


def offline_batch(dataset, collator, idx: list[int], device) -> dict:
    b = collator([dataset[i] for i in idx])
    b["base_model_outputs"] = {k: (v.to(device) if hasattr(v, "to") else v) for k, v in b["base_model_outputs"].items()}
    return {k: (v.to(device) if hasattr(v, "to") else v) for k, v in b.items()}


# ------------------------------------------------------------------------------------------- checkpoints


def save_checkpoint(scratch: Path, model, opt, sched, step: int, curve: list, extra: dict) -> None:
    """Draft weights (safetensors) + optimizer/schedule/step (torch.save of tensors and plain types),
    written to a fresh directory that replaces the previous checkpoint in one rename."""
    import torch
    from safetensors.torch import save_file

    final = scratch / CKPT
    tmp = scratch / f"{CKPT}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    sd = {k: v.detach().contiguous().cpu() for k, v in draft_module(model).state_dict().items()}
    save_file(sd, str(tmp / "draft.safetensors"))
    torch.save({"opt": opt.state_dict(), "sched": sched.state_dict(), "step": step, "curve": curve, **extra},
               tmp / "state.pt")
    old = scratch / f"{CKPT}.old"
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(scratch: Path, model, opt, sched, device) -> dict | None:
    import torch
    from safetensors.torch import load_file

    d = scratch / CKPT
    if not (d / "state.pt").exists():
        return None
    draft_module(model).load_state_dict(load_file(str(d / "draft.safetensors"), device=str(device)))
    state = torch.load(d / "state.pt", weights_only=True, map_location=device)
    opt.load_state_dict(state["opt"])
    sched.load_state_dict(state["sched"])
    return state


# ------------------------------------------------------------------------------------------- acceptance


def runtime_acceptance(target_dir: str | Path, draft_dir: str | Path, prompts: dict[str, list[list[int]]], *, osl: int,
                       draft_len: int, batch_size: int, eos_token_ids: list[int], device: str = "cpu", seed: int = 0,
                       expected_capture_layers: list[int] | None = None) -> dict:
    """The acceptance estimate through specpipe's speculative runtime, with the `validate` stage's definition and
    procedure: the target (here the BF16 checkpoint) and the draft as exported (`runtime.engine.drafts.load_draft`, ModelOpt's
    first-layer norm, as trained), greedy, `batch_size` prompts per `generate` call, at most `osl` new tokens, a
    request stopping at the first of `eos_token_ids`; AL per domain = (verification steps + accepted draft tokens) /
    verification steps over all its requests (`RunStats.acceptance_length`), overall the same over every domain."""
    import torch

    from runtime.engine.drafts import load_draft
    from runtime.engine.speculative import RunStats, SpeculativeEngine, load_target, target_shape
    from runtime.trtllm.draft_schedule import dflash_max_draft_len

    t0 = time.monotonic()
    model = load_target(target_dir, device=device)
    draft = load_draft(draft_dir, target_shape(model), device=device, expected_capture_layers=expected_capture_layers)
    if draft.algorithm == "dflash" and draft_len > dflash_max_draft_len(draft.block_size):
        raise JobError(f"train_draft.eval.draft_len {draft_len} exceeds what one DFlash block drafts "
                       f"({dflash_max_draft_len(draft.block_size)})")
    eng = SpeculativeEngine(model, draft)
    per_domain, total = {}, None
    for domain, ps in prompts.items():
        st = RunStats(draft_len)
        for i in range(0, len(ps), batch_size):
            g = eng.generate(ps[i:i + batch_size], max_new_tokens=osl, draft_len=draft_len, temperature=0.0,
                             eos_token_id=eos_token_ids, seed=seed + i, speculative=True)
            st = st.merge(g.stats)
        d = st.as_dict()
        per_domain[domain] = {"acceptance_length": round(st.acceptance_length, 6), "prompts": len(ps), "steps": st.steps,
                              "accepted": st.accepted, "drafted": st.drafted, "per_position": d["per_position"]}
        total = st if total is None else total.merge(st)
    del eng, draft, model
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"estimator": "runtime", "acceptance_length": round(total.acceptance_length, 6), "draft_len": draft_len,
            "osl": osl, "batch_size": batch_size, "eos_token_ids": list(eos_token_ids), "first_layer_norm": "modelopt",
            "target": "bf16", "seconds": round(time.monotonic() - t0, 2), "domains": per_domain}


def acceptance(model, tokenizer, prompts: dict[str, list[list[int]]], osl: int, steps: int) -> dict:
    """ModelOpt's own estimate: `validate_online` (target verifies the draft's tokens greedily, no KV cache)
    per prompt; acceptance length = mean tokens per target step, at most steps + 1. It stops at the tokenizer's
    eos token only, and averages per prompt (not per step as `runtime_acceptance` and `validate` do)."""
    import torch
    from modelopt.torch.speculative.plugins.hf_eagle import HFARValidation

    model.eval()
    device = next(model.parameters()).device
    val = HFARValidation(model, tokenizer)
    per_domain = {}
    with torch.no_grad():
        for domain, items in prompts.items():
            ars = []
            for ids in items:
                _, ar = val.validate_online(osl, input_ids=torch.tensor([ids], device=device), steps=steps)
                ars.append(float(ar))
            per_domain[domain] = {"acceptance_length": round(sum(ars) / len(ars), 4), "prompts": len(ars)}
    all_ars = [v["acceptance_length"] * v["prompts"] for v in per_domain.values()]
    n = sum(v["prompts"] for v in per_domain.values())
    return {"estimator": "modelopt", "acceptance_length": round(sum(all_ars) / max(1, n), 4), "draft_len": steps,
            "osl": osl, "domains": per_domain}


# ------------------------------------------------------------------------------------------- training


def allreduce_grads(params, world: int) -> None:
    """The draft's gradients averaged over all processes (what DDP does; under FSDP the draft is not wrapped).
    A parameter without a gradient on this process (DFlash's unused ones) contributes zeros."""
    import torch
    import torch.distributed as dist

    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= world
    off = 0
    for p, g in zip(params, grads):
        n = g.numel()
        p.grad = flat[off: off + n].view_as(p).clone()
        off += n


def _emit_stdout(ev: dict) -> None:
    print(PROGRESS_PREFIX + json.dumps(ev), flush=True)


def train(job: dict, emit: Callable[[dict], None] | None = None, should_stop: Callable[[int], bool] | None = None) -> dict:
    """Run the whole job in this process (one rank of a torchrun group, or alone). Returns the result
    (also written to `<scratch>/result.json` by rank 0). `should_stop(step)` lets a caller end training
    early after a checkpoint, as an interruption would (used by tests of resuming)."""
    proc = _start_process(job, emit)
    scratch = Path(job["scratch_dir"])
    scratch.mkdir(parents=True, exist_ok=True)
    data = _read_training_data(job, proc.world)
    _calibrate_d2t_once(job, data.samples, proc.rank)
    offline = job["mode"] == "offline"
    if offline:
        _dump_offline(job, data, scratch, proc)
    run = _setup_training(job, offline, scratch, proc)
    stopped_at = _train_steps(job, run, data, scratch, proc, should_stop)
    if stopped_at is not None:
        return {"stopped_at": stopped_at}

    # Evaluation and export run on rank 0 alone: leave the process group first, since ModelOpt's
    # validate_online broadcasts across ranks whenever one is initialized. Under FSDP no process holds the whole
    # target: all of them evaluate together (validate_online's broadcasts keep them in step), rank 0 exports.
    fsdp, rank = run.fsdp, proc.rank
    d = _dist()
    if d is not None and not fsdp:
        d.barrier()
        d.destroy_process_group()
    if rank != 0 and not fsdp:
        return {}
    held = [run.model]   # _finish takes the only reference: the runtime estimate frees the training model first
    curve, step_times, step0 = run.curve, run.step_times, run.step0
    del run   # the DDP wrapper, optimizer, schedule and parameter list with it
    result = _finish(job, held, offline, proc.device, data.tok, curve, step_times, step0, proc.world, data.dump_info, rank)
    held.clear()   # whatever _finish left of the model goes now, before the last barrier
    if d is not None and fsdp:
        d.barrier()
        d.destroy_process_group()
    return result if rank == 0 else {}


@dataclasses.dataclass
class _Process:
    """This process of the training group (or the only one) and where it reports progress."""

    rank: int
    world: int
    local_rank: int
    device: Any
    emit_fn: Callable[[dict], None]

    def emit0(self, ev: dict) -> None:   # only rank 0 reports progress
        if self.rank == 0:
            self.emit_fn(ev)


@dataclasses.dataclass
class _Data:
    """The training samples, the tokenizer's padding id and, offline, ModelOpt's dataset over the dumped records."""

    samples: list
    tok: Any
    pad_id: int
    dataset: Any = None
    collator: Any = None
    dump_info: dict = dataclasses.field(default_factory=dict)

    def batch(self, idx: list[int], seq_len: int, device) -> dict:
        if self.dataset is not None:
            return offline_batch(self.dataset, self.collator, idx, device)
        return online_batch(self.samples, idx, seq_len, self.pad_id, device)


@dataclasses.dataclass
class _Run:
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


def _start_process(job: dict, emit: Callable[[dict], None] | None) -> _Process:
    """Join the torchrun group (when WORLD_SIZE > 1), pick this process's device and thread count."""
    import torch

    world_env = int(os.environ.get("WORLD_SIZE", "1"))
    device_kind = job["device"]
    if world_env > 1 and _dist() is None:
        import torch.distributed as dist

        dist.init_process_group(backend="nccl" if device_kind == "cuda" else "gloo")
    rank, world = _rank_world()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(f"cuda:{local_rank}" if device_kind == "cuda" else "cpu")
    if device_kind == "cuda":
        torch.cuda.set_device(device)
    if job.get("threads"):
        torch.set_num_threads(job["threads"])
    return _Process(rank, world, local_rank, device, emit or (lambda ev: None))


def _read_training_data(job: dict, world: int) -> _Data:
    """The samples (refused when the global batch does not split over the processes, or none has a token to train
    on) and the target's tokenizer for padding."""
    from transformers import AutoTokenizer

    t = job["train"]
    if t["batch_size"] % world:
        raise JobError(f"train_draft.batch_size {t['batch_size']} is not divisible by the {world} training processes")
    samples = read_samples(job["train_parquet"], job.get("max_samples"))
    if not samples:
        raise JobError(f"no training samples with a non-zero loss mask in {job['train_parquet']}")
    tok = AutoTokenizer.from_pretrained(job["target_dir"], trust_remote_code=job["trust_remote_code"])
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    return _Data(samples, tok, pad_id)


def _calibrate_d2t_once(job: dict, samples, rank: int) -> None:
    """EAGLE-3 with a reduced vocabulary: rank 0 writes the d2t map unless a previous run did; all wait for it."""
    if job["algorithm"]["name"] == "eagle3" and job.get("d2t_path") and rank == 0 and not Path(job["d2t_path"]).exists():
        job["d2t_stats"] = calibrate_d2t(samples, job["target"]["vocab_size"], job["algorithm"]["draft_vocab_size"],
                                         Path(job["d2t_path"]))
    _barrier()


def _dump_offline(job: dict, data: _Data, scratch: Path, proc: _Process) -> None:
    """Offline mode: the disk preflight (rank 0, on what is not dumped yet), the hidden-state dump, and ModelOpt's
    dataset and collator over the records, set on `data` with the dump's numbers."""
    import torch

    t, samples = job["train"], data.samples
    tps = sum(min(len(a), t["seq_len"]) for a, _ in samples) / len(samples)
    itemsize = torch.finfo(_torch_dtype(job["train_dtype"])).bits // 8
    need = estimate_dump_bytes(len(samples), tps, len(capture_layer_ids(job)), job["target"]["hidden_size"], itemsize)
    existing = sum(f.stat().st_size for f in (scratch / HIDDEN).glob("*.pt")) if (scratch / HIDDEN).exists() else 0
    if proc.rank == 0:
        max_b = int(job["max_dump_gb"] * 2**30) if job.get("max_dump_gb") else None
        data.dump_info = dump_preflight(max(0, need - existing), scratch, max_b)
        data.dump_info["dump_estimate_bytes"] = need
    _barrier()
    t0 = time.monotonic()
    files = dump_hidden_states(job, samples, proc.device, proc.emit0)
    data.dump_info["dump_seconds"] = round(time.monotonic() - t0, 2)
    data.dump_info["dump_bytes"] = sum(f.stat().st_size for f in files)
    from modelopt.torch.speculative.eagle.utils import EagleOfflineDataCollator, OfflineSupervisedDataset

    data.dataset = OfflineSupervisedDataset([str(f) for f in files], answer_only_loss=True)
    data.collator = EagleOfflineDataCollator(t["seq_len"])


def _optimizer(params: list, t: dict):
    import torch

    if t["optimizer"] == "adamw":
        return torch.optim.AdamW(params, lr=t["lr"], weight_decay=t["weight_decay"], betas=tuple(t["betas"]))
    return torch.optim.SGD(params, lr=t["lr"], momentum=0.9, weight_decay=t["weight_decay"])


def _setup_training(job: dict, offline: bool, scratch: Path, proc: _Process) -> _Run:
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
                                      find_unused_parameters=job["algorithm"]["name"] == "dflash")
    return _Run(model, ddp, params, opt, sched, fsdp, step0, curve, step_times)


def _train_steps(job: dict, run: _Run, data: _Data, scratch: Path, proc: _Process,
                 should_stop: Callable[[int], bool] | None) -> int | None:
    """The steps from `run.step0` on, with the curve, progress and periodic checkpoints. Returns the step after
    which `should_stop` ended training early, None when every step ran."""
    import torch

    t = job["train"]
    rank, world = proc.rank, proc.world
    per_rank = t["batch_size"] // world
    run.model.train()
    proc.emit0({"event": "train_start", "total": t["steps"], "done": run.step0, "world_size": world})
    for step in range(run.step0, t["steps"]):
        t_step = time.monotonic()
        torch.manual_seed(t["seed"] * 7919 + step * world + rank)   # DFlash anchors: a function of (seed, step, rank)
        idx = batch_indices(step, len(data.samples), t["batch_size"], t["seed"])[rank * per_rank:(rank + 1) * per_rank]
        stats = _optimizer_step(job, run, data.batch(idx, t["seq_len"], proc.device), proc)
        _record_step(job, run, step, stats, time.monotonic() - t_step, proc)
        if step + 1 != t["steps"] and (step + 1) % t["checkpoint_every"] == 0:
            if rank == 0:
                save_checkpoint(scratch, run.model, run.opt, run.sched, step + 1, run.curve, {"step_times": run.step_times})
                proc.emit0({"event": "checkpoint", "step": step + 1})
            _barrier()
            if should_stop and should_stop(step + 1):
                return step + 1
    return None


def _optimizer_step(job: dict, run: _Run, batch: dict, proc: _Process):
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
    if d := _dist():
        d.all_reduce(stats)
        stats /= proc.world
    return stats


def _record_step(job: dict, run: _Run, step: int, stats, dt: float, proc: _Process) -> None:
    """The step's time, a curve point (every log_every steps, the first and the last), the `step` event."""
    t = job["train"]
    run.step_times.append(round(dt, 4))
    loss_v, acc_v = float(stats[0]), [round(float(a), 4) for a in stats[1:]]
    if (step + 1) % t["log_every"] == 0 or step + 1 == t["steps"] or step == run.step0:
        run.curve.append({"step": step + 1, "loss": round(loss_v, 4), "accuracy": acc_v,
                          "lr": round(run.sched.get_last_lr()[0], 8), "step_s": round(dt, 4)})
    proc.emit0({"event": "step", "step": step + 1, "loss": round(loss_v, 4), "accuracy": acc_v})


def _finish(job, held: list, offline, device, tok, curve, step_times, step0, world, dump_info, rank: int = 0) -> dict:
    """After training: export, the acceptance estimate on held-out prompts, result.json. Rank 0 alone, or under
    FSDP every rank (ModelOpt's estimate is collective there; only rank 0 exports and writes).

    `eval.estimator: runtime` (default): rank 0 exports, frees the training model, and measures the exported draft
    with the BF16 target through specpipe's runtime (`runtime_acceptance`, the validate stage's definition).
    `modelopt`: ModelOpt's `validate_online` on the in-memory model before the export (offline training first
    rebuilds the online model around the trained draft, since the offline model has no decoder layers).
    `held` holds the only reference to the model (so that it can be freed here)."""
    ev = job["eval"]
    estimator = ev.get("estimator", "runtime")
    prompts = read_prompts(job["eval_files"], ev["prompts_per_domain"])
    acc, eval_s = None, 0.0
    if prompts and estimator == "modelopt":
        acc, eval_s = _modelopt_estimate(job, held, offline, device, tok, prompts)
    elif prompts and (job.get("_fsdp") or job.get("shard_target")):
        raise JobError("train_draft.eval.estimator: runtime needs the whole target in one process; with launcher.fsdp "
                       "or shard_target use eval.estimator: modelopt")
    if rank != 0:
        return {}
    export_dir = _export_draft(job, held[0])
    if prompts and estimator == "runtime":
        held.clear()
        _free_memory(device)
        acc, eval_s = _runtime_estimate(job, export_dir, prompts, device)
    result = _result(job, curve, step_times, step0, world, acc, eval_s, dump_info)
    (Path(job["scratch_dir"]) / "result.json").write_text(json.dumps(result, indent=2))
    return result


def _modelopt_estimate(job: dict, held: list, offline: bool, device, tok, prompts: dict) -> tuple[dict, float]:
    """ModelOpt's `acceptance` on the in-memory model (with the online model rebuilt around the trained draft
    first when training was offline; it replaces the model in `held`). Returns (estimate, seconds)."""
    ev = job["eval"]
    t0 = time.monotonic()
    if offline:   # the offline model has no decoder layers: rebuild the online one around the trained draft
        sd = {k: v.detach().clone() for k, v in draft_module(held[0]).state_dict().items()}
        held.clear()
        held.append(build_model(job, False, device))
        draft_module(held[0]).load_state_dict(sd)
    held[0].eval()
    acc = acceptance(held[0], tok, prompts, ev["osl"], ev["draft_len"])
    return acc, time.monotonic() - t0


def _export_draft(job: dict, model) -> Path:
    """`export_speculative_decoding` into `export_dir`, in the export dtype. Returns the directory."""
    from modelopt.torch.export import export_speculative_decoding

    export_dir = Path(job["export_dir"])
    export_dir.mkdir(parents=True, exist_ok=True)
    dtype = _torch_dtype(job["export_dtype"])
    if job["algorithm"]["name"] == "eagle3":
        if job.get("_fsdp"):   # only the draft (and the lm_head it may share) is exported; the target stays sharded
            draft_module(model).to(dtype)
            model.get_output_embeddings().to(dtype)
        else:
            model.to(dtype)   # EagleExporter writes the state dict as is
        export_speculative_decoding(model, export_dir=str(export_dir))
    else:
        export_speculative_decoding(model, dtype=dtype, export_dir=str(export_dir))
    return export_dir


def _free_memory(device) -> None:
    import gc

    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _runtime_estimate(job: dict, export_dir: Path, prompts: dict, device) -> tuple[dict, float]:
    """`runtime_acceptance` of the exported draft with the BF16 target. Returns (estimate, seconds)."""
    ev = job["eval"]
    t0 = time.monotonic()
    acc = runtime_acceptance(job["target_dir"], export_dir, prompts, osl=ev["osl"], draft_len=ev["draft_len"],
                             batch_size=ev.get("batch_size", 4), eos_token_ids=ev.get("eos_token_ids") or [],
                             device=device.type, seed=job["train"]["seed"],
                             expected_capture_layers=capture_layer_ids(job))
    return acc, time.monotonic() - t0


def _result(job: dict, curve: list, step_times: list, step0: int, world: int, acc, eval_s: float, dump_info: dict) -> dict:
    """result.json: the run's figures, the curve and the acceptance estimate."""
    ts = step_times[1:] or step_times   # the first step pays one-time setup
    result = {
        "steps": job["train"]["steps"], "resumed_from_step": step0, "world_size": world,
        "final_loss": curve[-1]["loss"] if curve else None,
        "final_accuracy": curve[-1]["accuracy"] if curve else None,
        "step_ms_mean": round(1000 * sum(ts) / max(1, len(ts)), 2),
        "train_seconds": round(sum(step_times), 2), "eval_seconds": round(eval_s, 2),
        "curve": curve, "acceptance": acc, "d2t": job.get("d2t_stats"), **dump_info,
    }
    if job.get("_fsdp"):
        result["fsdp"] = job["_fsdp"]
    return result


# ------------------------------------------------------------------------------------------- entry point


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Train and export a speculative-decoding draft (one torchrun rank).")
    p.add_argument("--job", required=True, help="job JSON written by the train_draft stage")
    args = p.parse_args(argv)
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1)   # `kill -USR1 <pid>` prints every thread's stack to stderr
    job = json.loads(Path(args.job).read_text())
    try:
        train(job, emit=_emit_stdout)
    except JobError as e:
        print(PROGRESS_PREFIX + json.dumps({"event": "error", "message": str(e)}), flush=True)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
