"""FSDP2 of the frozen target (`launcher.fsdp` under torchrun with several processes): the target is never loaded
whole. `load_target_skeleton` builds it on the meta device with only what lies outside its decoder layers read
from the safetensors, `shard_target_layers` shards each decoder layer over all processes and fills each process's
rows from the checkpoint, and the replicated draft's gradients are all-reduced (`allreduce_grads`)."""
from __future__ import annotations

import json
from pathlib import Path

from runtime.training.dist import dist_group, rank_world
from runtime.training.job import JobError


class TargetCheckpoint:
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
    ckpt = TargetCheckpoint(job["target_dir"])
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
    return bool(job.get("fsdp")) and dist_group() is not None and rank_world()[1] > 1


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

    _, world = rank_world()
    base = model.get_decoder()
    layers = list(base.layers)
    prefix = next(n for n, m in model.named_modules() if m is base.layers)
    mesh = init_device_mesh(device.type, (world,))
    ckpt = TargetCheckpoint(target_dir)
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
    for p, g in zip(params, grads, strict=True):
        n = g.numel()
        p.grad = flat[off: off + n].view_as(p).clone()
        off += n

