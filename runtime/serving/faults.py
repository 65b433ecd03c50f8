"""TEST FAULTS of the CPU serving runtime: off unless the environment names one; for tests of `specpipe monitor`.

`SPECPIPE_TEST_FAULT_DRAFT_DECAY="N:SCALE[:SEED]"` (the only one): a served engine whose acceptance decays over time
with unchanged files, the "engine state" decay users report after hours of serving (vllm-project/vllm#41838,
sgl-project/sglang#28771). After the first N completed requests, every further completed request adds Gaussian noise
of SCALE x each tensor's standard deviation to the draft's parameters **in memory** (the files on disk stay as they
are), so the draft's proposals, and the acceptance, get worse request after request until the model is reloaded (a
restart: a fresh instance of the same export accepts as validated again). Applied on the scheduler's thread between
decoding steps (`runtime.serving.triton_model.model`: each request's `on_done`), so no forward sees half-written weights.
The Triton model logs a warning naming the fault when it is on; the environment reaches the model through the server
process (`runtime.serving.triton_server.start(..., env=...)`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

DRAFT_DECAY = "SPECPIPE_TEST_FAULT_DRAFT_DECAY"


class FaultSpecError(ValueError):
    """The fault's environment variable cannot be read; the message says the format."""


@dataclass
class DraftDecay:
    after: int                      # requests served normally
    scale: float                    # noise per further request, in units of each tensor's standard deviation
    seed: int = 0
    completed: int = 0
    applied: int = 0                # requests whose completion corrupted the draft

    @classmethod
    def from_env(cls, env=None) -> DraftDecay | None:
        raw = (os.environ if env is None else env).get(DRAFT_DECAY, "").strip()
        if not raw:
            return None
        parts = raw.split(":")
        try:
            after, scale = int(parts[0]), float(parts[1])
            seed = int(parts[2]) if len(parts) > 2 else 0
        except (IndexError, ValueError):
            raise FaultSpecError(f"{DRAFT_DECAY}={raw!r}: expected N:SCALE[:SEED] (requests before the decay, noise "
                                 "per request in standard deviations), e.g. 8:0.05") from None
        if after < 0 or not scale > 0 or len(parts) > 3:
            raise FaultSpecError(f"{DRAFT_DECAY}={raw!r}: N must be >= 0 and SCALE > 0 (format N:SCALE[:SEED])")
        return cls(after, scale, seed)

    def describe(self) -> str:
        return (f"TEST FAULT {DRAFT_DECAY}: after {self.after} requests every completed request adds noise of "
                f"{self.scale:g} x std to the draft's weights in memory (acceptance decays; the files are unchanged)")

    def request_finished(self, draft_module) -> bool:
        """Count one completed request; past `after`, corrupt `draft_module`'s parameters. True when it did."""
        import torch

        self.completed += 1
        if draft_module is None or self.completed <= self.after:
            return False
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.completed)
        with torch.no_grad():
            for p in draft_module.parameters():
                if p.numel() > 1 and p.is_floating_point():
                    noise = torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype)
                    p.add_(noise * (self.scale * float(p.detach().float().std())))
        # the decoder runs fused copies of the weights built on first use (runtime/engine/drafts/blocks.py draft_plan,
        # kept in the module's `_specpipe_plans`): drop them so the next step rebuilds them from the corrupted weights
        draft_module.__dict__.pop("_specpipe_plans", None)
        self.applied += 1
        return True
