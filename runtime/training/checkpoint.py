"""Training checkpoints in `<scratch>/ckpt/`, what a restarted job resumes from: the draft's weights as safetensors
and the optimizer, schedule, step and curve so far, replaced as a whole in one rename; with eval points during
training (`runtime.training.evals`) also the best point's draft weights (`best.safetensors`), carried from one
checkpoint to the next."""
from __future__ import annotations

import shutil
from pathlib import Path

from runtime.training.model import draft_module

CKPT = "ckpt"
BEST = "best.safetensors"


def save_checkpoint(scratch: Path, model, opt, sched, step: int, curve: list, extra: dict, new_best: bool = False) -> None:
    """Draft weights (safetensors) + optimizer/schedule/step (torch.save of tensors and plain types),
    written to a fresh directory that replaces the previous checkpoint in one rename. `best.safetensors`: these
    weights when `new_best`, else the previous checkpoint's (when it has one)."""
    import torch
    from safetensors.torch import save_file

    final = scratch / CKPT
    tmp = scratch / f"{CKPT}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    sd = {k: v.detach().contiguous().cpu() for k, v in draft_module(model).state_dict().items()}
    save_file(sd, str(tmp / "draft.safetensors"))
    if new_best:
        shutil.copyfile(tmp / "draft.safetensors", tmp / BEST)
    elif (final / BEST).exists():
        shutil.copyfile(final / BEST, tmp / BEST)
    torch.save({"opt": opt.state_dict(), "sched": sched.state_dict(), "step": step, "curve": curve, **extra},
               tmp / "state.pt")
    old = scratch / f"{CKPT}.old"
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(scratch: Path, model, opt, sched, device) -> dict | None:
    import torch
    from safetensors.torch import load_file

    d = scratch / CKPT
    if not (d / "state.pt").exists():
        return None
    draft_module(model).load_state_dict(load_file(str(d / "draft.safetensors"), device=str(device)))
    state = torch.load(d / "state.pt", weights_only=True, map_location=device)
    opt.load_state_dict(state["opt"])
    sched.load_state_dict(state["sched"])
    return state



def load_best(scratch: Path, model, device) -> None:
    """The best eval point's draft weights into `model` (`<scratch>/ckpt/best.safetensors`)."""
    from safetensors.torch import load_file

    draft_module(model).load_state_dict(load_file(str(scratch / CKPT / BEST), device=str(device)))
