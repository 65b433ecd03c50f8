"""The acceptance estimate at the end of training on held-out prompts per eval domain (`eval.estimator`):
`runtime_acceptance`, specpipe's speculative runtime on the BF16 target and the exported draft with the validate
stage's definition, or ModelOpt's `HFARValidation.validate_online` on the in-memory model (`acceptance`, the only
one that runs on a sharded target)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from runtime.training.job import JobError, capture_layer_ids
from runtime.training.model import build_model, draft_module

ESTIMATORS = {"runtime": "specpipe runtime, BF16 target + exported draft (validate's definition)",
              "modelopt": "ModelOpt validate_online"}


@dataclass(frozen=True)
class EvalDecoding:
    """How the acceptance estimate decodes: at most `osl` new tokens per request, `draft_len` draft tokens per step,
    `batch_size` prompts per `generate` call, stopping at the first of `eos_token_ids`, batch i seeded `seed + i`."""

    osl: int
    draft_len: int
    batch_size: int
    eos_token_ids: list[int]
    seed: int = 0


def runtime_acceptance(target_dir: str | Path, draft_dir: str | Path, prompts: dict[str, list[list[int]]],
                       decoding: EvalDecoding, *, device: str = "cpu",
                       expected_capture_layers: list[int] | None = None) -> dict:
    """The acceptance estimate through specpipe's speculative runtime, with the `validate` stage's definition and
    procedure: the target (here the BF16 checkpoint) and the draft as exported (`runtime.engine.drafts.load_draft`, ModelOpt's
    first-layer norm, as trained), greedy, `batch_size` prompts per `generate` call, at most `osl` new tokens, a
    request stopping at the first of `eos_token_ids`; AL per domain = (verification steps + accepted draft tokens) /
    verification steps over all its requests (`RunStats.acceptance_length`), overall the same over every domain."""
    import torch

    from runtime.engine.drafts import load_draft
    from runtime.engine.sampling import Sampling
    from runtime.engine.speculative import SpeculativeEngine
    from runtime.engine.stats import RunStats
    from runtime.engine.target import load_target, target_shape

    osl, draft_len, batch_size, eos_token_ids = decoding.osl, decoding.draft_len, decoding.batch_size, decoding.eos_token_ids
    seed = decoding.seed
    t0 = time.monotonic()
    model = load_target(target_dir, device=device)
    draft = load_draft(draft_dir, target_shape(model), device=device, expected_capture_layers=expected_capture_layers)
    cap = draft.traits.draft_len_cap(getattr(draft, "block_size", None))
    if cap is not None and draft_len > cap:
        raise JobError(f"train_draft.eval.draft_len {draft_len} exceeds what one {draft.traits.title} block drafts ({cap})")
    eng = SpeculativeEngine(model, draft)
    per_domain, total = {}, None
    for domain, ps in prompts.items():
        st = RunStats(draft_len)
        for i in range(0, len(ps), batch_size):
            g = eng.generate(ps[i:i + batch_size], max_new_tokens=osl, draft_len=draft_len,
                             eos_token_id=eos_token_ids, sampling=Sampling(seed=seed + i))
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


def modelopt_estimate(job: dict, held: list, offline: bool, device, tok, prompts: dict) -> tuple[dict, float]:
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


def runtime_estimate(job: dict, export_dir: Path, prompts: dict, device) -> tuple[dict, float]:
    """`runtime_acceptance` of the exported draft with the BF16 target. Returns (estimate, seconds)."""
    ev = job["eval"]
    t0 = time.monotonic()
    decoding = EvalDecoding(ev["osl"], ev["draft_len"], ev.get("batch_size", 4), ev.get("eos_token_ids") or [],
                            seed=job["train"]["seed"])
    acc = runtime_acceptance(job["target_dir"], export_dir, prompts, decoding, device=device.type,
                             expected_capture_layers=capture_layer_ids(job))
    return acc, time.monotonic() - t0

