"""The quality of an exported FP8 checkpoint, run through `runtime.engine.fp8` (TensorRT-LLM's arithmetic):
against the unquantized target (perplexity, next-token top-1 agreement, KL) and against ModelOpt's fake-quant
model before export (end to end, layer by layer and module by module on the same inputs), next to the FP8 model's
own noise floor."""
from __future__ import annotations

import contextlib
import math

from runtime.quant.modules import decoder_layers, quantized_linears


def scored_positions(s: dict, device):
    """Next-token targets and the mask of scored positions (loss_mask of the target token; all when none)."""
    import torch

    tgt = s["input_ids"][1:].to(device)
    mask = s["loss_mask"][1:].to(device).bool()
    return tgt, (mask if mask.any() else torch.ones_like(tgt, dtype=torch.bool))


def _kl_top1(a, b) -> tuple[float, int, int]:
    """(sum of KL(softmax a || softmax b), argmax agreements, positions) over the rows of two logit matrices."""
    la, lb = a.float().log_softmax(-1), b.float().log_softmax(-1)
    return (la.exp() * (la - lb)).sum().item(), int((a.argmax(-1) == b.argmax(-1)).sum()), a.shape[0]


def fake_quant_reference(model, samples: list[dict], *, device=None, keep: int = 4, capture_tokens: int = 128,
                         capture_rows: int = 32) -> dict:
    """Run ModelOpt's fake-quant model BEFORE export (export rewrites its weights to FP8 in place) on the first
    `keep` samples: their logits and perplexity. For the first sample (<= `capture_tokens` tokens) it also keeps,
    to replay on the exported checkpoint with exactly the same inputs: the input, keyword arguments and output of
    every decoder layer (`layerwise_agreement`), and the input and output rows (the first `capture_rows` tokens)
    of every quantized linear (`modulewise_agreement`)."""
    import torch

    device = device or torch.device("cpu")
    nll, n, logits = 0.0, 0, []
    _, layers = decoder_layers(model)
    caught: dict[int, list] = {}
    mods: dict[str, tuple] = {}

    def pre(i):
        def hook(mod, args, kwargs):
            h = args[0] if args else kwargs["hidden_states"]
            kw = {k: v for k, v in kwargs.items() if k != "hidden_states"}
            kw.update(past_key_values=None, use_cache=False)
            caught[i] = [h.detach().clone(), kw, None]
        return hook

    def post(i):
        def hook(mod, args, kwargs, out):
            o = out[0] if isinstance(out, tuple) else out
            caught[i][2] = o.detach().clone()
        return hook

    def lin_hook(name):
        def hook(mod, args, out):
            x = args[0]
            iq = getattr(mod, "input_quantizer", None)
            # the activation ModelOpt's GEMM saw, quantized in its own shape (per-token amax reduces the last dim)
            xq = iq(x) if iq is not None and iq.is_enabled else x
            mods[name] = tuple(t.reshape(-1, t.shape[-1])[:capture_rows].detach().clone() for t in (x, xq, out))
        return hook

    with torch.no_grad():
        hooks = [layer.register_forward_pre_hook(pre(i), with_kwargs=True) for i, layer in enumerate(layers)]
        hooks += [layer.register_forward_hook(post(i), with_kwargs=True) for i, layer in enumerate(layers)]
        hooks += [m.register_forward_hook(lin_hook(nm)) for nm, m in quantized_linears(model).items()]
        try:
            if samples:
                model(input_ids=samples[0]["input_ids"][:capture_tokens][None].to(device), use_cache=False)
        finally:
            for h in hooks:
                h.remove()
        for s in samples[:keep]:
            lf = model(input_ids=s["input_ids"][None].to(device), use_cache=False).logits[0, :-1].float()
            tgt, mask = scored_positions(s, device)
            nll -= lf.log_softmax(-1)[mask].gather(1, tgt[mask][:, None]).sum().item()
            n += int(mask.sum())
            logits.append(lf.cpu())
    return {"ppl": math.exp(nll / max(n, 1)), "logits": logits, "layers": [caught[i] for i in sorted(caught)],
            "modules": mods}


