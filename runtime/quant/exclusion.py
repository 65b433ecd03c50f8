"""The per-layer BF16 exclusion search: the fewest decoder layers to keep in high precision so that an FP8 model
meets a perplexity target on calibration samples (`search_exclusions`), run on the unquantized target with each
layer's linears switchable to the exact FP8 codes and scales the export writes (`SearchModel`)."""
from __future__ import annotations

import contextlib
import math
import re
import time
from pathlib import Path

from runtime.errors import RuntimeFailure
from runtime.quant.modules import decoder_layers, quantized_linears
from runtime.quant.ptq import CPU_RUN, RECIPES, QuantRun
from runtime.quant.quality import scored_positions


class SearchModel:
    """The unquantized target with, per decoder layer, its linears switchable between the original (BF16) modules
    and `runtime.engine.fp8.FP8Linear`s built from the calibrated ModelOpt model (the same codes and scales the export
    writes), plus the FP8 KV cache (unit scales, as TensorRT-LLM runs it) on every layer."""

    def __init__(self, fq_model, target_dir: Path, *, per_token: bool, kv_cache: str, device, dtype):
        """`per_token`: the recipe quantizes activations per token at run time (no static input scales)."""
        import torch
        from transformers import AutoModelForCausalLM

        from runtime.engine.fp8 import FP8_MAX, FP8Linear, quantize_weight
        from runtime.engine.placement import PlacementError, place

        try:
            self.model = place(AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype), device).eval()
        except PlacementError as e:
            raise RuntimeFailure(str(e)) from None
        self.prefix, self.layers = decoder_layers(self.model)
        mods = dict(self.model.named_modules())
        self.units: dict[int, list[tuple[str, object, object]]] = {}
        for name, m in quantized_linears(fq_model).items():
            match = re.match(rf"{re.escape(self.prefix)}\.(\d+)\.", name)
            if match is None or name not in mods:
                continue  # not inside a decoder layer: never a search unit
            scale = (m.weight_quantizer.amax.float() / FP8_MAX).reshape(-1)
            iq = getattr(m, "input_quantizer", None)
            static = None if per_token or iq is None or not iq.is_enabled else (iq.amax.float() / FP8_MAX).reshape(())
            with torch.no_grad():
                lin = FP8Linear(quantize_weight(m.weight.detach(), scale), scale, static,
                                None if m.bias is None else m.bias.detach(), dynamic_per_token=per_token,
                                compute_dtype=dtype).to(device)
            self.units.setdefault(int(match.group(1)), []).append((name, mods[name], lin))
        self.kv = kv_cache == "fp8"
        self.forwards = 0.0

    def set(self, quantized: set[int], kv: bool) -> None:
        """Quantize exactly the decoder layers in `quantized`; FP8 KV on every layer when `kv`."""
        import torch

        from runtime.engine.fp8 import KV_ATTN_IMPL, enable_fp8_kv

        for i, entries in self.units.items():
            for name, orig, lin in entries:
                parent, _, child = name.rpartition(".")
                setattr(self.model.get_submodule(parent), child, lin if i in quantized else orig)
        want = kv and self.kv
        if want:
            for layer in self.layers:
                a = layer.self_attn
                for attr in ("fp8_k_scale", "fp8_v_scale"):
                    if getattr(a, attr, None) is None:
                        a.register_buffer(attr, torch.ones((), device=self.model.device))
            enable_fp8_kv(self.model)
        elif str(self.model.config._attn_implementation).startswith(KV_ATTN_IMPL):
            self.model.config._attn_implementation = "sdpa"

    def logprobs(self, samples, start: int = 0, inputs=None) -> list:
        """Log-probabilities at each sample's scored positions. With `start`/`inputs` (from `layer_inputs`), run
        only decoder layers start.. on the captured hidden states (partial forward)."""
        import torch

        out = []
        with torch.no_grad():
            for k, s in enumerate(samples):
                if inputs is None:
                    logits = self.model(input_ids=s["input_ids"][None].to(self.model.device), use_cache=False).logits
                    self.forwards += 1
                else:
                    h, kw = inputs[k][start]
                    for layer in self.layers[start:]:
                        h = layer(h, **kw)
                        h = h[0] if isinstance(h, tuple) else h
                    logits = self.model.lm_head(self.model.model.norm(h))
                    self.forwards += (len(self.layers) - start) / len(self.layers)
                _, mask = scored_positions(s, logits.device)
                out.append(logits[0, :-1].float().log_softmax(-1)[mask])
        return out

    def layer_inputs(self, samples) -> list:
        """[sample][layer] = (hidden states entering the layer, its keyword arguments), from an unquantized pass."""
        import torch

        caught: list = []

        def pre(i):
            def hook(mod, args, kwargs):
                h = args[0] if args else kwargs["hidden_states"]
                kw = {k: v for k, v in kwargs.items() if k != "hidden_states"}
                kw.update(past_key_values=None, use_cache=False)
                caught[-1][i] = (h.detach(), kw)
            return hook

        hs = [layer.register_forward_pre_hook(pre(i), with_kwargs=True) for i, layer in enumerate(self.layers)]
        try:
            with torch.no_grad():
                for s in samples:
                    caught.append({})
                    self.model(input_ids=s["input_ids"][None].to(self.model.device), use_cache=False)
                    self.forwards += 1
        finally:
            for h in hs:
                h.remove()
        return caught


