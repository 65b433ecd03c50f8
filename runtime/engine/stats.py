"""Statistics of speculative decoding, with TensorRT-LLM's definitions (reference trtllm-triton.md §4):
acceptance length AL = mean over steps of (1 + accepted), draft acceptance rate = accepted / drafted, totals,
per-position conditional acceptance (P(position j accepted | positions < j accepted)), the distribution of the
accepted count per verification step (`accepted_per_step[a]`: steps that accepted exactly a draft tokens, the
histogram a speculation profile publishes), and draft vs target time
per step; per request (`RequestStats`) and per run (`RunStats`), and the speedup they predict
(`predicted_speedup`)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestStats:
    steps: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def acceptance_length(self) -> float:
        return (self.steps + self.accepted) / self.steps if self.steps else 1.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def as_dict(self) -> dict:
        return {"steps": self.steps, "total_draft_tokens": self.drafted, "total_accepted_draft_tokens": self.accepted,
                "acceptance_rate": round(self.acceptance_rate, 6), "acceptance_length": round(self.acceptance_length, 6)}


@dataclass
class RunStats:
    draft_len: int
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    reached: list[int] = field(default_factory=list)      # steps in which position j was drafted with j-1 accepted
    hits: list[int] = field(default_factory=list)         # ... and position j was accepted too
    accepted_per_step: list[int] = field(default_factory=list)   # [a]: steps that accepted exactly a draft tokens
    output_tokens: int = 0
    prefill_s: float = 0.0
    draft_s: float = 0.0
    target_s: float = 0.0
    other_s: float = 0.0
    wall_s: float = 0.0
    rows_per_step: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.reached = self.reached or [0] * self.draft_len
        self.hits = self.hits or [0] * self.draft_len
        self.accepted_per_step = self.accepted_per_step or [0] * (self.draft_len + 1)

    @property
    def acceptance_length(self) -> float:
        return (self.steps + self.accepted) / self.steps if self.steps else 1.0

    @property
    def per_position(self) -> list[float | None]:
        return [h / r if r else None for h, r in zip(self.hits, self.reached, strict=True)]

    def record_step(self, accepted: int, k: int) -> None:
        """One row's verification step that drafted k tokens and accepted `accepted` of them (per position and the
        accepted-count histogram; the totals are counted by the caller)."""
        for j in range(min(accepted + 1, k)):
            self.reached[j] += 1
        for j in range(accepted):
            self.hits[j] += 1
        self.accepted_per_step[accepted] += 1

    def merge(self, o: RunStats) -> RunStats:
        out = RunStats(max(self.draft_len, o.draft_len))
        pad = lambda xs: xs + [0] * (out.draft_len - len(xs))  # noqa: E731
        for f in ("steps", "drafted", "accepted", "output_tokens", "prefill_s", "draft_s", "target_s", "other_s", "wall_s"):
            setattr(out, f, getattr(self, f) + getattr(o, f))
        out.reached = [a + b for a, b in zip(pad(self.reached), pad(o.reached), strict=True)]
        out.hits = [a + b for a, b in zip(pad(self.hits), pad(o.hits), strict=True)]
        hist = lambda xs: xs + [0] * (out.draft_len + 1 - len(xs))  # noqa: E731
        out.accepted_per_step = [a + b for a, b in zip(hist(self.accepted_per_step), hist(o.accepted_per_step), strict=True)]
        out.rows_per_step = self.rows_per_step + o.rows_per_step
        return out

    def as_dict(self) -> dict:
        gen_s = self.draft_s + self.target_s + self.other_s
        return {
            "draft_len": self.draft_len, "steps": self.steps, "drafted": self.drafted, "accepted": self.accepted,
            "acceptance_length": round(self.acceptance_length, 6),
            "draft_acceptance_rate": round(self.accepted / self.drafted, 6) if self.drafted else None,
            "per_position": [None if p is None else round(p, 6) for p in self.per_position],
            "accepted_per_step": list(self.accepted_per_step),
            "output_tokens": self.output_tokens,
            "draft_ms_per_step": round(1000 * self.draft_s / self.steps, 4) if self.steps else None,
            "target_ms_per_step": round(1000 * self.target_s / self.steps, 4) if self.steps else None,
            "overhead_ms_per_step": round(1000 * self.other_s / self.steps, 4) if self.steps else None,
            "prefill_s": round(self.prefill_s, 4), "decode_s": round(gen_s, 4), "wall_s": round(self.wall_s, 4),
            "decode_tokens_per_s": round(self.output_tokens / gen_s, 3) if gen_s else None,
        }


def predicted_speedup(al: float, k: int, t_target_1: float, t_draft: float, t_target_verify: float,
                      parallel_draft: bool = False) -> float:
    """anchors.md: S ~= AL * T_target(B) / (k T_draft + T_target(B (k+1))); a parallel drafter (DFlash) pays
    one draft pass instead of k."""
    draft_cost = t_draft if parallel_draft else k * t_draft
    return al * t_target_1 / (draft_cost + t_target_verify)

