"""FP8 post-training quantization of an exported EAGLE-3 draft with ModelOpt: ModelOpt's EAGLE-3 model rebuilt
around the target from the exported draft (verified by re-exporting it bit for bit), only the draft part quantized
(per-tensor FP8) and calibrated with the training-time forward (every TTT step), exported with
`export_speculative_decoding`, and the written draft run back through `runtime.engine.fp8` as the export's
consistency check. Failures are `runtime.errors.RuntimeFailure` (`DraftRebuildError` when the exported draft
cannot be rebuilt)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from runtime.algorithms import eagle3
from runtime.algorithms.export import read_export
from runtime.errors import RuntimeFailure
from runtime.files import publish_tree
from runtime.quant.export import cast_high_precision, copy_tokenizer
from runtime.quant.ptq import CPU_RUN, QuantRun, align_with_deployment, place_model, quant_config

# ModelOpt's EAGLE-3 fc module (the pattern that disables its weight and input quantizers)
EAGLE_FC = "*eagle_module.fc"


class DraftRebuildError(RuntimeFailure):
    """The exported draft is not one this module can rebuild as ModelOpt's EAGLE-3 module (another architecture,
    already FP8, weights that do not load or do not re-export identically)."""


def _eagle_cfg_from_export(dcfg: dict, has_lm_head: bool) -> dict:
    """The ModelOpt EAGLE-3 convert config that produced an exported draft config.json."""
    import copy

    import modelopt.torch.speculative as mtsp

    cfg = copy.deepcopy(mtsp.EAGLE3_DEFAULT_CFG["config"])
    arch = cfg["eagle_architecture_config"]
    for k in ("num_hidden_layers", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
              "hidden_act", "rms_norm_eps", "mlp_bias", "attention_bias", "initializer_range", "draft_vocab_size"):
        if dcfg.get(k) is not None:
            arch[k] = dcfg[k]
    for k, v in (dcfg.get("eagle_config") or {}).items():
        if k in arch and v is not None:
            arch[k] = v
    theta = dcfg.get("rope_theta") or (dcfg.get("rope_scaling") or {}).get("rope_theta") or arch["rope_theta"]
    # the exported rope_scaling is ModelOpt's export-time override (YaRN); training used the default rope
    arch["rope_scaling"] = {"rope_type": "default", "rope_theta": theta}
    arch["rope_theta"] = theta
    arch["has_lm_head"] = has_lm_head
    cfg["eagle_use_torch_compile"] = False
    return cfg


def _eagle_model(target_dir: Path, draft_dir: Path, device, dtype):
    """Target + ModelOpt EAGLE-3 module rebuilt from an exported draft, weights loaded and verified: re-exporting
    the rebuilt module must give back the draft's tensors bit for bit."""
    import modelopt.torch.speculative as mtsp
    import torch
    from transformers import AutoModelForCausalLM

    from runtime.engine.fp8 import FP8_DTYPE, read_safetensors

    dcfg = json.loads((draft_dir / "config.json").read_text())
    if eagle3.ARCHITECTURE not in (dcfg.get("architectures") or []):
        raise DraftRebuildError(f"fp8 supports EAGLE-3 drafts ({eagle3.ARCHITECTURE}); {draft_dir} is "
                         f"{dcfg.get('architectures')}. Use quantize.draft: none")
    if problems := eagle3.check_export(read_export(draft_dir, dcfg)):   # what a valid draft is: runtime/algorithms/
        raise DraftRebuildError(f"{problems[0].message} (quantize.draft: none skips the draft's FP8)")
    dsd = read_safetensors(draft_dir)
    if any(v.dtype == FP8_DTYPE for v in dsd.values()):
        raise DraftRebuildError(f"{draft_dir} is already FP8")
    base = place_model(AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype), device)
    base_head = base.get_output_embeddings().weight
    lm = dsd.get("lm_head.weight")
    has_lm_head = lm is not None and (lm.shape != base_head.shape or not torch.equal(lm.to(base_head.dtype).cpu(),
                                                                                     base_head.detach().cpu()))
    mtsp.convert(base, [("eagle", _eagle_cfg_from_export(dcfg, has_lm_head))])
    esd = {f"eagle_module.{k}": v for k, v in dsd.items() if k != "lm_head.weight" or has_lm_head}
    res = base.load_state_dict(esd, strict=False)
    missing = [k for k in res.missing_keys if k.startswith("eagle_module.")]
    if missing or res.unexpected_keys:
        raise DraftRebuildError(f"could not rebuild the EAGLE-3 module from {draft_dir}: missing {missing[:5]}, "
                         f"unexpected {res.unexpected_keys[:5]}")
    again = base.get_exporter()._extract_state_dict(base.state_dict())
    diff = sorted(set(again) ^ set(dsd)) + [k for k in dsd if k in again and not torch.equal(again[k].to(dsd[k].dtype).cpu(),
                                                                                             dsd[k])]
    if diff:
        raise DraftRebuildError(f"the rebuilt EAGLE-3 module does not reproduce {draft_dir} (differs at {diff[:5]}); "
                         "the draft was exported with options this stage does not know")
    return base.eval(), dcfg, has_lm_head