def _compare(ref: list, test: list, samples) -> tuple[float, float]:
    """(relative perplexity increase, mean KL(ref || test)) over the scored positions."""
    nll_r = nll_t = kl = 0.0
    n = 0
    for a, b, s in zip(ref, test, samples, strict=True):
        tgt, mask = scored_positions(s, a.device)
        t = tgt[mask][:, None]
        nll_r -= a.gather(1, t).sum().item()
        nll_t -= b.gather(1, t).sum().item()
        kl += (a.exp() * (a - b)).sum().item()
        n += a.shape[0]
    return math.exp((nll_t - nll_r) / max(n, 1)) - 1, kl / max(n, 1)


def search_exclusions(fq_model, target_dir: Path, calib: list[dict], *, recipe: str, kv_cache: str,
                      max_ppl_increase: float, opts, run: QuantRun = CPU_RUN) -> dict:
    """The fewest decoder layers to keep in BF16 so that FP8 meets `max_ppl_increase` on calibration samples.

    1. Check: the fully quantized model on `check_samples` calibration samples (truncated to `seq_len`; the last
       ones, disjoint from the sensitivity samples when there are enough); if its perplexity increase is within
       `headroom * max_ppl_increase`, nothing is excluded. The increase is estimated as exp(mean KL) - 1: on text
       the target itself would write (the data stage's regenerated responses) the expected increase of the next-token
       NLL is exactly KL(p_bf16 || p_fp8), and KL carries none of the noise of the observed token (the measured
       perplexity increase of a dozen samples moves by +-0.5 % from one candidate to the next on SmolLM2, the KL
       decreases monotonically); the measured increase is recorded next to it.
    2. Sensitivity of each decoder layer: KL(unquantized || only that layer's linears in FP8) on
       `sensitivity_samples` samples, run from the layer's captured unquantized input onward (a partial forward;
       the FP8 KV cache is left out here: it is global in TensorRT-LLM, never a choice per layer).
    3. Greedy in sensitivity order: keep the k most sensitive layers in BF16, k = 1, 2, 4, ... up to `max_layers`,
       then bisect between the last k that missed and the first that met the target, checking each on the
       check samples with everything else (and the FP8 KV cache) quantized.
    Cost: (1 + L/2) * sensitivity_samples + (1 + #checks) * check_samples forward passes for L layers
    (`forwards` in the result, counted in full-forward equivalents). The held-out measurement that follows is
    the verification. Returns {"kept_bf16": [patterns], "layers", "sensitivity", "checks", "passed_on_calibration",
    "forwards", "seconds"}.

    `recipe`: the `RECIPES` entry calibrated (FP8_PER_CHANNEL_PER_TOKEN quantizes activations per token); `opts` has `headroom`,
    `seq_len`, `sensitivity_samples`, `check_samples` and `max_layers` (the quantize stage's `auto_exclude`).
    RuntimeFailure when the target cannot be placed or has no decoder-layer list."""
    import torch

    device, dtype, progress, log = run.device, run.dtype, run.progress, run.log
    per_token = RECIPES[recipe]["quant_algo"] == "FP8_PER_CHANNEL_PER_TOKEN"
    t0 = time.monotonic()
    target = opts.headroom * max_ppl_increase
    sm = SearchModel(fq_model, target_dir, per_token=per_token, kv_cache=kv_cache, device=device or torch.device("cpu"),
                     dtype=dtype or torch.float32)
    sens_s, check_s = search_samples(calib, opts)
    check, checks = _candidate_check(sm, check_s, target, log)
    result = {"target_ppl_increase": round(target, 6), "checks": checks, "layers": [], "kept_bf16": [],
              "sensitivity": {}, "order": []}
    if check(set()) <= target:
        result.update(passed_on_calibration=True)
    else:
        sens = layer_sensitivity(sm, sens_s, progress=progress)
        order = sorted(sens, key=lambda i: -sens[i])
        result.update(sensitivity={str(i): round(v, 6) for i, v in sens.items()}, order=order)
        if log:
            log.info("auto_exclude: layer sensitivity (KL, only that layer in FP8): %s", ", ".join(
                f"{i}: {sens[i]:.2g}" for i in order[:8]) + (" ..." if len(order) > 8 else ""))
        cap = min(opts.max_layers, len(order))
        hi = _fewest_layers(check, order, cap, target)
        keep = order[:hi if hi is not None else cap]
        result.update(passed_on_calibration=hi is not None, layers=sorted(keep),
                      kept_bf16=[f"{sm.prefix}.{i}.*" for i in sorted(keep)])
    result.update(forwards=round(sm.forwards, 1), seconds=round(time.monotonic() - t0, 1))
    if log:
        log.info("auto_exclude: %s in BF16 (%s on calibration), %.0f forward passes, %.0f s",
                 result["kept_bf16"] or "nothing", "meets the target" if result["passed_on_calibration"] else
                 f"misses the target even with {opts.max_layers} layers", result["forwards"], result["seconds"])
    return result