def _rel(a, b) -> float:
    a, b = a.float(), b.float().to(a.device)
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _near_boundary(v, rel: float = 1e-5):
    """True where E4M3 rounding of v (already divided by its scale) changes within +-rel: v sits on (or within
    float32 noise of) a rounding boundary, where two correct arithmetics may pick different neighbours."""

    from runtime.engine.fp8 import FP8_DTYPE, FP8_MAX

    lo = (v * (1 - rel)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float()
    hi = (v * (1 + rel)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float()
    return lo != hi


def modulewise_agreement(test, captured: dict) -> dict[str, dict]:
    """Every FP8 linear of `test` (the exported checkpoint in runtime.engine.fp8) against ModelOpt's fake-quant module,
    both fed the same input rows, without any amplification by later layers:

    - `act_mismatch`: activation E4M3 codes that differ although the value is not at a rounding boundary (must be
      0); `act_boundary`: codes that differ at a boundary, where ModelOpt's x * (448 / amax) and TensorRT-LLM's
      x * (1 / scale) (static) or x / scale (per token) break an exact tie differently (activations that are
      themselves FP8 values, e.g. the first token's attention output, hit such ties);
    - `gemm_rel_err`: the module's output from ModelOpt's quantized activation and the checkpoint's weight and
      scales, against ModelOpt's output (weights, scales and GEMM: float rounding only, ~1e-7);
    - `out_rel_err`: the executor's own output against ModelOpt's (includes the boundary flips)."""
    import torch
    import torch.nn.functional as F

    from runtime.engine.fp8 import FP8_DTYPE, FP8_MAX, FP8_MIN_TOKEN_SCALE, FP8Linear

    out = {}
    mods = dict(test.named_modules())
    with torch.no_grad():
        for name, (x, xq_fq, y) in captured.items():
            m = mods.get(name)
            if not isinstance(m, FP8Linear):   # quantized in ModelOpt but not FP8 in the checkpoint
                out[name] = {"act_mismatch": -1, "act_boundary": 0, "gemm_rel_err": float("inf"),
                             "out_rel_err": float("inf")}
                continue
            dev = m.weight.device
            x, xq_fq, y = x.to(dev).float(), xq_fq.to(dev).float(), y.to(dev).float()
            if m.activation == "dynamic_per_token":
                s = torch.clamp(x.abs().amax(-1, keepdim=True) / FP8_MAX, min=FP8_MIN_TOKEN_SCALE)
                v = x / s
            elif m.activation == "static":
                s = m.input_scale.float()
                v = x * (1.0 / s)
            else:
                s, v = None, None
            if s is not None:
                code_rt = v.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float()
                code_fq = (xq_fq / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float()
                diff = code_rt != code_fq
                edge = _near_boundary(v)
                mismatch, boundary = int((diff & ~edge).sum()), int((diff & edge).sum())
            else:
                mismatch = int((xq_fq != x).sum())
                boundary = 0
            bias = None if m.bias is None else m.bias.float()
            gemm = F.linear(xq_fq, m.dequantized_weight().float(), bias)
            out[name] = {"act_mismatch": mismatch, "act_boundary": boundary, "gemm_rel_err": _rel(gemm, y),
                         "out_rel_err": _rel(m(x), y)}
    return out


def layerwise_agreement(test, captured: list) -> list[float]:
    """Relative L2 error ||test_layer(x) - fq_layer(x)|| / ||fq_layer(x)|| of every decoder layer of `test` (the
    exported checkpoint in runtime.engine.fp8) fed exactly the input ModelOpt's fake-quant layer got: the GEMMs plus the
    attention with its FP8 KV cache. A rounding flip that `modulewise_agreement` allows can be amplified inside a
    sensitive layer (softmax, SwiGLU); a systematic error shows in every layer."""
    import torch

    _, layers = decoder_layers(test)
    errs = []
    with torch.no_grad():
        for layer, (h, kw, ref) in zip(layers, captured, strict=False):
            dev = next(iter(list(layer.parameters()) + list(layer.buffers()))).device
            kw = {k: (v.to(dev) if torch.is_tensor(v) else tuple(t.to(dev) for t in v) if isinstance(v, tuple) else v)
                  for k, v in kw.items()}
            out = layer(h.to(dev), **kw)
            errs.append(_rel((out[0] if isinstance(out, tuple) else out), ref))
    return errs


NOISE_REL = 2.0 ** -20   # relative perturbation of the input embeddings for the FP8 noise floor (~1e-6)


def noise_floor(test, samples: list[dict], base_logits: list, *, device=None) -> tuple[float, float]:
    """(top-1 agreement, mean KL) between `test` and itself with its input embeddings scaled by 1 + 2^-20.
    The unquantized model does not notice such a change (top-1 1.0, KL ~1e-10 on SmolLM2); an FP8 model turns it
    into whole E4M3 rounding steps that grow over the layers. It is the level below which two FP8 executions of
    the same checkpoint (a GPU kernel and an emulation, or two batch shapes) cannot be expected to agree."""
    import torch

    device = device or torch.device("cpu")
    emb = test.get_input_embeddings()
    h = emb.register_forward_hook(lambda mod, args, out: out * (1.0 + NOISE_REL))
    kl = agree = n = 0.0
    try:
        with torch.no_grad():
            for s, base in zip(samples, base_logits, strict=True):
                lp = test(input_ids=s["input_ids"][None].to(device), use_cache=False).logits[0, :-1].float().to(device)
                _, mask = scored_positions(s, device)
                a, g, k = _kl_top1(base.to(device)[mask], lp[mask])
                kl, agree, n = kl + a, agree + g, n + k
    finally:
        h.remove()
    return agree / max(n, 1), kl / max(n, 1)


def measure_quality(ref, test, samples: list[dict], *, device=None, fake_quant: dict | None = None, progress=None) -> dict:
    """Quality of `test` (the FP8 model) against `ref` (unquantized) on held-out samples.

    Scored positions: those whose target token has loss_mask 1 (all positions when a sample has none).
    ppl = exp(mean next-token NLL); top-1 agreement = share of positions where both argmaxes agree;
    mean KL = mean over positions of KL(p_ref || p_test), nats; max_abs_logit_diff = the largest |logit change|
    FP8 causes. With `fake_quant` (`fake_quant_reference`): export fidelity on its samples: ModelOpt's fake-quant
    perplexity, top-1 agreement and mean KL(p_fakequant || p_test) at the scored positions, the largest |logit
    difference|, next to the FP8 noise floor (`noise_floor`) and the layer-wise relative errors
    (`layerwise_agreement`)."""
    import torch

    device = device or torch.device("cpu")
    fq_logits = (fake_quant or {}).get("logits", [])
    sums = {"nll_ref": 0.0, "nll_test": 0.0, "kl": 0.0, "agree": 0.0, "n": 0, "max_effect": 0.0, "per_sample": []}
    fid = {"kl": 0.0, "agree": 0.0, "n": 0.0, "max_diff": 0.0, "test_logits": []}
    ctxm = progress(total=len(samples), desc="quality") if progress else contextlib.nullcontext()
    with torch.no_grad(), ctxm as bar:
        for i, s in enumerate(samples):
            ids = s["input_ids"][None].to(device)
            lr = ref(input_ids=ids).logits[0, :-1].float().to(device)    # a model spread over GPUs may
            lt = test(input_ids=ids).logits[0, :-1].float().to(device)   # return them on its last one
            tgt, mask = scored_positions(s, device)
            if i < len(fq_logits):
                _add_fidelity(fid, fq_logits[i].to(device), lt, mask)
            _add_sample(sums, lr, lt, tgt, mask)
            if progress:
                bar.update(1)
    out = _quality_summary(sums, len(samples))
    if fake_quant is not None:
        out.update(_export_fidelity(test, samples, fake_quant, fid, device=device))
    return out


def _add_sample(sums: dict, lr, lt, tgt, mask) -> None:
    """Add one sample's reference logits `lr` and FP8 logits `lt` to the running sums of `measure_quality`."""
    sums["max_effect"] = max(sums["max_effect"], (lr - lt).abs().max().item())
    lpr, lpt = lr.log_softmax(-1)[mask], lt.log_softmax(-1)[mask]
    t = tgt[mask]
    a = -lpr.gather(1, t[:, None]).sum().item()
    b = -lpt.gather(1, t[:, None]).sum().item()
    sums["nll_ref"] += a
    sums["nll_test"] += b
    sums["kl"] += (lpr.exp() * (lpr - lpt)).sum().item()
    sums["agree"] += (lpr.argmax(-1) == lpt.argmax(-1)).sum().item()
    k = int(mask.sum())
    sums["n"] += k
    sums["per_sample"].append([round(math.exp(a / k), 4), round(math.exp(b / k), 4)])


def _add_fidelity(fid: dict, lf, lt, mask) -> None:
    """Add one sample's fake-quant logits `lf` against the exported checkpoint's `lt` to the fidelity sums."""
    fid["max_diff"] = max(fid["max_diff"], (lf - lt).abs().max().item())
    a, g, k = _kl_top1(lf[mask], lt[mask])
    fid["kl"], fid["agree"], fid["n"] = fid["kl"] + a, fid["agree"] + g, fid["n"] + k
    fid["test_logits"].append(lt.cpu())


def _quality_summary(sums: dict, n_samples: int) -> dict:
    """Perplexities, top-1 agreement, mean KL and the largest logit change from the sums of `measure_quality`."""
    n = sums["n"]
    ppl_r, ppl_t = math.exp(sums["nll_ref"] / n), math.exp(sums["nll_test"] / n)
    return {"ppl_bf16": round(ppl_r, 4), "ppl_fp8": round(ppl_t, 4), "ppl_increase": round(ppl_t / ppl_r - 1, 6),
            "top1_agreement": round(sums["agree"] / n, 6), "mean_kl": round(sums["kl"] / n, 8), "eval_tokens": n,
            "eval_samples": n_samples, "max_abs_logit_diff": round(sums["max_effect"], 6),
            "per_sample_ppl": sums["per_sample"]}


def _export_fidelity(test, samples: list[dict], fake_quant: dict, fid: dict, *, device) -> dict:
    """The exported checkpoint against ModelOpt's fake-quant model: end to end (from the sums), next to the FP8
    noise floor, layer by layer and module by module."""
    kept_test = fid["test_logits"]
    floor_top1, floor_kl = noise_floor(test, samples[:len(kept_test)], kept_test, device=device)
    errs = layerwise_agreement(test, fake_quant.get("layers") or [])
    merrs = modulewise_agreement(test, fake_quant.get("modules") or {})
    fq_n = fid["n"]
    return {"ppl_fakequant": round(fake_quant["ppl"], 4),
            "export_vs_fakequant_max_abs_logit_diff": round(fid["max_diff"], 6),
            "export_vs_fakequant_top1_agreement": round(fid["agree"] / max(1, fq_n), 6),
            "export_vs_fakequant_kl": round(fid["kl"] / max(1, fq_n), 8),
            "export_vs_fakequant_samples": len(fake_quant.get("logits", [])),
            "noise_floor_top1_agreement": round(floor_top1, 6), "noise_floor_kl": round(floor_kl, 8),
            "layerwise_rel_err": [round(e, 8) for e in errs],
            "layerwise_max_rel_err": round(max(errs), 8) if errs else None,
            "layerwise_median_rel_err": round(sorted(errs)[len(errs) // 2], 8) if errs else None,
            "modulewise_checked": len(merrs),
            "modulewise_act_mismatch": sum(abs(v["act_mismatch"]) for v in merrs.values()),
            "modulewise_act_boundary": sum(v["act_boundary"] for v in merrs.values()),
            "modulewise_max_gemm_rel_err": max((v["gemm_rel_err"] for v in merrs.values()), default=None),
            "modulewise_max_out_rel_err": max((v["out_rel_err"] for v in merrs.values()), default=None)}
