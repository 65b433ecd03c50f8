"""The draft-length schedule as TensorRT-LLM encodes it: a `DraftSchedule` (runtime/algorithms/schedule.py, the
version-free type `tune` writes and `build` reads) translated to and from TensorRT-LLM's settings (`max_draft_len`,
`draft_len_schedule`, `max_concurrency`) in each version's semantics and for each execution mode
(`runtime.trtllm.compat.Release`). Nothing else in specpipe encodes or decodes these settings.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from runtime.algorithms.schedule import DraftSchedule
from runtime.trtllm import compat

if TYPE_CHECKING:
    from runtime.records_deploy import TuningInfo


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


def tuned_schedule(tuning: TuningInfo, version: str, mode: str):
    """tune's draft-length schedule, which it fitted to what `version` runs in `mode` (ValueError with the build
    stage's message when tuning.json does not fit)."""
    d = tuning.deployment
    if not d:
        raise ValueError("tuning.json has no deployment: it was written by an older specpipe; "
                         "rerun tune (specpipe build --from tune)")
    if compat.normalize_version(d.get("trtllm_version") or "") != version or d.get("mode") != mode:
        raise ValueError(f"tuning.json was tuned for TensorRT-LLM {d.get('trtllm_version')} {d.get('mode')}, but build "
                         f"deploys {version} {mode}: which draft lengths the deployment can run differs, so tune must "
                         "run again (its fingerprint includes the build section: `specpipe build` reruns it; with "
                         "tune.trtllm_version set, remove it)")
    return tuning.draft_schedule