def search_samples(calib: list[dict], opts) -> tuple[list[dict], list[dict]]:
    """(sensitivity samples, check samples): calibration samples truncated to `opts.seq_len`, those that keep
    scored tokens; the ranking and the acceptance checks use different samples when there are enough."""
    trunc = [{"input_ids": s["input_ids"][:opts.seq_len], "loss_mask": s["loss_mask"][:opts.seq_len]} for s in calib]
    # samples whose truncation leaves scored (loss_mask) tokens: the gate is on those, not on prompts
    trunc = [s for s in trunc if int(s["loss_mask"][1:].sum()) >= 8] or trunc
    # the ranking and the acceptance checks use different samples when there are enough (less selection bias)
    sens_s = trunc[:opts.sensitivity_samples]
    check_s = trunc[-opts.check_samples:] if len(trunc) >= opts.sensitivity_samples + opts.check_samples \
        else trunc[:opts.check_samples]
    return sens_s, check_s


def _candidate_check(sm: SearchModel, check_s: list[dict], target: float, log=None):
    """(check, checks): check(keep) quantizes every decoder layer but those in `keep` (and the FP8 KV cache), and
    returns the estimated calibration perplexity increase against the unquantized model; each check done is
    appended to `checks`."""
    all_layers = set(sm.units)
    sm.set(set(), kv=False)
    ref_check = sm.logprobs(check_s)
    checks: list[dict] = []

    def check(keep: set[int]) -> float:
        sm.set(all_layers - keep, kv=True)
        inc, kl = _compare(ref_check, sm.logprobs(check_s), check_s)
        est = math.exp(kl) - 1
        checks.append({"kept_layers": sorted(keep), "ppl_increase_estimate": round(est, 6),
                       "ppl_increase": round(inc, 6), "mean_kl": round(kl, 6)})
        if log:
            log.info("auto_exclude: %d layer(s) in BF16 %s -> calibration perplexity increase %+.3f%% (exp(KL) - 1; "
                     "measured %+.3f%%), target %+.3f%%", len(keep), sorted(keep), 100 * est, 100 * inc, 100 * target)
        return est

    return check, checks


def layer_sensitivity(sm: SearchModel, samples: list[dict], *, progress=None) -> dict[int, float]:
    """{layer: KL(unquantized || only that layer's linears in FP8)}, one partial forward per layer and sample from
    the layer's captured unquantized input (no FP8 KV cache: it is global, never a choice per layer)."""
    sm.set(set(), kv=False)
    inputs = sm.layer_inputs(samples)
    ref_sens = [lp for lp in sm.logprobs(samples)]
    sens = {}
    with (progress(total=len(sm.units), desc="layer sensitivity") if progress else contextlib.nullcontext()) as bar:
        for i in sorted(sm.units):
            sm.set({i}, kv=False)
            sens[i] = _compare(ref_sens, sm.logprobs(samples, start=i, inputs=inputs), samples)[1]
            if progress:
                bar.update(1)
    del inputs
    return sens


def _fewest_layers(check, order: list[int], cap: int, target: float) -> int | None:
    """The smallest k <= cap for which keeping the k most sensitive layers (`order`) in BF16 meets `target`: k = 1,
    2, 4, ... up to `cap`, then bisection between the last k that missed and the first that met it. None when
    even `cap` misses."""
    lo, hi, k = 0, None, 1   # lo: largest k known to miss; hi: smallest k known to meet
    while k <= cap:
        if check(set(order[:k])) <= target:
            hi = k
            break
        lo = k
        k = cap if k < cap and 2 * k > cap else 2 * k
    if hi is not None:
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if check(set(order[:mid])) <= target:
                hi = mid
            else:
                lo = mid
    return hi
