"""The draft-length schedule: draft tokens per step by batch size, the one type `tune` writes and `build` reads.

A `DraftSchedule` is a step function over batch sizes 1, 2, ...: runs `(first, last, k)` (batch sizes first..last
use k draft tokens; the last run is open-ended, `last` None). It is version-free: TensorRT-LLM's encoding of it is
runtime/trtllm/draft_schedule.py, vLLM's runtime/vllm/serve.py.

`tuning.json` stores a schedule once, as `{"runs": [[first, last, k], ...]}` up to the deployment's
max_batch_size (larger batches never occur); `build` reads it back with `DraftSchedule.from_json`.
"""
from __future__ import annotations

from dataclasses import dataclass

Run = tuple[int, "int | None", int]


@dataclass(frozen=True)
class DraftSchedule:
    runs: tuple[Run, ...]

    def __post_init__(self):
        runs = list(self.runs)
        if not runs:
            raise ValueError("a draft-length schedule needs at least one run")
        lo = 1
        for i, (a, b, k) in enumerate(runs):
            if a != lo or k < 0 or (b is not None and b < a) or (b is None and i != len(runs) - 1):
                raise ValueError(f"draft-length runs must cover batch sizes 1, 2, ... contiguously with k >= 0: {runs}")
            lo = (b or 0) + 1
        if runs[-1][1] is not None:
            raise ValueError(f"the last run must be open-ended (last batch None): {runs}")
        merged: list[list] = []
        for a, b, k in runs:          # canonical: neighbouring runs with the same k are one run
            if merged and merged[-1][2] == k:
                merged[-1][1] = b
            else:
                merged.append([a, b, k])
        object.__setattr__(self, "runs", tuple((a, b, k) for a, b, k in merged))

    # -- constructors

    @classmethod
    def constant(cls, k: int) -> DraftSchedule:
        return cls(((1, None, int(k)),))

    @classmethod
    def from_ks(cls, ks: list[int]) -> DraftSchedule:
        """k per batch size 1..len(ks); the last value continues above."""
        if not ks:
            raise ValueError("no draft lengths")
        runs: list[list] = []
        for b, k in enumerate(ks, start=1):
            if runs and runs[-1][2] == k:
                runs[-1][1] = b
            else:
                runs.append([b, b, int(k)])
        runs[-1][1] = None
        return cls(tuple(tuple(r) for r in runs))

    @classmethod
    def from_json(cls, doc) -> DraftSchedule:
        """From `to_json`'s form (runs up to a max batch size; the last continues above it)."""
        runs = doc.get("runs") if isinstance(doc, dict) else doc
        if not runs or not all(isinstance(r, (list, tuple)) and len(r) == 3 for r in runs):
            raise ValueError(f"a draft-length schedule is {{'runs': [[first, last, k], ...]}}, found {doc!r}")
        rr = [(int(a), int(b) if b is not None else None, int(k)) for a, b, k in runs]
        rr[-1] = (rr[-1][0], None, rr[-1][2])
        return cls(tuple(rr))

    # -- reading

    def k_at(self, batch: int) -> int:
        for a, b, k in self.runs:
            if a <= batch and (b is None or batch <= b):
                return k
        raise ValueError(f"batch size {batch} < 1")

    def ks(self, max_batch: int) -> list[int]:
        return [self.k_at(b) for b in range(1, max_batch + 1)]

    def bounded(self, max_batch: int) -> list[list[int]]:
        """[[first, last, k], ...] over batch sizes 1..max_batch."""
        out = []
        for a, b, k in self.runs:
            if a > max_batch:
                break
            out.append([a, max_batch if b is None else min(b, max_batch), k])
        return out

    def to_json(self, max_batch: int) -> dict:
        return {"runs": self.bounded(max_batch)}

    def max_draft_len(self, max_batch: int) -> int:
        return max(k for _, _, k in self.bounded(max_batch))

    def speculates(self, max_batch: int) -> bool:
        return self.max_draft_len(max_batch) > 0

    def describe(self, max_batch: int) -> str:
        return "; ".join(f"batch {a}-{b}: {'off' if k == 0 else f'k={k}'}" for a, b, k in self.bounded(max_batch))
