"""The model a draft trains in: the target converted by ModelOpt (`mtsp.convert`, EAGLE-3 or DFlash, the base
frozen) with the draft's architecture taken from the target's shape; the target loaded whole, spread over the GPUs
of one process (`shard_target`), without its decoder layers (offline) or sharded with FSDP2 (`runtime.training.fsdp`)."""
from __future__ import annotations

import copy

from runtime.algorithms import dflash, eagle3
from runtime.algorithms.dflash import DFLASH
from runtime.algorithms.eagle3 import EAGLE3
from runtime.training import objectives
from runtime.training.fsdp import fsdp_active, load_target_skeleton, shard_target_layers
from runtime.training.job import target_dtype, torch_dtype


def convert_config(job: dict, offline: bool) -> tuple[str, dict]:
    """The ModelOpt mode name and config for `mtsp.convert`, from the job's algorithm options."""
    return _CONVERT[job["algorithm"]["name"]](job, offline)


def _eagle3_config(job: dict, offline: bool) -> tuple[str, dict]:
    import modelopt.torch.speculative as mtsp

    a, tgt = job["algorithm"], job["target"]
    cfg = copy.deepcopy(mtsp.EAGLE3_DEFAULT_CFG["config"])
    arch = cfg["eagle_architecture_config"]
    arch.update({
        "num_hidden_layers": a["draft_layers"],
        "intermediate_size": a["intermediate_size"] or tgt["intermediate_size"],
        "num_attention_heads": tgt["num_attention_heads"],
        "num_key_value_heads": tgt["num_key_value_heads"],
        "head_dim": tgt["head_dim"],
        eagle3.CAPTURE_KEY: list(a["aux_layer_ids"]),     # ModelOpt's input key is the export's
    })
    if a["draft_vocab_size"] and a["draft_vocab_size"] != tgt["vocab_size"]:
        arch["draft_vocab_size"] = a["draft_vocab_size"]
    cfg.update({"eagle_ttt_steps": a["ttt_steps"], "eagle_loss_decay_factor": a["loss_decay_factor"],
                "eagle_use_torch_compile": job["torch_compile"], "eagle_offline": offline,
                "eagle_export_rope_scaling": job["export_rope_scaling"] or {}})
    return "eagle", cfg


def _dflash_config(job: dict, offline: bool) -> tuple[str, dict]:
    import modelopt.torch.speculative as mtsp

    a, tgt = job["algorithm"], job["target"]
    cfg = copy.deepcopy(mtsp.DFLASH_DEFAULT_CFG["config"])
    cfg.update({
        "dflash_block_size": a["block_size"], "dflash_mask_token_id": a["mask_token_id"],
        "dflash_num_anchors": a["num_anchors"], "dflash_use_torch_compile": job["torch_compile"],
        "dflash_loss_objective": a["loss_objective"], "dflash_loss_decay_factor": a["loss_decay_factor"],
        "dflash_offline": offline, "dflash_export_rope_scaling": job["export_rope_scaling"] or {},
        # Qwen3Config defaults (32 heads, 22016 MLP) would win over the target's shape otherwise.
        "dflash_architecture_config": {
            "num_hidden_layers": a["draft_layers"], dflash.CAPTURE_KEY: list(a["target_layer_ids"]),
            "intermediate_size": a["intermediate_size"] or tgt["intermediate_size"],
            "num_attention_heads": tgt["num_attention_heads"], "num_key_value_heads": tgt["num_key_value_heads"],
            "head_dim": tgt["head_dim"],
        },
    })
    return "dflash", cfg


def _eagle3_extras(model, job: dict) -> None:
    """EAGLE-3's objective (ModelOpt's, or the LK losses) and, with a reduced vocabulary, its d2t map."""
    objectives.install(model, job["algorithm"].get("loss", "kl"), job["algorithm"].get("lk_eta", 3.0),
                       compile_loss=bool(job["torch_compile"]))
    if job.get("d2t_path"):
        from modelopt.torch.speculative.plugins.hf_eagle import HFEagleModel

        HFEagleModel.load_draft_vocab_cache(model, job["d2t_path"])


# ModelOpt's conversion per algorithm, and what each installs after it
_CONVERT = {EAGLE3.name: _eagle3_config, DFLASH.name: _dflash_config}
_EXTRAS = {EAGLE3.name: _eagle3_extras}


def build_model(job: dict, offline: bool, device):
    """The target converted for draft training. Offline: the target without its decoder layers. With
    `fsdp` (several processes) the target's decoder layers end up sharded over all of them."""
    import modelopt.torch.speculative as mtsp
    import torch

    dtype = torch_dtype(job["train_dtype"])
    tdtype = target_dtype(job)
    fsdp = fsdp_active(job) and not offline   # the offline model has no decoder layers to shard
    if offline:
        from modelopt.torch.speculative.utils import load_vlm_or_llm

        model = load_vlm_or_llm(job["target_dir"], use_offline_training=True, dtype=tdtype,
                                trust_remote_code=job["trust_remote_code"])
    elif fsdp:
        model = load_target_skeleton(job, device, tdtype)
    else:
        model = load_full_target(job, device, tdtype)
    if offline or not (job.get("shard_target") or fsdp):
        model.to(device)
    mode, cfg = convert_config(job, offline)
    torch.manual_seed(job["train"]["seed"])  # the draft's initial weights
    mtsp.convert(model, [(mode, cfg)])
    if tdtype != dtype:   # ModelOpt builds the draft in the base model's dtype: its master weights stay in `dtype`
        draft_module(model).to(dtype)
    if extras := _EXTRAS.get(job["algorithm"]["name"]):
        extras(model, job)
    if fsdp:
        job.setdefault("_fsdp", shard_target_layers(model, device, job["target_dir"]))
    return model


def load_full_target(job: dict, device, dtype):
    """The full target on `device`; with `shard_target` its layers spread over all visible GPUs
    (transformers' device_map="auto"; one process) for a target larger than one GPU."""
    from transformers import AutoModelForCausalLM

    kw = {"device_map": "auto"} if job.get("shard_target") else {}
    model = AutoModelForCausalLM.from_pretrained(job["target_dir"], dtype=dtype, trust_remote_code=job["trust_remote_code"], **kw)
    return model if kw else model.to(device)


def draft_module(model):
    return model.eagle_module if hasattr(model, "eagle_module") else model.dflash_module

