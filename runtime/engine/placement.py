"""Where a whole model goes for the stages that run it in one process (quantize): one GPU, or several.

A 70B target in bf16 (~141 GB) fits no single GPU. On a CUDA device, a model larger than what the first GPU
has free (with headroom for activations) is spread over all visible GPUs with accelerate's big-model
dispatch (`infer_auto_device_map` + `dispatch_model`, the same mechanism as transformers' device_map="auto"
and ModelOpt's `hf_ptq.py`): layers go to GPUs in order and hooks move activations between them, so callers
keep feeding inputs to `device`. On a CPU nothing changes. A model that does not fit all GPUs together is an
error that says so, before anything is copied.
"""
from __future__ import annotations

import logging

log = logging.getLogger("specpipe.placement")

HEADROOM = 0.85   # share of free GPU memory weights may take; the rest is activations, calibration, KV


class PlacementError(RuntimeError):
    pass


def plan(model_bytes: int, free_bytes: list[int], headroom: float = HEADROOM) -> str:
    """'one': the model fits the first GPU; 'spread': it fits all of them together. PlacementError otherwise."""
    if not free_bytes:
        raise PlacementError("no CUDA device to place the model on")
    if model_bytes <= headroom * free_bytes[0]:
        return "one"
    if model_bytes <= headroom * sum(free_bytes):
        return "spread"
    gib = 2**30
    raise PlacementError(f"the model needs {model_bytes / gib:.1f} GiB but the {len(free_bytes)} visible GPU(s) have "
                         f"{sum(free_bytes) / gib:.1f} GiB free ({headroom:.0%} usable for weights); "
                         "run on a node with more GPU memory")


def model_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def place(model, device):
    """`model` on `device`, or spread over all visible GPUs when it does not fit the first one."""
    import torch

    device = torch.device(device)
    if device.type != "cuda" or torch.cuda.device_count() < 2:
        return model.to(device)
    free = [torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count())]
    need = model_bytes(model)
    if plan(need, free) == "one":
        return model.to(device)
    from accelerate import dispatch_model, infer_auto_device_map

    device_map = infer_auto_device_map(model, max_memory={i: int(HEADROOM * f) for i, f in enumerate(free)},
                                       no_split_module_classes=getattr(model, "_no_split_modules", None) or [])
    log.info("model of %.1f GiB spread over %d GPUs (%s free)", need / 2**30, len(free),
             ", ".join(f"{f / 2**30:.0f}" for f in free))
    return dispatch_model(model, device_map=device_map)