def _draft_eval(model, samples, device) -> tuple[float, float]:
    """(top-1 accuracy of the draft's first step vs the target's next-token argmax, mean EAGLE loss), eval forward."""
    import torch

    acc = loss = 0.0
    with torch.no_grad():
        for s in samples:
            out = model(input_ids=s["input_ids"][None].to(device), loss_mask=s["loss_mask"][None].to(device))
            acc += out.train_acc[0][0]
            loss += float(out.eagle_loss)
    return acc / len(samples), loss / len(samples)


@dataclass(frozen=True)
class DraftRecipe:
    """How an EAGLE-3 draft is quantized: its KV cache ("fp8" or "none"), the module patterns kept in high precision,
    and whether `fc` is FP8 (False: `EAGLE_FC` stays BF16)."""

    kv_cache: str = "fp8"
    exclude: tuple = ()
    fc_fp8: bool = True


def quantize_eagle_checkpoint(target_dir: Path, draft_dir: Path, out: Path, calib, heldout, *,
                              recipe: DraftRecipe = DraftRecipe(), run: QuantRun = CPU_RUN) -> dict:
    """FP8-quantize an exported EAGLE-3 draft: rebuild ModelOpt's EAGLE model around the target, quantize only the
    draft (`eagle_module`), calibrate with the training-time forward (every TTT step runs the draft on its own
    outputs, as speculative decoding does), export with `export_speculative_decoding`, keep the original draft
    config (plus `quantization_config`) and tokenizer. Then load the written draft back through `runtime.engine.fp8`
    and compare its EAGLE loss with the fake-quant model's: the export's consistency check. `fc_fp8=False` keeps
    `fc` in high precision (`EAGLE_FC`: what TensorRT-LLM 1.2's loader reads, runtime.trtllm.compat eagle3_fc_quant).
    `run.progress` is not used."""
    import modelopt.torch.quantization as mtq
    import torch

    kv_cache, exclude, fc_fp8 = recipe.kv_cache, recipe.exclude, recipe.fc_fp8
    device, dtype, log = run.device, run.dtype, run.log

    device = device or torch.device("cpu")
    dtype = dtype or torch.float32
    model, dcfg, has_lm_head = _eagle_model(target_dir, draft_dir, device, dtype)
    acc_bf16, loss_bf16 = _draft_eval(model, heldout, device)
    others = [n for n, _ in model.named_children() if n != "eagle_module"]
    excluded = list(exclude) + ([] if fc_fp8 else [EAGLE_FC])
    qcfg = quant_config("fp8", kv_cache, excluded, only_under="eagle_module", other_top_modules=others)

    def forward_loop(m):
        m.train()  # training forward: all TTT steps; no gradients, no parameter updates
        with torch.no_grad():
            for s in calib:
                # ModelOpt caches the training-time-test masks per step for one sequence length (training pads
                # to a fixed length); calibration samples vary in length, so drop the cache each time
                if isinstance(getattr(m, "_cached_attn_blk_masks", None), dict):
                    m._cached_attn_blk_masks = {}
                m(input_ids=s["input_ids"][None].to(device), loss_mask=s["loss_mask"][None].to(device))
        m.eval()

    model = mtq.quantize(model, qcfg, forward_loop)
    model.eval()
    align_with_deployment(model.eagle_module, log=log)  # one scale per fused q/k/v, gate/up; the export's codes
    acc_fp8, loss_fp8 = _draft_eval(model, heldout, device)
    _export_eagle_draft(model, dcfg, draft_dir, out)
    # consistency: the written FP8 draft, run through runtime.engine.fp8, against ModelOpt's fake-quant draft
    loss_export, info = _exported_draft_loss(target_dir, draft_dir, out, heldout, has_lm_head=has_lm_head,
                                             device=device, dtype=dtype)
    m = {"draft_top1_bf16": round(acc_bf16, 6), "draft_top1_fp8": round(acc_fp8, 6),
         "draft_loss_bf16": round(loss_bf16, 6), "draft_loss_fp8": round(loss_fp8, 6),
         "draft_loss_fp8_exported": round(loss_export, 6),
         "draft_export_vs_fakequant_loss_diff": round(abs(loss_export - loss_fp8), 8),
         "draft_fp8_linears": len(info["fp8_linears"]), "draft_kv_scales": info["kv_scales"], "draft_fc_fp8": fc_fp8,
         "calibration_forward": "training-mode (all TTT steps)"}
    if log:
        log.info("draft FP8: first-step top-1 vs target %.4f -> %.4f, EAGLE loss %.4f -> %.4f (exported %.4f)",
                 acc_bf16, acc_fp8, loss_bf16, loss_fp8, loss_export)
    return m


