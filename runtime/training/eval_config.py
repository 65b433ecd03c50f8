"""The config side of held-out acceptance during training (`train_draft.eval`): where eval points can run
(`in_training_blocker`), the steps between them (`resolve_every`), the config errors (`every_problems`) and the
options the job carries (`job_options`). The worker side is `runtime.training.evals`."""
from __future__ import annotations


def in_training_blocker(sec) -> str | None:
    """Why eval points cannot run during training with the section `sec` (train_draft's Config), or None."""
    ev = sec.eval
    if sec.launcher.kind == "torchrun" and sec.launcher.fsdp:
        return "launcher.fsdp (no process holds the whole target; the estimate runs once, at the end, collectively)"
    if ev.estimator == "modelopt" and sec.launcher.kind == "torchrun":
        return "eval.estimator modelopt under launcher torchrun (ModelOpt's validate_online is collective there)"
    if ev.estimator == "modelopt" and sec.mode == "offline":
        return "eval.estimator modelopt in offline mode (it rebuilds the online model to measure)"
    return None


def resolve_every(sec) -> int:
    """Steps between eval points: eval.every, default checkpoint_every where eval points run, 0 (at the end only)
    where they cannot or when there are no eval prompts."""
    ev = sec.eval
    if not ev.prompts_per_domain:
        return 0
    if ev.every is not None:
        return ev.every
    return 0 if in_training_blocker(sec) else sec.checkpoint_every


def every_problems(sec, p: str) -> list[tuple[str, str]]:
    """Config errors: an explicit eval.every where eval points cannot run, patience without eval points."""
    ev = sec.eval
    out = []
    why = in_training_blocker(sec)
    if ev.every and ev.prompts_per_domain and why:
        out.append((f"{p}.eval.every", f"{ev.every}: held-out acceptance during training does not run with {why}; "
                    "set eval.every: 0 (the estimate at the end only)"))
    if ev.patience and not resolve_every(sec):
        out.append((f"{p}.eval.patience", f"{ev.patience} needs eval points during training (eval.every > 0 and "
                    "eval.prompts_per_domain > 0)"))
    return out


def job_options(sec) -> dict:
    return {"every": resolve_every(sec), "patience": sec.eval.patience, "min_delta": sec.eval.min_delta}
