"""The draft-length schedule: draft tokens per step by batch size, the one type `tune` writes and `build` reads.

A `DraftSchedule` is a step function over batch sizes 1, 2, ...: runs `(first, last, k)` (batch sizes first..last
use k draft tokens; the last run is open-ended, `last` None). It is version-free. This module also owns its
translations to and from TensorRT-LLM's settings (`max_draft_len`, `draft_len_schedule`, `max_concurrency`) in
each version's semantics and for each execution mode (`runtime.trtllm.compat.Release`), and the rule that bounds a
DFlash draft's length (`dflash_max_draft_len`). Nothing else in specpipe encodes or decodes these settings.

`tuning.json` stores a schedule once, as `{"runs": [[first, last, k], ...]}` up to the deployment's
max_batch_size (larger batches never occur); `build` reads it back with `DraftSchedule.from_json`.
"""
from __future__ import annotations

from dataclasses import dataclass

from runtime.trtllm import compat

Run = tuple[int, "int | None", int]


def dflash_max_draft_len(block_size: int) -> int:
    """A DFlash draft fills one block of `block_size` slots, the first being the last verified token: it drafts
    at most block_size - 1 tokens per step (TensorRT-LLM 1.3 DFlashDecodingConfig: max_draft_len <= block_size - 1,
    compat.SOURCES['dflash_block_size']; ModelOpt's DFlash trains exactly that many)."""
    if int(block_size) < 2:
        raise ValueError(f"DFlash block_size {block_size} < 2 drafts nothing")
    return int(block_size) - 1


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


# ---------------------------------------------------------------------------------------------- TensorRT-LLM settings


class UnsupportedSchedule(ValueError):
    """The targeted TensorRT-LLM version/mode cannot express (or would silently mis-run) this schedule."""


def encode(schedule: DraftSchedule, rel: compat.Release, mode: compat.Mode, max_batch: int) -> dict:
    """The speculative_config keys that make `rel` in `mode` use exactly `schedule` at batch sizes 1..max_batch:
    `max_draft_len` and, where needed, `draft_len_schedule` (int keys) or `max_concurrency`. Raises
    UnsupportedSchedule where the version cannot do it (compat.SOURCES: per_batch_draft_len_1_2,
    zero_draft_len_one_engine); `tune` only produces schedules the deployment can run."""
    runs = schedule.bounded(max_batch)
    kmax = max(k for _, _, k in runs)
    if kmax == 0:
        raise UnsupportedSchedule("the schedule never speculates: deploy without a speculative_config")
    if runs[0][2] != kmax:
        raise UnsupportedSchedule(f"the draft length at batch 1 ({runs[0][2]}) must be the longest ({kmax}): "
                                  "TensorRT-LLM requires the first schedule entry to equal max_draft_len")
    if len(runs) == 1:
        return {"max_draft_len": kmax}
    where = f"TensorRT-LLM {rel.line} ({mode.replace('_', '-')})"
    if mode not in rel.per_batch_draft_len:
        raise UnsupportedSchedule(f"{where} uses max_draft_len at every batch size (draft_len_schedule and "
                                  f"max_concurrency are applied only by the {'/'.join(sorted(rel.per_batch_draft_len))} "
                                  f"path): it cannot run {schedule.describe(max_batch)}")
    if any(k == 0 for _, _, k in runs) and mode not in rel.zero_draft_len_ok:
        raise UnsupportedSchedule(f"{where}: a draft length of 0 corrupts the drafter's state and acceptance "
                                  "collapses once speculation resumes (TensorRT-LLM PR #16888); keep k >= 1")
    on = [r for r in runs if r[2] > 0]
    off_tail = runs[-1][2] == 0 and all(r[2] > 0 for r in runs[:-1])
    if rel.schedule_semantics == "lower_bound":
        if off_tail and len(on) == 1:       # one length, then off: max_concurrency says it
            return {"max_draft_len": kmax, "max_concurrency": runs[-1][0] - 1}
        return {"max_draft_len": kmax, "draft_len_schedule": {a: k for a, _, k in runs}}
    # upper bounds: batch <= key uses its value; above the largest key: 0
    if any(k == 0 for _, _, k in runs[:-1]):
        raise UnsupportedSchedule(f"{where}: upper-bound schedules switch speculation off only above the last key")
    if off_tail and len(on) == 1 and rel.schedule_with_max_concurrency:
        return {"max_draft_len": kmax, "max_concurrency": on[0][1]}
    return {"max_draft_len": kmax, "draft_len_schedule": {b: k for _, b, k in on}}