def _export_eagle_draft(model, dcfg: dict, draft_dir: Path, out: Path) -> None:
    """`export_speculative_decoding` of the quantized EAGLE model into `out`, with the original draft config (plus
    `quantization_config`), the draft's own dtypes for high-precision tensors, and its tokenizer."""
    import torch
    from modelopt.torch.export import export_speculative_decoding

    from runtime.engine.fp8 import read_safetensors

    export_speculative_decoding(model, dtype=torch.float32, export_dir=out)  # exact FP8 weights; see export.export_target
    exported = json.loads((out / "config.json").read_text())
    dcfg = dict(dcfg, quantization_config=exported.get("quantization_config"))
    (out / "config.json").write_text(json.dumps(dcfg, indent=4))   # RoPE as train_draft normalized it
    orig = read_safetensors(draft_dir)
    cast_high_precision(out, lambda k, v: orig[k].dtype if k in orig else v.dtype)
    copy_tokenizer(draft_dir, out)
    publish_tree(out)


def _exported_draft_loss(target_dir: Path, draft_dir: Path, out: Path, heldout, *, has_lm_head: bool, device,
                         dtype) -> tuple[float, dict]:
    """(EAGLE loss on `heldout`, load info) of the FP8 draft written to `out`, run through runtime.engine.fp8 inside
    a freshly rebuilt EAGLE model."""
    from runtime.engine.fp8 import enable_fp8_kv, load_fp8_state_dict, read_safetensors

    check_model, _, _ = _eagle_model(target_dir, draft_dir, device, dtype)
    sd = read_safetensors(out)
    if not has_lm_head:
        sd.pop("lm_head.weight", None)
    info = load_fp8_state_dict(check_model.eagle_module, sd, compute_dtype=dtype)
    if info["kv_scales"]:
        enable_fp8_kv(check_model.eagle_module)
    _, loss_export = _draft_eval(check_model, heldout, device)
    return loss_export, info
