"""What `tune` prices and the limits it derives: the deployment (shapes, precisions and machine) from the
artifacts' facts, the per-domain acceptance curves from validate's measurements, the batch limit the KV memory
allows, the predicted table's rows, and TensorRT-LLM's token budget and CUDA-graph batch sizes.

The stage (stages/tune.py) reads the artifacts and the config and hands their values in; failures are
RuntimeFailure with a message naming the file or field, which the stage raises as its StageError.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from runtime.algorithms.registry import ALGORITHMS
from runtime.cost import costmodel as cm
from runtime.errors import RuntimeFailure

if TYPE_CHECKING:
    from runtime.records import DraftInfo, QuantizeInfo, TargetInfo
    from runtime.records_validate import AcceptanceInfo

# ------------------------------------------------------------------------------------------ deployment


@dataclass(frozen=True)
class Hardware:
    """The `hardware` section as tune prices it: the GPU's key (`hardware.gpu`), its `pipeline.hardware.GPU` datasheet
    entry, the measured profile (`hardware.profile`, None: the datasheet) and `hardware.tensor_parallel_size`."""

    gpu_key: str
    gpu: object
    profile: Path | None = None
    tp: int = 1


def deployment(target: TargetInfo, draft: DraftInfo, draft_cfg: dict, quant: QuantizeInfo, *, hardware: Hardware,
               context_length: int, efficiency, log):
    """Shapes, precisions and machine of the deployment, and a description of them for tuning.json.

    `draft_cfg`: the exported draft's config.json (the HF config); `efficiency`: `tune.efficiency` (`compute`,
    `memory`, `op_overhead_us`)."""
    gpu_key, gpu, profile, tp = hardware.gpu_key, hardware.gpu, hardware.profile, hardware.tp
    algo = draft.algorithm
    if algo not in ALGORITHMS or not ALGORITHMS[algo].needs_trained_draft:
        raise RuntimeFailure(f"draft.json algorithm is {algo!r}; tune prices "
                             f"{' and '.join(a for a in ALGORITHMS if ALGORITHMS[a].needs_trained_draft)} drafts")
    weight_fmt = weight_format(quant.format)
    kv_bytes = 1.0 if quant.kv_cache_fp8 else 2.0
    draft_fp8 = quant.draft_is_fp8
    if profile is not None:
        doc = json.loads(Path(profile).read_text())
        machine = cm.machine_from_profile(doc, memory_gb=float(doc.get("memory_gb") or gpu.memory_gb))
        measured = set(doc["machine"]["peak_tflops"])
        if weight_fmt not in measured:
            log.warning("profile %s measured %s GEMMs, not %s: its rate stands in for %s GEMMs",
                        profile, ", ".join(sorted(measured)), weight_fmt, weight_fmt)
        desc = f"profile {profile} ({doc.get('device')})"
    else:
        if weight_fmt == "fp8" and not gpu.has_fp8:
            raise RuntimeFailure(f"{gpu.name} has no FP8 tensor cores but the target is FP8 ({quant.format}); "
                                 "choose an FP8-capable hardware.gpu or a BF16 quantize.format")
        e = efficiency
        machine = cm.machine_from_gpu(gpu, compute_efficiency=e.compute, memory_efficiency=e.memory,
                                      op_overhead_us=e.op_overhead_us)
        desc = f"{gpu.name} datasheet x efficiency (compute {e.compute}, memory {e.memory})"
    tprec = cm.Precision(weight_fmt, 1.0 if weight_fmt == "fp8" else 2.0, kv_bytes)
    dprec = cm.Precision("fp8" if draft_fp8 and gpu.has_fp8 else "bf16", 1.0 if draft_fp8 else 2.0, kv_bytes)
    tshape = cm.target_shape(target)
    dshape = cm.draft_shape(draft, draft_cfg, target.hidden_size)
    max_pos = target.max_position_embeddings
    if max_pos and context_length > max_pos:
        raise RuntimeFailure(f"tune.context_length {context_length} exceeds the target's max_position_embeddings "
                             f"{max_pos}; use the context the deployment will actually serve")
    dmax = draft.max_position_embeddings or draft_cfg.get("max_position_embeddings")
    if dmax and context_length > dmax:
        log.warning("tune.context_length %d is beyond the draft's max_position_embeddings %s: acceptance may "
                    "collapse past it in production", context_length, dmax)
    for name, shape in (("target", tshape), ("draft", dshape)):
        if shape.heads % tp or (shape.kv_heads % tp and tp % shape.kv_heads):
            raise RuntimeFailure(f"hardware.tensor_parallel_size {tp} does not divide the {name}'s {shape.heads} "
                                 f"attention heads / {shape.kv_heads} KV heads")
    dep = cm.Deployment(tshape, dshape, algo, tprec, dprec, machine, tp, context_length)
    hw_doc = {"gpu": gpu_key, "gpu_name": gpu.name, "datasheet_source": gpu.source, "tensor_parallel_size": tp,
              "profile": str(profile) if profile else None, "machine": desc,
              "peak_tflops": {k: v / 1e12 for k, v in machine.peak_flops.items()},
              "bandwidth_tb_s": machine.bandwidth / 1e12, "op_overhead_us": machine.op_overhead_s * 1e6,
              "ridge_rows": machine.ridge_rows(tprec)}
    return dep, hw_doc


def weight_format(fmt) -> str:
    f = str(fmt or "bf16").lower()
    if "fp8" in f:
        return "fp8"
    if f in ("bf16", "bfloat16", "fp16", "float16", "none", "auto"):
        return "bf16"
    raise RuntimeFailure(f"quantize.json format {fmt!r}: tune models FP8 and BF16 weights only")


def kv_name(p: cm.Precision) -> str:
    return "fp8" if p.kv_bytes == 1 else "bf16"


def shape_summary(s: cm.ModelShape | None) -> dict | None:
    if s is None:
        return None
    return {"num_layers": s.num_layers, "hidden": s.hidden, "heads": s.heads, "kv_heads": s.kv_heads,
            "head_dim": s.head_dim, "weight_params": s.weight_params()}


# ------------------------------------------------------------------------------------------ acceptance


def acceptance_curves(acc: AcceptanceInfo, draft: DraftInfo, *, domain_weights: dict[str, float] | None,
                      max_draft_len: int | None, log=None):
    """Per-domain conditional acceptance of the FP8 pair, the traffic weights (`tune.domain_weights`), and the
    longest k to consider (capped by `tune.max_draft_len`).

    A position no step reached (None) counts as 0: it adds nothing to the expected tokens either way. Where
    validate measured only acceptance lengths (its TensorRT-LLM runtime reports no per-position rates), the
    curve is the flat rate a with (1 - a^(K+1)) / (1 - a) = AL at the measured K."""
    from runtime.cost.draft_length import flat_acceptance

    domains = acc.domains
    curves: dict[str, list[float]] = {}
    for d, v in domains.items():
        fp8 = v.fp8
        pp = fp8.per_position if fp8 is not None else None
        if not pp:
            al, K = (fp8.acceptance_length if fp8 is not None else None), acc.measured_draft_len
            if not isinstance(al, (int, float)) or not K:
                raise RuntimeFailure(f"acceptance.json: domain '{d}' has neither fp8.per_position nor an acceptance_length "
                                     "with measured_draft_len; rerun validate")
            a = flat_acceptance(float(al), int(K))
            pp = [a] * int(K)
            if log:
                log.info("domain %s: no per-position rates; flat acceptance %.3f from AL %.3f at k=%d", d, a, al, K)
        pp = [0.0 if a is None else a for a in pp]
        if any(not isinstance(a, (int, float)) or not 0 <= a <= 1 for a in pp):
            raise RuntimeFailure(f"acceptance.json: domain '{d}' fp8.per_position must hold rates in [0, 1], found {pp}")
        curves[d] = [float(a) for a in pp]
    if not curves:
        raise RuntimeFailure("acceptance.json has no domains; validate must measure at least one")
    if domain_weights is None:
        weights = {d: 1.0 for d in curves}
    else:
        unknown = sorted(set(domain_weights) - set(curves))
        if unknown:
            raise RuntimeFailure(f"tune.domain_weights names {', '.join(unknown)}, which validate did not measure; "
                                 f"measured domains: {', '.join(sorted(curves))}")
        weights = {d: float(w) for d, w in domain_weights.items() if w > 0}
    K = min(len(c) for c in curves.values())
    if max_draft_len:
        K = min(K, max_draft_len)
    cap = ALGORITHMS[draft.algorithm].draft_len_cap(draft.block_size) if draft.algorithm in ALGORITHMS else None
    if cap is not None:
        K = min(K, cap)
    return curves, weights, K


# ------------------------------------------------------------------------------------------ limits and table


def batch_limit(dep: cm.Deployment, *, want: int, context_length: int, kv_cache_memory_fraction: float) \
        -> tuple[int, int | None]:
    """max_batch_size: `want` (the configured, or largest table, batch), capped by how many sequences of
    `context_length` tokens the KV cache of all TP ranks holds next to the weights."""
    mem = dep.machine.memory_bytes * dep.tp
    if not mem:
        return want, None
    weights = dep.target.weight_params() * dep.target_prec.weight_bytes
    if dep.draft is not None:
        weights += dep.draft.weight_params() * dep.draft_prec.weight_bytes
    per_seq = (dep.target.kv_bytes_per_token(dep.target_prec.kv_bytes)
               + (dep.draft.kv_bytes_per_token(dep.draft_prec.kv_bytes) if dep.draft else 0)) * context_length
    free = (mem - weights) * kv_cache_memory_fraction
    capacity = int(free // per_seq) if free > 0 else 0
    if capacity < 1:
        raise RuntimeFailure(f"the weights ({weights / 1e9:.1f} GB) leave no room for one sequence's KV cache "
                             f"({per_seq / 1e9:.2f} GB at {context_length} tokens) on {dep.tp} x {mem / dep.tp / 1e9:.0f} GB; "
                             "raise hardware.tensor_parallel_size or lower tune.context_length")
    return min(want, capacity), capacity


def table_row(dep: cm.Deployment, choice, curves, weights, max_batch: int) -> dict:
    """One row of tuning.json's `predicted` table: the per-batch optimum `choice` (draft_length.Choice) priced."""
    from runtime.cost.draft_length import mix_expected_tokens

    b, k = choice.batch, choice.k
    t1 = dep.target_time(b, 1)
    ts = dep.spec_time(b, k)
    e = mix_expected_tokens(curves, weights, k)
    return {"batch": b, "k": k, "speedup": choice.speedup, "speedups_by_k": choice.speedups,
            "domain_speedups": choice.domain_speedups, "tokens_per_step": e,
            "target_step_ms": t1 * 1e3, "spec_step_ms": ts * 1e3, "draft_ms": dep.draft_time(b, k) * 1e3,
            "tokens_per_s": b * e / ts, "rows_over_ridge": choice.rows_over_ridge,
            "within_max_batch_size": b <= max_batch}


# ------------------------------------------------------------------------------------------ TensorRT-LLM sizes


def cuda_graph_batch_sizes(max_batch: int, schedule_points: list[int]) -> list[int]:
    """Batch sizes to capture: TensorRT-LLM's padded default ([1, 2, 4] + multiples of 8 up to 128, then
    powers of two) up to max_batch, plus max_batch and every schedule boundary, so that the batch where
    the draft length changes has a graph of its own instead of being padded across the boundary."""
    base = [1, 2, 4] + list(range(8, 129, 8))
    p = 256
    while p < max_batch:
        base.append(p)
        p *= 2
    pts = {b for b in base if b <= max_batch} | {max_batch} | {b for b in schedule_points if 1 <= b <= max_batch}
    return sorted(pts)


def max_num_tokens(max_batch: int, max_draft_len: int, floor: int, multiple: int = 64) -> int:
    """Token budget per iteration: every generation request needs 1 + max_draft_len rows, and the budget
    keeps at least `floor` for chunked prefill."""
    need = max(floor, max_batch * (1 + max_draft_len))
    return int(math.ceil(need / multiple) * multiple)