def decode(spec: dict, rel: compat.Release, mode: compat.Mode, max_batch: int) -> DraftSchedule:
    """The draft length `rel` in `mode` uses at each batch size 1..max_batch under these speculative_config
    settings: the runtime's rules, for checking what is written."""
    K = int(spec.get("max_draft_len") or 0)
    sched = {int(a): int(b) for a, b in (spec.get("draft_len_schedule") or {}).items()}
    mc = spec.get("max_concurrency")
    if mode not in rel.per_batch_draft_len:
        return DraftSchedule.constant(K)
    if mc is not None and not sched and not rel.schedule_with_max_concurrency:
        sched = {int(mc): K}            # 1.3: max_concurrency alone becomes {max_concurrency: max_draft_len}
        mc = None
    ks = []
    for b in range(1, max_batch + 1):
        if not sched:
            k = K
        elif rel.schedule_semantics == "lower_bound":
            below = [key for key in sched if key <= b]
            k = sched[max(below)] if below else K
        else:
            above = [key for key in sched if key >= b]
            k = sched[min(above)] if above else 0
        if mc is not None and b > int(mc):
            k = 0
        ks.append(k)
    return DraftSchedule.from_ks(ks)


def schedule_problems(sched: dict, max_draft_len: int, rel: compat.Release) -> list[str]:
    """The version's validation rules for draft_len_schedule (llm_args.py; runtime/trtllm/schemas `rules`)."""
    keys = sorted(int(k) for k in sched)
    if not keys:
        return ["draft_len_schedule is empty"]
    vals = {int(k): int(v) for k, v in sched.items()}
    probs = []
    if keys[0] < 1 or any(v < 0 for v in vals.values()):
        probs.append("keys must be >= 1 and values >= 0")
    if any(v > max_draft_len for v in vals.values()):
        probs.append(f"every draft length must be <= max_draft_len {max_draft_len}")
    if rel.schedule_semantics == "lower_bound" and (keys[0] != 1 or vals[keys[0]] != max_draft_len):
        probs.append(f"TensorRT-LLM {rel.line} needs key 1 with value max_draft_len ({max_draft_len})")
    if rel.schedule_semantics == "upper_bound" and vals[keys[0]] != max_draft_len:
        probs.append(f"TensorRT-LLM {rel.line} needs the smallest key's value to equal max_draft_len ({max_draft_len})")
    return probs


def tuned_schedule(tuning: dict, version: str, mode: str):
    """tune's draft-length schedule, which it fitted to what `version` runs in `mode` (ValueError with the build
    stage's message when tuning.json does not fit)."""
    d = tuning.get("deployment") or {}
    if "draft_schedule" not in tuning or not d:
        raise ValueError("tuning.json has no draft_schedule/deployment: it was written by an older specpipe; "
                         "rerun tune (specpipe build --from tune)")
    if compat.normalize_version(d.get("trtllm_version") or "") != version or d.get("mode") != mode:
        raise ValueError(f"tuning.json was tuned for TensorRT-LLM {d.get('trtllm_version')} {d.get('mode')}, but build "
                         f"deploys {version} {mode}: which draft lengths the deployment can run differs, so tune must "
                         "run again (its fingerprint includes the build section: `specpipe build` reruns it; with "
                         "tune.trtllm_version set, remove it)")
    try:
        return DraftSchedule.from_json(tuning["draft_schedule"])
    except ValueError as e:
        raise ValueError(f"tuning.json draft_schedule: {e}; rerun tune") from None
