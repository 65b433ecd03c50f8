"""Speculative decoding of deployed artifacts: a target checkpoint (BF16 or ModelOpt FP8) with an exported draft.

One engine runs every mode through the same code: plain autoregressive decoding (no drafter), EAGLE-3 chain
drafting and DFlash block drafting, for a batch of B requests of different lengths. This module is its API
(`SpeculativeEngine.generate`, `load_pair`); the parts live beside it in runtime/engine/:
  target.py        loading the target and running it with a per-row KV cache (`TargetRunner`, `load_target`);
  drafters.py      what a drafter does (`Drafter`) and the EAGLE-3 / DFlash drafters (`make_drafter`);
  sampling.py      sampling distributions (temperature, top_p) and the acceptance rule (`accept`);
  decode_batch.py  the step-wise core: draft, verify in one target forward, accept, roll back (`DecodeBatch`),
                   given the target runner, the drafter and the acceptance rule (it does not import this module);
  stats.py         acceptance statistics with TensorRT-LLM's definitions (`RunStats`, `RequestStats`);
  lossless.py      the lossless checks (`lossless_diff`, `tie_margins`, the acceptance-rule invariant);
  drafts/          the exported draft models (`load_draft`); fused.py the fused layers both sides run.
Callers import each part from the module that defines it.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from runtime.engine.decode_batch import DecodeBatch, Seat, StepHooks, VerifyStep
from runtime.engine.drafters import Drafter, make_drafter
from runtime.engine.drafts import load_draft
from runtime.engine.sampling import GREEDY, Sampling, accept
from runtime.engine.stats import RequestStats, RunStats
from runtime.engine.target import TargetRunner, load_target, target_shape


@dataclass
class Generation:
    tokens: list[list[int]]                 # generated ids per request (prompt excluded), cut at eos/max
    requests: list[RequestStats]
    stats: RunStats


class SpeculativeEngine:
    """`generate(prompts, ...)`: speculative decoding when a drafter is given and draft_len > 0, plain
    autoregressive decoding otherwise (same target code path, one token per step). `batch(...)` gives the
    step-wise core that `generate` loops over, for callers that add and remove requests while others decode
    (continuous batching in `runtime.serving.batching`)."""

    def __init__(self, target_model, draft=None, *, drafter: Drafter | None = None, compute: str = "fp32"):
        """`compute`: `fp32` (the exact mode, default) | `bf16` | `auto`, for the target and the draft alike (see
        `TargetRunner`)."""
        if drafter is None and draft is not None:
            self.target = TargetRunner(target_model, draft.capture_layers, compute=compute)
            self.drafter = make_drafter(draft, self.target)
        else:
            self.drafter = drafter
            self.target = TargetRunner(target_model, drafter.capture_layers if drafter else (), compute=compute)
        self.compute = self.target.compute
        self._seat = Seat()           # the batches on this engine share its target's cache and its drafter's rows

    def batch(self, *, draft_len: int = 0, sampling: Sampling = GREEDY,
              on_tokens: Callable[[int, list[int]], None] | None = None,
              on_verify: Callable[[VerifyStep], None] | None = None) -> DecodeBatch:
        """A running batch on this engine's target and drafter, with this engine's acceptance rule (`_accept`).
        Batches on one engine take turns: the one that runs holds the target's cache and the drafter's rows."""
        return DecodeBatch(self.target, self.drafter, draft_len=draft_len, sampling=sampling,
                           hooks=StepHooks(on_tokens, on_verify), accept_rule=self._accept, seat=self._seat)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], *, max_new_tokens: int, draft_len: int = 0,
                 eos_token_id: int | Iterable[int] | None = None, sampling: Sampling = GREEDY,
                 on_tokens: Callable[[int, list[int]], None] | None = None,
                 on_verify: Callable[[VerifyStep], None] | None = None) -> Generation:
        """`eos_token_id`: one id or several (an instruct model's end-of-turn and its eos); a request stops after
        the first of them. `draft_len` 0: plain autoregressive decoding. `sampling.top_p` < 1 restricts sampling
        (temperature > 0) to the nucleus; the acceptance rule then targets that distribution. `on_tokens(request
        index, tokens)` is called each time tokens are appended to a request's output (after prefill and after every
        verification step): per-step streaming.
        `on_verify(VerifyStep)` sees every verification forward (the prefill's first token included) with what
        the engine decided from it: the hook a checker of the acceptance rule needs."""
        t_start = time.perf_counter()
        b = self.batch(draft_len=draft_len, sampling=sampling, on_tokens=on_tokens, on_verify=on_verify)
        keys = b.add(prompts, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id)
        while b.live:
            b.step()
        reqs = [b.finished.pop(k) for k in keys]
        b.stats.output_tokens = sum(len(r.tokens) for r in reqs)
        b.stats.wall_s = time.perf_counter() - t_start
        return Generation([r.tokens for r in reqs], [r.stats for r in reqs], b.stats)

    # The acceptance rule this engine's batches apply (`runtime.engine.sampling.accept`: greedy or rejection sampling);
    # a subclass may replace it.
    _accept = staticmethod(accept)


def load_pair(target_dir, draft_dir, *, device="cpu", compute_dtype=torch.float32, **draft_kw):
    """Target + draft from their deployed directories, with the pairing checks; returns (model, draft).
    `draft_kw`: strict, first_layer_norm, expected_capture_layers (see `runtime.engine.drafts.load_draft`)."""
    model = load_target(target_dir, device=device, compute_dtype=compute_dtype)
    draft = load_draft(draft_dir, target_shape(model), compute_dtype=compute_dtype, device=device, **draft_kw)
    return model, draft

